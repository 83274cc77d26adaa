"""Worker script for the torchrun end-to-end tests (gloo, CPU).

Usage: ``check_ranks.py OUT_DIR``. Every worker joins the default process group
through ``env://`` (the ``MASTER_ADDR``/``MASTER_PORT`` the agent gave it),
all-gathers its ``RANK``/``LOCAL_RANK``/``GROUP_RANK``/``LOCAL_WORLD_SIZE``,
checks them for consistency, checks an ``all_reduce``, and writes
``OUT_DIR/rank-<RANK>.json``. Exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_KEYS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
)  # fmt: skip


def check(rows: list[list[int]], world: int) -> list[str]:
    """Consistency problems of the gathered ``[rank, local_rank, local_world, group_rank]`` rows."""
    problems = []
    if sorted(r[0] for r in rows) != list(range(world)):
        problems.append(f"ranks are not 0..{world - 1}: {sorted(r[0] for r in rows)}")
    local_worlds = {r[2] for r in rows}
    if len(local_worlds) != 1:
        problems.append(f"LOCAL_WORLD_SIZE differs between workers: {sorted(local_worlds)}")
        return problems
    local_world = local_worlds.pop()
    groups: dict[int, list[int]] = {}
    for rank, local_rank, _, group_rank in rows:
        groups.setdefault(group_rank, []).append(local_rank)
        if rank != group_rank * local_world + local_rank:
            problems.append(f"rank {rank} != GROUP_RANK {group_rank} * {local_world} + LOCAL_RANK {local_rank}")
    if sorted(groups) != list(range(world // local_world)):
        problems.append(f"group ranks are not 0..{world // local_world - 1}: {sorted(groups)}")
    for group_rank, local_ranks in groups.items():
        if sorted(local_ranks) != list(range(local_world)):
            problems.append(f"local ranks of group {group_rank} are {sorted(local_ranks)}")
    return problems


def main() -> int:
    out_dir = sys.argv[1]
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    group_rank = int(os.environ["GROUP_RANK"])

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    problems = []
    if (dist.get_rank(), dist.get_world_size()) != (rank, world):
        problems.append(f"process group rank/size {dist.get_rank()}/{dist.get_world_size()} != env {rank}/{world}")
    mine = torch.tensor([rank, local_rank, local_world, group_rank], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [[int(v) for v in t.tolist()] for t in gathered]
    problems += check(rows, world)

    total = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(total)
    expected = world * (world + 1) // 2
    if int(total.item()) != expected:
        problems.append(f"all_reduce gave {int(total.item())}, expected {expected}")
    dist.barrier()
    dist.destroy_process_group()

    result = {"env": env, "pid": os.getpid(), "rows": rows, "all_reduce": int(total.item()),
              "expected": expected, "problems": problems}  # fmt: skip
    path = os.path.join(out_dir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if problems:
        print(f"rank {rank}: " + "; ".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
