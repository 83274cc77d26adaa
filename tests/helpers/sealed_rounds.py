"""Deterministic harness for torch's dynamic rendezvous: a controlled clock, gated steps (issue 22).

Nodes are handlers of one run, each running ``next_rendezvous`` in its own thread.
:func:`install` replaces, in torch's ``dynamic_rendezvous`` module (and in
``etcd_rdzv.dynamic.state``), what makes the handler non-deterministic:

* ``datetime`` (heartbeats, last-call deadlines, the dead-node check) and
  ``time.monotonic`` (the 1 s read cache, operation deadlines) read a
  :class:`Clock` that only the test moves;
* ``_delay`` (the join loop's 1 s poll, the first round's random skew): a node
  *parks* at each poll until the test lets it take one more step;
* ``_PeriodicTimer`` (the keep-alive thread) does nothing: a test sends a node's
  heartbeat by calling its ``_keep_alive()``;
* ``RendezvousStoreInfo.build`` returns a fixed address (its store reads would
  block a non-rank-0 node until rank 0 has finished; that is not what is tested).

:class:`MemoryBackend` is torch's backend contract over a shared in-memory cell
with a token; :class:`Stalling` wraps any backend so that a node stalls (the
clock jumps) between a read and what the node does with it.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from etcd_rdzv import EtcdRendezvousHandler
from etcd_rdzv.dynamic import state as our_state

WAIT = 20.0  # real seconds a node may take to reach its next poll (it needs milliseconds)
KEEP_ALIVE_S = 5  # torch's defaults: a heartbeat every 5 s, dead after 3 missed (15 s)
ATTEMPTS = 3
TIMEOUT = RendezvousTimeout(join=timedelta(seconds=600), last_call=timedelta(seconds=2))
START = datetime(2026, 1, 1, tzinfo=timezone.utc)

TORCH = DynamicRendezvousHandler
OURS = EtcdRendezvousHandler
KINDS = {"torch": TORCH, "ours": OURS}


class Clock:
    """Wall clock and monotonic clock of every node; moved only by :meth:`advance`/:meth:`at`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t = 0.0

    def reset(self) -> None:
        """Back to the start (between two runs of a test; no node may be joining)."""
        with self._lock:
            self.t = 0.0

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds

    def at(self, t: float) -> None:
        """Set the time to ``t`` seconds after the start (never backwards)."""
        with self._lock:
            assert t >= self.t, f"the clock cannot go back from {self.t} to {t}"
            self.t = t

    def now(self, tz: Any = None) -> datetime:
        return START + timedelta(seconds=self.t)

    def monotonic(self) -> float:
        return 1000.0 + self.t


class _NoTimer:
    def __init__(self, *args: Any) -> None:
        pass

    def set_name(self, name: str) -> None:
        pass

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        pass


_parked_at: dict[threading.Thread, Node] = {}


def _gated_delay(seconds: float | tuple[float, float]) -> None:
    if isinstance(seconds, tuple):  # the first round's random skew: none
        return
    node = _parked_at.get(threading.current_thread())
    assert node is not None, "a join poll outside a node thread"
    node._park()


