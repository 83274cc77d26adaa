"""``EtcdRendezvousBackend``: torch's ``RendezvousBackend`` contract over etcd v3.

The state is one key, ``<key_prefix>/<run_id>``, holding the base64 of the state bytes (as torch's
``etcd-v2`` and ``c10d`` backends store it); the fencing token is its ``mod_revision``. The bytes
are opaque, per torch's contract, so the backend does not guard torch's ``pickle.loads`` of them:
our handler's holder (:class:`etcd_rdzv.dynamic.state.SealedRoundStateHolder`) does. A torch
``DynamicRendezvousHandler`` built directly on this backend unpickles whatever the key holds: use
the registered ``etcd-v2``/``etcd`` handler where its writers are not all trusted (docs/security.md).

Round trips: ``get_state`` is one Range; ``set_state`` one Txn, ``if mod_revision(key) == token
(version == 0 without a token) then put else range``, so a lost race returns the winner's state in
the same RPC. Both are safe to retry: a replayed Txn that had applied fails its compare and
returns ``has_set=False``, which the handler treats as any lost race.

Expiry: every write binds the key to this object's lease, granted for ``state_ttl + state_ttl // 2``
(at least ``state_ttl + 1``) and replaced before a write once less than ``state_ttl`` remain: the
key lives ``state_ttl`` to ~1.5 x ``state_ttl`` after its last write, and costs one LeaseGrant per
``state_ttl / 2`` per process. Leases are never revoked (that would delete the state if we wrote
last).

Anchors: the first write with a lease also puts ``<state key>/lease/<lease hex>`` (same Txn, either
branch). etcd attaches a lease to a put only if the user may write every key already on it, and any
user can list lease ids: an unanchored lease of ours could take another job's key and then refuse
our writes; an anchored one cannot. A lease refused anyway is replaced once per write.
"""

from __future__ import annotations

import binascii
import logging
import threading
import time
from base64 import b64decode, b64encode
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
from ..conf import V2_ANCHOR_DIR, RdzvConfig, check_run_id, parse_rdzv_config
from ..conf_keys import DEFAULT_KEY_PREFIX, DEFAULT_STATE_TTL

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousParameters

log = logging.getLogger(__name__)

__all__ = ["STORE_TIMEOUT", "EtcdRendezvousBackend", "create_backend", "open_backend"]

STORE_TIMEOUT = timedelta(seconds=300)
"""Blocking-get timeout of the run's ``EtcdStore`` (torch's c10d store default)."""


class EtcdRendezvousBackend(RendezvousBackend):
    """A rendezvous backend that keeps the state in etcd (v3 API).

    ``client``'s ``timeout`` (rdzv-conf ``read_timeout``) bounds every call, retries included; the
    key is ``<key_prefix>/<run_id>`` (``run_id`` when the prefix is empty); ``ttl``: seconds the state
    outlives its last write; ``name``: the backend name reported (``etcd-v2`` or ``etcd``).

    Every method raises ``RendezvousConnectionError`` when etcd cannot be reached (or refuses the
    credentials) within the client's timeout, and ``RendezvousStateError`` naming the key when the
    stored value is not base64.
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
        self._anchored = 0  # the lease whose anchor a write has put

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

        ``token`` None (or 0) writes only if no state exists. A token no etcd revision can be (not an
        integer, below 1, over 64 bits) writes nothing and returns the current state (one Range).
        """
        if token is None or token == 0 or token == "":
            compare = compare_version(self._key, "==", 0)
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                revision = 0
            if not 0 < revision < 2**63:
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = compare_mod(self._key, "==", revision)

        value = b64encode(state)
        deadline = time.monotonic() + self._client.timeout

        def write(lease: int) -> TxnResult:
            # A new lease is anchored by the same Txn, whichever branch runs (module docstring).
            anchor = [] if lease == self._anchored else [op_put(self.anchor_key(lease), b"", lease=lease)]
            result = self._client.txn(
                [compare],
                [op_put(self._key, value, lease=lease), *anchor],
                [op_get(self._key), *anchor],
                timeout=self._remaining(deadline),
                idempotent=True,
            )
            self._anchored = lease
            return result

        try:
            # A lease revoked or lost: take a new one, once.
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
        """The state bytes stored in ``kv`` and its token; raises ``RendezvousStateError``."""
        try:
            state = b64decode(kv.value, validate=True)
        except (binascii.Error, ValueError):
            raise RendezvousStateError(
                f"The rendezvous state stored in etcd is corrupt: {self.key!r} does not hold base64"
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

    def anchor_key(self, lease: int) -> bytes:
        """The key that anchors ``lease`` to this run: ``<state key>/lease/<lease hex>``."""
        return f"{self.key}/{V2_ANCHOR_DIR}/{lease:x}".encode()

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
    """The backend and the run's store from torchrun's parameters
    (:func:`etcd_rdzv.conf.parse_rdzv_config`, then :func:`open_backend`). ``ValueError`` names a bad key."""
    return open_backend(parse_rdzv_config(params), params.run_id, name=params.backend)


def open_backend(
    config: RdzvConfig, run_id: str, *, name: str = "etcd-v2"
) -> tuple[EtcdRendezvousBackend, Store]:
    """The backend of ``run_id`` and the run's store, sharing one new client.

    The store is an :class:`etcd_store.EtcdStore` under ``<key_prefix>/<run_id>/store`` whose blocking
    reads wait up to :data:`STORE_TIMEOUT`; opening it costs one to three RPCs. Raises
    ``RendezvousConnectionError`` when etcd cannot be reached within ``read_timeout``.
    """
    client = EtcdClient.from_options(config.client)
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
    """The run's ``EtcdStore`` (RPCs bounded by the client's timeout); its namespace lease has TTL
    ``max(ttl, 2)``, so its keys go ``state_ttl`` after the last agent, as the state does."""
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
