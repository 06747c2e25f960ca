"""A drain run whose process is killed is noticed and replaced: Dagster still says STARTED (the
local run launcher cannot tell), but its worker's heartbeats stopped, so task_queue_sensor marks
it failed, its tasks come back with their leases, and the role gets a new run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import psycopg

from tests.helpers import add_stores, add_tasks
from tq_pipelines.jobs import drain_tasks_job, drain_worker_id
from tq_pipelines.resources import QueueResource
from tq_pipelines.sensors.queue import task_queue_sensor

ROLE = "product_resync"
ROOT = Path(__file__).resolve().parents[2]

RUN_WORKER = """
import sys, time
from tq_pipelines.queue import TaskQueue
from tq_pipelines.worker import Worker
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


def _tick(instance: dg.DagsterInstance, db_url: str) -> dg.SensorResult:
    with dg.build_sensor_context(
        instance=instance, resources={"tq": QueueResource(database_url=db_url)}
    ) as ctx:
        return task_queue_sensor(ctx)


def _wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "timed out"
        time.sleep(0.05)


def test_a_killed_drain_run_is_marked_failed_and_replaced(db_url: str, conn: psycopg.Connection):
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
            _wait_for(
                lambda: (
                    conn.execute(
                        "SELECT count(DISTINCT worker_id) FROM worker_tasks WHERE status = 'running'"
                    ).fetchone()
                    == (2,)
                )
            )
            # Both alive: nothing marked, the role is at its cap of 2 runs.
            first = _tick(instance, db_url)
            assert first.run_requests == []
            assert instance.get_run_by_id(dead_run.run_id).status == dg.DagsterRunStatus.STARTED  # type: ignore[union-attr]

            os.kill(procs[dead_worker].pid, signal.SIGKILL)
            procs[dead_worker].wait(timeout=30)
            # Its silence, aged past the short lease (2.5 of its 1 s intervals, at least 10 s).
            conn.execute(
                "UPDATE worker_registry SET last_heartbeat_at = now() - interval '15 seconds'"
                " WHERE worker_id = %s",
                (dead_worker,),
            )
            conn.execute(
                "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '15 seconds'"
                " WHERE worker_id = %s",
                (dead_worker,),
            )
            second = _tick(instance, db_url)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)

        dead = instance.get_run_by_id(dead_run.run_id)
        assert dead is not None and dead.status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(live_run.run_id).status == dg.DagsterRunStatus.STARTED  # type: ignore[union-attr]
        # Its tasks came back in the same tick, and the role got a run in its place.
        assert conn.execute(
            "SELECT count(*) FROM worker_tasks WHERE worker_id = %s AND status = 'running'", (dead_worker,)
        ).fetchone() == (0,)
        assert [r.tags["tq/role"] for r in second.run_requests] == [ROLE]
        failure = [
            e
            for e in instance.all_logs(dead_run.run_id)
            if e.dagster_event and e.dagster_event.is_run_failure
        ]
        assert failure and "presumed dead" in (failure[0].dagster_event.message or "")  # type: ignore[union-attr]
