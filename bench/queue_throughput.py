"""Queue throughput: claim -> start -> complete of no-op tasks, against pgbench on the same server.

    python bench/queue_throughput.py [--url URL] [--workers 1,4,16] [--tasks 20000]
                                     [--without 0006 --repeat 7]

Each worker is its own process with its own connection. Modes: ``single`` (claim_tasks of 1,
start_task, complete_task: three calls per task), ``batch`` (claim_tasks of --batch, start_tasks,
complete_tasks: three calls per batch) and ``worker`` (the Worker loop that the drain runs use:
claim_tasks with start, then complete_tasks: two calls and two row updates per task).
Layouts: ``adjacent`` (a store's tasks consecutive in claim order, the hard case) and
``interleaved``. The pgbench figure is single-row UPDATE transactions per
second at 16 clients, measured in the same run; the ratio is tasks/s over that TPS.

``--without VERSION`` also builds a database with every migration but VERSION (the queue
without that change; later migrations must not need it) and runs every case on both,
``--repeat`` times, alternating which goes first, so that a change's cost is measured in one run
on a machine whose speed drifts; the rows are the medians, and a last column gives now /
without. The tasks' platform has no limits: this is the bare queue.

``--before VERSION`` compares against the queue as it was before VERSION (the migrations before
it), for a change whose later migrations need it.

``--archive-every S`` runs, beside the workers of a schema with migration 0022, what the drain
sensor does every 5 s in production, compressed: every S seconds ``archive_tasks`` moves up to
5,000 finished tasks out of worker_tasks, so that the move's cost falls inside the timed run.

``--without 0013`` (lease tokens) compares against the worker-id API that 0013 replaced: on the
schema without it, the same TaskQueue and Worker code runs through :class:`WorkerIdQueue`, which
sends each statement in its 0012 form (the worker id instead of the tasks' lease tokens).
"""

import argparse
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tq_pipelines.db.migrate import load_migrations, migrate
from tq_pipelines.queue.api import Task, TaskQueue, task_row
from tq_pipelines.queue.worker import Worker

ROLE = "product_resync"
BENCH_DB = "tq_bench"


def recreate_db(server: str, name: str) -> str:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(server, dbname=name)


def migrated_db(server: str, name: str, before: str | None = None) -> str:
    """A new database with the project's migrations, or only those before version ``before``:
    the queue as it was, for a bench that measures a change beside it."""
    url = recreate_db(server, name)
    migrate(url, [m for m in load_migrations() if m.version < before] if before else None)
    return url


