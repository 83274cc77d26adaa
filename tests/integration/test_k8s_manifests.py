"""The Kubernetes manifests of deploy/k8s: schemas, the torchrun command lines, the auth set-up script.

* Every built-in kind validates against Kubernetes 1.37's schemas (``kubernetes-validate``, strict: unknown
  fields fail). The PyTorchJob (a CRD without a bundled schema) is checked structurally, and its pod
  template validates as a ``PodTemplate``.
* Every ``torchrun`` command line parses with torch's own parser, and names the etcd-v3 backend, every
  member of the etcd StatefulSet through its headless service, and ``--nnodes=MIN:MAX`` matching the job.
* The etcd StatefulSet: 3 members, no v2 API, 3.6+ health probes, a volume claim template, compaction and a
  quota; passwords only from Secrets (env ``secretKeyRef`` or mounted files), never in arguments.
* etcd/auth-setup.yaml's script, run against a real etcd, turns auth on with a user limited to the prefix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT
from torch.distributed.run import get_args_parser

from etcd_server import EtcdServer
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdPermissionDenied

if os.environ.get("CI", "").lower() == "true":  # the test extra installs it: missing is a failure there
    import kubernetes_validate
else:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(REPO_ROOT) / "deploy" / "k8s"
K8S_VERSION = "1.37"
FILES = sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in FILES:
        for doc in documents(path):
            yield path, doc


def by_kind(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in all_documents() if d["kind"] == kind]


def test_every_manifest_is_there() -> None:
    names = {str(p.relative_to(K8S)) for p in FILES}
    assert {"etcd/etcd.yaml", "etcd/etcd-tls.yaml", "etcd/auth-setup.yaml", "training/job.yaml",
            "training/job-tls-auth.yaml", "training/pytorchjob.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(K8S)))
def test_builtin_kinds_validate_against_the_schema(path: Path) -> None:
    for doc in documents(path):
        if doc["apiVersion"].startswith("kubeflow.org/"):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pytorchjob_structure() -> None:
    ((_, job),) = by_kind("PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    assert set(spec) <= {"elasticPolicy", "runPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
    policy = spec["elasticPolicy"]
    assert set(policy) <= {"rdzvBackend", "rdzvHost", "rdzvPort", "rdzvId", "rdzvConf", "minReplicas",
                           "maxReplicas", "maxRestarts", "nProcPerNode", "standalone", "metrics"}
    assert policy["rdzvBackend"] == "etcd-v3"
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: workers only, no Master
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert set(worker) <= {"replicas", "restartPolicy", "template"}
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
    assert [c["name"] for c in worker["template"]["spec"]["containers"]][0] == "pytorch"
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                "template": worker["template"]}
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)


# --------------------------------------------------------------------------- torchrun command lines


def pod_specs() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, the workload, its pod spec) of every workload that runs pods."""
    for path, doc in all_documents():
        where = f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Job", "StatefulSet"):
            yield where, doc, doc["spec"]["template"]["spec"]
        elif doc["kind"] == "PyTorchJob":
            for spec in doc["spec"]["pytorchReplicaSpecs"].values():
                yield where, doc, spec["template"]["spec"]


def torchrun_lines() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    found = []
    for where, doc, spec in pod_specs():
        for c in spec["containers"]:
            line = [*c.get("command", []), *c.get("args", [])]
            if line[:1] == ["torchrun"] or line[:3] == ["python", "-m", "torch.distributed.run"]:
                found.append((where, doc, c))
    return found


def etcd_members(tls: bool) -> set[str]:
    """``<pod>.<headless service>:2379`` of every member of the etcd StatefulSet (of that variant)."""
    for path, sts in by_kind("StatefulSet"):
        if (path.name == "etcd-tls.yaml") == tls:
            name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
            scheme = "https://" if tls else ""
            return {f"{scheme}{name}-{i}.{service}:2379" for i in range(sts["spec"]["replicas"])}
    raise AssertionError("no etcd StatefulSet")


