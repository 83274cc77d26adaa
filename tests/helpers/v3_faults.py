"""The etcd fault steps of the etcd-v3 interleaving checker (tests/helpers/v3_checker.py): compaction, an
outage of every member while the members poll, an etcd restart, a cluster member killed, frozen, healed.

:class:`FaultSteps` is a base of :class:`~helpers.v3_checker.Checker`; it uses the checker's etcd, model,
history, random generator and queries.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .history import History
from .v3_model import RunModel
from .v3_world import Etcd, Node

log = logging.getLogger(__name__)


class FaultSteps:
    """The fault steps (see the module docstring)."""

    etcd: Etcd
    model: RunModel
    history: History
    rng: random.Random
    nodes: list[Node]
    pool: ThreadPoolExecutor
    stats: dict[str, int]
    heartbeat: float
    read_timeout: float
    _query: Callable[[Node], int | None]
    _fail: Callable[[str, list[Node]], None]

    def _step_compact(self) -> None:
        try:
            revision = self.etcd.compact()
        except Exception as e:
            self.history.note("compaction failed", error=repr(e))
            return
        self.history.note("compacted", revision=revision)

    def _disturb_all(self) -> None:
        with self.model.lock:
            last = self.model.last_round()
            self.model.disturbed.update(r for r in (last, (last or 0) + 1) if r)

    def _step_outage(self) -> None:
        """Every etcd member frozen for longer than the lease TTL but shorter than ``read_timeout``,
        while every member's agent polls ``num_nodes_waiting()`` each 0.1 s (torch's monitor interval),
        so a poll is in flight during the outage: a group whose members all live must not restart."""
        seconds = self.heartbeat + self.rng.uniform(0.3, 0.8)
        group = self.model.group()
        intact = group is not None and not any(n.status == "waiting" for n in self.nodes) and all(
            n.alive and n.status == "member" and n.round == group[0] and self.model.gone(n, group[0]) is None
            for n in group[2]) and group[0] not in self.model.disturbed and self.model.fault_open is None
        members = [n for n in group[2] if n.alive and n.status == "member"] if group is not None else []
        answers: dict[str, list[int | None]] = {n.name: [] for n in members}
        stop = threading.Event()

        def monitor(node: Node) -> None:
            while not stop.is_set():
                answers[node.name].append(self._query(node))
                stop.wait(0.1)

        pollers = [threading.Thread(target=monitor, args=(n,), daemon=True) for n in members]
        for t in pollers:
            t.start()
        self.model.fault_begins(time.monotonic())
        self.history.note("etcd frozen", seconds=round(seconds, 2))
        self._disturb_all()
        try:
            self.etcd.freeze_all(seconds)
        finally:
            self.model.fault_ends(time.monotonic())
            self.history.note("etcd thawed")
            time.sleep(self.heartbeat)  # the polls after it: re-attach, then the group is whole
            stop.set()
            for t in pollers:
                t.join(self.read_timeout * 2)
        polled = [a for got in answers.values() for a in got]
        if not intact or group is None or None in polled:  # a poll that failed: its agent would have failed
            return
        self.stats["outage judged"] = self.stats.get("outage judged", 0) + 1
        if any(polled):
            self._fail(f"an outage of {seconds:.1f} s (every lease expired), round {group[0]} with all its "
                       f"{group[1]} members alive and polling, nobody waiting: num_nodes_waiting() answered "
                       f"{answers}; a surviving group must not restart", members)

    def _step_restart(self) -> None:
        self.model.fault_begins(time.monotonic())
        self.history.note("etcd restarted (SIGKILL, start)")
        self._disturb_all()
        self.etcd.restart()
        self.model.fault_ends(time.monotonic())

    def _step_member_kill(self) -> None:
        if self.etcd.down or self.etcd.frozen:
            return
        i = self.rng.randrange(self.etcd.size)
        self.model.fault_begins(time.monotonic())
        self._disturb_all()
        self.history.note("member killed", member=i)
        self.etcd.kill_member(i)

    def _step_member_freeze(self) -> None:
        if self.etcd.down or self.etcd.frozen:
            return
        i = self.rng.randrange(self.etcd.size)
        self.model.fault_begins(time.monotonic(), stall=True)
        self._disturb_all()
        self.history.note("member frozen (SIGSTOP)", member=i)
        self.etcd.freeze_member(i)

    def _step_heal(self) -> None:
        if not (self.etcd.down or self.etcd.frozen):
            return
        self.history.note("members healed", down=sorted(self.etcd.down), frozen=sorted(self.etcd.frozen))
        self.etcd.heal()
        self._disturb_all()
        self.model.fault_ends(time.monotonic())

