"""task_completion_log's current hour: a partition, materialised every five minutes while it fills
(its numbers rise as tasks complete), the closed hour still made final at five past."""

import time
from datetime import UTC, datetime, timedelta

import dagster as dg
import psycopg
import pytest

from tests.helpers import add_stores, add_tasks
from tq_pipelines.defs.partitions import FIRST_HOUR, hourly_partitions_def
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.rollup import task_completion_log, task_completion_log_job
from tq_pipelines.defs.schedules import (
    task_completion_log_current_hour_schedule,
    task_completion_log_schedule,
)
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"


@pytest.fixture(scope="module")
def repo() -> dg.RepositoryDefinition:
    """The rollup's job and schedules resolved as the daemon sees them."""
    return dg.Definitions(
        assets=[task_completion_log],
        jobs=[task_completion_log_job],
        schedules=[task_completion_log_schedule, task_completion_log_current_hour_schedule],
        resources={
            "tq": QueueResource(database_url="postgresql://tq@127.0.0.1:1/tq"),
            "crawl": CrawlResource(),
        },
    ).get_repository_def()


def requested(repo: dg.RepositoryDefinition, schedule: str, at: datetime) -> list[str | None]:
    with dg.build_schedule_context(scheduled_execution_time=at) as ctx:
        data = repo.get_schedule_def(schedule).evaluate_tick(ctx)
    return [r.partition_key for r in data.run_requests or []]


# -- the schedules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "key"),
    [
        (datetime(2026, 6, 1, 10, 0, tzinfo=UTC), "2026-06-01-10:00"),
        (datetime(2026, 6, 1, 10, 35, tzinfo=UTC), "2026-06-01-10:00"),
        (datetime(2026, 6, 1, 10, 55, tzinfo=UTC), "2026-06-01-10:00"),
        (datetime(2026, 6, 1, 23, 55, tzinfo=UTC), "2026-06-01-23:00"),
        (datetime(2026, 6, 2, 0, 0, tzinfo=UTC), "2026-06-02-00:00"),
    ],
)
def test_current_hour_schedule_requests_the_hour_it_runs_in(
    repo: dg.RepositoryDefinition, at: datetime, key: str
):
    assert requested(repo, "task_completion_log_current_hour_schedule", at) == [key]
    # The module's object, unresolved, says the same; with no run key, so that every tick of the
    # hour makes its run.
    with dg.build_schedule_context(scheduled_execution_time=at) as ctx:
        data = task_completion_log_current_hour_schedule.evaluate_tick(ctx)
    [request] = data.run_requests or []
    assert (request.partition_key, request.run_key) == (key, None)
    assert request.tags["dagster/partition"] == key


def test_current_hour_schedule_runs_every_five_minutes_by_default(repo: dg.RepositoryDefinition):
    schedule = repo.get_schedule_def("task_completion_log_current_hour_schedule")
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("*/5 * * * *", "UTC")
    assert schedule.job_name == "task_completion_log_job"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING


@pytest.mark.parametrize(
    ("at", "key"),
    [
        (datetime(2026, 6, 1, 11, 5, tzinfo=UTC), "2026-06-01-10:00"),
        (datetime(2026, 6, 2, 0, 5, tzinfo=UTC), "2026-06-01-23:00"),
    ],
)
def test_closed_hour_schedule_still_requests_the_hour_that_closed(
    repo: dg.RepositoryDefinition, at: datetime, key: str
):
    assert requested(repo, "task_completion_log_schedule", at) == [key]
    assert repo.get_schedule_def("task_completion_log_schedule").cron_schedule == "5 * * * *"


def test_the_hour_before_the_first_partition_is_skipped(repo: dg.RepositoryDefinition):
    """A new deployment's first closed-hour tick names the hour before its first partition."""
    at = FIRST_HOUR + timedelta(minutes=5)
    with dg.build_schedule_context(scheduled_execution_time=at) as ctx:
        data = repo.get_schedule_def("task_completion_log_schedule").evaluate_tick(ctx)
    assert not data.run_requests
    assert "before the first partition" in (data.skip_message or "")
    assert requested(repo, "task_completion_log_schedule", at + timedelta(hours=1)) == [
        FIRST_HOUR.strftime("%Y-%m-%d-%H:00")
    ]


# -- the partitions -------------------------------------------------------------------------------


def test_the_current_hour_is_the_last_partition():
    now = datetime.now(UTC)
    keys = hourly_partitions_def.get_partition_keys(current_time=now)
    current = now.strftime("%Y-%m-%d-%H:00")
    assert keys[-1] == current
    # The next hour is not a partition until it begins: a backfill of every partition ends at
    # the current hour.
    later = (now + timedelta(hours=1)).strftime("%Y-%m-%d-%H:00")
    assert later not in keys
    # The first is the deployment's first hour (tests/integration/test_partitions.py).
    assert keys[0] == FIRST_HOUR.strftime("%Y-%m-%d-%H:00")


# -- materialising the current hour as it fills ---------------------------------------------------


def current_hour(conn: psycopg.Connection) -> datetime:
    """The database's current UTC hour, at least 10 s before it ends (so that tasks completed in
    the test fall in it)."""
    while True:
        [now] = conn.execute("SELECT now()").fetchone()  # type: ignore[misc]
        now = now.astimezone(UTC)
        hour = now.replace(minute=0, second=0, microsecond=0)
        left = (hour + timedelta(hours=1) - now).total_seconds()
        if left > 10:
            return hour
        time.sleep(left + 0.1)


def materialize(db_url: str, key: str) -> dict:
    result = dg.materialize(
        [task_completion_log],
        partition_key=key,
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("task_completion_log")
    assert materialization.partition == key
    return {k: v.value for k, v in materialization.metadata.items()}


def complete(queue: TaskQueue, count: int) -> None:
    tasks = queue.claim_many(ROLE, "w-live", count, start=True)
    assert len(tasks) == count
    assert queue.complete_many({t.lease: {"ok": True} for t in tasks}) == {t.id for t in tasks}


def test_the_current_hour_rises_as_tasks_complete(db_url: str, conn: psycopg.Connection, queue: TaskQueue):
    hour = current_hour(conn)
    key = hour.strftime("%Y-%m-%d-%H:00")
    add_tasks(conn, ROLE, add_stores(conn, 10), 1)
    complete(queue, 3)

    first = materialize(db_url, key)
    assert (first["tasks_created"], first["tasks_completed"], first[f"{ROLE}_completed"]) == (10, 3, 3)
    assert first["hour_closed"] is False

    complete(queue, 4)
    second = materialize(db_url, key)
    assert (second["tasks_created"], second["tasks_completed"], second[f"{ROLE}_completed"]) == (10, 7, 7)
    assert second["hour_closed"] is False
    # Every role gets its numbers, zeros included, so that each role's plot has a point per run.
    roles = {r for (r,) in conn.execute("SELECT role FROM worker_task_roles").fetchall()}
    for role in roles:
        for measure in ("created", "completed", "failed"):
            assert isinstance(second[f"{role}_{measure}"], int), (role, measure)
    [row] = conn.execute(
        "SELECT tasks_completed FROM task_completion_log WHERE role = %s AND date = %s AND hour = %s",
        (ROLE, hour.date(), hour.hour),
    ).fetchall()
    assert row == (7,)


def test_a_closed_hour_says_it_is_final(db_url: str):
    meta = materialize(db_url, "2026-06-01-10:00")
    assert meta["hour_closed"] is True
    assert meta["tasks_completed"] == 0
