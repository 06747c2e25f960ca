"""PostgreSQL stopped under a drain and started again: the run fails cleanly with the real cause
(the database went away), nothing is lost, and once the server is back the tasks complete
exactly once. The server is one this test starts itself, never the one of the suite."""

import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.helpers import add_stores, add_tasks
from tq_pipelines.db import embedded
from tq_pipelines.db.migrate import migrate
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker

ROLE = "product_resync"


@pytest.fixture
def own_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    pgdata = tmp_path / "pgdata"
    url = embedded.start(pgdata)
    yield pgdata, url
    embedded.stop(pgdata)


def test_a_drain_survives_its_database_going_away_and_coming_back(own_server):  # type: ignore[no-untyped-def]
    pgdata, url = own_server
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        add_tasks(conn, ROLE, add_stores(conn, 40), 1)
    began = threading.Event()

    def handler(task: Task, ctx: TaskContext) -> dict:
        began.set()
        time.sleep(0.05)
        return {"ok": task.id}

    queue = TaskQueue.connect(url, max_size=2)
    # Short pool waits: the first call after the server is gone fails within seconds.
    queue.pool.timeout = 3.0
    failure: list[BaseException] = []

    def drain() -> None:
        try:
            Worker(queue, ROLE, handler, worker_id="before", batch_size=5, stop_grace_seconds=1).run()
        except BaseException as exc:
            failure.append(exc)

    runner = threading.Thread(target=drain)
    runner.start()
    assert began.wait(20)
    time.sleep(0.2)
    assert embedded.stop(pgdata)
    runner.join(60)
    assert not runner.is_alive()
    queue.close()
    [error] = failure
    # The cause it reports is the database's absence, not what stopping met after it.
    text = f"{type(error).__name__}: {error}"
    assert (
        isinstance(error, psycopg.OperationalError | psycopg.errors.AdminShutdown) or "PoolTimeout" in text
    ), text

    url = embedded.start(pgdata)
    with psycopg.connect(url, autocommit=True) as conn:
        # Whatever the dead run held comes back with its lease (aged here: its heartbeats stopped).
        conn.execute(
            "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '5 minutes'"
            " WHERE status IN ('claimed', 'running')"
        )
        with TaskQueue.connect(url) as again:
            again.expire_leases(min_seconds=1)
            stats = Worker(again, ROLE, handler, worker_id="after").run()
        counts = dict(conn.execute("SELECT status, count(*) FROM v_tasks GROUP BY status").fetchall())
        assert counts == {"completed": 40}, counts
        assert (
            stats.completed
            + conn.execute("SELECT count(*) FROM v_tasks WHERE worker_id = 'before'").fetchone()[0]
            == 40
        )  # type: ignore[index]
