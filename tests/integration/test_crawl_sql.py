"""The crawl's SQL (migration 0004 and its named queries), on a migrated database: task payloads,
enqueue_once, listing upserts, menu storage with history, analytics, Retry-After and deferral,
and the per-platform error counts.

The handlers' writes (store_menu, mark_store_gone, save_entry_point, upsert_listed_stores) act for
a held task, under its lease (migration 0013): their tests go through a real claim. Tests that only
need data set up call the bodies behind them (tq_store_menu, tq_upsert_listed_stores, ...) as the
superuser."""

import threading
import time
import uuid
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.helpers import add_stores, assert_store_state_consistent
from tq_pipelines.crawl.menu import menu_hash, normalise_menu
from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import Lease, PlatformLimits, Task, TaskQueue

ROLE = "product_resync"
LOOSE = "store_discovery"  # tasks without a store


def ts(value: str) -> datetime:
    """A timestamp from to_jsonb's text."""
    return datetime.fromisoformat(value)


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT now()").fetchone()[0]


def row(conn: psycopg.Connection, table: str, where: str, *args: Any) -> dict[str, Any] | None:
    """One row as JSON (every column), for before/after comparisons."""
    found = conn.execute(f"SELECT to_jsonb(t) FROM {table} t WHERE {where}", args).fetchone()
    return None if found is None else found[0]


def insert_task(
    conn: psycopg.Connection, role: str = ROLE, dispensary_id: int | None = None, **cols: Any
) -> int:
    cols = {"role": role, "dispensary_id": dispensary_id, **cols}
    names = ", ".join(cols)
    marks = ", ".join(f"%({c})s" for c in cols)
    (task_id,) = conn.execute(
        f"INSERT INTO worker_tasks ({names}) VALUES ({marks}) RETURNING id", cols
    ).fetchone()
    return task_id


def set_task_times(conn: psycopg.Connection, task_id: int, **times: timedelta) -> None:
    """Move a task's timestamps back (``completed_at=timedelta(hours=3)``: three hours ago), in
    the queue or the history. The updated_at trigger would overwrite updated_at, so it is off for
    the one statement."""
    sets = ", ".join(f"{c} = now() - %({c})s" for c in times)
    conn.execute(f"UPDATE worker_task_history SET {sets} WHERE id = %(id)s", {"id": task_id, **times})
    conn.execute("ALTER TABLE worker_tasks DISABLE TRIGGER worker_tasks_updated_at")
    try:
        conn.execute(f"UPDATE worker_tasks SET {sets} WHERE id = %(id)s", {"id": task_id, **times})
    finally:
        conn.execute("ALTER TABLE worker_tasks ENABLE TRIGGER worker_tasks_updated_at")


# ------------------------------------------------------------------------------------------------
# worker_tasks.payload
# ------------------------------------------------------------------------------------------------


def test_payload_defaults_to_an_empty_object_for_inserts_that_name_none(conn: psycopg.Connection):
    (store,) = add_stores(conn, 1)
    task_id = insert_task(conn, ROLE, store, platform="dutchie")
    (loose,) = conn.execute(
        "INSERT INTO worker_tasks (role) VALUES ('analytics_refresh') RETURNING id"
    ).fetchone()
    got = conn.execute("SELECT id, payload FROM v_tasks ORDER BY id").fetchall()
    assert got == [(task_id, {}), (loose, {})]


def test_payload_must_be_an_object(conn: psycopg.Connection):
    task_id = insert_task(conn, "analytics_refresh")
    for bad in ("[1]", '"text"', "1", "null", "true"):
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            conn.execute(
                "INSERT INTO worker_tasks (role, payload) VALUES ('analytics_refresh', %s::jsonb)", (bad,)
            )
        assert info.value.diag.constraint_name == "payload_is_object"
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("UPDATE worker_tasks SET payload = %s::jsonb WHERE id = %s", (bad, task_id))
    assert conn.execute("SELECT payload FROM v_tasks").fetchall() == [({},)]


def test_enqueue_payload_round_trips_to_the_claimed_task(conn: psycopg.Connection, queue: TaskQueue):
    payload = {"platform": "dutchie", "region": "north", "nested": {"n": [1, 2.5, None, True]}, "ü": "✓"}
    task_id = queue.enqueue(LOOSE, platform="dutchie", payload=payload)
    plain = queue.enqueue("analytics_refresh")
    claimed = queue.claim(LOOSE, "w")
    assert claimed is not None and claimed.id == task_id
    assert claimed.payload == payload
    assert claimed.platform == "dutchie"
    assert queue.get(plain).payload == {}


# ------------------------------------------------------------------------------------------------
# enqueue_once
# ------------------------------------------------------------------------------------------------


def test_enqueue_once_dedupes_pending_and_active_tasks_of_a_store(conn: psycopg.Connection, queue: TaskQueue):
    a, b = add_stores(conn, 2)
    first = queue.enqueue_once(ROLE, a, payload={"day": 1, "kind": "x"})
    assert first is not None
    # Pending: same role, store and payload (key order does not matter) -> nothing.
    assert queue.enqueue_once(ROLE, a, payload={"kind": "x", "day": 1}) is None
    # Any of them different -> a task.
    other_payload = queue.enqueue_once(ROLE, a, payload={"day": 2, "kind": "x"})
    other_role = queue.enqueue_once("product_discovery", a, payload={"day": 1, "kind": "x"})
    other_store = queue.enqueue_once(ROLE, b, payload={"day": 1, "kind": "x"})
    no_payload = queue.enqueue_once(ROLE, a)
    created = [first, other_payload, other_role, other_store, no_payload]
    assert None not in created and len(set(created)) == 5
    assert queue.enqueue_once(ROLE, a, payload={}) is None  # no payload is {}

    claimed = queue.claim(ROLE, "w")
    assert claimed is not None and claimed.id == first
    assert queue.enqueue_once(ROLE, a, payload={"day": 1, "kind": "x"}) is None  # claimed
    assert queue.start(claimed)
    assert queue.enqueue_once(ROLE, a, payload={"day": 1, "kind": "x"}) is None  # running
    assert queue.complete(claimed, {"ok": True})
    again = queue.enqueue_once(ROLE, a, payload={"day": 1, "kind": "x"})
    assert again is not None and again not in created
    got = queue.get(again)
    assert (got.status, got.role, got.dispensary_id, got.payload) == (
        "pending",
        ROLE,
        a,
        {"day": 1, "kind": "x"},
    )
    counted = conn.execute(
        "SELECT count(*) FROM v_tasks WHERE role = %s AND dispensary_id = %s AND payload = %s",
        (ROLE, a, Jsonb({"day": 1, "kind": "x"})),
    ).fetchone()
    assert counted == (2,)  # the completed one and the new one
    assert_store_state_consistent(conn)


def test_enqueue_once_creates_again_after_a_task_failed_or_was_cancelled(queue: TaskQueue):
    first = queue.enqueue_once(LOOSE, payload={"platform": "p"})
    assert first is not None
    claimed = queue.claim(LOOSE, "w")
    assert claimed is not None and claimed.id == first
    assert queue.fail(claimed, "boom", retryable=False) == "failed"
    second = queue.enqueue_once(LOOSE, payload={"platform": "p"})
    assert second not in (None, first)
    assert queue.cancel(second)
    assert queue.enqueue_once(LOOSE, payload={"platform": "p"}) not in (None, first, second)


