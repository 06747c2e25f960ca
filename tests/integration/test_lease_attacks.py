"""Attacks on held tasks by a compromised worker (issue 15, items 2 to 4; migration 0013, lease
tokens), each run as the role `tq grant` makes, through plain SQL.

The victim is a real claim of a worker registered as 'victim': the attacker knows the task's id
and the victim's worker id (both readable in worker_tasks), not its lease token. Every attack
below succeeded on the API of 0012, fenced by the worker id the caller passes and with no role
checks. Each is now refused or does nothing, and every table the queue keeps (tasks, stores and
heads, registry, platforms, stores' rows, menus, history) reads back as it was; then the victim's
own call, with its token, still works: the refusal was the fence's, not a malformed call's.
"""

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from tests.helpers import add_stores, assert_platform_counters_consistent, assert_store_state_consistent

# The attack tests' fixtures, found by pytest where a test module imports them: the worker role
# as `tq grant` leaves it, and the roles it makes (dropped after the test). A test's parameter
# named after an imported fixture is what ruff calls a redefinition (F811): that is how pytest
# works, in this file.
# ruff: noqa: F811
from tests.integration.test_attacks import Worker, make_role, worker  # noqa: F401
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"
VICTIM = "victim"
HOSTS = ["menus.example.com"]
MAX_PAUSE = 60.0
LIMITS = [
    {
        "platform": "dutchie",
        "max_in_flight": 4,
        "requests_per_second": 10,
        "max_pause_seconds": MAX_PAUSE,
        "hosts": HOSTS,
    }
]
PRODUCT = {
    "id": "p1",
    "name": "Forged",
    "category": "flower",
    "brand": None,
    "price": 0.01,
    "thc": 99,
    "cbd": None,
    "in_stock": True,
}
LISTED = [{"id": "evil-1", "name": "Evil store", "region": "north"}]

# Every table the queue keeps (the views are made of them).
TABLES = (
    "worker_tasks",
    "worker_task_stores",
    "worker_task_heads",
    "worker_registry",
    "tq_platforms",
    "dispensaries",
    "store_crawl_state",
    "products",
    "product_history",
    "store_analytics",
    "task_completion_log",
)


def snapshot(conn: psycopg.Connection) -> dict[str, Any]:
    """Every row of every queue table, as the superuser reads it."""
    return {
        table: conn.execute(
            sql.SQL("SELECT coalesce(jsonb_agg(to_jsonb(x) ORDER BY x::TEXT), '[]') FROM {} x").format(
                sql.Identifier(table)
            )
        ).fetchone()[0]
        for table in TABLES
    }


def assert_unchanged(
    conn: psycopg.Connection, before: dict[str, Any], attack: str, *, but: tuple[str, ...] = ()
) -> None:
    """Every queue table reads as ``before`` (but the tables ``but`` names)."""
    after = snapshot(conn)
    changed = {t: (before[t], after[t]) for t in TABLES if t not in but and before[t] != after[t]}
    assert changed == {}, f"{attack} changed {sorted(changed)}: {changed}"


def load_limits(conn: psycopg.Connection) -> None:
    """As the admin: dutchie's limits and hosts (the keys sync_platform_limits reads)."""
    assert conn.execute("SELECT sync_platform_limits(%s)", (Jsonb(LIMITS),)).fetchone() == (1,)
    assert conn.execute(
        "SELECT hosts, max_pause_seconds FROM tq_platforms WHERE platform = 'dutchie'"
    ).fetchone() == (HOSTS, MAX_PAUSE)


def half_open(conn: psycopg.Connection) -> None:
    """dutchie's pause is over and no probe is out: the next claim's task is its probe."""
    conn.execute(
        "UPDATE tq_platforms SET pauses = 1, paused_until = now() - INTERVAL '1 second', "
        "pause_reason = 'HTTP 503', probe_task_id = NULL, probe_sent = false WHERE platform = 'dutchie'"
    )


def claim(w: psycopg.Connection, role: str, worker_id: str, *, start: bool = False) -> tuple[int, uuid.UUID]:
    """A real claim of one task: its id and its lease token."""
    rows = w.execute(
        "SELECT (c.task).id, c.lease FROM claim_tasks(%s, %s, 1, %s) c", (role, worker_id, start)
    ).fetchall()
    assert len(rows) == 1, rows
    task_id, lease = rows[0]
    assert isinstance(lease, uuid.UUID)
    return task_id, lease


def enqueue(w: psycopg.Connection, conn: psycopg.Connection, role: str) -> int | None:
    """A task of ``role`` (on a new dutchie store, or a dutchie listing); its store."""
    if role == "store_discovery":
        w.execute(
            "SELECT enqueue_task('store_discovery', NULL, NULL, 0, NULL, 3, %s)",
            (Jsonb({"platform": "dutchie", "region": "north"}),),
        )
        return None
    (store,) = add_stores(conn, 1)
    w.execute("SELECT enqueue_task(%s, %s)", (role, store))
    return store


@dataclass(frozen=True)
class Victim:
    task_id: int
    lease: uuid.UUID  # its live token
    stale: uuid.UUID  # the token of the task's earlier claim, given back since
    store: int | None


def victim_task(w: psycopg.Connection, conn: psycopg.Connection, role: str, *, probe: bool = False) -> Victim:
    """The victim registers, enqueues a task of ``role``, claims it, gives it back (defer), and
    claims it again, running: the first token is stale, the second live. With ``probe``, the
    platform is half-open at both claims and the victim's task, its probe, has sent its request."""
    load_limits(conn)
    w.execute("SELECT register_worker(%s, %s, 'victim-pod', 'victim-host', 30)", (VICTIM, role))
    store = enqueue(w, conn, role)
    if probe:
        half_open(conn)
    task_id, stale = claim(w, role, VICTIM)
    assert w.execute("SELECT defer_task(%s, %s, '0 seconds')", (task_id, stale)).fetchone() == (True,)
    again, lease = claim(w, role, VICTIM, start=True)
    assert again == task_id and lease != stale
    if probe:
        assert conn.execute(
            "SELECT probe_task_id FROM tq_platforms WHERE platform = 'dutchie'"
        ).fetchone() == (task_id,)
        decision = w.execute(
            "SELECT decision FROM platform_request(%s, %s, true)", (task_id, lease)
        ).fetchone()
        assert decision == ("probe",)
    return Victim(task_id, lease, stale, store)


