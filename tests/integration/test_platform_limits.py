"""Per-platform limits kept in PostgreSQL (migration 0006): claims respect every platform's slots,
rate and pause whatever connection they come from; the counters follow the tasks on every path;
the breaker pauses, probes and closes, told only by tasks held under their lease (migration 0013),
its pauses bounded; the admin pauses and resumes by hand; a dead claimer's slots come back with
its lease."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.helpers import (
    add_stores,
    assert_platform_counters_consistent,
    assert_store_state_consistent,
    status_counts,
)
from tq_pipelines.queue.api import Lease, PlatformLimits, QueueInputError, Task, TaskQueue
from tq_pipelines.queue.worker import DeferTask, TaskContext, Worker

ROLE = "product_resync"
OTHER_ROLE = "store_discovery"  # another worker's tasks, of no store
ROOT = Path(__file__).resolve().parents[2]
FAST = 10_000.0  # requests per second high enough that the rate never binds


def add_platform_tasks(
    conn: psycopg.Connection,
    platform: str | None,
    stores: Sequence[int | None],
    *,
    per_store: int = 1,
    age_seconds: float = 60.0,
) -> list[int]:
    """``per_store`` pending tasks of ROLE and ``platform`` for each store (None: a store-less
    task), due in that order: the first ``age_seconds`` ago, each next one a millisecond later.
    Returns their ids, oldest due first."""
    rows = conn.execute(
        """
        INSERT INTO worker_tasks (role, dispensary_id, platform, scheduled_for)
        SELECT %(role)s, s.id, %(platform)s,
               now() - make_interval(secs => %(age)s)
                 + make_interval(secs => 0.001 * ((s.n - 1) * %(per)s + k))
        FROM unnest(%(stores)s::int[]) WITH ORDINALITY AS s (id, n)
        CROSS JOIN generate_series(1, %(per)s) AS k
        ORDER BY s.n, k
        RETURNING id, due_at
        """,
        {"role": ROLE, "platform": platform, "stores": stores, "per": per_store, "age": age_seconds},
    ).fetchall()
    return [r[0] for r in sorted(rows, key=lambda r: r[1])]


def another_workers_task(queue: TaskQueue, platform: str) -> Task:
    """A task of ``platform`` that another worker ("other") holds, done with its requests (its
    slot given back): it reports to the breaker what that worker meets (a platform's errors are
    reported by a held task, on its own platform). A store_discovery task of no store, so that
    claims of ROLE never take it. Call while the platform is open and has room."""
    queue.enqueue(OTHER_ROLE, platform=platform)
    (task,) = queue.claim_many(OTHER_ROLE, "other", 1, start=True)
    assert task.platform == platform
    if task.send_at is not None:
        assert queue.platform_release(task)
    return task


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT now()").fetchone()[0]


def platform_row(conn: psycopg.Connection, platform: str) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT * FROM tq_platforms WHERE platform = %s", (platform,)).fetchone()
    assert row is not None, platform
    return row


def status_of(queue: TaskQueue, platform: str) -> dict[str, Any]:
    (row,) = [r for r in queue.platform_status() if r["platform"] == platform]
    return row


def in_flight(conn: psycopg.Connection, platform: str) -> tuple[int, int]:
    """(tq_platforms.in_flight, the platform's tasks holding a slot: claimed or running with a
    send_at), from one snapshot."""
    return conn.execute(
        """
        SELECT l.in_flight,
               (SELECT count(*) FROM v_tasks t
                WHERE t.platform = l.platform AND t.status IN ('claimed', 'running')
                  AND t.send_at IS NOT NULL)::int
        FROM tq_platforms l WHERE l.platform = %s
        """,
        (platform,),
    ).fetchone()


# -- many claimers at once ---------------------------------------------------------------------


def _watch_platforms(
    db_url: str,
    caps: dict[str, int],
    stop: threading.Event,
    peaks: Counter[str],
    over: list[tuple[str, int]],
    drift: list[tuple[str, int, int]],
    samples: list[int],
) -> None:
    """Sample the tasks in flight per platform while the claimers run: note each platform's
    peak, any sample over its limit, and any snapshot where a counter disagrees with the tasks."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        while not stop.wait(0.003):
            samples[0] += 1
            for platform, n in conn.execute(
                """
                SELECT platform, count(*)::int FROM v_tasks
                WHERE status IN ('claimed', 'running') GROUP BY platform
                """
            ).fetchall():
                peaks[platform] = max(peaks[platform], n)
                if platform in caps and n > caps[platform]:
                    over.append((platform, n))
            drift.extend(
                conn.execute(
                    """
                    SELECT l.platform, l.in_flight, a.n
                    FROM tq_platforms l
                    CROSS JOIN LATERAL (SELECT count(*)::int AS n FROM v_tasks t
                                        WHERE t.platform = l.platform
                                          AND t.status IN ('claimed', 'running')
                                          AND t.send_at IS NOT NULL) a
                    WHERE l.in_flight <> a.n
                    """
                ).fetchall()
            )


