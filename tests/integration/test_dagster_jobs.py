"""The jobs and the rollup asset, run in process against the test's own database: resync
generation, stale recovery, draining a role (with handlers plugged in through real entry points),
the hourly task_completion_log and its check, and the failures that must name the setting at
fault."""

import importlib
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.dagster_helpers import failure_text, op_metadata
from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.defs.jobs import drain_tasks_job, generate_resync_tasks_job, recover_stale_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.rollup import task_completion_log
from tq_pipelines.handlers import ENTRY_POINT_GROUP, HandlerRegistryError, load_handlers
from tq_pipelines.queue.api import TaskQueue

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"
ROLE = "product_resync"


# -- helpers ------------------------------------------------------------------------------------


def run_job(
    job: dg.JobDefinition,
    database_url: str,
    run_config: dict | None = None,
    partition_key: str | None = None,
    **resource_settings: Any,
) -> dg.ExecuteInProcessResult:
    """One in-process run with the queue resource on ``database_url``; never raises."""
    return job.execute_in_process(
        run_config=run_config,
        resources={
            "tq": QueueResource(database_url=database_url, **resource_settings),
            "crawl": CrawlResource(),
        },
        partition_key=partition_key,
        raise_on_error=False,
    )


def resync(database_url: str, day: str, **config: Any) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"generate_resync_tasks": {"config": config}}} if config else None
    return run_job(generate_resync_tasks_job, database_url, run_config, partition_key=day)


def drain(database_url: str, role: str = ROLE, **config: Any) -> dg.ExecuteInProcessResult:
    return run_job(
        drain_tasks_job, database_url, {"ops": {"drain_role_tasks": {"config": {"role": role, **config}}}}
    )


def task_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM v_tasks").fetchone()[0]


@pytest.fixture
def noop_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROLE's handler is the no-op one: these tests are about the queue, not the crawl."""
    monkeypatch.setenv("TQ_HANDLERS", f"{ROLE}=tq_pipelines.handlers:noop")


# -- handler plug-ins: a real distribution's metadata on sys.path -------------------------------


@pytest.fixture
def plug_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """``plug_in(entry_points, source)``: a module written from ``source`` and an installed-looking
    distribution whose entry_points.txt registers ``entry_points`` (role -> "module:function",
    where ``{module}`` stands for the module's name) under tq_pipelines.handlers. Returns the
    module name."""
    modules: list[str] = []

    def install(entry_points: dict[str, str], source: str = "") -> str:
        module = f"tq_test_handlers_{uuid.uuid4().hex[:10]}"
        root = tmp_path / module
        root.mkdir()
        (root / f"{module}.py").write_text(source)
        dist_info = root / f"{module}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        lines = [f"[{ENTRY_POINT_GROUP}]"] + [
            f"{k} = {v.format(module=module)}" for k, v in entry_points.items()
        ]
        (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(root))  # also invalidates the import caches
        importlib.invalidate_caches()
        modules.append(module)
        return module

    yield install
    for module in modules:
        sys.modules.pop(module, None)


FAIL_ODD = '''
def fail_odd(task, ctx):
    """Fails the tasks with odd ids; the others succeed and say who ran them."""
    if task.id % 2:
        raise RuntimeError(f"odd task {task.id}")
    return {"handler": "fail_odd", "id": task.id}

NOT_A_FUNCTION = 42
'''


# -- generate_resync_tasks_job ------------------------------------------------------------------


