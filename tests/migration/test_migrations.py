"""The migrations against real PostgreSQL: they build what sql/schema.sql builds, run once, adopt
a database where the original 074 was applied statement by statement, and refuse what they must."""

import dataclasses
import difflib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.conftest import create_database, drop_database
from tests.helpers import assert_store_state_consistent
from tq_pipelines.db import schema as schema_module
from tq_pipelines.db.migrate import Migration, MigrationError, load_migrations, migrate
from tq_pipelines.db.queries import sql_dir
from tq_pipelines.db.schema import (
    PgDump,
    SchemaDumpError,
    catalog_snapshot,
    choose_pg_dump,
    clean_dump,
    dump_schema,
    split_statements,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMA_SQL = sql_dir() / "schema.sql"
# The original migration as it was released: not valid as one script, so applied in the field
# statement by statement.
# The original migration as deployments applied it (statement by statement).
SEED_074 = Path(__file__).with_name("fixtures") / "074_worker_task_queue.sql"
MIGRATION_FILES = [m.filename for m in load_migrations()]

Snapshot = dict[str, list[tuple]]


@pytest.fixture
def new_db(pg_server: str) -> Iterator[Callable[[], str]]:
    """Makes empty databases on the test server; all dropped at the end of the test."""
    names: list[str] = []

    def make() -> str:
        names.append(create_database(pg_server))
        return make_conninfo(pg_server, dbname=names[-1])

    yield make
    for name in names:
        drop_database(pg_server, name)


# --- comparing catalogs ----------------------------------------------------------------------------


def _render(section: str, rows: list[tuple]) -> list[str]:
    """One line per row; multi-line values (function bodies, views) below it, each line tagged
    with the row's object, so that a diff hunk says whose body changed."""
    lines = []
    for row in rows:
        fields = ["<below>" if isinstance(v, str) and "\n" in v else repr(v) for v in row]
        lines.append(f"{section}: " + " | ".join(fields))
        for value in row:
            if isinstance(value, str) and "\n" in value:
                lines += [f"    {row[0]}| {line}" for line in value.splitlines()]
    return lines


def catalog_diff(a: Snapshot, b: Snapshot, a_name: str, b_name: str) -> str:
    """A unified diff of two snapshots, section by section; empty when they are equal."""
    out = []
    for section in sorted(set(a) | set(b)):
        if a.get(section) != b.get(section):
            out += difflib.unified_diff(
                _render(section, a.get(section, [])),
                _render(section, b.get(section, [])),
                a_name,
                b_name,
                lineterm="",
            )
    return "\n".join(out)


def assert_same_catalog(a: Snapshot, b: Snapshot, a_name: str, b_name: str) -> None:
    diff = catalog_diff(a, b, a_name, b_name)
    assert not diff, f"the schemas differ:\n{diff}"


# Where a snapshot holds an expression as PostgreSQL prints it. A dump and restore can reprint
# such an expression differently with the same meaning: `status IN ('a', 'b')` over a VARCHAR
# column prints as `(ARRAY['a'::varchar, ...])::text[]`, which parses back as
# `ARRAY[('a'::varchar)::text, ...]`; a row comparison's nested ORs parse back flattened.
DEPARSED = {"constraints": 3, "indexes": 2, "triggers": 2, "views": 2}


def without_deparsed(snapshot: Snapshot) -> Snapshot:
    return {
        section: [
            tuple("<deparsed>" if i == DEPARSED.get(section) else v for i, v in enumerate(row))
            for row in rows
        ]
        for section, rows in snapshot.items()
    }


def table_rows(conninfo: str, snapshot: Snapshot) -> dict[str, list[str]]:
    """Every row of every table, as text, in order."""
    tables = [row[0] for row in snapshot["relations"] if row[1] == "r"]
    with psycopg.connect(conninfo) as conn:
        return {
            table: [
                r[0]
                for r in conn.execute(
                    sql.SQL("SELECT t::TEXT FROM {} AS t ORDER BY 1").format(sql.Identifier(table))
                )
            ]
            for table in tables
        }


def recorded_migrations(conninfo: str) -> list[tuple[str, str]]:
    with psycopg.connect(conninfo) as conn:
        return conn.execute("SELECT version, name FROM tq_migrations ORDER BY version").fetchall()


# --- migrations == schema.sql ----------------------------------------------------------------------


def test_migrations_build_what_schema_sql_builds(
    pg_server: str, new_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
):
    migrated, from_file, regenerated = new_db(), new_db(), new_db()
    assert migrate(migrated) == MIGRATION_FILES

    # As the file promises: one simple query (no parameters), on an empty database.
    schema_sql = SCHEMA_SQL.read_text()
    with psycopg.connect(from_file, autocommit=True) as conn:
        conn.execute(schema_sql)
        # The script leaves the session usable: search_path intact, the queue callable.
        assert conn.execute("SELECT count(*) FROM claim_tasks('product_resync', 'w', 1)").fetchone() == (0,)

    # What the tool makes today from the migrations on this server (and so with this server's
    # pg_dump), run the same way. Its scratch database is gone afterwards.
    scratch_id = uuid.uuid4()
    monkeypatch.setattr(schema_module, "uuid", SimpleNamespace(uuid4=lambda: scratch_id))
    fresh_text = dump_schema(pg_server)
    with psycopg.connect(pg_server) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (f"tq_schema_{scratch_id.hex[:12]}",)
        ).fetchone() == (0,)
    with psycopg.connect(regenerated, autocommit=True) as conn:
        conn.execute(fresh_text)

    file_catalog = catalog_snapshot(from_file)
    # sql/schema.sql is up to date: it builds exactly what a dump of the migrations builds.
    # (On failure, regenerate: python -m tq_pipelines.db.schema URL -o sql/schema.sql.)
    assert_same_catalog(catalog_snapshot(regenerated), file_catalog, "dump of the migrations", "schema.sql")
    # And the migrated database is that schema: the same objects with the same columns, types,
    # defaults, sequences, functions and comments; expressions may be printed differently (see
    # DEPARSED).
    migrated_catalog = catalog_snapshot(migrated)
    assert_same_catalog(
        without_deparsed(migrated_catalog), without_deparsed(file_catalog), "migrations", "schema.sql"
    )
    assert migrated_catalog["functions"] and migrated_catalog["views"] and migrated_catalog["triggers"]
    # The seed rows too (the five roles).
    seeded = table_rows(migrated, migrated_catalog)
    assert len(seeded["worker_task_roles"]) == 5
    assert table_rows(from_file, file_catalog) == seeded


