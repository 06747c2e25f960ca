"""Claim order holds as time passes: a task that comes due can overtake a store's head."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
from psycopg import sql

from tests.helpers import add_stores, assert_store_state_consistent
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"


def _insert(conn: psycopg.Connection, store: int, priority: int, due_in: timedelta) -> int:
    row = conn.execute(
        "INSERT INTO worker_tasks (role, dispensary_id, priority, scheduled_for)"
        " VALUES (%s, %s, %s, now() + %s) RETURNING id",
        (ROLE, store, priority, due_in),
    ).fetchone()
    assert row
    return int(row[0])


def test_a_task_coming_due_overtakes_its_stores_head(conn: psycopg.Connection, queue: TaskQueue):
    a, b = add_stores(conn, 2)
    _insert(conn, a, 0, timedelta(hours=-2))  # a's head now: priority 0
    urgent = _insert(conn, a, 10, timedelta(seconds=1))  # comes due in a second, outranks b
    _insert(conn, b, 5, timedelta(hours=-1))
    recheck = conn.execute(
        "SELECT recheck_at IS NOT NULL FROM worker_task_heads WHERE dispensary_id = %s", (a,)
    ).fetchone()
    assert recheck == (True,), "the head must know when the urgent task could overtake it"
    time.sleep(1.5)
    task = queue.claim(ROLE, "w")
    assert task is not None and task.id == urgent
    assert_store_state_consistent(conn)


def test_heads_follow_direct_writes(conn: psycopg.Connection, queue: TaskQueue):
    """Old callers that UPDATE or DELETE worker_tasks directly keep the heads true."""
    (a,) = add_stores(conn, 1)
    first = _insert(conn, a, 0, timedelta(minutes=-5))
    second = _insert(conn, a, 0, timedelta(minutes=-1))
    conn.execute("UPDATE worker_tasks SET priority = 7 WHERE id = %s", (second,))
    assert_store_state_consistent(conn)
    conn.execute("DELETE FROM worker_tasks WHERE id = %s", (second,))
    task = queue.claim(ROLE, "w")
    assert task is not None and task.id == first
    assert queue.claim(ROLE, "w2") is None
    assert queue.complete(task)
    assert queue.claim(ROLE, "w3") is None
    assert conn.execute("SELECT count(*) FROM worker_task_heads").fetchone() == (0,)


def test_no_join_of_the_heads_to_their_stores_offers_a_merge_key(conn: psycopg.Connection):
    """0020: a join on bare h.dispensary_id makes worker_task_heads_store_role's order useful for a
    merge join, so the planner builds a full scan of it, and under a held snapshot an ANALYZE
    can make that scan of every head, live or dead, the claim's chosen plan for a minute."""
    defs = conn.execute(
        "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p"
        " WHERE p.pronamespace = 'public'::regnamespace AND p.prokind = 'f'"
        " AND p.prosrc LIKE '%worker_task_heads h%' AND p.prosrc LIKE '%worker_task_stores s%'"
    ).fetchall()
    assert {name for name, _ in defs} >= {"claim_tasks", "tq_pick_next", "claim_wait"}
    for name, body in defs:
        joins = [line.strip() for line in body.splitlines() if "JOIN worker_task_stores s ON" in line]
        assert joins, name
        for line in joins:
            assert "s.dispensary_id = h.dispensary_id + 0" in line, f"{name}: {line}"


ENQUEUE = "SELECT enqueue_task_once(%s, s, NULL, 0, NULL, NULL) FROM unnest(%s::INT[]) s"
HEADS_INDEX_READS = (
    "SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = 'worker_task_heads'"
)
TASKS_PKEY_READS = (
    "SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE indexrelname = 'worker_tasks_pkey'"
)


