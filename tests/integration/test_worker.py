"""Worker: drains a role with a handler, retries and fails tasks as the handler says, keeps
leases, discards results of lost leases, and honours its time budget."""

import threading
import time
from typing import Any

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import PermanentTaskError, TaskContext, Worker

ROLE = "product_resync"
LOOSE = "analytics_refresh"  # tasks without a store


def add_loose_tasks(conn: psycopg.Connection, count: int, role: str = LOOSE) -> list[int]:
    rows = conn.execute(
        "INSERT INTO worker_tasks (role) SELECT %s FROM generate_series(1, %s) RETURNING id", (role, count)
    ).fetchall()
    return sorted(r[0] for r in rows)


def registry(conn: psycopg.Connection, worker_id: str) -> tuple:
    return conn.execute(
        "SELECT status, tasks_completed, tasks_failed FROM v_workers WHERE worker_id = %s", (worker_id,)
    ).fetchone()


def make_due(conn: psycopg.Connection) -> None:
    conn.execute(
        "UPDATE worker_tasks SET scheduled_for = now() - interval '1 second' WHERE status = 'pending'"
    )


@pytest.mark.parametrize("concurrency", [1, 4])
def test_worker_drains_500_tasks(conn: psycopg.Connection, queue: TaskQueue, concurrency: int):
    """All 500 tasks completed once, with the handler's result; stats and registry agree; the
    worker is offline afterwards."""
    stores = add_stores(conn, 100)
    add_tasks(conn, ROLE, stores, 5, adjacent=False)
    seen: list[int] = []
    lock = threading.Lock()

    def handler(task: Task, ctx: TaskContext) -> Any:
        assert task.status == "running" and ctx.worker_id == "drainer"
        with lock:
            seen.append(task.id)
        return {"id": task.id}

    stats = Worker(queue, ROLE, handler, worker_id="drainer", concurrency=concurrency).run()
    assert (stats.claimed, stats.completed, stats.retried, stats.failed, stats.lost) == (500, 500, 0, 0, 0)
    assert len(seen) == len(set(seen)) == 500
    assert status_counts(conn) == {"completed": 500}
    mismatched = conn.execute(
        "SELECT count(*) FROM v_tasks WHERE (result->>'id')::int <> id OR worker_id <> 'drainer'"
    ).fetchone()
    assert mismatched == (0,)
    assert registry(conn, "drainer") == ("offline", 500, 0)
    assert_store_state_consistent(conn)


def test_a_steady_stream_keeps_the_held_tasks_within_twice_the_threads(
    conn: psycopg.Connection, queue: TaskQueue
):
    """Was: with threads, outcomes were written only on a pass of the main loop that claimed
    nothing. Under a steady stream every pass claims, so finished tasks piled up held, unwritten,
    their leases heartbeaten: 1,445 in a long-horizon run, past the 1,000 that heartbeat_tasks
    takes, and their heartbeat refused. Now each pass writes what finished: a task is held from
    its claim until the pass after its handler returns."""
    add_tasks(conn, ROLE, add_stores(conn, 1500), 1)
    held: list[int] = []
    worker: Worker | None = None

    def handler(task: Task, ctx: TaskContext) -> Any:
        assert worker is not None
        held.append(len(worker._in_flight))

    worker = Worker(queue, ROLE, handler, worker_id="steady", concurrency=8, batch_size=50)
    stats = worker.run()
    assert (stats.completed, stats.lost) == (1500, 0)
    assert max(held) <= 2 * 8, sorted(held)[-5:]
    assert status_counts(conn) == {"completed": 1500}


def test_handler_errors_are_retried_then_failed(conn: psycopg.Connection, queue: TaskQueue):
    """A handler raising ValueError sends its task back to pending with a backoff (stats.retried);
    rerun after the backoff, it fails for good once max_retries retries are spent."""
    ids = add_loose_tasks(conn, 30)
    bad = {i for i in ids if i % 3 == 0}

    def handler(task: Task, ctx: TaskContext) -> Any:
        if task.id in bad:
            raise ValueError(f"menu of {task.id} unreadable")
        return task.id

    stats = Worker(queue, LOOSE, handler, worker_id="flaky").run()
    assert (stats.completed, stats.retried, stats.failed) == (20, 10, 0)
    pending = conn.execute(
        "SELECT id, retry_count, scheduled_for > now(), error_message FROM v_tasks WHERE status = 'pending'"
    ).fetchall()
    assert {r[0] for r in pending} == bad
    assert all(r[1] == 1 and r[2] for r in pending)
    assert all(r[3] == f"ValueError: menu of {r[0]} unreadable" for r in pending)
    # Not due yet: a run now finds nothing to do.
    assert Worker(queue, LOOSE, handler, worker_id="flaky").run().claimed == 0

    outcomes = []
    for _ in range(3):  # retries 2 and 3, then the final attempt
        make_due(conn)
        s = Worker(queue, LOOSE, handler, worker_id="flaky").run()
        outcomes.append((s.claimed, s.retried, s.failed))
    assert outcomes == [(10, 10, 0), (10, 10, 0), (10, 0, 10)]
    assert status_counts(conn) == {"completed": 20, "failed": 10}
    failed = conn.execute("SELECT DISTINCT retry_count FROM v_tasks WHERE status = 'failed'").fetchall()
    assert failed == [(3,)]
    assert registry(conn, "flaky") == ("offline", 20, 40)


