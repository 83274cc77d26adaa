"""etcdctl's environment variables (etcd_rdzv/conf_env.py) in the rendezvous conf and the CLI: precedence,
``name:password``, bad values named, passwords never logged. No etcd."""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from etcd_rdzv import conf_env
from etcd_rdzv.cli import build_parser
from etcd_rdzv.cli.connect import CliError, connect_options
from etcd_rdzv.conf import parse_rdzv_config
from etcd_rdzv.conf_keys import PASSWORD_ENV, PASSWORD_FILE_ENV, USER_ENV

_ids = itertools.count()
ETCDCTL = ("ETCDCTL_ENDPOINTS", "ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY", "ETCDCTL_USER", "ETCDCTL_PASSWORD")


def _params(endpoint: str = "", **conf: Any) -> RendezvousParameters:
    # Passwords over http are refused without allow_insecure_auth (tests/unit/test_conf.py checks that).
    conf.setdefault("allow_insecure_auth", "1")
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id=f"env-run-{next(_ids)}", min_nodes=1, max_nodes=2, **conf
    )


def _cli(*args: str) -> argparse.Namespace:
    return build_parser().parse_args([*args, "list"])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*ETCDCTL, USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(conf_env, "_noted", set())


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("ca", "ca2", "cert", "key", "cert2", "key2"):
        path = tmp_path / f"{name}.pem"
        path.write_text(f"-----BEGIN {'PRIVATE KEY' if 'key' in name else 'CERTIFICATE'}-----\n")
        files[name] = str(path)
    return files


def test_etcdctl_endpoints_apply_only_to_an_empty_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", "https://e1:2379,https://e2:2379")
    assert parse_rdzv_config(_params("")).client.endpoints == "https://e1:2379,https://e2:2379"
    assert parse_rdzv_config(_params("  ")).client.endpoints == "https://e1:2379,https://e2:2379"
    assert parse_rdzv_config(_params("h:1")).client.endpoints == "h:1"  # never merged
    assert connect_options(_cli()).client.endpoints == "https://e1:2379,https://e2:2379"
    assert connect_options(_cli("--endpoints", "x:1")).client.endpoints == "x:1"
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", " ")
    assert parse_rdzv_config(_params("")).client.endpoints == "localhost:2379"
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", "ftp://e1:2379")
    with pytest.raises(ValueError, match=r"\$ETCDCTL_ENDPOINTS: .*'ftp://e1:2379'.*scheme"):
        parse_rdzv_config(_params(""))
    parse_rdzv_config(_params("h:1"))  # an overridden bad variable is never an error
    with pytest.raises(CliError, match="ETCDCTL_ENDPOINTS"):
        connect_options(_cli())


def test_tls_files_from_etcdctl_below_the_keys(monkeypatch: pytest.MonkeyPatch, pem: dict[str, str]) -> None:
    monkeypatch.setenv("ETCDCTL_CACERT", pem["ca"])
    monkeypatch.setenv("ETCDCTL_CERT", pem["cert"])
    monkeypatch.setenv("ETCDCTL_KEY", pem["key"])
    client = parse_rdzv_config(_params("h:1")).client  # applies with an explicit endpoint too
    assert (client.ca_cert, client.cert, client.key) == (pem["ca"], pem["cert"], pem["key"])
    opts = connect_options(_cli()).client
    assert (opts.ca_cert, opts.cert, opts.key) == (pem["ca"], pem["cert"], pem["key"])
    # the keys win; the certificate and key are one pair: a key given alone never meets ETCDCTL_CERT
    client = parse_rdzv_config(_params(ca_cert=pem["ca2"], ssl_cert=pem["cert2"], ssl_cert_key=pem["key2"])).client
    assert (client.ca_cert, client.cert, client.key) == (pem["ca2"], pem["cert2"], pem["key2"])
    with pytest.raises(ValueError, match="'ssl_cert_key' was given without 'ssl_cert'"):
        parse_rdzv_config(_params(ssl_cert_key=pem["key2"]))
    opts = connect_options(_cli("--cacert", pem["ca2"], "--cert", pem["cert2"], "--key", pem["key2"])).client
    assert (opts.ca_cert, opts.cert, opts.key) == (pem["ca2"], pem["cert2"], pem["key2"])


