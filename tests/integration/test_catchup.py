"""resync_catchup_sensor requests today's resync until today has its tasks: when its scheduled run
is missing or failed, and when it ran before any store was known (0 tasks is no success), once
stores exist; at most a few runs a day."""

from collections.abc import Iterator
from datetime import UTC, datetime

import dagster as dg
import psycopg
import pytest

from tests.dagster_helpers import op_metadata
from tests.helpers import add_stores
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.resync import CATCHUP_ATTEMPTS, generate_resync_tasks_job, resync_catchup_sensor

UNREACHABLE = "postgresql://tq@127.0.0.1:1/nowhere?connect_timeout=1"


@pytest.fixture
def today() -> str:
    now = datetime.now(UTC)
    if (now.hour, now.minute) < (0, 5):
        pytest.skip("before the schedule's time the catch-up waits for the schedule")
    return now.date().isoformat()


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def resync(instance: dg.DagsterInstance, day: str, database_url: str) -> dg.ExecuteInProcessResult:
    return generate_resync_tasks_job.execute_in_process(
        partition_key=day,
        instance=instance,
        resources={"tq": QueueResource(database_url=database_url), "crawl": CrawlResource()},
        raise_on_error=False,
    )


def tick(instance: dg.DagsterInstance, db_url: str) -> dg.RunRequest | dg.SkipReason:
    with dg.build_sensor_context(
        instance=instance, resources={"tq": QueueResource(database_url=db_url)}
    ) as ctx:
        return resync_catchup_sensor(ctx)


def test_catchup_requests_todays_resync_again_after_a_failed_run(
    db_url: str, conn: psycopg.Connection, instance: dg.DagsterInstance, today: str
):
    add_stores(conn, 2)
    first = tick(instance, db_url)
    assert isinstance(first, dg.RunRequest)
    assert (first.partition_key, first.run_key) == (today, f"catchup:{today}:0")

    # The day's run failed (its database was unreachable): tried again, under a new key.
    assert not resync(instance, today, UNREACHABLE).success
    again = tick(instance, db_url)
    assert isinstance(again, dg.RunRequest)
    assert again.run_key == f"catchup:{today}:1"

    # A run that made the day's tasks is the day's: nothing more.
    assert resync(instance, today, db_url).success
    done = tick(instance, db_url)
    assert isinstance(done, dg.SkipReason)
    assert "has its 2 resync tasks" in (done.skip_message or "")


def test_a_resync_before_any_store_is_tried_again_once_stores_exist(
    db_url: str, conn: psycopg.Connection, instance: dg.DagsterInstance, today: str
):
    # The scheduled run came before store discovery had found a crawlable store (the platform is
    # known, here by a disabled store; in production by the platforms file): green, and 0 tasks.
    add_stores(conn, 1, enabled=False)
    empty = resync(instance, today, db_url)
    assert empty.success
    assert op_metadata(empty, "generate_resync_tasks")["created"] == 0

    waiting = tick(instance, db_url)
    assert isinstance(waiting, dg.SkipReason)
    assert "no store is known yet" in (waiting.skip_message or "")

    # Discovery lists stores later that day: the catch-up runs the day again, and it makes them.
    add_stores(conn, 3)
    request = tick(instance, db_url)
    assert isinstance(request, dg.RunRequest)
    assert (request.partition_key, request.run_key) == (today, f"catchup:{today}:1")
    again = resync(instance, today, db_url)
    assert op_metadata(again, "generate_resync_tasks")["created"] == 3
    done = tick(instance, db_url)
    assert isinstance(done, dg.SkipReason)
    assert "has its 3 resync tasks" in (done.skip_message or "")


def test_catchup_gives_up_for_the_day_after_runs_that_made_no_task(
    db_url: str, conn: psycopg.Connection, instance: dg.DagsterInstance, today: str
):
    add_stores(conn, 2)
    add_stores(conn, 1, platform="jane", enabled=False)
    assert not resync(instance, today, UNREACHABLE).success
    # Runs that succeed with 0 tasks while stores exist (here: only jane is resynced, and its one
    # store is disabled) count as attempts too.
    for _ in range(CATCHUP_ATTEMPTS - 1):
        result = generate_resync_tasks_job.execute_in_process(
            partition_key=today,
            instance=instance,
            run_config={"ops": {"generate_resync_tasks": {"config": {"platforms": ["jane"]}}}},
            resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
            raise_on_error=False,
        )
        assert result.success
        assert op_metadata(result, "generate_resync_tasks")["created"] == 0
    result = tick(instance, db_url)
    assert isinstance(result, dg.SkipReason)
    assert f"{CATCHUP_ATTEMPTS} resync runs made no task" in (result.skip_message or "")


def test_catchup_waits_for_a_run_under_way(
    db_url: str,
    conn: psycopg.Connection,
    instance: dg.DagsterInstance,
    today: str,
    monkeypatch: pytest.MonkeyPatch,
):
    add_stores(conn, 1)
    monkeypatch.setenv("TQ_DATABASE_URL", db_url)  # the job's resource reads it, as in a deployment
    run = instance.create_run_for_job(
        generate_resync_tasks_job, tags={"dagster/partition": today}, status=dg.DagsterRunStatus.STARTED
    )
    result = tick(instance, db_url)
    assert isinstance(result, dg.SkipReason)
    assert "under way" in (result.skip_message or ""), run.run_id
