"""The queue's two database roles (``tq grant``): an admin that owns the schema and migrates, and
a worker that may read the queue and call its functions, nothing else.

Roles are cluster-wide, so no migration creates them; what each may do in the database is
migrations 0010's and 0012's (``tq_grant_admin``, ``tq_grant_worker``, ``tq_secure_functions``,
``tq_worker_write_routes``). Run as a superuser, or as a role with CREATEROLE that owns the
queue's objects. Idempotent: run it again after every migration that adds a function, so that the
worker may call it. :func:`check` reports what differs from what it leaves, changing nothing.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from psycopg import errors, sql

from tq_pipelines.db import CONNECT_TIMEOUT_SECONDS, check_connection
from tq_pipelines.db.queries import query

# PostgreSQL truncates longer names: the role made would not be the role named.
MAX_ROLE_NAME_BYTES = 63

_ROLE_ATTRIBUTES = {
    "rolsuper": "SUPERUSER",
    "rolcreaterole": "CREATEROLE",
    "rolcreatedb": "CREATEDB",
    "rolreplication": "REPLICATION",
    "rolbypassrls": "BYPASSRLS",
}


# The worker role's own settings in the queue's database (ALTER ROLE ... IN DATABASE ... SET):
# a statement, a wait for a lock, a transaction left open never last longer than this. A drain
# run's longest statements (a prune batch, the analytics refresh) take seconds.
DEFAULT_WORKER_SETTINGS = {
    "statement_timeout": "5min",
    "lock_timeout": "30s",
    "idle_in_transaction_session_timeout": "1min",
}

# A duration as PostgreSQL's settings take it: a whole number and a unit (none: milliseconds).
_DURATION = re.compile(r"^[0-9]{1,9}\s*(us|ms|s|min|h|d)?$")


class GrantError(ValueError):
    """A role cannot be given what it asks for; the message names the argument and says what
    would be accepted."""


def grant(
    conninfo: str,
    *,
    worker_role: str,
    admin_role: str | None = None,
    worker_password: str | None = None,
    admin_password: str | None = None,
    settings: Mapping[str, str] | None = None,
    setting: str = "the admin database URL",
) -> list[str]:
    """Create or update the roles and grant them their rights in the database of ``conninfo``;
    returns what was done, one line each (never a password).

    ``worker_role`` gets LOGIN, CONNECT, USAGE on the schema, SELECT on what the workers, jobs,
    sensors and the asset read, and EXECUTE on the queue's functions, nothing else. With
    ``admin_role`` that role is created too, made the owner of the queue's relations and functions
    (which then run with its rights) and given CREATE in the schema; the schema's other objects,
    another application's, are left as they are. Without it the current owner stays admin.
    A password of None leaves the role's password as it is; the server receives only its SCRAM
    verifier. ``settings`` overrides :data:`DEFAULT_WORKER_SETTINGS`, set on the worker role in
    this database; any other setting the role has here or everywhere is removed. ``setting`` names
    where ``conninfo`` came from, for the error when it cannot connect.

    Refused (:class:`GrantError`, nothing changed): a worker that could write the queue by another
    route (a predefined role such as pg_write_all_data, another role's or PUBLIC's rights,
    CREATEROLE, ...), and, without ``admin_role``, queue functions owned by a superuser.
    """
    wanted = worker_settings(settings)
    _check_name("worker_role", worker_role)
    if admin_role is not None:
        _check_name("admin_role", admin_role)
        if admin_role == worker_role:
            raise GrantError(
                f"admin_role and worker_role are both {worker_role!r}: the worker must not own "
                "the queue; give two names"
            )
    for argument, password in (("worker_password", worker_password), ("admin_password", admin_password)):
        if password is not None and not password:
            raise GrantError(f"{argument} is empty: give a password, or None to keep the role's own")
    if admin_password is not None and admin_role is None:
        raise GrantError("admin_password is given without admin_role: name the admin role it is for")

    check_connection(conninfo, setting=setting)
    done: list[str] = []
    with psycopg.connect(conninfo, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn, conn.transaction():
        migrated = conn.execute(query("privileges_migrated")).fetchone()
        if not (migrated and migrated[0]):
            raise GrantError(
                "the database has no migration 0010_least_privilege: run tq migrate first, then tq grant"
            )
        if admin_role is not None:
            done += _ensure_role(conn, "admin_role", admin_role, admin_password, worker=False)
            conn.execute(query("grant_admin"), {"role": admin_role})
            done.append(
                f"{admin_role}: owns the queue's tables, views and functions, may create in the schema"
            )
        done += _ensure_role(conn, "worker_role", worker_role, worker_password, worker=True)
        conn.execute(query("secure_functions"))
        try:
            conn.execute(query("grant_worker"), {"role": worker_role})
        except errors.InvalidParameterValue as exc:
            hint = exc.diag.message_hint
            raise GrantError(
                f"worker_role {worker_role!r} refused: {exc.diag.message_primary}"
                + (f" ({hint})" if hint else "")
            ) from None
        counts = conn.execute(query("worker_privileges"), {"role": worker_role}).fetchone()
        assert counts is not None
        readable, writable, callable_ = counts
        done.append(
            f"{worker_role}: may read {readable} tables and views, call {callable_} functions, "
            f"write {writable} tables directly"
        )
        done += _apply_settings(conn, worker_role, wanted)
        for owner, superuser in conn.execute(query("function_owners")).fetchall():
            done.append(
                f"the queue's functions run as {owner}"
                + (
                    ", a superuser: give them an owner of their own with admin_role (tq grant --admin-role)"
                    if superuser
                    else ""
                )
            )
    return done


def check(
    conninfo: str,
    *,
    worker_role: str,
    settings: Mapping[str, str] | None = None,
    setting: str = "the admin database URL",
) -> list[str]:
    """What differs from what :func:`grant` leaves, one line each; empty when nothing does.
    Changes nothing.

    PostgreSQL lets every role change its own password and settings (``ALTER ROLE ... SET``): a
    worker can set ``statement_timeout = '1ms'`` or ``default_transaction_read_only`` for every
    pod that logs in as it. This reports such a setting, any route by which the worker could
    write the queue, rights it holds beyond its grant, and queue functions that run as a
    superuser. Run it on a schedule; ``grant`` again puts the settings back.
    """
    wanted = worker_settings(settings)
    _check_name("worker_role", worker_role)
    check_connection(conninfo, setting=setting)
    findings: list[str] = []
    with psycopg.connect(conninfo, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn, conn.transaction():
        migrated = conn.execute(query("routes_migrated")).fetchone()
        if not (migrated and migrated[0]):
            raise GrantError(
                "the database has no migration 0012_trust_boundary: run tq migrate first, then tq grant"
            )
        row = conn.execute(query("role_attributes"), {"role": worker_role}).fetchone()
        if row is None:
            return [f"{worker_role}: no such role (tq grant --worker-role {worker_role} makes it)"]
        held = [label for (_, label), value in zip(_ROLE_ATTRIBUTES.items(), row[:5], strict=True) if value]
        if held:
            findings.append(f"{worker_role}: has {', '.join(held)}")
        findings += [r[0] for r in conn.execute(query("worker_routes"), {"role": worker_role}).fetchall()]
        counts = conn.execute(query("worker_privileges"), {"role": worker_role}).fetchone()
        assert counts is not None
        if counts[1]:
            findings.append(f"{worker_role}: may write {counts[1]} of the queue's tables directly")
        database, _ = _database(conn)
        for change in _setting_changes(conn, worker_role, wanted):
            findings.append(f"{worker_role}: {change.describe(database)}")
        for owner, superuser in conn.execute(query("function_owners")).fetchall():
            if superuser:
                findings.append(f"the queue's functions run as {owner}, a superuser (tq grant --admin-role)")
    return findings


def worker_settings(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """:data:`DEFAULT_WORKER_SETTINGS` with ``overrides``; each a known timeout and a duration."""
    wanted = dict(DEFAULT_WORKER_SETTINGS)
    for name, value in (overrides or {}).items():
        if name not in DEFAULT_WORKER_SETTINGS:
            raise GrantError(
                f"settings: {name!r} is not one tq grant sets; it sets {', '.join(DEFAULT_WORKER_SETTINGS)}"
            )
        if not isinstance(value, str) or not _DURATION.match(value.strip()):
            raise GrantError(
                f"settings: {name} must be a duration such as 30s, 5min or 0 (none), got {value!r}"
            )
        wanted[name] = value.strip()
    return wanted


@dataclass(frozen=True, slots=True)
class _Change:
    """One setting of the worker role to set (``want``) or take away (``want`` None), in this
    database or (``everywhere``) for every database."""

    name: str
    have: str | None
    want: str | None
    everywhere: bool

    def describe(self, database: str) -> str:
        where = "for every database" if self.everywhere else f"in database {database}"
        have = "unset" if self.have is None else self.have
        return f"{self.name} is {have} {where} (tq grant sets {self.want or 'none'} there)"


def _database(conn: psycopg.Connection) -> tuple[str, str]:
    """The database's name and the role this session acts as."""
    row = conn.execute(query("current_database")).fetchone()
    assert row is not None
    return str(row[0]), str(row[1])


