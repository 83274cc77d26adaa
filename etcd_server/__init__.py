"""Local etcd v3 servers and clusters for tests, demos and single-node jobs.

Standard library only at import time (no torch, grpc or etcd_store)::

    from etcd_server import EtcdServer

    with EtcdServer() as server:          # blocks until etcd serves v3
        print(server.get_endpoint())      # "127.0.0.1:PORT"
"""

from .binary import ENV_VAR, EtcdBinaryNotFoundError, etcd_version, find_etcd_binary
from .cluster import EtcdCluster
from .gateway import AuthConfig, EtcdGatewayError
from .member import EtcdStartError, EtcdStartTimeoutError, TLSConfig
from .server import EtcdServer

__all__ = [
    "ENV_VAR",
    "AuthConfig",
    "EtcdCluster",
    "EtcdBinaryNotFoundError",
    "EtcdGatewayError",
    "EtcdServer",
    "EtcdStartError",
    "EtcdStartTimeoutError",
    "TLSConfig",
    "etcd_version",
    "find_etcd_binary",
]
