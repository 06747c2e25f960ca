"""The queue's SQL API through TaskQueue (and raw SQL where a caller would use it): claiming,
ordering, fencing, retries, the worker registry, daily resync generation, the hourly rollup,
the views, and the per-store state the triggers keep."""

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.queue.api import Lease, QueueInputError, TaskQueue

ROLE = "product_resync"


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT now()").fetchone()[0]


def row(conn: psycopg.Connection, task_id: int) -> dict[str, Any]:
    """The whole task row, for before/after comparisons."""
    return conn.execute("SELECT to_jsonb(t) FROM v_tasks t WHERE id = %s", (task_id,)).fetchone()[0]


def insert_task(
    conn: psycopg.Connection, role: str = ROLE, dispensary_id: int | None = None, **cols: Any
) -> int:
    """One task with explicit columns (status, priority, scheduled_for, created_at, ...)."""
    cols = {"role": role, "dispensary_id": dispensary_id, **cols}
    names = ", ".join(cols)
    marks = ", ".join(f"%({c})s" for c in cols)
    (task_id,) = conn.execute(
        f"INSERT INTO worker_tasks ({names}) VALUES ({marks}) RETURNING id", cols
    ).fetchone()
    return task_id


def heads(conn: psycopg.Connection, dispensary_id: int) -> list[tuple]:
    return conn.execute(
        "SELECT role, priority FROM worker_task_heads WHERE dispensary_id = %s ORDER BY role",
        (dispensary_id,),
    ).fetchall()


# ------------------------------------------------------------------------------------------------
# 074 defect 5: concurrent claims never trip the unique index; defect 6: an empty claim is empty.
# ------------------------------------------------------------------------------------------------


CLAIM_ONE = "SELECT (c.task).id, (c.task).dispensary_id, c.lease FROM claim_tasks('product_resync', %s, 1) c"


@pytest.mark.parametrize(
    ("stores", "call"),
    [
        pytest.param(2, CLAIM_ONE, id="claim_tasks"),
        pytest.param(
            2,
            "SELECT (c.task).id, (c.task).dispensary_id, c.lease"
            " FROM claim_tasks('product_resync', %s, 1, true) c",
            id="claim_tasks-start",
        ),
        # What claim_task (dropped in 0013) returned, a whole row, now with its lease beside it.
        pytest.param(
            2,
            "SELECT ((c).task).id, ((c).task).dispensary_id, (c).lease"
            " FROM claim_tasks('product_resync', %s, 1) c",
            id="claim_tasks-whole-row",
        ),
        pytest.param(1, CLAIM_ONE, id="one-store"),
    ],
)
def test_074_defect_5_open_transactions_claim_different_stores_without_unique_violation(
    db_url: str, conn: psycopg.Connection, stores: int, call: str
):
    """Two transactions claiming at once, neither committed: each gets a task of its own store
    (or nothing when the only store is taken); no unique violation, no waiting."""
    store_ids = add_stores(conn, stores)
    add_tasks(conn, ROLE, store_ids, 2)
    with psycopg.connect(db_url) as a, psycopg.connect(db_url) as b:
        for c in (a, b):
            # A claim that waited on the other transaction's lock would fail here, not hang.
            c.execute("SET lock_timeout = '5s'")
        got_a = [r for r in a.execute(call, ("wA",)).fetchall() if r[0] is not None]
        got_b = [r for r in b.execute(call, ("wB",)).fetchall() if r[0] is not None]
        assert len(got_a) == 1
        assert got_a[0][2] is not None  # each claimed task comes with its lease token
        if stores == 2:
            assert len(got_b) == 1
            assert got_a[0][1] != got_b[0][1]
            assert got_b[0][2] is not None and got_b[0][2] != got_a[0][2]
        else:
            assert got_b == []
        a.commit()
        b.commit()
    active = conn.execute(
        "SELECT worker_id, dispensary_id FROM v_tasks WHERE status IN ('claimed', 'running') ORDER BY 1"
    ).fetchall()
    assert [w for w, _ in active] == (["wA", "wB"] if stores == 2 else ["wA"])
    assert_store_state_consistent(conn)


@pytest.mark.parametrize("setup", ["empty", "future-only", "store-busy"])
def test_074_defect_6_empty_claim_returns_nothing(conn: psycopg.Connection, queue: TaskQueue, setup: str):
    """Nothing due: claim is None, claim_many is [], claim_tasks has no row (and so no lease)."""
    if setup != "empty":
        (store,) = add_stores(conn, 1)
        if setup == "future-only":
            queue.enqueue(ROLE, store, scheduled_for=db_now(conn) + timedelta(hours=1))
            queue.enqueue(ROLE, None, scheduled_for=db_now(conn) + timedelta(hours=1))
        else:
            add_tasks(conn, ROLE, [store], 2)
            assert queue.claim(ROLE, "holder") is not None
    before = status_counts(conn)
    assert queue.claim(ROLE, "w") is None
    assert queue.claim_many(ROLE, "w", 10) == []
    assert queue.claim_many(ROLE, "w", 10, start=True) == []
    assert conn.execute("SELECT count(*) FROM claim_tasks('product_resync', 'w', 5)").fetchone() == (0,)
    assert conn.execute(
        "SELECT (SELECT c.lease FROM claim_tasks('product_resync', 'w', 1) c) IS NULL"
    ).fetchone() == (True,)
    assert status_counts(conn) == before
    assert_store_state_consistent(conn)


# ------------------------------------------------------------------------------------------------
# Claim order and per-store exclusion
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["claim_many", "claim-one-by-one"])
def test_claim_order_is_priority_desc_then_oldest_due(conn: psycopg.Connection, queue: TaskQueue, how: str):
    """Across stores: higher priority first, then the task due earliest."""
    stores = add_stores(conn, 5)
    now = db_now(conn)
    spec = [  # (priority, due minutes ago)
        (0, 60),
        (5, 10),
        (5, 30),
        (0, 120),
        (10, 1),
    ]
    ids = [
        insert_task(conn, dispensary_id=s, priority=p, scheduled_for=now - timedelta(minutes=m))
        for s, (p, m) in zip(stores, spec, strict=True)
    ]
    expected = [ids[4], ids[2], ids[1], ids[3], ids[0]]
    if how == "claim_many":
        got = [t.id for t in queue.claim_many(ROLE, "w", 10)]
    else:
        got = []
        while (t := queue.claim(ROLE, f"w{len(got)}")) is not None:
            got.append(t.id)
    assert got == expected


def test_claim_takes_one_task_per_store_the_stores_best(conn: psycopg.Connection, queue: TaskQueue):
    """A claim of many takes at most one task per store, and that store's best due task."""
    a, b = add_stores(conn, 2)
    now = db_now(conn)
    insert_task(conn, dispensary_id=a, priority=0, scheduled_for=now - timedelta(hours=2))
    best_a = insert_task(conn, dispensary_id=a, priority=3, scheduled_for=now - timedelta(minutes=5))
    insert_task(conn, dispensary_id=a, priority=1, scheduled_for=now - timedelta(hours=1))
    insert_task(conn, dispensary_id=a, priority=9, scheduled_for=now + timedelta(hours=1))  # not due
    best_b = insert_task(conn, dispensary_id=b, priority=0, scheduled_for=now - timedelta(hours=3))
    insert_task(conn, dispensary_id=b, priority=0, scheduled_for=now - timedelta(hours=1))
    got = queue.claim_many(ROLE, "w", 10)
    assert [t.id for t in got] == [best_a, best_b]
    # Both stores are busy now: nothing more, whatever is left.
    assert queue.claim_many(ROLE, "w2", 10) == []
    assert_store_state_consistent(conn)


