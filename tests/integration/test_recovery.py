"""Leases: a claim starts one, heartbeats extend it, recover_stale_tasks gives back the tasks of
silent workers (or fails them once out of retries) and fences their old owners out."""

import dataclasses
from datetime import datetime, timedelta

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT now()").fetchone()[0]


def age_lease(conn: psycopg.Connection, task_id: int, minutes: int, *, heartbeat: bool = True) -> None:
    """Make a claimed/running task look as if its worker went silent ``minutes`` ago (or, with
    ``heartbeat=False``, as if it never heartbeated: an old caller that set only claimed_at)."""
    conn.execute(
        """
        UPDATE worker_tasks
        SET claimed_at = now() - make_interval(mins => %(m)s),
            started_at = CASE WHEN started_at IS NULL THEN NULL ELSE now() - make_interval(mins => %(m)s) END,
            last_heartbeat_at = CASE WHEN %(hb)s THEN now() - make_interval(mins => %(m)s) END
        WHERE id = %(id)s
        """,
        {"m": minutes, "hb": heartbeat, "id": task_id},
    )


@pytest.mark.parametrize("start", [False, True], ids=["claimed", "claimed-and-started"])
def test_074_defect_3_claim_starts_a_lease(conn: psycopg.Connection, queue: TaskQueue, start: bool):
    """A claim sets claimed_at and last_heartbeat_at (and started_at when starting) to its now()."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    before = db_now(conn)
    (task,) = queue.claim_many(ROLE, "w", 1, start=start)
    after = db_now(conn)
    assert task.id == task_id
    assert before <= task.claimed_at <= after
    assert task.last_heartbeat_at == task.claimed_at
    assert task.status == ("running" if start else "claimed")
    assert task.started_at == (task.claimed_at if start else None)
    # The row as stored is the claim's, but for the lease token (kept only as its hash).
    assert task.lease_token is not None
    assert queue.get(task_id) == dataclasses.replace(task, lease_token=None)


@pytest.mark.parametrize(
    ("store", "start", "heartbeat"),
    [
        pytest.param(True, False, True, id="store-claimed"),
        pytest.param(True, True, True, id="store-running"),
        pytest.param(True, False, False, id="store-claimed-no-heartbeat-column"),
        pytest.param(False, False, True, id="storeless-claimed"),
        pytest.param(False, True, False, id="storeless-running-no-heartbeat-column"),
    ],
)
def test_074_defect_3_task_of_worker_dead_after_claim_is_recovered(
    conn: psycopg.Connection, queue: TaskQueue, store: bool, start: bool, heartbeat: bool
):
    """A worker dies right after claiming: before the threshold its task stays put (and its store
    blocked); after it, recover_stale_tasks gives the task back and the store is free again."""
    (store_id,) = add_stores(conn, 1)
    dispensary = store_id if store else None
    task_id = queue.enqueue(ROLE, dispensary)
    sibling = queue.enqueue(ROLE, dispensary)
    assert [t.id for t in queue.claim_many(ROLE, "dead", 1, start=start)] == [task_id]
    if store:
        assert queue.claim(ROLE, "other") is None  # the store is blocked while the lease lives

    age_lease(conn, task_id, 9, heartbeat=heartbeat)
    assert queue.stuck_tasks(10) == 0
    report = queue.recover_stale(10)
    assert (report.recovered, report.failed) == (0, 0)
    assert queue.get(task_id).worker_id == "dead"

    age_lease(conn, task_id, 11, heartbeat=heartbeat)
    assert queue.stuck_tasks(10) == 1
    report = queue.recover_stale(10)
    assert (report.recovered, report.failed) == (1, 0)
    t = queue.get(task_id)
    assert (t.status, t.worker_id, t.claimed_at, t.started_at, t.last_heartbeat_at) == (
        "pending",
        None,
        None,
        None,
        None,
    )
    assert t.retry_count == 1
    assert "lease expired" in t.error_message and "dead" in t.error_message
    assert_store_state_consistent(conn)
    # The store is no longer blocked: the next claim takes one of its tasks.
    again = queue.claim(ROLE, "other")
    assert again is not None and again.id in (task_id, sibling)
    if store:
        assert again.dispensary_id == store_id


def test_074_defect_4_reclaimed_task_gets_a_fresh_lease(conn: psycopg.Connection, queue: TaskQueue):
    """A recovered task claimed again is not taken from its new owner by the next recovery."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    first = queue.claim(ROLE, "first")
    assert first.id == task_id
    age_lease(conn, task_id, 30)
    assert queue.recover_stale(10).recovered == 1
    second = queue.claim(ROLE, "second")
    assert second.id == task_id
    assert second.lease_token != first.lease_token
    assert second.last_heartbeat_at == second.claimed_at
    assert second.last_heartbeat_at > db_now(conn) - timedelta(minutes=1)
    for threshold in (10, 1):
        assert queue.recover_stale(threshold).recovered == 0
    t = queue.get(task_id)
    assert (t.status, t.worker_id) == ("claimed", "second")
    assert queue.complete(second, {"ok": 1})


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_074_defect_4_task_fails_when_its_lease_expires_with_no_retries_left(
    conn: psycopg.Connection, queue: TaskQueue, max_retries: int
):
    """Each expiry gives the task back with retry_count + 1 while retries remain; the expiry after
    max_retries retries fails it with a message about the lease, and frees its store."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store, max_retries=max_retries)
    history = []
    for attempt in range(max_retries + 1):
        (task,) = queue.claim_many(ROLE, f"w{attempt}", 1, start=attempt % 2 == 1)
        assert task.id == task_id
        age_lease(conn, task_id, 20)
        report = queue.recover_stale(10)
        t = queue.get(task_id)
        history.append((report.recovered, report.failed, t.status, t.retry_count))
    expected = [(1, 0, "pending", n + 1) for n in range(max_retries)]
    expected.append((0, 1, "failed", max_retries))
    assert history == expected
    t = queue.get(task_id)
    assert "lease expired" in t.error_message
    assert t.completed_at is not None
    assert queue.claim(ROLE, "late") is None
    assert_store_state_consistent(conn)
    # The store is free: new work for it is claimed.
    fresh = queue.enqueue(ROLE, store)
    assert queue.claim(ROLE, "late").id == fresh


def test_old_owner_is_fenced_out_after_recovery(conn: psycopg.Connection, queue: TaskQueue):
    """After recovery the old owner's complete/fail/start/heartbeat are refused and the row is
    untouched (result NULL, pending); once re-claimed, only the new owner can finish it."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    (old,) = queue.claim_many(ROLE, "old", 1, start=True)
    assert old.id == task_id
    age_lease(conn, task_id, 15)
    assert queue.recover_stale(10).recovered == 1
    recovered = conn.execute("SELECT to_jsonb(t) FROM worker_tasks t WHERE id = %s", (task_id,)).fetchone()
    assert queue.complete(old, {"stale": True}) is False
    assert queue.complete_many({old.lease: {"stale": True}}) == set()
    assert queue.fail(old, "gave up") is None
    assert queue.start(old) is False
    assert queue.heartbeat("old", [old]) == set()
    assert (
        conn.execute("SELECT to_jsonb(t) FROM worker_tasks t WHERE id = %s", (task_id,)).fetchone()
        == recovered
    )
    t = queue.get(task_id)
    assert (t.status, t.result) == ("pending", None)
    new = queue.claim(ROLE, "new")
    assert new.id == task_id
    assert queue.complete(old, {"stale": True}) is False
    assert queue.complete(new, {"fresh": True}) is True
    assert queue.get(task_id).result == {"fresh": True}


