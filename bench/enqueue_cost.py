"""The server time of one enqueue, against a bare INSERT into worker_tasks and into a table without triggers.

    python bench/enqueue_cost.py [--url URL] [--calls 2000] [--stores 5000] [--history 100000]
                                 [--repeat 5] [--without 0014]

Per call, in server time: a plpgsql loop of --calls calls (one statement each, all in one
transaction, each for another store), timed by clock_timestamp() inside the server, so neither
the network nor the client counts. Kinds: ``INSERT, no triggers`` (into ``bench_bare``, a table
LIKE worker_tasks with its indexes, checks and history but no triggers and no foreign keys),
``INSERT`` (the bare INSERT into worker_tasks: its triggers and foreign keys fire),
``enqueue_task`` and ``enqueue_task_once`` (each inserts: no store has a pending task of the
role). The queue holds --history finished tasks spread over --stores stores; after each loop the
new tasks are finished too (and the tables vacuumed), so every loop finds the same state. Each
kind runs --repeat times, alternating the order of the kinds (and of the schemas), since the
machine's speed drifts; the rows are the medians, with the ratio to the bare INSERT into
worker_tasks and to the INSERT without triggers.

``--without VERSION`` also builds a database with every migration but VERSION and measures it in
the same run (before / after a change).

Where the time goes, per schema: the triggers of one bare INSERT as EXPLAIN ANALYZE reports them
(foreign keys included; --explain statements, averaged), and the functions each kind calls
(pg_stat_xact_user_functions with track_functions = 'all' in the loop's transaction: self time,
that is less the functions it calls, per call of the kind).
"""

import statistics
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from psycopg import sql

from bench.queue_throughput import recreate_db, server_parser
from tq_pipelines.db.migrate import load_migrations, migrate

ROLE = "product_resync"
BENCH_DB = "tq_bench_enqueue"
KINDS = {
    "bare": "INSERT, no triggers",
    "insert": "INSERT into worker_tasks",
    "enqueue": "enqueue_task",
    "once": "enqueue_task_once",
}

LOOP_SQL = """
CREATE OR REPLACE FUNCTION bench_loop(p_kind TEXT, p_calls INTEGER) RETURNS FLOAT8 AS $$
DECLARE
  v_first INTEGER;
  v_began TIMESTAMPTZ;
BEGIN
  SELECT min(id) INTO v_first FROM dispensaries;
  v_began := clock_timestamp();
  IF p_kind = 'bare' THEN
    FOR i IN 0 .. p_calls - 1 LOOP
      INSERT INTO bench_bare (role, dispensary_id, platform)
      VALUES ('product_resync', v_first + i, 'dutchie');
    END LOOP;
  ELSIF p_kind = 'insert' THEN
    FOR i IN 0 .. p_calls - 1 LOOP
      INSERT INTO worker_tasks (role, dispensary_id, platform)
      VALUES ('product_resync', v_first + i, 'dutchie');
    END LOOP;
  ELSIF p_kind = 'enqueue' THEN
    FOR i IN 0 .. p_calls - 1 LOOP
      PERFORM enqueue_task('product_resync', v_first + i);
    END LOOP;
  ELSIF p_kind = 'once' THEN
    FOR i IN 0 .. p_calls - 1 LOOP
      IF enqueue_task_once('product_resync', v_first + i) IS NULL THEN
        RAISE EXCEPTION 'bench_loop: store % had a pending task', v_first + i;
      END IF;
    END LOOP;
  ELSE
    RAISE EXCEPTION 'bench_loop: no kind %', p_kind;
  END IF;
  RETURN extract(epoch FROM clock_timestamp() - v_began) * 1e6 / p_calls;
END;
$$ LANGUAGE plpgsql;
"""


