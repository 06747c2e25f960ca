"""Alert delivery never holds up a sensor tick. queue_health_sensor is evaluated tick after tick,
its cursor passed on, against real problems in the test's database and HTTP servers on 127.0.0.1
that answer, refuse, never answer, or answer a byte at a time; each server records what reached
it. run_failure_alert_sensor is bounded the same way."""

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import dagster as dg
import psycopg
import pytest
from pydantic import ValidationError

from tests.dagster_helpers import Webhook
from tests.helpers import add_stores, add_tasks
from tests.integration.test_dagster_sensors import age, insert_finished
from tests.integration.test_secrets import assert_hidden
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.jobs import drain_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor, run_failure_alert_sensor
from tq_pipelines.queue.api import TaskQueue

ROLES = ("product_resync", "product_discovery", "store_discovery")
FAILING = {f"{role}: failure rate 50% in the last hour" for role in ROLES}
STUCK = "Tasks stuck past the stale threshold"
TICK_LIMIT = 20.0  # what a tick of queue_health_sensor may take, whatever the channels do
# Short enough to keep the tests fast; no backoff unless a test is about it.
FAST = {"timeout_seconds": 0.5, "deadline_seconds": 1.5, "retry_backoff_seconds": 0}
DRIP_SECONDS = 0.2
TOKEN = "xoxb-0000-1111-test-token"


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that records the JSON of every POST as it arrives
    (``arrived``), then answers as ``mode`` says: "ok" at once (``answered``), "hang" never (the
    connection stays open), "drip" one byte of the answer every DRIP_SECONDS, "refuse" with 503.
    With ``slack`` it answers as Slack's Web API does (200 and ``{"ok": true}``), else as a
    webhook (204)."""

    def __init__(self, slack: bool = False) -> None:
        self.mode = "ok"
        self.arrived: list[dict[str, Any]] = []
        self.answered: list[dict[str, Any]] = []
        self.authorization: list[str] = []
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.arrived.append(body)
                receiver.authorization.append(self.headers.get("Authorization", ""))
                mode = receiver.mode
                if mode == "hang":
                    receiver.released.wait()
                    return
                status, payload = ("200 OK", b'{"ok": true}') if slack else ("204 No Content", b"")
                if mode == "refuse":
                    status, payload = "503 Service Unavailable", b""
                answer = (
                    f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n"
                ).encode() + payload
                if mode == "ok":
                    receiver.answered.append(body)
                try:
                    if mode == "drip":
                        for byte in answer:
                            if receiver.released.wait(DRIP_SECONDS):
                                return
                            self.wfile.write(bytes([byte]))
                    else:
                        self.wfile.write(answer)
                except OSError:  # the client gave up
                    return

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        root = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{root}/api/" if slack else f"{root}/hooks/tq"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def titles(posts: list[dict[str, Any]]) -> list[str]:
    """The alerts' titles, from the webhook's JSON or from Slack's text (``*title*\\n...``)."""
    return [p["title"] if "title" in p else p["text"].split("\n")[0].strip("*") for p in posts]


@pytest.fixture(autouse=True)
def only_the_tests_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TQ_ALERT_WEBHOOK_URL",
        "TQ_SLACK_TOKEN",
        "TQ_SLACK_CHANNEL",
        "TQ_DAGSTER_URL",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "http_proxy",
        "https_proxy",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(slack: bool = False) -> Receiver:
        made.append(Receiver(slack))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="module")
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def alerts_to(webhook: Receiver | None, slack: Receiver | None, **settings: Any) -> AlertResource:
    return AlertResource(
        webhook_url=webhook.url if webhook else "",
        slack_token=TOKEN if slack else "",
        slack_channel="#tq-alerts" if slack else "",
        slack_api_url=slack.url if slack else "https://slack.com/api/",
        **settings,
    )


class Tick(NamedTuple):
    cursor: str
    skip_message: str
    seconds: float


