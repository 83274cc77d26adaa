"""The training script's checkpoint fence, and ``LocalAgent.freeze``, on real processes.

A worker group that a newer group replaced (its node was frozen, then thawed
before its agent stopped it) must not put its older checkpoint over the newer
group's: ``train.py`` commits a checkpoint only while its round is still the
newest, and otherwise exits non-zero without writing. A one-rank group (no
torchrun) stands in for the stale group; writing the round counter stands in
for the newer group's start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from torch.distributed.elastic.utils.distributed import get_free_port

from etcd_rdzv.testing.agents import LocalAgent
from etcd_rdzv.testing.train import CHECKPOINT_NAME, ROUND_NAME, Record, read_records

pytestmark = pytest.mark.timeout(180)

REPO = REPO_ROOT


def _worker(tmp_path: Path, steps: int, step_time: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(get_free_port()), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": REPO,
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "etcd_rdzv.testing.train", "--log-file", str(tmp_path / "log.jsonl"),
         "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", str(steps), "--ckpt-every", "3",
         "--step-time", str(step_time)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait_for(proc: subprocess.Popen[bytes], log: Path, what: str, pred: object, timeout: float) -> list[Record]:
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(str(log))
        if pred(records):  # type: ignore[operator]
            return records
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0].decode(errors="replace") if proc.poll() is not None else ""
            raise AssertionError(f"no {what} (exit {proc.poll()}): {records}\n{out[-3000:]}")
        time.sleep(0.05)


def test_checkpoints_commit_while_the_round_is_newest(tmp_path: Path) -> None:
    """Control: left alone, the worker checkpoints every 3 steps and exits 0."""
    proc = _worker(tmp_path, steps=6, step_time=0.0)
    out = proc.communicate(timeout=150)[0].decode(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    records = read_records(str(tmp_path / "log.jsonl"))
    assert [r.step for r in records if r.kind == "ckpt"] == [3, 6]
    assert (tmp_path / "ckpt" / ROUND_NAME).read_text().strip() == "1"


def test_superseded_group_drops_its_checkpoint_and_exits(tmp_path: Path) -> None:
    proc = _worker(tmp_path, steps=60, step_time=0.1)
    try:
        log = tmp_path / "log.jsonl"
        records = _wait_for(proc, log, "first checkpoint", lambda rs: any(r.kind == "ckpt" for r in rs), 120)
        ckpt = tmp_path / "ckpt" / CHECKPOINT_NAME
        committed = ckpt.stat().st_mtime_ns
        (tmp_path / "ckpt" / ROUND_NAME).write_text(str(records[0].round + 1))  # a newer group started
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    assert "superseded" in out
    records = read_records(str(log))
    ckpts = [r.step for r in records if r.kind == "ckpt"]
    steps = max(r.step for r in records if r.kind == "step")
    assert steps > ckpts[-1], "the fence was never reached"
    assert not any(r.kind == "done" for r in records)
    assert ckpt.stat().st_mtime_ns == committed, "a superseded group rewrote the checkpoint"
    assert not [p for p in os.listdir(tmp_path / "ckpt") if p.endswith(".tmp")]


def test_freeze_stops_every_process_of_the_node_until_thaw(tmp_path: Path) -> None:
    """After ``freeze`` no process of the node runs (the agent and the child it
    started): a busy child appends nothing to its file until ``thaw``."""
    out = tmp_path / "ticks"
    child = f"import time\nwhile True:\n    open({str(out)!r}, 'a').write('x')\n    time.sleep(0.001)\n"
    parent = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "while True:\n    time.sleep(1)\n"
    )
    agent = LocalAgent("busy", [sys.executable, "-c", parent])
    agent.start()
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.stat().st_size > 0):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.01)
        pids = agent.freeze()
        assert len(pids) == 2
        size = out.stat().st_size
        time.sleep(0.3)  # a running child would append ~100 ticks meanwhile
        assert out.stat().st_size == size
        agent.thaw()
        deadline = time.monotonic() + 30
        while out.stat().st_size == size:
            assert time.monotonic() < deadline, "the child did not resume after thaw"
            time.sleep(0.01)
    finally:
        agent.kill()
