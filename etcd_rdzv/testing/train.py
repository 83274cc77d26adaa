"""A small real elastic training job for torchrun, and the reader of its step log.

Run it under torchrun, as a file or as a module::

    torchrun --nnodes=2:3 --nproc-per-node=2 --rdzv-backend=etcd-v2 \\
        --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 --max-restarts=3 \\
        etcd_rdzv/testing/train.py --log-file /tmp/job1/log.jsonl --ckpt-dir /tmp/job1 --steps 40
    torchrun ... -m etcd_rdzv.testing.train --log-file ... --ckpt-dir ... --steps 40

What one worker does: joins a gloo process group (``env://``, from torchrun's
``MASTER_ADDR``/``MASTER_PORT``), trains a one-layer model under
DistributedDataParallel on synthetic data, and every ``--ckpt-every`` steps
rank 0 saves the model and the step to ``<ckpt-dir>/checkpoint.pt``
(atomically: written aside, then renamed; not at all once a newer group has
started, so a stale group never overwrites a newer checkpoint). A worker group started after a
restart or a re-rendezvous resumes from that checkpoint, so a node loss costs
at most ``--ckpt-every`` steps. ``--step-time`` stretches each step to stand in
for real compute, so that faults can land mid-training. The job ends when the
step count reaches ``--steps``, or the number written in ``--steps-file`` (read
by rank 0 before every step and broadcast, so a running job can be lengthened
or shortened: the demo and the tests end jobs that way once they saw enough).

The log: every worker appends one JSON object per line to ``--log-file`` (a single
``write`` on an ``O_APPEND`` descriptor, so lines of concurrent writers never
interleave). Fields of every record (:class:`Record`):

* ``kind``: ``"start"`` (group formed; ``resumed_from`` = checkpoint step or 0),
  ``"step"`` (a step whose gradient all-reduce completed on every rank),
  ``"ckpt"`` (rank 0 saved step ``step``), ``"done"`` (last step reached);
* ``round``: the worker group's generation: rank 0 of every new group bumps a
  counter kept in ``<ckpt-dir>/round``, so each worker group (each successful
  rendezvous) gets the next number; ``group``: a random id of the group;
* ``rank``, ``world_size``, ``local_rank``, ``group_rank`` (the node's rank),
  ``node`` (``$ETCD_RDZV_NODE``, else the host name), ``pid``, ``restart``
  (``$TORCHELASTIC_RESTART_COUNT``), ``step``, ``t`` (``time.time()`` after the
  step completed).

:func:`read_records` parses the log; it and :class:`Record` import only the
standard library, so monitors (the demo, the tests) can read logs without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["NODE_ENV", "Record", "group_order", "main", "read_records"]

NODE_ENV = "ETCD_RDZV_NODE"
"""Environment variable naming the node (agent) a worker runs under, for the log."""

CHECKPOINT_NAME = "checkpoint.pt"
ROUND_NAME = "round"


@dataclasses.dataclass(frozen=True)
class Record:
    """One line of the training log (see the module docstring for the fields)."""

    kind: str
    t: float
    round: int
    group: str
    rank: int
    world_size: int
    step: int
    local_rank: int = 0
    group_rank: int = 0
    node: str = ""
    pid: int = 0
    restart: int = 0
    resumed_from: int = 0
    loss: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Record:
        """Parse one log line; raises ``ValueError`` on a malformed one."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"not a log record: {line!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as e:
            raise ValueError(f"not a log record: {line!r} ({e})") from e


def read_records(path: str) -> list[Record]:
    """All complete records of the log at ``path`` in file order ([] if absent).

    A last line without its newline (a writer killed mid-write) is skipped;
    a malformed complete line raises ``ValueError`` naming the line number.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    records: list[Record] = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: "" or an unfinished line
        if line.strip():
            try:
                records.append(Record.from_json(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from e
    return records


def group_order(records: Iterable[Record]) -> list[str]:
    """Group ids in the order their first record appears."""
    seen: dict[str, None] = {}
    for r in records:
        seen.setdefault(r.group, None)
    return list(seen)


# --------------------------------------------------------------------------- the worker


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="etcd_rdzv.testing.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-file", required=True, help="JSON-lines log every rank appends to")
    p.add_argument("--ckpt-dir", required=True, help="directory of the checkpoint and round counter")
    p.add_argument("--steps", type=int, default=30, help="train until this step (default 30)")
    p.add_argument(
        "--steps-file",
        default=None,
        help="file holding the target step count, re-read by rank 0 every step (lengthen or "
        "shorten a running job by rewriting it); --steps applies while it is absent or unreadable",
    )
    p.add_argument("--ckpt-every", type=int, default=3, help="checkpoint period in steps (default 3)")
    p.add_argument("--step-time", type=float, default=0.2, help="seconds per step, simulated compute")
    p.add_argument(
        "--pg-timeout", type=float, default=60.0,
        help="seconds a training collective waits for a silent (hung) peer before failing (default 60)",
    )  # fmt: skip
    p.add_argument(
        "--init-timeout", type=float, default=300.0,
        help="seconds the process group set-up waits for every rank to arrive (default 300)",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.ckpt_every < 1 or args.step_time < 0:
        p.error("--steps and --ckpt-every must be >= 1, --step-time >= 0")
    if args.pg_timeout <= 0 or args.init_timeout <= 0:
        p.error("--pg-timeout and --init-timeout must be > 0")
    return args


class _LogWriter:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Record) -> None:
        os.write(self._fd, (record.to_json() + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def _env_int(name: str, default: int = 0) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _target_steps(args: argparse.Namespace) -> int:
    """``--steps``, or the number in ``--steps-file`` when that file holds one."""
    if args.steps_file:
        try:
            with open(args.steps_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            pass
    return int(args.steps)


def _current_round(ckpt_dir: str) -> int:
    """The generation counter: the round of the newest worker group (0 before any)."""
    try:
        with open(os.path.join(ckpt_dir, ROUND_NAME)) as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0


def _next_round(ckpt_dir: str) -> int:
    """Bump and return the generation counter (rank 0 only)."""
    path = os.path.join(ckpt_dir, ROUND_NAME)
    last = _current_round(ckpt_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(last + 1))
    os.replace(tmp, path)
    return last + 1


def _identity(group: Any, ckpt_dir: str) -> dict[str, Any]:
    """The fields of every record of this worker: the round number and group id (chosen by rank
    0, shared with one broadcast over ``group``), its rank and world, node and restart count."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ident = torch.zeros(2, dtype=torch.int64)
    if rank == 0:
        ident[0] = _next_round(ckpt_dir)
        ident[1] = secrets.randbits(62)
    dist.broadcast(ident, src=0, group=group)
    return {
        "round": int(ident[0]),
        "group": f"{int(ident[1]):016x}",
        "rank": rank,
        "world_size": dist.get_world_size(),
        "local_rank": _env_int("LOCAL_RANK"),
        "group_rank": _env_int("GROUP_RANK"),
        "node": os.environ.get(NODE_ENV) or socket.gethostname(),
        "pid": os.getpid(),
        "restart": _env_int("TORCHELASTIC_RESTART_COUNT"),
    }


def _train_step(args: argparse.Namespace, ddp: Any, model: Any, step: int, rank: int) -> float:
    """One SGD step on this rank's batch of ``step``; returns its loss. Blocks in the gradient
    all-reduce until every rank took part."""
    import torch
    from torch import nn

    if args.step_time:
        time.sleep(args.step_time)  # stands in for the compute of a real step
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 16, generator=g)
    y = (x @ torch.linspace(-1.0, 1.0, 16)).unsqueeze(1)
    loss = nn.functional.mse_loss(ddp(x), y)
    model.zero_grad(set_to_none=True)
    loss.backward()  # the gradient all-reduce: completes only when every rank took part
    with torch.no_grad():  # plain SGD by hand: torch.optim would import torch._dynamo (seconds)
        for param in model.parameters():
            if param.grad is not None:
                param.add_(param.grad, alpha=-args.lr)
    return float(loss.detach())


