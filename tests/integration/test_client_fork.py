"""A process forked from one whose etcd streams ran: told at once that it cannot run streams.

Every watch and keep-alive stream of a process runs on one asyncio loop over ``grpc.aio``
(etcd_store/client/reactor.py), and gRPC's asyncio API does not survive a ``fork``: in the
child its poller thread is gone, so a watch would wait forever for etcd's confirmation. The
child is told so by an :class:`EtcdError` naming the way out (``spawn``), and the parent's
streams go on. The child makes no gRPC call here (gRPC does not support one after a fork
without its fork support either); it only asks for the stream loop, as a new watch would.

Each scenario runs in a fresh interpreter with ``GRPC_ENABLE_FORK_SUPPORT=0``: with gRPC's fork
handlers on (its default), a child forked while the stream loop's threads are in gRPC crashes
with SIGSEGV in CPython's ``threading._after_fork`` about one fork in 13 (3 of 40 measured with
grpcio 1.85, 0 of 40 with the variable set to 0): gRPC's doing, before any code of ours runs in
the child (docs/operations.md, the failure table).
"""


from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCENARIO = textwrap.dedent("""
    import json, os, sys, time
    from etcd_store.client import EtcdClient
    from etcd_store.client.reactor import reactor
    from etcd_store.errors import EtcdError

    def in_child(action):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                try:
                    said = action()
                except Exception as e:
                    said = f"{type(e).__name__}: {e}"
                os.write(write_end, said.encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as f:
            said = f.read().decode()
        _, status = os.waitpid(pid, 0)
        return said, os.waitstatus_to_exitcode(status)

    def asks_for_the_loop():
        try:
            reactor()
        except EtcdError as e:
            return f"EtcdError: {e}"
        return "no error"

    out = {}
    key = f"/test-fork/{time.monotonic_ns()}".encode()
    with EtcdClient(sys.argv[1], timeout=10) as client, client.watch(key) as watch:
        assert watch.wait_created(10)
        out["told"] = in_child(asks_for_the_loop)
        client.put(key, b"after the fork")
        out["parent_watch"] = [e.kv.value.decode() for e in watch.get(timeout=10)]
        session = client.session(3)
        deadline = time.monotonic() + 5
        while len(session.renewed_at()) < 2 and time.monotonic() < deadline:  # a renewal: the stream ran
            time.sleep(0.1)
        def closes():
            session.close()  # what an atexit or a `with` does in the child
            client.close()
            return "closed"
        out["closed"] = in_child(closes)
        after = time.monotonic()
        deadline = after + 5
        while max(session.renewed_at()) <= after and time.monotonic() < deadline:
            time.sleep(0.1)
        out["renewed_after"] = max(session.renewed_at()) > after and not session.done().is_set()
        out["alive"] = client.lease_time_to_live(session.id) > 0
        session.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def scenario(etcd_endpoint: str) -> dict[str, object]:
    env = dict(os.environ, GRPC_ENABLE_FORK_SUPPORT="0")
    done = subprocess.run([sys.executable, "-c", _SCENARIO, etcd_endpoint], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_forked_child_is_told_it_cannot_run_streams_and_the_parent_streams_on(scenario: dict) -> None:
    said, code = scenario["told"]
    assert code == 0
    assert said.startswith("EtcdError: ") and "forked" in said and "'spawn'" in said, said
    assert scenario["parent_watch"] == ["after the fork"]


def test_a_forked_child_closes_an_inherited_client_without_touching_the_parents_lease(scenario: dict) -> None:
    """Closing in the child raised (the keep-alives asked for the stream loop, refused there) and left
    the client half-closed; it now closes cleanly and revokes nothing: the lease is the parent's."""
    said, code = scenario["closed"]
    assert code == 0 and said == "closed", said
    assert scenario["renewed_after"] and scenario["alive"]