@pytest.mark.parametrize("other_role", [ROLE, "product_discovery"])
def test_store_with_active_task_yields_nothing(conn: psycopg.Connection, queue: TaskQueue, other_role: str):
    """While a store has a claimed task, none of its other due tasks (any role) is claimable."""
    busy, idle = add_stores(conn, 2)
    held = queue.enqueue(ROLE, busy)
    holder = queue.claim(ROLE, "holder")
    assert holder.id == held
    waiting = queue.enqueue(other_role, busy, priority=100)
    assert queue.claim(other_role, "w") is None
    other = queue.enqueue(other_role, idle)
    assert [t.id for t in queue.claim_many(other_role, "w", 10)] == [other]
    assert queue.complete(holder, {"ok": True})
    assert queue.claim(other_role, "w").id == waiting


def test_future_scheduled_tasks_are_not_claimed(conn: psycopg.Connection, queue: TaskQueue):
    """Tasks scheduled in the future (with or without a store) wait; due ones are claimed."""
    a, b = add_stores(conn, 2)
    later = db_now(conn) + timedelta(minutes=5)
    queue.enqueue(ROLE, a, scheduled_for=later, priority=10)
    queue.enqueue(ROLE, None, scheduled_for=later, priority=10)
    due = queue.enqueue(ROLE, b)
    assert [t.id for t in queue.claim_many(ROLE, "w", 10)] == [due]
    assert queue.claim_many(ROLE, "w", 10) == []
    assert status_counts(conn) == {"pending": 2, "claimed": 1}


def test_storeless_tasks_are_claimed_and_mixed_by_priority(conn: psycopg.Connection, queue: TaskQueue):
    """Tasks without a store are claimable, several per claim, in one priority/due order with
    store tasks of the same role."""
    a, b = add_stores(conn, 2)
    now = db_now(conn)
    s10 = insert_task(conn, dispensary_id=a, priority=10, scheduled_for=now - timedelta(minutes=1))
    l5 = insert_task(conn, priority=5, scheduled_for=now - timedelta(minutes=1))
    l0_old = insert_task(conn, priority=0, scheduled_for=now - timedelta(hours=2))
    s0 = insert_task(conn, dispensary_id=b, priority=0, scheduled_for=now - timedelta(hours=1))
    l0_new = insert_task(conn, priority=0, scheduled_for=now - timedelta(minutes=30))
    assert queue.claim(ROLE, "w1").id == s10
    rest = queue.claim_many(ROLE, "w2", 10)
    assert [t.id for t in rest] == [l5, l0_old, s0, l0_new]
    assert all(t.status == "claimed" and t.worker_id == "w2" for t in rest)
    # analytics_refresh is store-less by nature.
    ids = [queue.enqueue("analytics_refresh") for _ in range(3)]
    assert sorted(t.id for t in queue.claim_many("analytics_refresh", "w3", 10)) == ids


@pytest.mark.parametrize("case", ["future-high-priority", "same-priority-later-due"])
def test_claim_ranks_stores_by_the_task_it_actually_takes(
    conn: psycopg.Connection, queue: TaskQueue, case: str
):
    """claim returns the best due task of the role, whatever other tasks its store holds.
    (Regression: a store's head once mixed the max priority and the earliest due time of
    different tasks.)"""
    a, b = add_stores(conn, 2)
    now = db_now(conn)
    if case == "future-high-priority":
        # Store a: a priority-10 task due tomorrow and a priority-0 task due now.
        insert_task(conn, dispensary_id=a, priority=10, scheduled_for=now + timedelta(days=1))
        insert_task(conn, dispensary_id=a, priority=0, scheduled_for=now - timedelta(hours=1))
        best = insert_task(conn, dispensary_id=b, priority=5, scheduled_for=now - timedelta(hours=1))
    else:
        # Store a: priority 10 due 1 min ago, priority 0 due 3 h ago; store b: priority 10 due 1 h ago.
        insert_task(conn, dispensary_id=a, priority=10, scheduled_for=now - timedelta(minutes=1))
        insert_task(conn, dispensary_id=a, priority=0, scheduled_for=now - timedelta(hours=3))
        best = insert_task(conn, dispensary_id=b, priority=10, scheduled_for=now - timedelta(hours=1))
    assert queue.claim(ROLE, "w").id == best


def test_task_coming_due_overtakes_in_claim_order(conn: psycopg.Connection, queue: TaskQueue):
    """Once a store's high-priority task comes due (with no write in between), it is claimed
    ahead of other stores' lower-priority work."""
    a, b = add_stores(conn, 2)
    now = db_now(conn)
    soon = now + timedelta(seconds=0.5)
    insert_task(conn, dispensary_id=a, priority=0, scheduled_for=now - timedelta(hours=1))
    high = insert_task(conn, dispensary_id=a, priority=10, scheduled_for=soon)
    mid = insert_task(conn, dispensary_id=b, priority=5, scheduled_for=now - timedelta(hours=1))
    while db_now(conn) <= soon:
        time.sleep(0.05)
    assert queue.claim(ROLE, "w1").id == high
    assert queue.claim(ROLE, "w2").id == mid


@pytest.mark.parametrize("make_stale", ["cancel", "reschedule", "reprioritise"])
def test_changed_task_does_not_hide_other_stores_due_work(
    conn: psycopg.Connection, queue: TaskQueue, make_stale: str
):
    """A store whose best task was cancelled, rescheduled or demoted must not make a claim come
    back empty or out of order while another store has better due work. (Regression: stale
    heads once used up the claim's LIMIT.)"""
    a, b = add_stores(conn, 2)
    gone = queue.enqueue(ROLE, a, priority=10)
    other = queue.enqueue(ROLE, b, priority=5)
    if make_stale == "cancel":
        assert queue.cancel(gone)
    elif make_stale == "reschedule":
        conn.execute(
            "UPDATE worker_tasks SET scheduled_for = now() + interval '1 hour' WHERE id = %s", (gone,)
        )
    else:
        conn.execute("UPDATE worker_tasks SET priority = 0 WHERE id = %s", (gone,))
    task = queue.claim(ROLE, "w")
    assert task is not None and task.id == other
    assert_store_state_consistent(conn)


