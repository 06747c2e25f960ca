"""Crawl throughput: stores resynced per second against the bound the politeness limits allow.

    python bench/crawl_throughput.py [--url URL] [--stores 2000] [--platforms 2] [--latency-ms 100]
                                     [--in-flight 8] [--bound in-flight|rate] [--rate 40]
                                     [--runs 1] [--changed-versions 1]

In one run, on one database server, with the menu simulator in a process of its own (fixed
latency, no faults):
1. ``--stores`` stores, spread over ``--platforms`` platforms, are resolved and crawled once
   (product_discovery, through real drain runs): the first crawl, every product new;
2. the simulator restarts ``--changed-versions`` menu versions later, so that some menus changed;
3. the day's resync is generated and drained by ``--runs`` drain runs at once, each a process of
   its own (``drain_tasks_job`` in process, the same op the sensor launches), its concurrency
   sized by the op (twice the in-flight slots); the runs begin together, once all are loaded;
4. the bound: a probe measures one request's latency on the same simulator (median of 50).
   ``--bound in-flight``: ``--in-flight`` slots per host and no rate that binds; the bound is
   (in-flight per host x platforms) / that latency. ``--bound rate``: ``--rate`` requests per
   second per platform (below what the slots carry), and the bound is rate x platforms;
5. the client's ceiling (``--ceiling-seconds``, in-flight bound only): no queue, PostgreSQL idle,
   one thread per slot sending menu GETs back to back through one urllib3 pool per host, as the
   drain's client does: what this machine's client and simulator reach of the bound by
   themselves, and the slot gap they leave, the part of the crawl's gap that is not the queue's.
Figures: stores/s from first claim to last completion (from worker_tasks), and its ratio to the
bound; each run's share of the stores (and the spread, the largest over the smallest); the
server's highest in-flight count per host shows the limit was held, not exceeded, and its mean
in flight and a slot's gap between two requests (``server_slots``, from the server's own log:
mean, median, 90th percentile, and the slot time lost in gaps over 20 ms, the crawl's start and
any stall) show how busy the limit kept it; the cores used while the runs drained (the
machine's, the drain runs', the simulator's, the rest: PostgreSQL and anything else on the
machine) show whether the machine, not the queue, bound it.
"""

import argparse
import heapq
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import urllib3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import Span, own_cpu  # noqa: E402
from bench.instance import deployed_instance  # noqa: E402
from bench.queue_throughput import recreate_db  # noqa: E402
from tq_pipelines.db.migrate import migrate  # noqa: E402
from tq_pipelines.defs.jobs import drain_tasks_job  # noqa: E402
from tq_pipelines.defs.resources import CrawlResource, QueueResource  # noqa: E402
from tq_pipelines.queue.api import TaskQueue  # noqa: E402
from tq_pipelines_demo.simulator import (  # noqa: E402
    LogEntry,
    PlatformProfile,
    Simulator,
    SimulatorProcess,
    platforms_toml,
    politeness_report,
)

NAMES = ("dutchie", "jane", "treez", "weedmaps", "leafly", "meadow")
CHANGE_SECONDS = 600.0


def server_stats(sim: SimulatorProcess, slots: int) -> dict[str, dict[str, Any]]:
    """Per platform, from its server's counters and its own log: requests, the most in flight
    and the most that arrived in any one second, and its occupancy of ``slots``."""
    stats = {}
    for n, p in sim.platforms.items():
        served = p.server_stats(log=True)
        log: list[LogEntry] = [(a, d, s) for a, d, s in served["log"]]
        stats[n] = {
            "requests": served["requests"],
            "max_in_flight": served["max_in_flight"],
            "max_starts_sliding_1s": politeness_report(
                log, max_in_flight=served["max_in_flight"], requests_per_second=1, burst=0
            )["max_starts_sliding_1s"],
            **occupancy(log, slots),
        }
    return stats


