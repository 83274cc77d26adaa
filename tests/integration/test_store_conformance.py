"""Differential conformance: one list of scenarios, run on TCPStore and on EtcdStore.

Each scenario drives a store through a sequence of calls; a recorder keeps every
result (value and type) or exception (type, and message for torch's store
errors). A scenario passes when TCPStore and EtcdStore record the same thing,
once called directly from Python and once through torch's C++ path
(``PrefixStore("p", store)``, which calls the Python store through pybind11's
trampoline). Scenarios also assert the documented results themselves, so a bug
shared by both stores would still fail.

Deliberate differences, left out of the comparison:

* ``num_keys``: TCPStore counts one internal key of its own (a fresh TCPStore
  reports 1); EtcdStore counts only user keys. Scenarios compare changes of
  ``num_keys``, and the EtcdStore-only test pins the absolute count.
* Timeout messages name keys as the store sees them: TCPStore writes
  ``/key``, EtcdStore ``<prefix>/key``; the recorder maps ``<prefix>/`` to
  ``/`` (with an empty prefix EtcdStore writes ``/key`` too).
* ``add`` on a non-integer value: TCPStore's server fails to parse it and
  drops the connection (``DistNetworkError``, the store is unusable after);
  EtcdStore raises ``DistStoreError`` and stays usable. Both are ``DistError``.
* torch's pybind11 trampoline for Python stores forwards only set, get, add,
  compare_set, check, wait, multi_get, multi_set, append, clone and
  has_extended_api; ``PrefixStore`` over *any* Python store fails for
  delete_key, num_keys, list_keys and the queue methods.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from etcd_store import EtcdStore

#: The store contract runs on every etcd version of the matrix.
pytestmark = pytest.mark.etcd_matrix

SHORT = datetime.timedelta(milliseconds=200)
DEFAULT = datetime.timedelta(seconds=20)

Scenario = Callable[[Any, "Recorder"], None]
SCENARIOS: dict[str, Scenario] = {}
# Scenarios that use only methods torch forwards from C++ to a Python store.
CPP_PATH: set[str] = set()


def scenario(cpp: bool = True) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[fn.__name__] = fn
        if cpp:
            CPP_PATH.add(fn.__name__)
        return fn

    return register


def _norm(value: Any) -> Any:
    if isinstance(value, bytes) and len(value) > 256:
        return ("bytes", len(value), hashlib.sha256(value).hexdigest())
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


class Recorder:
    """Runs calls and keeps what they returned or raised."""

    def __init__(self, strip: str = "") -> None:
        self.strip = strip
        self.log: list[tuple[Any, ...]] = []

    def __call__(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
        except Exception as e:  # recording is the point
            message = None
            if isinstance(e, dist.DistError):
                message = str(e).replace(self.strip, "/") if self.strip else str(e)
            self.log.append((label, "raised", type(e).__name__, message))
            return e
        if isinstance(result, dist.Store):
            self.log.append((label, "a torch.distributed.Store"))
        else:
            self.log.append((label, type(result).__name__, _norm(result)))
        return result


# --------------------------------------------------------------------------- scenarios


@scenario()
def set_get_overwrite(s: Any, rec: Recorder) -> None:
    rec("set str", s.set, "a", "1")
    rec("get", s.get, "a")
    rec("set bytes", s.set, "a", b"\x00\xff binary")
    assert rec("get bytes", s.get, "a") == b"\x00\xff binary"
    rec("set empty", s.set, "e", "")
    assert rec("get empty", s.get, "e") == b""


@scenario()
def get_missing_times_out(s: Any, rec: Recorder) -> None:
    s.set_timeout(SHORT)
    err = rec("get missing", s.get, "missing")
    assert isinstance(err, dist.DistStoreError)
    rec("multi_get missing", s.multi_get, ["missing", "also"])


@scenario()
def get_waits_for_a_later_set(s: Any, rec: Recorder) -> None:
    other = s.clone()
    timer = threading.Timer(0.2, other.set, args=("late", "value"))
    timer.start()
    try:
        assert rec("get waits", s.get, "late") == b"value"
    finally:
        timer.join()
    timer = threading.Timer(0.2, other.multi_set, args=(["m2", "m3"], ["2", "3"]))
    s.set("m1", "1")
    timer.start()
    try:
        assert rec("multi_get waits", s.multi_get, ["m1", "m2", "m3"]) == [b"1", b"2", b"3"]
    finally:
        timer.join()


@scenario()
def add_counts(s: Any, rec: Recorder) -> None:
    assert rec("add new", s.add, "c", 5) == 5
    rec("add more", s.add, "c", 2)
    rec("add negative", s.add, "c", -10)
    assert rec("get counter", s.get, "c") == b"-3"
    rec("add zero new", s.add, "z", 0)
    rec("get zero", s.get, "z")
    rec("set number", s.set, "n", "41")
    assert rec("add to set number", s.add, "n", 1) == 42


@scenario()
def compare_set_cases(s: Any, rec: Recorder) -> None:
    assert rec("missing, empty expected", s.compare_set, "k", "", "new") == b"new"
    rec("get created", s.get, "k")
    assert rec("missing, expected given", s.compare_set, "k2", "x", "new") == b"x"
    assert rec("not created", s.check, ["k2"]) is False
    assert rec("mismatch", s.compare_set, "k", "other", "z") == b"new"
    assert rec("match", s.compare_set, "k", "new", "second") == b"second"
    assert rec("present, empty expected", s.compare_set, "k", "", "z") == b"second"
    rec("bytes arguments", s.compare_set, "k", b"second", b"\xff\x00")
    rec("get bytes", s.get, "k")
    s.set("empty", "")
    assert rec("empty value, empty expected", s.compare_set, "empty", "", "filled") == b"filled"
    rec("get filled", s.get, "empty")


@scenario()
def check_and_wait(s: Any, rec: Recorder) -> None:
    s.set("here", "1")
    rec("check empty list", s.check, [])
    rec("check present", s.check, ["here"])
    rec("check missing", s.check, ["here", "gone"])
    rec("wait empty list", s.wait, [])
    rec("wait present", s.wait, ["here"])
    err = rec("wait timeout overload", s.wait, ["here", "gone"], SHORT)
    assert isinstance(err, dist.DistStoreError) and "wait timeout after 200ms" in str(err)
    s.set_timeout(SHORT)
    rec("wait default timeout", s.wait, ["gone"])
    rec("timeout property", lambda: s.timeout)


@scenario()
def wait_wakes_up(s: Any, rec: Recorder) -> None:
    other = s.clone()
    s.set("first", "1")
    timer = threading.Timer(0.2, other.set, args=("second", "2"))
    timer.start()
    try:
        rec("wait", s.wait, ["first", "second"], DEFAULT)
    finally:
        timer.join()
    rec("both there", s.check, ["first", "second"])


@scenario(cpp=False)
def delete_and_count(s: Any, rec: Recorder) -> None:
    base = s.num_keys()
    s.set("a", "1")
    s.add("b", 1)
    s.multi_set(["c", "d"], ["3", "4"])
    s.append("e", "5")
    s.compare_set("f", "", "6")
    s.queue_push("q", "not a key")
    assert rec("num_keys grew by", lambda: s.num_keys() - base) == 6
    rec("list_keys", lambda: sorted(s.list_keys()))
    assert rec("delete present", s.delete_key, "a") is True
    assert rec("delete missing", s.delete_key, "a") is False
    rec("num_keys after delete", lambda: s.num_keys() - base)
    rec("check deleted", s.check, ["a"])
    s.set_timeout(SHORT)
    rec("get deleted", s.get, "a")
    rec("list_keys after delete", lambda: sorted(s.list_keys()))


@scenario()
def multi_set_get(s: Any, rec: Recorder) -> None:
    rec("multi_set", s.multi_set, ["x", "y", "z"], ["1", b"2", ""])
    assert rec("multi_get", s.multi_get, ["z", "x", "y"]) == [b"", b"1", b"2"]
    rec("multi_get duplicates", s.multi_get, ["x", "x"])
    rec("multi_get empty", s.multi_get, [])
    rec("multi_set empty", s.multi_set, [], [])
    rec("multi_set overwrite", s.multi_set, ["x"], ["one"])
    rec("get overwritten", s.get, "x")


@scenario(cpp=False)
def multi_set_length_mismatch(s: Any, rec: Recorder) -> None:
    # Through PrefixStore the mismatch is caught by pybind11 before any store sees it.
    err = rec("mismatch", s.multi_set, ["x", "y"], ["1"])
    assert isinstance(err, dist.DistStoreError)


@scenario()
def append_values(s: Any, rec: Recorder) -> None:
    rec("append new", s.append, "ap", "po")
    rec("append more", s.append, "ap", b"tato")
    assert rec("get appended", s.get, "ap") == b"potato"
    s.set("ap2", "x")
    rec("append to set", s.append, "ap2", "y")
    rec("get", s.get, "ap2")


@scenario(cpp=False)
def queues(s: Any, rec: Recorder) -> None:
    s.set_timeout(SHORT)
    rec("len of unknown", s.queue_len, "q")
    err = rec("pop empty, no block", s.queue_pop, "q", False)
    assert isinstance(err, dist.QueueEmptyError)
    rec("pop empty, block", s.queue_pop, "q")
    rec("check unknown queue", s.check, ["q"])
    for value in ("a", b"b", "c"):
        rec("push", s.queue_push, "q", value)
    rec("check queue", s.check, ["q"])
    rec("wait on queue", s.wait, ["q"])
    assert rec("len", s.queue_len, "q") == 3
    assert rec("pop", s.queue_pop, "q") == b"a"
    rec("pop", s.queue_pop, "q", False)
    rec("pop", s.queue_pop, "q", True)
    rec("len after pops", s.queue_len, "q")
    rec("check drained queue", s.check, ["q"])
    rec("queue and key share a name", s.set, "q", "plain")
    rec("push beside key", s.queue_push, "q", "item")
    rec("key untouched", s.get, "q")
    rec("len beside key", s.queue_len, "q")
    rec("pop beside key", s.queue_pop, "q")


@scenario(cpp=False)
def queue_pop_waits_for_push(s: Any, rec: Recorder) -> None:
    other = s.clone()
    timer = threading.Timer(0.2, other.queue_push, args=("jobs", "late"))
    timer.start()
    try:
        assert rec("blocking pop", s.queue_pop, "jobs") == b"late"
    finally:
        timer.join()
    timer = threading.Timer(0.2, other.queue_push, args=("jobs2", "x"))
    timer.start()
    try:
        rec("wait on queue", s.wait, ["jobs2"], DEFAULT)
    finally:
        timer.join()


@scenario(cpp=False)
def barriers(s: Any, rec: Recorder) -> None:
    rec("barrier of one", s.barrier, "b", 1)
    rec("barrier counter", s.get, "b")
    rec("reused barrier", s.barrier, "b", 1)
    err = rec("barrier timeout", s.barrier, "c", 2, SHORT)
    assert isinstance(err, dist.DistStoreError)
    rec("keys", lambda: sorted(s.list_keys()))
    other = s.clone()
    thread = threading.Thread(target=other.barrier, args=("d", 2, DEFAULT))
    thread.start()
    rec("barrier of two", s.barrier, "d", 2, DEFAULT)
    thread.join()
    rec("counter of two", s.get, "d")


@scenario()
def awkward_keys_and_values(s: Any, rec: Recorder) -> None:
    keys = ["with/slash", "/leading", "trailing/", "ключ", "日本語 key", "a b\tc", ""]
    for i, key in enumerate(keys):
        rec(f"set {key!r}", s.set, key, f"v{i}")
    rec("multi_get awkward", s.multi_get, keys)
    rec("check awkward", s.check, keys)
    every_byte = bytes(range(256)) * 3
    rec("set binary", s.set, "bin", every_byte)
    assert rec("get binary", s.get, "bin") == every_byte
    rec("set unicode value", s.set, "u", "значение ✓")
    rec("get unicode value", s.get, "u")


@scenario(cpp=False)
def awkward_keys_listed(s: Any, rec: Recorder) -> None:
    keys = ["with/slash", "/leading", "ключ", "日本語 key", ""]
    s.multi_set(keys, ["1"] * len(keys))
    assert rec("list_keys", lambda: sorted(s.list_keys())) == sorted(keys)
    rec("delete slash", s.delete_key, "with/slash")
    rec("after delete", lambda: sorted(s.list_keys()))


@scenario()
def big_values(s: Any, rec: Recorder) -> None:
    big = hashlib.sha256(b"seed").digest() * (6 * 1024 * 1024 // 32)  # 6 MiB
    rec("set 6 MiB", s.set, "big", big)
    assert rec("get 6 MiB", s.get, "big") == big
    rec("multi_set big", s.multi_set, ["big2", "small"], [big[: 3 * 1024 * 1024], "s"])
    rec("multi_get big", s.multi_get, ["big2", "small", "big"])
    rec("overwrite big with small", s.set, "big", "tiny")
    rec("get small again", s.get, "big")
    rec("append makes big", s.append, "grow", big[: 1024 * 1024])
    rec("append more", s.append, "grow", big[: 1024 * 1024])
    assert rec("get grown", s.get, "grow") == big[: 1024 * 1024] * 2
    rec("compare_set big expected", s.compare_set, "grow", big[: 1024 * 1024] * 2, "reset")
    rec("get reset", s.get, "grow")


@scenario()
def bad_arguments(s: Any, rec: Recorder) -> None:
    err = rec("set int value", s.set, "k", 1)
    assert isinstance(err, TypeError)
    rec("set None value", s.set, "k", None)
    rec("add str amount", s.add, "k", "1")
    rec("wait on a str", s.wait, "k")
    rec("check a str", s.check, "k")


@scenario()
def api_surface(s: Any, rec: Recorder) -> None:
    assert rec("has_extended_api", s.has_extended_api) is True
    rec("set_timeout", s.set_timeout, datetime.timedelta(seconds=7))
    rec("timeout", lambda: s.timeout)
    twin = rec("clone", s.clone)
    assert isinstance(twin, dist.Store)
    twin.set("from twin", "1")
    rec("clone shares data", s.get, "from twin")
    rec("clone keeps timeout", lambda: twin.timeout)


# --------------------------------------------------------------------------- fixtures


def _tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, DEFAULT, wait_for_workers=False)


@pytest.fixture
def make_etcd_store(etcd_endpoint: str) -> Iterator[Callable[..., EtcdStore]]:
    stores: list[EtcdStore] = []

    def make(**kwargs: Any) -> EtcdStore:
        kwargs.setdefault("prefix", f"conformance/{uuid.uuid4().hex[:8]}")
        kwargs.setdefault("timeout", DEFAULT)
        store = EtcdStore(etcd_endpoint, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _run(fn: Scenario, store: Any, strip: str = "") -> list[tuple[Any, ...]]:
    rec = Recorder(strip)
    fn(store, rec)
    return rec.log


#: The torch CI pins (.ci/run); older torch (the floor, torch 2.6) has a smaller Store API.
PINNED_TORCH = (2, 13)
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _reference(fn: Scenario, tcp: Any) -> list[tuple[Any, ...]]:
    """The scenario on torch's own store: the expected record.

    On a torch older than the pinned one, a scenario that torch's store cannot run (a method it lacks, or
    an older error type its own assertions reject) is skipped, naming why: there is nothing to compare
    with. On the pinned torch the same failure fails the test.
    """
    try:
        log = _run(fn, tcp)
    except (AttributeError, AssertionError) as e:
        if _TORCH >= PINNED_TORCH:
            raise
        pytest.skip(f"torch {torch.__version__}'s store cannot run this scenario: {type(e).__name__}: {e}")
    lacking = [entry for entry in log if entry[1:3] == ("raised", "AttributeError")]
    if lacking and _TORCH < PINNED_TORCH:
        pytest.skip(f"torch {torch.__version__}'s store lacks a method of the scenario: {lacking[0][0]}")
    return log


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_as_tcpstore(name: str, make_etcd_store: Callable[..., EtcdStore]) -> None:
    expected = _reference(SCENARIOS[name], _tcp_store())
    store = make_etcd_store()
    assert _run(SCENARIOS[name], store, strip=f"{store.prefix}/") == expected


@pytest.mark.parametrize("name", sorted(CPP_PATH))
def test_same_as_tcpstore_through_prefix_store(
    name: str, make_etcd_store: Callable[..., EtcdStore]
) -> None:
    expected = _reference(SCENARIOS[name], dist.PrefixStore("p", _tcp_store()))
    store = make_etcd_store()
    got = _run(SCENARIOS[name], dist.PrefixStore("p", store), strip=f"{store.prefix}/")
    assert got == expected


@pytest.mark.parametrize(
    "method, args",
    [
        ("delete_key", ("k",)),
        ("num_keys", ()),
        ("list_keys", ()),
        ("queue_push", ("q", "v")),
        ("queue_pop", ("q", False)),
        ("queue_len", ("q",)),
    ],
)
def test_prefix_store_methods_torch_does_not_forward(
    method: str, args: tuple[Any, ...], make_etcd_store: Callable[..., EtcdStore]
) -> None:
    """torch 2.13's trampoline has no override for these: any Python store fails the same way.

    If this test starts failing, torch forwards them now: add them to CPP_PATH.
    """
    if not hasattr(dist.PrefixStore, method):
        pytest.skip(f"torch {torch.__version__}'s PrefixStore has no {method}")
    store = make_etcd_store()
    with pytest.raises((RuntimeError, NotImplementedError)) as info:
        getattr(dist.PrefixStore("p", store), method)(*args)
    assert "pure virtual" in str(info.value) or "not implemented" in str(info.value)


def test_torch_python_store_self_test(make_etcd_store: Callable[..., EtcdStore]) -> None:
    dist._test_python_store(make_etcd_store())
    if not hasattr(dist.PrefixStore, "clone"):
        pytest.skip(f"torch {torch.__version__}'s PrefixStore has no clone")
    dist._test_python_store(dist.PrefixStore("p", make_etcd_store()).clone())


def test_num_keys_counts_only_user_keys(make_etcd_store: Callable[..., EtcdStore]) -> None:
    store = make_etcd_store()
    assert store.num_keys() == 0 and store.list_keys() == []
    store.set("a", "1")
    store.queue_push("q", "x")
    store.set("big", b"x" * (3 * 1024 * 1024))  # chunk keys are internal
    store.add("c", 1)  # add/append markers are internal
    assert store.num_keys() == 3
    assert store.list_keys() == ["a", "big", "c"]


def test_namespaces_are_separate(make_etcd_store: Callable[..., EtcdStore]) -> None:
    one = make_etcd_store(prefix="ns/one")
    sibling = make_etcd_store(prefix="ns/one-other")
    also_sibling = make_etcd_store(prefix="ns/on")
    for s in (one, sibling, also_sibling):
        s.set("k", s.prefix)
    assert [s.list_keys() for s in (one, sibling, also_sibling)] == [["k"], ["k"], ["k"]]
    assert [s.num_keys() for s in (one, sibling, also_sibling)] == [1, 1, 1]
    assert [s.get("k") for s in (one, sibling, also_sibling)] == [b"ns/one", b"ns/one-other", b"ns/on"]
    assert one.delete_key("k") and sibling.get("k") == b"ns/one-other"


def test_a_nested_prefix_is_a_prefix_store(make_etcd_store: Callable[..., EtcdStore]) -> None:
    """Keys are stored as ``<prefix>/<key>``: prefix "a/b" sees what PrefixStore("b", <prefix "a">) sees."""
    outer = make_etcd_store(prefix="nest/a")
    inner = make_etcd_store(prefix="nest/a/b")
    inner.set("k", "v")
    assert dist.PrefixStore("b", outer).get("k") == b"v"
    assert outer.list_keys() == ["b/k"]
    assert inner.list_keys() == ["k"]


def test_timeout_error_matches_tcpstore_exactly_with_empty_prefix(
    make_etcd_store: Callable[..., EtcdStore],
) -> None:
    store = make_etcd_store(prefix="", timeout=SHORT)
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, SHORT, wait_for_workers=False)
    messages = []
    for s in (tcp, store):
        with pytest.raises(dist.DistStoreError) as info:
            s.wait(["k1", "k2"])
        messages.append(str(info.value))
    assert messages[0] == messages[1] == "wait timeout after 200ms, keys: /k1, /k2"


def test_add_on_a_non_integer_raises_and_store_stays_usable(
    make_etcd_store: Callable[..., EtcdStore],
) -> None:
    store = make_etcd_store()
    store.set("text", "abc")
    with pytest.raises(dist.DistStoreError, match="not an integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"
    assert store.add("n", 1) == 1


def test_bad_keys_and_options_are_named(make_etcd_store: Callable[..., EtcdStore]) -> None:
    store = make_etcd_store()
    with pytest.raises(ValueError, match="NUL"):
        store.set("a\0b", "x")
    with pytest.raises(TypeError, match="key must be str"):
        store.get(12)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        make_etcd_store(timeout="soon")
    with pytest.raises(ValueError, match="lease_ttl"):
        make_etcd_store(lease_ttl=1)
    with pytest.raises(ValueError, match="Invalid etcd endpoint"):
        EtcdStore("127.0.0.1:notaport")
