"""resync_catchup_sensor requests today's resync when its scheduled run is missing or failed,
until one succeeds, at most a few times a day."""

from datetime import UTC, datetime

import dagster as dg
import psycopg
import pytest

from tests.helpers import add_stores
from tq_pipelines.jobs import generate_resync_tasks_job
from tq_pipelines.resources import CrawlResource, QueueResource
from tq_pipelines.sensors.queue import CATCHUP_ATTEMPTS, resync_catchup_sensor


def _resync(instance: dg.DagsterInstance, day: str, database_url: str) -> dg.ExecuteInProcessResult:
    return generate_resync_tasks_job.execute_in_process(
        partition_key=day,
        instance=instance,
        resources={"tq": QueueResource(database_url=database_url), "crawl": CrawlResource()},
        raise_on_error=False,
    )


def test_catchup_requests_todays_resync_again_after_a_failed_run(db_url: str):
    now = datetime.now(UTC)
    if (now.hour, now.minute) < (0, 5):
        pytest.skip("before the schedule's time the catch-up waits for the schedule")
    day = now.date().isoformat()
    with dg.instance_for_test() as instance:
        first = resync_catchup_sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(first, dg.RunRequest)
        assert (first.partition_key, first.run_key) == (day, f"catchup:{day}:0")

        # The day's run failed (its database was unreachable): tried again, under a new key.
        failed = _resync(instance, day, "postgresql://tq@127.0.0.1:1/nowhere?connect_timeout=1")
        assert not failed.success
        again = resync_catchup_sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(again, dg.RunRequest)
        assert again.run_key == f"catchup:{day}:1"

        # A run that succeeded is the day's: nothing more (dutchie, the default platform, is
        # known to the queue once it has a store).
        with psycopg.connect(db_url, autocommit=True) as conn:
            add_stores(conn, 1)
        assert _resync(instance, day, db_url).success
        done = resync_catchup_sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(done, dg.SkipReason)
        assert "already has a resync run" in (done.skip_message or "")


def test_catchup_gives_up_for_the_day_after_failing_runs(db_url: str):
    now = datetime.now(UTC)
    if (now.hour, now.minute) < (0, 5):
        pytest.skip("before the schedule's time the catch-up waits for the schedule")
    day = now.date().isoformat()
    with dg.instance_for_test() as instance:
        for _ in range(CATCHUP_ATTEMPTS):
            assert not _resync(instance, day, "postgresql://tq@127.0.0.1:1/nowhere?connect_timeout=1").success
        result = resync_catchup_sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(result, dg.SkipReason)
        assert f"{CATCHUP_ATTEMPTS} resync runs failed" in (result.skip_message or "")
