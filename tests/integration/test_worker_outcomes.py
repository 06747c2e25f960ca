"""No input of a handler can crash the worker: error texts with NUL characters, a megabyte of
error, progress notes that cannot be stored. Each such task ends with a storable error, the rest
of its batch is recorded, and no store stays blocked."""

from typing import Any

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.queue.api import MAX_TEXT_CHARS, PlatformLimits, Task, TaskQueue, storable_text
from tq_pipelines.queue.worker import PermanentTaskError, TaskContext, TransientTaskError, Worker

ROLE = "product_resync"
MEGABYTE = "x" * 1_000_000


def test_storable_text_drops_nul_and_marks_the_cut():
    assert storable_text("a\x00b") == "ab"
    assert storable_text("short") == "short"
    cut = storable_text("y" * 10_000, 100)
    assert len(cut) == 100
    assert cut.startswith("yyyy") and cut.endswith("[... cut: 9,900 more characters]")


@pytest.mark.parametrize("concurrency", [1, 4])
def test_handler_inputs_that_cannot_be_stored_cost_only_their_own_task(
    conn: psycopg.Connection, queue: TaskQueue, concurrency: int
):
    stores = add_stores(conn, 12)
    add_tasks(conn, ROLE, stores, 1)
    ids = [r[0] for r in conn.execute("SELECT id FROM v_tasks ORDER BY id").fetchall()]
    poison = {
        ids[0]: lambda ctx: (_ for _ in ()).throw(PermanentTaskError("HTTP 404: body \x00 with a NUL")),
        ids[1]: lambda ctx: (_ for _ in ()).throw(TransientTaskError("upstream said: " + MEGABYTE)),
        ids[2]: lambda ctx: (ctx.progress("fetched \x00 page", note=MEGABYTE), 1 / 0),
        ids[3]: lambda ctx: (_ for _ in ()).throw(RuntimeError("\x00" * 20_000)),
    }

    def handler(task: Task, ctx: TaskContext) -> Any:
        if task.id in poison:
            poison[task.id](ctx)
        return {"ok": task.id}

    stats = Worker(queue, ROLE, handler, worker_id="w", concurrency=concurrency, batch_size=12).run()
    assert (stats.claimed, stats.completed, stats.lost) == (12, 8, 0)
    assert (stats.failed, stats.retried) == (1, 3)  # the 404 fails at once, the others retry

    rows = dict(
        conn.execute("SELECT id, error_message FROM v_tasks WHERE id = ANY(%s)", (list(poison),)).fetchall()
    )
    for task_id, error in rows.items():
        assert "\x00" not in error, task_id
        assert len(error) <= MAX_TEXT_CHARS, (task_id, len(error))
    assert rows[ids[0]] == "PermanentTaskError: HTTP 404: body  with a NUL"
    assert rows[ids[1]].startswith("TransientTaskError: upstream said: xxx")
    assert rows[ids[1]].endswith("more characters]")
    assert rows[ids[2]].startswith("ZeroDivisionError: division by zero (after: ")
    assert "fetched" in rows[ids[2]] and "more characters]" in rows[ids[2]]
    assert rows[ids[3]].startswith("RuntimeError: ")
    # Nothing left running, no store blocked: the tasks to retry are pending, the rest done.
    assert status_counts(conn) == {"completed": 8, "failed": 1, "pending": 3}
    assert conn.execute(
        "SELECT count(*) FROM worker_task_stores WHERE active_task_id IS NOT NULL"
    ).fetchone() == (0,)
    assert_store_state_consistent(conn)


def test_a_platform_error_text_with_nul_is_stored(conn: psycopg.Connection, queue: TaskQueue):
    """The breaker's last error is stored the same way (a 5xx body can hold anything)."""
    queue.sync_platform_limits([PlatformLimits("p", 2, 10.0)])
    [store] = add_stores(conn, 1, platform="p")
    queue.enqueue(ROLE, store)
    [task] = queue.claim_many(ROLE, "w", 1, start=True)
    assert task.platform == "p"
    assert queue.platform_error(task, "HTTP 500: \x00" + MEGABYTE) is None
    [(error, errors)] = conn.execute(
        "SELECT last_error, errors_total FROM tq_platforms WHERE platform = 'p'"
    ).fetchall()
    assert errors == 1, "the error was not counted"
    assert "\x00" not in error and len(error) <= 1000
    assert error.startswith("HTTP 500: xxx")
    assert queue.complete(task)
