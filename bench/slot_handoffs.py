"""Slot hand-offs on one platform: the queue with 0025 against the queue before it, in one run.

    python bench/slot_handoffs.py [--url URL] [--slots 8,16] [--tasks 6000] [--repeat 3]
                                  [--pgbench-seconds 5]

Every hand-off (``platform_handoff``: the slot goes back and the platform's next task is
claimed with it) and every late start locks its platform's row in ``tq_platforms``. Before 0025
the row stayed locked through the commit's WAL flush, so the hand-offs of one platform queued
behind each other's flushes; with 0025 they commit without waiting for it.

Two databases on one server: the project's migrations, and the migrations before 0025. In each,
``--tasks`` stores of one platform get a task, the platform allows ``--slots`` requests in
flight (and a rate that never binds), one worker claims that many tasks, and as many threads
(each its own connection) hand their slot on, task after task, until the queue is empty: the
crawl's path between two requests of a slot, with no HTTP and no handler. Hand-offs per second,
median of ``--repeat``, the databases alternating; every task is checked completed-by-hand-off
once. pgbench's TPC-B on the same server, with as many clients, is the reference the ratio of
the two is set beside (how fast this server commits).
"""

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import migrated_db, reset_stores, server_parser
from tq_pipelines.queue.api import PlatformLimits, TaskQueue

ROLE = "product_resync"
WORKER = "bench-handoffs"
SCHEMAS = {"0025": None, "before 0025": "0025"}


def handoffs(url: str, slots: int, tasks: int) -> float:
    """Hand-offs per second, ``slots`` threads handing their slots on until no task is left."""
    with psycopg.connect(url, autocommit=True) as conn:
        reset_stores(conn, tasks)
        conn.execute(
            "SELECT enqueue_task_once(%s, d.id, 'dutchie', 0, NULL, NULL) FROM dispensaries d", (ROLE,)
        )
        conn.execute("VACUUM ANALYZE worker_tasks, worker_task_heads, worker_task_stores, tq_platforms")
    with TaskQueue.connect(url, min_size=slots + 1, max_size=slots + 1) as queue:
        queue.sync_platform_limits(
            [PlatformLimits("dutchie", max_in_flight=slots, requests_per_second=10_000)]
        )
        held = queue.claim_many(ROLE, WORKER, slots, start=True)
        assert len(held) == slots, f"claimed {len(held)} of {slots}"
        done = [0] * slots
        go = threading.Barrier(slots + 1)

        def hand_on(i: int) -> None:
            task = held[i]
            go.wait()
            while True:
                # The task's work is done with its request: it completes after handing on, as a
                # crawl's does (off the path measured here, so done in one statement at the end).
                nxt = queue.platform_handoff(task)
                done[i] += 1
                if nxt is None:
                    return
                task = nxt

        threads = [threading.Thread(target=hand_on, args=(i,)) for i in range(slots)]
        for t in threads:
            t.start()
        go.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        took = time.perf_counter() - began
    with psycopg.connect(url, autocommit=True) as conn:
        [(claimed, in_flight)] = conn.execute(
            "SELECT (SELECT count(*) FROM worker_tasks WHERE worker_id = %s AND status = 'running'),"
            " (SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie')",
            (WORKER,),
        ).fetchall()
    # Every task was claimed once (by the claim or a hand-off) and each gave its slot back.
    assert claimed == tasks and in_flight == 0 and sum(done) == tasks, (claimed, in_flight, sum(done))
    return tasks / took


def pgbench_tps(server: str, clients: int, seconds: int) -> float:
    params = conninfo_to_dict(server)
    db = "tq_bench_pgbench"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {db}")
    args = ["-h", str(params.get("host", "127.0.0.1")), "-p", str(params.get("port", 5432))]
    args += ["-U", str(params.get("user", "postgres"))]
    subprocess.run(["pgbench", *args, "-i", "-q", "-s", "1", db], check=True, capture_output=True)
    out = subprocess.run(
        ["pgbench", *args, "-c", str(clients), "-j", "2", "-T", str(seconds), db],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    [line] = [x for x in out.splitlines() if x.startswith("tps")]
    return float(line.split()[2])


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--slots", default="8,16", help="slots of the platform (threads), comma-separated")
    parser.add_argument("--tasks", type=int, default=6000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pgbench-seconds", type=int, default=5)
    args = parser.parse_args()
    urls = {
        name: migrated_db(args.url, "tq_bench_handoffs_" + str(i), before)
        for i, (name, before) in enumerate(SCHEMAS.items())
    }
    print(f"{'slots':>5}  {'0025 /s':>9}  {'before /s':>9}  {'ratio':>5}  {'pgbench TPS':>11}")
    for slots in (int(x) for x in args.slots.split(",")):
        rates: dict[str, list[float]] = {name: [] for name in urls}
        for i in range(args.repeat):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                rates[name].append(handoffs(urls[name], slots, args.tasks))
        tps = pgbench_tps(args.url, slots, args.pgbench_seconds) if args.pgbench_seconds else float("nan")
        new, old = (statistics.median(rates[n]) for n in SCHEMAS)
        print(f"{slots:>5}  {new:>9.0f}  {old:>9.0f}  {new / old:>5.2f}  {tps:>11.0f}", flush=True)
        for name, xs in rates.items():
            print(f"       {name}: " + ", ".join(f"{x:.0f}" for x in xs), flush=True)


if __name__ == "__main__":
    main()
