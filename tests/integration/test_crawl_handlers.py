"""Crawl handlers end to end: the five roles run by the Worker against the menu simulator (real
HTTP on 127.0.0.1) and a real database. Listing, entry points and menus land where they should;
history is written only for changes; every failure class ends its task the right way; the
politeness limits hold on the server's side; a handler that lost its lease writes nothing."""

import contextlib
import dataclasses
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.helpers import assert_store_state_consistent, status_counts
from tq_pipelines.crawl.handlers import HANDLERS, enqueue_store_discovery
from tq_pipelines.crawl.platforms import CrawlServices, PlatformSettings, load_platform_settings, sync_limits
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import DrainStats, LeaseLostError, TaskContext, Worker
from tq_pipelines_demo.simulator import REGIONS, PlatformProfile, SimulatedPlatform, Simulator

# No rate limit to speak of and no hang longer than a test can afford, unless a test says so.
FAST = {"requests_per_second": 1000.0, "timeout_seconds": 5.0}
CENT = Decimal("0.01")
LOG = logging.getLogger(__name__)

Crawl = Callable[..., tuple[Simulator, CrawlServices]]


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def crawl(tmp_path: Path) -> Iterator[Crawl]:
    """Starts a simulator and the CrawlServices pointed at it; both closed after the test (the
    HTTP client first, so that no keep-alive connection holds a server thread).

    ``crawl(*profiles, **overrides)`` goes through a platforms file (the overrides apply to every
    platform); ``crawl(*profiles, per_platform={name: {...}})`` builds the settings directly."""
    files = itertools.count()
    with ExitStack() as stack:

        def start(
            *profiles: PlatformProfile,
            per_platform: dict[str, dict[str, Any]] | None = None,
            **overrides: Any,
        ) -> tuple[Simulator, CrawlServices]:
            sim = Simulator(list(profiles)).start()
            stack.callback(stop_quickly, sim)
            if per_platform is None:
                path = tmp_path / f"platforms-{next(files)}.toml"
                path.write_text(sim.platforms_toml(**(FAST | overrides)))
                settings = load_platform_settings(path)
            else:
                settings = {
                    name: PlatformSettings(
                        base_url=p.base_url, regions=list(REGIONS), **(FAST | per_platform.get(name, {}))
                    )
                    for name, p in sim.platforms.items()
                }
            services = stack.enter_context(CrawlServices(settings))
            return sim, services

        yield start


class MenuServer:
    """A loopback server answering ``GET /menus/<id>`` with what the test put in ``routes``:
    (status, body bytes). For menus the simulator never serves (invalid ones)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes]] = {}
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = routes.get(self.path, (404, b'{"error": "no route"}'))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.base_url = f"http://{host!s}:{port}"

    def menu(self, platform_id: str, products: Any) -> None:
        self.routes[f"/menus/{platform_id}"] = (200, json.dumps({"products": products}).encode())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def menu_server() -> Iterator[MenuServer]:
    server = MenuServer()
    yield server
    server.close()


# -- helpers -----------------------------------------------------------------------------------


def drain(
    queue: TaskQueue, role: str, services: CrawlServices, *, concurrency: int = 4, **kwargs: Any
) -> DrainStats:
    return Worker(
        queue,
        role,
        HANDLERS[role],
        worker_id=f"{role}-worker",
        concurrency=concurrency,
        services=services,
        **kwargs,
    ).run()


def seed_stores(
    conn: psycopg.Connection, platform: SimulatedPlatform, count: int | None = None
) -> dict[int, Any]:
    """Stores of a simulated platform as listing and entry-point resolution leave them (platform id
    known, no menu_url: the adapter's menu_path is used); returns {dispensary id: simulator store}."""
    out: dict[int, Any] = {}
    for store in list(platform.stores.values())[:count]:
        (dispensary_id,) = conn.execute(
            "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)"
            " VALUES (%s, %s, %s) RETURNING id",
            (store.name, platform.profile.name, store.platform_id),
        ).fetchone()
        conn.execute(
            "INSERT INTO store_crawl_state (dispensary_id, platform, directory_id, region)"
            " VALUES (%s, %s, %s, %s)",
            (dispensary_id, platform.profile.name, store.directory_id, store.region),
        )
        out[dispensary_id] = store
    return out


def enqueue_all(
    queue: TaskQueue, role: str, stores: dict[int, Any], platform: str, **kwargs: Any
) -> list[int]:
    return [queue.enqueue(role, d, platform=platform, **kwargs) for d in stores]


def rows(conn: psycopg.Connection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql, params).fetchall()


def task_rows(conn: psycopg.Connection, role: str) -> list[dict[str, Any]]:
    return rows(
        conn,
        "SELECT *, scheduled_for - updated_at AS delay FROM v_tasks WHERE role = %s ORDER BY id",
        (role,),
    )


def money(value: Any) -> Decimal | None:
    return None if value is None else Decimal(str(value)).quantize(CENT)


def expected_products(menu: list[dict[str, Any]]) -> dict[str, tuple]:
    """The simulator's menu as the products table should hold it (computed here, not by the
    code under test): prices and percents as numeric(_, 2), category in lower case."""
    return {
        p["id"]: (
            p["name"],
            p["brand"],
            p["category"].lower(),
            money(p["price"]),
            money(p["thc"]),
            money(p["cbd"]),
            p["in_stock"],
        )
        for p in menu
    }


def stored_products(conn: psycopg.Connection, dispensary_id: int) -> dict[str, tuple]:
    """The store's listed products (not gone), in expected_products' shape."""
    return {
        r[0]: tuple(r[1:])
        for r in conn.execute(
            "SELECT external_id, name, brand, category, price, thc_percent, cbd_percent, in_stock"
            " FROM products WHERE dispensary_id = %s AND gone_at IS NULL",
            (dispensary_id,),
        ).fetchall()
    }


def assert_settled(conn: psycopg.Connection) -> None:
    """Queue bookkeeping agrees with the tasks, and no store is left holding an active task."""
    assert_store_state_consistent(conn)
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE status IN ('claimed', 'running')").fetchone() == (
        0,
    )
    assert conn.execute(
        "SELECT count(*) FROM worker_task_stores WHERE active_task_id IS NOT NULL"
    ).fetchone() == (0,)


def add_local_store(conn: psycopg.Connection, platform_id: str) -> int:
    """A resolved store of the 'local' platform (the test's own menu server)."""
    row = conn.execute(
        "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id) VALUES ('s', 'local', %s)"
        " RETURNING id",
        (platform_id,),
    ).fetchone()
    return int(row[0])


def stop_quickly(sim: Simulator) -> None:
    """Simulator.stop(), without waiting out each server's half-second poll: the platforms stop at
    once, and a connection wakes each server up to see that it was asked to."""
    addresses = [(u.hostname, u.port) for u in (urlsplit(p.base_url) for p in sim.platforms.values())]
    stoppers = [threading.Thread(target=p.stop) for p in sim.platforms.values()]
    for t in stoppers:
        t.start()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in stoppers) and time.monotonic() < deadline:
        for address in addresses:
            with contextlib.suppress(OSError), socket.create_connection(address, timeout=1):
                pass
        for t in stoppers:
            t.join(0.01)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- 1. the whole chain ------------------------------------------------------------------------


