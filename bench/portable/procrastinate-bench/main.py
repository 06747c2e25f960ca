#!/usr/bin/env python3
"""procrastinate-bench: procrastinate under the long-horizon protocol of the portable benchmark
(CONTRIBUTING_ADAPTERS.md), with the same offered load, no-op work and effect table as
tq-bench. README.md beside this file says how to run it.

Adapted from procrastinate-bench/main.py of hardbyte/postgresql-job-queue-benchmarking
(MIT License, Copyright (c) 2026 Brian Thorne).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import sys
import threading
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import procrastinate
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchlib
from benchlib import env_float, env_int

SYSTEM = "procrastinate"
QUEUE = "procrastinate_longhorizon_bench"
EVENT_TABLES = [
    "public.procrastinate_jobs",
    "public.procrastinate_events",
    "public.procrastinate_workers",
    "public.bench_done",
]
SCHEMA_LOCK_KEY = 0x7072_6F63

URL = benchlib.database_url()
WORKER_COUNT = max(1, env_int("WORKER_COUNT", 32))
WORK_MS = env_float("JOB_WORK_MS", 1)
PAYLOAD_BYTES = env_int("JOB_PAYLOAD_BYTES", 256)
PRODUCERS = max(1, env_int("PRODUCER_CONNECTIONS", 2))
# The worker's heartbeat and the age after which a silent worker's jobs are retried (the
# harness's own procrastinate adapter uses 5 s and 15 s).
HEARTBEAT_S = env_float("PROCRASTINATE_HEARTBEAT_S", 5)
STALLED_S = env_float("PROCRASTINATE_STALLED_S", 15)
MAINTENANCE_S = env_float("BENCH_MAINTENANCE_S", 5)

stop = threading.Event()
# Set by run(): what the handler, the producers and the pollers report to.
S = SimpleNamespace()


def log(message: str) -> None:
    benchlib.log(SYSTEM, message)


app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(
        conninfo=URL, min_size=1, max_size=WORKER_COUNT + PRODUCERS + 4, timeout=5
    )
)


@app.task(queue=QUEUE, name="long_horizon_job", pass_context=True)
async def bench_job(context: procrastinate.JobContext, created_at_iso: str, padding: str = "") -> None:
    began = dt.datetime.now(dt.UTC)
    created = dt.datetime.fromisoformat(created_at_iso)
    S.telemetry.pickup.record((began - created).total_seconds() * 1000)
    if WORK_MS > 0:
        await asyncio.sleep(WORK_MS / 1000)
    # The effect, in a transaction of its own: procrastinate finishes the job afterwards, in
    # another one (at least once).
    assert context.job.id is not None
    await context.app.connector.execute_query_async(
        "INSERT INTO bench_done (task_id, at) VALUES (%(task_id)s, now())", task_id=context.job.id
    )
    S.telemetry.add("completed")
    S.telemetry.end_to_end.record((dt.datetime.now(dt.UTC) - created).total_seconds() * 1000)


async def setup() -> None:
    """procrastinate's own schema (``apply_schema_async``, which is not idempotent: applied once,
    under an advisory lock, when its table is missing) and the effect table."""
    deadline = time.monotonic() + 60
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
                await conn.execute("SELECT pg_advisory_lock(%s)", (SCHEMA_LOCK_KEY,))
                try:
                    cur = await conn.execute("SELECT to_regclass('public.procrastinate_jobs')")
                    row = await cur.fetchone()
                    if row is None or row[0] is None:
                        await app.schema_manager.apply_schema_async()
                        log("applied procrastinate's schema")
                    await conn.execute(benchlib.BENCH_DONE_DDL)
                finally:
                    await conn.execute("SELECT pg_advisory_unlock(%s)", (SCHEMA_LOCK_KEY,))
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise
            log(f"setup: database unreachable ({exc}); retrying")
            await asyncio.sleep(1)


def build_worker() -> procrastinate.worker.Worker:
    return app._worker(
        queues=[QUEUE],
        concurrency=WORKER_COUNT,
        wait=True,
        fetch_job_polling_interval=0.05,
        abort_job_polling_interval=0.05,
        listen_notify=True,
        delete_jobs="never",
        install_signal_handlers=False,
        update_heartbeat_interval=HEARTBEAT_S,
        stalled_worker_timeout=STALLED_S,
    )


async def consumer() -> None:
    backoff = 0.5
    while not stop.is_set():
        worker = build_worker()
        task = asyncio.create_task(worker.run())
        try:
            while not stop.is_set() and not task.done():
                await asyncio.sleep(0.1)
            if stop.is_set():
                worker.stop()
                try:
                    await asyncio.wait_for(task, 3)
                except (TimeoutError, Exception):
                    task.cancel()
                return
            task.result()
            backoff = 0.5
        except Exception as exc:
            S.telemetry.add("worker_restarts")
            reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            log(f"worker failed ({reason}); a new one in {backoff:.1f} s")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


async def producer(index: int, wake: asyncio.Event) -> None:
    deferrer = bench_job.configure(queue=QUEUE)
    padding = "x" * max(0, PAYLOAD_BYTES - 64)
    backoff = 0.1
    while not stop.is_set():
        if not S.backlog.take(1, 0):
            wake.clear()
            if not S.backlog.pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 0.25)
            continue
        began = time.monotonic()
        try:
            await deferrer.defer_async(created_at_iso=benchlib.now_iso(), padding=padding)
            S.telemetry.enqueue_call.record((time.monotonic() - began) * 1000)
            S.telemetry.add("enqueued")
            backoff = 0.1
        except Exception as exc:
            S.telemetry.add("enqueue_failed")
            log(f"producer {index}: defer failed ({type(exc).__name__}: {str(exc).strip()[:200]})")
            until = time.monotonic() + backoff
            while time.monotonic() < until and not stop.is_set():
                S.telemetry.add("enqueue_failed", S.backlog.drain())
                await asyncio.sleep(0.05)
            backoff = min(backoff * 2, 2.0)


async def maintenance() -> None:
    """procrastinate's documented recipe for jobs of dead workers: retry the stalled jobs (those
    whose worker has sent no heartbeat for STALLED_S) every few seconds."""
    while not stop.is_set():
        try:
            stalled = await app.job_manager.get_stalled_jobs(queue=QUEUE, seconds_since_heartbeat=STALLED_S)
            for job in stalled:
                await app.job_manager.retry_job(job)
            if stalled:
                log(f"retried {len(stalled)} stalled jobs")
        except Exception as exc:
            log(f"maintenance failed ({type(exc).__name__}: {str(exc).strip()[:200]})")
        await asyncio.sleep(MAINTENANCE_S)


async def depth_poller(load: benchlib.OfferedLoad) -> None:
    if benchlib.instance_id() != 0 and load.mode != "depth-target":
        return
    while not stop.is_set():
        try:
            row = await app.connector.execute_query_one_async(
                "SELECT count(*) AS n FROM procrastinate_jobs WHERE queue_name = %(queue)s "
                "AND status = 'todo' AND (scheduled_at IS NULL OR scheduled_at <= now())",
                queue=QUEUE,
            )
            S.telemetry.depth = int(row["n"])
        except Exception:
            pass
        await asyncio.sleep(0.2 if load.mode == "depth-target" else 1.0)


async def run() -> int:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def offer(n: int) -> None:
        backlog.add(n)
        loop.call_soon_threadsafe(wake.set)

    load = benchlib.OfferedLoad(offer, stop, lambda: telemetry.depth)
    backlog = benchlib.Backlog(max(1000, int((load.rate if load.mode == "fixed" else 1000) * 10)))
    emitter = benchlib.Emitter(SYSTEM)
    telemetry = benchlib.Telemetry(emitter, load, backlog)
    S.backlog, S.telemetry = backlog, telemetry
    async with app.open_async():
        await setup()
        if os.environ.get("SCENARIO", "long_horizon") == "migrate_only":
            log("migrate_only: done")
            return 0
        emitter.descriptor(
            event_tables=EVENT_TABLES,
            extensions=[],
            version=version("procrastinate"),
            schema_version=version("procrastinate"),
            db_name=(urlparse(URL).path or "/").lstrip("/") or "procrastinate_bench",
            worker_count=WORKER_COUNT,
            producer_mode=load.mode,
            producer_pacing="harness" if load.harness_paced else "adapter",
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.create_task(consumer()),
            asyncio.create_task(maintenance()),
            asyncio.create_task(depth_poller(load)),
            *(asyncio.create_task(producer(i, wake)) for i in range(PRODUCERS)),
        ]
        telemetry.start(stop)
        load.start()
        log(f"running: {WORKER_COUNT} workers, producer {load.mode}")
        while not stop.is_set():
            await asyncio.sleep(0.1)
        # SIGTERM: the worker finishes what runs (3 s at most); out within 5 s.
        await asyncio.wait(tasks, timeout=3.5)
        log("stopped")
        # Closing the pool could wait on a dead server: the exit does not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main() -> None:
    try:
        code = asyncio.run(run())
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
