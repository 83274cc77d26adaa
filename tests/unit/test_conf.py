"""rdzv-conf parsing (etcd_rdzv/conf.py): defaults, values, environment, legacy keys, bad input. No etcd."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from helpers.ports import closed_port
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as torch_registry

from etcd_rdzv import conf_keys, plugin
from etcd_rdzv.conf import (
    DynamicSettings,
    parse_dynamic_settings,
    parse_rdzv_config,
    parse_v3_settings,
    translate_legacy_params,
)
from etcd_rdzv.conf_keys import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_STATE_TTL,
    LEGACY_KEY_PREFIX,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
)

_ids = itertools.count()


def _params(backend: str = "etcd-v2", endpoint: str = "127.0.0.1:2379", **conf: Any) -> RendezvousParameters:
    # Passwords over http are refused without allow_insecure_auth (the tests of that pass "0").
    conf.setdefault("allow_insecure_auth", "1")
    return RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=f"conf-run-{next(_ids)}", min_nodes=1, max_nodes=2, **conf
    )


@pytest.fixture(autouse=True)
def _no_auth_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(USER_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(plugin.DISABLE_OVERRIDE_ENV, raising=False)


def test_defaults() -> None:
    config = parse_rdzv_config(_params(endpoint=""))
    assert config.client.endpoints == "localhost:2379"
    assert config.client.timeout == DEFAULT_READ_TIMEOUT == 60
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
    assert config.client.timeout == 2.5
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


def test_cas_backoff_max_seconds_is_read_as_torch_reads_it() -> None:
    """torch 2.15's key (a random delay of up to that many seconds after a lost write of the state):
    0 (no delay) by default, any finite number of 0 or more, refused naming the key otherwise."""
    assert parse_dynamic_settings(_params()).cas_backoff_max_seconds == 0.0
    assert parse_dynamic_settings(_params(cas_backoff_max_seconds="0.25")).cas_backoff_max_seconds == 0.25
    assert parse_dynamic_settings(_params(cas_backoff_max_seconds="0")).cas_backoff_max_seconds == 0.0
    legacy = parse_dynamic_settings(_params("etcd", cas_backoff_max_seconds="1"), legacy=True)
    assert legacy.cas_backoff_max_seconds == 1.0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match=rf"'cas_backoff_max_seconds' must be a finite number .*{bad!r}"):
            parse_dynamic_settings(_params(cas_backoff_max_seconds=bad))


def test_presence_ttl_is_whole_seconds_of_two_or_more_or_zero() -> None:
    """etcd-v2's presence lease (etcd_rdzv/dynamic/presence.py): 3 s by default, 0 turns it off; 1 s is
    below etcd's shortest lease (refused, not silently lengthened), the rest refused naming the key."""
    assert parse_dynamic_settings(_params()).presence_ttl == 3
    assert parse_dynamic_settings(_params(presence_ttl="0")).presence_ttl == 0
    assert parse_dynamic_settings(_params(presence_ttl="10")).presence_ttl == 10
    with pytest.raises(ValueError, match=r"'presence_ttl' must be 0 \(off\) or at least 2 seconds"):
        parse_dynamic_settings(_params(presence_ttl="1"))
    for bad in ("-1", "2.5", "soon", "true"):
        with pytest.raises(ValueError, match=rf"'presence_ttl' must be an integer of 0 or more, got {bad!r}"):
            parse_dynamic_settings(_params(presence_ttl=bad))


def test_fast_recovery_is_off_by_default_and_needs_presence() -> None:
    """etcd-v2's fast_recovery (a deviation from torch's last call) is opt-in, read as every boolean key
    is (below), and refused with presence off (it waits for the nodes whose presence key is alive)."""
    assert parse_dynamic_settings(_params()).fast_recovery is False
    assert parse_dynamic_settings(_params(fast_recovery="true")).fast_recovery is True
    with pytest.raises(ValueError, match=r"'fast_recovery' needs presence .* presence_ttl=0"):
        parse_dynamic_settings(_params(fast_recovery="1", presence_ttl="0"))
    with pytest.raises(ValueError, match="fast_recovery"):
        parse_dynamic_settings(_params(fast_recovery="maybe"))


