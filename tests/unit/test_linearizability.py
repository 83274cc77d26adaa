"""The store's linearizability checker (tests/helpers/linearizability.py) on small hand-written histories."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.history import FAIL, OK, UNKNOWN, History, Op
from helpers.linearizability import (
    ANY,
    SearchBudgetExceeded,
    StoreModel,
    check,
    linearizable,
    partitions,
    patch,
)

_ids = iter(range(10**9))


def op(kind: str, *args: Any, at: tuple[int, int | None], result: Any = None, outcome: str = OK,
       client: str = "c") -> Op:
    """An op invoked at ``at[0]`` and completed at ``at[1]`` (None: never returned)."""
    start, end = at
    if end is None:
        outcome = UNKNOWN
    return Op(next(_ids), client, kind, args, start, end, outcome, result)


def ok(ops: list[Op]) -> bool:
    return check(ops).ok


# ------------------------------------------------------------------ registers


def test_sequential_register_history_is_linearizable() -> None:
    assert ok([
        op("set", "k", b"a", at=(0, 1)),
        op("get", "k", at=(2, 3), result=b"a"),
        op("compare_set", "k", b"a", b"b", at=(4, 5), result=b"b"),
        op("compare_set", "k", b"a", b"c", at=(6, 7), result=b"b"),
        op("delete_key", "k", at=(8, 9), result=True),
        op("delete_key", "k", at=(10, 11), result=False),
        op("get", "k", at=(12, 13), result=None),  # timed out: missing
    ])


def test_a_stale_read_is_not_linearizable() -> None:
    ops = [
        op("set", "k", b"a", at=(0, 1)),
        op("set", "k", b"b", at=(2, 3)),
        op("get", "k", at=(4, 5), result=b"a"),
    ]
    verdict = check(ops)
    assert not verdict.ok
    assert verdict.failing == [[("reg", "k")]]
    assert [o.kind for o in verdict.fragment][-1] == "get"


def test_concurrent_writes_may_be_read_in_either_order() -> None:
    base = [op("set", "k", b"a", at=(0, 10), client="1"), op("set", "k", b"b", at=(1, 9), client="2")]
    assert ok([*base, op("get", "k", at=(11, 12), result=b"a")])
    assert ok([*base, op("get", "k", at=(11, 12), result=b"b")])
    # but two later reads cannot disagree
    assert not ok([*base, op("get", "k", at=(11, 12), result=b"a"), op("get", "k", at=(13, 14), result=b"b")])


def test_torch_compare_set_semantics() -> None:
    # a missing key with a non-empty expected value stays missing; the expected value is returned
    assert ok([op("compare_set", "k", b"x", b"y", at=(0, 1), result=b"x"),
               op("check", ["k"], at=(2, 3), result=False)])
    # a missing key with an empty expected value is created
    assert ok([op("compare_set", "k", b"", b"y", at=(0, 1), result=b"y"),
               op("get", "k", at=(2, 3), result=b"y")])
    # a present key with another value is returned unchanged
    assert not ok([op("set", "k", b"a", at=(0, 1)),
                   op("compare_set", "k", b"x", b"y", at=(2, 3), result=b"y")])


def test_add_counts_and_a_lost_increment_is_caught() -> None:
    assert ok([op("add", "n", 2, at=(0, 1), result=2), op("add", "n", 3, at=(2, 3), result=5)])
    # two concurrent adds both returning 1 lose an increment
    assert not ok([op("add", "n", 1, at=(0, 5), result=1, client="1"),
                   op("add", "n", 1, at=(1, 4), result=1, client="2")])
    # an add applied twice (a resend without a fence) shows as a jump
    assert not ok([op("add", "n", 1, at=(0, 1), result=1), op("add", "n", 1, at=(2, 3), result=3)])


# ------------------------------------------------------------------ unknown outcomes


def test_an_unknown_write_may_take_effect_late_or_never() -> None:
    lost = op("set", "k", b"b", at=(2, None))
    first = op("set", "k", b"a", at=(0, 1))
    assert ok([first, lost, op("get", "k", at=(3, 4), result=b"a"), op("get", "k", at=(5, 6), result=b"b")])
    assert ok([first, lost, op("get", "k", at=(3, 4), result=b"a"), op("get", "k", at=(5, 6), result=b"a")])
    # but not before it was invoked
    assert not ok([first, op("get", "k", at=(1, 2), result=b"b"), op("set", "k", b"b", at=(3, None))])


def test_an_unknown_write_takes_effect_at_most_once() -> None:
    adds = [op("add", "n", 1, at=(0, None)), op("get", "n", at=(5, 6), result=b"1"),
            op("get", "n", at=(7, 8), result=b"2")]
    assert not ok(adds)


def test_failed_ops_and_unknown_reads_are_left_out() -> None:
    ops = [op("set", "k", b"a", at=(0, 1)),
           op("set", "k", b"b", at=(2, 3), outcome=FAIL),
           op("get", "k", at=(4, None), result=b"zzz"),
           op("get", "k", at=(5, 6), result=b"a")]
    assert ok(ops)
    assert [len(p.ops) for p in partitions(ops, StoreModel())] == [2]


# ------------------------------------------------------------------ queues, waits, multi-key ops


def test_queues_are_fifo_and_pop_each_item_once() -> None:
    push = [op("queue_push", "q", b"1", at=(0, 1)), op("queue_push", "q", b"2", at=(2, 3))]
    assert ok([*push, op("queue_pop", "q", at=(4, 5), result=b"1"), op("queue_pop", "q", at=(6, 7), result=b"2"),
               op("queue_pop", "q", at=(8, 9), result=None)])
    assert not ok([*push, op("queue_pop", "q", at=(4, 5), result=b"2")])
    assert not ok([*push, op("queue_pop", "q", at=(4, 5), result=b"1"), op("queue_pop", "q", at=(6, 7), result=b"1")])
    # a push whose reply was lost may be popped (once)
    assert ok([op("queue_push", "q", b"1", at=(0, None)), op("queue_pop", "q", at=(4, 5), result=b"1"),
               op("queue_pop", "q", at=(6, 7), result=None)])


def test_wait_check_and_multi_key_ops() -> None:
    assert ok([op("multi_set", ["a", "b"], [b"1", b"2"], at=(0, 1)),
               op("multi_get", ["b", "a"], at=(2, 3), result=[b"2", b"1"]),
               op("check", ["a", "b"], at=(4, 5), result=True),
               op("wait", ["a"], at=(6, 7), result=True),
               op("delete_key", "a", at=(8, 9), result=True),
               op("wait", ["a", "b"], at=(10, 11), result=False),
               op("check", ["b"], at=(12, 13), result=True)])
    # multi_set is atomic: no reader sees half of it
    assert not ok([op("multi_set", ["a", "b"], [b"1", b"2"], at=(0, 10)),
                   op("check", ["a"], at=(2, 3), result=True),
                   op("check", ["b"], at=(4, 5), result=False)])
    # a wait that returned saw the key
    assert not ok([op("wait", ["a"], at=(0, 1), result=True)])


def test_keys_are_checked_apart_and_a_multi_key_op_joins_them() -> None:
    ops = [op("set", "a", b"1", at=(0, 1)), op("set", "b", b"1", at=(0, 1)),
           op("check", ["a", "c"], at=(2, 3), result=False)]
    assert sorted(len(p.keys) for p in partitions(ops, StoreModel())) == [1, 2]


# ------------------------------------------------------------------ minimal fragments and budget


def test_a_failure_is_shrunk_to_a_short_fragment_from_an_unknown_state() -> None:
    ops = []
    t = 0
    for i in range(200):  # a long, correct history of another key and of this one
        ops.append(op("set", "k", str(i).encode(), at=(t, t + 1)))
        ops.append(op("add", "other", 1, at=(t, t + 1), result=i + 1))
        t += 2
    ops.append(op("get", "k", at=(t, t + 1), result=b"7"))  # stale
    ops.append(op("get", "k", at=(t + 2, t + 3), result=b"199"))
    verdict = check(ops)
    assert verdict.failing == [[("reg", "k")]]
    assert len(verdict.fragment) <= 3, verdict.fragment
    assert verdict.from_unknown
    history = History()
    text = verdict.explain(lambda frag: history.render(frag, notes=False))
    assert "NOT linearizable" in text and "get('k') -> b'7'" in text


def test_the_unknown_state_takes_the_first_observation() -> None:
    m = StoreModel()
    keys = [("reg", "k")]
    assert m.step(keys, (ANY,), op("get", "k", at=(0, 1), result=b"v")) == [(b"v",)]
    assert m.step(keys, (ANY,), op("add", "k", 2, at=(0, 1), result=5)) == [(b"5",)]
    q = [("queue", "q")]
    assert m.step(q, ((ANY,),), op("queue_pop", "q", at=(0, 1), result=None)) == [((),)]


def test_the_search_budget_is_reported() -> None:
    # many concurrent unknown adds then reads: a search that needs more than two steps
    ops = [op("add", "n", 1, at=(i, None)) for i in range(8)] + [op("get", "n", at=(100, 101), result=b"8")]
    assert linearizable(ops, StoreModel(), [("reg", "n")])
    with pytest.raises(SearchBudgetExceeded):
        linearizable(ops, StoreModel(), [("reg", "n")], budget=2)


def test_an_unknown_write_seen_by_a_reader_took_effect_before_that_read_returned() -> None:
    ops = [op("set", "k", b"a", at=(0, 1)),
           op("set", "k", b"b", at=(2, None)),
           op("get", "k", at=(3, 4), result=b"b"),
           op("get", "k", at=(5, 6), result=b"b")]
    patched = patch(ops, StoreModel())
    assert patched[1].completed == 4 and patched[1].outcome == UNKNOWN
    assert ok(ops)
    assert not ok([*ops, op("get", "k", at=(7, 8), result=b"a")])


def test_an_unknown_push_nobody_popped_is_left_out() -> None:
    ops = [op("queue_push", "q", b"1", at=(0, None)), op("queue_pop", "q", at=(4, 5), result=None)]
    assert [o.kind for o in patch(ops, StoreModel())] == ["queue_pop"]
    assert ok(ops)


def test_append_concatenates_once() -> None:
    ops = [op("append", "k", b"a", at=(0, 1)), op("append", "k", b"b", at=(2, 3)),
           op("get", "k", at=(4, 5), result=b"ab")]
    assert ok(ops)
    assert not ok([*ops[:2], op("get", "k", at=(4, 5), result=b"abb")])


def test_a_dumped_history_is_checked_again_after_loading(tmp_path: Any) -> None:
    history = History()
    with history.op("c1", "set", "k", b"\x00big") as o:
        o.ok(None)
    with history.op("c2", "multi_get", ["k"]) as o:
        o.ok([b"stale"])
    history.note("kill", member=1)
    path = str(tmp_path / "h.json")
    history.dump(path)
    again = History.load(path)
    assert [(o.kind, o.args, o.result) for o in again.ops()] == [
        ("set", ("k", b"\x00big"), None), ("multi_get", (["k"],), [b"stale"])]
    assert [n.what for n in again.notes()] == ["kill"]
    assert not check(again.ops()).ok