def test_enqueue_once_dedupes_loose_tasks(queue: TaskQueue):
    north = queue.enqueue_once(LOOSE, platform="dutchie", payload={"platform": "dutchie", "region": "north"})
    assert north is not None
    assert (
        queue.enqueue_once(LOOSE, platform="dutchie", payload={"platform": "dutchie", "region": "north"})
        is None
    )
    south = queue.enqueue_once(LOOSE, platform="dutchie", payload={"platform": "dutchie", "region": "south"})
    assert south not in (None, north)
    refresh = queue.enqueue_once("analytics_refresh")
    assert refresh is not None
    assert queue.enqueue_once("analytics_refresh") is None
    assert queue.get(north).dispensary_id is None


def test_enqueue_once_holds_between_concurrent_callers(db_url: str, conn: psycopg.Connection):
    params = {
        "role": LOOSE,
        "dispensary_id": None,
        "platform": "dutchie",
        "priority": 0,
        "scheduled_for": None,
        "payload": Jsonb({"platform": "dutchie"}),
    }
    result: dict[str, Any] = {}

    def other() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as b:
                b.execute("SET statement_timeout = '10s'")
                result["row"] = b.execute(query("enqueue_task_once"), params).fetchone()
        except Exception as exc:  # reported by the main thread
            result["error"] = exc

    with psycopg.connect(db_url) as a:
        first = a.execute(query("enqueue_task_once"), params).fetchone()
        assert first is not None and first[0] is not None  # not committed yet
        thread = threading.Thread(target=other)
        thread.start()
        # The second caller either finishes at once or waits for the first: let it get that far.
        deadline = time.monotonic() + 5
        while thread.is_alive() and time.monotonic() < deadline and not sessions_waiting_for_locks(conn):
            time.sleep(0.01)
        a.commit()
    thread.join(15)
    assert not thread.is_alive() and "error" not in result, result
    pending = conn.execute("SELECT count(*) FROM v_tasks WHERE role = %s", (LOOSE,)).fetchone()
    assert pending == (1,)
    assert result["row"] == (None,)


def sessions_waiting_for_locks(conn: psycopg.Connection) -> int:
    return conn.execute(
        """
        SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock'
        """
    ).fetchone()[0]


# ------------------------------------------------------------------------------------------------
# upsert_listed_stores
# ------------------------------------------------------------------------------------------------

UPSERT = (
    "SELECT dispensary_id, directory_id, created"
    " FROM upsert_listed_stores(%(task_id)s, %(lease)s, %(stores)s) ORDER BY directory_id"
)


def listing(ids: Any, region: str | None = "north") -> list[dict[str, Any]]:
    return [{"id": f"s{i:03d}", "name": f"Store {i}", "region": region} for i in ids]


def listing_task(queue: TaskQueue, platform: str | None, worker: str = "lister") -> Lease:
    """A store_discovery task of ``platform``, claimed: the lease a listing is upserted under
    (the platform is the task's). Each call a task of its own (a payload of its own)."""
    task_id = queue.enqueue(LOOSE, platform=platform, payload={"listing": uuid.uuid4().hex})
    task = queue.claim(LOOSE, worker)
    assert task is not None and task.id == task_id
    return task.lease


def upsert(conn: psycopg.Connection, lease: Lease, stores: list[dict[str, Any]]) -> list[tuple]:
    """upsert_listed_stores, for the store_discovery task held under ``lease``."""
    return conn.execute(UPSERT, {**lease.params, "stores": Jsonb(stores)}).fetchall()


def seed_listing(conn: psycopg.Connection, platform: str, stores: list[dict[str, Any]]) -> list[tuple]:
    """Stores listed by the body behind upsert_listed_stores, for tests that only need them."""
    return conn.execute(
        "SELECT dispensary_id, directory_id, created FROM tq_upsert_listed_stores(%s, %s)"
        " ORDER BY directory_id",
        (platform, Jsonb(stores)),
    ).fetchall()


def crawl_state(conn: psycopg.Connection, dispensary_id: int) -> dict[str, Any]:
    state = row(conn, "store_crawl_state", "dispensary_id = %s", dispensary_id)
    assert state is not None
    return state


def test_upsert_listed_stores_creates_new_stores_with_state_and_one_entry_point_task(
    conn: psycopg.Connection, queue: TaskQueue
):
    lease = listing_task(queue, "dutchie")
    stores = [*listing([1, 2]), {"id": "s003", "name": "", "region": None}, {"id": "s004"}]
    rows = upsert(conn, lease, stores)
    assert [(d, c) for _, d, c in rows] == [("s001", True), ("s002", True), ("s003", True), ("s004", True)]
    ids = [i for i, _, _ in rows]
    assert len(set(ids)) == 4
    dispensaries = conn.execute(
        "SELECT id, name, menu_type, crawl_enabled, platform_dispensary_id FROM dispensaries ORDER BY id"
    ).fetchall()
    names = ["Store 1", "Store 2", "s003", "s004"]  # no name: the directory id
    assert dispensaries == [(i, n, "dutchie", True, None) for i, n in zip(ids, names, strict=True)]
    states = conn.execute(
        """
        SELECT dispensary_id, platform, directory_id, region, first_listed_at = last_listed_at,
               first_listed_at IS NOT NULL, menu_hash, gone_at
        FROM store_crawl_state ORDER BY dispensary_id
        """
    ).fetchall()
    assert states == [
        (i, "dutchie", d, r, True, True, None, None)
        for i, d, r in zip(ids, ["s001", "s002", "s003", "s004"], ["north", "north", None, None], strict=True)
    ]
    tasks = conn.execute(
        "SELECT role, dispensary_id, platform, status, payload FROM v_tasks WHERE id <> %s ORDER BY id",
        (lease.task_id,),
    ).fetchall()
    assert sorted(tasks, key=lambda t: t[1]) == [
        ("entry_point_discovery", i, "dutchie", "pending", {}) for i in ids
    ]
    # The listing's own task is still held: the upsert writes for it, it does not finish it.
    assert queue.get(lease.task_id).status == "claimed"
    assert_store_state_consistent(conn)


def test_upsert_listed_stores_again_creates_nothing_and_marks_the_stores_listed(
    conn: psycopg.Connection, queue: TaskQueue
):
    lease = listing_task(queue, "dutchie")
    first = upsert(conn, lease, listing([1, 2, 3]))
    before = {i: crawl_state(conn, i) for i, _, _ in first}
    counts = conn.execute(
        "SELECT (SELECT count(*) FROM dispensaries), (SELECT count(*) FROM v_tasks)"
    ).fetchone()
    # s002 listed without a region keeps its region; s003 moves to another one.
    again_listing = [*listing([1]), {"id": "s002", "name": "Store 2"}, *listing([3], region="south")]
    again = upsert(conn, lease, again_listing)
    assert [(i, d, c) for i, d, c in again] == [(i, d, False) for i, d, _ in first]
    assert (
        conn.execute("SELECT (SELECT count(*) FROM dispensaries), (SELECT count(*) FROM v_tasks)").fetchone()
        == counts
    )
    for i, d, _ in first:
        after = crawl_state(conn, i)
        assert after["first_listed_at"] == before[i]["first_listed_at"]
        assert ts(after["last_listed_at"]) > ts(before[i]["last_listed_at"])
        assert after["region"] == ("south" if d == "s003" else "north")


