"""Slots a worker's share gives back, announced to the role's other workers (migration 0032).

When a worker's share shrinks (another worker of the role registered), its passes and hand-offs
give slots back rather than pass them on. Those slots are announced (NOTIFY tq_slot_free), and
the other workers, listening on their session's connection, claim at once rather than at their
next retry. The announcement is a hint, never a permission: a forged one, sent as the worker role
`tq grant` makes, gets nobody a slot beyond the limits.
"""

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from tests.helpers import add_stores, assert_platform_counters_consistent
from tests.integration.test_attacks import Worker as WorkerRole
from tests.integration.test_attacks import make_role, worker  # noqa: F401
from tests.integration.test_platform_limits import add_platform_tasks, in_flight
from tq_pipelines.queue import worker as worker_module
from tq_pipelines.queue.api import PlatformLimits, Task, TaskQueue, WorkerSession
from tq_pipelines.queue.worker import TaskContext, Worker

# The attack test's fixtures, found by pytest where the module imports them: a parameter named
# after one is what ruff calls a redefinition (F811), as in test_lease_attacks.
# ruff: noqa: F811

ROLE = "product_resync"


def announced(listener: psycopg.Connection) -> list[dict[str, str]]:
    """The announcements the listening connection has heard (their commits are done)."""
    return [json.loads(n.payload) for n in listener.notifies(timeout=0.2)]


@contextmanager
def session(queue: TaskQueue, worker_id: str) -> Iterator[WorkerSession]:
    """A live registration of the role: the fair share counts it."""
    s = queue.open_session(worker_id, ROLE, hostname="h", heartbeat_seconds=30)
    try:
        yield s
    finally:
        s.close()


