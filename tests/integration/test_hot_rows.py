"""Hot rows (migration 0015): a worker's counts are appended as tallies and folded at its
heartbeat, so that completions never update its registry row; v_workers is exact at any moment,
under many workers completing and heartbeating at once."""

import threading
import time

import psycopg
import pytest

from tests.helpers import add_stores, assert_store_state_consistent
from tq_pipelines.queue.api import TaskQueue

ROLE = "product_resync"


def registry_version(conn: psycopg.Connection, worker_id: str) -> tuple:
    """The registry row's version (ctid, xmin): changes with every update of the row."""
    return conn.execute(
        "SELECT ctid::TEXT, xmin::TEXT FROM worker_registry WHERE worker_id = %s", (worker_id,)
    ).fetchone()


def counts(conn: psycopg.Connection, relation: str, worker_id: str) -> tuple:
    return conn.execute(
        f"SELECT tasks_completed, tasks_failed FROM {relation} WHERE worker_id = %s", (worker_id,)
    ).fetchone()


def test_completions_and_failures_leave_the_registry_row_alone(conn: psycopg.Connection, queue: TaskQueue):
    stores = add_stores(conn, 6)
    for s in stores:
        queue.enqueue(ROLE, s)
    queue.register_worker("w1", ROLE)
    before = registry_version(conn, "w1")
    held = queue.claim_many(ROLE, "w1", 6, start=True)
    assert len(held) == 6
    assert queue.complete(held[0], {"n": 0})
    assert queue.complete_many({t.lease: None for t in held[1:4]}) == {t.id for t in held[1:4]}
    assert queue.fail(held[4], "boom", retryable=False) == "failed"
    assert queue.fail(held[5], "again") == "pending"
    queue.worker_completed("w1", 2)

    assert registry_version(conn, "w1") == before, "a completion or failure updated the registry row"
    assert counts(conn, "worker_registry", "w1") == (0, 0)
    assert counts(conn, "v_workers", "w1") == (6, 2)

    # The heartbeat folds: the registry row then holds the counts, and no tally is left.
    assert queue.heartbeat("w1", []) == set()
    assert counts(conn, "worker_registry", "w1") == (6, 2)
    assert counts(conn, "v_workers", "w1") == (6, 2)
    assert conn.execute("SELECT count(*) FROM worker_tallies").fetchone() == (0,)


def test_heartbeat_is_a_hot_update(db_url: str, conn: psycopg.Connection, queue: TaskQueue):
    """No index covers last_heartbeat_at any more: a heartbeat stays within its page."""
    queue.register_worker("w1", ROLE)
    queue.heartbeat("w1", [])
    with psycopg.connect(db_url) as c:
        for _ in range(5):
            c.execute("SELECT heartbeat_tasks('w1', '{}', '{}')")
        updates, hot = c.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'worker_registry'"
        ).fetchone()
    assert updates == 5
    assert hot == 5


def test_prune_workers_folds_every_workers_tallies(conn: psycopg.Connection, queue: TaskQueue):
    """A worker that never heartbeats (plain TaskQueue calls) has its tallies folded by the prune."""
    stores = add_stores(conn, 2)
    for s in stores:
        queue.enqueue(ROLE, s)
    queue.register_worker("quiet", ROLE)
    held = queue.claim_many(ROLE, "quiet", 2, start=True)
    queue.complete_many({t.lease: None for t in held})
    assert conn.execute("SELECT count(*) FROM worker_tallies").fetchone() == (1,)
    # A cut-off in the past keeps the worker's row: only the fold happens.
    conn.execute("SELECT prune_workers('-infinity', 100)")
    assert counts(conn, "worker_registry", "quiet") == (2, 0)
    assert conn.execute("SELECT count(*) FROM worker_tallies").fetchone() == (0,)


@pytest.mark.parametrize("workers", [8])
def test_counts_are_exact_under_concurrent_completions_and_folds(
    db_url: str, conn: psycopg.Connection, workers: int
):
    """Many workers complete in batches while their heartbeats (and a pruner) fold at the same
    time: afterwards every worker's count equals the tasks the table says it completed."""
    stores = add_stores(conn, 400)
    conn.execute(
        "INSERT INTO worker_tasks (role, dispensary_id) SELECT %s, s FROM unnest(%s::INT[]) s",
        (ROLE, stores),
    )
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers + 1)
    done = threading.Event()

    def work(n: int) -> None:
        worker_id = f"w{n}"
        try:
            with TaskQueue.connect(db_url, min_size=2, max_size=2) as q:
                q.register_worker(worker_id, ROLE)
                barrier.wait()
                while held := q.claim_many(ROLE, worker_id, 7, start=True):
                    q.complete_many({t.lease: None for t in held[1:]})
                    q.fail(held[0], "counted as a failure", retryable=False)
                    q.heartbeat(worker_id, [])
        except BaseException as e:
            errors.append(e)

    def fold() -> None:
        with psycopg.connect(db_url, autocommit=True) as c:
            barrier.wait()
            while not done.is_set():
                c.execute("SELECT prune_workers('-infinity', 100)")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(workers)]
    folder = threading.Thread(target=fold)
    for t in [*threads, folder]:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    folder.join(30)
    assert not errors, errors

    table = {
        r[0]: (r[1], r[2])
        for r in conn.execute(
            "SELECT worker_id, count(*) FILTER (WHERE status = 'completed'), "
            "count(*) FILTER (WHERE status = 'failed') FROM v_tasks GROUP BY worker_id"
        )
    }
    seen = {
        r[0]: (r[1], r[2])
        for r in conn.execute("SELECT worker_id, tasks_completed, tasks_failed FROM v_workers")
    }
    assert sum(c + f for c, f in seen.values()) == 400
    assert seen == table