@pytest.mark.parametrize(
    "deleted",
    [
        1,
        3,
    ],
)
def test_deleted_pending_tasks_do_not_hide_other_stores_due_work(
    conn: psycopg.Connection, queue: TaskQueue, deleted: int
):
    """Pending tasks removed by a raw DELETE (an admin purge) must not make a claim come back
    empty while another store has due work."""
    stores = add_stores(conn, deleted + 2)
    ids = [queue.enqueue(ROLE, s, priority=100 - n) for n, s in enumerate(stores)]
    conn.execute("DELETE FROM worker_tasks WHERE id = ANY(%s)", (ids[:deleted],))
    task = queue.claim(ROLE, "w")
    assert task is not None and task.id == ids[deleted]
    assert [t.id for t in queue.claim_many(ROLE, "w2", 5)] == [ids[deleted + 1]]


# ------------------------------------------------------------------------------------------------
# Fencing: a worker acts on a task only while it owns it.
# ------------------------------------------------------------------------------------------------


def test_other_worker_cannot_start_complete_fail_or_heartbeat(conn: psycopg.Connection, queue: TaskQueue):
    """start/complete/fail/defer/heartbeat with a lease the task's claim did not hand out refuse
    and change nothing."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    queue.register_worker("intruder", ROLE)
    owner = queue.claim(ROLE, "owner")
    assert owner.id == task_id
    before = row(conn, task_id)
    registry_before = conn.execute("SELECT tasks_completed, tasks_failed FROM v_workers").fetchall()
    intruder = Lease(task_id, uuid.uuid4())  # the task's id, with a token of the intruder's own
    assert queue.start(intruder) is False
    assert queue.start_many([intruder]) == set()
    assert queue.heartbeat("intruder", [intruder]) == set()
    assert queue.complete(intruder, {"stolen": True}) is False
    assert queue.complete_many({intruder: {"stolen": True}}) == set()
    assert queue.fail(intruder, "boom") is None
    assert queue.fail(intruder, "boom", retryable=False) is None
    assert queue.defer(intruder, 60) is False
    assert row(conn, task_id) == before
    assert conn.execute("SELECT tasks_completed, tasks_failed FROM v_workers").fetchall() == registry_before
    # The owner still can.
    assert queue.start(owner) is True
    assert queue.heartbeat("owner", [owner]) == {task_id}
    assert queue.complete(owner, {"by": "owner"}) is True
    assert queue.get(task_id).result == {"by": "owner"}


def test_cancel_takes_the_task_from_its_owner(conn: psycopg.Connection, queue: TaskQueue):
    """After cancel_task the owner's heartbeat no longer returns the id and every other call is refused."""
    a, b = add_stores(conn, 2)
    running = queue.enqueue(ROLE, a)
    claimed = queue.enqueue(ROLE, b)
    got = {t.id: t for t in queue.claim_many(ROLE, "owner", 2)}
    assert set(got) == {running, claimed}
    assert queue.start(got[running])
    assert queue.cancel(running) and queue.cancel(claimed)
    assert queue.heartbeat("owner", [got[running], got[claimed]]) == set()
    assert queue.complete(got[running], {"late": True}) is False
    assert queue.complete_many({got[claimed].lease: 1}) == set()
    assert queue.fail(got[running], "late") is None
    assert queue.start(got[claimed]) is False
    for task_id in (running, claimed):
        t = queue.get(task_id)
        assert (t.status, t.result) == ("cancelled", None)
    # The stores are free again.
    assert_store_state_consistent(conn)
    assert conn.execute(
        "SELECT count(*) FROM worker_task_stores WHERE active_task_id IS NOT NULL"
    ).fetchone() == (0,)


