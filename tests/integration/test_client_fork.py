"""A process forked from one whose etcd streams ran: told at once that it cannot run streams.

Every watch and keep-alive stream of a process runs on one asyncio loop over ``grpc.aio``
(etcd_store/client/reactor.py), and gRPC's asyncio API does not survive a ``fork``: in the
child its poller thread is gone, so a watch would wait forever for etcd's confirmation. The
child is told so by an :class:`EtcdError` naming the way out (``spawn``), and the parent's
streams go on. The child makes no gRPC call here (gRPC does not support one after a fork
without its fork support either); it only asks for the stream loop, as a new watch would.
"""

from __future__ import annotations

import os
import time

from etcd_store.client import EtcdClient
from etcd_store.client.reactor import reactor
from etcd_store.errors import EtcdError


def _child_says() -> str:
    """In the forked child: what asking for the stream loop gives."""
    try:
        reactor()
    except EtcdError as e:
        return f"EtcdError: {e}"
    return "no error"


def test_a_forked_child_is_told_it_cannot_run_streams_and_the_parent_streams_on(etcd_endpoint: str) -> None:
    key = f"/test-fork/{time.monotonic_ns()}".encode()
    with EtcdClient(etcd_endpoint, timeout=10) as client, client.watch(key) as watch:
        assert watch.wait_created(10)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report through the pipe, never return into pytest
            try:
                os.close(read_end)
                os.write(write_end, _child_says().encode())
            finally:
                os._exit(0)
        os.close(write_end)
        try:
            with os.fdopen(read_end, "rb") as f:
                said = f.read().decode()
        finally:
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert said.startswith("EtcdError: ") and "forked" in said and "'spawn'" in said, said
        client.put(key, b"after the fork")
        assert [e.kv.value for e in watch.get(timeout=10)] == [b"after the fork"]