def test_upsert_listed_stores_collapses_duplicates_and_keeps_platforms_apart(
    conn: psycopg.Connection, queue: TaskQueue
):
    dutchie, jane = listing_task(queue, "dutchie"), listing_task(queue, "jane")
    rows = upsert(conn, dutchie, [*listing([1]), *listing([2]), *listing([1]), *listing([2])])
    assert [(d, c) for _, d, c in rows] == [("s001", True), ("s002", True)]
    other = upsert(conn, jane, listing([1]))
    assert other[0][2] is True and other[0][0] not in {i for i, _, _ in rows}  # same id, other platform
    assert conn.execute("SELECT menu_type, count(*) FROM dispensaries GROUP BY 1 ORDER BY 1").fetchall() == [
        ("dutchie", 2),
        ("jane", 1),
    ]
    # One entry point per store, besides the two listings' own tasks.
    assert conn.execute("SELECT role, count(*) FROM v_tasks GROUP BY 1 ORDER BY 1").fetchall() == [
        ("entry_point_discovery", 3),
        ("store_discovery", 2),
    ]
    assert upsert(conn, dutchie, []) == []


def test_upsert_listed_stores_re_enables_a_gone_store_but_not_one_disabled_by_hand(
    conn: psycopg.Connection, queue: TaskQueue
):
    lease = listing_task(queue, "dutchie")
    (gone, _, _), (manual, _, _) = upsert(conn, lease, listing([1, 2]))
    conn.execute("SELECT tq_mark_store_gone(%s, %s)", (gone, "dutchie"))  # setup: the body, as the superuser
    conn.execute("UPDATE dispensaries SET crawl_enabled = false WHERE id = %s", (manual,))
    assert crawl_state(conn, gone)["gone_at"] is not None
    assert conn.execute("SELECT id, crawl_enabled FROM dispensaries ORDER BY id").fetchall() == [
        (gone, False),
        (manual, False),
    ]

    rows = upsert(conn, lease, listing([1, 2]))
    assert [(i, c) for i, _, c in rows] == [(gone, False), (manual, False)]
    assert conn.execute("SELECT id, crawl_enabled FROM dispensaries ORDER BY id").fetchall() == [
        (gone, True),
        (manual, False),
    ]
    assert crawl_state(conn, gone)["gone_at"] is None
    assert crawl_state(conn, manual)["gone_at"] is None


def test_upsert_listed_stores_refuses_an_empty_platform(conn: psycopg.Connection, queue: TaskQueue):
    """The platform is the listing task's (its platform, else its payload's): a task of none, or
    of an empty one, lists nothing."""
    no_platform = listing_task(queue, None)
    assert queue.get(no_platform.task_id).platform is None
    # An empty platform in the payload (enqueue would refuse it: set up by hand, then claimed).
    empty_id = insert_task(conn, LOOSE, None, payload=Jsonb({"platform": ""}))
    empty = queue.claim(LOOSE, "lister")
    assert empty is not None and empty.id == empty_id
    for lease in (no_platform, empty.lease):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
            upsert(conn, lease, listing([1]))
        assert info.value.sqlstate == "22023"
        assert "platform must not be empty" in str(info.value)
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone() == (0,)


def waiting_for_advisory_locks(conn: psycopg.Connection) -> int:
    return conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    ).fetchone()[0]


def test_concurrent_listings_of_one_platform_create_each_store_once(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """The second listing waits for the first (its transaction still open), then finds its stores:
    no duplicate, no unique violation. Two listing tasks of one platform, each with its lease."""
    first, second = listing(range(0, 60)), listing(range(30, 90))
    lease_a, lease_b = listing_task(queue, "dutchie", "a"), listing_task(queue, "dutchie", "b")
    result: dict[str, Any] = {}

    def other() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as b:
                b.execute("SET statement_timeout = '20s'")
                result["rows"] = upsert(b, lease_b, second)
        except Exception as exc:  # reported by the main thread
            result["error"] = exc

    with psycopg.connect(db_url) as a:
        rows_a = upsert(a, lease_a, first)  # not committed yet
        thread = threading.Thread(target=other)
        thread.start()
        deadline = time.monotonic() + 10
        while waiting_for_advisory_locks(conn) != 1:
            assert time.monotonic() < deadline, "the second listing never waited for the first"
            assert thread.is_alive(), result
            time.sleep(0.01)
        a.commit()
    thread.join(20)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert sum(c for _, _, c in rows_a) == 60
    rows_b = result["rows"]
    assert len(rows_b) == 60
    assert sorted(d for _, d, c in rows_b if c) == [f"s{i:03d}" for i in range(60, 90)]
    ids_a = {d: i for i, d, _ in rows_a}
    assert all(ids_a[d] == i for i, d, _ in rows_b if d in ids_a)
    assert conn.execute(
        """
        SELECT count(*), count(DISTINCT directory_id),
               (SELECT count(*) FROM dispensaries WHERE menu_type = 'dutchie'),
               (SELECT count(*) FROM v_tasks WHERE role = 'entry_point_discovery')
        FROM store_crawl_state WHERE platform = 'dutchie'
        """
    ).fetchone() == (90, 90, 90, 90)


def test_concurrent_listings_from_threads_started_together(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """Free-for-all: four listings of one platform at once, overlapping; each store once."""
    barrier = threading.Barrier(4)
    errors: list[Exception] = []
    leases = [listing_task(queue, "dutchie", f"lister-{n}") for n in range(4)]

    def run(start: int, lease: Lease) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                c.execute("SET statement_timeout = '20s'")
                barrier.wait(10)
                upsert(c, lease, listing(range(start, start + 40)))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n * 20, leases[n])) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert conn.execute(
        """
        SELECT count(*), count(DISTINCT directory_id),
               (SELECT count(*) FROM v_tasks WHERE role = 'entry_point_discovery'),
               (SELECT count(*) FROM v_tasks WHERE role <> 'entry_point_discovery')
        FROM store_crawl_state
        """
    ).fetchone() == (100, 100, 100, 4)  # and the four listings' own tasks


# ------------------------------------------------------------------------------------------------
# store_menu
# ------------------------------------------------------------------------------------------------


def item(ident: str, price: Any, in_stock: bool = True, **more: Any) -> dict[str, Any]:
    return {
        "id": ident,
        "name": f"Product {ident}",
        "category": "flower",
        "price": price,
        "in_stock": in_stock,
        **more,
    }


def menu_task(conn: psycopg.Connection, queue: TaskQueue, role: str = ROLE) -> tuple[int, Lease]:
    """A new store with a task of ``role``, claimed: (the store, the task's lease)."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(role, store)
    task = queue.claim(role, "crawler")
    assert task is not None and task.id == task_id
    return store, task.lease


def store_menu(conn: psycopg.Connection, lease: Lease, raw: list[dict[str, Any]]) -> dict[str, Any]:
    """store_menu (the named query), for the task held under ``lease``: its store's menu."""
    products = normalise_menu(raw)
    params = {**lease.params, "menu_hash": menu_hash(products), "products": Jsonb(products)}
    with conn.cursor(row_factory=dict_row) as cur:
        got = cur.execute(query("store_menu"), params).fetchone()
    assert got is not None
    return got


def seed_menu(conn: psycopg.Connection, dispensary_id: int, raw: list[dict[str, Any]]) -> dict[str, Any]:
    """A menu stored by the body behind store_menu, for tests that only need it stored."""
    products = normalise_menu(raw)
    with conn.cursor(row_factory=dict_row) as cur:
        got = cur.execute(
            "SELECT * FROM tq_store_menu(%s, %s, %s)", (dispensary_id, menu_hash(products), Jsonb(products))
        ).fetchone()
    assert got is not None
    return got