def test_torchrun_command_lines_parse_with_torch() -> None:
    lines = torchrun_lines()
    assert len(lines) == 3  # the Job, its TLS+auth variant, the PyTorchJob
    for where, doc, container in lines:
        line = [*container.get("command", []), *container.get("args", [])]
        argv = line[1:] if line[0] == "torchrun" else line[3:]
        args = get_args_parser().parse_args(argv)
        assert args.rdzv_backend == "etcd-v3", where
        tls = "ca_cert=" in args.rdzv_conf
        assert set(args.rdzv_endpoint.split(",")) == etcd_members(tls), where
        low, _, high = args.nnodes.partition(":")
        assert 1 <= int(low) <= int(high), where
        if doc["kind"] == "Job":
            assert doc["spec"]["completionMode"] == "Indexed"
            assert doc["spec"]["parallelism"] == doc["spec"]["completions"] == int(high), where
        else:
            policy = doc["spec"]["elasticPolicy"]
            assert (policy["minReplicas"], policy["maxReplicas"]) == (int(low), int(high)), where
            assert f"{policy['rdzvHost']}:{policy['rdzvPort']}" in etcd_members(False)
        env = {e["name"] for e in container.get("env", [])}
        referenced = set(re.findall(r"\$\((\w+)\)", " ".join(argv)))
        assert referenced <= env, (where, referenced - env)
        assert args.rdzv_id, where
        conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if kv)
        assert not {"user", "password"} & set(conf), where
        if tls:
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            for key in ("ca_cert", "ssl_cert", "ssl_cert_key"):
                assert any(conf[key].startswith(m + "/") for m in mounts), (where, key)


def test_secrets_never_in_arguments() -> None:
    for where, _, spec in pod_specs():
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            text = " ".join([*c.get("command", []), *c.get("args", [])]).lower()
            assert "password" not in text and "change-me" not in text, where
            for e in c.get("env", []):
                if "PASSWORD" in e["name"] and not e["name"].endswith("_FILE"):  # *_FILE: a path
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (where, e["name"])