def load(url: str, stores: int, history: int) -> None:
    """``stores`` stores, ``history`` finished tasks over them, and bench_bare: the same rows in a
    table LIKE worker_tasks without triggers or foreign keys."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id)"
            " SELECT 'store ' || g, 'dutchie', 'pid-' || g FROM generate_series(1, %s) g",
            (stores,),
        )
        conn.execute(
            """
            INSERT INTO worker_tasks
              (role, dispensary_id, platform, status, created_at, started_at, completed_at)
            SELECT %s, d.first + g %% %s, 'dutchie', 'completed',
                   now() - g * INTERVAL '1 second', now() - g * INTERVAL '1 second',
                   now() - g * INTERVAL '1 second' + INTERVAL '0.5 second'
            FROM generate_series(1, %s) g, (SELECT min(id) AS first FROM dispensaries) d
            """,
            (ROLE, stores, history),
        )
        conn.execute("DROP TABLE IF EXISTS bench_bare")
        conn.execute("CREATE TABLE bench_bare (LIKE worker_tasks INCLUDING ALL)")
        columns = sql.SQL(", ").join(
            sql.Identifier(name)
            for (name,) in conn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_name = 'worker_tasks' AND table_schema = current_schema()"
                " AND is_generated = 'NEVER' ORDER BY ordinal_position"
            )
        )
        conn.execute(sql.SQL("INSERT INTO bench_bare ({c}) SELECT {c} FROM worker_tasks").format(c=columns))
        conn.execute(LOOP_SQL)  # type: ignore[arg-type]  # constant text
        conn.execute("VACUUM ANALYZE")


def settle(conn: psycopg.Connection) -> None:
    """The loop's tasks finished, as the history's are, and the tables vacuumed."""
    for table in ("worker_tasks", "bench_bare"):
        conn.execute(
            sql.SQL(
                "UPDATE {} SET status = 'completed', started_at = now(), completed_at = now()"
                " WHERE status = 'pending'"
            ).format(sql.Identifier(table))
        )
    conn.execute("VACUUM worker_tasks, bench_bare, worker_task_stores, worker_task_heads")


def run(url: str, kind: str, calls: int) -> float:
    """Server microseconds per call of one loop."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT bench_loop(%s, %s)", (kind, calls)).fetchone()
        assert row
        settle(conn)
        return float(row[0])


def functions(url: str, kind: str, calls: int) -> list[tuple[str, float, float, float]]:
    """(function, calls, self us, total us) per call of the kind, from one loop's transaction."""
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute("SELECT bench_loop(%s, %s)", (kind, calls))
        rows = conn.execute(
            "SELECT funcname, calls, self_time, total_time FROM pg_stat_xact_user_functions"
            " WHERE funcname <> 'bench_loop' ORDER BY self_time DESC"
        ).fetchall()
        conn.commit()
        conn.autocommit = True
        settle(conn)
    return [(name, n / calls, 1000 * self / calls, 1000 * total / calls) for name, n, self, total in rows]


