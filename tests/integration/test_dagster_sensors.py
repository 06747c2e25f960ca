"""The sensors, evaluated as the daemon evaluates them, against the test's database and a real
webhook on 127.0.0.1: how many drain runs task_queue_sensor asks for, and which alerts reach the
webhook, once each."""

import json
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import psycopg
import pytest

# A RemoteJobOrigin is what Dagster requires of a QUEUED run (the daemon gets it from the code
# location). Built here as a plain value pointing at the real code location module.
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from pydantic import ValidationError

from tests.dagster_helpers import Webhook
from tests.helpers import add_stores, add_tasks
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.jobs import drain_tasks_job, generate_resync_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor, run_failure_alert_sensor
from tq_pipelines.defs.sensors.queue import task_queue_sensor
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"


@pytest.fixture(scope="module")
def instance() -> Iterator[dg.DagsterInstance]:
    """A persistent instance (build_sensor_context refuses an ephemeral one). Shared: evaluating a
    sensor writes nothing to it, and the runs other tests leave in it have finished."""
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def own_instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


# -- task_queue_sensor --------------------------------------------------------------------------


def evaluate_queue_sensor(
    instance: dg.DagsterInstance, db_url: str, cursor: str | None = None, **settings: Any
) -> Any:
    settings = {"role_caps": f"{ROLE}=3", "tasks_per_run": 100, "drain_batch_size": 20, **settings}
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"tq": QueueResource(database_url=db_url, **settings)}
    ) as ctx:
        return task_queue_sensor.evaluate_tick(ctx)


def drain_origin() -> RemoteJobOrigin:
    location = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name="tq_pipelines.definitions"))
    return RemoteJobOrigin(RemoteRepositoryOrigin(location, "__repository__"), drain_tasks_job.name)


def add_drain_run(instance: dg.DagsterInstance, role: str, status: dg.DagsterRunStatus) -> dg.DagsterRun:
    """A drain run of ``role`` in ``status``, as the daemon would have recorded it."""
    return instance.create_run_for_job(
        job_def=drain_tasks_job,
        run_config={"ops": {"drain_role_tasks": {"config": {"role": role}}}},
        tags={"tq/role": role},
        status=status,
        remote_job_origin=drain_origin(),
    )


