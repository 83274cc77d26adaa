"""torchrun entry point of ``--rdzv-backend=etcd-v3``.

torch's registry (``registry._register_out_of_tree_handlers``) loads the
``torchrun.handlers`` entry point ``etcd-v3 = etcd_rdzv.v3.handler:create_etcd_v3_handler``,
calls it with no argument and registers the returned *creator*
(``RendezvousParameters -> RendezvousHandler``) under ``etcd-v3``.

This module imports only the standard library at import time, because torch
loads it while ``torch.distributed.elastic.rendezvous`` is itself being
imported; gRPC, the etcd client and the handler are imported when a handler is
created.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from .rendezvous import EtcdV3RendezvousHandler

log = logging.getLogger(__name__)

__all__ = ["create_etcd_v3_handler", "create_etcd_v3_rdzv_handler"]


def create_etcd_v3_rdzv_handler(
    params: RendezvousParameters, *, client: Any = None
) -> EtcdV3RendezvousHandler:
    """Create an ``etcd-v3`` handler from torchrun's parameters (the registered creator).

    Reads the rdzv-conf keys of :mod:`etcd_rdzv.v3.settings` and
    :mod:`etcd_rdzv.params`; raises ``ValueError`` naming a bad key. No RPC is
    made here. ``client`` (an ``EtcdClient``) is used instead of a new one when
    given, and is then not closed by ``shutdown()``.
    """
    from .rendezvous import EtcdV3RendezvousHandler
    from .settings import parse_settings

    settings, options = parse_settings(params)
    if client is not None:
        return EtcdV3RendezvousHandler(settings, client, owns_client=False)
    return EtcdV3RendezvousHandler(settings, options.create_client(), owns_client=True)


def create_etcd_v3_handler() -> Any:
    """The ``torchrun.handlers`` factory: returns :func:`create_etcd_v3_rdzv_handler`."""
    return create_etcd_v3_rdzv_handler
