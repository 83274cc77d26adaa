"""What the plugin relies on in torch's private rendezvous code, asserted against the installed torch.

Each test lists what differs from what the plugin relies on and fails with one message naming the
installed torch version and every difference ("torch 2.16.0: ... moved"), so that a new torch that
moves one of these names is caught by CI (which pins the newest torch and tests the floor 2.6)
before a user finds it. No etcd.

* The registry (etcd_rdzv/plugin.py): torch's ``RendezvousHandlerRegistry`` in
  ``torch.distributed.elastic.rendezvous.api.rendezvous_handler_registry``, its
  ``register(backend, creator)`` that refuses a second creator for a name, its private
  ``_registry`` dict (the plugin deletes torch's ``etcd``/``etcd-v2`` entries from it) that
  ``register`` and ``create_handler`` read; ``registry.handler_registry`` (the same object),
  ``_register_default_handlers`` (registers ``etcd`` and ``etcd-v2``) run before
  ``_register_out_of_tree_handlers`` (loads the ``torchrun.handlers`` entry points, calls each with
  no argument, registers what it returns under the entry point's name, logs a failure).
* The dynamic rendezvous (etcd_rdzv/dynamic/state.py ``check_torch_internals`` and
  etcd_rdzv/dynamic/handler.py): the class-level names ``check_torch_internals`` checks, plus
  the instance attributes the handler and the state holder read or set (set by torch's
  ``__init__``, so checked on instances built here), ``RendezvousSettings``' fields and
  ``from_backend``'s parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.sealed_rounds import MemoryBackend, MemoryCell
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous import registry as torch_registry

import etcd_rdzv
from etcd_rdzv import plugin
from etcd_rdzv.dynamic import state as our_state
from etcd_rdzv.dynamic.handler import EtcdRendezvousHandler

OURS = {
    "etcd-v2": plugin.create_etcd_v2_rdzv_handler,
    "etcd": plugin.create_etcd_legacy_rdzv_handler,
    "etcd-v3": plugin.create_etcd_v3_rdzv_handler,
}


def _moved(what: str, found: list[str]) -> str:
    return (
        f"torch {torch.__version__}: {what} moved ({'; '.join(found)}); etcd-rdzv relies on it "
        "(tests/unit/test_torch_contract.py says where): adapt the plugin to this torch."
    )


def _params(function: Any) -> list[str]:
    try:
        return [p for p in inspect.signature(function).parameters if p != "self"]
    except (TypeError, ValueError):
        return ["(unreadable)"]


def _names(function: Any) -> tuple[str, ...]:
    """The global and attribute names ``function``'s code reads (nested code objects included)."""
    code = getattr(function, "__code__", None)
    found: list[str] = []
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        found.extend(c.co_names)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    return tuple(found)


# ------------------------------------------------------------------------------------------ the registry


def _registry_moves() -> list[str]:
    found: list[str] = []
    registry_cls = getattr(torch_api, "RendezvousHandlerRegistry", None)
    registry = getattr(torch_api, "rendezvous_handler_registry", None)
    if registry_cls is None:
        found.append("api.RendezvousHandlerRegistry is gone")
    if registry is None:
        return [*found, "api.rendezvous_handler_registry is gone"]
    if registry_cls is not None and not isinstance(registry, registry_cls):
        found.append(f"api.rendezvous_handler_registry is a {type(registry).__name__}")
    if _params(getattr(registry, "register", None)) != ["backend", "creator"]:
        found.append(f"register takes {_params(getattr(registry, 'register', None))}, not (backend, creator)")
    if not isinstance(getattr(registry, "_registry", None), dict):
        found.append("the registry has no _registry dict")
    for method in ("register", "create_handler"):
        if "_registry" not in _names(getattr(type(registry), method, None)):
            found.append(f"RendezvousHandlerRegistry.{method} no longer reads _registry")
    if getattr(torch_registry, "handler_registry", None) is not registry:
        found.append("registry.handler_registry is not api.rendezvous_handler_registry")
    for name in ("_register_default_handlers", "_register_out_of_tree_handlers"):
        if not callable(getattr(torch_registry, name, None)):
            found.append(f"registry.{name} is gone")
    out_of_tree = getattr(torch_registry, "_register_out_of_tree_handlers", None)
    if callable(out_of_tree) and '"torchrun.handlers"' not in inspect.getsource(out_of_tree):
        found.append("_register_out_of_tree_handlers no longer reads the torchrun.handlers entry points")
    package = inspect.getsource(__import__("torch.distributed.elastic.rendezvous", fromlist=["_"]))
    default, out = package.find("_register_default_handlers()"), package.find("_register_out_of_tree_handlers()")
    if not 0 <= default < out:
        found.append("torch.distributed.elastic.rendezvous no longer registers its defaults before the plugins")
    return found


