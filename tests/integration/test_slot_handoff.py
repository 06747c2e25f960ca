"""Slots handed from one task to the next, runs sharing a platform, and requests abandoned at
their client's timeout (migration 0016), measured where the requests land: the menu simulator's
real HTTP servers log every request's arrival and departure.

- a task done with its requests hands its slot to the next task of its platform at once: the
  drain claims one task at a time from its handler threads, and no server sees more than
  max_in_flight;
- four drain runs on one platform each get about a quarter of its requests;
- a request the client gave up on keeps its slot taken, in PostgreSQL, until the platform's own
  timeout has passed: the server never has more requests in flight than the limit, and a
  worker of another process cannot take the slot meanwhile.
"""

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.dagster_helpers import failure_text, op_metadata
from tests.helpers import add_stores, assert_store_state_consistent, status_counts
from tests.integration.test_crawl_dagster import add_simulated_stores, drain
from tests.integration.test_crawl_politeness import (  # noqa: F401 (fixtures)
    PLATFORMS,
    ROLE,
    assert_no_slots_held,
    clean_env,
    drains_at_once,
    platforms_file,
    simulate,
)
from tq_pipelines.queue.api import PlatformLimits, TaskQueue
from tq_pipelines_demo.simulator import SimulatorProcess, politeness_report


def only(conn: psycopg.Connection, platform: str) -> None:
    """Leave the tasks of one platform."""
    conn.execute("DELETE FROM worker_tasks WHERE platform <> %s", (platform,))


def test_a_freed_slot_goes_to_the_next_task_of_its_platform_at_once(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],  # noqa: F811 (the fixture)
    tmp_path: Path,
):
    stores, max_in_flight = 30, 3
    sim = simulate(stores=stores, latency_ms=40)
    limits = {"max_in_flight": max_in_flight, "requests_per_second": 1000, "timeout_seconds": 5}
    path = platforms_file(tmp_path, sim, dict.fromkeys(PLATFORMS, limits))
    platform_of = add_simulated_stores(conn, queue, sim)

    result = drain(db_url, ROLE, path)
    assert result.success, failure_text(result)
    meta = op_metadata(result, "drain_role_tasks")
    assert (meta["completed"], meta["retried"], meta["failed"], meta["lost"]) == (len(platform_of), 0, 0, 0)

    # The main loop's claims take up to a thread per free slot at once, and share a claimed_at;
    # a hand-off takes one task in a transaction of its own. Most tasks came by hand-off.
    claims = conn.execute(
        "SELECT count(*) FROM v_tasks WHERE role = %s GROUP BY claimed_at", (ROLE,)
    ).fetchall()
    singles = sum(1 for (n,) in claims if n == 1)
    assert singles >= len(platform_of) // 2, claims

    # Each task's slot went to the next as its request ended: at each server, never more than the
    # limit in flight, and every store asked once.
    for name, platform in sim.platforms.items():
        log = platform.request_log()
        report = politeness_report(
            log, max_in_flight=max_in_flight, requests_per_second=1000, burst=max_in_flight
        )
        assert Counter(status for _, _, status in log) == {200: stores}, name
        assert report["max_in_flight"] <= max_in_flight and report["over_in_flight"] == 0, (name, report)
    assert_no_slots_held(conn)


def test_drain_runs_share_a_platform_evenly(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],  # noqa: F811 (the fixture)
    tmp_path: Path,
):
    stores, max_in_flight, runs = 160, 4, 4
    sim = simulate(stores=stores, latency_ms=50)
    limits = {"max_in_flight": max_in_flight, "requests_per_second": 1000, "timeout_seconds": 5}
    path = platforms_file(tmp_path, sim, {"dutchie": limits})
    add_simulated_stores(conn, queue, sim)
    only(conn, "dutchie")

    # Each run has threads for every slot (twice the limit): only the shares keep one run from
    # holding them all and handing them to itself.
    results = drains_at_once(db_url, path, runs)
    metas = [op_metadata(r, "drain_role_tasks") for r in results]
    assert sum(m["completed"] for m in metas) == stores
    per_run = [
        n
        for (n,) in conn.execute(
            "SELECT count(*) FROM v_tasks WHERE status = 'completed' GROUP BY worker_id ORDER BY 1"
        ).fetchall()
    ]
    assert len(per_run) == runs, per_run
    # A fair share is a quarter (40); runs begin a little apart, and the first to begin pass their
    # slots on at once (relays, 0031) while the last are still starting, so allow a wide band
    # over a crawl long enough for the shares to settle.
    assert min(per_run) >= stores / runs / 2, per_run
    assert max(per_run) <= stores / runs * 2, per_run

    report = politeness_report(
        sim.platforms["dutchie"].request_log(), max_in_flight=max_in_flight, requests_per_second=1000, burst=4
    )
    assert report["requests"] == stores
    assert report["max_in_flight"] <= max_in_flight and report["over_in_flight"] == 0, report
    assert_no_slots_held(conn)


