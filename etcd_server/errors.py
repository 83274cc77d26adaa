"""Errors of etcd_server: start-up failures and JSON-gateway answers.

:class:`EtcdStartError` (and :class:`EtcdStartTimeoutError`) say why etcd did
not come up, with its exit code and log tail. :class:`EtcdGatewayError` is an
error answer of etcd's JSON gateway; it is the one place that interprets one,
by gRPC ``code`` and HTTP status only (the bodies differ between versions).
Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "GRPC_FAILED_PRECONDITION",
    "GRPC_INVALID_ARGUMENT",
    "GRPC_PERMISSION_DENIED",
    "GRPC_UNAUTHENTICATED",
    "NO_CODE",
    "EtcdGatewayError",
    "EtcdStartError",
    "EtcdStartTimeoutError",
]


class EtcdStartError(RuntimeError):
    """etcd did not come up.

    Attributes:
        returncode: exit status of the etcd process (negative: killed by that
            signal), or None if it was still running (a time-out).
        log_tail: the last lines etcd wrote to its stderr log ("" when the
            caller redirected stderr elsewhere).
        cmd: the command line that was run.
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None = None,
        log_tail: str = "",
        cmd: Sequence[str] = (),
    ) -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        self.cmd = list(cmd)
        full = message
        if log_tail:
            full += "\n--- last lines of the etcd log ---\n" + log_tail
        super().__init__(full)

    @property
    def address_in_use(self) -> bool:
        """True if the log says a listen port was already taken."""
        return "address already in use" in self.log_tail


class EtcdStartTimeoutError(EtcdStartError, TimeoutError):
    """etcd was still running but not ready when the start-up deadline passed."""


# gRPC status codes etcd reports in the gateway's ``code`` field.
GRPC_INVALID_ARGUMENT = 3
GRPC_PERMISSION_DENIED = 7
GRPC_FAILED_PRECONDITION = 9
GRPC_UNAUTHENTICATED = 16
NO_CODE = -1


class EtcdGatewayError(RuntimeError):
    """An error answer from etcd's JSON gateway (``/v3/...``).

    Every etcd version from 3.4 to 3.7 puts the gRPC status code in the
    answer's ``code`` field (the rest of the body changed in 3.6), so errors
    are told apart by :attr:`code` and :attr:`http_status` only, never by
    message text.

    Attributes:
        path: the gateway path requested.
        http_status: HTTP status code of the answer.
        code: the gRPC status code etcd reported (e.g. 9 FAILED_PRECONDITION),
            or -1 when the answer carried none (not a gRPC error).
        etcd_message: etcd's error message (for people; do not parse it).
    """

    def __init__(self, path: str, http_status: int, code: int, etcd_message: str):
        self.path = path
        self.http_status = http_status
        self.code = code
        self.etcd_message = etcd_message
        super().__init__(
            f"etcd {path} failed: {etcd_message} (grpc code {code}, HTTP {http_status})"
        )

    @property
    def is_auth_error(self) -> bool:
        """True for PERMISSION_DENIED (7) and UNAUTHENTICATED (16, e.g. a stale token).

        etcd reports a missing token and a wrong password as INVALID_ARGUMENT
        (3), which by code alone cannot be told from a malformed request.
        """
        return self.code in (GRPC_PERMISSION_DENIED, GRPC_UNAUTHENTICATED)

    @property
    def refused_by_gateway(self) -> bool:
        """True when the gateway refused the request before it reached etcd's gRPC API.

        That is an HTTP 400 with no gRPC code. In etcd 3.4 to 3.7 the one such
        refusal is for a TLS client whose certificate has a CommonName while
        auth is enabled ("CommonName of client sending a request against
        gateway will be ignored ..."), so it also says auth is on.
        """
        return self.http_status == 400 and self.code == NO_CODE
