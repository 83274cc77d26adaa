"""The restricted reading of torch's pickled etcd-v2 state (``etcd_rdzv.v2state``), shared by the
backend and the CLI: torch's own states in every protocol torch may write are accepted; hostile
pickles are refused with a short error, and nothing they name runs."""

from __future__ import annotations

import base64
import pickle
import pickletools
import random
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from helpers.v2_pickles import no_build, two_builds
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from etcd_rdzv.v2state import MAX_MESSAGE, MAX_STATE_BYTES, StateDecodeError, load_state, state_bytes


def torch_state(nodes: int = 3) -> _RendezvousState:
    state = _RendezvousState()
    ns = [_NodeDesc(f"host-{i}.example", 1000 + i, 0) for i in range(nodes)]
    state.round = 2
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=30)
    state.participants = {n: i for i, n in enumerate(ns)}
    state.wait_list = set(ns[:1])
    state.last_heartbeats = {n: datetime.now(timezone.utc) for n in ns}
    return state


class _Reduce:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def _refused(raw: bytes, match: str) -> str:
    with pytest.raises(StateDecodeError, match=match) as info:
        load_state(raw, "'/p/run'")
    message = str(info.value)
    assert "'/p/run'" in message and len(message) < MAX_MESSAGE + 200, message
    return message


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_torch_states_of_every_protocol_are_accepted(protocol: int) -> None:
    raw = pickle.dumps(torch_state(), protocol=protocol)
    state = load_state(raw)
    assert (state.round, len(state.participants), len(state.wait_list)) == (2, 3, 1)
    assert state_bytes(base64.b64encode(raw)) == raw  # the backend hands torch the bytes unchanged


def test_a_ten_thousand_node_state_is_accepted() -> None:
    # Its cost (~0.2 s on an idle core, docs/security.md) is a figure, not a timed assertion: a loaded CI
    # lane took 4-9 s.
    raw = pickle.dumps(torch_state(10_000))
    assert len(load_state(raw).participants) == 10_000