def test_resync_creates_one_task_per_enabled_store_then_nothing(db_url: str, conn: psycopg.Connection):
    stores = add_stores(conn, 10)
    add_stores(conn, 2, enabled=False)
    add_stores(conn, 3, platform="jane")

    first = resync(db_url, "2026-06-01")
    assert first.success
    meta = op_metadata(first, "generate_resync_tasks")
    assert meta["created"] == 10
    assert meta["date"] == "2026-06-01"
    rows = conn.execute(
        "SELECT dispensary_id, status, resync_date::text, "
        "       extract(hour FROM scheduled_for AT TIME ZONE 'UTC')::int, "
        "       (scheduled_for AT TIME ZONE 'UTC')::date::text "
        "FROM v_tasks WHERE role = 'product_resync' ORDER BY dispensary_id"
    ).fetchall()
    assert [r[0] for r in rows] == stores
    assert {r[1] for r in rows} == {"pending"}
    assert {r[2] for r in rows} == {"2026-06-01"}
    # Six batches (the default) spread over that UTC day.
    assert {r[3] for r in rows} == {0, 4, 8, 12, 16, 20}
    assert {r[4] for r in rows} == {"2026-06-01"}

    again = resync(db_url, "2026-06-01")
    assert again.success
    assert op_metadata(again, "generate_resync_tasks")["created"] == 0
    assert task_count(conn) == 10


def test_resync_platforms_and_batches_come_from_run_config(db_url: str, conn: psycopg.Connection):
    add_stores(conn, 4)
    add_stores(conn, 3, platform="jane")
    result = resync(db_url, "2026-06-02", platforms=["jane"], batches_per_day=1)
    assert result.success
    assert op_metadata(result, "generate_resync_tasks")["created"] == 3
    assert conn.execute(
        # One batch, opening at midnight UTC (its tasks a millisecond apart).
        "SELECT DISTINCT platform, date_trunc('second', scheduled_for) = '2026-06-02 00:00+00' FROM v_tasks"
    ).fetchall() == [("jane", True)]


@pytest.mark.parametrize("batches_per_day", [25, 0])
def test_resync_with_bad_batches_per_day_fails_before_touching_a_task(
    db_url: str, conn: psycopg.Connection, batches_per_day: int
):
    add_stores(conn, 5)
    result = resync(db_url, "2026-06-01", batches_per_day=batches_per_day)
    assert not result.success
    assert "batches_per_day" in failure_text(result)
    assert task_count(conn) == 0


# Slow by the product's design: TaskQueue.connect waits 30 s for a first connection before it
# gives up, whatever the reason the database cannot be reached.
@pytest.mark.slow
def test_unreachable_database_fails_the_run_naming_the_setting():
    result = resync(UNREACHABLE, "2026-06-01")
    assert not result.success
    text = failure_text(result)
    assert "database_url" in text
    assert "TQ_DATABASE_URL" in text


def test_bad_role_caps_fail_the_run_naming_the_setting(db_url: str, conn: psycopg.Connection):
    add_stores(conn, 5)
    result = run_job(generate_resync_tasks_job, db_url, partition_key="2026-06-01", role_caps="nosuchrole=2")
    assert not result.success
    assert "role_caps" in failure_text(result)
    assert "nosuchrole" in failure_text(result)
    assert task_count(conn) == 0


# -- recover_stale_tasks_job --------------------------------------------------------------------


def test_recover_gives_back_a_silent_workers_task_and_the_drain_completes_it(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, noop_handler: None
):
    add_tasks(conn, ROLE, add_stores(conn, 3), 1)
    for worker in ("dead-worker", "live-worker"):
        queue.register_worker(worker, ROLE)
    dead = queue.claim(ROLE, "dead-worker")
    live = queue.claim(ROLE, "live-worker")
    assert dead is not None and live is not None
    assert queue.start(dead)
    # The dead worker's lease and its registry heartbeat are an hour old; the live one's are fresh.
    conn.execute(
        "UPDATE worker_tasks SET claimed_at = now() - interval '61 minutes', "
        "started_at = now() - interval '61 minutes', last_heartbeat_at = now() - interval '60 minutes' "
        "WHERE id = %s",
        (dead.id,),
    )
    conn.execute(
        "UPDATE worker_registry SET last_heartbeat_at = now() - interval '60 minutes' "
        "WHERE worker_id = 'dead-worker'"
    )

    result = run_job(recover_stale_tasks_job, db_url)
    assert result.success
    meta = op_metadata(result, "recover_stale_tasks")
    assert (meta["recovered"], meta["failed"], meta["workers_offline"]) == (1, 0, 1)
    recovered = queue.get(dead.id)
    assert recovered is not None
    assert (recovered.status, recovered.retry_count, recovered.worker_id) == ("pending", 1, None)
    assert "lease expired" in (recovered.error_message or "")
    still_live = queue.get(live.id)
    assert still_live is not None and (still_live.status, still_live.worker_id) == ("claimed", "live-worker")

    drained = drain(db_url)
    assert drained.success
    assert (
        op_metadata(drained, "drain_role_tasks")["completed"] == 2
    )  # the recovered one and the untouched one
    done = queue.get(dead.id)
    assert done is not None
    assert done.status == "completed"
    assert done.worker_id == f"product_resync@run:{drained.run_id}"
    # The live worker keeps its task: the drain skipped its store.
    still_live = queue.get(live.id)
    assert still_live is not None and (still_live.status, still_live.worker_id) == ("claimed", "live-worker")
    assert_store_state_consistent(conn)