def test_the_registry_names_the_plugin_relies_on_are_there() -> None:
    found = _registry_moves()
    assert not found, _moved("the rendezvous handler registry", found)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A new torch registry in place of the global one (where torch's registry module and the
    plugin look it up), holding torch's defaults: what torch has when it loads the plugins."""
    registry = torch_api.RendezvousHandlerRegistry()
    monkeypatch.setattr(torch_api, "rendezvous_handler_registry", registry)
    monkeypatch.setattr(torch_registry, "handler_registry", registry)
    monkeypatch.delenv(plugin.DISABLE_OVERRIDE_ENV, raising=False)
    torch_registry._register_default_handlers()
    yield registry


def test_torch_loads_the_plugins_over_its_built_ins(fresh_registry: Any, caplog: pytest.LogCaptureFixture) -> None:
    """torch's own loading path, run again on a fresh registry: its defaults include etcd and
    etcd-v2, a second creator for a name is refused, and the plugin's entry points replace both."""
    found: list[str] = []
    table = fresh_registry._registry
    builtins = {name: table.get(name) for name in ("etcd", "etcd-v2", "c10d")}
    missing = sorted(name for name, creator in builtins.items() if creator is None)
    if missing:
        found.append(f"_register_default_handlers no longer registers {', '.join(missing)}")
    probe = torch_api.RendezvousHandlerRegistry()
    probe.register("x", OURS["etcd-v2"])
    try:
        probe.register("x", OURS["etcd"])
    except ValueError:
        pass
    else:
        found.append("register now replaces a registered creator (the plugin deletes torch's entry first)")
    with caplog.at_level(logging.WARNING, logger=torch_registry.__name__):
        torch_registry._register_out_of_tree_handlers()
    wrong = sorted(name for name, creator in OURS.items() if table.get(name) is not creator)
    if wrong:
        found.append(f"after _register_out_of_tree_handlers, {', '.join(wrong)} map to "
                     f"{[table.get(n) for n in wrong]} (torch logged: {caplog.text.strip()[:400]!r})")
    if builtins["c10d"] is not None and table.get("c10d") is not builtins["c10d"]:
        found.append("c10d changed")
    assert not found, _moved("the loading of torchrun.handlers plugins", found)


def test_torch_logs_a_plugin_that_fails_to_register(fresh_registry: Any, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The plugin's EtcdRdzvPluginError reaches the user only through torch's warning."""
    monkeypatch.setattr(fresh_registry, "_registry", None)  # what the plugin refuses (no table)
    with caplog.at_level(logging.WARNING, logger=torch_registry.__name__):
        try:
            torch_registry._register_out_of_tree_handlers()
        except Exception as e:  # torch would let a plugin's failure stop torchrun
            pytest.fail(_moved("_register_out_of_tree_handlers", [f"it raised {type(e).__name__}: {e}"]))
    logged = [r for r in caplog.records if "etcd-v2" in r.getMessage() and r.exc_info]
    assert logged, _moved("_register_out_of_tree_handlers",
                          [f"no warning with the plugin's error was logged: {caplog.text[:400]!r}"])
    assert isinstance(logged[0].exc_info[1], plugin.EtcdRdzvPluginError)  # type: ignore[index]


def test_the_installed_torch_registry_maps_the_three_names_to_the_plugin() -> None:
    """torch's registry as imported in this process (entry points of the installed package)."""
    table = torch_api.rendezvous_handler_registry._registry
    if plugin._override_disabled():
        pytest.skip(f"{plugin.DISABLE_OVERRIDE_ENV} is set: torch keeps its built-ins")
    wrong = {n: table.get(n) for n, creator in OURS.items() if table.get(n) is not creator}
    assert not wrong, _moved("the registry after import", [f"{n} -> {c!r}" for n, c in wrong.items()]) + (
        f" (etcd_rdzv from {etcd_rdzv.__file__})"
    )


# ------------------------------------------------------------------------------- the dynamic rendezvous


def _handler(cls: type[dr.DynamicRendezvousHandler]) -> dr.DynamicRendezvousHandler:
    return cls.from_backend("contract", dist.HashStore(), MemoryBackend(MemoryCell()), 1, 1, "127.0.0.1")


def _dynamic_moves() -> list[str]:
    found = list(our_state._problems())  # what check_torch_internals checks (class-level names)
    settings_fields = [f.name for f in dataclasses.fields(dr.RendezvousSettings)]
    want = ["run_id", "min_nodes", "max_nodes", "timeout", "keep_alive_interval", "keep_alive_max_attempt"]
    if settings_fields[: len(want)] != want:
        found.append(f"RendezvousSettings' fields are {settings_fields}")
    from_backend = _params(dr.DynamicRendezvousHandler.from_backend)
    want = ["run_id", "store", "backend", "min_nodes", "max_nodes", "local_addr", "timeout"]
    if from_backend[: len(want)] != want:
        found.append(f"DynamicRendezvousHandler.from_backend takes {from_backend}")
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=1), last_call=timedelta(seconds=1),
                                   close=timedelta(seconds=1), heartbeat=timedelta(seconds=1))
    if timeout.close != timedelta(seconds=1):
        found.append("RendezvousTimeout.close changed")
    read = _names(dr.DynamicRendezvousHandler.next_rendezvous)  # rebuilds what the handler drops each round
    missing = [a for a in ("_bootstrap_store_info", "_shared_tcp_store_server") if a not in read]
    if missing:
        found.append(f"DynamicRendezvousHandler.next_rendezvous no longer reads {', '.join(missing)}")
    generator = getattr(dr.DynamicRendezvousHandler, "_node_desc_generator", None)
    if not callable(getattr(generator, "generate", None)):
        found.append("DynamicRendezvousHandler._node_desc_generator.generate is gone")
    context = getattr(dr, "_RendezvousContext", None)
    if context is None or _params(context.__init__)[:2] != ["node", "state"]:
        found.append("_RendezvousContext(node, state, ...) changed")
    if found:
        return found  # the instances below may not build
    theirs = _handler(dr.DynamicRendezvousHandler)
    attrs = ("_this_node", "_settings", "_state_holder", "_op_executor", "_heartbeat_lock",
             "_shared_tcp_store_server", "_bootstrap_store_info")  # fmt: skip
    missing = [a for a in attrs if not hasattr(theirs, a)]
    if missing:
        found.append(f"a DynamicRendezvousHandler has no {', '.join(missing)}")
    holder = theirs._state_holder
    if type(holder) is not dr._BackendRendezvousStateHolder:
        found.append(f"from_backend's state holder is a {type(holder).__name__}")
    missing = [a for a in ("_backend", "_settings", "_cache_duration", "_state", "_dead_nodes", "state")
               if not hasattr(holder, a)]  # fmt: skip
    if missing:
        found.append(f"a _BackendRendezvousStateHolder has no {', '.join(missing)}")
    ours = _handler(EtcdRendezvousHandler)
    if not isinstance(ours._state_holder, our_state.SealedRoundStateHolder):
        found.append(f"EtcdRendezvousHandler's state holder is a {type(ours._state_holder).__name__}")
    return found


