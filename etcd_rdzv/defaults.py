"""The defaults of every rdzv-conf value and the names of the environment variables (no imports).

Shared by :mod:`etcd_rdzv.conf` (which re-exports them), :mod:`etcd_rdzv.conf_env` (the one connection
resolver), the ``etcd-rdzv`` command and the settings dataclasses, so none
imports another for a constant.
"""

from __future__ import annotations

DEFAULT_ENDPOINT = "localhost:2379"
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_KEY_PREFIX = "/torch/elastic/rendezvous"
#: The bound of the ``etcd-rdzv`` command's etcd work (``--timeout``), retries included.
DEFAULT_CLI_TIMEOUT = 10.0
LEGACY_KEY_PREFIX = "/torchelastic/p2p"
DEFAULT_STATE_TTL = 7200
MAX_STATE_TTL = 6_000_000_000  # the state's lease lasts 1.5 x state_ttl; etcd allows 9e9 s
USER_ENV = "ETCD_RDZV_USER"
PASSWORD_ENV = "ETCD_RDZV_PASSWORD"
PASSWORD_FILE_ENV = "ETCD_RDZV_PASSWORD_FILE"
# The rendezvous timeouts and keep-alive values: torch's ``DynamicRendezvousHandler`` defaults.
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
DEFAULT_CLOSE_TIMEOUT = 30.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
DEFAULT_KEEP_ALIVE_INTERVAL = 5
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_LEASE_TTL = DEFAULT_KEEP_ALIVE_INTERVAL * DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
#: etcd-v2: the TTL of a node's presence lease (etcd_rdzv/dynamic/presence.py); 0 turns presence off.
DEFAULT_PRESENCE_TTL = 3
