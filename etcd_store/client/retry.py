"""The client's retry policy as pure decisions: what a failed attempt means, and what to do next.

No I/O and no gRPC here. :mod:`.transport` (the one place that reads gRPC codes and etcd's
named errors) classifies each failed attempt as a :class:`Failure` and asks :func:`decide`;
:class:`Attempts` (one per call) remembers TLS failures, whether every failure was "no
connection at all", and the next attempt's deadline; :class:`RetryPolicy` holds the numbers.

The decision table (``failure`` x ``idempotent`` -> :class:`Action`):

========================  ================================  ================================
failure                   safe to resend (``idempotent``)   not safe to resend
========================  ================================  ================================
``UNREACHED``             next member                       next member (nothing was sent)
``NOT_APPLIED``           next member                       next member (etcd says so)
``MAYBE_APPLIED``         next member                       raise (it may still commit)
``TIMED_OUT``             next member                       raise (it may still commit)
``TLS``                   next member; raise once every member failed a handshake in this call
``STALE_TOKEN``           log in again and resend at once, once per call (with credentials);
                          otherwise raise
``FINAL``                 raise
========================  ================================  ================================
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Action", "Attempts", "Backoff", "Call", "Cause", "Failure", "Fate", "RetryPolicy", "StreamStep", "decide",
    "stall_bound", "stream_fate", "stream_reconnects",
]


class Failure(enum.Enum):
    """What one failed attempt says about the member and the request."""

    #: No connection to the member: refused, unknown host, reset before anything was sent.
    UNREACHED = "unreached"
    #: The TLS handshake with the member failed (certificate, CA, host name, http vs https).
    TLS = "tls"
    #: No answer within the attempt's deadline, or etcd's own request timeout: it may be applied.
    TIMED_OUT = "timed out"
    #: The member cannot serve now and etcd says the request was not applied (no leader, ...).
    NOT_APPLIED = "not applied"
    #: The member cannot serve now; a proposal it took may still commit (leader changed, ...).
    MAYBE_APPLIED = "maybe applied"
    #: etcd refused the auth token (expired, etcd restarted, users changed): log in again.
    STALE_TOKEN = "stale token"
    #: An answer that resending cannot change (denied, bad request, not found, compacted, ...).
    FINAL = "final"


class Action(enum.Enum):
    """What the call does after a failed attempt."""

    NEXT_MEMBER = "next member"  #: try the next member (after a pause once every member failed)
    LOGIN_AGAIN = "login again"  #: drop the member's token, log in, resend at once
    RAISE = "raise"  #: translate the failure and raise it to the caller


#: Failures that say "this member, not the request": another member may serve it.
_MEMBER_FAILURES = frozenset({Failure.UNREACHED, Failure.TLS, Failure.TIMED_OUT, Failure.NOT_APPLIED,
                              Failure.MAYBE_APPLIED})  # fmt: skip
#: Failures after which a request that is not safe to resend may have been applied.
_MAYBE_APPLIED = frozenset({Failure.TIMED_OUT, Failure.MAYBE_APPLIED})


def decide(
    failure: Failure, *, idempotent: bool, can_login: bool = False, tls_everywhere: bool = False
) -> Action:
    """The action for one failed attempt (the module docstring's table).

    ``can_login``: credentials, and no re-login yet in this call. ``tls_everywhere``: every
    member failed a TLS handshake in this call (this one included).
    """
    if failure is Failure.STALE_TOKEN:
        return Action.LOGIN_AGAIN if can_login else Action.RAISE
    if failure not in _MEMBER_FAILURES:
        return Action.RAISE
    if failure is Failure.TLS and tls_everywhere:
        return Action.RAISE  # a bad certificate does not heal
    if not idempotent and failure in _MAYBE_APPLIED:
        return Action.RAISE
    return Action.NEXT_MEMBER


def stream_reconnects(failure: Failure) -> bool:
    """Whether a broken stream (watch, keep-alive) should reopen on the next member.

    A stream resends nothing that could apply twice (a watch resumes from the next undelivered
    revision; keep-alives are idempotent), so every member failure and a refused token (dropped:
    the next stream logs in) reconnect; anything else is final.
    """
    return failure in _MEMBER_FAILURES or failure is Failure.STALE_TOKEN


# --------------------------------------------------------------------------- a stream's fate


class StreamStep(enum.Enum):
    """Where in a stream's life an error came from."""

    OPEN = "open"  #: logging in, building the metadata, opening the call
    SEND = "send"  #: writing a request or half-closing
    RECEIVE = "receive"  #: reading an answer, or the call's final status as its reader saw it


class Cause(enum.Enum):
    """What an error of a stream is, as :mod:`.streams` classifies it (gRPC's types, etcd's codes)."""

    #: A status another stream can get past: a member failure, a refused token (dropped), gRPC's
    #: INTERNAL, a call gRPC cancelled, or an owner's recoverable error (keep-alive "lease not found").
    RETRYABLE = "retryable status"
    #: etcd's answer that no other stream changes (denied, compacted, bad request).
    FINAL = "final status"
    #: gRPC's own complaint, not etcd's word: INTERNAL "Internal error from Core", ``InvalidStateError``
    #: from a write on a call etcd already ended, or a receive side that said nothing when asked.
    LOCAL = "local"
    #: The call was cancelled under a step, or its channel closed (the client closing, or gone away).
    CANCELLED_UNDER = "cancelled under"
    #: etcd rejected the credentials while the stream logged in.
    LOGIN_REFUSED = "login refused"
    #: The login found no member to answer (unreachable, timed out).
    LOGIN_FAILED = "login failed"
    #: etcd ended the stream cleanly (end of stream, no status error).
    ENDED = "ended"


class Fate(enum.Enum):
    """What a stream does after an error: the one decision, :func:`stream_fate`."""

    RECONNECT = "reconnect"  #: broken: a new stream on the next member (after a backoff if it never answered)
    ASK_RECEIVE = "ask the receive side"  #: a send's error decides nothing: the call's receive side does
    FINAL = "final"  #: the owner gets the error and stops
    STOP = "stop"  #: the owner is stopping: end quietly
    CLOSED = "closed"  #: the client closed: the owner gets the client's "closed" error


def stream_fate(step: StreamStep, cause: Cause, *, stopping: bool, closed: bool) -> Fate:
    """A stream's fate after an error; as in etcd's Go client, the receive side decides it.

    ============  ==================================================  ==================
    step          cause                                                fate
    ============  ==================================================  ==================
    any           (the owner is stopping)                              STOP
    any           (the client closed)                                  CLOSED
    SEND          RETRYABLE, FINAL, LOCAL, ENDED                       ASK_RECEIVE
    SEND          CANCELLED_UNDER                                      RECONNECT
    OPEN/RECEIVE  FINAL, LOGIN_REFUSED                                 FINAL
    OPEN/RECEIVE  RETRYABLE, LOCAL, CANCELLED_UNDER, LOGIN_FAILED,     RECONNECT
                  ENDED
    ============  ==================================================  ==================
    """
    if stopping:
        return Fate.STOP
    if closed:
        return Fate.CLOSED
    if step is StreamStep.SEND:
        return Fate.RECONNECT if cause is Cause.CANCELLED_UNDER else Fate.ASK_RECEIVE
    if cause in (Cause.FINAL, Cause.LOGIN_REFUSED):
        return Fate.FINAL
    return Fate.RECONNECT


class Backoff:
    """The pause before a stream's next attempt when the last ended before any answer (a member
    refusing every stream, a single endpoint): ``first`` doubling up to ``cap``, each drawn
    between half and all of it (jitter, so clients do not return in step); :meth:`reset` on an
    answer. A stream that answered is replaced at once, without a pause."""

    def __init__(self, first: float, cap: float, rand: random.Random | None = None) -> None:
        self.first = first
        self.cap = cap
        self._next = first
        self._rand = rand or random.Random()

    def pause(self) -> float:
        """The next pause, in seconds; the one after it is twice as long (up to ``cap``)."""
        bound = self._next
        self._next = min(self._next * 2, self.cap)
        return bound * (0.5 + 0.5 * self._rand.random())

    def reset(self) -> None:
        """The stream answered: the next pause starts again at ``first``."""
        self._next = self.first


#: A stream's answer bound doubles after each stall in a row, at most this many times.
MAX_STALL_DOUBLINGS = 3


def stall_bound(bound: float, stalls: int) -> float:
    """Seconds a stream that owes an answer may hear none: ``bound``, doubled for each of
    ``stalls`` consecutive silent streams (at most :data:`MAX_STALL_DOUBLINGS` times), as a
    request's attempt deadline doubles. A frozen member is still left after ``bound`` (the next
    answers, resetting the count); a merely slow member or client, or a single endpoint, is not
    hammered with a new stream every ``bound``."""
    return bound * 2 ** min(max(stalls, 0), MAX_STALL_DOUBLINGS)


@dataclass(frozen=True)
class RetryPolicy:
    """The numbers of the retry policy (seconds).

    ``first_attempt``: the first attempt's deadline for a request safe to resend, when another
    member exists (doubled after a round where every member timed out). ``first_pause``/
    ``max_pause``: the pause after a round where every member failed, doubling to the cap, so a
    long outage costs few RPCs.

    Streams (:mod:`.watch`, :mod:`.leases`) have no deadline, so a member answering nothing (hung
    host, SIGSTOPped etcd) would hold them for ever: a stream owing an answer that hears nothing
    for ``first_attempt`` (keep-alive: at most a third of its shortest lease's TTL, at least 1 s;
    either grown by :func:`stall_bound`) is resumed on the next member. A watch quiet for
    ``stream_quiet`` (its last request's ``first_attempt`` passed) sends one
    ``WatchProgressRequest`` (etcd 3.4+), which etcd answers.
    """

    first_attempt: float = 2.0
    first_pause: float = 0.025
    max_pause: float = 0.5
    stream_quiet: float = 5.0
    #: Pause (jittered) after a stream that ended before any answer, doubling to
    #: ``stream_backoff_max`` (:class:`Backoff`).
    stream_backoff: float = 0.1
    stream_backoff_max: float = 2.0

    def __post_init__(self) -> None:
        for name in ("first_attempt", "first_pause", "max_pause", "stream_quiet", "stream_backoff",
                     "stream_backoff_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RetryPolicy.{name} must be positive, got {getattr(self, name)!r}")
        if self.max_pause < self.first_pause:
            raise ValueError(f"RetryPolicy.max_pause ({self.max_pause}) is below first_pause ({self.first_pause})")
        if self.stream_backoff_max < self.stream_backoff:
            raise ValueError(f"RetryPolicy.stream_backoff_max ({self.stream_backoff_max}) is below "
                             f"stream_backoff ({self.stream_backoff})")


@dataclass
class Attempts:
    """What one call remembers between attempts. ``members``: how many it may try; ``user``:
    whether the client has credentials."""

    policy: RetryPolicy
    members: int
    user: bool
    #: Every failure so far found no server at all (refused, unknown host).
    unreached_only: bool = True
    logged_in_again: bool = False
    attempt_budget: float = 0.0
    pause: float = 0.0
    _tls_failed: set[int] = field(default_factory=set)
    _timeouts: int = 0

    def __post_init__(self) -> None:
        self.attempt_budget = self.policy.first_attempt
        self.pause = self.policy.first_pause

    def timeout(self, remaining: float, idempotent: bool) -> float:
        """The next attempt's deadline, ``remaining`` seconds being left of the call: the growing
        per-attempt deadline for a request safe to resend with another member to try; else all
        that remains (resending a merely slow request to one member only adds load)."""
        if idempotent and self.members > 1:
            return min(remaining, self.attempt_budget)
        return remaining

    def failed(self, member: int, failure: Failure, idempotent: bool) -> Action:
        """Record a failed attempt on ``member`` (an index) and decide what follows."""
        if failure is Failure.TLS:
            self._tls_failed.add(member)
        action = decide(
            failure, idempotent=idempotent, can_login=self.user and not self.logged_in_again,
            tls_everywhere=len(self._tls_failed) >= self.members,
        )  # fmt: skip
        if action is Action.LOGIN_AGAIN:
            self.logged_in_again = True
        elif action is Action.NEXT_MEMBER:
            if failure is Failure.TIMED_OUT:
                self._timeouts += 1
                if self._timeouts == self.members:  # every member timed out in this round
                    self.attempt_budget *= 2
            if failure is not Failure.UNREACHED:
                self.unreached_only = False
        return action

    def new_round(self) -> None:
        """A round over the members begins (timeouts are counted per round)."""
        self._timeouts = 0

    def next_pause(self) -> float:
        """The pause before the next round (growing up to ``max_pause``)."""
        pause = self.pause
        self.pause = min(self.pause * 2, self.policy.max_pause)
        return pause


@dataclass
class Call:
    """One unary call under the retry policy: the request, its deadline, its attempts so far."""

    service: str
    method: str
    request: Any
    what: str
    idempotent: bool
    budget: float
    start: float
    attempts: Attempts
    last: Any = None  #: the last failed attempt (the transport's record of it)
    sent: int = 0

    @property
    def deadline(self) -> float:
        return self.start + self.budget