@pytest.mark.parametrize("final", ["completed", "failed", "cancelled"])
def test_cancel_of_finished_task_is_refused(conn: psycopg.Connection, queue: TaskQueue, final: str):
    """cancel_task returns false for a finished task and leaves it as it was."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    task = queue.claim(ROLE, "w")
    assert task.id == task_id
    if final == "completed":
        assert queue.complete(task, {"n": 1})
    elif final == "failed":
        assert queue.fail(task, "bad", retryable=False) == "failed"
    else:
        assert queue.cancel(task_id)
    before = row(conn, task_id)
    assert queue.cancel(task_id) is False
    assert row(conn, task_id) == before


def test_complete_tasks_completes_only_owned_ids(conn: psycopg.Connection, queue: TaskQueue):
    """complete_tasks returns exactly the ids the caller held; the others (another's, or not
    claimed at all, under tokens of the caller's own) are untouched."""
    stores = add_stores(conn, 4)
    ids = [queue.enqueue(ROLE, s) for s in stores]
    held = queue.claim_many(ROLE, "wA", 2)
    mine = {t.id for t in held}
    theirs = queue.claim(ROLE, "wB").id
    (pending,) = set(ids) - mine - {theirs}
    queue.register_worker("wA", ROLE)
    leases = [t.lease for t in held] + [Lease(i, uuid.uuid4()) for i in (theirs, pending)]
    done = queue.complete_many({x: {"id": x.task_id} for x in leases})
    assert done == mine
    assert queue.get(theirs).status == "claimed" and queue.get(theirs).result is None
    assert queue.get(pending).status == "pending"
    assert all(queue.get(i).result == {"id": i} for i in mine)
    assert conn.execute("SELECT tasks_completed FROM v_workers WHERE worker_id = 'wA'").fetchone() == (2,)


def test_complete_tasks_with_mismatched_arrays_is_refused(conn: psycopg.Connection, queue: TaskQueue):
    """Task ids and results of different lengths: an input error naming both counts, nothing completed."""
    stores = add_stores(conn, 2)
    ids = [queue.enqueue(ROLE, s) for s in stores]
    tasks = sorted(queue.claim_many(ROLE, "w", 2), key=lambda t: t.id)
    assert [t.id for t in tasks] == sorted(ids)
    ids, leases = [t.id for t in tasks], [t.lease_token for t in tasks]
    with pytest.raises(QueueInputError, match="2 task ids, 1 results"):
        # The SQL statement TaskQueue.complete_many_json sends, with one result short.
        queue._one("complete_tasks", {"task_ids": ids, "leases": leases, "results": ['{"a": 1}']})
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT complete_tasks(%s, %s, ARRAY['{}']::jsonb[])", (ids, leases))
    assert status_counts(conn) == {"claimed": 2}


# ------------------------------------------------------------------------------------------------
# Bad inputs are refused clearly and leave the queue working.
# ------------------------------------------------------------------------------------------------

BAD_CALLS: list[tuple[str, Callable[[TaskQueue], object], str]] = [
    ("claim-unknown-role", lambda q: q.claim("bogus_role", "w"), "bogus_role"),
    ("claim_many-unknown-role", lambda q: q.claim_many("bogus_role", "w", 5, start=True), "bogus_role"),
    ("register-unknown-role", lambda q: q.register_worker("w", "bogus_role"), "bogus_role"),
    ("max_tasks-0", lambda q: q.claim_many(ROLE, "w", 0), "max_tasks"),
    ("max_tasks-negative", lambda q: q.claim_many(ROLE, "w", -1), "max_tasks"),
    ("max_tasks-1001", lambda q: q.claim_many(ROLE, "w", 1001), "max_tasks"),
    ("claim-empty-worker", lambda q: q.claim(ROLE, ""), "worker_id"),
    ("claim-blank-worker", lambda q: q.claim_many(ROLE, "   ", 3), "worker_id"),
    ("register-empty-worker", lambda q: q.register_worker("", ROLE), "worker_id"),
    ("recover-threshold-0", lambda q: q.recover_stale(0), "stale_threshold_minutes"),
    ("recover-threshold-negative", lambda q: q.recover_stale(-5), "stale_threshold_minutes"),
    ("refresh-hour-24", lambda q: q.refresh_completion_log(date(2024, 5, 1), 24), "hour"),
    ("refresh-hour-negative", lambda q: q.refresh_completion_log(date(2024, 5, 1), -1), "hour"),
    ("enqueue-unknown-role", lambda q: q.enqueue("bogus_role"), "bogus_role"),
    ("enqueue-unknown-role-with-store", lambda q: q.enqueue("bogus_role", 1, priority=9), "bogus_role"),
    ("enqueue-unknown-store", lambda q: q.enqueue(ROLE, 999_999), "dispensary"),
]


def _queue_state(conn: psycopg.Connection) -> tuple:
    return (
        conn.execute("SELECT to_jsonb(t) FROM v_tasks t ORDER BY id").fetchall(),
        conn.execute("SELECT to_jsonb(w) FROM worker_registry w ORDER BY id").fetchall(),
        conn.execute("SELECT count(*) FROM task_completion_log").fetchall(),
        conn.execute("SELECT * FROM worker_task_heads ORDER BY 1, 2").fetchall(),
        conn.execute("SELECT * FROM worker_task_stores ORDER BY 1").fetchall(),
    )


@pytest.mark.parametrize(("call", "named"), [pytest.param(c, n, id=i) for i, c, n in BAD_CALLS])
def test_bad_input_is_refused_and_queue_still_works(
    conn: psycopg.Connection, queue: TaskQueue, call: Callable[[TaskQueue], object], named: str
):
    """A refused argument raises QueueInputError naming it, changes nothing, and the next valid
    claim succeeds."""
    stores = add_stores(conn, 2)
    add_tasks(conn, ROLE, stores, 2)
    assert queue.claim(ROLE, "holder") is not None
    before = _queue_state(conn)
    with pytest.raises(QueueInputError, match=named):
        call(queue)
    assert _queue_state(conn) == before
    assert queue.claim(ROLE, "w") is not None  # the store the holder does not hold
    assert_store_state_consistent(conn)


# ------------------------------------------------------------------------------------------------
# 074 defect 7: fail_task backs off and counts; the registry tells the truth.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "cap", "retry_count"),
    [
        pytest.param(None, None, 0, id="default-first-retry"),
        pytest.param(None, None, 2, id="default-third-retry"),
        pytest.param(100, 150, 3, id="capped"),
        pytest.param(7, 3600, 1, id="custom-base"),
    ],
)
def test_074_defect_7_fail_task_backs_off_exponentially_with_jitter(
    conn: psycopg.Connection, queue: TaskQueue, base: int | None, cap: int | None, retry_count: int
):
    """A retryable failure puts the task back to pending, retry_count + 1, scheduled for
    now + [50%, 100%] of min(base * 2^retry_count, cap); not claimable until then."""
    if base is not None:
        conn.execute(
            "UPDATE worker_task_roles SET retry_base_seconds = %s, retry_cap_seconds = %s WHERE role = %s",
            (base, cap, ROLE),
        )
    base_s, cap_s = conn.execute(
        "SELECT retry_base_seconds, retry_cap_seconds FROM worker_task_roles WHERE role = %s", (ROLE,)
    ).fetchone()
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store, max_retries=5)
    conn.execute("UPDATE worker_tasks SET retry_count = %s WHERE id = %s", (retry_count, task_id))
    (task,) = queue.claim_many(ROLE, "w", 1, start=True)
    assert task.id == task_id
    with conn.transaction():  # one transaction: now() is the now() fail_task saw
        (status,) = conn.execute(
            "SELECT fail_task(%s, %s, 'timeout talking to menu')", (task_id, task.lease_token)
        ).fetchone()
        now = db_now(conn)
    assert status == "pending"
    t = queue.get(task_id)
    delay = timedelta(seconds=min(base_s * 2**retry_count, cap_s))
    assert now + delay / 2 <= t.scheduled_for <= now + delay
    assert t.retry_count == retry_count + 1
    assert (t.worker_id, t.claimed_at, t.started_at, t.last_heartbeat_at) == (None, None, None, None)
    assert t.error_message == "timeout talking to menu"
    assert queue.claim(ROLE, "w2") is None
    conn.execute(
        "UPDATE worker_tasks SET scheduled_for = now() - interval '1 second' WHERE id = %s", (task_id,)
    )
    assert queue.claim(ROLE, "w2").id == task_id
    assert_store_state_consistent(conn)


def test_074_defect_7_fail_task_fails_after_max_retries_and_at_once_when_not_retryable(
    conn: psycopg.Connection, queue: TaskQueue
):
    """Retryable failures retry max_retries times, then fail; a non-retryable one fails at once."""
    a, b = add_stores(conn, 2)
    flaky = queue.enqueue(ROLE, a, max_retries=2)
    statuses = []
    for _ in range(3):
        conn.execute(
            "UPDATE worker_tasks SET scheduled_for = now() - interval '1 second' WHERE id = %s", (flaky,)
        )
        task = queue.claim(ROLE, "w")
        assert task.id == flaky
        statuses.append(queue.fail(task, "flaky"))
    assert statuses == ["pending", "pending", "failed"]
    t = queue.get(flaky)
    assert (t.status, t.retry_count, t.error_message) == ("failed", 2, "flaky")
    assert t.completed_at is not None
    broken = queue.enqueue(ROLE, b, max_retries=3)
    task = queue.claim(ROLE, "w")
    assert task.id == broken
    assert queue.fail(task, "404: store gone", retryable=False) == "failed"
    t = queue.get(broken)
    assert (t.status, t.retry_count, t.error_message) == ("failed", 0, "404: store gone")
    assert queue.claim(ROLE, "w") is None
    assert_store_state_consistent(conn)


def test_retry_jitter_spreads_tasks_that_failed_together(conn: psycopg.Connection, queue: TaskQueue):
    """Tasks failing in the same instant do not all come back at the same instant."""
    stores = add_stores(conn, 20)
    add_tasks(conn, ROLE, stores, 1)
    tasks = queue.claim_many(ROLE, "w", 20)
    assert len(tasks) == 20
    with conn.transaction():
        for t in tasks:
            conn.execute("SELECT fail_task(%s, %s, 'rate limited')", (t.id, t.lease_token))
    times = conn.execute("SELECT count(DISTINCT scheduled_for) FROM v_tasks").fetchone()[0]
    assert times > 1


