"""Partitions start at the deployment's first hour, read from its database when the code location
loads: a new deployment has no partition before it, so none shows as missing that nothing could
ever fill ("0 % filled")."""

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from tq_pipelines.defs.partitions import database_first_hour, first_hour

ROOT = Path(__file__).resolve().parents[2]


def this_hour() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def test_a_new_database_starts_at_the_current_hour(db_url: str):
    before = this_hour()
    assert before <= database_first_hour(db_url) <= this_hour()


def test_a_database_with_history_starts_at_its_oldest_task_or_rollup_hour(
    db_url: str, conn: psycopg.Connection
):
    conn.execute(
        "INSERT INTO worker_tasks (role, status, created_at) "
        "VALUES ('analytics_refresh', 'completed', now() - interval '3 days')"
    )
    [created] = conn.execute("SELECT created_at FROM worker_tasks").fetchone()  # type: ignore[misc]
    assert database_first_hour(db_url) == created.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    # A rollup hour kept after its tasks were pruned counts too.
    conn.execute(
        "INSERT INTO task_completion_log (role, date, hour) "
        "VALUES ('analytics_refresh', (now() AT TIME ZONE 'UTC')::date - 10, 7)"
    )
    assert database_first_hour(db_url) == this_hour().replace(hour=7) - timedelta(days=10)


def test_tq_first_day_overrides_and_is_checked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TQ_FIRST_DAY", "2026-06-01")
    monkeypatch.setenv("TQ_DATABASE_URL", "postgresql://tq@127.0.0.1:1/nowhere")
    assert first_hour() == datetime(2026, 6, 1, tzinfo=UTC)
    monkeypatch.setenv("TQ_FIRST_DAY", "June 1st")
    with pytest.raises(ValueError, match="TQ_FIRST_DAY"):
        first_hour()


def test_an_unreachable_database_still_loads_from_today(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TQ_FIRST_DAY", raising=False)
    monkeypatch.setenv("TQ_DATABASE_URL", "postgresql://tq@127.0.0.1:1/nowhere")
    assert first_hour() == this_hour().replace(hour=0)


NEW_DEPLOYMENT = """
import json
from datetime import UTC, datetime
import dagster as dg
from tq_pipelines.defs.rollup import task_completion_log
from tq_pipelines.definitions import defs
from tq_pipelines.defs.resources import QueueResource

repo = defs.get_repository_def()
now = datetime.now(UTC)
hourly = repo.assets_defs_by_key[dg.AssetKey("task_completion_log")].partitions_def
daily = repo.assets_defs_by_key[dg.AssetKey("product_resync")].partitions_def
hours = hourly.get_partition_keys(current_time=now)
with dg.instance_for_test() as instance:
    # The current-hour schedule's first run.
    dg.materialize(
        [task_completion_log],
        partition_key=hours[-1],
        instance=instance,
        resources={"tq": QueueResource(database_url=dg.EnvVar("TQ_DATABASE_URL"))},
    )
    filled = instance.get_materialized_partitions(dg.AssetKey("task_completion_log"))
print(json.dumps({
    "hours": hours,
    "days": daily.get_partition_keys(current_time=now),
    "missing": sorted(set(hours) - filled),
    "now": now.isoformat(),
}))
"""


def test_a_new_deployment_has_no_missing_partition_after_its_first_rollup(db_url: str):
    env = {k: v for k, v in os.environ.items() if k != "TQ_FIRST_DAY"} | {"TQ_DATABASE_URL": db_url}
    proc = subprocess.run(
        [sys.executable, "-c", NEW_DEPLOYMENT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    now = datetime.fromisoformat(out["now"])
    # A database with nothing in it yet: its partitions are this hour and today, nothing older
    # (two hours if the hour turned while the code loaded).
    assert out["hours"][-1] == now.strftime("%Y-%m-%d-%H:00")
    assert len(out["hours"]) <= 2
    assert out["days"] == [now.date().isoformat()]
    # The first current-hour run fills every partition there is.
    assert out["missing"] == out["hours"][:-1]
