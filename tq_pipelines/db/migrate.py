"""Apply ``sql/migrations/NNNN_name.sql`` in order, once each, recorded with checksums."""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from tq_pipelines.db.queries import query, sql_dir

# pg_advisory_lock key shared by every migrator of this schema.
LOCK_KEY = 0x7451_0074


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


def migrate(conninfo: str, migrations: list[Migration] | None = None) -> list[str]:
    """Apply what is missing, each migration in its own transaction; returns the files applied."""
    migrations = load_migrations() if migrations is None else migrations
    applied: list[str] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(query("migrations_lock"), {"key": LOCK_KEY})
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
