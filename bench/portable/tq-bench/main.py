#!/usr/bin/env python3
"""tq-bench: tq_pipelines' queue under the long-horizon protocol of the portable benchmark
(hardbyte/postgresql-job-queue-benchmarking, CONTRIBUTING_ADAPTERS.md). README.md beside this
file says how to run it and what it measures.

One process is one replica: a producer that calls ``enqueue_task_once`` once per task (the
production enqueue), on stores taken in turn, and one drain run's :class:`Worker` with
``WORKER_COUNT`` handler threads (how a drain run of an HTTP role runs in production), whose
handler sleeps ``JOB_WORK_MS`` and then, in the task's own transaction, writes its effect
(``bench_done``) and completes the task. A maintenance thread does what task_queue_sensor does
every 5 s in production: gives back the tasks of dead workers and of expired leases.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psycopg
from psycopg_pool import ConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchlib
from benchlib import env_float, env_int, env_str

from tq_pipelines.db.migrate import Migration, load_migrations, migrate
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker

SYSTEM = "tq"
EVENT_TABLES = [
    "public.worker_tasks",
    "public.worker_task_heads",
    "public.worker_task_stores",
    "public.worker_registry",
    "public.worker_tallies",
    "public.worker_task_floors",
    "public.tq_platforms",
    "public.dispensaries",
    "public.bench_done",
]
# Every replica's worker ids start so: the maintenance thread gives back the tasks of these only.
WORKER_PREFIX = "tq-bench:"
# Seeded stores are named so; their ids are what the producer takes in turn.
STORE_NAME = "tq-bench store "
SEED_LOCK_KEY = 0x7451_BE4C


def log(message: str) -> None:
    benchlib.log(SYSTEM, message)


def open_queue(url: str, size: int, name: str) -> TaskQueue:
    """A :class:`TaskQueue` on a pool of its own, as ``TaskQueue.connect`` makes it, except that
    a pool that cannot connect within 5 s is closed (not left retrying) and the error raised."""
    pool = ConnectionPool(
        url, min_size=1, max_size=size, kwargs={"autocommit": True}, timeout=5, open=True, name=name
    )
    try:
        pool.wait(timeout=5)
    except Exception:
        threading.Thread(target=pool.close, daemon=True).start()
        raise
    return TaskQueue(pool, owns_pool=True)


class Stats:
    """What the sampler reports: counters (read as differences) and the latency windows."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enqueued = 0
        self.deduplicated = 0
        self.enqueue_failed = 0
        self.completed = 0
        self.worker_restarts = 0
        self.pickup = benchlib.RollingHistogram(30)
        self.end_to_end = benchlib.RollingHistogram(30)
        self.enqueue_call = benchlib.RollingHistogram(30)
        self.depth = 0

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                k: getattr(self, k)
                for k in ("enqueued", "deduplicated", "enqueue_failed", "completed", "worker_restarts")
            }