def test_permanent_error_fails_at_once(conn: psycopg.Connection, queue: TaskQueue):
    """PermanentTaskError fails the task on the spot, no retry."""
    stores = add_stores(conn, 4)
    add_tasks(conn, ROLE, stores, 1)
    doomed = conn.execute("SELECT min(id) FROM v_tasks").fetchone()[0]

    def handler(task: Task, ctx: TaskContext) -> Any:
        if task.id == doomed:
            raise PermanentTaskError("store closed")
        return None

    stats = Worker(queue, ROLE, handler, worker_id="w").run()
    assert (stats.completed, stats.retried, stats.failed) == (3, 0, 1)
    t = queue.get(doomed)
    assert (t.status, t.retry_count) == ("failed", 0)
    assert "PermanentTaskError" in t.error_message and "store closed" in t.error_message
    assert status_counts(conn) == {"completed": 3, "failed": 1}


BAD_RESULTS = [
    pytest.param({1, 2}, id="set"),
    pytest.param(object(), id="object"),
    pytest.param({"when": time}, id="module"),
    pytest.param({"price": float("nan")}, id="nan"),
    pytest.param({"name": "bad\x00byte"}, id="nul-char"),
]


@pytest.mark.parametrize("bad_result", BAD_RESULTS)
def test_non_json_result_fails_its_task_only(conn: psycopg.Connection, queue: TaskQueue, bad_result: Any):
    """A handler result that cannot be stored as JSON fails that task (error mentions JSON, no
    retry); the other tasks complete and the run ends normally."""
    ids = add_loose_tasks(conn, 10)
    odd = ids[3]

    def handler(task: Task, ctx: TaskContext) -> Any:
        return bad_result if task.id == odd else {"ok": task.id}

    stats = Worker(queue, LOOSE, handler, worker_id="w").run()
    assert (stats.completed, stats.failed, stats.retried) == (9, 1, 0)
    t = queue.get(odd)
    assert (t.status, t.result, t.retry_count) == ("failed", None, 0)
    assert "JSON" in t.error_message
    assert status_counts(conn) == {"completed": 9, "failed": 1}
    assert registry(conn, "w") == ("offline", 9, 1)