def tick(instance: dg.DagsterInstance, db_url: str, alerts: AlertResource, cursor: str | None) -> Tick:
    """One tick of queue_health_sensor, as the daemon runs it; it must end in time and save its cursor."""
    resources = {"tq": QueueResource(database_url=db_url), "alerts": alerts, "health": HealthThresholds()}
    started = time.monotonic()
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        data = queue_health_sensor.evaluate_tick(ctx)
    seconds = time.monotonic() - started
    assert seconds < TICK_LIMIT
    assert data.cursor is not None
    return Tick(data.cursor, data.skip_message or "", seconds)


def took(cursor: str) -> dict[str, list[str]]:
    """Per problem, the channels that took its alert, as the cursor says."""
    return {key: a["took"] for key, a in json.loads(cursor)["alerts"].items()}


def fail_roles(conn: psycopg.Connection) -> None:
    """Half of each role's tasks in the last hour failed: one failure-rate alert per role."""
    for role in ROLES:
        insert_finished(conn, role, completed=10, failed=10)


def stick_a_task(conn: psycopg.Connection, queue: TaskQueue) -> None:
    """A task claimed by a worker silent for 30 minutes: the "stuck" alert."""
    add_tasks(conn, ROLES[0], add_stores(conn, 1), 1)
    task = queue.claim(ROLES[0], "gone-worker")
    assert task is not None
    age(conn, task.id, 30)


def test_channels_that_never_answer_do_not_hold_up_the_tick(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, receiver: Callable[..., Receiver]
):
    # As deployed (default timeouts): three alerts, a webhook and a Slack that accept the
    # connection and never answer. Sent one after another, that was 3 x (10 s + 30 s).
    hook, slack = receiver(), receiver(slack=True)
    hook.mode = slack.mode = "hang"
    fail_roles(conn)
    alerts = alerts_to(hook, slack)

    first = tick(instance, db_url, alerts, None)
    assert first.seconds < alerts.timeout_seconds + 3  # the two channels waited side by side
    # Each channel stopped at its first failure; the log took every alert.
    assert (len(hook.arrived), len(slack.arrived)) == (1, 1)
    assert took(first.cursor) == {f"failure_rate:{role}": ["log"] for role in ROLES}
    assert "waiting: 3 for slack, next try" in first.skip_message
    assert "3 for webhook, next try" in first.skip_message

    # Within the backoff the channels are left alone: no connection, a quick tick, the same ids.
    second = tick(instance, db_url, alerts, first.cursor)
    assert second.seconds < 3
    assert (len(hook.arrived), len(slack.arrived)) == (1, 1)
    ids = {k: a["id"] for k, a in json.loads(first.cursor)["alerts"].items()}
    assert {k: a["id"] for k, a in json.loads(second.cursor)["alerts"].items()} == ids


def test_a_waiting_alert_reaches_a_channel_once_it_recovers_and_never_twice(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    receiver: Callable[..., Receiver],
):
    hook, slack = receiver(), receiver(slack=True)
    slack.mode = "hang"
    fail_roles(conn)
    alerts = alerts_to(hook, slack, **FAST)

    first = tick(instance, db_url, alerts, None)
    assert sorted(titles(hook.answered)) == sorted(FAILING)
    assert len({p["id"] for p in hook.answered}) == 3  # an id of its own per alert
    assert slack.answered == []
    assert set(map(tuple, took(first.cursor).values())) == {("log", "webhook")}

    # Slack still hangs; a new problem goes to the webhook at once, the others not again.
    stick_a_task(conn, queue)
    second = tick(instance, db_url, alerts, first.cursor)
    assert sorted(titles(hook.answered)) == sorted([*FAILING, STUCK])
    assert len(slack.arrived) == 2 and slack.answered == []
    assert "waiting: 4 for slack" in second.skip_message

    # The stuck task is recovered while Slack is down: its alert no longer holds, and is dropped.
    assert queue.recover_stale(10).recovered == 1
    slack.mode = "ok"
    third = tick(instance, db_url, alerts, second.cursor)
    assert sorted(titles(slack.answered)) == sorted(FAILING)
    assert all(a == ["log", "slack", "webhook"] for a in took(third.cursor).values())
    assert "waiting" not in third.skip_message
    assert [a for a in slack.authorization if a != f"Bearer {TOKEN}"] == []

    fourth = tick(instance, db_url, alerts, third.cursor)
    assert sorted(titles(hook.answered)) == sorted([*FAILING, STUCK])  # each once
    assert sorted(titles(slack.answered)) == sorted(FAILING)
    assert fourth.skip_message == "alerting: " + ", ".join(sorted(f"failure_rate:{r}" for r in ROLES))