class Adapter:
    def __init__(self) -> None:
        self.url = benchlib.database_url()
        self.instance = benchlib.instance_id()
        self.role = env_str("TQ_ROLE", "product_resync")
        self.platform = env_str("TQ_PLATFORM", "bench")
        self.stores_total = max(1, env_int("TQ_STORES", 5000))
        # Replicas that share the stores: replica i takes the stores i, i+R, i+2R, ... so that no
        # two producers take turns on one store.
        self.replicas = max(1, env_int("TQ_REPLICAS", 1))
        self.payload_mode = env_str("TQ_PAYLOAD", "none")
        self.worker_count = max(1, env_int("WORKER_COUNT", 32))
        self.work_ms = env_float("JOB_WORK_MS", 1)
        self.sample_every = max(1, env_int("SAMPLE_EVERY_S", 5))
        self.batch_size = max(1, env_int("TQ_BATCH_SIZE", 50))
        self.idle_poll = env_float("TQ_IDLE_POLL_S", 0.5)
        self.heartbeat = env_float("TQ_HEARTBEAT_S", 30)
        self.archive_after = env_float("TQ_ARCHIVE_AFTER_S", 60)
        self.maintenance_every = env_float("TQ_MAINTENANCE_S", 5)
        self.producer_threads = max(1, env_int("PRODUCER_CONNECTIONS", 2))
        self.stats = Stats()
        self.stop = threading.Event()
        self.stores: list[int] = []
        self.seq = itertools.count()
        self.seq_lock = threading.Lock()
        self.worker: Worker | None = None
        self.load = benchlib.OfferedLoad(self.offer, self.stop, lambda: self.stats.depth)
        rate = self.load.rate if self.load.mode == "fixed" else 1000
        self.backlog = benchlib.Backlog(max(1000, int(rate * 10)))
        self.emit = benchlib.Emitter(SYSTEM)

    # -- setup -----------------------------------------------------------------------------------

    def migrations(self) -> list[Migration]:
        """The project's migrations; with ``TQ_MIGRATE_BEFORE=NNNN`` only those before NNNN (the
        queue as it was before one change, for a run that measures that change)."""
        before = env_str("TQ_MIGRATE_BEFORE", "")
        return [m for m in load_migrations() if not before or m.version < before]

    def setup(self) -> None:
        """Migrate with the project's own path, create the effect table, seed the stores."""
        deadline = time.monotonic() + 60
        while True:
            try:
                applied = migrate(self.url, self.migrations())
                if applied:
                    log(f"migrated: {', '.join(applied)}")
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(benchlib.BENCH_DONE_DDL)
                    conn.execute("SELECT pg_advisory_lock(%s)", (SEED_LOCK_KEY,))
                    try:
                        conn.execute(
                            "INSERT INTO worker_task_roles (role) VALUES (%s) ON CONFLICT DO NOTHING",
                            (self.role,),
                        )
                        have = conn.execute(
                            "SELECT count(*) FROM dispensaries WHERE name LIKE %s", (STORE_NAME + "%",)
                        ).fetchone()[0]  # type: ignore[index]
                        if have < self.stores_total:
                            conn.execute(
                                "INSERT INTO dispensaries (name, menu_type) "
                                "SELECT %s || g, %s FROM generate_series(%s::int, %s::int) g",
                                (STORE_NAME, self.platform, have + 1, self.stores_total),
                            )
                            log(f"seeded {self.stores_total - have} stores")
                        rows = conn.execute(
                            "SELECT id FROM dispensaries WHERE name LIKE %s ORDER BY id LIMIT %s",
                            (STORE_NAME + "%", self.stores_total),
                        ).fetchall()
                    finally:
                        conn.execute("SELECT pg_advisory_unlock(%s)", (SEED_LOCK_KEY,))
                mine = self.instance % self.replicas
                self.stores = [r[0] for i, r in enumerate(rows) if i % self.replicas == mine]
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise
                log(f"setup: database unreachable ({exc}); retrying")
                time.sleep(1)

    # -- producer --------------------------------------------------------------------------------

    def offer(self, n: int) -> None:
        self.backlog.add(n)

    def next_store(self) -> tuple[int, int]:
        with self.seq_lock:
            seq = next(self.seq)
        return seq, self.stores[seq % len(self.stores)]

    def producer(self, index: int) -> None:
        """Insert what is offered, one ``enqueue_task_once`` call per task. A lost connection is
        given up and opened again with backoff; what is offered meanwhile is counted as failed."""
        queue: TaskQueue | None = None
        backoff = 0.1
        while not self.stop.is_set():
            n = self.backlog.take(1, 0.25)
            if not n:
                continue
            try:
                if queue is None:
                    queue = open_queue(self.url, 1, f"tq-bench-producer-{index}")
                seq, store = self.next_store()
                payload = {"seq": seq, "instance": self.instance} if self.payload_mode == "seq" else None
                began = time.monotonic()
                new_id = queue.enqueue_once(self.role, store, payload=payload)
                self.stats.enqueue_call.record((time.monotonic() - began) * 1000)
                self.stats.add("enqueued" if new_id is not None else "deduplicated")
                backoff = 0.1
            except Exception as exc:
                self.stats.add("enqueue_failed", n)
                log(f"producer {index}: enqueue failed ({type(exc).__name__}: {str(exc).strip()[:200]})")
                if queue is not None:
                    broken, queue = queue, None
                    threading.Thread(target=broken.close, daemon=True).start()
                # Offered while the database is away: not inserted, counted.
                until = time.monotonic() + backoff
                while time.monotonic() < until and not self.stop.is_set():
                    self.stats.add("enqueue_failed", self.backlog.drain())
                    time.sleep(0.05)
                backoff = min(backoff * 2, 2.0)

    # -- consumer --------------------------------------------------------------------------------

    def handler(self, task: Task, ctx: TaskContext) -> Any:
        began = time.monotonic()
        # On the database's clock: the claim's time plus how long since the claim was asked.
        assert task.claimed_at is not None
        offset = (task.claimed_at - task.created_at).total_seconds()
        self.stats.pickup.record((offset + began - ctx.claimed_at) * 1000)
        if self.work_ms > 0:
            time.sleep(self.work_ms / 1000)
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO bench_done (task_id, at) VALUES (%s, now())", (task.id,))
            ctx.complete(cur, None)
        self.stats.add("completed")
        self.stats.end_to_end.record((offset + time.monotonic() - ctx.claimed_at) * 1000)
        return None

    def consumer(self) -> None:
        """One drain run at a time, as production's task_queue_sensor keeps one going: a run that
        fails (the database went away) ends, and a new one with a new pool starts after a
        backoff."""
        backoff = 0.5
        while not self.stop.is_set():
            queue: TaskQueue | None = None
            try:
                queue = open_queue(self.url, self.worker_count + 4, "tq-bench-worker")
                host = socket.gethostname()
                worker_id = f"{WORKER_PREFIX}{self.instance}:{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
                self.worker = Worker(
                    queue,
                    self.role,
                    self.handler,
                    worker_id=worker_id[:100],
                    batch_size=self.batch_size,
                    concurrency=self.worker_count,
                    heartbeat_seconds=self.heartbeat,
                    idle_poll_seconds=self.idle_poll,
                    stop_grace_seconds=3.0,
                )
                if self.stop.is_set():
                    return
                started = time.monotonic()
                stats = self.worker.run()
                log(f"drain run ended: {stats.completed} completed, {stats.lost} lost, {stats.failed} failed")
                if time.monotonic() - started > 10:
                    backoff = 0.5
            except Exception as exc:
                if self.stop.is_set():
                    return
                self.stats.add("worker_restarts")
                reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
                log(f"drain run failed ({reason}); a new one in {backoff:.1f} s")
            finally:
                self.worker = None
                if queue is not None:
                    threading.Thread(target=queue.close, daemon=True).start()
            if self.stop.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)

    # -- what task_queue_sensor does in production ------------------------------------------------

    def maintenance(self) -> None:
        """Every TQ_MAINTENANCE_S: the tasks of bench workers whose session is gone (a killed
        replica) go back at once, those of silent leases once they expire, and tasks finished
        over TQ_ARCHIVE_AFTER_S ago (60) leave worker_tasks, as the drain sensor does."""
        queue: TaskQueue | None = None
        archives = False
        while not self.stop.is_set():
            try:
                if queue is None:
                    queue = open_queue(self.url, 1, "tq-bench-maintenance")
                    with queue.pool.connection() as conn:
                        # As the drain sensor does (0022); a queue migrated before 0022 has no archive.
                        archives = conn.execute(
                            "SELECT to_regprocedure('archive_tasks(timestamptz, integer)') IS NOT NULL"
                        ).fetchone()[0]  # type: ignore[index]
                with queue.pool.connection() as conn:
                    ids = [
                        r[0]
                        for r in conn.execute(
                            "SELECT worker_id FROM worker_registry"
                            " WHERE worker_id LIKE %s AND status <> 'offline'",
                            (WORKER_PREFIX + "%",),
                        ).fetchall()
                    ]
                released = queue.release_dead_workers(ids) if ids else None
                expired = queue.expire_leases()
                if archives:
                    queue.archive_finished(self.archive_after, limit=5000)
                if released and (released.recovered or released.failed):
                    log(
                        f"dead workers: {released.workers_offline} offline, {released.recovered} "
                        f"tasks back to pending, {released.failed} failed"
                    )
                if expired.recovered or expired.failed:
                    log(f"leases expired: {expired.recovered} back to pending, {expired.failed} failed")
            except Exception as exc:
                log(f"maintenance failed ({type(exc).__name__}: {str(exc).strip()[:200]})")
                if queue is not None:
                    broken, queue = queue, None
                    threading.Thread(target=broken.close, daemon=True).start()
            self.stop.wait(self.maintenance_every)

    def depth_poller(self) -> None:
        """Pending tasks of the role due now. Instance 0 reports it; every replica polls it in
        depth-target mode, which needs it."""
        if self.instance != 0 and self.load.mode != "depth-target":
            return
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                row = conn.execute(
                    "SELECT count(*) FROM worker_tasks"
                    " WHERE role = %s AND status = 'pending' AND due_at <= now()",
                    (self.role,),
                ).fetchone()
                self.stats.depth = int(row[0]) if row else 0
            except Exception:
                if conn is not None:
                    conn.close()
                conn = None
            self.stop.wait(0.2 if self.load.mode == "depth-target" else 1.0)

    # -- telemetry -------------------------------------------------------------------------------

    def sampler(self) -> None:
        last = self.stats.snapshot()
        last_t = time.monotonic()
        last_dropped = 0
        tick = benchlib.next_aligned_tick(self.sample_every)
        while not self.stop.wait(max(0.0, tick - time.time())):
            tick += self.sample_every
            now = time.monotonic()
            dt = max(0.001, now - last_t)
            cur = self.stats.snapshot()
            dropped = self.backlog.dropped
            rate = {k: (cur[k] - last[k]) / dt for k in cur}
            p50, p95, p99 = self.stats.pickup.percentiles((0.5, 0.95, 0.99))
            e50, e95, e99 = self.stats.end_to_end.percentiles((0.5, 0.95, 0.99))
            c50, c95, c99 = self.stats.enqueue_call.percentiles((0.5, 0.95, 0.99))
            w = float(self.sample_every)
            self.emit.samples(
                benchlib.now_iso(),
                [
                    ("claim_p50_ms", p50, 30.0),
                    ("claim_p95_ms", p95, 30.0),
                    ("claim_p99_ms", p99, 30.0),
                    ("enqueue_rate", rate["enqueued"], w),
                    ("completion_rate", rate["completed"], w),
                    ("queue_depth", float(self.stats.depth), 0.0),
                    ("producer_target_rate", self.load.current_rate, 0.0),
                    ("end_to_end_p50_ms", e50, 30.0),
                    ("end_to_end_p95_ms", e95, 30.0),
                    ("end_to_end_p99_ms", e99, 30.0),
                    ("producer_call_p50_ms", c50, 30.0),
                    ("producer_call_p95_ms", c95, 30.0),
                    ("producer_call_p99_ms", c99, 30.0),
                    ("enqueue_failed_rate", rate["enqueue_failed"], w),
                    ("enqueue_dropped_rate", (dropped - last_dropped) / dt, w),
                    ("enqueue_deduplicated_rate", rate["deduplicated"], w),
                    ("worker_restarts", float(cur["worker_restarts"] - last["worker_restarts"]), w),
                ],
            )
            last, last_t, last_dropped = cur, now, dropped

    # -- run -------------------------------------------------------------------------------------

    def descriptor(self) -> None:
        from importlib.metadata import version

        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT max(version) FROM tq_migrations").fetchone()
        import tq_pipelines

        checkout = Path(tq_pipelines.__file__).resolve().parent.parent
        try:
            sha = subprocess.run(
                ["git", "-C", str(checkout), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = ""
        self.emit.descriptor(
            event_tables=EVENT_TABLES,
            extensions=[],
            version=version("tq-pipelines") + (f"+g{sha}" if sha else ""),
            schema_version=str(row[0]) if row else "unknown",
            db_name=(urlparse(self.url).path or "/").lstrip("/") or "tq_bench",
            role=self.role,
            stores=len(self.stores),
            worker_count=self.worker_count,
            idle_poll_s=self.idle_poll,
            heartbeat_s=self.heartbeat,
            payload=self.payload_mode,
            producer_mode=self.load.mode,
            producer_pacing="harness" if self.load.harness_paced else "adapter",
        )

    def run(self) -> int:
        self.setup()
        if env_str("SCENARIO", "long_horizon") == "migrate_only":
            log("migrate_only: done")
            return 0
        self.descriptor()
        # The handler only raises a flag: setting the Event from it could deadlock with the main
        # thread's own wait on that Event.
        terminated = []
        signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
        signal.signal(signal.SIGINT, lambda *_: terminated.append(True))
        threads = [
            threading.Thread(target=self.maintenance, name="maintenance", daemon=True),
            threading.Thread(target=self.consumer, name="consumer", daemon=True),
            threading.Thread(target=self.depth_poller, name="depth", daemon=True),
            threading.Thread(target=self.sampler, name="sampler", daemon=True),
            *(
                threading.Thread(target=self.producer, args=(i,), name=f"producer-{i}", daemon=True)
                for i in range(self.producer_threads)
            ),
        ]
        for t in threads:
            t.start()
        self.load.start()
        log(
            f"running: role {self.role}, {len(self.stores)} stores, {self.worker_count} handler threads, "
            f"producer {self.load.mode}"
            + (" (harness-paced)" if self.load.harness_paced else f" at {self.load.rate:g}/s")
        )
        while not terminated:
            time.sleep(0.1)
        self.stop.set()
        # SIGTERM: stop claiming; handlers finish within the worker's grace; exit within 5 s.
        deadline = time.monotonic() + 4.0
        worker = self.worker
        if worker is not None:
            worker.stop()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        log("stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        return 0


def main() -> None:
    try:
        code = Adapter().run()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Threads blocked on a dead server (a pool's connect) must not hold the exit.
    os._exit(code)


if __name__ == "__main__":
    main()
