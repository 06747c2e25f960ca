"""Roles are rows of worker_task_roles, not constants: a role a deployment adds with an INSERT and
gives a handler (TQ_HANDLERS) is drained through the sensor's runs; one with work and no handler
gets no run, and the sensor and queue_health_sensor say so; role caps and drain runs are checked
against the database's roles."""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import psycopg
import pytest

from tests.dagster_helpers import Webhook, failure_text, op_metadata
from tests.helpers import add_stores, add_tasks, status_counts
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.jobs import drain_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor
from tq_pipelines.defs.sensors.queue import task_queue_sensor
from tq_pipelines.queue.api import Task
from tq_pipelines.queue.worker import TaskContext

NEW_ROLE = "tq_test_echo"
ORPHAN_ROLE = "tq_test_orphan"
ECHO_HANDLER = f"{NEW_ROLE}={__name__}:echo"


def echo(task: Task, ctx: TaskContext) -> dict[str, Any]:
    """The added role's handler, plugged in through TQ_HANDLERS: says which task it did."""
    return {"handler": "echo", "id": task.id}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(autouse=True)
def no_plugged_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TQ_HANDLERS", "TQ_ROLE_CAPS"):
        monkeypatch.delenv(name, raising=False)


def add_role(conn: psycopg.Connection, role: str) -> None:
    """What migration 0003 tells a deployment to do to add a role."""
    conn.execute(
        "INSERT INTO worker_task_roles (role, description) VALUES (%s, 'added by the deployment')", (role,)
    )


def evaluate_queue_sensor(instance: dg.DagsterInstance, db_url: str, **settings: Any) -> Any:
    with dg.build_sensor_context(
        instance=instance, resources={"tq": QueueResource(database_url=db_url, **settings)}
    ) as ctx:
        return task_queue_sensor.evaluate_tick(ctx)


def evaluate_health(instance: dg.DagsterInstance, db_url: str, webhook: Webhook, cursor: str | None) -> Any:
    resources = {
        "tq": QueueResource(database_url=db_url),
        "alerts": AlertResource(webhook_url=webhook.url),
        "health": HealthThresholds(),
    }
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        return queue_health_sensor.evaluate_tick(ctx)


def drain(instance: dg.DagsterInstance, db_url: str, run_config: Any, tags: Any) -> dg.ExecuteInProcessResult:
    return drain_tasks_job.execute_in_process(
        run_config=run_config,
        tags=tags,
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        instance=instance,
        raise_on_error=False,
    )


