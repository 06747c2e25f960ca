"""Analysts' scans beside the queue: what readers counting ``worker_tasks`` cost the queue's own
work, with their scans parallel (the planner's default) and in one process (migration 0021).

    python bench/reader_scans.py [--url URL] [--history 600000] [--readers 4] [--seconds 30]
                                 [--rounds 2] [--rate 0] [--victim queue|pgbench]

One database migrated to now, with ``--history`` finished tasks in ``worker_tasks`` (a few days of
a busy fleet), vacuumed and analysed. The queue's work is what the long-horizon bench found
short of CPU under readers: ``PRODUCERS`` processes calling ``enqueue_task_once`` one task at a
time, as fast as they can or at ``--rate`` tasks/s between them (the long-horizon bench's fixed
offered load), and a worker process claiming 50 with start and completing them, each on its own
connection and in its own process. For ``--seconds`` each, three cases in turn:

- ``none``: no readers;
- ``parallel``: ``--readers`` REPEATABLE READ transactions, each counting ``worker_tasks`` every
  100 ms (the harness's active readers), with the table's ``parallel_workers`` reset, so their
  counts plan as the server's settings make them (parallel once the table passes 8 MB);
- ``serial``: the same readers with 0021's ``parallel_workers = 0``.

``--victim pgbench`` puts pgbench's TPC-B-like transactions (4 clients, scale 10, in the same
database) in the queue's place: another user of the server.

The order of the cases turns each round, so that they share the machine's state. Per case: tasks
completed per second, the readers' counts per second and the mean time of one, and the completions
as a fraction of the ``none`` case of the same round.
"""

import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import recreate_db, reset_stores, server_parser
from tq_pipelines.db.migrate import migrate

ROLE = "product_resync"
WORKER = "bench-readers"
PRODUCERS = 2
STORES = 5000
CLAIM = "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, %s, true) AS c"
CASES = ("none", "parallel", "serial")


def producer(url: str, index: int, rate: float, until: float, out: "mp.Queue[tuple[str, int]]") -> None:
    """Enqueue one task per call, on this producer's share of the stores in turn: at its share of
    ``rate`` (a late call goes at once, none is skipped), or as fast as it can with rate 0."""
    n = 0
    step = PRODUCERS / rate if rate > 0 else 0.0
    with psycopg.connect(url, autocommit=True) as conn:
        stores = [r[0] for r in conn.execute("SELECT id FROM dispensaries ORDER BY id")][index::PRODUCERS]
        i = 0
        due = time.monotonic()
        while (now := time.monotonic()) < until:
            if step:
                if now < due:
                    time.sleep(due - now)
                due += step
            i = (i + 1) % len(stores)
            if conn.execute("SELECT enqueue_task_once(%s, %s)", (ROLE, stores[i])).fetchone()[0] is not None:  # type: ignore[index]
                n += 1
    out.put(("enqueued", n))


def worker(url: str, until: float, out: "mp.Queue[tuple[str, int]]") -> None:
    """Claim 50 with start and complete them, as the drain runs' Worker does; idle, poll at 10 ms."""
    n = 0
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < until:
            rows = conn.execute(CLAIM, (ROLE, WORKER, 50)).fetchall()
            if not rows:
                time.sleep(0.01)
                continue
            conn.execute(
                "SELECT complete_tasks(%s, %s, %s::JSONB[])",
                ([r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)),
            )
            n += len(rows)
    out.put(("completed", n))


def reader(url: str, stop: threading.Event, times: list[float]) -> None:
    """One REPEATABLE READ transaction for the case, a count every 100 ms."""
    with psycopg.connect(url) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        while not stop.is_set():
            began = time.perf_counter()
            conn.execute("SELECT count(*) FROM worker_tasks").fetchall()
            times.append(time.perf_counter() - began)
            stop.wait(0.1)
        conn.rollback()


