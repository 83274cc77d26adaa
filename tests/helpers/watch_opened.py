"""A client interceptor that tells a test when a watch stream was opened (the moment a wait is armed)."""

from __future__ import annotations

import threading
from typing import Any

from etcd_store.client.testing import RpcCounter


class WatchOpened(RpcCounter):
    """Counts RPCs as :class:`RpcCounter` does and sets ``opened`` when a watch stream is opened through
    the client it is installed on."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()

    def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        if "Watch" in str(details.method):
            self.opened.set()
        return super().intercept_stream_stream(continuation, details, it)
