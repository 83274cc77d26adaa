"""Randomized stress of the ``etcd-v3`` handler: dozens of nodes joining, dying and re-joining.

Each node slot runs in a thread: it joins (``next_round``), stays in its group
for a random moment, then either re-joins (as an agent does after a worker
failure) or dies (its lease is revoked, the handler abandoned) and is replaced
by a fresh node a moment later. A chaos thread meanwhile adds joiners that die
before sealing (join keys whose lease is revoked) and revokes the leases of
waiting nodes (which must re-join). After the run, every formed round is checked:

* ranks are distinct, every member reports the same world size and seal revision,
  and each member's rank is its place in the members record that the seal
  transaction wrote;
* that record is the first ``max_nodes`` join keys in create order as the sealer
  read them, checked against etcd's own history: the members still present at the
  seal revision are the first join keys there, in order, any later key is an
  overflow, every named member held its key when the join counter the seal is
  fenced on last changed, and every named member missing at the seal revision is a
  node whose lease ended after that (a dead node: fake joiner, killed node, revoked
  lease), never one that withdrew;
* ``min_nodes <= world_size <= max_nodes``;
* groups never overlap: every member of a round had left it before any member
  of a later round was admitted, and a node's rounds strictly increase.

The seed is printed; set ``V3_STRESS_SEED`` to replay a run's choices.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
)

from etcd_rdzv.native import protocol
from etcd_rdzv.native.handler import EtcdV3RendezvousHandler, RoundResult
from etcd_rdzv.native.records import RunKeys
from etcd_rdzv.plugin import create_etcd_v3_rdzv_handler
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(180)

SLOTS = 24
MIN_NODES, MAX_NODES = 2, 6
RUN_SECONDS = 8.0
MIN_ROUNDS = 5
P_DIE = 0.15
CONF = {"join_timeout": "120", "last_call_timeout": "0.2", "close_timeout": "10",
        "heartbeat": "10", "read_timeout": "20"}


@dataclass
class Entry:
    """One node's stay in one round: admitted at ``t_in``, gone at ``t_out``."""

    result: RoundResult
    t_in: float
    t_out: float = float("inf")


