"""Named SQL statements: the ``-- name: x`` blocks of ``sql/*.sql`` (migrations and the schema
snapshot aside), called by name with bound parameters only."""

import re
from functools import cache
from pathlib import Path

from psycopg import sql

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    """The folder holding ``migrations/``, ``queries.sql`` and ``schema.sql``."""
    packaged = Path(__file__).resolve().parent.parent / "sql"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "sql"


def parse(text: str) -> dict[str, sql.SQL]:
    """Split a queries file into its named statements."""
    parts = _NAME.split(text)
    queries: dict[str, sql.SQL] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = sql.SQL(body.strip())  # type: ignore[arg-type]  # file text, not input
    return queries


@cache
def queries() -> dict[str, sql.SQL]:
    found: dict[str, sql.SQL] = {}
    for path in sorted(sql_dir().glob("*.sql")):
        if path.name == "schema.sql":
            continue
        for name, statement in parse(path.read_text()).items():
            if name in found:
                raise ValueError(f"query {name!r} is defined twice ({path.name})")
            found[name] = statement
    return found


def query(name: str) -> sql.SQL:
    """The statement called ``name``; a KeyError names the unknown query."""
    return queries()[name]
