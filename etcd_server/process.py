"""Process plumbing shared by every local etcd: ports, spawning, clean-up.

* :func:`free_ports` picks loopback ports free a moment ago (callers retry on
  "address already in use");
* :func:`death_signal_prefix` / :func:`make_preexec` + :func:`in_spawner_thread`: on
  Linux a child gets ``PR_SET_PDEATHSIG=SIGKILL``, so the kernel kills etcd even when
  Python is SIGKILLed. Where util-linux's ``setpriv`` exists, etcd is exec'ed through
  ``setpriv --pdeathsig KILL`` so that no ``preexec_fn`` is needed: a ``preexec_fn``
  forces a plain ``fork()``, which runs the parent's ``atfork`` handlers in the child
  (gRPC's in a gRPC client: seen to abort the child under load), while without one
  Python spawns with ``vfork``, which runs none;
* :func:`register_live` / :func:`make_temp_dir`: an ``atexit`` hook stops every etcd
  still running and removes every temporary directory still there.

.. note:: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not
   only the process. So every launch is forked by one daemon "spawner" thread that lives
   until the process ends, and ``start()`` may be called from any thread (a short-lived
   one included). ``die_with_parent=False`` opts out of the death signal.

Standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

__all__ = [
    "HOST",
    "Stoppable",
    "death_signal_prefix",
    "free_ports",
    "in_spawner_thread",
    "make_preexec",
    "make_private_dir",
    "make_temp_dir",
    "register_live",
    "remove_temp_dir",
    "unregister_live",
]

logger = logging.getLogger(__name__)

#: The only address local etcd servers listen on.
HOST = "127.0.0.1"

_PR_SET_PDEATHSIG = 1


class Stoppable(Protocol):
    """What the ``atexit`` hook needs of a live etcd (``EtcdMember`` has it)."""

    def terminate(self, *, grace: float = ...) -> int | None: ...


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago.

    Binds port 0 ``n`` times, holding all sockets until all are chosen so the ports
    differ. Another process may take a port before etcd binds it; callers retry.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def death_signal_prefix(die_with_parent: bool) -> list[str] | None:
    """``[setpriv, "--pdeathsig", "KILL", "--"]`` to put before a command (Linux with util-linux), else None.

    The process ``setpriv`` execs keeps the death signal (cleared only for set-user-ID
    programs); its parent is the thread that spawned ``setpriv``.
    """
    if not die_with_parent or not sys.platform.startswith("linux"):
        return None
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else None


def make_preexec(die_with_parent: bool) -> Callable[[], None] | None:
    """A ``preexec_fn`` setting ``PR_SET_PDEATHSIG=SIGKILL`` (Linux), else None.

    libc and ``prctl`` are resolved before the fork, so the child only makes the system
    call. If the parent died between ``fork`` and ``prctl``, the child kills itself.
    """
    if not die_with_parent or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        logger.warning("prctl unavailable; etcd will not die with its parent")
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sigkill)

    return preexec


_T = TypeVar("_T")
_spawn_lock = threading.Lock()
_spawn_queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] | None = None


def _spawner_loop(q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
    while True:
        fn, fut = q.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the caller
            fut.set_exception(e)


def in_spawner_thread(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` (a fork) on the spawner thread (module docstring's note); block for it."""
    global _spawn_queue
    with _spawn_lock:
        if _spawn_queue is None:
            q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
            threading.Thread(
                target=_spawner_loop, args=(q,), name="etcd-server-spawner", daemon=True
            ).start()
            _spawn_queue = q
        fut: Future[_T] = Future()
        _spawn_queue.put((fn, fut))
    return fut.result()


_live_lock = threading.Lock()
_live: set[Stoppable] = set()
_temp_dirs: set[str] = set()
_atexit_registered = False


def _track(items: set[_T], item: _T) -> _T:
    """Add ``item`` to what the atexit hook cleans up (``_live`` or ``_temp_dirs``); returns it."""
    global _atexit_registered
    with _live_lock:
        items.add(item)
        if not _atexit_registered:
            atexit.register(_stop_all_at_exit)
            _atexit_registered = True
    return item


def make_temp_dir(prefix: str) -> str:
    """``mkdtemp`` that the atexit hook removes if the owner never does."""
    return _track(_temp_dirs, tempfile.mkdtemp(prefix=prefix))


#: Longest directory path for a private set-up socket (``<dir>/localhost:<port>``): AF_UNIX
#: addresses hold at most 107 bytes on Linux (103 on macOS).
_MAX_SOCKET_DIR = 80


def make_private_dir(parent: str | None) -> str:
    """A new directory only this user can enter (0700), for a private unix socket.

    Inside ``parent`` when the socket's path stays short enough, else a new temporary
    directory (``/tmp`` when the default one's path is long); the atexit hook removes it.
    """
    if parent is not None and len(os.path.abspath(parent)) + len("/private-xxxxxxxx") <= _MAX_SOCKET_DIR:
        path = tempfile.mkdtemp(prefix="private-", dir=parent)  # mkdtemp: mode 0700, a new name
    else:
        base = tempfile.gettempdir()
        if len(base) + len("/etcd-auth-xxxxxxxx") > _MAX_SOCKET_DIR and os.path.isdir("/tmp"):
            base = "/tmp"
        path = tempfile.mkdtemp(prefix="etcd-auth-", dir=base)
    return _track(_temp_dirs, path)


def remove_temp_dir(path: str) -> None:
    """Remove a directory made by :func:`make_temp_dir`."""
    shutil.rmtree(path, ignore_errors=True)
    with _live_lock:
        _temp_dirs.discard(path)


def register_live(member: Stoppable) -> None:
    _track(_live, member)


def unregister_live(member: Stoppable) -> None:
    with _live_lock:
        _live.discard(member)


def _stop_all_at_exit() -> None:
    """atexit hook: stop every etcd this process started and still runs."""
    with _live_lock:
        members = list(_live)
        dirs = list(_temp_dirs)
    for m in members:
        with contextlib.suppress(Exception):
            m.terminate(grace=5.0)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
