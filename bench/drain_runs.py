"""Drain runs per day, pickup latency and the cost of an idle run: drain runs that end as soon as
their role's queue is momentarily empty (old) against runs that stay while work keeps coming (new).

    python bench/drain_runs.py [--url URL] [--window-minutes 12] [--compression 10] [--samples 120]

In one run, on one database server. Each part runs a real ``dagster-daemon run`` over the
repository's dagster.yaml (runs in PostgreSQL, the queued run coordinator and its limits) in a
DAGSTER_HOME of its own, with the real task_queue_sensor and drain_tasks_job; every role's
handler is :func:`handle` (TQ_HANDLERS): the demo's work without HTTP.
1. Runs per day, old then new. The demo's first ``--window-minutes`` x ``--compression``
   minutes, ``--compression`` times faster: store discovery at the start (listings write stores
   and entry points through the real SQL, entry points queue first crawls), the demo crawl
   (every crawlable store every 10 minutes), analytics every 15 minutes, and the demo
   platforms' faults (429, 500, timeouts, stores that go away, treez's outage), retried with the
   queue's own backoff. Every queue-side time is divided by the compression too: arrivals,
   backoff, Retry-After, the idle exit, the time budget. The sensor's interval, a run's start
   and the idle poll stay as they are. Drain runs are counted in Dagster's storage, per role,
   and extrapolated to a day.
2. Pickup latency, a task's created_at to its started_at (the server's clock): from idle (no run
   alive), after the old replay; with a run live, under the new defaults uncompressed, tasks
   enqueued one at a time at random intervals.
3. The cost of those live runs once idle: claims and rows written per second at the server
   (pg_stat_user_functions, with track_functions = 'pl' on the bench's database, and
   pg_stat_user_tables), CPU seconds per minute and memory of each run process (/proc), and its
   connections (pg_stat_activity, matched to the process's sockets).
Then a simulation of the sensor's decisions and the worker loop, drawing sensor intervals and
run starts from those measured in 1., replays the same window (against the daemon's count) and
a whole demo day uncompressed. The databases it creates are dropped at the end.
"""

import argparse
import contextlib
import functools
import hashlib
import heapq
import itertools
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tq_pipelines.db import sqlalchemy_url  # noqa: E402
from tq_pipelines.db.migrate import migrate  # noqa: E402
from tq_pipelines.db.queries import query  # noqa: E402
from tq_pipelines.defs.jobs import drain_tasks_job  # noqa: E402
from tq_pipelines.defs.resources import CrawlResource, QueueResource  # noqa: E402
from tq_pipelines.defs.sensors.queue import task_queue_sensor  # noqa: E402
from tq_pipelines.queue.api import JSON, Task, TaskQueue  # noqa: E402
from tq_pipelines.queue.worker import DeferTask, PermanentTaskError, TaskContext, TransientTaskError  # noqa: E402
from tq_pipelines_demo.simulator import REGIONS, demo_profiles  # noqa: E402

BIN = Path(sys.executable).parent
DAY = 86_400.0
ROLES = (
    "analytics_refresh",
    "entry_point_discovery",
    "product_discovery",
    "product_resync",
    "store_discovery",
)
# Roles whose work comes once, when the demo starts (its discovery), not all day long.
ONCE = frozenset({"store_discovery", "entry_point_discovery", "product_discovery"})
STORE_ROLES = frozenset({"entry_point_discovery", "product_discovery", "product_resync"})

# -- the demo: what arrives when, and how its platforms answer ------------------------------------

PROFILES = {p.name: p for p in demo_profiles()}
# start_demo's platforms file: a request that hangs fails after this long.
CLIENT_TIMEOUT_SECONDS = 5.0
# The crons fire on the clock, so their phase against the demo's start is arbitrary; fixed here.
CRAWL_EVERY, CRAWL_PHASE = 600.0, 240.0  # demo_crawl_schedule, */10
ANALYTICS_EVERY, ANALYTICS_PHASE = 900.0, 420.0  # analytics_refresh_schedule, */15
OUTAGE_PHASE = 600.0  # treez's first outage, seconds after the start
REDISCOVERY_AT = 12 * 3600.0  # store_discovery_schedule, daily: once within a simulated day


@dataclass(frozen=True)
class Setting:
    name: str
    idle_exit_seconds: float
    time_budget_seconds: float
    idle_poll_seconds: float = 0.5

    def compressed(self, k: float) -> "Setting":
        """The queue-side times divided by ``k``; the idle poll is a mechanism's, as is the
        sensor's interval, and stays."""
        return Setting(
            self.name, self.idle_exit_seconds / k, self.time_budget_seconds / k, self.idle_poll_seconds
        )


OLD = Setting("old", idle_exit_seconds=0, time_budget_seconds=600)
NEW = Setting("new", idle_exit_seconds=1800, time_budget_seconds=14_400)
WHAT_IF = "new, idle exit 900 s (simulated only)"


def demo_actions(demo_seconds: float) -> list[tuple[float, str]]:
    """The demo's arrivals over its first ``demo_seconds``: (seconds after the start, what)."""
    actions = [(0.0, "discovery")]
    actions += [(t, "crawl") for t in _every(CRAWL_PHASE, CRAWL_EVERY, demo_seconds)]
    actions += [(t, "analytics") for t in _every(ANALYTICS_PHASE, ANALYTICS_EVERY, demo_seconds)]
    if demo_seconds > REDISCOVERY_AT:
        actions.append((REDISCOVERY_AT, "discovery"))
    return sorted(actions)


