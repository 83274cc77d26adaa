"""The etcd key layout of one ``etcd-v3`` rendezvous run.

Every key lives under ``<key_prefix>/<run_id>/v3/``::

    ctl/abort                     "1" once the run is aborted: closed,  (run lease)
                                  and every running agent stops now
    ctl/closed                    "1" once the run is closed            (run lease)
    ctl/sealed                    JSON: last sealed round, its members; (run lease)
                                  its mod_revision is the fencing token
    join/<round>/<node_id>        JSON {addr, pid, port}: node_id waits (node lease)
                                  for or belongs to <round>; create_revision orders joins
    rounds/<round>/members        JSON list of node ids, rank order     (run lease)
    rounds/<round>/start-acks/<node_id> empty: a member confirmed the round   (run lease)
    rounds/<round>/start          "go" or "void": the round's fate      (run lease)
    rounds/<round>/store/...      the round's EtcdStore
    run                           hex id of the run lease               (run lease)
    seq/<round>                   empty; its version counts the joins   (no lease)
                                  and withdrawals of <round>

``<round>`` is zero-padded to 10 digits so that byte order is round order and a
whole range of rounds is one ``[start, end)`` interval. ``ctl/`` holds exactly what
a waiting node watches; joins, stores and the join counter live outside it. As
``ctl/`` sorts just before ``join/``, one watch on ``[ctl/, join/<T>/)``
(:meth:`RunKeys.watch_range`) covers the control records and the join keys of the
rounds before ``T`` (only ``T - 1`` can hold any): what a seal candidate of ``T``
watches while ``T - 1`` still has members.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from etcd_store.client import prefix_range_end

log = logging.getLogger(__name__)

__all__ = ["RunKeys"]

_ROUND_DIGITS = 10


def _round(number: int) -> str:
    if not 0 <= number < 10**_ROUND_DIGITS:
        raise ValueError(f"round number out of range: {number}")
    return f"{number:0{_ROUND_DIGITS}d}"


@dataclass(frozen=True)
class RunKeys:
    """Key names (bytes) of one run; ``root`` is ``<key_prefix>/<run_id>/v3``."""

    root: str

    @classmethod
    def for_run(cls, key_prefix: str, run_id: str) -> RunKeys:
        if "/" in run_id:
            raise ValueError(f"The rendezvous run id must not contain '/', got {run_id!r}.")
        base = f"{key_prefix.rstrip('/')}/{run_id}" if key_prefix else run_id
        return cls(f"{base}/v3")

    # ------------------------------------------------------------------ ctl/

    @property
    def ctl(self) -> bytes:
        """Prefix of everything a waiting node watches."""
        return f"{self.root}/ctl/".encode()

    @property
    def ctl_end(self) -> bytes:
        return prefix_range_end(self.ctl)

    @property
    def closed(self) -> bytes:
        return f"{self.root}/ctl/closed".encode()

    @property
    def abort(self) -> bytes:
        """Written with (or after) ``closed`` by the operator's stop (``etcd-rdzv close``):
        the run is over for the members that still run too (see ``protocol.abort``)."""
        return f"{self.root}/ctl/abort".encode()

    @property
    def run(self) -> bytes:
        """The run lease's id (outside ``ctl/``: waiting nodes need not hear it created)."""
        return f"{self.root}/run".encode()

    @property
    def sealed(self) -> bytes:
        return f"{self.root}/ctl/sealed".encode()

    @property
    def join_root(self) -> bytes:
        return f"{self.root}/join/".encode()

    def join_prefix(self, round_: int) -> bytes:
        return f"{self.root}/join/{_round(round_)}/".encode()

    def join_key(self, round_: int, node_id: str) -> bytes:
        return self.join_prefix(round_) + node_id.encode()

    def parse_join_key(self, key: bytes) -> tuple[int, str] | None:
        """``(round, node_id)`` of a join key, None for any other key."""
        root = self.join_root
        if not key.startswith(root):
            return None
        rest = key[len(root) :].decode(errors="replace")
        number, sep, node_id = rest.partition("/")
        if not sep or not number.isdigit() or not node_id:
            return None
        return int(number), node_id

    def watch_range(self, round_: int, previous: bool) -> tuple[bytes, bytes]:
        """``[start, end)`` a node waiting in ``round_`` watches: ``ctl/`` alone, or with
        ``previous`` also the join keys of the rounds before ``round_`` (see the module
        docstring)."""
        return self.ctl, (self.join_prefix(round_) if previous else self.ctl_end)

    # ------------------------------------------------------------------ seq/

    @property
    def seq_root(self) -> bytes:
        return f"{self.root}/seq/".encode()

    def seq(self, round_: int) -> bytes:
        """The join counter of ``round_``: every join and every withdrawal bumps its version."""
        return f"{self.root}/seq/{_round(round_)}".encode()

    def seqs_through(self, round_: int) -> tuple[bytes, bytes]:
        """``[start, end)`` of the join counters of rounds up to ``round_`` included."""
        return self.seq_root, self.seq(round_ + 1)

    # ------------------------------------------------------------------ rounds/

    @property
    def rounds(self) -> bytes:
        return f"{self.root}/rounds/".encode()

    def round_prefix(self, round_: int) -> bytes:
        return f"{self.root}/rounds/{_round(round_)}/".encode()

    def members(self, round_: int) -> bytes:
        return self.round_prefix(round_) + b"members"

    def acks_prefix(self, round_: int) -> bytes:
        """Where the members of a sealed round confirm it (:mod:`~etcd_rdzv.native.start`)."""
        return self.round_prefix(round_) + b"start-acks/"

    def ack(self, round_: int, node_id: str) -> bytes:
        return self.acks_prefix(round_) + node_id.encode()

    def start(self, round_: int) -> bytes:
        """The fate of a sealed round, put once: ``go`` (every member confirmed) or ``void``."""
        return self.round_prefix(round_) + b"start"

    def store_prefix(self, round_: int) -> str:
        """The ``EtcdStore`` prefix of a round (a str, as the store takes it)."""
        return f"{self.root}/rounds/{_round(round_)}/store"

    def rounds_before(self, round_: int) -> tuple[bytes, bytes]:
        """``[start, end)`` of every ``rounds/`` key of rounds older than ``round_``."""
        return self.rounds, self.round_prefix(max(round_, 0))
