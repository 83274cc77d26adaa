"""The local agent harness shared by the demo and the test suite.

:class:`LocalAgent` launches, kills, freezes and thaws one local "node": a
torchrun agent (:func:`torchrun_command`) and every process under it, found by
the unique tag it carries in its environment (:func:`tagged_pids`).
:func:`summarize` condenses the training script's step log
(:mod:`etcd_rdzv.testing.train`) into one :class:`GroupSummary` per worker group;
:func:`log_line_times` reads the times of torchrun's own log lines in an agent's output.

Blocking: :meth:`LocalAgent.wait`, :meth:`LocalAgent.kill`,
:meth:`LocalAgent.freeze` and :meth:`LocalAgent.terminate` wait at most the
timeout they are given; they raise ``RuntimeError`` when processes do not stop
in that time. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .train import NODE_ENV, Record, group_order

log = logging.getLogger(__name__)

__all__ = [
    "TAG_ENV",
    "TRAIN_SCRIPT",
    "GroupSummary",
    "LocalAgent",
    "log_line_times",
    "summarize",
    "tagged_pids",
    "torchrun_command",
]

TAG_ENV = "ETCD_RDZV_PROC_TAG"
"""Environment variable carrying a :class:`LocalAgent`'s tag to every process under it."""

TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


# --------------------------------------------------------------------------- processes