def install(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Make torch's dynamic rendezvous deterministic for this test (module docstring)."""
    clock = Clock()
    shim = SimpleNamespace(now=clock.now)
    monkeypatch.setattr(dr, "datetime", shim)
    monkeypatch.setattr(our_state, "datetime", shim)
    monkeypatch.setattr(dr, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(dr, "_delay", _gated_delay)
    monkeypatch.setattr(dr, "_PeriodicTimer", _NoTimer)
    fixed = RendezvousStoreInfo("127.0.0.1", 29500)
    monkeypatch.setattr(dr, "RendezvousStoreInfo", SimpleNamespace(build=lambda *a, **k: fixed))
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return clock


# --------------------------------------------------------------------------- backends


class MemoryCell:
    """The shared state of one run: bytes and an integer token, under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bits: bytes | None = None
        self.token = 0


class MemoryBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` contract over a :class:`MemoryCell` (compare-and-set on the token)."""

    def __init__(self, cell: MemoryCell) -> None:
        self.cell = cell

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self) -> tuple[bytes, Token] | None:
        with self.cell.lock:
            return None if self.cell.bits is None else (self.cell.bits, self.cell.token)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        with self.cell.lock:
            if (token or 0) == self.cell.token:
                self.cell.bits, self.cell.token = state, self.cell.token + 1
                return state, self.cell.token, True
            return None if self.cell.bits is None else (self.cell.bits, self.cell.token, False)


class Stalling(RendezvousBackend):
    """Delegates to ``inner``; after :meth:`stall_next_read`, the next read is followed by a
    jump of the clock: the node stalled between reading the state and acting on it."""

    def __init__(self, inner: RendezvousBackend, clock: Clock) -> None:
        self.inner = inner
        self.clock = clock
        self._stall = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    def stall_next_read(self, seconds: float) -> None:
        self._stall = seconds

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self.inner.get_state()
        stall, self._stall = self._stall, 0.0
        self.clock.advance(stall)
        return found

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        return self.inner.set_state(state, token)


def stored_state(backend: RendezvousBackend) -> Any:
    """The run's stored ``_RendezvousState`` (``None`` when there is none)."""
    found = backend.get_state()
    return None if found is None else pickle.loads(found[0])


# --------------------------------------------------------------------------- nodes


@dataclass
class Node:
    """One handler; :meth:`join` runs its ``next_rendezvous`` in a thread parked at each poll."""

    name: str
    handler: Any
    backend: Stalling
    info: RendezvousInfo | None = None
    joined_round: int | None = None  # the round the last finished join returned
    error: BaseException | None = None
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _parked: bool = False
    _parks: int = 0
    _go: int = 0
    _running: bool = False

    def join(self) -> Node:
        """Start ``next_rendezvous``; return once it parks at a poll or has returned."""
        assert not self._running, f"{self.name} is already joining"
        self.info, self.error, self.joined_round, self._running = None, None, None, True
        thread = threading.Thread(target=self._run, name=f"node-{self.name}", daemon=True)
        _parked_at[thread] = self
        with self._cv:
            before = self._parks
            thread.start()
            self._wait(lambda: not self._running or self._parks > before)
        return self

    def step(self) -> None:
        """Let the parked node run to its next poll (or to the end of its join)."""
        with self._cv:
            assert self._parked, f"{self.name} is not parked"
            before = self._parks
            self._go += 1
            self._cv.notify_all()
            self._wait(lambda: not self._running or self._parks > before)

    @property
    def parked(self) -> bool:
        with self._cv:
            return self._parked

    @property
    def world(self) -> tuple[int, int] | None:
        """(rank, world size) the finished join returned."""
        if self.error is not None:
            raise AssertionError(f"{self.name}'s join failed") from self.error
        return None if self.info is None else (self.info.rank, self.info.world_size)

    @property
    def round(self) -> int:
        """The round of the finished join, else the round of the node's copy of the state."""
        if self.joined_round is not None:
            return self.joined_round
        return int(self.handler._state_holder.state.round)

    def _run(self) -> None:
        try:
            self.info = self.handler.next_rendezvous()
            self.joined_round = int(self.handler._state_holder.state.round)
        except BaseException as e:
            self.error = e
        finally:
            with self._cv:
                self._running = False
                self._cv.notify_all()

    def _park(self) -> None:
        with self._cv:
            self._parked = True
            self._parks += 1
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._go > 0, timeout=WAIT):
                raise AssertionError(f"{self.name} was never stepped again")
            self._go -= 1
            self._parked = False

    def _wait(self, done: Callable[[], bool]) -> None:
        if not self._cv.wait_for(done, timeout=WAIT):
            raise AssertionError(f"{self.name} did not reach its next poll within {WAIT} s")


class Run:
    """Nodes of one run, all of one handler kind, over backends from ``backend_factory``."""

    def __init__(
        self, kind: type, clock: Clock, backend_factory: Callable[[], RendezvousBackend], nnodes: tuple[int, int]
    ) -> None:
        self.kind = kind
        self.clock = clock
        self.backend_factory = backend_factory
        self.nnodes = nnodes
        self.store = dist.HashStore()
        self.nodes: dict[str, Node] = {}

    def node(self, name: str) -> Node:
        backend = Stalling(self.backend_factory(), self.clock)
        handler = self.kind.from_backend(
            "sealed", self.store, backend, *self.nnodes, local_addr=name, timeout=TIMEOUT,
            keep_alive_interval=KEEP_ALIVE_S, keep_alive_max_attempt=ATTEMPTS,
        )  # fmt: skip
        self.nodes[name] = Node(name, handler, backend)
        return self.nodes[name]

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def heartbeat(self, *names: str) -> None:
        """Each named node sends its keep-alive now (as its timer would)."""
        for name in names:
            self.nodes[name].handler._keep_alive()

    def waiting(self, *names: str) -> dict[str, int]:
        return {n: self.nodes[n].handler.num_nodes_waiting() for n in names}

    def drive(self, *, dt: float = 1.1, max_cycles: int = 80) -> None:
        """Advance the clock by ``dt`` and step every parked node, in the order they were
        made, until none is parked (every join returned)."""
        nodes = list(self.nodes.values())
        for _ in range(max_cycles):
            parked = [n for n in nodes if n.parked]
            if not parked:
                return
            self.clock.advance(dt)
            for n in parked:
                n.step()
        raise AssertionError(f"joins of {[n.name for n in nodes if n.parked]} still waiting")

    def participants(self) -> list[str]:
        """Addresses of the stored round's members."""
        state = stored_state(self.backend_factory())
        return sorted(n.addr for n in state.participants) if state else []

    def close(self) -> None:
        for node in self.nodes.values():
            if node.parked:  # let a parked join fail (it is past its deadline) rather than leak
                self.clock.advance(10_000)
                node.step()
