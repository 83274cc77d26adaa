"""torchrun entry points and rendezvous handler creators of all three backends.

``setup.cfg`` declares one ``torchrun.handlers`` entry point per backend, all here:
``etcd-v2`` and ``etcd`` (torch's dynamic rendezvous over our backend,
:mod:`etcd_rdzv.dynamic`) and ``etcd-v3`` (:mod:`etcd_rdzv.native`).

* **Factories** (the entry points: :func:`create_etcd_v2_handler`,
  :func:`create_etcd_legacy_handler`, :func:`create_etcd_v3_handler`): torch's registry
  (``registry._register_out_of_tree_handlers``) calls each with no argument and registers
  the returned *creator* under the entry-point name. torch has registered its built-in
  ``etcd-v2``/``etcd`` creators by then and refuses a second, different creator for a
  name, so those two factories first remove torch's registration (with
  ``ETCD_RDZV_DISABLE_OVERRIDE=1`` they return torch's current creator instead).
  ``etcd-v3`` is not a torch name. Every factory first checks the shape of torch's
  registry (``rendezvous_handler_registry`` with ``register`` and, to replace a built-in,
  its ``_registry`` dict) and raises :class:`EtcdRdzvPluginError` naming the torch version
  and what was expected, not an ``AttributeError``; torch logs it while loading the entry points.
* **Creators** (``RendezvousParameters -> RendezvousHandler``):
  :func:`create_etcd_v2_rdzv_handler`, :func:`create_etcd_legacy_rdzv_handler`,
  :func:`create_etcd_v3_rdzv_handler`.

Standard library only at import time: torch loads this module while
``torch.distributed.elastic.rendezvous`` is still being imported, and a failing import
here would only show as a warning and then "unknown backend". gRPC, the etcd client and
torch's rendezvous are imported when a handler is created; if that fails the
``etcd-v2``/``etcd`` creators raise :class:`EtcdRdzvPluginError` naming the cause and the fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .plugin_errors import EtcdRdzvPluginError, torch_version

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from .native.handler import EtcdV3RendezvousHandler

log = logging.getLogger(__name__)

__all__ = [
    "DISABLE_OVERRIDE_ENV",
    "EtcdRdzvPluginError",
    "create_etcd_legacy_handler",
    "create_etcd_legacy_rdzv_handler",
    "create_etcd_v2_handler",
    "create_etcd_v2_rdzv_handler",
    "create_etcd_v3_handler",
    "create_etcd_v3_rdzv_handler",
]

DISABLE_OVERRIDE_ENV = "ETCD_RDZV_DISABLE_OVERRIDE"
"""Set to ``1`` (``true``/``yes``) to keep torch's built-in ``etcd-v2``/``etcd`` handlers."""

Creator = Callable[["RendezvousParameters"], "RendezvousHandler"]


REGISTRY_EXPECTED = (
    "torch.distributed.elastic.rendezvous.api.rendezvous_handler_registry: a RendezvousHandlerRegistry "
    "with register(backend, creator) and its backend -> creator dict _registry (as in torch 2.6 to 2.15)"
)


def _override_disabled() -> bool:
    return os.environ.get(DISABLE_OVERRIDE_ENV, "").strip().lower() in ("1", "true", "yes", "y", "on")


def _registry_table(name: str, *, need_table: bool) -> dict[str, Any]:
    """torch's backend -> creator table (``{}`` when ``need_table`` is false: only ``register`` is checked).

    Raises :class:`EtcdRdzvPluginError` (torch version, what was expected) for a missing or
    reshaped registry.
    """
    try:
        from torch.distributed.elastic.rendezvous import api
    except Exception as e:
        raise EtcdRdzvPluginError(
            f"etcd-rdzv cannot register its {name!r} rendezvous handler: importing "
            f"torch.distributed.elastic.rendezvous.api failed under torch {torch_version()} "
            f"({type(e).__name__}: {e}); expected {REGISTRY_EXPECTED}."
        ) from e
    registry = getattr(api, "rendezvous_handler_registry", None)
    table = getattr(registry, "_registry", None)
    if registry is None:
        problem = "has no rendezvous_handler_registry"
    elif not callable(getattr(registry, "register", None)):
        problem = f"has a rendezvous_handler_registry ({type(registry).__name__}) without register()"
    elif need_table and not isinstance(table, dict):
        problem = f"has a rendezvous_handler_registry ({type(registry).__name__}) without a _registry dict"
    else:
        return table if need_table else {}  # type: ignore[return-value]
    raise EtcdRdzvPluginError(
        f"etcd-rdzv cannot register its {name!r} rendezvous handler: in torch {torch_version()}, "
        f"torch.distributed.elastic.rendezvous.api {problem}; expected {REGISTRY_EXPECTED}. "
        "Install a torch version the plugin supports, or a newer etcd-rdzv."
    )


