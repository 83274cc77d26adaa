"""Loopback ports for tests."""

from __future__ import annotations

import socket


def closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
