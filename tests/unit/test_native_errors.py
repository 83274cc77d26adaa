"""The one translation of an ``etcd-v3`` node's errors into torch's (``handler.torch_error``)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from etcd_rdzv.native.handler import torch_error
from etcd_rdzv.native.records import (
    ClosedWhileKeptOut,
    NodeShutDown,
    ProtocolStateError,
    RoundTimeout,
    RunClosed,
)
from etcd_store.errors import EtcdConnectionError, EtcdError, EtcdTimeoutError


@pytest.mark.parametrize(("error", "kwargs", "expected"), [
    (RunClosed("closed"), {}, RendezvousClosedError),
    (NodeShutDown("stopped"), {}, RendezvousClosedError),
    (ClosedWhileKeptOut("kept out"), {}, RendezvousGracefulExitError),
    (RoundTimeout("join_timeout"), {}, RendezvousTimeoutError),
    (ProtocolStateError("bad record"), {}, RendezvousStateError),
    (EtcdConnectionError("unreachable"), {}, RendezvousConnectionError),
    (EtcdTimeoutError("slow"), {}, RendezvousConnectionError),  # etcd out of reach, not join_timeout
    (EtcdTimeoutError("slow"), {"closing": True}, RendezvousTimeoutError),  # close_timeout passed
    (EtcdError("refused"), {"closing": True}, RendezvousConnectionError),
    (EtcdError("cancelled"), {"shut_down": True}, RendezvousClosedError),  # the stop ended the wait
])
def test_each_node_error_becomes_one_torch_error(error: Exception, kwargs: dict[str, bool],
                                                 expected: type[RendezvousError]) -> None:
    translated = torch_error(error, "run", **kwargs)  # type: ignore[arg-type]
    assert type(translated) is expected
    assert str(error) in str(translated) or kwargs.get("shut_down")  # the message names the cause


def test_the_node_errors_are_not_torchs() -> None:
    for error in (RunClosed, ClosedWhileKeptOut, NodeShutDown, RoundTimeout, ProtocolStateError):
        assert not issubclass(error, RendezvousError)
