"""Latency of the read views and of one claim: tq_pipelines (0003) against the original 074.

    python bench/latency.py [--url URL] [--finished 1000000] [--runs 50] [--claims 2000] [--future 50000]
                            [--rounds 1] [--skip-074]

Two fresh databases on the server, loaded with the same rows:

* ``tq_bench_latency``: ``migrate(url)``, the tq_pipelines schema. The original views and claim
  function are created here too, as ``v_worker_capacity_074``, ``v_task_history_074`` and
  ``claim_task_074``: the 074 SQL over the 0003 indexes and triggers.
* ``tq_bench_latency_074``: migrations 0001 and 0002 only (074's tables and indexes as released)
  plus 074's views and ``claim_task`` (named ``_074`` as above) and its timestamp trigger: the
  original.

Part 1: 1,000,000 finished tasks (completed/failed over the past 30 days, five roles, 2,000
stores) plus 2,000 pending due and 500 running; median and p95 of ``SELECT * FROM
v_worker_capacity`` and ``SELECT * FROM v_task_history LIMIT 50`` on a warm connection, and a
summary of their EXPLAIN (ANALYZE, BUFFERS).

Part 2: one claim + one completion of a product_resync task, --claims times, each on a fresh due
task; first as loaded, then with --future pending tasks scheduled for tomorrow that come before the
due ones in 074's claim order (created a day earlier, same priority, each on its own store).
tq_pipelines claims with ``claim_tasks`` of 1 and completes with ``complete_task`` under the
claim's lease token (0013); ``claim_task_074`` hands out no token, so its tasks, on either
schema, are completed as 074's callers did, by an UPDATE fenced by the worker id.

--rounds N alternates the two phases N times (the claims split evenly; the future tasks deleted
and the tables vacuumed between rounds), so that a spell of load on a shared machine is less
likely to fall on one phase only: a ratio of two phases measured once each cannot tell it from a
cost. Each round's medians go to the log.

--skip-074 leaves out the original database (its load is half the bench's time at 10 M rows);
the 074 SQL on the 0003 schema still runs in ``tq_bench_latency``.
"""

import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_throughput import recreate_db, server_parser
from tq_pipelines.db.migrate import load_migrations, migrate
from tq_pipelines.db.schema import split_statements
from tq_pipelines.queue.api import ROLES

ROLE = "product_resync"
WORKER = "bench-latency"
DB_V2 = "tq_bench_latency"
DB_074 = "tq_bench_latency_074"
STORES = 2000
STORELESS = ("store_discovery", "analytics_refresh")

# --- 074, read from the original migration; only the object names change --------------------

SEED_074 = (
    Path(__file__).resolve().parents[1] / "tests" / "migration" / "fixtures" / "074_worker_task_queue.sql"
)
RENAMED_074 = {
    "v_worker_capacity": "v_worker_capacity_074",
    "v_task_history": "v_task_history_074",
    "claim_task": "claim_task_074",
}


def original_074(*, with_trigger: bool) -> str:
    """074's views and claim_task under the _074 names, and (for a database built from 0001 and
    0002 only, which lack it) its updated_at trigger, as released."""
    wanted = []
    for statement in split_statements(SEED_074.read_text()):
        head = " ".join(statement.split()[:6])
        if any(f" {name}" in head for name in RENAMED_074) and head.startswith("CREATE"):
            renamed = statement
            for old, new in RENAMED_074.items():
                renamed = re.sub(rf"\b{old}\b", new, renamed)
            wanted.append(renamed)
        elif with_trigger and "update_worker_tasks_timestamp" in statement and not head.startswith("COMMENT"):
            wanted.append(statement)
    return "\n".join(wanted)


# 074 had no completion function: its callers updated the row. This mirrors complete_task.
COMPLETE_074 = """
WITH done AS (
  UPDATE worker_tasks
  SET status = 'completed', started_at = coalesce(started_at, claimed_at), completed_at = NOW()
  WHERE id = %(task_id)s
    AND worker_id = %(worker_id)s
    AND status IN ('claimed', 'running')
  RETURNING worker_id
)
UPDATE worker_registry r
SET tasks_completed = r.tasks_completed + 1, last_heartbeat_at = NOW()
FROM done
WHERE r.worker_id = done.worker_id
"""

