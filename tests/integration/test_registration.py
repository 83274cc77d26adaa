"""torchrun registration of ``etcd-v2``/``etcd``, rdzv-conf parsing, TLS and auth options."""

from __future__ import annotations

import itertools
import os
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

from etcd_rdzv import EtcdRendezvousBackend, plugin
from etcd_rdzv.conf import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_STATE_TTL,
    LEGACY_KEY_PREFIX,
    PASSWORD_ENV,
    USER_ENV,
    DynamicSettings,
    parse_dynamic_settings,
    parse_rdzv_config,
    translate_legacy_params,
)
from etcd_server import AuthConfig, EtcdServer, TLSConfig

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


# ------------------------------------------------------------------ rdzv-conf parsing


def test_defaults() -> None:
    config = parse_rdzv_config(_params(endpoint=""))
    assert config.client.endpoints == "localhost:2379"
    assert config.client.read_timeout == DEFAULT_READ_TIMEOUT == 60
    assert config.client.protocol is None
    assert (config.client.ca_cert, config.client.cert, config.client.key) == (None, None, None)
    assert (config.client.user, config.client.password) == (None, None)
    assert config.key_prefix == DEFAULT_KEY_PREFIX == "/torch/elastic/rendezvous"
    assert config.state_ttl == DEFAULT_STATE_TTL == 7200
    assert config.state_key("job") == "/torch/elastic/rendezvous/job"
    assert config.store_prefix("job") == "/torch/elastic/rendezvous/job/store"


def test_values_are_read() -> None:
    config = parse_rdzv_config(
        _params(
            endpoint="h1:1,https://h2:2",
            read_timeout="2.5",
            protocol="HTTPS",
            key_prefix="/my/prefix/",
            state_ttl="30",
            user="bob",
            password="pw",
        )
    )
    assert config.client.endpoints == "h1:1,https://h2:2"
    assert config.client.read_timeout == 2.5
    assert config.client.protocol == "https"
    assert config.key_prefix == "/my/prefix"
    assert config.state_ttl == 30
    assert (config.client.user, config.client.password) == ("bob", "pw")
    assert "pw" not in repr(config)


def test_user_and_password_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(USER_ENV, "env-user")
    monkeypatch.setenv(PASSWORD_ENV, "env-pw")
    options = parse_rdzv_config(_params()).client
    assert (options.user, options.password) == ("env-user", "env-pw")
    # The conf wins over the environment.
    options = parse_rdzv_config(_params(user="conf-user", password="conf-pw")).client
    assert (options.user, options.password) == ("conf-user", "conf-pw")


