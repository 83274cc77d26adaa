"""etcd's user and role administration (the ``Auth`` service), as functions of an :class:`EtcdClient`.

What ``etcd-rdzv grant``/``revoke`` need. Each function is one RPC under the client's retry
policy (``timeout`` bounds it, retries included) and raises only :mod:`etcd_store.errors`:
:class:`~etcd_store.errors.EtcdPermissionDenied` for a caller without ``root`` once auth is on,
:class:`~etcd_store.errors.EtcdRequestError` for what etcd rejects (unknown, existing or empty
name). Existence is never told from an error's text: read :func:`user_names`/:func:`role_names`
first. A password travels in the request body only; no message names it.

etcd accepts these calls with auth disabled (set up before ``auth enable``). Adds and deletes are
not resent after an attempt of unknown outcome (:meth:`EtcdClient.txn`'s rule); idempotent grants
and revokes are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from etcd3.etcdrpc import auth_pb2, rpc_pb2

from .kv import show_key

if TYPE_CHECKING:
    from .calls import EtcdClient

log = logging.getLogger(__name__)

__all__ = [
    "Permission",
    "role_add",
    "role_delete",
    "role_grant",
    "role_names",
    "role_permissions",
    "role_revoke",
    "user_add",
    "user_change_password",
    "user_delete",
    "user_grant_role",
    "user_names",
    "user_revoke_role",
    "user_roles",
]

_TYPES = {"read": auth_pb2.Permission.READ, "write": auth_pb2.Permission.WRITE,
          "readwrite": auth_pb2.Permission.READWRITE}
_NAMES = {v: k for k, v in _TYPES.items()}


@dataclass(frozen=True, order=True)
class Permission:
    """One key permission of a role: ``key`` alone (``range_end`` empty) or ``[key, range_end)``.

    ``kind`` is ``"read"``, ``"write"`` or ``"readwrite"``.
    """

    key: bytes
    range_end: bytes
    kind: str = "readwrite"

    def describe(self) -> str:
        """``READWRITE b'/p/run'`` or ``READWRITE [b'/p/run/', b'/p/run0')``."""
        where = show_key(self.key) if not self.range_end else f"[{show_key(self.key)}, {show_key(self.range_end)})"
        return f"{self.kind.upper()} {where}"


def _auth(client: EtcdClient, method: str, request: Any, what: str, timeout: float | None,
          idempotent: bool = True) -> Any:
    return client.transport.call("Auth", method, request, timeout=timeout, what=what, idempotent=idempotent)


# --------------------------------------------------------------------------- reading


def user_names(client: EtcdClient, *, timeout: float | None = None) -> list[str]:
    """Every etcd user's name. One UserList RPC."""
    resp = _auth(client, "UserList", rpc_pb2.AuthUserListRequest(), "list users", timeout)
    return list(resp.users)


def role_names(client: EtcdClient, *, timeout: float | None = None) -> list[str]:
    """Every etcd role's name. One RoleList RPC."""
    resp = _auth(client, "RoleList", rpc_pb2.AuthRoleListRequest(), "list roles", timeout)
    return list(resp.roles)


def user_roles(client: EtcdClient, name: str, *, timeout: float | None = None) -> list[str]:
    """The roles of user ``name`` (an unknown user: :class:`EtcdRequestError`). One UserGet RPC."""
    resp = _auth(client, "UserGet", rpc_pb2.AuthUserGetRequest(name=name), f"read user {name!r}", timeout)
    return list(resp.roles)


def role_permissions(client: EtcdClient, name: str, *, timeout: float | None = None) -> list[Permission]:
    """The key permissions of role ``name`` (an unknown role: :class:`EtcdRequestError`). One RoleGet RPC."""
    resp = _auth(client, "RoleGet", rpc_pb2.AuthRoleGetRequest(role=name), f"read role {name!r}", timeout)
    return [Permission(bytes(p.key), bytes(p.range_end), _NAMES.get(p.permType, str(p.permType)))
            for p in resp.perm]


# --------------------------------------------------------------------------- writing


def user_add(client: EtcdClient, name: str, password: str, *, timeout: float | None = None) -> None:
    """Create user ``name`` with ``password``. One UserAdd RPC; an existing name: :class:`EtcdRequestError`."""
    req = rpc_pb2.AuthUserAddRequest(name=name, password=password)
    _auth(client, "UserAdd", req, f"add user {name!r}", timeout, idempotent=False)


def user_change_password(client: EtcdClient, name: str, password: str, *, timeout: float | None = None) -> None:
    """Set user ``name``'s password. One UserChangePassword RPC."""
    req = rpc_pb2.AuthUserChangePasswordRequest(name=name, password=password)
    _auth(client, "UserChangePassword", req, f"change the password of user {name!r}", timeout)


def user_delete(client: EtcdClient, name: str, *, timeout: float | None = None) -> None:
    """Delete user ``name``. One UserDelete RPC."""
    req = rpc_pb2.AuthUserDeleteRequest(name=name)
    _auth(client, "UserDelete", req, f"delete user {name!r}", timeout, idempotent=False)


def role_add(client: EtcdClient, name: str, *, timeout: float | None = None) -> None:
    """Create role ``name`` (no permissions). One RoleAdd RPC; an existing name: :class:`EtcdRequestError`."""
    _auth(client, "RoleAdd", rpc_pb2.AuthRoleAddRequest(name=name), f"add role {name!r}", timeout,
          idempotent=False)


def role_delete(client: EtcdClient, name: str, *, timeout: float | None = None) -> None:
    """Delete role ``name`` (etcd also takes it from every user holding it). One RoleDelete RPC."""
    _auth(client, "RoleDelete", rpc_pb2.AuthRoleDeleteRequest(role=name), f"delete role {name!r}", timeout,
          idempotent=False)


def role_grant(client: EtcdClient, name: str, perm: Permission, *, timeout: float | None = None) -> None:
    """Add ``perm`` to role ``name`` (granting it again changes nothing). One RoleGrantPermission RPC."""
    if perm.kind not in _TYPES:
        raise ValueError(f"unknown permission kind {perm.kind!r}; choose from {', '.join(_TYPES)}")
    req = rpc_pb2.AuthRoleGrantPermissionRequest(
        name=name, perm=auth_pb2.Permission(permType=_TYPES[perm.kind], key=perm.key, range_end=perm.range_end))
    _auth(client, "RoleGrantPermission", req, f"grant role {name!r} {perm.describe()}", timeout)


def role_revoke(client: EtcdClient, name: str, perm: Permission, *, timeout: float | None = None) -> None:
    """Take ``perm``'s range from role ``name``. One RoleRevokePermission RPC."""
    req = rpc_pb2.AuthRoleRevokePermissionRequest(role=name, key=perm.key, range_end=perm.range_end)
    _auth(client, "RoleRevokePermission", req, f"revoke {perm.describe()} from role {name!r}", timeout)


def user_grant_role(client: EtcdClient, user: str, role: str, *, timeout: float | None = None) -> None:
    """Give ``user`` the role ``role``. One UserGrantRole RPC."""
    req = rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role)
    _auth(client, "UserGrantRole", req, f"grant user {user!r} the role {role!r}", timeout, idempotent=False)


def user_revoke_role(client: EtcdClient, user: str, role: str, *, timeout: float | None = None) -> None:
    """Take the role ``role`` from ``user``. One UserRevokeRole RPC."""
    req = rpc_pb2.AuthUserRevokeRoleRequest(name=user, role=role)
    _auth(client, "UserRevokeRole", req, f"take the role {role!r} from user {user!r}", timeout,
          idempotent=False)
