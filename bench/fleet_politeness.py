"""Fleet politeness: what the platforms receive when many drain runs crawl at once.

    python bench/fleet_politeness.py [--url URL] [--scenarios fleet,first,outage] [--runs-per-role 4]

The menu simulator runs in a process of its own and logs every request it receives (arrival,
departure, answer); every politeness figure below comes from that log, at the server, not from
what the crawler believes it sent. Three platforms, each ``max_in_flight`` 3 and
``requests_per_second`` 12 (burst 3) in the platforms file, 80 ms latency (+-50%).

- ``fleet``: the whole crawl from store discovery on, ``--runs-per-role`` drain runs of each of the
  four HTTP roles at once, each in a process of its own (as runs on many machines are), each
  running drain runs back to back until the crawl is done; 1% of requests answer 500. Reports,
  per platform, the moments with more requests in flight than ``max_in_flight`` and the seconds
  (calendar, and the most in any sliding second) with more starts than the rate plus the burst.
- ``first``: the first crawl (``product_discovery``) of stores queued platform after platform, one
  drain run: stores/s over the summed politeness bound, sum over platforms of
  min(max_in_flight / latency, requests_per_second), with the latency probed on the same server.
- ``outage``: a first crawl with ``--outage-runs`` drain runs while one platform answers 503
  (Retry-After 30) for ``--outage-seconds``: its tasks failed, its stores left uncrawled, the
  requests it received while down, and the other platforms' pace during the outage over their
  bound.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.instance import deployed_instance  # noqa: E402
from bench.queue_throughput import recreate_db  # noqa: E402
from tq_pipelines.crawl.handlers import HTTP_ROLES, enqueue_store_discovery  # noqa: E402
from tq_pipelines.crawl.platforms import load_platform_settings  # noqa: E402
from tq_pipelines.db.migrate import migrate  # noqa: E402
from tq_pipelines.defs.jobs import drain_tasks_job  # noqa: E402
from tq_pipelines.defs.resources import CrawlResource, QueueResource  # noqa: E402
from tq_pipelines.queue.api import TaskQueue  # noqa: E402
from tq_pipelines_demo.simulator import (  # noqa: E402
    PlatformProfile,
    Simulator,
    SimulatorProcess,
    platforms_toml,
    politeness_report,
)

NAMES = ("dutchie", "jane", "treez")
MAX_IN_FLIGHT = 3
RATE = 12.0
BURST = 3
LATENCY_MS = 80.0


def profiles(stores: dict[str, int], **faults: Any) -> list[PlatformProfile]:
    return [
        PlatformProfile(
            name,
            stores=n,
            latency_ms=LATENCY_MS,
            jitter=0.5,
            seed=11,
            change_seconds=600,
            **faults.get(name, {}),
        )
        for name, n in stores.items()
    ]


def write_platforms(folder: Path, urls: dict[str, str]) -> Path:
    path = folder / "platforms.toml"
    path.write_text(
        platforms_toml(
            urls,
            max_in_flight=MAX_IN_FLIGHT,
            requests_per_second=RATE,
            burst=BURST,
            timeout_seconds=10,
            slot_wait_seconds=30,
        )
    )
    return path


# -- drain runs, each process its own "machine" ----------------------------------------------------


def _drain_loop(url: str, role: str, path: str, stop: Any, out: Any) -> None:
    """Drain runs of ``role`` back to back until told to stop; sends back their outcomes."""
    totals = {k: 0 for k in ("runs", "claimed", "completed", "retried", "failed", "deferred", "lost")}
    resources = {
        "tq": QueueResource(database_url=url, pool_max_size=4),
        "crawl": CrawlResource(platforms_file=path),
    }
    config = {"role": role, "time_budget_seconds": 30, "platform_wait_seconds": 2}
    while not stop.is_set():
        result = drain_tasks_job.execute_in_process(
            run_config={
                "ops": {"drain_role_tasks": {"config": config}},
                "loggers": {"console": {"config": {"log_level": "WARNING"}}},
            },
            resources=resources,
            instance=deployed_instance(),
        )
        [event] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_OUTPUT]
        meta = {k: v.value for k, v in event.step_output_data.metadata.items()}
        totals["runs"] += 1
        for k in totals.keys() - {"runs"}:
            totals[k] += int(meta[k])
        if not meta["claimed"]:
            stop.wait(0.5)
    out.put((role, totals))


class Fleet:
    """``runs`` drain processes per role, started together."""

    def __init__(self, url: str, path: Path, runs: dict[str, int]) -> None:
        ctx = mp.get_context("fork")
        self.stop_event = ctx.Event()
        self.out = ctx.Queue()
        self.procs = [
            ctx.Process(target=_drain_loop, args=(url, role, str(path), self.stop_event, self.out))
            for role, n in runs.items()
            for _ in range(n)
        ]
        for p in self.procs:
            p.start()

    def stop(self) -> dict[str, dict[str, int]]:
        self.stop_event.set()
        totals: dict[str, dict[str, int]] = {}
        for _ in self.procs:
            role, t = self.out.get()
            mine = totals.setdefault(role, dict.fromkeys(t, 0))
            for k, v in t.items():
                mine[k] += v
        for p in self.procs:
            p.join(30)
        return totals


def unfinished(url: str, roles: tuple[str, ...]) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM worker_tasks"
            " WHERE role = ANY(%s) AND status IN ('pending', 'claimed', 'running')",
            (list(roles),),
        ).fetchone()
    return int(row[0]) if row else 0


def wait_until_done(url: str, roles: tuple[str, ...], timeout: float, settle: float = 3.0) -> float:
    """Waits until no task of ``roles`` is unfinished for ``settle`` seconds; returns when."""
    deadline = time.time() + timeout
    quiet_since: float | None = None
    while time.time() < deadline:
        if unfinished(url, roles) == 0:
            quiet_since = quiet_since or time.time()
            if time.time() - quiet_since >= settle:
                return quiet_since
        else:
            quiet_since = None
        time.sleep(0.5)
    raise SystemExit(f"not done after {timeout:.0f} s: {unfinished(url, roles)} tasks left")


# -- figures ------------------------------------------------------------------------------------


def politeness(logs: dict[str, list[tuple[float, float, int]]], windows: Any = ()) -> dict[str, Any]:
    return {
        name: politeness_report(
            log, max_in_flight=MAX_IN_FLIGHT, requests_per_second=RATE, burst=BURST, windows=windows
        )
        for name, log in logs.items()
    }


def probe_latency(urls: dict[str, str]) -> float:
    """Median seconds of one store-directory GET on a warm connection (no limits: the bare server)."""
    times = []
    with httpx.Client() as client:
        for i in range(60):
            base = urls[NAMES[i % len(NAMES)]]
            began = time.perf_counter()
            client.get(f"{base}/stores/none")  # a 404, after the same latency as any answer
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def load_resolved_stores(url: str, profs: list[PlatformProfile]) -> int:
    """The simulator's stores, resolved, each with a product_discovery task; queued platform after
    platform (all of the first platform's stores come first in claim order)."""
    rows = []
    for profile in profs:
        sim = Simulator([profile]).platforms[profile.name]
        rows += [(s.name, profile.name, s.platform_id, s.directory_id) for s in sim.stores.values()]
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
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
        cur.execute(
            "INSERT INTO worker_tasks (role, dispensary_id, platform)"
            " SELECT 'product_discovery', id, menu_type FROM dispensaries ORDER BY menu_type, id"
        )
        cur.execute("VACUUM ANALYZE dispensaries")
    return len(rows)


def outcomes(url: str, role: str) -> dict[str, dict[str, int]]:
    """Per platform: tasks by status, and retries spent."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT platform, status, count(*), sum(retry_count) FROM worker_tasks WHERE role = %s"
            " GROUP BY platform, status ORDER BY 1, 2",
            (role,),
        ).fetchall()
    result: dict[str, dict[str, int]] = {}
    for platform, status, n, retries in rows:
        result.setdefault(platform, {})[status] = int(n)
        result[platform]["retries_spent"] = result[platform].get("retries_spent", 0) + int(retries)
    return result


def crawl_pace(url: str, role: str) -> tuple[int, float]:
    """Tasks completed and their rate from the first claim to the last completion."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*), extract(EPOCH FROM max(completed_at) - min(claimed_at))"
            " FROM worker_tasks WHERE status = 'completed' AND role = %s",
            (role,),
        ).fetchone()
    assert row is not None
    n, seconds = int(row[0]), float(row[1] or 0)
    return n, n / seconds if seconds else 0.0


