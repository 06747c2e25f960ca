"""Retention against real PostgreSQL and a real Dagster instance: what goes, what stays, the
hourly rollup of pruned hours kept, bad settings refused before anything is deleted, Dagster's
old runs trimmed, and a prune running while workers claim."""

import math
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.scheduler.instigation import TickStatus
from psycopg import sql

from tests.dagster_helpers import op_metadata
from tests.helpers import (
    add_stores,
    add_tasks,
    assert_platform_counters_consistent,
    assert_store_state_consistent,
    status_counts,
)
from tq_pipelines.defs.prune import (
    PruneConfig,
    finished_runs_before,
    prune_job,
    prune_schedule,
    trim_dagster_runs,
)
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.queue.api import PlatformLimits, TaskQueue
from tq_pipelines.queue.retention import LIMITS, RetentionSettings, RetentionSettingsError, prune

ROLE = "product_resync"
REPO = Path(__file__).resolve().parents[2]
FAST = {"pause_seconds": 0}


# -- helpers ------------------------------------------------------------------------------------


def add_finished(
    conn: psycopg.Connection, stores: list[int], status: str, age: timedelta, *, per_store: int = 1
) -> list[int]:
    """Tasks of ``stores`` that finished ``age`` ago (after a minute of work), inserted as such."""
    rows = conn.execute(
        """
        INSERT INTO worker_tasks (role, dispensary_id, platform, status, worker_id,
                                  created_at, claimed_at, started_at, completed_at)
        SELECT %(role)s, s, 'dutchie', %(status)s, 'old-worker',
               now() - %(age)s - interval '2 minutes', now() - %(age)s - interval '1 minute',
               now() - %(age)s - interval '1 minute', now() - %(age)s
        FROM unnest(%(stores)s::int[]) AS s
        CROSS JOIN generate_series(1, %(per)s) AS k
        RETURNING id
        """,
        {"role": ROLE, "status": status, "age": age, "stores": stores, "per": per_store},
    ).fetchall()
    return [r[0] for r in rows]


def add_unfinished(conn: psycopg.Connection, store: int, status: str, age: timedelta) -> int:
    """A pending, claimed or running task created ``age`` ago; an active one holds a platform slot."""
    active = status != "pending"
    row = conn.execute(
        """
        INSERT INTO worker_tasks (role, dispensary_id, platform, status, worker_id, created_at,
                                  claimed_at, last_heartbeat_at, send_at)
        VALUES (%(role)s, %(store)s, 'dutchie', %(status)s, %(worker)s, now() - %(age)s,
                %(claimed)s, %(claimed)s, %(claimed)s)
        RETURNING id
        """,
        {
            "role": ROLE,
            "store": store,
            "status": status,
            "worker": "old-worker" if active else None,
            "age": age,
            "claimed": datetime.now(UTC) - age if active else None,
        },
    ).fetchone()
    assert row is not None
    return int(row[0])


def task_ids(conn: psycopg.Connection) -> set[int]:
    return {r[0] for r in conn.execute("SELECT id FROM v_tasks").fetchall()}


def rollup(conn: psycopg.Connection, hour: datetime, role: str = ROLE) -> tuple | None:
    return conn.execute(
        """
        SELECT tasks_created, tasks_completed, tasks_failed, avg_duration_sec, min_duration_sec,
               max_duration_sec
        FROM task_completion_log
        WHERE role = %s AND date = %s AND hour = %s
        """,
        (role, hour.date(), hour.hour),
    ).fetchone()


def db_hour(conn: psycopg.Connection, ago: timedelta) -> datetime:
    """The UTC hour that began at or before ``ago`` before the database's now."""
    row = conn.execute(
        "SELECT date_trunc('hour', (now() - %s) AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'", (ago,)
    ).fetchone()
    assert row is not None
    return row[0].astimezone(UTC)


def table_counts(conn: psycopg.Connection) -> dict[str, int]:
    return {
        t: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(t))).fetchone()[0]  # type: ignore[index]
        for t in ("worker_tasks", "task_completion_log", "worker_registry", "product_history")
    }


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def limited(queue: TaskQueue) -> TaskQueue:
    """dutchie has politeness limits: active tasks hold slots that the counters must keep."""
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=100, requests_per_second=1000)])
    return queue


# -- worker_tasks ---------------------------------------------------------------------------------