def test_16_claimers_never_exceed_any_platforms_max_in_flight(db_url: str, conn: psycopg.Connection):
    """16 connections claim, hold and complete over three limited platforms and one without a
    row: no sample ever shows a limited platform over its max_in_flight (each reaches it), the
    unlimited one goes past every limit, every task is completed exactly once, and the counters
    match the tasks at every sample and end at 0."""
    caps = {"alpha": 3, "beta": 4, "gamma": 5}
    stores_per_platform, per_store, workers = 30, 4, 16
    total = 0
    for platform in [*caps, "unlimited"]:
        stores = add_stores(conn, stores_per_platform, platform=platform)
        total += len(add_platform_tasks(conn, platform, stores, per_store=per_store))

    claimed: list[list[int]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    finished = [0]
    lock = threading.Lock()
    peaks: Counter[str] = Counter()
    over: list[tuple[str, int]] = []
    drift: list[tuple[str, int, int]] = []
    samples = [0]
    stop = threading.Event()
    deadline = time.monotonic() + 60

    with TaskQueue.connect(db_url, min_size=workers, max_size=workers) as queue:
        queue.sync_platform_limits([PlatformLimits(p, n, FAST) for p, n in caps.items()])

        def work(n: int) -> None:
            worker_id = f"w{n}"
            try:
                while time.monotonic() < deadline:
                    tasks = queue.claim_many(ROLE, worker_id, 8, start=True)
                    if not tasks:
                        with lock:
                            if finished[0] >= total:
                                return
                        time.sleep(0.002)
                        continue
                    assert {t.status for t in tasks} == {"running"}
                    claimed[n].extend(t.id for t in tasks)
                    time.sleep(0.003)
                    done = queue.complete_many({t.lease: {"by": worker_id} for t in tasks})
                    assert done == {t.id for t in tasks}
                    with lock:
                        finished[0] += len(done)
            except BaseException as exc:
                errors.append(exc)

        watcher = threading.Thread(
            target=_watch_platforms, args=(db_url, caps, stop, peaks, over, drift, samples)
        )
        watcher.start()
        threads = [threading.Thread(target=work, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()

    assert errors == []
    assert samples[0] >= 20, "the watcher should have sampled throughout"
    assert over == [], "a platform had more tasks in flight than its max_in_flight"
    assert drift == [], "a counter disagreed with the tasks in flight in a committed snapshot"
    assert {p: peaks[p] for p in caps} == caps, "the claimers should have filled every platform"
    assert peaks["unlimited"] > max(caps.values()), "a platform without a row must not be limited"
    all_claimed = Counter(i for ids in claimed for i in ids)
    assert len(all_claimed) == total
    assert max(all_claimed.values()) == 1, "a task was claimed twice"
    assert status_counts(conn) == {"completed": total}
    wrong_owner = conn.execute("SELECT count(*) FROM v_tasks WHERE result->>'by' <> worker_id").fetchone()
    assert wrong_owner == (0,)
    counters = dict(conn.execute("SELECT platform, in_flight FROM tq_platforms").fetchall())
    assert counters == dict.fromkeys(caps, 0)
    # Limited platforms' tasks were given a start; the unlimited platform's were not.
    send_ats = conn.execute(
        """
        SELECT platform, bool_and(send_at IS NOT NULL), bool_and(send_at IS NULL)
        FROM v_tasks GROUP BY platform
        """
    ).fetchall()
    assert {p: (with_start, without) for p, with_start, without in send_ats} == {
        **dict.fromkeys(caps, (True, False)),
        "unlimited": (False, True),
    }
    assert_store_state_consistent(conn)
    assert_platform_counters_consistent(conn)


def test_request_starts_given_by_claims_never_exceed_the_platform_rate(db_url: str, conn: psycopg.Connection):
    """16 connections claim and complete a rate-limited platform's tasks for 2.5 s: the starts the
    claims hand out (send_at) obey the GCRA (in any window, at most burst + rate * length, even
    for requests sent up to 0.1 s late) and lie within a second of their claim, the first claim
    starts a burst at once, and the claims keep handing out about all the rate allows."""
    rate, burst, workers = 20.0, 5, 16
    stores = add_stores(conn, 300, platform="paced")
    add_platform_tasks(conn, "paced", stores)
    claimed: list[int] = []
    errors: list[BaseException] = []

    with TaskQueue.connect(db_url, min_size=workers, max_size=workers) as queue:
        queue.sync_platform_limits([PlatformLimits("paced", 50, rate, burst)])
        stop_at = time.monotonic() + 2.5

        def work(n: int) -> None:
            worker_id = f"w{n}"
            try:
                while time.monotonic() < stop_at:
                    tasks = queue.claim_many(ROLE, worker_id, 8, start=True)
                    if not tasks:
                        time.sleep(0.005)
                        continue
                    claimed.extend(t.id for t in tasks)
                    assert all(t.send_at is not None for t in tasks)
                    assert queue.complete_many({t.lease: None for t in tasks}) == {t.id for t in tasks}
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    assert errors == []
    assert len(claimed) == len(set(claimed))
    rows = conn.execute("SELECT send_at FROM v_tasks WHERE status <> 'pending' ORDER BY send_at").fetchall()
    assert len(rows) == len(claimed)
    assert all(r[0] is not None for r in rows)
    # A claim gives out the starts of the coming second only: no task waits longer for its first.
    ahead = conn.execute(
        """
        SELECT max(extract(EPOCH FROM send_at - claimed_at))::float
        FROM v_tasks WHERE status <> 'pending'
        """
    ).fetchone()[0]
    assert 0 < ahead <= 1.0 + 1e-6
    sends = [r[0].timestamp() for r in rows]
    n = len(sends)
    # GCRA: any j - i + 1 starts span at least (j - i + 1 - burst) emission intervals.
    too_close = [
        (i, j, sends[j] - sends[i])
        for i in range(n)
        for j in range(i + 1, n)
        if sends[j] - sends[i] < (j - i - (burst - 1)) / rate - 1e-6
    ]
    assert too_close == [], f"starts closer than the rate allows: {too_close[:5]}"
    per_second = max(sum(1 for s in sends if t <= s < t + 1.0) for t in sends)
    assert per_second <= burst + rate
    # The tolerance keeps 0.1 s in hand (tq_platform_tolerance): requests that leave up to 0.1 s
    # after their start still make at most rate + burst in any second at the platform.
    late_per_second = max(sum(1 for s in sends if t <= s < t + 1.1) for t in sends)
    assert late_per_second <= burst + rate
    assert 1 < sends.count(sends[0]) <= burst, "after an idle spell, a burst should start at once"
    span = sends[-1] - sends[0]
    assert span >= 2.0, f"claims stopped handing out starts early: {span:.2f} s of starts"
    assert n >= 0.8 * (rate * span + burst), f"{n} starts over {span:.2f} s: the rate allows more"
    assert_platform_counters_consistent(conn)


def test_a_first_request_past_its_start_takes_the_next_one(conn: psycopg.Connection, queue: TaskQueue):
    """A claim gives three tasks the starts 0, 0.25 and 0.5 s (4/s, burst 1: a grace of 0.125 s).
    Asked 0.2 s in, the second task keeps its start; the first, past its own by more than the
    grace, is given the next start after all three, and the platform's pace moves one interval."""
    queue.sync_platform_limits([PlatformLimits("paced", 10, 4.0, 1)])
    add_platform_tasks(conn, "paced", add_stores(conn, 3, platform="paced"))
    tasks = sorted(queue.claim_many(ROLE, "w1", 3, start=True), key=lambda t: t.send_at or db_now(conn))
    [first, second, third] = tasks
    assert [t.send_at is not None for t in tasks] == [True] * 3
    tat = platform_row(conn, "paced")["tat"]
    assert (tat - first.send_at).total_seconds() == pytest.approx(0.75, abs=1e-3)

    time.sleep(max(0.0, 0.2 - (db_now(conn) - first.send_at).total_seconds()))
    kept = queue.platform_request(second, first=True)
    assert kept.decision == "go"
    assert 0 < kept.wait_seconds <= 0.05 + 1e-3
    assert platform_row(conn, "paced")["tat"] == tat

    moved = queue.platform_request(first, first=True)
    now = db_now(conn)
    assert moved.decision == "go"
    # Its new start: the platform's next, after the third task's (0.5 s).
    assert moved.wait_seconds == pytest.approx((tat - now).total_seconds(), abs=0.02)
    assert (tat - third.send_at).total_seconds() == pytest.approx(0.25, abs=1e-3)
    assert (platform_row(conn, "paced")["tat"] - tat).total_seconds() == pytest.approx(0.25, abs=1e-3)
    assert in_flight(conn, "paced") == (3, 3)


# -- one claim over several platforms ----------------------------------------------------------


def _queue_platforms_in_order(conn: psycopg.Connection, queue: TaskQueue) -> dict[str, list[int]]:
    """Three platforms (max_in_flight 3), five tasks each: all of alpha due first, then beta,
    then gamma."""
    queue.sync_platform_limits([PlatformLimits(p, 3, FAST) for p in ("alpha", "beta", "gamma")])
    return {
        p: add_platform_tasks(conn, p, add_stores(conn, 5, platform=p), age_seconds=age)
        for p, age in (("alpha", 300), ("beta", 200), ("gamma", 100))
    }


def _by_platform(tasks: list[Task]) -> dict[str, list[int]]:
    grouped: dict[str, list[Task]] = {}
    for t in tasks:
        grouped.setdefault(t.platform or "", []).append(t)
    return {p: [t.id for t in sorted(ts, key=lambda t: (t.due_at, t.id))] for p, ts in grouped.items()}


def test_one_claim_takes_each_limited_platforms_share_oldest_first(
    conn: psycopg.Connection, queue: TaskQueue
):
    """With every alpha task due before any beta or gamma task, a claim of 9 still takes 3 of
    each platform (their max_in_flight), each platform's oldest due first; then nothing more."""
    ids = _queue_platforms_in_order(conn, queue)
    tasks = queue.claim_many(ROLE, "w", 9)
    assert _by_platform(tasks) == {p: ids[p][:3] for p in ids}
    assert queue.claim_many(ROLE, "w2", 9) == []
    assert {p: in_flight(conn, p) for p in ids} == dict.fromkeys(ids, (3, 3))
    assert_store_state_consistent(conn)
    assert_platform_counters_consistent(conn)


def test_a_small_claim_takes_the_platforms_in_turns(conn: psycopg.Connection, queue: TaskQueue):
    """A claim of 4 takes every platform's first before any platform's second (not alpha's three
    oldest); the next claim fills what room is left, in the same turns."""
    ids = _queue_platforms_in_order(conn, queue)
    first = queue.claim_many(ROLE, "w", 4)
    assert _by_platform(first) == {
        "alpha": ids["alpha"][:2],
        "beta": ids["beta"][:1],
        "gamma": ids["gamma"][:1],
    }
    second = queue.claim_many(ROLE, "w", 9)
    assert _by_platform(second) == {
        "alpha": ids["alpha"][2:3],
        "beta": ids["beta"][1:3],
        "gamma": ids["gamma"][1:3],
    }
    assert queue.claim_many(ROLE, "w", 9) == []
    assert_platform_counters_consistent(conn)


# -- a claimer killed with its slots -----------------------------------------------------------

CLAIMER = """
import sys, time
from tq_pipelines.queue.api import TaskQueue
url, role, worker_id, max_tasks, ask = sys.argv[1:6]
queue = TaskQueue.connect(url, max_size=1)
tasks = queue.claim_many(role, worker_id, int(max_tasks), start=True)
if ask == "ask":
    for t in tasks:
        assert queue.platform_request(t, first=True).decision in ("go", "probe")
print("claimed", *[t.id for t in tasks], flush=True)
time.sleep(120)
"""


def claim_then_die(db_url: str, worker_id: str, max_tasks: int, *, ask: bool = False) -> list[int]:
    """A real process claims up to ``max_tasks`` (with ``ask``, each task then asks for its first
    request), and is killed with SIGKILL while it holds them. Returns their ids."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, db_url, ROLE, worker_id, str(max_tasks), "ask" if ask else "-"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["claimed"], proc.stderr.read() if proc.stderr else line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return sorted(int(x) for x in line[1:])


def expire_leases(conn: psycopg.Connection, worker_id: str) -> None:
    """As if the worker had been silent for 11 minutes (recovery counts in minutes)."""
    conn.execute(
        "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '11 minutes' WHERE worker_id = %s",
        (worker_id,),
    )


def test_a_killed_claimers_slots_come_back_with_its_lease(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """A process that claimed all of a platform's slots is killed (SIGKILL): its slots stay taken
    (no other worker gets that platform's tasks) until recovery gives its expired leases back,
    spending one retry each; then the counter is 0 and another worker claims the same tasks."""
    queue.sync_platform_limits([PlatformLimits("limited", 3, FAST)])
    task_ids = add_platform_tasks(conn, "limited", add_stores(conn, 6, platform="limited"))
    doomed = claim_then_die(db_url, "doomed", 10)
    assert doomed == task_ids[:3], "the claimer should have taken the platform's 3 slots"

    assert in_flight(conn, "limited") == (3, 3)
    # Another worker gets the due task of another platform, none of the 3 due of this one.
    (other_id,) = add_platform_tasks(conn, "other", add_stores(conn, 1, platform="other"))
    assert [t.id for t in queue.claim_many(ROLE, "w2", 10)] == [other_id], (
        "the dead claimer's slots were free"
    )
    assert queue.recover_stale(10).recovered == 0, "leases still fresh: nothing to recover yet"
    assert in_flight(conn, "limited") == (3, 3)

    expire_leases(conn, "doomed")
    report = queue.recover_stale(10)
    assert report.recovered == 3
    assert report.failed == 0
    assert in_flight(conn, "limited") == (0, 0)
    rows = conn.execute(
        """
        SELECT id, status, retry_count, worker_id, error_message
        FROM v_tasks WHERE id = ANY(%s) ORDER BY id
        """,
        (doomed,),
    ).fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(i, "pending", 1, None) for i in doomed]
    assert all("lease expired: worker doomed" in r[4] for r in rows)

    again = queue.claim_many(ROLE, "w3", 10)
    assert sorted(t.id for t in again) == doomed
    assert in_flight(conn, "limited") == (3, 3)
    assert_store_state_consistent(conn)
    assert_platform_counters_consistent(conn)


# -- pauses ------------------------------------------------------------------------------------


def test_a_paused_platform_gives_no_tasks_and_refuses_requests(conn: psycopg.Connection, queue: TaskQueue):
    """A 503 with Retry-After 30 pauses the platform for every worker: its state is 'paused',
    claims take only the other platform's tasks, and a task claimed before the pause is told to
    give itself back for about 30 s, on its first request as on a further one."""
    queue.sync_platform_limits([PlatformLimits("flaky", 5, 100.0), PlatformLimits("steady", 5, 100.0)])
    add_platform_tasks(conn, "flaky", add_stores(conn, 4, platform="flaky"), age_seconds=120)
    steady = add_platform_tasks(conn, "steady", add_stores(conn, 3, platform="steady"))
    (before,) = queue.claim_many(ROLE, "w1", 1, start=True)
    assert before.platform == "flaky"

    wait = queue.platform_error(before, "HTTP 503", retry_after=30)
    assert wait == pytest.approx(30, abs=0.01)
    flaky = status_of(queue, "flaky")
    assert flaky["state"] == "paused"
    assert 29 < float(flaky["pause_seconds_left"]) <= 30
    assert flaky["pause_reason"] == "HTTP 503"
    assert status_of(queue, "steady")["state"] == "open"

    assert sorted(t.id for t in queue.claim_many(ROLE, "w2", 10)) == steady
    assert queue.claim_many(ROLE, "w3", 10) == []

    first = queue.platform_request(before, first=True)
    assert first.decision == "paused"
    assert 28 < first.wait_seconds <= 30
    further = queue.platform_request(before, first=False)
    assert further.decision == "paused"
    assert 28 < further.wait_seconds <= 30
    # Another worker, with a token of its own making: the task is not its to ask for.
    assert queue.platform_request(Lease(before.id, uuid.uuid4()), first=True).decision == "lost"
    assert in_flight(conn, "flaky") == (1, 1)
    assert_platform_counters_consistent(conn)


def test_worker_defers_a_task_whose_platform_pauses_without_spending_a_retry(
    conn: psycopg.Connection, queue: TaskQueue
):
    """A real Worker's handler asks its permit for a request after the platform was paused (a 503
    with Retry-After 30 seen by another worker): the task goes back pending, untried, its
    retry_count unchanged, due again in about 30 s, and its slot is free."""
    queue.sync_platform_limits([PlatformLimits("flaky", 3, 100.0)])
    other = another_workers_task(queue, "flaky")
    (task_id,) = add_platform_tasks(conn, "flaky", add_stores(conn, 1, platform="flaky"))
    seen: dict[str, Any] = {}

    def handler(task: Task, ctx: TaskContext) -> dict[str, bool]:
        seen["permit"] = ctx.permit
        seen["in_flight"] = in_flight(conn, "flaky")
        assert queue.platform_error(other, "HTTP 503", retry_after=30) == pytest.approx(30, abs=0.01)
        assert ctx.permit is not None
        with ctx.permit.request():
            seen["sent"] = True
        return {"sent": True}

    stats = Worker(
        queue, ROLE, handler, batch_size=4, platform_wait_seconds=1.0, time_budget_seconds=20
    ).run()
    assert seen["permit"] is not None, "a task of a limited platform gets a permit"
    assert seen["in_flight"] == (1, 1)
    assert "sent" not in seen, "the request went out during the pause"
    assert (stats.claimed, stats.deferred, stats.completed, stats.retried, stats.failed) == (1, 1, 0, 0, 0)

    task = queue.get(task_id)
    assert task is not None
    assert (task.status, task.retry_count, task.worker_id) == ("pending", 0, None)
    assert task.scheduled_for is not None
    assert 28 < (task.scheduled_for - db_now(conn)).total_seconds() <= 30
    assert in_flight(conn, "flaky") == (0, 0)
    assert status_of(queue, "flaky")["state"] == "paused"
    assert_platform_counters_consistent(conn)


def _pause_length(conn: psycopg.Connection, platform: str) -> float:
    """The length of the platform's latest pause (set in the same statement as its error)."""
    row = platform_row(conn, platform)
    return (row["paused_until"] - row["last_error_at"]).total_seconds()


def test_breaker_pauses_after_errors_in_a_row_then_probes_then_closes(
    conn: psycopg.Connection, queue: TaskQueue
):
    """pause_after_errors errors in a row (a completion resets the streak) pause the platform for
    pause_seconds; once it ends, claims take exactly one probe task while it is out, whatever the
    free slots; the probe completing after its request closes the breaker (one that asked nothing
    lets another probe); a failed probe pauses again, each time twice as long, up to
    max_pause_seconds."""
    queue.sync_platform_limits(
        [PlatformLimits("flaky", 4, 100.0, pause_after_errors=5, pause_seconds=0.3, max_pause_seconds=1.0)]
    )
    # The errors come from another worker's task of the platform (its slot already given back).
    other = another_workers_task(queue, "flaky")
    add_platform_tasks(conn, "flaky", add_stores(conn, 12, platform="flaky"))

    # 4 errors, a completion, 4 errors: no 5 in a row.
    for _ in range(4):
        assert queue.platform_error(other, "HTTP 500") is None
    (task,) = queue.claim_many(ROLE, "w", 1)
    assert queue.complete_many({task.lease: None}) == {task.id}
    assert platform_row(conn, "flaky")["error_streak"] == 0
    for _ in range(4):
        assert queue.platform_error(other, "HTTP 500") is None
    row = status_of(queue, "flaky")
    assert (row["state"], row["error_streak"], row["errors_total"]) == ("open", 4, 8)

    # The 5th in a row pauses for pause_seconds; errors during the pause extend nothing.
    assert queue.platform_error(other, "HTTP 500") == pytest.approx(0.3)
    paused_until = platform_row(conn, "flaky")["paused_until"]
    assert _pause_length(conn, "flaky") == pytest.approx(0.3, abs=1e-6)
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["error_streak"]) == ("paused", 1, 0)
    assert queue.claim_many(ROLE, "w", 8) == []
    left = queue.platform_error(other, "HTTP 500")
    assert left is not None
    assert 0 < left <= 0.3
    assert platform_row(conn, "flaky")["paused_until"] == paused_until
    assert platform_row(conn, "flaky")["pauses"] == 1

    # Half-open: one probe, however many slots are free and tasks due.
    time.sleep(0.35)
    assert status_of(queue, "flaky")["state"] == "probing"
    (probe,) = queue.claim_many(ROLE, "w", 8)
    assert platform_row(conn, "flaky")["probe_task_id"] == probe.id
    assert queue.claim_many(ROLE, "w2", 8) == []
    # A probe that finished without asking the platform anything proves nothing: another probes.
    assert queue.complete_many({probe.lease: None}) == {probe.id}
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["probe_task_id"]) == ("probing", 1, None)
    (probe,) = queue.claim_many(ROLE, "w", 8)
    assert platform_row(conn, "flaky")["probe_task_id"] == probe.id
    assert queue.platform_request(probe, first=True).decision == "probe"

    # The probe's completion, after its request, closes the breaker: full claims again.
    assert queue.complete_many({probe.lease: None}) == {probe.id}
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["probe_task_id"]) == ("open", 0, None)
    assert platform_row(conn, "flaky")["paused_until"] is None
    batch = queue.claim_many(ROLE, "w", 8)
    assert len(batch) == 4
    assert queue.complete_many({t.lease: None for t in batch}) == {t.id for t in batch}

    # A probe's answer closes the breaker at once, whatever its task then does (here it fails
    # for good: a 404 is an answer): the platform does not wait for the task to finish.
    for _ in range(5):
        queue.platform_error(other, "HTTP 500")
    time.sleep(0.35)
    (probe,) = queue.claim_many(ROLE, "w", 8)
    assert not queue.platform_answered(probe), "no answer before its request went out"
    assert queue.platform_request(probe, first=True).decision == "probe"
    # Only the probe's holder may say the platform answered: not another task, nor a token of
    # another's making for the probe.
    assert not queue.platform_answered(other)
    assert not queue.platform_answered(Lease(probe.id, uuid.uuid4()))
    assert status_of(queue, "flaky")["state"] == "probing"
    assert queue.platform_answered(probe)
    assert status_of(queue, "flaky")["state"] == "open"
    assert len(queue.claim_many(ROLE, "w2", 8)) == 3  # the probe still holds its slot
    assert queue.fail(probe, "HTTP 404", retryable=False) == "failed"
    assert status_of(queue, "flaky")["state"] == "open"
    conn.execute("UPDATE worker_tasks SET status = 'completed', completed_at = now() WHERE worker_id = 'w2'")

    # Failed probes: each pause twice the last, capped.
    for _ in range(4):
        assert queue.platform_error(other, "HTTP 500") is None
    assert queue.platform_error(other, "HTTP 500") == pytest.approx(0.3)
    lengths = []
    lengths.append(_pause_length(conn, "flaky"))
    for expected in (0.6, 1.0):
        time.sleep(lengths[-1] + 0.05)
        (probe,) = queue.claim_many(ROLE, "w", 8)
        assert platform_row(conn, "flaky")["probe_task_id"] == probe.id
        assert queue.platform_error(probe, "HTTP 500") == pytest.approx(expected)
        lengths.append(_pause_length(conn, "flaky"))
        row = platform_row(conn, "flaky")
        assert row["probe_task_id"] is None
        assert status_of(queue, "flaky")["state"] == "paused"
        assert queue.defer(probe, 0)  # the worker gives its probe back
        assert in_flight(conn, "flaky") == (0, 0)
    assert lengths == pytest.approx([0.3, 0.6, 1.0], abs=1e-6)
    assert platform_row(conn, "flaky")["pauses"] == 3
    assert_platform_counters_consistent(conn)


