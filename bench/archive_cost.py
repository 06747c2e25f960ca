"""What a completed task's way out of the hot table costs: moved by its completion (0023) against
completed in place and archived later (0022), in one run.

    python bench/archive_cost.py [--url URL] [--tasks 20000] [--stores 5000] [--batch 5000]
                                 [--rounds 3]

Two databases on one server: the project's migrations, and the migrations before 0023. Each
round, on each: ``--tasks`` tasks are enqueued (one INSERT of many rows), claimed with start 50
at a time and completed 50 at a time (``complete_tasks``), the completions timed; then
``archive_tasks`` moves what is left ``--batch`` at a time, timed (before 0023 every completed
task, since then none). Each statement is its own transaction on a local connection; the figures
are the client's time per task (claim excluded), medians over the rounds, rounds alternating
between the schemas. The history grows round by round, as it would between prunes.
"""

import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import migrated_db, reset_stores, server_parser

ROLE = "product_resync"
WORKER = "bench-archive"
CLAIM = "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, 50, true) AS c"
SCHEMAS = ("0023", "before 0023")


def one_round(
    conn: psycopg.Connection, tasks: int, stores: int, batch: int, moves: bool
) -> tuple[float, float]:
    """Seconds per task: completing them, then archiving what the completions left (none when
    the completion ``moves`` the task, all of them when it does not)."""
    conn.execute(
        "INSERT INTO worker_tasks (role, dispensary_id, platform)"
        " SELECT %s, d.id, 'dutchie' FROM dispensaries d CROSS JOIN generate_series(1, %s) g",
        (ROLE, -(-tasks // stores)),
    )
    completing = 0.0
    done = 0
    while rows := conn.execute(CLAIM, (ROLE, WORKER)).fetchall():
        ids, leases = [r[0] for r in rows], [r[1] for r in rows]
        began = time.perf_counter()
        conn.execute("SELECT complete_tasks(%s, %s, %s::JSONB[])", (ids, leases, [None] * len(ids)))
        completing += time.perf_counter() - began
        done += len(ids)
    archiving = 0.0
    moved = 0
    while True:
        began = time.perf_counter()
        row = conn.execute("SELECT archive_tasks(now(), %s)", (batch,)).fetchone()
        archiving += time.perf_counter() - began
        if not row or not row[0]:
            break
        moved += row[0]
    assert moved == (0 if moves else done), (moved, done)
    return completing / done, archiving / done


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--stores", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    urls = {
        "0023": migrated_db(args.url, "tq_bench_archive"),
        "before 0023": migrated_db(args.url, "tq_bench_archive_before", "0023"),
    }
    conns = {k: psycopg.connect(u, autocommit=True) for k, u in urls.items()}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in SCHEMAS}
    try:
        for conn in conns.values():
            reset_stores(conn, args.stores)
            conn.execute("SELECT register_worker(%s, %s)", (WORKER, ROLE))
        for n in range(args.rounds):
            for schema in SCHEMAS:
                conn = conns[schema]
                results[schema].append(one_round(conn, args.tasks, args.stores, args.batch, schema == "0023"))
                conn.execute("VACUUM ANALYZE worker_tasks, worker_task_history")
                c, a = results[schema][-1]
                print(
                    f"round {n + 1}, {schema}: complete {c * 1e6:.1f} us/task, archive {a * 1e6:.1f} us/task",
                    flush=True,
                )
    finally:
        for conn in conns.values():
            conn.close()
    print()
    print("| per task (median of rounds) | complete (`complete_tasks`, 50 a call) | archive | both |")
    print("|---|---:|---:|---:|")
    both = {}
    for schema in SCHEMAS:
        complete = statistics.median(c for c, _ in results[schema])
        archive = statistics.median(a for _, a in results[schema])
        both[schema] = complete + archive
        print(
            f"| {schema} | {complete * 1e6:.1f} µs | {archive * 1e6:.1f} µs | {both[schema] * 1e6:.1f} µs |"
        )
    print(f"\n0023 / before 0023, both: {both['0023'] / both['before 0023']:.2f}")


if __name__ == "__main__":
    main()