# -- scenarios ------------------------------------------------------------------------------------


def fleet(server: str, folder: Path, stores: int, runs_per_role: int) -> dict[str, Any]:
    url = recreate_db(server, "tq_bench_fleet")
    migrate(url)
    profs = profiles(dict.fromkeys(NAMES, stores), **{n: {"rate_500": 0.01} for n in NAMES})
    sim = SimulatorProcess(profs)
    path = write_platforms(folder, sim.urls)
    with TaskQueue.connect(url) as queue:
        enqueue_store_discovery(queue, load_platform_settings(path))
    began = time.time()
    runs = Fleet(url, path, dict.fromkeys(HTTP_ROLES, runs_per_role))
    try:
        done_at = wait_until_done(url, HTTP_ROLES, timeout=900)
    finally:
        totals = runs.stop()
    logs = sim.request_logs()
    sim.stop()
    return {
        "stores": stores * len(NAMES),
        "drain_processes": runs_per_role * len(HTTP_ROLES),
        "seconds": round(done_at - began, 1),
        "server": server_report(logs),
        "runs": totals,
        "product_discovery": outcomes(url, "product_discovery"),
    }


def server_report(logs: dict[str, list[tuple[float, float, int]]]) -> dict[str, Any]:
    """politeness() per platform, without its windows."""
    return {n: {k: v for k, v in r.items() if k != "windows"} for n, r in politeness(logs).items()}


