"""Many connections at once, then an audit of the table: no double claim, one active task per
store, no lost task."""

import threading
from collections import Counter

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks, assert_store_state_consistent, status_counts
from tq_pipelines.queue.api import TaskQueue

WORKERS = 32
STORES = 200
PER_STORE = 100


def _overlaps(db_url: str, stop: threading.Event, seen: list[tuple[int, int]]) -> None:
    """Watch for two active tasks of one store while the workers run."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        while not stop.wait(0.005):
            seen.extend(
                conn.execute(
                    """
                    SELECT dispensary_id, count(*) FROM v_tasks
                    WHERE status IN ('claimed', 'running') AND dispensary_id IS NOT NULL
                    GROUP BY dispensary_id HAVING count(*) > 1
                    """
                ).fetchall()
            )


@pytest.mark.parametrize(
    ("batch", "per_store", "start"),
    [
        pytest.param(1, 10, False, id="claim_task-style, 2000 tasks"),
        pytest.param(8, PER_STORE, False, id="claim_tasks, 20000 tasks"),
        pytest.param(8, PER_STORE, True, id="claim_tasks with start, 20000 tasks"),
    ],
)
def test_32_workers_drain_adjacent_tasks_exactly_once(
    db_url: str, conn: psycopg.Connection, batch: int, per_store: int, start: bool
):
    stores = add_stores(conn, STORES)
    total = add_tasks(conn, "product_resync", stores, per_store, adjacent=True)
    claimed: list[list[int]] = [[] for _ in range(WORKERS)]
    completed: list[list[int]] = [[] for _ in range(WORKERS)]
    errors: list[BaseException] = []
    overlaps: list[tuple[int, int]] = []
    stop = threading.Event()

    with TaskQueue.connect(db_url, min_size=WORKERS, max_size=WORKERS) as queue:

        def work(n: int) -> None:
            worker_id = f"w{n}"
            try:
                while True:
                    if batch == 1:
                        task = queue.claim("product_resync", worker_id)
                        tasks = [task] if task else []
                    else:
                        tasks = queue.claim_many("product_resync", worker_id, batch, start=start)
                    if not tasks:
                        return
                    ids = [t.id for t in tasks]
                    claimed[n].extend(ids)
                    assert len({t.dispensary_id for t in tasks}) == len(tasks)
                    assert {t.status for t in tasks} == {"running" if start else "claimed"}
                    if not start:
                        assert queue.start_many(tasks) == set(ids)
                    done = queue.complete_many({t.lease: {"by": worker_id} for t in tasks})
                    completed[n].extend(done)
            except BaseException as exc:
                errors.append(exc)

        watcher = threading.Thread(target=_overlaps, args=(db_url, stop, overlaps))
        watcher.start()
        threads = [threading.Thread(target=work, args=(n,)) for n in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()

    assert errors == []
    assert overlaps == []
    all_claimed = Counter(i for ids in claimed for i in ids)
    assert len(all_claimed) == total
    assert max(all_claimed.values()) == 1, "a task was claimed twice"
    assert sum(len(c) for c in completed) == total
    assert status_counts(conn) == {"completed": total}
    by_owner = conn.execute("SELECT count(*) FROM v_tasks WHERE result->>'by' <> worker_id").fetchone()
    assert by_owner == (0,)
    assert_store_state_consistent(conn)
    assert conn.execute("SELECT count(*) FROM worker_task_heads").fetchone() == (0,)
