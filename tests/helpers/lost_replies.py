"""Deterministic faults for store tests: lost replies and forced compaction.

:class:`LostReplies` is a gRPC client interceptor (``EtcdClient(..., interceptors=[lost])``).
A rule armed with :meth:`LostReplies.lose` picks unary requests by method and by a predicate on
the request; a picked request is sent to etcd and completes there (it commits), and then the
caller gets ``UNAVAILABLE`` instead of the reply, exactly as if the connection broke after etcd
applied it. The client's retry policy then decides whether to resend. ``then`` runs after the
commit and before the caller sees the error (another writer acting in the window).
:meth:`LostReplies.meddle` runs a callback just before chosen requests are sent (contention).

:func:`compact` compacts etcd's history at its current revision (physically), so every read at an
older revision and every watch from one fails with "required revision has been compacted".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["LostReplies", "Rule", "compact", "puts_key", "txn_puts_key", "writes_key"]


class _LostReply(grpc.RpcError, grpc.Call, grpc.Future):  # type: ignore[misc]
    """The failed outcome an interceptor hands back: a finished call that raises itself."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    # grpc.Call
    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    # grpc.Future
    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def exception(self, timeout: float | None = None) -> BaseException:
        return self

    def traceback(self, timeout: float | None = None) -> Any:
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


@dataclass
class Rule:
    """Requests of ``method`` matching ``match`` lose their reply, ``times`` times.

    ``replies`` collects the replies etcd sent and the caller never saw.
    """

    method: str
    match: Callable[[Any], bool]
    times: int
    code: grpc.StatusCode
    then: Callable[[], object] | None
    send: bool = True
    before: Callable[[], object] | None = None
    replies: list[Any] = field(default_factory=list)
    dropped: int = 0

    @property
    def fired(self) -> int:
        return len(self.replies)


class LostReplies(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Lets chosen requests reach etcd and commit, then answers the caller with an error."""

    def __init__(self) -> None:
        self._rules: list[Rule] = []
        self._lock = threading.Lock()

    def lose(
        self,
        method: str,
        match: Callable[[Any], bool] = lambda request: True,
        *,
        times: int = 1,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        then: Callable[[], object] | None = None,
        send: bool = True,
    ) -> Rule:
        """Arm a rule: the next ``times`` requests of ``method`` (``"KV/Txn"``; ``"KV/"`` for any KV
        call) matching ``match`` are applied by etcd and answered with ``code``. Returns the rule.

        With ``send=False`` the requests never reach etcd (a connection that breaks before
        sending); rules are tried in the order they were armed."""
        rule = Rule(method, match, times, code, then, send)
        with self._lock:
            self._rules.append(rule)
        return rule

    def meddle(
        self, method: str, match: Callable[[Any], bool], before: Callable[[], object], *, times: int = 1
    ) -> Rule:
        """Arm a rule that runs ``before`` just before each of the next ``times`` matching requests
        is sent, and then delivers the request and its reply normally (a writer racing the caller)."""
        rule = Rule(method, match, times, grpc.StatusCode.OK, None, before=before)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _pick(self, method: str, request: Any) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.times > 0 and rule.method in method and rule.match(request):
                    rule.times -= 1
                    return rule
        return None

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        rule = self._pick(method, request)
        if rule is not None and rule.before is not None:
            rule.before()
            rule.replies.append(None)
            return continuation(details, request)
        if rule is not None and not rule.send:
            rule.dropped += 1
            return _LostReply(rule.code, "injected by LostReplies: the request never reached etcd")
        outcome = continuation(details, request)
        if rule is None:
            return outcome
        try:
            reply = outcome.result()
        except grpc.RpcError:
            with self._lock:
                rule.times += 1  # etcd refused it: nothing was applied, the rule stays armed
            return outcome
        rule.replies.append(reply)
        log.info("lost the reply of %s (%d of the rule)", method, rule.fired)
        if rule.then is not None:
            rule.then()
        return _LostReply(rule.code, "injected by LostReplies: etcd applied the request, its reply was lost")


def _puts(op: Any, pred: Callable[[bytes], bool]) -> bool:
    kind = op.WhichOneof("request")
    if kind == "request_put":
        return pred(op.request_put.key)
    if kind == "request_delete_range":
        return pred(op.request_delete_range.key)
    return False


def txn_puts_key(pred: Callable[[bytes], bool]) -> Callable[[Any], bool]:
    """A ``match`` for ``"KV/Txn"``: the Txn's success branch writes or deletes a key passing ``pred``."""

    def match(request: Any) -> bool:
        return isinstance(request, rpc_pb2.TxnRequest) and any(_puts(op, pred) for op in request.success)

    return match


def puts_key(pred: Callable[[bytes], bool]) -> Callable[[Any], bool]:
    """A ``match`` for ``"KV/Put"``: the Put's key passes ``pred``."""
    return lambda request: isinstance(request, rpc_pb2.PutRequest) and pred(request.key)


def writes_key(pred: Callable[[bytes], bool]) -> Callable[[Any], bool]:
    """A ``match`` for ``"KV/"``: a Put, DeleteRange or Txn (success branch) writing a key passing ``pred``."""
    in_txn = txn_puts_key(pred)

    def match(request: Any) -> bool:
        if isinstance(request, rpc_pb2.PutRequest | rpc_pb2.DeleteRangeRequest):
            return pred(request.key)
        return in_txn(request)

    return match


def compact(endpoint: str, timeout: float = 10.0) -> int:
    """Compact etcd at ``endpoint`` (``host:port``, no TLS) at its current revision; returns it."""
    channel = grpc.insecure_channel(endpoint)
    try:
        kv = rpc_pb2_grpc.KVStub(channel)
        revision = int(kv.Range(rpc_pb2.RangeRequest(key=b"\0"), timeout=timeout).header.revision)
        kv.Compact(rpc_pb2.CompactionRequest(revision=revision, physical=True), timeout=timeout)
        return revision
    finally:
        channel.close()