def _setting_changes(conn: psycopg.Connection, role: str, wanted: Mapping[str, str]) -> list[_Change]:
    """What it takes for the role's settings in this database to be ``wanted`` and nothing else:
    every setting it has for every database goes too (a worker may have set one for itself)."""
    here: dict[str, str] = {}
    everywhere: dict[str, str] = {}
    for in_database, name, value in conn.execute(query("worker_settings"), {"role": role}).fetchall():
        (here if in_database else everywhere)[name] = value
    changes = [
        _Change(name, here.get(name), value, False)
        for name, value in wanted.items()
        if here.get(name) != value
    ]
    changes += [_Change(n, v, None, False) for n, v in here.items() if n not in wanted]
    changes += [_Change(n, v, None, True) for n, v in everywhere.items()]
    return changes


def _apply_settings(conn: psycopg.Connection, role: str, wanted: Mapping[str, str]) -> list[str]:
    """Set the worker's timeouts in this database and take away any other setting it has."""
    database, user = _database(conn)
    names = {"role": sql.Identifier(role), "database": sql.Identifier(database)}
    done = []
    for change in _setting_changes(conn, role, wanted):
        name = sql.Identifier(*change.name.split("."))
        if change.want is not None:
            statement = query("set_worker_setting").format(name=name, value=sql.Literal(change.want), **names)
        elif change.everywhere:
            statement = query("reset_worker_setting").format(name=name, role=names["role"])
        else:
            statement = query("reset_worker_setting_in_database").format(name=name, **names)
        try:
            with conn.transaction():
                conn.execute(statement)
        except errors.InsufficientPrivilege:
            raise GrantError(
                f"{role}: {change.describe(database)}, and {user} may not change it: run tq grant "
                "as a superuser or a role with CREATEROLE"
            ) from None
        except (errors.InvalidParameterValue, errors.InvalidTextRepresentation) as exc:
            raise GrantError(
                f"settings: {change.name} = {change.want!r} refused: {exc.diag.message_primary}"
            ) from None
        if change.want is None:
            where = "for every database" if change.everywhere else f"in database {database}"
            done.append(f"{role}: {change.name} = {change.have} {where} removed")
    done.append(f"{role}: " + ", ".join(f"{n} = {v}" for n, v in wanted.items()) + f" in database {database}")
    return done