def _checkpoint(args: argparse.Namespace, model: Any, step: int, base: dict[str, Any], writer: _LogWriter) -> None:
    """Rank 0: save the checkpoint of ``step``, unless a newer round replaced this one (then the
    process exits at once with status 1)."""
    import torch

    ckpt_path = os.path.join(args.ckpt_dir, CHECKPOINT_NAME)
    tmp = f"{ckpt_path}.{os.getpid()}.tmp"
    torch.save({"model": model.state_dict(), "step": step}, tmp)
    # Fenced by the round: a group that a newer one replaced (this node
    # was frozen, say, and is thawed before its agent stops it) must not
    # put an older checkpoint over the newer group's.
    if _current_round(args.ckpt_dir) != base["round"]:
        os.unlink(tmp)
        log.error("round %d was superseded; checkpoint of step %d dropped", base["round"], step)
        writer.close()
        logging.shutdown()
        os._exit(1)  # skips gloo's destructors, which can hang on a dead group
    os.replace(tmp, ckpt_path)
    writer.write(Record(kind="ckpt", t=time.time(), step=step, **base))


def run(args: argparse.Namespace) -> int:
    """Train until ``args.steps``; returns the exit status (0)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    os.makedirs(args.ckpt_dir, exist_ok=True)
    # Two timeouts: set-up waits for the slowest rank to start (importing torch
    # takes seconds on a busy host); training collectives get a short one, so
    # that a hung (not dead) peer is noticed quickly.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.init_timeout))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    if not isinstance(group, dist.ProcessGroup):  # torch 2.15 types it ProcessGroup | _NonGroupMember
        raise RuntimeError(f"rank {dist.get_rank()} is not a member of the training group ({group!r})")
    writer = _LogWriter(args.log_file)
    base = _identity(group, args.ckpt_dir)
    rank = base["rank"]

    torch.manual_seed(args.seed)
    model = nn.Linear(16, 1)
    ckpt_path = os.path.join(args.ckpt_dir, CHECKPOINT_NAME)
    start = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        start = int(state["step"])
    ddp = DistributedDataParallel(model, process_group=group)  # broadcasts rank 0's parameters
    writer.write(Record(kind="start", t=time.time(), step=start, resumed_from=start, **base))
    log.info("rank %d/%d round %d resumes from step %d", rank, base["world_size"], base["round"], start)

    target = torch.zeros(1, dtype=torch.int64)
    step = start
    while True:
        # the target step count: rank 0 decides (it may re-read --steps-file), all follow
        if rank == 0:
            target[0] = _target_steps(args)
        dist.broadcast(target, src=0, group=group)
        if step >= int(target[0]):
            break
        step += 1
        loss = _train_step(args, ddp, model, step, rank)
        writer.write(Record(kind="step", t=time.time(), step=step, loss=loss, **base))
        if rank == 0 and step % args.ckpt_every == 0:
            _checkpoint(args, model, step, base, writer)

    writer.write(Record(kind="done", t=time.time(), step=step, **base))
    writer.close()
    # Tear down in order (DDP, the training group, the default group): leaving
    # it to interpreter exit can hang in gloo's destructors.
    dist.barrier(group=group)
    del ddp
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m etcd_rdzv.testing.train`` (under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = _parse_args(argv)
    return run(args)


def _describe(records: Sequence[Record]) -> dict[str, Any]:
    """Compact per-group summary (used by ``python -m etcd_rdzv.testing.train --summary LOG``)."""
    out: dict[str, Any] = {}
    for gid in group_order(records):
        rs = [r for r in records if r.group == gid]
        steps = [r.step for r in rs if r.kind == "step"]
        out[gid] = {
            "round": rs[0].round,
            "world_size": rs[0].world_size,
            "nodes": sorted({r.node for r in rs}),
            "steps": [min(steps), max(steps)] if steps else [],
            "done": any(r.kind == "done" for r in rs),
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        print(json.dumps(_describe(read_records(sys.argv[2])), indent=2))
        sys.exit(0)
    status = main()
    # Skip the interpreter's teardown: with torch and gloo loaded it takes
    # seconds, which the agent would count as the worker still running.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
