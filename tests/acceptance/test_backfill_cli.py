"""`dagster job backfill` from the command line, against a real instance: runs and events in
PostgreSQL, runs launched by the default coordinator (no daemon), tasks in the test's database."""

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from tests.helpers import add_stores
from tq_pipelines.db import ensure_database, sqlalchemy_url

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
JOB = "generate_resync_tasks_job"
DAYS = [date(2026, 6, 1), date(2026, 6, 2), date(2026, 6, 3)]
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@pytest.fixture
def dagster_home(pg_server: str, tmp_path: Path) -> Iterator[Path]:
    """A DAGSTER_HOME whose runs and events live in a scratch database on the test server, and
    whose runs start at once as local processes (DefaultRunCoordinator: no daemon needed; the
    CLI's code server launches them)."""
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
    yield home
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def backfill(home: Path, db_url: str) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(home), "TQ_DATABASE_URL": db_url}
    env.pop("TQ_ROLE_CAPS", None)
    args = [
        str(DAGSTER), "job", "backfill", "-w", "workspace.yaml", "-j", JOB,
        "--from", DAYS[0].isoformat(), "--to", DAYS[-1].isoformat(), "--noprompt",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Launched backfill job" in proc.stdout, proc.stdout[-3000:]


def wait_for_runs(instance: dg.DagsterInstance, count: int, timeout: float = 90) -> list[dg.DagsterRun]:
    """The job's runs once ``count`` of them exist and all have finished (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = instance.get_runs(dg.RunsFilter(job_name=JOB))
        if len(runs) >= count and all(r.status in FINISHED for r in runs):
            return list(runs)
        if time.monotonic() > deadline:
            pytest.fail(f"runs not finished after {timeout} s: {[(r.run_id, r.status) for r in runs]}")
        time.sleep(0.5)


def created_by(instance: dg.DagsterInstance, run: dg.DagsterRun) -> int:
    """The op's "created" output metadata, as stored in the instance's event log."""
    [record] = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
    assert record.dagster_event is not None
    return record.dagster_event.step_output_data.metadata["created"].value


@pytest.mark.slow
def test_backfill_cli_creates_each_days_resync_once(
    dagster_home: Path, db_url: str, conn: psycopg.Connection
):
    stores = add_stores(conn, 6)
    add_stores(conn, 2, enabled=False)

    backfill(dagster_home, db_url)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        first = wait_for_runs(instance, 3)
        assert len(first) == 3
        assert {r.status for r in first} == {dg.DagsterRunStatus.SUCCESS}
        first = sorted(first, key=lambda r: r.tags["dagster/partition"])
        assert [r.tags["dagster/partition"] for r in first] == [d.isoformat() for d in DAYS]
        assert len({r.tags["dagster/backfill"] for r in first}) == 1
        assert [created_by(instance, r) for r in first] == [len(stores)] * 3

        tasks = conn.execute(
            "SELECT resync_date, dispensary_id FROM worker_tasks WHERE role = 'product_resync' "
            "ORDER BY resync_date, dispensary_id"
        ).fetchall()
        assert tasks == [(d, s) for d in DAYS for s in stores]
        assert conn.execute("SELECT count(*) FROM worker_tasks").fetchone()[0] == 3 * len(stores)

        # Again: three more successful runs, and not one more task.
        backfill(dagster_home, db_url)
        runs = wait_for_runs(instance, 6)
        second = [r for r in runs if r.run_id not in {f.run_id for f in first}]
        assert len(second) == 3
        assert {r.status for r in second} == {dg.DagsterRunStatus.SUCCESS}
        assert [created_by(instance, r) for r in second] == [0, 0, 0]
        assert conn.execute("SELECT count(*) FROM worker_tasks").fetchone()[0] == 3 * len(stores)
