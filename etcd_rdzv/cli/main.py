"""The ``etcd-rdzv`` command: ``list``, ``show``, ``watch``, ``close`` and ``gc`` of rendezvous runs.

Exit codes: 0 done; 2 bad input or an etcd failure (unknown run, unreachable etcd,
denied permission, a record this tool cannot decode), reported as one line on
stderr within ``--timeout`` (never a traceback); 1 an internal error (one line too);
130 an interrupted command other than ``watch`` (Ctrl-C ends ``watch`` with 0).
etcd is reached through :class:`etcd_store.client.EtcdClient` only. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from etcd_store.client import EtcdClient, op_get
from etcd_store.errors import EtcdError

from ..native.keys import RunKeys
from ..native.records import ProtocolStateError
from ..v2state import StateDecodeError
from .actions import DEFAULT_STATE_TTL, close_v2, close_v3, gc
from .connect import CliError, ConnectOptions, Deadline, add_connect_arguments, connect_options
from .render import esc, render_list, render_show
from .runs import V2, V3, RunInfo, RunReadError, find_runs, read_run, state_key
from .watching import format_change, watch_run

log = logging.getLogger(__name__)

ERROR_LIMIT = 2000
"""The most characters of an error line (values from etcd in it are escaped, see :func:`.render.esc`)."""

__all__ = ["build_parser", "main"]

PROG = "etcd-rdzv"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_connect_arguments(common)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log more (-vv: debug)")
    parser = argparse.ArgumentParser(
        prog=PROG, parents=[common],
        description="Inspect and operate the torchrun rendezvous runs (etcd-v2, etcd-v3) kept in etcd.",
        epilog="The etcd user and password are read from the environment only: $ETCD_RDZV_USER with "
               "$ETCD_RDZV_PASSWORD (or $ETCD_RDZV_PASSWORD_FILE), else etcdctl's $ETCDCTL_USER "
               "(name:password) and $ETCDCTL_PASSWORD.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_, description=help_)

    def backend_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--backend", choices=(V2, V3), default=None,
                       help="the run's backend (default: found from its keys)")

    p = command("list", "every run under the key prefix")
    p.add_argument("--json", action="store_true", help='print {"runs": [...]}')
    p = command("show", "one run: members, ranks, leases, waiting nodes")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    backend_arg(p)
    p = command("watch", "follow a run's joins, seals, departures and closes from now on")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--count", type=int, default=None, metavar="N", help="exit after N changes")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="exit after S seconds")
    backend_arg(p)
    p = command("close", "close a run: every agent of it then exits cleanly")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--state-ttl", type=int, default=DEFAULT_STATE_TTL, metavar="S",
                   help="etcd-v3: TTL of the run lease if the run has none yet (default %(default)s)")
    backend_arg(p)
    p = command("gc", "remove what closed or dead runs left")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--grace", type=float, default=60.0, metavar="S",
                   help="etcd-v2: only closed runs whose newest heartbeat is older (default %(default)s)")
    p.add_argument("--json", action="store_true", help='print {"removed": [...], "dry_run": ...}')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    verbosity = getattr(ns, "verbose", 0)
    logging.basicConfig(
        level=logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG,
        format=f"{PROG}: %(levelname)s: %(message)s",
    )
    try:
        opts = connect_options(ns)
        with opts.create_client() as client:
            return int(_COMMANDS[ns.command](client, opts, ns))
    except (CliError, EtcdError, RunReadError, StateDecodeError, ProtocolStateError, ValueError) as e:
        _fail(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, never a traceback (-vv logs it)
        log.debug("internal error", exc_info=True)
        _fail(f"internal error: {type(e).__name__}: {e}")
        return 1


def _fail(message: str) -> None:
    print(f"{PROG}: error: {esc(' '.join(message.split()), ERROR_LIMIT)}", file=sys.stderr)


def _out(text: str) -> None:
    print(text, flush=True)


def resolve_backend(client: EtcdClient, prefix: str, run_id: str, wanted: str | None, deadline: Deadline) -> str:
    """The backend of ``run_id`` (``wanted`` if given and present); raises CliError if none."""
    if "/" in run_id or not run_id:
        raise CliError(f"invalid run id {run_id!r}")
    root = f"{RunKeys.for_run(prefix, run_id).root}/".encode()
    res = client.txn([], [op_get(state_key(prefix, run_id).encode(), count_only=True),
                          op_get(root, prefix=True, count_only=True)],
                     timeout=deadline.left(), idempotent=True)
    found = [b for b, r in zip((V2, V3), res.responses, strict=True) if getattr(r, "count", 0) > 0]
    where = f"under {prefix or '/'} at {client.describe()}"
    if wanted is not None:
        if wanted not in found:
            raise CliError(f"no {wanted} run {run_id!r} {where}")
        return wanted
    if not found:
        raise CliError(f"no rendezvous run {run_id!r} {where}")
    if len(found) > 1:
        raise CliError(f"run id {run_id!r} exists for both etcd-v2 and etcd-v3 {where}; pass --backend")
    return found[0]


def _list(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    runs: list[RunInfo] = []
    errors: list[tuple[str, str, str]] = []
    for run_id, backends in sorted(find_runs(client, opts.key_prefix, deadline).items()):
        for backend in sorted(backends):
            try:
                info = read_run(client, opts.key_prefix, run_id, backend, deadline)
            except (RunReadError, StateDecodeError, ProtocolStateError) as e:
                errors.append((run_id, backend, str(e)))
                continue
            if info is not None:  # gone since the scan
                runs.append(info)
    if ns.json:
        docs: list[dict[str, Any]] = [r.summary() for r in runs]
        docs += [{"run_id": r, "backend": b, "error": why} for r, b, why in errors]
        _out(json.dumps({"runs": docs}, indent=2))
    else:
        _out(render_list(runs, errors))
    return 0


def _show(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    backend = resolve_backend(client, opts.key_prefix, ns.run_id, ns.backend, deadline)
    info = read_run(client, opts.key_prefix, ns.run_id, backend, deadline, detail=True)
    if info is None:
        raise CliError(f"the run {ns.run_id!r} disappeared while reading it")
    _out(json.dumps(info.detail(), indent=2) if ns.json else render_show(info))
    return 0


def _watch(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    if ns.count is not None and ns.count < 1:
        raise CliError(f"--count must be at least 1, got {ns.count}")
    if ns.duration is not None and not ns.duration > 0:
        raise CliError(f"--duration must be positive, got {ns.duration:g}")
    backend = resolve_backend(client, opts.key_prefix, ns.run_id, ns.backend, deadline)

    def emit(change: dict[str, Any]) -> None:
        _out(json.dumps({"time": round(time.time(), 3), **change}) if ns.json
             else format_change(change, time.time()))

    def started(revision: int) -> None:
        print(f"{PROG}: watching {backend} run {esc(ns.run_id)} after revision {revision} (Ctrl-C ends)",
              file=sys.stderr, flush=True)

    try:
        watch_run(client, opts.key_prefix, ns.run_id, backend, deadline, emit,
                  count=ns.count, duration=ns.duration, started=started)
    except KeyboardInterrupt:
        pass
    return 0


def _close(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    backend = resolve_backend(client, opts.key_prefix, ns.run_id, ns.backend, deadline)
    stopped = False  # etcd-v3: closed already (by agents' shutdown()), aborted by this call
    if backend == V3:
        outcome = close_v3(client, opts.key_prefix, ns.run_id, deadline, state_ttl=ns.state_ttl)
        closed, stopped = outcome.closed, outcome.aborted and not outcome.closed
    else:
        closed = close_v2(client, opts.key_prefix, ns.run_id, deadline)
    run = esc(ns.run_id)
    if closed:
        _out(f"closed {backend} run {run}")
    elif stopped:
        _out(f"{backend} run {run} was already closed; its running agents now stop")
    else:
        _out(f"{backend} run {run} was already closed")
    return 0


def _gc(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    removed = gc(client, opts.key_prefix, deadline, grace=ns.grace, dry_run=ns.dry_run)
    if ns.json:
        _out(json.dumps({"dry_run": ns.dry_run, "removed": [r.__dict__ for r in removed]}, indent=2))
        return 0
    verb = "would remove" if ns.dry_run else "removed"
    for r in removed:
        _out(f"{verb} {r.keys} keys of {r.backend} run {esc(r.run_id)} ({esc(r.reason)})")
    if not removed:
        _out("nothing to remove")
    return 0


_COMMANDS = {"list": _list, "show": _show, "watch": _watch, "close": _close, "gc": _gc}
