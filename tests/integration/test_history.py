"""Finished tasks leave the hot table (migrations 0022, 0023): a completion moves its task from
worker_tasks to worker_task_history, archive_tasks moves failed and cancelled ones; v_tasks reads
both; a resync day is still made once per store.
"""

# ruff: noqa: F811 (the worker fixture, imported, is a test's argument)
import threading
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.helpers import add_stores, assert_store_state_consistent
from tests.integration.test_attacks import Worker, make_role, worker  # noqa: F401
from tq_pipelines.queue.api import QueueInputError, TaskQueue

ROLE = "product_resync"
# Every column, so that a moved row can be compared with what it was.
ROW = "SELECT to_jsonb(t) - 'due_at' FROM {} t WHERE t.id = ANY(%s) ORDER BY t.id"


def age_finished(conn: psycopg.Connection, seconds: float) -> None:
    """Make every finished task in worker_tasks look finished ``seconds`` ago."""
    conn.execute(
        "UPDATE worker_tasks SET completed_at = now() - make_interval(secs => %s),"
        " started_at = now() - make_interval(secs => %s + 1)"
        " WHERE status IN ('completed', 'failed', 'cancelled')",
        (seconds, seconds),
    )


def where(conn: psycopg.Connection) -> dict[str, set[int]]:
    return {
        "queue": {r[0] for r in conn.execute("SELECT id FROM worker_tasks").fetchall()},
        "history": {r[0] for r in conn.execute("SELECT id FROM worker_task_history").fetchall()},
    }


def test_finished_tasks_move_oldest_first_and_every_task_stays_readable(
    conn: psycopg.Connection, queue: TaskQueue
):
    stores = add_stores(conn, 8)
    ids = [queue.enqueue_once(ROLE, s) for s in stores]
    held = queue.claim_many(ROLE, "w1", 8, start=True)
    assert len(held) == 8
    done, failed, cancelled, running = held[:3], held[3], held[4], held[5:]
    for i, task in enumerate(done):
        assert queue.complete(task, {"n": i})
    assert queue.fail(failed, "boom", retryable=False) == "failed"
    assert queue.cancel(cancelled.id)
    finished = [t.id for t in done] + [failed.id, cancelled.id]
    # The completions moved their tasks at once; the failed and cancelled ones wait.
    assert where(conn)["history"] == {t.id for t in done}

    # Young: nothing moves.
    assert queue.archive_finished(60) == 0
    age_finished(conn, 120)
    conn.execute(
        "UPDATE worker_tasks SET completed_at = completed_at - INTERVAL '1 hour' WHERE id = %s", (failed.id,)
    )
    before = conn.execute(ROW.format("v_tasks"), (finished,)).fetchall()
    # Oldest first, a batch at a time.
    assert queue.archive_finished(60, limit=1) == 1
    assert where(conn)["history"] == {t.id for t in done} | {failed.id}
    assert queue.archive_finished(60, limit=100) == 1
    assert queue.archive_finished(60, limit=100) == 0

    place = where(conn)
    assert place["history"] == set(finished)
    assert place["queue"] == {t.id for t in running}
    # The rows as they were, every column.
    assert conn.execute(ROW.format("worker_task_history"), (finished,)).fetchall() == before
    # Every task is still there to read: v_tasks, get, v_task_history.
    assert {r[0] for r in conn.execute("SELECT id FROM v_tasks").fetchall()} == set(ids)
    newest_first = [r[0] for r in conn.execute("SELECT id FROM v_task_history").fetchall()]
    assert newest_first == sorted(ids, reverse=True)
    got = queue.get(done[1].id)
    assert got is not None and got.status == "completed" and got.result == {"n": 1}
    # The running tasks are untouched and still held: they complete where they are.
    assert all(queue.complete(t) for t in running)
    assert_store_state_consistent(conn)


def test_the_archive_refuses_bad_arguments_in_words(conn: psycopg.Connection, queue: TaskQueue):
    for seconds in (-1, float("nan"), float("inf")):
        with pytest.raises(QueueInputError, match="older_than_seconds"):
            queue.archive_finished(seconds)
    with pytest.raises(QueueInputError, match="limit must be between 1 and 100000"):
        queue.archive_finished(0, limit=0)
    for statement in ("SELECT archive_tasks(NULL, 10)", "SELECT archive_tasks(now(), 100001)"):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
            conn.execute(statement)
        assert info.value.diag.message_hint


