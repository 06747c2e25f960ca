"""Real PostgreSQL for every test: ``TQ_TEST_DATABASE_URL``, else an embedded server.

The migrations run once into a template database; each test gets its own copy
(``CREATE DATABASE ... TEMPLATE``), so tests commit freely and run on many connections.
"""

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tq_pipelines.db import embedded
from tq_pipelines.db.migrate import migrate
from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import TaskQueue

# What a developer's shell may export for `make dev` must not reach the tests: the partitions
# are read from TQ_DATABASE_URL (or TQ_FIRST_DAY) when tq_pipelines.defs.partitions is imported (after
# this module), alert links from TQ_DAGSTER_URL. Tests that need them set them themselves.
for _name in ("TQ_DATABASE_URL", "TQ_FIRST_DAY", "TQ_DAGSTER_URL", "TQ_PLATFORMS_FILE", "TQ_HANDLERS"):
    os.environ.pop(_name, None)

# The webhook fixture lives with the Dagster test helpers.
pytest_plugins = ["tests.dagster_helpers"]


def _admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A URL to a server where tests may create databases."""
    url = os.environ.get("TQ_TEST_DATABASE_URL")
    if url:
        return url
    return embedded.start(tmp_path_factory.mktemp("pg") / "data", stop_at_exit=True)


def create_database(server: str, template: str | None = None) -> str:
    name = f"tq_test_{uuid.uuid4().hex[:12]}"
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with _admin(server) as conn:
        conn.execute(statement)
    return name


def drop_database(server: str, name: str) -> None:
    with _admin(server) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    name = create_database(pg_server)
    migrate(make_conninfo(pg_server, dbname=name))
    yield name
    drop_database(pg_server, name)


@pytest.fixture
def empty_db_url(pg_server: str) -> Iterator[str]:
    """A database with nothing in it."""
    name = create_database(pg_server)
    yield make_conninfo(pg_server, dbname=name)
    drop_database(pg_server, name)


@pytest.fixture
def db_url(pg_server: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own. After the test, every platform's slot
    counter must still equal its tasks in flight, whatever the test did."""
    name = create_database(pg_server, template=template_db)
    url = make_conninfo(pg_server, dbname=name)
    yield url
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            drift = conn.execute(query("platform_counter_drift")).fetchall()
        assert drift == [], f"platform counters differ from the tasks in flight: {drift}"
    finally:
        drop_database(pg_server, name)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test's database, for setup and audits."""
    with psycopg.connect(db_url, autocommit=True) as c:
        yield c


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    with TaskQueue.connect(db_url, max_size=8) as q:
        yield q