def test_recover_threshold_comes_from_run_config(db_url: str, conn: psycopg.Connection, queue: TaskQueue):
    add_tasks(conn, ROLE, add_stores(conn, 1), 1)
    task = queue.claim(ROLE, "slow-worker")
    assert task is not None
    conn.execute(
        "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '20 minutes' WHERE id = %s", (task.id,)
    )
    config = {"ops": {"recover_stale_tasks": {"config": {"stale_threshold_minutes": 30}}}}
    result = run_job(recover_stale_tasks_job, db_url, config)
    assert result.success and op_metadata(result, "recover_stale_tasks")["recovered"] == 0
    config = {"ops": {"recover_stale_tasks": {"config": {"stale_threshold_minutes": 15}}}}
    result = run_job(recover_stale_tasks_job, db_url, config)
    assert result.success and op_metadata(result, "recover_stale_tasks")["recovered"] == 1


# -- drain_tasks_job ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stores", "per_store", "concurrency"),
    [pytest.param(100, 10, 1, id="1000 tasks inline"), pytest.param(20, 10, 4, id="200 tasks, 4 threads")],
)
def test_drain_completes_every_ready_task(
    db_url: str, conn: psycopg.Connection, stores: int, per_store: int, concurrency: int, noop_handler: None
):
    total = add_tasks(conn, ROLE, add_stores(conn, stores), per_store)
    add_tasks(conn, "product_discovery", add_stores(conn, 3), 1)  # another role: not drained

    result = drain(db_url, batch_size=20, concurrency=concurrency)
    assert result.success
    meta = op_metadata(result, "drain_role_tasks")
    assert (meta["claimed"], meta["completed"], meta["retried"], meta["failed"], meta["lost"]) == (
        total,
        total,
        0,
        0,
        0,
    )
    worker_id = f"{ROLE}@run:{result.run_id}"
    assert meta["worker_id"] == worker_id
    assert conn.execute(
        "SELECT role, status, worker_id, result->>'handler', count(*) FROM v_tasks "
        "GROUP BY 1, 2, 3, 4 ORDER BY 1"
    ).fetchall() == [
        ("product_discovery", "pending", None, None, 3),
        (ROLE, "completed", worker_id, "noop", total),
    ]
    assert conn.execute(
        "SELECT status, tasks_completed FROM v_workers WHERE worker_id = %s", (worker_id,)
    ).fetchone() == ("offline", total)
    assert_store_state_consistent(conn)


