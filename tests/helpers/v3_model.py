"""What the etcd-v3 interleaving checker (tests/helpers/v3_checker.py) knows of a run, and the invariants.

:class:`RunModel` is fed by the checker's steps (what it did to the nodes and to etcd), by the nodes'
``next_rendezvous`` outcomes and by a watch of the run's ``ctl/`` keys (every seal, the close, the abort,
with etcd's revisions). It answers two questions:

* :meth:`RunModel.violations`: the invariants, true after every step whatever happened:
  rounds are sealed once each, in order, none after the close; every returned group of a round agrees on
  its seal, world size and master address/port, with ranks ``0..w-1`` unique and
  ``min_nodes <= w <= max_nodes``; a node reports ``RendezvousClosedError`` only once the run is closed;
  no wait lasts past its deadline (:meth:`RunModel.deadline`).
* :meth:`RunModel.expect_waiting`: what ``num_nodes_waiting()`` must answer for one node, as torch's
  handler would for the same situation, when the model knows it (else None: any answer).

Liveness, beside safety: **a live node is never dropped unless it stalled past the bound**. A member
of round T that lives and has not left T (no re-join, leave, kill sent to it) when round T+1 is sealed
was dropped (T+1 seals only once T is empty: its key was evicted or its lease ended); that is a
violation unless it stalled longer than :meth:`RunModel.spared_stall` since T was sealed, or etcd
failed, or the checker revoked a lease of T. And **torch's rank barrier holds a live group**: every
member runs torch's own ``_assign_worker_ranks`` (the agent's store barrier over every rank of the
round) after ``next_rendezvous``; a barrier that fails when every member of its round lived through
it, none stalled past the bound and etcd did not fail is a violation (torch's agent would exit).

Times are ``time.monotonic()``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousGracefulExitError

from etcd_store.client.channels import _OPTIONS

from .v3_world import Node, NodeConf


def _option(name: str) -> int:
    return int(dict(_OPTIONS)[name])



STREAM_STALL = _option("grpc.keepalive_time_ms") / 1000 + _option("grpc.keepalive_timeout_ms") / 1000
"""Seconds until the client's HTTP/2 keepalive declares a member that answers nothing (SIGSTOPped)
dead: a stream on it (a wait's watch, a keep-alive stream) hears nothing meanwhile, then moves on."""


@dataclass(frozen=True)
class Seen:
    """One ``ctl/sealed`` PUT as the checker's watch saw it."""

    round: int
    revision: int
    world: int
    master: tuple[str, int] | None
    at: float


@dataclass(frozen=True)
class Expect:
    """An expected ``num_nodes_waiting()``: exactly ``eq``, or (``eq`` None) positive within ``within`` s."""

    eq: int | None
    why: str
    within: float = 0.0


@dataclass
class RunModel:
    conf: NodeConf
    slack: float
    lock: threading.RLock = field(default_factory=threading.RLock)
    seals: dict[int, Seen] = field(default_factory=dict)
    seal_order: list[int] = field(default_factory=list)
    closed_rev: int | None = None
    closing: bool = False  # a close or abort was sent (it may apply any time from now)
    closed_at: float | None = None  # the close step returned (the run is closed from then on)
    aborted: bool = False
    watch_gap: bool = False  # the ctl/ watch lost history (compaction): seal order not checked
    results: dict[int, list[tuple[Node, tuple[Any, ...]]]] = field(default_factory=dict)
    gone_at: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, round) -> when its key is gone
    disturbed: set[int] = field(default_factory=set)  # rounds whose members lost leases while alive
    faults: list[tuple[float, float]] = field(default_factory=list)  # etcd fault intervals
    fault_open: float | None = None
    stalls: list[float] = field(default_factory=list)  # when a member was frozen (streams on it stall)
    node_stalls: list[tuple[str, float, float, bool]] = field(default_factory=list)  # (node, from, to, long)
    left_at: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, round) -> when it was sent off
    barrier_failures: dict[int, tuple[float, list[str]]] = field(default_factory=dict)  # round -> first, who
    judged: set[tuple[str, int]] = field(default_factory=set)  # drops and barriers already reported
    problems: list[tuple[str, list[Node]]] = field(default_factory=list)
    unknown: str = ""  # why the last expect_waiting had no answer
    version: int = 0  # bumped on every change of a node's state (a query overlapping one is not judged)

    # ------------------------------------------------------------------ feeding

    def bump(self) -> None:
        with self.lock:
            self.version += 1

    def saw_seal(self, seen: Seen) -> None:
        with self.lock:
            old = self.seals.get(seen.round)
            if old is not None and old.revision != seen.revision:
                self.problem(f"round {seen.round} sealed twice: at revisions {old.revision} and {seen.revision}")
            if old is None:
                last = self.seal_order[-1] if self.seal_order else 0
                if seen.round != last + 1 and not self.watch_gap:
                    self.problem(f"round {seen.round} sealed after round {last} (not the next round)")
                if self.closed_rev is not None and seen.revision > self.closed_rev:
                    self.problem(f"round {seen.round} sealed at revision {seen.revision}, after the close "
                                 f"(revision {self.closed_rev})")
                self.seals[seen.round] = seen
                self.seal_order.append(seen.round)
            self.version += 1

    def saw_close(self, revision: int) -> None:
        with self.lock:
            if self.closed_rev is None:
                self.closed_rev = revision

    def node_done(self, node: Node, now: float) -> None:
        """``next_rendezvous`` of ``node`` returned or raised."""
        with self.lock:
            self.version += 1
            if node.status != "waiting":  # killed or left meanwhile: its outcome says nothing
                return
            late = now - self.deadline(node, now)
            if late > 0:
                self.problem(f"{node.name}'s next_rendezvous took {now - node.started:.1f} s, "
                             f"{late:.1f} s past its deadline", [node])
            if node.result is not None:
                node.status = "member"
                self.results.setdefault(node.result[0], []).append((node, node.result))
                return
            node.status = "failed"
            if isinstance(node.error, RendezvousClosedError | RendezvousGracefulExitError) and not self.closing \
                    and self.closed_rev is None:
                self.problem(f"{node.name} got {node.error!r} but the run was not closed", [node])

    def node_stall(self, node: Node, lo: float, hi: float, *, long: bool) -> int:
        """``node``'s path to etcd stalls from ``lo`` to ``hi`` (planned; :meth:`stall_ends` sets the true
        end); ``long``: past the bound (its lease, or eviction once its group failed, may drop it: its
        rounds' answers are not judged). Returns the stall's index."""
        with self.lock:
            self.node_stalls.append((node.name, lo, hi, long))
            if long:
                last = self.last_round()
                self.disturbed.update(r for r in (node.round, last, (last or 0) + 1) if r)
            self.version += 1
            return len(self.node_stalls) - 1

    def stall_ends(self, index: int, hi: float) -> None:
        with self.lock:
            name, lo, _, long = self.node_stalls[index]
            self.node_stalls[index] = (name, lo, hi, long)
            self.version += 1

    def stalled_long(self, name: str, lo: float, hi: float) -> bool:
        """Whether node ``name`` stalled past the bound between ``lo`` and ``hi``."""
        with self.lock:
            return any(who == name and long and s_hi >= lo and s_lo <= hi
                       for who, s_lo, s_hi, long in self.node_stalls)

    def barrier_failed(self, node: Node, round_: int, now: float) -> None:
        with self.lock:
            first, who = self.barrier_failures.get(round_, (now, []))
            self.barrier_failures[round_] = (min(first, now), [*who, node.name])

    def _silences(self) -> tuple[float, float, float]:
        """(lease TTL, renewal interval i, eviction's condemnation L): i is at most a third of the TTL,
        L = max(2·i, i + a + 1, 2·i + 2) with a, the client's answer bound, max(min(TTL/3, 2), 1)."""
        ttl = float(self.conf.heartbeat)
        i = min(1.0, ttl / 3)
        a = max(min(ttl / 3, 2.0), 1.0)
        return ttl, i, max(2 * i, i + a + 1, 2 * i + 2)

    def spared_stall(self) -> float:
        """The longest stall of one node after which it must keep its place: shorter than its lease and
        than eviction's condemnation, less one interval (its last renewal may be that old when the stall
        begins) and 0.5 s (a loaded host)."""
        ttl, i, condemned = self._silences()
        return min(ttl, condemned) - i - 0.5

    def dropping_stall(self) -> float:
        """The shortest stall drawn as long: past the lease and past eviction's condemnation."""
        ttl, _, condemned = self._silences()
        return max(ttl, condemned) + 0.5

    def fault_begins(self, now: float, *, stall: bool = False) -> None:
        """An etcd fault begins; ``stall``: a member answers nothing (SIGSTOP), streams on it stall."""
        with self.lock:
            if stall:
                self.stalls.append(now)
            if self.fault_open is None:
                self.fault_open = now

    def fault_ends(self, now: float) -> None:
        with self.lock:
            if self.fault_open is not None:
                self.faults.append((self.fault_open, now))
                self.fault_open = None

    def problem(self, what: str, nodes: list[Node] | None = None) -> None:
        with self.lock:
            self.problems.append((what, list(nodes or [])))

    # ------------------------------------------------------------------ deadlines

    def deadline(self, node: Node, now: float) -> float:
        """When ``node``'s pending ``next_rendezvous`` must have ended: ``join_timeout`` (plus the last
        call and ``slack``) from its start or from when the last full group stopped keeping it out (torch's
        redundancy list suspends the timeout), plus every etcd fault it overlapped and ``read_timeout``
        per fault; after a close, ``read_timeout`` + ``slack`` from the close."""
        c = self.conf
        start = max(node.started, min(self.full_until(now), now))
        bound = start + c.join_timeout + c.last_call_timeout + self.slack
        for lo, hi in self._fault_intervals(now):
            if hi >= node.started and lo <= now:
                bound += (hi - lo) + c.read_timeout + c.heartbeat
        for _name, lo, hi, long in self.node_stalls:  # a node's calls (and those waiting on it) hang
            if hi >= node.started and lo <= now:
                bound += (hi - lo) + (c.read_timeout + c.heartbeat if long else 0.0)
        if any(t <= now for t in self.stalls) and (self.fault_open is not None or
                                                   any(hi >= node.started for _, hi in self.faults)):
            bound += STREAM_STALL + c.read_timeout  # its watch may have sat on a frozen member
        if self.closed_at is not None:
            closed_bound = max(self.closed_at, node.started, self.stall_until(now)) + c.read_timeout + self.slack
            if self.stalls and (self.fault_open is not None or any(hi >= node.started for _, hi in self.faults)):
                closed_bound += STREAM_STALL + c.read_timeout
            bound = min(bound, closed_bound)
        return bound

    def _fault_intervals(self, now: float) -> list[tuple[float, float]]:
        """Every etcd fault interval, one still open counted until ``now``."""
        return [*self.faults, *([(self.fault_open, now)] if self.fault_open is not None else [])]

    def stall_until(self, now: float) -> float:
        """Until when a member was SIGSTOPped (``now`` while it is): a stream on it may hear nothing
        until then (tests/integration/test_client_frozen_member.py); 0 if none was."""
        if self.fault_open is not None and any(t >= self.fault_open for t in self.stalls):
            return now
        ends = [hi for lo, hi in self.faults if any(lo <= t <= hi for t in self.stalls)]
        return max(ends, default=0.0)

    def full_until(self, now: float) -> float:
        """Until when the last sealed round may have been full and holding its keys (it keeps the next
        round's joiners out): ``inf`` while it may still be; 0 if it never was."""
        last = self.last_round()
        if last is None or self.seals[last].world < self.conf.max_nodes:
            return 0.0
        members = [n for n, _ in self.results.get(last, [])]
        if len(members) < self.seals[last].world:
            return float("inf")  # a member has not returned yet (or died before): not known
        gone = [self.gone(n, last) or float("inf") for n in members]
        return min(gone)

    # ------------------------------------------------------------------ state

    def last_round(self) -> int | None:
        with self.lock:
            return max(self.seals) if self.seals else None

    def member_gone(self, node: Node, round_: int, when: float) -> None:
        """``node``'s join key of ``round_`` is gone by ``when`` (it left, re-joined, died), or earlier."""
        with self.lock:
            key = (node.name, round_)
            self.gone_at[key] = min(self.gone_at.get(key, when), when)
            self.left_at.setdefault(key, time.monotonic())
            self.version += 1

    def gone(self, node: Node, round_: int) -> float | None:
        """When ``node``'s join key of ``round_`` is (or will surely be) gone; None: not known to go."""
        return self.gone_at.get((node.name, round_))

    def group(self) -> tuple[int, int, list[Node]] | None:
        """The last sealed round, its world size and its members, once every member returned."""
        last = self.last_round()
        if last is None:
            return None
        world = self.seals[last].world
        members = [n for n, _ in self.results.get(last, [])]
        return (last, world, members) if len(members) == world else None

    def expect_waiting(self, node: Node, waiters: int | None, now: float) -> Expect | None:
        """What ``num_nodes_waiting()`` of ``node`` must answer (None: not known here; ``unknown`` says
        why). ``waiters``: nodes whose join of the next round the checker saw in etcd (None: not all
        of them known)."""
        c = self.conf
        grace = c.read_timeout + c.heartbeat  # GroupCheck.grace
        eventually = grace + c.heartbeat + self.slack
        if self.aborted:
            return Expect(None, "the run was aborted (etcd-rdzv close)", eventually)
        if self.closed_at is not None:
            return Expect(0, "the run was closed (a normal end): healthy workers run on")
        last = self.last_round()
        if last is None or node.status not in ("member", "new", "failed"):
            return self._unknown("no round yet")
        if node.status == "member" and node.round is not None and node.round < last:
            return Expect(None, f"{node.name}'s round {node.round} was sealed over by round {last}", eventually)
        g = self.group()
        if g is None:
            return self._unknown("members of the last round still returning (or died before)")
        if last in self.disturbed:
            return self._unknown("the round's leases ended while its members lived (outage)")
        if self.fault_open is not None or any(hi + grace + c.heartbeat > now for _, hi in self.faults):
            return self._unknown("an etcd fault now or within the grace")
        round_, world, members = g
        gone = [m for m in members if self.gone(m, round_) is not None]
        if node.status == "member" and node.round == round_:
            if any((self.gone(m, round_) or 0.0) <= now for m in gone):
                return Expect(None, f"round {round_} lost a member ({[m.name for m in gone]})",
                              eventually + c.heartbeat)
            if gone:
                return self._unknown("a member's lease is expiring")
            return self.intact(round_, world, waiters)
        if gone:
            return self._unknown("not a member, and the group lost a member")
        return self.intact(round_, world, waiters)

    def intact(self, round_: int, world: int, waiters: int | None) -> Expect | None:
        """Round ``round_`` runs with all its ``world`` members holding their keys: torch's answer is the
        wait list (0 when the group is full: newcomers are on the redundancy list)."""
        if waiters is None:
            return self._unknown("a waiter's join not seen in etcd")
        want = waiters if world < self.conf.max_nodes else 0
        return Expect(want, f"round {round_} intact ({world} of max {self.conf.max_nodes}), {waiters} waiting")

    def _unknown(self, why: str) -> Expect | None:
        self.unknown = why
        return None

    def violations(self, nodes: list[Node], now: float) -> list[tuple[str, list[Node]]]:
        """The invariants over what is known now (see the module docstring)."""
        with self.lock:
            out = list(self.problems)
            self.problems.clear()
            for node in nodes:
                if node.status == "waiting" and now > self.deadline(node, now):
                    p = node.handler._node
                    out.append((f"{node.name} waits for {now - node.started:.1f} s, past its deadline "
                                f"({self.deadline(node, now) - node.started:.1f} s); it holds {p.standing.joined}, "
                                f"its lease session {p.session}", [node]))
            for round_, got in self.results.items():
                out += self._round_violations(round_, got, now)
            out += self._drops()
            out += self._barriers(now)
        return out

    def _excused(self, name: str | None, lo: float, hi: float) -> str:
        """Why a node (``name``; None: any node) may have lost its place between ``lo`` and ``hi``: a
        long stall of it, an etcd fault (its grace included), or "" if nothing excuses it."""
        c = self.conf
        for who, s_lo, s_hi, long in self.node_stalls:
            if long and (name is None or who == name) and s_hi >= lo and s_lo <= hi:
                return f"{who} stalled {s_hi - s_lo:.1f} s"
        for f_lo, f_hi in self._fault_intervals(hi):
            if f_hi + c.read_timeout + c.heartbeat >= lo and f_lo <= hi:
                return "an etcd fault"
        return ""

    def _drops(self) -> list[tuple[str, list[Node]]]:
        """A live member of round T still in it (nothing sent it off) when T+1 was sealed: dropped."""
        out: list[tuple[str, list[Node]]] = []
        for round_, seen in self.seals.items():
            before = self.seals.get(round_ - 1)
            if before is None or round_ - 1 in self.disturbed:
                continue
            for node, _ in self.results.get(round_ - 1, []):
                key = (node.name, round_ - 1)
                left = self.left_at.get(key)
                if key in self.judged or (left is not None and left <= seen.at):
                    continue
                if not node.alive and left is None:
                    continue  # retired without a key of its own to drop (cannot happen: counted as left)
                if self._excused(node.name, before.at, seen.at):
                    continue
                self.judged.add(key)
                stalls = [round(hi - lo, 2) for who, lo, hi, _ in self.node_stalls if who == node.name
                          and hi >= before.at and lo <= seen.at]
                out.append((f"{node.name}, a live member of round {round_ - 1} that nothing sent off, was dropped: "
                            f"round {round_} was sealed without it (its stalls meanwhile: {stalls} s, spared "
                            f"up to {self.spared_stall():.1f} s)", [node]))
        return out

    def _barriers(self, now: float) -> list[tuple[str, list[Node]]]:
        """torch's rank barrier failed in round T, judged once every member had time to return: a
        violation unless a member of T never returned, was sent off or died by then, stalled past the
        bound, or etcd failed."""
        out: list[tuple[str, list[Node]]] = []
        c = self.conf
        for round_, (first, who) in self.barrier_failures.items():
            if ("barrier", round_) in self.judged or now < first + c.read_timeout + 2:
                continue
            self.judged.add(("barrier", round_))
            seal = self.seals.get(round_)
            members = self.results.get(round_, [])
            if seal is None or round_ in self.disturbed or len(members) < seal.world:
                continue
            gone = [n.name for n, _ in members if (self.left_at.get((n.name, round_)) or float("inf")) <= first]
            if gone or self._excused(None, seal.at - c.heartbeat, first):
                continue
            out.append((f"torch's rank barrier of round {round_} failed on {who}, with every member "
                        f"({[n.name for n, _ in members]}) alive and in it, no stall past the bound, no etcd fault",
                        [n for n, _ in members]))
        return out

    def _round_violations(self, round_: int, got: list[tuple[Node, tuple[Any, ...]]],
                          now: float) -> list[tuple[str, list[Node]]]:
        c = self.conf
        who = [n for n, _ in got]
        seal = self.seals.get(round_)
        if seal is None:
            first = min(n.op.completed or 0 for n in who if n.op is not None) / 1e9 if who else now
            first = max(first, self.stall_until(now))  # the checker's watch may sit on a frozen member
            bound = c.read_timeout + self.slack + (STREAM_STALL + c.read_timeout if self.stalls else 0.0)
            if now - first > bound and not self.watch_gap:
                return [(f"round {round_} was returned but its seal was never seen", who)]
            return []
        out: list[tuple[str, list[Node]]] = []
        ranks = [r[1] for _, r in got]
        if len(set(ranks)) != len(ranks):
            out.append((f"round {round_}: duplicate ranks {sorted(ranks)}", who))
        for n, (_, rank, world, seal_rev, _addr, _port) in got:
            if world != seal.world or seal_rev != seal.revision:
                out.append((f"round {round_}: {n.name} got world {world} at seal revision {seal_rev}, the seal "
                            f"says world {seal.world} at revision {seal.revision}", who))
            if not 0 <= rank < world:
                out.append((f"round {round_}: {n.name} got rank {rank} of {world}", who))
            if not c.min_nodes <= world <= c.max_nodes:
                out.append((f"round {round_}: world {world} outside [{c.min_nodes}, {c.max_nodes}]", who))
        masters = {(r[4], r[5]) for _, r in got}
        if len(masters) > 1:
            out.append((f"round {round_}: members disagree on the master: {sorted(map(str, masters))}", who))
        if seal.master is not None and masters and masters != {seal.master}:
            out.append((f"round {round_}: the seal names master {seal.master}, members got {masters}", who))
        if len(got) > seal.world:
            out.append((f"round {round_}: {len(got)} nodes returned for a world of {seal.world}", who))
        return out
