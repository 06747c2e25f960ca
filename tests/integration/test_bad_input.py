"""Bad input is refused in words before anything changes (issue 10, part 2).

Each row calls the queue (or one of its SQL functions) with one bad argument and expects: the
error type and SQLSTATE (22023 from the database; none for what only Python can see), a message
naming the argument and the value, a hint saying what is accepted, and the queue exactly as it
was: worker_tasks, worker_task_heads, worker_registry, tq_platforms and the stores' tables.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from tests.conftest import create_database, drop_database
from tests.helpers import add_stores
from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import (
    RESYNC_DAYS_AHEAD,
    RESYNC_DAYS_BACK,
    PlatformLimits,
    QueueInputError,
    Task,
    TaskQueue,
    resync_window,
)

ROLE = "product_resync"
TODAY = datetime.now(UTC).date()
NOW = datetime.now(UTC)
LONG_ID = "w" * 101


@dataclass
class Scene:
    """A queue with work in it: dutchie stores with limits, a worker holding a task of one of
    them (``held``) and the tasks its handlers' writes act on: a product_resync task of no store
    (``storeless``), and store_discovery tasks whose platform is dutchie, none, empty or 51
    characters long (``listings``)."""

    conn: psycopg.Connection
    queue: TaskQueue
    stores: list[int]
    held: Task
    storeless: Task
    listings: dict[str | None, Task]

    @property
    def claimed(self) -> int:
        return self.held.id

    def sql(self, statement: str, *params: Any) -> Any:
        return self.conn.execute(statement, params).fetchall()


# The platform a store_discovery task lists on: its own, else its payload's. Only dutchie can be
# enqueued; the others are written by hand, as a bad row could be.
LISTING_PLATFORMS: tuple[str | None, ...] = ("dutchie", None, "", "p" * 51)


def build_scene(conn: psycopg.Connection, queue: TaskQueue) -> Scene:
    stores = add_stores(conn, 3)
    queue.sync_platform_limits([PlatformLimits("dutchie", 5, 100.0)])
    queue.register_worker("holder", ROLE)
    for store in stores:
        queue.enqueue(ROLE, store, platform="dutchie")
    (task,) = queue.claim_many(ROLE, "holder", 1)
    assert task.dispensary_id == stores[0]
    # Ahead of the stores' tasks, so that the next claim takes it.
    queue.enqueue(ROLE, priority=1000)
    (storeless,) = queue.claim_many(ROLE, "holder", 1)
    assert storeless.dispensary_id is None
    listing_ids = {}
    for platform in LISTING_PLATFORMS:
        payload = {"scene": True} if platform is None else {"scene": True, "platform": platform}
        (listing_ids[platform],) = conn.execute(
            "INSERT INTO worker_tasks (role, payload) VALUES ('store_discovery', %s) RETURNING id",
            (Jsonb(payload),),
        ).fetchone()
    by_id = {t.id: t for t in queue.claim_many("store_discovery", "holder", 10)}
    assert set(by_id) == set(listing_ids.values())
    listings = {platform: by_id[i] for platform, i in listing_ids.items()}
    assert listings["dutchie"].platform == "dutchie"
    return Scene(conn, queue, stores, task, storeless, listings)


@pytest.fixture(scope="module")
def shared_scene(pg_server: str, template_db: str) -> Iterator[Scene]:
    """One database for the whole table: every row asserts that it changed nothing."""
    name = create_database(pg_server, template=template_db)
    url = make_conninfo(pg_server, dbname=name)
    try:
        with psycopg.connect(url, autocommit=True) as conn, TaskQueue.connect(url) as queue:
            yield build_scene(conn, queue)
    finally:
        drop_database(pg_server, name)


@pytest.fixture
def scene(conn: psycopg.Connection, queue: TaskQueue) -> Scene:
    return build_scene(conn, queue)


def snapshot(conn: psycopg.Connection) -> dict[str, list[Any]]:
    tables = {
        "worker_tasks": "id",
        "worker_task_heads": "role, dispensary_id",
        "worker_task_stores": "dispensary_id",
        "worker_registry": "id",
        "tq_platforms": "platform",
        "dispensaries": "id",
        "store_crawl_state": "dispensary_id",
        "products": "id",
    }
    return {
        name: conn.execute(f"SELECT to_jsonb(x) FROM {name} x ORDER BY {order}").fetchall()
        for name, order in tables.items()
    }


def upsert(s: Scene, platform: str | None, stores: Any) -> Any:
    """A listing by the held store_discovery task of ``platform``: it lists on its platform."""
    task = s.listings[platform]
    return s.sql("SELECT * FROM upsert_listed_stores(%s, %s, %s)", task.id, task.lease_token, stores)


def store_menu(s: Scene, task: Task, menu_hash: Any, products: Any) -> Any:
    """The menu of the store of ``task``, a held product task."""
    return s.sql("SELECT * FROM store_menu(%s, %s, %s, %s)", task.id, task.lease_token, menu_hash, products)


def product(**changes: Any) -> dict[str, Any]:
    item = {"id": "p1", "name": "A", "category": "flower", "price": "10.00", "in_stock": True}
    return {k: v for k, v in (item | changes).items() if v is not ...}


SERVER = "22023"  # refused by the database
PYTHON = None  # refused before the call: the database could not have named it


@dataclass(frozen=True)
class Bad:
    call: Callable[[Scene], Any]
    sqlstate: str | None
    named: tuple[str, ...]  # the argument and the value, as the message must show them


BAD: dict[str, Bad] = {
    # -- generate_resync_tasks: the inputs issue 10 names, then the others ----------------------
    "generate-empty-platform": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, platforms=[""]), SERVER, ("platforms", '{""}')
    ),
    "generate-blank-platform": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, platforms=["  "]), SERVER, ("platforms",)
    ),
    "generate-no-platforms": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, platforms=[]), SERVER, ("platforms", "{}")
    ),
    "generate-null-platforms": Bad(
        lambda s: s.sql("SELECT generate_resync_tasks(6, current_date, NULL)"), SERVER, ("platforms", "NULL")
    ),
    "generate-unknown-platform": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, platforms=["dutchie", "dutchi"]),
        SERVER,
        ("platforms", "'dutchi'"),
    ),
    "generate-platforms-as-a-string": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, platforms="dutchie"), PYTHON, ("platforms", "'dutchie'")
    ),
    "generate-date-year-1": Bad(
        lambda s: s.queue.generate_resync(day=date(1, 1, 1)), SERVER, ("date", "0001-01-01")
    ),
    "generate-date-too-old": Bad(
        lambda s: s.queue.generate_resync(day=TODAY - timedelta(days=RESYNC_DAYS_BACK + 1)),
        SERVER,
        ("date", (TODAY - timedelta(days=RESYNC_DAYS_BACK + 1)).isoformat()),
    ),
    "generate-date-too-far-ahead": Bad(
        lambda s: s.queue.generate_resync(day=TODAY + timedelta(days=RESYNC_DAYS_AHEAD + 1)),
        SERVER,
        ("date", (TODAY + timedelta(days=RESYNC_DAYS_AHEAD + 1)).isoformat()),
    ),
    "generate-date-null": Bad(
        lambda s: s.sql("SELECT generate_resync_tasks(6, NULL)"), SERVER, ("date", "NULL")
    ),
    "generate-batches-0": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, batches_per_day=0), SERVER, ("batches_per_day", "0")
    ),
    "generate-batches-25": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, batches_per_day=25), SERVER, ("batches_per_day", "25")
    ),
    "generate-batches-past-int32": Bad(
        lambda s: s.queue.generate_resync(day=TODAY, batches_per_day=2**40),
        PYTHON,
        ("batches_per_day", str(2**40)),
    ),
    # -- recovery ---------------------------------------------------------------------------------
    "recover-threshold-99999999999": Bad(
        lambda s: s.queue.recover_stale(99_999_999_999), PYTHON, ("stale_threshold_minutes", "99999999999")
    ),
    "recover-threshold-over-a-week": Bad(
        lambda s: s.queue.recover_stale(10_081), SERVER, ("stale_threshold_minutes", "10081")
    ),
    "recover-threshold-0": Bad(lambda s: s.queue.recover_stale(0), SERVER, ("stale_threshold_minutes", "0")),
    "recover-plain-function": Bad(
        lambda s: s.sql("SELECT recover_stale_tasks(-1)"), SERVER, ("stale_threshold_minutes", "-1")
    ),
    "expire-intervals-1": Bad(lambda s: s.queue.expire_leases(1.0), SERVER, ("intervals", "1")),
    "expire-intervals-nan": Bad(lambda s: s.queue.expire_leases(math.nan), SERVER, ("intervals", "NaN")),
    "expire-intervals-inf": Bad(lambda s: s.queue.expire_leases(math.inf), SERVER, ("intervals", "Infinity")),
    "expire-min-seconds-0": Bad(lambda s: s.queue.expire_leases(min_seconds=0), SERVER, ("min_seconds", "0")),
    "expire-default-heartbeat-0": Bad(
        lambda s: s.sql("SELECT * FROM expire_leases(2.5, 0, 10)"), SERVER, ("default_heartbeat_seconds", "0")
    ),
    # -- enqueue (the plain path was a bare INSERT) ------------------------------------------------
    "enqueue-negative-max-retries": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], max_retries=-1), SERVER, ("max_retries", "-1")
    ),
    "enqueue-max-retries-101": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], max_retries=101), SERVER, ("max_retries", "101")
    ),
    "enqueue-unknown-role": Bad(
        lambda s: s.queue.enqueue("bogus_role", s.stores[1]), SERVER, ("role", "'bogus_role'")
    ),
    "enqueue-unknown-store": Bad(
        lambda s: s.queue.enqueue(ROLE, 999_999), SERVER, ("dispensary_id", "999999")
    ),
    "enqueue-store-past-int32": Bad(
        lambda s: s.queue.enqueue(ROLE, 2**31), PYTHON, ("dispensary_id", str(2**31))
    ),
    "enqueue-empty-platform": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], platform=""), SERVER, ("platform", "''")
    ),
    "enqueue-platform-51-characters": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], platform="p" * 51), SERVER, ("platform", "51 characters")
    ),
    "enqueue-priority-1001": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], priority=1001), SERVER, ("priority", "1001")
    ),
    "enqueue-scheduled-year-1": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], scheduled_for=datetime(1, 1, 2, tzinfo=UTC)),
        SERVER,
        ("scheduled_for", "0001-"),
    ),
    "enqueue-scheduled-two-years-ahead": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], scheduled_for=NOW + timedelta(days=730)),
        SERVER,
        ("scheduled_for", str((NOW + timedelta(days=730)).year)),
    ),
    "enqueue-payload-a-list": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], payload=[1, 2]),  # type: ignore[arg-type]
        SERVER,
        ("payload", "[1, 2]"),
    ),
    "enqueue-payload-nan": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], payload={"x": math.nan}),
        PYTHON,
        ("payload", "NaN or infinity"),
    ),
    "enqueue-payload-not-json": Bad(
        lambda s: s.queue.enqueue(ROLE, s.stores[1], payload={"x": object()}), PYTHON, ("payload", "object")
    ),
    "enqueue-once-unknown-role": Bad(
        lambda s: s.queue.enqueue_once("bogus_role"), SERVER, ("role", "'bogus_role'")
    ),
    "enqueue-once-unknown-store": Bad(
        lambda s: s.queue.enqueue_once(ROLE, 999_999), SERVER, ("dispensary_id", "999999")
    ),
    "enqueue-once-empty-platform": Bad(
        lambda s: s.queue.enqueue_once("store_discovery", platform=" "), SERVER, ("platform", "' '")
    ),
    "enqueue-once-payload-a-string": Bad(
        lambda s: s.queue.enqueue_once("store_discovery", payload="north"),  # type: ignore[arg-type]
        SERVER,
        ("payload", '"north"'),
    ),
    "enqueue-once-priority": Bad(
        lambda s: s.queue.enqueue_once("store_discovery", priority=-1001), SERVER, ("priority", "-1001")
    ),
    # -- workers -----------------------------------------------------------------------------------
    "register-worker-id-101-characters": Bad(
        lambda s: s.queue.register_worker(LONG_ID, ROLE), SERVER, ("worker_id", "101 characters")
    ),
    "register-empty-worker-id": Bad(lambda s: s.queue.register_worker("", ROLE), SERVER, ("worker_id", "''")),
    "register-unknown-role": Bad(
        lambda s: s.queue.register_worker("w", "bogus_role"), SERVER, ("role", "'bogus_role'")
    ),
    "register-heartbeat-0": Bad(
        lambda s: s.queue.register_worker("w", ROLE, heartbeat_seconds=0), SERVER, ("heartbeat_seconds", "0")
    ),
    "register-heartbeat-nan": Bad(
        lambda s: s.queue.register_worker("w", ROLE, heartbeat_seconds=math.nan),
        SERVER,
        ("heartbeat_seconds", "NaN"),
    ),
    "register-pod-name-101-characters": Bad(
        lambda s: s.queue.register_worker("w", ROLE, pod_name="p" * 101),
        SERVER,
        ("pod_name", "101 characters"),
    ),
    "register-hostname-101-characters": Bad(
        lambda s: s.queue.register_worker("w", ROLE, hostname="h" * 101),
        SERVER,
        ("hostname", "101 characters"),
    ),
    "claim-worker-id-101-characters": Bad(
        lambda s: s.queue.claim_many(ROLE, LONG_ID, 1), SERVER, ("worker_id", "101 characters")
    ),
    "claim-blank-worker-id": Bad(lambda s: s.queue.claim_many(ROLE, "  ", 1), SERVER, ("worker_id", "'  '")),
    "claim-max-tasks-0": Bad(lambda s: s.queue.claim_many(ROLE, "w", 0), SERVER, ("max_tasks", "0")),
    "claim-max-tasks-1001": Bad(lambda s: s.queue.claim_many(ROLE, "w", 1001), SERVER, ("max_tasks", "1001")),
    "claim-max-tasks-past-int32": Bad(
        lambda s: s.queue.claim_many(ROLE, "w", 2**40), PYTHON, ("max_tasks", str(2**40))
    ),
    "defer-nan": Bad(lambda s: s.queue.defer(s.held, math.nan), PYTHON, ("delay_seconds", "NaN")),
    "fail-retry-after-nan": Bad(
        lambda s: s.queue.fail(s.held, "x", retry_after=math.nan), PYTHON, ("retry_after", "NaN")
    ),
    "complete-result-nan": Bad(
        lambda s: s.queue.complete(s.held, {"n": math.inf}),
        PYTHON,
        ("result", "NaN or infinity"),
    ),
    "complete-times-nan": Bad(
        lambda s: s.queue.complete_many_json({s.held.lease: "{}"}, {s.claimed: (0.0, math.nan)}),
        PYTHON,
        ("times", "nan"),
    ),
    "complete-arrays-of-two-lengths": Bad(
        lambda s: s.sql(
            "SELECT complete_tasks(%s, %s, ARRAY['{}', '{}']::jsonb[])", [s.claimed], [s.held.lease_token]
        ),
        SERVER,
        ("1 task ids", "2 results"),
    ),
    # -- platform limits ---------------------------------------------------------------------------
    "limits-max-in-flight-0": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("jane", 0, 1.0)]),
        SERVER,
        ("max_in_flight", "0"),
    ),
    "limits-rate-0": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("jane", 2, 0.0)]),
        SERVER,
        ("requests_per_second", "0"),
    ),
    "limits-rate-nan": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("jane", 2, math.nan)]),
        PYTHON,
        ("limits", "NaN or infinity"),
    ),
    "limits-burst-0": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("jane", 2, 1.0, burst=0)]),
        SERVER,
        ("burst", "0"),
    ),
    "limits-pause-after-errors-1001": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("jane", 2, 1.0, pause_after_errors=1001)]),
        SERVER,
        ("pause_after_errors", "1001"),
    ),
    "limits-max-pause-below-pause": Bad(
        lambda s: s.queue.sync_platform_limits(
            [PlatformLimits("jane", 2, 1.0, pause_seconds=9, max_pause_seconds=3)]
        ),
        SERVER,
        ("max_pause_seconds", "3"),
    ),
    "limits-empty-name": Bad(
        lambda s: s.queue.sync_platform_limits([PlatformLimits("", 2, 1.0)]), SERVER, ("name", "''")
    ),
    "limits-not-objects": Bad(
        lambda s: s.sql("SELECT sync_platform_limits('[1]')"), SERVER, ("limits", "'[1]'")
    ),
    "limits-whole-number-as-fraction": Bad(
        lambda s: s.sql(
            "SELECT sync_platform_limits(%s)",
            Jsonb([{"platform": "jane", "max_in_flight": 2.5, "requests_per_second": 1}]),
        ),
        SERVER,
        ("max_in_flight", "2.5"),
    ),
    # -- the crawl's writes ------------------------------------------------------------------------
    "listing-no-platform": Bad(
        lambda s: upsert(s, None, Jsonb([{"id": "s1"}])), SERVER, ("platform", "NULL")
    ),
    "listing-empty-platform": Bad(lambda s: upsert(s, "", Jsonb([{"id": "s1"}])), SERVER, ("platform", "''")),
    "listing-platform-51-characters": Bad(
        lambda s: upsert(s, "p" * 51, Jsonb([{"id": "s1"}])), SERVER, ("platform", "51 characters")
    ),
    "listing-not-an-array": Bad(
        lambda s: upsert(s, "dutchie", Jsonb({"id": "s1"})), SERVER, ("stores", '{"id": "s1"}')
    ),
    "listing-store-without-id": Bad(
        lambda s: upsert(s, "dutchie", Jsonb([{"id": ""}])), SERVER, ("non-empty id",)
    ),
    "menu-no-store": Bad(
        lambda s: store_menu(s, s.storeless, "h", Jsonb([product()])), SERVER, ("dispensary_id", "NULL")
    ),
    "menu-empty-hash": Bad(
        lambda s: store_menu(s, s.held, "", Jsonb([product()])), SERVER, ("menu_hash", "''")
    ),
    "menu-not-an-array": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb(product())), SERVER, ("products", '"id": "p1"')
    ),
    "menu-negative-price": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(price="-1")])),
        SERVER,
        ("price", "-1", "'p1'"),
    ),
    "menu-price-past-numeric-10-2": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(price=1e9)])),
        SERVER,
        ("price", "1000000000"),
    ),
    "menu-no-name": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(name=...)])), SERVER, ("no name",)
    ),
    "menu-in-stock-missing": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(in_stock=...)])),
        SERVER,
        ("in_stock", "missing"),
    ),
    "menu-thc-over-100": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(thc="101")])), SERVER, ("thc", "101")
    ),
    "menu-duplicate-id": Bad(
        lambda s: store_menu(s, s.held, "h", Jsonb([product(), product()])),
        SERVER,
        ("each id once", "'p1'"),
    ),
}


@pytest.mark.parametrize("case", [pytest.param(v, id=k) for k, v in BAD.items()])
def test_bad_input_is_refused_in_words_and_changes_nothing(shared_scene: Scene, case: Bad):
    scene = shared_scene
    before = snapshot(scene.conn)
    error_type = (
        QueueInputError
        if case.sqlstate is PYTHON
        else (QueueInputError, psycopg.errors.InvalidParameterValue)
    )
    with pytest.raises(error_type) as raised:
        case.call(scene)
    exc = raised.value
    if isinstance(exc, QueueInputError):
        assert exc.sqlstate == case.sqlstate, exc
        message, hint = exc.message, exc.hint
    else:
        assert exc.sqlstate == case.sqlstate, exc
        message, hint = exc.diag.message_primary or "", exc.diag.message_hint
    for word in case.named:
        assert word in message, f"{word!r} not in {message!r}"
    assert hint, f"no hint with {message!r}"
    assert snapshot(scene.conn) == before


def test_the_queue_still_works_after_the_refusals(scene: Scene):
    """The refusals leave nothing behind that gets in the way: the next calls succeed."""
    for case in BAD.values():
        with pytest.raises((QueueInputError, psycopg.errors.InvalidParameterValue)):
            case.call(scene)
    assert scene.queue.enqueue(ROLE, scene.stores[1], max_retries=0, priority=1000, payload={"a": 1}) > 0
    assert (
        scene.queue.enqueue_once("store_discovery", platform="dutchie", payload={"region": "north"})
        is not None
    )
    assert scene.queue.generate_resync(day=TODAY, platforms=["dutchie"]) == 3
    assert len(scene.queue.claim_many(ROLE, "w" * 100, 1000)) == 2  # one store is the holder's
    scene.queue.register_worker(
        "w" * 100, ROLE, pod_name="p" * 100, hostname="h" * 100, heartbeat_seconds=3600
    )


def test_unknown_platform_hint_names_the_known_ones(scene: Scene):
    """Known: a platform with limits, or with a store; the hint lists both kinds."""
    add_stores(scene.conn, 1, platform="treez")
    scene.queue.sync_platform_limits([PlatformLimits("jane", 2, 1.0)])
    with pytest.raises(QueueInputError) as raised:
        scene.queue.generate_resync(day=TODAY, platforms=["treez", "nope"])
    assert "'nope'" in raised.value.message and "'treez'" not in raised.value.message.split("unknown:")[1]
    assert raised.value.hint is not None and "Known platforms: dutchie, jane, treez." in raised.value.hint
    # A platform known by its limits alone (no store yet) is a resync of nothing, not an error.
    assert scene.queue.generate_resync(day=TODAY, platforms=["jane"]) == 0


def test_a_database_that_knows_no_platform_says_so(queue: TaskQueue):
    with pytest.raises(QueueInputError) as raised:
        queue.generate_resync(day=TODAY, platforms=["dutchie"])
    assert raised.value.hint is not None and raised.value.hint.startswith("No platform is known yet.")


def test_the_resync_window_is_the_same_in_python_and_sql(scene: Scene):
    """The command line checks --date against queue.resync_window; the database decides with
    tq_resync_window(): the same days. Both ends are accepted, the days beyond them refused."""
    first, last = scene.conn.execute("SELECT first_day, last_day FROM tq_resync_window()").fetchone()
    assert (first, last) == resync_window(TODAY)
    assert scene.queue.generate_resync(day=first) == 3
    assert scene.queue.generate_resync(day=last) == 3
    for day in (first - timedelta(days=1), last + timedelta(days=1)):
        with pytest.raises(QueueInputError, match=f"date must be a UTC day from {first} to {last}"):
            scene.queue.generate_resync(day=day)


def test_enqueue_checks_happen_in_the_database(scene: Scene):
    """The one place that decides is the database: the statement TaskQueue.enqueue sends refuses
    a bad argument itself, whoever sends it."""
    params = {
        "role": ROLE,
        "dispensary_id": scene.stores[1],
        "platform": None,
        "priority": 0,
        "scheduled_for": None,
        "max_retries": -1,
        "payload": None,
    }
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_retries must be between 0 and 100"):
        scene.conn.execute(query("enqueue_task"), params)
    params["max_retries"] = None  # the default, as the table has it
    (task_id,) = scene.conn.execute(query("enqueue_task"), params).fetchone()
    assert scene.queue.get(task_id).max_retries == 3  # type: ignore[union-attr]
