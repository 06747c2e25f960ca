"""Slot hand-offs on one platform: the queue as it is against the queue before a migration, in one run.

    python bench/slot_handoffs.py [--url URL] [--before 0026] [--slots 8,16] [--tasks 6000]
                                  [--repeat 3] [--pgbench-seconds 5] [--pass [both]]

Every hand-off (``platform_handoff``: the slot goes back and the platform's next task is
claimed with it) locks its platform's row in ``tq_platforms``, so the hand-offs of a platform
take turns. Before 0025 the row stayed locked through the commit's WAL flush; before 0026 a
hand-off wrote the row three times, in two UPDATEs of worker_tasks, each with its triggers.

Two databases on one server: the project's migrations, and those before ``--before``. In each,
``--tasks`` stores of one platform get a task, the platform allows ``--slots`` requests in
flight (and a rate that never binds), one worker claims that many tasks, and as many threads
(each its own connection) hand their slot on, task after task, until the queue is empty: the
crawl's path between two requests of a slot, with no HTTP and no handler. Hand-offs per second,
median of ``--repeat``, the databases alternating, and the server's CPU per hand-off (the
backends' CPU time from /proc: a server on this machine); every task is checked taken once and
every slot given back. pgbench's TPC-B on the same server, with as many clients, is the reference the ratio of
the two is set beside (how fast this server commits).
"""

import queue as queue_module
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import proc_cpu
from bench.queue_throughput import migrated_db, reset_stores, server_parser
from tq_pipelines.queue.api import PlatformLimits, Task, TaskQueue

ROLE = "product_resync"
WORKER = "bench-handoffs"


def handoffs(url: str, slots: int, tasks: int, passes: bool = False) -> tuple[float, float]:
    """Hand-offs per second, ``slots`` threads handing their slots on until no task is left, and
    the CPU milliseconds the server's backends spent on each (a local server's, from /proc).
    With ``passes``, the drain's path since 0028: each thread passes its slot to a standby task,
    which claims the next standby in the same statement (``platform_pass``)."""
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
        with psycopg.connect(url, autocommit=True) as conn:
            backends = [
                pid
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
            ]
        cpu_before = sum(proc_cpu(pid) or 0.0 for pid in backends)

        # A task that passed its slot on completes, as in a drain, on a connection of its own
        # (its CPU not counted): standbys are bounded by the worker's tasks without a slot.
        finished: queue_module.Queue[Task | None] = queue_module.Queue()

        completed = [0]

        def complete() -> None:
            with TaskQueue.connect(url, min_size=1, max_size=1) as own:
                while (task := finished.get()) is not None:
                    completed[0] += own.complete(task, None)

        def pass_on(i: int) -> None:
            task = held[i]
            standby = queue.platform_standby(task)
            go.wait()
            while standby is not None:
                decision, replacement = queue.platform_pass(task, standby, replace=True)
                assert decision.decision == "go"
                finished.put(task)
                done[i] += 1
                task, standby = standby, replacement
            queue.platform_release(task)
            done[i] += 1

        completer = threading.Thread(target=complete)
        completer.start()

        def hand_on(i: int) -> None:
            task = held[i]
            go.wait()
            while True:
                # Done with its request, the task passes the slot on (and would go on to store
                # what it fetched and complete, off the path measured here: not done).
                nxt = queue.platform_handoff(task)
                done[i] += 1
                if nxt is None:
                    return
                task = nxt

        threads = [threading.Thread(target=pass_on if passes else hand_on, args=(i,)) for i in range(slots)]
        for t in threads:
            t.start()
        go.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        took = time.perf_counter() - began
        server_ms = (sum(proc_cpu(pid) or 0.0 for pid in backends) - cpu_before) * 1000 / tasks
        finished.put(None)
        completer.join()
    with psycopg.connect(url, autocommit=True) as conn:
        [(claimed, in_flight)] = conn.execute(
            "SELECT (SELECT count(*) FROM worker_tasks WHERE worker_id = %s AND status = 'running'),"
            " (SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie')",
            (WORKER,),
        ).fetchall()
    claimed += completed[0]
    # Every task was claimed once (by the claim or a hand-off) and each gave its slot back.
    assert claimed == tasks and in_flight == 0 and sum(done) == tasks, (claimed, in_flight, sum(done))
    return tasks / took, server_ms


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
    parser.add_argument("--before", default="0026", help="the migration the queue before is without")
    parser.add_argument("--slots", default="8,16", help="slots of the platform (threads), comma-separated")
    parser.add_argument("--tasks", type=int, default=6000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pgbench-seconds", type=int, default=5)
    parser.add_argument(
        "--pass",
        dest="passes",
        nargs="?",
        const="now",
        choices=["now", "both"],
        help="slots passed to standby tasks (0028): by the queue now (the queue before hands them"
        " off), or by both",
    )
    args = parser.parse_args()
    schemas = {"now": None, f"before {args.before}": args.before}
    urls = {
        name: migrated_db(args.url, f"tq_bench_handoffs_{i}", v)
        for i, (name, v) in enumerate(schemas.items())
    }
    head = (
        f"{'slots':>5}  {'now /s':>8}  {'before /s':>9}  {'ratio':>5}  {'server ms, now':>14}  {'before':>6}"
    )
    print(head + f"  {'pgbench TPS':>11}")
    for slots in (int(x) for x in args.slots.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
        for i in range(args.repeat):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                runs[name].append(
                    handoffs(
                        urls[name],
                        slots,
                        args.tasks,
                        args.passes == "both" or (args.passes == "now" and name == "now"),
                    )
                )
        tps = pgbench_tps(args.url, slots, args.pgbench_seconds) if args.pgbench_seconds else float("nan")
        (new, new_ms), (old, old_ms) = (
            (statistics.median(r for r, _ in runs[n]), statistics.median(m for _, m in runs[n]))
            for n in schemas
        )
        print(
            f"{slots:>5}  {new:>8.0f}  {old:>9.0f}  {new / old:>5.2f}"
            f"  {new_ms:>14.2f}  {old_ms:>6.2f}  {tps:>11.0f}",
            flush=True,
        )
        for name, xs in runs.items():
            print(f"       {name}: " + ", ".join(f"{r:.0f}/s {m:.2f} ms" for r, m in xs), flush=True)


if __name__ == "__main__":
    main()
