"""product_resync, the daily resync as a partitioned asset: resync_progress_sensor follows each
day's tasks in observations of its partition, and the check backfill_finished passes only once
every task of the backfilled (past) days has finished; a past day never goes ahead of today's
work: it is held while today's tasks are unfinished, and queued by the sensor, one day at a
time, once they are done."""

from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import dagster as dg
import psycopg
import pytest

from tests.dagster_helpers import op_metadata
from tests.helpers import add_stores
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.resync import BACKFILL_CHECK, generate_resync_tasks_job, resync_progress_sensor
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"
TODAY = datetime.now(UTC).date()


@pytest.fixture(autouse=True)
def _today() -> None:
    """Today as of each test's start, not of the module's import: a suite may run past midnight."""
    global TODAY  # noqa: PLW0603 - the tests read it as a constant
    TODAY = datetime.now(UTC).date()


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def resync(instance: dg.DagsterInstance, db_url: str, day: date, **config: Any) -> dg.ExecuteInProcessResult:
    result = generate_resync_tasks_job.execute_in_process(
        partition_key=day.isoformat(),
        instance=instance,
        run_config={"ops": {"generate_resync_tasks": {"config": config}}} if config else None,
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
    )
    assert result.success
    return result


class Sensor:
    """resync_progress_sensor's ticks, its cursor carried from one to the next."""

    def __init__(self, instance: dg.DagsterInstance, db_url: str) -> None:
        self.instance, self.db_url, self.cursor = instance, db_url, None

    def tick(self) -> dg.SensorResult:
        with dg.build_sensor_context(
            instance=self.instance,
            cursor=self.cursor,
            resources={"tq": QueueResource(database_url=self.db_url)},
        ) as ctx:
            result = resync_progress_sensor(ctx)
        assert isinstance(result, dg.SensorResult)
        self.cursor = result.cursor
        return result


