"""Attacks on the queue by a compromised worker: the role `tq grant` makes, through plain SQL
(issue 15, items 1 and 5; docs/DEPLOYMENT.md, "Threat model"). Each attack is refused or
harmless, and the state afterwards says so: tables as they were, counters right, limits kept.

- a store's task takes its store's platform: enqueued with none or another, its claims keep the
  store's platform's limits (and the crawl, at the simulator's servers);
- worker_completed with a huge count, a 20 MB payload or result, 20,000 platforms in one sync;
- tq grant with a worker that could write the queue by another route, or while the queue's
  functions are a superuser's;
- ALTER ROLE on itself (PostgreSQL allows it): tq grant --check reports it, tq grant undoes it;
- holding tq migrate's lock: tq migrate gives up within its bound, naming the holder.

Roles are cluster-wide: each test makes its own and drops it at its end. 127.0.0.1 uses trust
authentication, so a URL with user=<role> connects as it.
"""

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from tests.helpers import add_stores, assert_platform_counters_consistent, assert_store_state_consistent
from tests.integration.test_crawl_politeness import drains_at_once, platforms_file
from tq_pipelines import cli
from tq_pipelines.crawl.platforms import load_platform_settings, sync_limits
from tq_pipelines.db.grant import DEFAULT_WORKER_SETTINGS, GrantError, check, grant
from tq_pipelines.db.migrate import LOCK_KEY, MigrationError, migrate
from tq_pipelines.queue.api import QueueInputError, TaskQueue
from tq_pipelines_demo.simulator import PlatformProfile, SimulatorProcess, politeness_report

ROLE = "product_resync"
MB = 1_048_576
CLAIM = "SELECT (c.task).id, c.lease FROM claim_tasks(%s, %s, %s, true) c"


# -- roles ----------------------------------------------------------------------------------------