def counts(result: dict[str, Any]) -> tuple:
    return (result["unchanged"], result["seen"], result["new"], result["changed"], result["gone"])


def history(conn: psycopg.Connection, dispensary_id: int, after_id: int = 0) -> list[tuple]:
    return conn.execute(
        """
        SELECT p.external_id, h.change, h.price, h.old_price, h.in_stock, h.old_in_stock
        FROM product_history h JOIN products p ON p.id = h.product_id
        WHERE h.dispensary_id = %s AND h.id > %s
        ORDER BY p.external_id, h.id
        """,
        (dispensary_id, after_id),
    ).fetchall()


def last_history_id(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT coalesce(max(id), 0) FROM product_history").fetchone()[0]


def products_of(conn: psycopg.Connection, dispensary_id: int) -> dict[str, dict[str, Any]]:
    rows = conn.execute(
        "SELECT p.external_id, to_jsonb(p) FROM products p WHERE dispensary_id = %s", (dispensary_id,)
    ).fetchall()
    return dict(rows)


FIRST_MENU = [item("A", "10", True), item("B", 20, True), item("C", "30.00", False), item("E", 5, True)]


def test_store_menu_first_menu_is_all_new_with_history(conn: psycopg.Connection, queue: TaskQueue):
    store, lease = menu_task(conn, queue)
    result = store_menu(conn, lease, FIRST_MENU)
    assert counts(result) == (False, 4, 4, 0, 0)
    d = Decimal
    assert history(conn, store) == [
        ("A", "new", d("10.00"), None, True, None),
        ("B", "new", d("20.00"), None, True, None),
        ("C", "new", d("30.00"), None, False, None),
        ("E", "new", d("5.00"), None, True, None),
    ]
    products = products_of(conn, store)
    assert {k: (v["price"], v["in_stock"], v["gone_at"]) for k, v in products.items()} == {
        "A": (10.0, True, None),
        "B": (20.0, True, None),
        "C": (30.0, False, None),
        "E": (5.0, True, None),
    }
    state = crawl_state(conn, store)
    assert state["menu_hash"] == menu_hash(normalise_menu(FIRST_MENU))
    assert state["platform"] == "dutchie"  # from the store's menu_type
    assert state["last_crawl_at"] is not None and state["last_change_at"] is not None


def test_store_menu_with_the_same_hash_writes_nothing_but_the_crawl_time(
    conn: psycopg.Connection, queue: TaskQueue
):
    store, lease = menu_task(conn, queue)
    store_menu(conn, lease, FIRST_MENU)
    products, rows, state = products_of(conn, store), history(conn, store), crawl_state(conn, store)
    # Same menu, other order and spelling: the same hash.
    again = store_menu(conn, lease, [dict(p, name=f"  {p['name']} ") for p in reversed(FIRST_MENU)])
    assert counts(again) == (True, 4, 0, 0, 0)
    assert products_of(conn, store) == products
    assert history(conn, store) == rows
    after = crawl_state(conn, store)
    assert ts(after["last_crawl_at"]) > ts(state["last_crawl_at"])
    assert {k: v for k, v in after.items() if k != "last_crawl_at"} == {
        k: v for k, v in state.items() if k != "last_crawl_at"
    }


def test_store_menu_checks_products_only_where_it_writes_them(conn: psycopg.Connection, queue: TaskQueue):
    """An unchanged hash writes none of the products, so they are not checked (0030); under a new
    hash the same products are refused, and nothing is written."""
    store, lease = menu_task(conn, queue)
    store_menu(conn, lease, FIRST_MENU)
    stored = menu_hash(normalise_menu(FIRST_MENU))
    products, rows = products_of(conn, store), history(conn, store)
    bad = Jsonb([{"id": "A", "price": "-1"}, {"id": "A"}])
    call = "SELECT unchanged, seen FROM store_menu(%s, %s, %s, %s)"
    assert conn.execute(call, (lease.task_id, lease.token, stored, bad)).fetchone() == (True, 2)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"product #0 \(id 'A'\) has no name"):
        conn.execute(call, (lease.task_id, lease.token, "another", bad))
    assert products_of(conn, store) == products
    assert history(conn, store) == rows
    assert crawl_state(conn, store)["menu_hash"] == stored


def test_store_menu_records_exactly_what_changed(conn: psycopg.Connection, queue: TaskQueue):
    store, lease = menu_task(conn, queue)
    store_menu(conn, lease, FIRST_MENU)
    before, mark, state = products_of(conn, store), last_history_id(conn), crawl_state(conn, store)
    # A's price changes, B goes out of stock, C is gone, D is new, E is as it was.
    changed_menu = [item("A", "11.5", True), item("B", 20, False), item("D", 7, True), item("E", 5, True)]
    result = store_menu(conn, lease, changed_menu)
    assert counts(result) == (False, 4, 1, 2, 1)
    d = Decimal
    assert history(conn, store, mark) == [
        ("A", "changed", d("11.50"), d("10.00"), True, True),
        ("B", "changed", d("20.00"), d("20.00"), False, True),
        ("C", "gone", None, d("30.00"), None, False),
        ("D", "new", d("7.00"), None, True, None),
    ]
    after = products_of(conn, store)
    assert set(after) == {"A", "B", "C", "D", "E"}  # the gone product is kept
    assert after["C"]["gone_at"] is not None
    assert after["C"]["price"] == 30.0 and after["C"]["in_stock"] is False
    assert all(after[k]["gone_at"] is None for k in "ABDE")
    assert (after["A"]["price"], after["B"]["in_stock"]) == (11.5, False)
    for k in "AB":
        assert ts(after[k]["changed_at"]) > ts(before[k]["changed_at"])
    assert after["E"]["changed_at"] == before["E"]["changed_at"]
    assert ts(after["E"]["last_seen_at"]) > ts(before["E"]["last_seen_at"])
    assert after["C"]["last_seen_at"] == before["C"]["last_seen_at"]
    new_state = crawl_state(conn, store)
    assert new_state["menu_hash"] == menu_hash(normalise_menu(changed_menu))
    assert ts(new_state["last_change_at"]) > ts(state["last_change_at"])

    # C comes back (at a new price): 'back', counted as changed.
    mark = last_history_id(conn)
    back_menu = [*changed_menu, item("C", 31, True)]
    assert counts(store_menu(conn, lease, back_menu)) == (False, 5, 0, 1, 0)
    assert history(conn, store, mark) == [("C", "back", d("31.00"), d("30.00"), True, False)]
    assert products_of(conn, store)["C"]["gone_at"] is None

    # C goes again, then stays away while something else changes: one 'gone', not one per menu.
    mark = last_history_id(conn)
    assert counts(store_menu(conn, lease, changed_menu)) == (False, 4, 0, 0, 1)
    assert counts(store_menu(conn, lease, [*changed_menu[:3], item("E", 6, True)])) == (False, 4, 0, 1, 0)
    assert [(h[0], h[1]) for h in history(conn, store, mark)] == [("C", "gone"), ("E", "changed")]


def test_store_menu_changes_of_name_only_write_no_history(conn: psycopg.Connection, queue: TaskQueue):
    store, lease = menu_task(conn, queue)
    store_menu(conn, lease, FIRST_MENU)
    mark, state = last_history_id(conn), crawl_state(conn, store)
    renamed = [dict(p, name="Renamed") if p["id"] == "A" else p for p in FIRST_MENU]
    assert counts(store_menu(conn, lease, renamed)) == (False, 4, 0, 0, 0)
    assert history(conn, store, mark) == []
    assert products_of(conn, store)["A"]["name"] == "Renamed"
    assert crawl_state(conn, store)["last_change_at"] == state["last_change_at"]


