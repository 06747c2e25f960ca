"""Claims and enqueues while a snapshot is held: their server time as dead row versions pile up.

    python bench/held_xmin.py [--url URL] [--stores 5000] [--rounds 6] [--churn 10000]
                              [--before 0015] [--samples 200]

One transaction holds its XID from the start (``BEGIN; SELECT txid_current()``: vacuum can
reclaim nothing made after it), as an analyst's report or a forgotten session would. Then, for
``--rounds`` rounds, ``--churn`` tasks go through the queue the way a worker fleet moves them
(``enqueue_task_once`` one at a time, ``claim_tasks`` of 50 with start, ``complete_tasks``),
each statement its own transaction, leaving their dead versions behind; after each round,
``--samples`` single tasks are timed: one enqueue, one claim of 1, one completion, each its own
statement, median server time (``pg_stat_statements`` is not needed: the client's time of a
statement on a local socket, minus nothing; the same for both schemas). Each round ends with an
ANALYZE of the queue's tables, as autovacuum would make (it analyses while a snapshot is held);
without it, on a server with autovacuum off, the plans cached while the tables were empty scan
them in sequence and every figure grows with the dead versions for that reason alone.

``--before VERSION`` builds a second database with the migrations before VERSION (the queue as
it was) and measures both in the same run, alternating which goes first per round, so that the
two columns share the machine's state. The last table gives dead tuples per task moved, per hot
table, at the end.
"""

import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import migrated_db, reset_stores, server_parser

ROLE = "product_resync"
WORKER = "bench-held"
TABLES = (
    "worker_tasks",
    "worker_task_heads",
    "worker_task_stores",
    "worker_registry",
    "worker_tallies",
    "worker_task_floors",
)
CLAIM = "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, %s, true) AS c"


class Schema:
    """One database: its connection, its snapshot holder, its next store."""

    def __init__(self, url: str, stores: int) -> None:
        self.url = url
        self.stores = stores
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("SELECT register_worker(%s, %s)", (WORKER, ROLE))
        self.holder = psycopg.connect(url)
        self.holder.execute("SELECT txid_current()")
        self.next_store = 0
        self.moved = 0

    def store(self) -> int:
        self.next_store = self.next_store % self.stores + 1
        return self.next_store

    def churn(self, n: int) -> None:
        for i in range(n):
            self.conn.execute("SELECT enqueue_task_once(%s, %s)", (ROLE, self.store()))
            if i % 50 == 49 or i == n - 1:
                self._drain()
        self.moved += n
        # What autovacuum's analyze does (0015: at 1 % of worker_tasks): new statistics, and the
        # sessions' cached plans made when the tables were empty replanned. Without it (a server
        # with autovacuum off) those plans scan every version of the tables in sequence.
        self.conn.execute("ANALYZE worker_tasks, worker_task_heads, worker_task_stores, worker_task_floors")

    def _drain(self) -> None:
        while rows := self.conn.execute(CLAIM, (ROLE, WORKER, 50)).fetchall():
            self.conn.execute(
                "SELECT complete_tasks(%s, %s, %s::JSONB[])",
                ([r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)),
            )

    def sample(self, n: int) -> dict[str, float]:
        """Median ms of one enqueue, one claim of 1 and one completion, over n tasks."""
        times: dict[str, list[float]] = {"enqueue": [], "claim": [], "complete": []}
        for _ in range(n):
            t0 = time.perf_counter()
            self.conn.execute("SELECT enqueue_task_once(%s, %s)", (ROLE, self.store()))
            t1 = time.perf_counter()
            ((task_id, lease),) = self.conn.execute(CLAIM, (ROLE, WORKER, 1)).fetchall()
            t2 = time.perf_counter()
            self.conn.execute("SELECT complete_task(%s, %s, NULL)", (task_id, lease))
            t3 = time.perf_counter()
            times["enqueue"].append(t1 - t0)
            times["claim"].append(t2 - t1)
            times["complete"].append(t3 - t2)
        self.moved += n
        return {k: 1000 * statistics.median(v) for k, v in times.items()}

    def dead(self) -> dict[str, int]:
        self.conn.execute("SELECT pg_stat_force_next_flush()")
        rows = self.conn.execute(
            "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)", (list(TABLES),)
        ).fetchall()
        return dict(rows)

    def close(self) -> None:
        self.holder.rollback()
        self.holder.close()
        self.conn.close()


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--stores", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--churn", type=int, default=10000, help="tasks moved through the queue per round")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument(
        "--before", default="", help="also measure the schema as it was before this migration"
    )
    args = parser.parse_args()

    urls = {"now": migrated_db(args.url, "tq_bench_held")}
    if args.before:
        urls[f"before {args.before}"] = migrated_db(args.url, "tq_bench_held_before", args.before)
    for url in urls.values():
        with psycopg.connect(url, autocommit=True) as conn:
            reset_stores(conn, args.stores)
            conn.execute("VACUUM ANALYZE")
    schemas = {name: Schema(url, args.stores) for name, url in urls.items()}
    names = list(schemas)
    rows: list[tuple[int, dict[str, dict[str, float]]]] = []
    try:
        for r in range(args.rounds + 1):
            order = names if r % 2 == 0 else names[::-1]
            if r:
                for name in order:
                    schemas[name].churn(args.churn)
            figures = {name: schemas[name].sample(args.samples) for name in order}
            rows.append((schemas[names[0]].moved, figures))
            print(
                f"{schemas[names[0]].moved:>8} moved: "
                + "; ".join(f"{n} " + " ".join(f"{k} {v:.3f}" for k, v in figures[n].items()) for n in names),
                flush=True,
            )
        dead = {name: s.dead() for name, s in schemas.items()}
        moved = {name: s.moved for name, s in schemas.items()}
    finally:
        for s in schemas.values():
            s.close()

    print()
    head = " | ".join(f"{n}: enqueue / claim / complete (ms)" for n in names)
    ratio = " | claim now / before |" if args.before else " |"
    print(f"| tasks moved under the held snapshot | {head}{ratio}")
    print("|---:|" + "---|" * len(names) + ("---:|" if args.before else ""))
    for moved_at, figures in rows:
        cells = " | ".join(
            f"{figures[n]['enqueue']:.3f} / {figures[n]['claim']:.3f} / {figures[n]['complete']:.3f}"
            for n in names
        )
        extra = f" {figures['now']['claim'] / figures[names[1]]['claim']:.2f} |" if args.before else ""
        print(f"| {moved_at:,} | {cells} |{extra}")
    print()
    print("| dead tuples per task moved | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for table in TABLES:
        print(
            f"| `{table}` | "
            + " | ".join(
                f"{dead[n].get(table, 0) / max(moved[n], 1):.2f}" if table in dead[n] else "-" for n in names
            )
            + " |"
        )


if __name__ == "__main__":
    main()