def test_a_dead_probe_failed_by_recovery_leaves_the_breaker_half_open(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """A half-open platform's probe sends its request and its process is killed (SIGKILL); with no
    retries left, recovery fails the task. The platform never answered, so the probe counts as
    given back (as a recovered probe does): the platform stays half-open and the next claim takes
    one new probe, not max_in_flight tasks."""
    queue.sync_platform_limits(
        [PlatformLimits("flaky", 4, 100.0, pause_after_errors=1, pause_seconds=0.1, max_pause_seconds=1.0)]
    )
    add_platform_tasks(conn, "flaky", add_stores(conn, 8, platform="flaky"))
    conn.execute("UPDATE worker_tasks SET max_retries = 0")
    other = another_workers_task(queue, "flaky")
    assert queue.platform_error(other, "HTTP 500") == pytest.approx(0.1)
    time.sleep(0.15)
    (probe_id,) = claim_then_die(db_url, "doomed", 8, ask=True)
    assert platform_row(conn, "flaky")["probe_task_id"] == probe_id

    expire_leases(conn, "doomed")
    report = queue.recover_stale(10)
    assert (report.recovered, report.failed) == (0, 1)
    assert in_flight(conn, "flaky") == (0, 0)
    assert_platform_counters_consistent(conn)
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"]) == ("probing", 1), "the breaker closed without an answer"
    assert len(queue.claim_many(ROLE, "w", 8)) == 1


# -- only a task's holder speaks for its platform ----------------------------------------------


def test_an_error_reported_without_the_tasks_lease_counts_nothing(conn: psycopg.Connection, queue: TaskQueue):
    """platform_error with a token that is not the task's (one of another's making, the token of an
    earlier claim of the same task, a finished task's own, none at all) counts nothing: no error,
    no change of the streak, no pause, whatever Retry-After it carries. The task's own lease is
    counted, on the task's own platform only."""
    limits = {"pause_after_errors": 3, "pause_seconds": 5.0, "max_pause_seconds": 60.0}
    queue.sync_platform_limits(
        [PlatformLimits("flaky", 4, FAST, **limits), PlatformLimits("steady", 4, FAST, **limits)]
    )
    (task_id,) = add_platform_tasks(conn, "flaky", add_stores(conn, 1, platform="flaky"))
    (earlier,) = queue.claim_many(ROLE, "w1", 8)
    assert queue.defer(earlier, 0)  # given back; claimed again under a new lease
    (held,) = queue.claim_many(ROLE, "w2", 8)
    assert held.id == earlier.id == task_id
    assert held.lease_token != earlier.lease_token
    add_platform_tasks(conn, "flaky", add_stores(conn, 1, platform="flaky"))
    (done,) = queue.claim_many(ROLE, "w3", 8)
    assert queue.complete(done)
    assert queue.platform_error(held, "HTTP 500") is None  # counted: a streak of 1
    before = platform_row(conn, "flaky")
    assert (before["error_streak"], before["errors_total"], before["pauses"]) == (1, 1, 0)

    not_held = [
        Lease(held.id, uuid.uuid4()),  # another's making
        earlier.lease,  # the task's earlier claim
        done.lease,  # a finished task
        Lease(2**31 - 1, uuid.uuid4()),  # no such task
    ]
    for lease in not_held:
        for retry_after in (None, 30.0, 86_400.0):
            assert queue.platform_error(lease, "HTTP 503", retry_after=retry_after) is None, lease
    for token in (None, uuid.uuid4()):
        assert conn.execute(
            "SELECT paused, wait_seconds FROM platform_error(%s, %s, 'HTTP 503', interval '1 hour')",
            (held.id, token),
        ).fetchone() == (False, 0.0)
    assert platform_row(conn, "flaky") == before, "an error without the task's lease was counted"
    assert status_of(queue, "flaky")["state"] == "open"

    # A held task of steady pauses steady, not flaky: the platform is the task's own.
    add_platform_tasks(conn, "steady", add_stores(conn, 1, platform="steady"))
    (steady,) = queue.claim_many(ROLE, "w4", 8)
    assert steady.platform == "steady"
    assert queue.platform_error(steady, "HTTP 429", retry_after=30) == pytest.approx(30, abs=0.01)
    assert status_of(queue, "steady")["state"] == "paused"
    assert platform_row(conn, "flaky") == before

    # The task's own lease: counted (the streak goes on), and a Retry-After pauses.
    assert queue.platform_error(held, "HTTP 500") is None
    assert platform_row(conn, "flaky")["error_streak"] == 2
    assert queue.platform_error(held, "HTTP 503", retry_after=30) == pytest.approx(30, abs=0.01)
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["errors_total"], row["pause_reason"]) == (
        "paused",
        1,
        3,
        "HTTP 503",
    )
    assert_platform_counters_consistent(conn)


