"""The Kubernetes manifests of deploy/k8s: schemas, the torchrun command lines, the auth set-up script.

* Every built-in kind validates against Kubernetes 1.37's schemas (``kubernetes-validate``, strict: unknown
  fields fail). The PyTorchJob (a CRD without a bundled schema) is checked structurally, and its pod
  template validates as a ``PodTemplate``.
* Every ``torchrun`` command line parses with torch's own parser, and names the etcd-v3 backend, every
  member of the etcd StatefulSet through its headless service, and ``--nnodes=MIN:MAX`` matching the job.
* The etcd StatefulSet: 3 members, no v2 API, 3.6+ health probes, a volume claim template, compaction and a
  quota; passwords only from Secrets (env ``secretKeyRef`` or mounted files), never in arguments.
* etcd/auth-setup.yaml's script, run against a real etcd, turns auth on (root only); etcd/grant-run.yaml's
  ``etcd-rdzv grant`` line, run after it, makes the training job's user, limited to the job's run.
* Who holds what: no pod mounts a service account token; every Secret a pod names exists (secrets/, with
  the keys used); each TLS training job mounts a client certificate of its own, ``etcd-rdzv-client-<job>``,
  whose CN (the ``etcd-rdzv/certificate-cn`` annotation of its example) is the job's etcd user, and the admin
  Jobs one with no CN; the peer port trusts a peer CA other than the client CA and only the members' CN; the
  root password is mounted only by the admin Jobs, which run no trainer image.
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
from etcd_store.client.auth_admin import role_names, user_names
from etcd_store.errors import EtcdPermissionDenied

if os.environ.get("CI", "").lower() == "true":  # the test extra installs it: missing is a failure there
    import kubernetes_validate
else:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(REPO_ROOT) / "deploy" / "k8s"
K8S_VERSION = "1.37"
FILES = sorted(K8S.rglob("*.yaml"))
ROOT_SECRET = "etcd-rdzv-root"
CN = "etcd-rdzv/certificate-cn"  # an example Secret's note of its tls.crt's CommonName ("": none)
ADMIN_FILES = {"etcd/auth-setup.yaml", "etcd/grant-run.yaml"}  # the Jobs that log in as root


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
    assert {"etcd/etcd.yaml", "etcd/etcd-tls.yaml", "etcd/auth-setup.yaml", "etcd/grant-run.yaml", "training/job.yaml",
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
    """No password in a command line; ``--password-file=PATH`` (``etcd-rdzv grant``) only names a file of a
    read-only mount."""
    for where, _, spec in pod_specs():
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            line = [*c.get("command", []), *c.get("args", [])]
            for arg in line:
                if arg.startswith("--password-file="):
                    path = arg.split("=", 1)[1]
                    assert any(path.startswith(m["mountPath"] + "/") and m.get("readOnly")
                               for m in c["volumeMounts"]), (where, arg)
            text = " ".join(a for a in line if not a.startswith("--password-file=")).lower()
            assert "password" not in text and "change-me" not in text, where
            for e in c.get("env", []):
                if "PASSWORD" in e["name"] and not e["name"].endswith("_FILE"):  # *_FILE: a path
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (where, e["name"])


def test_training_pods_read_the_password_from_a_file_and_never_mount_the_root_password() -> None:
    """torch copies the agent's environment into every worker: a password belongs in a file."""
    checked = 0
    for where, doc, spec in pod_specs():
        if "/training/" not in f"/{where}":
            continue
        assert ROOT_SECRET not in secrets_named(spec), where
        auth = f"etcd-rdzv-auth-{doc['metadata']['name']}"  # the job's own
        secret_volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        for volume in secret_volumes.values():  # only the user's password, never the root's
            assert volume["secretName"] != ROOT_SECRET, where
            if volume["secretName"].startswith("etcd-rdzv-auth"):
                assert volume["secretName"] == auth, where
                assert [i["key"] for i in volume.get("items", [])] == ["password"], where
        for c in spec["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert "ETCD_RDZV_PASSWORD" not in env, where
            if "ETCD_RDZV_PASSWORD_FILE" in env:
                path = env["ETCD_RDZV_PASSWORD_FILE"]["value"]
                (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
                volume = secret_volumes[mount["name"]]
                assert volume["secretName"] == auth and mount.get("readOnly"), where
                checked += 1
    assert checked == 1  # job-tls-auth.yaml


def test_every_pod_runs_unprivileged_with_a_read_only_root() -> None:
    """Non-root, the runtime's seccomp profile, no privilege escalation, no capabilities, a read-only
    root file system (training containers write scratch files to an emptyDir at /tmp)."""
    specs = list(pod_specs())
    assert len(specs) == 7  # 2 etcd StatefulSets, the auth set-up and grant Jobs, 3 training workloads
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


# --------------------------------------------------------------------------- who holds what


def example_secrets() -> dict[str, dict[str, Any]]:
    """The Secrets of secrets/*.example.yaml, by name."""
    found: dict[str, dict[str, Any]] = {}
    for path, doc in by_kind("Secret"):
        assert path.parent.name == "secrets" and doc["metadata"]["name"] not in found, path
        found[doc["metadata"]["name"]] = doc
    return found


def secret_refs(spec: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(Secret, key; None: every key) of everything a pod spec takes from Secrets."""
    refs: list[tuple[str, str | None]] = []
    for volume in spec.get("volumes", []):
        sources = [("secretName", volume["secret"])] if "secret" in volume else []
        sources += [("name", s["secret"]) for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        for field, source in sources:
            keys = [i["key"] for i in source.get("items", [])] or [None]
            refs += [(source[field], key) for key in keys]
    for c in spec["containers"] + spec.get("initContainers", []):
        for e in c.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                refs.append((e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"]))
        refs += [(e["secretRef"]["name"], None) for e in c.get("envFrom", []) if "secretRef" in e]
    return refs


def secrets_named(spec: dict[str, Any]) -> set[str]:
    return {name for name, _ in secret_refs(spec)}


def secret_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) of the file ``path`` of ``container``, which a secret volume must hold."""
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    name, relative = volume["secret"]["secretName"], path[len(mount["mountPath"]) + 1:]
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    return name, items[relative] if items else relative


def client_certificate(container: dict[str, Any]) -> str | None:
    """The client certificate file a container presents to etcd: torchrun's ``ssl_cert``, the CLI's
    ``--cert``, the auth set-up script's ``$TLS_DIR/tls.crt`` where that is mounted; None: none."""
    line = [*container.get("command", []), *container.get("args", [])]
    for arg in line:
        if arg.startswith("--rdzv-conf="):
            conf = dict(kv.split("=", 1) for kv in arg.split("=", 1)[1].split(",") if kv)
            return conf.get("ssl_cert")
        if arg.startswith("--cert="):
            return arg.split("=", 1)[1]
    if line[-1:] == ["/scripts/setup.sh"]:
        (config,) = [d for d in documents(K8S / "etcd" / "auth-setup.yaml") if d["kind"] == "ConfigMap"]
        default = re.search(r"TLS_DIR:-([^}]+)}", config["data"]["setup.sh"])
        assert default and any(m["mountPath"] == default.group(1) for m in container["volumeMounts"])
        return f"{default.group(1)}/tls.crt"
    return None


def test_no_pod_gets_a_service_account_token() -> None:
    """None of these pods calls the Kubernetes API: a token mounted in it would be a credential to steal."""
    for where, _, spec in pod_specs():
        assert spec.get("automountServiceAccountToken") is False, where


def test_every_secret_a_pod_names_exists_with_its_keys() -> None:
    """Every Secret a pod names has an example in secrets/ with the keys it takes, and every TLS file it
    reads (etcd's ``--*-file`` flags, a client's certificate) is a key of a mounted Secret."""
    secrets = example_secrets()
    for where, _, spec in pod_specs():
        for name, key in secret_refs(spec):
            assert name in secrets, (where, name)
            assert key is None or key in secrets[name]["stringData"], (where, name, key)
        for c in spec["containers"]:
            files = [a.split("=", 1)[1] for a in c.get("args", []) if re.match(r"--[\w-]*(file|cert|key|cacert)=/etc/", a)]
            files += [f for f in [client_certificate(c)] if f]  # not the trainer's --log-file=/ckpt/...
            for path in files:
                name, key = secret_file(spec, c, path)
                assert key in secrets[name]["stringData"], (where, path)


def test_the_peer_port_trusts_a_ca_of_its_own_and_the_members_cn_only() -> None:
    """The client CA signs every client certificate (a training pod's): were it the peer CA, each would be a
    valid peer certificate and only the NetworkPolicy would keep training pods off port 2380."""
    (sts,) = [d for d in documents(K8S / "etcd" / "etcd-tls.yaml") if d["kind"] == "StatefulSet"]
    spec = sts["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in container["args"])
    client_ca, _ = secret_file(spec, container, flags["--trusted-ca-file"])
    peer_ca, _ = secret_file(spec, container, flags["--peer-trusted-ca-file"])
    assert peer_ca != client_ca
    assert "--peer-client-cert-auth" in flags
    for flag in ("--peer-cert-file", "--peer-key-file"):  # the members' peer certificate, of the peer CA
        assert secret_file(spec, container, flags[flag])[0] == peer_ca, flag
    secrets = example_secrets()
    assert flags["--peer-cert-allowed-cn"] == secrets[peer_ca]["metadata"]["annotations"][CN]
    for where, _, other in pod_specs():  # the peer CA's Secret is the members' only
        if not where.startswith("etcd/etcd-tls.yaml:StatefulSet/"):
            assert peer_ca not in secrets_named(other), where
    for name, secret in secrets.items():  # and no other certificate has the members' peer CN
        if name != peer_ca:
            assert secret["metadata"].get("annotations", {}).get(CN) != flags["--peer-cert-allowed-cn"], name


def test_each_tls_job_presents_a_client_certificate_of_its_own_naming_its_user() -> None:
    """With ``--client-cert-auth`` etcd takes a certificate's CN as the user name: a certificate shared by
    jobs would let every job act as the user it names, password or not. Each training job presents its own,
    ``etcd-rdzv-client-<job>``, whose CN is the job's etcd user and which no other workload names; the admin
    Jobs present one with no CN (no user: root needs its password); no certificate names root or another
    job's user."""
    secrets = example_secrets()
    users = {"root"}
    for _, _, spec in pod_specs():
        for name, key in secret_refs(spec):
            if name.startswith("etcd-rdzv-auth") and key == "user":
                users.add(secrets[name]["stringData"]["user"])
    own: dict[str, str] = {}  # a job's certificate Secret -> its CN
    admin = 0
    for where, doc, spec in sorted(pod_specs(), key=lambda w: "/training/" not in f"/{w[0]}"):  # jobs first
        if doc["kind"] == "StatefulSet":
            continue
        for c in spec["containers"]:
            path = client_certificate(c)
            if path is None:
                continue
            name, _ = secret_file(spec, c, path)
            cn = secrets[name]["metadata"].get("annotations", {}).get(CN)
            if "/training/" in f"/{where}":
                assert name == f"etcd-rdzv-client-{doc['metadata']['name']}", where
                ref = {e["name"]: e for e in c["env"]}["ETCD_RDZV_USER"]["valueFrom"]["secretKeyRef"]
                assert cn == secrets[ref["name"]]["stringData"][ref["key"]] != "root", where
                own[name] = cn
            else:
                assert where.split(":")[0] in ADMIN_FILES and cn == "", where  # no CN
                admin += 1
    assert len(own) == 1 and admin == 2  # job-tls-auth.yaml; auth-setup.yaml, grant-run.yaml
    for name in own:  # no other workload names a job's certificate
        holders = [where for where, _, spec in pod_specs() if name in secrets_named(spec)]
        assert len(holders) == 1, (name, holders)
    for name, secret in secrets.items():  # a CN that is a user: only the job's own certificate's
        cn = secret["metadata"].get("annotations", {}).get(CN)
        if cn in users:
            assert own.get(name) == cn, name


def test_the_root_password_goes_only_to_the_admin_jobs_and_no_trainer_image() -> None:
    """Whoever controls the image a pod runs controls what it does with the Secrets mounted in it: the root
    password goes to the auth set-up and the grant Jobs only, and neither runs a trainer image."""
    training = {c["image"] for where, _, spec in pod_specs() if "/training/" in f"/{where}"
                for c in spec["containers"] + spec.get("initContainers", [])}
    holders = set()
    for where, _, spec in pod_specs():
        if ROOT_SECRET in secrets_named(spec):
            holders.add(where.split(":")[0])
            for c in spec["containers"] + spec.get("initContainers", []):
                assert c["image"] not in training, where
    assert holders == ADMIN_FILES
    container, _ = _grant_job()
    assert container["image"] not in training and "/etcd-rdzv-admin:" in container["image"]


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


def _grant_job() -> tuple[dict[str, Any], dict[str, str]]:
    """The container of etcd/grant-run.yaml and its plain ``env`` values."""
    ((_, job),) = [(p, d) for p, d in by_kind("Job") if p.name == "grant-run.yaml"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container, {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_grant_job_names_the_training_jobs_run_and_user() -> None:
    """grant-run.yaml grants the run id the TLS+auth training Job uses, to the user that Job logs in as."""
    container, env = _grant_job()
    (train,) = [c for where, _, c in torchrun_lines() if "job-tls-auth.yaml" in where]
    train_env = {e["name"]: e for e in train["env"]}
    assert train_env["RUN_ID"]["value"] == env["RUN_ID"]
    assert "--rdzv-id=$(RUN_ID)" in train["args"]
    users = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert users["RUN_USER"] == train_env["ETCD_RDZV_USER"]["valueFrom"]["secretKeyRef"]
    assert container["command"] == ["etcd-rdzv"] and env["ETCD_RDZV_USER"] == "root"
    endpoints = next(a for a in container["args"] if a.startswith("--endpoints=")).split("=", 1)[1]
    assert set(endpoints.split(",")) == etcd_members(True)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_auth_setup_then_grant_against_etcd(etcd_binary: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """auth-setup.yaml's script turns auth on with root only; grant-run.yaml's command line (its
    connection options replaced by the local etcd's) then makes a user limited to the job's run."""
    from etcd_rdzv.cli import main

    (config,) = [d for d in documents(K8S / "etcd" / "auth-setup.yaml") if d["kind"] == "ConfigMap"]
    script = tmp_path / "setup.sh"
    script.write_text(config["data"]["setup.sh"])
    password, root_password = 'pa"ss\\w0rd-x', 'r0"ot\\pw'  # quotes and backslashes survive
    mounts = {"/etc/etcd-rdzv-auth": tmp_path / "auth", "/etc/etcd-rdzv-root": tmp_path / "root"}
    for local in mounts.values():
        local.mkdir()
    (mounts["/etc/etcd-rdzv-auth"] / "password").write_text(password + "\n")
    (mounts["/etc/etcd-rdzv-root"] / "root-password").write_text(root_password)
    with EtcdServer(binary=etcd_binary) as server:
        env = {**os.environ, "ETCD_URL": server.get_client_url(), "ROOT_SECRETS": str(mounts["/etc/etcd-rdzv-root"]),
               "TLS_DIR": str(tmp_path / "no-tls")}
        first = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        assert root_password not in first.stdout + first.stderr
        again = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already" in again.stdout, again.stderr
        with EtcdClient(server.get_endpoint(), user="root", password=root_password, timeout=5,
                        allow_insecure_auth=True) as root_client:  # the set-up makes root only: no shared role
            assert (user_names(root_client), role_names(root_client)) == (["root"], ["root"])

        container, values = _grant_job()
        values["RUN_USER"] = "rdzv-train"  # the Secret's user
        argv = []
        for arg in container["args"]:
            if arg.split("=", 1)[0] in ("--endpoints", "--cacert", "--cert", "--key"):
                continue  # the cluster's https endpoints and client certificate
            arg = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg)
            for mount, local in mounts.items():
                arg = arg.replace(mount + "/", f"{local}/")
            argv.append(arg)
        root_pw = values["ETCD_RDZV_PASSWORD_FILE"].replace("/etc/etcd-rdzv-root/", f"{mounts['/etc/etcd-rdzv-root']}/")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ETCD_RDZV_USER", values["ETCD_RDZV_USER"])
            mp.setenv("ETCD_RDZV_PASSWORD_FILE", root_pw)
            mp.delenv("ETCD_RDZV_PASSWORD", raising=False)
            base = ["--endpoints", server.get_endpoint(), "--allow-insecure-auth"]  # no TLS locally
            for _ in range(2):  # a re-run changes nothing
                assert main([*base, *argv]) == 0, capsys.readouterr().err
        assert password not in capsys.readouterr().out
        run = b"/torch/elastic/rendezvous/train"
        with EtcdClient(server.get_endpoint(), user="rdzv-train", password=password, timeout=5,
                        allow_insecure_auth=True) as client:  # a local etcd without TLS
            client.put(run, b"1")
            client.put(run + b"/v3/ctl/sealed", b"1")
            for other in (run + b"2", run + b"2/v3/run", b"/torch/elastic/rendezvous/other/x", b"/other"):
                with pytest.raises(EtcdPermissionDenied):
                    client.put(other, b"1")
                with pytest.raises(EtcdPermissionDenied):
                    client.range(other)
        with EtcdClient(server.get_endpoint(), user="root", password=root_password, timeout=5,
                        allow_insecure_auth=True) as root_client:  # the root password of ROOT_SECRETS
            assert root_client.get(run) is not None
            # the grant adds the job's user and role, no role over the whole prefix
            assert (user_names(root_client), role_names(root_client)) == (["rdzv-train", "root"], ["rdzv-train", "root"])
