"""``KeepAlives``: the keep-alive streams of one client, refreshing every lease its sessions keep.

One bidirectional ``LeaseKeepAlive`` stream, as etcd Go's ``clientv3`` lessor: a timer heap holds
each lease's next refresh (a third of the TTL etcd last reported, at least 0.2 s, unless its session
set a pace); answers are routed to sessions by lease ID. Costs: no thread or stream per session; one
task on the stream loop (:mod:`.reactor`) and one stream while any lease is kept (opened when the
first refresh is due, so a burst of grants opens none; half-closed when the last is dropped); one
request per lease per interval, however many sessions keep it.

A broken stream is reopened on the next endpoint, every lease refreshed at once. So is a stream owing
answers that heard none for :meth:`KeepAlives.answer_bound` seconds, so a member answering nothing
(hung host, SIGSTOPped etcd: HTTP/2 keepalive takes 15 s or more, if ever) is left well before the
lease expires. A lease is given up when etcd answers TTL 0 (lost), or when none of its keep-alives
was answered for a whole TTL (presumed lost, etcd Go's lessor rule: :meth:`KeepAlives._check_deadlines`,
a loop timer no stream task can fail to run; etcd is asked once first, so a process merely slow to
read answers keeps its lease).

Nothing blocks a caller: :meth:`KeepAlives.keep`/:meth:`KeepAlives.drop` take a lock and wake the
task. Session callbacks (lease lost, TTL learnt) run on the loop, outside the lock, and must not
block; ``stopped`` runs in the thread closing the client (or on the loop, on a final failure).

etcd answers one stream's requests in order, and its leader holds each renewal until it applied
every committed entry (up to 1 s), so under a write burst one stream renews about one lease per
apply: hundreds would be renewed late and expire. Hence one more stream (same channel) per
:data:`LEASES_PER_STREAM` sessions (:meth:`~.calls.LeaseCalls.keep_alives`).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import threading
import time
from typing import Any, Protocol

import grpc
from etcd3.etcdrpc import rpc_pb2

from ..errors import EtcdError, EtcdLeaseNotFound
from .channels import Member
from .reactor import started
from .retry import stall_bound
from .streams import CallCancelled, Ended, ReconnectingStream, SendFailed, StreamEnded, send, step
from .transport import Transport

log = logging.getLogger(__name__)

__all__ = ["LEASES_PER_STREAM", "KeepAlives", "answer_bound", "refresh_interval"]

#: The shortest pause between two keep-alives of one lease.
MIN_INTERVAL = 0.2
#: The least time a keep-alive stream that owes answers may hear none (etcd's leader holds a
#: renewal up to about 1 s until it has applied every committed entry).
MIN_ANSWER_BOUND = 1.0
#: Leases one keep-alive stream refreshes (or has promised to new sessions) before a client opens another.
LEASES_PER_STREAM = 32


def refresh_interval(ttl: float) -> float:
    """Seconds between two keep-alives of a lease with ``ttl``: a third of it, at least 0.2 s."""
    return max(ttl / 3.0, MIN_INTERVAL)


def answer_bound(interval: float, first_attempt: float) -> float:
    """Seconds a keep-alive stream owing answers may hear none before moving to the next member:
    the shortest refresh ``interval`` (a third of a TTL), at most ``first_attempt``, at least
    :data:`MIN_ANSWER_BOUND`; so a lease is refreshed through another member before two thirds
    of its TTL pass since its last answer (plus the reconnect)."""
    return max(min(interval, first_attempt), MIN_ANSWER_BOUND)


class Keeper(Protocol):
    """What :class:`KeepAlives` tells a session (on the loop for the first two: must not block)."""

    def _lease_lost(self, lease_id: int, primary: bool, confirmed: bool = True) -> None: ...

    def _learn_ttl(self, ttl: int) -> None: ...

    def _stopped(self, reason: BaseException) -> None: ...


class _Kept:
    """One kept lease: its pace and its keepers (``True``: the session's own lease, ``False``:
    an extra, ``Session.keep_also``)."""

    __slots__ = ("deadline", "due", "fixed", "id", "interval", "keepers", "ttl_pace")

    def __init__(self, lease_id: int, interval: float, due: float, fixed: bool = False,
                 ttl_pace: float | None = None, deadline: float = float("inf")) -> None:
        self.id = lease_id
        self.interval = interval
        self.due = due
        # surely expired by then if no keep-alive is answered: last answer (or keep) + TTL;
        # inf for an extra lease whose TTL no answer told yet
        self.deadline = deadline
        self.fixed = fixed  # a pace asked for by a session: the TTL etcd reports does not change it
        # a third of etcd's last TTL: the answer bound's basis, even under a session's faster pace
        self.ttl_pace = interval if ttl_pace is None else ttl_pace
        self.keepers: dict[Keeper, bool] = {}


class KeepAlives:
    """The keep-alive multiplexer of one client (see the module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()  # the state below; never held across an await
        self._leases: dict[int, _Kept] = {}
        self._heap: list[tuple[float, int, int]] = []  # (due, tie-breaker, lease id); stale items skipped
        self._ties = itertools.count()
        self._running = False  # a task runs (or is about to) on the stream loop
        self._task: asyncio.Task[None] | None = None  # that task, once started (on the loop)
        self._poked = False  # on the loop: the state changed since the task last looked
        self._napping: asyncio.Future[None] | None = None  # on the loop: what the task's nap awaits
        self._halted = False
        self.streams_opened = 0
        self._reserved = 0  # sessions given this multiplexer that have not called keep() yet
        self._owed = 0  # requests of the current stream not answered yet
        self._owed_since = 0.0  # when the stream last progressed while owing (a request, an answer)
        self.streams_stalled = 0  # streams ended because they answered nothing in time
        self._stalls_in_row = 0  # of those, since the last answer (the answer bound doubles: retry.stall_bound)
        self._deadline_timer: asyncio.TimerHandle | None = None  # on the loop: the next lease deadline
        self._reconnecting: ReconnectingStream | None = None  # the task's stream loop (told of answers)
        #: Leases given up as lost because etcd answered none of their keep-alives for their TTL.
        self.deadlines_passed = 0

    # ------------------------------------------------------------------ callers' side

    def keep(self, keeper: Keeper, lease_id: int, ttl: int, *, first_in: float, primary: bool = True,
             interval: float | None = None) -> None:
        """Refresh ``lease_id`` for ``keeper`` from ``first_in`` seconds on (sooner if already kept),
        every ``interval`` (at least :data:`MIN_INTERVAL`), default a third of its TTL."""
        with self._lock:
            self._reserved = max(self._reserved - 1, 0)
            closed = self._halted or self._transport.closed
            if not closed:
                pace = refresh_interval(ttl) if interval is None else max(interval, MIN_INTERVAL)
                now = time.monotonic()
                self._add_locked(keeper, lease_id, pace, now + max(first_in, 0.0), primary,
                                 fixed=interval is not None, ttl_pace=refresh_interval(ttl), deadline=now + ttl)
        if closed:
            keeper._stopped(EtcdError(f"The etcd client for {self._transport.describe()} is closed."))

    def keep_with(self, keeper: Keeper, own: int, lease_id: int) -> None:
        """Refresh ``lease_id`` for ``keeper`` too, first together with its lease ``own``."""
        with self._lock:
            kept = self._leases.get(own)
            if kept is None or keeper not in kept.keepers or lease_id == own:
                return  # the keeper's own lease is gone or dropped: nothing is refreshed for it
            self._add_locked(keeper, lease_id, kept.interval, kept.due, False, ttl_pace=kept.ttl_pace)

    def drop(self, keeper: Keeper) -> None:
        """Stop refreshing every lease for ``keeper`` (a lease others keep goes on)."""
        with self._lock:
            self._drop_locked(keeper)
            self._poke_locked()

    def stop(self) -> None:
        """Stop for good (the client closes): end the stream; every keeper is told it stopped."""
        with self._lock:
            self._halted = True
            running = self._running
        loop = started()  # None in a process forked from the one whose task this is: nothing to end here
        if running and loop is not None:
            loop.call_soon(self._cancel_task)
        self._stop_all(EtcdError(f"The etcd client for {self._transport.describe()} was closed."))

    def answer_bound(self) -> float:
        """:func:`answer_bound` of the shortest third of a kept lease's TTL (not a session's pace:
        TTL 15 s renewed every second waits 2 s, not 1 s, about how long etcd's leader may hold a
        renewal under a write burst), grown by :func:`~.retry.stall_bound`. A read: lock optional."""
        shortest = min((kept.ttl_pace for kept in list(self._leases.values())), default=MIN_ANSWER_BOUND)
        return stall_bound(answer_bound(shortest, self._transport.retry_policy.first_attempt), self._stalls_in_row)

    def idle(self) -> bool:
        """Whether no stream task runs (nothing kept yet, or the last lease dropped and the stream
        half-closed); a lease kept after this opens a new stream."""
        with self._lock:
            return not self._running

    def kept(self) -> int:
        """How many leases are being refreshed."""
        with self._lock:
            return len(self._leases)

    def reserve(self, limit: int) -> bool:
        """Take one more session if fewer than ``limit`` leases are kept or promised."""
        with self._lock:
            if self._halted or len(self._leases) + self._reserved >= limit:
                return False
            self._reserved += 1
            return True

    def _add_locked(self, keeper: Keeper, lease_id: int, interval: float, due: float, primary: bool,
                    *, fixed: bool = False, ttl_pace: float | None = None, deadline: float = float("inf")) -> None:
        kept = self._leases.get(lease_id)
        if kept is None:
            kept = self._leases[lease_id] = _Kept(lease_id, interval, due, fixed, ttl_pace, deadline)
            self._push(kept)
            if deadline != float("inf"):
                self._transport.reactor.call_soon(self._arm_deadline)
        elif due < kept.due or interval < kept.interval:
            kept.fixed = kept.fixed or fixed
            kept.interval = min(kept.interval, interval)
            kept.due = min(kept.due, due)
            self._push(kept)
        kept.keepers[keeper] = kept.keepers.get(keeper, False) or primary
        if not self._running:
            self._running = True
            self._transport.reactor.call_soon(self._start)
        else:
            self._poke_locked()

    def _poke_locked(self) -> None:
        """Wake the task: leases or dues changed (no-op if none runs, or in a forked child)."""
        loop = started()
        if self._running and loop is not None:
            loop.call_soon(self._set_wake)

    def _drop_locked(self, keeper: Keeper) -> None:
        for lease_id in [i for i, k in self._leases.items() if keeper in k.keepers]:
            kept = self._leases[lease_id]
            del kept.keepers[keeper]
            if not kept.keepers:
                del self._leases[lease_id]

    def _forget_locked(self, kept: _Kept) -> list[tuple[Keeper, bool]]:
        """Drop a lost lease; a session that lost its own refreshes nothing more (its extra leases neither)."""
        del self._leases[kept.id]
        lost = list(kept.keepers.items())
        for keeper, primary in lost:
            if primary:
                self._drop_locked(keeper)
        return lost

    def _push(self, kept: _Kept) -> None:
        heapq.heappush(self._heap, (kept.due, next(self._ties), kept.id))

    # ------------------------------------------------------------------ the task, on the stream loop

    def _start(self) -> None:
        self._poked = False
        self._task = self._transport.reactor.spawn(self._run(), contextvars.Context())

    def _set_wake(self) -> None:
        self._poked = True
        _resolve(self._napping)

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _next_due(self) -> float:
        """The earliest refresh due (stale heap items dropped); inf when none."""
        while self._heap:
            due, _, lease_id = self._heap[0]
            kept = self._leases.get(lease_id)
            if kept is not None and kept.due == due:
                return due
            heapq.heappop(self._heap)
        return float("inf")

    async def _run(self) -> None:
        """Sleep until a refresh is due, then stream (reconnecting); end when nothing is kept, the
        client closes, or a failure is final."""
        transport = self._transport
        stream = self._reconnecting = ReconnectingStream(
            transport, "keep-alive stream", lambda: self._halted or transport.closed,
            recoverable=lambda e: isinstance(e, EtcdLeaseNotFound), on_reconnect=self._refresh_all_now,
        )  # fmt: skip
        try:
            while True:
                self._poked = False
                with self._lock:
                    if self._halted or transport.closed or not self._leases:
                        self._running = False  # stopped, or idle: the next keep() starts a new task
                        return
                    wait = self._next_due() - time.monotonic()
                if wait > 0:
                    await self._sleep(wait)
                    continue
                fatal = await stream.run(self._stream)
                if fatal is not None:
                    log.warning("keep-alive stream of %s stopped: %s", transport.describe(), fatal)
                    self._stop_all(fatal)
                    with self._lock:
                        self._running = False
                    return
        except asyncio.CancelledError:
            with self._lock:
                self._running = False
        except Exception as e:  # a defect: the sessions hear of it rather than expiring unrenewed
            log.exception("keep-alive stream of %s failed", transport.describe())
            self._stop_all(EtcdError(f"keep-alive stream of {transport.describe()} failed: {e!r}"))
            with self._lock:
                self._running = False

    async def _sleep(self, seconds: float, reader: asyncio.Future[Any] | None = None) -> None:
        """Wait up to ``seconds``, until poked or ``reader`` is done; one future and timer, no task
        (it runs once or twice per renewal)."""
        if self._poked or (reader is not None and reader.done()):
            return
        loop = asyncio.get_running_loop()
        nap = self._napping = loop.create_future()
        timer = loop.call_later(min(seconds, 3600.0), _resolve, nap)
        def woken(_: object) -> None:
            _resolve(nap)

        if reader is not None:
            reader.add_done_callback(woken)
        try:
            await nap
        finally:
            timer.cancel()
            self._napping = None
            if reader is not None:  # else a stream's reader gathers one callback per renewal
                reader.remove_done_callback(woken)

    def _take_due(self) -> tuple[list[int] | None, float]:
        """The leases due now (counted as owed) and seconds until the next thing to do; ``(None,
        0)``: half-close; ``([], 0)``: stalled (heard nothing for :meth:`answer_bound`)."""
        self._poked = False
        with self._lock:
            if self._halted or not self._leases:
                return None, 0.0
            now = time.monotonic()
            deadline = float("inf")
            if self._owed:
                deadline = self._owed_since + self.answer_bound()
                if now >= deadline:
                    return [], 0.0
            due: list[int] = []
            while self._next_due() <= now:
                _, _, lease_id = heapq.heappop(self._heap)
                kept = self._leases[lease_id]
                kept.due = now + kept.interval
                self._push(kept)
                due.append(lease_id)
            if due:
                if not self._owed:
                    self._owed_since = now
                self._owed += len(due)
            return due, min(self._next_due(), deadline) - now

    async def _stream(self, member: Member, metadata: tuple[tuple[str, str], ...]) -> Ended:
        """One keep-alive stream on ``member``: sends refreshes when due, a reader task takes answers;
        MOVE when it stalls or etcd ends it, STOP once idle or halted (half-closed, owed answers
        awaited for at most the answer bound)."""
        with self._lock:
            self._owed = 0
            self.streams_opened += 1
        call = member.stream_stub("Lease").LeaseKeepAlive(metadata=metadata)
        self._transport.stream_opened("Lease/LeaseKeepAlive")
        reader = asyncio.ensure_future(self._read_answers(call))
        try:
            while True:
                due, wait = self._take_due()
                if due is None:  # nothing left to keep (or halted): half-close, take the answers owed
                    try:
                        await send(call, None, self._stopping, reader)
                        await self._sleep(self.answer_bound(), reader)  # bounded: a hung member holds no one
                    except (grpc.RpcError, StreamEnded, SendFailed, CallCancelled):
                        pass  # nothing is kept on this stream any more: how it ended changes nothing
                    return Ended.STOP
                if not due and wait <= 0:
                    return self._stalled(member)
                for lease_id in due:
                    await send(call, rpc_pb2.LeaseKeepAliveRequest(ID=lease_id), self._stopping, reader)
                if reader.done():
                    await step(reader, self._stopping)  # etcd's error, or the call cancelled
                    return Ended.MOVE  # etcd ended the stream
                await self._sleep(wait, reader)
        finally:
            if reader.done():
                if not reader.cancelled():
                    reader.exception()  # retrieved: the fate was decided (it is never left unretrieved)
            else:
                reader.cancel()
            call.cancel()

    async def _read_answers(self, call: Any) -> None:
        """The answers of one stream until etcd ends it (returns) or it fails (raises)."""
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return
            if self._reconnecting is not None:
                self._reconnecting.heard()
            self._answer(resp)

    def _stopping(self) -> bool:
        """Whether :meth:`stop` ran (it sets this before it cancels the task)."""
        return self._halted

    def _stalled(self, member: Member) -> Ended:
        with self._lock:
            self.streams_stalled += 1
            self._stalls_in_row += 1
            silent = time.monotonic() - self._owed_since
        log.warning("keep-alive stream on %s answered nothing for %.1f s; moving on", member.endpoint, silent)
        return Ended.MOVE

    def _refresh_all_now(self) -> None:
        """After a reconnect: the old stream may have dropped refreshes, so every lease is due now."""
        with self._lock:
            now = time.monotonic()
            for kept in self._leases.values():
                kept.due = now
                self._push(kept)

    def _answer(self, resp: Any) -> None:
        lost: list[tuple[Keeper, bool]] = []
        learnt: list[Keeper] = []
        ttl = int(resp.TTL)
        with self._lock:
            if self._owed:
                self._owed -= 1
                self._owed_since = time.monotonic()
            self._stalls_in_row = 0
            kept = self._leases.get(resp.ID)
            if kept is None:
                return
            if ttl <= 0:
                lost = self._forget_locked(kept)
            else:
                kept.deadline = time.monotonic() + ttl
                kept.ttl_pace = refresh_interval(ttl)
                interval = kept.interval if kept.fixed else kept.ttl_pace
                if interval != kept.interval:
                    kept.due += interval - kept.interval
                    kept.interval = interval
                    self._push(kept)
                    self._set_wake()  # (on the loop) the sender looks at the dues again
                learnt = [k for k, primary in kept.keepers.items() if primary]
        if ttl <= 0:
            log.info("lease %x is gone (expired or revoked)", resp.ID)
        for keeper, primary in lost:
            keeper._lease_lost(int(resp.ID), primary)
        for keeper in learnt:
            keeper._learn_ttl(ttl)

    def _arm_deadline(self) -> None:
        """(On the loop.) Run :meth:`_check_deadlines` at the earliest lease deadline; a loop timer,
        so a dead or hung stream task cannot leave a session unrenewed and untold."""
        with self._lock:
            earliest = min((kept.deadline for kept in self._leases.values()), default=float("inf"))
        timer = self._deadline_timer
        if timer is not None:
            if timer.when() <= earliest:
                return
            timer.cancel()
            self._deadline_timer = None
        if earliest != float("inf") and not self._halted:
            loop = asyncio.get_running_loop()
            self._deadline_timer = loop.call_at(earliest, self._check_deadlines)

    def _check_deadlines(self) -> None:
        """(On the loop.) A lease with no keep-alive answered for its whole TTL (etcd Go's lessor rule)
        is asked about once, off the loop (:meth:`_ask_etcd`): alive (we were only slow, e.g. a
        starved host) -> kept with etcd's TTL; gone -> lost; no answer within min(TTL, client
        timeout) -> presumed lost (it may live on: etcd expires nothing without a leader)."""
        self._deadline_timer = None
        now = time.monotonic()
        asked: list[tuple[int, float]] = []
        with self._lock:
            for kept in self._leases.values():
                if kept.deadline <= now:
                    asked.append((kept.id, kept.ttl_pace * 3))
                    kept.deadline = float("inf")  # being asked: no second question meanwhile
        if asked:
            self._transport.reactor.offload(self._ask_etcd, asked)
        self._arm_deadline()

    def _ask_etcd(self, asked: list[tuple[int, float]]) -> None:
        """(Callback thread.) One LeaseTimeToLive per lease past its deadline, bounded by min(TTL,
        client timeout); each answer settled on the loop."""
        transport = self._transport
        for lease_id, ttl in asked:
            remaining: int | None
            try:
                resp = transport.call("Lease", "LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id),
                                      timeout=max(min(ttl, transport.timeout), 1.0),
                                      what=f"lease {lease_id:x} after its TTL without an answer")
                remaining = int(resp.TTL)
            except EtcdError:
                remaining = None
            if transport.closed:
                return
            transport.reactor.call_soon(self._settle_deadline, lease_id, remaining)

    def _settle_deadline(self, lease_id: int, remaining: int | None) -> None:
        """(On the loop.) What etcd said of a lease past its deadline (None: nothing in time)."""
        lost: list[tuple[Keeper, bool]] = []
        with self._lock:
            kept = self._leases.get(lease_id)
            if kept is None:
                return
            if remaining is not None and remaining > 0:
                kept.deadline = min(kept.deadline, time.monotonic() + remaining)
            else:
                lost = self._forget_locked(kept)
                self.deadlines_passed += 1
        try:
            if lost:
                if remaining is None:
                    log.warning("lease %x: etcd answered none of its keep-alives for its TTL, nor a question "
                                "about it; given up as lost", lease_id)
                for keeper, primary in lost:
                    keeper._lease_lost(lease_id, primary, remaining is not None)
        finally:
            self._arm_deadline()

    def _stop_all(self, reason: BaseException) -> None:
        with self._lock:
            keepers = {k for kept in self._leases.values() for k in kept.keepers}
            self._leases.clear()
            self._heap.clear()
        for keeper in keepers:
            keeper._stopped(reason)


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