def pgbench(url: str, seconds: float) -> float:
    """TPC-B-like transactions per second of pgbench's 4 clients on the bench's database."""
    done = subprocess.run(
        ["pgbench", "-n", "-c", "4", "-j", "2", "-T", str(int(seconds)), url],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(re.search(r"tps = ([0-9.]+)", done.stdout).group(1))  # type: ignore[union-attr]


def queue_work(url: str, rate: float, seconds: float) -> tuple[float, float]:
    """The producers and the worker for ``seconds``: tasks completed and enqueued per second."""
    out: mp.Queue[tuple[str, int]] = mp.Queue()
    until = time.monotonic() + seconds
    procs = [mp.Process(target=producer, args=(url, i, rate, until, out)) for i in range(PRODUCERS)]
    procs.append(mp.Process(target=worker, args=(url, until, out)))
    began = time.monotonic()
    for p in procs:
        p.start()
    totals: dict[str, int] = {"enqueued": 0, "completed": 0}
    for _ in procs:
        key, n = out.get()
        totals[key] += n
    elapsed = time.monotonic() - began
    for p in procs:
        p.join()
    return totals["completed"] / elapsed, totals["enqueued"] / elapsed


def drain(url: str) -> None:
    """What the worker left, completed, so that the next case starts empty."""
    with psycopg.connect(url, autocommit=True) as conn:
        while rows := conn.execute(CLAIM, (ROLE, WORKER, 500)).fetchall():
            conn.execute(
                "SELECT complete_tasks(%s, %s, %s::JSONB[])",
                ([r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)),
            )


def run_case(url: str, case: str, readers: int, rate: float, seconds: float, victim: str) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE worker_tasks RESET (parallel_workers)"
            if case == "parallel"
            else "ALTER TABLE worker_tasks SET (parallel_workers = 0)"
        )
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN SELECT count(*) FROM worker_tasks"))
    stop = threading.Event()
    times: list[float] = []
    threads = [
        threading.Thread(target=reader, args=(url, stop, times))
        for _ in range(readers if case != "none" else 0)
    ]
    for t in threads:
        t.start()
    time.sleep(1)  # the readers' snapshots taken, their first counts under way
    began = time.monotonic()
    completed_s, enqueued_s = (
        (pgbench(url, seconds),) * 2 if victim == "pgbench" else queue_work(url, rate, seconds)
    )
    elapsed = time.monotonic() - began
    stop.set()
    for t in threads:
        t.join()
    drain(url)
    return {
        "completed_s": completed_s,
        "enqueued_s": enqueued_s,
        "counts_s": len(times) / elapsed if times else 0.0,
        "count_ms": 1000 * statistics.mean(times) if times else 0.0,
        "parallel_plan": float("Gather" in plan),
    }


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--history", type=int, default=600_000, help="finished tasks in worker_tasks")
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0, help="tasks/s offered (0: as fast as they go)")
    parser.add_argument(
        "--victim",
        choices=("queue", "pgbench"),
        default="queue",
        help="whose work the readers share the cores with",
    )
    args = parser.parse_args()

    url = recreate_db(args.url, "tq_bench_readers")
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        reset_stores(conn, STORES)
        conn.execute("SELECT register_worker(%s, %s)", (WORKER, ROLE))
        conn.execute(
            """
            INSERT INTO worker_tasks (role, status, worker_id, claimed_at, started_at, completed_at,
                                      created_at, result, lease_hash)
            SELECT %s, 'completed', %s, t, t, t + interval '2 seconds', t, '{}', sha256(g::TEXT::BYTEA)
            FROM generate_series(1, %s) g,
                 LATERAL (SELECT now() - make_interval(secs => g * 0.5)) AS c(t)
            """,
            (ROLE, WORKER, args.history),
        )
        if args.victim == "pgbench":
            subprocess.run(["pgbench", "-i", "-q", "-s", "10", url], capture_output=True, check=True)
        conn.execute("VACUUM ANALYZE")
        size = conn.execute("SELECT pg_size_pretty(pg_table_size('worker_tasks'))").fetchone()[0]  # type: ignore[index]
        server = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    print(
        f"PostgreSQL {server}, worker_tasks {args.history:,} finished tasks ({size}), {os.cpu_count()} cores"
    )

    results: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    ratios: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        order = CASES if r % 2 == 0 else CASES[::-1]
        got = {c: run_case(url, c, args.readers, args.rate, args.seconds, args.victim) for c in order}
        for c in CASES:
            results[c].append(got[c])
            ratios[c].append(got[c]["completed_s"] / got["none"]["completed_s"])
            print(
                f"round {r + 1} {c:>8}: completed {got[c]['completed_s']:.0f}/s, enqueued "
                f"{got[c]['enqueued_s']:.0f}/s, counts {got[c]['counts_s']:.1f}/s of "
                f"{got[c]['count_ms']:.0f} ms, parallel plan {bool(got[c]['parallel_plan'])}",
                flush=True,
            )

    print()
    work = "pgbench transactions/s" if args.victim == "pgbench" else "tasks completed/s"
    print(f"| readers' scans | {work} | x no readers | counts/s | one count, ms | parallel plan |")
    print("|---|---:|---:|---:|---:|---|")
    for c in CASES:
        rows = results[c]
        print(
            f"| {c} | {statistics.median(x['completed_s'] for x in rows):.0f} "
            f"| {statistics.median(ratios[c]):.2f} "
            f"| {statistics.median(x['counts_s'] for x in rows):.1f} "
            f"| {statistics.median(x['count_ms'] for x in rows):.0f} "
            f"| {'yes' if rows[0]['parallel_plan'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