def _every(phase: float, every: float, end: float) -> list[float]:
    return [phase + i * every for i in range(int((end - phase) // every) + 1) if phase + i * every < end]


def draw(*key: object) -> float:
    """A uniform draw in [0, 1) fixed by ``key``: the same fault for the same attempt."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def gone_after(directory_id: str) -> float | None:
    """When the simulator stops having the store (seconds after the start), or None."""
    platform = directory_id.split("-", maxsplit=1)[0]
    p = PROFILES[platform]
    if draw("gone", directory_id) < p.gone_share:
        return draw("gone-at", directory_id) * p.gone_within_seconds
    return None


def listed(platform: str, region: str, demo_t: float) -> list[str]:
    """The directory ids a listing of one region returns at ``demo_t``."""
    ids = [
        f"{platform}-{i:03d}" for i in range(PROFILES[platform].stores) if REGIONS[i % len(REGIONS)] == region
    ]
    return [d for d in ids if (g := gone_after(d)) is None or demo_t < g]


def attempt_outcome(platform: str | None, key: object, demo_t: float) -> tuple[str, float, float]:
    """How the platform answers one attempt's request: ("ok" | "retry" | "defer", Retry-After or
    pause in demo seconds, extra seconds the request hung)."""
    p = PROFILES.get(platform or "")
    if p is None:
        return "ok", 0.0, 0.0
    if p.outage_every_seconds and (demo_t - OUTAGE_PHASE) % p.outage_every_seconds < p.outage_seconds:
        # The breaker pauses the platform for its Retry-After: the task goes back untried.
        return "defer", float(p.outage_retry_after_seconds), 0.0
    u = draw("answer", platform, key)
    if u < p.rate_429:
        return "retry", float(p.retry_after_seconds), 0.0
    if u < p.rate_429 + p.rate_500:
        return "retry", 0.0, 0.0
    if u < p.rate_429 + p.rate_500 + p.rate_timeout:
        return "retry", 0.0, CLIENT_TIMEOUT_SECONDS
    return "ok", 0.0, 0.0


# -- the code location the bench's daemon loads, and its handler ----------------------------------


def bench_definitions() -> dg.Definitions:
    """drain_tasks_job and task_queue_sensor, the queue resource with this phase's drain settings.
    The other schedules and sensors stay out: the replay brings their arrivals, compressed."""
    env = os.environ
    tq = QueueResource(
        database_url=dg.EnvVar("TQ_DATABASE_URL"),
        drain_idle_exit_seconds=float(env.get("TQ_BENCH_IDLE_EXIT_SECONDS", NEW.idle_exit_seconds)),
        drain_time_budget_seconds=float(env.get("TQ_BENCH_TIME_BUDGET_SECONDS", NEW.time_budget_seconds)),
        drain_idle_poll_seconds=float(env.get("TQ_BENCH_IDLE_POLL_SECONDS", NEW.idle_poll_seconds)),
    )
    return dg.Definitions(
        jobs=[drain_tasks_job],
        sensors=[task_queue_sensor],
        resources={"tq": tq, "crawl": CrawlResource()},
    )


defs = bench_definitions()


@dataclass(frozen=True)
class Clock:
    compression: float
    epoch: float  # time.time() of the demo's start
    task_seconds: float

    def demo_now(self) -> float:
        return (time.time() - self.epoch) * self.compression


@functools.cache
def clock() -> Clock:
    # Read once per run process: the bench writes the epoch before it queues anything.
    return Clock(
        float(os.environ["TQ_BENCH_COMPRESSION"]),
        float(Path(os.environ["TQ_BENCH_EPOCH_FILE"]).read_text()),
        float(os.environ["TQ_BENCH_TASK_SECONDS"]),
    )


def handle(task: Task, ctx: TaskContext) -> JSON:
    """Every role's handler in the bench: the demo's work without HTTP. Listings and entry points
    write through the real SQL (stores, entry points, first crawls queued); a request answers as
    the demo platforms do (:func:`attempt_outcome`); a short sleep stands for the rest."""
    c = clock()
    time.sleep(c.task_seconds)
    if task.role == "analytics_refresh":
        return {"bench": "analytics"}
    demo_t = c.demo_now()
    if task.role == "store_discovery":
        platform, region = task.payload["platform"], task.payload.get("region") or REGIONS[0]
        _answer(platform, task, demo_t, c)
        stores = [{"id": d, "name": d, "region": region} for d in listed(platform, region, demo_t)]
        with ctx.transaction() as cur:
            rows = cur.execute(
                query("upsert_listed_stores"), {**ctx.lease_params(), "stores": Jsonb(stores)}
            ).fetchall()
            result: JSON = {"listed": len(rows), "new": sum(1 for r in rows if r["created"])}
            ctx.complete(cur, result)
        return result
    assert ctx.pool is not None
    with ctx.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        store = cur.execute(query("store_entry_point"), {"dispensary_id": task.dispensary_id}).fetchone()
    if store is None:
        raise PermanentTaskError(f"store {task.dispensary_id} does not exist")
    platform = store["menu_type"]
    gone = gone_after(store["directory_id"] or f"{platform}-")
    if gone is not None and demo_t >= gone:
        with ctx.transaction() as cur:
            cur.execute(query("mark_store_gone"), ctx.lease_params())
        raise PermanentTaskError("store gone: HTTP 410")
    if task.role != "entry_point_discovery" and not store["crawl_enabled"]:
        return {"skipped": "crawl disabled"}
    _answer(platform, task, demo_t, c)
    if task.role != "entry_point_discovery":
        return {"crawled": store["id"]}
    with ctx.transaction() as cur:
        cur.execute(
            query("save_entry_point"),
            {
                **ctx.lease_params(),
                "platform_id": f"pid-{store['directory_id']}",
                # A path under the platform's base URL: an absolute URL must name one of its
                # hosts (0013), and the bench loads no platforms file.
                "menu_url": f"/menu/{store['directory_id']}",
            },
        )
        cur.execute(
            query("enqueue_task_once"),
            {
                "role": "product_discovery",
                "dispensary_id": store["id"],
                "platform": platform,
                "priority": 0,
                "scheduled_for": None,
                "payload": None,
            },
        )
        result = {"resolved": store["id"]}
        ctx.complete(cur, result)
    return result


def _answer(platform: str, task: Task, demo_t: float, c: Clock) -> None:
    kind, after, hung = attempt_outcome(platform, (task.id, task.retry_count), demo_t)
    if kind == "defer":
        raise DeferTask(after / c.compression, f"{platform} paused for {after:.0f} s")
    if kind == "retry":
        time.sleep(hung / c.compression)
        raise TransientTaskError(
            f"{platform} answered with an error", retry_after=after / c.compression if after else None
        )


# -- databases -------------------------------------------------------------------------------------


def create_db(server: str, name: str) -> str:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(server, dbname=name)


def drop_db(server: str, name: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def prepare_queue(url: str, compression: float) -> None:
    """Migrated, with the retry backoff compressed as the rest of the queue's times."""
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE worker_task_roles SET retry_base_seconds = greatest(1, round(retry_base_seconds / %s)),"
            " retry_cap_seconds = greatest(1, round(retry_cap_seconds / %s))",
            (compression, compression),
        )


# -- the daemon ------------------------------------------------------------------------------------

PID = re.compile(r"Started process for run \(pid: (\d+)\)")
DRAINED = re.compile(
    r"(\d+) completed, (\d+) retried, (\d+) failed, (\d+) deferred, (\d+) lost in ([\d.]+) s"
)
ALIVE_STATUSES = ("NOT_STARTED", "QUEUED", "STARTING", "STARTED", "CANCELING")


class Daemon:
    """``dagster-daemon run`` in a DAGSTER_HOME of its own, over the repository's dagster.yaml and
    the bench's code location; stopping it kills every process started under that home."""

    def __init__(
        self,
        home: Path,
        queue_url: str,
        dagster_url: str,
        setting: Setting,
        *,
        compression: float,
        task_seconds: float,
        role_caps: str = "",
    ) -> None:
        home.mkdir(parents=True)
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        (home / "workspace.yaml").write_text(
            "load_from:\n"
            "  - python_module:\n"
            "      module_name: bench.drain_runs\n"
            "      attribute: defs\n"
            "      location_name: tq_bench\n"
            f"      working_directory: {ROOT}\n"
        )
        self.home = home
        self.dagster_url = dagster_url
        self.epoch_file = home / "epoch"
        handler = "bench.drain_runs:handle"
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "TQ_DAGSTER_PG_URL": sqlalchemy_url(dagster_url),
            "TQ_DATABASE_URL": queue_url,
            "TQ_HANDLERS": ",".join(f"{role}={handler}" for role in ROLES),
            "TQ_BENCH_IDLE_EXIT_SECONDS": str(setting.idle_exit_seconds),
            "TQ_BENCH_TIME_BUDGET_SECONDS": str(setting.time_budget_seconds),
            "TQ_BENCH_IDLE_POLL_SECONDS": str(setting.idle_poll_seconds),
            "TQ_BENCH_COMPRESSION": str(compression),
            "TQ_BENCH_EPOCH_FILE": str(self.epoch_file),
            "TQ_BENCH_TASK_SECONDS": str(task_seconds),
            "PYTHONPATH": str(ROOT),
            "PYTHONWARNINGS": "ignore",
        }
        # The demo's: default caps, no platforms file (the handler makes no request).
        for name in ("TQ_PLATFORMS_FILE", "TQ_ROLE_CAPS"):
            env.pop(name, None)
        if role_caps:
            env["TQ_ROLE_CAPS"] = role_caps
        self.log = (home / "daemon.log").open("wb")
        self.proc = subprocess.Popen(
            [str(BIN / "dagster-daemon"), "run", "-w", str(home / "workspace.yaml")],
            env=env,
            cwd=home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.cpu = ProcessCpu(home)

    def wait_ready(self, timeout: float = 240) -> None:
        """Until task_queue_sensor has ticked once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"dagster-daemon exited; see {self.home / 'daemon.log'}")
            with (
                contextlib.suppress(psycopg.errors.UndefinedTable),
                psycopg.connect(self.dagster_url) as conn,
            ):
                if conn.execute("SELECT count(*) FROM job_ticks WHERE type = 'SENSOR'").fetchone() != (0,):
                    self.cpu.start()
                    return
            time.sleep(1)
        raise SystemExit(f"the sensor did not tick within {timeout:.0f} s; see {self.home / 'daemon.log'}")

    def start_clock(self) -> float:
        epoch = time.time()
        self.epoch_file.write_text(repr(epoch))
        return epoch

    def alive_runs(self) -> int:
        with psycopg.connect(self.dagster_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runs WHERE pipeline_name = %s AND status = ANY(%s)",
                (drain_tasks_job.name, list(ALIVE_STATUSES)),
            ).fetchone()
        return int(row[0]) if row else 0

    def runs(self) -> list[dict[str, Any]]:
        """Every drain run: role, status, enqueued/dequeued/start/end (unix seconds), its
        worker's outcome counts, and its process id."""
        with psycopg.connect(self.dagster_url, row_factory=dict_row) as conn:
            runs = conn.execute(
                """
                SELECT r.run_id, t.value AS role, r.status, r.start_time, r.end_time,
                       extract(EPOCH FROM r.create_timestamp)::float AS created
                FROM runs r JOIN run_tags t ON t.run_id = r.run_id AND t.key = 'tq/role'
                WHERE r.pipeline_name = %s
                """,
                (drain_tasks_job.name,),
            ).fetchall()
            events = conn.execute(
                """
                SELECT run_id, dagster_event_type, extract(EPOCH FROM timestamp)::float AS at, event
                FROM event_logs
                WHERE run_id = ANY(%s)
                  AND (dagster_event_type IN ('PIPELINE_ENQUEUED', 'PIPELINE_STARTING', 'ENGINE_EVENT')
                       OR dagster_event_type IS NULL)
                """,
                ([r["run_id"] for r in runs],),
            ).fetchall()
        by_run = {r["run_id"]: r for r in runs}
        for e in events:
            run = by_run[e["run_id"]]
            kind = e["dagster_event_type"]
            if kind == "PIPELINE_ENQUEUED":
                run["enqueued"] = e["at"]
            elif kind == "PIPELINE_STARTING":  # out of the run queue, its process being launched
                run["dequeued"] = e["at"]
            elif kind == "ENGINE_EVENT" and (m := PID.search(e["event"])):
                run["pid"] = int(m.group(1))
            elif kind is None and (m := DRAINED.search(e["event"])):
                run["outcomes"] = sum(int(m.group(i)) for i in range(1, 5))
                run["drain_seconds"] = float(m.group(6))
        return runs

    def sensor_ticks(self) -> list[float]:
        with psycopg.connect(self.dagster_url) as conn:
            rows = conn.execute(
                "SELECT extract(EPOCH FROM timestamp)::float FROM job_ticks WHERE type = 'SENSOR' ORDER BY 1"
            ).fetchall()
        return [r[0] for r in rows]

    def stop(self) -> None:
        self.cpu.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        kill_strays(self.home)
        self.log.close()


def _proc_environ_has(pid: str, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def kill_strays(home: Path) -> None:
    """Run processes outlive the daemon (the code server starts them in sessions of their own):
    kill those started under this DAGSTER_HOME, by pid."""
    marker = f"DAGSTER_HOME={home}".encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and _proc_environ_has(pid, marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> tuple[int, float] | None:
    """(start time in clock ticks, user + system CPU seconds) of a process, or None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ProcessCpu(threading.Thread):
    """CPU seconds of every process started under one DAGSTER_HOME, by kind (run processes, the
    daemon and its code server), sampled every half second: the last half second of a process
    that exits is missed, so the figures are lower bounds."""

    def __init__(self, home: Path) -> None:
        super().__init__(daemon=True)
        self.marker = f"DAGSTER_HOME={home}".encode()
        self.ours: dict[tuple[str, int], tuple[str, float]] = {}
        self.others: set[tuple[str, int]] = set()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.5):
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or (got := cpu_seconds(pid)) is None:
                    continue
                key = (pid, got[0])
                if key in self.others:
                    continue
                if key not in self.ours:
                    if not _proc_environ_has(pid, self.marker):
                        self.others.add(key)
                        continue
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    # Runs are spawned by the code server (multiprocessing).
                    kind = "run" if b"spawn_main" in cmdline else "dagster"
                else:
                    kind = self.ours[key][0]
                self.ours[key] = (kind, got[1])

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join()

    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for kind, seconds in self.ours.values():
            total[kind] += seconds
        return total


# -- 1. runs per day: the replay ------------------------------------------------------------------


@dataclass
class Replay:
    setting: Setting
    window_seconds: float
    compression: float
    runs: list[dict[str, Any]]
    ticks: list[float]
    epoch: float
    tasks: dict[str, int]
    cpu: Counter[str]
    pickup: dict[str, list[float]] = field(default_factory=dict)

    def in_window(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if self.epoch <= r["enqueued_at"] < self.epoch + self.window_seconds]

    def per_role(self) -> Counter[str]:
        return Counter(r["role"] for r in self.in_window())

    def per_day(self) -> float:
        return extrapolate(self.per_role(), self.window_seconds * self.compression)

    def tick_intervals(self) -> list[float]:
        t = [x for x in self.ticks if x >= self.epoch]
        return [b - a for a, b in itertools.pairwise(t) if b > a]

    def start_delays(self) -> list[tuple[float, float]]:
        """Per run: (request -> dequeued, request -> its worker registered), seconds."""
        return [
            (r["dequeued"] - r["enqueued_at"], r["registered"] - r["enqueued_at"])
            for r in self.runs
            if r.get("registered") is not None and r.get("dequeued") is not None
        ]

    def end_delays(self) -> list[float]:
        """Per run that ended idle: its worker's last outcome (or registration) -> the run's end,
        less the idle exit: the last empty claim, the worker going offline, the run's teardown."""
        idle = self.setting.idle_exit_seconds / self.compression
        out = []
        for r in self.runs:
            if r.get("registered") is None or r.get("end_time") is None:
                continue
            tail = r["end_time"] - (r["registered"] + r.get("drain_seconds", 0.0)) - idle
            if 0 <= tail < 30:  # not a run stopped by its time budget
                out.append(tail)
        return out


def extrapolate(per_role: Counter[str], demo_seconds: float) -> float:
    """Runs per demo day: the discovery's roles as they came (once a day), the rest scaled from
    the window to 24 hours."""
    return sum(n if role in ONCE else n * DAY / demo_seconds for role, n in per_role.items())


def run_action(queue: TaskQueue, kind: str) -> None:
    if kind == "discovery":
        for platform in PROFILES:
            for region in REGIONS:
                queue.enqueue_once(
                    "store_discovery", platform=platform, payload={"platform": platform, "region": region}
                )
    elif kind == "crawl":
        with queue.pool.connection() as conn:
            conn.execute(query("enqueue_demo_resyncs"))
    elif kind == "analytics":
        queue.enqueue_once("analytics_refresh")
    else:
        raise ValueError(kind)


def replay(daemon: Daemon, queue_url: str, setting: Setting, window: float, compression: float) -> Replay:
    """The demo's first ``window x compression`` seconds, ``compression`` times faster."""
    actions = demo_actions(window * compression)
    with TaskQueue.connect(queue_url, max_size=2) as queue:
        epoch = daemon.start_clock()
        for demo_t, kind in actions:
            time.sleep(max(0.0, epoch + demo_t / compression - time.time()))
            run_action(queue, kind)
        time.sleep(max(0.0, epoch + window - time.time()))
    # Whatever the window's last arrivals asked for is counted as it comes; then the books close.
    time.sleep(15)
    return collect(daemon, queue_url, setting, window, compression, epoch)


def collect(
    daemon: Daemon, queue_url: str, setting: Setting, window: float, compression: float, epoch: float
) -> Replay:
    runs = daemon.runs()
    with psycopg.connect(queue_url, row_factory=dict_row) as conn:
        registered = {
            r["worker_id"]: r["at"]
            for r in conn.execute(
                "SELECT worker_id, extract(EPOCH FROM started_at)::float AS at FROM worker_registry"
            ).fetchall()
        }
        tasks = {
            r["status"]: r["n"]
            for r in conn.execute("SELECT status, count(*) AS n FROM v_tasks GROUP BY status").fetchall()
        }
        # Pickup of work that came due alone: analytics, and retries (their last attempt).
        single = conn.execute(
            """
            SELECT role, extract(EPOCH FROM started_at - due_at)::float AS s FROM v_tasks
            WHERE status = 'completed' AND (role = 'analytics_refresh' OR retry_count > 0)
              AND due_at < to_timestamp(%s)
            """,
            (epoch + window,),
        ).fetchall()
    for r in runs:
        r["enqueued_at"] = r.get("enqueued") or r["created"]
        r["registered"] = registered.get(f"{r['role']}@run:{r['run_id']}"[:100])
    pickup = {
        "analytics": [s["s"] for s in single if s["role"] == "analytics_refresh"],
        "retries": [s["s"] for s in single if s["role"] != "analytics_refresh"],
    }
    return Replay(
        setting, window, compression, runs, daemon.sensor_ticks(), epoch, tasks, daemon.cpu.totals(), pickup
    )


# -- 2. pickup latency ------------------------------------------------------------------------------

_ANALYTICS = {
    "role": "analytics_refresh",
    "dispensary_id": None,
    "platform": None,
    "priority": 0,
    "scheduled_for": None,
    "max_retries": 3,
    "payload": None,
}


def pickup_one(url: str, timeout: float = 120) -> float:
    """Enqueue one task and wait for it to finish; returns created_at -> started_at, seconds."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query("enqueue_task"), _ANALYTICS).fetchone()
        assert row is not None
        task_id = row[0]
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT extract(EPOCH FROM started_at - created_at)::float FROM v_tasks"
                " WHERE id = %s AND status = 'completed'",
                (task_id,),
            ).fetchone()
            if row:
                return float(row[0])
            time.sleep(0.05)
    raise SystemExit(f"task {task_id} not done within {timeout:.0f} s")


def wait_idle(daemon: Daemon, queue_url: str, timeout: float = 300) -> None:
    """Until nothing is pending or running and no drain run is alive."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(queue_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM worker_tasks WHERE status IN ('pending', 'claimed', 'running')"
            ).fetchone()
            if row == (0,) and daemon.alive_runs() == 0:
                return
            time.sleep(0.5)
    raise SystemExit(f"the queue did not go idle within {timeout:.0f} s")


def from_idle(daemon: Daemon, queue_url: str, samples: int, rng: random.Random) -> list[float]:
    """One task at a time, each once no drain run is alive: the sensor's tick, a run's start."""
    out = []
    for _ in range(samples):
        wait_idle(daemon, queue_url)
        time.sleep(rng.uniform(0, 5))  # any phase of the sensor's interval
        out.append(pickup_one(queue_url))
    return out


def while_live(queue_url: str, samples: int, rng: random.Random) -> list[float]:
    """One task at a time at random intervals, a drain run live."""
    out = []
    for _ in range(samples):
        out.append(pickup_one(queue_url))
        time.sleep(rng.uniform(0.2, 3.0))
    return out


# -- 3. the cost of an idle run ----------------------------------------------------------------------


def socket_ports(pid: int) -> set[int]:
    """Local TCP ports of a process's sockets."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def connections(server: str, pid: int) -> dict[str, int]:
    """The server's sessions whose client is the process, per database."""
    ports = socket_ports(pid)
    with psycopg.connect(server) as conn:
        rows = conn.execute(
            "SELECT datname, count(*) FROM pg_stat_activity WHERE client_port = ANY(%s) GROUP BY datname",
            (list(ports),),
        ).fetchall()
    return {r[0]: r[1] for r in rows}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stat_snapshot(url: str) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        snap = {
            f"fn:{name}": float(calls)
            for name, calls in conn.execute("SELECT funcname, calls FROM pg_stat_user_functions").fetchall()
        }
        row = conn.execute(
            "SELECT sum(n_tup_ins + n_tup_upd + n_tup_del) FROM pg_stat_user_tables"
        ).fetchone()
        assert row is not None
        snap["rows_written"] = float(row[0] or 0)
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        snap["transactions"] = float(row[0])
    return snap


def idle_cost(server: str, queue_url: str, pids: list[int], seconds: float) -> dict[str, Any]:
    """Deltas over ``seconds`` with the runs of ``pids`` live and nothing to do: the queue
    database's (the sensor's ticks included), and each run process's."""
    before, t0 = stat_snapshot(queue_url), time.monotonic()
    cpu_before = [cpu_seconds(p) for p in pids]
    conns = [connections(server, p) for p in pids]
    time.sleep(seconds)
    after, elapsed = stat_snapshot(queue_url), time.monotonic() - t0
    cpu_after = [cpu_seconds(p) for p in pids]
    delta = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / elapsed for k in after}
    return {
        "seconds": elapsed,
        "runs": len(pids),
        "functions_per_s": {k[3:]: v for k, v in delta.items() if k.startswith("fn:") and v > 0},
        "rows_written_per_s": delta["rows_written"],
        "transactions_per_s": delta["transactions"],
        "cpu_s_per_min": [
            (a[1] - b[1]) / elapsed * 60 for a, b in zip(cpu_after, cpu_before, strict=True) if a and b
        ],
        "rss_mb": [rss_mb(p) for p in pids],
        "connections": conns,
        "connections_after": [connections(server, p) for p in pids],
    }


# -- the simulation ----------------------------------------------------------------------------------


@dataclass
class SimTask:
    id: int
    role: str
    store: str | None
    platform: str | None
    region: str | None
    due: float
    retries: int = 0
    done: bool = False

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return self.role, self.store, self.region


@dataclass
class SimStore:
    resolved: bool = False
    enabled: bool = True
    busy: bool = False


@dataclass
class SimRun:
    role: str
    requested: float
    dequeued: float
    tail: float
    budget_end: float = math.inf
    ended: float = math.inf
    idle_since: float | None = None


class Simulation:
    """The sensor's decisions and the drain runs' loop over a model of the queue, in event time:
    task_queue_sensor's arithmetic (runs wanted per role, one more when claimable work waited a
    whole tick beside live runs, caps of 2), each run's start drawn from those measured (request
    -> dequeued -> worker registered; last outcome -> run ended), the Worker's inline loop
    (claims of 50, one active task per store, outcomes written after each batch; with no idle
    exit it ends at its first empty claim, else it polls until idle that long), the queue's
    retry backoff, and the same arrivals and faults as the replay's handler."""

    CAP = 2
    TASKS_PER_RUN = 500
    BATCH = 50
    CLAIM_SECONDS = 0.01  # a claim and a batch's completion
    MAX_RETRIES = 3
    IN_TRANSACTION = frozenset({"store_discovery", "entry_point_discovery"})  # complete as they end

    def __init__(
        self,
        setting: Setting,
        compression: float,
        ticks: list[float],
        starts: list[tuple[float, float]],
        tails: list[float],
        task_seconds: float,
        retry: tuple[float, float],
        seed: int,
    ) -> None:
        self.s, self.k = setting, compression
        self.tick_intervals, self.starts, self.tails = ticks, starts, tails
        self.task_seconds = task_seconds + 0.002  # and the handler's own queries
        self.retry_base, self.retry_cap = retry
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.next_id = 0
        self.open: Counter[tuple[str, str | None, str | None]] = Counter()  # pending or active
        self.pending: dict[str, list[SimTask]] = {r: [] for r in ROLES}
        self.stores: dict[str, SimStore] = {}
        self.alive: dict[str, list[SimRun]] = {r: [] for r in ROLES}
        self.requested: Counter[str] = Counter()
        self.backlog: set[str] = set()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self, horizon: float) -> Counter[str]:
        """Runs requested per role within ``horizon`` seconds (compressed time)."""
        for demo_t, kind in demo_actions(horizon * self.k):
            self.at(demo_t / self.k, self.action, kind)
        self.at(self.rng.uniform(0, statistics.mean(self.tick_intervals)), self.tick)
        while self.events and self.events[0][0] < horizon:
            t, _, fn, args = heapq.heappop(self.events)
            fn(t, *args)
        return self.requested

    # arrivals, as the queue's functions make them
    def add(
        self,
        t: float,
        role: str,
        store: str | None = None,
        platform: str | None = None,
        region: str | None = None,
    ) -> None:
        self.next_id += 1
        task = SimTask(self.next_id, role, store, platform or (store and store.split("-")[0]), region, t)
        self.open[task.key] += 1
        self.pending[role].append(task)

    def add_once(
        self,
        t: float,
        role: str,
        store: str | None = None,
        platform: str | None = None,
        region: str | None = None,
    ) -> None:
        if not self.open[role, store, region]:
            self.add(t, role, store, platform, region)

    def action(self, t: float, kind: str) -> None:
        if kind == "discovery":
            for platform in PROFILES:
                for region in REGIONS:
                    self.add_once(t, "store_discovery", None, platform, region)
        elif kind == "crawl":
            for d, s in self.stores.items():
                if s.resolved and s.enabled:
                    self.add_once(t, "product_resync", d)
        else:
            self.add_once(t, "analytics_refresh")

    # the sensor
    def tick(self, t: float) -> None:
        backlog_before, self.backlog = self.backlog, set()
        for role in ROLES:
            due = [x for x in self.pending[role] if x.due <= t]
            ready = len(due)
            claimable = len({x.store or x.id for x in due if not self._busy(x)})
            alive = self.alive[role] = [r for r in self.alive[role] if t < r.ended]
            queued = [r for r in alive if t < r.dequeued]
            if not ready and not alive:
                continue
            wanted = min(
                self.CAP, math.ceil(ready / self.TASKS_PER_RUN), math.ceil(claimable / self.BATCH)
            ) - len(alive)
            if claimable:
                self.backlog.add(role)
                if wanted <= 0 and role in backlog_before and not queued and len(alive) < self.CAP:
                    wanted = 1
            for _ in range(max(wanted, 0)):
                dequeue, live = self.rng.choice(self.starts)
                run = SimRun(role, t, t + dequeue, self.rng.choice(self.tails))
                alive.append(run)
                self.requested[role] += 1
                self.at(t + live, self.start, run)
        self.at(t + self.rng.choice(self.tick_intervals), self.tick)

    def _busy(self, x: SimTask) -> bool:
        return x.store is not None and self.stores[x.store].busy

    # a drain run's worker
    def start(self, t: float, run: SimRun) -> None:
        run.budget_end = t + self.s.time_budget_seconds
        self.step(t, run)

    def step(self, t: float, run: SimRun) -> None:
        batch: list[SimTask] = []
        if t < run.budget_end:
            for x in sorted((x for x in self.pending[run.role] if x.due <= t), key=lambda x: x.due):
                if len(batch) == self.BATCH:
                    break
                if not self._busy(x):
                    batch.append(x)
                    if x.store:
                        self.stores[x.store].busy = True
        if batch:
            run.idle_since = None
            for x in batch:
                self.pending[run.role].remove(x)
            end = t + self.CLAIM_SECONDS
            later = []
            for x in batch:
                kind, after, hung = self.outcome(x, end)
                end += self.task_seconds + hung / self.k
                if kind == "ok" and x.role in self.IN_TRANSACTION:
                    self.at(end, self.finish, x, kind, after)
                else:  # written with the batch
                    later.append((x, kind, after))
            for x, kind, after in later:
                self.at(end, self.finish, x, kind, after)
            self.at(end, self.step, run)
            return
        if run.idle_since is None:
            run.idle_since = t
        if (
            t < run.budget_end
            and self.s.idle_exit_seconds > 0
            and t - run.idle_since <= self.s.idle_exit_seconds
        ):
            self.at(t + self.s.idle_poll_seconds, self.step, run)
        else:
            run.ended = t + run.tail

    def outcome(self, x: SimTask, t: float) -> tuple[str, float, float]:
        demo_t = t * self.k
        if x.role == "analytics_refresh":
            return "ok", 0.0, 0.0
        if x.store:
            g = gone_after(x.store)
            if g is not None and demo_t >= g:
                return "gone", 0.0, 0.0
            if x.role != "entry_point_discovery" and not self.stores[x.store].enabled:
                return "ok", 0.0, 0.0
        return attempt_outcome(x.platform, (x.id, x.retries), demo_t)

    def finish(self, t: float, x: SimTask, kind: str, after: float) -> None:
        if x.store:
            self.stores[x.store].busy = False
        if kind in {"defer", "retry"} and (kind == "defer" or x.retries < self.MAX_RETRIES):
            if kind == "defer":
                x.due = t + after / self.k
            else:
                backoff = min(self.retry_base * 2**x.retries, self.retry_cap) * self.rng.uniform(0.5, 1)
                x.due = t + max(backoff, after / self.k)
                x.retries += 1
            self.pending[x.role].append(x)
            return
        x.done = True
        self.open[x.key] -= 1
        if kind == "gone" and x.store:
            self.stores[x.store].enabled = False
        elif kind == "ok" and x.role == "store_discovery" and x.platform and x.region:
            for d in listed(x.platform, x.region, t * self.k):
                s = self.stores.setdefault(d, SimStore())
                if s.enabled and not s.resolved:
                    self.add_once(t, "entry_point_discovery", d)
        elif kind == "ok" and x.role == "entry_point_discovery" and x.store:
            self.stores[x.store].resolved = True
            self.add_once(t, "product_discovery", x.store)


