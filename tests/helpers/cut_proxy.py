"""A loopback TCP forwarder whose connections a test can cut at will (stdlib only).

``CutProxy(("127.0.0.1", port))`` listens on a free loopback port (:attr:`CutProxy.endpoint`)
and forwards every connection to the target. :meth:`CutProxy.cut` closes every connection it
carries now (both sides see the connection end, as after a member restart or a broken link)
while it goes on accepting new ones, so a client reconnects at once. :meth:`CutProxy.block`
is a partition instead: nothing is forwarded (data waits, as in the kernel's buffers during a
partition; a new connection is accepted but not carried on) until :meth:`CutProxy.unblock`, when
everything held is delivered, as after a partition heals. Its threads are named ``cutproxy-...``
(tests that count threads leave them out). :meth:`CutProxy.close` stops it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["CutProxy", "THREAD_PREFIX"]

THREAD_PREFIX = "cutproxy-"


class CutProxy:
    """See the module docstring. A context manager; :meth:`close` is idempotent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._open = threading.Event()
        self._open.set()
        self.accepted = 0
        threading.Thread(target=self._accept, name=f"{THREAD_PREFIX}accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._carry, args=(down,), name=f"{THREAD_PREFIX}carry", daemon=True).start()

    def _carry(self, down: socket.socket) -> None:
        with self._lock:
            self._conns.add(down)
        self._open.wait()  # blocked: the connection is accepted, not carried on
        try:
            up = socket.create_connection(self._target, timeout=5)
        except OSError:
            self._drop(down)
            return
        up.settimeout(None)
        with self._lock:
            self._conns.update((down, up))
            self.accepted += 1
        for src, dst in ((down, up), (up, down)):
            threading.Thread(target=self._pump, args=(src, dst), name=f"{THREAD_PREFIX}pump",
                             daemon=True).start()  # fmt: skip

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._open.wait()  # blocked: held until unblock()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._conns.discard(s)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> int:
        """Close every connection carried now; how many sockets were closed."""
        with self._lock:
            conns = list(self._conns)
        self._drop(*conns)
        return len(conns)

    def block(self) -> None:
        """Partition: forward nothing from now on until :meth:`unblock` (connections stay open)."""
        self._open.clear()

    def unblock(self) -> None:
        """Heal the partition: deliver what was held and forward again."""
        self._open.set()

    def close(self) -> None:
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.cut()

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
