"""A Dagster instance of a test's own for the acceptance tests: runs and events in a scratch
database on the test server, runs started at once as local processes (DefaultRunCoordinator: no
daemon needed to launch them)."""

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

from tq_pipelines.db import ensure_database, sqlalchemy_url


@contextmanager
def scratch_dagster_home(pg_server: str, tmp_path: Path) -> Iterator[Path]:
    """A DAGSTER_HOME whose storage is a new database, dropped at the end."""
    name = f"tq_dagster_{uuid.uuid4().hex[:12]}"
    url = ensure_database(pg_server, name)
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "storage:\n"
        "  postgres:\n"
        f"    postgres_url: '{sqlalchemy_url(url)}'\n"
        "run_coordinator:\n"
        "  module: dagster._core.run_coordinator\n"
        "  class: DefaultRunCoordinator\n"
        "run_launcher:\n"
        "  module: dagster._core.launcher\n"
        "  class: DefaultRunLauncher\n"
        "telemetry:\n"
        "  enabled: false\n"
    )
    try:
        yield home
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