SERVER_SECONDS = 1.5  # how long the slow platform takes over each request


def test_a_timed_out_request_keeps_its_slot_until_the_platform_is_done_with_it(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],  # noqa: F811 (the fixture)
    tmp_path: Path,
):
    # One slot; every request outlasts the client's timeout (0.3 s) and runs on at the server for
    # 1.5 s; the platform's own timeout is 2 s. Were the slot freed at the timeout, the next task
    # would reach the server while the first still runs there: two in flight.
    sim = simulate(stores=3, latency_ms=SERVER_SECONDS * 1000, dutchie={"jitter": 0.0})
    limits = {
        "max_in_flight": 1,
        "requests_per_second": 100,
        "timeout_seconds": 0.3,
        "server_timeout_seconds": 2.0,
        "pause_after_errors": 100,  # the breaker stays out of it
    }
    path = platforms_file(tmp_path, sim, {"dutchie": limits})
    add_simulated_stores(conn, queue, sim)
    only(conn, "dutchie")

    began = time.monotonic()
    result = drain(db_url, ROLE, path, platform_wait_seconds=15)
    assert result.success, failure_text(result)
    meta = op_metadata(result, "drain_role_tasks")
    assert meta["retried"] == 3, meta  # each timed out once, and waits for its retry
    # The three requests went one after another, each after the one before had its 1.7 s.
    assert time.monotonic() - began >= 2 * 1.7

    time.sleep(SERVER_SECONDS)  # the last request ends at the server
    log = sim.platforms["dutchie"].request_log()
    assert len(log) == 3, log
    report = politeness_report(log, max_in_flight=1, requests_per_second=100, burst=1)
    assert report["max_in_flight"] == 1 and report["over_in_flight"] == 0, (report, log)
    arrivals = sorted(a for a, _, _ in log)
    departures = sorted(d for _, d, _ in log)
    assert all(arrivals[i + 1] >= departures[i] for i in range(2)), log
    assert conn.execute("SELECT in_flight FROM tq_platforms WHERE platform = 'dutchie'").fetchone() == (0,)


def test_a_hold_outlives_its_task_and_binds_every_claimer(conn: psycopg.Connection, queue: TaskQueue):
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=1, requests_per_second=100)])
    for i in range(2):
        [store] = conn.execute(
            "INSERT INTO dispensaries (name, menu_type) VALUES (%s, 'dutchie') RETURNING id", (f"s{i}",)
        ).fetchone()
        queue.enqueue(ROLE, store, platform="dutchie")
    [task] = queue.claim_many(ROLE, "here", 1, start=True)
    assert queue.platform_request(task, first=True).decision == "go"

    # The client gives up; the platform may serve the request 1.5 s more. The task then fails
    # and this worker is gone: nothing of this process frees the slot before its time.
    assert queue.platform_abandon(task, 1.5)
    assert not queue.platform_abandon(task, 1.5)  # its slot is a hold already
    assert queue.fail(task, "timeout", retry_after=60) == "pending"
    [row] = conn.execute(
        "SELECT in_flight, held_after_timeout, state FROM v_platform_status WHERE platform = 'dutchie'"
    ).fetchall()
    assert row == (0, 1, "full")
    assert queue.claim_many(ROLE, "elsewhere", 5, start=True) == []
    assert queue.claimable()[ROLE][1] == 0
    assert 0 < queue.claim_wait(ROLE) <= 0.25  # type: ignore[operator]

    time.sleep(1.6)
    [other] = queue.claim_many(ROLE, "elsewhere", 5, start=True)
    assert other.platform == "dutchie"
    [row] = conn.execute(
        "SELECT in_flight, held_after_timeout FROM v_platform_status WHERE platform = 'dutchie'"
    ).fetchall()
    assert row == (1, 0)

    # A hold of a task no longer held is refused, and a bad length in words.
    assert not queue.platform_abandon(task, 1.0)
    with pytest.raises(Exception, match="busy_seconds"):
        queue.platform_abandon(other, -1)