def crawl_resolved(
    url: str, profs: list[PlatformProfile], runs: int, timeout: float
) -> tuple[
    int, SimulatorProcess, float, dict[str, dict[str, int]], dict[str, list[tuple[float, float, int]]]
]:
    """A first crawl (product_discovery) of the profiles' stores, resolved and queued platform after
    platform, by ``runs`` drain processes. Returns the stores, the (stopped) simulator, the probed
    latency, the runs' outcomes and the servers' request logs."""
    loaded = load_resolved_stores(url, profs)
    sim = SimulatorProcess(profs)
    path = write_platforms(Path(tempfile.mkdtemp(prefix="tq-fleet-crawl-")), sim.urls)
    latency = probe_latency(sim.urls)
    fleet_runs = Fleet(url, path, {"product_discovery": runs})
    try:
        wait_until_done(url, ("product_discovery",), timeout=timeout)
    finally:
        totals = fleet_runs.stop()
    logs = sim.request_logs()
    sim.stop()
    return loaded, sim, latency, totals, logs


def first_crawl(server: str, stores: int, runs: int) -> dict[str, Any]:
    url = recreate_db(server, "tq_bench_first")
    migrate(url)
    loaded, _, latency, totals, logs = crawl_resolved(
        url, profiles(dict.fromkeys(NAMES, stores)), runs, timeout=900
    )
    n, pace = crawl_pace(url, "product_discovery")
    bound = len(NAMES) * min(MAX_IN_FLIGHT / latency, RATE)
    return {
        "stores": loaded,
        "drain_runs": runs,
        "latency_ms": round(latency * 1000, 1),
        "bound_stores_per_s": round(bound, 1),
        "completed": n,
        "stores_per_s": round(pace, 1),
        "pace_over_bound": round(pace / bound, 2),
        "server": server_report(logs),
        "runs": totals,
    }