@pytest.fixture
def make_role(pg_server: str, db_url: str) -> Iterator[Callable[[str], str]]:
    """``make_role(kind)``: a unique role name; at the end of the test, what it owns or holds in
    the test's database is given back, and the role dropped."""
    names: list[str] = []

    def make(kind: str) -> str:
        names.append(f"tq_{kind}_{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield make
    admin = conninfo_to_dict(pg_server).get("user") or "postgres"
    with psycopg.connect(db_url, autocommit=True) as conn:
        for name in reversed(names):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(
                    sql.SQL("REASSIGN OWNED BY {} TO {}").format(sql.Identifier(name), sql.Identifier(admin))
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in reversed(names):
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@dataclass(frozen=True)
class Worker:
    role: str
    url: str

    def connect(self, **kwargs: Any) -> psycopg.Connection:
        return psycopg.connect(make_conninfo(self.url, **kwargs), autocommit=True)


@pytest.fixture
def worker(db_url: str, make_role: Callable[[str], str]) -> Worker:
    """The worker role, as `tq grant --admin-role ... --worker-role ...` leaves it."""
    role = make_role("worker")
    grant(db_url, worker_role=role, admin_role=make_role("admin"))
    return Worker(role, make_conninfo(db_url, user=role))


def refused(conn: psycopg.Connection, statement: str, params: tuple = ()) -> psycopg.Error:
    """Run ``statement``, which must be refused in words (22023 with a hint); the error."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        conn.execute(statement, params)
    assert info.value.diag.message_hint, statement
    return info.value


def sync(conn: psycopg.Connection, limits: list[dict[str, Any]]) -> None:
    conn.execute("SELECT sync_platform_limits(%s)", (Jsonb(limits),))


# -- 1. a task's platform is its store's ------------------------------------------------------------

AUDIT = """
SELECT
  -- tasks in flight whose requests go to dutchie: a store's on dutchie, or a listing of dutchie
  (SELECT count(*) FROM v_tasks t LEFT JOIN dispensaries d ON d.id = t.dispensary_id
   WHERE t.status IN ('claimed', 'running')
     AND coalesce(d.menu_type, t.payload ->> 'platform') = 'dutchie') AS going,
  -- of those, the ones that hold one of dutchie's slots
  (SELECT count(*) FROM v_tasks t
   WHERE t.status IN ('claimed', 'running') AND t.platform = 'dutchie' AND t.send_at IS NOT NULL) AS holding,
  (SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie') AS in_flight
"""


def test_enqueues_with_no_or_another_platform_keep_the_stores_limits(
    worker: Worker, conn: psycopg.Connection, db_url: str
):
    """Was: `enqueue_task(role, store)` made a task of no platform, claimed without dutchie's
    max_in_flight = 1 (three dutchie stores crawled at once, tq_platforms.in_flight 0)."""
    sync(
        conn,
        [
            {"platform": "dutchie", "max_in_flight": 1, "requests_per_second": 1000, "burst": 1000},
            {"platform": "jane", "max_in_flight": 50, "requests_per_second": 1000, "burst": 1000},
        ],
    )
    a, b, c, d = add_stores(conn, 4)  # dutchie
    with worker.connect() as w:
        for statement, store, platform in (
            ("SELECT enqueue_task('product_resync', %s, %s)", c, "jane"),
            ("SELECT enqueue_task('product_resync', %s, %s)", c, "unlimited"),
            ("SELECT enqueue_task_once('product_resync', %s, %s)", d, "jane"),
        ):
            error = refused(w, statement, (store, platform))
            assert f"platform must be that of store {store}, 'dutchie'" in str(error)
            assert "Leave it out" in (error.diag.message_hint or "")
        error = refused(
            w,
            "SELECT enqueue_task('store_discovery', NULL, 'unlimited', 0, NULL, 3, %s)",
            (Jsonb({"platform": "dutchie", "region": "north"}),),
        )
        assert "platform must be the one the payload names, 'dutchie'" in str(error)
        assert conn.execute("SELECT count(*) FROM v_tasks").fetchone() == (0,)

        w.execute("SELECT enqueue_task('product_resync', %s)", (a,))  # the natural call
        w.execute("SELECT enqueue_task_once('product_resync', %s)", (b,))
        w.execute("SELECT enqueue_task('product_resync', %s, 'dutchie')", (c,))
        w.execute("SELECT enqueue_task('product_resync', %s, NULL, 5)", (d,))
        w.execute(
            "SELECT enqueue_task('store_discovery', NULL, NULL, 0, NULL, 3, %s)",
            (Jsonb({"platform": "dutchie", "region": "north"}),),
        )
    assert conn.execute(
        "SELECT role, platform, count(*) FROM v_tasks GROUP BY 1, 2 ORDER BY 1"
    ).fetchall() == [
        ("product_resync", "dutchie", 4),
        ("store_discovery", "dutchie", 1),
    ]

    # Six workers claim both roles at once, each holding what it claims for a while; after each
    # claim the worker audits what it sees (its claim committed, the others' as they are).
    samples: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def work(n: int) -> None:
        try:
            with worker.connect() as w:
                barrier.wait(timeout=30)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    ids = [
                        (r[0], r[1])
                        for role in ("product_resync", "store_discovery")
                        for r in w.execute(CLAIM, (role, f"w-{n}", 5)).fetchall()
                    ]
                    samples.append(w.execute(AUDIT).fetchone())
                    if ids:
                        time.sleep(0.1)
                        for task_id, lease in ids:
                            assert w.execute(
                                "SELECT complete_task(%s, %s, '{}')", (task_id, lease)
                            ).fetchone()
                    elif w.execute("SELECT count(*) FROM v_tasks WHERE status <> 'completed'").fetchone() == (
                        0,
                    ):
                        return
                    else:
                        time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert max(going for going, _, _ in samples) == 1, "dutchie had more tasks in flight than its limit"
    assert all(going == holding == in_flight for going, holding, in_flight in samples), samples
    assert conn.execute("SELECT status, count(*) FROM v_tasks GROUP BY 1").fetchall() == [("completed", 5)]
    assert conn.execute(AUDIT).fetchone() == (0, 0, 0)


def test_the_python_api_takes_the_stores_platform_and_refuses_another(
    worker: Worker, conn: psycopg.Connection
):
    (store,) = add_stores(conn, 1, platform="jane")
    with TaskQueue.connect(worker.url) as queue:
        task = queue.get(queue.enqueue(ROLE, store))
        assert task is not None and task.platform == "jane"
        with pytest.raises(QueueInputError) as error:
            queue.enqueue_once("product_discovery", store, platform="dutchie")
        assert error.value.sqlstate == "22023" and "must be that of store" in error.value.message
        new_id = queue.enqueue_once("product_discovery", store)
        assert new_id is not None
        task = queue.get(new_id)
        assert task is not None and task.platform == "jane"


def test_a_store_that_changes_platform_takes_its_pending_tasks_and_waits_for_its_active_one(
    worker: Worker, conn: psycopg.Connection
):
    """Not the worker's to do (it may not write dispensaries): what keeps the rule true when the
    admin moves a store, and for every writer of worker_tasks."""
    sync(
        conn, [{"platform": p, "max_in_flight": 5, "requests_per_second": 1000} for p in ("dutchie", "jane")]
    )
    moved, busy = add_stores(conn, 2)
    with worker.connect() as w:
        w.execute("SELECT enqueue_task(%s, %s)", (ROLE, busy))
        [(active, lease)] = w.execute(CLAIM, (ROLE, "w-1", 5)).fetchall()
        for role in ("product_resync", "product_discovery"):
            w.execute("SELECT enqueue_task(%s, %s)", (role, moved))

    conn.execute("UPDATE dispensaries SET menu_type = 'jane' WHERE id = %s", (moved,))
    assert conn.execute(
        "SELECT DISTINCT platform FROM v_tasks WHERE dispensary_id = %s", (moved,)
    ).fetchall() == [("jane",)]
    assert_store_state_consistent(conn)  # the heads carry the new platform

    with pytest.raises(psycopg.errors.ObjectInUse) as error:
        conn.execute("UPDATE dispensaries SET menu_type = 'jane' WHERE id = %s", (busy,))
    assert f"while its task {active} is claimed or running" in str(error.value)
    assert conn.execute("SELECT menu_type FROM dispensaries WHERE id = %s", (busy,)).fetchone() == (
        "dutchie",
    )
    assert conn.execute("SELECT platform FROM v_tasks WHERE id = %s", (active,)).fetchone() == ("dutchie",)
    assert_platform_counters_consistent(conn)

    # Anyone's SQL: no platform takes the store's, another is refused.
    conn.execute("INSERT INTO worker_tasks (role, dispensary_id) VALUES ('product_discovery', %s)", (busy,))
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute(
            "INSERT INTO worker_tasks (role, dispensary_id, platform) VALUES (%s, %s, 'jane')", (ROLE, busy)
        )
    with worker.connect() as w:
        assert w.execute("SELECT complete_task(%s, %s, '{}')", (active, lease)).fetchone() == (True,)
    conn.execute("UPDATE dispensaries SET menu_type = 'jane' WHERE id = %s", (busy,))
    assert conn.execute(
        "SELECT status, platform FROM v_tasks WHERE dispensary_id = %s ORDER BY id", (busy,)
    ).fetchall() == [("completed", "dutchie"), ("pending", "jane")]  # history keeps where it ran


# -- 5. counters, sizes, the sync ------------------------------------------------------------------


def test_worker_completed_with_a_huge_count_leaves_the_victims_count_right(
    worker: Worker, conn: psycopg.Connection
):
    """Was: worker_completed('<victim>', 2147483647 - n) made the victim's next completions fail
    with 22003 (integer out of range)."""
    stores = add_stores(conn, 3)
    with worker.connect() as victim, worker.connect() as attacker:
        victim.execute("SELECT register_worker('victim', %s, NULL, NULL, 30)", (ROLE,))
        for s in stores:
            victim.execute("SELECT enqueue_task(%s, %s)", (ROLE, s))
        held = victim.execute(CLAIM, (ROLE, "victim", 3)).fetchall()
        ids, leases = [r[0] for r in held], [r[1] for r in held]
        assert len(ids) == 3

        error = refused(attacker, "SELECT worker_completed('victim', %s)", (2**31 - 1 - 2,))
        assert "count must be between 0 and 100000" in str(error)
        assert conn.execute(
            "SELECT tasks_completed FROM v_workers WHERE worker_id = 'victim'"
        ).fetchone() == (0,)

        # A count near INTEGER's end, as years of completions would make it: no longer a wall.
        conn.execute(
            "UPDATE worker_registry SET tasks_completed = %s WHERE worker_id = 'victim'", (2**31 - 2,)
        )
        assert victim.execute("SELECT complete_task(%s, %s, '{}')", held[0]).fetchone() == (True,)
        assert victim.execute(
            "SELECT complete_tasks(%s, %s, %s::JSONB[])", (ids[1:], leases[1:], ["{}", "{}"])
        ).fetchone() == (sorted(ids[1:]),)
    assert conn.execute("SELECT tasks_completed FROM v_workers WHERE worker_id = 'victim'").fetchone() == (
        2**31 - 2 + 3,
    )
    assert conn.execute("SELECT status, count(*) FROM v_tasks GROUP BY 1").fetchall() == [("completed", 3)]


def test_payloads_and_results_over_1_mb_are_refused_in_words(worker: Worker, conn: psycopg.Connection):
    """Was: a 20 MB payload or result was stored."""
    huge = Jsonb({"blob": "x" * 20_000_000})
    with worker.connect() as w:
        for statement in (
            "SELECT enqueue_task('analytics_refresh', NULL, NULL, 0, NULL, 3, %s)",
            "SELECT enqueue_task_once('analytics_refresh', NULL, NULL, 0, NULL, %s)",
        ):
            error = refused(w, statement, (huge,))
            assert "payload must be at most 1 MB (1048576 bytes), got 200000" in str(error)
        assert conn.execute("SELECT count(*) FROM v_tasks").fetchone() == (0,)

        w.execute("SELECT enqueue_task('analytics_refresh') FROM generate_series(1, 2)")
        (first, first_lease), (second, second_lease) = sorted(
            w.execute(CLAIM, ("analytics_refresh", "w-1", 2)).fetchall()
        )
        for statement, params in (
            ("SELECT complete_task(%s, %s, %s)", (first, first_lease, huge)),
            ("SELECT complete_task_tx(%s, %s, %s)", (first, first_lease, huge)),
            ("SELECT complete_tasks(%s, %s, %s)", ([first], [first_lease], [huge])),
        ):
            error = refused(w, statement, params)
            assert "result must be at most 1 MB (1048576 bytes), got 200000" in str(error), statement
        assert conn.execute("SELECT status, result FROM v_tasks WHERE id = %s", (first,)).fetchone() == (
            "running",
            None,
        )
        # Under the cap, as before.
        assert w.execute(
            "SELECT complete_task(%s, %s, %s)", (first, first_lease, Jsonb({"blob": "y" * (MB - 1000)}))
        ).fetchone() == (True,)
        # A 20 MB error text is harmless: kept to its first 8192 characters, the cut marked.
        assert w.execute(
            "SELECT fail_task(%s, %s, %s, false, NULL)", (second, second_lease, "e" * 20_000_000)
        ).fetchone() == ("failed",)
    [(length, tail)] = conn.execute(
        "SELECT length(error_message), right(error_message, 40) FROM v_tasks WHERE id = %s", (second,)
    ).fetchall()
    assert length == 8192 and tail.endswith("[... cut: 19,991,808 more characters]")


def test_a_sync_is_the_admins_and_one_of_20000_platforms_is_refused(worker: Worker, conn: psycopg.Connection):
    """Was: any worker rewrote the fleet's limits (max_in_flight 10000), and 20,000 platforms in
    one sync were taken. Now the worker may not sync at all; the admin's sync is capped."""
    sync(conn, [{"platform": "dutchie", "max_in_flight": 2, "requests_per_second": 5}])
    snapshot = "SELECT array_agg(l ORDER BY platform) FROM tq_platforms l"
    before = conn.execute(snapshot).fetchone()
    many = [{"platform": f"p{n}", "max_in_flight": 1, "requests_per_second": 1} for n in range(20_000)]
    with worker.connect() as w:
        for limits in (many, [{"platform": "dutchie", "max_in_flight": 10_000, "requests_per_second": 5}]):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                w.execute("SELECT sync_platform_limits(%s)", (Jsonb(limits),))
    assert conn.execute(snapshot).fetchone() == before
    error = refused(conn, "SELECT sync_platform_limits(%s)", (Jsonb(many),))
    assert "limits must list at most 1000 platforms, got 20000 platforms" in str(error)
    assert conn.execute(snapshot).fetchone() == before
    # Nor do syncs add up past it.
    sync(conn, many[:999])
    error = refused(conn, "SELECT sync_platform_limits(%s)", (Jsonb(many[999:1001]),))
    assert "at most 1000 platforms with limits" in str(error)
    assert conn.execute("SELECT count(*) FROM tq_platforms").fetchone() == (1000,)


# -- 5. the role itself ------------------------------------------------------------------------------


def no_rights(conn: psycopg.Connection, role: str) -> bool:
    """The role holds nothing on the queue: no table grant, no function it may call."""
    grants = conn.execute(
        "SELECT count(*) FROM information_schema.role_table_grants WHERE grantee = %s", (role,)
    ).fetchone()
    callable_ = conn.execute(
        "SELECT has_function_privilege(%s, 'claim_tasks(varchar, varchar, integer, boolean)', 'EXECUTE')",
        (role,),
    ).fetchone()
    return grants == (0,) and callable_ == (False,)


ROUTES = {
    # name: (setup statements, {w} the worker, {h} a helper role; what the refusal names)
    "pg_write_all_data": (
        ["CREATE ROLE {w} LOGIN", "GRANT pg_write_all_data TO {w}"],
        "member of pg_write_all_data",
    ),
    "pg_execute_server_program": (
        ["CREATE ROLE {w} LOGIN", "GRANT pg_execute_server_program TO {w}"],
        "member of pg_execute_server_program",
    ),
    "dml-on-worker_tasks": (
        [
            "CREATE ROLE {h} NOLOGIN",
            "GRANT INSERT, UPDATE ON worker_tasks TO {h}",
            "CREATE ROLE {w} LOGIN IN ROLE {h}",
        ],
        "through {h} may INSERT, UPDATE 1 of the queue's tables directly (worker_tasks)",
    ),
    "set-role-to-update-tq_retention": (
        [
            "CREATE ROLE {h} NOLOGIN",
            "GRANT UPDATE (min_tasks_days) ON tq_retention TO {h}",
            "CREATE ROLE {w} LOGIN NOINHERIT IN ROLE {h}",
        ],
        "through {h} may UPDATE 1 of the queue's tables directly (tq_retention)",
    ),
    "public-delete": (
        ["CREATE ROLE {w} LOGIN", "GRANT DELETE ON worker_tasks TO PUBLIC"],
        "may DELETE 1 of the queue's tables directly (worker_tasks)",
    ),
    "create-in-schema": (
        [
            "CREATE ROLE {h} NOLOGIN",
            "GRANT CREATE ON SCHEMA public TO {h}",
            "CREATE ROLE {w} LOGIN IN ROLE {h}",
        ],
        "may CREATE in schema public",
    ),
    "member-of-createrole": (
        ["CREATE ROLE {h} NOLOGIN CREATEROLE", "CREATE ROLE {w} LOGIN IN ROLE {h}"],
        "through {h} has CREATEROLE",
    ),
}


@pytest.mark.parametrize("route", ROUTES)
def test_grant_refuses_a_worker_that_could_write_the_queue_by_another_route(
    route: str, db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    """Was: accepted ("write 0 tables directly"), and that worker could lower the prune floors."""
    statements, named = ROUTES[route]
    names = {"w": make_role("worker"), "h": make_role("helper")}
    for statement in statements:
        conn.execute(statement.format(**names))
    if route == "set-role-to-update-tq_retention":
        # The route is real: NOINHERIT holds nothing itself, yet SET ROLE lowers a floor.
        with psycopg.connect(make_conninfo(db_url, user=names["w"])) as w:
            w.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(names["h"])))
            assert w.execute("UPDATE tq_retention SET min_tasks_days = 1").rowcount == 1
            w.rollback()
    admin = make_role("admin")
    with pytest.raises(GrantError) as error:
        grant(db_url, worker_role=names["w"], admin_role=admin)
    assert named.format(**names) in str(error.value)
    assert "outside its functions" in str(error.value)
    assert no_rights(conn, names["w"])
    # One transaction: the admin role it would have made is not there either.
    assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (admin,)).fetchone() is None
    assert conn.execute("SELECT min_tasks_days FROM tq_retention").fetchone() == (7,)


def test_grant_refuses_while_the_queues_functions_run_as_a_superuser(
    db_url: str, conn: psycopg.Connection, make_role: Callable[[str], str]
):
    role = make_role("worker")
    with pytest.raises(GrantError) as error:
        grant(db_url, worker_role=role)  # migrated by the superuser: its functions are its own
    assert "a superuser" in str(error.value) and "--admin-role" in str(error.value)
    assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None
    grant(db_url, worker_role=role, admin_role=make_role("admin"))
    assert not no_rights(conn, role)


def role_settings(conn: psycopg.Connection, role: str) -> dict[tuple[bool, str], str]:
    rows = conn.execute(
        "SELECT s.setdatabase <> 0, c FROM pg_db_role_setting s, unnest(s.setconfig) c "
        "WHERE s.setrole = %s::REGROLE",
        (role,),
    ).fetchall()
    return {(here, c.split("=", 1)[0]): c.split("=", 1)[1] for here, c in rows}


def test_a_worker_that_sets_its_own_settings_is_reported_and_put_back(
    worker: Worker,
    conn: psycopg.Connection,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    """PostgreSQL lets every role ALTER ROLE itself (its password and its settings): a worker can
    lock out or make read-only every pod that logs in as it. tq grant sets its timeouts in the
    queue's database (which also override the worker's own for every database), `tq grant --check`
    reports what differs, and tq grant puts it back."""
    database = conninfo_to_dict(db_url)["dbname"]
    assert role_settings(conn, worker.role) == {(True, k): v for k, v in DEFAULT_WORKER_SETTINGS.items()}
    with worker.connect() as w:
        assert w.execute("SHOW lock_timeout").fetchone() == ("30s",)
        assert w.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1min",)
        # What PostgreSQL allows a role to do to itself: no grant takes it away.
        w.execute("ALTER ROLE CURRENT_USER SET statement_timeout = '1ms'")
        w.execute(
            sql.SQL("ALTER ROLE CURRENT_USER IN DATABASE {} SET default_transaction_read_only = on").format(
                sql.Identifier(database)
            )
        )
    with worker.connect() as w:
        # statement_timeout: this database's setting wins over the one for every database.
        assert w.execute("SHOW statement_timeout").fetchone() == ("5min",)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            w.execute("SELECT enqueue_task('analytics_refresh')")

    findings = check(db_url, worker_role=worker.role)
    assert (
        f"{worker.role}: statement_timeout is 1ms for every database (tq grant sets none there)" in findings
    )
    read_only = f"default_transaction_read_only is on in database {database} (tq grant sets none there)"
    assert f"{worker.role}: {read_only}" in findings
    assert len(findings) == 2, findings

    monkeypatch.setenv("TQ_DATABASE_URL", db_url)
    assert cli.main(["grant", "--worker-role", worker.role, "--check"]) == 1
    out = capsys.readouterr()
    assert "default_transaction_read_only is on" in out.out and "2 difference(s)" in out.err
    # A timeout the operator chose differently is a difference too.
    assert any(
        "statement_timeout is 5min in database" in f
        for f in check(db_url, worker_role=worker.role, settings={"statement_timeout": "10min"})
    )

    assert cli.main(["grant", "--worker-role", worker.role]) == 0
    assert "default_transaction_read_only = on in database" in capsys.readouterr().out
    assert check(db_url, worker_role=worker.role) == []
    assert cli.main(["grant", "--worker-role", worker.role, "--check"]) == 0
    assert role_settings(conn, worker.role) == {(True, k): v for k, v in DEFAULT_WORKER_SETTINGS.items()}
    with worker.connect() as w:
        w.execute("SELECT enqueue_task('analytics_refresh')")
        assert len(w.execute(CLAIM, ("analytics_refresh", "w-1", 1)).fetchall()) == 1


def test_a_held_migration_lock_makes_tq_migrate_give_up_naming_the_holder(
    worker: Worker, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """Was: `tq migrate` waited for the lock with no bound and no word."""
    with worker.connect(application_name="squatter") as w:
        w.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        pid = w.info.backend_pid
        outcome: list[BaseException | list[str]] = []
        started = time.monotonic()
        thread = threading.Thread(target=lambda: outcome.append(_migrate(db_url, 1.0)))
        thread.start()
        thread.join(timeout=20)
        assert not thread.is_alive(), "tq migrate did not give up"
        assert time.monotonic() - started < 5
        [error] = outcome
        assert isinstance(error, MigrationError)
        for named in (f"pid {pid}", f"user {worker.role}", "application 'squatter'", "gave up after 1 s"):
            assert named in str(error), str(error)

        monkeypatch.setenv("TQ_DATABASE_URL", db_url)
        assert cli.main(["migrate", "--lock-wait-seconds", "1"]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("tq migrate: gave up after 1 s") and f"pid {pid}" in err and err.count("\n") == 1
        )
    # Let go, the next migrator goes through at once.
    assert migrate(db_url, lock_wait_seconds=5) == []


def _migrate(url: str, wait: float) -> BaseException | list[str]:
    try:
        return migrate(url, lock_wait_seconds=wait)
    except BaseException as exc:
        return exc


# -- the crawl ----------------------------------------------------------------------------------------

LIMITS = {"max_in_flight": 2, "requests_per_second": 20, "burst": 2}


def test_a_crawl_of_tasks_enqueued_with_no_wrong_or_right_platform_keeps_the_limits_at_the_servers(
    worker: Worker, conn: psycopg.Connection, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Three drain runs at once, as the worker, each with its own HTTP client; the simulator's
    servers count what arrives: never more than max_in_flight at once. The admin loads the
    limits (the deploy step, `tq platforms --sync`); the worker's runs work with them."""
    for name in ("TQ_PLATFORMS_FILE", "TQ_HANDLERS", "TQ_ROLE_CAPS", "TQ_ALERT_WEBHOOK_URL"):
        monkeypatch.delenv(name, raising=False)
    common = {"stores": 12, "latency_ms": 120, "jitter": 0.3, "change_seconds": 86_400, "seed": 5}
    sim = SimulatorProcess([PlatformProfile(name, **common) for name in ("dutchie", "jane")])
    try:
        path = platforms_file(
            tmp_path, sim, {n: {**LIMITS, "timeout_seconds": 5} for n in ("dutchie", "jane")}
        )
        other = {"dutchie": "jane", "jane": "dutchie"}
        with TaskQueue.connect(db_url) as admin:
            assert sync_limits(admin, load_platform_settings(path)) == 2
        with TaskQueue.connect(worker.url) as queue:
            n = 0
            for name, platform in sim.platforms.items():
                for s in platform.stores.values():
                    [store] = conn.execute(
                        "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id) "
                        "VALUES (%s, %s, %s) RETURNING id",
                        (s.name, name, s.platform_id),
                    ).fetchone()
                    if n % 3 == 1:  # the wrong platform: refused; the store is queued with none
                        with pytest.raises(QueueInputError):
                            queue.enqueue("product_discovery", store, platform=other[name])
                    queue.enqueue("product_discovery", store, platform=name if n % 3 == 2 else None)
                    n += 1
        drains_at_once(worker.url, path, 3, concurrency=4, batch_size=1)
        for name, platform in sim.platforms.items():
            log = platform.request_log()
            report = politeness_report(log, **LIMITS)
            assert report["requests"] == 12, (name, report)
            assert report["max_in_flight"] <= LIMITS["max_in_flight"], (name, report)
            assert report["over_in_flight"] == 0, (name, report)
    finally:
        sim.stop()
    assert conn.execute("SELECT status, count(*) FROM v_tasks GROUP BY 1").fetchall() == [("completed", 24)]