def test_drain_of_an_unknown_role_fails_naming_it(db_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    result = drain(db_url, role="nosuchrole")
    assert not result.success
    assert "nosuchrole" in failure_text(result)
    assert status_counts(conn) == {"pending": 2}


def test_load_handlers_merges_entry_points(plug_in: Callable[..., str]):
    builtin = load_handlers()
    module = plug_in({ROLE: "{module}:fail_odd"}, FAIL_ODD)
    handlers = load_handlers()
    assert handlers[ROLE] is sys.modules[module].fail_odd
    assert handlers[ROLE] is not builtin[ROLE]
    # The other roles keep their built-in handler.
    assert handlers["product_discovery"] is builtin["product_discovery"]


def test_handler_exceptions_fail_tasks_not_the_run(
    db_url: str, conn: psycopg.Connection, plug_in: Callable[..., str]
):
    plug_in({ROLE: "{module}:fail_odd"}, FAIL_ODD)
    add_tasks(conn, ROLE, add_stores(conn, 10), 2)
    odd = [r[0] for r in conn.execute("SELECT id FROM v_tasks WHERE id % 2 = 1 ORDER BY id")]
    even = [r[0] for r in conn.execute("SELECT id FROM v_tasks WHERE id % 2 = 0 ORDER BY id")]
    assert len(odd) == len(even) == 10

    first = drain(db_url)
    assert first.success
    meta = op_metadata(first, "drain_role_tasks")
    assert (meta["completed"], meta["retried"], meta["failed"]) == (10, 10, 0)
    rows = conn.execute(
        "SELECT id, status, retry_count, error_message, scheduled_for > now(), result->>'handler' "
        "FROM v_tasks ORDER BY id"
    ).fetchall()
    for task_id, status, retries, error, later, handler in rows:
        if task_id in odd:
            assert (status, retries, later) == ("pending", 1, True), task_id
            assert error == f"RuntimeError: odd task {task_id}"
        else:
            assert (status, retries, handler) == ("completed", 0, "fail_odd"), task_id

    # Due again, with no retries left: the next drain fails them for good.
    conn.execute(
        "UPDATE worker_tasks SET scheduled_for = now() - interval '1 minute', max_retries = 1 "
        "WHERE status = 'pending'"
    )
    second = drain(db_url)
    assert second.success
    meta = op_metadata(second, "drain_role_tasks")
    assert (meta["completed"], meta["retried"], meta["failed"]) == (0, 0, 10)
    assert (
        conn.execute(
            "SELECT array_agg(id ORDER BY id) FROM v_tasks WHERE status = 'failed' AND retry_count = 1 "
            "AND completed_at IS NOT NULL"
        ).fetchone()[0]
        == odd
    )
    assert status_counts(conn) == {"completed": 10, "failed": 10}
    assert_store_state_consistent(conn)


def test_entry_point_that_does_not_import_is_a_registry_error(
    db_url: str, conn: psycopg.Connection, plug_in: Callable[..., str]
):
    missing = f"tq_no_such_module_{uuid.uuid4().hex[:8]}"
    plug_in({ROLE: f"{missing}:handle"})
    with pytest.raises(HandlerRegistryError) as raised:
        load_handlers()
    assert ROLE in str(raised.value)
    assert missing in str(raised.value)

    # A drain run cannot do without its registry: the run fails, and no task was claimed.
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    result = drain(db_url)
    assert not result.success
    assert missing in failure_text(result)
    assert status_counts(conn) == {"pending": 2}


def test_entry_point_that_is_not_callable_is_a_registry_error(plug_in: Callable[..., str]):
    plug_in({"product_discovery": "{module}:NOT_A_FUNCTION"}, FAIL_ODD)
    with pytest.raises(HandlerRegistryError, match=r"product_discovery = .*:NOT_A_FUNCTION is not callable"):
        load_handlers()


def test_definitions_refuse_to_load_with_a_broken_handler(tmp_path: Path, plug_in: Callable[..., str]):
    """The code location fails at load, naming the entry point, instead of failing tasks later."""
    missing = f"tq_no_such_module_{uuid.uuid4().hex[:8]}"
    module = plug_in({ROLE: f"{missing}:handle"})
    plugin_root = next(p for p in sys.path if p.endswith(module))
    proc = subprocess.run(
        [sys.executable, "-c", "import tq_pipelines.definitions"],
        env={"PYTHONPATH": plugin_root, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "HandlerRegistryError" in proc.stderr
    assert f"product_resync = {missing}:handle" in proc.stderr


# -- task_completion_log (the hourly rollup asset) ----------------------------------------------

HOUR = "2026-06-01-10:00"
START, END = "2026-06-01 10:00:00+00", "2026-06-01 11:00:00+00"


def materialize_hour(db_url: str, threshold: float | None = None) -> dg.ExecuteInProcessResult:
    config = {"failure_rate_threshold": threshold} if threshold is not None else {}
    return dg.materialize(
        [task_completion_log],
        partition_key=HOUR,
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        run_config={"ops": {"task_completion_log": {"config": config}}},
    )


def insert_history(conn: psycopg.Connection) -> None:
    """Tasks around the UTC hour 2026-06-01 10:00, on both sides of each edge."""
    rows = [
        # role, status, created_at, started_at, completed_at
        (ROLE, "completed", "2026-06-01 10:00:00+00", "2026-06-01 10:29:30+00", "2026-06-01 10:30:00+00"),
        (ROLE, "completed", "2026-06-01 09:59:59.999+00", "2026-06-01 09:59:00+00", "2026-06-01 10:00:00+00"),
        (
            ROLE,
            "completed",
            "2026-06-01 09:00:00+00",
            "2026-06-01 10:59:00+00",
            "2026-06-01 10:59:59.999999+00",
        ),
        (ROLE, "completed", "2026-06-01 10:10:00+00", "2026-06-01 10:59:00+00", "2026-06-01 11:00:00+00"),
        (
            ROLE,
            "completed",
            "2026-06-01 09:00:00+00",
            "2026-06-01 09:59:00+00",
            "2026-06-01 09:59:59.999999+00",
        ),
        (ROLE, "failed", "2026-06-01 10:01:00+00", "2026-06-01 10:14:00+00", "2026-06-01 10:15:00+00"),
        (ROLE, "failed", "2026-06-01 10:02:00+00", "2026-06-01 11:14:00+00", "2026-06-01 11:15:00+00"),
        (ROLE, "pending", "2026-06-01 10:20:00+00", None, None),
        # 03:30 in Los Angeles is 10:30 UTC: in the hour.
        (ROLE, "pending", "2026-06-01 03:30:00-07", None, None),
        # The same wall-clock hour on other days is not this hour.
        (ROLE, "completed", "2026-05-31 10:10:00+00", "2026-05-31 10:10:00+00", "2026-05-31 10:20:00+00"),
        (ROLE, "completed", "2026-06-02 10:10:00+00", "2026-06-02 10:10:00+00", "2026-06-02 10:20:00+00"),
        (
            "product_discovery",
            "completed",
            "2026-06-01 10:05:00+00",
            "2026-06-01 10:05:00+00",
            "2026-06-01 10:05:10+00",
        ),
        (
            "product_discovery",
            "completed",
            "2026-06-01 10:06:00+00",
            "2026-06-01 10:06:00+00",
            "2026-06-01 10:06:20+00",
        ),
        ("product_discovery", "cancelled", "2026-06-01 10:07:00+00", None, "2026-06-01 10:08:00+00"),
    ]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at) "
            "VALUES (%s, %s, %s, %s, %s)",
            rows,
        )


def expected_hour(conn: psycopg.Connection) -> dict[str, tuple[int, int, int]]:
    """role -> (created, completed, failed) in the hour, counted straight from v_tasks."""
    rows = conn.execute(
        """
        SELECT r.role,
               (SELECT count(*) FROM v_tasks t
                 WHERE t.role = r.role AND t.created_at >= %(start)s AND t.created_at < %(end)s),
               (SELECT count(*) FROM v_tasks t WHERE t.role = r.role AND t.status = 'completed'
                   AND t.completed_at >= %(start)s AND t.completed_at < %(end)s),
               (SELECT count(*) FROM v_tasks t WHERE t.role = r.role AND t.status = 'failed'
                   AND t.completed_at >= %(start)s AND t.completed_at < %(end)s)
        FROM worker_task_roles r
        """,
        {"start": START, "end": END},
    ).fetchall()
    return {role: (created, completed, failed) for role, created, completed, failed in rows}


def logged_hour(conn: psycopg.Connection) -> dict[str, tuple]:
    rows = conn.execute(
        "SELECT role, tasks_created, tasks_completed, tasks_failed, avg_duration_sec, min_duration_sec, "
        "max_duration_sec FROM task_completion_log WHERE date = '2026-06-01' AND hour = 10"
    ).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


@pytest.fixture
def away_from_utc(db_url: str) -> None:
    """Sessions on the test database default to Los Angeles time: the rollup must not care."""
    dbname = conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET timezone TO 'America/Los_Angeles'").format(sql.Identifier(dbname))
        )