def test_old_finished_tasks_go_in_batches_and_young_or_unfinished_ones_stay(
    conn: psycopg.Connection, limited: TaskQueue, db_url: str
):
    stores = add_stores(conn, 12)
    old = (
        add_finished(conn, stores[:4], "completed", timedelta(days=40), per_store=5)
        + add_finished(conn, stores[4:6], "failed", timedelta(days=31, hours=2))
        + add_finished(conn, stores[6:8], "cancelled", timedelta(days=90))
    )
    young = add_finished(conn, stores[:4], "completed", timedelta(days=29)) + add_finished(
        conn, stores[4:6], "failed", timedelta(days=2)
    )
    # However old, a task that has not finished is never pruned.
    unfinished = [
        add_unfinished(conn, stores[8], "pending", timedelta(days=300)),
        add_unfinished(conn, stores[9], "claimed", timedelta(days=100)),
        add_unfinished(conn, stores[10], "running", timedelta(days=60)),
        add_unfinished(conn, stores[11], "pending", timedelta(days=45)),
    ]
    heads = conn.execute("SELECT * FROM worker_task_heads ORDER BY 1, 2").fetchall()
    in_flight = conn.execute("SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie'").fetchone()
    assert in_flight == (2,)
    settings = RetentionSettings(batch_size=7, **FAST)

    dry = prune(db_url, settings, dry_run=True)
    assert dry.tables["worker_tasks"].rows == len(old) == 24
    assert dry.tables["worker_tasks"].batches == 4
    assert task_ids(conn) == set(old + young + unfinished)

    report = prune(limited, settings)

    assert task_ids(conn) == set(young + unfinished)
    t = report.tables["worker_tasks"]
    assert (t.rows, t.batches, t.finished) == (24, math.ceil(24 / 7), True)
    assert report.cutoffs["tasks_before"] == db_hour(conn, timedelta(days=30))
    assert conn.execute("SELECT tasks_pruned_before FROM tq_retention").fetchone() == (
        report.cutoffs["tasks_before"],
    )
    assert report.rollup_kept_before == report.cutoffs["tasks_before"]
    # The triggers kept the stores' state, the heads and the platform's slots.
    assert_store_state_consistent(conn)
    assert_platform_counters_consistent(conn)
    assert conn.execute("SELECT * FROM worker_task_heads ORDER BY 1, 2").fetchall() == heads
    assert conn.execute("SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie'").fetchone() == (2,)
    # The old pending work is still claimable, and a second prune finds nothing.
    claimed = {t.id for t in limited.claim_many(ROLE, "w", 10)}
    assert claimed == {unfinished[0], unfinished[3]}
    assert prune(db_url, settings).rows == 0


def test_a_pruned_hour_keeps_its_rollup_and_a_later_refresh_changes_nothing(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str
):
    """The hourly asset never ran for hour H, and ran for H+1 while H was still open: the prune
    rolls both up from the whole rows before deleting any, once each; afterwards a refresh of
    either writes nothing and the numbers stay those of the whole rows."""
    h = db_hour(conn, timedelta(days=40))
    h1 = h + timedelta(hours=1)
    at = {m: h + timedelta(minutes=m) for m in range(0, 120)}
    rows = [
        # created, started, completed, status
        *[(at[5], at[10], at[10] + timedelta(seconds=s), "completed") for s in (2, 4, 6)],
        (at[6], at[11], at[20], "failed"),
        (at[7], None, at[30], "cancelled"),
        (at[8], at[50], at[70], "completed"),  # created in H, completed in H+1
        (at[9], None, None, "pending"),  # never pruned
    ]
    for created, started, completed, status in rows:
        conn.execute(
            """
            INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at)
            VALUES (%s, %s, %s, %s, %s)
            """,
            (ROLE, status, created, started, completed),
        )
    whole_h = (7, 3, 1, Decimal("4.00"), Decimal("2.00"), Decimal("6.00"))
    whole_h1 = (0, 1, 0, Decimal("1200.00"), Decimal("1200.00"), Decimal("1200.00"))
    queue.refresh_completion_log(h1.date(), h1.hour)
    assert rollup(conn, h1) == whole_h1
    # H's row as a run of the current hour would have left it: made before the hour ended.
    queue.refresh_completion_log(h.date(), h.hour)
    conn.execute(
        "UPDATE task_completion_log SET tasks_completed = 1, updated_at = %s WHERE date = %s AND hour = %s",
        (at[45], h.date(), h.hour),
    )
    assert rollup(conn, h)[1] == 1  # type: ignore[index]

    report = prune(db_url, RetentionSettings(batch_size=2, **FAST))

    assert report.tables["worker_tasks"].rows == 6
    assert report.hours_rolled_up == 1  # H, made again once; H+1 was whole already
    assert status_counts(conn) == {"pending": 1}
    assert rollup(conn, h) == whole_h
    assert rollup(conn, h1) == whole_h1
    # Recomputed from what remains, H would read (1, 0, 0, ...): the refresh leaves it.
    assert queue.refresh_completion_log(h.date(), h.hour) == 0
    assert queue.refresh_completion_log(h1.date(), h1.hour) == 0
    assert rollup(conn, h) == whole_h
    assert rollup(conn, h1) == whole_h1
    # Hours after the horizon are recomputed as before.
    now = db_hour(conn, timedelta(0))
    assert queue.refresh_completion_log(now.date(), now.hour) == len(queue.roles())