def server_parser(doc: str | None) -> argparse.ArgumentParser:
    """A bench's arguments, starting with ``--url``: the server it creates its databases on."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url",
        default=os.environ.get("TQ_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a server where the bench may create databases",
    )
    return parser


def reset_stores(conn: psycopg.Connection, stores: int) -> None:
    """An empty queue and ``stores`` crawlable dutchie stores."""
    conn.execute("TRUNCATE worker_tasks, worker_task_heads, worker_task_stores, worker_registry CASCADE")
    conn.execute("DELETE FROM dispensaries")
    conn.execute(
        """
        INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)
        SELECT 'store ' || g, 'dutchie', 'pid-' || g FROM generate_series(1, %s) g
        """,
        (stores,),
    )


def load(url: str, tasks: int, stores: int, layout: str) -> None:
    per_store = tasks // stores
    with psycopg.connect(url, autocommit=True) as conn:
        reset_stores(conn, stores)
        order = "d.id, k" if layout == "adjacent" else "k, d.id"
        conn.execute(
            sql.SQL(
                """
                INSERT INTO worker_tasks (role, dispensary_id, platform)
                SELECT %s, d.id, 'dutchie'
                FROM dispensaries d CROSS JOIN generate_series(1, %s) k
                ORDER BY {}
                """
            ).format(sql.SQL(order)),
            (ROLE, per_store),
        )
        conn.execute("VACUUM ANALYZE worker_tasks")
        conn.execute("VACUUM ANALYZE worker_task_heads")
        conn.execute("VACUUM ANALYZE worker_task_stores")


# The worker-id API of 0012 and before (claim_tasks returning worker_tasks rows, every call on
# a task fenced by the caller's worker id), as sql/queries.sql called it before 0013.
WORKER_ID_SQL = {
    name: sql.SQL(text)  # type: ignore[arg-type]  # constant text
    for name, text in {
        # A placeholder token, parsed per row as the real ones are: Task.lease works as with 0013.
        "claim_tasks": "SELECT c.*, '00000000-0000-0000-0000-000000000000'::UUID AS lease_token"
        " FROM claim_tasks(%(role)s, %(worker_id)s, %(max_tasks)s, %(start)s) c",
        "start_task": "SELECT start_task(%(task_id)s, %(worker_id)s) AS ok",
        "start_tasks": "SELECT start_tasks(%(worker_id)s, %(task_ids)s) AS ids",
        "heartbeat_tasks": "SELECT heartbeat_tasks(%(worker_id)s, %(task_ids)s) AS ids",
        "complete_task": "SELECT complete_task(%(task_id)s, %(worker_id)s, %(result)s) AS ok",
        "complete_tasks": "SELECT complete_tasks(%(worker_id)s, %(task_ids)s, %(results)s::JSONB[]) AS ids",
        "complete_tasks_timed": "SELECT complete_tasks_timed(%(worker_id)s, %(task_ids)s,"
        " %(results)s::JSONB[], %(began)s::FLOAT8[], %(ended)s::FLOAT8[]) AS ids",
        "fail_task": "SELECT fail_task(%(task_id)s, %(worker_id)s, %(error)s, %(retryable)s, %(retry_after)s)"
        " AS status",
        "defer_task": "SELECT defer_task(%(task_id)s, %(worker_id)s, %(delay)s) AS ok",
    }.items()
}


class WorkerIdQueue(TaskQueue):
    """TaskQueue on a schema without 0013: the same Python path (Task objects, their leases,
    results serialised and sorted as always), each statement sent in its worker-id form, fenced
    by the one worker id of this process instead of the lease tokens."""

    worker_id = ""

    def claim_many(self, role: str, worker_id: str, max_tasks: int, *, start: bool = False) -> list[Task]:
        params = {"role": role, "worker_id": worker_id, "max_tasks": max_tasks, "start": start}
        with self._cursor(task_row) as cur:
            return cur.execute(WORKER_ID_SQL["claim_tasks"], params).fetchall()

    def _one(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        statement = WORKER_ID_SQL.get(name)
        if statement is None:  # not fenced by a worker (registrations, counts): unchanged
            return super()._one(name, params)
        assert self.worker_id, "WorkerIdQueue.worker_id not set"
        args = {k: v for k, v in params.items() if k not in ("lease", "leases")}
        args.setdefault("worker_id", self.worker_id)
        with self._cursor() as cur:
            row = cur.execute(statement, args).fetchone()
        assert row is not None, name
        return row


def has_lease_tokens(url: str) -> bool:
    """Whether the schema has 0013's API (else the worker-id one: :class:`WorkerIdQueue`)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT to_regprocedure('complete_tasks(integer[], uuid[], jsonb[])') IS NOT NULL"
        ).fetchone()
    return bool(row and row[0])


def open_queue(url: str, worker_id: str, lease_tokens: bool, **pool: int) -> TaskQueue:
    if lease_tokens:
        return TaskQueue.connect(url, **pool)
    queue = WorkerIdQueue.connect(url, **pool)
    queue.worker_id = worker_id
    return queue


def _single(queue: TaskQueue, worker_id: str) -> tuple[int, int]:
    done = claims = 0
    while (task := queue.claim(ROLE, worker_id)) is not None:
        claims += 1
        queue.start(task)
        done += queue.complete(task, None)
    return done, claims + 1