def test_a_reduce_to_a_callable_is_refused_and_not_run(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    # open pickles as io.open, as _io.open from Python 3.12 on
    _refused(pickle.dumps(_Reduce(str(target))), r"refusing to load _?io\.open")
    state = torch_state()
    state.participants = {_NodeDesc("h", 1, 0): _Reduce(str(target))}  # type: ignore[dict-item]
    _refused(pickle.dumps(state), r"refusing to load _?io\.open")
    assert not target.exists()


@pytest.mark.parametrize(
    "module, name",
    [("os", "system"), ("builtins", "eval"), ("datetime", "datetime.fromisoformat"),
     ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousStateHolder"),
     ("nt\x1b]52;c;aGk=\x07", "x" * 5000)],
)
def test_unexpected_globals_are_refused_with_an_escaped_bounded_name(module: str, name: str) -> None:
    raw = b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8d" + len(name).to_bytes(8, "little")
    raw += name.encode() + b"\x93)R."
    message = _refused(raw, "refusing to load")
    assert "\x1b" not in message and "\x07" not in message


@pytest.mark.parametrize(
    "raw, match",
    [(b"\x80\x04P123\n.", "PERSID"), (b"\x80\x04\x82\x01.", "EXT1"), (b"\x80\x05\x97.", "NEXT_BUFFER"),
     (b"\x80\x04N\x94h\x05.", "missing memo"), (b"\x80\x04Nr\xff\xff\xff\x7f.", "malformed memo"),
     (b"\x80\x04u.", "malformed"), (b"\x80\x04\xfe.", "malformed")],
)
def test_opcodes_outside_a_state_are_refused(raw: bytes, match: str) -> None:
    _refused(raw, match)


def test_truncated_states_are_refused() -> None:
    raw = pickle.dumps(torch_state())
    for cut in (1, 2, 10, len(raw) // 2, len(raw) - 1):
        _refused(raw[:cut], "torch's rendezvous state")


def test_oversized_values_are_refused_before_decoding() -> None:
    with pytest.raises(StateDecodeError, match="more than") as info:
        state_bytes(b"A" * (MAX_STATE_BYTES * 2), "'/p/big'")
    assert "'/p/big'" in str(info.value)
    _refused(b"\x80\x04" + b"N" * MAX_STATE_BYTES + b".", "more than")


def _shared_bomb(levels: int) -> Any:
    """A list whose repr doubles with every level (the 552-byte pickle of a 25 MB error)."""
    x: Any = ["x" * 10]
    for _ in range(levels):
        x = [x, x]
    return x


def test_shared_reference_bombs_give_a_short_error_quickly() -> None:
    state = torch_state()
    bad = _NodeDesc("h", 1, 0)
    state.participants = {bad: 0}
    object.__setattr__(bad, "addr", _shared_bomb(40))  # after hashing it into the dict
    raw = pickle.dumps(state)
    assert len(raw) < 2000
    started = time.monotonic()
    message = _refused(raw, "malformed node")
    assert time.monotonic() - started < 1.0 and "a list" in message
    state = torch_state()
    state.round = _shared_bomb(40)  # type: ignore[assignment]
    _refused(pickle.dumps(state), "round a list")


def test_a_huge_integer_is_named_not_printed() -> None:
    state = torch_state()
    state.round = -(10**20000)
    assert "a int" in _refused(pickle.dumps(state), "round")


def test_deeply_nested_tuples_are_refused_before_anything_hashes_them() -> None:
    # Unpickling a dict key made of 1,000,000 nested tuples overflows the C stack (SIGSEGV) in any
    # unpickler, so the check runs in a child process: a crash there fails the test, not the run.
    code = (
        "from etcd_rdzv.v2state import load_state, StateDecodeError\n"
        "raw = b'\\x80\\x04}N' + b'\\x85' * 1_000_000 + b'Ns.'\n"
        "try:\n    load_state(raw, 'k')\nexcept StateDecodeError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused: k does not hold torch's rendezvous state: tuples nested more than" in out.stdout


@pytest.mark.parametrize("of", [_RendezvousState, _NodeDesc], ids=["state", "node"])
def test_an_object_pickled_without_its_fields_is_refused(of: type) -> None:
    # Unpickling never calls __init__: without a BUILD the stand-in has recorded nothing (issue 29).
    _refused(no_build(of), rf"{of.__name__} pickled without its fields")


def test_a_state_built_twice_is_refused() -> None:
    # Issue 32: a first BUILD puts __setstate__ in torch's instance dict, which torch then calls at the
    # second BUILD instead of replacing the fields: torch keeps the first BUILD's, a reader recording
    # the last BUILD saw only the second's.
    bad = dict(vars(torch_state()), round="not a round", __setstate__=frozenset)
    raw = two_builds(bad, torch_state())
    assert pickle.loads(raw).round == "not a round"  # what torch's own loads keeps
    _refused(raw, "built twice")


@pytest.mark.parametrize("field", ["deadline", "last_heartbeats"])
def test_times_without_a_time_zone_are_refused(field: str) -> None:
    # torch compares them with datetime.now(timezone.utc): a naive one raises TypeError there.
    state = torch_state()
    naive = datetime.now()
    if field == "deadline":
        state.deadline = naive
    else:
        state.last_heartbeats = dict.fromkeys(state.participants, naive)
    _refused(pickle.dumps(state), "without a time zone")


def test_mutated_states_are_refused_with_state_decode_error_only() -> None:
    # Seeded byte flips, insertions and cuts of torch's states and of the malformed ones above:
    # whatever they hold, the reader returns a state or raises StateDecodeError, nothing else.
    rng = random.Random(29)
    seeds = [pickle.dumps(torch_state(), protocol=p) for p in (3, 4, 5)]
    seeds += [no_build(_RendezvousState), no_build(_NodeDesc), two_builds(vars(torch_state()), torch_state())]
    opcodes = [bytes([op.code.encode("latin-1")[0]]) for op in pickletools.opcodes]
    for i in range(3000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(raw))
            kind = rng.randrange(3)
            if kind == 0:
                raw[at] = rng.randrange(256)
            elif kind == 1:
                raw[at:at] = rng.choice(opcodes)
            else:
                del raw[at : at + rng.randint(1, 8)]
        try:
            load_state(bytes(raw), "k")
        except StateDecodeError:
            pass
        except Exception as e:  # pragma: no cover - the failure report
            pytest.fail(f"mutation {i}: {type(e).__name__}: {e} for {bytes(raw)!r}")
