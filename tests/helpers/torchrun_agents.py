"""torchrun agents with raw command lines, on the one agent harness (:class:`etcd_rdzv.testing.agents.LocalAgent`).

:class:`TorchrunAgents` launches ``python -m torch.distributed.run`` (torch's unmodified elastic agent)
with the given arguments, one log file per agent, as :class:`LocalAgent`\\ s: each agent in a session of
its own, its processes (workers included) found by the tag in their environment, so :meth:`kill` ends
every one of them, also when a test fails. The job harness of the fault scenarios
(tests/helpers/elastic.py) uses the same class. No torch import here.
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

from etcd_rdzv.testing.agents import LocalAgent


class TorchrunAgents:
    """The torchrun agents of one test; workers write their results under ``out_dir``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.out_dir = tmp_path / "results"
        self.out_dir.mkdir()
        self.agents: list[LocalAgent] = []
        self.logs: list[Path] = []

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The agents' processes, in launch order."""
        return [a.proc for a in self.agents if a.proc is not None]

    def launch(self, n: int, torchrun_args: Sequence[str], *, env: dict[str, str] | None = None,
               runner: Sequence[str] = ("-m", "torch.distributed.run")) -> None:
        """Start ``n`` agents: ``python -m torch.distributed.run <torchrun_args>`` (``runner``:
        what follows ``python`` instead, e.g. a script that adjusts torch's agent, then runs
        ``torch.distributed.run.main()``).

        Children get single-threaded OpenMP, unbuffered output, gloo on loopback (LocalAgent's defaults),
        INFO logs and faulthandler; torch's agent-store sharing as torch ships it.
        """
        child_env = {"LOGLEVEL": "INFO", "PYTHONFAULTHANDLER": "1", **(env or {})}
        for _ in range(n):
            log = self.tmp_path / f"agent-{len(self.agents)}.log"
            agent = LocalAgent(
                log.stem, [sys.executable, *runner, *torchrun_args],
                env=child_env, output=str(log), unset=() if env and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in env
                else ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",),
            )  # fmt: skip
            agent.start()
            self.agents.append(agent)
            self.logs.append(log)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (None for an agent still running at the deadline; their stacks go to the logs)."""
        deadline = time.monotonic() + timeout
        codes = [a.wait(timeout=max(deadline - time.monotonic(), 0.01)) for a in self.agents]
        if None in codes:
            self.dump_stacks()
        return codes

    def dump_stacks(self) -> None:
        """SIGABRT the agents and workers still running: faulthandler prints their stacks."""
        for agent in self.agents:
            for pid in agent.pids():
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for agent in self.agents:
            agent.wait(timeout=max(deadline - time.monotonic(), 0.01))

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
        """End every agent and every process it started (SIGTERM, then SIGKILL after 10 s)."""
        for agent in self.agents:
            if agent.running():
                try:
                    os.kill(agent.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for agent in self.agents:
            agent.wait(timeout=max(deadline - time.monotonic(), 0.01))
            agent.close()  # SIGKILLs whatever is left of the node, workers included
