"""Secrets never printed. A distinctive secret goes into every URL setting (the queue database's
password, the alert webhook's path, the Slack token, a platform's credentials); each path that
prints is driven for real (a failed alert delivery, an unreachable database, a failing run and
its alert, the schema dump, a failing crawl request); then every output is searched for it:
exceptions, captured stdout/stderr and logging, what the webhook received, Dagster's event log,
run records, job snapshots and the files of its instance, and pg_dump's command line."""

import json
import logging
import os
import shlex
import socket
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.dagster_helpers import Webhook, failure_text
from tests.helpers import add_stores, add_tasks
from tq_pipelines.crawl.http import GoneError, PoliteClient
from tq_pipelines.db import DatabaseUnreachable, check_connection
from tq_pipelines.db.schema import SchemaDumpError, choose_pg_dump, dump_database, find_pg_dumps
from tq_pipelines.db.schema import main as schema_main
from tq_pipelines.defs.alerting import Alert, AlertResource
from tq_pipelines.defs.jobs import generate_resync_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor, run_failure_alert_sensor
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.worker import PermanentTaskError, TransientTaskError

ROLE = "product_resync"


# -- the secret and where to look for it ----------------------------------------------------------


@pytest.fixture
def mark() -> str:
    """The distinctive part of this test's secrets: every secret ends with it, so any piece of a
    secret that gets printed (a password cut at a '/' or '@' included) holds it."""
    return uuid.uuid4().hex


@pytest.fixture(autouse=True)
def no_secrets_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings each test gives are the only ones: redaction must not get its knowledge of a
    secret from a variable the test did not set."""
    for name in (
        "TQ_DATABASE_URL",
        "TQ_ALERT_WEBHOOK_URL",
        "TQ_SLACK_TOKEN",
        "TQ_SLACK_CHANNEL",
        "PGPASSWORD",
    ):
        monkeypatch.delenv(name, raising=False)


def assert_hidden(mark: str, **outputs: str) -> None:
    """``mark`` appears in none of ``outputs`` (named for the failure message)."""
    leaks = {
        name: text[max(0, i - 100) : i + 60] for name, text in outputs.items() if (i := text.find(mark)) >= 0
    }
    assert not leaks, f"the secret was printed: {leaks}"


def dagster_record(instance: dg.DagsterInstance) -> str:
    """Everything the instance holds, as text: each run, its job snapshot (where a resource's
    literal settings would be) and its events, serialized as Dagster stores them; and the bytes
    of the instance's files (SQLite storage, the steps' captured stdout/stderr)."""
    parts = []
    for run in instance.get_runs():
        parts.append(dg.serialize_value(run))
        if run.job_snapshot_id:
            parts.append(dg.serialize_value(instance.get_job_snapshot(run.job_snapshot_id)))
        parts += [dg.serialize_value(entry) for entry in instance.all_logs(run.run_id)]
    root = instance.root_directory
    assert root is not None
    parts += [p.read_bytes().decode("utf-8", "replace") for p in Path(root).rglob("*") if p.is_file()]
    return "\n".join(parts)


def event_messages(instance: dg.DagsterInstance, run_id: str) -> str:
    return "\n".join(entry.user_message for entry in instance.all_logs(run_id))


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def webhook_with_secret(webhook: Webhook, mark: str) -> str:
    """A Slack-style webhook URL on the test's server: the path is the secret."""
    return webhook.url.replace("/hooks/tq", f"/services/T0000/B0000/S3cr3t-{mark}")


# -- alert delivery ---------------------------------------------------------------------------


def alert_job(alert: Alert) -> dg.JobDefinition:
    """A job whose one op sends ``alert`` through the alerts resource, logging to Dagster's event
    log as the sensors do (the alert is built here, not given as run config: run config is
    stored with the run, and the test's secrets are not supposed to be there)."""

    @dg.op
    def send_alert(context: dg.OpExecutionContext, alerts: AlertResource) -> list[str]:
        return alerts.send(alert, context.log)

    @dg.job(name=f"send_alert_{uuid.uuid4().hex[:8]}")
    def job() -> None:
        send_alert()

    return job