def simulate(
    replay: Replay,
    compression: float,
    horizon: float,
    task_seconds: float,
    seed: int,
    setting: Setting | None = None,
) -> Counter[str]:
    """Runs per role the simulation makes over ``horizon`` at ``compression``, with the sensor
    intervals and run starts measured in ``replay`` (and its setting, unless given)."""
    retry = (30.0 / compression, 3600.0 / compression)  # worker_task_roles' defaults, compressed
    return Simulation(
        (setting or replay.setting).compressed(compression),
        compression,
        replay.tick_intervals(),
        replay.start_delays(),
        replay.end_delays(),
        task_seconds,
        retry,
        seed,
    ).run(horizon)


# -- the report ----------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_lives(replay: Replay) -> tuple[float, int]:
    """Median life of the window's runs (requested -> ended), and how many finished no task."""
    runs = [r for r in replay.in_window() if r.get("end_time")]
    return median([r["end_time"] - r["enqueued_at"] for r in runs]), sum(
        1 for r in runs if not r.get("outcomes")
    )


@contextlib.contextmanager
def running(
    tmp: Path,
    server: str,
    queue_db: str,
    setting: Setting,
    compression: float,
    task_seconds: float,
    role_caps: str = "",
) -> Iterator[Daemon]:
    dagster_url = create_db(server, f"{queue_db}_dagster")
    queue_url = make_conninfo(server, dbname=queue_db)
    daemon = Daemon(
        tmp / queue_db,
        queue_url,
        dagster_url,
        setting,
        compression=compression,
        task_seconds=task_seconds,
        role_caps=role_caps,
    )
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default=os.environ.get("TQ_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--window-minutes", type=float, default=12, help="replay per setting, wall clock")
    parser.add_argument("--compression", type=float, default=10, help="demo seconds per wall-clock second")
    parser.add_argument("--samples", type=int, default=120, help="pickups with a run live")
    parser.add_argument("--idle-samples", type=int, default=10, help="pickups from idle")
    parser.add_argument("--idle-seconds", type=float, default=120, help="window to measure an idle run")
    parser.add_argument("--task-ms", type=float, default=5, help="the handler's sleep per task")
    parser.add_argument("--sim-seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    k, window, task_seconds = args.compression, args.window_minutes * 60, args.task_ms / 1000
    rng = random.Random(args.seed)
    began = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - began:4.0f} s] {message}", flush=True)

    names = [f"tq_bench_runs_{n}" for n in ("old", "new", "live")]
    dbs = names + [f"{n}_dagster" for n in names]
    try:
        queue = {n: create_db(args.url, n) for n in names}
        for n in names[:2]:
            prepare_queue(queue[n], k)
        migrate(queue[names[2]])
        with psycopg.connect(args.url, autocommit=True) as conn:
            # Function calls counted in this database only (its sessions read it at connect).
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET track_functions = 'pl'").format(sql.Identifier(names[2]))
            )
        replays: dict[str, Replay] = {}
        with tempfile.TemporaryDirectory(prefix="tq-drain-runs-") as tmp:
            for name, setting in zip(names, (OLD, NEW), strict=False):
                with running(Path(tmp), args.url, name, setting.compressed(k), k, task_seconds) as d:
                    say(f"{setting.name}: replaying {window * k / 3600:.1f} demo hours in {window:.0f} s")
                    replays[setting.name] = replay(d, queue[name], setting, window, k)
                    say(f"{setting.name}: {len(replays[setting.name].in_window())} drain runs")
                    if setting is OLD:
                        say(f"{setting.name}: {args.idle_samples} pickups from idle")
                        idle_pickups = from_idle(d, queue[name], args.idle_samples, rng)
            # One run at most: the sensor's second run (runs that did nothing, above) would halve
            # the poll interval the pickups see.
            caps = "analytics_refresh=1"
            with running(Path(tmp), args.url, names[2], NEW, 1, task_seconds, caps) as d:
                d.start_clock()
                say(f"new defaults: {args.samples} pickups, one run live")
                idle_pickups.append(pickup_one(queue[names[2]]))  # the first starts the run
                live_pickups = while_live(queue[names[2]], args.samples, rng)
                live = [r for r in d.runs() if r["status"] in ALIVE_STATUSES and r.get("pid")]
                time.sleep(15)  # past the first seconds of idling, when it also asks after platforms
                say(f"new defaults: an idle run over {args.idle_seconds:.0f} s")
                cost = idle_cost(args.url, queue[names[2]], [r["pid"] for r in live], args.idle_seconds)
                live_runs = len(d.runs())
    finally:
        for name in dbs:
            with contextlib.suppress(psycopg.Error):
                drop_db(args.url, name)
    say("simulating")
    sims = {
        n: (
            [simulate(r, k, window, task_seconds, s) for s in range(args.sim_seeds)],
            [simulate(r, 1, DAY, task_seconds, s) for s in range(args.sim_seeds)],
        )
        for n, r in replays.items()
    }
    # Not measured: what the new loop would make if its idle exit outlasted the demo's longest
    # gap between arrivals (analytics, every 15 minutes).
    longer = Setting(WHAT_IF, idle_exit_seconds=900, time_budget_seconds=NEW.time_budget_seconds)
    sims[WHAT_IF] = (
        [],
        [simulate(replays["new"], 1, DAY, task_seconds, s, longer) for s in range(args.sim_seeds)],
    )
    say("done")
    report(replays, sims, window, k, idle_pickups, live_pickups, live_runs, len(live), cost)


