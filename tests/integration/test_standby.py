"""Standby tasks and slots passed to them (migration 0028), in PostgreSQL.

A worker holding slots of a platform keeps a few of its tasks claimed without a slot; a task done
with its requests passes its slot to one of them in one statement. The slot never leaves the
worker: the limits and the shares count as before, a standby takes no start of its own beyond
them (0027), and nobody but the tasks' holder can pass or claim.
"""

import threading
import time
from collections import Counter

import psycopg

from tests.helpers import (
    add_stores,
    assert_platform_counters_consistent,
    assert_store_state_consistent,
    status_counts,
)
from tests.integration.test_platform_limits import add_platform_tasks, in_flight
from tq_pipelines.queue.api import PlatformLimits, RequestDecision, Task, TaskQueue
from tq_pipelines.queue.worker import PlatformPermit, StandbyLine, TaskContext, Worker, current_permit

ROLE = "product_resync"


def slot_of(conn: psycopg.Connection, task_id: int) -> bool:
    """Whether the task holds a slot (its send_at set)."""
    return conn.execute(
        "SELECT send_at IS NOT NULL FROM worker_tasks WHERE id = %s", (task_id,)
    ).fetchone() == (True,)


def test_a_standby_takes_a_passed_slot_and_no_start_beyond_the_limits(
    conn: psycopg.Connection, queue: TaskQueue
):
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0), PlatformLimits("jane", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 6, platform="dutchie"))
    add_platform_tasks(conn, "jane", add_stores(conn, 2, platform="jane"))
    held = queue.claim_many(ROLE, "w", 4, start=True)
    a, b = [t for t in held if t.platform == "dutchie"]
    [jane, _] = [t for t in held if t.platform == "jane"]

    # Twice as many standbys as the worker holds slots of the platform, none with a slot.
    s1, s2 = queue.platform_standby(a), queue.platform_standby(b)
    assert s1 is not None and s2 is not None
    assert (s1.worker_id, s1.status, s1.platform, s1.send_at) == ("w", "running", "dutchie", None)
    s3, s4 = queue.platform_standby(a), queue.platform_standby(a)
    assert s3 is not None and s4 is not None
    assert queue.platform_standby(b) is None
    assert queue.platform_standby(jane) is None  # jane has nothing due
    assert in_flight(conn, "dutchie") == (2, 2)
    # Asking for a start of its own: the platform is full (0027).
    assert queue.platform_request(s2, first=True).decision == "full"

    # The pass: the slot moves, the counters do not, and the standby's start is now.
    passed, replacement = queue.platform_pass(a, s1)
    assert passed.decision == "go" and 0 <= passed.wait_seconds < 0.01 and replacement is None
    assert not slot_of(conn, a.id) and slot_of(conn, s1.id)
    assert in_flight(conn, "dutchie") == (2, 2)
    assert queue.platform_request(s1, first=True).decision == "go"

    # What does not match moves nothing: a task without a slot, a standby that has one, a task
    # of another platform, itself.
    for frm, to in ((a, s2), (b, s1), (jane, s2), (b, b)):
        assert queue.platform_pass(frm, to, replace=True) == (RequestDecision("lost", 0.0), None), (
            frm.id,
            to.id,
        )
    assert in_flight(conn, "dutchie") == (2, 2) and slot_of(conn, b.id) and not slot_of(conn, s2.id)

    # Paused: no standby is claimed, and a pass gives the slot back alone.
    queue.platform_pause("dutchie", 60, "maintenance")
    assert queue.platform_standby(b) is None
    assert queue.platform_pass(b, s2, replace=True) == (RequestDecision("paused", 0.25), None)
    assert not slot_of(conn, b.id) and not slot_of(conn, s2.id)
    assert in_flight(conn, "dutchie") == (1, 1)
    assert_platform_counters_consistent(conn)
    assert_store_state_consistent(conn)