def _batch(queue: TaskQueue, worker_id: str, batch: int) -> tuple[int, int]:
    done = claims = 0
    while tasks := queue.claim_many(ROLE, worker_id, batch):
        claims += 1
        queue.start_many(tasks)
        done += len(queue.complete_many(dict.fromkeys(t.lease for t in tasks)))
    return done, claims + 1


def _worker(url: str, lease_tokens: bool, mode: str, batch: int, n: int, barrier, out) -> None:  # type: ignore[no-untyped-def]
    worker_id = f"bench-{n}"
    with open_queue(url, worker_id, lease_tokens, min_size=1, max_size=1) as queue:
        queue.claim_many("analytics_refresh", worker_id, 1)  # connect and warm the session
        barrier.wait()
        if mode == "single":
            done, claims = _single(queue, worker_id)
        elif mode == "batch":
            done, claims = _batch(queue, worker_id, batch)
        else:
            # platform_wait_seconds=0: an older schema has no claim_wait; the queue empties anyway.
            worker = Worker(
                queue,
                ROLE,
                lambda task, ctx: None,
                worker_id=worker_id,
                batch_size=batch,
                platform_wait_seconds=0,
            )
            stats = worker.run()
            done, claims = stats.completed, stats.claims
        out.put((done, claims, time.monotonic()))