def test_074_defect_7_worker_registry_tracks_counts_and_status(conn: psycopg.Connection, queue: TaskQueue):
    """register -> active; heartbeat with tasks -> active, without -> idle (with only leases it
    lost: unchanged); complete/fail count; deregister -> offline (once)."""

    def reg(worker_id: str) -> tuple:
        return conn.execute(
            "SELECT status, tasks_completed, tasks_failed FROM v_workers WHERE worker_id = %s",
            (worker_id,),
        ).fetchone()

    stores = add_stores(conn, 4)
    ids = [queue.enqueue(ROLE, s, max_retries=1) for s in stores]
    queue.register_worker("w", ROLE, pod_name="pod-1", hostname="host-1")
    assert reg("w") == ("active", 0, 0)
    assert queue.heartbeat("w", []) == set()
    assert reg("w") == ("idle", 0, 0)
    got = queue.claim_many(ROLE, "w", 4)
    assert sorted(t.id for t in got) == ids
    assert queue.heartbeat("w", got) == set(ids)
    assert reg("w") == ("active", 0, 0)
    assert queue.complete(got[0], None)
    assert queue.complete_many({got[1].lease: [1, 2]}) == {got[1].id}
    assert queue.fail(got[2], "retry me") == "pending"
    assert queue.fail(got[3], "give up", retryable=False) == "failed"
    assert reg("w") == ("active", 2, 2)
    # Leases it no longer holds prove nothing: the registry row is left as it was.
    assert queue.heartbeat("w", got) == set()
    assert reg("w") == ("active", 2, 2)
    # Holding nothing, it is idle.
    assert queue.heartbeat("w", []) == set()
    assert reg("w") == ("idle", 2, 2)
    assert queue.deregister_worker("w") is True
    assert reg("w") == ("offline", 2, 2)
    assert queue.deregister_worker("w") is False
    # Registering again revives the row and keeps its history.
    queue.register_worker("w", "analytics_refresh")
    assert reg("w") == ("active", 2, 2)
    assert conn.execute("SELECT role, pod_name FROM worker_registry WHERE worker_id = 'w'").fetchone() == (
        "analytics_refresh",
        None,
    )


# ------------------------------------------------------------------------------------------------
# 074 defect 2: generate_resync_tasks
# ------------------------------------------------------------------------------------------------

DAY = date(2024, 3, 10)  # a DST change in America/Los_Angeles


def resync_schedule(conn: psycopg.Connection) -> list[tuple[int, datetime, str]]:
    return conn.execute(
        """
        SELECT dispensary_id, scheduled_for AT TIME ZONE 'UTC', platform
        FROM v_tasks WHERE role = 'product_resync' ORDER BY dispensary_id
        """
    ).fetchall()


def test_074_defect_2_generate_resync_is_idempotent_per_store_and_date(
    conn: psycopg.Connection, queue: TaskQueue
):
    """A second call for the same date creates nothing; another date gets its own tasks."""
    add_stores(conn, 10)
    assert queue.generate_resync(day=DAY) == 10
    assert queue.generate_resync(day=DAY) == 0
    assert queue.generate_resync(day=DAY, batches_per_day=12) == 0
    assert queue.generate_resync(day=DAY + timedelta(days=1)) == 10
    per_day = conn.execute("SELECT resync_date, count(*) FROM v_tasks GROUP BY 1 ORDER BY 1").fetchall()
    assert per_day == [(DAY, 10), (DAY + timedelta(days=1), 10)]
    # A new store joining later gets its task on the next call, the others are not duplicated.
    add_stores(conn, 1)
    assert queue.generate_resync(day=DAY) == 1
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE resync_date = %s", (DAY,)).fetchone() == (11,)


def test_074_defect_2_concurrent_generate_resync_creates_each_task_once(
    db_url: str, conn: psycopg.Connection
):
    """Two connections generating the same day at the same time: one set of tasks in total."""
    stores = 40
    add_stores(conn, stores)
    results: list[int] = []
    errors: list[BaseException] = []
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as second:
        # The first call holds its uncommitted rows; the second must wait for it, then add nothing.
        results.append(first.execute("SELECT generate_resync_tasks(6, %s)", (DAY,)).fetchone()[0])
        second_pid = second.info.backend_pid

        def call() -> None:
            try:
                second.execute("SET lock_timeout = '20s'")
                results.append(second.execute("SELECT generate_resync_tasks(6, %s)", (DAY,)).fetchone()[0])
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            waiting = conn.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (second_pid,)
            ).fetchone()
            if waiting and waiting[0]:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the second call never waited for the first")
        first.commit()
        thread.join()
    assert errors == []
    assert results == [stores, 0]
    assert conn.execute("SELECT count(*), count(DISTINCT dispensary_id) FROM v_tasks").fetchone() == (
        stores,
        stores,
    )
    assert_store_state_consistent(conn)


def test_074_defect_2_racing_threads_generate_resync_once(db_url: str, conn: psycopg.Connection):
    """Several threads calling generate_resync_tasks for the same day at once: rows == stores."""
    stores = 60
    add_stores(conn, stores)
    barrier = threading.Barrier(4)
    created: list[int] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                barrier.wait()
                created.append(c.execute("SELECT generate_resync_tasks(12, %s)", (DAY,)).fetchone()[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(created) == stores
    assert conn.execute("SELECT count(*) FROM v_tasks").fetchone() == (stores,)


@pytest.mark.parametrize(
    ("stores", "batches"),
    [(6, 6), (12, 12), (13, 6), (3, 6), (50, 24), (7, 5), (5, 1)],
)
def test_074_defect_2_generate_resync_spreads_batches_evenly_over_the_utc_day(
    conn: psycopg.Connection, queue: TaskQueue, stores: int, batches: int
):
    """Batches open on the grid midnight UTC + k * 24h/batches within that day, their tasks a
    millisecond apart; every slot is used when there are enough stores (else no two stores share
    one); slot sizes differ by at most one."""
    add_stores(conn, stores)
    assert queue.generate_resync(day=DAY, batches_per_day=batches) == stores
    midnight = datetime(DAY.year, DAY.month, DAY.day)
    step = timedelta(hours=24) / batches
    grid = [midnight + k * step for k in range(batches)]
    schedule = [t for _, t, _ in resync_schedule(conn)]
    opening = {t.replace(microsecond=0) for t in schedule}
    for start in opening:
        in_batch = sorted(t for t in schedule if t.replace(microsecond=0) == start)
        assert in_batch == [start + timedelta(milliseconds=k) for k in range(len(in_batch))]
    times = Counter(t.replace(microsecond=0) for t in schedule)
    assert set(times) <= set(grid)
    if stores >= batches:
        assert set(times) == set(grid)
        assert max(times.values()) - min(times.values()) <= 1
    else:
        assert len(times) == stores
    if (stores, batches) == (6, 6):
        assert sorted(t.hour for t in times) == [0, 4, 8, 12, 16, 20]
    if (stores, batches) == (12, 12):
        assert sorted(t.hour for t in times) == list(range(0, 24, 2))


def test_074_defect_2_generate_resync_ignores_session_timezone(conn: psycopg.Connection):
    """The same call under UTC, America/Los_Angeles and Asia/Kolkata schedules the same UTC instants."""
    add_stores(conn, 12)
    schedules = {}
    for tz in ("UTC", "America/Los_Angeles", "Asia/Kolkata"):
        conn.execute("DELETE FROM worker_tasks")
        conn.execute("SELECT set_config('TimeZone', %s, false)", (tz,))
        assert conn.execute("SELECT generate_resync_tasks(6, %s)", (DAY,)).fetchone() == (12,)
        schedules[tz] = resync_schedule(conn)
    assert schedules["America/Los_Angeles"] == schedules["UTC"]
    assert schedules["Asia/Kolkata"] == schedules["UTC"]
    assert {t.hour for _, t, _ in schedules["UTC"]} == {0, 4, 8, 12, 16, 20}


# Between them, these two zones have a local date other than the UTC date at every moment
# (UTC+14 from 10:00 UTC, UTC-11 before 11:00 UTC), and never the UTC hour.
FAR_ZONES = ["Pacific/Kiritimati", "Pacific/Pago_Pago"]


@pytest.mark.parametrize("tz", FAR_ZONES)
def test_074_defect_2_generate_resync_default_date_is_the_utc_date(conn: psycopg.Connection, tz: str):
    """Without a date, the UTC day is used, whatever the session's local date."""
    add_stores(conn, 3)
    conn.execute("SELECT set_config('TimeZone', %s, false)", (tz,))
    with conn.transaction():  # one now() for the call and the check
        assert conn.execute("SELECT generate_resync_tasks()").fetchone() == (3,)
        utc_day = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]
    assert conn.execute("SELECT DISTINCT resync_date FROM v_tasks").fetchall() == [(utc_day,)]
    first = conn.execute("SELECT min(scheduled_for) AT TIME ZONE 'UTC' FROM v_tasks").fetchone()[0]
    assert first == datetime(utc_day.year, utc_day.month, utc_day.day)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        pytest.param({"batches_per_day": 0}, "batches_per_day", id="batches-0"),
        pytest.param({"batches_per_day": 25}, "batches_per_day", id="batches-25"),
        pytest.param({"batches_per_day": -6}, "batches_per_day", id="batches-negative"),
        pytest.param({"batches_per_day": None}, "batches_per_day", id="batches-null"),
        pytest.param({"day": None}, "date", id="date-null"),
        pytest.param({"platforms": []}, "platforms", id="platforms-empty"),
    ],
)
def test_074_defect_2_generate_resync_refuses_bad_arguments(
    conn: psycopg.Connection, queue: TaskQueue, kwargs: dict[str, Any], named: str
):
    """Out-of-range batches, a NULL date or no platforms: QueueInputError naming the parameter,
    nothing inserted, and the queue still works."""
    add_stores(conn, 5)
    with pytest.raises(QueueInputError, match=named):
        queue.generate_resync(**{"day": DAY, **kwargs})
    assert status_counts(conn) == {}
    assert queue.generate_resync(day=DAY) == 5
    assert queue.claim(ROLE, "w") is not None


