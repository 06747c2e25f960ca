"""Long horizon: queues under sustained load, a held xmin, readers and chaos, after the public harness.

    python bench/long_horizon.py [--systems tq,procrastinate,pgqueuer] [--scenario pressure|chaos]
                                 [--phase LABEL=TYPE[(k=v,...)]:DURATION ...] [--phase-seconds 600]
                                 [--rate N|half-capacity] [--workers 8] [--work-ms 1] [--replicas N]
                                 [--url URL | --embedded] [--sample-every 5] [--run-id ID]

Each system runs in turn on one server, in its own database (its adapter.json's db_name,
recreated), through its adapter in bench/portable/<system>-bench (the harness's JSONL protocol),
at the same offered load, WORKER_COUNT and JOB_WORK_MS. A system ``tq-before-NNNN`` is tq's
adapter on a database with only the migrations before NNNN: one change measured beside the queue
without it, in the same run. Phases are the harness's: warmup, clean,
idle-in-tx, active-readers, high-load, recovery, repeated-kill, pg-backend-kill, pool-exhaustion,
postgres-restart. Scenario ``pressure``: warmup, clean, idle-in-tx, active-readers, high-load
(1.5x), recovery. Scenario ``chaos``: warmup, clean, then each fault followed by a recovery, with
two replicas (the offered rate split between them) so that one works while the other is killed.
A scenario phase lasts --phase-seconds (warmup half of it); a --phase duration may be ``30s``,
``10m`` or ``2x`` (times --phase-seconds).

``--embedded`` (always, when a phase restarts PostgreSQL) runs the whole run on a PostgreSQL
started from the PyPI wheel (tq_pipelines.db.embedded) under .tq/bench-lh, on a Unix socket with
a free port number, set up like the harness's postgres.conf (max_connections 400, ...). Else
--url (default the 5432 server).

Every --sample-every seconds: the adapters' samples (completion and enqueue rate, pickup
p50/p95/p99, queue depth) and, per declared event table, n_dead_tup, n_live_tup and
pg_total_relation_size. After the phases, producers stop (rate 0) and the queue drains; the audit
counts the tasks in the system's own table against the adapter's ``bench_done(task_id, at)``:
lost (never completed) and completed more than once. Output, in
docs/bench/long_horizon/<run-id>/: raw.csv.gz (one row per system and sample), tables.csv.gz
(per table), events.csv, summary.md (per phase x system, audit, recovery times, a verdict per
system) and timeline.png. Logs of the adapters go to .tq/bench-lh/logs/<run-id>/.

Smoke: ``--phase-seconds 20 --rate 50``; the real runs: ``--phase-seconds 600 --rate half-capacity``.
"""

import argparse
import contextlib
import csv
import gzip
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import machine_busy, proc_cpu  # noqa: E402

PORTABLE = ROOT / "bench" / "portable"
OUT_ROOT = ROOT / "docs" / "bench" / "long_horizon"
STATE = ROOT / ".tq" / "bench-lh"
APP = "lh-driver"  # application_name of every connection of this driver: never a target of kills

PHASE_TYPES = (
    "warmup",
    "clean",
    "idle-in-tx",
    "active-readers",
    "high-load",
    "recovery",
    "repeated-kill",
    "pg-backend-kill",
    "pool-exhaustion",
    "postgres-restart",
)
FAULTS = {"repeated-kill", "pg-backend-kill", "pool-exhaustion", "postgres-restart"}
STRESS = {"idle-in-tx", "active-readers", "high-load"} | FAULTS
# Durations in units of --phase-seconds.
SCENARIOS = {
    "pressure": [
        "warmup=warmup:0.5x",
        "clean=clean:1x",
        "idle_in_tx=idle-in-tx:1x",
        "readers=active-readers:1x",
        "high_load=high-load:1x",
        "recovery=recovery:1x",
    ],
    "chaos": [
        "warmup=warmup:0.5x",
        "clean=clean:1x",
        "kills=repeated-kill(instance=0):1x",
        "recovery_kills=recovery:1x",
        "backend_kills=pg-backend-kill(rate=2):1x",
        "recovery_backend=recovery:1x",
        "pool=pool-exhaustion(idle_conns=300):1x",
        "recovery_pool=recovery:1x",
        "pg_restart=postgres-restart:1x",
        "recovery_restart=recovery:1x",
    ],
}
# The harness's phase tints.
TINTS = {
    "warmup": "#D0D0D0",
    "clean": "#B8B8B8",
    "idle-in-tx": "#D46A6A",
    "recovery": "#DCDCDC",
    "active-readers": "#E0B66C",
    "high-load": "#A378C8",
    "postgres-restart": "#A03030",
    "pg-backend-kill": "#D86A3A",
    "pool-exhaustion": "#C8884A",
    "repeated-kill": "#B04040",
}
# The harness's postgres.conf, for the embedded server.
EMBEDDED_SETTINGS = {
    "max_connections": "400",
    "shared_buffers": "256MB",
    "work_mem": "8MB",
    "maintenance_work_mem": "128MB",
    "autovacuum_naptime": "60s",
    "autovacuum_vacuum_cost_delay": "2ms",
    "autovacuum_vacuum_cost_limit": "200",
    "autovacuum_vacuum_scale_factor": "0.2",
    "autovacuum_analyze_scale_factor": "0.1",
    "log_autovacuum_min_duration": "0",
}
# Ids of every task a system was given, from its own tables, when its adapter.json has no
# "enqueued_sql": completed tasks stay in these tables (procrastinate with delete_jobs=never;
# pgqueuer moves a finished job to its log).
ENQUEUED_SQL = {
    # Every task, in the queue or moved to its history (0022).
    "tq": "SELECT id FROM v_tasks",
    "procrastinate": "SELECT id FROM procrastinate_jobs",
    "pgqueuer": "SELECT id FROM pgqueuer UNION SELECT job_id FROM pgqueuer_log",
}
# Those of them still queued (pending, claimed or running): not completed yet, but not lost.
PENDING_SQL = {
    "tq": "SELECT id FROM worker_tasks WHERE status IN ('pending', 'claimed', 'running')",
    "procrastinate": "SELECT id FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
    "pgqueuer": "SELECT id FROM pgqueuer",
}
ADAPTER_METRICS = (
    "enqueue_rate",
    "completion_rate",
    "claim_p50_ms",
    "claim_p95_ms",
    "claim_p99_ms",
    "queue_depth",
    # Extras of these adapters (PROTOCOL-NOTES.md): offered jobs not inserted, and created to
    # effect committed.
    "enqueue_failed_rate",
    "enqueue_dropped_rate",
    "enqueue_deduplicated_rate",
    "end_to_end_p95_ms",
)


def log(msg: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


# ── phases ──────────────────────────────────────────────────────────────────────────────────────


@dataclass
class Phase:
    label: str
    type: str
    seconds: float
    params: dict[str, str] = field(default_factory=dict)
    start: float = 0.0  # wall clock, set when it runs
    end: float = 0.0


def parse_seconds(text: str, unit: float) -> float:
    text = text.strip().lower()
    if text.endswith("x"):
        return float(text[:-1]) * unit
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:])
    return float(text[:-1]) * scale if scale else float(text)