def _check_name(argument: str, name: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise GrantError(f"{argument} must be a role name, got {name!r}")
    if len(name.encode()) > MAX_ROLE_NAME_BYTES:
        raise GrantError(f"{argument} must be at most {MAX_ROLE_NAME_BYTES} bytes, got {len(name.encode())}")
    if name.lower().startswith("pg_") or name.lower() == "public":
        raise GrantError(f"{argument} {name!r} is reserved by PostgreSQL: choose a name of the queue's own")


def _ensure_role(
    conn: psycopg.Connection, argument: str, role: str, password: str | None, *, worker: bool
) -> list[str]:
    """CREATE ROLE if missing, else make sure it may log in; set the password if one is given.
    Refuses a role whose attributes give it more than its job (any of them for the worker,
    SUPERUSER for the admin), rather than take them from a role that may serve others."""
    name = sql.Identifier(role)
    row = conn.execute(query("role_attributes"), {"role": role}).fetchone()
    done = []
    if row is None:
        conn.execute(query("create_login_role").format(role=name))
        done.append(f"{role}: created, LOGIN")
    else:
        attributes = dict(zip(_ROLE_ATTRIBUTES, row[:5], strict=True))
        held = [label for column, label in _ROLE_ATTRIBUTES.items() if attributes[column]]
        refused = held if worker else [a for a in held if a == "SUPERUSER"]
        if refused:
            what = (
                "the worker role must hold none but LOGIN" if worker else "the queue's owner must not be one"
            )
            raise GrantError(
                f"{argument} {role!r} has {', '.join(refused)}: {what}; choose another role, or "
                f"ALTER ROLE {role} NO{refused[0]}"
            )
        if not row[5]:
            conn.execute(query("allow_login").format(role=name))
            done.append(f"{role}: LOGIN")
        else:
            done.append(f"{role}: exists")
    if password is not None:
        # Named, not the server's password_encryption, which may still be md5.
        verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
        conn.execute(query("set_role_password").format(role=name, password=sql.Literal(verifier.decode())))
        done.append(f"{role}: password set")
    return done
