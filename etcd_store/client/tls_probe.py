"""Whether a TLS endpoint fails its handshake: asked of the standard library, not read from error text.

gRPC reports a failed TLS handshake, a refused connection and an unknown host all as
UNAVAILABLE, told apart only by free text (which also holds the host name: a DNS failure for
a host named ``etcd-tls-0`` reads like a TLS failure). When an attempt on an ``https``
endpoint fails that way, :func:`tls_failure` repeats the connection with :mod:`socket` and
:mod:`ssl`, with the client's own CA, certificate and key, and says which step failed by the
exception it raised: no address or no connection (``OSError`` from ``getaddrinfo`` or
``connect``): not TLS; an :class:`ssl.SSLError` in the handshake, or as the server's answer to
the HTTP/2 preface (a TLS 1.3 server rejects a missing client certificate only after the
handshake): TLS.

Cost and blocking: one DNS lookup, one TCP connection and one handshake, only after a failed
attempt on an ``https`` endpoint; bounded by ``timeout`` (the lookup runs in a daemon thread,
since ``getaddrinfo`` takes no timeout).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["tls_failure"]

# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server answers with its
# own SETTINGS frame, a server that refused our certificate with a TLS alert.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context


def _resolve(host: str, port: int, timeout: float) -> list[tuple[socket.AddressFamily, tuple[Any, ...]]]:
    """The addresses of ``host``; ``[]`` when it has none or the lookup outlasts ``timeout``."""
    found: list[tuple[socket.AddressFamily, tuple[Any, ...]]] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found.extend((family, tuple(sockaddr[:2])) for family, _, _, _, sockaddr in infos)
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=lookup, name="etcd-tls-probe-dns", daemon=True).start()
    return list(found) if done.wait(timeout) else []


def tls_failure(
    host: str, port: int, *, ca: str | None, cert: str | None, key: str | None, timeout: float
) -> str | None:
    """Why a TLS connection to ``host:port`` fails in the handshake, or None when it does not
    (it succeeds, or fails before TLS: unknown host, refused, unreachable, timed out).

    Never raises; blocks at most about ``timeout`` seconds (twice for a host with several addresses
    that each time out: the first address that connects decides).
    """
    try:
        context = _context(ca, cert, key)
    except (OSError, ssl.SSLError) as e:  # unreadable or mismatched files: the channel fails the same way
        return f"cannot load the TLS files: {e}"
    for family, address in _resolve(host, port, timeout)[:2]:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError:
            sock.close()
            continue
        try:
            with context.wrap_socket(sock, server_hostname=host) as tls:
                tls.sendall(_H2_PREFACE)
                tls.recv(1)
            return None
        except ssl.SSLCertVerificationError as e:
            return f"certificate verification failed: {e.verify_message}"
        except ssl.SSLError as e:
            return f"TLS failed: {e.reason or e}"
        except OSError as e:  # reset or timed out after connecting: not a TLS verdict
            log.debug("TLS probe of %s:%d: %s", host, port, e)
            return None
        finally:
            sock.close()
    return None