def test_rollup_counts_the_utc_hour(db_url: str, away_from_utc: None, conn: psycopg.Connection):
    insert_history(conn)
    expected = expected_hour(conn)
    # The independent count is itself what the rows above say.
    assert expected[ROLE] == (6, 3, 1)
    assert expected["product_discovery"] == (3, 2, 0)

    result = materialize_hour(db_url, threshold=0.3)
    assert result.success
    logged = logged_hour(conn)
    assert set(logged) == set(expected)  # every known role, zeros included
    assert {role: row[:3] for role, row in logged.items()} == expected
    # Durations of the completed tasks in the hour: 30 s, 60 s and 59.999999 s; 10 s and 20 s.
    assert logged[ROLE][3:] == (Decimal("50.00"), Decimal("30.00"), Decimal("60.00"))
    assert logged["product_discovery"][3:] == (Decimal("15.00"), Decimal("10.00"), Decimal("20.00"))

    [materialization] = result.asset_materializations_for_node("task_completion_log")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert materialization.partition == HOUR
    assert meta["tasks_created"] == 9
    assert meta["tasks_completed"] == 5
    assert meta["tasks_failed"] == 1
    assert meta["failure_rate"] == pytest.approx(round(1 / 6, 4))
    assert (meta[f"{ROLE}_completed"], meta[f"{ROLE}_failed"]) == (3, 1)

    [check] = result.get_asset_check_evaluations()
    assert check.check_name == "failure_rate_below_threshold"
    assert check.passed
    assert check.metadata["threshold"].value == 0.3