def outage(
    server: str, stores: int, down_stores: int, runs: int, start: float, seconds: float
) -> dict[str, Any]:
    url = recreate_db(server, "tq_bench_outage")
    migrate(url)
    down = NAMES[-1]
    counts = {n: (down_stores if n == down else stores) for n in NAMES}
    outage_fault = {
        "outage_start_seconds": start,
        "outage_seconds": seconds,
        "outage_retry_after_seconds": 30,
    }
    loaded, sim, latency, totals, logs = crawl_resolved(
        url, profiles(counts, **{down: outage_fault}), runs, timeout=1800
    )
    window = sim.platforms[down].outage_window()
    assert window is not None
    t0, t1 = window
    # The others' pace while it is down, from their answers (a steady second after it began).
    during = politeness(logs, windows=[("down", t0 + 1, t1), ("down, first second included", t0, t1)])
    per_platform_bound = min(MAX_IN_FLIGHT / latency, RATE)
    others = [n for n in NAMES if n != down]
    others_ok = sum(during[n]["windows"]["down"]["answers"].get(200, 0) for n in others)
    others_pace = others_ok / (t1 - t0 - 1)
    with psycopg.connect(url) as conn:
        after = conn.execute(
            "SELECT count(*) FROM worker_tasks WHERE platform = %s AND status = 'completed'"
            " AND completed_at > to_timestamp(%s)",
            (down, t1),
        ).fetchone()
    assert after is not None
    return {
        "stores": loaded,
        "down_platform": down,
        "outage_seconds": seconds,
        "drain_runs": runs,
        "latency_ms": round(latency * 1000, 1),
        "tasks": outcomes(url, "product_discovery"),
        "down_platform_requests_while_down": during[down]["windows"]["down, first second included"],
        "down_platform_stores_completed_after_outage": int(after[0]),
        "others_pace_during_outage": round(others_pace, 1),
        "others_bound": round(per_platform_bound * len(others), 1),
        "others_pace_over_bound": round(others_pace / (per_platform_bound * len(others)), 2),
        "server": server_report(logs),
        "runs": totals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.environ.get("TQ_BENCH_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--scenarios", default="fleet,first,outage")
    parser.add_argument("--runs-per-role", type=int, default=4)
    parser.add_argument("--fleet-stores", type=int, default=150, help="per platform")
    parser.add_argument("--first-stores", type=int, default=300, help="per platform")
    parser.add_argument("--first-runs", type=int, default=1)
    parser.add_argument("--outage-stores", type=int, default=2200, help="per healthy platform")
    parser.add_argument("--outage-down-stores", type=int, default=600)
    parser.add_argument("--outage-runs", type=int, default=2)
    parser.add_argument("--outage-start", type=float, default=20)
    parser.add_argument("--outage-seconds", type=float, default=150)
    args = parser.parse_args()

    report: dict[str, Any] = {
        "limits": {"max_in_flight": MAX_IN_FLIGHT, "requests_per_second": RATE, "burst": BURST},
        "latency_ms_configured": LATENCY_MS,
    }
    folder = Path(tempfile.mkdtemp(prefix="tq-fleet-"))
    for scenario in args.scenarios.split(","):
        began = time.time()
        if scenario == "fleet":
            report["fleet"] = fleet(args.url, folder, args.fleet_stores, args.runs_per_role)
        elif scenario == "first":
            report["first"] = first_crawl(args.url, args.first_stores, args.first_runs)
        elif scenario == "outage":
            report["outage"] = outage(
                args.url,
                args.outage_stores,
                args.outage_down_stores,
                args.outage_runs,
                args.outage_start,
                args.outage_seconds,
            )
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        print(f"# {scenario}: {time.time() - began:.0f} s", file=sys.stderr, flush=True)
        print(json.dumps({scenario: report[scenario]}, indent=2), flush=True)


if __name__ == "__main__":
    main()
