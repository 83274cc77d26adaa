"""The ``etcd-rdzv`` command facing hostile etcd data (issue 23, item 6; issue 32, item 5), against a real
etcd: text output escapes control characters (JSON stays exact), on every way out (stdout, stderr, log
records at every verbosity, errors: every sub-command walked as a process), and deep or huge values give a
short error instead of a ``RecursionError`` or a flood."""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from etcd_rdzv.cli import main
from etcd_rdzv.cli.render import EscapingFormatter, esc, esc_lines
from etcd_rdzv.cli.watching import format_change
from etcd_rdzv.native.records import RunKeys
from etcd_server import AuthConfig, EtcdServer
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(180)

_ids = itertools.count()
#: Clear the screen, set the clipboard (OSC 52), a fake second row, a right-to-left override.
HOSTILE = "\x1b[2J\x1b]52;c;cHduZWQ=\x07\nforged-run  etcd-v3\u202e"
CONTROL = ("\x1b", "\x07", "\u202e")


@pytest.fixture
def prefix(etcd_endpoint: str) -> Iterator[tuple[EtcdClient, str]]:
    p = f"/cli-sec/{next(_ids)}"
    with EtcdClient(etcd_endpoint, timeout=10) as client:
        yield client, p
        client.delete(p.encode() + b"/", prefix=True)


