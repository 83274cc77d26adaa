"""The demo's timeline plot (etcd_rdzv/demo.py, ``--plot``): a valid PNG from a small recorded
timeline with a kill and a rejoin, and a clear error without matplotlib. No etcd, no agents."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from etcd_rdzv import demo
from etcd_rdzv.demo import Event, PlotUnavailable, plot_timeline
from etcd_rdzv.testing.train import Record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _timeline() -> list[Record]:
    """2 nodes train (round 1), node1 is killed, node0 goes on alone (round 2), node1 rejoins (round 3)."""
    out: list[Record] = []

    def group(rnd: int, gid: str, nodes: list[str], t: float, steps: range, resumed: int) -> None:
        ws = len(nodes)
        for rank, node in enumerate(nodes):
            out.append(Record("start", t, rnd, gid, rank, ws, resumed, node=node, resumed_from=resumed))
        for i, step in enumerate(steps):
            for rank, node in enumerate(nodes):
                out.append(Record("step", t + 0.5 + 0.3 * i, rnd, gid, rank, ws, step, node=node))

    group(1, "g1", ["node0", "node1"], 101.0, range(1, 7), 0)
    group(2, "g2", ["node0"], 106.0, range(4, 9), 3)
    group(3, "g3", ["node0", "node1"], 110.0, range(7, 12), 6)
    out.append(Record("done", 112.0, 3, "g3", 0, 2, 11, node="node0"))
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:16]
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"  # a whole PNG: header chunk first, end chunk last
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_of_a_recorded_timeline_is_a_valid_png(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    events = [Event(104.0, "kill node1"), Event(108.5, "re-add node1")]
    assert plot_timeline(_timeline(), str(path), t0=100.0, events=events, title="test run") == str(path)
    assert path.stat().st_size > 5000  # a drawn figure, not an empty canvas
    width, height = _png_size(path)
    assert width >= 600 and height >= 300


def test_an_empty_log_is_a_value_error_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "none.png"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_timeline([], str(path))
    assert not path.exists()
    plot_timeline([], str(path), events=[Event(1.0, "kill node1")])  # events alone can be drawn
    _png_size(path)


def test_without_matplotlib_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(PlotUnavailable, match=r'pip install "etcd-rdzv\[plot\]"') as ei:
        plot_timeline(_timeline(), str(tmp_path / "x.png"))
    assert isinstance(ei.value, ImportError)
    assert not (tmp_path / "x.png").exists()


def test_demo_refuses_plot_without_matplotlib_before_starting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as ei:
        demo._parse_args(["--plot", "t.png"])
    assert ei.value.code == 2
    assert "--plot: the timeline plot needs matplotlib" in capsys.readouterr().err


def test_demo_writes_the_plot_with_the_chaos_events(tmp_path: Path) -> None:
    """The demo's end-of-run hook: its kill and re-add times become the plot's events."""
    args = demo._parse_args(["--chaos", "--plot", str(tmp_path / "run.png")])
    view = demo.View(endpoint="127.0.0.1:2379", backend="etcd-v2", steps=10, t0=100.0)
    chaos = demo._Chaos(args, {}, None, view, str(tmp_path / "steps"))
    chaos.killed_at, chaos.rejoined_at = 104.0, 108.5
    drawn: list[list[Event]] = []
    real = demo.plot_timeline

    def spy(records: list[Record], path: str, **kw: object) -> str:
        drawn.append(list(kw["events"]))  # type: ignore[call-overload]
        return real(records, path, **kw)  # type: ignore[arg-type]

    out = tmp_path / "out.txt"
    with open(out, "w") as stream, pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "plot_timeline", spy)
        demo._write_plot(args.plot, _timeline(), view, chaos, stream)
    assert drawn == [[Event(104.0, "kill node2"), Event(108.5, "re-add node2")]]
    assert f"timeline plot: {args.plot}" in out.read_text()
    _png_size(Path(args.plot))
