"""What moving finished tasks out of the hot table costs, beside what completing them costs (0022).

    python bench/archive_cost.py [--url URL] [--tasks 20000] [--stores 5000] [--batch 5000]
                                 [--rounds 3]

One database with the project's migrations. Each round: ``--tasks`` tasks are enqueued (one
INSERT of many rows), claimed with start 50 at a time and completed 50 at a time
(``complete_tasks``), the completions timed; then ``archive_tasks`` moves them to
worker_task_history ``--batch`` at a time, timed. Each statement is its own transaction on a
local connection; the figures are the client's time per task (claim excluded), medians over the
rounds, so the archive is set against the completion it follows in the same run and database.
The history grows round by round, as it would between prunes.
"""

import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import recreate_db, reset_stores, server_parser
from tq_pipelines.db.migrate import migrate

ROLE = "product_resync"
WORKER = "bench-archive"
CLAIM = "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, 50, true) AS c"


def one_round(conn: psycopg.Connection, tasks: int, stores: int, batch: int) -> tuple[float, float]:
    """Seconds per task: completing them, then archiving them."""
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
    assert moved == done, (moved, done)
    return completing / done, archiving / moved


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--stores", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    url = recreate_db(args.url, "tq_bench_archive")
    migrate(url)
    results: list[tuple[float, float]] = []
    with psycopg.connect(url, autocommit=True) as conn:
        reset_stores(conn, args.stores)
        conn.execute("SELECT register_worker(%s, %s)", (WORKER, ROLE))
        for n in range(args.rounds):
            results.append(one_round(conn, args.tasks, args.stores, args.batch))
            conn.execute("VACUUM ANALYZE worker_tasks, worker_task_history")
            c, a = results[-1]
            print(f"round {n + 1}: complete {c * 1e6:.1f} us/task, archive {a * 1e6:.1f} us/task", flush=True)
        size = conn.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('worker_tasks')),"
            " pg_size_pretty(pg_total_relation_size('worker_task_history'))"
        ).fetchone()
    complete = statistics.median(c for c, _ in results)
    archive = statistics.median(a for _, a in results)
    print()
    print("| per task (median of rounds) | microseconds |")
    print("|---|---:|")
    print(f"| `complete_tasks`, 50 a call | {complete * 1e6:.1f} |")
    print(f"| `archive_tasks`, {args.batch} a call | {archive * 1e6:.1f} |")
    print(f"| archive / complete | {archive / complete:.2f} |")
    tasks_size, history_size = size if size else ("?", "?")
    print(f"\nworker_tasks {tasks_size}, worker_task_history {history_size} at the end")


if __name__ == "__main__":
    main()