def test_the_dynamic_rendezvous_names_the_etcd_v2_handler_relies_on_are_there() -> None:
    found = _dynamic_moves()
    assert not found, _moved("the dynamic rendezvous (DynamicRendezvousHandler and its state holder)", found)


def test_a_move_fails_with_the_torch_version_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The messages above name the torch version and what moved (a registry without its table)."""
    monkeypatch.setattr(torch_api.rendezvous_handler_registry, "_registry", None)
    monkeypatch.delattr(dr.DynamicRendezvousHandler, "_keep_alive")
    registry, dynamic = _moved("registry", _registry_moves()), _moved("dynamic", _dynamic_moves())
    assert f"torch {torch.__version__}: registry moved (the registry has no _registry dict)" in registry
    assert f"torch {torch.__version__}: dynamic moved (" in dynamic and "lacks _keep_alive" in dynamic


# ------------------------------------------------------------ torch 2.15's cas_backoff_max_seconds


def test_cas_backoff_max_seconds_reaches_a_torch_that_has_it(caplog: pytest.LogCaptureFixture) -> None:
    """torch 2.15 added ``cas_backoff_max_seconds`` (a random delay of up to that many seconds after a
    lost compare-and-swap of the state, in ``RendezvousSettings`` and ``from_backend``): the etcd-v2
    handler passes the rdzv-conf value on to it; an older torch has no such setting and the handler
    logs that it ignores a non-zero value."""
    from etcd_rdzv.conf import DynamicSettings, RdzvConfig
    from etcd_rdzv.dynamic.handler import _from_backend

    settings = DynamicSettings("etcd-v2", "contract", 1, 1, "127.0.0.1", RdzvConfig(client=None),  # type: ignore[arg-type]
                               cas_backoff_max_seconds=0.5)
    timeout = dr.RendezvousTimeout()
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.dynamic.handler"):
        handler = _from_backend(settings, dist.HashStore(), MemoryBackend(MemoryCell()), timeout)
    has_it = "cas_backoff_max_seconds" in _params(dr.DynamicRendezvousHandler.from_backend)
    if has_it:
        assert handler._settings.cas_backoff_max_seconds == 0.5, f"torch {torch.__version__}"
        assert "cas_backoff_max_seconds" not in caplog.text
    else:
        assert not hasattr(handler._settings, "cas_backoff_max_seconds")
        assert f"torch {torch.__version__}'s dynamic rendezvous has no cas_backoff_max_seconds" in caplog.text
    assert isinstance(handler._state_holder, our_state.SealedRoundStateHolder)
    assert handler._settings.keep_alive_interval == timedelta(seconds=settings.keep_alive_interval)
