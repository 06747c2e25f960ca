"""Database plumbing: where the server is, named queries, migrations, the embedded server."""

import os
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tq_pipelines.db import embedded
from tq_pipelines.db.queries import query
from tq_pipelines.queue.redact import redact_conninfo, redact_text

# Seconds a first connection may take before the database counts as unreachable.
CONNECT_TIMEOUT_SECONDS = 5


class DatabaseUnreachable(RuntimeError):
    """The database cannot be reached or refuses the connection; the message holds libpq's
    reason and the URL with its password masked."""


def check_connection(
    conninfo: str, *, timeout: int = CONNECT_TIMEOUT_SECONDS, setting: str = "TQ_DATABASE_URL"
) -> None:
    """Connect once, failing within ``timeout`` seconds with libpq's reason: a pool would
    instead retry in the background until its own timeout, the reason buried in warnings."""
    try:
        psycopg.connect(conninfo, connect_timeout=timeout, autocommit=True).close()
    except (psycopg.Error, ValueError) as exc:
        reason = redact_text(" ".join(str(exc).split()), [conninfo])
        raise DatabaseUnreachable(
            f"cannot connect to the database {setting} = {redact_conninfo(conninfo)}: {reason}"
        ) from None


def database_url() -> str:
    """``TQ_DATABASE_URL`` when set, else the embedded server (started if it is not running)."""
    return os.environ.get("TQ_DATABASE_URL") or embedded.start()


def ensure_database(server_url: str, name: str) -> str:
    """The URL of database ``name`` on the server of ``server_url``, created if missing."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        if conn.execute(query("database_exists"), {"name": name}).fetchone() is None:
            conn.execute(query("create_database").format(name=sql.Identifier(name)))
    return make_conninfo(server_url, dbname=name)


def dagster_database_url(queue_url: str) -> str:
    """Where Dagster keeps runs, events and schedules: ``TQ_DAGSTER_DATABASE_URL``, else a
    database named ``<queue database>_dagster`` on the queue's server (created if missing)."""
    explicit = os.environ.get("TQ_DAGSTER_DATABASE_URL")
    if explicit:
        return explicit
    dbname = conninfo_to_dict(queue_url).get("dbname") or "postgres"
    try:
        return ensure_database(queue_url, f"{dbname}_dagster")
    except psycopg.Error as exc:
        raise RuntimeError(
            f"cannot create the Dagster database {dbname}_dagster: {redact_text(str(exc), [queue_url])}; "
            "create it, or point TQ_DAGSTER_DATABASE_URL at a database Dagster may use"
        ) from None


def sqlalchemy_url(conninfo: str) -> str:
    """A libpq URL or key=value string as the SQLAlchemy URL that dagster-postgres wants.

    psycopg2 explicitly: SQLAlchemy 2.1 would hand a bare postgresql:// to psycopg 3, which
    dagster-postgres does not support (dagster-io/dagster#33958).
    """
    params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}
    user = quote(params.pop("user", ""), safe="")
    password = quote(params.pop("password", ""), safe="")
    dbname = quote(params.pop("dbname", "postgres"), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    tail = f"?{urlencode(params)}" if params else ""
    return f"postgresql+psycopg2://{auth}/{dbname}{tail}"