# --- The data: deterministic, so that both databases get the same rows --------------------------

ROLES_ARRAY = "ARRAY['" + "','".join(ROLES) + "']::VARCHAR[]"
STORELESS_ARRAY = "ARRAY['" + "','".join(STORELESS) + "']::VARCHAR[]"

LOAD_STORES = """
INSERT INTO dispensaries (id, name, menu_type, platform_dispensary_id)
SELECT g, 'store ' || g, 'dutchie', 'pid-' || g
FROM generate_series(%(first)s::INT, %(last)s::INT) g
"""

# Finished work, one row per task, spread evenly over the past 30 days (oldest first), 5% failed.
LOAD_FINISHED = f"""
INSERT INTO worker_tasks (
  role, dispensary_id, platform, status, priority, worker_id, claimed_at, started_at, completed_at,
  last_heartbeat_at, result, error_message, retry_count, created_at, updated_at
)
SELECT
  x.role,
  CASE WHEN x.role = ANY ({STORELESS_ARRAY}) THEN NULL ELSE 1 + x.g %% {STORES} END,
  'dutchie',
  CASE WHEN x.g %% 20 = 0 THEN 'failed' ELSE 'completed' END,
  0,
  'worker-' || x.g %% 40,
  x.done - make_interval(secs => 7 + x.g %% 240),
  x.done - make_interval(secs => 5 + x.g %% 240),
  x.done,
  x.done - make_interval(secs => x.g %% 30),
  CASE WHEN x.g %% 20 = 0 THEN NULL ELSE jsonb_build_object('products', x.g %% 500, 'pages', x.g %% 7) END,
  CASE WHEN x.g %% 20 = 0 THEN 'upstream returned 503 after 3 attempts' END,
  CASE WHEN x.g %% 20 = 0 THEN 3 ELSE 0 END,
  x.done - make_interval(secs => 60 + x.g %% 3600),
  x.done
FROM (
  SELECT
    g,
    ({ROLES_ARRAY})[1 + g %% 5] AS role,
    now() - make_interval(secs => (%(n)s::INT - g) * (30 * 86400.0 / %(n)s::INT)) AS done
  FROM generate_series(1, %(n)s::INT) g
) x
"""

# Unfinished work: pending due (created over the last hour, a third unscheduled) and running tasks
# (on distinct stores, as the unique active-store index demands).
LOAD_UNFINISHED = f"""
INSERT INTO worker_tasks (
  role, dispensary_id, platform, status, priority, scheduled_for, created_at, updated_at
)
SELECT
  x.role,
  CASE WHEN x.role = ANY ({STORELESS_ARRAY}) THEN NULL ELSE 1 + (x.g * 7) %% {STORES} END,
  'dutchie', 'pending', 0,
  CASE WHEN x.g %% 3 = 0 THEN NULL ELSE x.created END,
  x.created, x.created
FROM (
  SELECT g, ({ROLES_ARRAY})[1 + g %% 5] AS role,
         now() - INTERVAL '1 hour' + make_interval(secs => g * 3600.0 / %(pending)s::INT) AS created
  FROM generate_series(1, %(pending)s::INT) g
) x
"""

LOAD_RUNNING = f"""
INSERT INTO worker_tasks (
  role, dispensary_id, platform, status, priority, worker_id, claimed_at, started_at,
  last_heartbeat_at, created_at, updated_at
)
SELECT
  x.role,
  CASE WHEN x.role = ANY ({STORELESS_ARRAY}) THEN NULL ELSE x.g END,
  'dutchie', 'running', 0, 'worker-' || x.g %% 40,
  now() - make_interval(secs => x.g), now() - make_interval(secs => x.g),
  now() - make_interval(secs => x.g %% 60),
  now() - make_interval(secs => x.g + 60), now() - make_interval(secs => x.g %% 60)
FROM (SELECT g, ({ROLES_ARRAY})[1 + g %% 5] AS role FROM generate_series(1, %(running)s::INT) g) x
"""