def parse_phase(spec: str, unit: float) -> Phase:
    m = re.fullmatch(r"([A-Za-z]\w*)=([a-z-]+)(?:\(([^)]*)\))?:([\d.]+[smhx]?)", spec.strip())
    if not m or m.group(2) not in PHASE_TYPES:
        raise SystemExit(f"bad --phase {spec!r}: LABEL=TYPE[(k=v,...)]:DURATION, TYPE in {PHASE_TYPES}")
    params = dict(kv.split("=", 1) for kv in (m.group(3) or "").split(",") if "=" in kv)
    return Phase(m.group(1), m.group(2), parse_seconds(m.group(4), unit), params)


# ── the server ──────────────────────────────────────────────────────────────────────────────────


class Server:
    """The one server of a run: --url, or an embedded one that this driver starts and restarts."""

    def __init__(self, url: str | None, embedded_dir: Path | None) -> None:
        self.pgdata = embedded_dir
        self.port = 0
        if embedded_dir is None:
            assert url
            self.url = url
            return
        from tq_pipelines.db import embedded

        self._embedded = embedded
        port_file = embedded_dir / "port"
        self.port = int(port_file.read_text()) if port_file.exists() else free_port()
        # The embedded module connects to the URL pgserver gives, which names the socket folder
        # but not the port: libpq takes it from PGPORT.
        os.environ["PGPORT"] = str(self.port)
        self._embedded.stop(embedded_dir)  # a server left by an interrupted run
        if not port_file.exists():
            # First start: initdb, then the settings (a port of ours, the harness's config), restart.
            os.environ.pop("PGPORT")
            url = self._embedded.start(embedded_dir)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.SQL("ALTER SYSTEM SET port = {}").format(sql.Literal(str(self.port))))
            self._embedded.stop(embedded_dir)
            os.environ["PGPORT"] = str(self.port)
            port_file.write_text(str(self.port))
        url = self._embedded.start(embedded_dir)
        self.url = make_conninfo(url, port=str(self.port))
        with psycopg.connect(self.url, autocommit=True) as conn:
            for name, value in EMBEDDED_SETTINGS.items():
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
                )
        self.restart_now()
        log(f"embedded PostgreSQL on {embedded_dir} (socket, port {self.port}): {self.url}")

    @property
    def embedded(self) -> bool:
        return self.pgdata is not None

    def db_url(self, db: str) -> str:
        """A URL (not a key=value string): asyncpg-based adapters take only URLs."""
        p = conninfo_to_dict(self.url)
        auth = quote(str(p.get("user") or "postgres"), safe="")
        if p.get("password"):
            auth += ":" + quote(str(p["password"]), safe="")
        host, port = str(p.get("host") or ""), str(p.get("port") or "")
        if host.startswith("/"):
            return f"postgresql://{auth}@/{db}?host={quote(host, safe='/')}" + (
                f"&port={port}" if port else ""
            )
        return f"postgresql://{auth}@{host or 'localhost'}{':' + port if port else ''}/{db}"

    def stop(self) -> None:
        assert self.pgdata is not None
        self._embedded.stop(self.pgdata)

    def start(self) -> None:
        assert self.pgdata is not None
        self._embedded.start(self.pgdata)

    def restart_now(self) -> None:
        self.stop()
        self.start()

    def version(self) -> str:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"

    def recreate(self, db: str, extensions: list[str]) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
        with psycopg.connect(self.db_url(db), autocommit=True) as conn:
            for ext in extensions:
                conn.execute(sql.SQL("CREATE EXTENSION IF NOT EXISTS {}").format(sql.Identifier(ext)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return port if port != 5432 else free_port()


def connect(url: str, **kw: Any) -> psycopg.Connection:
    kw.setdefault("application_name", APP)
    return psycopg.connect(url, connect_timeout=5, **kw)


# ── where the CPU goes (a server on this machine: its backends' pids are read from /proc) ──────

READER_APP = APP + "-reader"
CPU_GROUPS = ("busy", "clients", "queue", "readers", "autovacuum", "other")


class CpuMeter:
    """Cores used between two samples: the machine's, the system's clients (its adapter
    processes), its backends, the readers' backends with their parallel workers, autovacuum's
    and the rest of the server's. A backend seen for the first time counts from zero (it was
    born in the window); one gone since the last sample loses its last window's share, and
    short-lived parallel workers count only if a sample catches them."""

    def __init__(self) -> None:
        self.prev: dict[int, float] = {}
        self.prev_busy: float | None = None
        self.prev_t = 0.0

    def sample(self, groups: dict[int, str]) -> dict[str, float] | None:
        now, busy = time.monotonic(), machine_busy()
        cur = {pid: c for pid in groups if (c := proc_cpu(pid)) is not None}
        first = self.prev_busy is None
        out: dict[str, float] = dict.fromkeys(CPU_GROUPS, 0.0)
        dt = now - self.prev_t
        if not first and dt > 0:
            out["busy"] = (busy - (self.prev_busy or 0.0)) / dt
            for pid, c in cur.items():
                out[groups[pid]] += max(0.0, c - self.prev.get(pid, 0.0)) / dt
        self.prev, self.prev_busy, self.prev_t = cur, busy, now
        return None if first else out


# ── adapters and their replicas ─────────────────────────────────────────────────────────────────


@dataclass
class Adapter:
    system: str
    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, system: str, root: Path = PORTABLE) -> "Adapter":
        # tq-before-NNNN: tq's adapter on a database of its own with the migrations before NNNN
        # (the queue as it was), to measure one change beside the queue with it, in one run.
        if before := re.fullmatch(r"tq-before-(\d{4})", system):
            tq = cls.load("tq", root)
            manifest = {
                **tq.manifest,
                "db_name": f"tq_bench_before_{before[1]}",
                # Before 0022 every task stayed in worker_tasks, and v_tasks did not exist.
                "enqueued_sql": "SELECT id FROM worker_tasks" if before[1] <= "0022" else ENQUEUED_SQL["tq"],
                "pending_sql": PENDING_SQL["tq"],
                "env": {"TQ_MIGRATE_BEFORE": before[1]},
            }
            return cls(system, tq.folder, manifest)
        folder = root / f"{system}-bench"
        path = folder / "adapter.json"
        if not path.exists():
            raise SystemExit(f"no adapter for {system}: {path} is missing")
        return cls(system, folder, json.loads(path.read_text()))

    @property
    def db(self) -> str:
        return str(self.manifest.get("db_name") or f"{self.system}_bench")

    @property
    def tables(self) -> list[str]:
        return [str(t) for t in self.manifest.get("event_tables", [])]

    def argv(self) -> list[str]:
        # adapter.json may name its command; else the adapter is main.py run by this Python.
        command = self.manifest.get("command") or self.manifest.get("argv")
        if command:
            return [str(c) for c in (command.split() if isinstance(command, str) else command)]
        return [sys.executable, "main.py"]


@dataclass
class Replica:
    proc: subprocess.Popen[str] | None = None
    intended: str = "unstarted"  # running, killed, stopped
    descriptor: dict[str, Any] | None = None


class SystemRun:
    """One system's adapters (a pool of replicas), its samples and its events."""

    def __init__(self, adapter: Adapter, server: Server, args: argparse.Namespace, run_dir: Path) -> None:
        self.adapter = adapter
        self.system = adapter.system
        self.server = server
        self.url = server.db_url(adapter.db)
        self.args = args
        self.replicas = [Replica() for _ in range(args.replicas)]
        self.lock = threading.Lock()
        self.samples: list[tuple[float, int, str, float]] = []  # (epoch, replica, metric, value)
        self.tables: list[tuple[float, str, float, float, float]] = []  # (epoch, table, dead, live, MB)
        self.backends: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, str, float]] = []  # (epoch, group, cores)
        self.cpu_meter = CpuMeter()
        self.events: list[tuple[float, str]] = []
        self.stderr_dir = STATE / "logs" / run_dir.name
        self.stderr_dir.mkdir(parents=True, exist_ok=True)
        fd, control = tempfile.mkstemp(prefix=f"lh-{self.system}-rate-", dir=STATE)
        os.close(fd)
        self.control_file = Path(control)
        self.total_rate = 0.0
        self.stop_sampling = threading.Event()
        self.sampler: threading.Thread | None = None

    # The offered rate, split between the replicas; adapters re-read the file on every tick.
    def set_rate(self, total: float) -> None:
        self.total_rate = total
        per = total / len(self.replicas)
        self.control_file.write_text(str(round(per)))

    def event(self, what: str) -> None:
        with self.lock:
            self.events.append((time.time(), what))
        log(f"{self.system}: {what}")

    def env(self, instance: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PGPORT", "TQ_DATABASE_URL")}
        env.update(
            DATABASE_URL=self.url,
            SCENARIO="long_horizon",
            PRODUCER_MODE="fixed",
            PRODUCER_RATE=self.control_file.read_text().strip() or "0",
            PRODUCER_RATE_CONTROL_FILE=str(self.control_file),
            WORKER_COUNT=str(self.args.workers),
            JOB_WORK_MS=str(self.args.work_ms),
            SAMPLE_EVERY_S=str(self.args.sample_every),
            BENCH_INSTANCE_ID=str(instance),
            # How many replicas share the load (tq-bench splits its stores between them).
            BENCH_REPLICAS=str(len(self.replicas)),
            TQ_REPLICAS=str(len(self.replicas)),
            PYTHONUNBUFFERED="1",
        )
        env.update({str(k): str(v) for k, v in (self.adapter.manifest.get("env") or {}).items()})
        return env

    def start(self, i: int, wait: float = 0.0) -> None:
        r = self.replicas[i]
        if r.proc is not None and r.proc.poll() is None:
            return
        log_file = open(self.stderr_dir / f"{self.system}-{i}.log", "a")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(
            self.adapter.argv(),
            cwd=self.adapter.folder,
            env=self.env(i),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C reaches the driver only, which stops them in order
        )
        log_file.close()
        r.proc, r.intended, r.descriptor = proc, "running", None
        threading.Thread(target=self._tail, args=(i, proc), daemon=True).start()
        deadline = time.monotonic() + wait
        while wait and r.descriptor is None and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.system} replica {i} exited (rc {proc.returncode}) before its descriptor; "
                    f"see {self.stderr_dir / f'{self.system}-{i}.log'}"
                )
            time.sleep(0.1)
        if wait and r.descriptor is None:
            raise RuntimeError(f"{self.system} replica {i}: no descriptor within {wait:.0f} s")

    def _tail(self, i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "descriptor":
                self.replicas[i].descriptor = rec
                continue
            if rec.get("kind", "adapter") != "adapter" or rec.get("metric") not in ADAPTER_METRICS:
                continue
            try:
                t = datetime.fromisoformat(str(rec["t"]).replace("Z", "+00:00")).timestamp()
            except (KeyError, ValueError):
                t = time.time()
            with self.lock:
                self.samples.append((t, i, rec["metric"], float(rec.get("value") or 0.0)))

    def kill(self, i: int) -> None:
        r = self.replicas[i]
        r.intended = "killed"
        if r.proc is not None and r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()

    def watch(self) -> None:
        """Restart a replica that died without being killed, and say so."""
        for i, r in enumerate(self.replicas):
            if r.intended == "running" and r.proc is not None and r.proc.poll() is not None:
                self.event(f"replica {i} died unexpectedly (rc {r.proc.returncode}): restarted")
                with contextlib.suppress(Exception):
                    self.start(i)

    def stop_all(self, grace: float = 10.0) -> None:
        live = [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for r in self.replicas:
            r.intended = "stopped"
        for r in live:
            assert r.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for r in live:
            assert r.proc is not None
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
        # Whatever the adapters left in their process groups (pools, helpers).
        for r in self.replicas:
            if r.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r.proc.pid, signal.SIGKILL)

    # ── the server side, every sample ──

    def start_sampling(self) -> None:
        self.sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self.sampler.start()

    def _sample_loop(self) -> None:
        every = self.args.sample_every
        conn: psycopg.Connection | None = None
        while not self.stop_sampling.wait(every - time.time() % every):
            now = round(time.time() / every) * every
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url, autocommit=True)
                rows = []
                for table in self.adapter.tables:
                    schema, _, rel = table.rpartition(".")
                    row = conn.execute(
                        "SELECT n_dead_tup, n_live_tup, pg_total_relation_size(relid) / 1048576.0"
                        " FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
                        (schema or "public", rel),
                    ).fetchone()
                    if row:
                        rows.append((now, table, float(row[0]), float(row[1]), float(row[2])))
                activity = conn.execute(
                    "SELECT pid, leader_pid, datname, application_name, backend_type FROM pg_stat_activity"
                    " WHERE pid <> pg_backend_pid()"
                ).fetchall()
                # The system's backends: those on its database that are not this driver's.
                backends = sum(
                    1
                    for _, _, db, app, _ in activity
                    if db == self.adapter.db and not (app or "").startswith(APP)
                )
                cpu = self.cpu_meter.sample(self._cpu_groups(activity))
                with self.lock:
                    self.tables.extend(rows)
                    self.backends.append((now, float(backends)))
                    self.cpu.extend((now, g, v) for g, v in (cpu or {}).items())
            except psycopg.Error:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def _cpu_groups(self, activity: list[tuple[Any, ...]]) -> dict[int, str]:
        """Each process to measure, by group: the adapters' and every backend in ``activity``
        (pg_stat_activity's pid, leader_pid, datname, application_name, backend_type)."""
        own: dict[int, str] = {}
        for pid, _, datname, app, btype in activity:
            if app == READER_APP:
                own[pid] = "readers"
            elif (btype or "").startswith("autovacuum"):
                own[pid] = "autovacuum"
            elif datname == self.adapter.db and not (app or "").startswith(APP):
                own[pid] = "queue"
            else:
                own[pid] = "other"
        groups = {pid: own.get(leader, own[pid]) if leader else own[pid] for pid, leader, *_ in activity}
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                groups[r.proc.pid] = "clients"
        return groups

    # ── the audit ──

    def enqueued_sql(self) -> str | None:
        return self.adapter.manifest.get("enqueued_sql") or ENQUEUED_SQL.get(self.system)

    def audit(self) -> dict[str, Any]:
        """Tasks in the system's table against bench_done: completed, still queued (unfinished),
        gone without completing (lost), completed more than once."""
        enq = self.enqueued_sql()
        pending = self.adapter.manifest.get("pending_sql") or PENDING_SQL.get(self.system)
        out: dict[str, Any] = {}
        with connect(self.url, autocommit=True) as conn:
            done = conn.execute(
                "SELECT count(*), count(DISTINCT task_id),"
                " (SELECT count(*) FROM (SELECT 1 FROM bench_done GROUP BY task_id HAVING count(*) > 1) d)"
                " FROM bench_done"
            ).fetchone()
            assert done is not None
            out.update(done_rows=done[0], completed=done[1], duplicated=done[2])
            if enq:
                # From this file or adapter.json: trusted text.
                q = sql.SQL(
                    "WITH e AS (SELECT DISTINCT id::bigint AS id FROM ({}) s(id)),"
                    " p AS (SELECT DISTINCT id::bigint AS id FROM ({}) s(id)),"
                    " d AS (SELECT DISTINCT task_id AS id FROM bench_done),"
                    " open AS (SELECT e.id, p.id IS NOT NULL AS queued FROM e"
                    "   LEFT JOIN p ON p.id = e.id WHERE NOT EXISTS (SELECT 1 FROM d WHERE d.id = e.id))"
                    " SELECT (SELECT count(*) FROM e),"
                    " (SELECT count(*) FROM open WHERE NOT queued),"
                    " (SELECT count(*) FROM open WHERE queued),"
                    " (SELECT count(*) FROM d WHERE NOT EXISTS (SELECT 1 FROM e WHERE e.id = d.id))"
                ).format(
                    sql.SQL(enq),  # type: ignore[arg-type]
                    sql.SQL(pending or "SELECT NULL::bigint WHERE false"),  # type: ignore[arg-type]
                )
                row = conn.execute(q).fetchone()
                assert row is not None
                out.update(enqueued=row[0], lost=row[1], unfinished=row[2], unknown=row[3])
        return out

    def pending(self) -> int | None:
        """Tasks enqueued and not completed yet (for the final drain); without a way to list the
        enqueued tasks, the depth the adapter reports."""
        if self.enqueued_sql():
            try:
                a = self.audit()
            except psycopg.Error:
                return None
            # Failed tasks (lost) never complete: wait only for the queued ones when known.
            has_pending = bool(self.adapter.manifest.get("pending_sql") or PENDING_SQL.get(self.system))
            return int(a["unfinished"]) + (0 if has_pending else int(a["lost"]))
        with self.lock:
            depth = [v for _, _, m, v in self.samples[-20:] if m == "queue_depth"]
        return int(depth[-1]) if depth else None


