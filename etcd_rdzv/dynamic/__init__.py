"""``etcd-v2`` and ``etcd``: torch's ``DynamicRendezvousHandler`` over a backend that keeps its state in etcd v3.

Modules: :mod:`.backend` (``EtcdRendezvousBackend``: torch's ``RendezvousBackend``
contract, one key fenced by its mod revision), :mod:`.handler`
(``EtcdRendezvousHandler``: torch's handler with a fresh agent store per round).
Importing this package is light; the modules import torch and gRPC.
"""