def test_an_answer_slower_than_the_deadline_is_cut_off_and_sent_again_with_the_same_id(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    receiver: Callable[..., Receiver],
):
    # A byte every 0.2 s: each read returns within the timeout, only the deadline ends it.
    hook = receiver()
    hook.mode = "drip"
    stick_a_task(conn, queue)
    alerts = alerts_to(hook, None, **FAST)

    first = tick(instance, db_url, alerts, None)
    assert first.seconds < FAST["deadline_seconds"] + 1.5
    [arrived] = hook.arrived  # it reached the receiver; we could not know
    assert (titles(hook.arrived), hook.answered) == ([STUCK], [])
    assert took(first.cursor) == {"stuck": ["log"]}

    hook.mode = "ok"
    second = tick(instance, db_url, alerts, first.cursor)
    assert [p["id"] for p in hook.arrived] == [arrived["id"]] * 2  # the receiver can drop the repeat
    assert took(second.cursor) == {"stuck": ["log", "webhook"]}

    # The problem clears and comes back: a new alert, with a new id.
    assert queue.recover_stale(10).recovered == 1
    cleared = tick(instance, db_url, alerts, second.cursor)
    stick_a_task(conn, queue)
    tick(instance, db_url, alerts, cleared.cursor)
    assert titles(hook.answered) == [STUCK, STUCK]
    assert hook.answered[1]["id"] != arrived["id"]


def test_a_refusing_webhook_is_tried_again_with_a_growing_backoff(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    webhook: Webhook,
):
    stick_a_task(conn, queue)
    webhook.refuse_next = 2
    alerts = AlertResource(webhook_url=webhook.url, timeout_seconds=0.5, retry_backoff_seconds=1)

    def retry_in(cursor: str) -> float:
        retry_at = datetime.fromisoformat(json.loads(cursor)["backoff"]["webhook"]["retry_at"])
        return (retry_at - datetime.now(UTC)).total_seconds()

    first = tick(instance, db_url, alerts, None)
    assert len(webhook.refused) == 1
    assert 0 < retry_in(first.cursor) <= 1
    waiting = tick(instance, db_url, alerts, first.cursor)  # within the backoff: not tried
    assert len(webhook.refused) == 1
    assert "waiting: 1 for webhook, next try" in waiting.skip_message

    time.sleep(max(0.0, retry_in(waiting.cursor)))
    second = tick(instance, db_url, alerts, waiting.cursor)
    assert len(webhook.refused) == 2
    assert 1 < retry_in(second.cursor) <= 2  # doubled

    time.sleep(max(0.0, retry_in(second.cursor)))
    third = tick(instance, db_url, alerts, second.cursor)
    assert webhook.titles() == [STUCK]
    assert webhook.posts[0]["id"] == webhook.refused[0]["id"] == webhook.refused[1]["id"]
    assert json.loads(third.cursor)["backoff"] == {}
    tick(instance, db_url, alerts, third.cursor)
    assert webhook.titles() == [STUCK]


def test_a_cursor_of_the_earlier_format_is_taken_as_sent(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, queue: TaskQueue, webhook: Webhook
):
    fail_roles(conn)
    stick_a_task(conn, queue)
    data = tick(instance, db_url, AlertResource(webhook_url=webhook.url), json.dumps(["stuck"]))
    assert sorted(webhook.titles()) == sorted(FAILING)
    assert took(data.cursor)["stuck"] == ["log", "webhook"]