# ── stresses: what a phase does besides the steady load ────────────────────────────────────────


class Stress:
    def __init__(self, run: SystemRun, phase: Phase) -> None:
        self.run, self.phase = run, phase
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.conns: list[psycopg.Connection] = []
        self.count = 0

    def thread(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def start(self) -> None:
        t, run, p = self.phase.type, self.run, self.phase
        if t == "idle-in-tx":
            # A writing transaction on the system's own database: its xid holds the horizon that
            # vacuum of that database's tables waits for.
            conn = connect(run.url)
            row = conn.execute("SELECT txid_current()").fetchone()
            self.conns.append(conn)
            run.event(f"idle-in-tx: holding xid {row[0] if row else '?'}")
        elif t == "active-readers":
            n = int(p.params.get("readers", os.environ.get("ACTIVE_READER_COUNT", "4")))
            table = (run.adapter.tables or ["pg_stat_user_tables"])[0]
            for _ in range(n):
                self.thread(self._reader, table)
            run.event(f"active-readers: {n} REPEATABLE READ readers on {table}")
        elif t == "high-load":
            run.set_rate(run.args.rate_value * float(p.params.get("multiplier", run.args.high_load)))
            run.event(f"high-load: offered {run.total_rate:.0f}/s")
        elif t == "repeated-kill":
            period = parse_seconds(p.params.get("period", f"{min(20.0, p.seconds / 3):.1f}s"), 1)
            self.thread(self._kill_loop, int(p.params.get("instance", "0")), period)
        elif t == "pg-backend-kill":
            self.thread(self._backend_kill_loop, float(p.params.get("rate", "2")))
        elif t == "pool-exhaustion":
            self.thread(self._hold_conns, int(p.params.get("idle_conns", "300")))
        elif t == "postgres-restart":
            if not run.server.embedded:
                raise SystemExit("postgres-restart needs --embedded")
            self.thread(self._restart)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=180)
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        if self.phase.type == "high-load":
            self.run.set_rate(self.run.args.rate_value)
        if self.phase.type == "repeated-kill":
            for i, r in enumerate(self.run.replicas):
                if r.intended == "killed":
                    self.run.start(i)
            self.run.event(f"repeated-kill: {self.count} kills")
        elif self.phase.type == "pg-backend-kill":
            self.run.event(f"pg-backend-kill: {self.count} backends terminated")

    def _reader(self, table: str) -> None:
        # As the harness: one REPEATABLE READ transaction per reader, scanning every 100 ms.
        try:
            with connect(self.run.url, application_name=READER_APP) as conn:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                while not self.stop_event.is_set():
                    conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(table))).fetchall()  # type: ignore[arg-type]
                    time.sleep(0.1)
        except psycopg.Error as exc:
            self.run.event(f"active-readers: a reader stopped: {exc}")

    def _kill_loop(self, instance: int, period: float) -> None:
        while not self.stop_event.wait(period):
            self.run.kill(instance)
            self.count += 1
            self.run.event(f"SIGKILL replica {instance}")
            if self.stop_event.wait(1.0):
                return
            self.run.start(instance)

    def _backend_kill_loop(self, rate: float) -> None:
        # From an admin connection, the system's backends by database name, as the harness does.
        q = (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s"
            " AND pid <> pg_backend_pid() AND application_name NOT LIKE %s"
            " AND state IN ('active', 'idle in transaction')"
        )
        while not self.stop_event.is_set():
            try:
                with connect(self.run.server.url, autocommit=True) as conn:
                    while not self.stop_event.wait(1.0 / rate):
                        self.count += len(conn.execute(q, (self.run.adapter.db, APP + "%")).fetchall())
            except psycopg.Error:
                self.stop_event.wait(1.0)

    def _hold_conns(self, n: int) -> None:
        if not self.run.server.embedded:
            # A shared server: leave the others 20 connections.
            with connect(self.run.server.url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT current_setting('max_connections')::int - count(*) FROM pg_stat_activity"
                ).fetchone()
            n = min(n, max(0, int(row[0] if row else 0) - 20))
        for _ in range(n):
            if self.stop_event.is_set():
                break
            try:
                self.conns.append(connect(self.run.url, autocommit=True))
            except psycopg.Error as exc:
                self.run.event(f"pool-exhaustion: stopped at {len(self.conns)} connections: {exc}")
                break
        self.run.event(f"pool-exhaustion: {len(self.conns)} idle connections held")
        self.stop_event.wait()

    def _restart(self) -> None:
        # Down for the first half of the phase, up for the second, as the harness.
        self.run.event("postgres-restart: stopping the server")
        self.run.server.stop()
        self.stop_event.wait(self.phase.seconds / 2)
        self.run.server.start()
        self.run.event("postgres-restart: server started again")