def test_the_rollup_of_an_hour_is_made_before_its_tasks_go_if_it_never_was(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str
):
    stores = add_stores(conn, 3)
    add_finished(conn, stores, "completed", timedelta(days=35), per_store=4)
    add_finished(conn, stores, "failed", timedelta(days=35, hours=3))
    assert conn.execute("SELECT count(*) FROM task_completion_log").fetchone() == (0,)

    report = prune(db_url, RetentionSettings(batch_size=5, **FAST))

    assert report.tables["worker_tasks"].rows == 15
    totals = conn.execute(
        "SELECT sum(tasks_created), sum(tasks_completed), sum(tasks_failed) FROM task_completion_log "
        "WHERE role = %s",
        (ROLE,),
    ).fetchone()
    assert totals == (15, 12, 3)
    hours = conn.execute("SELECT count(DISTINCT (date, hour)) FROM task_completion_log").fetchone()
    assert hours == (report.hours_rolled_up,)


# -- the other tables -----------------------------------------------------------------------------


def test_registry_rows_of_long_gone_workers_go_and_live_or_busy_ones_stay(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str
):
    [store] = add_stores(conn, 1)
    for worker in ("gone", "gone-never-said", "silent-holding", "live", "offline-lately"):
        queue.register_worker(worker, ROLE)
    queue.deregister_worker("gone")
    queue.deregister_worker("offline-lately")
    queue.enqueue(ROLE, store)
    assert queue.claim(ROLE, "silent-holding") is not None
    ages = {"gone": 10, "gone-never-said": 8, "silent-holding": 30, "offline-lately": 6}
    for worker, days in ages.items():
        conn.execute(
            "UPDATE worker_registry SET last_heartbeat_at = now() - make_interval(days => %s) "
            "WHERE worker_id = %s",
            (days, worker),
        )

    report = prune(db_url, RetentionSettings(batch_size=1, **FAST))

    kept = {r[0] for r in conn.execute("SELECT worker_id FROM worker_registry").fetchall()}
    assert kept == {"silent-holding", "live", "offline-lately"}
    assert (report.tables["worker_registry"].rows, report.tables["worker_registry"].batches) == (2, 2)


def test_product_history_and_the_rollup_go_by_age(conn: psycopg.Connection, db_url: str):
    [store] = add_stores(conn, 1)
    conn.execute(
        """
        INSERT INTO products (dispensary_id, external_id, name, category, price, in_stock)
        VALUES (%s, 'p1', 'Product', 'flower', 10, true)
        """,
        (store,),
    )
    # In id order, as store_menu writes them: ids follow observed_at.
    conn.execute(
        """
        INSERT INTO product_history (product_id, dispensary_id, observed_at, change, price)
        SELECT (SELECT id FROM products), %s, now() - make_interval(days => 400 - g), 'changed', g
        FROM generate_series(0, 399) AS g
        ORDER BY g
        """,
        (store,),
    )
    conn.execute(
        """
        INSERT INTO task_completion_log (role, date, hour)
        SELECT %s, (now() AT TIME ZONE 'UTC')::DATE - g, 0
        FROM generate_series(0, 500) AS g
        """,
        (ROLE,),
    )

    report = prune(db_url, RetentionSettings(batch_size=16, **FAST))

    # 400 - g days old: 35 past 365 days (g < 35), the one at exactly 365 days a moment later.
    left = conn.execute("SELECT min(price), count(*) FROM product_history").fetchone()
    assert left == (Decimal("36.00"), 364)
    assert report.tables["product_history"].rows == 36
    assert report.tables["product_history"].batches == 3
    oldest = conn.execute(
        "SELECT (now() AT TIME ZONE 'UTC')::DATE - min(date) FROM task_completion_log"
    ).fetchone()
    assert oldest == (400,)
    assert report.tables["task_completion_log"].rows == 100


