"""``etcd-rdzv grant`` and ``revoke``: one etcd user and one role per run, limited to that run's keys.

Everything a run writes, with either backend, lies in two ranges (:func:`run_permissions`):

* the key ``<prefix>/<run_id>``: the ``etcd-v2``/``etcd`` state (torch's pickled state);
* the prefix ``<prefix>/<run_id>/``: the ``etcd-v2`` run's ``EtcdStore`` (``store/``, its
  internal keys ``store\\0...`` included: a store writes nothing outside its prefix), its
  agents' lease anchors (``lease/<lease hex>``) and nodes' presence keys (``alive/<node>``),
  and every ``etcd-v3`` key (``v3/ctl/``, ``v3/join/``, ``v3/rounds/<T>/store...``,
  ``v3/run``, ``v3/seq/``).

Granting or keeping a lease alive needs no key permission; revoking one needs write, and
reading its time to live read permission on the keys attached to it: all in the two
ranges. A run id is also the prefix of longer ones (``job1`` of ``job10``), so the grants
are the key and the prefix ending in ``/``, never the bare prefix ``<prefix>/<run_id>``.

:func:`grant` is idempotent: a role with exactly these permissions, an existing user (its
password changed only when one is given) and a role already held are left as they are. It
refuses a role holding anything else, and the name ``root``. It does not take over a user
made for something else: a user holding etcd's ``root`` role is refused, and one holding
any role but the run's (another run's above all, named via :func:`_describe_role`) is
refused when the call would change it (a new password, the run's role added) unless
``shared`` (``--allow-shared-user``): else the new password would lock out the other run's
agents, or the run's password would read the other run's keys.

:func:`revoke` takes the role from the user, deletes it, and deletes the user when it holds
no other role (a shared user keeps the other run's role and password, so no flag is
needed). Both read the users and roles first (no error text is interpreted) and raise
:class:`CliError` before changing anything when the request cannot be carried out. Neither
is atomic against another administrator changing the same user or role meanwhile.
"""

from __future__ import annotations

import logging

from etcd_store.client import EtcdClient, prefix_range_end
from etcd_store.client.auth_admin import (
    Permission,
    role_add,
    role_delete,
    role_grant,
    role_names,
    role_permissions,
    user_add,
    user_change_password,
    user_delete,
    user_grant_role,
    user_names,
    user_revoke_role,
    user_roles,
)

from .connect import CliError, Deadline
from .render import esc
from .runs import state_key

#: etcd's role that may do everything; a user holding it is never used for a run.
ROOT_ROLE = "root"
#: The prefix of the user and role names ``grant`` makes (:func:`default_name`).
NAME_PREFIX = "rdzv-"

log = logging.getLogger(__name__)

__all__ = ["default_name", "grant", "revoke", "run_permissions"]


def run_permissions(prefix: str, run_id: str) -> list[Permission]:
    """The READWRITE permissions of one run: the key ``<prefix>/<run_id>`` and the prefix
    ``<prefix>/<run_id>/`` (see the module docstring). Raises CliError for an invalid run id."""
    if not run_id or "/" in run_id or "\0" in run_id:
        raise CliError(f"invalid run id {run_id!r}")
    key = state_key(prefix, run_id).encode()
    sub = key + b"/"
    return [Permission(key, b""), Permission(sub, prefix_range_end(sub))]


def default_name(run_id: str) -> str:
    """The user and role name ``grant`` uses for a run unless told otherwise: ``rdzv-<run_id>``."""
    return f"{NAME_PREFIX}{run_id}"


def _check_names(user: str, role: str) -> None:
    for what, name in (("user", user), ("role", role)):
        if not name:
            raise CliError(f"the {what} name must not be empty")
        if name == "root":
            raise CliError(f"refusing to use the {what} 'root' for a run")


def _foreign(perms: list[Permission], wanted: list[Permission]) -> list[Permission]:
    return [p for p in perms if p not in wanted]


def _run_key(perms: list[Permission]) -> bytes | None:
    """The state key ``K`` when ``perms`` are one run's two ranges (the key ``K``, the prefix ``K/``:
    what :func:`grant` gives a role, of any kind), else None."""
    if len(perms) != 2:
        return None
    key, sub = sorted(perms, key=lambda p: bool(p.range_end))
    if key.range_end or sub.key != key.key + b"/" or sub.range_end != prefix_range_end(sub.key):
        return None
    return key.key


def _describe_role(client: EtcdClient, prefix: str, run_id: str, role: str, deadline: Deadline) -> str:
    """``'rdzv-jobA' (run 'jobA')`` for a role of another run (its permissions are a run's two
    ranges, or, lacking those, its name is :func:`default_name` of another run id), else ``'name'``."""
    key = _run_key(role_permissions(client, role, timeout=deadline.left()))
    base = state_key(prefix, "").encode()  # "<prefix>/"
    if key is not None and key.startswith(base) and b"/" not in key[len(base):]:
        return f"{role!r} (run {key[len(base):].decode(errors='backslashreplace')!r})"
    if key is not None:
        return f"{role!r} (the run of key {key!r})"
    other = role[len(NAME_PREFIX):] if role.startswith(NAME_PREFIX) else ""
    if other and other != run_id:
        return f"{role!r} (run {other!r}, by its name)"
    return repr(role)


