"""Apply ``sql/migrations/NNNN_name.sql`` in order, once each, recorded with checksums."""

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import errors, sql

from tq_pipelines.db.queries import query, sql_dir

# pg_advisory_lock key shared by every migrator of this schema.
LOCK_KEY = 0x7451_0074

# How long a migrator waits for that lock before it gives up and names who holds it: a second
# migrator waits out the first (a few seconds), not a session that took the lock and sits on it.
DEFAULT_LOCK_WAIT_SECONDS = 60.0


class MigrationError(RuntimeError):
    """The database and the migration files disagree; nothing was applied."""


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def filename(self) -> str:
        return f"{self.version}_{self.name}.sql"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migration files, in version order."""
    directory = directory or sql_dir() / "migrations"
    found = []
    for path in sorted(directory.glob("*.sql")):
        version, _, name = path.stem.partition("_")
        if not version.isdigit() or not name:
            raise MigrationError(f"{path.name}: expected NNNN_description.sql")
        found.append(Migration(version, name, path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version: {versions}")
    return found


def pending_migrations(conn: psycopg.Connection, migrations: list[Migration]) -> list[Migration]:
    """The migrations not yet applied; raises if an applied one was changed or is unknown."""
    applied = {v: (n, c) for v, n, c in conn.execute(query("migrations_applied")).fetchall()}
    known = {m.version: m for m in migrations}
    for version, (name, checksum) in applied.items():
        migration = known.get(version)
        if migration is None:
            raise MigrationError(
                f"the database has migration {version}_{name}.sql, which these files do not: "
                "it was made by a newer tq_pipelines; upgrade instead of running this one"
            )
        if migration.checksum != checksum:
            raise MigrationError(
                f"{migration.filename} changed after it was applied (checksum {checksum[:12]} in "
                f"the database, {migration.checksum[:12]} on disk); released migrations are never "
                "edited: restore the file and put the change in a new migration"
            )
    return [m for m in migrations if m.version not in applied]


def migrate(
    conninfo: str,
    migrations: list[Migration] | None = None,
    *,
    lock_wait_seconds: float = DEFAULT_LOCK_WAIT_SECONDS,
) -> list[str]:
    """Apply what is missing, each migration in its own transaction; returns the files applied.

    Waits at most ``lock_wait_seconds`` for another migrator's lock, then raises
    :class:`MigrationError` naming the session that holds it (pid, user, application, since when).
    """
    if not (math.isfinite(lock_wait_seconds) and lock_wait_seconds > 0):
        raise MigrationError(
            f"lock_wait_seconds must be a number of seconds above 0, got {lock_wait_seconds!r}"
        )
    migrations = load_migrations() if migrations is None else migrations
    applied: list[str] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        _lock(conn, lock_wait_seconds)
        try:
            conn.execute(query("migrations_table"))
            for migration in pending_migrations(conn, migrations):
                with conn.transaction():
                    # A file of many statements: sent without parameters, as one simple query.
                    conn.execute(sql.SQL(migration.text))  # type: ignore[arg-type]
                    conn.execute(
                        query("migrations_record"),
                        {
                            "version": migration.version,
                            "name": migration.name,
                            "checksum": migration.checksum,
                        },
                    )
                applied.append(migration.filename)
        finally:
            conn.execute(query("migrations_unlock"), {"key": LOCK_KEY})
    return applied


def _lock(conn: psycopg.Connection, wait_seconds: float) -> None:
    """Take the migrators' lock, waiting at most ``wait_seconds`` (the session's lock_timeout
    for that one statement, then back as it was)."""
    row = conn.execute(query("lock_timeout_get")).fetchone()
    assert row is not None
    previous = str(row[0])
    conn.execute(query("lock_timeout_set"), {"value": f"{max(1, round(wait_seconds * 1000))}ms"})
    try:
        conn.execute(query("migrations_lock"), {"key": LOCK_KEY})
    except errors.LockNotAvailable:
        holders = conn.execute(query("migrations_lock_holders"), {"key": LOCK_KEY}).fetchall()
        raise MigrationError(
            f"gave up after {wait_seconds:g} s waiting for the migration lock "
            f"(pg_advisory_lock({LOCK_KEY})), held by {_holders(holders)}: wait for it to finish, or end "
            "that session (SELECT pg_terminate_backend(<pid>)), then run tq migrate again"
        ) from None
    finally:
        conn.execute(query("lock_timeout_set"), {"value": previous})


def _holders(rows: list[tuple]) -> str:
    """Who holds the lock, as pg_locks and pg_stat_activity say (what a role may not see of
    another's session is 'unknown')."""
    if not rows:
        return "a session that has let it go since"
    described = []
    for pid, user, application, backend_start, state, state_change in rows:
        since = backend_start.isoformat(sep=" ", timespec="seconds") if backend_start else "unknown"
        text = (
            f"pid {pid} (user {user or 'unknown'}, application {application or ''!r}, connected since {since}"
        )
        if state:
            changed = state_change.isoformat(sep=" ", timespec="seconds") if state_change else "unknown"
            text += f", {state} since {changed}"
        described.append(text + ")")
    return "; ".join(described)