def failed_run(db_url: str, instance: dg.DagsterInstance) -> dg.RunFailureSensorContext:
    result = drain_tasks_job.execute_in_process(
        run_config={"ops": {"drain_role_tasks": {"config": {"role": "no_such_role"}}}},
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        instance=instance,
        raise_on_error=False,
    )
    assert not result.success
    return dg.build_run_status_sensor_context(
        sensor_name="run_failure_alert_sensor",
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        dagster_event=result.get_run_failure_event(),
    ).for_run_failure()


def test_a_failed_runs_alert_is_bounded_and_keeps_its_id(
    db_url: str,
    instance: dg.DagsterInstance,
    receiver: Callable[..., Receiver],
    monkeypatch: pytest.MonkeyPatch,
):
    hook = receiver()
    hook.mode = "drip"
    context = failed_run(db_url, instance)
    alerts = alerts_to(hook, None, **FAST)
    # Read when the alert is sent, not when the resource is built.
    monkeypatch.setenv("TQ_DAGSTER_URL", "https://dagster.example.com/")

    started = time.monotonic()
    run_failure_alert_sensor(context, alerts=alerts)
    assert time.monotonic() - started < FAST["deadline_seconds"] + 1.5
    [arrived] = hook.arrived
    assert arrived["url"] == f"https://dagster.example.com/runs/{context.dagster_run.run_id}"

    # The same run evaluated again (a tick Dagster did not save): the same id.
    hook.mode = "ok"
    run_failure_alert_sensor(context, alerts=alerts)
    assert [p["id"] for p in hook.answered] == [arrived["id"]]
    explicit = alerts_to(hook, None, webserver_base_url="http://dagster.internal:3000", **FAST)
    assert explicit.run_url("r1") == "http://dagster.internal:3000/runs/r1"


def test_waiting_alerts_print_no_secret(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    receiver: Callable[..., Receiver],
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)  # Slack's client logs each request it sends
    mark = "S3cr3t-7f3a9c"
    hook, slack = receiver(), receiver(slack=True)
    hook.mode, slack.mode = "hang", "refuse"
    fail_roles(conn)
    hook_url = hook.url.replace("/hooks/tq", f"/services/T0000/B0000/{mark}")
    token = f"xoxb-0000-1111-{mark}"
    alerts = AlertResource(
        webhook_url=hook_url, slack_token=token, slack_channel="#tq-alerts", slack_api_url=slack.url, **FAST
    )

    first = tick(instance, db_url, alerts, None)
    hook.mode = slack.mode = "ok"
    second = tick(instance, db_url, alerts, first.cursor)

    assert sorted(titles(hook.answered)) == sorted(titles(slack.answered)) == sorted(FAILING)
    assert slack.authorization[-1] == f"Bearer {token}"  # the real token was used
    out, err = capfd.readouterr()
    printed = err + caplog.text
    assert "alert webhook http://127.0.0.1" in printed
    assert "alert to Slack channel #tq-alerts failed" in printed
    assert_hidden(
        mark,
        stdout=out,
        stderr=err,
        logging=caplog.text,
        cursors=first.cursor + second.cursor,
        messages=f"{first.skip_message} {second.skip_message}",
        sent=json.dumps(hook.arrived + slack.arrived),
    )


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("timeout_seconds", 0),
        ("timeout_seconds", 30),
        ("deadline_seconds", 60),
        ("retry_backoff_seconds", -1),
    ],
)
def test_delivery_settings_that_would_break_the_tick_bound_are_refused(setting: str, value: float):
    with pytest.raises(ValidationError) as raised:
        dg.Definitions(resources={"alerts": AlertResource(**{setting: value})})
    assert f"AlertResource.{setting} = {value!r} is refused" in str(raised.value)
