"""The ``etcd-rdzv`` command: ``list``, ``show``, ``watch``, ``close`` and ``gc`` of rendezvous runs,
and ``grant``/``revoke`` of a run's etcd user and role.

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

from etcd_store.client import EtcdClient
from etcd_store.errors import EtcdError, EtcdPermissionDenied

from ..conf_env import read_secret
from ..conf_keys import DEFAULT_STATE_TTL
from ..native.records import ProtocolStateError
from ..v2state import StateDecodeError
from .actions import close_v2, close_v3, gc
from .connect import CliError, ConnectOptions, Deadline, add_connect_arguments, connect_options
from .grants import default_name, grant, revoke
from .render import LINE_LIMIT, EscapingFormatter, esc, esc_lines, render_list, render_show
from .runs import V2, V3, RunInfo, RunReadError, backends_of, find_runs, read_run
from .watching import format_change, watch_run

log = logging.getLogger(__name__)

ERROR_LIMIT = LINE_LIMIT
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

    p = command("list", "every run under the key prefix (or the runs named)")
    p.add_argument("run_ids", nargs="*", metavar="RUN_ID",
                   help="only these runs (reads only their keys: a role limited to them suffices)")
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
    p = command("gc", "remove what closed or dead runs left (under the key prefix, or of the runs named)")
    p.add_argument("run_ids", nargs="*", metavar="RUN_ID",
                   help="only these runs (reads only their keys: a role limited to them suffices)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--grace", type=float, default=60.0, metavar="S",
                   help="etcd-v2: only closed runs whose newest heartbeat is older (default %(default)s)")
    p.add_argument("--json", action="store_true", help='print {"removed": [...], "dry_run": ...}')
    p = command("grant", "create the run's etcd user and role: read and write the run's keys, nothing else")
    _user_role_args(p)
    p.add_argument("--password-file", metavar="FILE", default=None,
                   help="the user's password (one line; - reads stdin); needed to create the user, "
                        "replaces an existing user's password")
    p.add_argument("--allow-shared-user", action="store_true",
                   help="change the password of, or add the run's role to, an existing user that holds "
                        "other roles (another run's: its agents then share the user)")
    p = command("revoke", "delete the run's role, and its user unless it holds other roles")
    _user_role_args(p)
    p.add_argument("--keep-user", action="store_true", help="delete the role only")
    return parser


def _user_role_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--user", default=None, metavar="NAME", help="the etcd user (default rdzv-RUN_ID)")
    p.add_argument("--role", default=None, metavar="NAME", help="the etcd role (default rdzv-RUN_ID)")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    verbosity = getattr(ns, "verbose", 0)
    handler = logging.StreamHandler()  # sys.stderr; every record escaped (etcd's data is in many)
    handler.setFormatter(EscapingFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    logging.basicConfig(
        level=logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG,
        handlers=[handler],
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
    """The error line: the message's words on one line, escaped and cut (it may quote etcd's data)."""
    _err(f"{PROG}: error: {esc(' '.join(message.split()), ERROR_LIMIT)}")


def _out(text: str) -> None:
    """Every stdout line of the command: escaped again (:func:`.render.esc_lines`) whatever built it."""
    print(esc_lines(text), flush=True)


def _err(text: str) -> None:
    """Every stderr line the command prints itself (log records: :class:`.render.EscapingFormatter`)."""
    print(esc_lines(text), file=sys.stderr, flush=True)


def resolve_backend(client: EtcdClient, prefix: str, run_id: str, wanted: str | None, deadline: Deadline) -> str:
    """The backend of ``run_id`` (``wanted`` if given and present); raises CliError if none."""
    if "/" in run_id or not run_id:
        raise CliError(f"invalid run id {run_id!r}")
    found = sorted(backends_of(client, prefix, run_id, deadline))
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


def _scope(ns: argparse.Namespace) -> list[str] | None:
    """The run ids of ``list``/``gc`` (None: every run under the prefix)."""
    for run_id in ns.run_ids:
        if not run_id or "/" in run_id:
            raise CliError(f"invalid run id {run_id!r}")
    return list(ns.run_ids) or None


def _scan_denied(e: EtcdPermissionDenied, command: str) -> CliError:
    return CliError(f"{e} (a role limited to single runs may name them: etcd-rdzv {command} RUN_ID ...)")


def _list(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    deadline = Deadline(opts.timeout)
    runs: list[RunInfo] = []
    errors: list[tuple[str, str, str]] = []
    run_ids = _scope(ns)
    try:
        found = find_runs(client, opts.key_prefix, deadline, run_ids)
    except EtcdPermissionDenied as e:
        if run_ids is not None:
            raise
        raise _scan_denied(e, "list") from None
    for run_id, backends in sorted(found.items()):
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
        _err(f"{PROG}: watching {backend} run {esc(ns.run_id)} after revision {revision} (Ctrl-C ends)")

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
    run_ids = _scope(ns)
    try:
        removed = gc(client, opts.key_prefix, deadline, grace=ns.grace, dry_run=ns.dry_run, run_ids=run_ids)
    except EtcdPermissionDenied as e:
        if run_ids is not None:
            raise
        raise _scan_denied(e, "gc") from None
    if ns.json:
        _out(json.dumps({"dry_run": ns.dry_run, "removed": [r.__dict__ for r in removed]}, indent=2))
        return 0
    verb = "would remove" if ns.dry_run else "removed"
    for r in removed:
        _out(f"{verb} {r.keys} keys of {r.backend} run {esc(r.run_id)} ({esc(r.reason)})")
    if not removed:
        _out("nothing to remove")
    return 0


def _password(path: str | None) -> str | None:
    """The new user's password: the file's one line, or stdin's for ``-`` (never argv)."""
    if path is None:
        return None
    if path == "-":
        text = sys.stdin.read()
        password = text[:-1] if text.endswith("\n") else text
    else:
        password = read_secret(path, "--password-file")
    if not password:
        raise CliError(f"--password-file {path!r}: the password is empty")
    return password


def _grant(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    password = _password(ns.password_file)
    lines = grant(client, opts.key_prefix, ns.run_id, Deadline(opts.timeout),
                  user=ns.user or default_name(ns.run_id), role=ns.role or default_name(ns.run_id),
                  password=password, shared=ns.allow_shared_user)
    _out("\n".join(lines))
    return 0


def _revoke(client: EtcdClient, opts: ConnectOptions, ns: argparse.Namespace) -> int:
    lines = revoke(client, opts.key_prefix, ns.run_id, Deadline(opts.timeout),
                   user=ns.user or default_name(ns.run_id), role=ns.role or default_name(ns.run_id),
                   keep_user=ns.keep_user)
    _out("\n".join(lines))
    return 0


_COMMANDS = {"list": _list, "show": _show, "watch": _watch, "close": _close, "gc": _gc, "grant": _grant,
             "revoke": _revoke}
