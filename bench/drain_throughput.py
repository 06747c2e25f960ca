"""Drain throughput: no-op tasks drained by real Dagster runs against the bare Worker loop.

    python bench/drain_throughput.py [--url URL] [--tasks 10000] [--runs 1]

In one run, on one database server:
1. `dagster dev` (daemon, task_queue_sensor, QueuedRunCoordinator, PostgreSQL storage) starts;
2. the bare loop: ``--runs`` Worker processes (the loop drain runs use) drain ``--tasks`` tasks
   of a second queue database, with Dagster idling beside them;
3. the day's resync is generated for ``--tasks`` stores in the database the sensor watches, and
   the bench waits for the last completion. The sensor may start up to ``--runs`` drain runs.
Figures: tasks/s from first claim to last completion (from v_tasks, the same measure for
both, per worker and summed), and the wall time from generation to the last completion.
"""

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.queue_throughput import recreate_db, reset_stores  # noqa: E402
from tq_pipelines.db import sqlalchemy_url  # noqa: E402
from tq_pipelines.db.migrate import migrate  # noqa: E402
from tq_pipelines.queue.api import TaskQueue  # noqa: E402
from tq_pipelines.queue.worker import Worker  # noqa: E402

ROLE = "product_resync"


def load_stores(url: str, stores: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        reset_stores(conn, stores)
        conn.execute("VACUUM ANALYZE dispensaries")


def generate(url: str) -> int:
    with TaskQueue.connect(url) as queue:
        # One batch: every task is due at once, at 00:00 UTC today.
        return queue.generate_resync(day=datetime.now(UTC).date(), batches_per_day=1)


def per_worker_rates(url: str) -> list[tuple[str, int, float]]:
    """(worker, tasks, tasks/s from its first claim to its last completion)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            """
            SELECT worker_id, count(*), extract(EPOCH FROM max(completed_at) - min(claimed_at))
            FROM v_tasks WHERE status = 'completed'
            GROUP BY worker_id ORDER BY worker_id
            """
        ).fetchall()
    return [(w, n, n / float(s) if s else 0.0) for w, n, s in rows]


def overall_rate(url: str) -> tuple[int, float]:
    with psycopg.connect(url) as conn:
        n, seconds = conn.execute(
            "SELECT count(*), extract(EPOCH FROM max(completed_at) - min(claimed_at)) FROM v_tasks"
            " WHERE status = 'completed'"
        ).fetchone()  # type: ignore[misc]
    return n, n / float(seconds)


def _bare(url: str, n: int, batch: int) -> None:
    with TaskQueue.connect(url, max_size=2) as queue:
        Worker(queue, ROLE, lambda task, ctx: None, worker_id=f"bare-{n}", batch_size=batch).run()


def run_bare(url: str, workers: int, batch: int) -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_bare, args=(url, n, batch)) for n in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def wait_until_done(url: str, total: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            done = conn.execute("SELECT count(*) FROM v_tasks WHERE status = 'completed'").fetchone()
            if done and done[0] >= total:
                return
            time.sleep(0.2)
    raise SystemExit(f"not drained within {timeout:.0f} s")


def start_dagster(
    home: Path, queue_url: str, dagster_url: str, runs: int, batch: int
) -> subprocess.Popen[bytes]:
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "TQ_DATABASE_URL": queue_url,
        "TQ_DAGSTER_PG_URL": sqlalchemy_url(dagster_url),
        "TQ_ROLE_CAPS": f"{ROLE}={runs}",
        # The queue's overhead is measured here, not the crawl's (bench/crawl_throughput.py).
        "TQ_HANDLERS": f"{ROLE}=tq_pipelines.handlers:noop",
    }
    log = open(home / "dagster-dev.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("dagster")),
            "dev",
            "-w",
            str(ROOT / "workspace.yaml"),
            "-p",
            "3999",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # A parent started in the background may ignore SIGINT; dagster dev needs it to stop.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def stop_dagster(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_until_live(home: Path, dagster_url: str, timeout: float = 180) -> None:
    """Until task_queue_sensor has ticked and no resync run is under way (on a queue with no
    stores the catch-up waits for stores and starts none): the system is live and idle."""
    deadline = time.monotonic() + timeout
    log = home / "dagster-dev.log"
    while time.monotonic() < deadline:
        if log.exists() and "Sensor task_queue_sensor skipped" in log.read_text(errors="replace"):
            try:
                with psycopg.connect(dagster_url) as conn:
                    busy = conn.execute(
                        "SELECT count(*) FROM runs WHERE pipeline_name = 'generate_resync_tasks_job'"
                        " AND status IN ('NOT_STARTED', 'QUEUED', 'STARTING', 'STARTED')"
                    ).fetchone()
                if busy == (0,):
                    return
            except psycopg.errors.UndefinedTable:
                pass
        time.sleep(0.5)
    raise SystemExit(f"dagster dev did not come up; see {log}")


def generation_to_last_completion(url: str) -> float:
    """Seconds from the first task's creation to the last completion, by the database's clock."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT extract(EPOCH FROM max(completed_at) - min(created_at)) FROM v_tasks"
        ).fetchone()
    assert row and row[0] is not None
    return float(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.environ.get("TQ_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--tasks", type=int, default=10000)
    parser.add_argument("--runs", type=int, default=1, help="drain runs (and bare workers) at once")
    parser.add_argument("--batch", type=int, default=50, help="tasks per claim (the Worker default)")
    args = parser.parse_args()

    # Two queue databases on the same server: one the sensor watches, one for the bare loop,
    # which runs while Dagster is up so that both see the same machine.
    queue_url = recreate_db(args.url, "tq_bench_drain")
    bare_url = recreate_db(args.url, "tq_bench_drain_bare")
    dagster_url = recreate_db(args.url, "tq_bench_drain_dagster")
    for url in (queue_url, bare_url):
        migrate(url)
    load_stores(bare_url, args.tasks)

    with tempfile.TemporaryDirectory(prefix="tq-drain-bench-") as tmp:
        home = Path(tmp)
        proc = start_dagster(home, queue_url, dagster_url, args.runs, args.batch)
        try:
            wait_until_live(home, dagster_url)
            generate(bare_url)
            run_bare(bare_url, args.runs, args.batch)
            load_stores(queue_url, args.tasks)
            created = generate(queue_url)
            assert created == args.tasks, created
            wait_until_done(queue_url, created, timeout=300)
        finally:
            stop_dagster(proc)
    bare_n, bare_rate = overall_rate(bare_url)
    bare_workers = per_worker_rates(bare_url)
    dagster_n, dagster_rate = overall_rate(queue_url)
    runs = per_worker_rates(queue_url)
    wall = generation_to_last_completion(queue_url)

    bare_per = sum(r for _, _, r in bare_workers) / len(bare_workers)
    run_per = sum(r for _, _, r in runs) / len(runs)
    print(f"\n{args.tasks} no-op tasks, batch {args.batch}, up to {args.runs} run(s) at once\n")
    print("| measure | bare Worker loop | Dagster drain runs | ratio |")
    print("|---|---:|---:|---:|")
    print(
        f"| tasks/s per worker or run, first claim to last completion | {bare_per:,.0f} | {run_per:,.0f} "
        f"| {run_per / bare_per:.2f} |"
    )
    print(f"| tasks/s overall | {bare_rate:,.0f} | {dagster_rate:,.0f} | {dagster_rate / bare_rate:.2f} |")
    print(f"| drain runs (or workers) | {len(bare_workers)} | {len(runs)} | |")
    print(f"| wall time, generation to last completion (sensor latency included) | | {wall:.1f} s | |")
    assert dagster_n == bare_n == args.tasks


if __name__ == "__main__":
    main()
