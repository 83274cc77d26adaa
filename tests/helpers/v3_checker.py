"""A seeded, randomized interleaving checker of the ``etcd-v3`` protocol (issue 20), in the spirit of
etcd's robustness tests: M in-process nodes (real handlers, each with its own client) against a real etcd
(one member, or a 3-member cluster), driven by a ``random.Random(seed)`` through steps: joins
(``next_rendezvous`` in a thread), voluntary leaves (``leave()``, torchrun's SIGTERM path), kills (the lease
revoked, or left to expire), a member's lease lost while it lives (it re-attaches at its next
``num_nodes_waiting()``), ``num_nodes_waiting()`` queries, a normal end (``shutdown()``: the run closes), the
operator's close (``etcd-rdzv close``: abort), etcd outages (every member frozen past the lease TTL), member
kill/SIGSTOP/restart on a cluster, etcd restart on one member, compaction, pauses, and one node's stall
(its own path to etcd blocked while the others run: shorter than the bound, when it must keep its place,
or past it). Every node runs torch's rank barrier (``_assign_worker_ranks``) on each round it gets, and
leaves when it fails, as torch's agent exits then.

After every step the invariants of :mod:`helpers.v3_model` are checked; ``num_nodes_waiting()`` answers are
compared with the model's expectation when it has one. A violation raises :class:`CheckFailed`: the seed, the
step, how to replay it, and the operations of the failing round and those concurrent with them
(:meth:`helpers.history.History.render`).

Replay / long mode: ``ETCD_RDZV_CHECK_SEED=7 ETCD_RDZV_CHECK_STEPS=2000`` (see tests/integration/
test_v3_interleavings.py). The nodes' blocking calls run in threads, so a replay makes the same choices but
the interleaving of etcd's answers may differ; a failing seed usually fails again within a few replays.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from etcd_rdzv.cli.actions import close_v3
from etcd_rdzv.cli.connect import CliError, Deadline
from etcd_rdzv.native import protocol
from etcd_rdzv.native.records import RunKeys, Sealed
from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdCompactedError, EtcdError

from .history import History, Op
from .v3_faults import FaultSteps
from .v3_model import Expect, RunModel, Seen
from .v3_world import Etcd, Node, NodeConf, kill, new_node, start_rendezvous

log = logging.getLogger(__name__)

WEIGHTS = {"join": 20, "pause": 16, "query": 10, "monitor": 8, "leave": 4, "kill_revoke": 4, "kill_expire": 3,
           "lease_loss": 2, "stall": 4, "compact": 2, "outage": 1, "close": 1.5, "abort": 1,
           "member_kill": 2, "member_freeze": 2, "heal": 3, "restart": 0.4, "evict_joiner": 1.5}
CLUSTER_ONLY = {"member_kill", "member_freeze", "heal"}
SINGLE_ONLY = {"restart"}
FAULTS = {"outage", "member_kill", "member_freeze", "restart"}


class CheckFailed(AssertionError):
    pass


@dataclass
class CheckConf:
    """One checker run. ``node``/``slots`` None: drawn from the seed (:meth:`NodeConf.drawn`; node slots:
    ``max_nodes`` + 1 to 3, so that full groups keep nodes out)."""

    seed: int
    steps: int
    slots: int | None = None
    node: NodeConf | None = None
    faults: bool = True  # etcd outages, member faults, restarts
    slack: float = 0.0  # default: 2 x read_timeout + heartbeat + 4 s (a loaded 2-core machine)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed * 7919 + 1)
        self.node = self.node or NodeConf.drawn(rng)
        self.slots = self.slots or self.node.max_nodes + rng.choice((1, 2, 2, 3))
        if not self.slack:
            self.slack = 2 * self.node.read_timeout + self.node.heartbeat + 4.0

    @property
    def nodes(self) -> NodeConf:
        assert self.node is not None
        return self.node

    @property
    def width(self) -> int:
        assert self.slots is not None
        return self.slots

    def describe(self) -> str:
        n = self.nodes
        return (f"{self.width} slots, min_nodes={n.min_nodes} max_nodes={n.max_nodes} "
                f"last_call={n.last_call_timeout} fast_recovery={n.fast_recovery}")


class Checker(FaultSteps):
    """One seeded run of the checker against ``etcd`` (see the module docstring)."""

    def __init__(self, etcd: Etcd, conf: CheckConf) -> None:
        self.etcd, self.conf = etcd, conf
        self.heartbeat, self.read_timeout = conf.nodes.heartbeat, conf.nodes.read_timeout
        self.rng = random.Random(conf.seed)
        self.history = History()
        self.client = EtcdClient(etcd.endpoint, timeout=conf.nodes.read_timeout * 3)
        self.pool = ThreadPoolExecutor(max_workers=2 * conf.width + 2)  # calls, and a stall per node
        self.episode = 0
        self.step_no = 0
        self.stats: dict[str, int] = {}
        self.rounds = 0  # rounds sealed, all episodes
        self._queried: dict[str, Op] = {}  # each node's latest num_nodes_waiting()
        self._strays: list[Node] = []  # nodes whose next_rendezvous raised something no handler raises
        self.nodes: list[Node] = []
        self._made: list[Node] = []  # every node of the episode (their proxies close with it)
        self._stalled: set[str] = set()  # nodes whose path to etcd is blocked now
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._new_episode()

    # ------------------------------------------------------------------ episodes

    def _new_episode(self) -> None:
        self.episode += 1
        self.run_id = f"chk{self.conf.seed}e{self.episode}"
        self.prefix = f"/v3chk{time.monotonic_ns() % 10**9}"
        self.keys = RunKeys.for_run(self.prefix, self.run_id)
        self.model = RunModel(self.conf.nodes, self.conf.slack)
        self.nodes = [self._fresh(i) for i in range(self.conf.width)]
        self._watch_stop = threading.Event()
        start = self.client.range(self.keys.ctl, count_only=True).revision + 1
        self._watcher = threading.Thread(target=self._watch_ctl, args=(self.model, self._watch_stop, start),
                                         name="chk-ctl-watch", daemon=True)
        self._watcher.start()
        self.history.note("episode", run=self.run_id, prefix=self.prefix)
        self._episode_ns = time.monotonic_ns()

    def _fresh(self, slot: int) -> Node:
        node = new_node(self.etcd, self.conf.nodes, self.run_id, self.prefix, slot)
        self._made.append(node)
        return node

    def _end_episode(self) -> None:
        """Every live node leaves (bounded); the threads of their calls end."""
        for node in self.nodes:
            if node.alive:
                node.status = "left"
                try:
                    node.handler.leave()
                except Exception as e:
                    log.info("leave of %s failed: %s", node.name, e)
        for node in self.nodes:
            if node.thread is not None:
                node.thread.join(self.conf.nodes.read_timeout + 5)
        for node in self._made:
            node.close_proxies()
        self._made = []
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
        self.rounds += len(self.model.seals)

    def _watch_ctl(self, model: RunModel, stop: threading.Event, start: int) -> None:
        """Every seal and close of the run, with its revision, as etcd applied them."""
        keys = self.keys
        while not stop.is_set():
            try:
                with self.client.watch(keys.ctl, keys.ctl_end, start_revision=start) as watch:
                    while not stop.is_set():
                        for ev in watch.get(timeout=0.2):
                            start = ev.kv.mod_revision + 1
                            if ev.type != "PUT":
                                continue
                            if ev.key == keys.sealed:
                                s = Sealed.from_kv(ev.kv)
                                world = s.membership.world if s.membership is not None else -1
                                model.saw_seal(Seen(s.round, s.revision, world, s.master, time.monotonic()))
                            elif ev.key == keys.closed:
                                model.saw_close(ev.kv.mod_revision)
            except EtcdCompactedError:
                model.watch_gap, start = True, 0
                self.history.note("ctl watch compacted: seal order no longer checked")
            except EtcdError as e:
                if stop.is_set():
                    return
                log.info("ctl watch: %s", e)
                stop.wait(0.2)

    # ------------------------------------------------------------------ the run

    def run(self, on_step: Callable[[int], None] | None = None) -> dict[str, int]:
        """All steps; raises :class:`CheckFailed` at the first violation. Returns the steps taken by kind."""
        try:
            for step in range(1, self.conf.steps + 1):
                self.step_no = step
                kind = self._pick()
                self.stats[kind] = self.stats.get(kind, 0) + 1
                getattr(self, f"_step_{kind}")()
                self._check()
                if on_step is not None:
                    on_step(step)
        finally:
            self.close()
        return self.stats

    def _pick(self) -> str:
        kinds = [k for k in WEIGHTS if (self.etcd.cluster or k not in CLUSTER_ONLY)
                 and (not self.etcd.cluster or k not in SINGLE_ONLY) and (self.conf.faults or k not in FAULTS)]
        return self.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]

    def _check(self) -> None:
        if self._strays:
            node = self._strays[0]
            self._fail(f"{node.name}'s next_rendezvous raised {node.error!r}, which is no rendezvous outcome "
                       "(torch's handlers raise RendezvousError subclasses)", [node])
        found = self.model.violations(self.nodes, time.monotonic())
        if found:
            what, nodes = found[0]
            self._fail(what, nodes)

    def _fail(self, what: str, nodes: list[Node]) -> None:
        ops = [n.op for n in nodes if n.op is not None] + [self._queried[n.name] for n in nodes
                                                           if n.name in self._queried]
        raise CheckFailed(
            f"etcd-v3 interleaving checker: {what}\n"
            f"seed {self.conf.seed} ({self.conf.describe()}), step {self.step_no} of {self.conf.steps}, "
            f"episode {self.episode} "
            f"(run {self.run_id!r}, etcd {'cluster' if self.etcd.cluster else 'single member'})\n"
            f"replay: ETCD_RDZV_CHECK_SEED={self.conf.seed} ETCD_RDZV_CHECK_STEPS={self.step_no}\n"
            f"history (the operations involved and those concurrent with them):\n{self._render(ops)}"
        )

    def _render(self, ops: list[Op]) -> str:
        if not ops:
            return self.history.render(self.history.ops()[-40:])
        lo = min(o.invoked for o in ops)
        hi = max(o.completed or time.monotonic_ns() for o in ops)
        near = [o for o in self.history.ops() if o.invoked <= hi and (o.completed or hi) >= lo
                and o.invoked >= self._episode_ns]
        return self.history.render(near)

    def close(self) -> None:
        try:
            self._end_episode()
        finally:
            self.etcd.heal()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.client.close()

    # ------------------------------------------------------------------ helpers

    def _pick_node(self, pred: Callable[[Node], bool]) -> Node | None:
        chosen = [n for n in self.nodes if pred(n)]
        return self.rng.choice(chosen) if chosen else None

    def _done(self, node: Node) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        if node.error is not None and not isinstance(node.error, RendezvousError):
            self._strays.append(node)  # no outcome of a rendezvous: the product or the harness broke
        self.model.node_done(node, node.returned or time.monotonic())
        if node.barrier:
            kind = "barrier ok" if node.barrier == "ok" else "barrier failed"
            self.stats[kind] = self.stats.get(kind, 0) + 1
        if node.status == "member" and node.result is not None and node.barrier not in ("", "ok"):
            # torch's agent raises out of its run; the launcher's shutdown() then leaves the run
            self.model.barrier_failed(node, node.result[0], time.monotonic())
            self.history.note("rank barrier failed: the node leaves", node=node.name, error=node.barrier)
            self._retire(node, "left")
            try:
                node.handler.leave()
            except Exception as e:
                log.info("leave of %s after its barrier failed: %s", node.name, e)
            self.model.bump()

    def _left_group(self, node: Node, after: float = 0.0) -> None:
        if node.status == "member" and node.round is not None:
            self.model.member_gone(node, node.round, time.monotonic() + after)

    def _retire(self, node: Node, status: str, after: float = 0.0) -> None:
        """``node`` leaves the run (``status``: left, killed, shut); its key of the round it returned is
        gone ``after`` seconds from now. Under the model's lock, so that a ``next_rendezvous`` returning
        meanwhile is either recorded before (and its round left here) or ignored."""
        with self.model.lock:
            node.status = status
            if node.result is not None:
                self.model.member_gone(node, node.result[0], time.monotonic() + after)

    def _waiters_joined(self, round_: int) -> int | None:
        """How many waiting nodes hold a join key of ``round_`` (None if some waiter holds none yet)."""
        waiting = [n for n in self.nodes if n.status == "waiting"]
        deadline = time.monotonic() + 2.0
        # A wait that failed and could not withdraw, and a killed node whose lease is left to expire, leave
        # their key until the lease ends (by design: torch's handlers count a dead node until its keep-alive
        # times out too): not judged then.
        try:
            if any(self.client.get(self.keys.join_key(round_, n.handler.node_id)) is not None
                   for n in self.nodes if n.status in ("failed", "killed")):
                return None
        except EtcdError:
            return None
        while True:
            try:
                present = sum(self.client.get(self.keys.join_key(round_, n.handler.node_id)) is not None
                              for n in waiting)
            except EtcdError:
                return None
            if present == len(waiting):
                return present
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _query(self, node: Node) -> int | None:
        with self.history.op(node.name, "num_nodes_waiting") as op:
            self._queried[node.name] = op
            try:
                n = node.handler.num_nodes_waiting()
            except Exception as e:
                op.fail(e)
                return None
            op.ok(n)
            return n

    def _lease_trouble(self) -> bool:
        """Whether a live node's lease ended unasked (keep-alives starved on a loaded machine): the
        model's "intact" then does not hold, and an exact expectation is not judged."""
        for n in self.nodes:
            session = n.handler._node.session
            if n.alive and session is not None and (session.lost.is_set() or session.done().is_set()):
                self.history.note("lease ended unasked", node=n.name)
                return True
        return False

    def _judge(self, node: Node, expect: Expect | None, version: int) -> int | None:
        verdict = f"unjudged: {self.model.unknown}" if expect is None else \
            "judged=" if expect.eq is not None else "judged>0"
        self.stats[verdict] = self.stats.get(verdict, 0) + 1
        if expect is None:
            return self._query(node)
        got = self._query(node)
        if expect.eq is not None:
            if got is not None and got != expect.eq and self.model.version == version and not self._lease_trouble():
                self._fail(f"{node.name}: num_nodes_waiting() = {got}, expected {expect.eq}: {expect.why}", [node])
            return got
        deadline = time.monotonic() + expect.within
        while not got:  # positive within the bound, as an agent's monitor loop would poll
            if time.monotonic() > deadline:
                self._fail(f"{node.name}: num_nodes_waiting() still {got} after {expect.within:.1f} s, "
                           f"expected > 0: {expect.why}", [node])
            time.sleep(0.2)
            if not node.alive:
                return None
            got = self._query(node)
        return got

    # ------------------------------------------------------------------ steps

    def _step_pause(self) -> None:
        time.sleep(self.rng.uniform(0.05, 0.6))

    def _step_join(self) -> None:
        slot = self.rng.randrange(len(self.nodes))
        node = self.nodes[slot]
        if node.status == "waiting":
            return
        if not node.alive:
            node = self.nodes[slot] = self._fresh(slot)
        self._rejoin(node)

    def _rejoin(self, node: Node) -> None:
        self._left_group(node, after=self.conf.nodes.read_timeout)
        start_rendezvous(node, self.history, self._done)
        time.sleep(0.02)

    def _settle_departures(self) -> None:
        """Members of the last round that are on their way out (a re-join sent, a lease expiring):
        gone now if etcd no longer holds their key."""
        g = self.model.group()
        if g is None:
            return
        now = time.monotonic()
        for m in g[2]:
            if (self.model.gone(m, g[0]) or 0.0) > now:
                try:
                    if self.client.get(self.keys.join_key(g[0], m.handler.node_id)) is None:
                        self.model.member_gone(m, g[0], now)
                except EtcdError:
                    return

    def _step_query(self, node: Node | None = None) -> None:
        """One ``num_nodes_waiting()``, judged; a member told that nodes wait restarts its workers and
        re-rendezvous, as torch's agent does (most of the time: its workers may fail first)."""
        node = node or self._pick_node(lambda n: n.status in ("member", "new", "failed"))
        if node is None or node.status not in ("member", "new", "failed"):
            return
        self._settle_departures()
        last = self.model.last_round()
        waiters = None if last is None else self._waiters_joined(last + 1)
        version = self.model.version
        expect = self.model.expect_waiting(node, waiters, time.monotonic())
        if self.model.last_round() != last:  # a seal arrived meanwhile: the waiters were counted for another round
            expect = None
            self.model.unknown = "a seal arrived while the waiters were counted"
        got = self._judge(node, expect, version)
        if got and node.status == "member" and self.rng.random() < 0.8:
            self._rejoin(node)

    def _step_monitor(self) -> None:
        """Every member's agent polls once (its monitor interval), each reacting to its answer."""
        for node in [n for n in self.nodes if n.status == "member"]:
            self._step_query(node)

    def _step_leave(self) -> None:
        node = self._pick_node(lambda n: n.alive)
        if node is None:
            return
        self._retire(node, "left")
        with self.history.op(node.name, "leave") as op:
            op.ok(node.handler.leave())
        self.model.bump()

    def _step_stall(self) -> None:
        """One live node's path to etcd stalls while the others run (its host froze, its link
        partitioned): mostly shorter than the bound, when it must keep its place and nothing may change
        for anybody, else past it, when its lease or eviction may drop it (it re-attaches or re-joins)."""
        node = self._pick_node(lambda n: n.alive and n.name not in self._stalled)
        if node is None:
            return
        long = self.rng.random() < 0.35
        lo_s, hi_s = ((self.model.dropping_stall(), self.model.dropping_stall() + self.heartbeat) if long
                      else (0.2, self.model.spared_stall()))
        seconds = self.rng.uniform(lo_s, hi_s)
        kind = "stall past the bound" if long else "stall spared"
        self.stats[kind] = self.stats.get(kind, 0) + 1
        self._stalled.add(node.name)
        self.pool.submit(self.stall, node, seconds, long=long)  # the next steps run meanwhile
        round_ = node.round
        other = self._pick_node(lambda n: n is not node and n.status == "member" and n.round == round_)
        if round_ is not None and other is not None and self.rng.random() < 0.6:
            # its group fails meanwhile (another member's worker failed): the others observe it
            self.stats["stall while its group fails"] = self.stats.get("stall while its group fails", 0) + 1
            self._rejoin(other)

    def stall(self, node: Node, seconds: float, *, long: bool) -> None:
        """``node``'s path to etcd blocked for ``seconds``, recorded (``long``: past the bound)."""
        began = time.monotonic()
        index = self.model.node_stall(node, began, began + seconds, long=long)
        self.history.note("node stalled", node=node.name, seconds=round(seconds, 2), long=long)
        try:
            node.stall(seconds)
        finally:
            self.model.stall_ends(index, time.monotonic())
            self.history.note("node resumed", node=node.name)
            self._stalled.discard(node.name)

    def _step_evict_joiner(self) -> None:
        """A sealer evicts a live joiner of the open round (as after a stall of it past its bound that
        just ended; its lease is fine), and half the time the last node out then removes the records
        (``seq/`` restarts). The node must be told and join again, and never take a rank in a round
        whose record does not name its key (identity by etcd; the model's unique-ranks check)."""
        node = self._pick_node(lambda n: n.alive and n.status == "waiting" and n.name not in self._stalled)
        if node is None:
            return
        try:
            sealed = protocol.read_meta(self.client, self.keys).sealed
            read = protocol.read_round(self.client, self.keys, sealed.round + 1)
            mine = [j for j in read.joiners if j.node_id == node.handler.node_id]
            if not mine:
                return
            now = time.monotonic()  # excused as a stall past the bound: it may lose its place, nothing else
            self.model.stall_ends(self.model.node_stall(node, now, now, long=True), now)
            out = protocol.evict_joiners(self.client, self.keys, sealed.round + 1, sealed,
                                         [(j.key, j.mod_revision, j.lease, j.create_revision) for j in mine])
            self.history.note("joiner evicted alive", node=node.name, round=sealed.round + 1, ok=out.ok)
            if out.ok and self.rng.random() < 0.5:
                removed = protocol.remove_round_records_if_idle(self.client, self.keys)
                self.history.note("last node out", removed=removed)
        except EtcdError as e:
            self.history.note("eviction not sent", node=node.name, error=str(e)[:80])
        self.model.bump()

    def _step_kill_revoke(self) -> None:
        node = self._pick_node(lambda n: n.alive)
        if node is not None:
            self._retire(node, "killed")
            self.history.note("kill (lease revoked)", node=node.name)
            kill(node, revoke_with=self.client)
            self.model.bump()

    def _step_kill_expire(self) -> None:
        node = self._pick_node(lambda n: n.alive)
        if node is not None:
            self._retire(node, "killed", after=self.conf.nodes.heartbeat + 1.0)
            self.history.note("kill (lease left to expire)", node=node.name)
            kill(node)
            self.model.bump()

    def _step_lease_loss(self) -> None:
        """A member's lease ends while it lives (as after a cut from etcd longer than its TTL); its next
        ``num_nodes_waiting()`` re-attaches it, and a group otherwise intact answers as before."""
        node = self._pick_node(lambda n: n.status == "member")
        lease = None if node is None else node.session_id()
        if node is None or lease is None:
            return
        last = self.model.last_round()
        waiters = None if last is None else self._waiters_joined(last + 1)
        version = self.model.version
        before = self.model.expect_waiting(node, waiters, time.monotonic())
        if self.model.last_round() != last:
            before = None
        self.history.note("lease revoked, node alive", node=node.name, round=node.round)
        try:
            self.client.lease_revoke(lease)
        except EtcdError as e:
            log.info("lease_loss: %s", e)
        if before is not None and before.eq is not None and self.model.last_round() == last:
            self._judge(node, before, version)  # re-attaches
        elif node.round is not None:
            self._query(node)
            with self.model.lock:
                self.model.disturbed.add(node.round)
        self.model.bump()

    def _step_close(self) -> None:
        """A normal end: one node's ``shutdown()`` closes the run; the others' workers run on."""
        node = self._pick_node(lambda n: n.alive and n.status != "waiting")
        if node is None:
            return
        self._retire(node, "shut")
        self.model.closing = True
        with self.history.op(node.name, "shutdown") as op:
            op.ok(node.handler.shutdown())
        # False: it could not close (etcd failed; after losing etcd it only leaves, by design)
        if op.result or self._closed_in_etcd():
            self._after_close(aborted=False)

    def _step_abort(self) -> None:
        """The operator's ``etcd-rdzv close``: every wait ends, every agent is told to stop."""
        self.model.closing = True
        with self.history.op("operator", "etcd-rdzv close") as op:
            try:
                out = close_v3(self.client, self.prefix, self.run_id, Deadline(self.conf.nodes.close_timeout * 3))
            except (CliError, EtcdError) as e:  # nothing of the run in etcd yet, or etcd failed
                op.fail(e)
            else:
                op.ok(out)
        if op.outcome == "ok" or self._closed_in_etcd():
            self._after_close(aborted=True)

    def _closed_in_etcd(self) -> bool:
        """Whether the run is closed after a close that reported failure (its answer may have been
        lost); if not, the run goes on. A read through the checker's client (failing over)."""
        try:
            closed = self.client.get(self.keys.closed) is not None
        except EtcdError:
            closed = False  # not known: the watch of ctl/ tells the model if it was
        self.model.closing = closed or self.model.closed_rev is not None
        return self.model.closing

    def _ended_by_close(self, node: Node) -> None:
        """A wait pending at the close ended with ``RendezvousClosedError`` (``RendezvousGracefulExitError``
        for a node kept out), or with the rank of a round sealed before the close, or with the error of
        a wait that had timed out or lost etcd (a fault) on its own."""
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousConnectionError,
            RendezvousGracefulExitError,
            RendezvousTimeoutError,
        )

        if node.status not in ("member", "failed"):
            return  # still waiting (the deadline check reports it) or retired meanwhile
        if node.result is not None:
            seal = self.model.seals.get(node.result[0])
            closed = self.model.closed_rev
            if seal is not None and closed is not None and seal.revision > closed:
                self._fail(f"{node.name} was admitted to round {node.result[0]} sealed at revision "
                           f"{seal.revision}, after the close at {closed}", [node])
            return
        e = node.error
        if isinstance(e, RendezvousClosedError | RendezvousGracefulExitError):
            return
        if isinstance(e, RendezvousTimeoutError) and time.monotonic() - node.started >= self.conf.nodes.join_timeout:
            return
        if isinstance(e, RendezvousConnectionError) and (self.model.fault_open is not None or self.model.faults):
            return
        if isinstance(e, RendezvousConnectionError) and self.model.stalled_long(node.name, node.started,
                                                                                 time.monotonic()):
            return  # its own path to etcd was blocked past read_timeout
        self._fail(f"{node.name}'s wait, pending at the close, ended with {e!r}", [node])

    def _after_close(self, *, aborted: bool) -> None:
        """Every wait ends by the deadline, queries answer as torch's would, a new rendezvous raises
        ``RendezvousClosedError``; then the episode ends and a new run begins."""
        with self.model.lock:
            self.model.closed_at = time.monotonic()
            self.model.aborted = self.model.aborted or aborted
            self.model.version += 1
        waiting = [n for n in self.nodes if n.status == "waiting" and n.thread is not None]
        for node in waiting:
            assert node.thread is not None
            node.thread.join(max(self.model.deadline(node, time.monotonic()) - time.monotonic(), 0) + 0.5)
        self._check()
        for node in waiting:
            self._ended_by_close(node)
        version = self.model.version
        for node in [n for n in self.nodes if n.status in ("member", "new", "failed")]:
            self._judge(node, self.model.expect_waiting(node, None, time.monotonic()), version)
        probe = self._pick_node(lambda n: n.status in ("member", "new", "failed"))
        if probe is not None:
            start_rendezvous(probe, self.history, self._done)
            assert probe.thread is not None
            probe.thread.join(self.conf.nodes.read_timeout + self.conf.slack)
            from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

            if not isinstance(probe.error, RendezvousClosedError):
                self._fail(f"{probe.name}: next_rendezvous after the close ended with "
                           f"{probe.error or probe.result!r}, not RendezvousClosedError", [probe])
        if not aborted and self.rng.random() < 0.5:
            self._step_abort()
            return
        self._check()
        self._end_episode()
        self._new_episode()