def test_schema_sql_has_no_psql_commands_or_session_settings():
    statements = split_statements(SCHEMA_SQL.read_text())
    assert not [line for line in SCHEMA_SQL.read_text().splitlines() if line.startswith("\\")]
    settings = [s for s in statements if s.upper().startswith(("SET ", "SELECT PG_CATALOG.SET_CONFIG"))]
    assert settings == ["SET check_function_bodies = false;"]
    assert "tq_migrations" not in SCHEMA_SQL.read_text()


# --- running the migrations ------------------------------------------------------------------------


def test_migrating_twice_changes_nothing(empty_db_url: str):
    assert migrate(empty_db_url) == MIGRATION_FILES
    first = catalog_snapshot(empty_db_url)
    assert migrate(empty_db_url) == []
    assert_same_catalog(first, catalog_snapshot(empty_db_url), "after one run", "after two")
    assert [v for v, _ in recorded_migrations(empty_db_url)] == [m.version for m in load_migrations()]


def test_concurrent_migrators_apply_each_migration_once(empty_db_url: str):
    runners = 4
    start = threading.Barrier(runners)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start.wait(timeout=10)
            results.append(migrate(empty_db_url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert sorted(results) == [[]] * (runners - 1) + [MIGRATION_FILES]
    assert recorded_migrations(empty_db_url) == [(m.version, m.name) for m in load_migrations()]


def test_an_applied_migration_that_changed_is_refused(db_url: str):
    before = recorded_migrations(db_url)
    edited = [
        dataclasses.replace(m, text=m.text + "\n-- an afterthought\n") if m.version == "0002" else m
        for m in load_migrations()
    ]
    later = Migration("9001", "should_not_run", "CREATE TABLE should_not_exist (id INTEGER);")
    with pytest.raises(MigrationError, match=r"0002_worker_task_queue\.sql changed after it was applied"):
        migrate(db_url, [*edited, later])
    assert recorded_migrations(db_url) == before
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT to_regclass('should_not_exist')").fetchone() == (None,)


def test_an_applied_migration_missing_from_the_files_is_refused(db_url: str):
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tq_migrations (version, name, checksum) VALUES ('0099', 'from_a_newer_release', 'x')"
        )
    with pytest.raises(MigrationError, match=r"0099_from_a_newer_release\.sql"):
        migrate(db_url)


def test_the_cli_migrates_then_says_up_to_date(empty_db_url: str):
    env = {**os.environ, "TQ_DATABASE_URL": empty_db_url}

    def tq_migrate() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tq_pipelines", "migrate"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = tq_migrate()
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "applied: " + ", ".join(MIGRATION_FILES)
    again = tq_migrate()
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "up to date"
    assert len(recorded_migrations(empty_db_url)) == len(MIGRATION_FILES)


# --- adopting a database where the original 074 was applied ---------------------------------------

# The deployment's own stores table: what the queue reads, nullable where it never said otherwise,
# and a column of its own.
DEPLOYMENT_DISPENSARIES = """
CREATE TABLE dispensaries (
  id SERIAL PRIMARY KEY,
  name TEXT,
  menu_type VARCHAR(50),
  platform_dispensary_id TEXT,
  crawl_enabled BOOLEAN,
  city TEXT
)
"""

# Rows as the original allowed them: every status, NULLs where it had no NOT NULL.
LEGACY_ROWS = """
INSERT INTO dispensaries (id, name, menu_type, platform_dispensary_id, crawl_enabled, city) VALUES
  (1, 'Green Leaf', 'dutchie', 'gl-1', true, 'Denver'),
  (2, 'Busy Bee', 'dutchie', 'bb-2', true, 'Boulder'),
  (3, 'Runner', 'jane', 'rn-3', true, 'Aurora'),
  (4, 'Old Timer', 'dutchie', NULL, NULL, NULL);
SELECT setval('dispensaries_id_seq', 4);

INSERT INTO worker_tasks (id, role, dispensary_id, status, priority) VALUES
  (1, 'product_resync', 1, 'pending', NULL),
  (3, 'product_resync', 2, 'pending', 5),
  (4, 'product_discovery', 2, 'pending', 1),
  (9, 'menu_audit', NULL, 'pending', 0);
INSERT INTO worker_tasks (id, role, dispensary_id, status, worker_id, claimed_at, started_at,
                          last_heartbeat_at)
VALUES
  (2, 'product_resync', 2, 'claimed', 'w-dead', now(), NULL, NULL),
  (5, 'product_resync', 3, 'running', 'w-live', now(), now(), now()),
  (8, 'product_resync', 4, 'stale', 'w-gone', now() - INTERVAL '2 hours', NULL, NULL);
INSERT INTO worker_tasks (id, role, dispensary_id, status, started_at, completed_at, result, error_message,
                          retry_count)
VALUES
  (6, 'product_resync', 1, 'completed', now() - INTERVAL '2 minutes', now() - INTERVAL '1 minute',
   '{"products": 12}', NULL, 0),
  (7, 'entry_point_discovery', 3, 'failed', NULL, now() - INTERVAL '5 minutes', NULL, 'timeout', 3);
INSERT INTO worker_tasks (id, role, status, retry_count, max_retries, created_at, updated_at) VALUES
  (10, 'analytics_refresh', 'pending', NULL, NULL, NULL, NULL);
SELECT setval('worker_tasks_id_seq', 10);

INSERT INTO worker_registry (worker_id, role, status) VALUES
  ('w-dead', 'product_resync', 'active'),
  ('w-live', 'product_resync', 'active'),
  ('w-legacy', 'image_sync', 'offline');

INSERT INTO task_completion_log (role, tasks_completed, avg_duration_sec) VALUES ('product_resync', 10, 12.5);
INSERT INTO task_completion_log (role, date, hour, tasks_failed) VALUES ('menu_audit', '2024-03-01', 23, 1);
"""
# The tasks above by id; stores are 1 (idle), 2 (claimed), 3 (running), 4 (its task was 'stale').
NULL_PRIORITY, CLAIMED, BUSY_PENDING, BUSY_DISCOVERY, RUNNING = 1, 2, 3, 4, 5
STALE, UNKNOWN_ROLE, ALL_NULLS = 8, 9, 10
ADOPTED_TABLES = ("dispensaries", "worker_tasks", "worker_registry", "task_completion_log")


def _apply_074(conn: psycopg.Connection) -> list[tuple[str, str | None]]:
    """074 statement by statement, as in the field; returns (first line, SQLSTATE) of failures."""
    statements = split_statements(SEED_074.read_text())
    assert len(statements) == 28
    failed = []
    for statement in statements:
        try:
            conn.execute(statement)
        except psycopg.Error as exc:
            failed.append((statement.splitlines()[0][:50], exc.sqlstate))
    return failed


def _counts(conn: psycopg.Connection, *, tasks: str = "worker_tasks") -> dict[str, int]:
    """Rows per adopted table; ``tasks`` is where worker_tasks' rows are read (after 0022 the
    finished ones are in worker_task_history, and v_tasks reads both)."""
    counts = {}
    for table in ADOPTED_TABLES:
        read = tasks if table == "worker_tasks" else table
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(read))).fetchone()
        counts[table] = row[0] if row else -1
    return counts