def test_an_answer_of_a_task_that_is_not_the_probe_leaves_the_breaker_as_it_is(
    conn: psycopg.Connection, queue: TaskQueue
):
    """platform_answered by a held task that is not its platform's probe (a task claimed before
    the pause, another worker's, the probe under a token of another's making) does nothing: a
    paused platform stays paused, a probing one keeps probing with the same probe. Only the
    probe's own answer reopens it."""
    queue.sync_platform_limits(
        [PlatformLimits("flaky", 4, 100.0, pause_after_errors=1, pause_seconds=0.3, max_pause_seconds=1.0)]
    )
    other = another_workers_task(queue, "flaky")
    add_platform_tasks(conn, "flaky", add_stores(conn, 4, platform="flaky"))
    (bystander,) = queue.claim_many(ROLE, "w", 1, start=True)  # claimed while open: no probe
    assert queue.platform_request(bystander, first=True).decision == "go"

    assert queue.platform_error(other, "HTTP 500") == pytest.approx(0.3)
    paused = platform_row(conn, "flaky")
    for held in (bystander, other):
        assert not queue.platform_answered(held)
    assert platform_row(conn, "flaky") == paused
    assert status_of(queue, "flaky")["state"] == "paused"

    time.sleep(0.35)
    (probe,) = queue.claim_many(ROLE, "w2", 8)
    assert queue.platform_request(probe, first=True).decision == "probe"
    probing = platform_row(conn, "flaky")
    assert (probing["probe_task_id"], probing["probe_sent"], probing["pauses"]) == (probe.id, True, 1)
    for held in (bystander, other, Lease(probe.id, uuid.uuid4())):
        assert not queue.platform_answered(held)
    assert platform_row(conn, "flaky") == probing
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["probe_task_id"]) == ("probing", 1, probe.id)
    # The platform is still held off for every task but its probe.
    assert queue.platform_request(bystander, first=False).decision == "paused"
    assert queue.claim_many(ROLE, "w3", 8) == []

    assert queue.platform_answered(probe)
    row = status_of(queue, "flaky")
    assert (row["state"], row["pauses"], row["probe_task_id"]) == ("open", 0, None)
    assert queue.platform_request(bystander, first=False).decision == "go"
    assert_platform_counters_consistent(conn)