class Stress:
    def __init__(self, endpoint: str, seed: int) -> None:
        self.endpoint = endpoint
        self.seed = seed
        self.prefix = f"/v3stress{time.monotonic_ns() % 10**9}"
        self.run_id = "stress"
        self.keys = RunKeys.for_run(self.prefix, self.run_id)
        self.client = EtcdClient(endpoint, timeout=20)
        self.lock = threading.Lock()
        self.entries: list[Entry] = []
        self.handlers: list[EtcdV3RendezvousHandler] = []
        self.waiting: set[EtcdV3RendezvousHandler] = set()
        self.fakes: set[str] = set()
        self.lease_ended: set[str] = set()  # node ids whose lease a test thread revoked
        # lease id -> time the chaos thread revoked it: a node whose lease ends
        # has left its group then, even if its thread still "runs" the group.
        self.revoked_at: dict[int, float] = {}
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.deaths = self.rejoins = self.lease_kills = 0
        # Named members gone at the seal revision, and of them those that reported their rank.
        self.named_gone = self.named_gone_ranked = 0

    def new_handler(self, slot: int) -> EtcdV3RendezvousHandler:
        params = RendezvousParameters(
            backend="etcd-v3", endpoint=self.endpoint, run_id=self.run_id,
            min_nodes=MIN_NODES, max_nodes=MAX_NODES, local_addr="127.0.0.1",
            key_prefix=self.prefix, **CONF,
        )
        # Even slots share the test's client, odd slots own one.
        handler = create_etcd_v3_rdzv_handler(params, client=self.client if slot % 2 == 0 else None)
        with self.lock:
            self.handlers.append(handler)
        return handler

    def slot(self, slot: int) -> None:
        rng = random.Random(self.seed * 1000 + slot)
        handler = self.new_handler(slot)
        entry: Entry | None = None
        try:
            while not self.stop.is_set():
                with self.lock:
                    self.waiting.add(handler)
                try:
                    result = handler.next_round()
                except (RendezvousClosedError, RendezvousGracefulExitError):
                    return  # the run was closed at the end of the test
                finally:
                    with self.lock:
                        self.waiting.discard(handler)
                entry = Entry(result, time.monotonic())
                lease = handler._node.session.id if handler._node.session is not None else None
                with self.lock:
                    self.entries.append(entry)
                self.stop.wait(rng.uniform(0.0, 0.15))  # the group "runs"
                if rng.random() < P_DIE:
                    entry.t_out = self.left_at(lease)
                    self.kill(handler)
                    self.stop.wait(rng.uniform(0.0, 0.3))
                    handler = self.new_handler(slot)
                    self.deaths += 1
                else:
                    entry.t_out = self.left_at(lease)  # about to leave the group: re-join
                    self.rejoins += 1
        except BaseException as e:  # recorded, re-raised by the test
            self.errors.append(e)

    def left_at(self, lease: int | None) -> float:
        """Now, or earlier if the chaos thread revoked the node's lease meanwhile
        (chaos picks waiting nodes, but one may be admitted as it picks)."""
        with self.lock:
            revoked = self.revoked_at.get(lease, float("inf")) if lease is not None else float("inf")
        return min(time.monotonic(), revoked)

    def kill(self, handler: EtcdV3RendezvousHandler) -> None:
        """The node dies: no shutdown (that would close the run), its lease just ends."""
        session = handler._node.session
        if session is not None:
            with self.lock:
                self.lease_ended.add(handler.node_id)
            session.close(revoke=True)

    def chaos(self) -> None:
        rng = random.Random(self.seed)
        for i in itertools.count():
            if self.stop.wait(rng.uniform(0.05, 0.25)):
                return
            try:
                if rng.random() < 0.6:
                    self.fake_joiner(rng, i)
                else:
                    with self.lock:
                        waiting = sorted(self.waiting, key=id)
                    if waiting:
                        victim = rng.choice(waiting)
                        session = victim._node.session
                        if session is not None:
                            with self.lock:
                                self.revoked_at.setdefault(session.id, time.monotonic())
                                self.lease_ended.add(victim.node_id)
                            self.client.lease_revoke(session.id)
                            self.lease_kills += 1
            except Exception as e:
                self.errors.append(e)
                return

    def fake_joiner(self, rng: random.Random, i: int) -> None:
        """A node that joins the open round (the join transaction) and dies a moment
        later, before or after sealing."""
        name = f"fake-{i}"
        lease = self.client.lease_grant(30)
        self.fakes.add(name)
        sealed = protocol.read_meta(self.client, self.keys).sealed
        protocol.join(self.client, self.keys, name, b"{}", lease, sealed)  # may fail: sealed since
        self.stop.wait(rng.uniform(0.0, 0.2))
        self.client.lease_revoke(lease)

    def close(self) -> None:
        with self.lock:
            handlers = list(self.handlers)
        for h in handlers:
            try:
                h.shutdown()
            except Exception:
                pass
        self.client.close()


