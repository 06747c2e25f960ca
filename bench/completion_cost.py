"""The cost of completing a task in its handler's transaction, against the worker's batch.

    python bench/completion_cost.py [--url URL] [--tasks 5000] [--stores 500] [--workers 1,4]
                                    [--concurrency 4] [--repeat 3]

Every handler writes one row (an INSERT into ``effects``) through ``ctx.transaction()``. Modes:
``transactional`` (the handler also calls ``ctx.complete(cur, result)``: the task's completion
commits with the row, one ``complete_task`` per task) and ``batched`` (it does not: the Worker
completes the tasks afterwards, one ``complete_tasks`` per few). Each worker is its own process
with its own TaskQueue, running ``Worker(..., concurrency=--concurrency)`` (1: inline). Each case
runs ``--repeat`` times, alternating which mode goes first, since the machine's speed drifts;
the rows are the medians, and the ratio is transactional / batched tasks/s. Tasks/s: from the
workers' start (a barrier) to the last one's end, every task completed and written once.

Each handler's commit waits for its WAL flush, which bounds both modes alike on a slow disk;
``--synchronous-commit off`` (set in the workers' sessions only) shows the work besides the flush.
"""

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from psycopg.conninfo import make_conninfo

from bench.queue_throughput import load, recreate_db, server_parser
from tq_pipelines.db.migrate import migrate
from tq_pipelines.queue.api import Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker

ROLE = "product_resync"
BENCH_DB = "tq_bench_completion"
MODES = ("transactional", "batched")


def handler_for(mode: str) -> Any:
    def handler(task: Task, ctx: TaskContext) -> dict[str, bool]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO effects (task_id) VALUES (%s)", (task.id,))
            if mode == "transactional":
                ctx.complete(cur, {"ok": True})
        return {"ok": True}

    return handler


def _worker(url: str, mode: str, concurrency: int, n: int, barrier, out) -> None:  # type: ignore[no-untyped-def]
    # Every connection the Worker can use (handlers, its loop, its heartbeat) opened before the start.
    size = concurrency + 2
    with TaskQueue.connect(url, min_size=size, max_size=size) as queue:
        worker_id = f"bench-{mode}-{n}"
        queue.claim_many("analytics_refresh", worker_id, 1)  # warm the session
        barrier.wait()
        stats = Worker(
            queue, ROLE, handler_for(mode), worker_id=worker_id, concurrency=concurrency, heartbeat_seconds=5
        ).run()
        out.put((stats.completed, stats.retried + stats.failed + stats.lost, time.monotonic()))


def run_case(url: str, mode: str, workers: int, concurrency: int) -> tuple[int, float]:
    """Completed tasks and seconds for one drain of the loaded queue."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(workers + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, mode, concurrency, n, barrier, out)) for n in range(workers)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.monotonic()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    errors = sum(r[1] for r in results)
    assert errors == 0, f"{errors} tasks retried, failed or lost in a {mode} run"
    return sum(r[0] for r in results), max(r[2] for r in results) - start


def audit(url: str, tasks: int) -> None:
    """Every task completed, each with exactly one effect."""
    with psycopg.connect(url, autocommit=True) as conn:
        completed, effects, distinct = conn.execute(
            """
            SELECT (SELECT count(*) FROM v_tasks WHERE status = 'completed'),
                   (SELECT count(*) FROM effects),
                   (SELECT count(DISTINCT task_id) FROM effects)
            """
        ).fetchone()
    assert (completed, effects, distinct) == (tasks, tasks, tasks), (completed, effects, distinct)


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--stores", type=int, default=500)
    parser.add_argument("--workers", default="1,4", help="worker processes, one case each")
    parser.add_argument("--concurrency", default="4", help="handler threads per worker (1: inline)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode per case (medians)")
    parser.add_argument(
        "--synchronous-commit", choices=("on", "off"), default="on", help="in the workers' sessions"
    )
    args = parser.parse_args()

    url = recreate_db(args.url, BENCH_DB)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (task_id INTEGER NOT NULL, written_at TIMESTAMPTZ DEFAULT now())")

    workers_url = make_conninfo(url, options=f"-c synchronous_commit={args.synchronous_commit}")
    print(
        f"{args.tasks} tasks over {args.stores} stores, {args.repeat} runs of each mode (medians), "
        f"synchronous_commit={args.synchronous_commit}\n"
    )
    print("| workers | concurrency | batched tasks/s | transactional tasks/s | transactional / batched |")
    print("|---:|---:|---:|---:|---:|")
    every_run = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for workers in (int(w) for w in args.workers.split(",")):
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.repeat):
                for mode in MODES[:: 1 if r % 2 == 0 else -1]:
                    load(url, args.tasks, args.stores, "interleaved")
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute("TRUNCATE effects")
                    done, seconds = run_case(workers_url, mode, workers, concurrency)
                    assert done == args.tasks, f"{done} of {args.tasks} completed"
                    audit(url, args.tasks)
                    rates[mode].append(args.tasks / seconds)
            batched, transactional = (statistics.median(rates[m]) for m in ("batched", "transactional"))
            print(
                f"| {workers} | {concurrency} | {batched:,.0f} | {transactional:,.0f} "
                f"| {transactional / batched:.2f} |",
                flush=True,
            )
            runs = "; ".join(f"{m} " + ", ".join(f"{x:,.0f}" for x in rates[m]) for m in MODES)
            every_run.append(f"{workers} x {concurrency}: {runs}")
    print("\nevery run, tasks/s, in order:\n" + "\n".join(every_run))


if __name__ == "__main__":
    main()