def test_a_pause_a_worker_causes_is_bounded_by_max_pause_seconds(conn: psycopg.Connection, queue: TaskQueue):
    """However long the Retry-After a held task reports (through a real Worker's permit, through
    the queue, or straight to SQL past the queue's cap of a day), the pause lasts no longer than
    the platform's max_pause_seconds, which the admin's sync sets (600 s unless told). The worker
    gives its task back for that pause, not for the Retry-After."""
    queue.sync_platform_limits(
        [
            PlatformLimits("capped", 4, FAST, max_pause_seconds=5.0),
            PlatformLimits("default", 4, FAST),
            PlatformLimits("raw", 4, FAST, max_pause_seconds=7.0),
        ]
    )
    (capped_id,) = add_platform_tasks(conn, "capped", add_stores(conn, 1, platform="capped"))
    seen: dict[str, Any] = {}

    def handler(task: Task, ctx: TaskContext) -> None:
        assert ctx.permit is not None
        with ctx.permit.request():
            pause = ctx.permit.report_error("HTTP 429", retry_after=365 * 86_400.0)
        seen["pause"] = pause
        assert pause is not None
        raise DeferTask(pause, f"platform paused for {pause:.0f} s")

    stats = Worker(queue, ROLE, handler, batch_size=1, time_budget_seconds=20).run()
    assert (stats.claimed, stats.deferred) == (1, 1)
    assert seen["pause"] == pytest.approx(5.0)
    assert _pause_length(conn, "capped") == pytest.approx(5.0, abs=1e-6)
    row = status_of(queue, "capped")
    assert row["state"] == "paused" and 4 < float(row["pause_seconds_left"]) <= 5
    task = queue.get(capped_id)
    assert task is not None and task.scheduled_for is not None
    assert (task.status, task.retry_count) == ("pending", 0)
    assert 4 < (task.scheduled_for - db_now(conn)).total_seconds() <= 5

    for p in ("default", "raw"):
        add_platform_tasks(conn, p, add_stores(conn, 1, platform=p))
    held = {t.platform: t for t in queue.claim_many(ROLE, "w", 8)}
    assert set(held) == {"default", "raw"}
    assert queue.platform_error(held["default"], "HTTP 503", retry_after=float("inf")) == pytest.approx(600)
    assert _pause_length(conn, "default") == pytest.approx(600, abs=1e-6)
    assert conn.execute(
        "SELECT paused, wait_seconds FROM platform_error(%s, %s, 'HTTP 429', interval '1000 days')",
        (held["raw"].id, held["raw"].lease_token),
    ).fetchone() == (True, pytest.approx(7.0))
    assert _pause_length(conn, "raw") == pytest.approx(7.0, abs=1e-6)
    assert_platform_counters_consistent(conn)