def test_a_scan_of_a_roles_heads_has_one_index_to_take(conn: psycopg.Connection):
    """0018. Under a held snapshot a role's heads are a few live rows among every head deleted
    since, and ANALYZE sees only the live ones: any index with a role column looks as cheap as
    the positioned one, and a generic plan that took it walked every dead head (the held-snapshot
    stalls of docs/BENCHMARKS.md; PostgreSQL 18 took even an index with role as its second
    column). So no index of the heads but the positioned one (and the recheck index, partial on
    recheck_at) has a role column; one head per store and role is kept by a unique index on an
    expression of it, which the upserts name."""
    rows = conn.execute(
        """
        SELECT c.relname, i.indisunique, i.indpred IS NOT NULL,
               array_agg(a.attname ORDER BY k.n) FILTER (WHERE a.attname IS NOT NULL)
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k (attnum, n)
        LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = 'worker_task_heads'::regclass
        GROUP BY c.relname, i.indisunique, i.indpred
        ORDER BY c.relname
        """
    ).fetchall()
    with_role = {name: partial for name, _, partial, columns in rows if "role" in (columns or [])}
    assert with_role == {"idx_worker_task_heads_platform": False, "idx_worker_task_heads_recheck": True}
    assert ("worker_task_heads_store_role", True, False, ["dispensary_id"]) in rows
    # Nor a sequential scan, which reads the dead heads too, in the functions that walk them
    # (0018), nor in those that look one task up (0034), nor in the standbys' claim (0035).
    walkers = conn.execute(
        "SELECT proname FROM pg_proc WHERE 'enable_seqscan=off' = ANY (proconfig) ORDER BY proname"
    ).fetchall()
    assert [w for (w,) in walkers] == [
        "claim_tasks",
        "claim_wait",
        "complete_task_tx",
        "complete_tasks",
        "complete_tasks_timed",
        "defer_task",
        "enqueue_task_once",
        "fail_task",
        "heartbeat_tasks",
        "platform_standby",
        "platform_standbys",
        "task_still_owned",
        "tq_claim_next",
        "tq_pass",
        "tq_pick_next",
        "tq_raise_floors",
        "tq_refresh_head",
        "tq_refresh_heads",
    ]


# As if a minute had passed since every floor was raised and swept.
MINUTE_LATER = (
    "UPDATE worker_task_floors SET raised_at = '-infinity', swept_at = now() - interval '2 minutes'"
)


def floor_of(conn: psycopg.Connection, platform: str = "dutchie", priority: int = 0):
    row = conn.execute(
        "SELECT min(floor) FROM worker_task_floors WHERE role = %s AND platform = %s AND priority = %s",
        (ROLE, platform, priority),
    ).fetchone()
    return row[0]


def test_a_head_due_before_the_floor_lowers_it_and_is_claimed_first(
    conn: psycopg.Connection, queue: TaskQueue
):
    """Claims raise the floor past the work they took; a task due earlier than the floor (a
    backfilled day, a recovered task) lowers it, and the claim order stays oldest due first."""
    a, b, c = add_stores(conn, 3)
    queue.enqueue(ROLE, a)
    (first,) = queue.claim_many(ROLE, "w1", 1)
    assert first.dispensary_id == a
    queue.enqueue(ROLE, b)
    raised = floor_of(conn)
    assert raised > conn.execute("SELECT now() - interval '1 minute'").fetchone()[0]
    old = conn.execute("SELECT now() - interval '1 hour'").fetchone()[0]
    conn.execute("SELECT enqueue_task(%s, %s, NULL, 0, %s)", (ROLE, c, old))
    assert floor_of(conn) == old
    assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 2)] == [c, b]