def _claim(conn: psycopg.Connection, role: str, worker: str) -> dict[int, int | None]:
    """claim_tasks(role, worker, 100): claimed task id -> its store."""
    return dict(
        conn.execute(
            "SELECT (c.task).id, (c.task).dispensary_id FROM claim_tasks(%s, %s, 100) c", (role, worker)
        ).fetchall()
    )


def _about_dispensaries(section: str, row: tuple) -> bool:
    if section in ("relations", "columns", "constraints", "indexes", "triggers"):
        return row[0] == "dispensaries"
    if section == "sequences":
        return row[8] == "dispensaries"
    if section == "comments":
        return "public.dispensaries" in row[1]
    return False


def test_adopts_a_database_where_074_was_applied_statement_by_statement(empty_db_url: str, db_url: str):
    url = empty_db_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(DEPLOYMENT_DISPENSARIES)
        # The function that does not compile, then the comment on it: nothing else failed.
        assert _apply_074(conn) == [
            ("CREATE OR REPLACE FUNCTION generate_resync_tasks(", "42601"),
            ("COMMENT ON FUNCTION generate_resync_tasks IS 'Gene", "42883"),
        ]
        conn.execute(LEGACY_ROWS)
        counts = _counts(conn)

    assert migrate(url) == MIGRATION_FILES

    with psycopg.connect(url, autocommit=True) as conn:
        assert _counts(conn, tasks="v_tasks") == counts, "rows were lost"
        # The finished tasks moved to the history (0022), the others stayed in the queue.
        assert conn.execute("SELECT id, status FROM worker_task_history ORDER BY id").fetchall() == [
            (6, "completed"),
            (7, "failed"),
        ]
        assert conn.execute(
            "SELECT status, worker_id, claimed_at FROM worker_tasks WHERE id = %s", (STALE,)
        ).fetchone() == ("pending", None, None)
        assert conn.execute(
            "SELECT id, priority, retry_count, max_retries, created_at IS NOT NULL FROM worker_tasks"
            " WHERE id = ANY(%s) ORDER BY id",
            ([NULL_PRIORITY, ALL_NULLS],),
        ).fetchall() == [(NULL_PRIORITY, 0, 0, 3, True), (ALL_NULLS, 0, 0, 3, True)]
        # The deployment keeps its own table.
        cities = conn.execute("SELECT city FROM dispensaries ORDER BY id").fetchall()
        assert cities == [("Denver",), ("Boulder",), ("Aurora",), (None,)]
        # The claimed and the running task make their stores busy; pending work has heads.
        stores = dict(conn.execute("SELECT dispensary_id, active_task_id FROM worker_task_stores").fetchall())
        assert stores == {1: None, 2: CLAIMED, 3: RUNNING, 4: None}
        heads = conn.execute(
            "SELECT role, dispensary_id, priority FROM worker_task_heads ORDER BY 1, 2"
        ).fetchall()
        assert heads == [
            ("product_discovery", 2, 1),
            ("product_resync", 1, 0),
            ("product_resync", 2, 5),
            ("product_resync", 4, 0),
        ]
        assert_store_state_consistent(conn)
        roles = {r for (r,) in conn.execute("SELECT role FROM worker_task_roles")}
        assert {"menu_audit", "image_sync"} <= roles

        # Claims work: one task per idle store, never one of a busy store; the new role too.
        assert _claim(conn, "product_resync", "w-new") == {NULL_PRIORITY: 1, STALE: 4}
        assert _claim(conn, "product_discovery", "w-new") == {}
        assert _claim(conn, "menu_audit", "w-new") == {UNKNOWN_ROLE: None}

        # The claim that never had a heartbeat is given back once it is old enough (the original
        # compared the NULL heartbeat with the cutoff and never gave it back). Its claim is what
        # counts: the updated_at trigger keeps updated_at at now() whatever an UPDATE sets.
        assert conn.execute("SELECT recover_stale_tasks(10)").fetchone() == (0,)
        conn.execute(
            "UPDATE worker_tasks SET claimed_at = now() - INTERVAL '1 hour' WHERE id = %s", (CLAIMED,)
        )
        assert conn.execute("SELECT recover_stale_tasks(10)").fetchone() == (1,)
        assert conn.execute(
            "SELECT status, worker_id, retry_count FROM worker_tasks WHERE id = %s", (CLAIMED,)
        ).fetchone() == ("pending", None, 1)
        assert_store_state_consistent(conn)
        assert _claim(conn, "product_resync", "w-new") == {BUSY_PENDING: 2}
        assert_store_state_consistent(conn)

    adopted = catalog_snapshot(url)
    assert migrate(url) == []
    assert_same_catalog(adopted, catalog_snapshot(url), "adopted", "migrated again")

    # Every function, view, index, trigger, ... of a fresh migration; only the deployment's own
    # dispensaries table differs.
    fresh = catalog_snapshot(db_url)
    theirs = {s: [r for r in rows if not _about_dispensaries(s, r)] for s, rows in adopted.items()}
    ours = {s: [r for r in rows if not _about_dispensaries(s, r)] for s, rows in fresh.items()}
    assert_same_catalog(ours, theirs, "fresh", "adopted")
    assert ("dispensaries", 6, "city", "text", False, None, None, "", "", None) in adopted["columns"]
    assert adopted["columns"] != fresh["columns"]


