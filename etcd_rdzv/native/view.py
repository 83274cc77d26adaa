"""The round view of ``etcd-v3``: what a waiting node knows, folded from its watch.

A node that joins round ``T`` watches the run's ``ctl/`` keys from "now", on a
watch that etcd confirmed before the join Txn was sent (so it starts below the join's
revision; its events at or below that revision are not folded in: the join's compares
saw that state). While it may have to tell when ``T - 1`` empties (a seal candidate,
or a node kept out by a full group), it watches the join keys of ``T - 1`` too
(:meth:`~etcd_rdzv.native.keys.RunKeys.watch_range`), on a watch opened after the
join, whose gap one read covers (:meth:`RoundView.catch_up`). It never watches the
joins of its own round: it sees about one event per round (the ``sealed``
record, which names the members), plus one per departure from ``T - 1`` when it
watches those. :class:`RoundView` starts from the join's answer and folds
every event in order (no RPC, no clock), and takes in the reads of a seal
candidate (:meth:`RoundView.update`). Events that end the wait come back as a
:class:`Signal`. Raises :class:`~etcd_rdzv.native.records.ProtocolStateError`
on records the protocol never writes.

Two rules keep every revision counted once, and only the second is the view's own:

* **The synced rule** (the client's :class:`~etcd_store.client.synced.SyncedWatch`,
  applied by :class:`~etcd_rdzv.native.wait.RoundWait`): the events a watch delivers at
  or below the last read that covered its gap (the join, or a catch-up read) never reach
  :meth:`RoundView.apply`. That read stands for every key the watch covers, control
  records included.
* **Absolute counts** (``counted_through``): a read of the round at revision X
  (:meth:`RoundView.update`: a seal candidate's, or a failed seal's answer) holds the
  number of join keys of ``T - 1`` at X, so join-key events at or below X are not
  counted again. It is not a synced read: the watch was confirmed long before it, and
  the wait does not take ``sealed``/``closed`` from it but waits for their events, so
  control events at or below X must still reach the view. Hence a revision of its own
  next to the synced watch's, for the counts only.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from etcd_store.client import Event

from .keys import RunKeys
from .queries import CatchUp, RoundRead
from .records import Membership, Sealed

log = logging.getLogger(__name__)

__all__ = ["RoundView", "Signal", "SignalKind"]


class SignalKind(enum.Enum):
    SEALED = "sealed"  # ctl/sealed changed: see Signal.sealed
    CLOSED = "closed"  # ctl/closed (or ctl/abort, written with or after it) appeared
    RESET = "reset"  # ctl/sealed vanished (the run lease expired)


@dataclass(frozen=True)
class Signal:
    kind: SignalKind
    sealed: Sealed = Sealed()

    @property
    def round(self) -> int:
        return self.sealed.round

    @property
    def membership(self) -> Membership | None:
        return self.sealed.membership


class RoundView:
    """What a node waiting in round ``T`` knows (see the module docstring).

    ``seq`` and ``create_revision``: this node's sequence number and key create
    revision in ``T`` (from its join; with the sealed record they give its rank).
    ``count``: join keys of ``T`` as of the join or the latest read;
    ``prev_count``: join keys left in ``T - 1`` (kept current by the watch when it
    covers them); ``changes``: how many times the view changed; ``read``: the
    latest read of the round, while nothing changed since (else None).
    """

    def __init__(
        self,
        keys: RunKeys,
        round_: int,
        node_id: str,
        seq: int,
        create_revision: int,
        count: int,
        prev_count: int,
        revision: int,
    ) -> None:
        self.keys = keys
        self.round = round_
        self.node_id = node_id
        self.seq = seq
        self.create_revision = create_revision
        self.count = count
        self.prev_count = prev_count
        self.revision = revision
        self.changes = 0
        self.read: RoundRead | None = None
        # Join-key events of the previous round at or below this revision are already counted:
        # the join's or a catch-up read's (the synced watch skips those anyway), or a later read
        # of the round (update) whose counts are absolute (see the module docstring).
        self.counted_through = revision

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def update(self, read: RoundRead) -> None:
        """Take in a read of the round (a candidate's, or a failed seal's answer).

        Its counts are absolute at its revision X: join-key events at or below X that the watch
        delivers later are already in them (skipped, and the read stays fresh). Control events
        are not skipped: the caller settles on what the read shows of ``sealed`` and ``closed``
        and waits for their events, which the watch delivers whatever their revision.
        """
        self.count, self.prev_count, self.read = read.count, read.prev_count, read
        self.revision = max(self.revision, read.revision)
        self.counted_through = max(self.counted_through, read.revision)
        self.changes += 1

    def catch_up(self, read: CatchUp, *, expect_sealed: bool) -> Signal | None:
        """Take in a read that covers the gap between the view's revision and the start of a
        watch opened after it (read, not watched: the wider watch opened after the join).

        A ``sealed`` or ``closed`` record written after the view's revision (the join's, or a
        later read's) gives its signal, as its event would have (a ``sealed`` record gone
        since, when the join saw one, is the RESET its delete would have given); the previous
        round's count is taken as read. The caller's synced watch skips the events at or
        below the read's revision from now on (``SyncedWatch.read_at``): the read holds them.
        """
        since = self.revision  # everything at or below it is in the view already
        self.prev_count = read.prev_count
        self.counted_through = max(self.counted_through, read.revision)
        self.revision = max(self.revision, read.revision)
        self.changes += 1
        self.read = None
        return self._caught(read, since, expect_sealed=expect_sealed)

    def _caught(self, read: CatchUp, since: int, *, expect_sealed: bool) -> Signal | None:
        control = {kv.key: kv for kv in read.control}
        for key in (self.keys.closed, self.keys.abort):
            closed = control.get(key)
            if closed is not None and closed.mod_revision > since:
                return self._control(Event("PUT", closed))
        sealed = control.get(self.keys.sealed)
        if sealed is None:
            return Signal(SignalKind.RESET) if expect_sealed else None
        return self._control(Event("PUT", sealed)) if sealed.mod_revision > since else None

    def apply(self, event: Event) -> Signal | None:
        """Fold one watch event into the view; a :class:`Signal` when it ends the wait.

        ``event`` is above the last synced read (the caller's
        :class:`~etcd_store.client.synced.SyncedWatch` skipped the others)."""
        kv = event.kv
        key = kv.key
        parsed = self.keys.parse_join_key(key)
        self.revision = max(self.revision, kv.mod_revision)
        if key in (self.keys.sealed, self.keys.closed, self.keys.abort):
            return self._control(event)
        if parsed is None or parsed[0] != self.round - 1:
            return None
        if kv.mod_revision <= self.counted_through:
            return None  # a later read of the round already counted it
        self.changes += 1
        self.read = None
        if event.type == "DELETE":
            self.prev_count -= 1
        elif kv.version == 1:
            self.prev_count += 1
        return None

    def _control(self, event: Event) -> Signal | None:
        kv = event.kv
        if kv.key == self.keys.sealed:
            if event.type == "DELETE":
                return Signal(SignalKind.RESET)
            return Signal(SignalKind.SEALED, Sealed.from_kv(kv))
        return Signal(SignalKind.CLOSED) if event.type == "PUT" else None