def test_bad_etcdctl_tls_variables_are_named(monkeypatch: pytest.MonkeyPatch, pem: dict[str, str]) -> None:
    monkeypatch.setenv("ETCDCTL_CACERT", "/nonexistent/ca.pem")
    with pytest.raises(ValueError, match=r"\$ETCDCTL_CACERT names '/nonexistent/ca.pem'"):
        parse_rdzv_config(_params())
    with pytest.raises(CliError, match=r"\$ETCDCTL_CACERT"):
        connect_options(_cli())
    assert parse_rdzv_config(_params(ca_cert=pem["ca"])).client.ca_cert == pem["ca"]
    monkeypatch.delenv("ETCDCTL_CACERT")
    monkeypatch.setenv("ETCDCTL_CERT", pem["cert"])
    with pytest.raises(ValueError, match=r"\$ETCDCTL_CERT is set but \$ETCDCTL_KEY is not"):
        parse_rdzv_config(_params())
    monkeypatch.delenv("ETCDCTL_CERT")
    monkeypatch.setenv("ETCDCTL_KEY", pem["key"])
    with pytest.raises(CliError, match=r"\$ETCDCTL_KEY is set but \$ETCDCTL_CERT is not"):
        connect_options(_cli())


def test_etcdctl_user_name_colon_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCDCTL_USER", "alice:pa:ss")  # split at the first ':', as etcdctl does
    client = parse_rdzv_config(_params()).client
    assert (client.user, client.password) == ("alice", "pa:ss")
    assert "pa:ss" not in repr(client)
    opts = connect_options(_cli()).client
    assert (opts.user, opts.password) == ("alice", "pa:ss")
    monkeypatch.setenv("ETCDCTL_PASSWORD", "pw2")  # with ETCDCTL_PASSWORD the user is taken whole
    client = parse_rdzv_config(_params()).client
    assert (client.user, client.password) == ("alice:pa:ss", "pw2")


def test_our_credentials_win_and_are_never_mixed_with_etcdctl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ETCDCTL_USER", "carol:c-pw")
    monkeypatch.setenv(USER_ENV, "bob")
    monkeypatch.setenv(PASSWORD_ENV, "b-pw")
    assert (parse_rdzv_config(_params()).client.user, connect_options(_cli()).client.user) == ("bob", "bob")
    client = parse_rdzv_config(_params(user="dave", password="d-pw")).client
    assert (client.user, client.password) == ("dave", "d-pw")
    monkeypatch.delenv(PASSWORD_ENV)  # our user without our password: an error, not carol's password
    with pytest.raises(ValueError, match="'bob' was given without a password"):
        parse_rdzv_config(_params())
    with pytest.raises(CliError, match="ETCD_RDZV_USER is set"):
        connect_options(_cli())
    secret = tmp_path / "pw"
    secret.write_text("file-pw\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))  # the CLI reads the password file too
    opts = connect_options(_cli()).client
    assert (opts.user, opts.password) == ("bob", "file-pw")


def test_bad_etcdctl_credentials_are_named_without_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCDCTL_USER", "alice")
    with pytest.raises(ValueError, match=r"\$ETCDCTL_USER names the etcd user 'alice' without a password"):
        parse_rdzv_config(_params())
    with pytest.raises(CliError, match="name:password"):
        connect_options(_cli())
    monkeypatch.setenv("ETCDCTL_USER", ":s3cret-x")
    with pytest.raises(ValueError, match="empty user name") as err:
        parse_rdzv_config(_params())
    assert "s3cret-x" not in str(err.value)
    monkeypatch.delenv("ETCDCTL_USER")
    monkeypatch.setenv("ETCDCTL_PASSWORD", "s3cret-x")
    with pytest.raises(ValueError, match=r"\$ETCDCTL_PASSWORD is set but \$ETCDCTL_USER is not") as err:
        parse_rdzv_config(_params())
    assert "s3cret-x" not in str(err.value)


def test_use_is_logged_once_by_name_never_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, pem: dict[str, str]
) -> None:
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", "e1:2379")
    monkeypatch.setenv("ETCDCTL_CACERT", pem["ca"])
    monkeypatch.setenv("ETCDCTL_USER", "alice:s3cret-y")
    with caplog.at_level(logging.DEBUG):
        parse_rdzv_config(_params())
        parse_rdzv_config(_params())
        connect_options(_cli())  # the same set of names: not logged again
    lines = [r.getMessage() for r in caplog.records if "ETCDCTL" in r.getMessage()]
    assert lines == ["etcd-rdzv: using etcdctl's environment variables $ETCDCTL_CACERT, $ETCDCTL_ENDPOINTS, "
                     "$ETCDCTL_USER"]
    assert "s3cret-y" not in caplog.text
    with caplog.at_level(logging.INFO):
        parse_rdzv_config(_params("h:1"))  # another set (no endpoint taken): logged once
    assert sum("ETCDCTL" in r.getMessage() for r in caplog.records) == 2
