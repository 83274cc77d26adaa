"""The nemesis: a seeded schedule of faults against a real torchrun job, and what its history must keep.

:func:`schedule` draws the faults (kind, length) from a seeded ``random.Random``; :class:`Nemesis`
injects them, one at a time, into a :class:`~helpers.elastic.Job` of local nodes that reach a
3-member :class:`etcd_server.EtcdCluster` each through its own :class:`~helpers.cut_proxy.CutProxy`
per member (so one node can be cut off from etcd); :func:`violations` checks the history (the
training log, the faults, the agents' exits) and :func:`stalls` measures each fault's cost.

The kinds (:data:`KINDS`): SIGKILL and SIGSTOP of a whole node, of its agent only and of one
worker; SIGKILL and SIGSTOP of an etcd follower and of the leader; a quorum loss (two of three
members down for 10 s); one node cut off from etcd (a partition: nothing forwarded, nothing reset);
a CPU hog (one busy process per core). A kind that ``may_restart`` is allowed to restart the worker
group; the others (etcd's members, the CPU) must not: a worker group formed with no such fault in
reach is a false eviction.

The invariants:

* **steps**: every group resumes from the newest checkpoint logged before it started (none lost)
  and not past the last step done before it (none invented), then logs every step after it, in
  order, with no gap; no two groups train at once (a frozen node's step completed before its
  freeze and logged after its thaw is not training).
* **restarts explained**: every worker group after the first starts during, or within
  :data:`EXPLAIN_S` after, a fault that may restart it.
* **never closed by a failure**: no agent exits while the faults run, except one the nemesis
  killed (checked by the caller, which knows its agents), and every agent exits 0 at the end.

Stdlib only (no torch); the processes are the caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Sequence
from typing import Any

from etcd_rdzv.testing.train import Record

__all__ = ["EXPLAIN_S", "KINDS", "Fault", "Kind", "Nemesis", "schedule", "stalls", "violations"]

EXPLAIN_S = 45.0
"""How long after a fault that may restart the group a new group is still its doing: detection
(a lease or a presence TTL, a collective's timeout), the last call, a pod restart's scale-up."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of fault: whether it may restart the worker group, and how long it lasts (seconds)."""

    name: str
    may_restart: bool
    hold: tuple[float, float]


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("kill_node", True, (1, 3)),  # SIGKILL of agent and workers; the pod restarts after the hold
    Kind("stop_node", True, (2, 5)),
    Kind("kill_agent", True, (1, 3)),  # the agent only; its workers linger until the pod restarts
    Kind("stop_agent", True, (2, 5)),
    Kind("kill_worker", True, (0, 0)),  # the agent restarts its group
    Kind("stop_worker", True, (2, 5)),
    Kind("kill_follower", False, (1, 4)),
    Kind("stop_follower", False, (2, 5)),
    Kind("kill_leader", False, (1, 4)),
    Kind("stop_leader", False, (2, 5)),
    Kind("quorum_loss", False, (10, 10)),
    Kind("cut_node", True, (2, 5)),  # one node's connections to etcd partitioned
    Kind("cpu_hog", False, (5, 10)),
)}  # fmt: skip


@dataclasses.dataclass
class Fault:
    """One fault of a schedule; ``start``/``end`` (``time.time()``) once injected."""

    kind: str
    hold: float
    target: str = ""
    start: float = 0.0
    end: float = 0.0

    @property
    def may_restart(self) -> bool:
        return KINDS[self.kind].may_restart

    def describe(self) -> str:
        return f"{self.kind} {self.target} for {self.hold:.1f} s".replace("  ", " ")


def schedule(seed: int, backend: str, count: int, kinds: Sequence[str] = tuple(KINDS)) -> list[Fault]:
    """``count`` faults drawn from ``kinds``: each kind once first (in a seeded order), then at random;
    the same ``seed`` and ``backend`` give the same schedule."""
    rng = random.Random(f"nemesis-{seed}-{backend}")
    first = rng.sample(list(kinds), len(kinds))
    out = []
    for i in range(count):
        kind = first[i] if i < len(first) else rng.choice(list(kinds))
        lo, hi = KINDS[kind].hold
        out.append(Fault(kind, round(rng.uniform(lo, hi), 1)))
    return out


def _hog() -> None:  # a child process: spin until killed
    while True:
        pass


