"""``EtcdRendezvousBackend``: torch's ``RendezvousBackend`` contract over etcd v3.

The rendezvous state is one key, ``<key_prefix>/<run_id>``, whose value is the
base64 of the state bytes (as torch's ``etcd-v2`` and ``c10d`` backends store it).
torch ``pickle.loads`` what :meth:`get_state` and :meth:`set_state` return, so every
value read from etcd first passes :func:`etcd_rdzv.v2state.state_bytes` (bounded size,
a restricted unpickler admitting only torch's state types): a value that is not torch's
rendezvous state raises ``RendezvousStateError`` naming the key and is never unpickled
by torch. The fencing token is the key's ``mod_revision``, an opaque ``int``.

Round trips (healthy etcd): :meth:`get_state` is one Range; :meth:`set_state` is
one Txn, ``if mod_revision(key) == token (version == 0 without a token) then put
else range``, so a lost race returns the winner's state in the same RPC. Both
calls are safe to retry on another endpoint: a replayed Txn that had been
applied fails its compare and returns the (our) current state with
``has_set=False``, which the handler treats like any lost race.

Expiry: every successful write attaches the key to a lease held by this backend
object. The lease is granted with ``state_ttl + state_ttl // 2`` seconds (at
least ``state_ttl + 1``) and replaced by a fresh one before a write once less
than ``state_ttl`` seconds of it remain, so the key lives at least ``state_ttl``
and at most ~1.5 x ``state_ttl`` seconds after its last write, and never
expires while some node keeps writing it (the handler's heartbeats write every
``keep_alive_interval``). This costs one LeaseGrant RPC per ``state_ttl / 2``
per process instead of one per write. Leases are never revoked (that would
delete the state if we were the last writer); they run out on their own.
"""

from __future__ import annotations

import logging
import threading
import time
from base64 import b64encode
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from etcd_store.client import (
    EtcdClient,
    KeyValue,
    RangeResult,
    TxnResult,
    compare_mod,
    compare_version,
    op_get,
    op_put,
    renewing_lease,
)
from etcd_store.errors import EtcdError

from .. import metrics
from ..conf import DEFAULT_KEY_PREFIX, DEFAULT_STATE_TTL, RdzvConfig, check_run_id, parse_rdzv_config
from ..v2state import StateDecodeError, state_bytes

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousParameters

log = logging.getLogger(__name__)

__all__ = ["STORE_TIMEOUT", "EtcdRendezvousBackend", "create_backend", "open_backend"]

STORE_TIMEOUT = timedelta(seconds=300)
"""Blocking-get timeout of the run's ``EtcdStore`` (torch's c10d store default)."""


