"""The plugin's factories against a torch handler registry of another shape (etcd_rdzv/plugin.py):
a clear EtcdRdzvPluginError naming the torch version and what was expected, never an AttributeError. No etcd."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import registry as torch_registry

from etcd_rdzv import plugin

FACTORIES: dict[str, Callable[[], Any]] = {
    "etcd-v2": plugin.create_etcd_v2_handler,
    "etcd": plugin.create_etcd_legacy_handler,
    "etcd-v3": plugin.create_etcd_v3_handler,
}


class _NewShapeRegistry:
    """A registry that registers through another method and keeps no ``_registry`` dict."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add(self, backend: str, creator: Any) -> None:
        self.handlers[backend] = creator


class _RegisterOnlyRegistry(_NewShapeRegistry):
    def register(self, backend: str, creator: Any) -> None:
        self.handlers[backend] = creator


@pytest.fixture(autouse=True)
def _no_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.DISABLE_OVERRIDE_ENV, raising=False)


def _raises(factory: Callable[[], Any]) -> str:
    with pytest.raises(plugin.EtcdRdzvPluginError) as ei:
        factory()
    assert isinstance(ei.value, ImportError) and not isinstance(ei.value, AttributeError)
    text = str(ei.value)
    assert f"torch {torch.__version__}" in text and plugin.REGISTRY_EXPECTED in text, text
    return text


def test_a_missing_registry_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch_api, "rendezvous_handler_registry")
    for name, factory in FACTORIES.items():
        text = _raises(factory)
        assert f"its {name!r} rendezvous handler" in text and "has no rendezvous_handler_registry" in text


def test_a_registry_without_register_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_api, "rendezvous_handler_registry", _NewShapeRegistry())
    for factory in FACTORIES.values():
        assert "(_NewShapeRegistry) without register()" in _raises(factory)


def test_a_registry_without_its_table_refuses_only_the_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_api, "rendezvous_handler_registry", _RegisterOnlyRegistry())
    for name in ("etcd-v2", "etcd"):  # replacing torch's built-in needs the table
        assert "without a _registry dict" in _raises(FACTORIES[name])
    assert plugin.create_etcd_v3_handler() is plugin.create_etcd_v3_rdzv_handler  # a new name needs only register


def test_the_message_reaches_torch_log_when_torch_loads_the_entry_points(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's own loading path (registry._register_out_of_tree_handlers) logs our message."""
    registry = _RegisterOnlyRegistry()
    monkeypatch.setattr(torch_api, "rendezvous_handler_registry", registry)
    monkeypatch.setattr(torch_registry, "handler_registry", registry)
    with caplog.at_level(logging.WARNING):
        torch_registry._register_out_of_tree_handlers()
    assert registry.handlers.get("etcd-v3") is plugin.create_etcd_v3_rdzv_handler
    assert "etcd-v2" not in registry.handlers and "etcd" not in registry.handlers
    failed = {r.getMessage().split()[-1].rstrip(":") for r in caplog.records if "out of tree plugin" in r.getMessage()}
    assert {"etcd-v2", "etcd"} <= failed
    assert "without a _registry dict" in caplog.text and f"torch {torch.__version__}" in caplog.text


def test_the_real_registry_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    table = torch_api.rendezvous_handler_registry._registry
    monkeypatch.setitem(table, "etcd-v2", torch_registry._create_etcd_v2_handler)
    assert plugin.create_etcd_v2_handler() is plugin.create_etcd_v2_rdzv_handler
    assert "etcd-v2" not in table  # torch's built-in was removed so that ours can be registered
    assert plugin.create_etcd_v3_handler() is plugin.create_etcd_v3_rdzv_handler
