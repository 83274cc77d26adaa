"""A TCP forwarder that adds a fixed latency to each direction (stdlib only).

For kernels without ``sch_netem`` (``tc qdisc ... netem`` answers "Specified qdisc kind
is unknown"): the test bed runs it inside a host's namespace in front of a port
(:meth:`tests.helpers.netns.Host.start_delay_proxy`), and clients connect to it instead.

Contract: every byte read from one side is written to the other side ``delay`` seconds
after it was read, in order; bytes read later are never held up by more than the delay
(a stream of chunks is delayed, not slowed to one chunk per delay). A side that closes
is closed on the other side after the data before it. Blocking: :func:`serve` runs until
the process is killed. Run as a script::

    python delay_proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS

It prints ``listening HOST:PORT`` on stdout once it accepts connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + delay, chunk))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((time.monotonic() + delay, b""))

    reading = asyncio.ensure_future(read())
    try:
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the injected latency itself
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        with contextlib.suppress(Exception):
            writer.close()


async def _forward(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: tuple[str, int], delay: float
) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    await asyncio.gather(_pump(client_r, server_w, delay), _pump(server_r, client_w, delay))


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _forward(r, w, target, delay), listen[0], listen[1], reuse_address=True
    )
    print(f"listening {listen[0]}:{listen[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(_addr(argv[0]), _addr(argv[1]), float(argv[2]) / 1000.0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