def has_archive(url: str) -> bool:
    """Whether the schema moves finished tasks out of worker_tasks (migration 0022)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT to_regprocedure('archive_tasks(timestamptz, integer)') IS NOT NULL"
        ).fetchone()
    return bool(row and row[0])


def _archiver(url: str, every: float, stop, out) -> None:  # type: ignore[no-untyped-def]
    """What the drain sensor does, compressed: every ``every`` seconds, up to 5,000 tasks finished
    by then move to worker_task_history."""
    moved = 0
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.wait(every):
            row = conn.execute("SELECT archive_tasks(now(), 5000)").fetchone()
            moved += row[0] if row else 0
    out.put(moved)


def run_queue(
    url: str, workers: int, mode: str, batch: int, archive_every: float = 0
) -> tuple[int, int, float, int]:
    """Tasks done, claim calls, seconds, and tasks the archiver moved while the workers ran."""
    lease_tokens = has_lease_tokens(url)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(workers + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, lease_tokens, mode, batch, n, barrier, out))
        for n in range(workers)
    ]
    stop, archived = ctx.Event(), ctx.Queue()
    archiver = None
    if archive_every > 0 and has_archive(url):
        archiver = ctx.Process(target=_archiver, args=(url, archive_every, stop, archived))
    for p in procs:
        p.start()
    barrier.wait()
    start = time.monotonic()
    if archiver is not None:
        archiver.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    stop.set()
    moved = archived.get() if archiver is not None else 0
    if archiver is not None:
        archiver.join()
    return (
        sum(r[0] for r in results),
        sum(r[1] for r in results),
        max(r[2] for r in results) - start,
        moved,
    )


def run_pgbench(server: str, seconds: int, clients: int = 16) -> float:
    if shutil.which("pgbench") is None:
        raise SystemExit("pgbench not found: install postgresql-client (Debian: postgresql-contrib)")
    url = recreate_db(server, "tq_bench_pgbench")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id INT PRIMARY KEY, v BIGINT NOT NULL DEFAULT 0)")
        conn.execute("INSERT INTO t (id) SELECT generate_series(1, 100000)")
        conn.execute("VACUUM ANALYZE t")
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write("\\set id random(1, 100000)\nUPDATE t SET v = v + 1 WHERE id = :id;\n")
    params = conninfo_to_dict(url)
    env = {**os.environ}
    for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"), ("password", "PGPASSWORD")):
        if params.get(key):
            env[var] = str(params[key])
    out = subprocess.run(
        [
            "pgbench",
            "-n",
            "-M",
            "prepared",
            "-c",
            str(clients),
            "-j",
            "2",
            "-T",
            str(seconds),
            "-f",
            script.name,
            str(params["dbname"]),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.unlink(script.name)
    match = re.search(r"tps = ([\d.]+)", out)
    assert match, out
    return float(match.group(1))


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--workers", default="1,4,16")
    parser.add_argument("--modes", default="single,batch,worker")
    parser.add_argument("--layouts", default="adjacent,interleaved")
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--stores", type=int, default=200)
    parser.add_argument("--batch", type=int, default=50, help="tasks per claim (the Worker default)")
    parser.add_argument("--pgbench-seconds", type=int, default=10)
    parser.add_argument(
        "--without", default="", help="also measure the schema without this migration version"
    )
    parser.add_argument("--before", default="", help="or: the schema as it was before this migration version")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case per schema (medians)")
    parser.add_argument(
        "--archive-every",
        type=float,
        default=0,
        help="seconds: beside the workers, archive_tasks moves what has finished (schemas with 0022)",
    )
    args = parser.parse_args()
    if args.without and args.before:
        parser.error("--without and --before: one of them")

    tps = run_pgbench(args.url, args.pgbench_seconds)
    print(f"pgbench single-row UPDATE, 16 clients: {tps:,.0f} TPS\n")
    schemas = {"now": recreate_db(args.url, BENCH_DB)}
    migrate(schemas["now"])
    if args.without:
        schemas[f"without {args.without}"] = recreate_db(args.url, BENCH_DB + "_without")
        migrate(
            schemas[f"without {args.without}"], [m for m in load_migrations() if m.version != args.without]
        )
    elif args.before:
        schemas[f"before {args.before}"] = migrated_db(args.url, BENCH_DB + "_without", args.before)
    compared = bool(args.without or args.before)
    compare = (" now / without |" if args.without else " now / before |") if compared else ""
    header = "| schema | layout | mode | workers | tasks | claim calls | seconds | tasks/s | x pgbench TPS |"
    print(header + compare)
    print("|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if compared else ""))
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                runs: dict[str, list[tuple[int, float]]] = {name: [] for name in schemas}
                moved: dict[str, list[int]] = {name: [] for name in schemas}
                for r in range(args.repeat):
                    for schema in list(schemas)[:: 1 if r % 2 == 0 else -1]:
                        load(schemas[schema], args.tasks, args.stores, layout)
                        done, claims, seconds, archived = run_queue(
                            schemas[schema], workers, mode, args.batch, args.archive_every
                        )
                        assert done == args.tasks, f"{done} of {args.tasks} completed"
                        runs[schema].append((claims, seconds))
                        moved[schema].append(archived)
                label = {
                    "single": "single",
                    "batch": f"batch {args.batch}",
                    "worker": f"Worker, batch {args.batch}",
                }[mode]
                rates = {
                    name: statistics.median(args.tasks / sec for _, sec in r) for name, r in runs.items()
                }
                for schema, r in runs.items():
                    claims = int(statistics.median(c for c, _ in r))
                    seconds = statistics.median(sec for _, sec in r)
                    rate = rates[schema]
                    ratio = f" {rates['now'] / rate:.2f} |" if schema != "now" else (" |" if compared else "")
                    print(
                        f"| {schema} | {layout} | {label} | {workers} | {args.tasks} | {claims} "
                        f"| {seconds:.2f} | {rate:,.0f} | {rate / tps:.2f} |{ratio}",
                        flush=True,
                    )
                    if any(moved[schema]):
                        print(f"  ({schema}: archived while the workers ran: {moved[schema]})", flush=True)
    tps_after = run_pgbench(args.url, args.pgbench_seconds)
    print(f"\npgbench again after the runs: {tps_after:,.0f} TPS")


if __name__ == "__main__":
    main()
