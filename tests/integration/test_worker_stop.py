"""Stopping in the right order: stop() ends the claims, heartbeats go on while handlers finish,
what outlives the grace period is given back (its late writes refused), and the error a run
reports is its first."""

import threading
import time

import psycopg
import psycopg_pool
import pytest

from tests.helpers import add_stores, add_tasks, status_counts
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import LeaseLostError, TaskContext, Worker

ROLE = "product_resync"


class _StopWhenStarted:
    """Calls ``worker.stop()`` from another thread as soon as ``count`` handlers have begun: the
    stop lands while they run, however long the claim before them took (a loaded server)."""

    def __init__(self, worker: Worker, count: int) -> None:
        self.count = count
        self.started = 0
        self._lock = threading.Lock()
        self._reached = threading.Event()
        self._thread = threading.Thread(target=self._stop, args=(worker,), daemon=True)
        self._thread.start()

    def began(self) -> None:
        """Called by each handler as it begins."""
        with self._lock:
            self.started += 1
            if self.started == self.count:
                self._reached.set()

    def _stop(self, worker: Worker) -> None:
        if self._reached.wait(60):
            worker.stop()


def test_stop_lets_running_handlers_finish_with_their_leases_alive(
    conn: psycopg.Connection, queue: TaskQueue
):
    add_tasks(conn, ROLE, add_stores(conn, 6), 1)
    expired: list[int] = []
    done = threading.Event()

    def sweep() -> None:  # the sensor's short lease, all along: 2.5 x 0.4 s, at least 1 s
        while not done.wait(0.1):
            expired.append(queue.expire_leases(min_seconds=1).recovered)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()

    def handler(task: Task, ctx: TaskContext) -> None:
        stopper.began()
        time.sleep(3)

    worker = Worker(
        queue,
        ROLE,
        handler,
        worker_id="w",
        concurrency=2,
        batch_size=2,
        heartbeat_seconds=0.4,
    )
    stopper = _StopWhenStarted(worker, 2)
    try:
        stats = worker.run()
    finally:
        done.set()
        sweeper.join()
    assert sum(expired) == 0, "a lease expired while its handler ran after stop()"
    assert (stats.claimed, stats.completed, stats.lost) == (2, 2, 0)
    assert status_counts(conn) == {"completed": 2, "pending": 4}  # no claim after stop()
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE retry_count > 0").fetchone() == (0,)


def test_handlers_past_the_grace_period_are_given_back_and_their_writes_refused(
    conn: psycopg.Connection, queue: TaskQueue
):
    conn.execute("CREATE TABLE effects (task_id INTEGER NOT NULL)")
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    refused: list[int] = []
    finished = threading.Event()

    def handler(task: Task, ctx: TaskContext) -> None:
        stopper.began()
        time.sleep(2)
        try:
            with ctx.transaction() as cur:
                cur.execute("INSERT INTO effects (task_id) VALUES (%s)", (task.id,))
                ctx.complete(cur, {"late": True})
        except LeaseLostError:
            refused.append(task.id)
        finally:
            if len(refused) == 2:
                finished.set()

    worker = Worker(queue, ROLE, handler, worker_id="w", concurrency=2, stop_grace_seconds=0.3)
    stopper = _StopWhenStarted(worker, 2)
    stats = worker.run()
    assert stats.deferred == 2
    rows = conn.execute("SELECT status, retry_count, worker_id FROM v_tasks").fetchall()
    assert rows == [("pending", 0, None)] * 2  # given back untried
    assert finished.wait(10), "the late handlers did not run into the fence"
    assert conn.execute("SELECT count(*) FROM effects").fetchone() == (0,)


def test_inline_stop_gives_back_the_rest_of_the_batch_untried(conn: psycopg.Connection, queue: TaskQueue):
    add_tasks(conn, ROLE, add_stores(conn, 5), 1)

    def handler(task: Task, ctx: TaskContext) -> None:
        stopper.began()
        time.sleep(0.3)

    worker = Worker(queue, ROLE, handler, worker_id="w", batch_size=5)
    stopper = _StopWhenStarted(worker, 2)  # stopped during the batch's second task
    stats = worker.run()
    assert (stats.claimed, stats.completed, stats.deferred) == (5, 2, 3)
    assert status_counts(conn) == {"completed": 2, "pending": 3}
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE retry_count > 0").fetchone() == (0,)


def test_the_error_a_run_reports_is_its_first(db_url: str, conn: psycopg.Connection):
    """The queue's pool closes under the worker (as when its database goes away): the run fails
    with that error, not with what stopping afterwards met (recording, giving back,
    deregistering, all on the same closed pool)."""
    add_tasks(conn, ROLE, add_stores(conn, 4), 1)
    queue = TaskQueue.connect(db_url, max_size=4)

    def handler(task: Task, ctx: TaskContext) -> None:
        queue.pool.close()

    with pytest.raises(psycopg_pool.PoolClosed) as raised:
        Worker(queue, ROLE, handler, worker_id="w", batch_size=1, stop_grace_seconds=0.5).run()
    # The first call after the handler was recording its completion.
    assert any("_record" in str(tb.name) for tb in raised.traceback), raised.traceback