def test_a_role_added_with_an_insert_and_a_handler_is_drained_through_the_sensor(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    add_role(conn, NEW_ROLE)
    add_tasks(conn, NEW_ROLE, add_stores(conn, 6), 1)
    monkeypatch.setenv("TQ_HANDLERS", ECHO_HANDLER)

    # A cap for the new role is accepted: the caps are checked against the database's roles.
    # (its run ends once the queue is empty, not after the sensor's usual idle wait)
    tick = evaluate_queue_sensor(instance, db_url, role_caps=f"{NEW_ROLE}=1", drain_idle_exit_seconds=0)
    [request] = tick.run_requests
    assert request.tags["tq/role"] == NEW_ROLE
    assert request.run_config["ops"]["drain_role_tasks"]["config"]["role"] == NEW_ROLE

    result = drain(instance, db_url, request.run_config, request.tags)
    assert result.success, failure_text(result)
    assert op_metadata(result, "drain_role_tasks")["completed"] == 6
    rows = conn.execute(
        "SELECT status, result->>'handler', (result->>'id')::bigint = id FROM v_tasks WHERE role = %s",
        (NEW_ROLE,),
    ).fetchall()
    assert rows == [("completed", "echo", True)] * 6

    assert evaluate_queue_sensor(instance, db_url).skip_message == "no ready tasks"


def test_a_role_with_work_and_no_handler_gets_no_run_and_the_sensor_says_so(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    add_role(conn, ORPHAN_ROLE)
    add_tasks(conn, ORPHAN_ROLE, add_stores(conn, 3), 1)

    tick = evaluate_queue_sensor(instance, db_url)
    assert tick.run_requests == []
    assert tick.skip_message == f"{ORPHAN_ROLE}: 3 ready and no handler, not drained"

    # The other roles are served as before, in the same tick.
    monkeypatch.setenv("TQ_HANDLERS", "product_resync=tq_pipelines.handlers:noop")
    add_tasks(conn, "product_resync", add_stores(conn, 2), 1)
    tick = evaluate_queue_sensor(instance, db_url)
    assert [r.tags["tq/role"] for r in tick.run_requests] == ["product_resync"]

    # A drain run launched by hand for it is refused before it claims anything.
    result = drain(instance, db_url, {"ops": {"drain_role_tasks": {"config": {"role": ORPHAN_ROLE}}}}, {})
    assert not result.success
    text = failure_text(result)
    assert f"role '{ORPHAN_ROLE}' has no handler" in text
    assert "TQ_HANDLERS" in text
    assert conn.execute(
        "SELECT count(*) FROM v_tasks WHERE role = %s AND status = 'pending' AND worker_id IS NULL",
        (ORPHAN_ROLE,),
    ).fetchone() == (3,)


def test_a_drain_run_of_a_role_not_in_the_table_is_refused_in_words(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TQ_HANDLERS", ECHO_HANDLER)  # a handler is not enough: the role is data
    add_tasks(conn, "product_resync", add_stores(conn, 2), 1)
    result = drain(instance, db_url, {"ops": {"drain_role_tasks": {"config": {"role": NEW_ROLE}}}}, {})
    assert not result.success
    text = failure_text(result)
    assert f"role '{NEW_ROLE}' is not in worker_task_roles" in text
    assert "INSERT INTO worker_task_roles" in text
    assert status_counts(conn) == {"pending": 2}


def test_role_caps_are_checked_against_the_databases_roles(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TQ_HANDLERS", ECHO_HANDLER)
    with pytest.raises(dg.DagsterError) as raised:
        evaluate_queue_sensor(instance, db_url, role_caps=f"{NEW_ROLE}=3")
    text = f"{raised.value} {raised.value.__cause__}"
    assert f"role_caps (TQ_ROLE_CAPS) names {NEW_ROLE}, not a role of worker_task_roles" in text

    add_role(conn, NEW_ROLE)
    add_tasks(conn, NEW_ROLE, add_stores(conn, 40), 1)
    # TQ_ROLE_CAPS, read at the tick, caps the new role like a built-in one.
    monkeypatch.setenv("TQ_ROLE_CAPS", f"{NEW_ROLE}=3")
    tick = evaluate_queue_sensor(instance, db_url, tasks_per_run=5, drain_batch_size=5)
    assert [r.tags["tq/role"] for r in tick.run_requests] == [NEW_ROLE] * 3


def test_health_alerts_once_per_occurrence_of_a_role_with_work_and_no_handler(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    webhook: Webhook,
    monkeypatch: pytest.MonkeyPatch,
):
    add_role(conn, NEW_ROLE)
    stores = add_stores(conn, 5)
    healthy = evaluate_health(instance, db_url, webhook, None)  # a role with no work is no problem
    assert healthy.skip_message == "healthy"

    add_tasks(conn, NEW_ROLE, stores[:3], 1)
    first = evaluate_health(instance, db_url, webhook, healthy.cursor)
    assert webhook.titles() == [f"role {NEW_ROLE} has 3 ready tasks and no handler"]
    post = webhook.posts[0]
    assert post["severity"] == "error"
    assert "TQ_HANDLERS" in post["text"]
    assert "tq_pipelines.handlers" in post["text"]

    add_tasks(conn, NEW_ROLE, stores[3:], 1)  # more of the same problem: not sent again
    again = evaluate_health(instance, db_url, webhook, first.cursor)
    assert len(webhook.posts) == 1
    assert again.skip_message == f"alerting: no_handler:{NEW_ROLE}"

    monkeypatch.setenv("TQ_HANDLERS", ECHO_HANDLER)
    cleared = evaluate_health(instance, db_url, webhook, again.cursor)
    assert cleared.skip_message == "healthy"

    monkeypatch.delenv("TQ_HANDLERS")  # the handler is gone again: a new occurrence
    evaluate_health(instance, db_url, webhook, cleared.cursor)
    assert webhook.titles() == [
        f"role {NEW_ROLE} has 3 ready tasks and no handler",
        f"role {NEW_ROLE} has 5 ready tasks and no handler",
    ]