def test_archives_beside_a_busy_queue_lose_no_task_and_move_each_once(db_url: str, conn: psycopg.Connection):
    """Four workers enqueue, claim and complete (or fail) while two archivers move everything
    finished: afterwards every task is in exactly one table, each as it ended."""
    stores = add_stores(conn, 40)
    stop = threading.Event()
    errors: list[BaseException] = []
    enqueued: list[int] = []
    lock = threading.Lock()

    def drain(n: int) -> None:
        try:
            with TaskQueue.connect(db_url, max_size=2) as q:
                i = 0
                while not stop.is_set():
                    new = q.enqueue(ROLE, stores[(n * 10 + i) % len(stores)])
                    with lock:
                        enqueued.append(new)
                    i += 1
                    for task in q.claim_many(ROLE, f"w{n}", 5, start=True):
                        if task.id % 7 == 0:
                            q.fail(task, "no", retryable=False)
                        else:
                            q.complete(task, {"by": n})
        except BaseException as exc:
            errors.append(exc)

    def archiver() -> None:
        try:
            with TaskQueue.connect(db_url, max_size=1) as q:
                while not stop.is_set():
                    q.archive_finished(0, limit=20)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(n,)) for n in range(4)]
    threads += [threading.Thread(target=archiver) for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait(6)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(enqueued) > 100

    with TaskQueue.connect(db_url, max_size=1) as q:
        while q.archive_finished(0, limit=1000):
            pass
    place = where(conn)
    assert place["queue"] & place["history"] == set()
    assert place["queue"] | place["history"] == set(enqueued)
    assert conn.execute(
        "SELECT count(*) FROM worker_tasks WHERE status IN ('completed', 'failed', 'cancelled')"
    ).fetchone() == (0,)
    wrong = conn.execute(
        "SELECT id, status, result FROM worker_task_history"
        " WHERE NOT ((id % 7 = 0 AND status = 'failed') OR (id % 7 <> 0 AND status = 'completed'"
        "            AND result ? 'by'))"
    ).fetchall()
    assert wrong == []
    assert_store_state_consistent(conn)


def test_a_resync_day_is_made_once_though_its_tasks_were_archived(db_url: str, conn: psycopg.Connection):
    """Generators of one day, at once and while its finished tasks are archived: one task per
    store and day, in the queue or the history."""
    stores = add_stores(conn, 30)
    today = datetime.now(UTC).date()
    with TaskQueue.connect(db_url, max_size=2) as q:
        assert q.generate_resync(day=today, batches_per_day=1) == 30  # all due at 00:00 UTC
        for task in q.claim_many(ROLE, "w", 20, start=True):
            q.complete(task)
        # Completed, so moved: the history holds them, the keys stay.
        assert q.archive_finished(0) == 0
        assert conn.execute("SELECT count(*) FROM worker_task_history").fetchone() == (20,)
        assert q.generate_resync(day=today) == 0

    # Now the next day, from four connections at once, with an archiver busy.
    day = today + timedelta(days=1)
    made: list[int] = []
    errors: list[BaseException] = []
    go = threading.Barrier(5)

    def generate() -> None:
        try:
            with TaskQueue.connect(db_url, max_size=1) as q:
                go.wait()
                made.append(q.generate_resync(day=day))
        except BaseException as exc:
            errors.append(exc)

    def archive() -> None:
        try:
            with TaskQueue.connect(db_url, max_size=1) as q:
                go.wait()
                for _ in range(20):
                    q.archive_finished(0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=generate) for _ in range(4)] + [threading.Thread(target=archive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(made) == [0, 0, 0, 30]
    per_store = conn.execute(
        "SELECT resync_date, count(*), count(DISTINCT dispensary_id) FROM v_tasks"
        " WHERE role = %s GROUP BY resync_date ORDER BY resync_date",
        (ROLE,),
    ).fetchall()
    assert per_store == [(today, 30, 30), (day, 30, 30)]
    assert conn.execute("SELECT count(*) FROM worker_task_resyncs").fetchone() == (60,)
    assert len(stores) == 30


def test_the_prune_takes_the_history_and_the_keys_and_the_day_can_be_made_again(
    conn: psycopg.Connection, queue: TaskQueue
):
    add_stores(conn, 5)
    day = datetime.now(UTC).date() - timedelta(days=60)
    assert queue.generate_resync(day=day) == 5
    for i, task in enumerate(queue.claim_many(ROLE, "w", 5, start=True)):
        if i < 3:
            assert queue.complete(task)
        else:
            assert queue.fail(task, "gone", retryable=False) == "failed"
    # Made and finished 60 days ago: three completed (moved), one failed archived, one failed
    # left in the queue (no sensor ran).
    for table in ("worker_tasks", "worker_task_history"):
        conn.execute(
            f"UPDATE {table} SET created_at = now() - INTERVAL '60 days',"
            " claimed_at = now() - INTERVAL '60 days', started_at = now() - INTERVAL '60 days',"
            " completed_at = now() - INTERVAL '60 days' + INTERVAL '1 minute'"
        )
    assert queue.archive_finished(0, limit=1) == 1
    assert conn.execute("SELECT count(*) FROM worker_tasks").fetchone() == (1,)
    before = conn.execute(
        "SELECT (date_trunc('hour', now() AT TIME ZONE 'UTC') - INTERVAL '30 days') AT TIME ZONE 'UTC'"
    ).fetchone()[0]  # type: ignore[index]
    deleted, _ = conn.execute("SELECT * FROM prune_tasks(%s, 1000)", (before,)).fetchone()  # type: ignore[misc]
    assert deleted == 5
    assert conn.execute("SELECT count(*) FROM v_tasks").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM worker_task_resyncs").fetchone() == (0,)
    # The rollup of their hours was kept; and a backfill of the day makes it again, as before.
    assert conn.execute("SELECT sum(tasks_completed) FROM task_completion_log").fetchone() == (3,)
    assert queue.generate_resync(day=day) == 5


def test_the_worker_role_reads_every_task_and_writes_neither_table(
    worker: Worker, conn: psycopg.Connection, queue: TaskQueue
):
    """As the role `tq grant` makes, through plain SQL: the history and the keys are the queue's
    functions' to write; the worker reads v_tasks and may run the archive, which moves only
    what has finished."""
    add_stores(conn, 3)
    today = datetime.now(UTC).date()
    assert queue.generate_resync(day=today, batches_per_day=1) == 3  # all due at 00:00 UTC
    first, second = queue.claim_many(ROLE, "w", 2, start=True)
    assert queue.complete(first)
    assert queue.fail(second, "gone", retryable=False) == "failed"
    tables = ("worker_tasks", "worker_task_history", "worker_task_resyncs")
    before = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone() for t in tables}
    with worker.connect() as w:
        for statement in (
            "DELETE FROM worker_task_resyncs",
            "INSERT INTO worker_task_resyncs VALUES (current_date, 'product_resync', 1)",
            f"INSERT INTO worker_task_history SELECT * FROM v_tasks WHERE id = {first.id}",
            "UPDATE worker_task_history SET status = 'failed'",
            "DELETE FROM worker_task_history",
            "SELECT count(*) FROM worker_task_history",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                w.execute(statement)
        assert w.execute("SELECT count(*) FROM v_tasks").fetchone() == (3,)
        # The archive, asked to move everything, moves the one failed task and nothing else.
        assert w.execute("SELECT archive_tasks(now() + INTERVAL '1 year', 100000)").fetchone() == (1,)
        # And the day cannot be made twice through it.
        assert w.execute("SELECT generate_resync_tasks(6, %s, '{dutchie}')", (today,)).fetchone() == (0,)
    after = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone() for t in tables}
    assert after == {
        "worker_tasks": (before["worker_tasks"][0] - 1,),  # type: ignore[index]
        "worker_task_history": (2,),
        "worker_task_resyncs": (3,),
    }
    assert conn.execute("SELECT id, status FROM worker_task_history ORDER BY id").fetchall() == sorted(
        [(first.id, "completed"), (second.id, "failed")]
    )