# -- bad settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"tasks_days": -1}, "tasks_days must be from 1 to 36500, got -1"),
        ({"tasks_days": 0}, "tasks_days must be from 1 to 36500, got 0"),
        ({"batch_size": 0}, "batch_size must be from 1 to 100000, got 0"),
        ({"workers_days": 2.5}, "workers_days must be a whole number from 1 to 36500, got 2.5"),
        ({"product_history_days": True}, "product_history_days must be a whole number"),
        ({"pause_seconds": float("nan")}, "pause_seconds must be from 0 to 60, got nan"),
        ({"completion_log_days": 20}, "completion_log_days (20) must be at least tasks_days (30)"),
    ],
)
def test_bad_settings_are_refused_in_words(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(RetentionSettingsError) as err:
        RetentionSettings(**settings)
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"tasks_days": -1}, "tasks_days = -1: Input should be greater than or equal to 1"),
        ({"batch_size": 0}, "batch_size = 0: Input should be greater than or equal to 1"),
        (
            {"tasks_days": 90, "completion_log_days": 60},
            "completion_log_days (60) must be at least tasks_days (90)",
        ),
    ],
)
def test_the_job_refuses_bad_config_before_the_run_exists(
    conn: psycopg.Connection, db_url: str, instance: dg.DagsterInstance, config: dict[str, int], words: str
) -> None:
    stores = add_stores(conn, 2)
    add_finished(conn, stores, "completed", timedelta(days=100))
    before = table_counts(conn)

    with pytest.raises(dg.DagsterInvalidConfigError) as err:
        prune_job.execute_in_process(
            run_config={"ops": {"prune_old_rows": {"config": config}}},
            resources={"tq": QueueResource(database_url=db_url)},
            instance=instance,
        )

    assert words in str(err.value)
    assert "refused before the run is created" in str(err.value)
    assert instance.get_runs() == []
    assert table_counts(conn) == before


def test_sql_arguments_are_refused_with_a_hint(conn: psycopg.Connection) -> None:
    calls = [
        ("SELECT refresh_task_completion_log(NULL, 3)", "date must not be NULL"),
        ("SELECT refresh_task_completion_log(current_date, 24)", "hour must be from 0 to 23, got 24"),
        ("SELECT refresh_task_completion_log(current_date, NULL)", "got NULL"),
        (
            "SELECT * FROM prune_tasks(date_trunc('hour', now()) - interval '2 hours', 10)",
            "before must be at least 7 days ago (tq_retention.min_tasks_days)",
        ),
        (
            "SELECT * FROM prune_tasks(date_trunc('hour', now()) - interval '30 days 30 minutes', 10)",
            "whole",
        ),
        ("SELECT * FROM prune_tasks(NULL, 10)", "got NULL"),
        ("SELECT * FROM prune_tasks(date_trunc('hour', now()) - interval '30 days', 0)", "batch size"),
    ]
    for statement, words in calls:
        with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
            conn.execute(statement)
        assert words in str(err.value), statement
        assert err.value.diag.message_hint, statement


def test_the_default_settings_pass_the_default_floors(conn: psycopg.Connection, db_url: str) -> None:
    floors = conn.execute(
        "SELECT min_tasks_days, min_completion_log_days, min_workers_days, min_product_history_days "
        "FROM tq_retention"
    ).fetchone()
    assert floors == (7, 90, 1, 30)
    defaults = RetentionSettings()
    days = (
        defaults.tasks_days,
        defaults.completion_log_days,
        defaults.workers_days,
        defaults.product_history_days,
    )
    assert all(d >= f for d, f in zip(days, floors, strict=True))
    assert prune(db_url, dry_run=True).finished
    assert prune(db_url).finished