# ── running a system ────────────────────────────────────────────────────────────────────────────


def run_system(
    adapter: Adapter, server: Server, phases: list[Phase], args: argparse.Namespace, run_dir: Path
) -> SystemRun:
    run = SystemRun(adapter, server, args, run_dir)
    RUNS.append(run)
    server.recreate(adapter.db, [str(e) for e in adapter.manifest.get("extensions", [])])
    run.set_rate(args.rate_value)
    log(
        f"{run.system}: {len(run.replicas)} replica(s), offered {args.rate_value:g}/s, "
        f"WORKER_COUNT={args.workers} each, JOB_WORK_MS={args.work_ms}"
    )
    for i in range(len(run.replicas)):
        run.start(i, wait=90)
    run.start_sampling()
    # Phases start on the sample grid and last whole samples, so that every sample's window falls
    # in one phase.
    every = args.sample_every
    at = (time.time() // every + 1) * every
    for phase in phases:
        while time.time() < at:
            time.sleep(min(0.5, max(0.0, at - time.time())))
            run.watch()
        phase.start = at
        log(f"{run.system}: phase {phase.label} ({phase.type}, {phase.seconds:.0f} s)")
        stress = Stress(run, phase)
        end = phase.start + phase.seconds
        try:
            stress.start()
            while time.time() < end:
                time.sleep(min(0.5, max(0.0, end - time.time())))
                if phase.type != "postgres-restart":
                    run.watch()
        finally:
            phase.end = min(time.time(), end)  # earlier when interrupted
            stress.stop()
        at = phase.end
    drain(run, args)
    run.stop_all(grace=float(adapter.manifest.get("shutdown_grace_s", 10)))
    run.stop_sampling.set()
    if run.sampler:
        run.sampler.join(timeout=args.sample_every + 10)
    try:
        run.audit_result = run.audit()  # type: ignore[attr-defined]
    except psycopg.Error as exc:
        run.audit_result = {"error": str(exc).strip()}  # type: ignore[attr-defined]
    log(f"{run.system}: audit {run.audit_result}")  # type: ignore[attr-defined]
    return run


def drain(run: SystemRun, args: argparse.Namespace) -> None:
    """Stop producing, then wait until every enqueued task completed (or the timeout)."""
    run.set_rate(0)
    started = time.time()
    run.drain_start = started  # type: ignore[attr-defined]
    pending = None
    while time.time() - started < args.drain_timeout:
        time.sleep(2)
        run.watch()
        pending = run.pending()
        if pending == 0 and time.time() - started > args.sample_every:
            break
    run.drain_seconds = time.time() - started  # type: ignore[attr-defined]
    log(f"{run.system}: drain {run.drain_seconds:.0f} s, pending {pending}")  # type: ignore[attr-defined]


RUNS: list[SystemRun] = []


def find_capacity(adapter: Adapter, server: Server, args: argparse.Namespace, run_dir: Path) -> float:
    """Offered rates doubling from --ramp-start, each --ramp-seconds: the highest rate that completes
    at >= 95 % of offered with a queue depth that does not grow."""
    probe = argparse.Namespace(**{**vars(args), "replicas": 1})
    run = SystemRun(adapter, server, probe, run_dir)
    RUNS.append(run)
    server.recreate(adapter.db, [str(e) for e in adapter.manifest.get("extensions", [])])

    def clean_at(rate: float) -> bool:
        run.set_rate(rate)
        began = time.time()
        time.sleep(args.ramp_seconds)
        with run.lock:
            got = [s for s in run.samples if s[0] > began + args.sample_every]
        comp = [v for _, _, m, v in got if m == "completion_rate"]
        depth = [v for _, _, m, v in got if m == "queue_depth"]
        ok = bool(comp) and statistics.mean(comp) >= 0.95 * rate
        growing = len(depth) >= 2 and depth[-1] > max(50.0, 2 * depth[0], 0.5 * rate)
        log(
            f"ramp: offered {rate:g}/s, completed {statistics.mean(comp) if comp else 0:.0f}/s, "
            f"depth {depth[-1] if depth else '?'} -> {'clean' if ok and not growing else 'saturated'}"
        )
        return ok and not growing

    def settle() -> None:
        # Let the backlog of a saturated step drain, so it does not count against the next one.
        run.set_rate(0)
        deadline = time.time() + 60
        while time.time() < deadline:
            time.sleep(args.sample_every)
            with run.lock:
                depth = [v for _, _, m, v in run.samples[-12:] if m == "queue_depth"]
            if depth and depth[-1] <= 5:
                break

    rate, best = float(args.ramp_start), 0.0
    run.set_rate(rate)
    run.start(0, wait=90)
    try:
        while rate <= args.ramp_max and clean_at(rate):
            best = rate
            rate *= 2
        if best:
            settle()
            if clean_at(best * 1.5):
                best *= 1.5
    finally:
        run.stop_all()
        run.control_file.unlink(missing_ok=True)
    RUNS.remove(run)
    return best


# ── summaries ───────────────────────────────────────────────────────────────────────────────────


@dataclass
class Tick:
    t: float
    phase: str = ""
    ptype: str = ""
    m: dict[str, float] = field(default_factory=dict)


def ticks_of(run: SystemRun, phases: list[Phase], every: float) -> list[Tick]:
    """One row per sample: rates summed over the replicas, percentiles and depth their max, with
    the tables' stats and the phase the sample's window falls in."""
    by: dict[float, dict[str, dict[int, float]]] = {}
    with run.lock:
        samples = list(run.samples)
        tables = list(run.tables)
        backends = list(run.backends)
        cpu = list(run.cpu)
    for t, i, metric, v in samples:
        key = round(t / every) * every
        by.setdefault(key, {}).setdefault(metric, {})[i] = v
    for t, _, dead, live, mb in tables:
        d = by.setdefault(t, {})
        for name, v in (("dead_tup", dead), ("live_tup", live), ("size_mb", mb)):
            d.setdefault(name, {})
            d[name][len(d[name])] = v
    for t, n in backends:
        by.setdefault(t, {})["backends"] = {0: n}
    for t, group, cores in cpu:
        by.setdefault(t, {})[f"cpu_{group}"] = {0: cores}
    out = []
    for t in sorted(by):
        tick = Tick(t)
        for metric, per in by[t].items():
            vals = list(per.values())
            if (
                metric.endswith("_rate")
                or metric in ("dead_tup", "live_tup", "size_mb", "backends")
                or metric.startswith("cpu_")
            ):
                tick.m[metric] = sum(vals)
            else:
                tick.m[metric] = max(vals)
        if "completion_rate" in by[t]:
            tick.m["replicas_reporting"] = len(by[t]["completion_rate"])
        mid = t - every / 2
        for p in phases:
            if p.start <= mid < p.end:
                tick.phase, tick.ptype = p.label, p.type
                break
        else:
            tick.phase = "drain" if phases and t > phases[-1].end else ""
        out.append(tick)
    return out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def phase_stats(ticks: list[Tick], phase: Phase, offered: float) -> dict[str, Any]:
    rows = [k for k in ticks if k.phase == phase.label]
    comp = [k.m["completion_rate"] for k in rows if "completion_rate" in k.m]
    enq = [k.m["enqueue_rate"] for k in rows if "enqueue_rate" in k.m]
    last_db = [k for k in ticks if "dead_tup" in k.m and k.t <= phase.end + 0.5]
    end = last_db[-1].m if last_db else {}
    depth = [k.m["queue_depth"] for k in rows if "queue_depth" in k.m]
    missed = [
        sum(k.m.get(f"enqueue_{w}_rate", 0.0) for w in ("failed", "dropped", "deduplicated")) for k in rows
    ]
    return {
        "missed": statistics.mean(missed) if missed else None,
        "offered": offered,
        "completion": statistics.mean(comp) if comp else None,
        "enqueue": statistics.mean(enq) if enq else None,
        "p50": median([k.m["claim_p50_ms"] for k in rows if "claim_p50_ms" in k.m]),
        "p95": median([k.m["claim_p95_ms"] for k in rows if "claim_p95_ms" in k.m]),
        "p99": median([k.m["claim_p99_ms"] for k in rows if "claim_p99_ms" in k.m]),
        "depth_median": median(depth),
        "depth_max": max(depth) if depth else None,
        "dead_end": end.get("dead_tup"),
        "live_end": end.get("live_tup"),
        "size_end": end.get("size_mb"),
        "dead_max": max((k.m["dead_tup"] for k in rows if "dead_tup" in k.m), default=None),
        "samples": len(rows),
        "cpu": {
            g: statistics.mean(v)
            for g in CPU_GROUPS
            if (v := [k.m[c] for k in rows if (c := f"cpu_{g}") in k.m])
        },
    }


def back_to_clean(
    ticks: list[Tick], stress: str, recovery: str, offered: float, depth_limit: float
) -> float | None:
    """As the harness's chaos_recovery_time_s: from the stress phase's last sample to the first
    sample of the recovery phase at >= 90 % of offered, here also with the queue depth back under
    the clean phase's level; None if that never happened within the recovery phase."""
    last = [k.t for k in ticks if k.phase == stress]
    if not last:
        return None
    for k in ticks:
        if k.phase != recovery:
            continue
        if k.m.get("completion_rate", 0) >= 0.9 * offered and k.m.get("queue_depth", math.inf) <= depth_limit:
            return k.t - last[-1]
    return None


def fmt(v: Any, digits: int | None = None) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if digits is None:
        digits = 0 if isinstance(v, int) or abs(v) >= 10 else 1
    return f"{v:,.{digits}f}"


def summarise(
    runs: list[SystemRun], phases_by: dict[str, list[Phase]], args: argparse.Namespace, header: list[str]
) -> tuple[str, dict[str, list[Tick]]]:
    lines = list(header)
    all_ticks: dict[str, list[Tick]] = {}
    stats: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        phases = phases_by[run.system]
        ticks = ticks_of(run, phases, args.sample_every)
        all_ticks[run.system] = ticks
        stats[run.system] = {}
        for p in phases:
            if p.start == 0:
                continue
            offered = args.rate_value * (args.high_load if p.type == "high-load" else 1)
            stats[run.system][p.label] = phase_stats(ticks, p, offered)

    labels = [p for p in next(iter(phases_by.values()), []) if p.type != "warmup"]
    lines += [
        "",
        "### Per phase",
        "",
        "Means over the phase's samples; pickup (insert to worker start, the adapter's 30 s window) is "
        "the median of the samples' percentiles; dead/live tuples and size are the sum over the "
        "system's declared event tables at the phase's end (max dead during the phase in brackets).",
        "",
        "| phase | system | offered/s | enqueued/s | not inserted/s | completed/s | x offered "
        "| pickup p50 ms | p95 ms | p99 ms | depth median (max) | dead tuples end (max) "
        "| live tuples end | size MB end |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in labels:
        for run in runs:
            s = stats[run.system].get(p.label)
            if not s:
                continue
            ratio = s["completion"] / s["offered"] if s["completion"] is not None and s["offered"] else None
            lines.append(
                f"| {p.label} ({p.type}) | {run.system} | {fmt(s['offered'])} | {fmt(s['enqueue'])} "
                f"| {fmt(s['missed'])} "
                f"| {fmt(s['completion'])} "
                f"| {fmt(ratio, 2)} | {fmt(s['p50'], 1)} | {fmt(s['p95'], 1)} | {fmt(s['p99'], 1)} "
                f"| {fmt(s['depth_median'])} ({fmt(s['depth_max'])}) "
                f"| {fmt(s['dead_end'])} ({fmt(s['dead_max'])}) | {fmt(s['live_end'])} "
                f"| {fmt(s['size_end'], 2)} |"
            )

    lines += [
        "",
        "### Where the CPU went",
        "",
        f"Cores used, means over the phase's samples, on a machine of {os.cpu_count()}: all of it "
        "(busy), the system's adapter processes (clients: producer and workers), its backends "
        "(queue), the readers' backends and their parallel workers, autovacuum, and the server's "
        "other backends (other); busy less the parts is what no part holds: the bench itself, "
        "other processes, and short-lived ones (parallel workers) no sample caught. Measured from "
        "/proc, so only for a server on this machine.",
        "",
        "| phase | system | " + " | ".join(CPU_GROUPS) + " |",
        "|---|---|" + "---:|" * len(CPU_GROUPS),
    ]
    for p in labels:
        for run in runs:
            s = stats[run.system].get(p.label)
            if s and s["cpu"]:
                lines.append(
                    f"| {p.label} ({p.type}) | {run.system} | "
                    + " | ".join(fmt(s["cpu"].get(g), 2) for g in CPU_GROUPS)
                    + " |"
                )

    # Recovery: after each stress phase that a recovery (or clean) phase follows.
    lines += [
        "",
        "### Recovery",
        "",
        "As the harness's chaos_recovery_time_s: from the stress's last sample to the first sample of "
        "the recovery with completions >= 90 % of offered, and here also the queue depth at most the "
        "clean phase's level "
        "(max(1.5 x its max depth, its max + 10)). ✗ = not within the recovery phase.",
        "",
        "| stress | then | system | back to clean s |",
        "|---|---|---|---:|",
    ]
    recov: dict[str, dict[str, float | None]] = {r.system: {} for r in runs}
    for run in runs:
        phases = [p for p in phases_by[run.system] if p.start]
        clean = next((p for p in phases if p.type == "clean"), None)
        clean_depth = (stats[run.system][clean.label]["depth_max"] or 0.0) if clean else 0.0
        limit = max(1.5 * clean_depth, clean_depth + 10)
        for j, p in enumerate(phases[1:], 1):
            prev = phases[j - 1]
            if p.type not in ("recovery", "clean") or prev.type not in STRESS:
                continue
            t = back_to_clean(all_ticks[run.system], prev.label, p.label, args.rate_value, limit)
            stressed = [
                q.label for q in phases[:j] if q.type in STRESS and q.start >= _stress_run_start(phases, j)
            ]
            recov[run.system][p.label] = t
            lines.append(
                f"| {' + '.join(stressed)} | {p.label} | {run.system} "
                f"| {fmt(t, 0) if t is not None else '✗'} |"
            )

    lines += [
        "",
        "### Audit",
        "",
        "After the phases the producers stop (rate 0) and the queue drains "
        f"(at most {args.drain_timeout:.0f} s). "
        "Enqueued: task ids in the system's own table; completed: distinct task ids in bench_done; "
        "still queued: not completed and still pending, claimed or running when the drain ended; lost: "
        "enqueued, not completed and no longer queued (failed and not retried: procrastinate "
        "`failed`, pgqueuer `exception`); twice: ids in bench_done more than once (the handler's "
        "effect committed twice). "
        "Not inserted/s (per phase above): offered jobs the adapter could not insert (server down, "
        "backlog over 10 s of load) or that tq deduplicated (a store with a task still pending).",
        "",
        "| system | enqueued | completed | still queued | lost | completed twice | bench_done rows "
        "| drain s | events |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        a = getattr(run, "audit_result", {}) or {}
        unexpected = sum(1 for _, e in run.events if "unexpectedly" in e)
        kills = sum(1 for _, e in run.events if e.startswith("SIGKILL"))
        events = f"{kills} SIGKILLs, {unexpected} unexpected exits" if kills or unexpected else "-"
        if "error" in a:
            events += f"; audit failed: {a['error'][:80]}"
        lines.append(
            f"| {run.system} | {fmt(a.get('enqueued'))} | {fmt(a.get('completed'))} "
            f"| {fmt(a.get('unfinished'))} | {fmt(a.get('lost'))} "
            f"| {fmt(a.get('duplicated'))} | {fmt(a.get('done_rows'))} "
            f"| {fmt(getattr(run, 'drain_seconds', None))} | {events} |"
        )

    lines += ["", "### Verdict", ""]
    lines.append(
        "Goals: in idle-in-tx and active-readers, completions >= 0.95 of offered and pickup p95 <= 2x "
        "clean's; back to clean within 60 s of the recovery that follows; and nothing lost."
    )
    lines.append("")
    for run in runs:
        verdict = []
        st = stats[run.system]
        phases = [p for p in phases_by[run.system] if p.start]
        clean = next((p for p in phases if p.type == "clean"), None)
        clean_p95 = st[clean.label]["p95"] if clean else None
        for p in phases:
            if p.type not in ("idle-in-tx", "active-readers"):
                continue
            s = st[p.label]
            ratio = s["completion"] / s["offered"] if s["completion"] is not None else 0.0
            p95x = s["p95"] / clean_p95 if s["p95"] is not None and clean_p95 else None
            ok = ratio >= 0.95 and p95x is not None and p95x <= 2
            verdict.append(
                f"{p.label} {'pass' if ok else 'FAIL'} ({ratio:.2f} of offered, p95 "
                f"{fmt(p95x, 1) if p95x is not None else '?'}x clean)"
            )
            nxt = next((q for q in phases if q.start > p.start and q.type in ("recovery", "clean")), None)
            if nxt is not None and nxt.label in recov[run.system]:
                t = recov[run.system][nxt.label]
                back = f"in {fmt(t, 0)} s" if t is not None else "not within it"
                verdict.append(
                    f"{nxt.label}: back to clean {back} {'pass' if t is not None and t <= 60 else 'FAIL'}"
                )
        for p in phases:
            if p.type in FAULTS:
                nxt = next((q for q in phases if q.start > p.start and q.type in ("recovery", "clean")), None)
                t = recov[run.system].get(nxt.label) if nxt else None
                verdict.append(f"{p.type}: {'back in ' + fmt(t, 0) + ' s' if t is not None else 'not back'}")
        a = getattr(run, "audit_result", {}) or {}
        if "lost" in a:
            verdict.append(f"lost {a['lost']}, twice {a['duplicated']}")
        lines.append(f"- **{run.system}**: " + "; ".join(dict.fromkeys(verdict)))
    return "\n".join(lines) + "\n", all_ticks


def _stress_run_start(phases: list[Phase], j: int) -> float:
    """Start of the run of stress phases that ends just before phases[j]."""
    k = j - 1
    while k > 0 and phases[k - 1].type in STRESS:
        k -= 1
    return phases[k].start


def write_raw(run_dir: Path, runs: list[SystemRun], all_ticks: dict[str, list[Tick]]) -> None:
    cols = [
        *ADAPTER_METRICS,
        "replicas_reporting",
        "dead_tup",
        "live_tup",
        "size_mb",
        "backends",
        *(f"cpu_{g}" for g in CPU_GROUPS),
    ]
    with gzip.open(run_dir / "raw.csv.gz", "wt", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["system", "t", "t_rel_s", "phase", "phase_type", *cols])
        for run in runs:
            ticks = all_ticks.get(run.system, [])
            t0 = ticks[0].t if ticks else 0
            for k in ticks:
                w.writerow(
                    [run.system, f"{k.t:.0f}", f"{k.t - t0:.0f}", k.phase, k.ptype]
                    + [f"{k.m[c]:.4g}" if c in k.m else "" for c in cols]
                )
    with gzip.open(run_dir / "tables.csv.gz", "wt", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["system", "t", "table", "n_dead_tup", "n_live_tup", "total_mb"])
        for run in runs:
            for t, table, dead, live, mb in run.tables:
                w.writerow([run.system, f"{t:.0f}", table, int(dead), int(live), f"{mb:.3f}"])
    with open(run_dir / "events.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["system", "time", "event"])
        for run in runs:
            for t, e in run.events:
                w.writerow([run.system, datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds"), e])


def plot(
    run_dir: Path, runs: list[SystemRun], phases_by: dict[str, list[Phase]], all_ticks: dict[str, list[Tick]]
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing: no plot (.venv/bin/pip install -c constraints.txt matplotlib)")
        return
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    panels = [
        ("completion_rate", "completed / s", False),
        ("claim_p95_ms", "pickup p95 ms (log)", True),
        ("dead_tup", "dead tuples, event tables", False),
    ]
    ref = next((phases_by[r.system] for r in runs if phases_by[r.system][0].start), [])
    t_ref = ref[0].start if ref else 0
    for ax, (metric, title, logy) in zip(axes, panels, strict=True):
        for p in ref:
            ax.axvspan(p.start - t_ref, p.end - t_ref, color=TINTS.get(p.type, "#EEE"), alpha=0.35, lw=0)
        for run in runs:
            phases = phases_by[run.system]
            if not phases[0].start:
                continue
            t0 = phases[0].start
            t1 = max(p.end for p in phases) + getattr(run, "drain_seconds", 0.0) + run.args.sample_every
            pts = [
                (k.t - t0, k.m[metric])
                for k in all_ticks[run.system]
                if metric in k.m and t0 <= k.t <= t1 and not (logy and k.m[metric] <= 0)  # no pickups
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                if logy:
                    ys = tuple(max(y, 0.1) for y in ys)
                ax.plot(xs, ys, label=run.system, lw=1.3)
        if metric == "completion_rate" and runs:
            offered = [(p.start - t_ref, p.end - t_ref, p.type) for p in ref]
            for a, b, typ in offered:
                rate = runs[0].args.rate_value * (runs[0].args.high_load if typ == "high-load" else 1)
                ax.hlines(rate, a, b, colors="k", linestyles=":", lw=0.8)
        if logy:
            ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    for p in ref:
        axes[0].text(
            (p.start + p.end) / 2 - t_ref,
            1.01,
            p.label,
            transform=axes[0].get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=20,
        )
    if ref and ref[-1].end:
        for ax in axes:
            ax.axvline(ref[-1].end - t_ref, color="k", lw=0.6, ls="--")
        axes[0].text(ref[-1].end - t_ref, 1.01, " drain", transform=axes[0].get_xaxis_transform(), fontsize=7)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the system's warmup started (dotted: offered)")
    fig.tight_layout()
    fig.savefig(run_dir / "timeline.png", dpi=90)
    plt.close(fig)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


# ── main ────────────────────────────────────────────────────────────────────────────────────────


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default="tq,procrastinate,pgqueuer")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="default pressure, unless --phase")
    parser.add_argument("--phase", action="append", default=[], help="LABEL=TYPE[(k=v,...)]:DURATION")
    parser.add_argument("--phase-seconds", type=float, default=600, help="a scenario phase's length")
    parser.add_argument("--rate", default="half-capacity", help="offered jobs/s, or half-capacity")
    parser.add_argument("--high-load", type=float, default=1.5, help="high-load's multiple of --rate")
    parser.add_argument("--workers", type=int, default=8, help="WORKER_COUNT of each replica")
    parser.add_argument("--work-ms", type=int, default=1, help="JOB_WORK_MS")
    parser.add_argument("--replicas", type=int, help="per system; default 2 with repeated-kill, else 1")
    parser.add_argument("--sample-every", type=int, default=5, help="SAMPLE_EVERY_S")
    parser.add_argument("--drain-timeout", type=float, help="default max(60, --phase-seconds / 2)")
    parser.add_argument("--ramp-start", type=float, default=25)
    parser.add_argument("--ramp-seconds", type=float, default=20)
    parser.add_argument("--ramp-max", type=float, default=20000)
    parser.add_argument(
        "--url",
        default=os.environ.get("TQ_BENCH_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a server where the bench may create databases",
    )
    parser.add_argument("--embedded", action="store_true", help="run on an embedded PostgreSQL of its own")
    parser.add_argument("--embedded-dir", type=Path, default=STATE / "pgdata")
    parser.add_argument("--adapters", type=Path, default=PORTABLE, help="the folder of the <system>-bench/")
    parser.add_argument("--run-id", help="default <UTC time>-<scenario>")
    parser.add_argument("--out", type=Path, default=OUT_ROOT)
    args = parser.parse_args()

    scenario = args.scenario or ("custom" if args.phase else "pressure")
    specs = SCENARIOS.get(scenario, []) + args.phase
    template = [parse_phase(s, args.phase_seconds) for s in specs]
    if template[0].type != "warmup":
        template.insert(0, Phase("warmup", "warmup", args.phase_seconds / 2))
    for p in template:  # whole samples
        p.seconds = max(1, round(p.seconds / args.sample_every)) * args.sample_every
    if args.replicas is None:
        args.replicas = 2 if any(p.type == "repeated-kill" for p in template) else 1
    if args.drain_timeout is None:
        args.drain_timeout = max(60.0, args.phase_seconds / 2)
    embedded = args.embedded or any(p.type in FAULTS for p in template)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    adapters = [Adapter.load(s, args.adapters) for s in systems]
    run_id = args.run_id or f"{datetime.now(UTC):%Y%m%dT%H%M}-{scenario}"
    run_dir = args.out / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    STATE.mkdir(parents=True, exist_ok=True)

    # Ctrl-C and SIGTERM end the run where it is; what was collected is still written.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background, which ignores it
    server: Server | None = None
    runs: list[SystemRun] = []
    phases_by: dict[str, list[Phase]] = {}
    interrupted = False
    started = time.time()
    try:
        if embedded:
            args.embedded_dir.parent.mkdir(parents=True, exist_ok=True)
            server = Server(None, args.embedded_dir)
        else:
            server = Server(args.url, None)
        if args.rate == "half-capacity":
            tq = next((a for a in adapters if a.system == "tq"), None) or Adapter.load("tq", args.adapters)
            capacity = find_capacity(tq, server, args, run_dir)
            args.rate_value = max(1.0, capacity / 2)
            log(f"tq's clean capacity {capacity:g}/s: offering half of it, {args.rate_value:g}/s")
            print(f"rate: half of tq's clean capacity ({capacity:g}/s) = {args.rate_value:g}/s", flush=True)
        else:
            args.rate_value = float(args.rate)
        total = sum(p.seconds for p in template) * len(adapters)
        log(
            f"run {run_id}: {len(template)} phases, about {total / 60:.0f} min of phases "
            f"for {len(adapters)} system(s)"
        )
        for adapter in adapters:
            phases = [Phase(p.label, p.type, p.seconds, dict(p.params)) for p in template]
            phases_by[adapter.system] = phases
            run = run_system(adapter, server, phases, args, run_dir)
            runs.append(run)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: stopping the adapters, writing what was collected")
    finally:
        for run in RUNS:
            run.stop_all(grace=5)
            run.stop_sampling.set()
            with contextlib.suppress(OSError):
                run.control_file.unlink()
            if run not in runs and run.system in phases_by:
                runs.append(run)  # the one interrupted
        if server is not None and server.embedded:
            with contextlib.suppress(Exception):
                server.start()  # interrupted in the middle of a restart: bring it up for the audit
    version = "?"
    with contextlib.suppress(Exception):
        version = server.version() if server is not None else "?"
    header = [
        f"## Run {run_id}{' (interrupted)' if interrupted else ''}",
        "",
        "```sh",
        "python bench/long_horizon.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        f"PostgreSQL {version} ({'embedded, harness settings' if embedded else 'the --url server'}); "
        f"offered {getattr(args, 'rate_value', 0):g} jobs/s; WORKER_COUNT {args.workers} x {args.replicas} "
        f"replica(s); JOB_WORK_MS {args.work_ms}; samples every {args.sample_every} s; "
        f"{datetime.now(UTC):%Y-%m-%d}, {(time.time() - started) / 60:.0f} min wall. Phases: "
        + ", ".join(f"{p.label} ({p.type}, {p.seconds:.0f} s)" for p in template)
        + ".",
    ]
    try:
        if interrupted:
            for run in runs:
                with contextlib.suppress(Exception):
                    run.audit_result = run.audit()  # type: ignore[attr-defined]
        text, all_ticks = summarise(runs, phases_by, args, header)
        (run_dir / "summary.md").write_text(text)
        write_raw(run_dir, runs, all_ticks)
        plot(run_dir, runs, phases_by, all_ticks)
        print(text)
        log(f"written to {run_dir}")
    finally:
        if server is not None and server.embedded:
            server.stop()


if __name__ == "__main__":
    main()