def test_074_defect_2_generate_resync_follows_platforms_and_skips_uncrawlable_stores(
    conn: psycopg.Connection, queue: TaskQueue
):
    """Tasks for enabled stores of the given platforms that have a platform id, each carrying
    its store's platform; disabled stores and stores without a platform id get none."""
    dutchie = add_stores(conn, 2, platform="dutchie")
    jane = add_stores(conn, 2, platform="jane")
    treez = add_stores(conn, 1, platform="treez")
    disabled = add_stores(conn, 1, platform="jane", enabled=False)
    unresolved = add_stores(conn, 1, platform="dutchie")
    conn.execute("UPDATE dispensaries SET platform_dispensary_id = NULL WHERE id = %s", (unresolved[0],))
    assert queue.generate_resync(day=DAY, platforms=["dutchie", "jane"]) == 4
    got = {(d, p) for d, _, p in resync_schedule(conn)}
    assert got == {(d, "dutchie") for d in dutchie} | {(d, "jane") for d in jane}
    assert queue.generate_resync(day=DAY, platforms=["treez"]) == 1
    assert queue.generate_resync(day=DAY) == 0  # dutchie, already done
    got = {d for d, _, _ in resync_schedule(conn)}
    assert got.isdisjoint(disabled + unresolved)
    assert treez[0] in got


# ------------------------------------------------------------------------------------------------
# 074 defect 9: task_completion_log
# ------------------------------------------------------------------------------------------------

LOG_DAY = date(2024, 5, 1)
LOG_HOUR = 13
H0 = datetime(2024, 5, 1, 13, tzinfo=UTC)
US = timedelta(microseconds=1)


def seed_completion_hour(conn: psycopg.Connection) -> None:
    """Tasks around 13:00-14:00 UTC on LOG_DAY, edges included and excluded."""
    (store,) = add_stores(conn, 1)
    earlier = H0 - timedelta(hours=3)
    # Created: inside at both edges, outside just before and at the end.
    for created in (H0, H0 + timedelta(hours=1) - US, H0 - US, H0 + timedelta(hours=1)):
        insert_task(conn, dispensary_id=store, created_at=created, scheduled_for=H0 + timedelta(days=400))
    finished = [  # (status, started, completed) -- created three hours earlier
        ("completed", H0 - timedelta(seconds=10), H0),
        ("completed", H0 + timedelta(minutes=30), H0 + timedelta(minutes=30, seconds=20)),
        ("completed", H0 + timedelta(hours=1) - timedelta(seconds=30), H0 + timedelta(hours=1) - US),
        ("completed", H0 - timedelta(seconds=99), H0 - US),  # previous hour
        ("completed", H0 + timedelta(minutes=59), H0 + timedelta(hours=1)),  # next hour
        ("failed", H0 + timedelta(minutes=5), H0 + timedelta(minutes=6)),
        ("failed", H0 - timedelta(minutes=5), H0 - timedelta(minutes=1)),  # previous hour
        ("cancelled", None, H0 + timedelta(minutes=10)),  # never counted
    ]
    for status, started, completed in finished:
        insert_task(
            conn,
            dispensary_id=store,
            status=status,
            created_at=earlier,
            started_at=started,
            completed_at=completed,
        )
    insert_task(
        conn,
        "analytics_refresh",
        status="failed",
        created_at=H0 + timedelta(minutes=1),
        started_at=None,
        completed_at=H0 + timedelta(minutes=2),
    )


EXPECTED_LOG = {
    # role: (created, completed, failed, avg, min, max)
    "analytics_refresh": (1, 0, 1, None, None, None),
    "entry_point_discovery": (0, 0, 0, None, None, None),
    "product_discovery": (0, 0, 0, None, None, None),
    "product_resync": (2, 3, 1, 20.0, 10.0, 30.0),
    "store_discovery": (0, 0, 0, None, None, None),
}


def log_rows(queue: TaskQueue) -> dict[str, tuple]:
    return {
        r["role"]: (
            r["tasks_created"],
            r["tasks_completed"],
            r["tasks_failed"],
            *(
                None if r[k] is None else float(r[k])
                for k in ("avg_duration_sec", "min_duration_sec", "max_duration_sec")
            ),
        )
        for r in queue.completion_log(LOG_DAY, LOG_HOUR)
    }