def _registration(name: str, ours: Creator) -> Creator:
    """The creator torch should register under ``name`` ; raises as :func:`_registry_table`."""
    table = _registry_table(name, need_table=True)
    current = table.get(name)
    if _override_disabled():
        if current is not None:
            log.info("etcd-rdzv: %s is set; keeping torch's built-in %r handler", DISABLE_OVERRIDE_ENV, name)
            return current  # type: ignore[no-any-return]
        return ours
    if current is not None and current is not ours:
        del table[name]
        log.debug("etcd-rdzv: replaced torch's %r rendezvous handler", name)
    return ours


def _load_creator(name: str) -> Callable[..., RendezvousHandler]:
    """Import the heavy part of the plugin; raise a clear error if it cannot load."""
    try:
        from .dynamic.handler import create_handler_from_params
    except Exception as e:
        raise EtcdRdzvPluginError(
            f"The rendezvous backend {name!r} of etcd-rdzv cannot be used: importing its "
            f"dependencies failed with {type(e).__name__}: {e}. Fix: reinstall the plugin with "
            "its dependencies (`pip install --force-reinstall etcd-rdzv`, which needs "
            "grpcio>=1.60, protobuf>=5 and python3-etcd3), or set "
            f"{DISABLE_OVERRIDE_ENV}=1 to use torch's built-in {name!r} backend instead "
            "(that one needs an etcd serving the v2 API)."
        ) from e
    return create_handler_from_params


def create_etcd_v2_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v2`` handler: torch's dynamic rendezvous over etcd v3.

    Takes torch's ``etcd-v2`` rdzv-conf keys plus ours (:mod:`etcd_rdzv.conf`). Opens the
    run's store (one to three RPCs). Raises ``ValueError`` naming a bad key,
    ``RendezvousConnectionError`` when etcd is unreachable within ``read_timeout``,
    :class:`EtcdRdzvPluginError` when the plugin's dependencies cannot be imported.
    """
    return _load_creator(params.backend)(params, legacy=False)


def create_etcd_legacy_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd`` handler: the same dynamic rendezvous, fed torch's legacy
    ``etcd`` conf keys (``timeout``, ``etcd_prefix``, ``cacert``, ``cert``, ``key``)."""
    return _load_creator(params.backend)(params, legacy=True)


def create_etcd_v2_handler(params: RendezvousParameters | None = None) -> Any:
    """``torchrun.handlers`` entry point for ``etcd-v2``.

    With no argument (as torch calls it), the creator to register; with ``params``, the
    handler itself, so it can also be registered as a creator by hand.
    """
    if params is not None:
        return create_etcd_v2_rdzv_handler(params)
    return _registration("etcd-v2", create_etcd_v2_rdzv_handler)


def create_etcd_legacy_handler(params: RendezvousParameters | None = None) -> Any:
    """``torchrun.handlers`` entry point for ``etcd`` (see :func:`create_etcd_v2_handler`)."""
    if params is not None:
        return create_etcd_legacy_rdzv_handler(params)
    return _registration("etcd", create_etcd_legacy_rdzv_handler)


def create_etcd_v3_rdzv_handler(
    params: RendezvousParameters, *, client: Any = None
) -> EtcdV3RendezvousHandler:
    """Create an ``etcd-v3`` handler from torchrun's parameters (the registered creator); no RPC.

    Reads the rdzv-conf keys (:func:`etcd_rdzv.conf.parse_v3_settings`; ``metrics_port``:
    :func:`etcd_rdzv.metrics.maybe_start`); raises ``ValueError`` naming a bad key.
    ``client`` (an ``EtcdClient``), when given, is used instead of a new one and not closed
    by ``shutdown()``.
    """
    from etcd_store.client import EtcdClient

    from .conf import parse_v3_settings
    from .metrics import maybe_start
    from .native.handler import EtcdV3RendezvousHandler

    settings, options = parse_v3_settings(params)
    maybe_start(params)  # the optional metrics endpoint (rdzv-conf metrics_port)
    if client is not None:
        return EtcdV3RendezvousHandler(settings, client, owns_client=False)
    return EtcdV3RendezvousHandler(settings, EtcdClient.from_options(options), owns_client=True)


def create_etcd_v3_handler() -> Any:
    """``torchrun.handlers`` entry point for ``etcd-v3``: returns :func:`create_etcd_v3_rdzv_handler`.

    Raises :class:`EtcdRdzvPluginError` if torch's registry has no ``register``.
    """
    _registry_table("etcd-v3", need_table=False)
    return create_etcd_v3_rdzv_handler