def test_heartbeat_keeps_a_long_task_alive(conn: psycopg.Connection, queue: TaskQueue):
    """A task whose worker heartbeats is not recovered, however long ago it was claimed."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    task = queue.claim(ROLE, "w")
    assert task.id == task_id
    age_lease(conn, task_id, 60)
    assert queue.heartbeat("w", [task]) == {task_id}
    assert queue.recover_stale(10).recovered == 0
    assert queue.get(task_id).status == "claimed"
    assert queue.start(task)
    age_lease(conn, task_id, 60)
    assert queue.start(task)  # a start is a sign of life too
    assert queue.recover_stale(10).recovered == 0
    assert queue.get(task_id).status == "running"


def test_recovery_marks_silent_workers_offline(conn: psycopg.Connection, queue: TaskQueue):
    """Workers silent past the threshold go offline (and are counted); live ones stay as they are."""
    for w in ("alive", "silent-1", "silent-2", "gone"):
        queue.register_worker(w, ROLE)
    assert queue.deregister_worker("gone")
    conn.execute(
        "UPDATE worker_registry SET last_heartbeat_at = now() - interval '30 minutes'"
        " WHERE worker_id <> 'alive'"
    )
    queue.heartbeat("alive", [])  # idle, not silent
    report = queue.recover_stale(10)
    assert report.workers_offline == 2
    statuses = dict(conn.execute("SELECT worker_id, status FROM worker_registry").fetchall())
    assert statuses == {"alive": "idle", "silent-1": "offline", "silent-2": "offline", "gone": "offline"}
    assert queue.recover_stale(10).workers_offline == 0


def test_recovery_counts_across_many_workers(conn: psycopg.Connection, queue: TaskQueue):
    """A mixed batch: silent tasks with retries left go back, exhausted ones fail, live ones stay,
    and the report counts each."""
    stores = add_stores(conn, 6)
    add_tasks(conn, ROLE, stores, 1)
    conn.execute("UPDATE worker_tasks SET max_retries = 0 WHERE dispensary_id = ANY(%s)", (stores[:2],))
    tasks = queue.claim_many(ROLE, "w", 6)
    by_store = {t.dispensary_id: t.id for t in tasks}
    for s in stores[:5]:
        age_lease(conn, by_store[s], 20)
    report = queue.recover_stale(10)
    assert (report.recovered, report.failed) == (3, 2)
    assert status_counts(conn) == {"pending": 3, "failed": 2, "claimed": 1}
    assert queue.get(by_store[stores[5]]).worker_id == "w"
    assert_store_state_consistent(conn)
    assert len(queue.claim_many(ROLE, "w2", 6)) == 3