class Nemesis:
    """Injects :class:`Fault` s into a job and its etcd cluster (``inject`` blocks for the fault's
    length, then undoes it); :meth:`heal` undoes whatever is still in force (call it in ``finally``).

    Args:
        job: the :class:`~helpers.elastic.Job`.
        cluster: its :class:`etcd_server.EtcdCluster` of 3.
        proxies: per node name, its proxies (one per member).
        restart: starts node ``name`` again (a pod restart), with its own endpoint.
        rng: picks targets (a node, a worker).
    """

    def __init__(self, job, cluster, proxies, restart, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
        self.job = job
        self.cluster = cluster
        self.proxies = proxies
        self.restart = restart
        self.rng = rng
        self.thaws: list[tuple[str, float]] = []
        self.killed: set[str] = set()  # nodes whose agent the nemesis ended (exits expected)
        self._stopped: list[int] = []
        self._down: list[int] = []
        self._blocked: list[str] = []
        self._hogs: list[Any] = []  # the fork context's processes

    def inject(self, fault: Fault) -> None:
        """Inject ``fault``, wait its ``hold`` (the fault's length: not a synchronisation), undo it."""
        getattr(self, f"_{fault.kind}")(fault)
        self._settle()

    # --- nodes -------------------------------------------------------------------------------
    def _node(self, fault: Fault) -> str:
        fault.target = self.rng.choice(sorted(self.job.nodes))
        return fault.target

    def _kill_node(self, fault: Fault) -> None:
        name = self._node(fault)
        fault.start = self.job.nodes[name].kill()
        self.killed.add(name)
        time.sleep(fault.hold)  # the pod restart's delay
        self.restart(name)
        fault.end = time.time()

    def _stop_node(self, fault: Fault) -> None:
        name = self._node(fault)
        agent = self.job.nodes[name]
        fault.start = time.time()
        agent.freeze()
        time.sleep(fault.hold)  # the fault's length
        agent.thaw()
        fault.end = time.time()
        self.thaws.append((name, fault.end))

    def _kill_agent(self, fault: Fault) -> None:
        name = self._node(fault)
        fault.start = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.job.nodes[name].pid, signal.SIGKILL)
        self.killed.add(name)
        time.sleep(fault.hold)  # the pod restart's delay (the restart kills the lingering workers)
        self.restart(name)
        fault.end = time.time()

    def _stop_agent(self, fault: Fault) -> None:
        name = self._node(fault)
        pid = self.job.nodes[name].pid
        fault.start = time.time()
        self._signal([pid], signal.SIGSTOP)
        time.sleep(fault.hold)  # the fault's length
        self._signal([pid], signal.SIGCONT)
        fault.end = time.time()

    def _worker(self, fault: Fault) -> int | None:
        name = self._node(fault)
        agent = self.job.nodes[name]
        workers = sorted(agent.pids() - {agent.pid})
        return self.rng.choice(workers) if workers else None

    def _kill_worker(self, fault: Fault) -> None:
        pid = self._worker(fault)
        fault.start = time.time()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        fault.end = time.time()

    def _stop_worker(self, fault: Fault) -> None:
        pid = self._worker(fault)
        fault.start = time.time()
        if pid is not None:
            self._signal([pid], signal.SIGSTOP)
            time.sleep(fault.hold)  # the fault's length
            self._signal([pid], signal.SIGCONT)
        fault.end = time.time()
        self.thaws.append((fault.target, fault.end))

    def _cut_node(self, fault: Fault) -> None:
        name = self._node(fault)
        fault.start = time.time()
        self._blocked.append(name)
        for p in self.proxies[name]:
            p.block()
        time.sleep(fault.hold)  # the partition's length
        self._unblock()
        fault.end = time.time()

    # --- etcd --------------------------------------------------------------------------------
    def _member(self, fault: Fault, leader: bool) -> int:
        lead = self.cluster.leader()
        i = lead if leader else self.rng.choice([m for m in range(3) if m != lead])
        fault.target = f"member{i}"
        return i

    def _kill_members(self, fault: Fault, members: list[int]) -> None:
        fault.start = time.time()
        self._down.extend(members)
        for i in members:
            self.cluster.stop_member(i, graceful=False)
        time.sleep(fault.hold)  # the fault's length
        self._start_down()
        fault.end = time.time()

    def _stop_members(self, fault: Fault, members: list[int]) -> None:
        pids = [p for p in (self.cluster.pids[i] for i in members) if p is not None]
        fault.start = time.time()
        self._signal(pids, signal.SIGSTOP)
        time.sleep(fault.hold)  # the fault's length
        self._signal(pids, signal.SIGCONT)
        fault.end = time.time()

    def _kill_follower(self, fault: Fault) -> None:
        self._kill_members(fault, [self._member(fault, leader=False)])

    def _stop_follower(self, fault: Fault) -> None:
        self._stop_members(fault, [self._member(fault, leader=False)])

    def _kill_leader(self, fault: Fault) -> None:
        self._kill_members(fault, [self._member(fault, leader=True)])

    def _stop_leader(self, fault: Fault) -> None:
        self._stop_members(fault, [self._member(fault, leader=True)])

    def _quorum_loss(self, fault: Fault) -> None:
        lead = self.cluster.leader()
        follower = self.rng.choice([m for m in range(3) if m != lead])
        fault.target = f"member{lead},member{follower}"
        self._kill_members(fault, [lead, follower])

    def _cpu_hog(self, fault: Fault) -> None:
        fault.start = time.time()
        ctx = multiprocessing.get_context("fork")
        self._hogs = [ctx.Process(target=_hog, daemon=True) for _ in range(os.cpu_count() or 2)]
        for h in self._hogs:
            h.start()
        time.sleep(fault.hold)  # the fault's length
        self._stop_hogs()
        fault.end = time.time()

    # --- undoing -----------------------------------------------------------------------------
    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self._stopped.extend(pids)
        elif sig == signal.SIGCONT:
            self._stopped = [p for p in self._stopped if p not in pids]

    def _start_down(self) -> None:
        down, self._down = self._down, []
        for i in down:
            self.cluster.start_member(i)

    def _unblock(self) -> None:
        blocked, self._blocked = self._blocked, []
        for name in blocked:
            for p in self.proxies[name]:
                p.unblock()

    def _stop_hogs(self) -> None:
        hogs, self._hogs = self._hogs, []
        for h in hogs:
            h.kill()
            h.join(10)

    def _settle(self) -> None:
        """Nothing of a fault is left in force (each undo above ran; this is for an exception)."""
        self._signal(list(self._stopped), signal.SIGCONT)
        self._unblock()
        self._stop_hogs()

    def heal(self) -> None:
        """Undo whatever is still in force (a fault cut short by an exception); never raises."""
        with contextlib.suppress(Exception):
            self._settle()
        with contextlib.suppress(Exception):
            self._start_down()