def occupancy(log: list[LogEntry], slots: int) -> dict[str, float]:
    """From the server's own log: the seconds from the first arrival to the last departure, and
    the seconds of requests in flight over that span (their sum: the mean in flight times the
    span); and how long each request's slot stood empty before it (:func:`slot_gaps`)."""
    if not log:
        return {"span_s": 0.0, "busy_s": 0.0, "gap_p50_ms": 0.0, "gap_p90_ms": 0.0, "gaps_over_20ms_s": 0.0}
    gaps = slot_gaps(log, slots)
    return {
        "span_s": max(d for _, d, _ in log) - min(a for a, _, _ in log),
        "busy_s": sum(d - a for a, d, _ in log),
        "gap_p50_ms": round(gaps[len(gaps) // 2] * 1000, 1),
        "gap_p90_ms": round(gaps[len(gaps) * 9 // 10] * 1000, 1),
        # The slot time lost in long gaps: a crawl's start, and stalls of the whole drain.
        "gaps_over_20ms_s": round(sum(g for g in gaps if g > 0.02), 2),
    }


def slot_gaps(log: list[LogEntry], slots: int) -> list[float]:
    """Each request's wait, in seconds and sorted, from the slot it took standing free (the
    earliest freed, all ``slots`` free at the first arrival) to its arrival: the server's view of
    a slot's gap, whichever task used it."""
    events = sorted([(a, 1) for a, _, _ in log] + [(d, 0) for _, d, _ in log])
    free = [events[0][0]] * slots
    gaps = []
    for t, arrival in events:  # a departure before an arrival at the same instant
        if arrival:
            gaps.append(t - heapq.heappop(free))
        else:
            heapq.heappush(free, t)
    return sorted(gaps)


def slot_report(stats: dict[str, dict[str, Any]], slots: int) -> dict[str, dict[str, float]]:
    """Per server: the mean requests in flight over its busy span, and how long a slot stood
    empty between two requests on average ((slots x span - busy) / requests): what a freed slot
    loses before the next request arrives, as the platform sees it. The median gap is the steady
    crawl's; the long gaps' total shows what the start and any stall of the drain cost."""
    return {
        n: {
            "mean_in_flight": round(s["busy_s"] / s["span_s"], 2) if s["span_s"] else 0.0,
            "slot_gap_ms": round((slots * s["span_s"] - s["busy_s"]) / s["requests"] * 1000, 1)
            if s["requests"]
            else 0.0,
            # Its median and 90th percentile, and the slot time lost in gaps over 20 ms.
            **{k: s[k] for k in ("gap_p50_ms", "gap_p90_ms", "gaps_over_20ms_s")},
        }
        for n, s in stats.items()
    }


def platforms_file(folder: Path, urls: dict[str, str], in_flight: int, rate: float = 10000) -> Path:
    """Politeness at ``in_flight`` per host and ``rate`` requests per second (by default one that
    never binds), and no timeout that could bind first."""
    path = folder / "platforms.toml"
    path.write_text(
        platforms_toml(
            urls,
            max_in_flight=in_flight,
            requests_per_second=rate,
            timeout_seconds=30,
            slot_wait_seconds=30,
        )
    )
    return path


def load_stores(url: str, profiles: list[PlatformProfile]) -> int:
    """The simulator's stores, resolved (platform id known), as entry_point_discovery leaves them."""
    rows = []
    for profile in profiles:
        sim = Simulator([profile]).platforms[profile.name]
        rows += [(s.name, profile.name, s.platform_id, s.directory_id) for s in sim.stores.values()]
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(
            "TRUNCATE worker_tasks, worker_task_history, worker_task_heads, worker_task_stores,"
            " worker_registry CASCADE"
        )
        cur.execute("DELETE FROM dispensaries")
        cur.executemany(
            """
            WITH d AS (
              INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)
              VALUES (%s, %s, %s) RETURNING id, menu_type
            )
            INSERT INTO store_crawl_state (dispensary_id, platform, directory_id, resolved_at)
            SELECT id, menu_type, %s, now() FROM d
            """,
            rows,
        )
        cur.execute("VACUUM ANALYZE dispensaries")
    return len(rows)


def drain(url: str, role: str, path: Path, pool: int) -> dict[str, Any]:
    result = drain_tasks_job.execute_in_process(
        run_config={"ops": {"drain_role_tasks": {"config": {"role": role, "time_budget_seconds": 3600}}}},
        resources={
            "tq": QueueResource(database_url=url, pool_max_size=pool),
            "crawl": CrawlResource(platforms_file=str(path)),
        },
        instance=deployed_instance(),
    )
    [event] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_OUTPUT]
    return {k: v.value for k, v in event.step_output_data.metadata.items()}


def _drain_process(url: str, role: str, path: str, pool: int, ready: Any, go: Any, out: Any) -> None:
    """One drain run in a process of its own: loaded, it waits for the others, then drains."""
    ready.put(os.getpid())
    go.wait()
    began = own_cpu()
    result = drain(url, role, Path(path), pool)
    out.put(result | {"cpu_seconds": own_cpu() - began})


def drain_runs(
    url: str, role: str, path: Path, pool: int, runs: int, simulator: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``runs`` drain runs at once, each a process; returns each run's metadata, and the cores
    used from the moment they all began: the machine's, the drain runs', the simulator's (and so
    PostgreSQL's and the rest's, the difference). With one run, in this process, as a single run
    is usually launched."""
    if runs == 1:
        span, began = Span(simulator=simulator), own_cpu()
        results = [drain(url, role, path, pool) | {"cpu_seconds": own_cpu() - began}]
        return results, span.cores(drain_runs=sum(r["cpu_seconds"] for r in results))
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_drain_process, args=(url, role, str(path), pool, ready, go, out))
        for _ in range(runs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    span = Span(simulator=simulator)
    go.set()
    results = [out.get(timeout=3600) for _ in procs]
    cores = span.cores(drain_runs=sum(r["cpu_seconds"] for r in results))
    for p in procs:
        p.join(30)
    return results, cores


def shares(url: str, role: str) -> list[int]:
    """Stores completed by each run (worker), largest first."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM v_tasks WHERE status = 'completed' AND role = %s"
            " GROUP BY worker_id ORDER BY 1 DESC",
            (role,),
        ).fetchall()
    return [n for (n,) in rows]


def rate(url: str, role: str) -> tuple[int, float]:
    with psycopg.connect(url) as conn:
        n, seconds = conn.execute(
            "SELECT count(*), extract(EPOCH FROM max(completed_at) - min(claimed_at)) FROM v_tasks"
            " WHERE status = 'completed' AND role = %s",
            (role,),
        ).fetchone()  # type: ignore[misc]
    return n, n / float(seconds) if seconds else 0.0


def probe_latency(urls: dict[str, str], url: str) -> float:
    """Median seconds of one menu GET on a warm connection, store by store."""
    with psycopg.connect(url) as conn:
        stores = conn.execute(
            "SELECT menu_type, platform_dispensary_id FROM dispensaries ORDER BY id LIMIT 50"
        ).fetchall()
    return median_get([f"{urls[platform]}/menus/{pid}" for platform, pid in stores])


def median_get(urls: list[str]) -> float:
    """Median seconds of a GET of each of ``urls`` in turn, on one warm connection."""
    times = []
    with urllib3.PoolManager() as client:
        for u in urls:
            began = time.perf_counter()
            assert client.request("GET", u).status == 200, u
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def menu_paths(sim: SimulatorProcess) -> dict[str, list[str]]:
    """Every store's menu path, by platform."""
    return {n: [f"/menus/{s.platform_id}" for s in p.stores.values()] for n, p in sim.platforms.items()}


def client_ceiling(sim: SimulatorProcess, in_flight: int, seconds: float, bound: float) -> dict[str, Any]:
    """``in_flight`` threads per platform, each sending menu GETs back to back for ``seconds``
    through the platform's one urllib3 pool; the requests per second the servers logged, as a
    fraction of ``bound``, and their slot gap."""
    paths = menu_paths(sim)
    clients = {n: urllib3.connection_from_url(u, maxsize=in_flight) for n, u in sim.urls.items()}
    began = time.time() + 0.5
    until = began + seconds

    def send(platform: str, k: int) -> None:
        mine = paths[platform][k::in_flight]
        while time.time() < began:
            time.sleep(0.001)
        i = 0
        while time.time() < until:
            assert clients[platform].urlopen("GET", mine[i % len(mine)]).status == 200
            i += 1

    threads = [threading.Thread(target=send, args=(n, k)) for n in paths for k in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients.values():
        c.close()
    rate, slots = served_since(sim, began, in_flight)
    return {
        "seconds": seconds,
        "requests_per_s": round(rate, 1),
        "ratio": round(rate / bound, 2),
        "server_slots": slots,
    }


def served_since(
    sim: SimulatorProcess, began: float, slots: int
) -> tuple[float, dict[str, dict[str, float]]]:
    """From the servers' logs, the requests that arrived from ``began`` on: their rate over all
    platforms (requests per second), and each server's :func:`slot_report`."""
    stats = {}
    for n, platform in sim.platforms.items():
        served = platform.server_stats(log=True)["log"]
        log: list[LogEntry] = [(a, d, st) for a, d, st in served if a >= began]
        stats[n] = {"requests": len(log), **occupancy(log, slots)}
    rate = sum(s["requests"] / s["span_s"] for s in stats.values() if s["span_s"])
    return rate, slot_report(stats, slots)


def history_rows(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM product_history").fetchone()[0]  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.environ.get("TQ_BENCH_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--stores", type=int, default=2000)
    parser.add_argument("--platforms", type=int, default=2, choices=range(1, len(NAMES) + 1))
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--in-flight", type=int, default=8, help="max_in_flight per platform host")
    parser.add_argument("--changed-versions", type=int, default=1, help="menu versions between crawls")
    parser.add_argument("--pool", type=int, default=8, help="queue connection pool of each drain run")
    parser.add_argument("--runs", type=int, default=1, help="drain runs at once, each a process")
    parser.add_argument(
        "--bound",
        choices=("in-flight", "rate"),
        default="in-flight",
        help="the limit that binds: in-flight slots per host, or a request rate per platform",
    )
    parser.add_argument(
        "--rate", type=float, default=40.0, help="with --bound rate: requests per second per platform"
    )
    parser.add_argument(
        "--ceiling-seconds",
        type=float,
        default=10.0,
        help="with --bound in-flight: seconds of the client's ceiling, no queue (0: none)",
    )
    args = parser.parse_args()
    limit_rate = args.rate if args.bound == "rate" else 10000

    per = args.stores // args.platforms
    profiles = [
        PlatformProfile(
            NAMES[i],
            stores=per,
            latency_ms=args.latency_ms,
            jitter=0.0,
            seed=11,
            change_seconds=CHANGE_SECONDS,
        )
        for i in range(args.platforms)
    ]
    url = recreate_db(args.url, "tq_bench_crawl")
    migrate(url)
    stores = load_stores(url, profiles)
    folder = Path(tempfile.mkdtemp(prefix="tq-crawl-bench-"))

    # 1. First crawl.
    sim = SimulatorProcess(profiles)
    with psycopg.connect(url, autocommit=True) as conn:
        # Platforms in turn, as generate_resync_tasks orders a batch.
        conn.execute(
            "INSERT INTO worker_tasks (role, dispensary_id, platform)"
            " SELECT 'product_discovery', id, menu_type FROM dispensaries"
            " ORDER BY row_number() OVER (PARTITION BY menu_type ORDER BY id), menu_type, id"
        )
    path = platforms_file(folder, sim.urls, args.in_flight, limit_rate)
    first, first_cpu = drain_runs(url, "product_discovery", path, args.pool, args.runs, sim.process.pid or 0)
    first_n, first_rate = rate(url, "product_discovery")
    first_shares = shares(url, "product_discovery")
    first_stats = server_stats(sim, args.in_flight)
    sim.stop()
    new_history = history_rows(url)

    # 2-3. Menus moved on; the day's resync.
    sim = SimulatorProcess(profiles, started_at=time.time() - CHANGE_SECONDS * args.changed_versions)
    with TaskQueue.connect(url) as queue:
        generated = queue.generate_resync(
            day=datetime.now(UTC).date(), batches_per_day=1, platforms=[p.name for p in profiles]
        )
    path = platforms_file(folder, sim.urls, args.in_flight, limit_rate)
    resync, resync_cpu = drain_runs(url, "product_resync", path, args.pool, args.runs, sim.process.pid or 0)
    resync_n, resync_rate = rate(url, "product_resync")
    resync_shares = shares(url, "product_resync")
    with psycopg.connect(url) as conn:
        changed_menus = conn.execute(
            "SELECT count(*) FILTER (WHERE NOT (result->>'unchanged')::boolean) FROM v_tasks"
            " WHERE role = 'product_resync' AND status = 'completed'"
        ).fetchone()[0]  # type: ignore[index]
    resync_stats = server_stats(sim, args.in_flight)  # before the probe's own requests
    # 4. The bound, on the same simulator.
    latency = probe_latency(sim.urls, url)
    in_flight_bound = args.in_flight * args.platforms / latency
    bound = (
        in_flight_bound if args.bound == "in-flight" else min(limit_rate * args.platforms, in_flight_bound)
    )
    # 5. What the client and the simulator reach without the queue.
    ceiling = (
        client_ceiling(sim, args.in_flight, args.ceiling_seconds, bound)
        if args.bound == "in-flight" and args.ceiling_seconds > 0
        else None
    )
    sim.stop()

    def run_totals(runs: list[dict[str, Any]]) -> dict[str, int]:
        # How the slots moved too: passed to a standby, handed off, and the standbys claimed.
        keys = (
            *("completed", "failed", "retried", "deferred", "lost"),
            *("passes_to_standby", "passes_relayed", "hand_offs", "standby_claimed"),
            *("standby_claimed_before_slot", "late_starts"),
        )
        return {k: sum(r.get(k, 0) for r in runs) for k in keys} | {"concurrency": runs[0]["concurrency"]}

    def spread(counts: list[int]) -> float | None:
        return round(max(counts) / min(counts), 2) if counts and min(counts) > 0 else None

    report = {
        "stores": stores,
        "platforms": args.platforms,
        "runs": args.runs,
        "bound_by": args.bound,
        "in_flight_per_host": args.in_flight,
        "requests_per_second_per_platform": limit_rate,
        # rate + burst (the burst is max_in_flight when the platforms file names none)
        "requests_allowed_in_1s": limit_rate + args.in_flight,
        "latency_ms_configured": args.latency_ms,
        "latency_ms_measured": round(latency * 1000, 1),
        "bound_stores_per_s": round(bound, 1),
        "client_ceiling": ceiling,
        "first_crawl": {
            "completed": first_n,
            "stores_per_s": round(first_rate, 1),
            "ratio": round(first_rate / bound, 2),
            "of_client_ceiling": round(first_rate / ceiling["requests_per_s"], 2) if ceiling else None,
            "history_rows": new_history,
            "run": run_totals(first),
            "per_run": first_shares,
            "spread": spread(first_shares),
            "server_max_in_flight": {n: s["max_in_flight"] for n, s in first_stats.items()},
            "server_max_requests_in_1s": {n: s["max_starts_sliding_1s"] for n, s in first_stats.items()},
            "server_slots": slot_report(first_stats, args.in_flight),
            "cores": first_cpu,
        },
        "resync": {
            "generated": generated,
            "completed": resync_n,
            "changed_menus": changed_menus,
            "stores_per_s": round(resync_rate, 1),
            "ratio": round(resync_rate / bound, 2),
            "of_client_ceiling": round(resync_rate / ceiling["requests_per_s"], 2) if ceiling else None,
            "history_rows_added": history_rows(url) - new_history,
            "run": run_totals(resync),
            "per_run": resync_shares,
            "spread": spread(resync_shares),
            "server_max_in_flight": {n: s["max_in_flight"] for n, s in resync_stats.items()},
            "server_max_requests_in_1s": {n: s["max_starts_sliding_1s"] for n, s in resync_stats.items()},
            "server_slots": slot_report(resync_stats, args.in_flight),
            "cores": resync_cpu,
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
