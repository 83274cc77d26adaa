"""The round view of ``etcd-v3``: what a waiting node knows, folded from its watch.

A node that joined round ``T`` watches the run's ``ctl/`` keys from the revision
right after its join. :class:`RoundView` starts from the join's answer and folds
every event in order (no RPC, no clock); at the revision ``S`` of the ``sealed``
event for ``T`` it equals the join set at ``S``, which is the membership rule of
:mod:`etcd_rdzv.native.protocol`. Events that end the wait come back as a
:class:`Signal`. Raises :class:`~etcd_rdzv.native.records.ProtocolStateError`
on records the protocol never writes.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from etcd_store.client import Event

from .keys import RunKeys
from .records import ProtocolStateError, decode_sealed

log = logging.getLogger(__name__)

__all__ = ["RoundView", "Signal", "SignalKind"]


class SignalKind(enum.Enum):
    SEALED = "sealed"  # ctl/sealed changed: see Signal.round / .revision / .run_lease
    CLOSED = "closed"  # ctl/closed appeared
    LOST = "lost"  # our own join key vanished (our lease expired)
    RESET = "reset"  # ctl/sealed or ctl/run vanished (the run lease expired)


@dataclass(frozen=True)
class Signal:
    kind: SignalKind
    round: int = 0
    revision: int = 0
    run_lease: int | None = None
    master: tuple[str, int] | None = None


class RoundView:
    """What a node waiting in round ``T`` knows, rebuilt from its gap-free watch on ``ctl/``.

    Starts from the counts of :func:`join` (``before``: join keys of ``T`` created
    before ours; ``prev_count``: join keys of ``T - 1``) and applies every event
    after the join revision in order. At the revision ``S`` of the ``sealed``
    event for ``T`` the view equals the join set at ``S``: our rank is
    ``before``, the round's size ``min(count, max_nodes)``. Keys created after
    ours are tracked by name (their deletion must not lower ``before``).
    """

    def __init__(
        self,
        keys: RunKeys,
        round_: int,
        node_id: str,
        create_revision: int,
        before: int,
        prev_count: int,
        revision: int,
    ) -> None:
        self.keys = keys
        self.round = round_
        self.node_id = node_id
        self.create_revision = create_revision
        self.before = before
        self.after: dict[str, int] = {}
        self.prev_count = prev_count
        self.revision = revision
        self.join_revision = revision  # our join's revision: our key's mod revision
        self.changes = 0

    @property
    def count(self) -> int:
        """Join keys of this round, ours included."""
        return self.before + 1 + len(self.after)

    @property
    def vacated(self) -> bool:
        """Whether no node remains in the previous round (so this one may be sealed)."""
        return self.prev_count <= 0

    def members_after_us(self) -> list[str]:
        """Node ids that joined after us, in join order."""
        return [name for name, _ in sorted(self.after.items(), key=lambda item: item[1])]

    def apply(self, event: Event) -> Signal | None:
        """Fold one watch event into the view; a :class:`Signal` when it ends the wait."""
        kv = event.kv
        self.revision = max(self.revision, kv.mod_revision)
        key = kv.key
        if key == self.keys.sealed:
            if event.type == "DELETE":
                return Signal(SignalKind.RESET, revision=kv.mod_revision)
            round_, run_lease, master = decode_sealed(kv.value, key)
            return Signal(SignalKind.SEALED, round_, kv.mod_revision, run_lease, master)
        if key == self.keys.closed:
            return Signal(SignalKind.CLOSED, revision=kv.mod_revision) if event.type == "PUT" else None
        if key == self.keys.run:
            return Signal(SignalKind.RESET, revision=kv.mod_revision) if event.type == "DELETE" else None
        parsed = self.keys.parse_join_key(key)
        if parsed is None:
            return None
        round_, name = parsed
        if round_ == self.round - 1:
            self.changes += 1
            self.prev_count += -1 if event.type == "DELETE" else (1 if kv.version == 1 else 0)
            return None
        if round_ != self.round:
            return None
        if name == self.node_id:
            if event.type == "DELETE":
                return Signal(SignalKind.LOST, revision=kv.mod_revision)
            return None
        self.changes += 1
        if event.type == "PUT":
            if kv.create_revision > self.create_revision:
                self.after[name] = kv.create_revision
        elif self.after.pop(name, None) is None:
            self.before -= 1
            if self.before < 0:
                raise ProtocolStateError(
                    f"round {self.round}: more earlier joiners left than had joined"
                )
        return None
