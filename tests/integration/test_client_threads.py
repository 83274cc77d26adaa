"""Threads of the client's streams: none per stream, none left behind by a reconnect or by ``close()``
(issue 21, item 7; issue 24: a client's fixed cost).

A watch's stream runs over a forwarder whose connections the test cuts (tests/helpers/cut_proxy.py);
each cut makes the watch reconnect and resume. Before issue 21's fix every reconnect left one gRPC
thread behind, and those threads outlived ``client.close()``. Since issue 24 every stream of the
process runs on one event loop (etcd_store/client/reactor.py): the loop's thread and gRPC's poller
exist once per process, and a client's watch and keep-alive streams add no thread at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from helpers.cut_proxy import THREAD_PREFIX, CutProxy

from etcd_store.client import EtcdClient

RECONNECTS = 6


def _threads() -> int:
    """Live threads of this process, the forwarder's own left out."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith(THREAD_PREFIX))


def _settles(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate`` holds within ``timeout`` (threads end a moment after their stream)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling the thread list
    return True


def test_stream_reconnects_and_close_leave_no_threads(etcd_endpoint: str) -> None:
    host, port = etcd_endpoint.rsplit(":", 1)
    prefix = f"/test-threads/{time.monotonic_ns()}/".encode()
    with CutProxy((host, int(port))) as proxy, EtcdClient(etcd_endpoint, timeout=10) as writer:
        writer.put(prefix + b"warm", b"")  # the writer's channel exists before counting
        with writer.watch(prefix + b"warm") as warm:  # the process's stream loop exists before counting
            assert warm.wait_created(10)
        before = _threads()
        client = EtcdClient(proxy.endpoint, timeout=10)
        try:
            watch = client.watch(prefix, prefix=True)
            session = client.session(2)  # its keep-alive stream (refreshes every 0.67 s) rides the same cuts
            assert watch.wait_created(10)
            writer.put(prefix + b"0", b"0")
            assert [e.kv.key for e in watch.get(timeout=10)] == [prefix + b"0"]
            _settles(lambda: session._mux.streams_opened >= 1, 2.0)
            one_stream = _threads()
            assert one_stream == before, (
                f"a watch and a keep-alive stream hold {one_stream - before} threads: "
                f"{[t.name for t in threading.enumerate() if not t.name.startswith(THREAD_PREFIX)]}"
            )
            counts = []
            for i in range(1, RECONNECTS + 1):
                assert proxy.cut() > 0
                writer.put(prefix + str(i).encode(), b"")
                # The watch resumes after the cut and delivers the write made meanwhile.
                assert [e.kv.key for e in watch.get(timeout=10)] == [prefix + str(i).encode()]
                _settles(lambda: _threads() <= one_stream, 2.0)
                counts.append(_threads())
            assert proxy.accepted >= RECONNECTS + 1
            assert session._mux.streams_opened > 1 and not session.lost.is_set()
            assert max(counts) <= one_stream, (
                f"threads after each of {RECONNECTS} reconnects: {counts}; with one stream: {one_stream}"
            )
        finally:
            client.close()  # the watch is not cancelled: close() alone must end its threads
        assert _settles(lambda: _threads() <= before, 5.0), (
            f"{_threads() - before} threads outlive client.close(): "
            f"{[t.name for t in threading.enumerate() if not t.name.startswith(THREAD_PREFIX)]}"
        )
        assert watch.cancelled is False and session.done().is_set()
