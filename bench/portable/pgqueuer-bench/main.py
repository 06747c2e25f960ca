#!/usr/bin/env python3
"""pgqueuer-bench: pgqueuer under the long-horizon protocol of the portable benchmark
(hardbyte/postgresql-job-queue-benchmarking, CONTRIBUTING_ADAPTERS.md), with the same offered
load, no-op work and effect table as tq-bench. README.md beside this file says how to run it.

pgqueuer's public API only: ``Queries.install`` / ``Queries.enqueue`` for the schema and the
producer, a ``QueueManager`` with one entrypoint for the consumer, over psycopg's async driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import psycopg
from pgqueuer import Job, Queries, QueueManager
from pgqueuer.db import PsycopgDriver
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchlib
from benchlib import env_float, env_int

SYSTEM = "pgqueuer"
ENTRYPOINT = "long_horizon_job"
EVENT_TABLES = [
    "public.pgqueuer",
    "public.pgqueuer_log",
    "public.pgqueuer_statistics",
    "public.bench_done",
]
SCHEMA_LOCK_KEY = 0x7067_7175

URL = benchlib.database_url()
WORKER_COUNT = max(1, env_int("WORKER_COUNT", 32))
WORK_MS = env_float("JOB_WORK_MS", 1)
PAYLOAD_BYTES = env_int("JOB_PAYLOAD_BYTES", 256)
PRODUCERS = max(1, env_int("PRODUCER_CONNECTIONS", 2))
# pgqueuer re-picks a job whose heartbeat is older than this (its default, 30 s): how long the
# jobs of a killed worker wait.
HEARTBEAT_TIMEOUT_S = env_float("PGQUEUER_HEARTBEAT_TIMEOUT_S", 30)
# Jobs fetched per dequeue; at most WORKER_COUNT picked at once (pgqueuer wants the cap to be at
# least twice the batch).
BATCH_SIZE = max(1, env_int("PGQUEUER_BATCH_SIZE", max(1, WORKER_COUNT // 2)))

stop = threading.Event()
# Set by run(): what the handler, the producers and the pollers report to.
S = SimpleNamespace()


def log(message: str) -> None:
    benchlib.log(SYSTEM, message)


async def connect() -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(URL, autocommit=True, connect_timeout=5)


async def setup() -> None:
    """pgqueuer's own install (``Queries.install``) when its schema is missing, under an advisory
    lock, and the effect table."""
    deadline = time.monotonic() + 60
    while True:
        try:
            async with await connect() as conn:
                await conn.execute("SELECT pg_advisory_lock(%s)", (SCHEMA_LOCK_KEY,))
                try:
                    queries = Queries(PsycopgDriver(conn))
                    if not await queries.schema_is_installed():
                        await queries.install()
                        log("installed pgqueuer's schema")
                    await conn.execute(benchlib.BENCH_DONE_DDL)
                finally:
                    await conn.execute("SELECT pg_advisory_unlock(%s)", (SCHEMA_LOCK_KEY,))
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise
            log(f"setup: database unreachable ({exc}); retrying")
            await asyncio.sleep(1)


def queue_manager(conn: psycopg.AsyncConnection, effects: AsyncConnectionPool) -> QueueManager:
    qm = QueueManager(Queries(PsycopgDriver(conn)))

    @qm.entrypoint(ENTRYPOINT)
    async def bench_job(job: Job) -> None:
        began = dt.datetime.now(dt.UTC)
        created = dt.datetime.fromisoformat(json.loads(job.payload or b"{}")["created_at"])
        S.telemetry.pickup.record((began - created).total_seconds() * 1000)
        if WORK_MS > 0:
            await asyncio.sleep(WORK_MS / 1000)
        # The effect, in a transaction of its own: pgqueuer logs the job done afterwards, in
        # another one (at least once).
        async with effects.connection() as c:
            await c.execute("INSERT INTO bench_done (task_id, at) VALUES (%s, now())", (job.id,))
        S.telemetry.add("completed")
        S.telemetry.end_to_end.record((dt.datetime.now(dt.UTC) - created).total_seconds() * 1000)

    return qm


async def consumer(effects: AsyncConnectionPool) -> None:
    """One QueueManager on a connection of its own; when it fails (connection lost) a new one on
    a new connection starts after a backoff."""
    backoff = 0.5
    while not stop.is_set():
        conn = None
        try:
            conn = await connect()
            qm = queue_manager(conn, effects)
            task = asyncio.create_task(
                qm.run(
                    batch_size=BATCH_SIZE,
                    max_concurrent_tasks=max(WORKER_COUNT, 2 * BATCH_SIZE),
                    dequeue_timeout=timedelta(seconds=5),
                    heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S),
                )
            )
            while not stop.is_set() and not task.done():
                await asyncio.sleep(0.1)
            if stop.is_set():
                qm.shutdown.set()
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
            log(f"queue manager failed ({reason}); a new one in {backoff:.1f} s")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        finally:
            if conn is not None and stop.is_set() is False:
                with contextlib.suppress(Exception):
                    await conn.close()


async def producer(index: int, wake: asyncio.Event) -> None:
    padding = "x" * max(0, PAYLOAD_BYTES - 64)
    backoff = 0.1
    conn: psycopg.AsyncConnection | None = None
    queries: Queries | None = None
    while not stop.is_set():
        if not S.backlog.take(1, 0):
            wake.clear()
            if not S.backlog.pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 0.25)
            continue
        began = time.monotonic()
        try:
            if queries is None:
                conn = await connect()
                queries = Queries(PsycopgDriver(conn))
            payload = json.dumps({"created_at": benchlib.now_iso(), "padding": padding}).encode()
            await queries.enqueue(ENTRYPOINT, payload)
            S.telemetry.enqueue_call.record((time.monotonic() - began) * 1000)
            S.telemetry.add("enqueued")
            backoff = 0.1
        except Exception as exc:
            S.telemetry.add("enqueue_failed")
            log(f"producer {index}: enqueue failed ({type(exc).__name__}: {str(exc).strip()[:200]})")
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            conn, queries = None, None
            until = time.monotonic() + backoff
            while time.monotonic() < until and not stop.is_set():
                S.telemetry.add("enqueue_failed", S.backlog.drain())
                await asyncio.sleep(0.05)
            backoff = min(backoff * 2, 2.0)


async def depth_poller(load: benchlib.OfferedLoad) -> None:
    if benchlib.instance_id() != 0 and load.mode != "depth-target":
        return
    conn: psycopg.AsyncConnection | None = None
    while not stop.is_set():
        try:
            if conn is None or conn.closed:
                conn = await connect()
            cur = await conn.execute(
                "SELECT count(*) FROM pgqueuer WHERE entrypoint = %s AND status = 'queued' "
                "AND execute_after <= now()",
                (ENTRYPOINT,),
            )
            row = await cur.fetchone()
            S.telemetry.depth = int(row[0]) if row else 0
        except Exception:
            conn = None
        await asyncio.sleep(0.2 if load.mode == "depth-target" else 1.0)


async def run() -> int:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def offer(n: int) -> None:
        S.backlog.add(n)
        loop.call_soon_threadsafe(wake.set)

    load = benchlib.OfferedLoad(offer, stop, lambda: S.telemetry.depth)
    S.backlog = benchlib.Backlog(max(1000, int((load.rate if load.mode == "fixed" else 1000) * 10)))
    emitter = benchlib.Emitter(SYSTEM)
    S.telemetry = benchlib.Telemetry(emitter, load, S.backlog)
    await setup()
    if os.environ.get("SCENARIO", "long_horizon") == "migrate_only":
        log("migrate_only: done")
        return 0
    emitter.descriptor(
        event_tables=EVENT_TABLES,
        extensions=[],
        version=version("pgqueuer"),
        schema_version=version("pgqueuer"),
        db_name=(urlparse(URL).path or "/").lstrip("/") or "pgqueuer_bench",
        worker_count=WORKER_COUNT,
        batch_size=BATCH_SIZE,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        producer_mode=load.mode,
        producer_pacing="harness" if load.harness_paced else "adapter",
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    effects = AsyncConnectionPool(
        URL, min_size=1, max_size=WORKER_COUNT, kwargs={"autocommit": True}, timeout=5, open=False
    )
    await effects.open()
    tasks = [
        asyncio.create_task(consumer(effects)),
        asyncio.create_task(depth_poller(load)),
        *(asyncio.create_task(producer(i, wake)) for i in range(PRODUCERS)),
    ]
    S.telemetry.start(stop)
    load.start()
    log(f"running: {WORKER_COUNT} workers (batch {BATCH_SIZE}), producer {load.mode}")
    while not stop.is_set():
        await asyncio.sleep(0.1)
    # SIGTERM: the queue manager finishes what runs (3 s at most); out within 5 s.
    await asyncio.wait(tasks, timeout=3.5)
    log("stopped")
    # Closing the pool could wait on a dead server: the exit does not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