def test_store_menu_refuses_a_store_that_does_not_exist(conn: psycopg.Connection, queue: TaskQueue):
    # The body, given a store id that names none.
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        seed_menu(conn, 987654, FIRST_MENU)
    assert info.value.sqlstate == "22023"
    assert "no store with id 987654" in str(info.value)
    # The API's function, for a held task of no store (set up by hand: enqueue would refuse it).
    task_id = insert_task(conn, ROLE, None)
    task = queue.claim(ROLE, "crawler")
    assert task is not None and task.id == task_id
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        store_menu(conn, task.lease, FIRST_MENU)
    assert info.value.sqlstate == "22023"
    assert "no store with id NULL" in str(info.value)
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)


# ------------------------------------------------------------------------------------------------
# refresh_store_analytics
# ------------------------------------------------------------------------------------------------


def refresh(conn: psycopg.Connection) -> tuple[int, int]:
    return conn.execute("SELECT stores, removed FROM refresh_store_analytics()").fetchone()


def analytics(conn: psycopg.Connection) -> dict[int, dict[str, Any]]:
    rows = conn.execute("SELECT dispensary_id, to_jsonb(a) FROM store_analytics a").fetchall()
    return dict(rows)


def test_refresh_store_analytics_counts_per_store(conn: psycopg.Connection):
    one, two = add_stores(conn, 2)
    ((listed_only, _, _),) = seed_listing(conn, "jane", listing([1]))  # crawl state, no products
    seed_menu(conn, one, [item("A", 10, True), item("B", 20, True), item("C", 30, False), item("F", 1, True)])
    seed_menu(
        conn, one, [item("A", 11, True), item("B", 20, False), item("F", 1, True)]
    )  # price, stock, gone
    seed_menu(conn, one, [item("A", 11, True), item("B", 20, False), item("F", 2, True)])  # price
    # F's price change was two days ago: in the week, not the day.
    conn.execute(
        """
        UPDATE product_history h SET observed_at = now() - interval '2 days'
        FROM products p
        WHERE p.id = h.product_id AND p.external_id = 'F' AND h.change = 'changed'
        """
    )
    seed_menu(conn, two, [item("X", 1, True), item("Y", 2, False)])
    now = db_now(conn)
    insert_task(conn, "product_discovery", one, status="completed", completed_at=now - timedelta(hours=3))
    insert_task(conn, "product_resync", one, status="completed", completed_at=now - timedelta(hours=1))
    insert_task(
        conn, "entry_point_discovery", one, status="completed", completed_at=now - timedelta(minutes=1)
    )
    insert_task(conn, "product_resync", one, status="failed", completed_at=now - timedelta(minutes=1))
    insert_task(conn, "product_resync", one, status="pending")

    assert refresh(conn) == (3, 0)
    got = analytics(conn)
    assert set(got) == {one, two, listed_only}
    a = got[one]
    assert (a["products_listed"], a["products_in_stock"]) == (3, 2)  # A, B, F; A and F in stock
    assert (a["price_changes_24h"], a["price_changes_7d"]) == (1, 2)  # B's stock flip is not a price change
    state = crawl_state(conn, one)
    # The last menu stored or found unchanged, whatever the tasks' history says.
    assert (a["last_success_at"], a["last_change_at"], a["platform"]) == (
        state["last_crawl_at"],
        state["last_change_at"],
        "dutchie",
    )
    b = got[two]
    assert (b["products_listed"], b["products_in_stock"], b["price_changes_24h"], b["price_changes_7d"]) == (
        2,
        1,
        0,
        0,
    )
    assert b["last_success_at"] == crawl_state(conn, two)["last_crawl_at"] is not None
    c = got[listed_only]
    assert (c["products_listed"], c["products_in_stock"], c["platform"], c["last_success_at"]) == (
        0,
        0,
        "jane",
        None,
    )

    # Freshness is computed when read: an hour after the last stored menu reads as an hour.
    conn.execute(
        "UPDATE store_analytics SET last_success_at = now() - interval '1 hour' WHERE dispensary_id = %s",
        (one,),
    )
    hours = dict(conn.execute("SELECT dispensary_id, hours_since_success FROM v_store_freshness").fetchall())
    assert float(hours[one]) == pytest.approx(1.0, abs=0.05)
    assert float(hours[two]) == pytest.approx(0.0, abs=0.05)
    assert hours[listed_only] is None

    # A store whose crawl state is deleted leaves the analytics on the next refresh.
    conn.execute("DELETE FROM store_crawl_state WHERE dispensary_id = %s", (two,))
    assert refresh(conn) == (2, 1)
    assert set(analytics(conn)) == {one, listed_only}


def test_readers_see_the_old_analytics_while_a_refresh_is_open(db_url: str, conn: psycopg.Connection):
    (store,) = add_stores(conn, 1)
    seed_menu(conn, store, [item("A", 1), item("B", 2), item("C", 3)])
    refresh(conn)
    seed_menu(conn, store, [item("A", 1), item("B", 2), item("C", 3), item("D", 4)])
    listed = "SELECT products_listed FROM store_analytics WHERE dispensary_id = %s"
    with psycopg.connect(db_url) as writer, psycopg.connect(db_url, autocommit=True) as reader:
        reader.execute("SET statement_timeout = '2s'")
        assert refresh(writer) == (1, 0)  # open: not committed
        assert writer.execute(listed, (store,)).fetchone() == (4,)
        # A reader that waited for the writer's locks would hit the timeout.
        assert reader.execute(listed, (store,)).fetchone() == (3,)
        assert reader.execute("SELECT count(*) FROM v_store_freshness").fetchone() == (1,)
        assert reader.execute("SELECT count(*) FROM store_analytics").fetchone() == (1,)
        writer.commit()
        assert reader.execute(listed, (store,)).fetchone() == (4,)


# ------------------------------------------------------------------------------------------------
# fail_task with Retry-After
# ------------------------------------------------------------------------------------------------