@pytest.mark.parametrize("endpoint", ["answers_503", "closed_port"])
def test_a_failed_webhook_delivery_names_the_host_not_the_secret(
    endpoint: str,
    mark: str,
    webhook: Webhook,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)
    if endpoint == "answers_503":
        hook_url = webhook_with_secret(webhook, mark)
        webhook.refuse_next = 1
        host = hook_url.split("/services/")[0]
    else:
        host = f"http://127.0.0.1:{closed_port()}"
        hook_url = f"{host}/services/T0000/B0000/S3cr3t-{mark}"
    # As deployed: the resource left empty in Definitions, the URL from the environment.
    monkeypatch.setenv("TQ_ALERT_WEBHOOK_URL", hook_url)
    db_url = f"postgresql://tq:S3cr3t-{mark}@db.internal:5432/tq"
    run_link = "http://dagster.example:3000/runs/0123-abcd"
    alert = Alert("drain_tasks_job failed", f"could not reach {db_url}: timeout", url=run_link)

    result = alert_job(alert).execute_in_process(
        resources={"alerts": AlertResource(timeout_seconds=5)}, instance=instance
    )

    assert result.output_for_node("send_alert") == ["log"]  # the delivery failed, the op did not
    messages = event_messages(instance, result.run_id)
    # The failure says where and why, by the webhook's host only.
    why = "HTTP 503" if endpoint == "answers_503" else "URLError: [Errno 111] Connection refused"
    assert f"alert webhook {host}/*** failed: {why}" in messages
    if endpoint == "answers_503":
        [post] = webhook.refused
        assert post["path"].endswith(f"S3cr3t-{mark}")  # the real secret URL was used
        assert post["url"] == run_link  # the run's link stays usable
        assert "postgresql://tq:***@db.internal:5432/tq" in post["text"]
        assert_hidden(mark, sent=json.dumps(post | {"path": ""}))
    out, err = capfd.readouterr()
    assert_hidden(mark, dagster=dagster_record(instance), stdout=out, stderr=err, logging=caplog.text)


def test_the_slack_token_and_the_alert_text_are_not_printed(
    mark: str,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    # Slack's API behind a proxy that refuses: the client fails at once, as with no network. Its
    # DEBUG log shows the body it sends.
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("TQ_SLACK_TOKEN", f"xoxb-0000-1111-S3cr3t{mark}")
    monkeypatch.setenv("TQ_SLACK_CHANNEL", "#tq-alerts")
    alert = Alert("run failed", f"cannot connect to postgresql://tq:S3cr3t-{mark}@db.internal/tq")

    result = alert_job(alert).execute_in_process(resources={"alerts": AlertResource()}, instance=instance)

    assert result.output_for_node("send_alert") == ["log"]
    assert "alert to Slack channel #tq-alerts failed: URLError" in event_messages(instance, result.run_id)
    assert "Sending a request" in caplog.text  # the client did try, and logged its body
    out, err = capfd.readouterr()
    assert_hidden(mark, dagster=dagster_record(instance), stdout=out, stderr=err, logging=caplog.text)


def test_a_webhook_url_that_urllib_refuses_is_not_quoted(mark: str, caplog: pytest.LogCaptureFixture):
    # No scheme: urllib's error message quotes the whole URL.
    url = f"hooks.slack.com/services/T0000/B0000/S3cr3t-{mark}"
    assert AlertResource(webhook_url=url).send(Alert("t", "x"), logging.getLogger("tq-test")) == ["log"]
    assert "alert webhook" in caplog.text
    assert "ValueError: unknown url type" in caplog.text
    assert_hidden(mark, logging=caplog.text)


# -- an unreachable database --------------------------------------------------------------------


@pytest.mark.parametrize(
    "password",
    [
        "S3cr3t%zz-{mark}",  # not valid percent-encoding: libpq quotes the token in its error
        "P@ss-{mark}",  # an unencoded '@': libpq reads the rest as the host, and names it
    ],
)
def test_an_unreachable_database_is_reported_without_its_password(password: str, mark: str):
    # The URL given as a value (not from TQ_DATABASE_URL, which redaction also reads).
    url = f"postgresql://tq:{password.format(mark=mark)}@127.0.0.1:{closed_port()}/tq"
    with pytest.raises(DatabaseUnreachable) as raised:
        check_connection(url, timeout=2)
    assert "TQ_DATABASE_URL" in str(raised.value)
    assert_hidden(mark, error=str(raised.value))


def test_a_failing_run_and_its_alert_do_not_show_the_database_password(
    mark: str,
    webhook: Webhook,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)
    # A password with a '%' that is not an escape: libpq quotes it back in its error.
    queue_url = f"postgresql://tq:S3cr3t%zz-{mark}@127.0.0.1:{closed_port()}/tq"
    monkeypatch.setenv("TQ_DATABASE_URL", queue_url)
    result = generate_resync_tasks_job.execute_in_process(
        # As definitions.py gives it: through an EnvVar (a literal would be kept in the job
        # snapshot, shown in the UI).
        resources={"tq": QueueResource(database_url=dg.EnvVar("TQ_DATABASE_URL")), "crawl": CrawlResource()},
        instance=instance,
        partition_key="2026-06-01",
        raise_on_error=False,
    )
    assert not result.success
    assert "percent-encoded" in failure_text(result)  # libpq's reason reached the run

    # The run failure alert, to a webhook (secret path) that answers 503.
    hook_url = webhook_with_secret(webhook, mark)
    webhook.refuse_next = 1
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alert_sensor",
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        dagster_event=result.get_run_failure_event(),
    ).for_run_failure()
    run_failure_alert_sensor(context, alerts=AlertResource(webhook_url=hook_url, timeout_seconds=5))

    [post] = webhook.refused
    assert post["title"] == "generate_resync_tasks_job failed"
    assert post["url"] == f"http://localhost:3000/runs/{result.run_id}"
    out, err = capfd.readouterr()
    assert "alert webhook http://127.0.0.1" in err + caplog.text
    assert_hidden(
        mark,
        failure=failure_text(result),
        sent=json.dumps(post | {"path": ""}),
        dagster=dagster_record(instance),
        stdout=out,
        stderr=err,
        logging=caplog.text,
    )