@pytest.mark.parametrize(
    ("column", "setting"),
    [
        ("min_tasks_days", "tasks_days"),
        ("min_completion_log_days", "completion_log_days"),
        ("min_workers_days", "workers_days"),
        ("min_product_history_days", "product_history_days"),
    ],
)
def test_a_floor_raised_by_the_admin_refuses_a_younger_horizon_before_anything_goes(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str, column: str, setting: str
) -> None:
    stores = add_stores(conn, 3)
    add_finished(conn, stores, "completed", timedelta(days=500))
    queue.register_worker("gone", ROLE)
    conn.execute("UPDATE worker_registry SET last_heartbeat_at = now() - interval '500 days'")
    before = table_counts(conn)
    # The rollup outlives the tasks: the tasks' floor may not pass the rollup's (a CHECK).
    raised = ["min_completion_log_days", column] if column == "min_tasks_days" else [column]
    conn.execute(
        sql.SQL("UPDATE tq_retention SET {}").format(
            sql.SQL(", ").join(sql.SQL("{} = 800").format(sql.Identifier(c)) for c in raised)
        )
    )
    for dry_run in (True, False):
        with pytest.raises(RetentionSettingsError) as refused:
            prune(db_url, RetentionSettings(**FAST), dry_run=dry_run)
        assert f"{setting} must be at least 800 days in this database (tq_retention.{column})" in str(
            refused.value
        )
        assert f"the admin (the owner of tq_retention) lowers it: UPDATE tq_retention SET {column} = " in str(
            refused.value
        )
    assert table_counts(conn) == before
    assert conn.execute("SELECT updated_at = '-infinity' FROM tq_retention").fetchone() == (True,)


def test_the_job_config_has_the_bounds_and_defaults_of_the_settings() -> None:
    fields = PruneConfig.model_fields
    defaults = RetentionSettings()
    for name, (low, high) in LIMITS.items():
        f = fields[name]
        bounds = {type(m).__name__: m for m in f.metadata}
        assert (bounds["Ge"].ge, bounds["Le"].le, f.default) == (low, high, getattr(defaults, name)), name


# -- Dagster ----------------------------------------------------------------------------------------


def add_run(instance: dg.DagsterInstance, ended_days_ago: float | None, end: str | None) -> str:
    """A run that started ``ended_days_ago`` days ago and ended then with ``end`` (None: still
    running), its events written at those times."""
    run = instance.create_run_for_job(job_def=prune_job)
    when = (datetime.now(UTC) - timedelta(days=ended_days_ago or 0)).timestamp()
    events = [dg.DagsterEventType.PIPELINE_START] + ([dg.DagsterEventType(end)] if end else [])
    for event_type in events:
        event = dg.DagsterEvent(event_type_value=event_type.value, job_name=run.job_name)
        instance.report_dagster_event(event, run_id=run.run_id, timestamp=when)
    return run.run_id


def test_finished_dagster_runs_past_the_horizon_go_with_their_events(instance: dg.DagsterInstance) -> None:
    old = {
        "success": add_run(instance, 45, "PIPELINE_SUCCESS"),
        "failure": add_run(instance, 40, "PIPELINE_FAILURE"),
        "canceled": add_run(instance, 35, "PIPELINE_CANCELED"),
    }
    kept = {
        "young": add_run(instance, 20, "PIPELINE_SUCCESS"),
        "in flight for long": add_run(instance, 60, None),
        "not started": instance.create_run_for_job(job_def=prune_job).run_id,
    }
    assert instance.get_run_by_id(old["success"]).status == dg.DagsterRunStatus.SUCCESS  # type: ignore[union-attr]
    assert instance.all_logs(old["success"])

    before = datetime.now(UTC) - timedelta(days=30)
    assert finished_runs_before(instance, before, 10) == [old["success"], old["failure"], old["canceled"]]
    # A small number per prune, oldest first.
    assert trim_dagster_runs(instance, older_than_days=30, limit=2, page=1) == 2
    assert instance.get_run_by_id(old["success"]) is None
    assert instance.get_run_by_id(old["canceled"]) is not None
    assert trim_dagster_runs(instance, older_than_days=30, limit=100) == 1

    for run_id in old.values():
        assert instance.get_run_by_id(run_id) is None
        assert instance.all_logs(run_id) == []
    for name, run_id in kept.items():
        assert instance.get_run_by_id(run_id) is not None, name
    assert trim_dagster_runs(instance, older_than_days=30, limit=100) == 0


