"""Helpers for the torchrun fault scenarios: jobs of local nodes, log reading, timings.

A :class:`Job` is one elastic torchrun job: a run id, a training log and a
checkpoint directory under ``tmp_path``, and any number of nodes
(:class:`etcd_rdzv.testing.agents.LocalAgent`: a torchrun agent plus every process it
starts, found by an environment tag). :meth:`Job.close` kills every node and
fails if any process of the job is still alive afterwards.

Waiting is done against deadlines by re-reading the log (:meth:`Job.wait_for`);
a wait that times out, or finds every agent gone, fails with the job's log
summary and the tail of each agent's output.

No torch import here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from etcd_rdzv.testing.agents import LocalAgent, log_line_times, summarize, torchrun_command
from etcd_rdzv.testing.train import Record, read_records

T = TypeVar("T")

BACKENDS = ("etcd-v2", "etcd-v3")

# Short rendezvous timeouts so that scenarios take seconds, not minutes. A node
# is declared dead keep_alive_interval * keep_alive_max_attempt = 3 s after its
# last heartbeat.
FAST_CONF: dict[str, Any] = {
    "join_timeout": 90,
    "last_call_timeout": 1,
    "close_timeout": 10,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
    "read_timeout": 5,
}

#: Set by ``python -m benchmarks.recovery``: a directory where each timed scenario writes its figure.
#: Unset (a plain test run), figures are only printed: tests write nothing tracked.
TIMINGS_DIR_ENV = "ETCD_RDZV_TIMINGS_DIR"


def pick_version(versions: Sequence[str], scenario: int, backend: str) -> str:
    """The etcd version a scenario runs on for a backend.

    Alternates between scenarios and between backends, so every backend meets
    every version (see the table in tests/e2e/test_elastic_faults.py).
    """
    if not versions:
        raise ValueError("no etcd binary found")
    shift = BACKENDS.index(backend) if backend in BACKENDS else 0
    return sorted(versions)[(scenario + shift) % len(versions)]


def record_timing(key: str, values: Mapping[str, Any]) -> None:
    """Print ``{key: values}`` (a ``[timing]`` line); under ``python -m benchmarks.recovery`` also write it
    as one JSON file of its own in ``$ETCD_RDZV_TIMINGS_DIR`` (no shared file, so parallel tests cannot
    lose each other's figures; the benchmark command merges them into benchmarks/results/recovery.json)."""
    record = {**values, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"\n[timing] {key}: {json.dumps(dict(values))}")
    out_dir = os.environ.get(TIMINGS_DIR_ENV)
    if not out_dir:
        return
    name = key.replace("/", "__") + ".json"
    tmp = os.path.join(out_dir, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({key: record}, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, name))


class Job:
    """One elastic training job made of local torchrun agents.

    Args:
        workdir: directory for the log, the checkpoint and the agents' output.
        backend: ``--rdzv-backend``.
        endpoint: ``--rdzv-endpoint``.
        nnodes: ``--nnodes`` (``"2:3"``).
        nproc_per_node: workers per node.
        steps: the initial target step count, kept in a steps file that
            :meth:`finish` rewrites (by default the job runs until told).
        step_time, ckpt_every, pg_timeout: passed to the training script.
        conf: ``--rdzv-conf`` entries added to (or replacing) :data:`FAST_CONF`.
        module: run the script as ``-m etcd_rdzv.testing.train`` instead of by path.
        max_restarts: ``--max-restarts``.
    """

    def __init__(
        self,
        workdir: str,
        *,
        backend: str,
        endpoint: str,
        nnodes: str,
        nproc_per_node: int = 1,
        steps: int = 1_000_000,
        step_time: float = 0.15,
        ckpt_every: int = 3,
        pg_timeout: float = 60.0,
        conf: Mapping[str, Any] | None = None,
        module: bool = False,
        max_restarts: int = 3,
        run_id: str | None = None,
    ) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id or f"job-{uuid.uuid4().hex[:10]}"
        self.log_file = os.path.join(workdir, "log.jsonl")
        self.steps_file = os.path.join(workdir, "steps")
        self.set_target(steps)
        self.conf = {**FAST_CONF, **(conf or {})}
        self.nodes: dict[str, LocalAgent] = {}
        self.retired: list[LocalAgent] = []
        self._cmd = torchrun_command(
            [
                "--log-file", self.log_file, "--ckpt-dir", os.path.join(workdir, "ckpt"),
                "--steps-file", self.steps_file, "--step-time", str(step_time),
                "--ckpt-every", str(ckpt_every), "--pg-timeout", str(pg_timeout),
            ],
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            backend=backend,
            endpoint=endpoint,
            run_id=self.run_id,
            rdzv_conf=self.conf,
            max_restarts=max_restarts,
            module=module,
        )  # fmt: skip

    # ------------------------------------------------------------------ nodes

    def start(self, name: str, env: Mapping[str, str] | None = None, *, endpoint: str | None = None) -> LocalAgent:
        """Start node ``name`` (a node killed before under that name is retired); ``endpoint``: its own
        ``--rdzv-endpoint`` instead of the job's (a node reaching etcd through its own proxies)."""
        if name in self.nodes:
            old = self.nodes.pop(name)
            old.close()
            self.retired.append(old)
        cmd = self._cmd
        if endpoint is not None:
            cmd = [f"--rdzv-endpoint={endpoint}" if a.startswith("--rdzv-endpoint=") else a for a in cmd]
        agent = LocalAgent(
            name,
            cmd,
            env={"LOGLEVEL": "INFO", **(env or {})},
            output=os.path.join(self.workdir, f"{name}.{len(self.retired)}.out"),
        )
        agent.start()
        self.nodes[name] = agent
        return agent

    def wait_exit(self, names: Sequence[str] | None = None, timeout: float = 120.0) -> dict[str, int]:
        """Wait until the named agents (default all) exited; their exit statuses."""
        deadline = time.monotonic() + timeout
        result: dict[str, int] = {}
        for name in names or list(self.nodes):
            rc = self.nodes[name].wait(max(0.0, deadline - time.monotonic()))
            if rc is None:
                raise AssertionError(f"agent {name} still running after {timeout:.0f}s\n{self.diagnostics()}")
            result[name] = rc
        return result

    def close(self) -> None:
        """Kill every node; fail if any process of the job survives."""
        errors = []
        for agent in [*self.nodes.values(), *self.retired]:
            try:
                agent.close()
            except RuntimeError as e:
                errors.append(str(e))
        left = {a.name: sorted(a.pids()) for a in [*self.nodes.values(), *self.retired] if a.pids()}
        if errors or left:
            raise AssertionError(f"processes left behind by the job: {left} {errors}")

    def set_target(self, steps: int) -> None:
        """Rewrite the job's target step count (rank 0 reads it every step)."""
        tmp = f"{self.steps_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(steps))
        os.replace(tmp, self.steps_file)

    def finish(self, extra: int = 3) -> int:
        """Let the job end ``extra`` steps after the last step logged so far; the target."""
        last = max((r.step for r in self.records() if r.kind == "step"), default=0)
        self.set_target(last + extra)
        return last + extra

    # ------------------------------------------------------------------ log

    def records(self) -> list[Record]:
        return read_records(self.log_file)

    def wait_for(
        self,
        what: str,
        predicate: Callable[[list[Record]], T | None],
        timeout: float,
        *,
        allow_exit: bool = False,
    ) -> T:
        """Re-read the log until ``predicate(records)`` returns a truthy value; return it.

        Fails after ``timeout`` seconds, or at once when every agent has exited
        (unless ``allow_exit``) and the predicate still does not hold.
        """
        deadline = time.monotonic() + timeout
        while True:
            records = self.records()
            value = predicate(records)
            if value:
                return value
            if not allow_exit and self.nodes and all(not a.running() for a in self.nodes.values()):
                value = predicate(self.records())
                if value:
                    return value
                raise AssertionError(f"every agent exited before: {what}\n{self.diagnostics()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for: {what}\n{self.diagnostics()}"
                )
            time.sleep(0.2)  # log polling period

    def diagnostics(self, lines: int = 25) -> str:
        """Log summary and each agent's exit status and output tail."""
        parts = ["--- worker groups in the log:"]
        try:
            for g in summarize(self.records()):
                parts.append(
                    f"  round {g.round} world {g.world_size} nodes {g.nodes} steps "
                    f"{g.first_step}..{g.last_step} resumed_from {g.resumed_from} "
                    f"t {g.first_t:.2f}..{g.last_t:.2f} done={g.done}"
                )
        except ValueError as e:
            parts.append(f"  unreadable log: {e}")
        for agent in [*self.retired, *self.nodes.values()]:
            parts.append(f"--- {agent.name} (rc={agent.returncode}) output tail:")
            parts.append(agent.output_tail(lines))
        return "\n".join(parts)


def rendezvous_completions(agent: LocalAgent) -> list[float]:
    """Times (epoch seconds) at which the agent logged "Rendezvous complete for workers"."""
    return agent_log_times(agent, "Rendezvous complete for workers")


def agent_log_times(agent: LocalAgent, needle: str) -> list[float]:
    """Times (epoch seconds) of the agent's log lines that contain ``needle``.

    Read from torchrun's INFO log lines (glog prefix ``I%m%d %H:%M:%S.%f``, local
    time; the year is taken as the current one).
    """
    return log_line_times(agent.output_tail(100_000), needle)


# ---------------------------------------------------------------------- log predicates


def steps_of(records: Sequence[Record], group: str | None = None) -> list[Record]:
    return [r for r in records if r.kind == "step" and (group is None or r.group == group)]


def group_with(
    records: Sequence[Record],
    *,
    world_size: int | None = None,
    min_step: int | None = None,
    nodes: set[str] | None = None,
    after: float | None = None,
    min_steps_done: int = 1,
) -> str | None:
    """Id of the first group whose step records match, or None.

    ``min_steps_done``: how many distinct steps the group must have logged;
    ``after``: only groups whose first record is later than this time.
    """
    for g in summarize(records):
        if world_size is not None and g.world_size != world_size:
            continue
        if nodes is not None and set(g.nodes) != nodes:
            continue
        if after is not None and g.first_t <= after:
            continue
        steps = sorted({r.step for r in steps_of(records, g.group)})
        if len(steps) < min_steps_done:
            continue
        if min_step is not None and (not steps or steps[-1] < min_step):
            continue
        return g.group
    return None


def node_of_group_rank(records: Sequence[Record], group: str, group_rank: int) -> str:
    """The node that had ``group_rank`` in ``group``."""
    for r in records:
        if r.group == group and r.group_rank == group_rank:
            return r.node
    raise AssertionError(f"no node with group rank {group_rank} in group {group}")


def assert_groups_never_overlap(records: Sequence[Record], slack: float = 0.0) -> None:
    """No two worker groups logged records during overlapping time spans."""
    spans = sorted((g.first_t, g.last_t, g.group, tuple(g.nodes)) for g in summarize(records))
    for (_, a1, ga, na), (b0, _, gb, nb) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0 + slack, (
            f"worker groups overlap: {ga} {na} logged until {a1:.3f}, {gb} {nb} started at {b0:.3f}"
        )


@contextlib.contextmanager
def job_factory(tmp_path: Any) -> Iterator[Callable[..., Job]]:
    """A factory of :class:`Job` under ``tmp_path``; on exit every job is killed and
    checked for leftover processes, also when the test failed (the ``jobs`` fixture)."""
    made: list[Job] = []

    def make(**kwargs: Any) -> Job:
        job = Job(os.path.join(str(tmp_path), f"job{len(made)}"), **kwargs)
        made.append(job)
        return job

    try:
        yield make
    finally:
        errors = []
        for job in made:
            try:
                job.close()
            except AssertionError as e:
                errors.append(str(e))
        assert not errors, errors


def exclusive_records(records: Sequence[Record], thaws: Sequence[tuple[str, float]]) -> list[Record]:
    """The records without the steps a node logged just after a thaw whose all-reduce had
    completed before its freeze (their step is at most what the other members logged)."""
    late: set[int] = set()
    for node, thawed in thaws:
        for i, r in enumerate(records):
            if r.node == node and r.kind == "step" and thawed <= r.t <= thawed + 5:
                others = [o.step for o in records if o.group == r.group and o.node != node and o.kind == "step"]
                if others and r.step <= max(others):
                    late.add(i)
    return [r for i, r in enumerate(records) if i not in late]
