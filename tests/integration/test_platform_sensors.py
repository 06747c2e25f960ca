"""What operators see of the platforms' fleet-wide limits: ``platform_status_sensor`` (loads the
platforms file into ``tq_platforms`` and observes ``platform_limits``), the "platform X is paused"
alert of ``queue_health_sensor`` (on a real webhook), and ``tq platforms [--sync]``. Each runs
against the test's own database."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from tests.dagster_helpers import Webhook
from tests.helpers import add_stores
from tests.integration.test_crawl_dagster import evaluate_health, write_platforms
from tq_pipelines.cli import main
from tq_pipelines.crawl.platforms import load_platform_settings, sync_limits
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.platforms import PLATFORM_LIMITS, platform_status_sensor
from tq_pipelines.queue.api import Task, TaskQueue

# Nothing listens there: the sensors and the command read the file, they never send a request.
FILE = """\
[platforms.dutchie]
base_url = "http://127.0.0.1:9/dutchie"
max_in_flight = {dutchie_in_flight}
requests_per_second = 5
burst = 2

[platforms.jane]
base_url = "http://127.0.0.1:9/jane"
max_in_flight = 4
requests_per_second = 10
"""
# (max_in_flight, requests_per_second, burst) as the file says; jane's burst is its max_in_flight.
LIMITS = {"dutchie": (3, 5.0, 2), "jane": (4, 10.0, 4)}
OUTAGE = "HTTP 503 for http://127.0.0.1:9/jane/menus/x (Retry-After 60 s)"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from the shell decides where the platforms are or where alerts go."""
    for name in ("TQ_PLATFORMS_FILE", "TQ_HANDLERS", "TQ_ALERT_WEBHOOK_URL", "TQ_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def platforms_file(tmp_path: Path, dutchie_in_flight: int = 3) -> Path:
    return write_platforms(tmp_path, FILE.format(dutchie_in_flight=dutchie_in_flight))


def limits_in_queue(conn: psycopg.Connection) -> dict[str, tuple[int, float, int]]:
    rows = conn.execute(
        "SELECT platform, max_in_flight, requests_per_second, burst FROM tq_platforms"
    ).fetchall()
    return {p: (m, r, b) for p, m, r, b in rows}


def another_workers_jane_task(queue: TaskQueue) -> Task:
    """A jane task (store_discovery, of no store) that another worker holds: what meets jane's
    outage (a platform's errors are reported by a held task, on its own platform). Claimed before
    jane has limits, so it holds none of jane's slots."""
    queue.enqueue("store_discovery", platform="jane")
    [task] = queue.claim_many("store_discovery", "other", 1, start=True)
    assert (task.platform, task.send_at) == ("jane", None)
    return task


def pause_jane(queue: TaskQueue, held: Task) -> None:
    """Another worker met a 503 with Retry-After 60 on jane: jane is paused for everyone."""
    assert queue.platform_error(held, OUTAGE, retry_after=60) is not None


# -- platform_status_sensor ---------------------------------------------------------------------


def tick(instance: dg.DagsterInstance, db_url: str, path: Path, cursor: str | None) -> Any:
    resources = {"tq": QueueResource(database_url=db_url), "crawl": CrawlResource(platforms_file=str(path))}
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        return platform_status_sensor.evaluate_tick(ctx)


def observed(data: Any) -> list[dict[str, Any]]:
    """The metadata (plain values) of each platform_limits observation of a tick."""
    events = data.asset_events or []
    assert all(isinstance(e, dg.AssetObservation) and e.asset_key == PLATFORM_LIMITS for e in events), events
    return [{k: v.value for k, v in e.metadata.items()} for e in events]


def test_platform_status_sensor_loads_the_limits_and_observes_each_change_of_state(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, tmp_path: Path, instance: dg.DagsterInstance
):
    path = platforms_file(tmp_path)
    other = another_workers_jane_task(queue)
    assert limits_in_queue(conn) == {}

    # The first tick loads the file into the queue and observes every platform.
    first = tick(instance, db_url, path, None)
    assert limits_in_queue(conn) == LIMITS
    [meta] = observed(first)
    for p, (in_flight, rate, _) in LIMITS.items():
        assert {k.removeprefix(f"{p} "): v for k, v in meta.items() if k.startswith(f"{p} ")} == {
            "state": "open",
            "in_flight": 0,
            "max_in_flight": in_flight,
            "requests_per_second": rate,
            "paused": 0,
            "pause_seconds_left": 0.0,
            "errors_total": 0,
        }
    assert first.skip_message == "dutchie: open, 0/3 in flight; jane: open, 0/4 in flight"
    assert first.run_requests == []

    # Nothing changed: no observation, the same message.
    second = tick(instance, db_url, path, first.cursor)
    assert observed(second) == []
    assert second.skip_message == first.skip_message

    # jane pauses: the next tick observes it, once.
    pause_jane(queue, other)
    third = tick(instance, db_url, path, second.cursor)
    [meta] = observed(third)
    assert (meta["jane state"], meta["jane paused"], meta["jane pause_reason"]) == ("paused", 1, OUTAGE)
    assert 55 <= meta["jane pause_seconds_left"] <= 60
    assert meta["jane errors_total"] == 1
    assert (meta["dutchie state"], meta["dutchie paused"]) == ("open", 0)
    assert "dutchie pause_reason" not in meta
    assert re.fullmatch(
        r"dutchie: open, 0/3 in flight; jane: paused, 0/4 in flight, \d+ s left \("
        + re.escape(OUTAGE)
        + r"\)",
        third.skip_message,
    ), third.skip_message
    assert observed(tick(instance, db_url, path, third.cursor)) == []

    # An edit of the file reaches the queue at the next tick, and the UI in an observation; the
    # state (jane's pause) stays.
    path = platforms_file(tmp_path, dutchie_in_flight=5)
    fourth = tick(instance, db_url, path, third.cursor)
    assert limits_in_queue(conn) == {**LIMITS, "dutchie": (5, 5.0, 2)}
    [meta] = observed(fourth)
    assert (meta["dutchie max_in_flight"], meta["jane state"]) == (5, "paused")
    assert fourth.skip_message.startswith("dutchie: open, 0/5 in flight; jane: paused, 0/4 in flight, ")
    [row] = [r for r in queue.platform_status() if r["platform"] == "jane"]
    assert (row["state"], row["pause_reason"]) == ("paused", OUTAGE)


# -- queue_health_sensor: "platform X is paused" -------------------------------------------------


def test_a_paused_platform_is_alerted_once_per_outage(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    tmp_path: Path,
    webhook: Webhook,
    instance: dg.DagsterInstance,
):
    other = another_workers_jane_task(queue)
    sync_limits(queue, load_platform_settings(platforms_file(tmp_path)))
    [store] = add_stores(conn, 1, platform="jane")
    task_id = queue.enqueue("product_discovery", store, platform="jane")

    healthy = evaluate_health(instance, db_url, webhook, None)
    assert (healthy.skip_message, webhook.posts) == ("healthy", [])

    # The outage: one alert, naming the platform and the answer that paused it.
    pause_jane(queue, other)
    first = evaluate_health(instance, db_url, webhook, healthy.cursor)
    assert webhook.titles() == ["platform jane is paused"]
    post = webhook.posts[0]
    assert OUTAGE in post["text"] and "1 pause(s) in a row" in post["text"], post["text"]
    assert "without spending retries" in post["text"]
    assert list(json.loads(first.cursor)["alerts"]) == ["paused:jane"]

    # Still paused, then half-open (the pause is over, the probe goes out): the same outage.
    again = evaluate_health(instance, db_url, webhook, first.cursor)
    assert again.skip_message == "alerting: paused:jane"
    conn.execute("UPDATE tq_platforms SET paused_until = now() WHERE platform = 'jane'")  # the pause ran out
    [probe] = queue.claim_many("product_discovery", "prober", 5, start=True)
    assert probe.id == task_id
    assert queue.platform_request(probe, first=True).decision == "probe"
    probing = evaluate_health(instance, db_url, webhook, again.cursor)
    assert [r["state"] for r in queue.platform_status() if r["platform"] == "jane"] == ["probing"]
    assert probing.skip_message == "alerting: paused:jane"
    assert webhook.titles() == ["platform jane is paused"]  # not sent again

    # The probe completes: jane is open, the alert's key clears.
    assert queue.complete(probe, {"ok": True})
    assert [r["state"] for r in queue.platform_status() if r["platform"] == "jane"] == ["open"]
    cleared = evaluate_health(instance, db_url, webhook, probing.cursor)
    assert (cleared.skip_message, json.loads(cleared.cursor)["alerts"]) == ("healthy", {})

    # The next outage is a new one: alerted again.
    pause_jane(queue, other)
    evaluate_health(instance, db_url, webhook, cleared.cursor)
    assert webhook.titles() == ["platform jane is paused"] * 2


# -- tq platforms [--sync] ----------------------------------------------------------------------


def table(out: str) -> dict[str, list[str]]:
    """The rows of `tq platforms` by platform, as words (after the header)."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("platform "))
    assert lines[header].split()[:4] == ["platform", "state", "in", "flight"], lines[header]
    return {line.split()[0]: line.split()[1:] for line in lines[header + 1 :]}


def test_tq_platforms_sync_loads_the_file_and_prints_each_platform(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.setenv("TQ_DATABASE_URL", db_url)
    path = platforms_file(tmp_path)
    other = another_workers_jane_task(queue)

    assert main(["platforms", "--sync", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"limits loaded from {path}: 2 platform(s) changed"
    assert table(out) == {
        "dutchie": ["open", "0/3", "5", "2", "0s", "0"],
        "jane": ["open", "0/4", "10", "4", "0s", "0"],
    }
    assert limits_in_queue(conn) == LIMITS

    # What is in flight and what is paused shows; a second sync changes nothing and keeps both.
    [store] = add_stores(conn, 1)
    queue.enqueue("product_discovery", store, platform="dutchie")
    assert len(queue.claim_many("product_discovery", "someone", 5, start=True)) == 1
    pause_jane(queue, other)
    assert main(["platforms", "--sync", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"limits loaded from {path}: 0 platform(s) changed"
    rows = table(out)
    assert rows["dutchie"] == ["open", "1/3", "5", "2", "0s", "0"]
    assert rows["jane"][:4] == ["paused", "0/4", "10", "4"], rows["jane"]
    assert re.fullmatch(r"\d+s", rows["jane"][4]) and 55 <= int(rows["jane"][4][:-1]) <= 60, rows["jane"]
    assert rows["jane"][5] == "1" and " ".join(rows["jane"][6:]) == OUTAGE

    # Without --sync: the same table, nothing loaded.
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("limits loaded") and set(table(out)) == {"dutchie", "jane"}


def test_tq_platforms_sync_refuses_a_bad_file_naming_the_key_and_changes_nothing(
    db_url: str,
    conn: psycopg.Connection,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.setenv("TQ_DATABASE_URL", db_url)
    assert main(["platforms", "--sync", "--file", str(platforms_file(tmp_path))]) == 0
    capsys.readouterr()
    before = conn.execute("SELECT l::text FROM tq_platforms l ORDER BY platform").fetchall()

    # dutchie's new limit is fine; jane's typo is not: nothing is loaded, not even dutchie's.
    bad = write_platforms(
        tmp_path,
        FILE.format(dutchie_in_flight=9).replace("max_in_flight = 4", "max_in_fligth = 4"),
        name="bad.toml",
    )
    assert main(["platforms", "--sync", "--file", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("tq platforms: ") and str(bad) in line and "[platforms.jane]" in line, line
    assert "max_in_fligth" in line, line
    assert conn.execute("SELECT l::text FROM tq_platforms l ORDER BY platform").fetchall() == before

    # --sync without a file anywhere: refused, nothing changed.
    assert main(["platforms", "--sync"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--file or set TQ_PLATFORMS_FILE" in line, line
    assert conn.execute("SELECT l::text FROM tq_platforms l ORDER BY platform").fetchall() == before
