"""The run as the trust boundary (issue 23): ``etcd-rdzv grant`` makes a user that can run everything of
one run, and nothing of another.

Against a real etcd with auth on (``AuthConfig``: root only), ``etcd-rdzv grant`` (run in-process with the
root credentials in the environment, as an operator runs it) creates the users of ``job1`` and ``job10``
(a run id that ``job1`` is a prefix of). As ``job1``'s user: a rendezvous of each backend (real handlers of
``etcd-v3`` and ``etcd-v2`` in threads), the ``EtcdStore`` (every kind of operation, chunked values, a nested
namespace, its lease), and every CLI command on the run (``list``, ``show``, ``watch``, ``close``, ``gc``).
``job10``'s user can neither read nor write ``job1``'s keys, nor ``job1``'s its (``EtcdPermissionDenied``,
the CLI's exit 2). Then ``revoke`` removes the user and role. ``grant`` does not take over another run's
user (issue 32), and ``revoke`` of a shared user leaves the other run alone.

Plain ``http`` on loopback with ``--allow-insecure-auth``: TLS is not what is checked here
(test_store_security.py, test_client_security.py do TLS with auth).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import REPO_ROOT
from helpers.handlers import shut_down_all
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from etcd_rdzv.cli import main
from etcd_rdzv.native.records import RunKeys
from etcd_rdzv.plugin import create_etcd_v2_rdzv_handler, create_etcd_v3_rdzv_handler
from etcd_server import AuthConfig, EtcdServer
from etcd_store import EtcdStore
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdAuthError, EtcdPermissionDenied

pytestmark = pytest.mark.timeout(180)

ROOT_PW = "r00t-grant-pw"
PREFIX = "/torch/elastic/rendezvous"
WAIT = 30.0
CONF = {
    "etcd-v3": {"join_timeout": "60", "last_call_timeout": "0.3", "close_timeout": "5", "heartbeat": "3",
                "read_timeout": "10"},
    "etcd-v2": {"join_timeout": "60", "last_call_timeout": "0.3", "close_timeout": "5", "heartbeat_timeout": "5",
                "keep_alive_interval": "1", "keep_alive_max_attempt": "4", "read_timeout": "5"},
}


class Etcd:
    """One etcd with auth on, and the CLI pointed at it as root or as a run's user."""

    def __init__(self, server: EtcdServer, tmp: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> None:
        self.server, self.tmp, self.monkeypatch, self.capsys = server, tmp, monkeypatch, capsys
        self.endpoint = server.get_endpoint()
        self.passwords = {"root": ROOT_PW}

    def password_file(self, user: str) -> str:
        path = self.tmp / f"{user}.pw"
        path.write_text(self.passwords[user] + "\n")
        return str(path)

    def cli(self, user: str, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
        """``etcd-rdzv ARGS`` in-process as ``user`` (credentials in the environment only)."""
        self.monkeypatch.setenv("ETCD_RDZV_USER", user)
        self.monkeypatch.setenv("ETCD_RDZV_PASSWORD", self.passwords[user])
        if stdin is not None:
            self.monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        self.capsys.readouterr()
        rc = main(["--endpoints", self.endpoint, "--allow-insecure-auth", "--timeout", "10", *args])
        out, err = self.capsys.readouterr()
        return rc, out, err

    def ok(self, user: str, *args: str, stdin: str | None = None) -> str:
        rc, out, err = self.cli(user, *args, stdin=stdin)
        assert rc == 0, (args, err)
        return out

    def denied(self, user: str, *args: str) -> str:
        rc, out, err = self.cli(user, *args)
        assert rc == 2 and out == "" and err.count("\n") == 1, (args, rc, out, err)
        assert "permission denied" in err, (args, err)
        return err

    def client(self, user: str) -> EtcdClient:
        return EtcdClient(self.endpoint, user=user, password=self.passwords[user], timeout=10,
                          allow_insecure_auth=True)

    def watcher(self, user: str, *args: str) -> subprocess.Popen[str]:
        """``etcd-rdzv watch ...`` as a process (it streams until its ``--count``); :func:`started`
        waits for it to watch."""
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "ETCD_RDZV_USER": user, "ETCD_RDZV_PASSWORD": self.passwords[user]}
        return subprocess.Popen(
            [sys.executable, "-m", "etcd_rdzv", "--endpoints", self.endpoint, "--allow-insecure-auth",
             "watch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)


def started(proc: subprocess.Popen[str]) -> None:
    """Read ``watch``'s stderr up to its start line (after the plain-text password warning)."""
    assert proc.stderr is not None
    lines: list[str] = []
    while not (lines and lines[-1].startswith("etcd-rdzv: watching")):
        lines.append(proc.stderr.readline())
        if not lines[-1]:
            raise AssertionError("".join(lines) + proc.stderr.read())


@pytest.fixture
def etcd(etcd_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> Iterator[Etcd]:
    server = EtcdServer(binary=etcd_binary, auth=AuthConfig(ROOT_PW))
    server.start(timeout=30)
    try:
        yield Etcd(server, tmp_path, monkeypatch, capsys)
    finally:
        # Not graceful: the etcd-v2 handlers' run stores keep their lease streams open until the
        # process exits (torch's handler never closes its store), which etcd would wait 5 s for.
        server.stop(graceful=False)


def grant_two_runs(etcd: Etcd) -> None:
    """``grant job1`` (password from a file) and ``grant job10`` (from stdin), as root."""
    etcd.passwords |= {"rdzv-job1": "j0b1-pw", "rdzv-job10": "j0b10-pw"}
    out = etcd.ok("root", "grant", "job1", "--password-file", etcd.password_file("rdzv-job1"))
    assert out.splitlines() == [
        "role rdzv-job1: created",
        f"role rdzv-job1: granted READWRITE b'{PREFIX}/job1'",
        f"role rdzv-job1: granted READWRITE [b'{PREFIX}/job1/', b'{PREFIX}/job10')",
        "user rdzv-job1: created",
        "user rdzv-job1: granted role rdzv-job1",
    ]
    assert "j0b1-pw" not in out
    etcd.ok("root", "grant", "job10", "--password-file", "-", stdin="j0b10-pw\n")
    again = etcd.ok("root", "grant", "job1")  # idempotent; the password stays
    assert [line.split(":")[1].split()[0] for line in again.splitlines()] == ["has", "has", "has"]
    rc, _, err = etcd.cli("root", "grant", "job2")  # a new user needs a password
    assert rc == 2 and "--password-file" in err


def assert_cannot_touch(client: EtcdClient, keys: list[bytes]) -> None:
    """Every read, write, delete and watch of ``keys`` is denied."""
    for key in keys:
        with pytest.raises(EtcdPermissionDenied):
            client.get(key)
        with pytest.raises(EtcdPermissionDenied):
            client.put(key, b"x")
        with pytest.raises(EtcdPermissionDenied):
            client.delete(key)
        with pytest.raises(EtcdPermissionDenied):
            client.range(key, prefix=True, count_only=True)
    for key in keys[:2]:
        with client.watch(key, prefix=True) as watch, pytest.raises(EtcdPermissionDenied):
            watch.get(timeout=WAIT)


class Job:
    """Rendezvous handlers of run ``job1`` as its user, in threads."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.handlers: list[RendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=8)

    def handler(self, backend: str) -> RendezvousHandler:
        params = RendezvousParameters(
            backend=backend, endpoint=self.etcd.endpoint, run_id="job1", min_nodes=2, max_nodes=2,
            local_addr="127.0.0.1", user="rdzv-job1", password_file=self.etcd.password_file("rdzv-job1"),
            allow_insecure_auth="1", **CONF[backend])
        create = create_etcd_v3_rdzv_handler if backend == "etcd-v3" else create_etcd_v2_rdzv_handler
        h = create(params)
        self.handlers.append(h)
        return h

    def rendezvous(self, backend: str) -> list[RendezvousHandler]:
        pair = [self.handler(backend), self.handler(backend)]
        infos = [f.result(timeout=WAIT) for f in [self.pool.submit(h.next_rendezvous) for h in pair]]
        assert sorted(i.rank for i in infos) == [0, 1]
        store = infos[0].store  # the round's store, written through the user's role
        store.set("from-rank", "x")
        assert infos[1].store.get("from-rank") == b"x"
        return pair

    def close(self) -> None:
        shut_down_all(self.handlers, self.pool)


def use_the_store(client: EtcdClient) -> None:
    """Every kind of store operation, chunked values and a nested namespace, under the run's prefix."""
    timeout = timedelta(seconds=10)
    with EtcdStore(client, prefix=f"{PREFIX}/job1/app", timeout=timeout, chunk_bytes=1024) as store:
        store.set("k", "v")
        assert store.get("k") == b"v" and store.check(["k"])
        assert store.add("n", 2) == 2 and store.add("n", 1) == 3
        assert store.compare_set("k", "v", "w") == b"w"
        store.multi_set(["a", "b"], ["1", "2"])
        assert store.multi_get(["a", "b"]) == [b"1", b"2"]
        store.append("a", "+")
        store.queue_push("q", "item")
        assert store.queue_len("q") == 1 and store.queue_pop("q") == b"item"
        big = bytes(range(256)) * 20  # 5 chunks
        store.set("big", big)
        assert store.get("big") == big
        with EtcdStore(client, prefix=f"{PREFIX}/job1/app/sub", timeout=timeout) as nested:
            nested.set("inner", "1")
            assert store.get("sub/inner") == b"1"
            nested.wait(["inner"])
        store.clone().set("late", "x")
        store.wait(["late"])
        store.barrier("done", 1)
        assert store.delete_key("late")
        assert sorted(store.list_keys()) == ["a", "b", "big", "done", "k", "n", "sub/inner"]


@pytest.mark.etcd_matrix("3.6")
def test_a_granted_user_runs_everything_of_its_run_and_nothing_of_another(etcd: Etcd) -> None:
    grant_two_runs(etcd)
    job = Job(etcd)
    watchers: list[subprocess.Popen[str]] = []
    try:
        job.rendezvous("etcd-v3")
        job.rendezvous("etcd-v2")
        # Watchers of both backends' records as the run's user (they start while the rest runs).
        watchers = [etcd.watcher("rdzv-job1", "job1", "--backend", b, "--count", "1", "--json")
                    for b in ("etcd-v3", "etcd-v2")]
        with etcd.client("rdzv-job1") as mine:
            use_the_store(mine)

            # The CLI as the run's user: list and gc name the run (a scan of the prefix is denied).
            rows = json.loads(etcd.ok("rdzv-job1", "list", "job1", "--json"))["runs"]
            assert sorted((r["backend"], r["world_size"], r["closed"]) for r in rows) == [
                ("etcd-v2", 2, False), ("etcd-v3", 2, False)]
            assert "etcd-rdzv list RUN_ID" in etcd.denied("rdzv-job1", "list")
            for backend in ("etcd-v2", "etcd-v3"):
                shown = json.loads(etcd.ok("rdzv-job1", "show", "job1", "--backend", backend, "--json"))
                assert shown["world_size"] == 2 and shown["store_keys"] >= 1
                ttls = [m["lease_ttl_s"] for m in shown["members"]]  # etcd-v3: LeaseTimeToLive
                assert all(t is None if backend == "etcd-v2" else t > 0 for t in ttls), ttls

            # Another job's user: nothing of job1, through the client, the store and the CLI.
            with etcd.client("rdzv-job10") as other:
                keys = RunKeys.for_run(PREFIX, "job1")
                assert_cannot_touch(other, [f"{PREFIX}/job1".encode(), keys.sealed, keys.run,
                                            f"{PREFIX}/job1/store/".encode(), f"{PREFIX}/job1/app/k".encode()])
                with pytest.raises(dist.DistStoreError, match="permission denied"):
                    EtcdStore(other, prefix=f"{PREFIX}/job1/store")
                other.put(f"{PREFIX}/job10/mine".encode(), b"1")  # its own run: allowed
            for args in (["show", "job1", "--backend", "etcd-v3"], ["show", "job1", "--backend", "etcd-v2"],
                         ["list", "job1"], ["close", "job1", "--backend", "etcd-v3"],
                         ["gc", "job1", "--grace", "0"], ["watch", "job1", "--backend", "etcd-v3"]):
                etcd.denied("rdzv-job10", *args)
            # ... nor job1's user anything of job10, or next to its run's keys.
            assert_cannot_touch(mine, [f"{PREFIX}/job10".encode(), f"{PREFIX}/job10/mine".encode(),
                                       f"{PREFIX}/job1\0x".encode(), f"{PREFIX}/job1x".encode()])

            # close as the run's user: the watchers see it, the agents stop.
            for proc in watchers:
                started(proc)
            assert etcd.ok("rdzv-job1", "close", "job1", "--backend", "etcd-v3").strip() == (
                "closed etcd-v3 run job1")
            assert etcd.ok("rdzv-job1", "close", "job1", "--backend", "etcd-v2").strip() == (
                "closed etcd-v2 run job1")
            events = []
            for proc in watchers:
                out, err = proc.communicate(timeout=WAIT)
                assert proc.returncode == 0, err
                events.append(json.loads(out)["event"])
            assert events[0] in ("close", "abort") and events[1] == "close", events
            for agent in (job.handlers[0], job.handlers[-1]):  # an agent of each backend
                with pytest.raises(RendezvousClosedError):
                    job.pool.submit(agent.next_rendezvous).result(timeout=WAIT)
            job.close()

            removed = json.loads(etcd.ok("rdzv-job1", "gc", "job1", "--grace", "0", "--json"))["removed"]
            assert sorted(r["backend"] for r in removed) == ["etcd-v2", "etcd-v3"]
            assert json.loads(etcd.ok("rdzv-job1", "list", "job1", "--json")) == {"runs": []}
    finally:
        for proc in watchers:
            proc.kill()
            proc.communicate()
        job.close()

    out = etcd.ok("root", "revoke", "job1")
    assert out.splitlines() == ["user rdzv-job1: role rdzv-job1 taken", "role rdzv-job1: deleted",
                                "user rdzv-job1: deleted"]
    with etcd.client("rdzv-job1") as gone, pytest.raises(EtcdAuthError):
        gone.get(f"{PREFIX}/job1".encode())
    assert etcd.ok("root", "revoke", "job1").startswith("nothing to revoke for run job1")


def test_grant_refuses_what_it_cannot_do_cleanly(etcd: Etcd) -> None:
    """A role holding other permissions, root, a bad run id, a non-root operator: one line, exit 2,
    nothing changed."""
    etcd.passwords["rdzv-job1"] = "j0b1-pw"
    pw = etcd.password_file("rdzv-job1")
    with etcd.client("root") as root:
        from etcd_store.client.auth_admin import Permission, role_add, role_grant, role_names

        role_add(root, "wide")
        role_grant(root, "wide", Permission(f"{PREFIX}/".encode(), f"{PREFIX}0".encode()))
        for args, message in ((["grant", "job1", "--role", "wide", "--password-file", pw], "outside run 'job1'"),
                              (["revoke", "job1", "--role", "wide"], "not deleting it"),
                              (["grant", "job1", "--user", "root", "--password-file", pw], "'root'"),
                              (["grant", "a/b", "--password-file", pw], "invalid run id")):
            rc, out, err = etcd.cli("root", *args)
            assert (rc, out) == (2, "") and message in err and err.count("\n") == 1, (args, err)
        assert sorted(role_names(root)) == ["root", "wide"]
    etcd.ok("root", "grant", "job1", "--password-file", pw)
    rc, _, err = etcd.cli("rdzv-job1", "grant", "job10", "--password-file", pw)
    assert rc == 2 and "permission denied" in err and "j0b1-pw" not in err


def auth_state(root: EtcdClient) -> dict[str, object]:
    """Every user with its roles and every role with its permissions."""
    from etcd_store.client.auth_admin import role_names, role_permissions, user_names, user_roles

    return {"users": {u: sorted(user_roles(root, u)) for u in user_names(root)},
            "roles": {r: sorted(role_permissions(root, r)) for r in role_names(root)}}


def can_read(etcd: Etcd, user: str, password: str, key: str) -> bool:
    """Whether ``user`` logs in with ``password`` and may read ``key`` (False: the password or the key is refused)."""
    with EtcdClient(etcd.endpoint, user=user, password=password, timeout=10, allow_insecure_auth=True) as c:
        try:
            c.get(key.encode())
        except (EtcdAuthError, EtcdPermissionDenied):
            return False
        return True


@pytest.mark.etcd_matrix("3.6")
def test_grant_does_not_take_over_another_runs_user(etcd: Etcd) -> None:
    """Issue 32, item 4: ``grant jobB --user rdzv-jobA`` changed job A's password (its agents were then
    refused) and gave job A's user job B's role, without a word. It is refused (one line naming the user and
    job A's role, exit 2, nothing changed) unless ``--allow-shared-user``; a user holding ``root`` is refused
    always; a user holding only the run's role is re-granted (password rotation). ``revoke`` of a shared user
    takes the run's role only: the other run keeps its role, user and password."""
    etcd.passwords |= {"rdzv-jobA": "j0bA-pw", "jobB": "j0bB-pw", "admin": "adm1n-pw"}
    a_key, b_key = f"{PREFIX}/jobA/v3/run", f"{PREFIX}/jobB/v3/run"
    etcd.ok("root", "grant", "jobA", "--password-file", etcd.password_file("rdzv-jobA"))
    b_pw = etcd.password_file("jobB")
    with etcd.client("root") as root:
        from etcd_store.client.auth_admin import user_add, user_grant_role

        user_add(root, "admin", etcd.passwords["admin"])
        user_grant_role(root, "admin", "root")
        before = auth_state(root)
        for args, expected in (
            (["grant", "jobB", "--user", "rdzv-jobA", "--password-file", b_pw],
             "user 'rdzv-jobA' holds role 'rdzv-jobA' (run 'jobA'): refusing to change its password and give "
             "it role 'rdzv-jobB' for run 'jobB'"),
            (["grant", "jobB", "--user", "rdzv-jobA"], "refusing to give it role 'rdzv-jobB' for run 'jobB'"),
            (["grant", "jobB", "--user", "rdzv-jobA", "--role", "custom"], "holds role 'rdzv-jobA' (run 'jobA')"),
            (["grant", "jobA", "--user", "rdzv-jobA", "--role", "second", "--password-file", b_pw],
             "holds role 'rdzv-jobA' (run 'jobA')"),
            (["grant", "jobB", "--user", "admin", "--allow-shared-user"], "user 'admin' holds etcd's role 'root'"),
        ):
            rc, out, err = etcd.cli("root", *args)
            assert (rc, out) == (2, "") and err.count("\n") == 1 and expected in err, (args, err)
            assert ("--allow-shared-user" in err) != ("admin" in args), err
            assert auth_state(root) == before, args  # nothing changed: no role, no password, no grant
        assert can_read(etcd, "rdzv-jobA", "j0bA-pw", a_key)  # job A's agents still log in
        assert not can_read(etcd, "rdzv-jobA", "j0bB-pw", a_key)  # job B's password reads nothing of A

        # Only the run's role: re-granted, the password replaced (rotation), nothing else.
        etcd.passwords["rdzv-jobA"] = "j0bA-pw2"
        out = etcd.ok("root", "grant", "jobA", "--password-file", etcd.password_file("rdzv-jobA"))
        assert [line.split(": ")[1] for line in out.splitlines()] == [
            f"has READWRITE b'{PREFIX}/jobA'", f"has READWRITE [b'{PREFIX}/jobA/', b'{PREFIX}/jobA0')",
            "password changed", "has role rdzv-jobA"]
        assert can_read(etcd, "rdzv-jobA", "j0bA-pw2", a_key)

        # Shared on purpose: the role is added, the password kept (none given).
        out = etcd.ok("root", "grant", "jobB", "--user", "rdzv-jobA", "--allow-shared-user")
        assert out.splitlines()[-2:] == ["user rdzv-jobA: granted role rdzv-jobB",
                                         "user rdzv-jobA: shared, it also holds rdzv-jobA"]
        assert can_read(etcd, "rdzv-jobA", "j0bA-pw2", a_key) and can_read(etcd, "rdzv-jobA", "j0bA-pw2", b_key)
        # Re-running it changes nothing, so needs no flag; a new password does.
        assert "has role rdzv-jobB" in etcd.ok("root", "grant", "jobB", "--user", "rdzv-jobA")
        rc, _, err = etcd.cli("root", "grant", "jobB", "--user", "rdzv-jobA", "--password-file", b_pw)
        assert rc == 2 and "refusing to change its password for run 'jobB'" in err, err

        # revoke of the shared user: job B's role goes, job A keeps its role, user and password.
        rc, out, err = etcd.cli("root", "revoke", "jobB", "--role", "rdzv-jobA")  # job A's permissions
        assert (rc, out) == (2, "") and "role 'rdzv-jobA' holds permissions outside run 'jobB'" in err, err
        out = etcd.ok("root", "revoke", "jobB", "--user", "rdzv-jobA")
        assert out.splitlines() == ["user rdzv-jobA: role rdzv-jobB taken", "role rdzv-jobB: deleted",
                                    "user rdzv-jobA: kept, it holds other roles (rdzv-jobA)"]
        assert auth_state(root) == before
        assert can_read(etcd, "rdzv-jobA", "j0bA-pw2", a_key) and not can_read(etcd, "rdzv-jobA", "j0bA-pw2", b_key)