class EtcdRendezvousBackend(RendezvousBackend):
    """A rendezvous backend that keeps the state in etcd (v3 API).

    Args:
        client: the :class:`~etcd_store.client.EtcdClient` to use; its ``timeout``
            (rdzv-conf ``read_timeout``) bounds every call, retries included.
        run_id: the run id of the rendezvous (non-empty).
        key_prefix: the state key is ``<key_prefix>/<run_id>`` (``run_id`` when empty).
        ttl: seconds the state outlives its last write (default two hours).
        name: what :attr:`name` reports: the rendezvous backend name this
            backend was created for (``etcd-v2`` or ``etcd``).

    Every method raises ``RendezvousConnectionError`` when etcd cannot be reached
    (or refuses the credentials) within the client's timeout, and
    ``RendezvousStateError`` when the stored value is not torch's rendezvous state
    (not base64, too large, or a pickle naming anything but torch's state types);
    ``set_state`` writes ``state`` as given (it comes from torch's own handler).
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        key_prefix: str | None = DEFAULT_KEY_PREFIX,
        ttl: int | None = None,
        *,
        name: str = "etcd-v2",
    ) -> None:
        check_run_id(run_id)
        self._client = client
        self._name = name
        self.key = f"{key_prefix}/{run_id}" if key_prefix else run_id
        self._key = self.key.encode()
        self.ttl = int(ttl) if ttl and ttl > 0 else DEFAULT_STATE_TTL
        self._lease_ttl = max(self.ttl + self.ttl // 2, self.ttl + 1)
        self._lease_lock = threading.Lock()
        self._lease_id = 0
        self._lease_renew_at = 0.0  # monotonic time after which a write takes a new lease

    @property
    def name(self) -> str:
        """See base class."""
        return self._name

    @property
    def client(self) -> EtcdClient:
        return self._client

    # ------------------------------------------------------------ contract

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class. One Range RPC."""
        try:
            kv = self._client.get(self._key)
        except EtcdError as e:
            raise self._connection_error(e) from e
        return None if kv is None else self._decode(kv)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class. One Txn RPC (plus a LeaseGrant every ``ttl / 2`` seconds).

        ``token`` None (or 0) writes only if no state exists. A token that is not
        an integer writes nothing and returns the current state (one Range RPC).
        """
        if token is None or token == 0 or token == "":
            compare = compare_version(self._key, "==", 0)
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = compare_mod(self._key, "==", revision)

        value = b64encode(state)
        deadline = time.monotonic() + self._client.timeout

        def write(lease: int) -> TxnResult:
            return self._client.txn(
                [compare],
                [op_put(self._key, value, lease=lease)],
                [op_get(self._key)],
                timeout=self._remaining(deadline),
                idempotent=True,
            )

        try:
            # Someone revoked our lease (or etcd lost it): take a new one, once.
            result = renewing_lease(write, lambda: self._lease(deadline), self._forget_lease, renewals=1)
        except EtcdError as e:
            raise self._connection_error(e) from e

        if result.succeeded:
            return state, result.revision, True
        found = result.responses[0]
        assert isinstance(found, RangeResult)
        if not found.kvs:
            return None
        return (*self._decode(found.kvs[0]), False)

    # ------------------------------------------------------------ helpers

    def _decode(self, kv: KeyValue) -> tuple[bytes, Token]:
        """The checked state bytes of ``kv`` and its token; raises ``RendezvousStateError``."""
        try:
            state = state_bytes(kv.value, repr(self.key))
        except StateDecodeError as e:
            raise RendezvousStateError(
                f"The rendezvous state stored in etcd is corrupt or not torch's, refusing it: {e}"
            ) from None
        return state, kv.mod_revision

    def _lease(self, deadline: float) -> int:
        """The lease to write with; granted anew when less than ``ttl`` seconds remain."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease_id == 0 or now >= self._lease_renew_at:
                # Measured from before the request: our estimate of the expiry is early, never late.
                self._lease_id = self._client.lease_grant(
                    self._lease_ttl, timeout=self._remaining(deadline)
                )
                self._lease_renew_at = now + (self._lease_ttl - self.ttl)
            return self._lease_id

    def _forget_lease(self, lease: int) -> None:
        with self._lease_lock:
            lost = self._lease_id == lease
            if lost:
                self._lease_id = 0
        if lost:
            metrics.put_rdzv(self._name, metrics.LEASE_LOST)

    def _remaining(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousConnectionError(
                f"etcd at {self._client.describe()} did not answer within the read timeout "
                f"of {self._client.timeout:g} s (rendezvous state {self.key!r})."
            )
        return remaining

    def _connection_error(self, err: EtcdError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"The rendezvous state {self.key!r} could not be read or written: {err}"
        )


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Store]:
    """Create the backend and the run's store from torchrun's parameters.

    rdzv-conf keys: see :func:`etcd_rdzv.conf.parse_rdzv_config`; then as
    :func:`open_backend`, named ``params.backend``. Raises ``ValueError`` naming a bad key.
    """
    return open_backend(parse_rdzv_config(params), params.run_id, name=params.backend)


def open_backend(
    config: RdzvConfig, run_id: str, *, name: str = "etcd-v2"
) -> tuple[EtcdRendezvousBackend, Store]:
    """The backend of ``run_id`` and the run's store, sharing one new client.

    The store is an :class:`etcd_store.EtcdStore` with keys under
    ``<key_prefix>/<run_id>/store``; its blocking reads wait up to
    :data:`STORE_TIMEOUT`. Creating it reads (or creates) its namespace lease:
    one to three RPCs. Raises ``RendezvousConnectionError`` when etcd cannot be
    reached (or refuses the credentials) within ``read_timeout``.
    """
    client = config.client.create_client()
    try:
        backend = EtcdRendezvousBackend(
            client, run_id, key_prefix=config.key_prefix, ttl=config.state_ttl, name=name
        )
        store = _create_store(client, config.store_prefix(run_id), config.state_ttl)
    except BaseException:
        client.close()
        raise
    return backend, store


def _create_store(client: EtcdClient, prefix: str, ttl: int) -> Store:
    """The run's ``EtcdStore``; its constructor's RPCs are bounded by the client's timeout.

    Its namespace lease has the TTL ``ttl`` (``state_ttl``, at least 2 s): the store's keys
    go ``state_ttl`` after the last agent, as the state does (they stayed an hour before,
    the store's default)."""
    import torch.distributed as dist

    from etcd_store import EtcdStore

    try:
        store = EtcdStore(client, prefix=prefix, timeout=timedelta(seconds=client.timeout), lease_ttl=max(ttl, 2))
    except dist.DistError as e:
        raise RendezvousConnectionError(
            f"The rendezvous store {prefix!r} could not be opened in etcd at "
            f"{client.describe()}: {e}"
        ) from e
    store.set_timeout(STORE_TIMEOUT)
    return store
