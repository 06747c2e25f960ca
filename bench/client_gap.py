"""What a slot's path between two requests costs, without the queue: the crawl's ceiling, taken apart.

    python bench/client_gap.py [--url URL] [--seconds 12] [--in-flight 8] [--platforms 2]
                               [--latency-ms 100] [--cells CELL,...]

The menu simulator in a process of its own (as in ``crawl_throughput``), ``--in-flight`` threads
per platform sending menu GETs back to back; between an answer and the thread's next request a
cell puts one of these, and the servers' own logs give each cell's slot gap (how long a slot
stood empty between two requests) and its rate as a fraction of (in-flight x platforms) /
latency, the latency probed as ``crawl_throughput`` probes it. Cells, in the order given,
each one run of ``--seconds``:

- ``httpx``: nothing between (one httpx client per host, shared by its threads, as the
  drain's client); ``urllib3`` (one pool manager) and ``http.client`` (a connection a thread):
  other clients, nothing between;
- ``select1``: ``SELECT 1`` on the thread's own connection to ``--url``;
- ``cpu1ms``: a statement of about 1 ms of server CPU (a slot's pass costs about 1.4 ms);
- ``+busy``: any cell with processes keeping 0.7 of a core busy elsewhere (PostgreSQL's share in
  a crawl), e.g. ``cpu1ms+busy``;
- ``+gil``: any cell with 4 threads of the client's process holding its interpreter 60% of
  the time, e.g. ``select1+gil``.
"""

import argparse
import http.client
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import urllib3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.crawl_throughput import NAMES, median_get, menu_paths, served_since  # noqa: E402
from tq_pipelines_demo.simulator import PlatformProfile, SimulatorProcess  # noqa: E402

CELLS = ("httpx", "urllib3", "http.client", "select1", "cpu1ms")
BUSY_CORES = 0.7
BUSY_SHARE = 0.35  # of a core, per process
GIL_THREADS, GIL_SHARE = 4, 0.15


def _busy(period: float, share: float, stop: Any) -> None:
    """Spins ``share`` of every ``period`` seconds (a core, and the interpreter with it) until
    ``stop`` is set."""
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < period * share:
            pass
        time.sleep(period * (1 - share))


def cpu_statement_rows(url: str) -> int:
    """The generate_series length whose count(*) takes about 1 ms on this server."""
    rows = 5000
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(3):
            began = time.perf_counter()
            for _ in range(20):
                conn.execute("SELECT count(*) FROM generate_series(1, %s)", (rows,))
            took = (time.perf_counter() - began) / 20
            rows = max(100, int(rows * 0.001 / took))
    return rows


def run_cell(
    cell: str,
    sim: SimulatorProcess,
    paths: dict[str, list[str]],
    args: argparse.Namespace,
    rows: int,
    latency: float,
) -> dict[str, Any]:
    kind, *extras = cell.split("+")
    if kind not in CELLS or any(e not in ("busy", "gil") for e in extras):
        raise SystemExit(f"unknown cell {cell!r}: one of {', '.join(CELLS)}, with +busy or +gil")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    busy = [
        ctx.Process(target=_busy, args=(0.01, BUSY_SHARE, stop))
        for _ in range(round(BUSY_CORES / BUSY_SHARE) if "busy" in extras else 0)
    ]
    held = threading.Event()
    holders = [
        threading.Thread(target=_busy, args=(0.002, GIL_SHARE, held))
        for _ in range(GIL_THREADS if "gil" in extras else 0)
    ]
    for p in busy:
        p.start()
    for t in holders:
        t.start()
    clients = {n: httpx.Client(base_url=u) for n, u in sim.urls.items()}
    pool = urllib3.PoolManager(maxsize=args.in_flight)
    began = time.time() + 1.0
    until = began + args.seconds

    def send(platform: str, k: int) -> None:
        base = sim.urls[platform]
        mine = paths[platform][k :: args.in_flight]
        conn = psycopg.connect(args.url, autocommit=True) if kind in ("select1", "cpu1ms") else None
        host = urlsplit(base)
        own = http.client.HTTPConnection(host.hostname or "", host.port) if kind == "http.client" else None
        while time.time() < began:
            time.sleep(0.001)
        i = 0
        while time.time() < until:
            path = mine[i % len(mine)]
            i += 1
            if kind == "urllib3":
                assert pool.request("GET", base + path).status == 200
            elif own is not None:
                own.request("GET", path)
                answer = own.getresponse()
                answer.read()
                assert answer.status == 200
            else:
                clients[platform].get(path).raise_for_status()
            if kind == "select1":
                conn.execute("SELECT 1")  # type: ignore[union-attr]
            elif kind == "cpu1ms":
                conn.execute("SELECT count(*) FROM generate_series(1, %s)", (rows,))  # type: ignore[union-attr]
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=send, args=(n, k)) for n in paths for k in range(args.in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    held.set()
    for p in busy:
        p.join()
    for t in holders:
        t.join()
    for c in clients.values():
        c.close()
    rate, slots = served_since(sim, began, args.in_flight)
    bound = args.in_flight * len(paths) / latency
    return {
        "cell": cell,
        "requests_per_s": round(rate, 1),
        "of_bound": round(rate / bound, 3),
        "slot_gap_ms": {n: g["slot_gap_ms"] for n, g in slots.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.environ.get("TQ_BENCH_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--platforms", type=int, default=2, choices=range(1, len(NAMES) + 1))
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument(
        "--cells",
        default="httpx,select1,cpu1ms,httpx+busy,cpu1ms+busy,select1+gil,urllib3,http.client",
    )
    args = parser.parse_args()
    profiles = [
        PlatformProfile(NAMES[i], stores=1000, latency_ms=args.latency_ms, jitter=0.0, seed=11)
        for i in range(args.platforms)
    ]
    rows = cpu_statement_rows(args.url)
    with SimulatorProcess(profiles) as sim:
        paths = menu_paths(sim)
        first = next(iter(paths))
        latency = median_get([sim.urls[first] + path for path in paths[first][:50]])
        print(json.dumps({"latency_ms": round(latency * 1000, 1), "cpu_statement_rows": rows}), flush=True)
        for cell in args.cells.split(","):
            print(json.dumps(run_cell(cell, sim, paths, args, rows, latency)), flush=True)


if __name__ == "__main__":
    main()