def test_each_priority_has_its_floor_and_an_empty_one_goes(conn: psycopg.Connection, queue: TaskQueue):
    """Floors are kept per priority (0017): the claim order stays priority first, and the floor
    of a priority with no pending work is deleted by the raise that sweeps it (once a minute)."""
    low, high, later = add_stores(conn, 3)
    an_hour_ago = conn.execute("SELECT now() - interval '1 hour'").fetchone()[0]
    conn.execute("SELECT enqueue_task(%s, %s, NULL, -5, %s)", (ROLE, low, an_hour_ago))
    queue.enqueue(ROLE, high, priority=5)
    queue.enqueue(ROLE, later, priority=5)
    assert floor_of(conn, priority=-5) == an_hour_ago
    assert floor_of(conn, priority=5) is not None
    assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 3)] == [high, later, low]
    conn.execute("SELECT pg_sleep(1.1)")
    assert queue.claim_many(ROLE, "w1", 3) == []  # raises: no live head of either priority
    assert conn.execute("SELECT count(*) FROM worker_task_floors WHERE role = %s", (ROLE,)).fetchone() == (2,)
    conn.execute(MINUTE_LATER)
    assert queue.claim_many(ROLE, "w1", 3) == []  # sweeps: still none
    assert conn.execute("SELECT count(*) FROM worker_task_floors WHERE role = %s", (ROLE,)).fetchone() == (0,)
    # The next head of a priority writes its floor again.
    (again,) = add_stores(conn, 1)
    conn.execute("SELECT enqueue_task(%s, %s, NULL, -5, %s)", (ROLE, again, an_hour_ago))
    assert floor_of(conn, priority=-5) == an_hour_ago
    assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 3)] == [again]


def test_a_raise_is_a_hot_update(db_url: str, conn: psycopg.Connection, queue: TaskQueue):
    """0018: the floor's value is not indexed, so a raise rewrites its row within its page; under
    a held snapshot its versions then cost a read of the floor no index entry each."""
    a, b = add_stores(conn, 2)
    queue.enqueue(ROLE, a)
    queue.claim_many(ROLE, "w1", 1)
    queue.enqueue(ROLE, b)
    conn.execute(MINUTE_LATER)
    before = floor_of(conn)
    with psycopg.connect(db_url) as c:
        claimed = c.execute("SELECT (claim_tasks(%s, 'w1', 5)).task.dispensary_id", (ROLE,)).fetchall()
        assert claimed == [(b,)]
        updates, hot = c.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
            " WHERE relname = 'worker_task_floors'"
        ).fetchone()
    assert floor_of(conn) > before
    assert updates == hot == 1


def test_a_sweep_finds_a_head_below_its_floor(conn: psycopg.Connection, queue: TaskQueue):
    """The net under the floors: should a head ever be below its floor, the raise that looks from
    the start of the index (once a minute per floor) lowers the floor to it."""
    a, b = add_stores(conn, 2)
    queue.enqueue(ROLE, a)
    conn.execute("SELECT enqueue_task(%s, %s, NULL, 0, now() - interval '1 hour')", (ROLE, b))
    # What no path of the queue does: the floor moved past a live head.
    conn.execute(
        "UPDATE worker_task_floors SET raised_at = now(), swept_at = now(), "
        "floor = (SELECT due_at FROM v_tasks WHERE dispensary_id = %s)",
        (a,),
    )
    assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 5)] == [a]  # b is not seen
    assert queue.claim_many(ROLE, "w1", 5) == []
    conn.execute(MINUTE_LATER)
    # The claim that sweeps finds no work from the floor it had; the next one takes b.
    claimed = queue.claim_many(ROLE, "w1", 5) or queue.claim_many(ROLE, "w1", 5)
    assert [t.dispensary_id for t in claimed] == [b]
    assert_store_state_consistent(conn)


def test_no_raise_passes_a_head_its_writer_has_not_committed(db_url: str, conn: psycopg.Connection):
    """A head's writer holds its floor's lock from its check to its commit: a claim meanwhile
    leaves that floor where it is (and does not wait), so the head is claimable the moment it
    commits."""
    (store,) = add_stores(conn, 1)
    with TaskQueue.connect(db_url, max_size=2) as queue, psycopg.connect(db_url) as slow:
        queue.enqueue(ROLE, add_stores(conn, 1)[0])
        assert len(queue.claim_many(ROLE, "w1", 5)) == 1  # the floor row exists and was raised
        slow.execute("SELECT enqueue_task(%s, %s)", (ROLE, store))  # due at the start of its transaction
        conn.execute("SELECT pg_sleep(1.2)")
        before = floor_of(conn)
        assert queue.claim_many(ROLE, "w1", 5) == []  # the raise skips the floor being written
        assert floor_of(conn) == before
        slow.commit()
        due = conn.execute("SELECT due_at FROM v_tasks WHERE dispensary_id = %s", (store,)).fetchone()[0]
        assert floor_of(conn) <= due
        assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 5)] == [store]


