"""Claims after an ANALYZE that found the queue nearly empty, while a reader's snapshot is held:
the queue with 0024 against the queue before it, in one run.

    python bench/analyze_nearly_empty.py [--url URL] [--stores 5000] [--churn 50000]
                                         [--live 1,3,300] [--claims 7]

Autovacuum analyses the hot tables every minute or so, and a queue that keeps up is nearly empty
when it does: the statistics then say ``worker_task_heads`` holds a head or two. Meanwhile a
reader's snapshot (a report, an analyst's REPEATABLE READ scan) keeps every dead version of the
heads, and every dead index entry, in place.

Two databases on one server: the project's migrations, and the migrations before 0024. On each, a
REPEATABLE READ transaction takes its snapshot first and holds it to the end. ``--churn`` tasks go
through the queue (``enqueue_task_once`` on 100 stores at a time, ``claim_tasks`` of 100 with
start, ``complete_tasks``), leaving their dead versions behind. Then, for each count in
``--live``: the queue is drained, that many stores get a task, ``ANALYZE worker_task_heads``; then
``--claims`` times 50 more stores get a task and one ``claim_tasks`` of 50 is timed by the client
on a local connection (median), and what it took is completed. A claim takes the oldest due
heads first, so the ``--live`` stores go first. The schemas alternate per count.
"""

import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import migrated_db, reset_stores, server_parser

ROLE = "product_resync"
WORKER = "bench-analyze"
SCHEMAS = ("0024", "before 0024")
ENQUEUE = "SELECT enqueue_task_once(%s, g, NULL, 0, NULL, NULL) FROM generate_series(%s::INT, %s::INT) g"
CLAIM = "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, %s, true) AS c"


def claim_and_complete(conn: psycopg.Connection, n: int) -> tuple[int, float]:
    """One claim of up to ``n``, timed, then the completion of what it took."""
    began = time.perf_counter()
    rows = conn.execute(CLAIM, (ROLE, WORKER, n)).fetchall()
    took = time.perf_counter() - began
    if rows:
        conn.execute(
            "SELECT complete_tasks(%s, %s, %s::JSONB[])",
            ([r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)),
        )
    return len(rows), took


def churn(conn: psycopg.Connection, tasks: int, stores: int) -> None:
    for first in range(0, tasks, 100):
        low = first % stores + 1
        conn.execute(ENQUEUE, (ROLE, low, min(low + 99, stores)))
        while claim_and_complete(conn, 100)[0]:
            pass


def claims_after_analyze(
    conn: psycopg.Connection, live: int, claims: int, stores: int
) -> tuple[float, float]:
    """The statistics' head count, and the median seconds of a claim of 50 after that ANALYZE."""
    while claim_and_complete(conn, 100)[0]:
        pass
    conn.execute(ENQUEUE, (ROLE, stores - live + 1, stores))
    conn.execute("ANALYZE worker_task_heads")
    row = conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'worker_task_heads'").fetchone()
    times = []
    for i in range(claims):
        conn.execute(ENQUEUE, (ROLE, i * 50 + 1, i * 50 + 50))
        got, took = claim_and_complete(conn, 50)
        assert got == 50, got
        times.append(took)
    return float(row[0]) if row else -1.0, statistics.median(times)


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--stores", type=int, default=5000)
    parser.add_argument("--churn", type=int, default=50000)
    parser.add_argument("--live", default="1,3,300", help="live heads when ANALYZE runs, comma-separated")
    parser.add_argument("--claims", type=int, default=7)
    args = parser.parse_args()
    lives = [int(x) for x in args.live.split(",")]
    if args.stores < max(lives) + 50 * args.claims:
        parser.error("--stores must exceed the largest --live plus 50 per claim")

    urls = {
        "0024": migrated_db(args.url, "tq_bench_analyze"),
        "before 0024": migrated_db(args.url, "tq_bench_analyze_before", "0024"),
    }
    conns = {k: psycopg.connect(u, autocommit=True) for k, u in urls.items()}
    readers = {k: psycopg.connect(u) for k, u in urls.items()}
    results: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        for schema in SCHEMAS:
            conn = conns[schema]
            reset_stores(conn, args.stores)
            conn.execute("SELECT register_worker(%s, %s)", (WORKER, ROLE))
            conn.execute("ANALYZE")
            readers[schema].execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            readers[schema].execute("SELECT count(*) FROM worker_tasks")  # the snapshot, held
            began = time.perf_counter()
            churn(conn, args.churn, args.stores - max(lives))
            print(
                f"{schema}: {args.churn} tasks through the queue in {time.perf_counter() - began:.0f} s",
                flush=True,
            )
        for n, live in enumerate(lives):
            for schema in SCHEMAS if n % 2 == 0 else SCHEMAS[::-1]:
                results[schema, live] = claims_after_analyze(conns[schema], live, args.claims, args.stores)
                stats, took = results[schema, live]
                print(
                    f"{live} live heads, {schema}: reltuples {stats:.0f}, claim of 50 {took * 1000:.1f} ms",
                    flush=True,
                )
    finally:
        for c in [*readers.values(), *conns.values()]:
            c.close()
    print()
    print(
        f"| live heads at the ANALYZE ({args.churn:,} tasks moved under the held snapshot)"
        " | 0024: claim of 50 | before 0024 | 0024 / before |"
    )
    print("|---:|---:|---:|---:|")
    for live in lives:
        now, before = results["0024", live][1], results["before 0024", live][1]
        print(f"| {live} | {now * 1000:.1f} ms | {before * 1000:.1f} ms | {now / before:.2f} |")


if __name__ == "__main__":
    main()