def test_a_pass_keeps_the_workers_share(conn: psycopg.Connection, queue: TaskQueue):
    """Two live workers of the role share 2 slots: the one holding both passes neither on (its
    share shrank to one: the first slot goes back), then passes its last within its share."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 6, platform="dutchie"))
    first = queue.open_session("first", ROLE, hostname="h", heartbeat_seconds=30)
    try:
        a, b = queue.claim_many(ROLE, "first", 2, start=True)
        s1, s2 = queue.platform_standby(a), queue.platform_standby(b)
        assert s1 is not None and s2 is not None
        second = queue.open_session("second", ROLE, hostname="h", heartbeat_seconds=30)
        try:
            assert queue.platform_pass(a, s1)[0].decision == "full"
            assert in_flight(conn, "dutchie") == (1, 1)
            assert queue.platform_pass(b, s2)[0].decision == "go"
            assert in_flight(conn, "dutchie") == (1, 1) and slot_of(conn, s2.id)
        finally:
            second.close()
    finally:
        first.close()
    assert_platform_counters_consistent(conn)


def tat(conn: psycopg.Connection, platform: str) -> float:
    """The platform's GCRA tat, in seconds from the database's clock now (negative: behind it)."""
    row = conn.execute(
        "SELECT extract(EPOCH FROM tat - clock_timestamp())::FLOAT8 FROM tq_platforms WHERE platform = %s",
        (platform,),
    ).fetchone()
    assert row is not None
    return float(row[0])


def test_a_relay_is_given_only_where_the_rate_has_room_and_its_record_moves_the_slot_alone(
    conn: psycopg.Connection, queue: TaskQueue
):
    """0031. dutchie's rate is 20 times its slots, jane's 5 times: a pass on dutchie gives the
    slot's new holder a relay (a start booked now: the tat moves two intervals), on jane none
    (one interval). A relay's record moves the slot even while paused (the request is
    out), books nothing then, and gives no relay; what does not match moves nothing."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 40.0), PlatformLimits("jane", 2, 10.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 8, platform="dutchie"))
    add_platform_tasks(conn, "jane", add_stores(conn, 4, platform="jane"))
    held = queue.claim_many(ROLE, "w", 4, start=True)
    a, b = [t for t in held if t.platform == "dutchie"]
    j1, _ = [t for t in held if t.platform == "jane"]
    s1, s2, sj = queue.platform_standby(a), queue.platform_standby(b), queue.platform_standby(j1)
    assert s1 is not None and s2 is not None and sj is not None

    conn.execute("UPDATE tq_platforms SET tat = '-infinity'")
    decision, relay, _ = queue.platform_relay(a, s1)
    assert (decision.decision, relay) == ("go", True)
    assert 0.04 < tat(conn, "dutchie") <= 0.05  # its start and the relay's, 25 ms each
    assert not slot_of(conn, a.id) and slot_of(conn, s1.id) and in_flight(conn, "dutchie") == (2, 2)
    decision, relay, _ = queue.platform_relay(j1, sj)
    assert (decision.decision, relay) == ("go", False)
    assert 0.09 < tat(conn, "jane") <= 0.1  # its start only, at 10/s

    # A rate that binds now (its tat ahead of the clock, as the relay left it) gives no relay.
    s3 = queue.platform_standby(s1)
    assert s3 is not None
    decision, relay, _ = queue.platform_relay(s1, s3)
    assert (decision.decision, relay) == ("go", False)
    assert slot_of(conn, s3.id) and in_flight(conn, "dutchie") == (2, 2)

    # The record of a request sent on a relay: paused since, the slot moves all the same, and
    # nothing is booked (the tat stays), nor a relay given.
    s4 = queue.platform_standby(s3)
    assert s4 is not None
    queue.platform_pause("dutchie", 60, "maintenance")
    before = tat(conn, "dutchie")
    decision, relay, replacement = queue.platform_relay(s3, s4, replace=True, sent=True)
    assert (decision.decision, relay, replacement) == ("go", False, None)  # no standby claimed while paused
    assert not slot_of(conn, s3.id) and slot_of(conn, s4.id) and in_flight(conn, "dutchie") == (2, 2)
    assert before - 0.02 < tat(conn, "dutchie") <= before
    # What does not match moves nothing: from a task without a slot, to one that has one, across
    # platforms, to itself.
    for frm, to in ((s3, s2), (b, s4), (sj, s2), (b, b)):
        assert queue.platform_relay(frm, to, replace=True, sent=True) == (
            RequestDecision("lost", 0.0),
            False,
            None,
        ), (frm.id, to.id)
    assert slot_of(conn, b.id) and not slot_of(conn, s2.id) and in_flight(conn, "dutchie") == (2, 2)
    assert_platform_counters_consistent(conn)
    assert_store_state_consistent(conn)


