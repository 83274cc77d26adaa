"""torchrun agents started by a test, each in a process group of its own.

:class:`TorchrunAgents` launches ``python -m torch.distributed.run`` (torch's
unmodified elastic agent) with the given arguments, one log file per agent,
and :meth:`TorchrunAgents.kill` ends every agent's process group, workers
included, also when a test fails. No torch import here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TorchrunAgents:
    """The torchrun agents of one test; workers write their results under ``out_dir``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.out_dir = tmp_path / "results"
        self.out_dir.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def launch(self, n: int, torchrun_args: Sequence[str], *, env: dict[str, str] | None = None,
               runner: Sequence[str] = ("-m", "torch.distributed.run")) -> None:
        """Start ``n`` agents: ``python -m torch.distributed.run <torchrun_args>`` (``runner``:
        what follows ``python`` instead, e.g. a script that adjusts torch's agent, then runs
        ``torch.distributed.run.main()``).

        Children get single-threaded OpenMP, unbuffered output, gloo on loopback,
        INFO logs and faulthandler; torch's agent-store sharing as torch ships it.
        """
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
                     "LOGLEVEL": "INFO", "PYTHONFAULTHANDLER": "1"}
        child_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        child_env.update(env or {})
        for _ in range(n):
            log = self.tmp_path / f"agent-{len(self.procs)}.log"
            cmd = [sys.executable, *runner, *torchrun_args]
            with open(log, "wb") as f:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
                )
            self.logs.append(log)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (None for an agent still running at the deadline; their stacks go to the logs)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if None in codes:
            self.dump_stacks()
        return codes

    def _signal_running(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group of every agent still running."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _wait_each(self, timeout: float) -> list[subprocess.Popen[bytes]]:
        """Wait up to ``timeout`` for each agent in turn; the ones still running."""
        running = []
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                running.append(proc)
        return running

    def dump_stacks(self) -> None:
        """SIGABRT the agents and workers still running: faulthandler prints their stacks."""
        self._signal_running(signal.SIGABRT)
        self._wait_each(10)

    def log_tails(self, lines: int = 60) -> str:
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace").splitlines()
            parts.append(f"----- {log.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def read_results(self, pattern: str) -> list[dict[str, Any]]:
        """The JSON files under ``out_dir`` matching ``pattern``, in name order."""
        return [json.loads(p.read_text()) for p in sorted(self.out_dir.glob(pattern))]

    def kill(self) -> None:
        """End every agent's process group (SIGTERM, then SIGKILL), workers left behind included."""
        self._signal_running(signal.SIGTERM)
        for proc in self._wait_each(10):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for proc in self.procs:
            try:  # workers left behind in the agent's group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