def claimed_task(conn: psycopg.Connection, queue: TaskQueue, worker: str = "w") -> Task:
    """A new store's task, claimed: the Task the claim returned, with its lease token."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store, platform="dutchie")
    task = queue.claim(ROLE, worker)
    assert task is not None and task.id == task_id and task.lease_token is not None
    return task


def fail_and_measure(
    conn: psycopg.Connection, queue: TaskQueue, task: Task, retry_after: float | None
) -> tuple[float, float]:
    """Fail the task; returns the bounds of (scheduled_for - the failure's now()) in seconds."""
    before = db_now(conn)
    assert queue.fail(task, "HTTP 429", retry_after=retry_after) == "pending"
    after = db_now(conn)
    scheduled_for = queue.get(task.id).scheduled_for
    return (scheduled_for - after).total_seconds(), (scheduled_for - before).total_seconds()


def role_backoff(conn: psycopg.Connection, role: str = ROLE) -> tuple[int, int]:
    return conn.execute(
        "SELECT retry_base_seconds, retry_cap_seconds FROM worker_task_roles WHERE role = %s", (role,)
    ).fetchone()


def test_fail_with_retry_after_waits_at_least_that_long(conn: psycopg.Connection, queue: TaskQueue):
    base, _ = role_backoff(conn)
    assert base < 600  # so that the Retry-After is what decides
    claimed = claimed_task(conn, queue)
    low, high = fail_and_measure(conn, queue, claimed, 600)
    assert low >= 600 - 1 and high <= 600 + 1
    task = queue.get(claimed.id)
    assert (task.status, task.retry_count, task.worker_id, task.error_message) == (
        "pending",
        1,
        None,
        "HTTP 429",
    )
    assert_store_state_consistent(conn)


def test_fail_caps_retry_after_at_a_day(conn: psycopg.Connection, queue: TaskQueue):
    task = claimed_task(conn, queue)
    low, high = fail_and_measure(conn, queue, task, 10 * 86400)
    assert low >= 86400 - 1 and high <= 86400 + 1


def test_fail_without_a_longer_retry_after_backs_off_as_before(conn: psycopg.Connection, queue: TaskQueue):
    base, _ = role_backoff(conn)
    for retry_after in (None, 0, -60, 1):
        task = claimed_task(conn, queue)
        low, high = fail_and_measure(conn, queue, task, retry_after)
        # retry 1: base * 2^0 with jitter in [50%, 100%]
        assert low >= base * 0.5 - 1 and high <= base + 1, retry_after
    assert_store_state_consistent(conn)


@pytest.mark.parametrize(("call", "seconds"), [("fail", 1e14), ("defer", float("inf"))])
def test_an_absurd_retry_after_is_capped_at_a_day(
    conn: psycopg.Connection, queue: TaskQueue, seconds: float, call: str
):
    task = claimed_task(conn, queue)
    if call == "fail":
        assert queue.fail(task, "HTTP 429", retry_after=seconds) == "pending"
    else:
        assert queue.defer(task, seconds)
    due_in = conn.execute("SELECT scheduled_for - now() FROM v_tasks WHERE id = %s", (task.id,)).fetchone()[0]
    assert due_in <= timedelta(days=1)


# ------------------------------------------------------------------------------------------------
# defer_task
# ------------------------------------------------------------------------------------------------


def test_defer_gives_the_task_back_untried(conn: psycopg.Connection, queue: TaskQueue):
    claimed = claimed_task(conn, queue)
    task_id = claimed.id
    # Spend one retry first, so that "unchanged" is not just "still zero".
    conn.execute(
        "UPDATE worker_tasks SET retry_count = 1, error_message = 'earlier' WHERE id = %s", (task_id,)
    )
    assert queue.start(claimed)
    before = db_now(conn)
    assert queue.defer(claimed, 300) is True
    after = db_now(conn)
    task = queue.get(task_id)
    assert task.status == "pending"
    assert task.retry_count == 1
    assert task.error_message == "earlier"
    assert before + timedelta(seconds=300) <= task.scheduled_for <= after + timedelta(seconds=300)
    assert (task.worker_id, task.claimed_at, task.started_at, task.last_heartbeat_at) == (
        None,
        None,
        None,
        None,
    )
    assert_store_state_consistent(conn)
    assert conn.execute(
        "SELECT active_task_id FROM worker_task_stores WHERE dispensary_id = %s", (task.dispensary_id,)
    ).fetchone() == (None,)
    assert queue.claim(ROLE, "w2") is None  # not due for five minutes
    conn.execute(
        "UPDATE worker_tasks SET scheduled_for = now() - interval '1 second' WHERE id = %s", (task_id,)
    )
    again = queue.claim(ROLE, "w2")
    assert again is not None and again.id == task_id and again.retry_count == 1
    # The new claim's lease is a new one: the old is spent, whoever presents it.
    assert again.lease_token != claimed.lease_token
    held = row(conn, "worker_tasks", "id = %s", task_id)
    assert queue.start(claimed) is False
    assert queue.defer(claimed, 0) is False
    assert queue.complete(claimed, {"stale": True}) is False
    assert row(conn, "worker_tasks", "id = %s", task_id) == held
    assert queue.complete(again, {"ok": True}) is True
    assert_store_state_consistent(conn)


def test_defer_by_a_non_owner_changes_nothing(conn: psycopg.Connection, queue: TaskQueue):
    task = claimed_task(conn, queue)
    other = claimed_task(conn, queue, worker="someone-else")
    before = row(conn, "worker_tasks", "id = %s", task.id)
    # A made-up token, and another held task's real one: neither is this task's lease.
    assert queue.defer(Lease(task.id, uuid.uuid4()), 60) is False
    assert queue.defer(Lease(task.id, other.lease.token), 60) is False
    assert row(conn, "worker_tasks", "id = %s", task.id) == before
    assert queue.complete(task, {})
    done = row(conn, "worker_tasks", "id = %s", task.id)
    assert queue.defer(task, 60) is False  # finished: nothing to give back
    assert row(conn, "worker_tasks", "id = %s", task.id) == done
    assert queue.get(other.id).status == "claimed"
    assert_store_state_consistent(conn)


def test_defer_delay_is_clamped_to_now_and_a_day(conn: psycopg.Connection, queue: TaskQueue):
    for delay, expected in ((-30, 0), (0, 0), (10 * 86400, 86400)):
        task = claimed_task(conn, queue)
        before = db_now(conn)
        assert queue.defer(task, delay)
        after = db_now(conn)
        scheduled_for = queue.get(task.id).scheduled_for
        low, high = before + timedelta(seconds=expected), after + timedelta(seconds=expected)
        assert low <= scheduled_for <= high, delay
        assert queue.cancel(task.id)  # out of the next claim's way
    assert_store_state_consistent(conn)


def test_task_still_owned_only_for_the_owner_while_active(conn: psycopg.Connection, queue: TaskQueue):
    task = claimed_task(conn, queue)

    def owned(lease: Lease) -> bool:
        return conn.execute(query("task_still_owned"), lease.params).fetchone() is not None

    assert owned(task.lease) and not owned(Lease(task.id, uuid.uuid4()))
    assert queue.defer(task, 0)
    assert not owned(task.lease)
    # Claimed again: the new lease holds it, the old one (stale) does not.
    again = queue.claim(ROLE, "w")
    assert again is not None and again.id == task.id
    assert owned(again.lease) and not owned(task.lease)


# ------------------------------------------------------------------------------------------------
# platform_errors
# ------------------------------------------------------------------------------------------------


def test_platform_errors_counts_the_window_per_platform(conn: psycopg.Connection, queue: TaskQueue):
    # (label, platform, outcome, error, moved back by)
    plan = [
        ("a-done-1", "alpha", "complete", None, None),
        ("a-done-2", "alpha", "complete", None, None),
        ("a-failed", "alpha", "failed", "alpha failed", timedelta(minutes=10)),
        ("a-retry", "alpha", "retry", "alpha retry, newest", timedelta(minutes=2)),
        ("a-old-done", "alpha", "complete", None, timedelta(hours=3)),
        ("a-old-failed", "alpha", "failed", "alpha old failure", timedelta(hours=3)),
        ("a-old-retry", "alpha", "retry", "alpha old retry", timedelta(hours=2)),
        ("b-failed", "beta", "failed", "beta failed", None),
        ("b-pending", "beta", "pending", None, None),
        ("g-old-done", "gamma", "complete", None, timedelta(hours=5)),
        ("none-failed", None, "failed", "no platform", None),
    ]
    ids = {label: queue.enqueue(LOOSE, platform=p, payload={"label": label}) for label, p, *_ in plan}
    claimed = {t.payload["label"]: t for t in queue.claim_many(LOOSE, "w", 100)}
    assert {label: t.id for label, t in claimed.items()} == ids
    for label, _, outcome, error, back in plan:
        task_id, task = ids[label], claimed[label]
        if outcome == "complete":
            assert queue.complete(task, {})
        elif outcome == "failed":
            assert queue.fail(task, error, retryable=False) == "failed"
        elif outcome == "retry":
            assert queue.fail(task, error) == "pending"
        else:
            assert queue.defer(task, 0)  # pending, never failed: no error
        if back is not None:
            columns = {"updated_at": back} | ({} if outcome == "retry" else {"completed_at": back})
            set_task_times(conn, task_id, **columns)

    assert queue.platform_errors(60) == [
        {"platform": "alpha", "completed": 2, "errors": 2, "last_error": "alpha retry, newest"},
        {"platform": "beta", "completed": 0, "errors": 1, "last_error": "beta failed"},
    ]
    # A longer window takes the older ones in; the newest error is still the newest.
    assert queue.platform_errors(600) == [
        {"platform": "alpha", "completed": 3, "errors": 4, "last_error": "alpha retry, newest"},
        {"platform": "beta", "completed": 0, "errors": 1, "last_error": "beta failed"},
        {"platform": "gamma", "completed": 1, "errors": 0, "last_error": None},
    ]
    assert queue.platform_errors(1) == [
        {"platform": "alpha", "completed": 2, "errors": 0, "last_error": None},
        {"platform": "beta", "completed": 0, "errors": 1, "last_error": "beta failed"},
    ]


# -- review fixes: unresolved stores, bad listings and menus, heartbeats beside a writing handler


def test_listing_again_retries_the_entry_point_of_a_store_still_unresolved(
    conn: psycopg.Connection, queue: TaskQueue
):
    lease = listing_task(queue, "dutchie")
    [(store, _, _)] = upsert(conn, lease, listing([1]))
    # Its entry point failed for good (say, 5xx until out of retries): the store has no platform id.
    conn.execute(
        "UPDATE worker_tasks SET status = 'failed', completed_at = now() WHERE dispensary_id = %s", (store,)
    )
    upsert(conn, lease, listing([1]))
    assert conn.execute(
        "SELECT status FROM v_tasks WHERE dispensary_id = %s AND role = 'entry_point_discovery' ORDER BY id",
        (store,),
    ).fetchall() == [("failed",), ("pending",)]
    upsert(conn, lease, listing([1]))  # one is pending already: not a second
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE status = 'pending'").fetchone() == (1,)
    # Resolved, or disabled by hand: nothing more is queued. (Every task finished, the listing's
    # too: each listing after this one is a new task's.)
    conn.execute("UPDATE worker_tasks SET status = 'completed', completed_at = now()")
    conn.execute("UPDATE dispensaries SET crawl_enabled = false")
    upsert(conn, listing_task(queue, "dutchie"), listing([1]))
    conn.execute("UPDATE dispensaries SET crawl_enabled = true, platform_dispensary_id = 'p1'")
    upsert(conn, listing_task(queue, "dutchie"), listing([1]))
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE status = 'pending'").fetchone() == (0,)


@pytest.mark.parametrize("ident", [None, ""])
def test_upsert_listed_stores_refuses_a_store_without_an_id(
    conn: psycopg.Connection, queue: TaskQueue, ident: Any
):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="non-empty id"):
        upsert(conn, listing_task(queue, "dutchie"), [*listing([1]), {"id": ident, "name": "x"}])
    assert conn.execute("SELECT count(*) FROM dispensaries").fetchone() == (0,)


