"""Chunked values of :class:`~etcd_store.EtcdStore`: values above ``chunk_bytes``.

A large value is written as chunks under a fresh generation (one Put each) and
a manifest at the user key; reading it is one more Range at the manifest's
revision (see :mod:`etcd_store._layout`). Chunks of a replaced or deleted value
are deleted (best effort: the namespace lease removes any left over).
"""

from __future__ import annotations

import logging
import uuid

from ._base import StoreBase
from ._layout import MAGIC, Manifest
from .client import KeyValue
from .errors import EtcdCompactedError, EtcdError

log = logging.getLogger(__name__)


class ChunkedValues(StoreBase):
    """Encoding and decoding of stored values (inline, or a manifest of chunks)."""

    def _inline(self, value: bytes) -> bool:
        return len(value) <= self._chunk_bytes and not value.startswith(MAGIC)

    def _encode(self, value: bytes, lease: int, timeout: float) -> bytes:
        """What to store at the user key: the value, or a manifest after writing its chunks."""
        if self._inline(value):
            return value
        size = self._chunk_bytes
        gen = uuid.uuid4().hex
        count = max(1, -(-len(value) // size))
        for i in range(count):
            self._client.put(
                self._layout.chunk_key(gen, i), value[i * size : (i + 1) * size],
                lease=lease, timeout=timeout,
            )
        return Manifest(gen, count, len(value)).encode()

    def _decode(self, kv: KeyValue) -> bytes | None:
        """The value ``kv`` holds; None if its chunks are gone (replaced and compacted)."""
        manifest = Manifest.decode(kv.value)
        if manifest is None:
            return kv.value
        try:
            res = self._client.range(
                self._layout.chunk_prefix(manifest.gen), prefix=True, revision=kv.mod_revision,
                timeout=self._rpc_timeout(),
            )
        except EtcdCompactedError:
            return None
        data = b"".join(c.value for c in res.kvs)
        if len(res.kvs) != manifest.count or len(data) != manifest.size:
            return None
        return data

    def _discard(self, stored: bytes) -> None:
        """Delete the chunks of a manifest that was never committed."""
        gen = _gen_of(stored)
        if gen is not None:
            self._delete_chunks(gen)

    def _drop_replaced(self, prev: KeyValue | None, own_gen: str | None = None) -> None:
        """Delete the chunks of a value that was overwritten or deleted (not our own)."""
        if prev is None:
            return
        gen = _gen_of(prev.value)
        if gen is not None and gen != own_gen:
            self._delete_chunks(gen)

    def _delete_chunks(self, gen: str) -> None:
        try:
            self._client.delete(self._layout.chunk_prefix(gen), prefix=True, timeout=self._rpc_timeout())
        except EtcdError as e:  # harmless: the namespace lease removes them later
            log.warning("could not delete the chunks of %s: %s", gen, e)


def _gen_of(stored: bytes) -> str | None:
    manifest = Manifest.decode(stored)
    return manifest.gen if manifest is not None else None
