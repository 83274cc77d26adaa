"""``Presence``: an etcd-v2 node's liveness as a key on a short lease, judged on etcd's clock.

torch's handler judges a member of a running round by the heartbeat stored in the state, written
every ``keep_alive_interval`` and read on the reader's clock, so a node that hangs (SIGSTOP, a host
that stops without closing its connections) is found dead only when that heartbeat is
``member_expiry`` old (16 s by default). Here each node also keeps ``<state key>/alive/<node>`` on a
lease of ``presence_ttl`` seconds (default 3), renewed every sixth of it by the client's keep-alive
stream (the one the client already has). etcd's leader deletes the key once no renewal reached it
for the TTL: the judgement is etcd's, on etcd's clock, and etcd extends every lease when a new
leader takes over, so an election or a quorum loss drops nobody.

An observer (a member of a completed round of rank below :data:`OBSERVERS`) reads the run's
presence keys at most every :attr:`Presence.period` seconds while it trains; a member whose key it
once read and no longer finds is dead (:meth:`Presence.departed`), and its handler reports a waiting
node, so the round is re-formed without it. A member whose key it never read (a node of an older
etcd-rdzv, torch's own handler on this backend, a key not written because etcd refused it) is
judged by its heartbeat only, as before.

False drops: a live node's renewals reach etcd at most ``interval + answer bound + reconnect``
apart (0.5 s + 1 s + the reconnect with the default TTL: a keep-alive stream that hears no answer
for the answer bound moves to another member, :mod:`etcd_store.client.leases`), under the 3 s TTL.
A node dropped all the same (its lease expired) sees its round end in ``num_nodes_waiting()``, puts
its key anew and joins the next round: one restart, never a stranded node. An observer judges only
from a read that holds its own key under the lease it holds: when its own key is gone (etcd
unreachable from it for a TTL, so every key it reads may have expired for the same reason), it
forgets whom it has seen and judges nobody until it sees them again after its own key is back;
a member that died meanwhile is then judged by its heartbeat, as one never seen.

Costs: per node one LeaseGrant and one Put when it first joins (again only after its lease was
lost), one keep-alive per ``period`` on the client's stream; per observer one keys-only Range of
the run's presence keys per ``period`` while its round runs (at most :data:`OBSERVERS` per run);
:meth:`Presence.leave` revokes the lease (one RPC), so a node that ends is gone at once. Every call
is bounded by the client's timeout; an etcd error is logged and judged as no news (never a drop).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable

from etcd_store.client import EtcdClient, Session, renewing_lease
from etcd_store.errors import EtcdError

from ..conf import V2_PRESENCE_DIR

log = logging.getLogger(__name__)

__all__ = ["OBSERVERS", "Presence", "presence_period"]

OBSERVERS = 4
"""The members of ranks ``0 .. OBSERVERS - 1`` of a completed round read the presence keys: one
that finds a member gone re-forms the round, which every other member then sees."""


def presence_period(ttl: int) -> float:
    """Seconds between two renewals of a presence lease of ``ttl``, and between two reads of an
    observer: a sixth of the TTL, at least 0.2 s (0.5 s for the default 3 s)."""
    return max(ttl / 6.0, 0.2)


class Presence:
    """This node's presence key and an observer's view of the run's keys.

    Args:
        client: the client of the run's backend (its keep-alive stream renews the lease).
        state_key: the run's state key; the keys are ``<state_key>/alive/<node name>``.
        ttl: the lease TTL in seconds (at least 2: etcd's shortest lease is about 1.5 s).

    Thread-safe. Nothing here raises an etcd error: a failed call is logged and changes nothing.
    """

    def __init__(self, client: EtcdClient, state_key: str, ttl: int) -> None:
        if ttl < 2:
            raise ValueError(f"presence_ttl must be 0 (off) or at least 2 seconds, got {ttl}")
        self._client = client
        self._dir = f"{state_key}/{V2_PRESENCE_DIR}/"
        self.ttl = ttl
        self.period = presence_period(ttl)
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._own: str | None = None  # this node's name, once ensure() put its key
        self._seen: set[str] = set()
        self._present: frozenset[str] = frozenset()
        self._read_at = -math.inf
        self._trusted_from = -math.inf  # monotonic time from which a read may judge (own key held)

    def key(self, name: str) -> bytes:
        """The presence key of the node named ``name`` (``str`` of torch's ``_NodeDesc``)."""
        return (self._dir + name).encode()

    def ensure(self, name: str) -> bool:
        """Keep the key of node ``name`` alive: one LeaseGrant and one Put when it has no live lease
        (the first call, or after the lease was lost), else nothing. Returns whether the key is kept.

        Blocks at most twice the client's timeout; an etcd error is logged (the node is then judged
        by its heartbeat) and returns False. A lease refused because another user attached a key to
        it first is replaced once (:func:`~etcd_store.client.renewing_lease`).
        """
        with self._lock:
            session = self._session
            if session is not None and not session.done().is_set():
                return True
            if session is not None:
                self._forget_seen()  # its own lease was lost: so may everyone's have been
            self._session = None
            self._own = name
            key = self.key(name)
            made: list[Session] = []

            def grant() -> int:
                made.append(self._client.session(self.ttl, interval=self.period))
                return made[-1].id

            def forget(lease: int) -> None:
                for s in made:
                    if s.id == lease:
                        s.close(revoke=False)

            try:
                renewing_lease(lambda lease: self._client.put(key, b"", lease=lease), grant, forget, renewals=1)
            except EtcdError as e:
                for s in made:
                    s.close()
                log.warning("node %s: could not put its presence key %r (%s); it is judged by its heartbeat "
                            "only until the next attempt", name, key.decode(), e)
                return False
            self._session = made[-1]
            return True

    def leave(self) -> None:
        """Revoke this node's lease (its key goes at once); one RPC of at most a TTL (the lease would
        expire by then anyway), never raises. Idempotent."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close(timeout=self.ttl)

    def departed(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, those whose key this view once read and its latest read lacks, sorted.

        Reads as :meth:`present` does; with no read younger than a TTL, nobody is reported (the
        observer cannot tell who renewed).
        """
        present = self.present()
        if present is None:
            return []
        with self._lock:
            return sorted(n for n in names if n in self._seen and n not in present)

    def _forget_seen(self) -> None:
        """This view lost its own key: judge nobody from reads before it is back, and nobody it
        has not read since (call with the lock held)."""
        self._seen.clear()
        self._present = frozenset()
        self._read_at = -math.inf
        self._trusted_from = math.inf

    def present(self) -> frozenset[str] | None:
        """The names whose key the latest read found; None when no read succeeded within a TTL,
        or when this node's own key has been back for less than a TTL after it was lost (the others
        cut off with it may not have put theirs back yet).

        Reads the presence keys (one keys-only Range, at most a TTL long) when the last read is older
        than :attr:`period`; a read that fails is logged and keeps the last one, which ages.
        """
        now = time.monotonic()
        with self._lock:
            stale = now - self._read_at >= self.period
        if stale:
            self._read(now)
        with self._lock:
            now = time.monotonic()
            if now - self._read_at > self.ttl or now - self._trusted_from < self.ttl:
                return None
            return self._present

    def _read(self, started: float) -> None:
        try:
            # Bounded by the TTL, not the client's timeout: a read that takes longer is no news.
            found = self._client.range(self._dir.encode(), prefix=True, keys_only=True, timeout=self.ttl)
        except EtcdError as e:
            log.info("could not read the presence keys under %r: %s", self._dir, e)
            return
        present = frozenset(kv.key.decode(errors="replace")[len(self._dir):] for kv in found.kvs)
        with self._lock:
            if self._own is not None and self._own not in present:
                # Its own key is gone although its keep-alive stream may not know yet: the others'
                # may be gone for the same reason (etcd unreachable from here), so this read judges
                # nobody, and nobody is judged before being read again once the key is back.
                self._forget_seen()
                return
            if self._trusted_from == math.inf:
                self._trusted_from = started  # the first read with its key back
            self._present = present
            self._seen |= present
            self._read_at = started