def check(result: dg.SensorResult) -> dg.AssetCheckEvaluation | None:
    """The tick's result of backfill_finished, if it reported one."""
    found = [e for e in result.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
    assert len(found) <= 1
    if found:
        assert (found[0].check_name, found[0].partition) == (BACKFILL_CHECK, None)
    return found[0] if found else None


def check_state(result: dg.SensorResult) -> tuple[bool, int, int]:
    """passed, days in progress, days held."""
    evaluation = check(result)
    assert evaluation is not None
    meta = evaluation.metadata
    return evaluation.passed, meta["days_in_progress"].value, meta["days_held"].value  # type: ignore[return-value]


def observed(result: dg.SensorResult) -> dict[str, dict[str, Any]]:
    return {
        e.partition: {k: v.value for k, v in e.metadata.items()}  # type: ignore[misc]
        for e in result.asset_events
        if isinstance(e, dg.AssetObservation)
    }


def finish(queue: TaskQueue, count: int, worker: str = "w-test") -> list[int]:
    """Claim ``count`` product_resync tasks as the queue orders them, and complete them."""
    tasks = queue.claim_many(ROLE, worker, count, start=True)
    assert len(tasks) == count
    assert queue.complete_many({t.lease: {"ok": True} for t in tasks}) == {t.id for t in tasks}
    return [t.id for t in tasks]


def resync_dates(conn: psycopg.Connection, ids: list[int]) -> set[date]:
    return {d for (d,) in conn.execute("SELECT resync_date FROM v_tasks WHERE id = ANY(%s)", (ids,))}


def test_a_backfilled_days_check_passes_only_once_its_tasks_are_done(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, instance: dg.DagsterInstance
):
    add_stores(conn, 3)
    day = TODAY - timedelta(days=3)
    key = day.isoformat()

    run = resync(instance, db_url, day)
    meta = op_metadata(run, "generate_resync_tasks")
    assert (meta["created"], meta["tasks"], meta["pending"], meta["backfill"]) == (3, 3, 3, True)
    assert meta["dagster/row_count"] == 3
    [in_run] = run.get_asset_check_evaluations()
    assert (in_run.check_name, in_run.partition, in_run.passed) == (BACKFILL_CHECK, None, False)
    assert in_run.metadata["tasks_unfinished"].value == 3

    sensor = Sensor(instance, db_url)
    first = sensor.tick()
    assert check_state(first) == (False, 1, 0)
    assert (
        observed(first)[key].items()
        >= {"tasks": 3, "pending": 3, "completed": 0, "state": "in progress"}.items()
    )

    finish(queue, 2)
    second = sensor.tick()
    assert check_state(second) == (False, 1, 0)
    assert f"{key}: 2 of 3 finished" in (check(second).description or "")  # type: ignore[union-attr]
    assert observed(second)[key].items() >= {"pending": 1, "completed": 2, "finished_share": 0.6667}.items()

    # Nothing moved: nothing reported.
    assert sensor.tick().asset_events == []

    finish(queue, 1)
    done = sensor.tick()
    assert check_state(done) == (True, 0, 0)
    assert (
        observed(done)[key].items()
        >= {"pending": 0, "running": 0, "completed": 3, "state": "finished"}.items()
    )
    assert sensor.tick().asset_events == []  # a finished day is no longer followed

    # Materialised again: nothing more to queue, and the check, evaluated in the run, agrees.
    again = resync(instance, db_url, day)
    assert op_metadata(again, "generate_resync_tasks")["created"] == 0
    [evaluation] = again.get_asset_check_evaluations()
    assert evaluation.passed


def test_past_days_wait_for_todays_work_and_are_claimed_after_it(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, instance: dg.DagsterInstance
):
    add_stores(conn, 3)
    # Today's resync in one batch at midnight: all three tasks are due.
    resync(instance, db_url, TODAY, batches_per_day=1)
    older, newer = TODAY - timedelta(days=5), TODAY - timedelta(days=2)

    # A backfill of two past days now: both held, nothing queued, no materialisation.
    for day in (newer, older):
        held = resync(instance, db_url, day)
        assert held.asset_materializations_for_node("generate_resync_tasks") == []
        [observation] = held.get_asset_observation_events()
        assert observation.partition == day.isoformat()
        assert observation.asset_observation_data.asset_observation.metadata["held"].value is True
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE resync_date < %s", (TODAY,)).fetchone() == (0,)

    sensor = Sensor(instance, db_url)
    first = sensor.tick()
    assert first.run_requests == []
    assert check_state(first) == (False, 0, 2)
    for day in (older, newer):
        assert observed(first)[day.isoformat()]["state"] == "held"
        assert f"{day}: held" in (check(first).description or "")  # type: ignore[union-attr]

    # Today's work is claimed first, all of it; then the older held day is queued, alone.
    assert resync_dates(conn, finish(queue, 3)) == {TODAY}
    [request] = sensor.tick().run_requests
    assert request.partition_key == older.isoformat()
    assert op_metadata(resync(instance, db_url, older), "generate_resync_tasks")["created"] == 3
    running = sensor.tick()
    assert running.run_requests == []  # one past day at a time
    assert check_state(running) == (False, 1, 1)
    assert resync_dates(conn, finish(queue, 3)) == {older}

    [request] = sensor.tick().run_requests
    assert request.partition_key == newer.isoformat()
    resync(instance, db_url, newer)
    assert resync_dates(conn, finish(queue, 3)) == {newer}
    last = sensor.tick()
    assert last.run_requests == []
    assert check_state(last) == (True, 0, 0)


def test_a_past_day_is_queued_at_once_when_nothing_newer_waits(
    db_url: str, conn: psycopg.Connection, instance: dg.DagsterInstance
):
    add_stores(conn, 2)
    day = TODAY - timedelta(days=1)
    assert op_metadata(resync(instance, db_url, day), "generate_resync_tasks")["created"] == 2
    # Other past days do not hold it: only today's work does.
    assert (
        op_metadata(resync(instance, db_url, day - timedelta(days=1)), "generate_resync_tasks")["created"]
        == 2
    )