@pytest.mark.parametrize("notice", ["handler-calls-heartbeat", "background-heartbeat"])
def test_cancelled_task_is_lost_and_its_result_discarded(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue, notice: str
):
    """A task cancelled while its handler runs: the next heartbeat flags ctx.lost, the handler
    sees it, the result is discarded (still cancelled, no result) and counted as lost."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    observed: list[bool] = []
    worker: Worker

    def handler(task: Task, ctx: TaskContext) -> Any:
        assert not ctx.lost
        with psycopg.connect(db_url, autocommit=True) as other:
            assert other.execute("SELECT cancel_task(%s)", (task.id,)).fetchone() == (True,)
        if notice == "handler-calls-heartbeat":
            assert worker.heartbeat() == {task.id}
        else:
            ctx.lease_lost.wait(10)  # the heartbeat thread sets it within one interval
        observed.append(ctx.lost)
        return {"would": "overwrite"}

    heartbeat_seconds = 30.0 if notice == "handler-calls-heartbeat" else 0.2
    worker = Worker(queue, ROLE, handler, worker_id="w", heartbeat_seconds=heartbeat_seconds)
    stats = worker.run()
    assert observed == [True]
    assert (stats.claimed, stats.completed, stats.failed, stats.retried, stats.lost) == (1, 0, 0, 0, 1)
    t = queue.get(task_id)
    assert (t.status, t.result) == ("cancelled", None)
    assert registry(conn, "w") == ("offline", 0, 0)


def test_result_of_task_recovered_mid_run_is_discarded(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """A task recovered (lease expired) while its handler runs, with no heartbeat in between: the
    worker's completion is refused and counted as lost; the retry's result is the one kept."""
    (store,) = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    attempts: list[int] = []

    def handler(task: Task, ctx: TaskContext) -> Any:
        attempts.append(task.retry_count)
        if len(attempts) == 1:
            with psycopg.connect(db_url, autocommit=True) as other:
                other.execute(
                    "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '20 minutes' WHERE id = %s",
                    (task.id,),
                )
                assert other.execute("SELECT recover_stale_tasks(10)").fetchone() == (1,)
        return {"attempt": len(attempts)}

    stats = Worker(queue, ROLE, handler, worker_id="w").run()
    assert attempts == [0, 1]
    assert (stats.claimed, stats.completed, stats.lost) == (2, 1, 1)
    t = queue.get(task_id)
    assert (t.status, t.result, t.retry_count, t.worker_id) == ("completed", {"attempt": 2}, 1, "w")
    assert registry(conn, "w") == ("offline", 1, 0)
    assert_store_state_consistent(conn)


def test_background_heartbeat_extends_running_leases(db_url: str, conn: psycopg.Connection, queue: TaskQueue):
    """While a handler runs, the heartbeat thread moves last_heartbeat_at past the claim time."""
    add_loose_tasks(conn, 1)
    observed: list[bool] = []

    def handler(task: Task, ctx: TaskContext) -> Any:
        with psycopg.connect(db_url, autocommit=True) as other:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                moved = other.execute(
                    "SELECT last_heartbeat_at > claimed_at FROM v_tasks WHERE id = %s", (task.id,)
                ).fetchone()[0]
                if moved:
                    break
                time.sleep(0.05)
        observed.append(moved)
        return None

    stats = Worker(queue, LOOSE, handler, worker_id="w", heartbeat_seconds=0.2).run()
    assert observed == [True]
    assert stats.completed == 1 and stats.lost == 0


@pytest.mark.parametrize("concurrency", [1, 4])
def test_time_budget_stops_claiming(conn: psycopg.Connection, queue: TaskQueue, concurrency: int):
    """Past its time budget the worker claims no more: some tasks are done, the rest are still
    pending and claimable, and nothing is left claimed or running."""
    ids = add_loose_tasks(conn, 1000)

    def handler(task: Task, ctx: TaskContext) -> Any:
        time.sleep(0.05)
        return None

    stats = Worker(
        queue, LOOSE, handler, worker_id="w", concurrency=concurrency, batch_size=5, time_budget_seconds=0.3
    ).run()
    counts = status_counts(conn)
    assert set(counts) == {"completed", "pending"}
    assert 0 < counts["completed"] < len(ids)
    assert stats.completed == stats.claimed == counts["completed"]
    assert len(queue.claim_many(LOOSE, "next", 5)) == 5
    assert registry(conn, "w")[0] == "offline"


def test_worker_can_run_again(conn: psycopg.Connection, queue: TaskQueue):
    """A second run() of the same Worker drains work added since, with stats of its own."""
    add_loose_tasks(conn, 5)
    worker = Worker(queue, LOOSE, lambda task, ctx: task.id, worker_id="again")
    assert worker.run().completed == 5
    assert registry(conn, "again") == ("offline", 5, 0)
    add_loose_tasks(conn, 3)
    second = worker.run()
    assert (second.claimed, second.completed) == (3, 3)
    assert status_counts(conn) == {"completed": 8}
    assert registry(conn, "again") == ("offline", 8, 0)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_an_idle_worker_stays_picks_up_new_work_and_ends_after_its_idle_limit(
    conn: psycopg.Connection, queue: TaskQueue, concurrency: int
):
    """A long-lived drain: with nothing to do it polls, takes work that arrives, and ends once it
    has claimed nothing for idle_exit_seconds (not when the queue is first empty)."""
    worker = Worker(
        queue,
        LOOSE,
        lambda task, ctx: {"ok": True},
        worker_id="long-lived",
        concurrency=concurrency,
        idle_poll_seconds=0.05,
        idle_exit_seconds=2.0,
        time_budget_seconds=60,
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        for _ in range(3):
            time.sleep(0.5)  # empty meanwhile: the worker stays
            assert thread.is_alive()
            [task_id] = add_loose_tasks(conn, 1)
            deadline = time.monotonic() + 10
            while conn.execute("SELECT status FROM v_tasks WHERE id = %s", (task_id,)).fetchone() != (
                "completed",
            ):
                assert time.monotonic() < deadline, "the idle worker did not take the new task"
                time.sleep(0.02)
            assert conn.execute("SELECT worker_id FROM v_tasks WHERE id = %s", (task_id,)).fetchone() == (
                "long-lived",
            )
        last = time.monotonic()
        thread.join(timeout=30)
        assert not thread.is_alive()
        # It ended by its idle limit, not its time budget, and not at the first empty poll (its
        # idle clock starts at its last claim, a little before this test saw the completion).
        assert 1.5 <= time.monotonic() - last < 30
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert worker.stats.completed == 3
    assert registry(conn, "long-lived")[0] == "offline"