# --- the pieces of tq_pipelines.db.schema ----------------------------------------------------------


def test_split_statements_keeps_quoted_semicolons():
    text = """
-- a comment; with a semicolon
CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $inner$;$inner$ $body$ LANGUAGE sql;
/* block; /* nested; */ still comment; */
INSERT INTO t VALUES ('a;b', E'c\\';d', "x;y", $$;$$, $1);
CREATE FUNCTION g() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT CASE WHEN true THEN 2 END; END;
\\restrict abc
SELECT 1 AS begin; SELECT 2"""
    assert split_statements(text) == [
        "CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $inner$;$inner$ $body$ LANGUAGE sql;",
        """INSERT INTO t VALUES ('a;b', E'c\\';d', "x;y", $$;$$, $1);""",
        "CREATE FUNCTION g() RETURNS int LANGUAGE sql"
        " BEGIN ATOMIC SELECT 1; SELECT CASE WHEN true THEN 2 END; END;",
        "SELECT 1 AS begin;",
        "SELECT 2",
    ]


PG_DUMP_SAMPLE = """\
--
-- PostgreSQL database dump
--

\\restrict Kx1

-- Dumped from database version 18.4
-- Dumped by pg_dump version 18.4

SET statement_timeout = 0;
SET transaction_timeout = 0;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;

--
-- Name: f(); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.f() RETURNS integer
    LANGUAGE plpgsql
    AS $$
BEGIN
SET search_path = '';
RETURN 1;
END;
$$;


SET default_tablespace = '';

--
-- Name: t; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.t (
    id integer NOT NULL
);


--
-- Data for Name: t; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: r; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.r (role) VALUES
\t('a');


--
-- Name: t_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.t_id_seq', 1, false);


--
-- Name: u_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.u_id_seq', 7, true);


--
-- PostgreSQL database dump complete
--

\\unrestrict Kx1
"""


