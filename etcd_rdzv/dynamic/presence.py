"""``Presence``: an etcd-v2 node's liveness as a key on a short lease, judged on etcd's clock.

torch judges a member by its heartbeat in the state, on the reader's clock, so a hung node (SIGSTOP,
a host gone silent) is found only after ``member_expiry`` (16 s by default). Here each node also
keeps ``<state key>/alive/<node>`` on a lease of ``presence_ttl`` (default 3 s), renewed every sixth
of it on the client's keep-alive stream. etcd's leader deletes the key after a TTL without renewal:
etcd's clock decides, and a new leader extends every lease, so an election or a quorum loss drops
nobody. An observer (rank below :data:`OBSERVERS` of a completed round) reads the keys at most every
:attr:`Presence.period`; a member whose key it once read and then finds in no read for
:attr:`Presence.grace` (half a TTL) is dead (:meth:`Presence.departed`); one it never read (an older
etcd-rdzv, torch's own handler) is judged by its heartbeat only.

False drops: a live node's renewals reach etcd at most ``interval + answer bound + reconnect``
apart (0.5 + 1 s + reconnect by default), under the 3 s TTL; a node dropped all the same sees its
round end and joins the next one (never stranded). An observer judges only from a read holding its
own key: without it (etcd unreachable for a TTL, so others' keys may have expired for the same
reason) it judges nobody until it reads them again with its key back. etcd may also end a live
node's lease: a leader paused for about a TTL revokes, when it resumes, the leases it finds expired on
its own stale clock, and that revoke can commit before it steps down (etcd-io/etcd#15247); some nodes
lose their key, others keep theirs. Such a stall shows in the observer's own renewals too, so it
judges only after a TTL of steady ones (:meth:`Presence._steady`); and the node learns of its lost
lease at its next answered keep-alive and puts its key again at its next poll, so an absence must last
the grace to count. docs/operations.md
("etcd-v2's sealed rounds") has the measurements.

Costs: per node one LeaseGrant and one Put at its first join (again only after a lost lease) and a
keep-alive per ``period``; per observer one keys-only Range per ``period`` while its round runs;
:meth:`Presence.leave` one revoke. Every call is bounded by the client's timeout; an etcd error is
logged and counts as no news (never a drop).
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
"""Members of ranks ``0 .. OBSERVERS - 1`` of a completed round read the presence keys; one that finds
a member gone re-forms the round, which every other member then sees."""


def presence_period(ttl: int) -> float:
    """Seconds between renewals of a presence lease of ``ttl``, and between an observer's reads: a sixth
    of the TTL, at least 0.2 s."""
    return max(ttl / 6.0, 0.2)


class Presence:
    """This node's presence key and an observer's view of the run's keys.

    ``client``: the backend's (its keep-alive stream renews the lease); keys are
    ``<state_key>/alive/<node name>``; ``ttl`` at least 2 s (etcd's shortest lease is about 1.5 s).
    Thread-safe; never raises an etcd error (a failed call is logged and changes nothing).
    """

    def __init__(self, client: EtcdClient, state_key: str, ttl: int) -> None:
        if ttl < 2:
            raise ValueError(f"presence_ttl must be 0 (off) or at least 2 seconds, got {ttl}")
        self._client = client
        self._dir = f"{state_key}/{V2_PRESENCE_DIR}/"
        self.ttl = ttl
        self.period = presence_period(ttl)
        #: Seconds a member's key must be missing from every read before it counts as departed.
        self.grace = ttl / 2.0
        #: A gap between our own renewals longer than this: etcd (or our way to it) stalled.
        self.stall = 3.0 * self.period
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._own: str | None = None  # this node's name, once ensure() put its key
        self._seen: set[str] = set()
        self._missing_since: dict[str, float] = {}  # seen members the reads lack: the first such read's start
        self._present: frozenset[str] = frozenset()
        self._read_at = -math.inf
        self._trusted_from = -math.inf  # monotonic time from which a read may judge (own key held)

    def key(self, name: str) -> bytes:
        """The presence key of the node named ``name`` (``str`` of torch's ``_NodeDesc``)."""
        return (self._dir + name).encode()

    def ensure(self, name: str) -> bool:
        """Keep the key of node ``name`` alive: one LeaseGrant and one Put when it has no live lease, else
        nothing. Whether the key is kept.

        Blocks at most twice the client's timeout; an etcd error is logged and returns False (the node is
        then judged by its heartbeat). A lease refused (another user's key on it) is replaced once.
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
        """Revoke this node's lease (its key goes at once); one RPC bounded by a TTL; never raises; idempotent."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close(timeout=self.ttl)

    def departed(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, those whose key this view once read and every read of the last :attr:`grace`
        lacks, sorted; nobody without a read younger than a TTL (see :meth:`present`)."""
        if self.present() is None:
            return []
        with self._lock:
            since = self._missing_since
            return sorted(n for n in names if n in since and self._read_at - since[n] >= self.grace)

    def _forget_seen(self) -> None:
        """Our own key was lost: judge nobody from reads before it is back, nor anybody not read since
        (lock held)."""
        self._seen.clear()
        self._missing_since.clear()
        self._present = frozenset()
        self._read_at = -math.inf
        self._trusted_from = math.inf

    def present(self) -> frozenset[str] | None:
        """The names whose key the latest read found; None without a successful read within a TTL, or while
        our own key has been back for less than a TTL (others cut off with us may not be back yet).

        Reads (one keys-only Range, bounded by a TTL) when the last read is older than :attr:`period`; a
        failed read is logged and the last one ages.
        """
        now = time.monotonic()
        with self._lock:
            stale = now - self._read_at >= self.period
        if stale:
            self._read(now)
        with self._lock:
            now = time.monotonic()
            if now - self._read_at > self.ttl or now - self._trusted_from < self.ttl or not self._steady(now):
                return None
            return self._present

    def _steady(self, now: float) -> bool:
        """Whether our own lease was renewed at most :attr:`stall` apart through the last TTL (lock held).

        After a stall of etcd (a paused leader, an election) others' leases may have ended for the same
        reason, and their owners learn it only when their own streams recover: judge nobody until a TTL
        of steady renewals has passed. No RPC."""
        session = self._session
        if session is None:
            return False
        times = session.renewed_at()  # oldest first
        first = next((i for i, t in enumerate(times) if t >= now - self.ttl), len(times))
        points = [*times[max(first - 1, 0):], now]  # the renewals of the last TTL and the one before
        return all(b - a <= self.stall for a, b in zip(points, points[1:], strict=False))

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
                # Own key gone (the stream may not know yet): the others' may be gone for the same
                # reason, so judge nobody until they are read again with our key back.
                self._forget_seen()
                return
            if self._trusted_from == math.inf:
                self._trusted_from = started  # the first read with its key back
            for name in self._seen - present:
                self._missing_since.setdefault(name, started)
            for name in present:
                self._missing_since.pop(name, None)
            self._present = present
            self._seen |= present
            self._read_at = started