# The tasks the claim loops consume: due product_resync work, several per store, created between two
# hours and one hour ago (before the pending tasks above), stores interleaved.
LOAD_CLAIMABLE = """
INSERT INTO worker_tasks (
  role, dispensary_id, platform, status, priority, scheduled_for, created_at, updated_at
)
SELECT
  'product_resync', 1 + g %% %(stores)s::INT, 'dutchie', 'pending', 0,
  CASE WHEN g %% 2 = 0 THEN NULL ELSE x.created END,
  x.created, x.created
FROM generate_series(1, %(n)s::INT) g
CROSS JOIN LATERAL (
  SELECT now() - INTERVAL '2 hours' + make_interval(secs => g * 3600.0 / %(n)s::INT) AS created
) x
"""

# Tomorrow's resync batches, each on its own store, created a day ago: in 074's claim order
# (priority DESC, created_at) every one of them comes before every due task.
LOAD_FUTURE = """
INSERT INTO worker_tasks (
  role, dispensary_id, platform, status, priority, scheduled_for, created_at, updated_at
)
SELECT
  'product_resync', %(first_store)s::INT + g - 1, 'dutchie', 'pending', 0,
  (current_date + 1) + make_interval(hours => 4 * (g %% 6)),
  now() - INTERVAL '1 day' + make_interval(secs => g * 0.01),
  now() - INTERVAL '1 day' + make_interval(secs => g * 0.01)
FROM generate_series(1, %(n)s::INT) g
"""

REGISTER_074 = """
INSERT INTO worker_registry (worker_id, role) VALUES (%(worker_id)s, %(role)s)
ON CONFLICT (worker_id) DO NOTHING
"""

T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Bench:
    """A database and the SQL it claims and completes with."""

    label: str
    url: str
    claim_sql: str
    complete_sql: str

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)


def setup(server: str, with_074: bool = True) -> tuple[Bench, Bench, Bench | None]:
    v2_url = recreate_db(server, DB_V2)
    migrate(v2_url)
    urls = [(v2_url, False)]
    orig_url = ""
    if with_074:
        orig_url = recreate_db(server, DB_074)
        migrate(orig_url, [m for m in load_migrations() if m.version in ("0001", "0002")])
        urls.append((orig_url, True))
    else:
        # A database of an earlier run would be reported as if measured now.
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB_074)))
    for url, with_trigger in urls:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(original_074(with_trigger=with_trigger))
    v2 = Bench(
        "tq_pipelines",
        v2_url,
        "SELECT (c.task).id, (c.task).scheduled_for, c.lease FROM claim_tasks(%(role)s, %(worker_id)s, 1) c",
        "SELECT complete_task(%(task_id)s, %(lease)s, NULL)",
    )
    # claim_task_074 gives the task no lease token, which complete_task needs (0013).
    v2_074 = Bench(
        "074 SQL on the 0003 schema",
        v2_url,
        "SELECT id, scheduled_for FROM claim_task_074(%(role)s, %(worker_id)s)",
        COMPLETE_074,
    )
    orig = (
        Bench(
            "original 074",
            orig_url,
            "SELECT id, scheduled_for FROM claim_task_074(%(role)s, %(worker_id)s)",
            COMPLETE_074,
        )
        if with_074
        else None
    )
    return v2, v2_074, orig


def vacuum(conn: psycopg.Connection[Any]) -> None:
    for (table,) in conn.execute(
        "SELECT relname FROM pg_class WHERE relname IN ('worker_tasks', 'dispensaries', "
        "'worker_task_heads', 'worker_task_stores', 'worker_registry') AND relkind = 'r'"
    ).fetchall():
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
    # Flush the load now rather than in a checkpoint during the timed loops.
    conn.execute("CHECKPOINT")