def _state(pid: int) -> str | None:
    """Process state letter from /proc (``None`` if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rindex(b")")
    return stat[end + 2 : end + 3].decode()


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def tagged_pids(tag: str) -> set[int]:
    """Live (non-zombie) processes whose environment holds ``TAG_ENV=tag``.

    Reads ``/proc/<pid>/environ`` (the environment a process was started
    with), so it finds a node's workers even after their agent died and they
    were re-parented. Linux only.
    """
    needle = f"{TAG_ENV}={tag}".encode()
    found: set[int] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and _alive(int(entry)):
            found.add(int(entry))
    return found


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state ``T``/``t``) or gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # the thread ended
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def torchrun_command(
    script_args: Sequence[str],
    *,
    nnodes: str,
    nproc_per_node: int,
    backend: str,
    endpoint: str,
    run_id: str,
    rdzv_conf: Mapping[str, Any] | None = None,
    max_restarts: int = 3,
    monitor_interval: float = 0.3,
    module: bool = False,
    local_addr: str | None = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m torch.distributed.run ...`` running the training script.

    ``module=True`` runs it as ``-m etcd_rdzv.testing.train``, else as the file
    ``etcd_rdzv/testing/train.py`` (:data:`TRAIN_SCRIPT`). ``script_args`` go to the training script.
    ``local_addr`` is the address the node advertises (its workers' store and
    gloo peers are reached there); 127.0.0.1 for local nodes.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}",
    ]  # fmt: skip
    if local_addr:
        cmd.append(f"--local-addr={local_addr}")
    if rdzv_conf:
        cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    cmd.extend(extra)
    cmd.extend(["-m", "etcd_rdzv.testing.train"] if module else [TRAIN_SCRIPT])
    cmd.extend(script_args)
    return cmd


class LocalAgent:
    """One local "node": a torchrun agent and every process it starts.

    The agent runs in a new session (its own process group) with
    ``TAG_ENV=<unique tag>`` and ``NODE_ENV=name`` in its environment; torchrun
    starts each worker in yet another session, so the node's processes are
    found by that tag (:func:`tagged_pids`), not by process group.

    Args:
        name: node name, logged by the training script as ``node``.
        argv: the agent's command line (see :func:`torchrun_command`).
        env: extra environment variables.
        output: file receiving the agent's (and its workers') stdout and stderr;
            ``None`` discards them.
        unset: variables of this process's environment the agent must not inherit.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        output: str | None = None,
        unset: Sequence[str] = (),
    ) -> None:
        self.name = name
        self._unset = tuple(unset)
        self.argv = list(argv)
        self.tag = f"{name}-{uuid.uuid4().hex}"
        self.output = output
        self._extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self.started_at: float | None = None

    def __repr__(self) -> str:
        state = "not started" if self.proc is None else f"pid={self.proc.pid} rc={self.proc.poll()}"
        return f"LocalAgent({self.name!r}, {state})"

    def start(self) -> None:
        """Start the agent (returns at once)."""
        if self.proc is not None:
            raise RuntimeError(f"agent {self.name} already started")
        env = {k: v for k, v in os.environ.items() if k not in self._unset}
        # local nodes: gloo on loopback, one thread per worker
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"})
        env.update(self._extra_env)
        env.update({TAG_ENV: self.tag, NODE_ENV: self.name})
        if self.output:
            self._out = open(self.output, "ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._out if self._out else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        """The agent's pid (raises if not started)."""
        if self.proc is None:
            raise RuntimeError(f"agent {self.name} not started")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The agent's exit status, ``None`` while it runs (or before start)."""
        return self.proc.poll() if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> set[int]:
        """Live processes of this node (agent, workers, anything under them)."""
        return tagged_pids(self.tag)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the agent to exit; its status, or ``None`` on timeout."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _stop_all(self, timeout: float = 10.0, *, must_stop: bool = True) -> set[int]:
        """SIGSTOP the node's processes until no new one appears; return them.

        Returns once every thread of those processes is stopped (so anything
        they log carries an earlier time than the moment this returns), or
        after ``timeout``: then raises ``RuntimeError`` if ``must_stop``.
        """
        stopped: set[int] = set()
        if self.running():
            os.kill(self.pid, signal.SIGSTOP)  # a stopped agent starts no new worker
            stopped.add(self.pid)
        for _ in range(20):
            new = self.pids() - stopped
            if not new:
                break
            _signal(new, signal.SIGSTOP)
            stopped |= new
        deadline = time.monotonic() + timeout
        while running := {pid for pid in stopped if not _all_threads_stopped(pid)}:
            if time.monotonic() > deadline:
                if not must_stop:
                    break
                raise RuntimeError(f"node {self.name}: processes {sorted(running)} did not stop")
            time.sleep(0.005)  # the kernel signals no event when a process has stopped
        return stopped

    def freeze(self, timeout: float = 10.0) -> set[int]:
        """SIGSTOP the agent and all its processes (a hung node); returns their pids
        once all are stopped. Raises ``RuntimeError`` if one still runs after ``timeout``."""
        return self._stop_all(timeout)

    def thaw(self) -> None:
        """SIGCONT every process of the node (after :meth:`freeze`)."""
        pids = self.pids()
        if self.running():
            pids.add(self.pid)
        _signal(pids, signal.SIGCONT)

    def kill(self, timeout: float = 10.0) -> float:
        """Node failure: SIGKILL the agent and every process under it at once.

        Freezes them all first (so none reacts to another's death), then
        SIGKILLs them; blocks until none is alive. Returns ``time.time()`` of
        the kill. Raises ``RuntimeError`` if a process survives ``timeout``.
        """
        pids = self._stop_all(min(timeout, 5.0), must_stop=False)
        killed_at = time.time()
        _signal(pids, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.05)
            left = self.pids()
            if not left:
                return killed_at
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name}: processes {sorted(left)} survived SIGKILL")
            _signal(left, signal.SIGKILL)

    def terminate(self, grace: float = 5.0) -> int | None:
        """Stop the node politely: SIGTERM the agent (torchrun stops its workers),
        then after ``grace`` seconds kill whatever is left. Returns the agent's status."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            self.wait(grace)
        if self.pids():
            self.kill()
        return self.returncode

    def close(self) -> None:
        """Kill anything left of the node and release the output file (idempotent)."""
        if self.proc is not None and (self.running() or self.pids()):
            self.kill()
        if self._out is not None:
            self._out.close()
            self._out = None

    def output_tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the agent's output file ('' if none)."""
        if not self.output or not os.path.exists(self.output):
            return ""
        with open(self.output, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class GroupSummary:
    """What the log says about one worker group (one round)."""

    group: str
    round: int
    world_size: int
    nodes: list[str]
    first_t: float
    last_t: float
    first_step: int | None
    last_step: int | None
    resumed_from: int
    done: bool


def summarize(records: Sequence[Record]) -> list[GroupSummary]:
    """One :class:`GroupSummary` per worker group, in order of appearance."""
    out: list[GroupSummary] = []
    for gid in group_order(records):
        rs = [r for r in records if r.group == gid]
        steps = [r.step for r in rs if r.kind == "step"]
        starts = [r.resumed_from for r in rs if r.kind == "start"]
        out.append(
            GroupSummary(
                group=gid,
                round=rs[0].round,
                world_size=rs[0].world_size,
                nodes=sorted({r.node for r in rs}),
                first_t=min(r.t for r in rs),
                last_t=max(r.t for r in rs),
                first_step=min(steps) if steps else None,
                last_step=max(steps) if steps else None,
                resumed_from=max(starts) if starts else 0,
                done=any(r.kind == "done" for r in rs),
            )
        )
    return out


def log_line_times(text: str, needle: str, *, now: float | None = None) -> list[float]:
    """Times (epoch seconds) of the torchrun log lines of ``text`` that contain ``needle``, in order.

    torchrun's lines start with a glog prefix, ``I1202 04:03:32.001000 ...`` (level, month and day,
    local time; no year): the year is the one that puts the time at most a day after ``now``
    (default: the current time), so a log written on 31 December reads right on 1 January. Lines
    without a parsable prefix are skipped.
    """
    now = time.time() if now is None else now
    year = time.localtime(now).tm_year
    out: list[float] = []
    for line in text.splitlines():
        if needle not in line or len(line) < 21:
            continue
        try:
            fraction = float("0" + line[14:21])
            t = time.mktime(time.strptime(f"{year} {line[1:5]} {line[6:14]}", "%Y %m%d %H:%M:%S")) + fraction
            if t > now + 86400:
                t = time.mktime(time.strptime(f"{year - 1} {line[1:5]} {line[6:14]}", "%Y %m%d %H:%M:%S")) + fraction
        except ValueError:
            continue
        out.append(t)
    return out