@pytest.mark.parametrize(
    ("conf", "endpoint", "named"),
    [
        ({"read_timeout": "soon"}, None, "'read_timeout'"),
        ({"read_timeout": "0"}, None, "'read_timeout'"),
        ({"read_timeout": "-3"}, None, "'read_timeout'"),
        ({"protocol": "ftp"}, None, "'protocol'"),
        ({"ca_cert": "/no/such/ca.pem"}, None, "'ca_cert'"),
        ({"ssl_cert": "/no/such/cert.pem"}, None, "'ssl_cert'"),
        ({"ssl_cert_key": __file__}, None, "'ssl_cert_key'"),
        ({"ssl_cert": __file__}, None, "'ssl_cert_key'"),  # a cert file without a key
        ({"user": "bob"}, None, "'password'"),
        ({"password": "pw"}, None, "'user'"),
        ({"state_ttl": "long"}, None, "'state_ttl'"),
        ({"state_ttl": "0"}, None, "'state_ttl'"),
        ({"state_ttl": "9000000000"}, None, "'state_ttl'"),
        ({"key_prefix": "/a b"}, None, "'key_prefix'"),
        ({}, "host:notaport", "--rdzv-endpoint"),
        ({}, "ftp://host:1", "--rdzv-endpoint"),
        ({"join_timeout": "-5"}, None, "join"),
        ({"keep_alive_interval": "x"}, None, "'keep_alive_interval'"),
        ({"keep_alive_max_attempt": "0"}, None, "'keep_alive_max_attempt'"),
        ({"keep_alive_max_attempt": "many"}, None, "'keep_alive_max_attempt' must be a positive integer"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_key(
    conf: dict[str, str], endpoint: str | None, named: str
) -> None:
    params = _params(endpoint=endpoint or "127.0.0.1:2379", **conf)
    with pytest.raises(ValueError) as ei:
        torch_registry.get_rendezvous_handler(params)  # what torchrun calls
    assert named in str(ei.value)


def test_legacy_keys_are_translated() -> None:
    legacy = translate_legacy_params(
        _params("etcd", cacert="/ca", cert="/c", key="/k", etcd_prefix="/old", timeout="77")
    )
    assert legacy.get("ca_cert") == "/ca"
    assert legacy.get("ssl_cert") == "/c"
    assert legacy.get("ssl_cert_key") == "/k"
    assert legacy.get("key_prefix") == "/old"
    assert legacy.get("join_timeout") == "77"
    # Defaults: the legacy prefix; join_timeout wins over torchrun's injected timeout.
    plain = translate_legacy_params(_params("etcd", timeout="900", join_timeout="20"))
    assert plain.get("key_prefix") == LEGACY_KEY_PREFIX
    assert plain.get("join_timeout") == "20"


def test_dynamic_settings_name_every_timeout() -> None:
    """One pass: torch's handler defaults, the values given, the legacy keys."""
    d = parse_dynamic_settings(_params())
    assert (d.join_timeout, d.last_call_timeout, d.close_timeout, d.heartbeat_timeout) == (600, 30, 30, 5)
    assert (d.keep_alive_interval, d.keep_alive_max_attempt) == (5, 3)
    assert d.config.key_prefix == DEFAULT_KEY_PREFIX and d.backend == "etcd-v2"
    given = parse_dynamic_settings(
        _params(join_timeout="7", heartbeat_timeout="1.5", keep_alive_interval="2", keep_alive_max_attempt="4")
    )
    assert (given.join_timeout, given.heartbeat_timeout) == (7, 1.5)
    assert (given.keep_alive_interval, given.keep_alive_max_attempt) == (2, 4)
    legacy = parse_dynamic_settings(_params("etcd", timeout="77", etcd_prefix="/old"), legacy=True)
    assert isinstance(legacy, DynamicSettings)
    assert (legacy.join_timeout, legacy.config.key_prefix, legacy.backend) == (77, "/old", "etcd")


def test_legacy_handler_reads_legacy_keys(etcd_endpoint: str) -> None:
    handler = torch_registry.get_rendezvous_handler(
        _params("etcd", etcd_endpoint, etcd_prefix="/legacy/p2p", timeout="77", last_call_timeout="3")
    )
    assert handler.settings.timeout.join.total_seconds() == 77
    assert handler.settings.timeout.last_call.total_seconds() == 3
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    assert isinstance(backend, EtcdRendezvousBackend)
    assert backend.key == f"/legacy/p2p/{handler.get_run_id()}"
    assert backend.name == "etcd"


def test_several_endpoints_fail_over(etcd_endpoint: str) -> None:
    params = _params(endpoint=f"127.0.0.1:{closed_port()},{etcd_endpoint}", read_timeout="10")
    config = parse_rdzv_config(params)
    with config.client.create_client() as client:
        backend = EtcdRendezvousBackend(client, params.run_id, config.key_prefix)
        result = backend.set_state(b"state")
        assert result is not None and result[2]
        assert backend.get_state() == (b"state", result[1])


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
    with config.client.create_client() as client:
        backend = EtcdRendezvousBackend(client, params.run_id, config.key_prefix)
        result = backend.set_state(b"over tls")
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
    with config.client.create_client() as client:
        with pytest.raises(RendezvousConnectionError, match="(?i)tls|certificate"):
            EtcdRendezvousBackend(client, "tls-run").get_state()


def test_auth_user_and_password_from_environment(
    etcd_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = AuthConfig("r00t-pw-x", user="alice", password="al1ce-pw-x", prefix=b"/jobs/alice/")
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        monkeypatch.setenv(USER_ENV, "alice")
        monkeypatch.setenv(PASSWORD_ENV, "al1ce-pw-x")
        _roundtrip(_params(endpoint=server.get_endpoint(), key_prefix="/jobs/alice/rdzv", read_timeout="10"))
        monkeypatch.setenv(PASSWORD_ENV, "wrong-pw")
        config = parse_rdzv_config(
            _params(endpoint=server.get_endpoint(), key_prefix="/jobs/alice/rdzv", read_timeout="5")
        )
        with config.client.create_client() as client:
            with pytest.raises(RendezvousConnectionError, match="alice"):
                EtcdRendezvousBackend(client, "auth-run", config.key_prefix).get_state()