def test_full_chain_lists_resolves_and_stores_menus(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """store_discovery → entry_point_discovery → product_discovery on two platforms: one store per
    simulator store (name, region, directory id), each resolved to its platform id and menu URL
    with exactly one product_discovery queued (also when resolved twice), and each menu stored
    exactly as the simulator serves it, with one 'new' history row per product."""
    sim, services = crawl(
        PlatformProfile("alpha", stores=12, latency_ms=5, seed=1),
        PlatformProfile("beta", stores=9, latency_ms=5, seed=2),
    )
    assert enqueue_store_discovery(queue, services.settings) == 6  # 2 platforms x 3 regions
    assert enqueue_store_discovery(queue, services.settings) == 0  # still queued: none added

    stats = drain(queue, "store_discovery", services)
    assert (stats.completed, stats.failed, stats.retried) == (6, 0, 0)
    results = [t["result"] for t in task_rows(conn, "store_discovery")]
    assert sorted((r["platform"], r["region"]) for r in results) == sorted(
        (p, r) for p in ("alpha", "beta") for r in REGIONS
    )
    assert sum(r["new"] for r in results) == sum(r["listed"] for r in results) == 21

    listed = rows(
        conn,
        "SELECT d.id, d.name, d.menu_type, d.crawl_enabled, d.platform_dispensary_id, c.platform,"
        " c.directory_id, c.region, c.first_listed_at FROM dispensaries d"
        " JOIN store_crawl_state c ON c.dispensary_id = d.id",
    )
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone() == (21,)
    by_directory = {(r["platform"], r["directory_id"]): r for r in listed}
    expected = {(name, s.directory_id): s for name, p in sim.platforms.items() for s in p.stores.values()}
    assert set(by_directory) == set(expected)
    for key, store in expected.items():
        row = by_directory[key]
        assert (row["name"], row["region"], row["menu_type"]) == (store.name, store.region, key[0])
        assert row["crawl_enabled"] and row["platform_dispensary_id"] is None
        assert row["first_listed_at"] is not None
    ids = {key: row["id"] for key, row in by_directory.items()}
    entry_tasks = task_rows(conn, "entry_point_discovery")
    assert len(entry_tasks) == 21
    assert {(t["dispensary_id"], t["status"], t["platform"]) for t in entry_tasks} == {
        (dispensary_id, "pending", name) for (name, _), dispensary_id in ids.items()
    }

    # Listing again adds nothing: no new store, no second entry-point task.
    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    assert sum(t["result"]["new"] for t in task_rows(conn, "store_discovery")[6:]) == 0
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone() == (21,)
    assert len(task_rows(conn, "entry_point_discovery")) == 21

    stats = drain(queue, "entry_point_discovery", services)
    assert (stats.completed, stats.failed, stats.retried) == (21, 0, 0)
    resolved = rows(
        conn,
        "SELECT d.id, d.platform_dispensary_id, c.menu_url, c.resolved_at FROM dispensaries d"
        " JOIN store_crawl_state c ON c.dispensary_id = d.id",
    )
    by_id = {r["id"]: r for r in resolved}
    for (name, directory_id), dispensary_id in ids.items():
        store = sim.platforms[name].stores[directory_id]
        row = by_id[dispensary_id]
        assert row["platform_dispensary_id"] == store.platform_id
        # As the platform gave it: relative, so that a base_url that moves keeps working.
        assert row["menu_url"] == f"/menus/{store.platform_id}"
        assert row["resolved_at"] is not None
    assert all(t["result"]["queued_discovery"] is True for t in task_rows(conn, "entry_point_discovery"))

    def pending_discovery() -> dict[int, int]:
        return dict(
            conn.execute(
                "SELECT dispensary_id, count(*) FROM v_tasks"
                " WHERE role = 'product_discovery' AND status = 'pending' GROUP BY dispensary_id"
            ).fetchall()
        )

    assert pending_discovery() == dict.fromkeys(ids.values(), 1)
    # Resolved a second time (a retry after a lost lease, say): no second product_discovery.
    for (name, _), dispensary_id in ids.items():
        queue.enqueue("entry_point_discovery", dispensary_id, platform=name)
    stats = drain(queue, "entry_point_discovery", services)
    assert stats.completed == 21
    again = task_rows(conn, "entry_point_discovery")[21:]
    assert [t["result"]["queued_discovery"] for t in again] == [False] * 21
    assert pending_discovery() == dict.fromkeys(ids.values(), 1)

    stats = drain(queue, "product_discovery", services, concurrency=8)
    assert (stats.completed, stats.failed, stats.retried) == (21, 0, 0)
    for (name, directory_id), dispensary_id in ids.items():
        platform = sim.platforms[name]
        store = platform.stores[directory_id]
        assert platform.menu_version(store) == 0
        menu = platform.menu(store, 0)
        assert stored_products(conn, dispensary_id) == expected_products(menu)
        history = conn.execute(
            "SELECT p.external_id, h.change, h.price, h.old_price, h.in_stock FROM product_history h"
            " JOIN products p ON p.id = h.product_id WHERE h.dispensary_id = %s",
            (dispensary_id,),
        ).fetchall()
        assert sorted(history) == sorted(
            (p["id"], "new", money(p["price"]), None, p["in_stock"]) for p in menu
        )
    results = {t["dispensary_id"]: t["result"] for t in task_rows(conn, "product_discovery")}
    for (name, directory_id), dispensary_id in ids.items():
        n = sim.platforms[name].stores[directory_id].products
        assert (results[dispensary_id]["seen"], results[dispensary_id]["new"]) == (n, n)
        assert results[dispensary_id]["unchanged"] is False
    assert status_counts(conn) == {"completed": 6 + 6 + 42 + 21}
    assert_settled(conn)


def test_store_directory_pages_are_followed(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """A region with more stores than one directory page (100) is listed whole; a directory with
    more pages than max_pages fails its task instead of listing part of it."""
    sim, services = crawl(PlatformProfile("big", stores=306, latency_ms=1))  # 102 stores a region
    enqueue_store_discovery(queue, services.settings)
    stats = drain(queue, "store_discovery", services)
    assert (stats.completed, stats.failed) == (3, 0)
    assert sorted(t["result"]["listed"] for t in task_rows(conn, "store_discovery")) == [102, 102, 102]
    listed = {r[0] for r in conn.execute("SELECT directory_id FROM store_crawl_state").fetchall()}
    assert listed == set(sim.platforms["big"].stores)

    capped = CrawlServices(
        {"big": PlatformSettings(base_url=sim.platforms["big"].base_url, max_pages=1, **FAST)}
    )
    with capped:
        task_id = queue.enqueue(
            "store_discovery", platform="big", payload={"platform": "big", "region": "north"}
        )
        stats = drain(queue, "store_discovery", capped)
    task = queue.get(task_id)
    assert (stats.failed, task.status, task.retry_count) == (1, "failed", 0)
    assert "max_pages" in task.error_message
    assert_settled(conn)


# -- 2. history only on change -----------------------------------------------------------------


def test_history_is_written_only_for_changes(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """The same menu again: unchanged, no history, products untouched. A newer menu version (some
    products dropped, some added): the counts and the history rows are exactly the diff computed
    here, price changes carry their old price. Dropped products coming back are 'back'."""
    change_seconds = 30.0
    sim, services = crawl(
        PlatformProfile("menus", stores=6, latency_ms=5, change_seconds=change_seconds, seed=3)
    )
    platform = sim.platforms["menus"]
    stores = seed_stores(conn, platform)
    enqueue_all(queue, "product_discovery", stores, "menus")
    assert drain(queue, "product_discovery", services).completed == 6
    old_menus = {d: platform.menu(s, 0) for d, s in stores.items()}
    assert all(platform.menu_version(s) == 0 for s in stores.values())

    def snapshot() -> dict[int, dict[str, dict[str, Any]]]:
        return {
            d: {
                r["external_id"]: r
                for r in rows(conn, "SELECT * FROM products WHERE dispensary_id = %s", (d,))
            }
            for d in stores
        }

    def history_count() -> int:
        return conn.execute("SELECT count(*) FROM product_history").fetchone()[0]

    before, history_before = snapshot(), history_count()
    assert history_before == sum(len(m) for m in old_menus.values())
    hashes = dict(conn.execute("SELECT dispensary_id, menu_hash FROM store_crawl_state").fetchall())

    # Same version again: nothing to store.
    enqueue_all(queue, "product_resync", stores, "menus")
    assert drain(queue, "product_resync", services).completed == 6
    results = [t["result"] for t in task_rows(conn, "product_resync")]
    assert [(r["unchanged"], r["new"], r["changed"], r["gone"]) for r in results] == [(True, 0, 0, 0)] * 6
    assert snapshot() == before
    assert history_count() == history_before
    assert dict(conn.execute("SELECT dispensary_id, menu_hash FROM store_crawl_state").fetchall()) == hashes

    # Later: every store's menu version moves on (12 periods: version 3..12 by change_every), one
    # store drops its last 5 products and another gains 4.
    platform.started_at -= 12 * change_seconds
    dropper, gainer = sorted(stores)[:2]
    stores[dropper].products -= 5
    stores[gainer].products += 4
    new_menus = {d: platform.menu(s) for d, s in stores.items()}
    assert all(platform.menu_version(s) >= 3 for s in stores.values())

    expected: dict[int, dict[str, Any]] = {}
    for d in stores:
        old, new = expected_products(old_menus[d]), expected_products(new_menus[d])
        moved = {i for i in old.keys() & new.keys() if (old[i][3], old[i][6]) != (new[i][3], new[i][6])}
        expected[d] = {
            "new": new.keys() - old.keys(),
            "gone": old.keys() - new.keys(),
            "changed": moved,
            "old": old,
            "now": new,
        }
    assert len(expected[dropper]["gone"]) == 5 and len(expected[gainer]["new"]) == 4
    assert all(e["changed"] for e in expected.values())  # the fixture menus did move

    last_history = conn.execute("SELECT max(id) FROM product_history").fetchone()[0]
    enqueue_all(queue, "product_resync", stores, "menus")
    assert drain(queue, "product_resync", services).completed == 6
    results = {t["dispensary_id"]: t["result"] for t in task_rows(conn, "product_resync")[6:]}
    for d, e in expected.items():
        r = results[d]
        assert (r["unchanged"], r["new"], r["changed"], r["gone"]) == (
            False,
            len(e["new"]),
            len(e["changed"]),
            len(e["gone"]),
        ), d
        assert stored_products(conn, d) == e["now"]
        history = rows(
            conn,
            "SELECT p.external_id, h.change, h.price, h.old_price, h.in_stock, h.old_in_stock"
            " FROM product_history h JOIN products p ON p.id = h.product_id"
            " WHERE h.dispensary_id = %s AND h.id > %s",
            (d, last_history),
        )
        assert sorted((h["external_id"], h["change"]) for h in history) == sorted(
            [(i, "new") for i in e["new"]]
            + [(i, "gone") for i in e["gone"]]
            + [(i, "changed") for i in e["changed"]]
        )
        for h in history:
            i = h["external_id"]
            if h["change"] == "changed":
                old, now = e["old"][i], e["now"][i]
                assert (h["price"], h["old_price"], h["in_stock"], h["old_in_stock"]) == (
                    now[3],
                    old[3],
                    now[6],
                    old[6],
                )
            elif h["change"] == "gone":
                assert (h["price"], h["old_price"], h["old_in_stock"]) == (
                    None,
                    e["old"][i][3],
                    e["old"][i][6],
                )
        # changed_at moves only for products whose price or stock moved (or that went away).
        after = dict(
            conn.execute(
                "SELECT external_id, changed_at FROM products WHERE dispensary_id = %s", (d,)
            ).fetchall()
        )
        moved_or_gone = e["changed"] | e["gone"]
        for i, at in after.items():
            if i not in e["new"]:
                assert (at != before[d][i]["changed_at"]) == (i in moved_or_gone), i
        gone_marked = {
            r[0]
            for r in conn.execute(
                "SELECT external_id FROM products WHERE dispensary_id = %s AND gone_at IS NOT NULL", (d,)
            ).fetchall()
        }
        assert gone_marked == e["gone"]

    # The analytics count price changes (not stock-only changes) and listed products.
    task_id = queue.enqueue("analytics_refresh")
    assert drain(queue, "analytics_refresh", services, concurrency=1).completed == 1
    analytics = dict(
        (r[0], r[1:])
        for r in conn.execute(
            "SELECT dispensary_id, products_listed, price_changes_24h FROM store_analytics"
        ).fetchall()
    )
    for d, e in expected.items():
        price_moves = sum(1 for i in e["changed"] if e["old"][i][3] != e["now"][i][3])
        assert analytics[d] == (len(e["now"]), price_moves)
    assert queue.get(task_id).result["stores"] == 6

    # The dropped products come back (same version): 'back', counted as changed, with their old
    # values as the old side.
    stores[dropper].products += 5
    back_menu = expected_products(platform.menu(stores[dropper]))
    last_history = conn.execute("SELECT max(id) FROM product_history").fetchone()[0]
    queue.enqueue("product_resync", dropper, platform="menus")
    assert drain(queue, "product_resync", services).completed == 1
    result = task_rows(conn, "product_resync")[-1]["result"]
    assert (result["new"], result["changed"], result["gone"]) == (0, 5, 0)
    back = conn.execute(
        "SELECT p.external_id, h.change, h.price, h.old_price FROM product_history h"
        " JOIN products p ON p.id = h.product_id WHERE h.id > %s",
        (last_history,),
    ).fetchall()
    old = expected_products(old_menus[dropper])
    assert sorted(back) == sorted((i, "back", back_menu[i][3], old[i][3]) for i in expected[dropper]["gone"])
    assert stored_products(conn, dropper) == back_menu
    assert_settled(conn)


# -- 3. each failure class → the task's outcome ------------------------------------------------


def crawl_one(
    conn: psycopg.Connection,
    queue: TaskQueue,
    services: CrawlServices,
    platform: SimulatedPlatform,
    **kw: Any,
) -> tuple[DrainStats, dict[str, Any], int]:
    (dispensary_id,) = seed_stores(conn, platform, 1)
    (task_id,) = enqueue_all(queue, "product_discovery", {dispensary_id: None}, platform.profile.name, **kw)
    stats = drain(queue, "product_discovery", services, concurrency=1)
    (task,) = rows(
        conn, "SELECT *, scheduled_for - updated_at AS delay FROM v_tasks WHERE id = %s", (task_id,)
    )
    return stats, task, dispensary_id


@pytest.mark.parametrize(
    ("profile", "overrides", "message"),
    [
        pytest.param({"rate_500": 1.0}, {}, "HTTP 500 for http://127.0.0.1", id="http-500"),
        pytest.param(
            {"rate_timeout": 1.0, "timeout_sleep_seconds": 1.0},
            {"timeout_seconds": 0.5},
            "TransientTaskError: timeout on GET",
            id="hang-past-timeout",
        ),
    ],
)
def test_transient_failures_go_back_with_backoff(
    conn: psycopg.Connection,
    queue: TaskQueue,
    crawl: Crawl,
    profile: dict[str, Any],
    overrides: dict[str, Any],
    message: str,
):
    """A 500 or a hang past the client's timeout: the task is pending again, one retry spent,
    due after the role's backoff (15-30 s for a first retry), nothing stored."""
    sim, services = crawl(PlatformProfile("flaky", stores=1, latency_ms=5, **profile), **overrides)
    stats, task, store = crawl_one(conn, queue, services, sim.platforms["flaky"])
    assert (stats.retried, stats.failed, stats.completed) == (1, 0, 0)
    assert (task["status"], task["retry_count"], task["worker_id"]) == ("pending", 1, None)
    assert message in task["error_message"]
    assert timedelta(seconds=14) < task["delay"] <= timedelta(seconds=31)
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert conn.execute("SELECT crawl_enabled FROM dispensaries WHERE id = %s", (store,)).fetchone() == (
        True,
    )
    assert_settled(conn)


def test_429_retry_after_delays_the_retry_and_pauses_the_host(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl
):
    """A 429 with Retry-After 120: its task is retried no sooner than 120 s; the host is paused, so
    the other stores' tasks are deferred for about that long (no retry spent, no request sent)."""
    sim, services = crawl(
        PlatformProfile("busy", stores=3, latency_ms=5, rate_429=1.0, retry_after_seconds=120)
    )
    platform = sim.platforms["busy"]
    stores = seed_stores(conn, platform)
    enqueue_all(queue, "product_discovery", stores, "busy")
    stats = drain(queue, "product_discovery", services, concurrency=1)
    assert (stats.retried, stats.deferred, stats.failed, stats.completed) == (1, 2, 0, 0)
    assert platform.stats.requests == 1 and platform.stats.answers[429] == 1
    tasks = task_rows(conn, "product_discovery")
    assert {t["status"] for t in tasks} == {"pending"}
    (retried,) = [t for t in tasks if t["retry_count"] == 1]
    assert "HTTP 429" in retried["error_message"] and "Retry-After 120" in retried["error_message"]
    assert retried["delay"] >= timedelta(seconds=120)
    deferred = [t for t in tasks if t is not retried]
    assert [t["retry_count"] for t in deferred] == [0, 0]
    assert all(timedelta(seconds=100) < t["delay"] <= timedelta(seconds=121) for t in deferred)
    assert_settled(conn)


def test_connection_refused_is_retried(conn: psycopg.Connection, queue: TaskQueue):
    """Nothing listening on the platform's port: pending again with a retry spent."""
    settings = {"nowhere": PlatformSettings(base_url=f"http://127.0.0.1:{closed_port()}", **FAST)}
    (store,) = conn.execute(
        "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id) VALUES ('x', 'nowhere', 'x1')"
        " RETURNING id"
    ).fetchone()
    task_id = queue.enqueue("product_discovery", store, platform="nowhere")
    with CrawlServices(settings) as services:
        stats = drain(queue, "product_discovery", services, concurrency=1)
    task = queue.get(task_id)
    assert (stats.retried, task.status, task.retry_count) == (1, "pending", 1)
    assert "connection error on GET" in task.error_message
    assert_settled(conn)


def test_out_of_retries_fails(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """A transient error with no retry left (max_retries 0) fails the task."""
    sim, services = crawl(PlatformProfile("flaky", stores=1, latency_ms=5, rate_500=1.0))
    stats, task, _ = crawl_one(conn, queue, services, sim.platforms["flaky"], max_retries=0)
    assert (stats.failed, stats.retried) == (1, 0)
    assert (task["status"], task["retry_count"]) == ("failed", 0)
    assert "HTTP 500" in task["error_message"] and task["completed_at"] is not None
    assert_settled(conn)


@pytest.mark.parametrize("role", ["product_discovery", "entry_point_discovery"])
def test_gone_store_fails_at_once_and_stops_crawling(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl, role: str
):
    """The platform answers 410 for the store: the task fails without spending a retry, the store
    is disabled with gone_at set, and the message says the store is gone."""
    sim, services = crawl(
        PlatformProfile("closing", stores=2, latency_ms=5, gone_share=1.0, gone_within_seconds=0.001)
    )
    platform = sim.platforms["closing"]
    time.sleep(0.01)
    assert all(platform.is_gone(s) for s in platform.stores.values())
    stores = seed_stores(conn, platform)
    enqueue_all(queue, role, stores, "closing")
    stats = drain(queue, role, services, concurrency=2)
    assert (stats.failed, stats.retried, stats.completed) == (2, 0, 0)
    for task in task_rows(conn, role):
        assert (task["status"], task["retry_count"]) == ("failed", 0)
        assert "store gone" in task["error_message"] and "HTTP 410" in task["error_message"]
    state = conn.execute(
        "SELECT d.crawl_enabled, c.gone_at IS NOT NULL FROM dispensaries d"
        " JOIN store_crawl_state c ON c.dispensary_id = d.id"
    ).fetchall()
    assert state == [(False, True), (False, True)]
    assert platform.stats.answers[410] == 2
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert_settled(conn)


def test_gone_store_listed_again_is_enabled_again(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """A store whose menu answered 410 is disabled; when the directory lists it again, it is
    enabled again (same dispensary, gone_at cleared) and its next crawl works."""
    sim, services = crawl(PlatformProfile("flux", stores=3, latency_ms=5))
    platform = sim.platforms["flux"]
    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    drain(queue, "entry_point_discovery", services)
    (victim, directory_id) = conn.execute(
        "SELECT dispensary_id, directory_id FROM store_crawl_state ORDER BY dispensary_id LIMIT 1"
    ).fetchone()
    platform.stores[directory_id].gone_after = 0.0  # gone from now on: 410, and not listed
    assert drain(queue, "product_discovery", services).failed == 1
    assert conn.execute("SELECT crawl_enabled FROM dispensaries WHERE id = %s", (victim,)).fetchone() == (
        False,
    )

    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    assert conn.execute("SELECT crawl_enabled FROM dispensaries WHERE id = %s", (victim,)).fetchone() == (
        False,
    )

    platform.stores[directory_id].gone_after = None  # back
    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    row = conn.execute(
        "SELECT d.crawl_enabled, c.gone_at FROM dispensaries d"
        " JOIN store_crawl_state c ON c.dispensary_id = d.id WHERE d.id = %s",
        (victim,),
    ).fetchone()
    assert row == (True, None)
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone() == (3,)
    queue.enqueue("product_resync", victim, platform="flux")
    assert drain(queue, "product_resync", services).completed == 1
    assert stored_products(conn, victim) == expected_products(platform.menu(platform.stores[directory_id]))
    assert_settled(conn)


def test_store_gone_before_resolution_is_resolved_when_listed_again(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl
):
    """upsert_listed_stores: 'a store listed again after it was gone is crawled again'. A store
    that went away between its listing and its entry point never got a platform id; listed
    again, it needs its entry point resolved, else nothing will ever crawl it."""
    sim, services = crawl(PlatformProfile("flux", stores=2, latency_ms=5))
    platform = sim.platforms["flux"]
    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    (victim, directory_id) = conn.execute(
        "SELECT dispensary_id, directory_id FROM store_crawl_state ORDER BY dispensary_id LIMIT 1"
    ).fetchone()
    platform.stores[directory_id].gone_after = 0.0
    assert drain(queue, "entry_point_discovery", services).failed == 1
    platform.stores[directory_id].gone_after = None
    enqueue_store_discovery(queue, services.settings)
    drain(queue, "store_discovery", services)
    assert conn.execute(
        "SELECT crawl_enabled, platform_dispensary_id FROM dispensaries WHERE id = %s", (victim,)
    ).fetchone() == (True, None)
    pending = conn.execute(
        "SELECT count(*) FROM v_tasks WHERE dispensary_id = %s AND status = 'pending'"
        " AND role IN ('entry_point_discovery', 'product_discovery')",
        (victim,),
    ).fetchone()[0]
    assert pending == 1


BAD_MENUS = [
    pytest.param(
        [
            {"id": "p1", "name": "A", "category": "Flower", "price": 5, "in_stock": True},
            {"id": "p2", "name": "B", "category": "Vape", "price": -1, "in_stock": True},
        ],
        ["product #1 (id 'p2')", "price must be between 0 and"],
        id="negative-price",
    ),
    pytest.param(
        [
            {"id": "p1", "name": "A", "category": "Flower", "price": 5, "in_stock": True},
            {"id": "p1", "name": "B", "category": "Vape", "price": 6, "in_stock": False},
        ],
        ["id 'p1' appears twice"],
        id="duplicate-id",
    ),
    pytest.param(
        [{"id": "p1", "name": "A", "category": "Flower", "price": 5, "in_stock": "yes"}],
        ["(id 'p1')", "in_stock must be true or false"],
        id="stock-not-boolean",
    ),
    pytest.param({"p1": {}}, ["menu products must be a list"], id="not-a-list"),
]


@pytest.mark.parametrize(("products", "names"), BAD_MENUS)
def test_invalid_menu_fails_at_once_naming_the_product(
    conn: psycopg.Connection, queue: TaskQueue, menu_server: MenuServer, products: Any, names: list[str]
):
    """A menu that fails validation fails its task at once (no retry spent), the message names the
    offending product, nothing of the menu is stored and the store is not taken for gone."""
    menu_server.menu("bad", products)
    store = add_local_store(conn, "bad")
    task_id = queue.enqueue("product_discovery", store, platform="local")
    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        stats = drain(queue, "product_discovery", services, concurrency=1)
    task = queue.get(task_id)
    assert (stats.failed, task.status, task.retry_count) == (1, "failed", 0)
    assert task.error_message.startswith("MenuValidationError: menu")
    for name in names:
        assert name in task.error_message
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert conn.execute("SELECT crawl_enabled FROM dispensaries").fetchone() == (True,)
    assert_settled(conn)


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        pytest.param(200, b"<html>menu</html>", "did not answer JSON", id="not-json"),
        pytest.param(403, b'{"error": "forbidden"}', "HTTP 403", id="http-403"),
        # A 404 (a wrong path in the settings answers it too) is no proof the store is gone.
        pytest.param(404, b'{"error": "not found"}', "HTTP 404", id="http-404"),
        pytest.param(200, b'{"items": []}', "expected an object with 'products'", id="no-products-key"),
    ],
)
def test_unusable_answers_fail_at_once(
    conn: psycopg.Connection,
    queue: TaskQueue,
    menu_server: MenuServer,
    status: int,
    body: bytes,
    message: str,
):
    """An answer no retry can fix (not JSON, 403, wrong shape): failed at once, store still enabled."""
    menu_server.routes["/menus/odd"] = (status, body)
    store = add_local_store(conn, "odd")
    task_id = queue.enqueue("product_discovery", store, platform="local")
    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        drain(queue, "product_discovery", services, concurrency=1)
    task = queue.get(task_id)
    assert (task.status, task.retry_count) == ("failed", 0)
    assert message in task.error_message and "store gone" not in task.error_message
    assert conn.execute("SELECT crawl_enabled FROM dispensaries").fetchone() == (True,)
    assert_settled(conn)


def test_menu_is_normalised_before_it_is_stored(
    conn: psycopg.Connection, queue: TaskQueue, menu_server: MenuServer
):
    """Numbers as text or with a dollar sign, integer ids, padded names and upper-case categories
    are stored in one form: numeric(_, 2), text ids, single spaces, lower-case categories."""
    menu_server.menu(
        "fine",
        [
            {
                "id": 7,
                "name": "  Blue   Dream ",
                "category": "FLOWER",
                "price": "$12.5",
                "in_stock": True,
                "brand": "",
                "thc": "21.456",
                "cbd": None,
            },
            {
                "id": "a",
                "name": "Gummies",
                "brand": "Kiva",
                "category": "Edible",
                "price": 3,
                "in_stock": False,
                "thc": 5,
            },
        ],
    )
    store = add_local_store(conn, "fine")
    queue.enqueue("product_discovery", store, platform="local")
    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        assert drain(queue, "product_discovery", services, concurrency=1).completed == 1
    assert stored_products(conn, store) == {
        "7": ("Blue Dream", None, "flower", Decimal("12.50"), Decimal("21.46"), None, True),
        "a": ("Gummies", "Kiva", "edible", Decimal("3.00"), Decimal("5.00"), None, False),
    }


# -- 3b. URLs a platform hands back stay on its hosts --------------------------------------------


def loopback_clone(profile: PlatformProfile) -> SimulatedPlatform:
    """A server of the same stores and menus as ``profile``'s, on 127.0.0.1 like the simulator's:
    reached by the name ``localhost``, it is another host to the crawl's allow-list (which holds
    host names, not addresses), and it counts every request that reaches it."""
    return SimulatedPlatform(dataclasses.replace(profile)).start()


def test_a_redirect_to_another_host_is_refused_before_it_is_requested(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl
):
    """A menu whose redirect hop points at another host fails its task at once (no retry spent),
    the error shows that URL as scheme://host:port/*** only, and the other host hears nothing.
    With that host among the platform's hosts, the same hop is followed (the control: a request
    there is counted)."""
    profile = PlatformProfile("hop", stores=2, latency_ms=5, change_seconds=86_400, seed=21)
    elsewhere = loopback_clone(profile)
    try:
        away = f"http://localhost:{urlsplit(elsewhere.base_url).port}"
        profile.redirect_base = away  # GET /go/menus/<id> -> 302 http://localhost:<port>/menus/<id>
        sim, services = crawl(profile, menu_path="/go/menus/{platform_id}")
        hop = sim.platforms["hop"]
        assert services.settings["hop"].allowed_hosts() == ("127.0.0.1",)
        stores = seed_stores(conn, hop)
        enqueue_all(queue, "product_discovery", stores, "hop")
        stats = drain(queue, "product_discovery", services, concurrency=2)
        assert (stats.failed, stats.retried, stats.completed) == (2, 0, 0)
        for task in task_rows(conn, "product_discovery"):
            assert (task["status"], task["retry_count"]) == ("failed", 0)
            message = task["error_message"]
            assert message.startswith(f"PermanentTaskError: refused to request {away}/***: "), message
            assert "not on the platform's hosts (127.0.0.1)" in message, message
            assert "/menus/" not in message and not any(s.platform_id in message for s in stores.values())
        assert dict(hop.stats.answers) == {302: 2}  # the hops, then nothing more
        assert elsewhere.stats.requests == 0 and elsewhere.request_log() == []
        assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
        assert conn.execute("SELECT bool_and(crawl_enabled) FROM dispensaries").fetchone() == (True,)
        assert_settled(conn)

        # The control: localhost among the platform's hosts, the hop is followed and served there.
        allowed = PlatformSettings(
            base_url=hop.base_url,
            menu_path="/go/menus/{platform_id}",
            hosts=["127.0.0.1", "localhost"],
            **FAST,
        )
        enqueue_all(queue, "product_discovery", stores, "hop")
        with CrawlServices({"hop": allowed}) as followed:
            assert drain(queue, "product_discovery", followed, concurrency=2).completed == 2
        assert dict(hop.stats.answers) == {302: 4}
        assert (elsewhere.stats.requests, dict(elsewhere.stats.answers)) == (2, {200: 2})
        for dispensary_id, store in stores.items():
            assert stored_products(conn, dispensary_id) == expected_products(elsewhere.menu(store))
        assert_settled(conn)
    finally:
        elsewhere.stop()


def test_menu_urls_stay_on_the_platforms_hosts(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl, tmp_path: Path
):
    """Entry points that answer absolute menu URLs on another host: save_entry_point refuses them
    (the platform's hosts, loaded by the sync, are the base URL's), showing scheme and host only,
    and the menus are never fetched there. A menu URL stored before such checks existed is refused
    by the HTTP client. With that host in the platforms file's ``hosts``, the sync loads it into
    tq_platforms.hosts: the URLs are saved, and the menus fetched there."""
    profile = PlatformProfile("menus", stores=3, latency_ms=5, change_seconds=86_400, seed=22)
    elsewhere = loopback_clone(profile)
    try:
        away = f"http://localhost:{urlsplit(elsewhere.base_url).port}"
        profile.menu_url_base = away  # entry points answer menu_url http://localhost:<port>/menus/<id>
        sim, services = crawl(profile)
        platform = sim.platforms["menus"]
        sync_limits(queue, services.settings)
        assert conn.execute("SELECT platform, hosts FROM tq_platforms").fetchall() == [
            ("menus", ["127.0.0.1"])
        ]

        enqueue_store_discovery(queue, services.settings)
        assert drain(queue, "store_discovery", services).completed == len(REGIONS)
        conn.execute("UPDATE worker_tasks SET max_retries = 0 WHERE role = 'entry_point_discovery'")
        stats = drain(queue, "entry_point_discovery", services)
        assert (stats.failed, stats.completed) == (3, 0)
        for task in task_rows(conn, "entry_point_discovery"):
            message = task["error_message"]
            assert task["status"] == "failed"
            assert f"save_entry_point: menu_url {away}/... is not on the hosts of platform" in message, (
                message
            )
            assert message.endswith("(127.0.0.1)"), message
            assert "/menus/" not in message
        assert conn.execute(
            "SELECT count(*) FROM dispensaries d JOIN store_crawl_state c ON c.dispensary_id = d.id"
            " WHERE d.platform_dispensary_id IS NULL AND c.menu_url IS NULL AND c.resolved_at IS NULL"
        ).fetchone() == (3,)
        assert conn.execute("SELECT count(*) FROM v_tasks WHERE role = 'product_discovery'").fetchone() == (
            0,
        )
        assert elsewhere.stats.requests == 0

        # Such a URL stored by hand (as before the hosts were checked): the client refuses it.
        [(victim, directory_id)] = conn.execute(
            "SELECT dispensary_id, directory_id FROM store_crawl_state ORDER BY dispensary_id LIMIT 1"
        ).fetchall()
        store = platform.stores[directory_id]
        conn.execute(
            "UPDATE dispensaries SET platform_dispensary_id = %s WHERE id = %s", (store.platform_id, victim)
        )
        conn.execute(
            "UPDATE store_crawl_state SET menu_url = %s WHERE dispensary_id = %s",
            (f"{away}/menus/{store.platform_id}?key=s3cret", victim),
        )
        task_id = queue.enqueue("product_discovery", victim, platform="menus")
        assert drain(queue, "product_discovery", services).failed == 1
        failed = queue.get(task_id)
        assert (failed.status, failed.retry_count) == ("failed", 0)
        assert f"refused to request {away}/***" in failed.error_message
        assert "s3cret" not in failed.error_message and store.platform_id not in failed.error_message
        assert elsewhere.stats.requests == 0
        conn.execute("UPDATE store_crawl_state SET menu_url = NULL WHERE dispensary_id = %s", (victim,))

        # localhost among the platform's hosts, in the platforms file: loaded by the sync.
        path = tmp_path / "hosts.toml"
        path.write_text(sim.platforms_toml(**FAST, hosts=["localhost", "127.0.0.1"]))
        settings = load_platform_settings(path)
        assert settings["menus"].allowed_hosts() == ("127.0.0.1", "localhost")
        assert sync_limits(queue, settings) == 1
        assert conn.execute("SELECT hosts FROM tq_platforms WHERE platform = 'menus'").fetchone() == (
            ["127.0.0.1", "localhost"],
        )
        with CrawlServices(settings) as allowed:
            for (dispensary_id,) in conn.execute("SELECT id FROM dispensaries ORDER BY id").fetchall():
                queue.enqueue("entry_point_discovery", dispensary_id, platform="menus")
            assert drain(queue, "entry_point_discovery", allowed).completed == 3
            saved = dict(conn.execute("SELECT directory_id, menu_url FROM store_crawl_state").fetchall())
            assert saved == {d: f"{away}/menus/{s.platform_id}" for d, s in platform.stores.items()}
            assert drain(queue, "product_discovery", allowed).completed == 3
        assert (elsewhere.stats.requests, dict(elsewhere.stats.answers)) == (3, {200: 3})
        for dispensary_id, directory_id in conn.execute(
            "SELECT dispensary_id, directory_id FROM store_crawl_state"
        ).fetchall():
            menu = elsewhere.menu(elsewhere.stores[directory_id])
            assert stored_products(conn, dispensary_id) == expected_products(menu)
        assert_settled(conn)
    finally:
        elsewhere.stop()


# -- 4. politeness -----------------------------------------------------------------------------


def test_in_flight_limit_holds_and_is_reached(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """16 handler threads over 40 stores on two platforms, at most 3 requests in flight per host:
    the servers never saw more than 3 at once, and at least one saw 3."""
    sim, services = crawl(
        PlatformProfile("left", stores=20, latency_ms=20, seed=5),
        PlatformProfile("right", stores=20, latency_ms=20, seed=6),
        max_in_flight=3,
    )
    for name, platform in sim.platforms.items():
        enqueue_all(queue, "product_discovery", seed_stores(conn, platform), name)
    stats = drain(queue, "product_discovery", services, concurrency=16)
    assert (stats.completed, stats.failed, stats.retried, stats.deferred) == (40, 0, 0, 0)
    seen = {name: p.stats.max_in_flight for name, p in sim.platforms.items()}
    assert all(n <= 3 for n in seen.values()), seen
    assert max(seen.values()) == 3, seen
    assert sum(p.stats.requests for p in sim.platforms.values()) == 40
    assert conn.execute("SELECT count(DISTINCT dispensary_id) FROM products").fetchone() == (40,)
    assert_settled(conn)


def test_request_rate_is_limited(conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl):
    """20 requests/s, one at a time, 10 menus of a 5 ms server: at least 9 intervals of 50 ms."""
    sim, services = crawl(
        PlatformProfile("slowpoke", stores=10, latency_ms=5),
        requests_per_second=20.0,
        max_in_flight=1,
        slot_wait_seconds=5.0,
    )
    platform = sim.platforms["slowpoke"]
    enqueue_all(queue, "product_discovery", seed_stores(conn, platform), "slowpoke")
    began = time.monotonic()
    stats = drain(queue, "product_discovery", services, concurrency=4)
    elapsed = time.monotonic() - began
    assert (stats.completed, stats.deferred) == (10, 0)
    assert platform.stats.requests == 10 and platform.stats.max_in_flight == 1
    assert elapsed >= 0.4


def test_slow_host_does_not_stall_the_others(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl
):
    """A host taking 1 s a request with one slot: its second task cannot get the slot within
    slot_wait_seconds and is deferred (pending, no retry spent, due later) instead of holding a
    thread, and the fast host's tasks all complete before the slow host's first one."""
    sim, services = crawl(
        PlatformProfile("sluggish", stores=2, latency_ms=1000, jitter=0.0),
        PlatformProfile("snappy", stores=12, latency_ms=5),
        per_platform={"sluggish": {"max_in_flight": 1, "slot_wait_seconds": 0.2}},
    )
    slow = seed_stores(conn, sim.platforms["sluggish"])
    fast = seed_stores(conn, sim.platforms["snappy"])
    enqueue_all(queue, "product_discovery", slow, "sluggish")
    enqueue_all(queue, "product_discovery", fast, "snappy")

    observed: list[tuple] = []
    done = threading.Event()

    def watch() -> None:
        with psycopg.connect(db_url, autocommit=True) as other:
            while not done.is_set():
                observed.extend(
                    other.execute(
                        "SELECT id, retry_count FROM v_tasks WHERE platform = 'sluggish'"
                        " AND status = 'pending' AND scheduled_for > now() AND error_message IS NULL"
                    ).fetchall()
                )
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        stats = drain(queue, "product_discovery", services, concurrency=4)
    finally:
        done.set()
        watcher.join(10)
    assert stats.deferred > 0 and stats.failed == 0 and stats.retried == 0
    assert observed and {r[1] for r in observed} == {0}
    tasks = task_rows(conn, "product_discovery")
    fast_tasks = [t for t in tasks if t["platform"] == "snappy"]
    slow_tasks = [t for t in tasks if t["platform"] == "sluggish"]
    assert [t["status"] for t in fast_tasks] == ["completed"] * 12
    assert all(t["retry_count"] == 0 for t in slow_tasks)
    assert all(t["status"] in ("completed", "pending") for t in slow_tasks)
    first_slow = min(t["completed_at"] for t in slow_tasks if t["status"] == "completed")
    assert max(t["completed_at"] for t in fast_tasks) < first_slow
    assert sim.platforms["sluggish"].stats.max_in_flight == 1
    assert_settled(conn)


def test_tasks_deferred_by_a_pause_are_sent_after_it(
    conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl
):
    """A 429 with Retry-After 1 s pauses the host; the 19 other stores' tasks are deferred until
    the pause ends. Coming back when told, they must get requests through once it has ended (at
    20 requests/s, all within about a second), not defer one another for ever."""
    sim, services = crawl(
        PlatformProfile("paused", stores=20, latency_ms=2, rate_429=1.0, retry_after_seconds=1),
        requests_per_second=20.0,
        max_in_flight=1,
        slot_wait_seconds=0.1,
    )
    platform = sim.platforms["paused"]
    first, *others = seed_stores(conn, platform)
    queue.enqueue("product_discovery", first, platform="paused")
    assert drain(queue, "product_discovery", services, concurrency=1).retried == 1  # the 429
    platform.profile.rate_429 = 0.0  # the platform answers again; the host stays paused for 1 s
    enqueue_all(queue, "product_discovery", dict.fromkeys(others), "paused")
    stats = drain(
        queue, "product_discovery", services, concurrency=2, idle_poll_seconds=0.02, time_budget_seconds=2.0
    )
    assert stats.deferred >= 19  # all waited for the pause
    assert platform.stats.requests > 1, f"no request after the pause; {stats.deferred} deferrals"
    assert stats.completed >= 1
    assert_settled(conn)


# -- 5. lost leases ----------------------------------------------------------------------------


@pytest.mark.parametrize("heartbeat_seconds", [30.0, 0.1], ids=["fenced-write", "heartbeat-flag"])
def test_handler_that_lost_its_lease_writes_nothing(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, crawl: Crawl, heartbeat_seconds: float
):
    """While the menu is being fetched, recovery gives the task away. The handler's write is
    refused (by the transaction's ownership check, or earlier by the heartbeat's flag): no
    product, no menu hash, the task not completed by the old worker, counted as lost. The next
    run stores the menu."""
    sim, services = crawl(PlatformProfile("slowmenu", stores=1, latency_ms=600, jitter=0.0))
    platform = sim.platforms["slowmenu"]
    stores = seed_stores(conn, platform)
    (store,) = stores
    (task_id,) = enqueue_all(queue, "product_discovery", stores, "slowmenu")
    recovered: list[int] = []

    def thief() -> None:
        with psycopg.connect(db_url, autocommit=True) as other:
            deadline = time.monotonic() + 10
            while platform.stats.in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            with other.transaction():
                other.execute(
                    "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '20 minutes' WHERE id = %s",
                    (task_id,),
                )
                recovered.append(other.execute("SELECT recover_stale_tasks(10)").fetchone()[0])
                # Not due again during this run: the old worker must not simply take it back.
                other.execute(
                    "UPDATE worker_tasks SET scheduled_for = now() + interval '1 hour' WHERE id = %s",
                    (task_id,),
                )

    refusals: list[str] = []

    def handler(task: Task, ctx: TaskContext) -> Any:
        try:
            return HANDLERS["product_discovery"](task, ctx)
        except LeaseLostError as exc:
            refusals.append(str(exc))
            raise

    stealer = threading.Thread(target=thief)
    stealer.start()
    worker = Worker(
        queue,
        "product_discovery",
        handler,
        worker_id="old",
        services=services,
        heartbeat_seconds=heartbeat_seconds,
    )
    stats = worker.run()
    stealer.join(10)
    assert recovered == [1]
    assert (stats.claimed, stats.completed, stats.lost, stats.failed, stats.retried) == (1, 0, 1, 0, 0)
    assert platform.stats.answers[200] == 1  # the menu was fetched; its write was dropped
    assert len(refusals) == 1
    if heartbeat_seconds < 1:
        assert "nothing written" not in refusals[0]  # stopped by check_lease, before the transaction
    else:
        assert "nothing written" in refusals[0]
    task = queue.get(task_id)
    assert (task.status, task.worker_id, task.completed_at, task.result, task.retry_count) == (
        "pending",
        None,
        None,
        None,
        1,
    )
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM product_history").fetchone() == (0,)
    assert conn.execute("SELECT menu_hash, last_crawl_at FROM store_crawl_state").fetchone() == (None, None)
    assert_settled(conn)

    # The setup was sound: due again and with a fast server, the task stores the menu.
    platform.profile.latency_ms = 5
    conn.execute("UPDATE worker_tasks SET scheduled_for = now() WHERE id = %s", (task_id,))
    assert drain(queue, "product_discovery", services).completed == 1
    assert stored_products(conn, store) == expected_products(platform.menu(stores[store]))


def test_transaction_of_a_task_not_owned_raises_and_writes_nothing(
    conn: psycopg.Connection, queue: TaskQueue
):
    """ctx.transaction() for a task held under another lease raises LeaseLostError before the body
    runs and flags the lease lost, whatever worker id it names: a forged token, and the stale one
    of a claim the task was given back from. The holder's context writes."""
    (store,) = conn.execute(
        "INSERT INTO dispensaries (name, menu_type) VALUES ('s', 'x') RETURNING id"
    ).fetchone()
    queue.enqueue("product_discovery", store, platform="x")
    (first,) = queue.claim_many("product_discovery", "owner", 1, start=True)
    # Given back and claimed again (by the same worker id): the first claim's lease is stale.
    assert queue.defer(first, 0)
    (task,) = queue.claim_many("product_discovery", "owner", 1, start=True)
    assert task.id == first.id and task.lease_token != first.lease_token
    insert = (
        "INSERT INTO products (dispensary_id, external_id, name, category, price, in_stock)"
        " VALUES (%s, %s, 'n', 'c', 1, true)"
    )

    strangers = {
        "forged": TaskContext(
            dataclasses.replace(task, lease_token=uuid.uuid4()), "owner", LOG, pool=queue.pool
        ),
        "stale": TaskContext(first, "owner", LOG, pool=queue.pool),
    }
    for name, stranger in strangers.items():
        ran: list[bool] = []
        with pytest.raises(LeaseLostError, match="nothing written"), stranger.transaction() as cur:
            ran.append(True)
            cur.execute(insert, (store, name))
        assert ran == [] and stranger.lost, name
        with pytest.raises(LeaseLostError):
            stranger.check_lease()
        # Nor can it complete the task, in a transaction of its own.
        with (
            pytest.raises(LeaseLostError),
            queue.pool.connection() as c,
            c.cursor(row_factory=dict_row) as cur,
        ):
            stranger.complete(cur, {"by": name})
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert queue.get(task.id).status == "running"

    owner = TaskContext(task, "owner", LOG, pool=queue.pool)
    with owner.transaction() as cur:
        cur.execute(insert, (store, "owner"))
    assert not owner.lost
    assert conn.execute("SELECT external_id FROM products").fetchall() == [("owner",)]

    # Once the task is finished, not even its owner may write for it.
    assert queue.complete(task, {"ok": True})
    with pytest.raises(LeaseLostError), owner.transaction() as cur:
        cur.execute(insert, (store, "late"))
    assert conn.execute("SELECT external_id FROM products").fetchall() == [("owner",)]


def test_a_crawl_of_a_store_disabled_meanwhile_is_skipped(
    conn: psycopg.Connection, queue: TaskQueue, menu_server: MenuServer
):
    menu_server.menu("quiet", [{"id": "a", "name": "A", "category": "flower", "price": 1, "in_stock": True}])
    store = add_local_store(conn, "quiet")
    task_id = queue.enqueue("product_resync", store, platform="local")
    conn.execute("UPDATE dispensaries SET crawl_enabled = false WHERE id = %s", (store,))
    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        drain(queue, "product_resync", services, concurrency=1)
    task = queue.get(task_id)
    assert (task.status, task.result) == ("completed", {"skipped": "crawl disabled"})
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)
    assert_settled(conn)


def test_an_entry_point_for_a_store_never_listed_fails_saying_what_to_do(
    conn: psycopg.Connection, queue: TaskQueue, menu_server: MenuServer
):
    store = add_local_store(conn, "by-hand")  # no store_crawl_state row: no directory id
    task_id = queue.enqueue("entry_point_discovery", store, platform="local")
    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        drain(queue, "entry_point_discovery", services, concurrency=1)
    task = queue.get(task_id)
    assert (task.status, task.retry_count) == ("failed", 0)
    assert "no directory id" in task.error_message and "store_crawl_state" in task.error_message
    assert conn.execute("SELECT crawl_enabled FROM dispensaries").fetchone() == (True,)


def test_a_failed_task_says_how_far_its_handler_got(
    conn: psycopg.Connection, queue: TaskQueue, menu_server: MenuServer
):
    """A menu that fails validation after the fetch: the error carries the last progress note."""
    menu_server.menu("half", [{"id": "a", "name": "A", "category": "flower", "price": -1, "in_stock": True}])
    store = add_local_store(conn, "half")
    task_id = queue.enqueue("product_discovery", store, platform="local")

    def fetch_then_fail(task: Task, ctx: TaskContext) -> Any:
        ctx.progress("fetched", products=1)
        return HANDLERS["product_discovery"](task, ctx)

    with CrawlServices({"local": PlatformSettings(base_url=menu_server.base_url, **FAST)}) as services:
        Worker(queue, "product_discovery", fetch_then_fail, services=services).run()
    task = queue.get(task_id)
    assert task is not None and task.status == "failed"
    assert "price must be between" in task.error_message
    assert task.error_message.endswith('(after: {"message": "fetched", "products": 1})')
