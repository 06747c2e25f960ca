"""`dagster job backfill` of the daily resync from the command line, against a real instance: runs
and events in PostgreSQL, runs launched by the default coordinator (no daemon), tasks in the
test's database, partitions from the deployment's first day as the code location reads it."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from tests.acceptance.scratch_instance import scratch_dagster_home
from tests.helpers import add_stores

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
JOB = "generate_resync_tasks_job"
TODAY = datetime.now(UTC).date()
# A deployment five days old; three of its past days backfilled.
FIRST_DAY = TODAY - timedelta(days=5)
DAYS = [TODAY - timedelta(days=n) for n in (4, 3, 2)]
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@pytest.fixture
def dagster_home(pg_server: str, tmp_path: Path) -> Iterator[Path]:
    with scratch_dagster_home(pg_server, tmp_path) as home:
        yield home


def backfill(home: Path, db_url: str, days: list = DAYS) -> subprocess.CompletedProcess:
    env = {**os.environ, "DAGSTER_HOME": str(home), "TQ_DATABASE_URL": db_url}
    env.pop("TQ_ROLE_CAPS", None)
    env.pop("TQ_FIRST_DAY", None)
    args = [
        str(DAGSTER), "job", "backfill", "-w", "workspace.yaml", "-j", JOB,
        "--from", days[0].isoformat(), "--to", days[-1].isoformat(), "--noprompt",
    ]  # fmt: skip
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)


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


def materialised(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dict:
    """The product_resync materialisation of the run, as stored in the instance's event log."""
    [record] = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
    assert record.dagster_event is not None
    event = record.dagster_event.step_materialization_data.materialization
    return {"partition": event.partition, **{k: v.value for k, v in event.metadata.items()}}


@pytest.mark.slow
def test_backfill_cli_creates_each_days_resync_once(
    dagster_home: Path, db_url: str, conn: psycopg.Connection
):
    stores = add_stores(conn, 6)
    add_stores(conn, 2, enabled=False)
    # The deployment's first task, five days ago: where its partitions start.
    conn.execute(
        "INSERT INTO worker_tasks (role, status, created_at) VALUES ('analytics_refresh', 'completed', %s)",
        (datetime(FIRST_DAY.year, FIRST_DAY.month, FIRST_DAY.day, 12, tzinfo=UTC),),
    )

    # A day before the deployment's first is no partition: refused, nothing launched.
    before = backfill(dagster_home, db_url, [FIRST_DAY - timedelta(days=1), FIRST_DAY])
    assert before.returncode != 0
    assert "Launched backfill job" not in before.stdout

    proc = backfill(dagster_home, db_url)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Launched backfill job" in proc.stdout, proc.stdout[-3000:]
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        first = wait_for_runs(instance, 3)
        assert len(first) == 3
        assert {r.status for r in first} == {dg.DagsterRunStatus.SUCCESS}
        first = sorted(first, key=lambda r: r.tags["dagster/partition"])
        assert [r.tags["dagster/partition"] for r in first] == [d.isoformat() for d in DAYS]
        assert len({r.tags["dagster/backfill"] for r in first}) == 1
        metadata = [materialised(instance, r) for r in first]
        assert [(m["partition"], m["created"], m["pending"], m["backfill"]) for m in metadata] == [
            (d.isoformat(), len(stores), len(stores), True) for d in DAYS
        ]
        # The runs are green; the days are not done: the check says so, in each run.
        checks = [
            e.dagster_event.asset_check_evaluation_data
            for r in first
            for e in instance.all_logs(r.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
            if e.dagster_event is not None
        ]
        assert [(c.check_name, c.passed) for c in checks] == [("backfill_finished", False)] * 3

        tasks = conn.execute(
            "SELECT resync_date, dispensary_id FROM worker_tasks WHERE role = 'product_resync' "
            "ORDER BY resync_date, dispensary_id"
        ).fetchall()
        assert tasks == [(d, s) for d in DAYS for s in stores]

        # Again: three more successful runs, and not one more task.
        assert backfill(dagster_home, db_url).returncode == 0
        runs = wait_for_runs(instance, 6)
        second = [r for r in runs if r.run_id not in {f.run_id for f in first}]
        assert len(second) == 3
        assert {r.status for r in second} == {dg.DagsterRunStatus.SUCCESS}
        assert [materialised(instance, r)["created"] for r in second] == [0, 0, 0]
        assert conn.execute("SELECT count(*) FROM worker_tasks WHERE role = 'product_resync'").fetchone() == (
            3 * len(stores),
        )