def test_074_defect_9_refresh_completion_log_counts_one_utc_hour(conn: psycopg.Connection, queue: TaskQueue):
    """Counts created/completed/failed per role for [hour, hour + 1h) UTC only, with durations;
    idle roles get a row of zeros; a second call rewrites the same rows."""
    seed_completion_hour(conn)
    roles = len(queue.roles())
    assert queue.refresh_completion_log(LOG_DAY, LOG_HOUR) == roles
    assert log_rows(queue) == EXPECTED_LOG
    ids = conn.execute("SELECT id, role FROM task_completion_log ORDER BY id").fetchall()
    assert queue.refresh_completion_log(LOG_DAY, LOG_HOUR) == roles
    assert log_rows(queue) == EXPECTED_LOG
    assert conn.execute("SELECT id, role FROM task_completion_log ORDER BY id").fetchall() == ids
    # The neighbouring hours see what this one excluded.
    queue.refresh_completion_log(LOG_DAY, LOG_HOUR + 1)
    nxt = {r["role"]: r for r in queue.completion_log(LOG_DAY, LOG_HOUR + 1)}
    assert (nxt["product_resync"]["tasks_created"], nxt["product_resync"]["tasks_completed"]) == (1, 1)
    assert conn.execute("SELECT count(*) FROM task_completion_log").fetchone() == (2 * roles,)


def test_074_defect_9_refresh_completion_log_ignores_session_timezone(
    conn: psycopg.Connection, queue: TaskQueue
):
    """The rollup of an hour is the same whatever the session TimeZone (half-hour offsets too)."""
    seed_completion_hour(conn)
    for tz in ("Asia/Kolkata", "America/Los_Angeles", "Pacific/Kiritimati"):
        conn.execute("TRUNCATE task_completion_log")
        conn.execute("SELECT set_config('TimeZone', %s, false)", (tz,))
        conn.execute("SELECT refresh_task_completion_log(%s, %s)", (LOG_DAY, LOG_HOUR))
        assert log_rows(queue) == EXPECTED_LOG, tz


@pytest.mark.parametrize("tz", FAR_ZONES)
def test_074_defect_9_completion_log_defaults_are_utc(conn: psycopg.Connection, tz: str):
    """A row inserted with the date/hour defaults gets the UTC date and hour, whatever the
    session TimeZone."""
    conn.execute("SELECT set_config('TimeZone', %s, false)", (tz,))
    got = conn.execute(
        """
        INSERT INTO task_completion_log (role) VALUES ('product_resync')
        RETURNING date, hour,
                  (now() AT TIME ZONE 'UTC')::date,
                  extract(HOUR FROM now() AT TIME ZONE 'UTC')::int,
                  extract(HOUR FROM now())::int
        """
    ).fetchone()
    log_date, log_hour, utc_date, utc_hour, local_hour = got
    assert (log_date, log_hour) == (utc_date, utc_hour)
    assert local_hour != utc_hour  # the session really is elsewhere


# ------------------------------------------------------------------------------------------------
# 074 defect 8: the views' numbers
# ------------------------------------------------------------------------------------------------


def test_074_defect_8_worker_capacity_counts_a_known_mix(conn: psycopg.Connection, queue: TaskQueue):
    """v_worker_capacity: pending vs ready, claimed, running, active workers, last-hour
    completions/failures and durations, zeros for idle roles."""
    s = add_stores(conn, 8)
    now = db_now(conn)
    insert_task(conn, dispensary_id=s[0])  # ready
    insert_task(conn, dispensary_id=s[1], scheduled_for=now - timedelta(minutes=5))  # ready
    insert_task(conn, dispensary_id=s[2], scheduled_for=now + timedelta(hours=2))  # future
    insert_task(conn, dispensary_id=s[3], status="claimed", worker_id="wA", claimed_at=now)
    insert_task(conn, dispensary_id=s[4], status="running", worker_id="wA", claimed_at=now, started_at=now)
    insert_task(conn, dispensary_id=s[5], status="running", worker_id="wB", claimed_at=now, started_at=now)
    for started, completed, status in [
        (now - timedelta(minutes=30, seconds=10), now - timedelta(minutes=30), "completed"),
        (now - timedelta(minutes=10, seconds=30), now - timedelta(minutes=10), "completed"),
        (now - timedelta(minutes=20), now - timedelta(minutes=19), "failed"),
        (now - timedelta(hours=2, seconds=500), now - timedelta(hours=2), "completed"),  # too old
        (now - timedelta(hours=3), now - timedelta(hours=3), "failed"),  # too old
        (None, now - timedelta(minutes=1), "cancelled"),
    ]:
        insert_task(conn, dispensary_id=s[6], status=status, started_at=started, completed_at=completed)
    insert_task(conn, "analytics_refresh")  # store-less, ready
    insert_task(conn, "analytics_refresh", status="running", worker_id="wC", claimed_at=now, started_at=now)

    caps = {c.role: c for c in queue.capacity()}
    assert set(caps) == set(queue.roles())
    r = caps[ROLE]
    assert (r.pending_tasks, r.ready_tasks, r.claimed_tasks, r.running_tasks) == (3, 2, 1, 2)
    assert (r.completed_last_hour, r.failed_last_hour, r.active_workers) == (2, 1, 2)
    assert r.avg_duration_sec == pytest.approx(20.0)
    # The pace is what completed in the last hour over the time it took, whatever each worker's
    # concurrency: two tasks from the first start (30 min 10 s ago) to the last completion (10
    # min ago), written without a worker (one); three pending take one and a half times that.
    busy_hours = (20 * 60 + 10) / 3600
    assert r.tasks_per_worker_hour == pytest.approx(2 / busy_hours)
    assert r.estimated_hours_to_drain == pytest.approx(3 * busy_hours / 2)
    a = caps["analytics_refresh"]
    assert (a.pending_tasks, a.ready_tasks, a.running_tasks, a.active_workers) == (1, 1, 1, 1)
    assert (
        a.completed_last_hour,
        a.avg_duration_sec,
        a.tasks_per_worker_hour,
        a.estimated_hours_to_drain,
    ) == (
        0,
        None,
        None,
        None,
    )
    idle = caps["store_discovery"]
    assert (idle.pending_tasks, idle.ready_tasks, idle.claimed_tasks, idle.running_tasks) == (0, 0, 0, 0)
    assert (idle.completed_last_hour, idle.failed_last_hour, idle.active_workers) == (0, 0, 0)


def test_074_defect_8_task_history_newest_first_with_store_name(conn: psycopg.Connection):
    """v_task_history lists tasks newest first (ties by id) with their store's name."""
    a, b = add_stores(conn, 2)
    conn.execute("UPDATE dispensaries SET name = 'Green Leaf' WHERE id = %s", (a,))
    now = db_now(conn)
    oldest = insert_task(conn, dispensary_id=a, created_at=now - timedelta(hours=2))
    newest = insert_task(conn, dispensary_id=b, created_at=now - timedelta(minutes=1))
    middle = insert_task(conn, "analytics_refresh", created_at=now - timedelta(hours=1))
    tie = insert_task(conn, dispensary_id=a, created_at=now - timedelta(hours=1))
    done = insert_task(
        conn,
        dispensary_id=b,
        status="completed",
        created_at=now - timedelta(hours=3),
        started_at=now - timedelta(minutes=3),
        completed_at=now - timedelta(minutes=1, seconds=30),
    )
    rows = conn.execute("SELECT id, dispensary_name, duration_sec FROM v_task_history").fetchall()
    assert [r[0] for r in rows] == [newest, tie, middle, oldest, done]
    names = {r[0]: r[1] for r in rows}
    assert names[oldest] == names[tie] == "Green Leaf"
    assert names[newest] == "store 2"
    assert names[middle] is None
    assert float(dict((r[0], r[2]) for r in rows)[done]) == pytest.approx(90.0)


