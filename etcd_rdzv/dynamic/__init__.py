"""``etcd-v2`` and ``etcd``: torch's ``DynamicRendezvousHandler`` over a backend keeping its state in etcd v3.

:mod:`.backend` (``EtcdRendezvousBackend``: one key fenced by its mod revision), :mod:`.handler`
(``EtcdRendezvousHandler``: a fresh agent store per round), :mod:`.state` (sealed rounds),
:mod:`.presence` (liveness on etcd's clock). Importing this package is light; the modules import torch
and gRPC.
"""