@pytest.mark.parametrize("key", ["fast_recovery", "allow_insecure_auth"])
def test_every_boolean_key_reads_torchs_spellings_and_on_off(key: str) -> None:
    """One boolean parser for every key: each spelling torch's ``get_as_bool`` takes means the same here
    (side by side), ``on``/``off`` too; anything else is refused naming the key; blank is the default."""
    for text in ("1", "true", "T", "Yes", "y", "0", "false", "F", "NO", "n"):
        torch_reads = _params(**{key: text}).get_as_bool(key)
        assert conf_keys.boolean(key, text) is torch_reads, text
    assert (conf_keys.boolean(key, "on"), conf_keys.boolean(key, " OFF ")) == (True, False)
    with pytest.raises(ValueError, match=rf"^The rendezvous configuration option '{key}' must be a boolean, got 'maybe'"):
        conf_keys.boolean(key, "maybe")
    assert parse_v3_settings(_params("etcd-v3", fast_recovery=""))[0].fast_recovery is True  # etcd-v3's default
    assert parse_dynamic_settings(_params(fast_recovery=" ")).fast_recovery is False  # etcd-v2's


def test_etcd_v3_lease_ttl_is_heartbeat_else_torchs_keep_alive_product() -> None:
    """Without ``heartbeat`` (absent or blank) the lease TTL is ``keep_alive_interval ×
    keep_alive_max_attempt`` (whole seconds), so a switch from ``etcd-v2`` keeps the time a silent node
    counts as dead; ``heartbeat`` wins and is rounded up to whole seconds."""
    def ttl(**conf: str) -> int:
        return parse_v3_settings(_params("etcd-v3", **conf))[0].lease_ttl

    assert ttl() == 15
    assert ttl(keep_alive_interval="2", keep_alive_max_attempt="4") == 8
    assert ttl(heartbeat="", keep_alive_interval="2", keep_alive_max_attempt="4") == 8
    assert ttl(heartbeat="7", keep_alive_interval="2") == 7
    assert ttl(heartbeat="2.5") == 3


# ------------------------------------------------------------------ secrets from files


def test_password_file_option_and_variable(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cr3t\n")  # as a Kubernetes Secret volume holds it
    options = parse_rdzv_config(_params(user="bob", password_file=str(secret))).client
    assert (options.user, options.password) == ("bob", "s3cr3t")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    monkeypatch.setenv(USER_ENV, "env-user")
    assert parse_rdzv_config(_params()).client.password == "s3cr3t"
    monkeypatch.setenv(PASSWORD_ENV, "from-env")  # the plain variable wins over the file variable
    assert parse_rdzv_config(_params()).client.password == "from-env"


def test_unreadable_password_file_names_the_option_not_the_secret(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"'password_file' \('/no/such/pw'\) cannot be read: No such file"):
        parse_rdzv_config(_params(user="bob", password_file="/no/such/pw"))


def test_a_password_in_rdzv_conf_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import etcd_rdzv.conf as conf

    conf._password_in_conf_warned = False
    with caplog.at_level("WARNING", logger="etcd_rdzv.conf"):
        parse_rdzv_config(_params(user="bob", password="hunter2"))
    assert "password_file" in caplog.text and "hunter2" not in caplog.text


# ------------------------------------------------------------------ run ids


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd", "etcd-v3"])
@pytest.mark.parametrize(("run_id", "said"), [("a/b", "must not contain '/'"), ("", "must be a non-empty string")])
def test_every_backend_rejects_the_same_run_ids_alike(backend: str, run_id: str, said: str) -> None:
    """Bad run ids fail before any etcd call (nothing listens on the endpoint) with one message."""
    params = RendezvousParameters(
        backend=backend, endpoint=f"127.0.0.1:{closed_port()}", run_id=run_id, min_nodes=1, max_nodes=2
    )
    with pytest.raises(ValueError, match=rf"run id \(--rdzv-id\) {said}"):
        torch_registry.get_rendezvous_handler(params)


def test_a_password_over_http_is_refused_unless_allow_insecure_auth() -> None:
    with pytest.raises(ValueError, match="plain text to http://127.0.0.1:2379.*allow_insecure_auth") as info:
        parse_rdzv_config(_params(user="bob", password="b0b-pw", allow_insecure_auth="0"))
    assert "b0b-pw" not in str(info.value)
    assert parse_rdzv_config(_params(user="bob", password="pw", allow_insecure_auth="yes")).client.allow_insecure_auth
    https = parse_rdzv_config(_params(endpoint="https://h:1", user="bob", password="pw", allow_insecure_auth="0"))
    assert https.client.password == "pw" and not https.client.allow_insecure_auth
    with pytest.raises(ValueError, match="'allow_insecure_auth' must be a boolean"):
        parse_rdzv_config(_params(allow_insecure_auth="maybe"))


@pytest.mark.parametrize("endpoint, match", [
    ("https://h1:1,http://h2:2", "mix https and http"),
    ("http://h1:1", "says http but the client is configured for https"),
])
def test_endpoint_schemes_must_agree_with_each_other_and_the_protocol(endpoint: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rdzv_config(_params(endpoint=endpoint, protocol="https" if "," not in endpoint else None))