def test_training_pods_read_the_password_from_a_file_and_never_mount_the_root_password() -> None:
    """torch copies the agent's environment into every worker: a password belongs in a file."""
    checked = 0
    for where, _, spec in pod_specs():
        if "/training/" not in f"/{where}":
            continue
        secret_volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        for volume in secret_volumes.values():  # only the user's password, never the root's
            assert volume["secretName"] != "etcd-rdzv-root", where
            if volume["secretName"] == "etcd-rdzv-auth":
                assert [i["key"] for i in volume.get("items", [])] == ["password"], where
        for c in spec["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert "ETCD_RDZV_PASSWORD" not in env, where
            if "ETCD_RDZV_PASSWORD_FILE" in env:
                path = env["ETCD_RDZV_PASSWORD_FILE"]["value"]
                (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
                volume = secret_volumes[mount["name"]]
                assert volume["secretName"] == "etcd-rdzv-auth" and mount.get("readOnly"), where
                checked += 1
    assert checked == 1  # job-tls-auth.yaml


def test_every_pod_runs_unprivileged_with_a_read_only_root() -> None:
    """Non-root, the runtime's seccomp profile, no privilege escalation, no capabilities, a read-only
    root file system (training containers write scratch files to an emptyDir at /tmp)."""
    specs = list(pod_specs())
    assert len(specs) == 6  # 2 etcd StatefulSets, the auth set-up Job, 3 training workloads
    for where, _, spec in specs:
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0, where
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities") == {"drop": ["ALL"]}, where
            if "/training/" in f"/{where}":
                (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert "emptyDir" in volumes[tmp["name"]], where


@pytest.mark.parametrize("variant", ["etcd.yaml", "etcd-tls.yaml"])
def test_a_network_policy_lets_only_labelled_clients_and_members_reach_etcd(variant: str) -> None:
    docs = documents(K8S / "etcd" / variant)
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    members = sts["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= members.items() and spec["policyTypes"] == ["Ingress"]
    reach: dict[int, list[dict[str, str]]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without 'from' admits every pod"
        for port in rule["ports"]:
            reach.setdefault(port["port"], []).extend(f["podSelector"]["matchLabels"] for f in rule["from"])
    client = {"etcd-rdzv/client": "true"}
    assert {p: sorted(map(str, s)) for p, s in reach.items()} == {
        2379: sorted(map(str, [client, members])), 2380: [str(members)]}
    for where, workload, _ in pod_specs():  # every other workload talks to etcd: it carries the label
        if workload["kind"] != "StatefulSet":
            assert _template_labels(workload).items() >= client.items(), where


def _template_labels(doc: dict[str, Any]) -> dict[str, str]:
    if doc["kind"] == "PyTorchJob":
        (spec,) = doc["spec"]["pytorchReplicaSpecs"].values()
        return dict(spec["template"].get("metadata", {}).get("labels", {}))
    return dict(doc["spec"]["template"].get("metadata", {}).get("labels", {}))


# --------------------------------------------------------------------------- the etcd cluster


@pytest.mark.parametrize("variant", ["etcd.yaml", "etcd-tls.yaml"])
def test_etcd_statefulset(variant: str) -> None:
    docs = {d["kind"]: d for d in documents(K8S / "etcd" / variant)}
    sts, svc = docs["StatefulSet"], docs["Service"]
    assert sts["spec"]["replicas"] == 3
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["publishNotReadyAddresses"] is True
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert re.search(r"etcd:v3\.7\.\d+$", container["image"])
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in container["args"])
    assert not any("enable-v2" in f for f in flags)
    assert flags["--auto-compaction-mode"] == "periodic" and flags["--auto-compaction-retention"] == "1h"
    assert int(flags["--quota-backend-bytes"]) >= 2 * 1024**3
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert flags["--data-dir"].startswith(mounts[claim["metadata"]["name"]] + "/")
    members = etcd_members(variant == "etcd-tls.yaml")
    peers = {m.replace(":2379", ":2380") for m in members}
    cluster = {p.split("=", 1)[1].removeprefix("http://") for p in flags["--initial-cluster"].split(",")}
    assert cluster == peers
    if variant == "etcd-tls.yaml":
        assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
        assert flags["--listen-client-urls"].startswith("https://")


# --------------------------------------------------------------------------- the auth set-up script


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_auth_setup_script_against_etcd(etcd_binary: str, tmp_path: Path) -> None:
    (config,) = [d for d in documents(K8S / "etcd" / "auth-setup.yaml") if d["kind"] == "ConfigMap"]
    script = tmp_path / "setup.sh"
    script.write_text(config["data"]["setup.sh"])
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    password = 'pa"ss\\w0rd-x'  # quotes and backslashes survive the JSON body
    (secrets / "user").write_text("rdzv\n")
    (secrets / "password").write_text(password + "\n")
    root = tmp_path / "root"  # a Secret of its own: no training pod mounts it
    root.mkdir()
    (root / "root-password").write_text("r00t-pw")
    with EtcdServer(binary=etcd_binary) as server:
        env = {**os.environ, "ETCD_URL": server.get_client_url(), "SECRETS": str(secrets), "ROOT_SECRETS": str(root),
               "TLS_DIR": str(tmp_path / "no-tls"), "KEY_PREFIX": "/torch/elastic/rendezvous"}
        first = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        assert password not in first.stdout + first.stderr and "r00t-pw" not in first.stdout + first.stderr
        again = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already" in again.stdout, again.stderr
        with EtcdClient(server.get_endpoint(), user="rdzv", password=password, timeout=5,
                        allow_insecure_auth=True) as client:  # a local etcd without TLS
            client.put(b"/torch/elastic/rendezvous/job/x", b"1")
            with pytest.raises(EtcdPermissionDenied):
                client.put(b"/torch/elastic/rendezvousX", b"1")
            with pytest.raises(EtcdPermissionDenied):
                client.range(b"/other")
        with EtcdClient(server.get_endpoint(), user="root", password="r00t-pw", timeout=5,
                        allow_insecure_auth=True) as root_client:  # the root password of ROOT_SECRETS
            assert root_client.get(b"/torch/elastic/rendezvous/job/x") is not None
