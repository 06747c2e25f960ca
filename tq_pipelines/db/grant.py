"""The queue's two database roles (``tq grant``): an admin that owns the schema and migrates, and
a worker that may read the queue and call its functions, nothing else.

Roles are cluster-wide, so no migration creates them; what each may do in the database is
migration 0010's (``tq_grant_admin``, ``tq_grant_worker``, ``tq_secure_functions``). Run as a
superuser, or as a role with CREATEROLE that owns the queue's objects. Idempotent: run it again
after every migration that adds a function, so that the worker may call it.
"""

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
    verifier. ``setting`` names where ``conninfo`` came from, for the error when it cannot connect.
    """
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