def check_rounds(stress: Stress) -> int:
    """Check every invariant over the recorded rounds; return the number of groups formed."""
    by_round: dict[int, list[Entry]] = defaultdict(list)
    for e in stress.entries:
        by_round[e.result.round].append(e)
    client, keys = stress.client, stress.keys
    formed = sorted(by_round)
    for round_ in formed:
        entries = by_round[round_]
        results = [e.result for e in entries]
        world = {r.world_size for r in results}
        assert len(world) == 1, f"round {round_}: members disagree on world size: {world}"
        world_size = world.pop()
        assert MIN_NODES <= world_size <= MAX_NODES, f"round {round_}: size {world_size}"
        revisions = {r.seal_revision for r in results}
        assert len(revisions) == 1, f"round {round_}: members disagree on the seal: {revisions}"
        seal_revision = revisions.pop()
        ranks = sorted(r.rank for r in results)
        assert len(set(ranks)) == len(ranks), f"round {round_}: duplicate ranks {ranks}"
        # Later seals delete old records: read it as the seal wrote it.
        members_res = client.range(keys.members(round_), revision=seal_revision)
        assert members_res.kvs, f"round {round_}: no members record"
        named = json.loads(members_res.kvs[0].value)
        assert len(named) == world_size
        by_rank = {r.rank: r.node_id for r in results}
        for rank, node in by_rank.items():
            assert named[rank] == node, f"round {round_}: rank {rank} is {node}, the record says {named}"
        # The record against etcd's history at the seal revision.
        snap = client.range(keys.join_prefix(round_), prefix=True, keys_only=True, revision=seal_revision)
        at_seal = [
            keys.parse_join_key(kv.key)[1]  # type: ignore[index]
            for kv in sorted(snap.kvs, key=lambda kv: kv.create_revision)
        ]
        present = [n for n in named if n in at_seal]
        assert at_seal[: len(present)] == present, f"round {round_}: {named} vs {at_seal}"
        gone = set(named) - set(at_seal)
        assert gone <= stress.fakes | stress.lease_ended, f"round {round_}: {gone} left yet were named"
        # The seal is fenced on the join counter (joins and withdrawals bump it, a lease end does
        # not): every named member held its key at the counter's last change before the seal, so
        # a named member gone at the seal is one whose lease ended after that (between the
        # sealer's read and its seal). One that still ran may report its rank and then re-attach,
        # as after a lease end right after the seal (test_v3_protocol.py::
        # test_a_lease_that_ends_between_the_read_and_the_seal_is_a_member_that_re_attaches).
        counter = client.range(keys.seq(round_), revision=seal_revision - 1).kvs
        assert counter, f"round {round_}: no join counter before the seal"
        fenced = client.range(keys.join_prefix(round_), prefix=True, keys_only=True,
                              revision=counter[0].mod_revision)
        at_fence = {keys.parse_join_key(kv.key)[1] for kv in fenced.kvs}  # type: ignore[index]
        assert set(named) <= at_fence, f"round {round_}: {set(named) - at_fence} named without a key"
        stress.named_gone += len(gone)
        stress.named_gone_ranked += len(gone & set(by_rank.values()))
    # Exclusivity: a later group is admitted only after the earlier one was left.
    for earlier, later in itertools.pairwise(formed):
        left = max(e.t_out for e in by_round[earlier])
        admitted = min(e.t_in for e in by_round[later])
        assert left <= admitted, f"round {later} was admitted while round {earlier} still ran"
    per_node: dict[str, list[int]] = defaultdict(list)
    for e in sorted(stress.entries, key=lambda e: e.t_in):
        per_node[e.result.node_id].append(e.result.round)
    for node, rounds in per_node.items():
        assert rounds == sorted(set(rounds)), f"{node} was in rounds {rounds}"
    return len(formed)


def test_random_joins_deaths_and_rejoins(etcd_endpoint: str) -> None:
    seed = int(os.environ.get("V3_STRESS_SEED", random.randrange(10**6)))
    print(f"V3_STRESS_SEED={seed}")
    stress = Stress(etcd_endpoint, seed)
    threads = [threading.Thread(target=stress.slot, args=(i,), daemon=True) for i in range(SLOTS)]
    threads.append(threading.Thread(target=stress.chaos, daemon=True))
    try:
        for t in threads:
            t.start()
        stress.stop.wait(RUN_SECONDS)
        stress.stop.set()
        # Closing the run releases every node still waiting.
        with stress.lock:
            closer = stress.handlers[0]
        closer.set_closed()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a node is stuck"
        if stress.errors:
            raise stress.errors[0]
        formed = check_rounds(stress)
        print(
            f"rounds formed: {formed}, admissions: {len(stress.entries)}, deaths: {stress.deaths}, "
            f"re-joins: {stress.rejoins}, waiting leases revoked: {stress.lease_kills}, "
            f"fake joiners: {len(stress.fakes)}, named but gone at the seal: {stress.named_gone} "
            f"(of them reported a rank: {stress.named_gone_ranked})"
        )
        assert formed >= MIN_ROUNDS
        assert stress.deaths > 0 and stress.rejoins > 0
    finally:
        stress.stop.set()
        stress.close()
