"""Standbys of a worker that holds no slot of a full platform (migration 0035).

A drain run that starts when another holds every slot of a platform claims nothing there. It
now keeps standbys of that platform anyway (``platform_standbys``): tasks claimed without a
slot, their handlers waiting at their first request, so that a slot the other's share gives back
(announced, 0032) is used at once. They hold stores, never slots: the limits and the shares
are as they were, whatever a caller passes.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.helpers import add_stores, assert_platform_counters_consistent
from tests.integration.test_attacks import Worker as WorkerRole
from tests.integration.test_attacks import make_role, worker  # noqa: F401
from tests.integration.test_platform_limits import add_platform_tasks, in_flight
from tests.integration.test_slot_free import session, wait_for
from tq_pipelines.queue import worker as worker_module
from tq_pipelines.queue.api import PlatformLimits, QueueInputError, Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker

# The attack test's fixtures, found by pytest where the module imports them (F811, as in
# test_slot_free).
# ruff: noqa: F811

ROLE = "product_resync"


def held(conn: psycopg.Connection, worker_id: str, platform: str) -> tuple[int, int]:
    """(slots, standbys): the worker's tasks of the platform with a slot, and without one."""
    row = conn.execute(
        """
        SELECT count(*) FILTER (WHERE send_at IS NOT NULL), count(*) FILTER (WHERE send_at IS NULL)
        FROM worker_tasks
        WHERE worker_id = %s AND platform = %s AND status IN ('claimed', 'running')
        """,
        (worker_id, platform),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_standbys_only_for_a_live_worker_without_a_slot_of_a_full_platform(
    conn: psycopg.Connection, queue: TaskQueue
):
    """Nothing for a worker the share does not count, on a platform with a free slot, for a worker
    that holds a slot there (its line is platform_standby's), or on a paused platform; else at most
    two a platform, without a slot, and their first requests get one only within the limits."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0), PlatformLimits("jane", 1, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 8, platform="dutchie"))
    add_platform_tasks(conn, "jane", add_stores(conn, 4, platform="jane"))
    with session(queue, "first"):
        # Not registered: the share does not count it.
        assert queue.platform_standbys(ROLE, "second", 10) == []
        # Neither platform full: a claim would get a slot.
        assert queue.platform_standbys(ROLE, "first", 10) == []
        # Alone, first takes every slot of both.
        claimed = queue.claim_many(ROLE, "first", 10, start=True)
        assert sorted(t.platform or "" for t in claimed) == ["dutchie", "dutchie", "jane"]
        assert in_flight(conn, "dutchie") == (2, 2) and in_flight(conn, "jane") == (1, 1)
        # It holds slots of both: nothing of this kind for it.
        assert queue.platform_standbys(ROLE, "first", 10) == []
        with session(queue, "second"):
            standbys = queue.platform_standbys(ROLE, "second", 10)
            assert sorted(t.platform or "" for t in standbys) == ["dutchie", "dutchie", "jane", "jane"]
            assert all(t.send_at is None and t.status == "running" for t in standbys)
            assert held(conn, "second", "dutchie") == (0, 2) and held(conn, "second", "jane") == (0, 2)
            assert queue.platform_standbys(ROLE, "second", 10) == []  # two a platform
            assert in_flight(conn, "dutchie") == (2, 2) and in_flight(conn, "jane") == (1, 1)

            # A standby's first request: full while first holds every slot; a slot given back
            # goes to one of them, and the next finds the platform full again.
            duts = [t for t in standbys if t.platform == "dutchie"]
            assert [queue.platform_request(t, first=True).decision for t in duts] == ["full", "full"]
            assert queue.platform_release(next(t for t in claimed if t.platform == "dutchie"))
            assert queue.platform_request(duts[0], first=True).decision == "go"
            assert queue.platform_request(duts[1], first=True).decision == "full"
            assert in_flight(conn, "dutchie") == (2, 2)
            assert held(conn, "second", "dutchie") == (1, 1)

            # Jane paused: none there (and second holds a slot of dutchie now).
            queue.platform_pause("jane", 60, "maintenance")
            for t in standbys:
                if t.platform == "jane":
                    assert queue.defer(t, 0)
            assert queue.platform_standbys(ROLE, "second", 10) == []
    assert_platform_counters_consistent(conn)


def test_standbys_claimed_from_many_connections_at_once_stay_two_a_platform(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str
):
    """Sixteen calls at once for one worker, each on its own connection: two standbys of the full
    platform in all, each task claimed once, every claimed store's only active task."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 1, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 40, platform="dutchie"), per_store=2)
    with session(queue, "first"), session(queue, "second"):
        assert len(queue.claim_many(ROLE, "first", 1, start=True)) == 1
        barrier = threading.Barrier(16)

        def call(_: int) -> list[int]:
            with psycopg.connect(db_url, autocommit=True) as c:
                barrier.wait()
                rows = c.execute("SELECT (s.task).id FROM platform_standbys(%s, 'second', 3) s", (ROLE,))
                return [r[0] for r in rows.fetchall()]

        with ThreadPoolExecutor(16) as pool:
            got = [i for ids in pool.map(call, range(16)) for i in ids]
    assert len(got) == len(set(got)) == 2
    assert held(conn, "second", "dutchie") == (0, 2)
    assert in_flight(conn, "dutchie") == (1, 1)
    assert conn.execute(
        """
        SELECT count(*) FROM (
          SELECT dispensary_id FROM worker_tasks WHERE status IN ('claimed', 'running')
          GROUP BY dispensary_id HAVING count(*) > 1) x
        """
    ).fetchone() == (0,)
    assert_platform_counters_consistent(conn)


def test_bad_input_to_platform_standbys_is_refused_and_claims_nothing(
    conn: psycopg.Connection, queue: TaskQueue
):
    queue.sync_platform_limits([PlatformLimits("dutchie", 1, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 4, platform="dutchie"))
    with session(queue, "first"), session(queue, "second"):
        assert len(queue.claim_many(ROLE, "first", 1, start=True)) == 1
        for role, worker_id, most in (
            (ROLE, "second", 0),
            (ROLE, "second", 1001),
            (ROLE, "", 1),
            (ROLE, "x" * 101, 1),
            ("no_such_role", "second", 1),
        ):
            with pytest.raises(QueueInputError):
                queue.platform_standbys(role, worker_id, most)
        assert held(conn, "second", "dutchie") == (0, 0)
        assert len(queue.platform_standbys(ROLE, "second", 1)) == 1


def test_standbys_asked_as_the_worker_role_get_no_slot_beyond_the_limits(
    conn: psycopg.Connection, db_url: str, worker: WorkerRole
):
    """As the worker role `tq grant` makes, through plain SQL: standbys for a worker that is not
    running, for one that holds a slot, and for a live one with a huge count, then their first
    requests, many times over. No slot beyond the limits, no share exceeded, two standbys a worker
    and platform, each store's one active task."""
    with TaskQueue.connect(db_url, max_size=4) as admin:
        admin.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
        add_platform_tasks(conn, "dutchie", add_stores(conn, 20, platform="dutchie"))
        with session(admin, "first"):
            assert len(admin.claim_many(ROLE, "first", 2, start=True)) == 2  # alone: both slots
            with session(admin, "second"), worker.connect() as attacker:
                for victim in ("gone", "first"):
                    rows = attacker.execute(
                        "SELECT (s.task).id FROM platform_standbys(%s, %s, 1000) s", (ROLE, victim)
                    ).fetchall()
                    assert rows == [], victim
                taken = attacker.execute(
                    "SELECT (s.task).id, s.lease FROM platform_standbys(%s, 'second', 1000) s", (ROLE,)
                ).fetchall()
                assert len(taken) == 2
                for _ in range(5):
                    for task_id, lease in taken:
                        decision = attacker.execute(
                            "SELECT decision FROM platform_request(%s, %s, true)", (task_id, lease)
                        ).fetchone()
                        assert decision == ("full",)
                    assert attacker.execute(
                        "SELECT count(*) FROM platform_standbys(%s, 'second', 1000)", (ROLE,)
                    ).fetchone() == (0,)
                assert in_flight(conn, "dutchie") == (2, 2)
                assert held(conn, "first", "dutchie") == (2, 0)
                assert held(conn, "second", "dutchie") == (0, 2)
                assert held(conn, "gone", "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)


def test_a_drain_holding_no_slot_waits_with_standbys_and_sends_when_a_slot_is_given_back(
    conn: psycopg.Connection, queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
):
    """Worker 'first' holds both of dutchie's slots when a drain run of 'second' starts, with only
    dutchie's work due: its claim finds nothing, so it claims two standbys, which wait at their
    requests, sending nothing. When first's pass is refused by its share, a dutchie request of
    second's goes within seconds, though its claims retry only once a minute; then second stops
    and gives back what it did not run, nothing lost or failed, no store left blocked."""
    monkeypatch.setattr(worker_module, "SHORT_RETRY_SECONDS", 60.0)
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 8, platform="dutchie"))
    sent: dict[int, float] = {}

    def handler(task: Task, ctx: TaskContext) -> None:
        assert ctx.permit is not None
        with ctx.permit.request():
            sent[task.id] = time.monotonic()

    with session(queue, "first"):
        a, _ = queue.claim_many(ROLE, "first", 2, start=True)
        s1 = queue.platform_standby(a)
        assert s1 is not None
        second = Worker(queue, ROLE, handler, worker_id="second", concurrency=4, idle_poll_seconds=None)
        thread = threading.Thread(target=second.run)
        thread.start()
        try:
            assert wait_for(lambda: held(conn, "second", "dutchie") == (0, 2), 10)
            time.sleep(0.5)
            assert sent == {} and in_flight(conn, "dutchie") == (2, 2)
            passed = time.monotonic()
            assert queue.platform_pass(a, s1)[0].decision == "full"
            assert wait_for(lambda: bool(sent), 10), "the slot given back was not used"
            assert min(sent.values()) - passed < 10
            # A standby's, or a task the announcement's claim took: either way a slot of its own.
            assert in_flight(conn, "dutchie")[0] <= 2
        finally:
            second.stop()
            thread.join(30)
    assert not thread.is_alive()
    assert second.stats.lost == 0 and second.stats.failed == 0
    assert second.stats.standbys_before_slot >= 2
    # Nothing of second's is still held, and every store it touched is free or ran.
    assert conn.execute(
        "SELECT count(*) FROM worker_tasks WHERE worker_id = 'second' AND status IN ('claimed', 'running')"
    ).fetchone() == (0,)
    assert conn.execute(
        """
        SELECT count(*) FROM worker_task_stores s
        JOIN worker_tasks t ON t.id = s.active_task_id
        WHERE t.status NOT IN ('claimed', 'running')
        """
    ).fetchone() == (0,)
    assert_platform_counters_consistent(conn)