def test_queue_health_alerts_keep_the_webhook_secret(
    mark: str,
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    webhook: Webhook,
    instance: dg.DagsterInstance,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)
    add_tasks(conn, ROLE, add_stores(conn, 1), 1)
    task = queue.claim(ROLE, "gone-worker")
    assert task is not None
    conn.execute(
        "UPDATE worker_tasks SET claimed_at = now() - interval '1 hour', "
        "last_heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (task.id,),
    )
    webhook.refuse_next = 1
    resources = {
        "tq": QueueResource(database_url=db_url),
        "alerts": AlertResource(webhook_url=webhook_with_secret(webhook, mark), timeout_seconds=5),
        "health": HealthThresholds(),
    }
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
        queue_health_sensor.evaluate_tick(ctx)

    [post] = webhook.refused
    assert post["title"] == "Tasks stuck past the stale threshold"
    out, err = capfd.readouterr()
    assert "alert webhook http://127.0.0.1" in err + caplog.text
    assert_hidden(mark, stdout=out, stderr=err, logging=caplog.text, dagster=dagster_record(instance))


# -- the schema dump ----------------------------------------------------------------------------


@pytest.fixture
def pg_dump_spy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_server: str) -> Path:
    """A ``pg_dump`` first on PATH that records its command line (what ps and /proc show) and the
    PGPASSWORD it was given, then runs the real pg_dump. With SPY_FAIL set it fails instead,
    echoing its command line and environment to stderr (as a tool that reports what it was given
    would). Returns the folder of its records."""
    with psycopg.connect(pg_server) as c:
        server_major = c.info.server_version // 10000
    real = choose_pg_dump(server_major, find_pg_dumps()).path
    records = tmp_path / "records"
    records.mkdir()
    spy = tmp_path / "bin" / "pg_dump"
    spy.parent.mkdir()
    spy.write_text(
        "#!/bin/sh\n"
        f"records={shlex.quote(str(records))}\n"
        'for arg in "$@"; do printf "%s\\n" "$arg"; done >> "$records/argv"\n'
        'printf "%s\\n" "${PGPASSWORD-<unset>}" >> "$records/pgpassword"\n'
        'if [ -n "$SPY_FAIL" ] && [ "$1" != --version ]; then\n'
        '  echo "pg_dump: error: given $* with $(env)" >&2; exit 1\n'
        "fi\n"
        f'exec {shlex.quote(str(real))} "$@"\n'
    )
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{spy.parent}{os.pathsep}{os.environ['PATH']}")
    return records


@pytest.fixture
def role_with_password(pg_server: str, mark: str) -> Iterator[tuple[str, str]]:
    """A login role with a password (the test server may trust any password: what matters is
    where the password string goes), able to read the test's database; dropped afterwards."""
    name, password = f"tq_secret_{uuid.uuid4().hex[:12]}", f"S3cr3t-{mark}"
    with psycopg.connect(pg_server, autocommit=True) as c:
        c.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE pg_read_all_data").format(
                sql.Identifier(name), sql.Literal(password)
            )
        )
    yield name, password
    with psycopg.connect(pg_server, autocommit=True) as c:
        c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def url_with_password(db_url: str, user: str, password: str) -> str:
    """``db_url`` as a postgresql:// URL of ``user`` with ``password``."""
    params = conninfo_to_dict(db_url)
    host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
    if str(host).startswith("/"):  # a Unix socket's folder (the embedded server) goes in the query
        return (
            f"postgresql://{user}:{password}@/{params['dbname']}?host={quote(str(host), safe='')}&port={port}"
        )
    return f"postgresql://{user}:{password}@{host}:{port}/{params['dbname']}"