def _index_reads(conn: psycopg.Connection, statement: str = HEADS_INDEX_READS) -> int:
    """The index entries ``statement`` counts (by default, all of worker_task_heads' indexes')."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")  # the flush happens as the backend goes idle
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(statement).fetchone()
    assert row
    return int(row[0])


@contextmanager
def _dead_work_behind_a_held_snapshot(
    conn: psycopg.Connection, db_url: str, worker: str, stores: list[int]
) -> Iterator[None]:
    """A reader's snapshot, held until the block ends, behind which ``worker`` enqueues, claims and
    completes 4,800 tasks of ``stores[:600]`` (tasks and heads made and deleted: dead, and kept by
    the snapshot); then one task left, on the last store, due in an hour."""
    conn.execute("SELECT register_worker(%s, %s)", (worker, ROLE))
    with psycopg.connect(db_url) as reader:
        reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM worker_tasks")  # the snapshot, held from here
        for _ in range(8):
            conn.execute(ENQUEUE, (ROLE, stores[:600]))
            while _claim_and_complete(conn, worker, 200):
                pass
        conn.execute(
            "SELECT enqueue_task_once(%s, %s, NULL, 0, now() + interval '1 hour', NULL)", (ROLE, stores[-1])
        )
        yield


def _claim_and_complete(conn: psycopg.Connection, worker: str, n: int) -> int:
    rows = conn.execute(
        "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, %s, %s, true) AS c", (ROLE, worker, n)
    ).fetchall()
    if rows:
        conn.execute(
            "SELECT complete_tasks(%s, %s, %s::JSONB[])",
            ([r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)),
        )
    return len(rows)


def test_a_claim_after_a_nearly_empty_analyze_reads_only_its_own_heads(conn: psycopg.Connection, db_url: str):
    """0024: autovacuum finds a queue that keeps up nearly empty, and its ANALYZE then says the
    heads are one or two; with a reader's snapshot keeping every dead head, plans that read the
    role's heads whole (the floors' semi-join probes, a DELETE joined to the fresh heads) looked
    cheapest and walked thousands of dead entries per claim."""
    stores = add_stores(conn, 650)
    with _dead_work_behind_a_held_snapshot(conn, db_url, "heads-w", stores):
        # One head left, due in an hour; a second on, a claim (of nothing) raises the role's floor
        # past the dead heads, as a fleet's claims keep it a second behind.
        time.sleep(1.2)
        assert _claim_and_complete(conn, "heads-w", 50) == 0
        conn.execute("ANALYZE worker_task_heads")
        (heads,) = conn.execute(
            "SELECT reltuples FROM pg_class WHERE relname = 'worker_task_heads'"
        ).fetchone() or (None,)
        assert heads == 1
        conn.execute(ENQUEUE, (ROLE, stores[:50]))
        before = _index_reads(conn)
        # An idle worker's look for work, then the claim.
        (wait,) = conn.execute("SELECT claim_wait(%s)", (ROLE,)).fetchone() or (None,)
        assert wait is not None
        assert _claim_and_complete(conn, "heads-w", 50) == 50
        reads = _index_reads(conn) - before
    # The 50 stores' heads, the floors' probes and the rewrites: a few hundred entries at most,
    # where a read of the role's heads is 4,800 (and one per claimed store, 240,000).
    assert reads < 1000, reads
    assert_store_state_consistent(conn)


def _backlog_after_a_nearly_empty_analyze(
    conn: psycopg.Connection, worker: str, table: str, stores: list[int]
) -> None:
    """``worker`` registered; the first store's task enqueued and ``table`` analyzed, its
    autovacuum off (the statistics of a queue that keeps up); then the rest of ``stores``
    enqueued: a backlog those statistics do not know."""
    conn.execute("SELECT register_worker(%s, %s)", (worker, ROLE))
    conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(sql.Identifier(table)))
    conn.execute(ENQUEUE, (ROLE, stores[:1]))
    conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))
    conn.execute(ENQUEUE, (ROLE, stores[1:]))


def test_a_claim_behind_a_backlog_that_grew_since_a_nearly_empty_analyze_reads_what_it_claims(
    conn: psycopg.Connection,
):
    """0033: autovacuum's ANALYZE of a queue that keeps up finds one head or two; when a backlog
    then builds (a burst, an outage), the claim's plan from those statistics read every due head
    of the platform, joined each to its store and sorted them all to take a few: a claim's cost
    grew with the backlog it was meant to drain (450/s offered: 2,851 to 4,980 heads and up to
    15,054 buffers for 4 tasks, and the queue went 4,700 deep until the next ANALYZE)."""
    # The backlog: 2,000 more stores due, behind statistics of one head.
    _backlog_after_a_nearly_empty_analyze(conn, "heads-w", "worker_task_heads", add_stores(conn, 2001))
    (heads,) = conn.execute(
        "SELECT reltuples FROM pg_class WHERE relname = 'worker_task_heads'"
    ).fetchone() or (None,)
    assert heads == 1
    # What those statistics made of the claim's plan, whichever this server's estimates pick
    # today: a bitmap scan preferred to the index's order (the session's settings, which the
    # claim's own override).
    conn.execute("SET enable_indexscan = off")
    before = _index_reads(conn)
    for _ in range(5):
        assert _claim_and_complete(conn, "heads-w", 4) == 4
    reads = _index_reads(conn) - before
    # 20 stores' heads, the floors' probes and the rewrites: a few hundred entries at most,
    # where each claim reading the due heads whole is 2,000 (10,000 for the five).
    assert reads < 1000, reads
    assert_store_state_consistent(conn)


def test_a_tasks_lookups_after_a_nearly_empty_analyze_scan_no_table(conn: psycopg.Connection, db_url: str):
    """0034: after an ANALYZE of a nearly empty worker_tasks, the lookups of one task (by its id in
    the handler's transaction and its completion, by its store in the enqueue's check) were
    planned as sequential scans, which read every row of the table once a backlog built. With a
    session that prefers sequential scans (as those statistics did), an enqueue, a handler's
    transaction, a completion, a heartbeat, a deferral and a failure scan no table."""
    stores = add_stores(conn, 2010)
    _backlog_after_a_nearly_empty_analyze(conn, "scan-w", "worker_tasks", stores[:2000])
    claimed = conn.execute(
        "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, 'scan-w', 4, true) AS c", (ROLE,)
    ).fetchall()
    assert len(claimed) == 4
    seq_reads = "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'worker_tasks'"

    def scanned() -> int:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        (n,) = conn.execute(seq_reads).fetchone() or (0,)
        return int(n)

    conn.execute("SET enable_indexscan = off")
    conn.execute("SET enable_bitmapscan = off")
    before = scanned()
    (a, la), (b, lb), (c, lc), (d, ld) = claimed
    conn.execute(ENQUEUE, (ROLE, stores[2000:2010]))
    conn.execute(ENQUEUE, (ROLE, stores[1:3]))  # pending already: nothing new
    with conn.transaction():
        assert conn.execute("SELECT * FROM task_still_owned(%s, %s)", (a, la)).fetchall() == [(1,)]
        assert conn.execute("SELECT complete_task_tx(%s, %s, NULL)", (a, la)).fetchone() == (True,)
    conn.execute("SELECT heartbeat_tasks('scan-w', %s, %s::UUID[])", ([b, c, d], [lb, lc, ld]))
    conn.execute("SELECT complete_tasks(%s, %s, %s::JSONB[])", ([b], [lb], [None]))
    conn.execute("SELECT defer_task(%s, %s, interval '1 minute')", (c, lc))
    conn.execute("SELECT fail_task(%s, %s, 'boom', true, NULL)", (d, ld))
    reads = scanned() - before
    # Each lookup through an index; a sequential scan of the table is 2,000 rows or more.
    assert reads == 0, reads
    conn.execute("RESET enable_indexscan")
    conn.execute("RESET enable_bitmapscan")
    assert_store_state_consistent(conn)


def test_a_batch_behind_a_held_snapshot_after_a_nearly_empty_analyze_reads_only_its_tasks(
    conn: psycopg.Connection, db_url: str
):
    """0036: the claim's last statement updated the picked tasks through a join to them by id, and
    the start, heartbeat and completion of a batch through a join to its unnested ids. After an
    ANALYZE of a nearly empty worker_tasks the planner joined them to a full scan of its primary
    key, which a held snapshot keeps full of dead entries: 111,000 buffers for a claim of 3 to 5
    tasks, and completions fell to half the offered rate for a minute."""
    stores = add_stores(conn, 650)
    conn.execute("ALTER TABLE worker_tasks SET (autovacuum_enabled = false)")
    with _dead_work_behind_a_held_snapshot(conn, db_url, "pkey-w", stores):
        conn.execute("ANALYZE worker_tasks")
        tasks = conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'worker_tasks'").fetchone()
        assert tasks == (1,)
        conn.execute(ENQUEUE, (ROLE, stores[:8]))
        before = _index_reads(conn, TASKS_PKEY_READS)
        claimed = conn.execute(
            "SELECT (c).task.id, (c).lease FROM claim_tasks(%s, 'pkey-w', 4, false) AS c", (ROLE,)
        ).fetchall()
        ids, leases = [r[0] for r in claimed], [r[1] for r in claimed]
        assert len(ids) == 4
        started = conn.execute("SELECT start_tasks(%s, %s::UUID[])", (ids, leases)).fetchone()
        beaten = conn.execute("SELECT heartbeat_tasks('pkey-w', %s, %s::UUID[])", (ids, leases)).fetchone()
        results = [None] * len(ids)
        done = conn.execute("SELECT complete_tasks(%s, %s, %s::JSONB[])", (ids, leases, results)).fetchone()
        reads = _index_reads(conn, TASKS_PKEY_READS) - before
    assert started == beaten == done == (sorted(ids),)
    # The 4 tasks by their ids, four statements over: a few dozen entries, where a scan of the
    # primary key is the 4,800 dead tasks' (19,222 entries before 0036 on PostgreSQL 15).
    assert reads < 200, reads
    assert_store_state_consistent(conn)