def test_only_a_slot_the_share_gives_back_is_announced(
    conn: psycopg.Connection, queue: TaskQueue, db_url: str
):
    """A pass and a hand-off that the share refuses announce their slot, once, naming the role,
    platform and worker; a pass of a lone worker, a pass within the share and a pass refused by
    a pause announce nothing."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 8, platform="dutchie"))
    one = {"role": ROLE, "platform": "dutchie", "worker": "first"}
    with psycopg.connect(db_url, autocommit=True) as listener, session(queue, "first"):
        listener.execute("LISTEN tq_slot_free")
        a, b = queue.claim_many(ROLE, "first", 2, start=True)
        s1, s2, s3 = (queue.platform_standby(t) for t in (a, b, a))
        assert s1 is not None and s2 is not None and s3 is not None
        # Alone, its share is both slots: the pass goes.
        assert queue.platform_pass(a, s1)[0].decision == "go"
        assert announced(listener) == []

        with session(queue, "second"):
            # Its share is now one slot of two: the pass of one of its two gives the slot back.
            assert queue.platform_relay(s1, s3)[0].decision == "full"
            assert announced(listener) == [one]
            assert in_flight(conn, "dutchie") == (1, 1)
            # Within its share: the last slot is passed on, and nothing is announced.
            assert queue.platform_pass(b, s2)[0].decision == "go"
            assert announced(listener) == []

        # Alone again, it takes the second slot back; a second worker comes, and its hand-off
        # finds no room in its share: the slot goes back, announced.
        [d] = queue.claim_many(ROLE, "first", 1, start=True)
        assert in_flight(conn, "dutchie") == (2, 2)
        with session(queue, "second"):
            assert queue.platform_handoff(d) is None
            assert announced(listener) == [one]
            assert in_flight(conn, "dutchie") == (1, 1)

            # Paused: a pass gives the slot back for nobody to take, and announces nothing.
            queue.platform_pause("dutchie", 60, "maintenance")
            assert queue.platform_pass(s2, s3)[0].decision == "paused"
            assert announced(listener) == []
            assert in_flight(conn, "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@contextmanager
def second_waits_for_dutchie(
    conn: psycopg.Connection, queue: TaskQueue, admin: TaskQueue
) -> Iterator[tuple[Task, Task, Worker, dict[str, float]]]:
    """Dutchie's 2 slots held by worker 'first' (its task ``a`` and a standby ``s1`` of it), and a
    drain run of worker 'second' that holds jane's one slot (its handler waits) and has claimed
    nothing of dutchie: its claim came back short, and it would claim again only at its retry.
    Yields ``(a, s1, second, began)``, ``began`` when second's first request of each platform
    went; then second stops, having lost and failed nothing."""
    admin.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0), PlatformLimits("jane", 1, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 4, platform="dutchie"))
    began: dict[str, float] = {}
    release = threading.Event()

    def handler(task: Task, ctx: TaskContext) -> None:
        assert ctx.permit is not None
        with ctx.permit.request():
            began.setdefault(task.platform or "", time.monotonic())
        if task.platform == "jane":
            release.wait(60)

    with session(queue, "first"):
        a, _ = queue.claim_many(ROLE, "first", 2, start=True)
        s1 = queue.platform_standby(a)
        assert s1 is not None
        add_platform_tasks(conn, "jane", add_stores(conn, 1, platform="jane"))
        second = Worker(queue, ROLE, handler, worker_id="second", concurrency=4, idle_poll_seconds=None)
        thread = threading.Thread(target=second.run)
        thread.start()
        try:
            assert wait_for(lambda: "jane" in began, 10) and "dutchie" not in began
            yield a, s1, second, began
        finally:
            release.set()
            second.stop()
            thread.join(30)
        assert second.stats.lost == 0 and second.stats.failed == 0


def test_a_slot_another_workers_share_gives_back_is_claimed_at_once(
    conn: psycopg.Connection, queue: TaskQueue, monkeypatch: pytest.MonkeyPatch
):
    """The first worker holds both of dutchie's slots when a second starts; the second's claim
    comes back short, and it would claim again only a minute later. The first's next pass is
    refused by its share, and the second claims that slot at once, having heard of it."""
    monkeypatch.setattr(worker_module, "SHORT_RETRY_SECONDS", 60.0)
    with second_waits_for_dutchie(conn, queue, queue) as (a, s1, _, began):
        time.sleep(0.5)  # its loop is waiting now
        assert "dutchie" not in began
        passed = time.monotonic()
        assert queue.platform_pass(a, s1)[0].decision == "full"
        # Heard at once: well within the minute its retry would have taken.
        assert wait_for(lambda: "dutchie" in began, 10), "the slot given back was not claimed"
        assert began["dutchie"] - passed < 10
    assert_platform_counters_consistent(conn)


def test_a_forged_announcement_gets_no_slot_beyond_the_limits(
    conn: psycopg.Connection, db_url: str, worker: WorkerRole, monkeypatch: pytest.MonkeyPatch
):
    """As the worker role `tq grant` makes, through plain SQL: announcements of dutchie, full,
    naming its holder, and payloads that are not the queue's. The listening worker (connected as
    that role too) claims on the forged one and gets nothing; it ignores the others, and it still
    claims on the real one that follows."""
    monkeypatch.setattr(worker_module, "SHORT_RETRY_SECONDS", 60.0)
    with TaskQueue.connect(db_url, max_size=4) as admin, TaskQueue.connect(worker.url, max_size=8) as queue:
        with second_waits_for_dutchie(conn, queue, admin) as (a, s1, second, began):
            with worker.connect() as attacker:
                claims = second.stats.claims
                for payload in (
                    "not json",
                    "[]",
                    json.dumps({"role": ROLE, "platform": 7, "worker": "x"}),
                    json.dumps({"role": "analytics", "platform": "dutchie", "worker": "x"}),
                ):
                    attacker.execute("SELECT pg_notify('tq_slot_free', %s)", (payload,))
                time.sleep(0.5)
                assert second.stats.claims == claims, "a payload not the queue's woke the worker"
                attacker.execute(
                    "SELECT pg_notify('tq_slot_free', %s)",
                    (json.dumps({"role": ROLE, "platform": "dutchie", "worker": "first"}),),
                )
                # Heard: it claimed, and got no slot of a full platform (standbys at most, 0035,
                # which send nothing until a slot is theirs).
                assert wait_for(lambda: second.stats.claims > claims, 10)
                time.sleep(0.3)
                assert "dutchie" not in began
                assert in_flight(conn, "dutchie") == (2, 2)
                assert conn.execute(
                    "SELECT count(*) FROM worker_tasks WHERE worker_id = 'second'"
                    " AND platform = 'dutchie' AND status IN ('claimed', 'running')"
                    " AND send_at IS NOT NULL"
                ).fetchone() == (0,)
            # The real one, after all that: still heard, and the slot is claimed.
            assert queue.platform_pass(a, s1)[0].decision == "full"
            assert wait_for(lambda: "dutchie" in began, 10), "the listener stopped hearing"
        assert in_flight(conn, "dutchie")[0] <= 2
    assert_platform_counters_consistent(conn)