def test_passes_and_standbys_from_many_connections_take_each_task_once_within_the_limits(
    db_url: str, conn: psycopg.Connection, queue: TaskQueue
):
    """Eight threads, each its own connection, two workers of four slots each: every thread
    claims standbys for its worker and passes its slot to one, until the 400 tasks are taken.
    Each task is claimed once; the platform never counts more than its limit, a worker never more
    than its share, nor more tasks without a slot than twice its slots; every standby ends with
    a slot, completed, or given back. Half the threads pass with ``platform_relay`` and, given a
    relay, record the next pass as sent on it (0031): the records race the passes and claims."""
    stores, max_in_flight = 400, 8
    queue.sync_platform_limits([PlatformLimits("dutchie", max_in_flight, 10_000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, stores, platform="dutchie"))
    sessions = [queue.open_session(w, ROLE, hostname="h", heartbeat_seconds=30) for w in ("a", "b")]
    try:
        held = [t for w in ("a", "b") for t in queue.claim_many(ROLE, w, max_in_flight, start=True)]
        assert sorted(Counter(t.worker_id for t in held).values()) == [4, 4]
        taken: list[list[int]] = [[t.id] for t in held]
        stop = threading.Event()
        over: list[tuple[object, ...]] = []
        errors: list[BaseException] = []

        def watch() -> None:
            with psycopg.connect(db_url, autocommit=True) as c:
                while not stop.is_set():
                    row = c.execute(
                        "SELECT (SELECT in_flight FROM tq_platforms), w.worker_id, w.slots, w.standby"
                        " FROM (SELECT worker_id, count(*) FILTER (WHERE send_at IS NOT NULL) AS slots,"
                        "        count(*) FILTER (WHERE send_at IS NULL) AS standby"
                        "       FROM worker_tasks WHERE status = 'running' GROUP BY worker_id) w"
                    ).fetchall()
                    for r in row:
                        if r[0] > max_in_flight or r[2] > 4 or r[3] > 2 * r[2]:
                            over.append(r)

        relays = Counter[int]()

        def pass_to(many: TaskQueue, i: int, task: Task, to: Task, replace: bool) -> Task | None:
            if i % 2 == 0:
                decision, new = many.platform_pass(task, to, replace=replace)
            else:
                sent = relays[task.id] > 0  # as if its standby had sent on the relay it holds
                decision, relay, new = many.platform_relay(task, to, replace=replace, sent=sent)
                relays[to.id] += relay
            assert decision.decision == "go"
            return new

        def pass_on(many: TaskQueue, i: int) -> None:
            try:
                task = held[i]
                while True:
                    # Two standbys at a time, where the bound allows: they race the other threads'.
                    ready = [s for s in (many.platform_standby(task), many.platform_standby(task)) if s]
                    if not ready:
                        break
                    taken[i].extend(s.id for s in ready)
                    # Every other pass claims a standby in the same statement, and passes to it.
                    new = pass_to(many, i, task, ready[0], len(ready) == 1)
                    assert many.complete(task, {"passed": True})
                    task = ready[0]
                    if new is not None:
                        assert (new.worker_id, new.send_at) == (task.worker_id, None)
                        taken[i].append(new.id)
                        assert pass_to(many, i, task, new, False) is None
                        assert many.complete(task, {"passed": True})
                        task = new
                    for extra in ready[1:]:
                        # Its own slot, if one is free; else given back untried.
                        if many.platform_request(extra, first=True).decision != "go":
                            assert many.defer(extra, 0)
                            taken[i].remove(extra.id)
                        else:
                            assert many.complete(extra, {"extra": True})
            except BaseException as exc:  # reported below
                errors.append(exc)

        with TaskQueue.connect(db_url, min_size=max_in_flight, max_size=max_in_flight) as many:
            watcher = threading.Thread(target=watch)
            watcher.start()
            threads = [threading.Thread(target=pass_on, args=(many, i)) for i in range(max_in_flight)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            stop.set()
            watcher.join()
    finally:
        for s in sessions:
            s.close()
    assert errors == []
    assert sum(relays.values()) >= 20, relays
    ids = [i for chain in taken for i in chain]
    assert len(ids) == len(set(ids)) == stores
    assert over == []
    assert conn.execute("SELECT in_flight FROM tq_platforms").fetchone() == (max_in_flight,)
    assert conn.execute(
        "SELECT count(*) FROM worker_tasks WHERE status = 'running' AND send_at IS NULL"
    ).fetchone() == (0,)
    assert_platform_counters_consistent(conn)
    assert_store_state_consistent(conn)


class Platform:
    """A platform's side of the requests: how many are in at once, at most."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.now = self.most = self.served = 0

    def request(self, ctx: TaskContext, block: threading.Event | None = None) -> None:
        permit = current_permit.get()
        assert permit is not None, "a limited platform's task has a permit"
        with permit.request():
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(self.seconds)
            if block is not None:
                block.wait(10)
            with self.lock:
                self.now -= 1
                self.served += 1
        ctx.release_platform()


def test_a_drain_passes_its_slots_to_standby_tasks_within_the_limit(
    conn: psycopg.Connection, queue: TaskQueue
):
    """A drain run of 8 threads on a platform of 3 slots: most slots go to standby tasks
    (passes), the platform never has more than 3 requests in, each task completes once, and no
    slot or standby is left when the queue is empty."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 3, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 60, platform="dutchie"))
    platform = Platform(0.03)

    def handler(task: Task, ctx: TaskContext) -> None:
        platform.request(ctx)

    worker = Worker(queue, ROLE, handler, worker_id="w", concurrency=8, idle_poll_seconds=None)
    stats = worker.run()
    assert (stats.completed, stats.failed, stats.lost, stats.deferred) == (60, 0, 0, 0)
    assert platform.served == 60 and platform.most == 3
    assert stats.passes >= 30, stats
    # At 1,000 requests a second for 3 slots, most passes went on relays, sent before their record.
    assert stats.relays >= stats.passes // 2, stats
    assert stats.standbys >= stats.passes
    assert status_counts(conn) == {"completed": 60}
    assert in_flight(conn, "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)
    assert_store_state_consistent(conn)


def test_a_drains_first_slots_are_passed_to_standbys_already_in_line(
    conn: psycopg.Connection, queue: TaskQueue
):
    """A run's first requests end together: its standbys are claimed with its first claim, so
    the first slots freed are passed on in line, none claimed for (a hand-off)."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 10, platform="dutchie"))
    lock = threading.Lock()
    in_line: list[int] = []  # standby tasks in PostgreSQL as each request ends

    def handler(task: Task, ctx: TaskContext) -> None:
        permit = current_permit.get()
        assert permit is not None
        with permit.request():
            time.sleep(0.2)
            with queue.pool.connection() as c:
                [(n,)] = c.execute(
                    "SELECT count(*) FROM worker_tasks"
                    " WHERE worker_id = 'w' AND status = 'running' AND send_at IS NULL"
                ).fetchall()
            with lock:
                in_line.append(n)
        ctx.release_platform()

    worker = Worker(queue, ROLE, handler, worker_id="w", concurrency=8, idle_poll_seconds=None)
    stats = worker.run()
    assert (stats.completed, stats.failed, stats.lost, stats.deferred) == (10, 0, 0, 0)
    # Both first requests ended with the line full (2 standbys), and every slot went to one.
    assert in_line[:2] == [2, 2], in_line
    assert stats.hand_offs == 0 and stats.passes == 8, stats
    assert status_counts(conn) == {"completed": 10}
    assert in_flight(conn, "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)


class SlowToAnswerPass(TaskQueue):
    """Passes answered 60 ms after they are asked for, as when the run's pooled connections
    are all busy with its handlers' reads and writes."""

    def platform_relay(
        self, held: Task, standby: Task, *, replace: bool = False, sent: bool = False
    ) -> tuple[RequestDecision, bool, Task | None]:
        time.sleep(0.06)
        return super().platform_relay(held, standby, replace=replace, sent=sent)


def test_a_standby_reckons_its_start_from_the_pass_s_answer(conn: psycopg.Connection, queue: TaskQueue):
    """A pass's start is reckoned from its answer, however long the call waited before its
    statement ran: the standby sends at once, rather than take the wait for lateness and ask
    PostgreSQL for another start (or, where a rate binds, send that much before its start). At
    50 requests a second for 3 slots the queue gives no relays: every standby waits for its pass."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 3, 50.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 60, platform="dutchie"))
    platform = Platform(0.1)

    def handler(task: Task, ctx: TaskContext) -> None:
        platform.request(ctx)

    slow = SlowToAnswerPass(queue.pool)
    worker = Worker(slow, ROLE, handler, worker_id="w", concurrency=8, idle_poll_seconds=None)
    stats = worker.run()
    assert (stats.completed, stats.failed, stats.lost, stats.deferred) == (60, 0, 0, 0)
    assert platform.served == 60 and platform.most == 3
    assert stats.passes >= 10 and stats.relays == 0, stats
    # Each pass's standby would be 60 ms late for a start reckoned from the call; a few may
    # wake late on a busy machine.
    assert stats.late_starts <= stats.passes // 4, stats
    assert in_flight(conn, "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)


def test_a_stopping_drain_gives_its_standby_tasks_back_untried(conn: psycopg.Connection, queue: TaskQueue):
    """The first tasks' requests end at once and pass their slots on; the next hold theirs until
    released. Stopped meanwhile, the run finishes what holds a slot and gives its standby tasks
    back untried, no retry spent; nothing is left running or counted."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 2, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 20, platform="dutchie"))
    platform = Platform(0.0)
    hold = threading.Event()
    started = Counter[str]()

    def handler(task: Task, ctx: TaskContext) -> None:
        started["n"] += 1
        platform.request(ctx, None if started["n"] <= 4 else hold)

    worker = Worker(queue, ROLE, handler, worker_id="w", concurrency=8, idle_poll_seconds=None)

    def stop_when_standbys_wait() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and worker.stats.standbys < 2:
            time.sleep(0.01)
        time.sleep(0.2)
        worker.stop()
        hold.set()

    stopper = threading.Thread(target=stop_when_standbys_wait)
    stopper.start()
    stats = worker.run()
    stopper.join()
    assert stats.standbys >= 2 and stats.deferred >= 1, stats
    assert platform.most <= 2
    counts = status_counts(conn)
    assert set(counts) <= {"completed", "pending"} and counts["completed"] == stats.completed, counts
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE retry_count > 0").fetchone() == (0,)
    assert in_flight(conn, "dutchie") == (0, 0)
    assert_platform_counters_consistent(conn)
    assert_store_state_consistent(conn)


def test_a_standby_told_to_ask_finds_the_platform_full_and_waits_in_line_again(
    conn: psycopg.Connection, queue: TaskQueue
):
    """A slot came back and a standby was told to ask for it, but a claim took it first: the
    standby finds the platform full (0027) and goes back in line, its task kept (not given back);
    the next pass reaches it and its request goes."""
    queue.sync_platform_limits([PlatformLimits("dutchie", 1, 1000.0)])
    add_platform_tasks(conn, "dutchie", add_stores(conn, 3, platform="dutchie"))
    [holder] = queue.claim_many(ROLE, "w", 1, start=True)
    standby = queue.platform_standby(holder)
    assert standby is not None
    line = StandbyLine()
    permit = PlatformPermit(queue, standby, threading.Event(), line=line)
    assert line.add(permit)
    sent = threading.Event()

    def first_request() -> None:
        with permit.request():
            sent.set()

    requester = threading.Thread(target=first_request)
    requester.start()
    try:
        line.poke("dutchie")  # told to ask: the holder still has the only slot
        assert not sent.wait(0.5)
        assert line.take("dutchie") is permit  # back in line, waiting
        assert not slot_of(conn, standby.id) and in_flight(conn, "dutchie") == (1, 1)

        asked = time.monotonic()
        decision, _ = queue.platform_pass(holder, standby)
        permit.passed(asked, decision)
        assert sent.wait(5)
    finally:
        permit.passed(time.monotonic(), None)  # whatever happened, the thread ends
        requester.join(5)
    assert permit.requests == 1 and not permit.standby
    assert slot_of(conn, standby.id) and in_flight(conn, "dutchie") == (1, 1)
    assert_platform_counters_consistent(conn)