@pytest.mark.parametrize(
    ("menu_hash", "products"),
    [
        pytest.param(None, [item("A", 1)], id="no hash"),
        pytest.param("h", [item("A", 1), item("A", 2)], id="duplicate id"),
        pytest.param("h", [{"name": "no id", "price": 1, "in_stock": True, "category": "c"}], id="no id"),
    ],
)
def test_store_menu_refuses_what_it_cannot_store_faithfully(
    conn: psycopg.Connection, queue: TaskQueue, menu_hash: str | None, products: list[dict[str, Any]]
):
    _, lease = menu_task(conn, queue)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute(
            "SELECT * FROM store_menu(%s, %s, %s, %s)",
            (lease.task_id, lease.token, menu_hash, Jsonb(products)),
        )
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (0,)


def test_a_heartbeat_does_not_wait_for_a_handler_writing_its_task(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """A handler's write transaction holds its task row FOR SHARE; the worker's heartbeat reports
    that task owned without waiting for it, and beats the others."""
    stores = add_stores(conn, 3)
    for s in stores:
        queue.enqueue(ROLE, s)
    tasks = sorted(queue.claim_many(ROLE, "w", 3, start=True), key=lambda t: t.id)
    ids = [t.id for t in tasks]
    assert len(ids) == 3
    conn.execute("UPDATE worker_tasks SET last_heartbeat_at = now() - interval '5 minutes'")
    with psycopg.connect(db_url) as handler:
        handler.execute("SELECT 1 FROM task_still_owned(%(task_id)s, %(lease)s)", tasks[1].lease.params)
        with psycopg.connect(db_url, autocommit=True) as worker:
            worker.execute("SET statement_timeout = '3s'")
            [owned] = worker.execute(  # type: ignore[misc]
                "SELECT heartbeat_tasks('w', %s, %s::uuid[])", (ids, [t.lease_token for t in tasks])
            ).fetchone()
        handler.rollback()
    assert owned == sorted(ids)
    fresh = dict(
        conn.execute("SELECT id, last_heartbeat_at > now() - interval '1 minute' FROM v_tasks").fetchall()
    )
    assert fresh == {ids[0]: True, ids[1]: False, ids[2]: True}


# ------------------------------------------------------------------------------------------------
# The handlers' writes act for a held task (migration 0013)
# ------------------------------------------------------------------------------------------------

# name: (the role that may call it, a role that may not, its arguments besides the lease, what it
# writes for the store of the test: true once written)
HANDLER_WRITES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "store_menu": (
        "product_resync",
        "entry_point_discovery",
        {"menu_hash": "h", "products": Jsonb(normalise_menu([item("A", 1)]))},
        "SELECT count(*) = 1 FROM products WHERE dispensary_id = %(store)s",
    ),
    "mark_store_gone": (
        "product_discovery",
        "store_discovery",
        {},
        "SELECT NOT crawl_enabled FROM dispensaries WHERE id = %(store)s",
    ),
    "save_entry_point": (
        "entry_point_discovery",
        "product_discovery",
        {"platform_id": "p-new", "menu_url": "/menus/p-new"},
        "SELECT platform_dispensary_id = 'p-new' FROM dispensaries WHERE id = %(store)s",
    ),
    "upsert_listed_stores": (
        "store_discovery",
        "entry_point_discovery",
        {"stores": Jsonb(listing([7]))},
        "SELECT count(*) = 1 FROM store_crawl_state WHERE directory_id = 's007'",
    ),
}


def crawl_tables(conn: psycopg.Connection) -> tuple:
    """Everything a handler's write could change, for before/after comparisons."""
    return conn.execute(
        """
        SELECT (SELECT jsonb_agg(to_jsonb(d) ORDER BY d.id) FROM dispensaries d),
               (SELECT jsonb_agg(to_jsonb(c) ORDER BY c.dispensary_id) FROM store_crawl_state c),
               (SELECT jsonb_agg(to_jsonb(p) ORDER BY p.id) FROM products p),
               (SELECT count(*) FROM product_history),
               (SELECT count(*) FROM v_tasks)
        """
    ).fetchone()