# -- 1. a forged, missing or stale lease does nothing (issue 15, item 2) ---------------------------

REFUSED = object()  # the call raises 42501, "task N is not held under this lease"


@dataclass(frozen=True)
class Call:
    statement: str  # %(id)s, %(lease)s (a UUID or NULL), %(menu)s, %(stores)s
    nothing: Any  # its answer to a lease it does not hold, or REFUSED
    was: str  # what the attacker did with it on 0012's API
    role: str = ROLE
    probe: bool = False


CALLS = {
    "start_task": Call(
        "SELECT start_task(%(id)s, %(lease)s::UUID)",
        False,
        "marked the victim's task running and refreshed its heartbeat (its lease kept alive)",
    ),
    "start_tasks": Call(
        "SELECT start_tasks(ARRAY[%(id)s]::INTEGER[], ARRAY[%(lease)s::UUID])",
        [],
        "marked the victim's task running and refreshed its heartbeat",
    ),
    "heartbeat_tasks": Call(
        "SELECT heartbeat_tasks('victim', ARRAY[%(id)s]::INTEGER[], ARRAY[%(lease)s::UUID])",
        [],
        "kept the lease of a dead victim alive: its task never went back to the queue",
    ),
    "complete_task": Call(
        """SELECT complete_task(%(id)s, %(lease)s::UUID, '{"stolen": true}')""",
        False,
        "completed the victim's task with a forged result (its work lost, the store's crawl skipped)",
    ),
    "complete_task_tx": Call(
        """SELECT complete_task_tx(%(id)s, %(lease)s::UUID, '{"stolen": true}')""",
        False,
        "completed the victim's task with a forged result",
    ),
    "complete_tasks": Call(
        "SELECT complete_tasks(ARRAY[%(id)s]::INTEGER[], ARRAY[%(lease)s::UUID], "
        """ARRAY['{"stolen": true}']::JSONB[])""",
        [],
        "completed the victim's task with a forged result",
    ),
    "complete_tasks_timed": Call(
        "SELECT complete_tasks_timed(ARRAY[%(id)s]::INTEGER[], ARRAY[%(lease)s::UUID], "
        """ARRAY['{"stolen": true}']::JSONB[], ARRAY[0.0]::FLOAT8[], ARRAY[86400.0]::FLOAT8[])""",
        [],
        "completed the victim's task with a forged result and a forged duration",
    ),
    "fail_task": Call(
        "SELECT fail_task(%(id)s, %(lease)s::UUID, 'sabotaged', false)",
        None,
        "failed the victim's task for good, with the attacker's error message",
    ),
    "defer_task": Call(
        "SELECT defer_task(%(id)s, %(lease)s::UUID, '1 day')",
        False,
        "took the task from the victim and pushed it a day away, no retry spent",
    ),
    "task_still_owned": Call(
        "SELECT count(*) FROM task_still_owned(%(id)s, %(lease)s::UUID)",
        0,
        "locked the victim's task (FOR SHARE), holding off its recovery and its other writers",
    ),
    "platform_request": Call(
        "SELECT decision, wait_seconds FROM platform_request(%(id)s, %(lease)s::UUID, false)",
        ("lost", 0.0),
        "took starts from the platform's rate in the victim's name (tq_platforms.tat pushed on)",
    ),
    "platform_release": Call(
        "SELECT platform_release(%(id)s, %(lease)s::UUID)",
        False,
        "gave back the victim's platform slot while its requests ran: one more task in flight than "
        "max_in_flight",
    ),
    "platform_error": Call(
        "SELECT paused, wait_seconds FROM platform_error(%(id)s, %(lease)s::UUID, 'HTTP 503', '1 day')",
        (False, 0.0),
        "paused the victim's platform for a day, for every worker",
    ),
    "platform_answered": Call(
        "SELECT platform_answered(%(id)s, %(lease)s::UUID)",
        False,
        "reopened a half-open platform for every worker, without its probe's answer",
        probe=True,
    ),
    "store_menu": Call(
        "SELECT * FROM store_menu(%(id)s, %(lease)s::UUID, 'forged', %(menu)s)",
        REFUSED,
        "wrote a forged menu for the victim's store (products and their history)",
    ),
    "mark_store_gone": Call(
        "SELECT mark_store_gone(%(id)s, %(lease)s::UUID)",
        REFUSED,
        "switched the victim's store off: no more crawls until a listing named it again",
    ),
    "save_entry_point": Call(
        "SELECT save_entry_point(%(id)s, %(lease)s::UUID, 'evil-pid', '/menus/evil')",
        REFUSED,
        "pointed the victim's store at another menu",
        role="entry_point_discovery",
    ),
    "upsert_listed_stores": Call(
        "SELECT * FROM upsert_listed_stores(%(id)s, %(lease)s::UUID, %(stores)s)",
        REFUSED,
        "added stores, and their entry_point_discovery tasks, to the victim's platform",
        role="store_discovery",
    ),
}


def outcome(w: psycopg.Connection, call: Call, task_id: int, lease: uuid.UUID | None) -> Any:
    """What ``call`` answers for (task_id, lease); REFUSED when it raised 42501."""
    params = {"id": task_id, "lease": lease, "menu": Jsonb([PRODUCT]), "stores": Jsonb(LISTED)}
    try:
        rows = w.execute(call.statement, params).fetchall()
    except psycopg.errors.InsufficientPrivilege as error:
        assert f"task {task_id} is not held under this lease" in str(error), str(error)
        return REFUSED
    if call.nothing is REFUSED:
        return rows
    (row,) = rows
    return row[0] if len(row) == 1 else tuple(row)