# ------------------------------------------------------------------------------ the history


@dataclasses.dataclass(frozen=True)
class Group:
    """A worker group as the log shows it: its first record's time, the step it resumed from."""

    group: str
    start: float
    resumed_from: int
    steps: tuple[int, ...]


def groups(records: Sequence[Record]) -> list[Group]:
    """The worker groups of the log with a ``start`` record, in the order they started."""
    starts: dict[str, Record] = {}
    for r in records:
        if r.kind == "start" and (r.group not in starts or r.t < starts[r.group].t):
            starts[r.group] = r
    steps: dict[str, set[int]] = {}
    for r in records:
        if r.kind == "step":
            steps.setdefault(r.group, set()).add(r.step)
    out = [Group(g, s.t, s.resumed_from, tuple(sorted(steps.get(g, ())))) for g, s in starts.items()]
    return sorted(out, key=lambda g: g.start)


def violations(
    records: Sequence[Record], faults: Sequence[Fault], *, since: float, explain_s: float = EXPLAIN_S
) -> list[str]:
    """What in the history breaks the step and restart invariants (the module docstring); [] if none.
    Groups that started before ``since`` (the job forming, before the first fault) need no fault."""
    out = []
    ckpts = sorted((r.t, r.step) for r in records if r.kind == "ckpt")
    done = sorted((r.t, r.step) for r in records if r.kind == "step")
    for i, g in enumerate(groups(records)):
        newest = max((s for t, s in ckpts if t < g.start), default=0)
        last = max((s for t, s in done if t < g.start), default=0)
        if g.resumed_from < newest:
            out.append(f"group {g.group} resumed from step {g.resumed_from}, not the newest checkpoint "
                       f"{newest}: steps lost")
        if g.resumed_from > last:
            out.append(f"group {g.group} resumed from step {g.resumed_from}, past the last step done ({last})")
        expected = tuple(range(g.resumed_from + 1, g.resumed_from + 1 + len(g.steps)))
        if g.steps != expected:
            out.append(f"group {g.group} (resumed from {g.resumed_from}) logged steps {_span(g.steps)}: "
                       f"not each step after it once, in order")
        if i and g.start > since and not any(f.may_restart and f.start <= g.start <= f.end + explain_s for f in faults):
            near = [f.describe() for f in faults if f.start - 5 <= g.start <= f.end + explain_s]
            out.append(f"group {g.group} started at {g.start:.2f} with no fault that may restart a group "
                       f"in reach (a false eviction); faults near it: {near or 'none'}")
    return out


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)})" if steps else "none"


def stalls(records: Sequence[Record], faults: Sequence[Fault], until: float) -> list[float]:
    """Per fault, the longest time no step was done from its start to the next fault's start (the
    last one: to ``until``): what the fault cost the training, restart and rendezvous included."""
    times = sorted({r.t for r in records if r.kind == "step"})
    out = []
    for i, f in enumerate(faults):
        stop = faults[i + 1].start if i + 1 < len(faults) else until
        inside = [t for t in times if f.start < t <= stop]
        marks = [f.start, *inside]
        gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        out.append(round(max(gaps) if inside else stop - f.start, 2))
    return out