def test_pg_dump_gets_the_password_from_the_environment_not_its_command_line(
    mark: str, db_url: str, pg_dump_spy: Path, role_with_password: tuple[str, str]
):
    user, password = role_with_password
    text = dump_database(url_with_password(db_url, user, password))

    assert "CREATE TABLE public.worker_tasks" in text
    argv = (pg_dump_spy / "argv").read_text()
    assert f"user={user}" in argv  # the spy saw the dump's command line
    assert_hidden(mark, argv=argv)
    # The --version probes get no password; the dump gets it through PGPASSWORD.
    assert (pg_dump_spy / "pgpassword").read_text().splitlines()[-1] == password


def test_a_failing_pg_dump_is_reported_without_the_password(
    mark: str,
    db_url: str,
    pg_dump_spy: Path,
    role_with_password: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
):
    user, password = role_with_password
    monkeypatch.setenv("SPY_FAIL", "1")
    with pytest.raises(SchemaDumpError) as raised:
        dump_database(url_with_password(db_url, user, password))
    assert "pg_dump: error: given" in str(raised.value)
    assert_hidden(mark, error=str(raised.value), argv=(pg_dump_spy / "argv").read_text())


@pytest.mark.parametrize("given", ["argument", "TQ_DATABASE_URL"])
def test_the_schema_command_reports_a_bad_url_without_the_password(
    given: str, mark: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    url = f"postgresql://tq:S3cr3t%zz-{mark}@127.0.0.1:{closed_port()}/tq"
    if given == "argument":
        assert schema_main([url]) == 1
    else:  # off the command line, where every user of the machine would see it
        monkeypatch.setenv("TQ_DATABASE_URL", url)
        assert schema_main([]) == 1
    out, err = capfd.readouterr()
    assert "percent-encoded" in err
    assert_hidden(mark, stdout=out, stderr=err)


# -- crawl requests -----------------------------------------------------------------------------


class Platform:
    """A platform API on 127.0.0.1 answering each GET with the status its path names
    (/status/410 ...), remembering the Authorization headers it got."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        platform = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                platform.authorizations.append(self.headers.get("Authorization"))
                status = int(self.path.split("/status/")[1].split("?")[0])
                body = b"not json" if status == 200 else b'{"error": "no"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)


@pytest.fixture
def platform() -> Iterator[Platform]:
    api = Platform()
    api.thread.start()
    yield api
    api.server.shutdown()
    api.server.server_close()
    api.thread.join()


@pytest.mark.parametrize(
    ("status", "error"),
    [(500, TransientTaskError), (410, GoneError), (404, PermanentTaskError), (200, PermanentTaskError)],
)
def test_crawl_errors_do_not_show_a_platforms_credentials(
    status: int, error: type[Exception], mark: str, platform: Platform, caplog: pytest.LogCaptureFixture
):
    url = f"http://menus:S3cr3t-{mark}@127.0.0.1:{platform.port}/status/{status}?token=S3cr3t-{mark}&page=2"
    with PoliteClient(timeout_seconds=5) as client, pytest.raises(error) as raised:
        client.get_json(url)
    assert platform.authorizations[0] is not None  # the credentials were used
    text = str(raised.value)
    assert f"HTTP {status}" in text or "did not answer JSON" in text
    assert f"127.0.0.1:{platform.port}/status/{status}" in text  # the URL stays useful
    assert_hidden(mark, error=text, url=getattr(raised.value, "url", ""), logging=caplog.text)


def test_a_refused_crawl_connection_does_not_show_the_credentials(mark: str):
    url = f"http://menus:S3cr3t-{mark}@127.0.0.1:{closed_port()}/stores?api_key=S3cr3t-{mark}"
    with PoliteClient(timeout_seconds=5) as client, pytest.raises(TransientTaskError) as raised:
        client.get_json(url)
    assert "connection error on GET http://menus:***@127.0.0.1" in str(raised.value)
    assert_hidden(mark, error=str(raised.value))
