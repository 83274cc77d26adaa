"""B3: re-rendezvous after a node loss.

Per backend: N nodes (``min_nodes = N - 1``, ``max_nodes = N``) complete a
round; node 0 lives alone in its own worker process, which is then killed
with SIGKILL (no shutdown, no lease revoke: a machine gone). At that moment the
N - 1 survivors call ``next_rendezvous()`` (in torchrun the agents do so as soon
as their workers' collectives fail). The figure is the time from the kill until
the last survivor holds its new RendezvousInfo. Two scenarios:

* ``shrink``: nobody replaces the dead node; the survivors go on as N - 1.
* ``replace``: a fresh node (a new process, as a restarted pod) joins at the
  moment of the kill; the round completes with N nodes again.

The time is set by the backend's settings, not by CPU: how long until a dead
node counts as gone (``keep_alive_interval * keep_alive_max_attempt`` for the
DynamicRendezvousHandler backends, the lease TTL for etcd-v3) and the
``last_call_timeout`` waited once ``min_nodes`` are present. So the backends
run concurrently, each on its own etcd (or TCPStore), and the settings are
printed beside the figure.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .b2_rendezvous import handler_spec
from .common import C10D, EtcdFarm, Series, say
from .workers import GroupRun, NodeGroup, Pool, Worker, WorkerError, assign

# torch's defaults (DynamicRendezvousHandler; our etcd-v2 and etcd-v3 share them).
TORCH_DEFAULTS = {"keep_alive_interval": 5, "keep_alive_max_attempt": 3, "last_call_timeout": 30}

# Settings a production job would pick to recover fast (README, "Elastic training"): a node
# counts as dead after 2 s x 3 = 6 s, and 5 s of last call cover arrivals spread over a few seconds.
TUNED = {"keep_alive_interval": "2", "keep_alive_max_attempt": "3", "last_call_timeout": "5"}


def decisive_settings(conf: dict[str, Any], n: int) -> dict[str, Any]:
    """The settings that decide the figure (``conf`` overrides torch's defaults)."""
    out: dict[str, Any] = {k: conf.get(k, v) for k, v in TORCH_DEFAULTS.items()}
    out["dead_after_s"] = float(out["keep_alive_interval"]) * float(out["keep_alive_max_attempt"])
    out["min_nodes"] = n - 1
    out["max_nodes"] = n
    out["defaults"] = all(k not in conf for k in TORCH_DEFAULTS)
    out["fast_recovery"] = str(conf.get("fast_recovery", "true")).lower() in ("1", "true", "t", "yes", "y")
    return out


class _Case:
    def __init__(self, contender: str, group: NodeGroup, victim: Worker, survivors: list[Worker]):
        self.contender = contender
        self.group = group
        self.victim = victim
        self.survivors = survivors
        self.newcomer: NodeGroup | None = None
        self.t_kill = 0.0
        self.error: str | None = None
        self.run: GroupRun | None = None
        self.new_run: GroupRun | None = None

    def elapsed(self) -> float | None:
        runs = [r for r in (self.run, self.new_run) if r is not None]
        if self.error is not None or not runs or not all(r.ok for r in runs):
            return None
        return max(r.elapsed or 0.0 for r in runs)


def _left(t0: float, timeout: float) -> float:
    return max(1.0, timeout - (time.monotonic() - t0))


def run_b3(pool: Pool, farm: EtcdFarm, tcp_endpoint: str, contenders: list[str], n: int, reps: int,
           conf: dict[str, Any], timeout: float, max_workers: int, scenario: str = "shrink",
           name: str | None = None) -> dict[str, Any]:
    """Kill one of ``n`` nodes ``reps`` times per backend; returns a B3 section named
    ``name`` (default: the scenario; it names the plot file)."""
    if scenario not in ("shrink", "replace"):
        raise ValueError(f"unknown B3 scenario {scenario!r}")
    replace = scenario == "replace"
    if n < 2:
        raise ValueError("B3 needs at least 2 nodes")
    conf = dict(conf)
    conf.setdefault("join_timeout", str(int(timeout)))
    series = {c: Series() for c in contenders}
    failures: dict[str, list[str]] = {c: [] for c in contenders}
    for rep in range(reps):
        if all(failures[c] for c in contenders):
            break
        extra = pool.spawn_extra(len(contenders) * (2 if replace else 1))
        victims, newcomers = extra[: len(contenders)], extra[len(contenders):]
        cases: list[_Case] = []
        try:
            survivors = pool.workers[: max(1, min(max_workers, n - 1))]
            for i, (c, victim) in enumerate(zip(contenders, victims, strict=True)):
                if failures[c]:  # a failure here is a behaviour, not noise: do not wait for it again
                    continue
                run_id = f"b3-{c.replace(' ', '_')}-{n}-{uuid.uuid4().hex[:8]}"
                layout = {victim: [0]}
                layout.update(assign(list(range(1, n)), survivors))
                group = NodeGroup(run_id, layout)
                case = _Case(c, group, victim, list(layout)[1:])
                cases.append(case)
                server = None if c == C10D else farm.get(c)
                kind, spec = handler_spec(c, server.get_endpoint() if server else "", tcp_endpoint, run_id,
                                          n - 1, n, conf)
                try:
                    errors = group.create(kind, spec, timeout)
                    if errors:
                        case.error = f"create: {next(iter(errors.values()))}"
                        continue
                    first = group.run("rendezvous", timeout)
                    if not first.ok:
                        case.error = f"first round: {first.first_error()}"
                    elif replace:
                        case.newcomer = NodeGroup(run_id, {newcomers[i]: [n]})
                        errors = case.newcomer.create(kind, spec, timeout)
                        if errors:
                            case.error = f"create the newcomer: {next(iter(errors.values()))}"
                except WorkerError as e:
                    case.error = str(e)
            live = [k for k in cases if k.error is None]
            for k in live:
                k.group.arm("rendezvous", only=k.survivors)
                if k.newcomer is not None:
                    k.newcomer.arm("rendezvous")
            for k in live:
                k.victim.kill()
                k.t_kill = k.group.go(only=k.survivors)
                if k.newcomer is not None:
                    k.newcomer.go()
            for k in live:
                try:
                    # The backends ran concurrently: every deadline counts from its kill.
                    k.run = k.group.collect(k.t_kill, _left(k.t_kill, timeout), only=k.survivors)
                    if k.newcomer is not None:
                        k.new_run = k.newcomer.collect(k.t_kill, _left(k.t_kill, timeout))
                    for r in (k.run, k.new_run):
                        if r is not None and not r.ok:
                            k.error = f"second round: {r.first_error()}"
                except WorkerError as e:
                    k.error = str(e)
            for k in cases:
                elapsed = k.elapsed()
                if elapsed is not None and k.run is not None:
                    series[k.contender].add_run([elapsed])
                    worlds = {r["value"][1] for r in k.run.results.values()}
                    say(f"B3 {name or scenario} N={n} rep {rep} {k.contender}: {elapsed:.2f} s (new world {sorted(worlds)})")
                else:
                    failures[k.contender].append(k.error or "no result")
                    series[k.contender].add_run([])
                    say(f"B3 {name or scenario} N={n} rep {rep} {k.contender}: FAILED {str(k.error)[:300]}")
        finally:
            for k in cases:
                k.group.layout = {w: ids for w, ids in k.group.layout.items() if w is not k.victim}
                k.group.close()
                if k.newcomer is not None:
                    k.newcomer.close()
            for v in extra:
                v.stop(timeout=5)
    settings = decisive_settings(conf, n)
    rows = []
    for c in contenders:
        rows.append({"contender": c, "s": series[c].summary(), "failures": failures[c][:3],
                     "failed_runs": len(failures[c])})
    what = ("a fresh node joins at the kill (a restarted pod)" if replace
            else "nobody replaces the dead node")
    return {"scenario": scenario, "name": name or scenario, "n": n, "reps": reps, "conf": conf, "settings": settings, "rows": rows,
            "note": f"Scenario {scenario}: {what}. Backends run concurrently (the figure is set by timeouts, "
                    "not CPU). Survivors call next_rendezvous() right after the kill."}
