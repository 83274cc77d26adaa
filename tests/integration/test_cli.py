"""The ``etcd-rdzv`` command: decoding units without etcd, then ``list``/``show``/``watch``/``close``/``gc``
against a real etcd with live runs (real handlers of both backends in threads of this process).

The command runs in-process (``main(argv)``, output captured) except where its process behaviour
is the point (exit codes and stderr of bad input, the module entry point, ``watch`` streaming).
Waiting for a state in etcd is done on a watch (``wait_count``), never by sleeping.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT
from helpers.nodes import Nodes
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from etcd_rdzv.cli import main
from etcd_rdzv.cli.actions import encode_closed
from etcd_rdzv.cli.connect import CliError, connect_options
from etcd_rdzv.cli.render import format_seconds, render_list
from etcd_rdzv.cli.runs import RunInfo, classify_keys, v2_info
from etcd_rdzv.cli.watching import describe_v3, diff_v2
from etcd_rdzv.native.records import RunKeys
from etcd_rdzv.v2state import NodeDesc, StateDecodeError, V2State, decode_state
from etcd_server import AuthConfig, EtcdServer
from etcd_store.client import Event, KeyValue

pytestmark = pytest.mark.timeout(180)

ROOT = Path(REPO_ROOT)
_ids = itertools.count()
WAIT = 30.0


# --------------------------------------------------------------------------- units: the v2 state


def torch_state(closed: bool = False) -> _RendezvousState:
    state = _RendezvousState()
    a, b, c = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 22, 0), _NodeDesc("host-c", 33, 1)
    state.round = 3
    state.complete = True
    state.closed = closed
    state.deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
    state.participants = {a: 0, b: 1}
    state.wait_list = {c}
    state.last_heartbeats = {a: datetime.now(timezone.utc), b: datetime.now(timezone.utc) - timedelta(seconds=9)}
    return state


def test_v2_state_decodes_without_torch_classes() -> None:
    value = base64.b64encode(pickle.dumps(torch_state()))
    state = decode_state(value, "/p/run")
    assert (state.round, state.complete, state.closed) == (3, True, False)
    assert [(n.node_id, r) for n, r in state.members()] == [("host-a_11_0", 0), ("host-b_22_0", 1)]
    assert [n.node_id for n in state.waiting()] == ["host-c_33_1"]
    assert state.deadline == datetime(2030, 1, 1, tzinfo=timezone.utc)
    info = v2_info("run", state, datetime.now(timezone.utc))
    assert info.world_size == 2 and info.age_s is not None and info.age_s < 5
    assert {n.node_id: n.heartbeat_age_s is not None and n.heartbeat_age_s >= 8 for n in info.members} == {
        "host-a_11_0": False, "host-b_22_0": True}


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_v2_state_refuses_other_globals_without_running_them(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    value = base64.b64encode(pickle.dumps(_Exploit(str(target))))
    with pytest.raises(StateDecodeError, match=r"refusing to load _?io\.open"):  # _io.open from Python 3.12 on
        decode_state(value, "/p/evil")
    assert not target.exists()
    state = torch_state()
    state.participants = {_NodeDesc("h", 1, 0): _Exploit(str(target))}  # type: ignore[dict-item]
    with pytest.raises(StateDecodeError, match="refusing"):
        decode_state(base64.b64encode(pickle.dumps(state)), "/p/evil")
    assert not target.exists()


@pytest.mark.parametrize(
    "value, match",
    [(b"not base64!", "base64"), (base64.b64encode(b"\x80\x04junk"), "torch's rendezvous state"),
     (base64.b64encode(pickle.dumps({"round": 1})), "dict, not a _RendezvousState")],
)
def test_v2_state_rejects_what_is_not_a_state(value: bytes, match: str) -> None:
    with pytest.raises(StateDecodeError, match=match):
        decode_state(value, "/p/x")


def test_closed_state_is_torch_readable() -> None:
    state = decode_state(base64.b64encode(pickle.dumps(torch_state())), "k")
    raw = base64.b64decode(encode_closed(state))
    back = pickle.loads(raw)  # torch's own reading
    assert isinstance(back, _RendezvousState) and back.closed is True
    assert back.participants == torch_state().participants and back.round == 3
    assert decode_state(encode_closed(state), "k").closed


# --------------------------------------------------------------------------- units: keys, events, output


def test_classify_keys() -> None:
    keys = [b"/p/a", b"/p/a/store/x", b"/p/a/store\x00lease", b"/p/b/v3/ctl/run", b"/p/b/v3/rounds/x",
            b"/p/c/store/only", b"/other/d", b"/p/a/v3/ctl/closed"]
    assert classify_keys("/p", keys) == {"a": {"etcd-v2", "etcd-v3"}, "b": {"etcd-v3"}}


def _kv(key: bytes, value: bytes = b"", rev: int = 10, version: int = 1) -> KeyValue:
    return KeyValue(key, value, rev, rev, version, 0)


def test_describe_v3_events() -> None:
    keys = RunKeys.for_run("/p", "r")
    events = [
        Event("PUT", _kv(keys.join_key(1, "n1"), b'{"addr": "h1", "pid": 1, "port": 5}', 10)),
        Event("DELETE", _kv(keys.join_key(1, "n2"), rev=11, version=0)),
        Event("PUT", _kv(keys.join_key(2, "n2"), b'{"addr": "h2"}', 11)),
        Event("PUT", _kv(keys.join_key(2, "n2"), b'{"addr": "h2"}', 12, version=2)),  # re-put: no change
        Event("PUT", _kv(keys.sealed, b'{"round": 2, "run_lease": "ff", "master": ["h2", 29500]}', 13)),
        Event("DELETE", _kv(keys.join_key(2, "n3"), rev=14, version=0)),
        Event("PUT", _kv(keys.closed, b"1", 15)),
    ]
    assert describe_v3(keys, events) == [
        {"event": "join", "revision": 10, "round": 1, "node": "n1", "host": "h1"},
        {"event": "rejoin", "revision": 11, "round": 2, "node": "n2", "host": "h2", "from_round": 1},
        {"event": "seal", "revision": 13, "round": 2, "master": "h2:29500"},
        {"event": "leave", "revision": 14, "round": 2, "node": "n3"},
        {"event": "close", "revision": 15},
    ]


def test_diff_v2_states() -> None:
    a, b = NodeDesc("ha", 1, 0), NodeDesc("hb", 2, 0)
    filling = V2State(1, False, False, None, {a: 0})
    full = V2State(1, True, False, None, {a: 0, b: 1})
    assert diff_v2(None, filling, 5) == [{"event": "join", "revision": 5, "round": 1, "node": "ha_1_0",
                                          "host": "ha"}]
    assert [c["event"] for c in diff_v2(filling, full, 6)] == ["join", "seal"]
    assert diff_v2(full, full, 7) == []  # a heartbeat
    closed = V2State(1, True, True, None, {a: 0})
    assert [c["event"] for c in diff_v2(full, closed, 8)] == ["leave", "close"]
    assert diff_v2(closed, None, 9) == [{"event": "state-gone", "revision": 9}]


def test_connect_options_from_environment() -> None:
    from etcd_rdzv.cli import build_parser

    ns = build_parser().parse_args(["list"])
    opts = connect_options(ns, {"ETCDCTL_ENDPOINTS": "e1:2379,e2:2379", "ETCD_RDZV_USER": "u",
                                "ETCD_RDZV_PASSWORD": "pw"})
    assert (opts.client.endpoints, opts.client.user, opts.client.password, opts.key_prefix) == (
        "e1:2379,e2:2379", "u", "pw", "/torch/elastic/rendezvous")
    assert "pw" not in repr(opts)
    ns = build_parser().parse_args(["--timeout", "3", "list", "--endpoints", "x:1", "--key-prefix", "/k/"])
    opts = connect_options(ns, {})
    assert (opts.client.endpoints, opts.timeout, opts.key_prefix) == ("x:1", 3.0, "/k")
    with pytest.raises(CliError, match="ETCD_RDZV_PASSWORD"):
        connect_options(ns, {"ETCD_RDZV_USER": "u"})
    with pytest.raises(CliError, match="--cert and --key"):
        connect_options(build_parser().parse_args(["list", "--cert", "c.pem"]), {})
    with pytest.raises(SystemExit):  # no password option exists: secrets stay out of argv
        build_parser().parse_args(["list", "--password", "pw"])


def test_text_output() -> None:
    assert [format_seconds(v) for v in (None, -1, 5, 65, 3725)] == ["-", "gone", "5s", "1m05s", "1h02m"]
    text = render_list([RunInfo("job-1", "etcd-v3", 2, 4, False, expiry_s=7100)])
    header, row = text.splitlines()
    assert header.split() == ["RUN_ID", "BACKEND", "ROUND", "WORLD", "MEMBERS", "WAITING", "CLOSED", "AGE",
                              "EXPIRY"]
    assert row.split() == ["job-1", "etcd-v3", "2", "4", "0", "0", "no", "-", "1h58m"]


# --------------------------------------------------------------------------- live runs


CONF = {"v3": {"join_timeout": "60", "last_call_timeout": "0.5", "close_timeout": "5", "heartbeat": "3",
               "read_timeout": "10"},
        "v2": {"join_timeout": "60", "last_call_timeout": "1", "close_timeout": "5", "heartbeat_timeout": "5",
               "keep_alive_interval": "1", "keep_alive_max_attempt": "4", "read_timeout": "5"}}


class Run(Nodes):
    """Handlers of one run (``kind`` ``v3`` or ``v2``) in threads, and the CLI pointed at its key prefix."""

    def __init__(self, endpoint: str, kind: str) -> None:
        super().__init__(endpoint, f"etcd-{kind}", conf=CONF[kind], name="cli-run")
        self.kind = kind

    def cli(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["--endpoints", self.endpoint, "--key-prefix", self.prefix, "--timeout", "10", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    def cli_json(self, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
        rc, out, err = self.cli(capsys, *args, "--json")
        assert rc == 0, err
        return json.loads(out)

    def wait_until(self, capsys: pytest.CaptureFixture[str], check: Any) -> Any:
        """Re-read ``list --json`` after each change under the prefix until ``check(runs)`` holds."""
        deadline = time.monotonic() + WAIT
        with self.client.watch(self.prefix.encode() + b"/", prefix=True) as watch:
            watch.wait_created(WAIT)
            while True:
                runs = {r["run_id"]: r for r in self.cli_json(capsys, "list")["runs"]}
                if check(runs):
                    return runs
                if time.monotonic() > deadline:
                    raise AssertionError(f"never reached: {runs}")
                watch.get(timeout=deadline - time.monotonic())


@pytest.fixture(params=["v3", "v2"])
def run(request: pytest.FixtureRequest, etcd_endpoint: str) -> Iterator[Run]:
    r = Run(etcd_endpoint, request.param)
    try:
        yield r
    finally:
        r.close()


def test_list_show_close_gc_of_live_runs(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    backend = f"etcd-{run.kind}"
    a, b = run.new(2, 2), run.new(2, 2)
    infos = [f.result(timeout=WAIT) for f in run.join(a, b)]
    assert sorted(i.rank for i in infos) == [0, 1]

    first_round = 1 if run.kind == "v3" else 0  # torch numbers its rounds from 0
    runs = {r["run_id"]: r for r in run.cli_json(capsys, "list")["runs"]}
    row = runs[run.run_id]
    assert (row["backend"], row["round"], row["world_size"], len(row["members"]), row["closed"]) == (
        backend, first_round, 2, 2, False)
    assert row["expiry_s"] > 0

    shown = run.cli_json(capsys, "show", run.run_id)
    assert shown["backend"] == backend and shown["world_size"] == 2
    assert sorted(m["rank"] for m in shown["members"]) == [0, 1]
    assert {m["host"] for m in shown["members"]} == {"127.0.0.1"}
    assert shown["store_keys"] >= 1  # the round's (v3) or run's (v2) store holds the rank-0 address
    if run.kind == "v3":
        assert all(0 < m["lease_ttl_s"] <= 3 for m in shown["members"])
    else:
        assert all(m["heartbeat_age_s"] is not None for m in shown["members"])
    rc, text, _ = run.cli(capsys, "show", run.run_id)
    assert rc == 0 and f"run {run.run_id} ({backend}): round {first_round}, world_size 2, open" in text

    # A second run of the same prefix: one node waiting for a partner that never comes.
    lonely = Run(run.endpoint, run.kind)
    lonely.prefix = run.prefix
    try:
        waiter = lonely.new(2, 2)
        (pending,) = lonely.join(waiter)
        runs = run.wait_until(capsys, lambda rs: len(rs.get(lonely.run_id, {}).get("waiting", [])) == 1)
        assert runs[lonely.run_id]["world_size"] == 0 and not runs[lonely.run_id]["closed"]

        rc, out, err = run.cli(capsys, "close", lonely.run_id)
        assert (rc, out.strip()) == (0, f"closed {backend} run {lonely.run_id}"), err
        with pytest.raises(RendezvousClosedError):
            pending.result(timeout=WAIT)
        rc, out, _ = run.cli(capsys, "close", lonely.run_id)
        assert (rc, out.strip()) == (0, f"{backend} run {lonely.run_id} was already closed")
        runs = {r["run_id"]: r for r in run.cli_json(capsys, "list")["runs"]}
        assert runs[lonely.run_id]["closed"] and not runs[run.run_id]["closed"]
    finally:
        lonely.close()  # shuts the waiter down: no live node left in the closed run

    # gc removes the closed run only; the live one keeps every key.
    before = run.client.range(f"{run.prefix}/{run.run_id}".encode(), prefix=True, count_only=True).count
    dry = run.cli_json(capsys, "gc", "--dry-run", "--grace", "0")
    assert [r["run_id"] for r in dry["removed"]] == [lonely.run_id] and dry["dry_run"]
    done = run.cli_json(capsys, "gc", "--grace", "0")
    assert [(r["run_id"], r["backend"]) for r in done["removed"]] == [(lonely.run_id, backend)]
    assert done["removed"][0]["keys"] >= 1
    assert run.client.range(f"{run.prefix}/{lonely.run_id}".encode(), prefix=True, count_only=True).count == 0
    assert run.client.range(f"{run.prefix}/{run.run_id}".encode(), prefix=True, count_only=True).count == before
    assert run.cli_json(capsys, "gc", "--grace", "0")["removed"] == []


def _cli_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    environ = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "etcd_rdzv", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environ, cwd=ROOT)


def test_watch_shows_join_and_seal(run: Run) -> None:
    first = run.new(2, 2)
    (f1,) = run.join(first)
    joins = RunKeys.for_run(run.prefix, run.run_id).join_prefix(1) if run.kind == "v3" else None
    deadline = time.monotonic() + WAIT
    key = joins or f"{run.prefix}/{run.run_id}".encode()
    while run.client.range(key, prefix=joins is not None, count_only=True).count == 0:
        assert time.monotonic() < deadline
        with run.client.watch(key, prefix=joins is not None) as w:
            w.get(timeout=1.0)
    proc = _cli_process("--endpoints", run.endpoint, "--key-prefix", run.prefix, "watch", run.run_id,
                        "--json", "--count", "2", "--duration", "60")
    try:
        assert proc.stderr is not None and proc.stdout is not None
        started = proc.stderr.readline()
        assert started.startswith(f"etcd-rdzv: watching etcd-{run.kind} run {run.run_id}"), started
        second = run.new(2, 2)
        (f2,) = run.join(second)
        f1.result(timeout=WAIT), f2.result(timeout=WAIT)
        out, err = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    changes = [json.loads(line) for line in out.splitlines()]
    assert [c["event"] for c in changes] == ["join", "seal"], changes
    assert changes[1]["round"] == (1 if run.kind == "v3" else 0) and changes[0]["host"] == "127.0.0.1"


def test_bad_input_is_one_line_and_exit_2(etcd_endpoint: str) -> None:
    cases = [
        (["--endpoints", etcd_endpoint, "show", "no-such-run"], "no rendezvous run 'no-such-run'"),
        (["--endpoints", etcd_endpoint, "close", "no-such-run"], "no rendezvous run 'no-such-run'"),
        (["--endpoints", "127.0.0.1:1", "--timeout", "2", "list"], "No answer from etcd at http://127.0.0.1:1"),
        (["--endpoints", etcd_endpoint, "list", "--cacert", "/nonexistent/ca.pem"], "--cacert"),
    ]
    for args, message in cases:
        started = time.monotonic()
        proc = _cli_process(*args)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
        assert proc.returncode == 2, (args, out, err)
        assert err.count("\n") == 1 and err.startswith("etcd-rdzv: error: ") and message in err, err
        assert "Traceback" not in err and out == ""
        assert elapsed < 15, (args, elapsed)  # --timeout 2 plus the interpreter's start-up


def test_permission_denied_is_exit_2(etcd_binary: str, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    auth = AuthConfig("r00t-cli-pw", user="alice", password="al1ce-cli-pw", prefix=b"/jobs/alice/")
    with EtcdServer(binary=etcd_binary, auth=auth) as server:
        monkeypatch.setenv("ETCD_RDZV_USER", "alice")
        monkeypatch.setenv("ETCD_RDZV_PASSWORD", "al1ce-cli-pw")
        base = ["--endpoints", server.get_endpoint(), "--timeout", "5"]
        assert main([*base, "list"]) == 2  # a password over http: refused without the opt-in
        err = capsys.readouterr().err
        assert "--allow-insecure-auth" in err and "al1ce-cli-pw" not in err
        base.append("--allow-insecure-auth")
        assert main([*base, "--key-prefix", "/jobs/alice", "list", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"runs": []}
        assert main([*base, "list"]) == 2
        err = capsys.readouterr().err
        assert "permission denied" in err and err.count("\n") == 1
        monkeypatch.setenv("ETCD_RDZV_PASSWORD", "n0t-her-pw")
        assert main([*base, "--key-prefix", "/jobs/alice", "list"]) == 2
        err = capsys.readouterr().err
        assert "alice" in err and "n0t-her-pw" not in err


def test_entry_points() -> None:
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("etcd-rdzv") == "etcd_rdzv.cli:main"
    proc = _cli_process("--help")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "watch" in out and "gc" in out