# -- the admin's pause -------------------------------------------------------------------------


def test_the_admin_pauses_and_resumes_a_platform_by_hand(conn: psycopg.Connection, queue: TaskQueue):
    """platform_pause holds a platform off for the seconds given, with the reason shown: no claims
    of it, its tasks in flight told to give themselves back; then one probe first, as after any
    pause. platform_resume ends a pause at once, with no probe. Seconds outside 1 to 86400 (NaN
    and infinity among them) and a platform without limits are refused in words, changing
    nothing."""
    queue.sync_platform_limits([PlatformLimits("limited", 3, FAST), PlatformLimits("steady", 3, FAST)])
    add_platform_tasks(conn, "limited", add_stores(conn, 6, platform="limited"))
    (held,) = queue.claim_many(ROLE, "w", 1, start=True)

    began = db_now(conn)
    until = queue.platform_pause("limited", 120, "maintenance window")
    assert 119.5 < (until - began).total_seconds() <= 121
    row = status_of(queue, "limited")
    assert (row["state"], row["pause_reason"], row["pauses"], row["paused_until"]) == (
        "paused",
        "maintenance window",
        1,
        until,
    )
    assert 119 < float(row["pause_seconds_left"]) <= 120
    assert queue.claim_many(ROLE, "w2", 8) == []
    decision = queue.platform_request(held, first=True)
    assert decision.decision == "paused" and 119 < decision.wait_seconds <= 120
    wait = queue.claim_wait(ROLE)
    assert wait is not None and 119 < wait <= 120

    snapshot = conn.execute("SELECT l::text FROM tq_platforms l ORDER BY platform").fetchall()
    for seconds in (0, 0.5, -1, 86_400.5, 86_401, 1e9, float("nan"), float("inf"), float("-inf")):
        with pytest.raises(QueueInputError) as raised:
            queue.platform_pause("steady", seconds, "too long or too short")
        assert raised.value.sqlstate == "22023"
        assert raised.value.message.startswith("platform_pause: seconds must be between 1 and 86400, got "), (
            seconds,
            raised.value.message,
        )
        assert "up to a day" in (raised.value.hint or "")
    for refuse in (lambda: queue.platform_pause("nosuch", 60), lambda: queue.platform_resume("nosuch")):
        with pytest.raises(QueueInputError, match="platform must be a platform with limits, got 'nosuch'"):
            refuse()
    assert conn.execute("SELECT l::text FROM tq_platforms l ORDER BY platform").fetchall() == snapshot

    # Resumed: open at once, no probe; every free slot is claimed again.
    queue.platform_resume("limited")
    row = status_of(queue, "limited")
    assert (row["state"], row["pauses"], row["probe_task_id"], row["error_streak"]) == ("open", 0, None, 0)
    assert platform_row(conn, "limited")["paused_until"] is None
    assert queue.platform_request(held, first=True).decision == "go"
    assert len(queue.claim_many(ROLE, "w2", 8)) == 2

    # The bounds are taken: a day, then (a new pause replaces it) a second, with the default
    # reason; once it is over, one probe first.
    add_platform_tasks(conn, "steady", add_stores(conn, 3, platform="steady"))
    began = db_now(conn)
    until = queue.platform_pause("steady", 86_400)
    assert 86_399.5 < (until - began).total_seconds() <= 86_401
    until = queue.platform_pause("steady", 1)
    row = status_of(queue, "steady")
    assert (row["state"], row["pause_reason"], row["pauses"]) == ("paused", "paused by hand", 2)
    assert 0 < float(row["pause_seconds_left"]) <= 1
    assert queue.claim_many(ROLE, "w3", 8) == []
    time.sleep(max(0.0, (until - db_now(conn)).total_seconds()) + 0.05)
    assert status_of(queue, "steady")["state"] == "probing"
    (probe,) = queue.claim_many(ROLE, "w3", 8)
    assert probe.platform == "steady"
    assert platform_row(conn, "steady")["probe_task_id"] == probe.id
    assert_platform_counters_consistent(conn)


