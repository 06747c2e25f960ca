"""The crawl under Dagster: the jobs run in process against the test's own database and the menu
simulator's real HTTP servers on 127.0.0.1. A whole pass (store discovery to analytics) through
drain runs, the runs that must fail before touching a task, the periodic enqueuers, a failing
platform raising its alert on a real webhook, and the demo resync schedule."""

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dagster as dg
import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.dagster_helpers import Webhook, failure_text, op_metadata
from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.jobs import (
    drain_tasks_job,
    enqueue_analytics_refresh_job,
    enqueue_store_discovery_job,
    generate_resync_tasks_job,
)
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.schedules import (
    analytics_refresh_schedule,
    store_discovery_schedule,
)
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines_demo.dagster import demo_crawl_job, demo_crawl_schedule
from tq_pipelines_demo.simulator import REGIONS, PlatformProfile, Simulator, SimulatorProcess, platforms_toml

PLATFORMS = ("dutchie", "jane")
STORES = 12  # per platform: four per region
MAX_IN_FLIGHT = 3
AUTO_CONCURRENCY = 2 * MAX_IN_FLIGHT * len(PLATFORMS)  # what concurrency 0 sizes an HTTP drain to
HTTP_ROLES = ("store_discovery", "entry_point_discovery", "product_discovery", "product_resync")
ROOT = Path(__file__).resolve().parents[2]


# -- helpers (run_job, op_metadata and failure_text as in test_dagster_jobs) ---------------------


def run_job(
    job: dg.JobDefinition,
    database_url: str,
    *,
    platforms_file: Path | None = None,
    run_config: dict | None = None,
    partition_key: str | None = None,
) -> dg.ExecuteInProcessResult:
    """One in-process run; never raises. No platforms_file: the crawl resource's default."""
    return job.execute_in_process(
        run_config=run_config,
        resources={
            "tq": QueueResource(database_url=database_url),
            "crawl": CrawlResource(platforms_file=str(platforms_file) if platforms_file else ""),
        },
        partition_key=partition_key,
        raise_on_error=False,
    )


def drain(
    database_url: str, role: str, platforms_file: Path | None = None, **config: Any
) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"drain_role_tasks": {"config": {"role": role, **config}}}}
    return run_job(drain_tasks_job, database_url, platforms_file=platforms_file, run_config=run_config)


def resync(
    database_url: str, day: str, platforms_file: Path | None = None, **config: Any
) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"generate_resync_tasks": {"config": config}}} if config else None
    return run_job(
        generate_resync_tasks_job,
        database_url,
        platforms_file=platforms_file,
        run_config=run_config,
        partition_key=day,
    )


def assert_drained(
    result: dg.ExecuteInProcessResult, tasks: int, concurrency: int, **outcomes: int
) -> dict[str, Any]:
    """The drain run succeeded and did exactly this: ``tasks`` claimed, all completed unless
    ``outcomes`` says otherwise (completed=, retried=, failed=)."""
    assert result.success, failure_text(result)
    meta = op_metadata(result, "drain_role_tasks")
    expected = {"completed": tasks, "retried": 0, "failed": 0, **outcomes}
    got = {
        k: meta[k] for k in ("claimed", "completed", "retried", "failed", "deferred", "lost", "concurrency")
    }
    assert got == {"claimed": tasks, **expected, "deferred": 0, "lost": 0, "concurrency": concurrency}
    assert meta["worker_id"] == f"{meta['role']}@run:{result.run_id}"
    return meta


def tasks_of(conn: psycopg.Connection, role: str) -> list[tuple]:
    """(dispensary_id, platform, status, retry_count, worker_id, result) of the role's tasks."""
    return conn.execute(
        "SELECT dispensary_id, platform, status, retry_count, worker_id, result FROM v_tasks "
        "WHERE role = %s ORDER BY dispensary_id NULLS FIRST, id",
        (role,),
    ).fetchall()


def untouched(conn: psycopg.Connection) -> list[tuple]:
    """Tasks a run claimed, started, failed or retried: none for a run that failed up front."""
    return conn.execute(
        "SELECT id, role, status, retry_count, worker_id FROM v_tasks "
        "WHERE status <> 'pending' OR retry_count <> 0 OR worker_id IS NOT NULL "
        "   OR claimed_at IS NOT NULL OR started_at IS NOT NULL OR error_message IS NOT NULL"
    ).fetchall()