# ------------------------------------------------------------------------------------------------
# Per-store state (worker_task_stores / worker_task_heads) under every writer
# ------------------------------------------------------------------------------------------------


def test_cancelled_only_task_leaves_no_stale_head(conn: psycopg.Connection, queue: TaskQueue):
    """Cancelling a store's only pending task: the claim finds nothing, the head is gone after
    it, and new work for that store is claimed normally."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store, priority=3)
    assert queue.cancel(task_id)
    assert queue.claim(ROLE, "w") is None
    assert heads(conn, store) == []
    assert_store_state_consistent(conn)
    fresh = queue.enqueue(ROLE, store)
    assert queue.claim(ROLE, "w").id == fresh
    assert queue.get(task_id).status == "cancelled"


def test_deleting_store_with_active_task(conn: psycopg.Connection, queue: TaskQueue):
    """Deleting a store that has claimed and pending tasks works, cascades, and leaves the store
    state consistent; other stores are unaffected and the old owner's calls are refused."""
    gone, kept = add_stores(conn, 2)
    add_tasks(conn, ROLE, [gone, kept], 2)
    queue.enqueue("product_discovery", gone)
    claimed = {t.dispensary_id: t for t in queue.claim_many(ROLE, "w", 2)}
    conn.execute("DELETE FROM dispensaries WHERE id = %s", (gone,))
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE dispensary_id = %s", (gone,)).fetchone() == (0,)
    assert conn.execute(
        "SELECT count(*) FROM worker_task_stores WHERE dispensary_id = %s", (gone,)
    ).fetchone() == (0,)
    assert heads(conn, gone) == []
    assert_store_state_consistent(conn)
    assert queue.complete(claimed[gone], {}) is False
    assert queue.complete(claimed[kept], {}) is True
    assert queue.claim(ROLE, "w").dispensary_id == kept
    assert queue.claim("product_discovery", "w") is None


def test_raw_sql_release_of_claimed_task_keeps_state_consistent(conn: psycopg.Connection, queue: TaskQueue):
    """An old caller's `UPDATE worker_tasks SET status = 'pending'` of a claimed task: the store is
    freed, the task is claimable again, the per-store state stays true."""
    a, b = add_stores(conn, 2)
    task_id = queue.enqueue(ROLE, a)
    queue.enqueue(ROLE, b)
    got = {t.dispensary_id: t for t in queue.claim_many(ROLE, "old", 2)}
    assert got[a].id == task_id
    conn.execute("UPDATE worker_tasks SET status = 'pending' WHERE id = %s", (task_id,))
    assert_store_state_consistent(conn)
    again = queue.claim(ROLE, "new")
    assert again is not None and again.id == task_id and again.worker_id == "new"
    assert_store_state_consistent(conn)
    assert again.lease_token != got[a].lease_token
    assert queue.complete(got[a], {}) is False
    assert queue.complete(again, {}) is True


def test_raw_sql_inserts_and_updates_keep_state_consistent(conn: psycopg.Connection, queue: TaskQueue):
    """Direct INSERTs (pending and already claimed) and UPDATEs of priority, schedule, role and
    store keep worker_task_stores/heads true, and the claims follow them."""
    a, b, c = add_stores(conn, 3)
    now = db_now(conn)
    claimed = insert_task(conn, dispensary_id=a, status="claimed", worker_id="legacy", claimed_at=now)
    waiting = insert_task(conn, dispensary_id=a, priority=50)
    moved = insert_task(conn, dispensary_id=b, scheduled_for=now + timedelta(hours=1))
    assert_store_state_consistent(conn)
    assert queue.claim(ROLE, "w") is None  # a is busy, b's task is not due
    conn.execute("UPDATE worker_tasks SET dispensary_id = %s, scheduled_for = NULL WHERE id = %s", (c, moved))
    assert_store_state_consistent(conn)
    assert queue.claim(ROLE, "w").id == moved
    conn.execute(
        "UPDATE worker_tasks SET status = 'completed', completed_at = now() WHERE id = %s", (claimed,)
    )
    conn.execute("UPDATE worker_tasks SET role = 'product_discovery' WHERE id = %s", (waiting,))
    assert_store_state_consistent(conn)
    assert queue.claim(ROLE, "w") is None
    assert queue.claim("product_discovery", "w").id == waiting
    assert_store_state_consistent(conn)


def test_bulk_raw_sql_updates_keep_state_consistent(conn: psycopg.Connection, queue: TaskQueue):
    """One UPDATE touching many stores at once (reprioritise, reschedule, release, move) keeps the
    per-store state true, and claims follow it."""
    stores = add_stores(conn, 12)
    add_tasks(conn, ROLE, stores, 3, adjacent=False)
    held = {t.dispensary_id: t.id for t in queue.claim_many(ROLE, "old", 6)}
    assert sorted(held) == stores[:6]  # equal keys: store order
    conn.execute("UPDATE worker_tasks SET priority = id % 4 WHERE status = 'pending'")
    assert_store_state_consistent(conn)
    later = stores[:3] + stores[6:9]
    conn.execute(
        "UPDATE worker_tasks SET scheduled_for = now() + interval '1 hour'"
        " WHERE status = 'pending' AND dispensary_id = ANY(%s)",
        (later,),
    )
    assert_store_state_consistent(conn)
    conn.execute("UPDATE worker_tasks SET status = 'pending' WHERE id = ANY(%s)", (list(held.values()),))
    assert_store_state_consistent(conn)
    conn.execute(
        "UPDATE worker_tasks SET dispensary_id = %s WHERE dispensary_id = %s AND status = 'pending'",
        (stores[9], stores[11]),
    )
    assert_store_state_consistent(conn)
    claimed = {t.dispensary_id: t.id for t in queue.claim_many(ROLE, "new", 20)}
    # Stores 1-3 have only their released task due; 7-9 nothing due; 12 nothing left.
    assert sorted(claimed) == stores[:6] + stores[9:11]
    assert all(claimed[s] == held[s] for s in stores[:3])
    assert_store_state_consistent(conn)


def test_truncate_of_tasks_does_not_leave_stores_busy(conn: psycopg.Connection, queue: TaskQueue):
    """After TRUNCATE worker_tasks (a reset), new work for a store that had an active task is claimable."""
    (store,) = add_stores(conn, 1)
    add_tasks(conn, ROLE, [store], 2)
    assert queue.claim(ROLE, "w") is not None
    conn.execute("TRUNCATE worker_tasks")
    fresh = queue.enqueue(ROLE, store)
    task = queue.claim(ROLE, "w")
    assert task is not None and task.id == fresh