def test_clean_dump_keeps_objects_and_drops_session_noise():
    cleaned = clean_dump(PG_DUMP_SAMPLE, pg_dump_major=18, server_major=18)
    statements = split_statements(cleaned)
    assert statements[0] == "SET check_function_bodies = false;"
    assert [s.split("\n")[0] for s in statements[1:]] == [
        "CREATE FUNCTION public.f() RETURNS integer",
        "CREATE TABLE public.t (",
        "INSERT INTO public.r (role) VALUES",
        "SELECT pg_catalog.setval('public.u_id_seq', 7, true);",
    ]
    assert "SET search_path = '';\nRETURN 1;" in statements[1]  # inside a body: kept
    assert "\\" not in cleaned and "transaction_timeout" not in cleaned and "Dumped" not in cleaned
    assert "Data for Name: t;" not in cleaned and "t_id_seq" not in cleaned
    assert "-- Name: t; Type: TABLE; Schema: public; Owner: -" in cleaned

    with pytest.raises(SchemaDumpError, match="connect"):
        clean_dump(
            PG_DUMP_SAMPLE.replace("\\restrict Kx1", "\\connect other"), pg_dump_major=18, server_major=18
        )


def test_choose_pg_dump_takes_the_oldest_that_can_dump_the_server():
    found = [
        PgDump(Path("/a/pg_dump"), "18.4"),
        PgDump(Path("/b/pg_dump"), "15.20"),
        PgDump(Path("/c/pg_dump"), "16.14"),
    ]
    assert choose_pg_dump(15, found).path == Path("/b/pg_dump")
    assert choose_pg_dump(16, found).path == Path("/c/pg_dump")
    assert choose_pg_dump(18, found).path == Path("/a/pg_dump")
    with pytest.raises(SchemaDumpError, match=r"no pg_dump for PostgreSQL 19 or newer.*/a/pg_dump \(18\.4\)"):
        choose_pg_dump(19, found)
