"""Where an :class:`~etcd_store.EtcdStore` namespace keeps things in etcd, and how values are stored.

For a namespace ``ns`` (the store's prefix, UTF-8):

=============================================  =========================================
``ns/<key>``                                   a user key; its value, or a chunk manifest
``ns/<key>\\0q<id>``                            one item of the queue ``<key>``
``ns\\0lease``                                  the id of the namespace lease
``ns\\0c/<gen>/<index>``                        one chunk of a value too big for one request
``ns\\0w/<store>/<thread>``                     the last write of one store thread (exactly-once marker)
=============================================  =========================================

Everything a store writes lies under its prefix: under ``ns/`` or ``ns\\0``, so a
role granted the prefix ``ns`` (or the prefixes ``ns/`` and ``ns\\0``) suffices.

User keys live under ``ns/`` and contain no NUL byte, so every internal key is
either outside that range (``ns\\0...`` sorts before ``ns/``) or contains a NUL
(queue items). A namespace nested in another (``job/sub`` in ``job``) has its user
keys in the outer one's user range, as with ``PrefixStore`` (the outer store sees
``sub/<key>``), and its internal keys there too (``job/sub\\0lease``): those contain
a NUL not followed by ``q``, so they are neither a user key nor a queue item of the
outer store. ``check`` and ``wait`` on a key read the key and its queue items
(``[ns/<key>\\0q, ns/<key>\\0r)``), never the whole ``[ns/<key>, ns/<key>\\1)``
range; a wait watches that range and ignores the events of a nested namespace's
internal keys; ``num_keys`` and ``list_keys`` list the keys and leave out every key
with a NUL.

Values up to ``chunk_bytes`` are stored as they are. A bigger value (or one that
starts with :data:`MAGIC`) is split into chunk keys written first, then the
user key gets a small *manifest* (``MAGIC`` + JSON) that commits them. Each value
gets a fresh generation id and chunks are never rewritten, so a reader reads the
chunks at the latest revision, guarded by the manifest's mod revision (see
:mod:`etcd_store._values`): it never sees a mix of two writes, and compaction
does not affect it.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAGIC = b"\x00etcd_store.chunked\x00"
DEFAULT_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Manifest:
    """A committed chunked value: ``count`` chunks under generation ``gen``."""

    gen: str
    count: int
    size: int

    def encode(self) -> bytes:
        return MAGIC + json.dumps({"gen": self.gen, "count": self.count, "size": self.size}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest | None:
        """The manifest stored in ``raw``, or None if ``raw`` is a plain value."""
        if not raw.startswith(MAGIC):
            return None
        try:
            doc = json.loads(raw[len(MAGIC) :])
            return cls(str(doc["gen"]), int(doc["count"]), int(doc["size"]))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed chunk manifest %r", raw[:200])
            return None


class Layout:
    """The etcd keys of one namespace."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"EtcdStore prefix must be a str, got {type(prefix).__name__}")
        if "\0" in prefix:
            raise ValueError(f"EtcdStore prefix {prefix!r} contains a NUL character")
        self.prefix = prefix.rstrip("/")
        self.ns = self.prefix.encode("utf-8", "surrogateescape")
        self.user_start = self.ns + b"/"
        self.user_end = self.ns + b"0"  # "/" + 1: the end of the user range
        self.lease_key = self.ns + b"\0lease"
        self._chunks = self.ns + b"\0c/"
        self._markers = self.ns + b"\0w/"

    # ------------------------------------------------------------------ user keys

    def key(self, key: str | bytes) -> bytes:
        """The etcd key of a user key. Raises TypeError/ValueError naming a bad key."""
        if isinstance(key, str):
            raw = key.encode("utf-8", "surrogateescape")
        elif isinstance(key, (bytes, bytearray, memoryview)):
            raw = bytes(key)
        else:
            raise TypeError(f"EtcdStore key must be str, got {type(key).__name__}: {key!r}")
        if b"\0" in raw:
            raise ValueError(f"EtcdStore key {key!r} contains a NUL character, which etcd_store reserves")
        return self.user_start + raw

    def user_key(self, etcd_key: bytes) -> str | None:
        """The user key of an etcd key under ``ns/``, None for an internal key."""
        if not etcd_key.startswith(self.user_start) or b"\0" in etcd_key[len(self.user_start) :]:
            return None
        return etcd_key[len(self.user_start) :].decode("utf-8", "surrogateescape")

    def display(self, key: str | bytes) -> str:
        """A key as error messages show it (``<prefix>/<key>``, like TCPStore's ``/<key>``)."""
        text = key if isinstance(key, str) else bytes(key).decode("utf-8", "replace")
        return f"{self.prefix}/{text}"

    @staticmethod
    def span_end(etcd_key: bytes) -> bytes:
        """End of the range holding a user key and its queue items."""
        return etcd_key + b"\x01"

    # ------------------------------------------------------------------ queues

    @staticmethod
    def queue_prefix(etcd_key: bytes) -> bytes:
        return etcd_key + b"\0q"

    @staticmethod
    def is_queue_item(etcd_key: bytes, item: bytes) -> bool:
        return item.startswith(etcd_key + b"\0q")

    def new_queue_item(self, etcd_key: bytes) -> bytes:
        return self.queue_prefix(etcd_key) + uuid.uuid4().hex.encode()

    # ------------------------------------------------------------------ chunks & markers

    def chunk_prefix(self, gen: str) -> bytes:
        return self._chunks + gen.encode() + b"/"

    def chunk_key(self, gen: str, index: int) -> bytes:
        return self.chunk_prefix(gen) + b"%08d" % index

    def marker_key(self, store_id: str, thread_no: int) -> bytes:
        return self._markers + f"{store_id}/{thread_no}".encode()
