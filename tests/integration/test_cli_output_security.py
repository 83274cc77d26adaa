"""The ``etcd-rdzv`` command facing hostile etcd data (issue 23, item 6), against a real etcd: text
output escapes control characters (JSON stays exact), and deep or huge values give a short error
instead of a ``RecursionError`` or a flood."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from etcd_rdzv.cli import main
from etcd_rdzv.cli.render import esc
from etcd_rdzv.cli.watching import format_change
from etcd_rdzv.native.keys import RunKeys
from etcd_store.client import EtcdClient

pytestmark = pytest.mark.timeout(120)

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
