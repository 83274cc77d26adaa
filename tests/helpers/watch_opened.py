"""A client interceptor that tells a test when a watch stream was opened (the moment a wait is armed)."""

from __future__ import annotations

import threading

from etcd_store.client.testing import RpcCounter


class WatchOpened(RpcCounter):
    """Counts RPCs as :class:`RpcCounter` does and sets ``opened`` when a watch stream is opened through
    the client it is installed on."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()

    def stream_opened(self, method: str) -> None:
        super().stream_opened(method)
        if method == "Watch/Watch":
            self.opened.set()