# -- counters ----------------------------------------------------------------------------------


def test_slots_come_back_on_every_path(conn: psycopg.Connection, queue: TaskQueue):
    """Tasks of a limited platform leave the active states by every path (completion, retryable
    and final failure, deferral, cancellation, recovery, a DELETE, a hand-written UPDATE, a
    change of platform, TRUNCATE) and enter them by a direct INSERT: after each, the counter
    equals the tasks in flight. repair_platform_counters finds nothing, then repairs drift."""
    queue.sync_platform_limits([PlatformLimits("limited", 20, FAST), PlatformLimits("elsewhere", 20, FAST)])
    stores = add_stores(conn, 10, platform="limited")
    add_platform_tasks(conn, "limited", [*stores, None, None])
    tasks = queue.claim_many(ROLE, "w", 12, start=True)
    assert len(tasks) == 12
    assert sum(t.dispensary_id is None for t in tasks) == 2
    # The ninth path, a change of platform by hand, takes a task of no store: a store's task has
    # its store's platform, and another is refused (migration 0012).
    stored = [t.id for t in tasks if t.dispensary_id is not None]
    loose = [t.id for t in tasks if t.dispensary_id is None]
    ids = stored[:8] + loose[:1] + stored[8:] + loose[1:]
    held = {t.id: t for t in tasks}
    assert in_flight(conn, "limited") == (12, 12)

    def released(n_left: int) -> None:
        assert in_flight(conn, "limited") == (n_left, n_left)
        assert_platform_counters_consistent(conn)

    assert queue.complete_many({held[ids[0]].lease: None}) == {ids[0]}
    released(11)
    assert queue.fail(held[ids[1]], "boom") == "pending"
    released(10)
    assert queue.fail(held[ids[2]], "boom", retryable=False) == "failed"
    released(9)
    assert queue.defer(held[ids[3]], 5)
    released(8)
    assert queue.cancel(ids[4])
    released(7)
    conn.execute(
        "UPDATE worker_tasks SET last_heartbeat_at = now() - interval '11 minutes' WHERE id = %s", (ids[5],)
    )
    assert queue.recover_stale(10).recovered == 1
    released(6)
    conn.execute("DELETE FROM worker_tasks WHERE id = %s", (ids[6],))
    released(5)
    conn.execute(
        """
        UPDATE worker_tasks
        SET status = 'pending', worker_id = NULL, claimed_at = NULL, started_at = NULL,
            last_heartbeat_at = NULL
        WHERE id = %s
        """,
        (ids[7],),
    )
    released(4)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must be that of store"):
        conn.execute("UPDATE worker_tasks SET platform = 'elsewhere' WHERE id = %s", (ids[9],))
    released(4)
    conn.execute("UPDATE worker_tasks SET platform = 'elsewhere' WHERE id = %s", (ids[8],))
    released(3)
    assert in_flight(conn, "elsewhere") == (1, 1)
    # A row written as running by hand holds a slot when it says so (send_at), as a claim does.
    conn.execute(
        "INSERT INTO worker_tasks (role, platform, status, worker_id, claimed_at, send_at) "
        "VALUES (%s, 'limited', 'running', 'w', now(), now())",
        (ROLE,),
    )
    released(4)
    conn.execute(
        "INSERT INTO worker_tasks (role, platform, status, worker_id, claimed_at) "
        "VALUES (%s, 'limited', 'running', 'w', now())",
        (ROLE,),
    )
    released(4)
    # Two statements' worth of work in one transaction, rolled back: nothing changes.
    with pytest.raises(RuntimeError), conn.transaction():
        conn.execute("DELETE FROM worker_tasks WHERE id = %s", (ids[9],))
        conn.execute("UPDATE worker_tasks SET status = 'completed' WHERE id = %s", (ids[10],))
        assert in_flight(conn, "limited") == (2, 2)
        raise RuntimeError("roll back")
    released(4)

    assert queue.repair_platform_counters() == []
    conn.execute("UPDATE tq_platforms SET in_flight = 0")
    repaired = queue.repair_platform_counters()
    assert repaired == [
        {"platform": "elsewhere", "counted": 0, "in_flight": 1, "probe_cleared": False},
        {"platform": "limited", "counted": 0, "in_flight": 4, "probe_cleared": False},
    ]
    released(4)
    assert queue.repair_platform_counters() == []

    conn.execute("TRUNCATE worker_tasks")
    released(0)
    assert in_flight(conn, "elsewhere") == (0, 0)
    assert_store_state_consistent(conn)


# -- limits from the platforms file ------------------------------------------------------------