def report(
    replays: dict[str, Replay],
    sims: dict[str, tuple[list[Counter[str]], list[Counter[str]]]],
    window: float,
    k: float,
    idle_pickups: list[float],
    live_pickups: list[float],
    live_runs: int,
    live_at_once: int,
    cost: dict[str, Any],
) -> None:
    demo_window = window * k
    print(
        f"\n1. Drain runs, real dagster-daemon: the demo's first {demo_window / 3600:.1f} h replayed in "
        f"{window / 60:.0f} min ({k:g}x)\n"
    )
    print(
        "| setting | runs in the window | by role | runs per demo day | median run life (s) "
        "| runs that did nothing | tasks finished | CPU s of run processes |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for n, r in replays.items():
        roles = ", ".join(f"{role} {c}" for role, c in sorted(r.per_role().items()))
        life, empty = run_lives(r)
        done = r.tasks.get("completed", 0) + r.tasks.get("failed", 0)
        print(
            f"| {n} | {len(r.in_window())} | {roles} | {r.per_day():,.0f} | {life:.1f} | {empty} "
            f"| {done:,} | {r.cpu['run']:.0f} |"
        )
    print(f"\nold / new, runs per demo day: {replays['old'].per_day() / replays['new'].per_day():.1f}\n")

    print("Simulation (not the daemon): the sensor's decisions and the worker loop, with the sensor")
    print("intervals and run starts measured above; means of the seeds (range)\n")
    print(
        "| setting | daemon, runs in the window | simulated, the same window | its runs per demo day "
        "| simulated, a whole demo day uncompressed |"
    )
    print("|---|---:|---:|---:|---:|")
    for n, r in replays.items():
        same, day = sims[n]
        w = [sum(c.values()) for c in same]
        wd = [extrapolate(c, demo_window) for c in same]
        d = [sum(c.values()) for c in day]
        print(
            f"| {n} | {len(r.in_window())} | {statistics.mean(w):.1f} ({min(w)}-{max(w)}) "
            f"| {statistics.mean(wd):,.0f} | {statistics.mean(d):,.0f} ({min(d)}-{max(d)}) |"
        )
    d = [sum(c.values()) for c in sims[WHAT_IF][1]]
    print(f"| {WHAT_IF} | | | | {statistics.mean(d):,.0f} ({min(d)}-{max(d)}) |")
    for n, (_, day) in sims.items():
        total: Counter[str] = Counter()
        for c in day:
            total.update(c)
        means = {r: round(v / len(day)) for r, v in sorted(total.items())}
        print(f"  {n}, a whole day by role (mean): {means}")
    ticks = [t for r in replays.values() for t in r.tick_intervals()]
    starts = [s[1] for r in replays.values() for s in r.start_delays()]
    print(
        f"  sensor interval: median {median(ticks):.1f} s, p95 {pct(ticks, 0.95):.1f} s; run request -> "
        f"worker registered: median {median(starts):.1f} s, p95 {pct(starts, 0.95):.1f} s"
    )

    print("\n2. Pickup latency, created_at (or due) -> started_at, server clock\n")
    print("| case | n | p50 (s) | p95 (s) | max (s) |")
    print("|---|---:|---:|---:|---:|")
    cases = [
        ("new defaults, a drain run live", live_pickups),
        ("from idle, no run alive", idle_pickups),
    ]
    for n, r in replays.items():
        cases.append((f"replay, {n}: analytics, due -> started", r.pickup["analytics"]))
        cases.append((f"replay, {n}: retries, due -> started", r.pickup["retries"]))
    for label, values in cases:
        print(
            f"| {label} | {len(values)} | {median(values):.2f} | {pct(values, 0.95):.2f} "
            f"| {max(values, default=math.nan):.2f} |"
        )
    print(f"\n  drain runs during the live pickups: {live_runs} made, {live_at_once} alive at the end")

    runs = cost["runs"]
    fns = cost["functions_per_s"]
    print(f"\n3. Idle drain runs, new defaults: {runs} live, over {cost['seconds']:.0f} s\n")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| claims/s per run (claim_tasks calls / runs) | {fns.get('claim_tasks', 0.0) / runs:.2f} |")
    print(f"| heartbeats/s per run | {fns.get('heartbeat_tasks', 0.0) / runs:.3f} |")
    print(f"| rows written/s, queue database (the sensor's too) | {cost['rows_written_per_s']:.2f} |")
    print(f"| transactions/s, queue database (the sensor's too) | {cost['transactions_per_s']:.2f} |")
    print(f"| CPU s per minute, each run process | {', '.join(f'{c:.2f}' for c in cost['cpu_s_per_min'])} |")
    print(f"| memory (RSS), each run process | {', '.join(f'{m:.0f} MB' for m in cost['rss_mb'])} |")
    print(f"| connections, each run process | {cost['connections']}, then {cost['connections_after']} |")
    print(f"\n  calls/s by function: { {f: round(v, 2) for f, v in sorted(fns.items())} }")


if __name__ == "__main__":
    main()
