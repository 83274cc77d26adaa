"""Make throw-away TLS certificates for tests with the ``openssl`` command.

``make_certs(directory)`` writes a CA, a server certificate for
``127.0.0.1``/``localhost`` (serverAuth + clientAuth, which etcd's JSON
gateway needs when it dials itself under ``--client-cert-auth``), a client
certificate, and a second unrelated CA for "wrong CA" tests. EC P-256 keys,
so generation takes milliseconds. Nothing here imports pytest.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """PEM files written by :func:`make_certs`."""

    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def have_openssl() -> bool:
    """True if the ``openssl`` command is on PATH."""
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    proc = subprocess.run(
        ["openssl", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stdout.decode(errors='replace')}")


def _make_ca(directory: str, name: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem")
    _openssl(
        "req", "-x509", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def _make_leaf(directory: str, name: str, ca: str, ca_key: str, extensions: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem")
    csr, ext = os.path.join(directory, f"{name}.csr"), os.path.join(directory, f"{name}.ext")
    with open(ext, "w") as f:
        f.write(extensions)
    _openssl(
        "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return cert, key


def make_certs(directory: str | os.PathLike[str]) -> CertPaths:
    """Write a CA, server and client certificates (and an unrelated CA) into ``directory``.

    Blocks for the few ``openssl`` runs. Raises RuntimeError if one fails.
    """
    d = os.fspath(directory)
    os.makedirs(d, exist_ok=True)
    ca, ca_key = _make_ca(d, "ca")
    other_ca, _ = _make_ca(d, "other-ca")
    server_cert, server_key = _make_leaf(
        d,
        "server",
        ca,
        ca_key,
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    client_cert, client_key = _make_leaf(
        d,
        "client",
        ca,
        ca_key,
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )
    return CertPaths(ca, ca_key, server_cert, server_key, client_cert, client_key, other_ca)