def test_a_hand_off_takes_a_task_only_within_the_workers_share(conn: psycopg.Connection, queue: TaskQueue):
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=2, requests_per_second=1000)])
    for i in range(6):
        [store] = conn.execute(
            "INSERT INTO dispensaries (name, menu_type) VALUES (%s, 'dutchie') RETURNING id", (f"s{i}",)
        ).fetchone()
        queue.enqueue(ROLE, store, platform="dutchie")
    first = queue.open_session("first", ROLE, hostname="h", heartbeat_seconds=30)
    try:
        held = queue.claim_many(ROLE, "first", 5, start=True)
        assert len(held) == 2  # alone: the whole limit
        nxt = queue.platform_handoff(held[0])
        assert nxt is not None and nxt.worker_id == "first" and nxt.send_at is not None
        assert conn.execute("SELECT in_flight FROM tq_platforms").fetchone() == (2,)

        # A second live worker of the role: each may hold one slot. "first" holds two, so its
        # hand-offs give slots back until it is within its share, and the other claims them.
        second = queue.open_session("second", ROLE, hostname="h", heartbeat_seconds=30)
        try:
            assert queue.claim_many(ROLE, "second", 5, start=True) == []
            assert queue.platform_handoff(nxt) is None
            [theirs] = queue.claim_many(ROLE, "second", 5, start=True)
            assert queue.platform_handoff(held[1]) is not None  # within its share of one
            assert queue.platform_handoff(theirs) is not None
            assert conn.execute("SELECT in_flight FROM tq_platforms").fetchone() == (2,)
        finally:
            second.close()
    finally:
        first.close()
    # A task that gave its slot back already hands nothing off.
    assert queue.platform_handoff(held[0]) is None


def test_a_hand_off_or_a_hold_needs_the_tasks_lease(conn: psycopg.Connection, queue: TaskQueue):
    """Forged, missing or stale tokens: nothing released, claimed or held."""
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=2, requests_per_second=1000)])
    stores = [
        conn.execute(
            "INSERT INTO dispensaries (name, menu_type) VALUES (%s, 'dutchie') RETURNING id", (f"s{i}",)
        ).fetchone()[0]  # type: ignore[index]
        for i in range(3)
    ]
    for store in stores[:2]:
        queue.enqueue(ROLE, store, platform="dutchie")
    [stale] = queue.claim_many(ROLE, "victim", 1, start=True)
    assert queue.defer(stale, 0)
    [task] = [t for t in queue.claim_many(ROLE, "victim", 2, start=True) if t.id == stale.id]
    queue.enqueue(ROLE, stores[2], platform="dutchie")  # what a hand-off would take

    def state() -> list[tuple[object, ...]]:
        return conn.execute(
            "SELECT (SELECT in_flight FROM tq_platforms), (SELECT busy_until FROM tq_platforms), "
            "array_agg((id, status, worker_id, send_at IS NULL) ORDER BY id) FROM v_tasks"
        ).fetchall()

    before = state()
    for lease in (uuid.uuid4(), None, stale.lease_token):
        params = {"task_id": task.id, "lease": lease}
        assert conn.execute(
            "SELECT count(*) FROM platform_handoff(%(task_id)s, %(lease)s::UUID)", params
        ).fetchone() == (0,)
        assert conn.execute(
            "SELECT platform_abandon(%(task_id)s, %(lease)s::UUID, 60)", params
        ).fetchone() == (False,)
        assert state() == before, lease
    # With its own token, the hand-off acts: the slot went back and the last task took it.
    nxt = queue.platform_handoff(task)
    assert nxt is not None and nxt.id not in (task.id,)
    assert state() != before


