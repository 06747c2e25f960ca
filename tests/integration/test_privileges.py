"""Least privilege (migration 0010, ``tq grant``): the worker role drains, runs the scheduled jobs,
the rollup and the sensors, and does the crawl handlers' writes, all through the queue's
functions; every statement that would change a task, a role or a platform by hand, or the
schema itself, is refused. The queue's functions are SECURITY DEFINER with a pinned search_path,
and stay so after a migration replaces one.

Roles are cluster-wide: each test makes its own (tq_worker_<hex>, tq_admin_<hex>) and drops it
at its end. 127.0.0.1 uses trust authentication, so a URL with user=<role> connects as it.
"""

import re
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.dagster_helpers import Webhook, failure_text, op_metadata
from tests.helpers import add_stores, add_tasks, status_counts
from tq_pipelines.crawl.menu import menu_hash, normalise_menu
from tq_pipelines.db.grant import GrantError, grant
from tq_pipelines.db.migrate import Migration, load_migrations, migrate
from tq_pipelines.db.queries import query
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.freshness import store_freshness
from tq_pipelines.defs.jobs import (
    drain_tasks_job,
    enqueue_analytics_refresh_job,
    generate_resync_tasks_job,
    recover_stale_tasks_job,
)
from tq_pipelines.defs.prune import prune_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.rollup import task_completion_log
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor
from tq_pipelines.defs.sensors.queue import task_queue_sensor
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.worker import Worker

ROLE = "product_resync"
PINNED = "search_path=public, pg_temp"

# Functions that run with their caller's rights, and that the worker may not call: the internal
# helpers (named tq_*), called only from the queue's SECURITY DEFINER functions, where the caller
# is the owner. Any other function must be SECURITY DEFINER with the pinned search_path; a new
# helper goes here, with why it needs no rights of its own.
INVOKER_FUNCTIONS = {
    # argument checks and the texts of their refusals (0008)
    "tq_refuse",
    "tq_shown",
    "tq_json_number_between",
    "tq_json_text",
    "tq_resync_window",
    "tq_known_platforms_hint",
    "tq_require_worker",
    "tq_require_role",
    "tq_check_task",
    "tq_check_prune",
    # the claim's bookkeeping: store heads, platform counters and quotas (0003, 0006; one
    # store's head, 0014)
    "tq_lock_and_refresh",
    "tq_refresh_heads",
    "tq_refresh_head",
    "tq_platforms_apply",
    "tq_platform_quota",
    "tq_platform_tolerance",
    "tq_platform_grace",  # how long a start stays good (0019)
    "tq_retry_delay",
    # whether a worker's session lock is held (0011)
    "tq_session_alive",
    # the rollup of one hour, under refresh_task_completion_log and prune_tasks (0009)
    "tq_rollup_hour",
    # a worker's tallies into its registry row, under heartbeat_tasks and prune_workers (0015)
    "tq_fold_tallies",
    # the claim floors, under the heads' triggers and claim_tasks (0015, per priority 0017)
    "tq_lower_floor",
    "tq_raise_floors",
    "tq_floor_lock_key",
    # the admin's: `tq grant` and the end of every migration (0010), and the queue's objects
    # they act on (the registries tq_relations and tq_api)
    "tq_queue_relations",
    "tq_queue_functions",
    "tq_secure_functions",
    "tq_grant_admin",
    "tq_grant_worker",
    # the ways a worker could write the queue around its functions, for tq grant (0012)
    "tq_worker_write_routes",
    # lease tokens: the hash, the check of a held task and of a batch's leases, URLs on a
    # platform's hosts, a registration's session (0013)
    "tq_lease_hash",
    "tq_held_task",
    "tq_check_leases",
    "tq_url_allowed",
    "tq_url_shown",
    "tq_session_pid",
    # the handlers' writes, called by their lease-checking API functions (0013)
    "tq_store_menu",
    "tq_mark_store_gone",
    "tq_save_entry_point",
    "tq_upsert_listed_stores",
    # a hand-off's claim of one task, the holds after a timeout, fair shares (0016)
    "tq_claim_next",
    # the claim's order of one platform, for tq_claim_next and platform_standby (0028)
    "tq_pick_next",
    "tq_worker_slots",
    "tq_platform_held",
    "tq_fair_share",
    "tq_worker_room",
    "tq_sync_limits",
    # slot bookkeeping without a flush wait, under the hand-off, a start and a release (0025)
    "tq_slot_commit",
    # a pass, with or without a relay, under platform_pass and platform_relay (0031)
    "tq_pass",
    # the announcement of a slot a worker's share gave back, after a pass or a hand-off (0032)
    "tq_slot_refused",
    # the standbys' bound and claim, under platform_standby and platform_standbys (0035)
    "tq_standby_room",
    "tq_take_standby",
}


# -- roles ----------------------------------------------------------------------------------------