def test_queue_sensor_requests_the_cap_for_a_long_queue(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    add_tasks(conn, ROLE, add_stores(conn, 100), 10)

    first = evaluate_queue_sensor(instance, db_url)
    requests = first.run_requests
    assert len(requests) == 3  # 10 runs' worth of work, capped at 3
    for request in requests:
        assert request.tags["tq/role"] == ROLE
        config = request.run_config["ops"]["drain_role_tasks"]["config"]
        assert config["role"] == ROLE
        # What the sensor asks for is a valid run config of the job it launches.
        dg.validate_run_config(drain_tasks_job, request.run_config)
    assert len({r.run_key for r in requests}) == 3
    assert first.cursor is not None
    epoch, tick = json.loads(first.cursor)["epoch"], json.loads(first.cursor)["tick"]
    assert tick == 1

    # None of them launched (nothing runs them here): the next tick asks again, under new keys
    # of the same epoch.
    second = evaluate_queue_sensor(instance, db_url, cursor=first.cursor)
    assert len(second.run_requests) == 3
    assert second.cursor is not None
    assert (json.loads(second.cursor)["epoch"], json.loads(second.cursor)["tick"]) == (epoch, 2)
    keys = [r.run_key for r in requests + second.run_requests]
    assert len(set(keys)) == 6, keys
    # A tick evaluated again from the same cursor (its own was not saved) asks for the same keys,
    # which Dagster launches once.
    again = evaluate_queue_sensor(instance, db_url, cursor=first.cursor)
    assert [r.run_key for r in again.run_requests] == [r.run_key for r in second.run_requests]


def test_queue_sensor_passes_drain_settings_to_the_run(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    add_tasks(conn, ROLE, add_stores(conn, 5), 1)
    data = evaluate_queue_sensor(
        instance, db_url, drain_batch_size=7, drain_concurrency=3, drain_time_budget_seconds=120
    )
    [request] = data.run_requests
    config = request.run_config["ops"]["drain_role_tasks"]["config"]
    assert (config["batch_size"], config["concurrency"], config["time_budget_seconds"]) == (7, 3, 120)


@pytest.mark.parametrize(("ready", "runs"), [(150, 2), (100, 1), (1, 1), (301, 3)])
def test_queue_sensor_asks_one_run_per_tasks_per_run(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, ready: int, runs: int
):
    add_tasks(conn, ROLE, add_stores(conn, ready), 1)
    assert len(evaluate_queue_sensor(instance, db_url).run_requests) == runs


def test_queue_sensor_skips_an_empty_queue(instance: dg.DagsterInstance, db_url: str):
    data = evaluate_queue_sensor(instance, db_url)
    assert data.run_requests == []
    assert data.skip_message == "no ready tasks"


def test_queue_sensor_ignores_tasks_not_yet_due(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    stores = add_stores(conn, 160)
    conn.execute(
        "INSERT INTO worker_tasks (role, dispensary_id, scheduled_for) "
        "SELECT %s, id, now() + interval '1 hour' FROM unnest(%s::int[]) AS id",
        (ROLE, stores[:150]),
    )
    assert evaluate_queue_sensor(instance, db_url).run_requests == []
    add_tasks(conn, ROLE, stores[150:], 1)  # 10 ready
    assert len(evaluate_queue_sensor(instance, db_url).run_requests) == 1


def test_queue_sensor_moves_tasks_finished_long_enough_ago_out_of_the_queue(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    """Each tick archives a batch: tasks finished over archive_after_seconds ago, no others."""
    add_tasks(conn, ROLE, add_stores(conn, 6), 1)
    conn.execute(
        "UPDATE worker_tasks SET status = 'completed', claimed_at = now(), started_at = now(),"
        " completed_at = now() - CASE WHEN id % 2 = 0 THEN INTERVAL '2 minutes' ELSE INTERVAL '5 seconds' END"
        " WHERE id IN (SELECT id FROM worker_tasks ORDER BY id LIMIT 4)"
    )
    old = {
        r[0]
        for r in conn.execute("SELECT id FROM worker_tasks WHERE completed_at < now() - INTERVAL '1 minute'")
    }
    assert len(old) == 2
    evaluate_queue_sensor(instance, db_url, archive_after_seconds=60, archive_batch_size=1)
    evaluate_queue_sensor(instance, db_url, archive_after_seconds=60, archive_batch_size=1)
    evaluate_queue_sensor(instance, db_url, archive_after_seconds=60, archive_batch_size=1)
    assert {r[0] for r in conn.execute("SELECT id FROM worker_task_history")} == old
    assert conn.execute("SELECT status, count(*) FROM worker_tasks GROUP BY 1 ORDER BY 1").fetchall() == [
        ("completed", 2),
        ("pending", 2),
    ]


def test_queue_sensor_serves_every_role_within_its_own_cap(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    stores = add_stores(conn, 500)
    add_tasks(conn, ROLE, stores, 1)
    add_tasks(conn, "product_discovery", stores, 1)
    add_tasks(conn, "store_discovery", stores[:50], 1)
    data = evaluate_queue_sensor(
        instance, db_url, role_caps=f"{ROLE}=3,store_discovery=0", default_runs_per_role=2
    )
    by_role: dict[str, int] = {}
    for request in data.run_requests:
        role = request.tags["tq/role"]
        assert request.run_config["ops"]["drain_role_tasks"]["config"]["role"] == role
        by_role[role] = by_role.get(role, 0) + 1
    assert by_role == {ROLE: 3, "product_discovery": 2}


def test_queue_sensor_counts_runs_already_in_flight(
    own_instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection
):
    instance = own_instance
    add_tasks(conn, ROLE, add_stores(conn, 100), 10)
    add_drain_run(instance, ROLE, dg.DagsterRunStatus.QUEUED)
    # Finished runs and other roles' runs do not count.
    add_drain_run(instance, ROLE, dg.DagsterRunStatus.SUCCESS)
    add_drain_run(instance, ROLE, dg.DagsterRunStatus.FAILURE)
    add_drain_run(instance, "product_discovery", dg.DagsterRunStatus.QUEUED)
    # The backlog asks for the cap (3); one run is queued already: two more.
    assert len(evaluate_queue_sensor(instance, db_url).run_requests) == 2

    add_drain_run(instance, ROLE, dg.DagsterRunStatus.STARTED)
    assert len(evaluate_queue_sensor(instance, db_url).run_requests) == 1

    add_drain_run(instance, ROLE, dg.DagsterRunStatus.QUEUED)
    data = evaluate_queue_sensor(instance, db_url)
    assert data.run_requests == []
    assert data.skip_message is not None and "1 runs live, 2 queued" in data.skip_message


def test_queue_sensor_does_not_launch_runs_that_cannot_claim(
    own_instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    stores = add_stores(conn, 5)
    add_tasks(conn, ROLE, stores, 1)
    for n, _ in enumerate(stores):  # every store is busy with a long product_resync task
        assert queue.claim(ROLE, f"crawler-{n}") is not None
    add_tasks(conn, "product_discovery", stores, 50)  # 250 tasks, none claimable now

    # What a drain run of product_discovery would do now: claim nothing.
    assert queue.claim_many("product_discovery", "probe", 20) == []
    data = evaluate_queue_sensor(own_instance, db_url)
    assert [r.tags["tq/role"] for r in data.run_requests] == []


def test_queue_sensor_with_a_bad_cap_raises_naming_it(instance: dg.DagsterInstance, db_url: str):
    # Malformed: refused as the resource is built (test_dagster_config walks every case).
    with pytest.raises(ValidationError, match="role_caps"):
        evaluate_queue_sensor(instance, db_url, role_caps=f"{ROLE}=lots")
    # Well formed, for a role the database does not have: refused as the tick starts.
    with pytest.raises(dg.DagsterError) as raised:
        evaluate_queue_sensor(instance, db_url, role_caps="nosuchrole=2")
    assert "role_caps" in str(raised.value) + str(raised.value.__cause__)


# -- queue_health_sensor ------------------------------------------------------------------------


def evaluate_health(
    instance: dg.DagsterInstance, db_url: str, webhook: Webhook, cursor: str | None, **limits: Any
) -> Any:
    resources = {
        "tq": QueueResource(database_url=db_url),
        # A refused alert is tried again on the next tick, with no backoff.
        "alerts": AlertResource(webhook_url=webhook.url, retry_backoff_seconds=0),
        "health": HealthThresholds(**limits),
    }
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        return queue_health_sensor.evaluate_tick(ctx)


def age(conn: psycopg.Connection, task_id: int, minutes: int) -> None:
    conn.execute(
        "UPDATE worker_tasks SET claimed_at = now() - make_interval(mins => %(m)s), "
        "last_heartbeat_at = now() - make_interval(mins => %(m)s) WHERE id = %(id)s",
        {"m": minutes, "id": task_id},
    )


def test_health_alerts_once_per_stuck_episode(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, queue: TaskQueue, webhook: Webhook
):
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    healthy = evaluate_health(instance, db_url, webhook, None)
    assert webhook.posts == []
    assert healthy.skip_message == "healthy"

    task = queue.claim(ROLE, "gone-worker")
    assert task is not None
    age(conn, task.id, 5)  # silent, but not past the 10-minute threshold
    quiet = evaluate_health(instance, db_url, webhook, healthy.cursor)
    assert webhook.posts == []

    age(conn, task.id, 30)
    first = evaluate_health(instance, db_url, webhook, quiet.cursor)
    assert len(webhook.posts) == 1
    post = webhook.posts[0]
    assert post["path"] == "/hooks/tq"
    assert post["content_type"] == "application/json"
    assert post["title"] == "Tasks stuck past the stale threshold"
    assert "1 task(s)" in post["text"]
    assert post["severity"] == "error"

    again = evaluate_health(instance, db_url, webhook, first.cursor)
    assert len(webhook.posts) == 1  # the same problem is not sent twice
    assert "stuck" in (again.skip_message or "")

    assert queue.recover_stale(10).recovered == 1
    cleared = evaluate_health(instance, db_url, webhook, again.cursor)
    assert cleared.skip_message == "healthy"
    assert len(webhook.posts) == 1

    other = queue.claim(ROLE, "another-gone-worker")
    assert other is not None
    age(conn, other.id, 30)
    evaluate_health(instance, db_url, webhook, cleared.cursor)
    assert webhook.titles() == ["Tasks stuck past the stale threshold"] * 2


def test_health_alert_refused_by_the_webhook_is_sent_again(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, queue: TaskQueue, webhook: Webhook
):
    add_tasks(conn, ROLE, add_stores(conn, 1), 1)
    task = queue.claim(ROLE, "gone-worker")
    assert task is not None
    age(conn, task.id, 30)
    webhook.refuse_next = 1
    first = evaluate_health(instance, db_url, webhook, None)
    assert [p["title"] for p in webhook.refused] == ["Tasks stuck past the stale threshold"]
    evaluate_health(instance, db_url, webhook, first.cursor)  # the webhook is back
    assert webhook.titles() == ["Tasks stuck past the stale threshold"]


def insert_finished(
    conn: psycopg.Connection, role: str, completed: int, failed: int, minutes_ago: int = 10
) -> None:
    conn.execute(
        "INSERT INTO worker_tasks (role, status, started_at, completed_at) "
        "SELECT %(role)s, s, now() - make_interval(mins => %(m)s + 1), now() - make_interval(mins => %(m)s) "
        "FROM (SELECT 'completed' AS s FROM generate_series(1, %(c)s) "
        "      UNION ALL SELECT 'failed' FROM generate_series(1, %(f)s)) x",
        {"role": role, "c": completed, "f": failed, "m": minutes_ago},
    )


def test_health_alerts_on_a_roles_failure_rate(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, webhook: Webhook
):
    insert_finished(conn, ROLE, completed=20, failed=10)  # 33 % over 30
    insert_finished(conn, "product_discovery", completed=19, failed=1)  # 5 %: fine
    insert_finished(conn, "store_discovery", completed=0, failed=5)  # 100 %, but too few to count
    insert_finished(conn, "analytics_refresh", completed=0, failed=50, minutes_ago=90)  # not the last hour

    data = evaluate_health(instance, db_url, webhook, None, failure_rate=0.2, min_finished=20)
    assert len(webhook.posts) == 1, webhook.titles()
    assert webhook.posts[0]["title"] == f"{ROLE}: failure rate 33% in the last hour"
    assert "10 of 30" in webhook.posts[0]["text"]
    assert list(json.loads(data.cursor)["alerts"]) == [f"failure_rate:{ROLE}"]

    evaluate_health(instance, db_url, webhook, data.cursor, failure_rate=0.2, min_finished=20)
    assert len(webhook.posts) == 1


def test_health_warns_when_the_queue_will_not_drain_before_the_next_resync(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, queue: TaskQueue, webhook: Webhook
):
    # One worker doing a task every 10 minutes has 1,000 tasks ahead: days of work, whatever the hour.
    stores = add_stores(conn, 1000)
    add_tasks(conn, ROLE, stores, 1)
    conn.execute(
        "INSERT INTO worker_tasks (role, status, started_at, completed_at) "
        "VALUES (%s, 'completed', now() - interval '15 minutes', now() - interval '5 minutes')",
        (ROLE,),
    )
    assert queue.claim(ROLE, "slow-worker") is not None

    evaluate_health(instance, db_url, webhook, None)
    assert webhook.titles() == [f"{ROLE}: queue will not drain before the next resync"]
    assert webhook.posts[0]["severity"] == "warning"


# -- run_failure_alert_sensor -------------------------------------------------------------------


def alert_for_failed_run(
    instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult, alerts: AlertResource
) -> None:
    assert not result.success
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alert_sensor",
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        dagster_event=result.get_run_failure_event(),
    ).for_run_failure()
    run_failure_alert_sensor(context, alerts=alerts)


def test_failed_run_is_posted_to_the_webhook_with_a_link(
    db_url: str, webhook: Webhook, instance: dg.DagsterInstance
):
    # A run that fails for real: its config is refused when the op starts (an unreachable
    # database fails the same way, after the pool's 30 s wait; see test_dagster_jobs).
    result = generate_resync_tasks_job.execute_in_process(
        run_config={"ops": {"generate_resync_tasks": {"config": {"batches_per_day": 25}}}},
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        instance=instance,
        partition_key="2026-06-01",
        raise_on_error=False,
    )
    alerts = AlertResource(webhook_url=webhook.url, webserver_base_url="http://dagster.example:3000/")
    alert_for_failed_run(instance, result, alerts)

    assert len(webhook.posts) == 1
    post = webhook.posts[0]
    assert post["title"] == "generate_resync_tasks_job failed"
    assert post["url"] == f"http://dagster.example:3000/runs/{result.run_id}"
    assert post["severity"] == "error"
    assert "generate_resync_tasks" in post["text"]


def test_failed_drain_run_alert_names_its_role(db_url: str, webhook: Webhook, instance: dg.DagsterInstance):
    result = drain_tasks_job.execute_in_process(
        run_config={"ops": {"drain_role_tasks": {"config": {"role": "no_such_role"}}}},
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        instance=instance,
        tags={"tq/role": "no_such_role"},
        raise_on_error=False,
    )
    alert_for_failed_run(instance, result, AlertResource(webhook_url=webhook.url))
    assert webhook.titles() == ["drain_tasks_job failed (role no_such_role)"]
    assert webhook.posts[0]["url"].startswith("http://localhost:3000/runs/")


def test_an_unreachable_webhook_does_not_fail_the_sensor(db_url: str, instance: dg.DagsterInstance):
    result = drain_tasks_job.execute_in_process(
        run_config={"ops": {"drain_role_tasks": {"config": {"role": "no_such_role"}}}},
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        instance=instance,
        raise_on_error=False,
    )
    alerts = AlertResource(webhook_url="http://127.0.0.1:1/nothing-listens-here", timeout_seconds=5)
    alert_for_failed_run(instance, result, alerts)  # logs the delivery failure, raises nothing


def test_health_alerts_on_drain_runs_that_stay_queued(
    own_instance: dg.DagsterInstance, db_url: str, webhook: Webhook
):
    # A run queued a moment ago is normal; one held past the limit is a role not drained.
    add_drain_run(own_instance, "product_discovery", dg.DagsterRunStatus.STARTED)
    add_drain_run(own_instance, ROLE, dg.DagsterRunStatus.QUEUED)
    fresh = evaluate_health(own_instance, db_url, webhook, None, queued_run_seconds=60)
    assert "queued_runs" not in (fresh.skip_message or "")
    time.sleep(1.5)
    held = evaluate_health(own_instance, db_url, webhook, fresh.cursor, queued_run_seconds=1)
    assert held.skip_message is not None and f"queued_runs:{ROLE}" in held.skip_message
    assert "queued_runs:product_discovery" not in held.skip_message
    assert webhook.titles() == [f"{ROLE}: drain runs queued for 0 minutes"]
    # Still held next tick: not sent again.
    evaluate_health(own_instance, db_url, webhook, held.cursor, queued_run_seconds=1)
    assert len(webhook.titles()) == 1
