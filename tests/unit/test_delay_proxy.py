"""The delay forwarder of the partition scenarios (tests/helpers/delay_proxy.py) on loopback:
it adds its latency to each direction, keeps the byte order, and delays a stream
without slowing it to one chunk per delay."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import delay_proxy
from helpers.ports import closed_port

DELAY_MS = 150


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    thread.join(10)


@pytest.fixture
def proxy(echo_port: int) -> Iterator[int]:
    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, delay_proxy.__file__, f"127.0.0.1:{port}", f"127.0.0.1:{echo_port}", str(DELAY_MS)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("listening")
        yield port
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the forwarder closed the connection"
        out += chunk
    return out


def test_each_direction_is_delayed_and_a_stream_is_not_slowed(proxy: int) -> None:
    with socket.create_connection(("127.0.0.1", proxy), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"ping")
        assert _recv_exactly(sock, 4) == b"ping"
        rtt = time.monotonic() - started
        assert 2 * DELAY_MS / 1000 <= rtt < 2 * DELAY_MS / 1000 + 1.0
        # 20 writes 10 ms apart: all back about one round trip after the last, in order.
        payload = b"".join(f"{i:04d}".encode() for i in range(20))
        started = time.monotonic()
        for i in range(20):
            sock.sendall(payload[4 * i : 4 * i + 4])
            time.sleep(0.01)  # spacing the writes of the stream
        assert _recv_exactly(sock, len(payload)) == payload
        took = time.monotonic() - started
        assert took < 0.2 + 2 * DELAY_MS / 1000 + 1.0, f"a stream of 20 chunks took {took:.2f} s"