def test_the_prune_job_reports_per_table_counts(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str, instance: dg.DagsterInstance
) -> None:
    stores = add_stores(conn, 5)
    add_finished(conn, stores, "completed", timedelta(days=60), per_store=3)
    queue.register_worker("gone", ROLE)
    conn.execute("UPDATE worker_registry SET last_heartbeat_at = now() - interval '9 days'")
    old_run = add_run(instance, 31, "PIPELINE_SUCCESS")

    result = prune_job.execute_in_process(
        run_config={"ops": {"prune_old_rows": {"config": {"batch_size": 4, "pause_seconds": 0}}}},
        resources={"tq": QueueResource(database_url=db_url)},
        instance=instance,
    )

    assert result.success
    meta = op_metadata(result, "prune_old_rows")
    assert (meta["worker_tasks_rows"], meta["worker_tasks_batches"]) == (15, 4)
    assert (meta["worker_registry_rows"], meta["product_history_rows"]) == (1, 0)
    assert meta["dagster_runs"] == 1
    assert meta["finished"] is True
    assert "| worker_tasks | 15 | 4 |" in meta["by_table"]
    assert instance.get_run_by_id(old_run) is None
    assert instance.get_run_by_id(result.run_id) is not None
    assert conn.execute("SELECT count(*) FROM v_tasks").fetchone() == (0,)


def test_the_schedule_runs_daily_off_peak_and_dagster_yaml_trims_ticks() -> None:
    assert prune_schedule.cron_schedule == "30 3 * * *"
    assert prune_schedule.execution_timezone == "UTC"
    assert prune_schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    for path in (REPO / "dagster.yaml", REPO / "deploy" / "k8s" / "dagster.yaml"):
        retention = yaml.safe_load(path.read_text())["retention"]
        with dg.instance_for_test(overrides={"retention": retention}) as inst:
            schedule = inst.get_tick_retention_settings(InstigatorType.SCHEDULE)
            sensor = inst.get_tick_retention_settings(InstigatorType.SENSOR)
        assert set(schedule.values()) == {30}, path
        assert sensor[TickStatus.SKIPPED] == 3, path
        assert {sensor[s] for s in (TickStatus.SUCCESS, TickStatus.FAILURE, TickStatus.STARTED)} == {30}, path


# -- pruning while workers drain ------------------------------------------------------------------


def test_pruning_while_workers_claim_loses_no_active_task(
    conn: psycopg.Connection, limited: TaskQueue, db_url: str
) -> None:
    stores = add_stores(conn, 40)
    conn.execute(
        """
        INSERT INTO worker_tasks (role, dispensary_id, platform, status, worker_id, created_at,
                                  started_at, completed_at)
        SELECT %s, s, 'dutchie', 'completed', 'old-worker', now() - interval '60 days',
               now() - interval '60 days', now() - interval '60 days' + g * interval '1 second'
        FROM unnest(%s::int[]) AS s
        CROSS JOIN generate_series(1, 300) AS g
        """,
        (ROLE, stores),
    )
    # Pending work created as long ago as the pruned tasks: its created hours stay counted.
    add_tasks(conn, ROLE, stores, 15, adjacent=False)
    conn.execute("UPDATE worker_tasks SET created_at = now() - interval '60 days' WHERE status = 'pending'")
    pending = {r[0] for r in conn.execute("SELECT id FROM v_tasks WHERE status = 'pending'").fetchall()}
    completed: list[int] = []
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            with TaskQueue.connect(db_url, max_size=1) as q:
                while tasks := q.claim_many(ROLE, f"w{n}", 5, start=True):
                    completed.extend(q.complete_many({t.lease: {"n": n} for t in tasks}))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    report = prune(db_url, RetentionSettings(batch_size=250, pause_seconds=0))
    for t in threads:
        t.join(timeout=60)

    assert errors == []
    assert report.tables["worker_tasks"].rows == 40 * 300
    assert sorted(completed) == sorted(pending)
    assert status_counts(conn) == {"completed": len(pending)}
    assert task_ids(conn) == pending
    assert_store_state_consistent(conn)
    assert_platform_counters_consistent(conn)
    created = conn.execute(
        "SELECT sum(tasks_created), sum(tasks_completed) FROM task_completion_log WHERE role = %s", (ROLE,)
    ).fetchone()
    assert created == (40 * 300 + len(pending), 40 * 300)
