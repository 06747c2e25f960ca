"""A backfill of 48 hours of task_completion_log as the UI launches one (GraphQL's
launchPartitionBackfill, here through the dagster-graphql command) and the daemon runs it: two
runs of 24 hours (BackfillPolicy.multi_run), every hour materialised and rolled up."""

import json
import os
import signal
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

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLE = "product_resync"
NOW_HOUR = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
HOURS = [NOW_HOUR - timedelta(hours=49 - h) for h in range(48)]  # 48 closed hours
KEYS = [h.strftime("%Y-%m-%d-%H:00") for h in HOURS]
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}

LAUNCH = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
  }
}
"""


@pytest.fixture
def dagster_home(pg_server: str, tmp_path: Path) -> Iterator[Path]:
    with scratch_dagster_home(pg_server, tmp_path) as home:
        yield home


def env_for(home: Path, db_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_FIRST_DAY", "TQ_ROLE_CAPS")}
    return env | {"DAGSTER_HOME": str(home), "TQ_DATABASE_URL": db_url}


@pytest.fixture
def daemon(dagster_home: Path, db_url: str) -> Iterator[subprocess.Popen]:
    """dagster-daemon on the scratch instance, in a session of its own, stopped at the end."""
    proc = subprocess.Popen(
        [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=env_for(dagster_home, db_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    yield proc
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


@pytest.mark.slow
def test_a_48_hour_backfill_runs_in_two_runs_and_fills_every_hour(
    dagster_home: Path, db_url: str, conn: psycopg.Connection, daemon: subprocess.Popen
):
    # Hour h of the 48 has h % 5 + 1 completed tasks.
    for h, hour in enumerate(HOURS):
        conn.execute(
            "INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at) "
            "SELECT %s, 'completed', %s, %s, %s FROM generate_series(1, %s)",
            (ROLE, hour, hour, hour + timedelta(minutes=1), h % 5 + 1),
        )
    params = {"assetSelection": [{"path": ["task_completion_log"]}], "partitionNames": KEYS}
    launched = subprocess.run(
        [
            str(BIN / "dagster-graphql"),
            "-w",
            "workspace.yaml",
            "-t",
            LAUNCH,
            "-v",
            json.dumps({"params": params}),
        ],
        cwd=ROOT,
        env=env_for(dagster_home, db_url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    # The answer, then the code server's log lines.
    document, _ = json.JSONDecoder().raw_decode(launched.stdout[launched.stdout.index("{") :])
    answer = document["data"]["launchPartitionBackfill"]
    assert answer["__typename"] == "LaunchBackfillSuccess", answer
    backfill_id = answer["backfillId"]

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        deadline = time.monotonic() + 240
        while True:
            runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
            filled = instance.get_materialized_partitions(dg.AssetKey("task_completion_log"))
            if runs and all(r.status in FINISHED for r in runs) and set(KEYS) <= filled:
                break
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"backfill not done: {[(r.run_id, r.status) for r in runs]}, {len(filled)} hours")
            time.sleep(1)
        assert len(runs) == 2
        assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
        ranges = sorted(
            (r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
            for r in runs
        )
        assert ranges == [(KEYS[0], KEYS[23]), (KEYS[24], KEYS[47])]
        # The daemon also runs the hourly rollup schedule: an hour closing during the test may be
        # filled by it, never one the backfill did not ask for before the 48.
        assert set(KEYS) <= filled
        assert all(key > KEYS[-1] for key in filled - set(KEYS)), sorted(filled - set(KEYS))

    logged = dict(
        conn.execute(
            "SELECT date + make_interval(hours => hour), tasks_completed FROM task_completion_log "
            "WHERE role = %s",
            (ROLE,),
        ).fetchall()
    )
    assert [logged[h.replace(tzinfo=None)] for h in HOURS] == [h % 5 + 1 for h in range(48)]
