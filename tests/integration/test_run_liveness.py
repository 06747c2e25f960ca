"""A drain run whose process is killed gives back what it held at the next tick: its worker's
connection ended with it, and the server knows (the session lock of migration 0011). Dagster may
still say STARTED (a pod gone without a word): the sensor does not count such a run against its
role's cap, gives its tasks back, and the role gets a new run. Nothing here ages a heartbeat."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from tests.helpers import add_stores, add_tasks
from tq_pipelines.defs.jobs import drain_tasks_job, drain_worker_id
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.defs.sensors.queue import task_queue_sensor
from tq_pipelines.queue.api import QueueInputError, TaskQueue

ROLE = "product_resync"
ROOT = Path(__file__).resolve().parents[2]

RUN_WORKER = """
import sys, time
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.worker import Worker
url, worker_id = sys.argv[1:3]
Worker(TaskQueue.connect(url, max_size=4), "product_resync", lambda task, ctx: time.sleep(600),
       worker_id=worker_id, concurrency=2, batch_size=2, heartbeat_seconds=1).run()
"""


def _started_run(instance: dg.DagsterInstance) -> dg.DagsterRun:
    return instance.create_run_for_job(
        job_def=drain_tasks_job,
        run_config={"ops": {"drain_role_tasks": {"config": {"role": ROLE}}}},
        tags={"tq/role": ROLE},
        status=dg.DagsterRunStatus.STARTED,
    )


def _tick(instance: dg.DagsterInstance, db_url: str, cursor: str | None = None) -> dg.SensorResult:
    with dg.build_sensor_context(
        instance=instance, resources={"tq": QueueResource(database_url=db_url)}, cursor=cursor
    ) as ctx:
        return task_queue_sensor(ctx)


def _wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "timed out"
        time.sleep(0.05)


def _running_of(conn: psycopg.Connection, worker_id: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM worker_tasks WHERE worker_id = %s AND status IN ('claimed', 'running')",
        (worker_id,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_killed_drain_run_gives_its_tasks_back_at_the_next_tick(db_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 6), 1)
    with dg.instance_for_test() as instance:
        dead_run, live_run = _started_run(instance), _started_run(instance)
        dead_worker = drain_worker_id(ROLE, dead_run.run_id)
        live_worker = drain_worker_id(ROLE, live_run.run_id)
        procs = {
            w: subprocess.Popen([sys.executable, "-c", RUN_WORKER, db_url, w], cwd=ROOT)
            for w in (dead_worker, live_worker)
        }
        try:
            _wait_for(lambda: _running_of(conn, dead_worker) == 2 and _running_of(conn, live_worker) == 2)
            # Both alive: nothing given back, the role is at its cap of 2 runs.
            first = _tick(instance, db_url)
            assert first.run_requests == []
            assert _running_of(conn, dead_worker) == 2

            os.kill(procs[dead_worker].pid, signal.SIGKILL)
            procs[dead_worker].wait(timeout=30)
            killed_at = time.monotonic()
            # The server sees the connection end; no lease has expired (heartbeats are 1 s, the
            # shortest lease 10 s), so only the session can have told.
            _wait_for(
                lambda: (
                    conn.execute(
                        "SELECT session_alive FROM worker_sessions(ARRAY[%s]::VARCHAR[])", (dead_worker,)
                    ).fetchone()
                    == (False,)
                )
            )
            second = _tick(instance, db_url, first.cursor)
            tick_seconds = time.monotonic() - killed_at
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)

        assert tick_seconds < 10, "the tick came after the short lease: it proves nothing"
        assert _running_of(conn, dead_worker) == 0
        assert _running_of(conn, live_worker) == 2
        back = conn.execute(
            "SELECT count(*) FROM worker_tasks WHERE status = 'pending' AND retry_count = 1"
            " AND error_message LIKE %s",
            (f"worker {dead_worker} is gone%",),
        ).fetchone()
        assert back == (2,)
        assert conn.execute(
            "SELECT status FROM worker_registry WHERE worker_id = %s", (dead_worker,)
        ).fetchone() == ("offline",)
        # Dagster still says STARTED (nothing launched it): the run is not counted, the role gets
        # a run in its place.
        assert instance.get_run_by_id(dead_run.run_id).status == dg.DagsterRunStatus.STARTED  # type: ignore[union-attr]
        assert [r.tags["tq/role"] for r in second.run_requests] == [ROLE]
        assert all("dagster/max_runtime" in r.tags for r in second.run_requests)


def test_a_live_worker_named_as_dead_keeps_its_tasks(db_url: str, conn: psycopg.Connection):
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    with TaskQueue.connect(db_url) as queue:
        session = queue.open_session("live", ROLE, heartbeat_seconds=30)
        try:
            claimed = queue.claim_many(ROLE, "live", 2, start=True)
            assert len(claimed) == 2
            report = queue.release_dead_workers(["live", "nobody"])
            assert (report.workers_offline, report.recovered, report.failed) == (0, 0, 0)
            assert _running_of(conn, "live") == 2
            # Nor can another connection take its registration over.
            with pytest.raises(QueueInputError, match="alive on another connection") as refused:
                queue.open_session("live", ROLE, heartbeat_seconds=0.001)
            assert refused.value.sqlstate == "55P03"
            assert conn.execute(
                "SELECT heartbeat_seconds, status FROM worker_registry WHERE worker_id = 'live'"
            ).fetchone() == (30, "active")
        finally:
            session.close()
        # Ended in order (offline), its session gone a moment later: not taken for a dead worker,
        # whatever it left is its leases' to give back.
        _wait_for(lambda: queue.worker_liveness(["live"])["live"]["session_alive"] is False)
        assert queue.release_dead_workers(["live"]).workers_offline == 0


def test_a_dead_worker_is_released_from_its_active_tasks_alone(db_url: str, conn: psycopg.Connection):
    """0018: the sensor names every drain run's worker each tick; with none dead, nothing of
    worker_tasks is read (the statement before it scanned the whole table, history and all, on
    every call); a dead one's active tasks go back, once."""
    stores = add_stores(conn, 4)
    add_tasks(conn, ROLE, stores, 1)
    with TaskQueue.connect(db_url) as queue:
        done = queue.claim_many(ROLE, "other", 2, start=True)
        queue.complete_many({t.lease: None for t in done})  # history
        session = queue.open_session("doomed", ROLE, heartbeat_seconds=30)
        held = queue.claim_many(ROLE, "doomed", 2, start=True)
        assert len(held) == 2
        conn.execute("UPDATE worker_tasks SET retry_count = max_retries WHERE id = %s", (held[1].id,))

        conn.execute(
            "INSERT INTO worker_tasks (role, dispensary_id, status, completed_at)"
            " SELECT %s, s, 'completed', now() FROM unnest(%s::int[]) s, generate_series(1, 500)",
            (ROLE, stores),
        )
        conn.execute("ANALYZE worker_tasks")

        def seq_scans_of_release(worker_ids: list[str]) -> tuple[tuple, int]:
            with psycopg.connect(db_url) as c:
                for _ in range(6):  # as a sensor's connection: past the custom plans, the generic one
                    c.execute("SELECT * FROM release_dead_workers(%s)", (["nobody"],))
                c.commit()
                report = c.execute("SELECT * FROM release_dead_workers(%s)", (worker_ids,)).fetchone()
                (scans,) = c.execute(
                    "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'worker_tasks'"
                ).fetchone()
            return report, scans

        assert seq_scans_of_release(["doomed", "other"]) == ((0, 0, 0), 0)
        conn.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN worker_registry w ON l.objid = w.id::OID"
            " WHERE l.locktype = 'advisory' AND l.classid = 7471 AND l.objsubid = 2"
            " AND w.worker_id = 'doomed'"
        )
        _wait_for(lambda: queue.worker_liveness(["doomed"])["doomed"]["session_alive"] is False)
        assert seq_scans_of_release(["doomed", "other"])[0] == (1, 1, 1)
        assert seq_scans_of_release(["doomed"]) == ((0, 0, 0), 0)  # released once
        assert conn.execute(
            "SELECT id, status FROM worker_tasks WHERE id = ANY(%s) ORDER BY id", ([t.id for t in held],)
        ).fetchall() == sorted([(held[0].id, "pending"), (held[1].id, "failed")])
        with contextlib.suppress(psycopg.Error):
            session.close()  # its connection was the one terminated
