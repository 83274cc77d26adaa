"""The demo (``python -m etcd_rdzv.demo`` / ``etcd-rdzv-demo``): a real run with
--chaos, Ctrl-C, an error, and the view it draws.

Every demo run gets a unique marker in its environment, inherited by the
embedded etcd, the agents and the workers; after the demo exits no process
carrying that marker may be alive.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from etcd_rdzv.demo import View
from etcd_rdzv.testing.agents import LocalAgent, summarize
from etcd_rdzv.testing.train import Record, read_records

MARK = "ETCD_RDZV_DEMO_TEST"


def _marked(value: str) -> set[int]:
    needle = f"{MARK}={value}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            if stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X"):
                found.add(int(entry))
        except OSError:
            continue
    return found


class Demo:
    """One demo process, started in its own session, output to a file."""

    def __init__(self, tmp_path: Any, *args: str, command: list[str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.workdir = str(tmp_path / "demo")
        self.out_path = str(tmp_path / "demo.out")
        self.out = open(self.out_path, "wb")
        cmd = command or [sys.executable, "-m", "etcd_rdzv.demo"]
        self.proc = subprocess.Popen(
            [*cmd, "--workdir", self.workdir, *args],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, MARK: self.mark},
            start_new_session=True,
        )

    def output(self) -> str:
        with open(self.out_path, "rb") as f:
            return f.read().decode(errors="replace")

    def records(self) -> list[Record]:
        return read_records(os.path.join(self.workdir, "log.jsonl"))

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"demo still running after {timeout:.0f}s:\n{self.output()[-4000:]}"
            ) from None

    def leftovers(self) -> set[int]:
        """Processes of this run still alive (waits a little for exiting ones)."""
        deadline = time.monotonic() + 5
        while (left := _marked(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in _marked(self.mark):  # never leave anything behind, whatever the test said
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out.close()


@pytest.fixture
def demos(tmp_path: Any) -> Iterator[list[Demo]]:
    made: list[Demo] = []
    try:
        yield made
    finally:
        for d in made:
            d.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_with_chaos_shows_re_rendezvous_and_cleans_up(tmp_path: Any, demos: list[Demo]) -> None:
    demo = Demo(
        tmp_path,
        "--nodes", "2", "--min-nodes", "1", "--steps", "12", "--step-time", "0.15",
        "--chaos", "--chaos-after", "3", "--rejoin-after", "2", "--backend", "etcd-v2",
        "--plot", str(tmp_path / "timeline.png"),
    )  # fmt: skip
    demos.append(demo)
    rc = demo.wait(240)
    out = demo.output()
    assert rc == 0, out[-4000:]
    for needle in (
        "chaos: SIGKILLed node1",
        "recovered: round",
        "chaos: re-added node1",
        "grown back",
        "job finished",
    ):
        assert needle in out, f"{needle!r} not in the demo output:\n{out[-4000:]}"
    sizes = [g.world_size for g in summarize(demo.records())]
    assert 2 in sizes and 1 in sizes[sizes.index(2) :] and sizes[-1] == 2, sizes  # 2 -> 1 -> 2
    png = (tmp_path / "timeline.png").read_bytes()  # --plot: the run's timeline
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000 and f"timeline plot: {tmp_path}" in out
    assert not demo.leftovers()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_ctrl_c_stops_everything(tmp_path: Any, demos: list[Demo]) -> None:
    demo = Demo(tmp_path, "--nodes", "2", "--steps", "100000", "--step-time", "0.2")
    demos.append(demo)
    deadline = time.monotonic() + 150
    while not [r for r in demo.records() if r.kind == "step"]:
        assert demo.proc.poll() is None, demo.output()[-4000:]
        assert time.monotonic() < deadline, demo.output()[-4000:]
        time.sleep(0.2)
    assert len(_marked(demo.mark)) >= 5  # etcd, 2 agents, 2 workers
    os.kill(demo.proc.pid, signal.SIGINT)
    assert demo.wait(60) == 130
    assert "interrupted" in demo.output()
    assert not demo.leftovers()


@pytest.mark.timeout(120)
def test_demo_error_exits_nonzero_and_cleans_up(tmp_path: Any, demos: list[Demo]) -> None:
    demo = Demo(tmp_path, "--nodes", "2", "--backend", "no-such-backend")
    demos.append(demo)
    assert demo.wait(100) == 1
    out = demo.output()
    assert "job FAILED" in out and "no-such-backend" in out, out[-4000:]
    assert not demo.leftovers()


def test_console_script_and_bad_arguments() -> None:
    script = shutil.which("etcd-rdzv-demo")
    assert script, "the etcd-rdzv-demo console script is not installed (pip install -e .)"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "--chaos" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "etcd_rdzv.demo", "--nodes", "1", "--chaos"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--chaos needs" in proc.stderr


def test_view_lines_show_rounds_ranks_world_size_and_steps() -> None:
    def rec(kind: str, t: float, rnd: int, group: str, rank: int, ws: int, step: int, node: str) -> Record:
        return Record(kind=kind, t=t, round=rnd, group=group, rank=rank, world_size=ws, step=step, node=node)

    records = [
        rec("start", 1.0, 1, "g1", 0, 2, 0, "node0"),
        rec("start", 1.0, 1, "g1", 1, 2, 0, "node1"),
        rec("step", 1.1, 1, "g1", 0, 2, 1, "node0"),
        rec("step", 1.2, 1, "g1", 0, 2, 2, "node0"),
        Record("start", 5.0, 2, "g2", 0, 1, 0, node="node0", resumed_from=2),
        rec("step", 5.1, 2, "g2", 0, 1, 3, "node0"),
    ]
    agent = LocalAgent("node0", ["true"])
    view = View(endpoint="127.0.0.1:2379", backend="etcd-v2", steps=10, t0=0.0)
    lines = view.lines(records, {"node0": agent})
    text = "\n".join(lines)
    assert "round  1  world size  2  nodes node0,node1" in text
    assert "round  2  world size  1  nodes node0" in text and "resumed from   2" in text
    assert "current round 2: ranks 0@node0/0" in text
