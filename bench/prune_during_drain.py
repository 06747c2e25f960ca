"""Pruning a million finished tasks while 16 workers drain the queue: what the prune costs them.

    python bench/prune_during_drain.py [--url URL] [--rows 1000000] [--workers 16]
                                       [--window 20] [--rounds 2] [--backlog 300000]
                                       [--pause 0.05]

In a scratch database of its own (created, then dropped), it loads ``--rows`` finished tasks
older than the 30-day horizon (INSERT ... SELECT generate_series, in chunks: the statement
triggers of worker_tasks run once per chunk, over its transition table), and a backlog of
pending no-op tasks over 1,000 stores. Then ``--workers`` processes drain as the Worker loop does
(``claim_tasks`` of 50 with start, then ``complete_tasks``), each timing its claims, for the
whole run; the run alternates windows of ``--window`` seconds without and with the prune
(``tq_pipelines.queue.retention.prune`` with its default settings: 5,000 rows a batch, 50 ms apart,
its time budget the window), ``--rounds`` times each. Between windows, unmeasured, the backlog is
topped up, and before a window with the prune the finished rows are topped up to ``--rows``
again (in older hours, whose rollup the prune then makes, as it would the first time).

Per window: tasks claimed per second (all workers), claim latency p50 and p99, and the rows the
prune deleted and its rows/s.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import ROLE, recreate_db, server_parser
from tq_pipelines.db.migrate import migrate
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.retention import RetentionSettings, prune

BENCH_DB = "tq_bench_prune"
STORES = 1000
CLAIM = 50
CHUNK = 250_000


def load_finished(url: str, rows: int, round_: int) -> float:
    """``rows`` completed tasks, a minute each, spread over 60 days that end 31 + 60 * round_
    days ago; returns the seconds it took."""
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        for first in range(0, rows, CHUNK):
            conn.execute(
                """
                INSERT INTO worker_tasks (role, dispensary_id, platform, status, worker_id,
                                          created_at, claimed_at, started_at, completed_at)
                SELECT %(role)s, 1 + g %% %(stores)s, 'dutchie', 'completed', 'old-worker',
                       e - interval '2 minutes', e - interval '1 minute', e - interval '1 minute', e
                FROM generate_series(%(first)s, %(last)s) AS g
                CROSS JOIN LATERAL (
                  SELECT now() - make_interval(days => 31 + 60 * %(round)s)
                         - g * (interval '60 days' / %(rows)s) AS e
                ) AS t
                """,
                {
                    "role": ROLE,
                    "stores": STORES,
                    "first": first,
                    "last": min(first + CHUNK, rows) - 1,
                    "round": round_,
                    "rows": rows,
                },
            )
    return time.monotonic() - started


def pending(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM worker_tasks WHERE status = 'pending'").fetchone()
    return int(row[0]) if row else 0


def top_up_backlog(url: str, backlog: int) -> int:
    """Pending no-op tasks up to ``backlog``, interleaved over the stores; returns how many were added."""
    missing = backlog - pending(url)
    with psycopg.connect(url, autocommit=True) as conn:
        if missing > 0:
            conn.execute(
                """
                INSERT INTO worker_tasks (role, dispensary_id, platform)
                SELECT %s, 1 + g %% %s, 'dutchie'
                FROM generate_series(0, %s - 1) AS g
                ORDER BY g
                """,
                (ROLE, STORES, missing),
            )
    return max(missing, 0)


def old_rows(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM worker_tasks "
            "WHERE status = 'completed' AND completed_at < now() - interval '31 days'"
        ).fetchone()
    return int(row[0]) if row else 0


def _worker(url: str, n: int, stop: Any, ready: Any, out: Any) -> None:
    """Claim and complete until told to stop; sends back (claim start, seconds, tasks) per claim."""
    samples: list[tuple[float, float, int]] = []
    with TaskQueue.connect(url, min_size=1, max_size=1) as queue:
        worker_id = f"bench-{n}"
        queue.claim_many("analytics_refresh", worker_id, 1)  # connect and warm the session
        ready.wait()
        while not stop.is_set():
            began = time.monotonic()
            tasks = queue.claim_many(ROLE, worker_id, CLAIM, start=True)
            samples.append((began, time.monotonic() - began, len(tasks)))
            if tasks:
                queue.complete_many_json(dict.fromkeys((t.lease for t in tasks), "null"))
            else:
                time.sleep(0.01)
    out.put(samples)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000, help="finished tasks past the horizon")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per measured window")
    parser.add_argument("--rounds", type=int, default=2, help="windows without, then with, the prune")
    parser.add_argument(
        "--pause",
        type=float,
        default=RetentionSettings.pause_seconds,
        help="the prune's pause between batches",
    )
    parser.add_argument("--backlog", type=int, default=300_000, help="pending tasks at each window's start")
    args = parser.parse_args()

    url = recreate_db(args.url, BENCH_DB)
    try:
        run(url, args)
    finally:
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(BENCH_DB)))


def run(url: str, args: argparse.Namespace) -> None:
    began = time.monotonic()
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)
            SELECT 'store ' || g, 'dutchie', 'pid-' || g FROM generate_series(1, %s) AS g
            """,
            (STORES,),
        )
    seconds = load_finished(url, args.rows, 0)
    print(f"loaded {args.rows:,} finished tasks in {seconds:.1f} s ({args.rows / seconds:,.0f} rows/s)")
    top_up_backlog(url, args.backlog)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE worker_tasks")

    ctx = mp.get_context("fork")
    stop, ready, out = ctx.Event(), ctx.Barrier(args.workers + 1), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, n, stop, ready, out)) for n in range(args.workers)]
    for p in procs:
        p.start()
    ready.wait()

    windows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for with_prune in (False, True):
            if with_prune and r > 0:
                load_finished(url, args.rows - old_rows(url), r)
            top_up_backlog(url, args.backlog)
            time.sleep(1)
            window: dict[str, Any] = {"round": r + 1, "prune": with_prune, "start": time.monotonic()}
            if with_prune:
                settings = RetentionSettings(pause_seconds=args.pause, time_budget_seconds=args.window)
                result: dict[str, Any] = {}
                pruner = threading.Thread(
                    target=lambda s=settings, res=result: res.update(report=prune(url, s))
                )
                pruner.start()
                time.sleep(args.window)
                window["end"] = time.monotonic()
                pruner.join()
                table = result["report"].tables["worker_tasks"]
                window["pruned"], window["prune_seconds"] = table.rows, table.seconds
            else:
                time.sleep(args.window)
                window["end"] = time.monotonic()
            windows.append(window)
            window["pending_left"] = pending(url)
            print(f"window {len(windows)} done", flush=True)
    stop.set()
    samples = [s for _ in procs for s in out.get()]
    for p in procs:
        p.join()

    print(
        f"\n{args.workers} workers, claims of {CLAIM} with start; windows of {args.window:g} s; "
        f"prune batches of {RetentionSettings.batch_size:,}, {args.pause * 1000:g} ms apart\n"
    )
    print(
        "| round | prune | tasks claimed/s | claims/s | claim p50 ms | claim p99 ms "
        "| rows pruned | prune rows/s | pending left |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rates: dict[bool, list[float]] = {False: [], True: []}
    p99s: dict[bool, list[float]] = {False: [], True: []}
    for w in windows:
        inside = [s for s in samples if w["start"] <= s[0] < w["end"]]
        full = [s[1] * 1000 for s in inside if s[2]]
        seconds = w["end"] - w["start"]
        rate = sum(s[2] for s in inside) / seconds
        rates[w["prune"]].append(rate)
        p99s[w["prune"]].append(percentile(full, 0.99))
        pruned = f"{w['pruned']:,} | {w['pruned'] / w['prune_seconds']:,.0f}" if w["prune"] else "- | -"
        print(
            f"| {w['round']} | {'with' if w['prune'] else 'without'} | {rate:,.0f} "
            f"| {len(inside) / seconds:,.0f} | {percentile(full, 0.5):.1f} | {percentile(full, 0.99):.1f} "
            f"| {pruned} | {w['pending_left']:,} |"
        )
    rate_ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    p99_ratio = statistics.median(p99s[True]) / statistics.median(p99s[False])
    print(
        f"\nwith / without, medians: claim rate {rate_ratio:.2f}, p99 claim latency {p99_ratio:.2f}; "
        f"whole run {time.monotonic() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
