"""Short leases and true times: a killed worker's stores come back within a few of its heartbeat
intervals, a live one keeps its leases however long its handlers run, and recorded durations
are the handlers' own, inline or pooled."""

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker

ROLE = "product_resync"
ROOT = Path(__file__).resolve().parents[2]

SLEEPER = """
import sys, time
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.worker import Worker
url, worker_id = sys.argv[1:3]
queue = TaskQueue.connect(url, max_size=4)
Worker(queue, "product_resync", lambda task, ctx: time.sleep(600), worker_id=worker_id,
       concurrency=4, batch_size=4, heartbeat_seconds=1).run()
"""


def _wait_for(predicate, timeout: float = 20.0, step: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "timed out"
        time.sleep(step)
    return time.monotonic() - began


def _running(conn: psycopg.Connection, worker_id: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM v_tasks WHERE worker_id = %s AND status = 'running'", (worker_id,)
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_killed_workers_stores_come_back_within_a_few_heartbeats(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    stores = add_stores(conn, 4)
    add_tasks(conn, ROLE, stores, 1)
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, db_url, "doomed"], cwd=ROOT)
    try:
        _wait_for(lambda: _running(conn, "doomed") == 4)
        time.sleep(1.5)  # heartbeats flowing: the leases are alive, nothing expires
        assert queue.expire_leases(min_seconds=2).recovered == 0
        assert _running(conn, "doomed") == 4
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed = time.monotonic()

    # The sweep the sensor runs every tick: 2.5 of the worker's 1 s intervals, at least 2 s.
    def back() -> bool:
        return queue.expire_leases(min_seconds=2).recovered > 0 or _running(conn, "doomed") == 0

    _wait_for(back, timeout=20, step=0.2)
    unblocked = time.monotonic() - killed
    assert unblocked < 5, f"stores blocked {unblocked:.1f} s after the kill"
    rows = conn.execute("SELECT status, retry_count, error_message FROM v_tasks").fetchall()
    assert {(s, r) for s, r, _ in rows} == {("pending", 1)}
    assert all(e.startswith("lease expired: worker doomed silent for over") for _, _, e in rows)
    assert len(queue.claim_many(ROLE, "next", 10)) == 4  # every store claimable again
    assert_store_state_consistent(conn)


def test_a_live_worker_keeps_its_leases_through_long_handlers(conn: psycopg.Connection, queue: TaskQueue):
    """Handlers that run for several lease lengths keep their tasks: the heartbeat extends them,
    and the sweep (run here all along) expires none."""
    stores = add_stores(conn, 3)
    add_tasks(conn, ROLE, stores, 1)
    stop = threading.Event()
    expired: list[int] = []

    def sweep() -> None:
        while not stop.wait(0.2):
            expired.append(queue.expire_leases(min_seconds=2).recovered)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        stats = Worker(
            queue,
            ROLE,
            lambda task, ctx: time.sleep(4),
            worker_id="alive",
            concurrency=3,
            heartbeat_seconds=0.5,
        ).run()
    finally:
        stop.set()
        sweeper.join()
    assert len(expired) >= 10 and sum(expired) == 0, expired
    assert (stats.completed, stats.lost, stats.retried) == (3, 0, 0)
    assert conn.execute(
        "SELECT count(*) FROM v_tasks"
        " WHERE status = 'completed' AND retry_count = 0 AND error_message IS NULL"
    ).fetchone() == (3,)


@pytest.mark.parametrize(("concurrency", "tasks", "seconds"), [(1, 5, 0.2), (4, 8, 0.3)])
def test_recorded_durations_are_the_handlers(
    conn: psycopg.Connection, queue: TaskQueue, concurrency: int, tasks: int, seconds: float
):
    """Inline, a batch's tasks run one after another and are completed together; pooled, several
    at once: either way started_at and completed_at bracket each handler, so the durations, the
    hourly rollup and the starts' spacing are the truth (within 10%)."""
    stores = add_stores(conn, tasks)
    add_tasks(conn, ROLE, stores, 1)

    def handler(task: Task, ctx: TaskContext) -> None:
        time.sleep(seconds)

    Worker(queue, ROLE, handler, worker_id="timed", concurrency=concurrency, batch_size=tasks).run()
    rows = conn.execute(
        "SELECT extract(EPOCH FROM started_at)::float8, extract(EPOCH FROM completed_at - started_at)::float8"
        " FROM v_tasks ORDER BY started_at"
    ).fetchall()
    assert len(rows) == tasks
    for _, duration in rows:
        assert duration == pytest.approx(seconds, rel=0.1)
    if concurrency == 1:
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows)]
        assert all(g == pytest.approx(seconds, rel=0.15) for g in gaps), gaps
    now = datetime.now(UTC)
    queue.refresh_completion_log(now.date(), now.hour)
    [row] = [r for r in queue.completion_log(now.date(), now.hour) if r["role"] == ROLE]
    assert float(row["avg_duration_sec"]) == pytest.approx(seconds, rel=0.1)


def test_a_completed_task_carries_no_error_of_an_earlier_attempt(conn: psycopg.Connection, queue: TaskQueue):
    [store] = add_stores(conn, 1)
    task_id = queue.enqueue(ROLE, store)
    [task] = queue.claim_many(ROLE, "w", 1)
    assert queue.fail(task, "HTTP 503 for the menu") == "pending"
    conn.execute("UPDATE worker_tasks SET scheduled_for = now() WHERE id = %s", (task_id,))
    [again] = queue.claim_many(ROLE, "w", 1)
    assert again.id == task_id and again.lease_token != task.lease_token
    assert queue.complete_many({again.lease: {"ok": True}}) == {task_id}
    row = conn.execute("SELECT status, retry_count, error_message FROM v_tasks").fetchone()
    assert row == ("completed", 1, None)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_drain_estimate_is_the_time_the_rest_takes(
    conn: psycopg.Connection, queue: TaskQueue, concurrency: int
):
    """v_worker_capacity's time to drain, from a first part of the work, against the time the
    rest then really takes (within 10%), inline and with four handlers at once."""
    stores = add_stores(conn, 24)
    add_tasks(conn, ROLE, stores, 1)

    def handler(task: Task, ctx: TaskContext) -> None:
        time.sleep(0.2)

    # The first half, and the estimate for the rest while a worker holds a task (active).
    Worker(
        queue,
        ROLE,
        handler,
        worker_id="first",
        concurrency=concurrency,
        batch_size=4,
        time_budget_seconds=0.01,
    ).run()
    done_first = conn.execute("SELECT count(*) FROM v_tasks WHERE status = 'completed'").fetchone()[0]  # type: ignore[index]
    while done_first < 12:
        Worker(
            queue,
            ROLE,
            handler,
            worker_id="first",
            concurrency=concurrency,
            batch_size=4,
            time_budget_seconds=0.01,
        ).run()
        done_first = conn.execute("SELECT count(*) FROM v_tasks WHERE status = 'completed'").fetchone()[0]  # type: ignore[index]
    [held] = queue.claim_many(ROLE, "holder", 1)
    [cap] = [c for c in queue.capacity() if c.role == ROLE]
    assert cap.estimated_hours_to_drain is not None
    estimate = cap.estimated_hours_to_drain * 3600
    assert queue.complete_many({held.lease: None}) == {held.id}

    began = time.monotonic()
    Worker(queue, ROLE, handler, worker_id="rest", concurrency=concurrency, batch_size=4).run()
    truth = time.monotonic() - began
    assert estimate == pytest.approx(truth, rel=0.1), (estimate, truth)