@pytest.mark.parametrize("function", list(CALLS))
def test_a_forged_missing_or_stale_lease_does_nothing(
    worker: Worker, conn: psycopg.Connection, function: str
):
    """Issue 15, item 2 (lease tokens): the attacker calls ``function`` on the victim's task with a
    random token, with none (NULL), and with the token of the task's earlier claim (given back,
    claimed again since). Was (the worker id was the fence, and the attacker knows it): see
    CALLS[function].was, e.g. complete_task completed the victim's task with a forged result."""
    call = CALLS[function]
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, call.role, probe=call.probe)
        before = snapshot(conn)
        for name, lease in (("forged", uuid.uuid4()), ("missing", None), ("stale", v.stale)):
            got = outcome(attacker, call, v.task_id, lease)
            assert got == call.nothing, f"{function} with a {name} lease answered {got!r}; was: {call.was}"
            but: tuple[str, ...] = ()
            assert_unchanged(conn, before, f"{function} with a {name} lease", but=but)
        assert_platform_counters_consistent(conn)
        assert_store_state_consistent(conn)

        # The same call, with the victim's token, acts: the refusals were the lease's.
        got = outcome(victim, call, v.task_id, v.lease)
        assert got is not REFUSED and got != call.nothing, (function, got)
        if function == "platform_request":
            assert got[0] == "go"


def test_the_lease_hash_the_worker_reads_is_no_token(worker: Worker, conn: psycopg.Connection):
    """Issue 15, item 2: what the worker can read of the victim's lease. worker_tasks.lease_hash
    (the worker may SELECT worker_tasks) is the token's SHA-256: presented as a token, in any
    shape a UUID takes from it, it holds nothing. The token itself is nowhere the worker reads:
    not in a table or view granted to it, not in pg_stat_activity's text of the victim's calls
    (sent as parameters). Was: the fence was worker_tasks.worker_id, readable by every worker."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        # The victim's last call carried its token: its text is what pg_stat_activity keeps.
        assert victim.execute("SELECT start_task(%s, %s)", (v.task_id, v.lease)).fetchone() == (True,)
        before = snapshot(conn)

        [(lease_hash, worker_id)] = attacker.execute(
            "SELECT lease_hash, worker_id FROM worker_tasks WHERE id = %s", (v.task_id,)
        ).fetchall()
        assert worker_id == VICTIM
        assert bytes(lease_hash) == hashlib.sha256(v.lease.bytes).digest()
        h = bytes(lease_hash)
        shapes = {
            "the hash's first 16 bytes": uuid.UUID(bytes=h[:16]),
            "the hash's last 16 bytes": uuid.UUID(bytes=h[16:]),
            "the stale token's hash": uuid.UUID(bytes=hashlib.sha256(v.stale.bytes).digest()[:16]),
            "the hash's first 32 hex digits": uuid.UUID(h.hex()[:32]),
        }
        for shape, token in shapes.items():
            assert token != v.lease
            for function in (
                "start_task",
                "start_tasks",
                "task_still_owned",
                "complete_task",
                "fail_task",
            ):
                call = CALLS[function]
                got = outcome(attacker, call, v.task_id, token)
                assert got == call.nothing, f"{function} with {shape} answered {got!r}"
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            attacker.execute("SELECT start_task(%s, %s::UUID)", (v.task_id, h.hex()))
        assert_unchanged(conn, before, "the lease hash presented as a token")

        # The token, in any spelling, is nowhere the worker can read.
        spellings = {str(v.lease), v.lease.hex, str(v.lease).upper(), v.lease.hex.upper()}
        readable = [
            r[0]
            for r in attacker.execute(
                "SELECT c.oid::REGCLASS::TEXT FROM pg_class c "
                "WHERE c.relnamespace = current_schema()::REGNAMESPACE AND c.relkind IN ('r', 'v', 'm', 'p') "
                "AND has_table_privilege(c.oid, 'SELECT') ORDER BY 1"
            ).fetchall()
        ]
        assert "worker_tasks" in readable and "v_task_history" in readable, readable
        for relation in readable:
            [(text,)] = attacker.execute(
                sql.SQL("SELECT coalesce(string_agg(x::TEXT, ' '), '') FROM {} x").format(
                    sql.Identifier(relation)
                )
            ).fetchall()
            assert not any(s in text for s in spellings), f"the victim's token is readable in {relation}"
        [(activity,)] = attacker.execute(
            "SELECT string_agg(query, ' ') FROM pg_stat_activity WHERE pid = %s", (victim.info.backend_pid,)
        ).fetchall()
        assert activity and "start_task" in activity, activity  # the attacker sees the call...
        assert not any(s in activity for s in spellings), activity  # ...not its token

        assert victim.execute("SELECT complete_task(%s, %s, '{}')", (v.task_id, v.lease)).fetchone() == (
            True,
        )


# -- 2. the admin's calls (issue 15, item 3) --------------------------------------------------------

ADMIN_CALLS = {
    "cancel_task": ("SELECT cancel_task(%(id)s)", "cancelled any task, the victim's in flight among them"),
    "sync_platform_limits": (
        "SELECT sync_platform_limits(%(limits)s)",
        "rewrote the fleet's limits: dutchie at 10,000 in flight and 10,000 requests a second",
    ),
    "platform_pause": (
        "SELECT platform_pause('dutchie', 86400, 'attacker')",
        "(with platform_error) paused dutchie for a day, for every worker",
    ),
    "platform_resume": (
        "SELECT platform_resume('dutchie')",
        "(with platform_answered) reopened dutchie while the admin had it paused",
    ),
    # The bodies 0013 kept as helpers: no EXECUTE, and no right on the tables they write.
    "tq_sync_limits": ("SELECT tq_sync_limits(%(limits)s)", "(as sync_platform_limits)"),
    "tq_store_menu": (
        "SELECT * FROM tq_store_menu(%(store)s, 'forged', %(menu)s)",
        "(as store_menu) a forged menu for any store",
    ),
    "tq_mark_store_gone": ("SELECT tq_mark_store_gone(%(store)s, 'dutchie')", "(as mark_store_gone)"),
    "tq_save_entry_point": (
        "SELECT tq_save_entry_point(%(store)s, 'dutchie', 'evil', 'http://10.0.0.5:8080/admin')",
        "(as save_entry_point) an entry point on any host",
    ),
    "tq_upsert_listed_stores": (
        "SELECT * FROM tq_upsert_listed_stores('dutchie', %(stores)s)",
        "(as upsert_listed_stores) new stores with no listing task",
    ),
    "tq_held_task": (
        "SELECT tq_held_task('x', %(id)s, %(lease)s, ARRAY['product_resync'])",
        "(a helper: no use to call, but not the worker's either)",
    ),
}


def test_the_admins_calls_are_denied_to_the_worker(worker: Worker, conn: psycopg.Connection):
    """Issue 15, item 3 (admin-only limits and pauses), and item 2 for cancel_task (it had no
    fence at all). Each of ADMIN_CALLS, as the worker: permission denied (42501), nothing changes,
    the victim's task and the admin's pause among it. Was: ADMIN_CALLS[name][1]."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        until = conn.execute("SELECT platform_pause('dutchie', 3600, 'by the admin')").fetchone()[0]
        before = snapshot(conn)
        params = {
            "id": v.task_id,
            "lease": uuid.uuid4(),
            "store": v.store,
            "menu": Jsonb([PRODUCT]),
            "stores": Jsonb(LISTED),
            "limits": Jsonb([{"platform": "dutchie", "max_in_flight": 10000, "requests_per_second": 10000}]),
        }
        allowed = []
        for name, (statement, was) in ADMIN_CALLS.items():
            try:
                attacker.execute(statement, params)
                allowed.append(f"{name} (was: {was})")
            except psycopg.errors.InsufficientPrivilege as error:
                assert error.sqlstate == "42501"
                assert "permission denied" in str(error), (name, str(error))
            assert_unchanged(conn, before, name)
        assert allowed == []
        assert conn.execute(
            "SELECT paused_until, max_in_flight FROM tq_platforms WHERE platform = 'dutchie'"
        ).fetchone() == (until, 4)
        # The admin may (the calls were sound).
        assert conn.execute("SELECT cancel_task(%s)", (v.task_id,)).fetchone() == (True,)
        assert conn.execute("SELECT platform_resume('dutchie')").fetchone() == (True,)


