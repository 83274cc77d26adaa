"""torchrun registration of ``etcd-v2``/``etcd``, rdzv-conf parsing, TLS and auth options."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from helpers.certs import CertPaths, have_openssl, make_certs
from helpers.ports import closed_port
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as torch_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from etcd_rdzv import EtcdRendezvousBackend, plugin
from etcd_rdzv.conf import parse_rdzv_config
from etcd_rdzv.conf_keys import PASSWORD_ENV, USER_ENV
from etcd_server import AuthConfig, EtcdServer, TLSConfig
from etcd_store.client import EtcdClient

_ids = itertools.count()


def _params(backend: str = "etcd-v2", endpoint: str = "127.0.0.1:2379", **conf: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=f"reg-run-{next(_ids)}",
        min_nodes=1,
        max_nodes=2,
        **conf,
    )




@pytest.fixture(autouse=True)
def _no_auth_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(USER_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(plugin.DISABLE_OVERRIDE_ENV, raising=False)


# ------------------------------------------------------------------ entry points and registry


def test_entry_points_declare_all_three_backends_in_one_module() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert eps.get("etcd-v2") == "etcd_rdzv.plugin:create_etcd_v2_handler"
    assert eps.get("etcd") == "etcd_rdzv.plugin:create_etcd_legacy_handler"
    assert eps.get("etcd-v3") == "etcd_rdzv.plugin:create_etcd_v3_handler"


def test_torch_registry_holds_our_creators_after_import() -> None:
    table = rendezvous_handler_registry._registry
    assert table["etcd-v2"] is plugin.create_etcd_v2_rdzv_handler
    assert table["etcd"] is plugin.create_etcd_legacy_rdzv_handler
    # torch's other built-ins are untouched.
    assert table["c10d"] is torch_registry._create_c10d_handler
    assert table["static"] is torch_registry._create_static_handler


def test_factories_take_no_argument_and_replace_the_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    table = rendezvous_handler_registry._registry
    builtins = {"etcd-v2": torch_registry._create_etcd_v2_handler, "etcd": torch_registry._create_etcd_handler}
    factories = {"etcd-v2": plugin.create_etcd_v2_handler, "etcd": plugin.create_etcd_legacy_handler}
    for name, builtin in builtins.items():
        # As torch does: built-ins first, then the entry point's factory() result.
        monkeypatch.setitem(table, name, builtin)
        creator = factories[name]()
        rendezvous_handler_registry.register(name, creator)  # must not raise
        assert table[name] is creator is not builtin


def test_disable_env_keeps_torch_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    table = rendezvous_handler_registry._registry
    monkeypatch.setenv(plugin.DISABLE_OVERRIDE_ENV, "1")
    for name, builtin, factory in (
        ("etcd-v2", torch_registry._create_etcd_v2_handler, plugin.create_etcd_v2_handler),
        ("etcd", torch_registry._create_etcd_handler, plugin.create_etcd_legacy_handler),
    ):
        monkeypatch.setitem(table, name, builtin)
        creator = factory()
        assert creator is builtin
        rendezvous_handler_registry.register(name, creator)
        assert table[name] is builtin


def test_entry_point_modules_import_neither_torch_nor_grpc() -> None:
    """torch imports the entry points while it is itself being imported: they must stay light."""
    code = (
        "import sys\n"
        "import etcd_rdzv, etcd_rdzv.plugin, etcd_rdzv.dynamic, etcd_rdzv.native, etcd_rdzv.testing\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'etcd3')))\n"
        "print(etcd_rdzv.create_etcd_v3_handler is etcd_rdzv.plugin.create_etcd_v3_handler)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stderr


def test_disable_env_in_a_fresh_torch_process() -> None:
    """The real loading path: torch imports its registry and calls our factories."""
    code = (
        "import torch.distributed.elastic.rendezvous as r\n"
        "t = r.rendezvous_handler_registry._registry\n"
        "print(t['etcd-v2'].__module__, t['etcd'].__module__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != plugin.DISABLE_OVERRIDE_ENV}
    off = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, plugin.DISABLE_OVERRIDE_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert off.stdout.split() == [
        "torch.distributed.elastic.rendezvous.registry",
        "torch.distributed.elastic.rendezvous.registry",
    ], off.stderr
    assert "Exception while registering" not in off.stderr


def test_factory_called_with_params_creates_the_handler(etcd_endpoint: str) -> None:
    handler = plugin.create_etcd_v2_handler(_params(endpoint=etcd_endpoint))
    assert handler.get_backend() == "etcd-v2"


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_registry_creates_our_handler_with_the_requested_name(etcd_endpoint: str, backend: str) -> None:
    from etcd_rdzv import EtcdRendezvousHandler

    handler = torch_registry.get_rendezvous_handler(_params(backend, etcd_endpoint))
    assert isinstance(handler, EtcdRendezvousHandler)
    assert handler.get_backend() == backend
    assert handler.use_agent_store == (os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1")


def test_plugin_that_cannot_import_grpc_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate a broken grpc install: importing it fails, as do the modules built on it.
    monkeypatch.setitem(sys.modules, "grpc", None)
    for name in ("etcd_store.client", "etcd_rdzv.dynamic.backend", "etcd_rdzv.dynamic.handler"):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)
    with pytest.raises(plugin.EtcdRdzvPluginError) as ei:
        torch_registry.get_rendezvous_handler(_params())
    text = str(ei.value)
    assert "'etcd-v2'" in text and "grpc" in text
    assert "pip install" in text and plugin.DISABLE_OVERRIDE_ENV in text
    assert isinstance(ei.value, ImportError)


def test_legacy_handler_reads_legacy_keys(etcd_endpoint: str) -> None:
    handler = torch_registry.get_rendezvous_handler(
        _params("etcd", etcd_endpoint, etcd_prefix="/legacy/p2p", timeout="77", last_call_timeout="3")
    )
    assert handler.settings.timeout.join.total_seconds() == 77
    assert handler.settings.timeout.last_call.total_seconds() == 3
    backend = handler._state_holder.backend  # type: ignore[attr-defined]  # the SealedRoundStateHolder's
    assert isinstance(backend, EtcdRendezvousBackend)
    assert backend.key == f"/legacy/p2p/{handler.get_run_id()}"
    assert backend.name == "etcd"


def test_several_endpoints_fail_over(etcd_endpoint: str) -> None:
    params = _params(endpoint=f"127.0.0.1:{closed_port()},{etcd_endpoint}", read_timeout="10")
    config = parse_rdzv_config(params)
    with EtcdClient.from_options(config.client) as client:
        backend = EtcdRendezvousBackend(client, params.run_id, config.key_prefix)
        state = pickle.dumps(_RendezvousState())  # the backend hands torch only torch's states
        result = backend.set_state(state)
        assert result is not None and result[2]
        assert backend.get_state() == (state, result[1])


# ------------------------------------------------------------------ TLS and auth


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    if not have_openssl():
        pytest.skip("openssl command not available")
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def tls_server(etcd_binary: str, certs: CertPaths) -> Iterator[EtcdServer]:
    tls = TLSConfig(
        certs.server_cert, certs.server_key, certs.ca,
        client_cert_file=certs.client_cert, client_key_file=certs.client_key,
    )  # fmt: skip
    with EtcdServer(binary=etcd_binary, tls=tls) as server:
        yield server


def _roundtrip(params: RendezvousParameters) -> None:
    config = parse_rdzv_config(params)
    with EtcdClient.from_options(config.client) as client:
        backend = EtcdRendezvousBackend(client, params.run_id, config.key_prefix)
        result = backend.set_state(pickle.dumps(_RendezvousState()))
        assert result is not None and result[2]


def test_tls_keys_as_torch_etcd_v2(tls_server: EtcdServer, certs: CertPaths, tmp_path: Path) -> None:
    endpoint = tls_server.get_endpoint()
    _roundtrip(
        _params(
            endpoint=endpoint, protocol="https", ca_cert=certs.ca,
            ssl_cert=certs.client_cert, ssl_cert_key=certs.client_key, read_timeout="10",
        )
    )  # fmt: skip
    # torch's etcd-v2 also takes one PEM file holding both certificate and key.
    combined = tmp_path / "client-combined.pem"
    combined.write_bytes(Path(certs.client_cert).read_bytes() + Path(certs.client_key).read_bytes())
    _roundtrip(
        _params(endpoint=endpoint, protocol="https", ca_cert=certs.ca, ssl_cert=str(combined), read_timeout="10")
    )
    # The wrong CA is refused within the read timeout, as a connection error.
    config = parse_rdzv_config(
        _params(endpoint=endpoint, protocol="https", ca_cert=certs.other_ca,
                ssl_cert=certs.client_cert, ssl_cert_key=certs.client_key, read_timeout="3")
    )  # fmt: skip
    with EtcdClient.from_options(config.client) as client:
        with pytest.raises(RendezvousConnectionError, match="(?i)tls|certificate"):
            EtcdRendezvousBackend(client, "tls-run").get_state()


def test_auth_user_and_password_from_environment(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = AuthConfig("r00t-pw-x", user="alice", password="al1ce-pw-x", prefix=b"/jobs/alice/")
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        monkeypatch.setenv(USER_ENV, "alice")
        monkeypatch.setenv(PASSWORD_ENV, "al1ce-pw-x")
        # A local etcd without TLS: the password goes in plain text only with the opt-in.
        local = {"endpoint": server.get_endpoint(), "allow_insecure_auth": "1"}
        _roundtrip(_params(**local, key_prefix="/jobs/alice/rdzv", read_timeout="10"))
        monkeypatch.setenv(PASSWORD_ENV, "wrong-pw")
        config = parse_rdzv_config(_params(**local, key_prefix="/jobs/alice/rdzv", read_timeout="5"))
        with EtcdClient.from_options(config.client) as client:
            with pytest.raises(RendezvousConnectionError, match="alice"):
                EtcdRendezvousBackend(client, "auth-run", config.key_prefix).get_state()


def test_etcdctl_environment_alone_reaches_a_tls_and_auth_etcd(
    etcd_binary: str, certs: CertPaths, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shell set up for etcdctl (ETCDCTL_*) serves the rendezvous and the CLI with no other option."""
    from etcd_rdzv.cli import main as cli_main

    tls = TLSConfig(
        certs.server_cert, certs.server_key, certs.ca,
        client_cert_file=certs.client_cert, client_key_file=certs.client_key,
    )  # fmt: skip
    auth = AuthConfig("r00t-pw-e", user="erin", password="er1n-pw-e", prefix=b"/jobs/erin/")
    with EtcdServer(binary=etcd_binary, tls=tls, auth=auth) as server:
        for name, value in {"ETCDCTL_ENDPOINTS": server.get_client_url(), "ETCDCTL_CACERT": certs.ca,
                            "ETCDCTL_CERT": certs.client_cert, "ETCDCTL_KEY": certs.client_key,
                            "ETCDCTL_USER": "erin:er1n-pw-e"}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
        params = _params(endpoint="", key_prefix="/jobs/erin/rdzv", read_timeout="10")
        _roundtrip(params)
        assert cli_main(["--key-prefix", "/jobs/erin/rdzv", "--timeout", "10", "list", "--json"]) == 0
        assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [params.run_id]
        monkeypatch.setenv("ETCDCTL_USER", "erin:wrong-pw-e")
        assert cli_main(["--key-prefix", "/jobs/erin/rdzv", "--timeout", "5", "list"]) == 2
        err = capsys.readouterr().err
        assert "erin" in err and "wrong-pw-e" not in err and err.count("\n") == 1