def test_sync_changes_limits_and_keeps_state(conn: psycopg.Connection, queue: TaskQueue):
    """A sync while tasks are in flight changes the limits and keeps the count, rate and errors;
    a platform first synced while its tasks are in flight starts counting them (so a claim takes
    only the room left); bad input raises QueueInputError and changes nothing."""
    assert queue.sync_platform_limits([PlatformLimits("alpha", 5, 10.0)]) == 1
    add_platform_tasks(conn, "alpha", add_stores(conn, 8, platform="alpha"))
    tasks = queue.claim_many(ROLE, "w", 3)
    assert len(tasks) == 3
    assert queue.platform_error(tasks[0], "HTTP 500") is None
    before = platform_row(conn, "alpha")
    assert (before["max_in_flight"], before["burst"], before["in_flight"], before["error_streak"]) == (
        5,
        5,
        3,
        1,
    )

    assert queue.sync_platform_limits([PlatformLimits("alpha", 4, 20.0, burst=2, pause_seconds=7.0)]) == 1
    after = platform_row(conn, "alpha")
    assert (after["max_in_flight"], after["requests_per_second"], after["burst"], after["pause_seconds"]) == (
        4,
        20.0,
        2,
        7.0,
    )
    assert (after["in_flight"], after["tat"], after["error_streak"]) == (3, before["tat"], 1)
    assert queue.sync_platform_limits([PlatformLimits("alpha", 4, 20.0, burst=2, pause_seconds=7.0)]) == 0
    assert len(queue.claim_many(ROLE, "w", 8)) == 1, "the new max_in_flight (4) counts the 3 in flight"

    # Tasks claimed before their platform had a row hold no slot (no send_at: claimed without
    # limits); the limits count from the first claim under them.
    add_platform_tasks(conn, "beta", add_stores(conn, 8, platform="beta"))
    add_platform_tasks(conn, "beta", [None])
    early = queue.claim_many(ROLE, "w", 4)
    assert len(early) == 4 and all(t.send_at is None for t in early)
    assert queue.sync_platform_limits([PlatformLimits("beta", 3, FAST)]) == 1
    assert in_flight(conn, "beta") == (0, 0)
    assert queue.repair_platform_counters() == []
    later = queue.claim_many(ROLE, "w", 8)
    assert [t.platform for t in later] == ["beta"] * 3 and all(t.send_at is not None for t in later)
    assert in_flight(conn, "beta") == (3, 3)

    snapshot = conn.execute("SELECT * FROM tq_platforms ORDER BY platform").fetchall()
    bad_inputs = [
        [PlatformLimits("gamma", 3, 1.0), PlatformLimits("alpha", 1, 1.0), PlatformLimits("alpha", 2, 1.0)],
        [PlatformLimits("gamma", 3, 1.0), PlatformLimits("", 3, 1.0)],
    ]
    for bad in bad_inputs:
        with pytest.raises(QueueInputError, match="non-empty name, once"):
            queue.sync_platform_limits(bad)
        assert conn.execute("SELECT * FROM tq_platforms ORDER BY platform").fetchall() == snapshot
    assert_platform_counters_consistent(conn)


# -- what a drain that found nothing should do -------------------------------------------------


def test_claim_wait_tells_how_long_until_a_claim_could_take_work(conn: psycopg.Connection, queue: TaskQueue):
    """None without due work; 0 for due work of a platform without limits; the rest of the pause
    for a paused platform; a short poll for a full platform; about the next start for a platform
    out of rate."""
    assert queue.claim_wait(ROLE) is None
    # Work that is not due yet is no due work.
    add_platform_tasks(conn, "free", add_stores(conn, 1, platform="free"), age_seconds=-3600)
    assert queue.claim_wait(ROLE) is None

    (free_id,) = add_platform_tasks(conn, None, [None])
    assert queue.claim_wait(ROLE) == 0
    assert [t.id for t in queue.claim_many(ROLE, "w", 5)] == [free_id]
    assert queue.claim_wait(ROLE) is None

    queue.sync_platform_limits([PlatformLimits("full", 2, FAST)])
    add_platform_tasks(conn, "full", add_stores(conn, 4, platform="full"))
    assert queue.claim_wait(ROLE) == 0
    assert len(queue.claim_many(ROLE, "w", 5)) == 2
    wait = queue.claim_wait(ROLE)
    assert wait is not None
    assert 0 < wait <= 0.5

    queue.sync_platform_limits([PlatformLimits("paused", 2, FAST)])
    other = another_workers_task(queue, "paused")
    add_platform_tasks(conn, "paused", add_stores(conn, 1, platform="paused"))
    assert queue.platform_error(other, "HTTP 429", retry_after=30) == pytest.approx(30, abs=0.01)
    wait = queue.claim_wait(ROLE)
    assert wait is not None
    assert 0 < wait <= 0.5, "the full platform's poll is the sooner"
    conn.execute("DELETE FROM worker_tasks WHERE platform = 'full'")
    wait = queue.claim_wait(ROLE)
    assert wait is not None
    assert 29 < wait <= 30

    # One start a second, no burst: a claim takes the starts of the coming second (now and in
    # 1 s), after which the next start is about a second away.
    queue.sync_platform_limits([PlatformLimits("slow", 10, 1.0, burst=1)])
    add_platform_tasks(conn, "slow", add_stores(conn, 5, platform="slow"))
    assert len(queue.claim_many(ROLE, "w", 5)) == 2
    assert queue.claim_many(ROLE, "w", 5) == []
    wait = queue.claim_wait(ROLE)
    assert wait is not None
    assert 0.5 < wait <= 1.0
    assert_platform_counters_consistent(conn)


def test_a_task_done_with_its_requests_gives_its_slot_back(conn: psycopg.Connection, queue: TaskQueue):
    """platform_release: a task done with its platform's requests frees its slot while it goes on
    (storing what it fetched), so another task can be claimed; its outcome then frees nothing
    twice, and a second release finds nothing to give back."""
    queue.sync_platform_limits([PlatformLimits("limited", 2, FAST)])
    add_platform_tasks(conn, "limited", add_stores(conn, 4, platform="limited"))
    first, second = queue.claim_many(ROLE, "w", 8, start=True)
    assert queue.claim_many(ROLE, "w2", 8) == []
    # Fenced: only the task's lease gives its slot back, not a token of another's making.
    assert not queue.platform_release(Lease(second.id, uuid.uuid4()))
    assert in_flight(conn, "limited") == (2, 2)
    assert queue.platform_release(first)
    assert in_flight(conn, "limited") == (1, 1)
    assert queue.get(first.id).status == "running"  # type: ignore[union-attr]
    [third] = queue.claim_many(ROLE, "w2", 8)
    assert in_flight(conn, "limited") == (2, 2)
    assert queue.complete_many({first.lease: None}) == {first.id}
    assert in_flight(conn, "limited") == (2, 2), "its slot was already back: nothing freed twice"
    assert not queue.platform_release(first)
    assert queue.complete_many({second.lease: None}) == {second.id}
    assert queue.complete_many({third.lease: None}) == {third.id}
    assert in_flight(conn, "limited") == (0, 0)
    assert_platform_counters_consistent(conn)
