"""PostgreSQL stopped under a drain and started again: the run fails cleanly with the real cause
(the database went away), nothing is lost, and once the server is back the tasks complete
exactly once. The server is one this test starts itself, never the one of the suite."""

import os
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.helpers import (
    add_stores,
    add_tasks,
    assert_platform_counters_consistent,
    assert_store_state_consistent,
    status_counts,
)
from tq_pipelines.db import embedded
from tq_pipelines.db.migrate import migrate
from tq_pipelines.queue.api import PlatformLimits, Task, TaskQueue
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


def test_hand_offs_lost_in_a_crash_lose_no_task_and_leave_the_slots_counted(own_server):  # type: ignore[no-untyped-def]
    """0025: hand-offs commit without waiting for their WAL flush. The server is killed -9 right
    after a run of them, the WAL writer held back so that the last are not yet written: whatever
    the crash took, it took whole hand-offs. The slot counters agree with the tasks, each slot is
    with one task of its chain, and every task then completes exactly once."""
    pgdata, url = own_server
    migrate(url)
    stores, slots = 200, 4
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        conn.execute("ALTER SYSTEM SET wal_writer_flush_after = '1GB'")
        conn.execute("SELECT pg_reload_conf()")
        add_tasks(conn, ROLE, add_stores(conn, stores), 1)
    queue = TaskQueue.connect(url, max_size=slots)
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=slots, requests_per_second=10_000)])
    held = queue.claim_many(ROLE, "before", slots, start=True)
    # Flushed: from here on only the hand-offs write, none of them waits for a flush, and the
    # WAL writer writes only full pages of them (what it wrote survives a kill -9; the rest not).
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    seen: list[int] = []  # tasks a hand-off gave the client

    def hand_on(task: Task) -> None:
        for _ in range(20):
            nxt = queue.platform_handoff(task)
            if nxt is None:
                return
            seen.append(nxt.id)
            task = nxt

    threads = [threading.Thread(target=hand_on, args=(t,)) for t in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 20 * slots
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    children = [int(p) for p in Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()]
    for pid in [postmaster, *children]:
        os.kill(pid, signal.SIGKILL)
    queue.close()

    url = embedded.start(pgdata)
    with psycopg.connect(url, autocommit=True) as conn:
        running = {r[0] for r in conn.execute("SELECT id FROM v_tasks WHERE status = 'running'").fetchall()}
        # Each chain stands at one of its tasks: the last hand-off the crash left, or the claim.
        assert len(running) == slots and running <= {t.id for t in held} | set(seen), running
        assert_platform_counters_consistent(conn)
        assert_store_state_consistent(conn)
        conn.execute(
            "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '5 minutes'"
            " WHERE status IN ('claimed', 'running')"
        )
        with TaskQueue.connect(url) as again:
            again.expire_leases(min_seconds=1)
            stats = Worker(again, ROLE, lambda task, ctx: {"ok": task.id}, worker_id="after").run()
        assert stats.completed == stores
        assert status_counts(conn) == {"completed": stores}
        assert conn.execute("SELECT count(DISTINCT id) FROM v_tasks").fetchone() == (stores,)
        assert_platform_counters_consistent(conn)