def triggers(url: str, statements: int) -> list[tuple[str, float]]:
    """Microseconds per bare INSERT of each trigger (foreign keys too), as EXPLAIN ANALYZE reports."""
    spent: dict[str, float] = {}
    with psycopg.connect(url) as conn:
        (first,) = conn.execute("SELECT min(id) FROM dispensaries").fetchone() or (0,)
        for i in range(statements):
            (plan,) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) INSERT INTO worker_tasks (role, dispensary_id, platform)"
                " VALUES (%s, %s, 'dutchie')",
                (ROLE, first + i),
            ).fetchone() or ([],)
            for trigger in plan[0].get("Triggers", []):
                spent[trigger["Trigger Name"]] = spent.get(trigger["Trigger Name"], 0.0) + trigger["Time"]
            spent["(the plan: the row, its indexes, its BEFORE triggers)"] = (
                spent.get("(the plan: the row, its indexes, its BEFORE triggers)", 0.0)
                + plan[0]["Plan"]["Actual Total Time"]
            )
        conn.commit()
        conn.autocommit = True
        settle(conn)
        # The foreign keys' triggers, by their constraints' names.
        named = dict(
            conn.execute(
                "SELECT t.tgname, 'foreign key ' || c.conname FROM pg_trigger t"
                " JOIN pg_constraint c ON c.oid = t.tgconstraint WHERE t.tgrelid = 'worker_tasks'::REGCLASS"
            ).fetchall()
        )
    return sorted(
        ((named.get(name, name), 1000 * ms / statements) for name, ms in spent.items()), key=lambda r: -r[1]
    )


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="calls per loop (at most --stores)")
    parser.add_argument("--stores", type=int, default=5000)
    parser.add_argument("--history", type=int, default=100000, help="finished tasks in the queue")
    parser.add_argument("--repeat", type=int, default=5, help="loops of each kind per schema (medians)")
    parser.add_argument("--explain", type=int, default=200, help="EXPLAIN ANALYZE statements (0: none)")
    parser.add_argument(
        "--without", default="", help="also measure the schema without this migration version"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch databases")
    args = parser.parse_args()
    if args.calls > args.stores:
        parser.error("--calls must be at most --stores: each call is for another store")

    schemas = {"now": recreate_db(args.url, BENCH_DB)}
    migrate(schemas["now"])
    if args.without:
        schemas[f"without {args.without}"] = recreate_db(args.url, BENCH_DB + "_without")
        migrate(
            schemas[f"without {args.without}"], [m for m in load_migrations() if m.version != args.without]
        )
    try:
        for url in schemas.values():
            load(url, args.stores, args.history)
        for url in schemas.values():
            for kind in KINDS:  # warm the sessions' caches and the tables
                run(url, kind, min(args.calls, 200))

        times: dict[tuple[str, str], list[float]] = {(s, k): [] for s in schemas for k in KINDS}
        for r in range(args.repeat):
            for schema in list(schemas)[:: 1 if r % 2 == 0 else -1]:
                for kind in list(KINDS)[:: 1 if r % 2 == 0 else -1]:
                    times[schema, kind].append(run(schemas[schema], kind, args.calls))

        print(
            f"{args.calls} calls per loop, {args.stores} stores, {args.history} finished tasks,"
            f" {args.repeat} loops per kind (medians)\n"
        )
        print("| schema | call | µs per call (server) | x INSERT into worker_tasks | x INSERT, no triggers |")
        print("|---|---|---:|---:|---:|")
        for schema in schemas:
            median = {k: statistics.median(times[schema, k]) for k in KINDS}
            for kind, label in KINDS.items():
                print(
                    f"| {schema} | {label} | {median[kind]:.0f} | {median[kind] / median['insert']:.2f}"
                    f" | {median[kind] / median['bare']:.2f} |"
                )
        spread = max(
            (max(v) - min(v)) / statistics.median(v) for v in times.values() if statistics.median(v) > 0
        )
        print(f"\nwidest spread of a kind's loops (max - min) / median: {spread:.0%}")

        for schema, url in schemas.items():
            if args.explain:
                print(
                    f"\n{schema}: one bare INSERT into worker_tasks, per trigger (EXPLAIN ANALYZE,"
                    f" {args.explain} statements, µs each)\n"
                )
                print("| trigger | µs |")
                print("|---|---:|")
                for name, us in triggers(url, args.explain):
                    print(f"| {name} | {us:.1f} |")
            print(f"\n{schema}: functions per call (track_functions = 'all': timing adds to each)\n")
            print("| call | function | calls | self µs | total µs |")
            print("|---|---|---:|---:|---:|")
            for kind in ("insert", "once"):
                for name, n, self_us, total_us in functions(url, kind, args.calls):
                    if total_us >= 0.5:
                        print(f"| {KINDS[kind]} | {name} | {n:g} | {self_us:.1f} | {total_us:.1f} |")
    finally:
        if not args.keep:
            with psycopg.connect(args.url, autocommit=True) as conn:
                for name in (BENCH_DB, BENCH_DB + "_without"):
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                    )


if __name__ == "__main__":
    main()