def _cli(capsys: pytest.CaptureFixture[str], endpoint: str, prefix: str, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--endpoints", endpoint, "--key-prefix", prefix, "--timeout", "10", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _plant_v3_join(client: EtcdClient, prefix: str, run_id: str, value: bytes, node: str = "n1") -> RunKeys:
    keys = RunKeys.for_run(prefix, run_id)
    client.put(keys.join_key(1, node), value)
    return keys


def test_control_characters_are_escaped_in_text_and_exact_in_json(
    prefix: tuple[EtcdClient, str], etcd_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client, p = prefix
    run_id = "evil" + HOSTILE
    join = json.dumps({"addr": "host" + HOSTILE, "pid": 7, "port": 5}).encode()
    _plant_v3_join(client, p, run_id, join, node="node" + HOSTILE)
    rc, out, err = _cli(capsys, etcd_endpoint, p, "list")
    assert rc == 0, err
    assert not any(c in out for c in CONTROL) and out.count("\n") == 2, out  # header + one row
    assert "evil\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07\\nforged-run" in out
    rc, out, err = _cli(capsys, etcd_endpoint, p, "show", run_id)
    assert rc == 0, err
    assert not any(c in out + err for c in CONTROL) and "node\\x1b" in out, out
    rc, out, _ = _cli(capsys, etcd_endpoint, p, "list", "--json")
    (row,) = json.loads(out)["runs"]
    assert row["run_id"] == run_id  # exact
    rc, out, _ = _cli(capsys, etcd_endpoint, p, "show", run_id, "--json")
    assert any(n["node_id"] == "node" + HOSTILE for n in json.loads(out)["waiting"])
    rc, _, err = _cli(capsys, etcd_endpoint, p, "show", "gone" + HOSTILE)  # an error line names the run
    assert rc == 2 and err.count("\n") == 1 and not any(c in err for c in CONTROL)


def test_watch_lines_are_escaped() -> None:
    line = format_change({"event": "join", "revision": 3, "round": 1, "node": "n" + HOSTILE,
                          "host": "h" + HOSTILE}, 0.0)
    assert not any(c in line for c in CONTROL + ("\n",)) and "n\\x1b[2J" in line
    assert esc("x" * 10_000).endswith("...") and len(esc("x" * 10_000)) == 203


def test_log_records_and_lines_are_escaped() -> None:
    """The command's log handler escapes the message (one line, cut), a traceback line by line, and leaves
    the record alone; printable text (a table, JSON) passes the last pass unchanged."""
    formatter = EscapingFormatter("etcd-rdzv: %(levelname)s: %(message)s")
    try:
        raise ValueError("bad" + HOSTILE)
    except ValueError:
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "gc skips %s: %s", ("k" + HOSTILE, "y" * 5000),
                                   sys.exc_info())
    line = formatter.format(record)
    first, *trace = line.split("\n")
    assert first.startswith("etcd-rdzv: WARNING: gc skips k\\x1b[2J") and len(first) < 2100, first
    assert any("ValueError: bad\\x1b[2J" in t for t in trace) and not any(t.startswith("forged") for t in trace)
    assert not any(c in line for c in CONTROL + ("\r",)) and record.args is not None and record.exc_text is None
    table = "RUN_ID  BACKEND\nrun\\x1b  etcd-v3"
    assert esc_lines(table) == table and esc_lines('{"run_id": "\\u001b"}') == '{"run_id": "\\u001b"}'
    assert esc_lines("a\x1b\nb\r") == "a\\x1b\nb\\r"


def test_deeply_nested_json_is_a_short_error_not_a_recursion_error(
    prefix: tuple[EtcdClient, str], etcd_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client, p = prefix
    keys = _plant_v3_join(client, p, "deep", b"[" * 200_000)  # a join value: its host shows as unknown
    rc, out, err = _cli(capsys, etcd_endpoint, p, "show", "deep")
    assert rc == 0 and "internal error" not in err, err
    client.put(keys.sealed, b'{"round": 1, "run_lease": ' + b"[" * 200_000)
    for args in (("show", "deep"), ("list",)):
        rc, out, err = _cli(capsys, etcd_endpoint, p, *args)
        text = out + err
        assert "internal error" not in text and "Recursion" not in text, text[-500:]
        assert len(text) < 3000 and "ctl/sealed" in text, text[-500:]
        assert rc == (2 if args[0] == "show" else 0)
        if args[0] == "show":  # a one-line error naming the key, nothing on stdout
            assert out == "" and err.count("\n") == 1 and err.endswith("\n") and "ctl/sealed" in err, err[-500:]


def test_a_huge_value_gives_bounded_output(
    prefix: tuple[EtcdClient, str], etcd_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client, p = prefix
    addr = "h" * 1_000_000
    _plant_v3_join(client, p, "huge", json.dumps({"addr": addr, "pid": 1, "port": 5}).encode())
    rc, out, err = _cli(capsys, etcd_endpoint, p, "show", "huge")
    assert rc == 0, err[-500:]
    assert max(len(line) for line in out.splitlines()) < 1000
    rc, out, _ = _cli(capsys, etcd_endpoint, p, "show", "huge", "--json")
    assert any(n.get("host") == addr for n in json.loads(out)["waiting"])  # JSON stays exact


# --------------------------------------------------------------------------- every message path, as a process

#: A run id with ESC (a clear screen), OSC 52 (a clipboard write) ended by BEL, CR, a newline before a forged
#: line, a C1 CSI and a right-to-left override.
RUN = "evil\x1b[2J\x1b]52;c;cHduZWQ=\x07\r\nforged-line\x9b31m\u202e"
#: What every message shows of it (``esc``: escaped, never the bytes); an error line, one line of words,
#: shows its CR and newline as a space where the run id is not quoted (``HEAD``: what it shows of it all).
SHOWN = "evil\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07\\r\\nforged-line\\x9b31m\\u202e"
HEAD = "evil\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07"
ROOT_PW = "r00t-esc-pw"
PREFIX = "/torch/elastic/rendezvous"


def assert_clean(what: object, *texts: str) -> None:
    """No control or other non-printable character but the newlines between lines, and no line that the
    run id's newline would have forged."""
    for text in texts:
        bad = sorted({c for c in text if not c.isprintable() and c != "\n"})
        assert not bad, (what, bad, text[-3000:])
        assert not any(line.startswith("forged") for line in text.split("\n")), (what, text[-3000:])


class Cli:
    """``python -m etcd_rdzv`` as root against one etcd with auth, its real stdout and stderr."""

    def __init__(self, endpoint: str, tmp: Path) -> None:
        self.endpoint, self.tmp = endpoint, tmp
        self.env = {**os.environ, "ETCD_RDZV_USER": "root", "ETCD_RDZV_PASSWORD": ROOT_PW,
                    "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "etcd_rdzv", "--endpoints", self.endpoint, "--allow-insecure-auth",
                "--timeout", "10", *args]

    def run(self, *args: str, rc: int = 0, out: str | None = None, err: str | None = None) -> tuple[str, str]:
        """Run it; check the exit code, that ``out``/``err`` show up escaped where given, and that no control
        byte reaches either stream."""
        done = subprocess.run(self.argv(*args), capture_output=True, env=self.env, cwd=REPO_ROOT, timeout=60)
        stdout, stderr = text(done.stdout), text(done.stderr)
        assert done.returncode == rc, (args, done.returncode, stderr[-3000:])
        assert_clean(args, stdout, stderr)
        assert out is None or out in stdout, (args, out, stdout[-3000:])
        assert err is None or err in stderr, (args, err, stderr[-3000:])
        return stdout, stderr


def text(raw: bytes) -> str:
    """The bytes a stream carried, CRs kept (no newline translation), undecodable bytes visible."""
    return raw.decode("utf-8", "surrogateescape")


@pytest.fixture
def auth_etcd(etcd_binary: str) -> Iterator[EtcdServer]:
    server = EtcdServer(binary=etcd_binary, auth=AuthConfig(ROOT_PW))
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop(graceful=False)


def test_no_message_path_lets_a_control_byte_through(auth_etcd: EtcdServer, tmp_path: Path) -> None:
    """Issue 32, item 5: every sub-command's outputs (stdout, stderr, warnings, ``-v``/``-vv`` logs, errors)
    with a hostile run id (and node, role and key names) from etcd, in a real process: no control byte on
    either stream. ``gc`` used to log the key of a state it could not read as it was."""
    cli = Cli(auth_etcd.get_endpoint(), tmp_path)
    live, done, bad = RUN, "done" + RUN, "bad" + RUN
    with EtcdClient(cli.endpoint, user="root", password=ROOT_PW, allow_insecure_auth=True, timeout=10) as root:
        join = json.dumps({"addr": "host" + RUN, "pid": 7, "port": 5}).encode()
        _plant_v3_join(root, PREFIX, live, join, node="node" + RUN)  # a live etcd-v3 run, waiting
        root.put(RunKeys.for_run(PREFIX, done).closed, b"1")  # a closed etcd-v3 run: gc removes it
        root.put(f"{PREFIX}/{bad}".encode(), b"not base64!")  # an etcd-v2 state nobody can read

        cli.run("list", out=SHOWN)
        cli.run("list", "-vv", out=SHOWN)
        cli.run("list", "--json")
        cli.run("show", live, out="node" + SHOWN)
        cli.run("show", live, "-vv", out="host" + SHOWN)
        cli.run("show", live, "--json")
        cli.run("show", "gone" + RUN, rc=2, err="gone" + SHOWN)
        cli.run("show", bad, rc=2, err="bad" + HEAD)

        watch = subprocess.Popen(cli.argv("watch", live, "--count", "1", "-v"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=cli.env, cwd=REPO_ROOT)
        try:
            assert watch.stderr is not None
            lines: list[str] = []
            while not (lines and lines[-1].startswith("etcd-rdzv: watching")):
                lines.append(text(watch.stderr.readline()))
                assert lines[-1], "".join(lines)
            root.put(RunKeys.for_run(PREFIX, live).join_key(1, "late" + RUN), join)
            raw_out, raw_err = watch.communicate(timeout=30)
        finally:
            watch.kill()
        out, err = text(raw_out), text(raw_err)
        assert watch.returncode == 0, err
        assert_clean("watch", out, "".join(lines) + err)
        assert "late" + SHOWN in out and "host" + SHOWN in out and SHOWN in lines[-1], (out, lines)

        cli.run("close", live, "-vv", out=f"closed etcd-v3 run {SHOWN}", err=SHOWN)  # -vv: the run lease's log
        cli.run("close", live, out="was already closed")
        cli.run("gc", "--dry-run", out=f"would remove 1 keys of etcd-v3 run done{SHOWN}", err="bad" + HEAD)
        cli.run("gc", "--dry-run", "-v", err=f"keeps etcd-v3 run {SHOWN}")
        cli.run("gc", "-v", out=f"removed 1 keys of etcd-v3 run done{SHOWN}", err="bad" + HEAD)
        cli.run("gc", "--json")

        # grant and revoke: names from etcd in their lines and errors.
        pw = tmp_path / "run.pw"
        pw.write_text("run-pw\n")
        cli.run("grant", live, "--password-file", str(pw), "-v", out=f"user rdzv-{SHOWN}: created", err=SHOWN)
        cli.run("grant", "other", "--user", "rdzv-" + live, "--password-file", str(pw), rc=2,
                err=f"holds role 'rdzv-{SHOWN}' (run '{SHOWN}')")
        from etcd_store.client.auth_admin import Permission, role_add, role_grant, user_grant_role

        wide = "wide" + RUN
        role_add(root, wide)
        role_grant(root, wide, Permission(f"{PREFIX}/x{RUN}".encode(), b""))
        cli.run("grant", live, "--role", wide, rc=2, err=f"'wide{SHOWN}' exists with permissions outside")
        cli.run("revoke", live, "--role", wide, rc=2, err=f"READWRITE b'{PREFIX}/xevil\\x1b[2J")
        user_grant_role(root, "rdzv-" + live, wide)
        cli.run("revoke", live, out=f"kept, it holds other roles (wide{SHOWN})")