# -- 3. registrations (issue 15, item 2) ------------------------------------------------------------


def test_register_worker_over_a_live_session_is_refused_and_its_leases_stay(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 2: re-registering a live worker. The victim holds its session
    (TaskQueue.open_session, heartbeat 30 s) and a task; the attacker, on another connection,
    registers its id with a heartbeat of 0.001 s (plain and as a session), deregisters it, and
    names it dead. Was: register_worker overwrote the victim's row (heartbeat_seconds 0.001), so
    that expire_leases gave its task away after 1 s of silence instead of 75; deregister_worker
    marked it offline."""
    load_limits(conn)
    (store,) = add_stores(conn, 1)
    with TaskQueue.connect(worker.url) as queue:
        session = queue.open_session(VICTIM, ROLE, pod_name="victim-pod", heartbeat_seconds=30)
        try:
            queue.enqueue(ROLE, store)
            task = queue.claim(ROLE, VICTIM)
            assert task is not None and task.lease_token is not None
            before = snapshot(conn)
            with worker.connect() as attacker:
                for statement in (
                    "SELECT register_worker('victim', 'product_resync', 'evil-pod', 'evil-host', 0.001)",
                    "SELECT register_worker('victim', 'product_resync')",
                    "SELECT register_worker_session('victim', 'product_resync', 'evil-pod', 'evil-host', "
                    "0.001)",
                ):
                    with pytest.raises(psycopg.errors.LockNotAvailable) as error:
                        attacker.execute(statement)
                    assert error.value.sqlstate == "55P03"
                    assert "is registered and alive" in str(error.value), str(error.value)
                    assert_unchanged(conn, before, statement)
                assert attacker.execute("SELECT deregister_worker('victim')").fetchone() == (False,)
                assert attacker.execute(
                    "SELECT workers, recovered, failed FROM release_dead_workers(ARRAY['victim'])"
                ).fetchone() == (0, 0, 0)
                assert_unchanged(conn, before, "deregister_worker and release_dead_workers")
                assert conn.execute(
                    "SELECT status, heartbeat_seconds, pod_name FROM worker_registry "
                    "WHERE worker_id = 'victim'"
                ).fetchone() == ("active", 30, "victim-pod")

                # The victim's lease is 2.5 x 30 s: a second of silence does not end it, whoever asks.
                time.sleep(1.1)
                for statement in (
                    "SELECT recovered, failed FROM expire_leases(2.5, 30, 1)",
                    "SELECT recovered, failed FROM expire_leases()",
                ):
                    [(recovered, failed)] = attacker.execute(statement).fetchall()
                    assert (recovered, failed) == (0, 0), statement
                assert attacker.execute(
                    "SELECT count(*) FROM claim_tasks(%s, 'attacker', 5)", (ROLE,)
                ).fetchone() == (0,)
            assert_unchanged(conn, before, "expire_leases after the attempts")
            assert queue.complete(task, {"ok": True})
        finally:
            session.close()
    assert conn.execute("SELECT status FROM worker_registry WHERE worker_id = 'victim'").fetchone() == (
        "offline",
    )


# -- 4. the handlers' writes (issue 15, item 4) -----------------------------------------------------


def test_handler_writes_without_a_held_task_or_of_the_wrong_role_are_refused(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 4 (handler writes without a held task). The attacker holds tasks of its own
    (an entry_point_discovery, a product_resync and a store_discovery one, real claims) and
    writes with none held (the victim's task with a forged token, a pending task, NULL), or with
    one of the wrong role: refused (42501), or, a listing of 20,000 stores with the right role,
    22023; nothing written. Was: store_menu wrote a forged menu for any store, mark_store_gone
    switched any store off, save_entry_point pointed any store at any URL, upsert_listed_stores
    added 20,000 stores and their entry_point_discovery tasks, none of them with a task held."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        held = {}
        for role in ("entry_point_discovery", "product_resync", "store_discovery"):
            enqueue(attacker, conn, role)
            held[role] = claim(attacker, role, "attacker", start=True)
        (other,) = add_stores(conn, 1)
        attacker.execute("SELECT enqueue_task('product_discovery', %s)", (other,))
        [(pending,)] = conn.execute(
            "SELECT id FROM worker_tasks WHERE status = 'pending' AND dispensary_id = %s", (other,)
        ).fetchall()
        before = snapshot(conn)

        not_held = {
            "the victim's task, a forged token": (v.task_id, uuid.uuid4()),
            "the victim's task, its stale token": (v.task_id, v.stale),
            "a pending task": (pending, uuid.uuid4()),
            "no task": (None, None),
        }
        huge = Jsonb([{"id": f"s{n}", "name": f"Store {n}"} for n in range(20_000)])
        writes = {
            "store_menu": ("SELECT * FROM store_menu(%s, %s::UUID, 'forged', %s)", Jsonb([PRODUCT])),
            "mark_store_gone": ("SELECT mark_store_gone(%s, %s::UUID)", None),
            "save_entry_point": (
                "SELECT save_entry_point(%s, %s::UUID, 'evil-pid', 'https://menus.example.com/evil')",
                None,
            ),
            "upsert_listed_stores": ("SELECT * FROM upsert_listed_stores(%s, %s::UUID, %s)", huge),
        }
        wrong_role = {
            "store_menu": "entry_point_discovery",
            "mark_store_gone": "store_discovery",
            "save_entry_point": "product_resync",
            "upsert_listed_stores": "product_resync",
        }
        for function, (statement, data) in writes.items():
            attempts = dict(not_held)
            attempts[f"its own {wrong_role[function]} task"] = held[wrong_role[function]]
            for what, (task_id, lease) in attempts.items():
                args = (task_id, lease) if data is None else (task_id, lease, data)
                with pytest.raises(psycopg.errors.InsufficientPrivilege) as error:
                    attacker.execute(statement, args)
                message = str(error.value)
                if what.startswith("its own"):
                    assert f"is a {wrong_role[function]} task; only" in message, message
                else:
                    assert "is not held under this lease" in message, message
                assert_unchanged(conn, before, f"{function} with {what}")

        # The right role, and a listing of 20,000 stores: refused in words.
        task_id, lease = held["store_discovery"]
        with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
            attacker.execute("SELECT * FROM upsert_listed_stores(%s, %s, %s)", (task_id, lease, huge))
        assert "must list at most 10000 stores" in str(refused.value) and refused.value.diag.message_hint
        assert_unchanged(conn, before, "upsert_listed_stores of 20,000 stores")

        # Held and of the right role, a write goes through, on the task's own store only.
        task_id, lease = held["product_resync"]
        attacker.execute("SELECT * FROM store_menu(%s, %s, 'real', %s)", (task_id, lease, Jsonb([PRODUCT])))
        [(own,)] = conn.execute("SELECT dispensary_id FROM worker_tasks WHERE id = %s", (task_id,)).fetchall()
        assert conn.execute("SELECT dispensary_id, external_id FROM products").fetchall() == [(own, "p1")]


def refused_url(w: psycopg.Connection, task: tuple[int, uuid.UUID], url: str, secrets: list[str]) -> None:
    """save_entry_point(url) is refused with 22023, and no part of the error shows ``secrets``."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        w.execute("SELECT save_entry_point(%s, %s, 'pid-ok', %s)", (*task, url))
    error = info.value
    assert "is not on the hosts of platform 'dutchie' (menus.example.com)" in str(error), str(error)
    shown = " | ".join(
        x or ""
        for x in (
            str(error),
            error.diag.message_primary,
            error.diag.message_detail,
            error.diag.message_hint,
            error.diag.context,
        )
    )
    for secret in secrets:
        assert secret not in shown, f"the refusal of {url!r} shows {secret!r}: {shown}"


def test_save_entry_point_keeps_menu_urls_on_the_platforms_hosts(worker: Worker, conn: psycopg.Connection):
    """Issue 15, item 4: an entry point on any host. The attacker holds a real
    entry_point_discovery task of a dutchie store (hosts: menus.example.com, loaded by the admin's
    sync) and saves menu URLs on an internal host, with user info, scheme-relative, on a host that
    only begins like the platform's: refused (22023), the error showing neither the URL's path nor
    its user info, and the store's menu_url as it was. A path, or a URL on the platform's host, is
    saved. Was: any URL was saved, and the crawler fetched it (SSRF: http://10.0.0.5:8080/admin)."""
    load_limits(conn)
    with worker.connect() as attacker:
        (store,) = add_stores(conn, 1)
        attacker.execute("SELECT enqueue_task('entry_point_discovery', %s)", (store,))
        task = claim(attacker, "entry_point_discovery", "attacker", start=True)
        attacker.execute("SELECT save_entry_point(%s, %s, 'pid-ok', '/menus/0')", task)
        before = snapshot(conn)
        for url, secrets in (
            ("http://10.0.0.5:8080/admin", ["/admin", "10.0.0.5:8080/admin"]),
            ("http://user:pw@menus.example.com/x", ["user:pw", "pw@", "/x"]),
            ("http://menus.example.com:443@evil.example/x", ["evil.example/x", "/x"]),
            ("//evil.example/x", ["evil.example/x", "/x"]),
            ("/\\evil.example/x", ["evil.example/x"]),
            ("https://menus.example.com.evil.example/x", ["/x"]),
            ("https://evil.example\\@menus.example.com/x", ["/x"]),
            ("http://menus.example.com\n.evil.example/x", ["/x"]),
            ("file:///etc/passwd", ["/etc/passwd"]),
            ("menus/1", []),
        ):
            refused_url(attacker, task, url, secrets)
            assert_unchanged(conn, before, f"save_entry_point({url!r})")
        assert conn.execute(
            "SELECT menu_url FROM store_crawl_state WHERE dispensary_id = %s", (store,)
        ).fetchone() == ("/menus/0",)

        for url in (
            "/menus/1",
            "https://menus.example.com/embedded-menu/1",
            "HTTP://Menus.Example.com:8443/m?id=1",
        ):
            attacker.execute("SELECT save_entry_point(%s, %s, 'pid-ok', %s)", (*task, url))
            assert conn.execute(
                "SELECT menu_url FROM store_crawl_state WHERE dispensary_id = %s", (store,)
            ).fetchone() == (url,)
        assert conn.execute(
            "SELECT platform_dispensary_id FROM dispensaries WHERE id = %s", (store,)
        ).fetchone() == ("pid-ok",)


# -- 5. the breaker (issue 15, item 3) --------------------------------------------------------------

PLATFORM = (
    "SELECT in_flight, paused_until, pauses, probe_task_id, probe_sent, error_streak, errors_total, "
    "last_error FROM tq_platforms WHERE platform = 'dutchie'"
)


def test_platform_error_of_a_non_holder_counts_nothing_and_a_holders_pause_is_bounded(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 3: `platform_error` paused a platform for up to a day. Ten errors reported
    for the victim's task without its lease (and for a pending task, and for no task) count
    nothing: no error, no streak, no pause (pause_after_errors is 5). A holder's error with
    Retry-After of a day pauses dutchie for max_pause_seconds (60) at most. Was: any worker
    reported errors for any platform, and platform_error(p, id, e, '1 day') paused it for a day."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        enqueue(attacker, conn, ROLE)
        (other,) = add_stores(conn, 1)
        attacker.execute("SELECT enqueue_task(%s, %s)", (ROLE, other))
        [(pending,)] = conn.execute(
            "SELECT id FROM worker_tasks WHERE status = 'pending' AND dispensary_id = %s", (other,)
        ).fetchall()
        before = snapshot(conn)
        for _ in range(10):
            for task_id, lease in ((v.task_id, uuid.uuid4()), (v.task_id, v.stale), (pending, uuid.uuid4())):
                assert attacker.execute(
                    "SELECT paused, wait_seconds FROM platform_error(%s, %s, 'HTTP 503', '1 day')",
                    (task_id, lease),
                ).fetchone() == (False, 0.0)
            assert attacker.execute(
                "SELECT paused, wait_seconds FROM platform_error(NULL, NULL, 'HTTP 503', NULL)"
            ).fetchone() == (False, 0.0)
        assert_unchanged(conn, before, "platform_error without a held task")

        # A holder's own task (a real claim): its Retry-After of a day is cut to max_pause_seconds.
        task_id, lease = claim(attacker, ROLE, "attacker", start=True)
        paused, wait = attacker.execute(
            "SELECT paused, wait_seconds FROM platform_error(%s, %s, 'HTTP 429', '1 day')", (task_id, lease)
        ).fetchone()
        assert paused and 0 < wait <= MAX_PAUSE
        [(left, pauses, errors)] = conn.execute(
            "SELECT extract(EPOCH FROM paused_until - now()), pauses, errors_total FROM tq_platforms "
            "WHERE platform = 'dutchie'"
        ).fetchall()
        assert 0 < left <= MAX_PAUSE and pauses == 1 and errors == 1
        # Again, while paused: counted, the pause not pushed on.
        until = conn.execute("SELECT paused_until FROM tq_platforms WHERE platform = 'dutchie'").fetchone()
        assert attacker.execute(
            "SELECT paused FROM platform_error(%s, %s, 'HTTP 429', '1 day')", (task_id, lease)
        ).fetchone() == (True,)
        assert (
            conn.execute("SELECT paused_until FROM tq_platforms WHERE platform = 'dutchie'").fetchone()
            == until
        )
        # The victim's task is untouched by it all.
        assert conn.execute(
            "SELECT status, worker_id, retry_count, error_message FROM worker_tasks WHERE id = %s",
            (v.task_id,),
        ).fetchone() == ("running", VICTIM, 0, None)


def test_platform_answered_by_a_task_that_is_not_the_probe_leaves_the_platform_paused(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 3: `platform_answered` reopened a platform without holding its probe. The
    attacker holds a dutchie task claimed before dutchie was paused; while paused, then half-open
    with the victim's task as its probe (its request sent), the attacker's platform_answered with
    its own lease, and with the probe's id and a forged or stale lease, is false and dutchie stays
    as it was: paused, then half-open with the victim's probe. The probe's holder closes it. Was:
    platform_answered('dutchie', <any id>) reopened dutchie for every worker."""
    with worker.connect() as victim, worker.connect() as attacker:
        load_limits(conn)
        enqueue(attacker, conn, ROLE)
        mine = claim(attacker, ROLE, "attacker", start=True)

        # Paused (by the admin): nobody's answer reopens it.
        conn.execute("SELECT platform_pause('dutchie', 3600, 'HTTP 503 x 5')")
        before = snapshot(conn)
        assert attacker.execute("SELECT platform_answered(%s, %s)", mine).fetchone() == (False,)
        assert attacker.execute("SELECT decision FROM platform_request(%s, %s, false)", mine).fetchone() == (
            "paused",
        )
        assert_unchanged(conn, before, "platform_answered of a paused platform")

        # Half-open: the victim's task is the probe, its request out.
        victim.execute("SELECT register_worker(%s, %s, NULL, NULL, 30)", (VICTIM, ROLE))
        store = enqueue(victim, conn, ROLE)
        half_open(conn)
        probe_id, stale = claim(victim, ROLE, VICTIM)
        assert victim.execute("SELECT defer_task(%s, %s, '0 seconds')", (probe_id, stale)).fetchone() == (
            True,
        )
        probe_id, lease = claim(victim, ROLE, VICTIM, start=True)
        assert conn.execute(
            "SELECT dispensary_id FROM worker_tasks WHERE id = %s", (probe_id,)
        ).fetchone() == (store,)
        assert victim.execute(
            "SELECT decision FROM platform_request(%s, %s, true)", (probe_id, lease)
        ).fetchone() == ("probe",)
        state = conn.execute(PLATFORM).fetchone()
        assert state[2:5] == (1, probe_id, True), state
        before = snapshot(conn)
        for task_id, token in (mine, (probe_id, uuid.uuid4()), (probe_id, stale), (probe_id, None)):
            assert attacker.execute(
                "SELECT platform_answered(%s, %s::UUID)", (task_id, token)
            ).fetchone() == (False,)
            assert_unchanged(conn, before, f"platform_answered({task_id}) by the attacker")
        # The attacker's requests still wait: it is not the probe.
        assert attacker.execute("SELECT decision FROM platform_request(%s, %s, false)", mine).fetchone() == (
            "paused",
        )
        assert_unchanged(conn, before, "platform_request of a task that is not the probe")

        assert victim.execute("SELECT platform_answered(%s, %s)", (probe_id, lease)).fetchone() == (True,)
        assert conn.execute("SELECT pauses, paused_until, probe_task_id FROM tq_platforms").fetchone() == (
            0,
            None,
            None,
        )


# -- a worker's registry row and a refused URL's user info ---------------------------------------


def test_heartbeat_tasks_holding_nothing_leaves_the_named_workers_registry_row_alone(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 2: a heartbeat in the victim's name, with a forged token. Nothing is
    written: no lease extended, and the victim's registry row as it was (a caller that proves no
    lease does not refresh a label's row, which would keep a dead worker from going offline).
    Was: the victim's lease extended and its row refreshed."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        before = snapshot(conn)
        assert attacker.execute(
            "SELECT heartbeat_tasks('victim', ARRAY[%s]::INTEGER[], ARRAY[%s::UUID])",
            (v.task_id, uuid.uuid4()),
        ).fetchone() == ([],)
        assert_unchanged(conn, before, "heartbeat_tasks('victim', <the victim's task>, <a forged token>)")


def test_a_live_worker_registered_without_a_session_is_not_taken_over(
    worker: Worker, conn: psycopg.Connection
):
    """Issue 15, item 2: re-registering a live worker that registered without a session
    (TaskQueue.register_worker; the drain runs' workers hold one). register_worker over it is
    refused while its heartbeat is recent or it holds tasks (55P03), and deregister_worker from
    another connection leaves it alone while it holds tasks, so its id cannot be taken with a
    heartbeat of 0.001 s that would make expire_leases give its task away after 1 s of silence.
    Was: register_worker alone did it."""
    load_limits(conn)
    with worker.connect() as victim, worker.connect() as attacker:
        victim.execute("SELECT register_worker('victim', %s, NULL, NULL, 30)", (ROLE,))
        enqueue(victim, conn, ROLE)
        task_id, lease = claim(victim, ROLE, VICTIM, start=True)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            attacker.execute("SELECT register_worker('victim', %s, NULL, NULL, 0.001)", (ROLE,))

        [(deregistered,)] = attacker.execute("SELECT deregister_worker('victim')").fetchall()
        try:
            attacker.execute("SELECT register_worker('victim', %s, 'evil-pod', NULL, 0.001)", (ROLE,))
            took_over = True
        except psycopg.errors.LockNotAvailable:
            took_over = False
        time.sleep(1.1)
        [(expired,)] = attacker.execute("SELECT recovered FROM expire_leases(2.5, 30, 1)").fetchall()
        stolen = attacker.execute("SELECT count(*) FROM claim_tasks(%s, 'attacker', 1)", (ROLE,)).fetchone()
        assert (deregistered, took_over, expired, stolen) == (False, False, 0, (0,))
        assert victim.execute("SELECT complete_task(%s, %s, '{}')", (task_id, lease)).fetchone() == (True,)


def test_a_refused_menu_url_shows_no_part_of_its_user_info(worker: Worker, conn: psycopg.Connection):
    """Issue 15, item 4: the refusal of an entry point off the platform's hosts shows the URL's
    scheme and host only; a URL with user info is not shown at all, since a password with '#',
    '/' or '?' in it (as people write them, unencoded) would otherwise come out in part: the
    handler's error goes to the task's error_message, which every worker reads, and to the logs
    and alerts."""
    load_limits(conn)
    with worker.connect() as attacker:
        (store,) = add_stores(conn, 1)
        attacker.execute("SELECT enqueue_task('entry_point_discovery', %s)", (store,))
        task = claim(attacker, "entry_point_discovery", "attacker", start=True)
        before = snapshot(conn)
        for url in (
            "http://admin:s3cr#t@menus.example.com/x",
            "http://admin:s3cr/t@menus.example.com/x",
            "http://admin:s3cr?t@menus.example.com/x",
        ):
            refused_url(attacker, task, url, ["admin", "s3cr"])
            assert_unchanged(conn, before, f"save_entry_point({url!r})")


def test_a_task_holding_no_slot_is_given_no_start_beyond_its_platforms_limit(
    worker: Worker, conn: psycopg.Connection
):
    """A task's requests are counted by its slot. The attacker fills dutchie's 4 slots, gives one
    back (platform_release) or passes it on (platform_handoff), and the freed slot is claimed
    again: the platform is full. The tasks that gave their slots away are still the attacker's,
    and ask for starts, first and further: each answer is 'full', no start is taken (tat as it
    was) and the counters still say 4. Once a slot is free, a slotless task takes it with its
    start, counted, and the platform is full again. Was: 'go', a fifth request in flight."""
    with worker.connect() as attacker:
        load_limits(conn)
        for _ in range(7):
            enqueue(attacker, conn, ROLE)
        held = [claim(attacker, ROLE, "attacker", start=True) for _ in range(4)]
        released, passer = held[0], held[1]
        assert attacker.execute("SELECT platform_release(%s, %s)", released).fetchone() == (True,)
        assert attacker.execute("SELECT count(*) FROM platform_handoff(%s, %s)", passer).fetchone() == (1,)
        claim(attacker, ROLE, "attacker", start=True)
        assert conn.execute(PLATFORM).fetchone()[0] == 4
        before = snapshot(conn)
        for task in (released, passer):
            for first in (True, False):
                decision, wait = attacker.execute(
                    "SELECT decision, wait_seconds FROM platform_request(%s, %s, %s)", (*task, first)
                ).fetchone()
                assert decision == "full" and wait > 0, (task, first, decision)
                assert_unchanged(conn, before, f"platform_request of a slotless task, first={first}")

        # A slot comes back: the slotless task takes it, counted, and the next finds it full.
        assert attacker.execute("SELECT platform_release(%s, %s)", held[2]).fetchone() == (True,)
        assert attacker.execute(
            "SELECT decision FROM platform_request(%s, %s, true)", released
        ).fetchone() == ("go",)
        assert conn.execute(PLATFORM).fetchone()[0] == 4
        assert conn.execute(
            "SELECT send_at IS NOT NULL FROM worker_tasks WHERE id = %s", (released[0],)
        ).fetchone() == (True,)
        assert attacker.execute("SELECT decision FROM platform_request(%s, %s, true)", passer).fetchone() == (
            "full",
        )
        assert_platform_counters_consistent(conn)
        assert_store_state_consistent(conn)


def test_a_pass_or_a_standby_needs_both_leases_and_one_worker(worker: Worker, conn: psycopg.Connection):
    """0028: platform_pass moves a slot to a standby task, platform_standby claims one. The
    attacker holds a slot of its own and knows the victim's ids. Passing its slot to the victim's
    standby with a forged or missing token, passing the victim's slot, claiming a standby from the
    victim's task, and passing to a slotless task of another worker id (with both real tokens):
    each answers 'lost' or nothing, and every table reads back as it was; so does platform_relay
    (0031), asked for a pass or recording one sent on a relay, which skips the limits. Hoarding
    standbys stops at twice the slots held. The victim's own record of a relay then moves its
    slot."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        for _ in range(6):
            enqueue(attacker, conn, ROLE)
        [(standby_id, standby_lease)] = victim.execute(
            "SELECT (c.task).id, c.lease FROM platform_standby(%s, %s) c", (v.task_id, v.lease)
        ).fetchall()
        mine = claim(attacker, ROLE, "attacker")
        other = claim(attacker, ROLE, "attacker-2")
        assert attacker.execute("SELECT platform_release(%s, %s)", other).fetchone() == (True,)
        before = snapshot(conn)
        for frm, to in (
            (mine, (standby_id, uuid.uuid4())),
            (mine, (standby_id, None)),
            (mine, (standby_id, v.stale)),
            ((v.task_id, uuid.uuid4()), other),
            (mine, other),
        ):
            for call in (
                "platform_pass(%s, %s::UUID, %s, %s::UUID, true)",
                "platform_relay(%s, %s::UUID, %s, %s::UUID, true, false)",
                "platform_relay(%s, %s::UUID, %s, %s::UUID, true, true)",
            ):
                answer = attacker.execute(f"SELECT decision FROM {call}", (*frm, *to)).fetchone()
                assert answer == ("lost",), (call, frm, to)
                assert_unchanged(conn, before, f"{call}: {frm[0]} -> {to[0]}")
        for lease in (uuid.uuid4(), None, v.stale):
            assert attacker.execute(
                "SELECT count(*) FROM platform_standby(%s, %s::UUID)", (v.task_id, lease)
            ).fetchone() == (0,)
            assert_unchanged(conn, before, "platform_standby from the victim's task")

        # Its own standbys: fewer than twice its one slot, counting the released task of another
        # worker id not at all and its own slotless ones.
        got = [
            attacker.execute("SELECT count(*) FROM platform_standby(%s, %s)", mine).fetchone()[0]  # type: ignore[index]
            for _ in range(4)
        ]
        assert got == [1, 1, 0, 0]
        assert_platform_counters_consistent(conn)

        assert victim.execute(
            "SELECT decision FROM platform_relay(%s, %s, %s, %s, false, true)",
            (v.task_id, v.lease, standby_id, standby_lease),
        ).fetchone() == ("go",)
        assert conn.execute(
            "SELECT id FROM worker_tasks WHERE send_at IS NOT NULL AND worker_id = %s", (VICTIM,)
        ).fetchall() == [(standby_id,)]
        assert_platform_counters_consistent(conn)
        assert_store_state_consistent(conn)


def test_a_batch_pairs_each_task_with_its_own_lease_and_result(worker: Worker, conn: psycopg.Connection):
    """0036: start, heartbeat and completion find a batch's tasks by their ids and read each task's
    lease, result and times at its id's position. The attacker's own live leases, beside the
    victim's task id at every position (and the id given twice), move nothing of the victim's;
    a batch in any order starts, heartbeats and completes each of the attacker's tasks, with its
    own result."""
    with worker.connect() as victim, worker.connect() as attacker:
        v = victim_task(victim, conn, ROLE)
        attacker.execute("SELECT register_worker('attacker', %s)", (ROLE,))
        enqueue(attacker, conn, ROLE)
        enqueue(attacker, conn, ROLE)
        (a, la), (b, lb) = attacker.execute(
            "SELECT (c.task).id, c.lease FROM claim_tasks(%s, 'attacker', 2, false) c", (ROLE,)
        ).fetchall()
        victims_row = "SELECT to_jsonb(t) FROM worker_tasks t WHERE t.id = %s"
        stolen = Jsonb({"stolen": True})
        before = conn.execute(victims_row, (v.task_id,)).fetchone()

        started = attacker.execute(
            "SELECT start_tasks(%s, %s::UUID[])", ([v.task_id, b, a, v.task_id], [la, lb, la, lb])
        ).fetchone()
        beaten = attacker.execute(
            "SELECT heartbeat_tasks('attacker', %s, %s::UUID[])", ([a, v.task_id, b], [la, lb, lb])
        ).fetchone()
        done = attacker.execute(
            "SELECT complete_tasks_timed(%s, %s::UUID[], %s::JSONB[], %s, %s)",
            (
                [b, v.task_id, a, v.task_id],
                [lb, la, la, lb],
                [Jsonb({"task": "b"}), stolen, Jsonb({"task": "a"}), stolen],
                [0.0, 0.0, 0.0, 0.0],
                [0.0, 86400.0, 0.0, 86400.0],
            ),
        ).fetchone()
        assert started == beaten == done == (sorted([a, b]),)
        assert conn.execute(victims_row, (v.task_id,)).fetchone() == before
        results = conn.execute("SELECT id, result FROM worker_task_history WHERE id = ANY (%s)", ([a, b],))
        assert dict(results.fetchall()) == {a: {"task": "a"}, b: {"task": "b"}}
        assert_store_state_consistent(conn)

        # The victim's own completion, with its token, still acts.
        assert victim.execute(
            "SELECT complete_tasks(%s, %s::UUID[], %s::JSONB[])", ([v.task_id], [v.lease], [None])
        ).fetchone() == ([v.task_id],)