def test_a_head_written_during_a_raise_adds_a_floor_row_of_its_own(db_url: str, conn: psycopg.Connection):
    """The other order: a claim raised the floor and has not committed; a head written below it
    waits for that claim no more than 20 ms (0018): it adds a floor row at its due time, which
    the raise, not having read it, leaves alone."""
    a, b = add_stores(conn, 2)
    with TaskQueue.connect(db_url, max_size=2) as queue, psycopg.connect(db_url) as claim:
        queue.enqueue(ROLE, a)
        claim.execute("SELECT pg_sleep(1.1)")
        claim.commit()
        claim.execute("SELECT claim_tasks(%s, 'w1', 5)", (ROLE,))  # raises, holds the floor's lock
        raised = floor_of(claim)
        old = conn.execute("SELECT now() - interval '1 hour'").fetchone()[0]
        with psycopg.connect(db_url, autocommit=True) as w:
            w.execute("SET statement_timeout = '5s'")  # it must not wait for the claim's commit
            w.execute("SELECT enqueue_task(%s, %s, NULL, 0, %s)", (ROLE, b, old))
        claim.commit()
        assert floor_of(conn) == old < raised
        assert conn.execute("SELECT count(*) FROM worker_task_floors").fetchone() == (2,)
        assert [t.dispensary_id for t in queue.claim_many(ROLE, "w1", 5)] == [b]


def test_heads_written_during_raises_are_never_stranded(db_url: str, conn: psycopg.Connection):
    """Writers enqueue tasks due in the past, at three priorities, in transactions that stay open
    a while, as claimers raise floors: every task is claimed, once, and no head is ever below
    its floor."""
    stores = add_stores(conn, 240)
    errors: list[BaseException] = []
    claimed: list[int] = []
    done = threading.Event()

    def write(chunk: list[int]) -> None:
        try:
            with psycopg.connect(db_url) as w:
                for i, store in enumerate(chunk):
                    w.execute(
                        "SELECT enqueue_task(%s, %s, NULL, %s, now() - make_interval(secs => %s))",
                        (ROLE, store, (-1, 0, 3)[i % 3], (i * 7) % 50),
                    )
                    if i % 4 == 3:
                        w.execute("SELECT pg_sleep(0.3)")
                        w.commit()
                w.commit()
        except BaseException as e:
            errors.append(e)

    def claim(n: int) -> None:
        try:
            with TaskQueue.connect(db_url, min_size=1, max_size=1) as q:
                while not done.is_set():
                    held = q.claim_many(ROLE, f"w{n}", 7)
                    claimed.extend(t.id for t in held)
                    if not held:
                        done.wait(0.05)
        except BaseException as e:
            errors.append(e)

    writers = [threading.Thread(target=write, args=(stores[i::6],)) for i in range(6)]
    claimers = [threading.Thread(target=claim, args=(n,)) for n in range(3)]
    for t in [*writers, *claimers]:
        t.start()
    for t in writers:
        t.join(60)
    deadline = time.monotonic() + 15
    while len(claimed) < len(stores) and time.monotonic() < deadline:
        time.sleep(0.1)
    done.set()
    for t in claimers:
        t.join(30)
    assert not errors, errors
    assert len(claimed) == len(set(claimed)) == len(stores)
    assert_store_state_consistent(conn)


# The queue's tables whose scans run in one process (migration 0021).
SERIAL_TABLES = (
    "worker_tasks",
    "worker_task_heads",
    "worker_task_stores",
    "worker_registry",
    "worker_tallies",
    "worker_task_floors",
    "tq_platforms",
    "task_completion_log",
)


def test_an_analysts_scan_of_a_queue_table_runs_in_one_process(conn: psycopg.Connection, queue: TaskQueue):
    """With parallel plans made free, a count over each queue table still plans no workers; take
    the table's setting back and the same count plans a Gather: the setting is what holds it."""
    for s in add_stores(conn, 20):
        queue.enqueue(ROLE, s)
    for setting in (
        "parallel_setup_cost = 0",
        "parallel_tuple_cost = 0",
        "min_parallel_table_scan_size = 0",
        "min_parallel_index_scan_size = 0",
        "max_parallel_workers_per_gather = 2",
    ):
        conn.execute(f"SET {setting}")

    def plan(table: str) -> str:
        return "\n".join(r[0] for r in conn.execute(f"EXPLAIN SELECT count(*) FROM {table}"))

    for table in SERIAL_TABLES:
        assert "Gather" not in plan(table), f"a scan of {table} plans parallel workers:\n{plan(table)}"
    for table in SERIAL_TABLES:
        conn.execute(f"ALTER TABLE {table} RESET (parallel_workers)")
        assert "Gather" in plan(table), f"{table} without the setting: no parallel plan to prevent"