def load_base(url: str, finished: int, pending: int, running: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LOAD_STORES, {"first": 1, "last": STORES})
        conn.execute(LOAD_FINISHED, {"n": finished})
        conn.execute(LOAD_UNFINISHED, {"pending": pending})
        conn.execute(LOAD_RUNNING, {"running": running})
        conn.execute(REGISTER_074, {"worker_id": WORKER, "role": ROLE})
        vacuum(conn)


def load_claimable(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LOAD_CLAIMABLE, {"n": n, "stores": STORES})
        vacuum(conn)


def load_future(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LOAD_STORES, {"first": STORES + 1, "last": STORES + n})
        conn.execute(LOAD_FUTURE, {"n": n, "first_store": STORES + 1})
        vacuum(conn)


def unload_future(url: str) -> None:
    """Removes what load_future added, so that the next round measures without it again."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM worker_tasks WHERE dispensary_id > %s", (STORES,))
        if conn.execute("SELECT to_regclass('worker_task_stores')").fetchone()[0]:  # type: ignore[index]
            conn.execute("DELETE FROM worker_task_stores WHERE dispensary_id > %s", (STORES,))
        conn.execute("DELETE FROM dispensaries WHERE id > %s", (STORES,))
        vacuum(conn)


# --- Measuring --------------------------------------------------------------------------------


@dataclass
class Timing:
    samples: list[float]  # milliseconds

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95(self) -> float:
        ordered = sorted(self.samples)
        return ordered[math.ceil(0.95 * len(ordered)) - 1]

    def cell(self) -> str:
        return f"{fmt(self.median)} / {fmt(self.p95)} ms (n={len(self.samples)})"


def fmt(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def time_query(conn: psycopg.Connection[Any], query: str, runs: int, warmup: int = 3) -> Timing:
    samples = []
    for i in range(warmup + runs):
        start = time.perf_counter()
        conn.execute(query).fetchall()
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1000)
    return Timing(samples)


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def explain(conn: psycopg.Connection[Any], query: str) -> str:
    """One line about the plan of ``query``: time, buffers, how it reads worker_tasks."""
    (doc,) = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query).fetchone()  # type: ignore
    plan = doc[0]
    top = plan["Plan"]
    scans: Counter[str] = Counter()
    seq = False
    for node in _nodes(top):
        if node.get("Relation Name") != "worker_tasks":
            continue
        kind = node["Node Type"]
        seq = seq or kind == "Seq Scan"
        name = ("Parallel " if node.get("Parallel Aware") else "") + kind
        name += f" using {node['Index Name']}" if "Index Name" in node else ""
        scans[name] += 1
    parts = [
        f"{plan['Execution Time']:.2f} ms",
        f"buffers hit={top.get('Shared Hit Blocks', 0)} read={top.get('Shared Read Blocks', 0)}",
        "worker_tasks: " + ", ".join(f"{n}{f' x{c}' if c > 1 else ''}" for n, c in scans.items()),
    ]
    if "JIT" in plan:
        parts.append(f"JIT {plan['JIT']['Timing']['Total']:.0f} ms")
    parts.append("**Seq Scan on worker_tasks**" if seq else "no Seq Scan on worker_tasks")
    return "; ".join(parts)


def claim_loop(bench: Bench, n: int, warmup: int) -> tuple[Timing, Timing]:
    """Claim + complete ``n`` times (after ``warmup``); returns (round trip, claim alone)."""
    both: list[float] = []
    claim: list[float] = []
    params: dict[str, Any] = {"role": ROLE, "worker_id": WORKER}
    with bench.connect() as conn:
        for i in range(warmup + n):
            start = time.perf_counter()
            row = conn.execute(bench.claim_sql, params).fetchone()
            claimed = time.perf_counter()
            assert row is not None and row[0] is not None, f"{bench.label}: nothing to claim after {i}"
            task_id, scheduled_for, *lease = row  # the lease token: tq_pipelines' claim only
            held = {"task_id": task_id, "lease": lease[0] if lease else None}
            conn.execute(bench.complete_sql, {**params, **held})
            done = time.perf_counter()
            assert scheduled_for is None or scheduled_for <= datetime.now(UTC) + timedelta(seconds=5), (
                f"{bench.label} claimed task {task_id}, scheduled for {scheduled_for}"
            )
            if i >= warmup:
                both.append((done - start) * 1000)
                claim.append((claimed - start) * 1000)
            if (i + 1) % 500 == 0:
                log(f"  {bench.label}: {i + 1} of {warmup + n}")
    return Timing(both), Timing(claim)


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--finished", type=int, default=1_000_000, help="completed/failed tasks")
    parser.add_argument("--pending", type=int, default=2000, help="pending due tasks, all roles")
    parser.add_argument("--running", type=int, default=500)
    parser.add_argument("--runs", type=int, default=50, help="timed runs of each view query")
    parser.add_argument(
        "--slow-runs", type=int, default=20, help="timed runs of the original capacity view (a full scan)"
    )
    parser.add_argument("--claims", type=int, default=2000, help="timed claims per phase")
    parser.add_argument(
        "--claims-074-on-0003",
        type=int,
        default=200,
        help="timed claims per phase of claim_task_074 on the 0003 schema (0: skip)",
    )
    parser.add_argument("--future", type=int, default=50_000, help="future tasks added for phase two")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the phases without and with future tasks this many times, the claims "
        "split evenly (a spell of a shared machine's load is then less likely to fall on one only)",
    )
    parser.add_argument(
        "--skip-074", action="store_true", help="no original 074 database (its columns read 'not run')"
    )
    args = parser.parse_args()

    with psycopg.connect(args.url) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    machine = f"nproc {os.cpu_count()}, PostgreSQL {version}"
    log(f"{machine}; creating {DB_V2}" + ("" if args.skip_074 else f" and {DB_074}"))
    v2, v2_074, orig = setup(args.url, with_074=not args.skip_074)
    loaded = [b for b in (v2, orig) if b is not None]
    for bench in loaded:
        counts = f"{args.finished:,} finished + {args.pending:,} pending + {args.running} running"
        log(f"loading {counts}: {bench.label}")
        load_base(bench.url, args.finished, args.pending, args.running)

    # Part 1: the views.
    results: dict[tuple[str, str], str] = {}
    plans: list[str] = []
    view_queries = {
        "capacity": ("SELECT * FROM v_worker_capacity", "SELECT * FROM v_worker_capacity_074"),
        "history": ("SELECT * FROM v_task_history LIMIT 50", "SELECT * FROM v_task_history_074 LIMIT 50"),
    }
    for key, (new_query, old_query) in view_queries.items():
        for label, bench, query in (
            ("tq_pipelines", v2, new_query),
            ("original 074", orig, old_query),
            ("074 SQL on the 0003 schema", v2, old_query),
        ):
            if bench is None:
                continue
            runs = args.slow_runs if key == "capacity" and label != "tq_pipelines" else args.runs
            log(f"{query}: {label}, {runs} runs")
            with bench.connect() as conn:
                results[(key, label)] = time_query(conn, query, runs).cell()
                line = explain(conn, query)
            plans.append(f"- {label}, `{query}`: {line}")

    # Part 2: claims, without and then with tomorrow's tasks ahead of the due ones, --rounds times.
    warmup = 50
    n_0003 = args.claims_074_on_0003
    rounds = args.rounds
    per_phase = args.claims + rounds * warmup + (n_0003 + rounds * warmup if n_0003 else 0)
    # Stores with a running product_resync task never free up; their tasks are never claimable.
    claimable = int(2 * per_phase * 1.25) + 1000
    for bench in loaded:
        log(f"loading {claimable:,} due {ROLE} tasks: {bench.label}")
        load_claimable(bench.url, claimable)
    claims: dict[tuple[str, str], tuple[Timing, Timing]] = {}
    future_loaded = False
    for r in range(rounds):
        for phase in ("without", "with"):
            if (phase == "with") != future_loaded:
                for bench in loaded:
                    if future_loaded:
                        log(f"removing the future {ROLE} tasks: {bench.label}")
                        unload_future(bench.url)
                    else:
                        log(f"loading {args.future:,} future {ROLE} tasks: {bench.label}")
                        load_future(bench.url, args.future)
                future_loaded = not future_loaded
            for bench, total in ((v2, args.claims), (orig, args.claims), (v2_074, n_0003)):
                # This round's share of the phase's claims.
                n = total // rounds + (1 if r < total % rounds else 0)
                if bench is None or not n:
                    continue
                log(f"claim + complete x{n} ({phase} future tasks, round {r + 1} of {rounds}): {bench.label}")
                both, claim = claim_loop(bench, n, warmup)
                log(f"  medians: claim {fmt(claim.median)} ms, claim + complete {fmt(both.median)} ms")
                if (phase, bench.label) in claims:
                    before_both, before_claim = claims[(phase, bench.label)]
                    both = Timing(before_both.samples + both.samples)
                    claim = Timing(before_claim.samples + claim.samples)
                claims[(phase, bench.label)] = (both, claim)

    def claim_cell(phase: str, label: str, which: int = 0) -> str:
        found = claims.get((phase, label))
        return found[which].cell() if found else "not run"

    def ratio_cell(label: str, which: int = 0) -> str:
        if ("with", label) not in claims:
            return "not run"
        before, after = claims[("without", label)][which], claims[("with", label)][which]
        return f"{after.median / before.median:.2f}x (p95 {after.p95 / before.p95:.2f}x)"

    future = f"{args.future:,}"
    targets = {"capacity": "< 50 ms", "history": "< 10 ms"}
    print(
        f"Machine: {machine}. {args.finished:,} finished tasks, {args.pending:,} pending due, "
        f"{args.running} running, {STORES:,} stores.\n"
    )
    print("| measurement | original 074 | tq_pipelines | target |")
    print("|---|---:|---:|---|")
    for key, (new_query, _) in view_queries.items():
        print(
            f"| `{new_query}`, median / p95 | {results.get((key, 'original 074'), 'not run')} "
            f"| {results[(key, 'tq_pipelines')]} | {targets[key]} |"
        )
    for phase, title in (("without", "no future tasks"), ("with", f"{future} future tasks ahead")):
        print(
            f"| claim + complete, {title}, median / p95 | {claim_cell(phase, 'original 074')} "
            f"| {claim_cell(phase, 'tq_pipelines')} | |"
        )
    for phase, title in (("without", "no future tasks"), ("with", f"{future} future tasks ahead")):
        print(
            f"| claim alone, {title}, median / p95 | {claim_cell(phase, 'original 074', 1)} "
            f"| {claim_cell(phase, 'tq_pipelines', 1)} | |"
        )
    print(
        f"| claim + complete, with / without future tasks (median) | {ratio_cell('original 074')} "
        f"| {ratio_cell('tq_pipelines')} | about 1.0 |"
    )
    print(
        f"| claim alone, with / without future tasks (median) | {ratio_cell('original 074', 1)} "
        f"| {ratio_cell('tq_pipelines', 1)} | about 1.0 |"
    )

    label = "074 SQL on the 0003 schema"
    print(
        f"\nThe 074 SQL ({label}: `v_*_074` views and `claim_task_074` in {DB_V2}, over the 0003 "
        "indexes and triggers):\n"
    )
    print("| measurement | 074 SQL on the 0003 schema |")
    print("|---|---:|")
    for key, (_, old_query) in view_queries.items():
        print(f"| `{old_query}`, median / p95 | {results[(key, label)]} |")
    for phase, title in (("without", "no future tasks"), ("with", f"{future} future tasks ahead")):
        print(f"| claim_task_074 + 074's completion, {title}, median / p95 | {claim_cell(phase, label)} |")
    print(f"| ratio with / without (median) | {ratio_cell(label)} |")

    print("\nEXPLAIN (ANALYZE, BUFFERS), one run each after the timed runs:\n")
    print("\n".join(plans))
    log("done")


if __name__ == "__main__":
    main()