@pytest.fixture
def make_role(pg_server: str, db_url: str) -> Iterator[Callable[[str], str]]:
    """``make_role(kind)``: a unique role name for grant() to create; at the end of the test,
    what it owns or holds in the test's database is given back, and the role dropped."""
    names: list[str] = []

    def make(kind: str) -> str:
        names.append(f"tq_{kind}_{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield make
    admin = conninfo_to_dict(pg_server).get("user") or "postgres"
    with psycopg.connect(db_url, autocommit=True) as conn:
        for name in names:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(
                    sql.SQL("REASSIGN OWNED BY {} TO {}").format(sql.Identifier(name), sql.Identifier(admin))
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def as_role(db_url: str, role: str) -> str:
    return make_conninfo(db_url, user=role)


@pytest.fixture
def worker_url(db_url: str, make_role: Callable[[str], str]) -> str:
    """The URL of a worker role granted on the test's database, the queue's objects owned by an
    admin role (tq grant refuses a worker while they are a superuser's)."""
    role = make_role("worker")
    grant(db_url, worker_role=role, admin_role=make_role("admin"))
    return as_role(db_url, role)


# -- the hardening --------------------------------------------------------------------------------


def functions(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    """Every function and procedure of the schema by signature: security, settings, whether a
    trigger function, whether PUBLIC may call it."""
    rows = conn.execute(
        """
        SELECT p.oid::REGPROCEDURE::TEXT AS signature, p.proname AS name, p.prosecdef AS definer,
               coalesce(p.proconfig, '{}') AS config, p.prorettype = 'trigger'::REGTYPE AS trigger,
               EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                       WHERE a.grantee = 0) AS public_execute
        FROM pg_proc p
        WHERE p.pronamespace = 'public'::REGNAMESPACE AND p.prokind IN ('f', 'p')
        """
    ).fetchall()
    return {
        r[0]: dict(zip(("name", "definer", "config", "trigger", "public_execute"), r[1:], strict=True))
        for r in rows
    }


def unsecured(conn: psycopg.Connection, invoker: frozenset[str] = frozenset()) -> list[str]:
    """Functions that break the rule: API not SECURITY DEFINER with the pinned search_path, or a
    helper (INVOKER_FUNCTIONS, and ``invoker``) that is DEFINER, or anything PUBLIC may call."""
    wrong = []
    for signature, f in sorted(functions(conn).items()):
        if f["public_execute"]:
            wrong.append(f"{signature}: PUBLIC may execute it")
        if f["trigger"]:
            continue
        if f["name"] in INVOKER_FUNCTIONS | invoker:
            if f["definer"]:
                wrong.append(f"{signature}: an internal helper, yet SECURITY DEFINER")
        elif not (f["definer"] and PINNED in f["config"]):
            wrong.append(f"{signature}: SECURITY DEFINER {f['definer']}, settings {f['config']}")
    return wrong


def test_every_function_is_definer_with_a_pinned_search_path_or_an_internal_helper(conn: psycopg.Connection):
    found = functions(conn)
    assert unsecured(conn) == []
    names = {f["name"] for f in found.values()}
    assert names >= INVOKER_FUNCTIONS, f"not in the schema any more: {INVOKER_FUNCTIONS - names}"
    # the API the workers call, by name, is among the DEFINER functions
    definer = {f["name"] for f in found.values() if f["definer"]}
    assert {
        "claim_tasks",
        "complete_tasks_timed",
        "heartbeat_tasks",
        "store_menu",
        "save_entry_point",
    } <= definer
    # a function's own settings stay beside the pinned path
    [claim] = [f for f in found.values() if f["name"] == "claim_tasks"]
    assert "plan_cache_mode=force_generic_plan" in claim["config"]


def test_public_holds_nothing_on_the_tables_nor_create_in_the_schema(conn: psycopg.Connection):
    granted = conn.execute(
        """
        SELECT c.relname, a.privilege_type
        FROM pg_class c
        CROSS JOIN LATERAL aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
        WHERE c.relnamespace = 'public'::REGNAMESPACE AND a.grantee = 0
        """
    ).fetchall()
    assert granted == []
    assert conn.execute(
        """
        SELECT a.privilege_type
        FROM pg_namespace n
        CROSS JOIN LATERAL aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
        WHERE n.nspname = 'public' AND a.grantee = 0
        """
    ).fetchall() == [("USAGE",)]


def test_secure_functions_restores_what_a_later_migration_resets(conn: psycopg.Connection):
    # CREATE OR REPLACE without the attributes, as a later migration would write it
    definition = conn.execute(
        "SELECT pg_get_functiondef('worker_completed(varchar, integer)'::REGPROCEDURE)"
    ).fetchone()[0]
    plain = re.sub(r"^\s*(SECURITY DEFINER|SET search_path.*)$\n", "", definition, flags=re.MULTILINE)
    assert plain != definition
    conn.execute(plain)
    conn.execute("CREATE FUNCTION later_api() RETURNS INTEGER AS $$ SELECT 1 $$ LANGUAGE sql")
    conn.execute("INSERT INTO tq_api (function_name) VALUES ('later_api')")
    conn.execute("CREATE FUNCTION tq_later_helper() RETURNS INTEGER AS $$ SELECT 1 $$ LANGUAGE sql")
    wrong = unsecured(conn)
    assert any(w.startswith("worker_completed(") for w in wrong)
    assert any(w.startswith("later_api()") for w in wrong)

    conn.execute("CALL tq_secure_functions()")
    conn.execute("CALL tq_secure_functions()")  # idempotent
    assert unsecured(conn, invoker=frozenset({"tq_later_helper"})) == []


def test_migration_0010_applies_without_the_migrations_beside_it(empty_db_url: str):
    """0010 is written over whatever functions exist: it must not need 0008 or 0009."""
    migrations = [m for m in load_migrations() if m.version not in ("0008", "0009")]
    assert "0010_least_privilege.sql" in migrate(empty_db_url, migrations)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert unsecured(conn) == []


# -- what the worker does -------------------------------------------------------------------------


def run_job(
    job: dg.JobDefinition, url: str, run_config: dict | None = None, partition_key: str | None = None
) -> dg.ExecuteInProcessResult:
    return job.execute_in_process(
        run_config=run_config,
        resources={"tq": QueueResource(database_url=url), "crawl": CrawlResource()},
        partition_key=partition_key,
        raise_on_error=False,
    )


def test_the_worker_runs_the_scheduled_jobs_a_drain_and_the_rollup(
    worker_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TQ_HANDLERS", f"{ROLE}=tq_pipelines.handlers:noop")
    monkeypatch.delenv("TQ_PLATFORMS_FILE", raising=False)
    add_stores(conn, 6)
    now = datetime.now(UTC)

    resync = run_job(
        generate_resync_tasks_job,
        worker_url,
        {"ops": {"generate_resync_tasks": {"config": {"batches_per_day": 1, "platforms": ["dutchie"]}}}},
        partition_key=now.date().isoformat(),
    )
    assert resync.success, failure_text(resync)
    assert op_metadata(resync, "generate_resync_tasks")["created"] == 6

    drain = run_job(drain_tasks_job, worker_url, {"ops": {"drain_role_tasks": {"config": {"role": ROLE}}}})
    assert drain.success, failure_text(drain)
    assert op_metadata(drain, "drain_role_tasks")["completed"] == 6
    assert status_counts(conn) == {"completed": 6}

    recover = run_job(recover_stale_tasks_job, worker_url)
    assert recover.success, failure_text(recover)
    analytics = run_job(enqueue_analytics_refresh_job, worker_url)
    assert analytics.success, failure_text(analytics)
    assert op_metadata(analytics, "enqueue_analytics_refresh_task")["created"] == 1

    # the hour of the completions, even if a new one began meanwhile
    hour = conn.execute("SELECT max(completed_at) FROM v_tasks").fetchone()[0].astimezone(UTC)
    rollup = dg.materialize(
        [task_completion_log],
        partition_key=hour.strftime("%Y-%m-%d-%H:00"),
        resources={"tq": QueueResource(database_url=worker_url), "crawl": CrawlResource()},
        raise_on_error=False,
    )
    assert rollup.success, failure_text(rollup)
    [materialized] = rollup.asset_materializations_for_node("task_completion_log")
    assert materialized.metadata["tasks_completed"].value == 6

    freshness = dg.materialize(
        [store_freshness],
        resources={"tq": QueueResource(database_url=worker_url)},
        raise_on_error=False,
    )
    assert freshness.success, failure_text(freshness)
    [fresh] = freshness.asset_materializations_for_node("store_freshness")
    assert fresh.metadata["dutchie_enabled"].value == 6

    # The nightly prune, with its Dagster runs trimmed too: its batches are functions.
    for table in ("worker_tasks", "worker_task_history"):
        conn.execute(
            f"UPDATE {table} SET created_at = now() - interval '41 days',"
            " completed_at = now() - interval '40 days' WHERE status = 'completed'"
        )
    pruned = run_job(prune_job, worker_url)
    assert pruned.success, failure_text(pruned)
    assert status_counts(conn) == {"pending": 1}  # the analytics refresh queued above


def test_the_worker_evaluates_the_sensors(worker_url: str, conn: psycopg.Connection, webhook: Webhook):
    add_tasks(conn, ROLE, add_stores(conn, 3), 1)
    with dg.instance_for_test() as instance:
        with dg.build_sensor_context(
            instance=instance, resources={"tq": QueueResource(database_url=worker_url)}
        ) as ctx:
            result = task_queue_sensor.evaluate_tick(ctx)
        assert [r.run_config["ops"]["drain_role_tasks"]["config"]["role"] for r in result.run_requests] == [
            ROLE
        ]
        resources = {
            "tq": QueueResource(database_url=worker_url),
            "alerts": AlertResource(webhook_url=webhook.url),
            "health": HealthThresholds(),
        }
        with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
            health = queue_health_sensor.evaluate_tick(ctx)
        assert health.skip_message is not None


def test_a_worker_loop_drains_fails_and_retries_as_the_worker(worker_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 8), 1)

    def odd_fails(task: Any, ctx: Any) -> dict[str, int]:
        if task.id % 2:
            raise RuntimeError(f"odd task {task.id}")
        return {"id": task.id}

    with TaskQueue.connect(worker_url) as queue:
        worker = Worker(
            queue,
            ROLE,
            odd_fails,
            batch_size=3,
            heartbeat_seconds=0.2,
            time_budget_seconds=20,
            platform_wait_seconds=0,
        )
        stats = worker.run()
        assert queue.claimable()[ROLE] == (0, 0)  # the failed ones wait for their retry
        [capacity] = [c for c in queue.capacity() if c.role == ROLE]
        assert (capacity.pending_tasks, capacity.completed_last_hour) == (4, 4)
    assert (stats.completed, stats.retried) == (4, 4)
    assert status_counts(conn) == {"completed": 4, "pending": 4}


def _enqueue(w: psycopg.Connection, role: str, store: int | None, payload: Any = None) -> int | None:
    """enqueue_task_once as the worker: the new task's id (None: one is queued already)."""
    row = w.execute(
        query("enqueue_task_once"),
        {
            "role": role,
            "dispensary_id": store,
            "platform": "dutchie" if store is None else None,
            "priority": 0,
            "scheduled_for": None,
            "payload": Jsonb(payload) if payload is not None else None,
        },
    ).fetchone()
    assert row is not None
    return row["id"]


def _claim(w: psycopg.Connection, role: str) -> dict[str, Any]:
    """One task of ``role`` claimed and started by the worker: its id and lease."""
    [row] = w.execute(
        "SELECT (c.task).id AS task_id, c.lease FROM claim_tasks(%s, 'w-1', 1, true) c", (role,)
    ).fetchall()
    return dict(row)


def test_the_crawl_handlers_writes_go_through_functions(worker_url: str, conn: psycopg.Connection):
    """Each handler's write, as the worker role, under the lease of a task of its role."""
    with psycopg.connect(worker_url, autocommit=True, row_factory=dict_row) as w:
        _enqueue(w, "store_discovery", None, {"platform": "dutchie", "region": "az"})
        listing = _claim(w, "store_discovery")
        listed = w.execute(
            query("upsert_listed_stores"),
            {**listing, "stores": Jsonb([{"id": "dir-1", "name": "One", "region": "az"}])},
        ).fetchall()
        store = listed[0]["dispensary_id"]
        assert (
            w.execute(query("store_entry_point"), {"dispensary_id": store}).fetchone()["directory_id"]
            == "dir-1"
        )

        _enqueue(w, "entry_point_discovery", store)
        entry = _claim(w, "entry_point_discovery")
        w.execute(query("save_entry_point"), {**entry, "platform_id": "pid-1", "menu_url": "/menu/1"})
        assert conn.execute(
            "SELECT d.platform_dispensary_id, c.menu_url FROM dispensaries d "
            "JOIN store_crawl_state c ON c.dispensary_id = d.id WHERE d.id = %s",
            (store,),
        ).fetchone() == ("pid-1", "/menu/1")
        task = _enqueue(w, "product_discovery", store)
        assert w.execute("SELECT complete_task(%(task_id)s, %(lease)s, '{}')", entry).fetchone()[
            "complete_task"
        ]

        crawl = _claim(w, "product_discovery")
        assert crawl["task_id"] == task
        products = normalise_menu(
            [{"id": "A", "name": "A", "category": "flower", "price": 10, "in_stock": True}]
        )
        stored = w.execute(
            query("store_menu"), {**crawl, "menu_hash": menu_hash(products), "products": Jsonb(products)}
        ).fetchone()
        assert (stored["seen"], stored["new"]) == (1, 1)

        w.execute(query("mark_store_gone"), crawl)
        assert conn.execute("SELECT crawl_enabled FROM dispensaries WHERE id = %s", (store,)).fetchone() == (
            False,
        )
        # A store that resolves again is crawled again.
        assert w.execute("SELECT complete_task(%(task_id)s, %(lease)s, '{}')", crawl).fetchone()[
            "complete_task"
        ]
        _enqueue(w, "entry_point_discovery", store)
        entry = _claim(w, "entry_point_discovery")
        w.execute(query("save_entry_point"), {**entry, "platform_id": "pid-1", "menu_url": "/menu/1"})
        assert conn.execute("SELECT crawl_enabled FROM dispensaries WHERE id = %s", (store,)).fetchone() == (
            True,
        )

        assert w.execute(query("refresh_store_analytics")).fetchone()["stores"] == 1
        assert w.execute(query("analytics_summary")).fetchone()["stores"] == 1

        # Under a lease that is not the task's: refused, in words, and nothing written.
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not held under this lease"):
            w.execute(
                query("save_entry_point"),
                {**entry, "lease": uuid.uuid4(), "platform_id": "pid-2", "menu_url": "/menu/2"},
            )
        assert conn.execute(
            "SELECT platform_dispensary_id FROM dispensaries WHERE id = %s", (store,)
        ).fetchone() == ("pid-1",)

        w.execute("SELECT complete_task(%(task_id)s, %(lease)s, '{}')", entry)
        conn.execute("UPDATE worker_tasks SET status = 'completed' WHERE id = %s", (task,))
        ids = w.execute("SELECT id FROM enqueue_demo_resyncs() AS id")
        assert ids.rowcount == 1


def test_task_still_owned_locks_the_task_until_the_handlers_commit(worker_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 1), 1)
    with TaskQueue.connect(worker_url) as queue:
        [task] = queue.claim_many(ROLE, "w-1", 1, start=True)
    with psycopg.connect(worker_url) as w:
        assert w.execute(
            "SELECT owned FROM task_still_owned(%s, %s)", (task.id, task.lease_token)
        ).fetchall() == [(1,)]
        # The row lock is the transaction's: a writer of the task waits (here: refused at once).
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute("SELECT 1 FROM worker_tasks WHERE id = %s FOR UPDATE NOWAIT", (task.id,))
        w.rollback()
        assert (
            w.execute("SELECT owned FROM task_still_owned(%s, %s)", (task.id, uuid.uuid4())).fetchall() == []
        )


def test_the_prune_batches_delete_only_what_is_past_their_floors(worker_url: str, conn: psycopg.Connection):
    """The prune functions are the worker's, so tq_retention's floors (7 days of tasks, 90 of the
    rollup, 1 of silent workers, 30 of product history) are all that keeps it from erasing the
    history: a younger horizon is refused, and nothing goes."""
    long_ago = datetime.now(UTC) - timedelta(days=400)
    young = datetime.now(UTC) - timedelta(hours=1)
    (store,) = add_stores(conn, 1)
    # A finished task, a rollup row, a silent worker and a history row, each just younger than
    # its floor but older than a day, and one of each long ago.
    conn.execute(
        "INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at) "
        "VALUES (%s, 'completed', %s, %s, %s), (%s, 'completed', now() - interval '6 days',"
        " now() - interval '6 days', now() - interval '6 days')",
        (ROLE, long_ago, long_ago, long_ago, ROLE),
    )
    conn.execute(
        "INSERT INTO task_completion_log (role, date, hour) VALUES (%s, %s, 1), (%s, current_date - 89, 1)",
        (ROLE, long_ago.date(), ROLE),
    )
    conn.execute(
        "INSERT INTO worker_registry (worker_id, role, started_at, last_heartbeat_at) "
        "VALUES ('gone', %s, %s, %s), ('lately', %s, %s, %s)",
        (ROLE, long_ago, long_ago, ROLE, young, young),
    )
    conn.execute(
        "INSERT INTO products (dispensary_id, external_id, name, category, price, in_stock) "
        "VALUES (%s, 'A', 'A', 'flower', 1, true)",
        (store,),
    )
    conn.execute(
        "INSERT INTO product_history (product_id, dispensary_id, observed_at, change) "
        "SELECT id, %s, t, 'new' FROM products "
        "CROSS JOIN (VALUES (%s::TIMESTAMPTZ), (now() - interval '29 days')) v (t)",
        (store, long_ago),
    )
    counts = (
        "SELECT (SELECT count(*) FROM v_tasks), (SELECT count(*) FROM task_completion_log),"
        " (SELECT count(*) FROM worker_registry), (SELECT count(*) FROM product_history)"
    )
    assert conn.execute(counts).fetchone() == (2, 2, 2, 2)
    refusals = {
        "SELECT * FROM prune_tasks(date_trunc('hour', now()) - interval '6 days', 100)": (
            "prune_tasks: before must be at least 7 days ago (tq_retention.min_tasks_days)",
            "UPDATE tq_retention SET min_tasks_days",
        ),
        "SELECT prune_completion_log(current_date - 89, 100)": (
            "prune_completion_log: before must be at least 90 days ago "
            "(tq_retention.min_completion_log_days)",
            "UPDATE tq_retention SET min_completion_log_days",
        ),
        "SELECT prune_workers(now() - interval '23 hours', 100)": (
            "prune_workers: before must be at least 1 days ago (tq_retention.min_workers_days)",
            "UPDATE tq_retention SET min_workers_days",
        ),
        "SELECT * FROM prune_product_history(0, now() - interval '29 days', 100)": (
            "prune_product_history: before must be at least 30 days ago "
            "(tq_retention.min_product_history_days)",
            "UPDATE tq_retention SET min_product_history_days",
        ),
        "SELECT prune_workers(now() - interval '7 days', 0)": (
            "limit must be from 1 to 100000",
            "batch_size",
        ),
    }
    with psycopg.connect(worker_url, autocommit=True) as w:
        for statement, (words, hint) in refusals.items():
            with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
                w.execute(statement)
            assert words in str(refused.value), statement
            assert hint in (refused.value.diag.message_hint or ""), statement
        assert conn.execute(counts).fetchone() == (2, 2, 2, 2)
        # The worker may not lower a floor itself.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            w.execute("UPDATE tq_retention SET min_tasks_days = 1")
        # At the floors, the old rows go and the young ones stay.
        assert w.execute("SELECT prune_completion_log(current_date - 90, 100)").fetchone() == (1,)
        assert w.execute(
            "SELECT deleted FROM prune_tasks(date_trunc('hour', now()) - interval '7 days', 100)"
        ).fetchone() == (1,)
        assert w.execute("SELECT prune_workers(now() - interval '1 day', 100)").fetchone() == (1,)
        deleted, _, reached_young = w.execute(
            "SELECT * FROM prune_product_history(0, now() - interval '30 days', 100)"
        ).fetchone()
        assert (deleted, reached_young) == (1, True)
    tasks, _, workers, history = conn.execute(counts).fetchone()  # type: ignore[misc]
    assert (tasks, workers, history) == (1, 1, 1)
    assert conn.execute("SELECT worker_id FROM worker_registry").fetchone() == ("lately",)
    assert conn.execute(
        "SELECT count(*) FROM task_completion_log WHERE date = current_date - 89"
    ).fetchone() == (1,)
    assert conn.execute("SELECT min_tasks_days FROM tq_retention").fetchone() == (7,)


# -- what the worker may not do -------------------------------------------------------------------

FORBIDDEN = [
    "UPDATE worker_tasks SET status = 'completed'",
    "UPDATE worker_tasks SET status = 'completed' WHERE id = (SELECT min(id) FROM worker_tasks)",
    "DELETE FROM worker_tasks",
    "INSERT INTO worker_tasks (role, status) VALUES ('product_resync', 'completed')",
    "SELECT id FROM worker_tasks FOR UPDATE",
    "TRUNCATE worker_tasks",
    "INSERT INTO worker_task_roles (role) VALUES ('rogue')",
    "UPDATE worker_task_roles SET retry_base_seconds = 0",
    "DELETE FROM worker_task_roles",
    "UPDATE tq_platforms SET max_in_flight = 10000",
    "DELETE FROM tq_platforms",
    "UPDATE dispensaries SET crawl_enabled = false",
    "DELETE FROM product_history",
    "DROP TABLE worker_tasks",
    "DROP FUNCTION claim_wait(varchar)",
    "ALTER TABLE worker_tasks ADD COLUMN rogue INTEGER",
    "ALTER TABLE worker_tasks DISABLE TRIGGER USER",
    "ALTER FUNCTION claim_wait(varchar) SECURITY INVOKER",
    "CREATE TABLE rogue (id INTEGER)",
    "CREATE FUNCTION rogue() RETURNS INTEGER AS $$ SELECT 1 $$ LANGUAGE sql",
    "CREATE VIEW rogue AS SELECT 1",
    "SELECT tq_platforms_apply(ARRAY['dutchie'], ARRAY[-5], NULL, NULL)",
    "SELECT tq_refresh_heads(NULL, NULL)",
    "SELECT tq_refresh_head(NULL, NULL)",
    "CALL tq_secure_functions()",
    "CALL tq_grant_worker(current_user)",
    "SELECT * FROM tq_migrations",
    "UPDATE tq_retention SET min_tasks_days = 1, min_completion_log_days = 1",
    "UPDATE tq_retention SET tasks_pruned_before = now()",
    "INSERT INTO tq_api (function_name) VALUES ('rogue')",
    "DELETE FROM tq_relations",
]


def test_the_worker_is_refused_every_write_by_hand(worker_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    conn.execute(
        "INSERT INTO tq_platforms (platform, max_in_flight, requests_per_second, burst) "
        "VALUES ('dutchie', 2, 1, 2)"
    )
    snapshot = (
        "SELECT (SELECT array_agg(t ORDER BY id) FROM v_tasks t),"
        " (SELECT array_agg(r ORDER BY role) FROM worker_task_roles r),"
        " (SELECT array_agg(l ORDER BY platform) FROM tq_platforms l),"
        " (SELECT array_agg(k) FROM tq_retention k)"
    )
    before = conn.execute(snapshot).fetchone()
    allowed = []
    with psycopg.connect(worker_url, autocommit=True) as w:
        for statement in FORBIDDEN:
            try:
                w.execute(statement)
                allowed.append(statement)
            except psycopg.errors.InsufficientPrivilege:
                pass
    assert allowed == []
    assert conn.execute(snapshot).fetchone() == before


def test_a_temporary_table_of_the_worker_does_not_stand_in_for_the_queues(
    worker_url: str, conn: psycopg.Connection
):
    """The pinned search_path puts pg_temp last: without it a temporary worker_task_heads would
    hide every task from the claim (or fail it)."""
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    with psycopg.connect(worker_url, autocommit=True) as w:
        w.execute("CREATE TEMPORARY TABLE worker_task_heads (LIKE public.worker_task_heads)")
        claimed = w.execute(
            query("claim_tasks"), {"role": ROLE, "worker_id": "w-1", "max_tasks": 5, "start": True}
        )
        assert len(claimed.fetchall()) == 2


# -- tq grant -------------------------------------------------------------------------------------


def test_grant_is_idempotent_and_stores_only_a_password_verifier(
    db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    role, admin = make_role("worker"), make_role("admin")
    password = "s3cret 'quoted\" $$ \\ pass"
    first = grant(db_url, worker_role=role, admin_role=admin, worker_password=password)
    conn.execute("CREATE FUNCTION later_api() RETURNS INTEGER AS $$ SELECT 1 $$ LANGUAGE sql")
    conn.execute("INSERT INTO tq_api (function_name) VALUES ('later_api')")
    # after a migration that adds a function (here the superuser's: the admin takes it over)
    second = grant(db_url, worker_role=role, admin_role=admin)
    assert f"{role}: created, LOGIN" in first and f"{role}: exists" in second
    assert not any(password in line for line in first + second)
    stored = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0]
    assert stored.startswith("SCRAM-SHA-256$") and password not in stored
    with psycopg.connect(as_role(db_url, role), autocommit=True) as w:
        assert w.execute("SELECT later_api()").fetchone() == (1,)
    privileges = conn.execute(
        "SELECT count(*) FROM information_schema.role_table_grants "
        "WHERE grantee = %s AND privilege_type <> 'SELECT'",
        (role,),
    ).fetchone()
    assert privileges == (0,)


def test_grant_refuses_roles_that_would_hold_more_than_their_job(
    db_url: str, empty_db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    owner = conninfo_to_dict(db_url).get("user") or "postgres"
    refusals = {
        "worker_role 'x' has": dict(worker_role=owner),
        "both": dict(worker_role="tq_same", admin_role="tq_same"),
        "reserved": dict(worker_role="pg_worker"),
        "at most 63 bytes": dict(worker_role="w" * 64),
        "worker_password is empty": dict(worker_role="tq_w", worker_password=""),
    }
    for message, arguments in refusals.items():
        with pytest.raises(GrantError) as refused:
            grant(db_url, **arguments)  # type: ignore[arg-type]
        assert message.replace("'x'", repr(owner)) in str(refused.value)

    member = make_role("member")
    conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(member), sql.Identifier(owner))
    )
    with pytest.raises(GrantError, match="member of"):
        grant(db_url, worker_role=member)

    with pytest.raises(GrantError, match="run tq migrate first"):
        grant(empty_db_url, worker_role=make_role("worker"))


def test_an_admin_role_owns_the_schema_migrates_and_the_worker_still_drains(
    db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    admin, worker = make_role("admin"), make_role("worker")
    done = grant(db_url, worker_role=worker, admin_role=admin)
    assert f"the queue's functions run as {admin}" in done
    owners = conn.execute(
        "SELECT relowner::REGROLE::TEXT FROM pg_class WHERE relnamespace = 'public'::REGNAMESPACE "
        "UNION SELECT proowner::REGROLE::TEXT FROM pg_proc WHERE pronamespace = 'public'::REGNAMESPACE"
    ).fetchall()
    assert owners == [(admin,)]

    # A later migration, run as the admin, ends by securing what it made; tq grant then gives it.
    later = Migration(
        "9999",
        "later",
        "CREATE FUNCTION later_api() RETURNS INTEGER AS $$ SELECT 2 $$ LANGUAGE sql;\n"
        "INSERT INTO tq_api (function_name) VALUES ('later_api');\n"
        "CALL tq_secure_functions();\n",
    )
    assert migrate(as_role(db_url, admin), [*load_migrations(), later]) == ["9999_later.sql"]
    assert unsecured(conn) == []
    # the admin runs tq grant again for the worker: no superuser needed once the roles exist
    again = grant(as_role(db_url, admin), worker_role=worker)
    assert f"{worker}: exists" in again

    add_tasks(conn, ROLE, add_stores(conn, 3), 1)
    with TaskQueue.connect(as_role(db_url, worker)) as queue:
        claimed = queue.claim_many(ROLE, "w-1", 10, start=True)
        assert queue.complete_many({t.lease: {"ok": True} for t in claimed}) == {t.id for t in claimed}
    with psycopg.connect(as_role(db_url, worker), autocommit=True) as w:
        assert w.execute("SELECT later_api()").fetchone() == (2,)
    assert status_counts(conn) == {"completed": 3}


# -- a database shared with another application ---------------------------------------------------

OTHER_APP = """
CREATE TABLE other_app_orders (id INTEGER PRIMARY KEY);
GRANT SELECT ON other_app_orders TO PUBLIC;
CREATE FUNCTION other_app_purge() RETURNS INTEGER AS $$
  WITH gone AS (DELETE FROM other_app_orders RETURNING 1) SELECT count(*)::INTEGER FROM gone
$$ LANGUAGE sql;
"""


def other_app_state(conn: psycopg.Connection) -> dict[str, Any]:
    return {
        "function": conn.execute(
            "SELECT proowner::REGROLE::TEXT, prosecdef, proconfig, proacl FROM pg_proc "
            "WHERE oid = 'other_app_purge()'::REGPROCEDURE"
        ).fetchone(),
        "table": conn.execute(
            "SELECT relowner::REGROLE::TEXT, relacl FROM pg_class WHERE oid = 'other_app_orders'::REGCLASS"
        ).fetchone(),
    }


def test_another_applications_objects_in_the_schema_are_left_alone(
    make_role: Callable[[str], str], empty_db_url: str
):
    """An adopted database: the other application's function and table, made by the superuser
    before the queue came, keep their owner, security, grants and PUBLIC's rights through the
    migrations, tq grant with an admin role, and a later tq_secure_functions."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(OTHER_APP)
        before = other_app_state(conn)
        migrate(empty_db_url)
        admin, worker = make_role("admin"), make_role("worker")
        grant(empty_db_url, worker_role=worker, admin_role=admin)
        conn.execute("CALL tq_secure_functions()")
        assert other_app_state(conn) == before
        assert before["function"][:3] == (
            conninfo_to_dict(empty_db_url).get("user") or "postgres",
            False,
            None,
        )
        # no grant to the worker on either (it may call the function through PUBLIC, with its own rights)
        held = conn.execute(
            "SELECT count(*) FROM (SELECT aclexplode(proacl) a FROM pg_proc WHERE proname = 'other_app_purge'"
            " UNION ALL SELECT aclexplode(relacl) FROM pg_class WHERE relname = 'other_app_orders') x"
            " WHERE (a).grantee = %s::REGROLE",
            (worker,),
        ).fetchone()
        assert held == (0,)
        # ... while the queue's own objects are the admin's and hardened
        assert unsecured(conn, invoker=frozenset({"other_app_purge"})) == [
            "other_app_purge(): PUBLIC may execute it"
        ]
        assert conn.execute(
            "SELECT DISTINCT relowner::REGROLE::TEXT FROM pg_class "
            "WHERE relnamespace = 'public'::REGNAMESPACE AND relname NOT LIKE 'other_app%%'"
        ).fetchall() == [(admin,)]
    # It runs with the worker's rights, which hold nothing on the other app's table but SELECT.
    with (
        psycopg.connect(as_role(empty_db_url, worker), autocommit=True) as w,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        w.execute("SELECT other_app_purge()")
    # The fixtures drop the roles after this database: hand back what the admin owns here.
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(admin)))
        for role in (admin, worker):
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))


def test_grant_refuses_a_worker_that_owns_the_database(pg_server: str, make_role: Callable[[str], str]):
    """The database's owner is a member of pg_database_owner, which owns schema public: it could
    DROP the queue's tables there."""
    worker = make_role("worker")
    name = f"tq_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as server:
        server.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(worker)))
        server.execute(
            sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(worker))
        )
    try:
        url = make_conninfo(pg_server, dbname=name)
        migrate(url)  # as the superuser: the queue's objects are not the worker's
        with pytest.raises(GrantError) as refused:
            grant(url, worker_role=worker)
        assert f"owns database {name}" in str(refused.value)
        assert "ALTER DATABASE" in str(refused.value)
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute(
                "SELECT count(*) FROM information_schema.role_table_grants WHERE grantee = %s", (worker,)
            ).fetchone() == (0,)
    finally:
        with psycopg.connect(pg_server, autocommit=True) as server:
            server.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_the_password_is_sent_as_scram_whatever_the_servers_password_encryption(
    db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    role = make_role("worker")
    grant(
        make_conninfo(db_url, options="-c password_encryption=md5"),
        worker_role=role,
        admin_role=make_role("admin"),
        worker_password="pw 1",
    )
    stored = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,)).fetchone()[0]
    assert stored.startswith("SCRAM-SHA-256$")


def test_the_helpers_behind_the_handlers_writes_are_not_the_workers(
    worker_url: str, conn: psycopg.Connection
):
    """The bodies of the handlers' writes take a store, not a lease: only their lease-checking
    API functions call them, and the worker may not."""
    (store,) = add_stores(conn, 1)
    before = conn.execute(
        "SELECT (SELECT array_agg(d) FROM dispensaries d), (SELECT array_agg(c) FROM store_crawl_state c)"
    ).fetchone()
    with psycopg.connect(worker_url, autocommit=True) as w:
        for statement in (
            "SELECT tq_mark_store_gone(%s, 'dutchie')",
            "SELECT * FROM tq_store_menu(%s, 'h', '[]')",
            "SELECT * FROM tq_upsert_listed_stores("
            "'dutchie', jsonb_build_array(jsonb_build_object('id', %s)))",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                w.execute(statement, (store,))
    after = conn.execute(
        "SELECT (SELECT array_agg(d) FROM dispensaries d), (SELECT array_agg(c) FROM store_crawl_state c)"
    ).fetchone()
    assert after == before