def write_platforms(tmp_path: Path, text: str, name: str = "platforms.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the simulator ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from the shell decides where the platforms are or which handlers run."""
    for name in ("TQ_PLATFORMS_FILE", "TQ_HANDLERS", "TQ_ROLE_CAPS", "TQ_ALERT_WEBHOOK_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def simulate() -> Iterator[Callable[..., Simulator]]:
    """``simulate(jane={"rate_500": 1.0})``: a started simulator of PLATFORMS, STORES stores each,
    fast and fault-free unless told; menus do not change during a test. Stopped at the end."""
    started: list[Simulator] = []

    def start(**faults: dict[str, Any]) -> Simulator:
        profiles = [
            PlatformProfile(
                name,
                stores=STORES,
                latency_ms=5,
                jitter=0.5,  # 2.5 to 7.5 ms
                change_seconds=86_400,
                seed=11,
                **faults.get(name, {}),
            )
            for name in PLATFORMS
        ]
        sim = Simulator(profiles)
        started.append(sim)
        return sim.start()

    yield start
    for sim in started:
        sim.stop()


def platforms_file(tmp_path: Path, sim: Simulator) -> Path:
    """The simulator's platforms file, with politeness limits that never hold a test back."""
    return write_platforms(
        tmp_path,
        sim.platforms_toml(max_in_flight=MAX_IN_FLIGHT, requests_per_second=500, timeout_seconds=5),
    )


# -- 1. a whole pass, end to end through drain runs ----------------------------------------------


def test_a_whole_crawl_pass_through_dagster_runs(
    db_url: str, conn: psycopg.Connection, simulate: Callable[..., Simulator], tmp_path: Path
):
    sim = simulate()
    path = platforms_file(tmp_path, sim)
    fleet = {(name, s.directory_id): s for name, p in sim.platforms.items() for s in p.stores.values()}
    assert len(fleet) == len(PLATFORMS) * STORES

    # The periodic enqueuer: one store_discovery task per platform and region.
    result = run_job(enqueue_store_discovery_job, db_url, platforms_file=path)
    assert result.success, failure_text(result)
    assert op_metadata(result, "enqueue_store_discovery_tasks") == {
        "created": len(PLATFORMS) * len(REGIONS),
        "platforms": ", ".join(PLATFORMS),
    }
    assert sorted(
        conn.execute(
            "SELECT platform, payload->>'platform', payload->>'region' FROM v_tasks "
            "WHERE role = 'store_discovery' AND payload - 'platform' - 'region' = '{}'"
        ).fetchall()
    ) == sorted((p, p, r) for p in PLATFORMS for r in REGIONS)

    # store_discovery: every store listed, with a dispensaries row, a crawl state and a task.
    result = drain(db_url, "store_discovery", path)
    assert_drained(result, len(PLATFORMS) * len(REGIONS), AUTO_CONCURRENCY)
    # The run loaded the file's limits, and each platform's hosts: its base URL's (none given).
    assert conn.execute("SELECT platform, hosts FROM tq_platforms ORDER BY platform").fetchall() == [
        (p, ["127.0.0.1"]) for p in PLATFORMS
    ]
    listings = conn.execute(
        "SELECT result FROM v_tasks WHERE role = 'store_discovery' AND status = 'completed'"
    ).fetchall()
    per_region = STORES // len(REGIONS)
    assert sorted((r["platform"], r["region"], r["listed"], r["new"]) for (r,) in listings) == sorted(
        (p, region, per_region, per_region) for p in PLATFORMS for region in REGIONS
    )
    stores = conn.execute(
        "SELECT c.platform, c.directory_id, c.dispensary_id, c.region, d.name, d.menu_type, "
        "       d.crawl_enabled, d.platform_dispensary_id "
        "FROM store_crawl_state c JOIN dispensaries d ON d.id = c.dispensary_id"
    ).fetchall()
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone()[0] == len(fleet)
    assert {(r[0], r[1]): (r[3], r[4], r[5], r[6], r[7]) for r in stores} == {
        (p, d): (s.region, s.name, p, True, None) for (p, d), s in fleet.items()
    }
    ids = {(r[0], r[1]): r[2] for r in stores}  # (platform, directory id) -> dispensary id
    sim_store = {ids[k]: (k[0], s) for k, s in fleet.items()}  # dispensary id -> (platform, store)
    assert [(t[0], t[1], t[2]) for t in tasks_of(conn, "entry_point_discovery")] == [
        (i, sim_store[i][0], "pending") for i in sorted(sim_store)
    ]

    # entry_point_discovery: every store resolved to its platform id and menu URL.
    result = drain(db_url, "entry_point_discovery", path)
    assert_drained(result, len(fleet), AUTO_CONCURRENCY)
    resolved = conn.execute(
        "SELECT d.id, d.platform_dispensary_id, c.menu_url, c.resolved_at IS NOT NULL "
        "FROM dispensaries d JOIN store_crawl_state c ON c.dispensary_id = d.id"
    ).fetchall()
    assert sorted(resolved) == [
        (i, s.platform_id, f"/menus/{s.platform_id}", True)  # as given: relative to base_url
        for i, (p, s) in sorted(sim_store.items())
    ]
    assert [(t[0], t[2]) for t in tasks_of(conn, "product_discovery")] == [
        (i, "pending") for i in sorted(sim_store)
    ]

    # product_discovery: every menu stored, product for product.
    result = drain(db_url, "product_discovery", path, concurrency=0)  # 0: sized from the platforms
    assert_drained(result, len(fleet), AUTO_CONCURRENCY)
    menus = {i: sim.platforms[p].menu(s) for i, (p, s) in sim_store.items()}
    stored = conn.execute(
        "SELECT dispensary_id, external_id, price, in_stock FROM products WHERE gone_at IS NULL"
    ).fetchall()
    assert len(stored) == sum(len(m) for m in menus.values()) == sum(s.products for _, s in fleet.items())
    assert sorted(stored) == sorted(
        (i, p["id"], Decimal(str(p["price"])).quantize(Decimal("0.01")), p["in_stock"])
        for i, menu in menus.items()
        for p in menu
    )
    for dispensary_id, _, _, _, _, task_result in tasks_of(conn, "product_discovery"):
        products = len(menus[dispensary_id])
        assert (task_result["seen"], task_result["new"], task_result["unchanged"]) == (
            products,
            products,
            False,
        )
    history = conn.execute("SELECT count(*) FROM product_history").fetchone()[0]
    assert history == len(stored)  # one 'new' row per product

    # The day's resync, platforms from the platforms file (batches_per_day=1: all due now).
    today = datetime.now(UTC).date()
    result = resync(db_url, today.isoformat(), path, batches_per_day=1)
    assert result.success, failure_text(result)
    meta = op_metadata(result, "generate_resync_tasks")
    assert (meta["created"], meta["date"], meta["platforms"]) == (
        len(fleet),
        today.isoformat(),
        "dutchie, jane",
    )

    # product_resync: one task per store, each finding the menu it stored (same version).
    result = drain(db_url, "product_resync", path)
    assert_drained(result, len(fleet), AUTO_CONCURRENCY)
    resyncs = conn.execute(
        "SELECT dispensary_id, status, resync_date, result, completed_at FROM v_tasks "
        "WHERE role = 'product_resync' ORDER BY dispensary_id"
    ).fetchall()
    assert [r[0] for r in resyncs] == sorted(sim_store)
    for dispensary_id, status, resync_date, task_result, _ in resyncs:
        assert (status, resync_date) == ("completed", today)
        assert task_result["unchanged"] is True, task_result
        assert (task_result["seen"], task_result["new"], task_result["changed"], task_result["gone"]) == (
            len(menus[dispensary_id]),
            0,
            0,
            0,
        )
    assert conn.execute("SELECT count(*) FROM product_history").fetchone()[0] == history

    # analytics_refresh: one task, run inline (no HTTP), a row per store.
    result = run_job(enqueue_analytics_refresh_job, db_url)
    assert result.success, failure_text(result)
    assert op_metadata(result, "enqueue_analytics_refresh_task") == {"created": 1}
    result = drain(db_url, "analytics_refresh", path)
    assert_drained(result, 1, 1)
    [(_, _, status, _, _, summary)] = tasks_of(conn, "analytics_refresh")
    assert status == "completed"
    assert (summary["stores"], summary["products_listed"], summary["stale_stores"]) == (
        len(fleet),
        len(stored),
        0,
    )
    crawled_at = dict(conn.execute("SELECT dispensary_id, last_crawl_at FROM store_crawl_state").fetchall())
    analytics = conn.execute(
        "SELECT dispensary_id, platform, products_listed, products_in_stock, last_success_at "
        "FROM store_analytics ORDER BY dispensary_id"
    ).fetchall()
    assert analytics == [
        (
            i,
            sim_store[i][0],
            len(menus[i]),
            sum(p["in_stock"] for p in menus[i]),
            crawled_at[i],  # the latest menu stored or found unchanged
        )
        for i in sorted(sim_store)
    ]
    assert status_counts(conn) == {"completed": len(PLATFORMS) * len(REGIONS) + 3 * len(fleet) + 1}
    assert_store_state_consistent(conn)

    # The next discovery pass lists the same stores: nothing new, nothing more to resolve.
    result = run_job(enqueue_store_discovery_job, db_url, platforms_file=path)
    assert op_metadata(result, "enqueue_store_discovery_tasks")["created"] == len(PLATFORMS) * len(REGIONS)
    result = drain(db_url, "store_discovery", path)
    assert_drained(result, len(PLATFORMS) * len(REGIONS), AUTO_CONCURRENCY)
    listings = conn.execute(
        "SELECT result FROM v_tasks WHERE role = 'store_discovery' AND worker_id = %s",
        (f"store_discovery@run:{result.run_id}",),
    ).fetchall()
    assert sorted((r["listed"], r["new"]) for (r,) in listings) == [(per_region, 0)] * len(listings)
    assert len(listings) == len(PLATFORMS) * len(REGIONS)
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone()[0] == len(fleet)
    assert len(tasks_of(conn, "entry_point_discovery")) == len(fleet)


def test_the_platforms_files_hosts_reach_the_queue_through_the_drain_runs(
    db_url: str, conn: psycopg.Connection, simulate: Callable[..., Simulator], tmp_path: Path
):
    """Both platforms' entry points answer absolute menu URLs naming their server as
    ``localhost``. dutchie's ``hosts`` in the platforms file list it: the drain run loads them into
    tq_platforms.hosts, the URLs are saved and the menus fetched. jane has no ``hosts`` (its base
    URL's host only): its entry points fail, nothing saved, and its menus are never asked for."""
    sim = simulate()
    for platform in sim.platforms.values():
        platform.profile.menu_url_base = f"http://localhost:{urlsplit(platform.base_url).port}"
    limits = {"max_in_flight": MAX_IN_FLIGHT, "requests_per_second": 500, "timeout_seconds": 5}
    path = write_platforms(
        tmp_path,
        platforms_toml(
            {"dutchie": sim.platforms["dutchie"].base_url}, **limits, hosts=["localhost", "127.0.0.1"]
        )
        + "\n"
        + platforms_toml({"jane": sim.platforms["jane"].base_url}, **limits),
    )

    assert run_job(enqueue_store_discovery_job, db_url, platforms_file=path).success
    assert_drained(drain(db_url, "store_discovery", path), len(PLATFORMS) * len(REGIONS), AUTO_CONCURRENCY)
    assert conn.execute("SELECT platform, hosts FROM tq_platforms ORDER BY platform").fetchall() == [
        ("dutchie", ["127.0.0.1", "localhost"]),
        ("jane", ["127.0.0.1"]),
    ]

    conn.execute("UPDATE worker_tasks SET max_retries = 0 WHERE role = 'entry_point_discovery'")
    result = drain(db_url, "entry_point_discovery", path)
    assert_drained(result, 2 * STORES, AUTO_CONCURRENCY, completed=STORES, failed=STORES)
    resolved = conn.execute(
        "SELECT c.platform, c.directory_id, d.platform_dispensary_id, c.menu_url, t.status, t.error_message "
        "FROM store_crawl_state c JOIN dispensaries d ON d.id = c.dispensary_id "
        "JOIN v_tasks t ON t.dispensary_id = d.id AND t.role = 'entry_point_discovery'"
    ).fetchall()
    assert len(resolved) == 2 * STORES
    for platform, directory_id, platform_id, menu_url, status, error in resolved:
        store = sim.platforms[platform].stores[directory_id]
        base = sim.platforms[platform].profile.menu_url_base
        if platform == "dutchie":
            assert (platform_id, menu_url, status) == (
                store.platform_id,
                f"{base}/menus/{store.platform_id}",
                "completed",
            )
        else:
            assert (platform_id, menu_url, status) == (None, None, "failed")
            assert f"save_entry_point: menu_url {base}/... is not on the hosts of platform" in error, error
            assert "(127.0.0.1)" in error and store.platform_id not in error, error
    jane_requests = sim.platforms["jane"].stats.requests
    assert jane_requests == len(REGIONS) + STORES  # its listings and entry points

    result = drain(db_url, "product_discovery", path)
    assert_drained(result, STORES, AUTO_CONCURRENCY)
    assert conn.execute(
        "SELECT DISTINCT d.menu_type FROM products p JOIN dispensaries d ON d.id = p.dispensary_id"
    ).fetchall() == [("dutchie",)]
    assert sim.platforms["dutchie"].stats.answers[200] == len(REGIONS) + 2 * STORES  # and its menus
    assert sim.platforms["jane"].stats.requests == jane_requests


# -- 2. runs that must fail before touching a task -----------------------------------------------


def seed_role(conn: psycopg.Connection, queue: TaskQueue, role: str) -> int:
    """Pending tasks of ``role``; returns how many."""
    if role == "store_discovery":
        for region in REGIONS:
            queue.enqueue(role, platform="dutchie", payload={"platform": "dutchie", "region": region})
        return len(REGIONS)
    return add_tasks(conn, role, add_stores(conn, 3), 1)


@pytest.mark.parametrize("role", HTTP_ROLES)
def test_http_drain_without_platforms_fails_the_run_and_claims_nothing(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, role: str
):
    seeded = seed_role(conn, queue, role)
    result = drain(db_url, role)  # CrawlResource() and no TQ_PLATFORMS_FILE
    assert not result.success
    text = failure_text(result)
    assert "TQ_PLATFORMS_FILE" in text
    assert role in text
    assert untouched(conn) == []
    assert status_counts(conn) == {"pending": seeded}
    assert conn.execute("SELECT count(*) FROM worker_registry").fetchone()[0] == 0


BAD_FILES = {
    "unknown key": (
        '[platforms.dutchie]\nbase_url = "http://127.0.0.1:9/dutchie"\n\n'
        '[platforms.jane]\nbase_url = "http://127.0.0.1:9/jane"\nmax_inflight = 3\n',
        "max_inflight",
    ),
    "bad base_url": (
        '[platforms.dutchie]\nbase_url = "http://127.0.0.1:9/dutchie"\n\n'
        '[platforms.jane]\nbase_url = "ftp://menus.example.com/jane"\n',
        "base_url",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_platforms_file_fails_the_runs_naming_file_and_key(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, tmp_path: Path, case: str
):
    text, key = BAD_FILES[case]
    path = write_platforms(tmp_path, text, name=f"bad-{key}.toml")
    seeded = seed_role(conn, queue, "product_discovery")
    add_stores(conn, 2, platform="jane")  # resolved stores a resync would pick

    runs = {
        "drain": drain(db_url, "product_discovery", path),
        "store discovery": run_job(enqueue_store_discovery_job, db_url, platforms_file=path),
        "resync": resync(db_url, "2026-06-01", path),
    }
    for name, result in runs.items():
        assert not result.success, name
        failure = failure_text(result)
        assert str(path) in failure, (name, failure)
        assert "[platforms.jane]" in failure, (name, failure)
        assert key in failure, (name, failure)
        assert "platforms_file" in failure, (name, failure)
    assert untouched(conn) == []
    assert status_counts(conn) == {"pending": seeded}
    assert conn.execute("SELECT count(*) FROM worker_registry").fetchone()[0] == 0


def test_an_unloadable_adapter_fails_the_drain_naming_file_and_platform(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, tmp_path: Path
):
    path = write_platforms(
        tmp_path,
        '[platforms.dutchie]\nbase_url = "http://127.0.0.1:9/d"\n\n'
        '[platforms.jane]\nbase_url = "http://127.0.0.1:9/j"\nadapter = "tq_no_such_adapter:factory"\n',
    )
    seeded = seed_role(conn, queue, "product_discovery")
    result = drain(db_url, "product_discovery", path)
    assert not result.success
    assert untouched(conn) == []
    assert status_counts(conn) == {"pending": seeded}
    failure = failure_text(result)
    assert "tq_no_such_adapter:factory" in failure
    # As for every other mistake in the file: which file, which platform.
    assert str(path) in failure, failure
    assert "[platforms.jane]" in failure, failure


def test_an_http_role_with_its_own_handler_needs_no_platforms(
    db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    """The run fails for want of platforms only when the built-in handler would need them."""
    monkeypatch.setenv("TQ_HANDLERS", "product_resync=tq_pipelines.handlers:noop")
    add_tasks(conn, "product_resync", add_stores(conn, 3), 1)
    result = drain(db_url, "product_resync")
    assert_drained(result, 3, 1)  # no platforms to size it from: inline
    assert conn.execute("SELECT DISTINCT status, result->>'handler' FROM v_tasks").fetchall() == [
        ("completed", "noop")
    ]


@pytest.mark.parametrize("with_file", [False, True], ids=["no platforms file", "broken platforms file"])
def test_analytics_refresh_drains_without_platform_settings(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, tmp_path: Path, with_file: bool
):
    [store] = add_stores(conn, 1)
    products = [
        {"id": "a", "name": "A", "brand": None, "category": "flower", "price": "10.00", "thc": None,
         "cbd": None, "in_stock": True},
        {"id": "b", "name": "B", "brand": None, "category": "vape", "price": "20.00", "thc": None,
         "cbd": None, "in_stock": False},
    ]  # fmt: skip
    # Setup only: the body behind store_menu (which a held task's lease calls), as the superuser.
    conn.execute("SELECT * FROM tq_store_menu(%s, 'hash', %s)", (store, Jsonb(products)))
    queue.enqueue("analytics_refresh")
    path = write_platforms(tmp_path, BAD_FILES["unknown key"][0]) if with_file else None

    result = drain(db_url, "analytics_refresh", path)
    assert_drained(result, 1, 1)
    assert conn.execute(
        "SELECT dispensary_id, products_listed, products_in_stock, last_success_at IS NOT NULL"
        " FROM store_analytics"
    ).fetchall() == [(store, 2, 1, True)]  # its menu was stored


# -- 3. the periodic enqueuers -------------------------------------------------------------------


def test_store_discovery_is_enqueued_once_per_platform_and_region_while_queued(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, tmp_path: Path
):
    path = write_platforms(
        tmp_path,
        '[platforms.dutchie]\nbase_url = "http://127.0.0.1:9/d"\nregions = ["north", "south", "east"]\n\n'
        '[platforms.jane]\nbase_url = "http://127.0.0.1:9/j"\n',  # no regions: the whole directory
    )
    expected = sorted(
        [("dutchie", json.dumps({"platform": "dutchie", "region": r})) for r in REGIONS]
        + [("jane", json.dumps({"platform": "jane"}))]
    )

    first = run_job(enqueue_store_discovery_job, db_url, platforms_file=path)
    assert first.success, failure_text(first)
    assert op_metadata(first, "enqueue_store_discovery_tasks") == {"created": 4, "platforms": "dutchie, jane"}
    second = run_job(enqueue_store_discovery_job, db_url, platforms_file=path)
    assert second.success, failure_text(second)
    assert op_metadata(second, "enqueue_store_discovery_tasks")["created"] == 0
    rows = conn.execute("SELECT id, platform, payload, status FROM v_tasks ORDER BY id").fetchall()
    assert sorted((p, json.dumps(payload, sort_keys=True)) for _, p, payload, _ in rows) == expected
    assert {s for _, _, _, s in rows} == {"pending"}
    last_id = rows[-1][0]

    # One still running, one done: only the one done is queued again.
    running = queue.claim("store_discovery", "someone")
    done = queue.claim("store_discovery", "someone-else")
    assert running is not None and done is not None
    assert queue.complete(done, {"listed": 0})
    third = run_job(enqueue_store_discovery_job, db_url, platforms_file=path)
    assert third.success, failure_text(third)
    assert op_metadata(third, "enqueue_store_discovery_tasks")["created"] == 1
    assert conn.execute(
        "SELECT platform, payload, status FROM v_tasks WHERE id > %s", (last_id,)
    ).fetchall() == [(done.platform, done.payload, "pending")]


def test_store_discovery_enqueuer_without_platforms_fails_naming_the_setting(
    db_url: str, conn: psycopg.Connection
):
    result = run_job(enqueue_store_discovery_job, db_url)
    assert not result.success
    assert "TQ_PLATFORMS_FILE" in failure_text(result)
    assert status_counts(conn) == {}


def test_analytics_refresh_is_enqueued_once_while_queued(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    created = []
    for _ in range(2):
        result = run_job(enqueue_analytics_refresh_job, db_url)
        assert result.success, failure_text(result)
        created.append(op_metadata(result, "enqueue_analytics_refresh_task")["created"])
    assert created == [1, 0]
    assert conn.execute("SELECT role, status, count(*) FROM v_tasks GROUP BY 1, 2").fetchall() == [
        ("analytics_refresh", "pending", 1)
    ]

    # Claimed: still not queued again. Finished: queued again.
    task = queue.claim("analytics_refresh", "refresher")
    assert task is not None
    result = run_job(enqueue_analytics_refresh_job, db_url)
    assert op_metadata(result, "enqueue_analytics_refresh_task")["created"] == 0
    assert queue.complete(task, {})
    result = run_job(enqueue_analytics_refresh_job, db_url)
    assert op_metadata(result, "enqueue_analytics_refresh_task")["created"] == 1
    assert status_counts(conn) == {"completed": 1, "pending": 1}


# -- 4. a failing platform raises its alert ------------------------------------------------------


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def evaluate_health(
    instance: dg.DagsterInstance, db_url: str, webhook: Webhook, cursor: str | None, **limits: Any
) -> Any:
    resources = {
        "tq": QueueResource(database_url=db_url),
        "alerts": AlertResource(webhook_url=webhook.url),
        "health": HealthThresholds(**limits),
    }
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        return queue_health_sensor.evaluate_tick(ctx)


def add_simulated_stores(
    conn: psycopg.Connection, queue: TaskQueue, sim: Simulator | SimulatorProcess
) -> dict[int, str]:
    """The simulator's stores as resolved stores, each with a product_discovery task; returns
    dispensary id -> platform."""
    platform_of = {}
    for name, platform in sim.platforms.items():
        for s in platform.stores.values():
            [store_id] = conn.execute(
                "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id, crawl_enabled) "
                "VALUES (%s, %s, %s, true) RETURNING id",
                (s.name, name, s.platform_id),
            ).fetchone()
            queue.enqueue("product_discovery", store_id, platform=name)
            platform_of[store_id] = name
    return platform_of


def test_a_failing_platform_is_alerted_once_and_the_healthy_one_not(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., Simulator],
    tmp_path: Path,
    webhook: Webhook,
    instance: dg.DagsterInstance,
):
    sim = simulate(jane={"rate_500": 1.0})
    # A breaker that does not trip here: this is the alert on the platform's error rate.
    path = write_platforms(
        tmp_path,
        sim.platforms_toml(
            max_in_flight=MAX_IN_FLIGHT, requests_per_second=500, timeout_seconds=5, pause_after_errors=100
        ),
    )
    platform_of = add_simulated_stores(conn, queue, sim)

    result = drain(db_url, "product_discovery", path, concurrency=5)  # set: not sized from the platforms
    assert_drained(result, 2 * STORES, 5, completed=STORES, retried=STORES)
    rows = conn.execute(
        "SELECT dispensary_id, status, retry_count, error_message, scheduled_for > now() "
        "FROM v_tasks ORDER BY dispensary_id"
    ).fetchall()
    assert len(rows) == 2 * STORES
    for store_id, status, retries, error, later in rows:
        if platform_of[store_id] == "jane":
            assert (status, retries, later) == ("pending", 1, True), store_id
            assert error.startswith("TransientTaskError: HTTP 500 for "), error
        else:
            assert (status, retries, error) == ("completed", 0, None), store_id
    assert conn.execute(
        "SELECT DISTINCT d.menu_type FROM products p JOIN dispensaries d ON d.id = p.dispensary_id"
    ).fetchall() == [("dutchie",)]

    # 12 errors: under a minimum of 13 nothing is said, at 5 jane is reported.
    quiet = evaluate_health(instance, db_url, webhook, None, platform_min_errors=STORES + 1)
    assert webhook.posts == []
    assert quiet.skip_message == "healthy"

    first = evaluate_health(instance, db_url, webhook, quiet.cursor, platform_min_errors=5)
    assert webhook.titles() == ["platform jane is failing"]
    post = webhook.posts[0]
    assert f"{STORES} of {STORES} tasks on jane" in post["text"]
    assert "HTTP 500" in post["text"]
    assert post["severity"] == "error"
    assert list(json.loads(first.cursor)["alerts"]) == ["platform:jane"]

    again = evaluate_health(instance, db_url, webhook, first.cursor, platform_min_errors=5)
    assert webhook.titles() == ["platform jane is failing"]  # not sent twice
    assert again.skip_message == "alerting: platform:jane"
    assert list(json.loads(again.cursor)["alerts"]) == ["platform:jane"]


# -- 5. the demo crawl schedule ------------------------------------------------------------------


def test_demo_crawl_resyncs_every_crawlable_store_once_at_a_time(
    db_url: str, conn: psycopg.Connection, instance: dg.DagsterInstance
):
    stores = add_stores(conn, 4)
    conn.execute("UPDATE dispensaries SET crawl_enabled = false WHERE id = %s", (stores[0],))
    conn.execute("UPDATE dispensaries SET platform_dispensary_id = NULL WHERE id = %s", (stores[1],))
    with dg.build_schedule_context(
        instance=instance, scheduled_execution_time=datetime(2026, 6, 1, 10, 0, tzinfo=UTC)
    ) as ctx:
        [request] = demo_crawl_schedule.evaluate_tick(ctx).run_requests

    first = run_job(demo_crawl_job, db_url, run_config=request.run_config)
    again = run_job(demo_crawl_job, db_url, run_config=request.run_config)
    assert first.success and again.success, failure_text(first) + failure_text(again)
    assert op_metadata(first, "enqueue_demo_crawl")["created"] == 2
    assert op_metadata(again, "enqueue_demo_crawl")["created"] == 0  # still pending: none twice
    assert conn.execute(
        "SELECT dispensary_id, resync_date FROM v_tasks WHERE role = 'product_resync' ORDER BY 1"
    ).fetchall() == [(stores[2], None), (stores[3], None)]

    conn.execute("UPDATE worker_tasks SET status = 'completed', completed_at = now()")
    third = run_job(demo_crawl_job, db_url, run_config=request.run_config)
    assert op_metadata(third, "enqueue_demo_crawl")["created"] == 2  # done: the next tick crawls again


def test_demo_crawl_opens_with_the_platforms_in_turn(db_url: str, conn: psycopg.Connection):
    for platform in ("jane", "dutchie"):
        conn.execute(
            "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)"
            " SELECT %s || g, %s, %s || g FROM generate_series(1, 3) g",
            (platform, platform, platform),
        )
    assert op_metadata(run_job(demo_crawl_job, db_url), "enqueue_demo_crawl")["created"] == 6
    order = [r[0] for r in conn.execute("SELECT platform FROM v_tasks ORDER BY due_at").fetchall()]
    assert order == ["dutchie", "jane"] * 3


def test_periodic_schedules_run_their_enqueuers(
    db_url: str, conn: psycopg.Connection, tmp_path: Path, instance: dg.DagsterInstance
):
    """store_discovery_schedule and analytics_refresh_schedule: UTC, and each tick's request runs
    its enqueuer as is (no config to fill in)."""
    path = write_platforms(
        tmp_path, '[platforms.jane]\nbase_url = "http://127.0.0.1:9/j"\nregions = ["east"]\n'
    )
    tick = datetime(2026, 6, 1, 23, 0, tzinfo=UTC)
    for schedule, job in (
        (store_discovery_schedule, enqueue_store_discovery_job),
        (analytics_refresh_schedule, enqueue_analytics_refresh_job),
    ):
        assert (schedule.job_name, schedule.execution_timezone) == (job.name, "UTC")
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=tick) as ctx:
            [request] = schedule.evaluate_tick(ctx).run_requests
        result = run_job(job, db_url, platforms_file=path, run_config=request.run_config)
        assert result.success, failure_text(result)
    assert conn.execute("SELECT role, platform, payload FROM v_tasks ORDER BY role").fetchall() == [
        ("analytics_refresh", None, {}),
        ("store_discovery", "jane", {"platform": "jane", "region": "east"}),
    ]


DEFS_SCHEDULES = "from tq_pipelines.definitions import defs; print([s.name for s in defs.schedules])"


@pytest.mark.parametrize(
    ("value", "included"),
    [("1", True), (None, False), ("0", False), ("true", False)],
    ids=["TQ_DEMO=1", "unset", "TQ_DEMO=0", "TQ_DEMO=true"],
)
def test_definitions_include_the_demo_schedule_only_with_tq_demo_1(value: str | None, included: bool):
    env = {k: v for k, v in os.environ.items() if k not in ("TQ_DEMO", "TQ_HANDLERS")}
    if value is not None:
        env["TQ_DEMO"] = value
    proc = subprocess.run(
        [sys.executable, "-c", DEFS_SCHEDULES],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    names = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert ("demo_crawl_schedule" in names) is included
    assert {
        "generate_resync_tasks_schedule",
        "recover_stale_tasks_schedule",
        "task_completion_log_schedule",
        "store_discovery_schedule",
        "analytics_refresh_schedule",
        "task_completion_log_current_hour_schedule",
        "store_freshness_schedule",
        "prune_schedule",
    } <= set(names)
    assert len(names) == 8 + included


# -- 6. which platforms the resync covers --------------------------------------------------------


def resync_tasks(conn: psycopg.Connection, day: str) -> list[tuple[int, str]]:
    return conn.execute(
        "SELECT dispensary_id, platform FROM v_tasks WHERE role = 'product_resync' "
        "AND resync_date = %s ORDER BY dispensary_id",
        (day,),
    ).fetchall()


def test_resync_platforms_come_from_the_crawl_settings_else_dutchie(
    db_url: str, conn: psycopg.Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = write_platforms(
        tmp_path,
        '[platforms.treez]\nbase_url = "http://127.0.0.1:9/t"\n\n'
        '[platforms.jane]\nbase_url = "http://127.0.0.1:9/j"\n',
    )
    dutchie = add_stores(conn, 2)
    jane = add_stores(conn, 3, platform="jane")
    treez = add_stores(conn, 4, platform="treez")
    add_stores(conn, 1, platform="other")
    configured = sorted([(s, "jane") for s in jane] + [(s, "treez") for s in treez])

    # The crawl resource's platforms file.
    result = resync(db_url, "2026-06-01", path)
    assert result.success, failure_text(result)
    meta = op_metadata(result, "generate_resync_tasks")
    assert (meta["created"], meta["platforms"]) == (7, "jane, treez")
    assert resync_tasks(conn, "2026-06-01") == configured

    # Explicit platforms win over the file.
    result = resync(db_url, "2026-06-02", path, platforms=["dutchie"])
    assert result.success, failure_text(result)
    assert op_metadata(result, "generate_resync_tasks")["platforms"] == "dutchie"
    assert resync_tasks(conn, "2026-06-02") == [(s, "dutchie") for s in dutchie]

    # TQ_PLATFORMS_FILE when the resource names none.
    monkeypatch.setenv("TQ_PLATFORMS_FILE", str(path))
    result = resync(db_url, "2026-06-03")
    assert result.success, failure_text(result)
    assert op_metadata(result, "generate_resync_tasks")["platforms"] == "jane, treez"
    assert resync_tasks(conn, "2026-06-03") == configured

    # No settings at all: dutchie.
    monkeypatch.delenv("TQ_PLATFORMS_FILE")
    result = resync(db_url, "2026-06-04")
    assert result.success, failure_text(result)
    meta = op_metadata(result, "generate_resync_tasks")
    assert (meta["created"], meta["platforms"]) == (2, "dutchie")
    assert resync_tasks(conn, "2026-06-04") == [(s, "dutchie") for s in dutchie]
    assert len(resync_tasks(conn, "2026-06-05")) == 0


def test_resync_of_todays_partition_covers_every_simulated_store(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., Simulator],
    tmp_path: Path,
):
    """The stores of every configured platform get a task, with the default config."""
    sim = simulate()
    platform_of = add_simulated_stores(conn, queue, sim)
    today = datetime.now(UTC).date().isoformat()
    result = resync(db_url, today, platforms_file(tmp_path, sim))
    assert result.success, failure_text(result)
    assert op_metadata(result, "generate_resync_tasks")["created"] == len(platform_of)
    assert resync_tasks(conn, today) == sorted(platform_of.items())