def test_rollup_check_fails_over_the_threshold(db_url: str, conn: psycopg.Connection):
    insert_history(conn)
    result = materialize_hour(db_url, threshold=0.1)  # 1 failed of 6 finished: 16.7 %
    assert result.success  # a warning check: the rollup itself is still written
    [check] = result.get_asset_check_evaluations()
    assert check.passed is False
    assert check.metadata["failure_rate"].value == pytest.approx(round(1 / 6, 4))
    assert logged_hour(conn)[ROLE][:3] == (6, 3, 1)


def test_rollup_is_idempotent_and_follows_late_changes(db_url: str, conn: psycopg.Connection):
    insert_history(conn)
    assert materialize_hour(db_url).success
    first = logged_hour(conn)
    assert materialize_hour(db_url).success
    assert logged_hour(conn) == first
    assert conn.execute(
        "SELECT count(*), count(DISTINCT role) FROM task_completion_log "
        "WHERE date = '2026-06-01' AND hour = 10"
    ).fetchone() == (5, 5)

    # A task of the hour recorded late: the next materialisation of the hour picks it up.
    conn.execute(
        "INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at) "
        "VALUES (%s, 'failed', '2026-06-01 08:00+00', '2026-06-01 10:40+00', '2026-06-01 10:41+00')",
        (ROLE,),
    )
    result = materialize_hour(db_url)
    assert result.success
    assert logged_hour(conn)[ROLE][:3] == (6, 3, 2)
    assert expected_hour(conn)[ROLE] == (6, 3, 2)
    [check] = result.get_asset_check_evaluations()
    assert check.passed is False  # 2 of 7 is over the default 20 %