def _shared_user_refused(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, user: str, role: str,
                         others: list[str], *, new_password: bool, new_role: bool) -> CliError:
    """Why :func:`grant` will not change ``user``, which holds the roles ``others`` of other runs."""
    described = ", ".join(_describe_role(client, prefix, run_id, r, deadline) for r in others)
    change, effects = [], []
    if new_password:
        change.append("change its password")
        effects.append("the new password locks out whoever logs in as it now")
    if new_role:
        change.append(f"give it role {role!r}")
        effects.append(f"whoever logs in as it reaches run {run_id!r}'s keys")
    return CliError(f"user {user!r} holds {'roles' if len(others) > 1 else 'role'} {described}: refusing to {' and '.join(change)} for run "
                    f"{run_id!r} ({'; '.join(effects)}); choose another --user, or pass "
                    "--allow-shared-user to share it")


def grant(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, *, user: str, role: str,
          password: str | None, shared: bool = False) -> list[str]:
    """Create (or complete) ``role`` with the run's permissions and give it to ``user``, created with
    ``password`` if missing (a given ``password`` also replaces an existing user's); one line per
    thing done or found. Raises CliError (nothing changed) as the module docstring says, and for a
    missing user without ``password``; EtcdError for etcd's refusals.
    """
    wanted = run_permissions(prefix, run_id)
    _check_names(user, role)
    roles = role_names(client, timeout=deadline.left())
    users = user_names(client, timeout=deadline.left())
    have = role_permissions(client, role, timeout=deadline.left()) if role in roles else []
    foreign = _foreign(have, wanted)
    if foreign:
        raise CliError(f"role {role!r} exists with permissions outside run {run_id!r} "
                       f"({', '.join(p.describe() for p in foreign)}); choose another --role")
    if user not in users and password is None:
        raise CliError(f"user {user!r} does not exist; give its password with --password-file FILE (- reads stdin)")
    held = user_roles(client, user, timeout=deadline.left()) if user in users else []
    if ROOT_ROLE in held:
        raise CliError(f"user {user!r} holds etcd's role 'root'; refusing to use it for run {run_id!r}; "
                       "choose another --user")
    others = [r for r in held if r != role]
    if others and not shared and (password is not None or role not in held):
        raise _shared_user_refused(client, prefix, run_id, deadline, user, role, others,
                                   new_password=password is not None, new_role=role not in held)
    done: list[str] = []
    if role not in roles:
        role_add(client, role, timeout=deadline.left())
        done.append(f"role {esc(role)}: created")
    for perm in wanted:
        if perm in have:
            done.append(f"role {esc(role)}: has {esc(perm.describe())}")
        else:
            role_grant(client, role, perm, timeout=deadline.left())
            done.append(f"role {esc(role)}: granted {esc(perm.describe())}")
    if user not in users:
        assert password is not None
        user_add(client, user, password, timeout=deadline.left())
        done.append(f"user {esc(user)}: created")
    elif password is not None:
        user_change_password(client, user, password, timeout=deadline.left())
        done.append(f"user {esc(user)}: password changed")
    if role in held:
        done.append(f"user {esc(user)}: has role {esc(role)}")
    else:
        user_grant_role(client, user, role, timeout=deadline.left())
        done.append(f"user {esc(user)}: granted role {esc(role)}")
    if others:
        done.append(f"user {esc(user)}: shared, it also holds {esc(', '.join(others))}")
    log.info("run %r of %r: user %r, role %r", run_id, prefix, user, role)
    return done


def revoke(client: EtcdClient, prefix: str, run_id: str, deadline: Deadline, *, user: str, role: str,
           keep_user: bool = False) -> list[str]:
    """Take ``role`` from ``user`` and delete it; delete ``user`` too unless ``keep_user`` or it
    holds other roles. Returns one line per thing done (``nothing to revoke`` when neither
    exists). Raises CliError (nothing changed) when ``role`` holds permissions outside the run."""
    wanted = run_permissions(prefix, run_id)
    _check_names(user, role)
    roles = role_names(client, timeout=deadline.left())
    users = user_names(client, timeout=deadline.left())
    if role in roles:
        foreign = _foreign(role_permissions(client, role, timeout=deadline.left()), wanted)
        if foreign:
            raise CliError(f"role {role!r} holds permissions outside run {run_id!r} "
                           f"({', '.join(p.describe() for p in foreign)}); not deleting it")
    done: list[str] = []
    held = user_roles(client, user, timeout=deadline.left()) if user in users else []
    if role in held:
        user_revoke_role(client, user, role, timeout=deadline.left())
        held.remove(role)
        done.append(f"user {esc(user)}: role {esc(role)} taken")
    if role in roles:
        role_delete(client, role, timeout=deadline.left())
        done.append(f"role {esc(role)}: deleted")
    if user in users and not keep_user:
        if held:
            done.append(f"user {esc(user)}: kept, it holds other roles ({esc(', '.join(held))})")
        else:
            user_delete(client, user, timeout=deadline.left())
            done.append(f"user {esc(user)}: deleted")
    return done or [f"nothing to revoke for run {esc(run_id)} (no user {esc(user)}, no role {esc(role)})"]