def test_slot_bookkeeping_commits_without_its_flush_unless_its_transaction_wrote(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """0025: a hand-off, a start or a release alone in its transaction does not wait for the WAL
    flush; called after the caller's own writes, it leaves that transaction's flush as it was."""
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight=2, requests_per_second=1000)])
    for store in add_stores(conn, 4):
        queue.enqueue(ROLE, store, platform="dutchie")
    first, second = queue.claim_many(ROLE, "w", 2, start=True)
    calls = {
        "request": ("SELECT decision FROM platform_request(%(task_id)s, %(lease)s, true)", first),
        "handoff": ("SELECT (h.task).id FROM platform_handoff(%(task_id)s, %(lease)s) h", first),
        "release": ("SELECT platform_release(%(task_id)s, %(lease)s)", second),
    }
    with psycopg.connect(db_url) as c:  # a transaction per call
        for name, (sql, task) in calls.items():
            params = {"task_id": task.id, "lease": task.lease_token}
            # After the caller's own write: its commit keeps its flush (and rolls back here).
            c.execute("UPDATE dispensaries SET name = name WHERE id = %s", (task.dispensary_id,))
            assert c.execute(sql, params).fetchone() is not None
            assert c.execute("SHOW synchronous_commit").fetchone() == ("on",), name
            c.rollback()
            # Alone: no flush wait, and what it did commits.
            assert c.execute(sql, params).fetchone() is not None
            assert c.execute("SHOW synchronous_commit").fetchone() == ("off",), name
            c.commit()
            assert c.execute("SHOW synchronous_commit").fetchone() == ("on",), name
            c.rollback()
    # The hand-off passed first's slot on, the release gave second's back: one slot held.
    assert conn.execute("SELECT in_flight FROM tq_platforms").fetchone() == (1,)
    assert conn.execute(
        "SELECT count(*) FROM v_tasks WHERE status = 'running' AND send_at IS NOT NULL"
    ).fetchone() == (1,)


def test_hand_offs_from_many_connections_take_each_task_once_within_the_limits(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """Six threads, each its own connection, two workers of three slots each, hand their slots
    on until the platform's 300 tasks are taken (0026: one UPDATE moves a slot): each task is
    taken once, the platform never counts more than its limit, nor a worker more than its
    share, and every slot is back at the end."""
    stores, max_in_flight = 300, 6
    queue.sync_platform_limits(
        [PlatformLimits("dutchie", max_in_flight=max_in_flight, requests_per_second=10_000)]
    )
    conn.execute(
        "INSERT INTO dispensaries (name, menu_type) SELECT 's' || g, 'dutchie' FROM generate_series(1, %s) g",
        (stores,),
    )
    conn.execute("SELECT enqueue_task_once(%s, d.id, 'dutchie', 0, NULL, NULL) FROM dispensaries d", (ROLE,))
    sessions = [queue.open_session(w, ROLE, hostname="h", heartbeat_seconds=30) for w in ("a", "b")]
    try:
        held = [t for w in ("a", "b") for t in queue.claim_many(ROLE, w, max_in_flight, start=True)]
        assert sorted(Counter(t.worker_id for t in held).values()) == [3, 3]
        taken: list[list[int]] = [[t.id] for t in held]
        stop = threading.Event()
        over: list[tuple[object, ...]] = []

        def watch() -> None:
            with psycopg.connect(db_url, autocommit=True) as c:
                while not stop.is_set():
                    row = c.execute(
                        "SELECT (SELECT in_flight FROM tq_platforms),"
                        " (SELECT max(n) FROM (SELECT count(*) AS n FROM worker_tasks"
                        "  WHERE send_at IS NOT NULL AND status = 'running' GROUP BY worker_id) w)"
                    ).fetchone()
                    if row is not None and (row[0] > max_in_flight or (row[1] or 0) > 3):
                        over.append(row)

        def hand_on(many: TaskQueue, i: int) -> None:
            task = held[i]
            while (nxt := many.platform_handoff(task)) is not None:
                assert nxt.worker_id == task.worker_id
                taken[i].append(nxt.id)
                task = nxt

        with TaskQueue.connect(db_url, min_size=max_in_flight, max_size=max_in_flight) as many:
            watcher = threading.Thread(target=watch)
            watcher.start()
            threads = [threading.Thread(target=hand_on, args=(many, i)) for i in range(max_in_flight)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            stop.set()
            watcher.join()
    finally:
        for s in sessions:
            s.close()
    ids = [i for chain in taken for i in chain]
    assert len(ids) == len(set(ids)) == stores
    assert over == []
    assert conn.execute("SELECT in_flight FROM tq_platforms").fetchone() == (0,)
    assert status_counts(conn) == {"running": stores}
    assert_store_state_consistent(conn)