def claim_for(conn: psycopg.Connection, queue: TaskQueue, role: str, worker: str) -> Task:
    """A task of ``role`` claimed: a store_discovery task of dutchie, else one of a new store."""
    if role == LOOSE:
        task_id = queue.enqueue(role, platform="dutchie", payload={"platform": "dutchie"})
    else:
        (store,) = add_stores(conn, 1)
        task_id = queue.enqueue(role, store)
    task = queue.claim(role, worker)
    assert task is not None and task.id == task_id
    return task


@pytest.mark.parametrize("name", list(HANDLER_WRITES))
def test_handler_writes_need_the_lease_of_a_held_task_of_their_role(
    conn: psycopg.Connection, queue: TaskQueue, name: str
):
    """A forged token, another task's token, no token, a held task of another role, a stale lease
    (the task given back and claimed again) and a finished task's lease are all refused (42501),
    writing nothing; the current lease writes, for its task's store or platform."""
    role, wrong_role, args, written = HANDLER_WRITES[name]
    task = claim_for(conn, queue, role, "holder")
    other = claim_for(conn, queue, wrong_role, "other")
    store = task.dispensary_id
    sql = query(name)

    def call(params: dict[str, Any]) -> None:
        conn.execute(sql, {**params, **args}).fetchall()

    before = crawl_tables(conn)
    refused = {
        "forged token": {"task_id": task.id, "lease": uuid.uuid4()},
        "another task's token": {"task_id": task.id, "lease": other.lease_token},
        "no token": {"task_id": task.id, "lease": None},
        "no task": {"task_id": None, "lease": task.lease_token},
    }
    for why, params in refused.items():
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as info:
            call(params)
        assert info.value.sqlstate == "42501", why
        assert "is not held under this lease" in str(info.value), why
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as info:
        call(other.lease.params)  # held, and rightly: but not a task of this write's role
    assert f"is a {wrong_role} task" in str(info.value)
    assert crawl_tables(conn) == before

    # Given back and claimed again: the old lease is stale.
    assert queue.defer(task, 0)
    again = queue.claim(role, "holder-again")
    assert again is not None and again.id == task.id
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not held under this lease"):
        call(task.lease.params)
    assert crawl_tables(conn) == before

    call(again.lease.params)  # the current lease writes
    if store is None:  # a listing: the task's platform
        assert conn.execute(
            "SELECT menu_type FROM dispensaries d JOIN store_crawl_state c ON c.dispensary_id = d.id"
            " WHERE c.directory_id = 's007'"
        ).fetchone() == ("dutchie",)
    assert conn.execute(written, {"store": store}).fetchone() == (True,)

    after = crawl_tables(conn)
    assert queue.complete(again, {})
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not held under this lease"):
        call(again.lease.params)  # finished: not even its holder writes for it
    assert crawl_tables(conn) == after


def entry_point_task(conn: psycopg.Connection, queue: TaskQueue, platform: str) -> tuple[int, Lease]:
    (store,) = add_stores(conn, 1, platform=platform)
    task_id = queue.enqueue("entry_point_discovery", store)
    task = queue.claim("entry_point_discovery", "resolver")
    assert task is not None and task.id == task_id
    return store, task.lease


def save_entry_point(conn: psycopg.Connection, lease: Lease, platform_id: str, menu_url: str | None) -> None:
    conn.execute(
        query("save_entry_point"), {**lease.params, "platform_id": platform_id, "menu_url": menu_url}
    )


def entry_point_of(conn: psycopg.Connection, store: int) -> tuple:
    return conn.execute(
        "SELECT d.platform_dispensary_id, c.menu_url FROM dispensaries d"
        " LEFT JOIN store_crawl_state c ON c.dispensary_id = d.id WHERE d.id = %s",
        (store,),
    ).fetchone()


def test_save_entry_point_keeps_a_menu_url_on_the_platforms_hosts(conn: psycopg.Connection, queue: TaskQueue):
    """An absolute menu URL must be http(s) on one of the platform's hosts (tq_platforms.hosts, as
    the sync loaded them), with no user info; a path under the base URL is always fine. A refused
    URL is shown by its scheme and host only, and nothing is written."""
    hosts = ("menus.example.com", "cdn.example.com")
    assert queue.sync_platform_limits([PlatformLimits("dutchie", 4, 100.0, hosts=hosts)]) == 1
    assert conn.execute("SELECT hosts FROM tq_platforms WHERE platform = 'dutchie'").fetchone() == (
        sorted(hosts),
    )
    store, lease = entry_point_task(conn, queue, "dutchie")

    accepted = [
        None,
        "/menus/p1",
        "/m/p1?page=2#top",
        "https://menus.example.com/menus/p1",
        "http://cdn.example.com:8080/p1?k=v",
        "HTTPS://CDN.Example.COM/p1",  # scheme and host in any case
    ]
    for n, url in enumerate(accepted):
        save_entry_point(conn, lease, f"p{n}", url)
        assert entry_point_of(conn, store) == (f"p{n}", url), url  # kept as given

    last = entry_point_of(conn, store)
    # URL -> how the error shows it: a plain scheme://host[:port] is shown so; anything else
    # (user info, a parser's trick) is not shown at all, or by nothing of its own but a host.
    refused: dict[str, str | None] = {
        "https://evil.example.net/menus/secret-path?token=s3cret": "https://evil.example.net/...",
        "https://menus.example.com.evil.net/p1": "https://menus.example.com.evil.net/...",
        "ftp://menus.example.com/p1": "ftp://menus.example.com/...",
        "https://menus.example.com/p1 https://evil.net/": "https://menus.example.com/...",
        "https://user:s3cret@menus.example.com/menus/p1": None,
        "https://menus.example.com\\@evil.net/p1": None,
        "https://menus.example.com:8080@evil.net/p1": None,
        "//evil.example.net/p1": None,
        "/\\evil.example.net/p1": None,
        "menus.example.com/p1": None,
        "javascript:alert(1)": None,
    }
    for url, shown in refused.items():
        with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
            save_entry_point(conn, lease, "p-evil", url)
        message = info.value.diag.message_primary or ""
        assert message.startswith("save_entry_point: menu_url "), message
        assert " is not on the hosts of platform " in message, message
        assert message.endswith("(cdn.example.com, menus.example.com)"), message
        if shown is not None:
            assert f"menu_url {shown} is not on the hosts of platform" in message, (url, message)
        for secret in ("user", "p1", "alert", "@"):  # nothing of the URL but its scheme and host
            assert secret not in message, (secret, message)
        for secret in ("s3cret", "secret-path", "token"):  # nor anywhere in the error
            assert secret not in str(info.value), (secret, str(info.value))
        assert entry_point_of(conn, store) == last, url

    # A platform whose hosts were never loaded: paths only.
    other, other_lease = entry_point_task(conn, queue, "jane")
    with pytest.raises(
        psycopg.errors.InvalidParameterValue, match=r"is not on the hosts of platform .*\(none loaded\)"
    ):
        save_entry_point(conn, other_lease, "j1", "https://menus.example.com/menus/j1")
    assert entry_point_of(conn, other) == ("pid-1", None)
    save_entry_point(conn, other_lease, "j1", "/menus/j1")
    assert entry_point_of(conn, other) == ("j1", "/menus/j1")
