"""A worker that drains one role: claim in batches, run handlers, keep leases, report outcomes.

Plain Python over :class:`TaskQueue`; Dagster's drain op wraps it, and a process outside Dagster
can run it the same way.
"""

import contextvars
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import (
    JSON,
    QueueInputError,
    RequestDecision,
    Task,
    TaskQueue,
    WorkerSession,
    storable_text,
)

log = logging.getLogger(__name__)

# After a claim that came back short, how long the main loop leaves claiming to hand-offs and to
# slots given back with outcomes before it asks again.
SHORT_RETRY_SECONDS = 0.25

# A request's thread that wakes this long after its start asks PostgreSQL again rather than
# send late (PlatformPermit.request); after this many late wakes in a row the task is deferred.
LATE_START_SECONDS = 0.01
MAX_LATE_STARTS = 4

# Standby tasks (0028) a worker keeps per platform whose slots it passes on: claimed without a
# slot and run up to their first request, so that a slot passed on is used at once. One that
# waits this long for a slot leaves the line and asks for one of its own.
STANDBY_PER_PLATFORM = 2
STANDBY_WAIT_SECONDS = 5.0

# A relay (0031), the start of a slot's next request given with a pass, is used within this long
# of its answer or not at all: the queue's bound on the requests relays add to any second of a
# platform holds for relays used within a second. A standby passed a relay sends at once.
RELAY_SECONDS = 0.9
# How long a standby sent on a relay waits, when it is done with its requests, for the record
# of that relay (the slot's move in PostgreSQL) before it passes the slot on in turn.
RELAY_RECORD_WAIT_SECONDS = 30.0
# How long a passer that relayed waits for its standby's request to go before it records the pass.
RELAY_SEND_WAIT_SECONDS = 0.02


class PermanentTaskError(Exception):
    """Raised by a handler for a failure that a retry cannot fix: the task fails at once."""


class TransientTaskError(Exception):
    """Raised by a handler for a failure worth retrying (timeout, 429, 5xx): the task goes back to
    the queue with backoff, and no sooner than ``retry_after`` seconds when the server said so."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeferTask(Exception):
    """Raised by a handler that chose not to do the task now (its host is saturated): the task
    goes back untried, due in ``delay`` seconds, without spending a retry."""

    def __init__(self, delay: float, reason: str) -> None:
        super().__init__(reason)
        self.delay = delay


class LeaseLostError(Exception):
    """The worker no longer owns the task; whatever the handler was about to write is dropped."""


class StandbyLine:
    """A worker's standby tasks, per platform: claimed without a slot (``platform_standby``), their
    handlers waiting at their first request for a slot a finished task passes on
    (``platform_relay``). Closed when the worker stops: no task waits for a slot after that."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._line: dict[str, list[PlatformPermit]] = {}
        # Places promised to standbys being claimed: two top-ups at once claim no more than one.
        self._reserved: dict[str, int] = {}
        self._closed = False

    def reserve(self, platform: str, most: int) -> int:
        """Places for up to ``most`` more standbys of the platform, up to ``STANDBY_PER_PLATFORM``
        in line or promised; each is then ``add``-ed or given back with ``unreserve``."""
        with self._lock:
            if self._closed:
                return 0
            held = len(self._line.get(platform, ())) + self._reserved.get(platform, 0)
            n = max(0, min(most, STANDBY_PER_PLATFORM - held))
            self._reserved[platform] = self._reserved.get(platform, 0) + n
            return n

    def unreserve(self, platform: str, n: int) -> None:
        with self._lock:
            self._reserved[platform] = self._reserved.get(platform, 0) - n

    def add(self, permit: "PlatformPermit", *, reserved: bool = False) -> bool:
        """Into the line (in a place ``reserved`` before); False once closed."""
        with self._lock:
            if reserved:
                self._reserved[permit.platform] = self._reserved.get(permit.platform, 0) - 1
            if self._closed:
                return False
            self._line.setdefault(permit.platform, []).append(permit)
            return True

    def take(self, platform: str) -> "PlatformPermit | None":
        """Out of the line, to be passed a slot: one already waiting at its request first."""
        with self._lock:
            line = self._line.get(platform)
            if not line:
                return None
            ready = next((p for p in line if p.waiting), line[0])
            line.remove(ready)
            return ready

    def poke(self, platform: str) -> None:
        """A slot of the platform came back with no pass (a task's outcome, a release): one
        standby asks for a slot of its own now, instead of waiting out its time in line."""
        permit = self.take(platform)
        if permit is not None:
            permit.passed(time.monotonic(), RequestDecision("full", 0.0))

    def empty(self) -> bool:
        """No standby in line or promised, of any platform."""
        with self._lock:
            return not any(self._line.values()) and not any(self._reserved.values())

    def withdraw(self, permit: "PlatformPermit") -> bool:
        """Out of the line on its own (waited too long, or done without a request); False when a
        passer took it first: its answer is on its way."""
        with self._lock:
            line = self._line.get(permit.platform, [])
            if permit in line:
                line.remove(permit)
                return True
            return False

    def close(self) -> None:
        """No more standbys; the ones waiting give their tasks back untried."""
        with self._lock:
            self._closed = True
            waiting = [p for line in self._line.values() for p in line]
            self._line.clear()
        for permit in waiting:
            permit.passed(time.monotonic(), None)


class PlatformPermit:
    """A task's requests to its platform, under the limits every worker shares (``tq_platforms``).

    The claim counted the task in its platform's slots and reserved the start of its first
    request; each further request takes the next start the platform's rate allows. Every request
    asks PostgreSQL first, so a pause reaches tasks already claimed, except a standby's first
    sent on a relay: a start booked with its slot's last pass, at most 0.9 s before (0031). A
    task's requests go one at a time: its one slot covers one request in flight. HTTP clients
    call :meth:`request` around each request (``tq_pipelines.crawl.http.PoliteClient`` does),
    :meth:`report_error` for answers that speak of the platform (5xx, 429, timeouts) and
    :meth:`report_answer` for the others (which reopens a half-open platform when this task is
    its probe). A handler done with its requests calls :meth:`release`
    (``ctx.release_platform()``) so that the slot serves another task while it stores what it
    fetched; else the slot goes back with its outcome. With ``hand_off`` (the worker's), the
    release passes the slot straight to the next task of the platform (a standby, or one
    ``platform_handoff`` claims); ``hand_off`` returns False when it cannot take one (no free
    thread, the worker stopping), and the slot is then simply given back.
    """

    def __init__(
        self,
        queue: TaskQueue,
        task: Task,
        lease_lost: threading.Event,
        on_release: Callable[[str], None] | None = None,
        hand_off: Callable[["PlatformPermit"], bool] | None = None,
        line: StandbyLine | None = None,
    ) -> None:
        self.queue = queue
        self.on_release = on_release
        self.hand_off = hand_off
        # A standby (0028): no slot yet; its first request waits in ``line`` for one passed on.
        self.line = line
        self.standby = line is not None
        self.waiting = False
        self._passed = threading.Event()
        self._pass: tuple[float, RequestDecision | None, float | None] = (0.0, None, None)
        # A relay this task holds (0031): until this time.monotonic(), the standby it passes its
        # slot to may send at once, the pass recorded after. None: none.
        self.relay_until: float | None = None
        # Cleared while a relay's record is on its way: the slot is this task's in PostgreSQL
        # only once it is set again.
        self.recorded = threading.Event()
        self.recorded.set()
        # Set as its first request goes: a passer that relayed to it records the pass after.
        self.sending = threading.Event()
        self.task = task
        self.platform = task.platform or ""
        self.lease_lost = lease_lost
        self.requests = 0
        # Starts asked for again because the thread woke too late for the one given (a busy
        # machine shows here first).
        self.late_starts = 0
        self.released = False
        # A hand-off's claim is its first request's permission, given while the platform was
        # open: (time.monotonic() of the claim, seconds from then to its send_at). None: ask.
        self.first_start: tuple[float, float] | None = None
        # The task probes its half-open platform: the first healthy answer reopens it for all.
        self.probing = False
        self._one_at_a_time = threading.Lock()

    @contextmanager
    def request(self) -> Iterator[None]:
        """Hold the task's slot for one request: waits for its start; raises :class:`DeferTask`
        when the platform is paused, :class:`LeaseLostError` when the task is no longer ours."""
        with self._one_at_a_time:
            if self.released:
                raise RuntimeError(
                    f"task {self.task.id} gave its {self.platform} slot back and cannot send more requests"
                )
            first = self.requests == 0
            if not first:
                # Sent on a relay: the slot is this task's in PostgreSQL once that is recorded.
                self.recorded.wait(RELAY_RECORD_WAIT_SECONDS)
            # Sent at once up to this time.monotonic(), whatever the start: a relay's (0031).
            relayed_until: float | None = None
            if first and self.standby:
                due, relayed_until = self._await_pass()
            elif first and self.first_start is not None:
                claimed, delay = self.first_start
                due = claimed + delay
            else:
                due = self._ask(first)
            late = 0
            while True:
                # The wait is at most about a second (the claim looks no further ahead); a lost
                # lease ends it.
                wait = due - time.monotonic()
                if wait > 0 and self.lease_lost.wait(wait):
                    raise LeaseLostError(f"lease on task {self.task.id} lost while waiting to send")
                now = time.monotonic()
                if now - due <= LATE_START_SECONDS or (relayed_until is not None and now <= relayed_until):
                    break
                # Woken late (a busy machine, a stalled process): sent now, the request would
                # arrive among the starts given after its own. PostgreSQL keeps a claim's start
                # within the platform's grace, else gives the next (0019).
                late += 1
                self.late_starts += 1
                if late == MAX_LATE_STARTS:
                    reason = f"task {self.task.id} woke late for {late} starts of {self.platform}"
                    raise DeferTask(1.0, reason)
                due = self._ask(first)
            self.requests += 1
            self.sending.set()
            yield

    def passed(
        self, answered: float, decision: RequestDecision | None, relayed_until: float | None = None
    ) -> None:
        """The answer to a standby: a slot passed on ('go', its start ``decision.wait_seconds``
        after ``answered``, the ``time.monotonic()`` the pass returned; or, ``relayed_until``
        given, at once on the passer's relay, sent up to then), none (anything else: ask for
        one), or None: the worker is stopping."""
        self._pass = (answered, decision, relayed_until)
        self._passed.set()

    def _await_pass(self) -> tuple[float, float | None]:
        """A standby's first request: wait in line for a slot passed on. Told to ask (a slot came
        back with no pass, or a pass failed), it asks for one of its own and, the platform full
        again (another claim took it), goes back in line. After ``STANDBY_WAIT_SECONDS`` it leaves
        the line and asks once more; then a full platform gives the task back."""
        waited = time.monotonic()
        self.waiting = True
        try:
            while True:
                if self._passed.wait(0.25):
                    answered, decision, relayed_until = self._pass
                    self._passed.clear()
                    if decision is None:
                        raise self._stopping()
                    if decision.decision == "go":
                        self.standby = False
                        return answered + decision.wait_seconds, relayed_until
                    due = self._start(True)
                    if due is not None:
                        self.standby = False
                        return due, None
                    if self.line is None or not self.line.add(self):
                        raise self._stopping()
                    continue
                gone = self.lease_lost.is_set()
                if (gone or time.monotonic() - waited >= STANDBY_WAIT_SECONDS) and (
                    self.line is None or self.line.withdraw(self)
                ):
                    if gone:
                        raise LeaseLostError(f"lease on task {self.task.id} lost while waiting for a slot")
                    self.standby = False
                    return self._ask(True), None
        finally:
            self.waiting = False

    def _stopping(self) -> DeferTask:
        """A standby given back untried: its worker stops before a slot came to it."""
        return DeferTask(0.0, f"worker stopping: task {self.task.id} had no {self.platform} slot")

    def _ask(self, first: bool) -> float:
        """Ask PostgreSQL for the request's start: its ``time.monotonic()``. A task holding no
        slot that finds none free is given back."""
        due = self._start(first)
        if due is None:
            raise DeferTask(1.0, f"platform {self.platform} has no free slot")
        return due

    def _start(self, first: bool) -> float | None:
        """The request's start from PostgreSQL (``time.monotonic()``); None when the task holds no
        slot and none is free ('full', 0027)."""
        answer = self.queue.platform_request(self.task, first=first)
        answered = time.monotonic()
        if answer.decision == "lost":
            self.lease_lost.set()
            raise LeaseLostError(f"lease on task {self.task.id} lost before a request")
        self.probing = answer.decision == "probe"
        if answer.decision == "paused":
            raise DeferTask(
                max(answer.wait_seconds, 1.0),
                f"platform {self.platform} is paused for {answer.wait_seconds:.0f} s",
            )
        if answer.decision == "full":
            return None
        return answered + answer.wait_seconds

    def release(self) -> None:
        """Done with the platform: give the task's slot back now (idempotent)."""
        with self._one_at_a_time:
            if not self.released:
                self.released = True
                if self.standby:
                    # Never given a slot: out of the line, nothing to give back. (One a passer
                    # took meanwhile goes back with the task's outcome.)
                    if self.line is not None:
                        self.line.withdraw(self)
                    return
                # A relay's record first: until it lands, the slot is the passer's in PostgreSQL.
                self.recorded.wait(RELAY_RECORD_WAIT_SECONDS)
                if self.hand_off is not None and self.hand_off(self):
                    return
                self.queue.platform_release(self.task)
                if self.on_release is not None:
                    self.on_release(self.platform)  # the worker may use the free slot now

    def abandon(self, busy_seconds: float) -> None:
        """The client gave up on the request in flight (a timeout), which the platform may go on
        serving for ``busy_seconds``: the slot stays taken that long, in PostgreSQL, whatever
        becomes of this task or process; the task sends nothing more. Called by the thread that
        holds the request (inside :meth:`request`)."""
        if not self.released:
            self.released = True
            # Sent on a relay: the slot is this task's in PostgreSQL once the relay is recorded.
            self.recorded.wait(RELAY_RECORD_WAIT_SECONDS)
            self.queue.platform_abandon(self.task, busy_seconds)

    def report_answer(self) -> None:
        """An answer that is not an error of the platform's (anything but a 5xx, a 429, a
        timeout): if this task is the platform's probe, the platform is back for every worker."""
        if self.probing:
            self.queue.platform_answered(self.task)
            self.probing = False

    def report_error(self, error: str, *, retry_after: float | None = None) -> float | None:
        """An answer that speaks of the platform (5xx, 429, a timeout): counted by its breaker.
        Returns the pause left when the platform is now paused (give the task back), else None."""
        return self.queue.platform_error(self.task, error, retry_after=retry_after)


# The permit of the task whose handler runs in this thread; None for tasks without platform limits.
current_permit: contextvars.ContextVar[PlatformPermit | None] = contextvars.ContextVar(
    "tq_current_permit", default=None
)


@dataclass
class TaskContext:
    """What a handler gets besides its task: its lease, the database, and the run's services."""

    task: Task
    worker_id: str
    log: logging.Logger
    lease_lost: threading.Event = field(default_factory=threading.Event)
    pool: ConnectionPool | None = None
    # Whatever the process that runs the worker shares with its handlers (HTTP client, settings).
    services: Any = None
    last_progress: dict[str, Any] = field(default_factory=dict)
    # Requests to the task's platform (None: its platform has no limits).
    permit: PlatformPermit | None = None
    # time.monotonic() when the claim came back: handler times are measured from it.
    claimed_at: float = field(default_factory=time.monotonic)
    # The task's completion committed with the handler's writes (complete() in transaction()).
    completed: bool = False
    _completing: bool = False

    @property
    def lost(self) -> bool:
        """True once the worker no longer owns the task: stop, the result will be discarded."""
        return self.lease_lost.is_set()

    def release_platform(self) -> None:
        """The handler is done with its platform's requests: its slot serves another task now,
        while this one goes on (storing what it fetched). No-op without platform limits."""
        if self.permit is not None:
            self.permit.release()

    def lease_params(self) -> dict[str, Any]:
        """``{"task_id", "lease"}``: what the queue's lease-fenced functions (the handlers'
        writes among them) take to know the task is still this worker's."""
        return self.task.lease.params

    def check_lease(self) -> None:
        """Raise :class:`LeaseLostError` if the lease is known to be lost."""
        if self.lost:
            raise LeaseLostError(f"lease on task {self.task.id} lost")

    def progress(self, message: str, **fields: Any) -> None:
        """Note how far the task got: logged, and added to the task's error if it then fails."""
        self.last_progress = {"message": message, **fields}
        self.log.debug("task %s: %s %s", self.task.id, message, fields or "")

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        """A transaction for the task's writes, fenced by its lease: it opens by locking the task
        row, so recovery cannot give the task away before the commit, and raises
        :class:`LeaseLostError` (writing nothing) when the task is no longer this worker's."""
        if self.pool is None:
            raise RuntimeError("this worker has no database pool for its handlers")
        self._completing = False
        with self.pool.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            if cur.execute(query("task_still_owned"), self.lease_params()).fetchone() is None:
                self.lease_lost.set()
                raise LeaseLostError(f"lease on task {self.task.id} lost: nothing written")
            yield cur
        # Committed: a completion written in it is now as true as the writes.
        self.completed = self.completed or self._completing

    def complete(self, cur: psycopg.Cursor[dict[str, Any]], result: JSON) -> None:
        """Complete the task in the handler's transaction (``with ctx.transaction() as cur``):
        its writes and its completion commit together, or neither does, so a crash at any point
        never leaves the writes done and the task due again. Fenced by the lease: when the task
        is no longer this worker's it raises :class:`LeaseLostError` and the writes roll back.
        The handler then returns ``result`` as usual; the worker records nothing more."""
        try:
            _to_jsonb_text(result)
        except (TypeError, ValueError) as exc:
            raise PermanentTaskError(f"handler result cannot be stored as JSON: {exc}") from exc
        params = {**self.lease_params(), "result": Jsonb(result)}
        if not cur.execute(query("complete_task_tx"), params).fetchone()["ok"]:  # type: ignore[index]
            self.lease_lost.set()
            raise LeaseLostError(f"lease on task {self.task.id} lost: nothing written")
        self._completing = True


Handler = Callable[[Task, TaskContext], JSON]


@dataclass
class DrainStats:
    """What one :meth:`Worker.run` did. Times are ``time.monotonic()`` seconds."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    deferred: int = 0
    claims: int = 0
    # Slots passed on from handler threads: to a task claimed in the same call (hand-offs), or
    # to a standby task waiting at its first request (passes); standby tasks claimed.
    hand_offs: int = 0
    passes: int = 0
    standbys: int = 0
    # Of those, claimed by a run holding no slot of their platform, full (0035).
    standbys_before_slot: int = 0
    # Passes whose standby sent on the passer's relay before the pass was recorded (0031).
    relays: int = 0
    # Requests whose thread woke too late for its start and asked for another (0019).
    late_starts: int = 0
    handler_seconds: float = 0.0
    first_claim_at: float | None = None
    last_finish_at: float | None = None

    @property
    def drain_seconds(self) -> float:
        """From the first claim to the last outcome recorded."""
        if self.first_claim_at is None or self.last_finish_at is None:
            return 0.0
        return self.last_finish_at - self.first_claim_at

    @property
    def tasks_per_second(self) -> float:
        done = self.completed + self.failed + self.retried
        return done / self.drain_seconds if self.drain_seconds > 0 else 0.0


@dataclass
class _Outcome:
    ctx: TaskContext
    result_json: str | None = None
    error: str | None = None
    retryable: bool = True
    retry_after: float | None = None
    defer_seconds: float | None = None
    seconds: float = 0.0
    # When the handler began and ended, in seconds after the claim.
    began: float = 0.0
    ended: float = 0.0


def _to_jsonb_text(value: JSON) -> str:
    """JSON text that PostgreSQL's jsonb accepts: no NaN or Infinity, no NUL character."""
    text = json.dumps(value, allow_nan=False)
    if "\\u0000" in text:
        raise ValueError("a string holds a NUL character (\\u0000), which jsonb refuses")
    return text


def _first_line(exc: BaseException) -> str:
    return storable_text(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, 500)


def default_worker_id(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"[:100]


class Worker:
    """Drains ``role`` with ``handler`` until the queue is empty or the time budget is spent.

    ``concurrency`` handlers run at once (1 runs them inline). Claims are batched (``batch_size``),
    completions are written in one transaction per batch, and a background thread heartbeats the
    leases every ``heartbeat_seconds``, flagging tasks whose lease was lost. A handler exception
    fails its task (retried with backoff unless it is a :class:`PermanentTaskError`); it never
    stops the worker. If the process dies, ``recover_stale_tasks`` gives its tasks back.
    """

    def __init__(
        self,
        queue: TaskQueue,
        role: str,
        handler: Handler,
        *,
        worker_id: str | None = None,
        batch_size: int = 50,
        concurrency: int = 1,
        heartbeat_seconds: float = 30.0,
        time_budget_seconds: float | None = None,
        idle_poll_seconds: float | None = None,
        idle_exit_seconds: float | None = None,
        logger: logging.Logger | None = None,
        services: Any = None,
        platform_wait_seconds: float = 10.0,
        stop_grace_seconds: float = 60.0,
    ) -> None:
        if batch_size < 1 or concurrency < 1 or heartbeat_seconds <= 0:
            raise ValueError("batch_size and concurrency must be >= 1, heartbeat_seconds > 0")
        self.queue = queue
        self.role = role
        self.handler = handler
        self.worker_id = worker_id or default_worker_id(role)
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.heartbeat_seconds = heartbeat_seconds
        self.time_budget_seconds = time_budget_seconds
        # With nothing to do, claim again every idle_poll_seconds (None: stop at once) until
        # idle_exit_seconds pass with nothing claimed (None: until the time budget is spent).
        self.idle_poll_seconds = idle_poll_seconds
        self.idle_exit_seconds = idle_exit_seconds
        self.log = logger or log
        self.services = services
        # With nothing running and nothing claimable, how long to keep waiting for platforms
        # (paused, full or rate-limited) before the run ends.
        self.platform_wait_seconds = platform_wait_seconds
        # On stop (stop(), SIGTERM, an error), how long handlers may go on finishing, their
        # leases kept alive, before what is left is given back.
        self.stop_grace_seconds = stop_grace_seconds
        self.stats = DrainStats()
        self._in_flight: dict[int, TaskContext] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Heartbeats outlive claiming: they stop only once the handlers have finished or been
        # given back.
        self._heartbeats_stop = threading.Event()
        # Set when a handler finishes or gives its platform slot back: time to record and claim.
        self._wake = threading.Event()
        self._claim_asked_at = time.monotonic()
        self._session: WorkerSession | None = None
        # Hand-offs (platform_handoff) start tasks from handler threads: the pool, threads taken
        # (submitted, handler not yet returned), the tasks handed off not yet seen by the main
        # loop, and whether a slot came back without a hand-off (the main loop may claim for it).
        self._pool: ThreadPoolExecutor | None = None
        self._busy = 0
        self._handed: list[tuple[Future[_Outcome], TaskContext]] = []
        self._slot_freed = threading.Event()
        self._deadline: float | None = None
        self._line = StandbyLine()

    def stop(self) -> None:
        """Ask the worker to stop claiming. Its handlers go on, their leases kept alive, for up to
        ``stop_grace_seconds``; what is left then is given back, untried or fenced."""
        self._stop.set()
        self._line.close()
        self._wake.set()

    def run(self) -> DrainStats:
        """Drain until empty or out of time; returns what this run did."""
        self.stats = DrainStats()
        self._stop.clear()
        self._heartbeats_stop.clear()
        # Registered on a connection of its own: if this process dies, the server knows at once.
        self._session = self.queue.open_session(
            self.worker_id,
            self.role,
            hostname=socket.gethostname(),
            heartbeat_seconds=self.heartbeat_seconds,
            on_slot_free=self._slot_free_elsewhere,
        )
        started = time.monotonic()
        self._deadline = None if self.time_budget_seconds is None else started + self.time_budget_seconds
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="tq-heartbeat", daemon=True)
        heartbeat.start()
        pool = ThreadPoolExecutor(self.concurrency, "tq-handler") if self.concurrency > 1 else None
        with self._lock:
            self._pool, self._busy, self._handed = pool, 0, []
            self._line = StandbyLine()
        running: dict[Future[_Outcome], TaskContext] = {}
        # After a short claim, claim again only once a slot came back without a hand-off (a
        # task ended holding its slot, or gave it back with no thread free to hand it to), or
        # SHORT_RETRY_SECONDS passed (other runs' slots, rates refilling, shares changing):
        # hand-offs keep the slots busy meanwhile, and every empty claim queues on the
        # platforms' rows with them.
        short = False
        short_at = 0.0
        idle_since: float | None = None
        # With a pool, claim again once a quarter of the threads are free, not at every finished
        # task: one claim and one completion write per few tasks instead of per task.
        refill_at = max(1, self.concurrency // 4)
        try:
            # Told to stop: what runs gets stop_grace_seconds in _finish, heartbeats alive.
            while not self._stop.is_set():
                budget_left = (
                    self.time_budget_seconds is None or time.monotonic() - started < self.time_budget_seconds
                )
                if not budget_left:
                    self._line.close()  # out of time: no task waits for a slot
                self._take_handed(running)
                if short and (
                    self._slot_freed.is_set() or time.monotonic() - short_at >= SHORT_RETRY_SECONDS
                ):
                    short = False
                with self._lock:
                    free = self.concurrency - (self._busy if pool is not None else len(running))
                claimed: list[Task] = []
                if (
                    budget_left
                    and not self._stop.is_set()
                    and free >= (refill_at if running else 1)
                    and not (short and running)
                ):
                    # With a pool, only as many as there are free threads: a task counts as
                    # running from its claim, so it must not wait in the pool's queue. The
                    # threads are taken before the claim, so that hand-offs meanwhile cannot
                    # take them too.
                    want = min(self.batch_size if pool is None else free, self.batch_size)
                    if pool is not None:
                        with self._lock:
                            want = min(want, self.concurrency - self._busy)
                            self._busy += want
                    self._slot_freed.clear()
                    try:
                        claimed = self._claim(want) if want > 0 else []
                    finally:
                        if pool is not None:
                            with self._lock:
                                self._busy -= want - len(claimed)
                    short = len(claimed) < want
                    short_at = time.monotonic()
                if claimed or running:
                    idle_since = None
                if claimed:
                    # What finished while we claimed is recorded now too: under a steady stream
                    # every pass claims, and outcomes left for a pass that claims nothing would
                    # pile up unwritten, their leases heartbeaten (or, past 1,000, not at all).
                    outcomes = (
                        self._run_inline(self._contexts(claimed))
                        if pool is None
                        else self._submit(pool, running, claimed) + self._finished(running)
                    )
                    if pool is not None:
                        self._top_up_lines(claimed)
                elif running:
                    # Platforms free up without our handlers finishing (other runs complete,
                    # rates refill): a short claim is retried within SHORT_RETRY_SECONDS. Tasks
                    # that completed in their transaction and handed their slot on do not wake
                    # the loop (nothing waits on them): they are counted at the next wake.
                    self._wake.wait(min(self.heartbeat_seconds, SHORT_RETRY_SECONDS))
                    self._wake.clear()
                    self._take_handed(running)
                    # Whatever else finished meanwhile is recorded in the same write.
                    outcomes = self._finished(running)
                elif budget_left and not self._stop.is_set() and (pause := self._platform_wait(idle_since)):
                    idle_since = idle_since or time.monotonic()
                    if pool is not None and self._line.empty():
                        self._stand_by()
                    # Woken early by a slot another worker's share gave back (a standby asks
                    # for it, and the loop claims), or by stop().
                    self._wake.wait(pause)
                    self._wake.clear()
                    continue
                elif (
                    budget_left
                    and not self._stop.is_set()
                    and self.idle_poll_seconds
                    and not (
                        self.idle_exit_seconds is not None
                        and idle_since is not None
                        and time.monotonic() - idle_since > self.idle_exit_seconds
                    )
                ):
                    idle_since = idle_since or time.monotonic()
                    self._stop.wait(self.idle_poll_seconds)
                    continue
                else:
                    break
                self._record(outcomes)
        except BaseException:
            self._stop.set()
            # The run's own error is the one it reports: whatever stopping in order meets after
            # it (the database it lost, say) is logged, never raised in its place.
            try:
                self._finish(pool, running, heartbeat)
            except Exception:
                self.log.exception("while stopping after an error")
            raise
        self._stop.set()
        self._finish(pool, running, heartbeat)
        return self.stats

    def _finish(
        self,
        pool: ThreadPoolExecutor | None,
        running: dict[Future[_Outcome], TaskContext],
        heartbeat: threading.Thread,
    ) -> None:
        """Stop in order: no more claims (already); heartbeats go on while running handlers
        finish, for up to ``stop_grace_seconds``, and their outcomes are recorded; what is still
        running then is given back (its handler's later writes are fenced off); heartbeats stop
        last, then the worker goes offline."""
        try:
            # _stop is set: no hand-off adds a task after this, and no standby waits.
            self._line.close()
            self._take_handed(running)
            if running:
                finished, left = wait(running, timeout=self.stop_grace_seconds)
                self._record([f.result() for f in finished])
                for future in left:
                    ctx = running[future]
                    ctx.lease_lost.set()  # the handler should stop; its writes would be refused
                    if self.queue.defer(ctx.task, 0):
                        self.stats.deferred += 1
                    self.log.warning(
                        "task %s still running %.0f s after stop: given back",
                        ctx.task.id,
                        self.stop_grace_seconds,
                    )
                running.clear()
        finally:
            with self._lock:
                self._pool = None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            self._heartbeats_stop.set()
            heartbeat.join()
            if self._session is not None:
                self._session.close()
                self._session = None

    def _run_inline(self, contexts: list[TaskContext]) -> list[_Outcome]:
        """A claimed batch, one task after another; once the worker is told to stop, the tasks
        not begun are given back untried (no retry spent)."""
        outcomes = []
        for ctx in contexts:
            if self._stop.is_set():
                with self._lock:
                    self._in_flight.pop(ctx.task.id, None)
                if self.queue.defer(ctx.task, 0):
                    self.stats.deferred += 1
                continue
            outcomes.append(self._run_one(ctx))
        return outcomes

    # -- steps ------------------------------------------------------------------------------------

    def _platform_wait(self, idle_since: float | None) -> float | None:
        """Nothing claimable and nothing running: how long to sleep before claiming again when
        due work waits only for its platforms, or None to stop (no due work, or waited enough)."""
        if self.platform_wait_seconds <= 0:
            return None
        if idle_since is not None and time.monotonic() - idle_since > self.platform_wait_seconds:
            return None
        wait = self.queue.claim_wait(self.role)
        if wait is None or wait > self.platform_wait_seconds:
            return None
        return min(max(wait, 0.05), 1.0)

    def _claim(self, want: int) -> list[Task]:
        # Claimed and started in one statement: every task claimed here begins straight away.
        # Handler times are measured from the moment the claim was asked for, as its claimed_at
        # is the database's time at the start of the claim.
        self._claim_asked_at = time.monotonic()
        tasks = self.queue.claim_many(self.role, self.worker_id, want, start=True)
        with self._lock:  # hand-offs count their claims from other threads
            self.stats.claims += 1
            if tasks:
                if self.stats.first_claim_at is None:
                    self.stats.first_claim_at = time.monotonic()
                self.stats.claimed += len(tasks)
        return tasks

    def _contexts(
        self, tasks: list[Task], claimed_at: float | None = None, *, standby: bool = False
    ) -> list[TaskContext]:
        """The tasks' contexts, registered for heartbeats. A task the claim gave a slot gets its
        platform's permit; a ``standby`` one (claimed without a slot) a permit that waits for one."""
        contexts = []
        hand_off = self._hand_off if self._pool is not None else None
        for t in tasks:
            ctx = TaskContext(
                t,
                self.worker_id,
                self.log,
                pool=self.queue.pool,
                services=self.services,
                claimed_at=self._claim_asked_at if claimed_at is None else claimed_at,
            )
            if t.send_at is not None or standby:  # the claim reserved its platform's start, or will
                line = self._line if standby else None
                ctx.permit = PlatformPermit(
                    self.queue, t, ctx.lease_lost, self._slot_given_back, hand_off, line
                )
            contexts.append(ctx)
        with self._lock:
            self._in_flight.update((c.task.id, c) for c in contexts)
        return contexts

    def _slot_given_back(self, platform: str) -> None:
        """A slot went back without a hand-off: a standby of the platform may take it, or the
        main loop claim for it."""
        self._line.poke(platform)
        self._slot_freed.set()
        self._wake.set()

    def _slot_free_elsewhere(self, role: str, platform: str, worker: str) -> None:
        """Another worker of the role gave a slot of ``platform`` back to its share (0032): one
        of our standbys of the platform asks for it, and the main loop claims, now rather than at
        its next retry. Whoever asks first gets it, within our share."""
        if role != self.role or worker == self.worker_id:
            return
        self._line.poke(platform)
        self._slot_freed.set()
        self._wake.set()

    def _submit(
        self, pool: ThreadPoolExecutor, running: dict[Future[_Outcome], TaskContext], tasks: list[Task]
    ) -> list[_Outcome]:
        # The threads were taken before the claim (_busy).
        for ctx in self._contexts(tasks):
            future = pool.submit(self._run_one, ctx)
            future.add_done_callback(self._on_done(ctx))
            running[future] = ctx
        return []

    @staticmethod
    def _finished(running: dict[Future[_Outcome], TaskContext]) -> list[_Outcome]:
        """The outcomes of the handlers that have finished, out of ``running``."""
        done = [f for f in running if f.done()]
        for f in done:
            del running[f]
        return [f.result() for f in done]

    def _on_done(self, ctx: TaskContext) -> Callable[[Future[_Outcome]], None]:
        """Wake the main loop when a finished task may leave it something to do now: an outcome
        to write, a thread to claim for, or a slot it gave back with its outcome. A task that
        completed in its transaction after passing its slot on does not: hand-offs keep its
        platform busy, and the loop counts it at its next wake."""

        def done(_: Future[_Outcome]) -> None:
            if not (ctx.completed and ctx.permit is not None and ctx.permit.released):
                self._wake.set()

        return done

    def _take_handed(self, running: dict[Future[_Outcome], TaskContext]) -> None:
        """The tasks hand-offs started join the main loop's."""
        with self._lock:
            handed, self._handed = self._handed, []
        running.update(handed)

    def _hand_off(self, permit: PlatformPermit) -> bool:
        """From a handler thread done with its platform's requests: pass the slot on without
        waiting for the main loop. To a standby task of the platform if one is in line (one short
        call, ``platform_relay``, and its thread sends at once; with a relay, it sends before the
        call); else to the next due task, claimed and started in a free thread in the same call
        (``platform_handoff``). Then the line is topped up. False, doing nothing, when the worker
        is stopping or out of time, or no thread is free for a hand-off: the slot is then
        released."""
        task = permit.task
        with self._lock:
            if (
                self._pool is None
                or self._stop.is_set()
                or (self._deadline is not None and time.monotonic() >= self._deadline)
            ):
                return False
            standby = self._line.take(task.platform or "")
            # A thread for the next task: the one claimed, or the standby claimed in place of
            # the one passed to (without a free thread, the line is one shorter).
            thread = self._busy < self.concurrency
            if standby is None and not thread:
                return False
            self._busy += thread
        if standby is not None:
            return self._pass(permit, standby, thread)
        asked = time.monotonic()  # the hand-off's claimed_at, as the main loop's claims
        try:
            nxt = self.queue.platform_handoff(task)
        except BaseException:
            with self._lock:
                self._busy -= 1
            raise
        if nxt is None:
            with self._lock:
                self._busy -= 1
            return True
        answered = time.monotonic()
        [ctx] = self._contexts([nxt], claimed_at=asked)
        if ctx.permit is not None and nxt.send_at is not None and nxt.claimed_at is not None:
            # From the answer, as a pass's start (above).
            ctx.permit.first_start = (answered, max(0.0, (nxt.send_at - nxt.claimed_at).total_seconds()))
        if self._start_handed(ctx):
            with self._lock:
                self.stats.hand_offs += 1
            self._top_up(nxt)
        return True

    def _pass(self, permit: PlatformPermit, standby: PlatformPermit, thread: bool) -> bool:
        """The slot of ``permit`` to ``standby`` (taken from the line), with a standby claimed in
        its place when ``thread`` (one taken for it). With a relay still good, the standby sends
        first and the pass is its record; else the standby waits for the pass's start."""
        # A relay goes only to a standby already at its request, and from tasks both still held
        # as far as the heartbeat knows: its request goes before anything is asked.
        relay = permit.relay_until
        sent = (
            relay is not None
            and time.monotonic() < relay
            and standby.waiting
            and not permit.lease_lost.is_set()
            and not standby.lease_lost.is_set()
        )
        if sent:
            standby.recorded.clear()
            standby.passed(time.monotonic(), RequestDecision("go", 0.0), relayed_until=relay)
            # Its request first: the record would take the process's time from the send. (A
            # standby not yet at its request is not waited for long.)
            standby.sending.wait(RELAY_SEND_WAIT_SECONDS)
        decision = RequestDecision("full", 0.0)
        replacement = None
        asked = time.monotonic()  # a relay is good from before it was given: never longer
        try:
            decision, relayed, replacement = self.queue.platform_relay(
                permit.task, standby.task, replace=thread, sent=sent
            )
            if relayed:
                standby.relay_until = asked + RELAY_SECONDS
        finally:
            if sent:
                standby.recorded.set()
            else:
                # On an error too: the standby asks on its own. Its start is reckoned from the
                # answer, as a request's (_start): from the call, a wait for a pooled connection
                # would send it early where a rate binds, and late (asking again) where none does.
                standby.passed(time.monotonic(), decision)
            if thread and replacement is None:
                with self._lock:
                    self._busy -= 1
        if replacement is not None:
            self._start_standby(replacement)
        if decision.decision == "lost":
            # Nothing moved. Passed, the slot (if still ours) goes back; relayed, it stays with
            # its task until the task's outcome: the standby's request is out.
            if sent:
                self.log.warning(
                    "task %s: the pass of its %s slot to task %s was sent on a relay and not recorded",
                    permit.task.id,
                    permit.platform,
                    standby.task.id,
                )
            return sent
        if decision.decision == "go":
            with self._lock:
                self.stats.passes += 1
                self.stats.relays += sent
            self._top_up(standby.task)
        else:
            # It went back alone (paused, or the limits shrank): the main loop may claim.
            self._slot_freed.set()
            self._wake.set()
        return True

    def _start_handed(self, ctx: TaskContext) -> bool:
        """Run a task a handler thread claimed (its thread taken already), unless the worker began
        stopping meanwhile: the task then goes back untried."""
        with self._lock:
            self.stats.claimed += 1
            if self._stop.is_set() or self._pool is None:
                self._busy -= 1
                self._in_flight.pop(ctx.task.id, None)
                give_back = True
            else:
                give_back = False
                future = self._pool.submit(self._run_one, ctx)
                future.add_done_callback(self._on_done(ctx))
                self._handed.append((future, ctx))
        if give_back and self.queue.defer(ctx.task, 0):
            with self._lock:
                self.stats.deferred += 1
        return not give_back

    def _top_up(self, holder: Task) -> None:
        """Keep ``STANDBY_PER_PLATFORM`` standby tasks in line for the platform of ``holder`` (a
        task of this worker holding one of its slots), in free threads."""
        platform = holder.platform or ""
        with self._lock:
            if self._stop.is_set() or self._pool is None:
                return
            want = self._line.reserve(platform, self.concurrency - self._busy)
            if want <= 0:
                return
            self._busy += want
        started = 0
        try:
            for _ in range(want):
                task = self.queue.platform_standby(holder)
                if task is None:
                    break
                started += 1
                self._start_standby(task, reserved=True)
        finally:
            self._line.unreserve(platform, want - started)
            with self._lock:
                self._busy -= want - started

    def _stand_by(self) -> None:
        """Nothing claimed, nothing running, due work waiting for its platforms: standbys (0035)
        of the full platforms where this worker holds no slot, in free threads, to take at once
        a slot that another worker's share gives back (the announcement pokes one) rather than
        claim for it then."""
        with self._lock:
            if self._stop.is_set() or self._pool is None:
                return
            want = min(self.concurrency - self._busy, 2 * STANDBY_PER_PLATFORM)
            if want <= 0:
                return
            self._busy += want
        started = 0
        try:
            for task in self.queue.platform_standbys(self.role, self.worker_id, want):
                started += 1
                with self._lock:
                    self.stats.standbys_before_slot += 1
                self._start_standby(task)
        finally:
            with self._lock:
                self._busy -= want - started

    def _top_up_lines(self, claimed: list[Task]) -> None:
        """Standbys for the platforms whose slots a claim just took: a run's first requests end
        together, and their slots are then passed on in line, not each claimed for."""
        for holder in {t.platform: t for t in claimed if t.send_at is not None}.values():
            self._top_up(holder)

    def _start_standby(self, task: Task, *, reserved: bool = False) -> None:
        """Run a standby task (its thread taken already) up to its first request, in line."""
        [ctx] = self._contexts([task], claimed_at=time.monotonic(), standby=True)
        assert ctx.permit is not None
        with self._lock:
            self.stats.standbys += 1
        if not self._line.add(ctx.permit, reserved=reserved):
            ctx.permit.passed(time.monotonic(), None)  # closed meanwhile: given back untried
        self._start_handed(ctx)

    def _run_one(self, ctx: TaskContext) -> _Outcome:
        try:
            return self._run_handler(ctx)
        finally:
            with self._lock:
                if self._pool is not None:
                    self._busy -= 1
                if ctx.permit is not None:
                    self.stats.late_starts += ctx.permit.late_starts

    def _run_handler(self, ctx: TaskContext) -> _Outcome:
        began = time.monotonic()
        outcome = _Outcome(ctx, began=began - ctx.claimed_at)
        permit = current_permit.set(ctx.permit)
        try:
            result = self.handler(ctx.task, ctx)
            if not ctx.completed:
                try:
                    outcome.result_json = _to_jsonb_text(result)
                except (TypeError, ValueError) as exc:
                    outcome.error = f"handler result cannot be stored as JSON: {exc}"
                    outcome.retryable = False
        except LeaseLostError:
            ctx.lease_lost.set()
        except DeferTask as exc:
            outcome.defer_seconds = exc.delay
            outcome.error = str(exc)
        except PermanentTaskError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.retryable = False
        except TransientTaskError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.retry_after = exc.retry_after
        except Exception as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        finally:
            current_permit.reset(permit)
        if ctx.completed and (outcome.error is not None or outcome.defer_seconds is not None):
            # Its completion committed with its writes; what it raised afterwards changes nothing.
            self.log.warning("task %s raised after its completion committed: %s", ctx.task.id, outcome.error)
            outcome.error = outcome.defer_seconds = None
        if outcome.error is not None and outcome.defer_seconds is None and ctx.last_progress:
            # Where the handler got to, for whoever reads the error at 3 a.m.
            outcome.error += f" (after: {storable_text(json.dumps(ctx.last_progress, default=str), 1000)})"
        ended = time.monotonic()
        outcome.seconds, outcome.ended = ended - began, ended - ctx.claimed_at
        return outcome

    def _record(self, outcomes: list[_Outcome]) -> None:
        if not outcomes:
            return
        # Out of the heartbeat's sight first: a lease it found gone a moment after our own
        # completion would be reported as lost.
        with self._lock:
            for o in outcomes:
                self._in_flight.pop(o.ctx.task.id, None)
        successes = {
            o.ctx.task.lease: o.result_json
            for o in outcomes
            if o.error is None and not o.ctx.completed and not o.ctx.lost
        }
        times = {o.ctx.task.id: (o.began, o.ended) for o in outcomes}
        try:
            completed = self.queue.complete_many_json(successes, times)  # type: ignore[arg-type]
        except (psycopg.DataError, QueueInputError):
            # One result the database refuses must not cost the batch: each on its own, and the
            # refused ones fail with the reason.
            completed = set()
            for o in outcomes:
                if o.ctx.task.lease in successes:
                    try:
                        one = {o.ctx.task.lease: o.result_json}
                        if self.queue.complete_many_json(one, times):  # type: ignore[arg-type]
                            completed.add(o.ctx.task.id)
                    except (psycopg.DataError, QueueInputError) as exc:
                        o.error, o.retryable = f"handler result cannot be stored: {_first_line(exc)}", False
            successes = {x: r for x, r in successes.items() if x.task_id in completed}
        self.stats.completed += len(completed)
        self.stats.lost += len(successes) - len(completed)
        if any(o.ctx.permit is not None and not o.ctx.permit.released for o in outcomes):
            # These tasks gave their slots back with their outcomes: room for a claim.
            self._slot_freed.set()
        in_tx = sum(1 for o in outcomes if o.ctx.completed)
        if in_tx:
            self.queue.worker_completed(self.worker_id, in_tx)
        for o in outcomes:
            self.stats.handler_seconds += o.seconds
            if o.ctx.completed:
                self.stats.completed += 1
            elif o.ctx.lost:
                self.stats.lost += 1
            elif o.defer_seconds is not None:
                if self._contained(o, lambda o=o: self.queue.defer(o.ctx.task, o.defer_seconds)):
                    self.stats.deferred += 1
                else:
                    self.stats.lost += 1
            elif o.error is not None:
                status = self._contained(o, self._fail, o)
                if status == "pending":
                    self.stats.retried += 1
                elif status == "failed":
                    self.stats.failed += 1
                    self.log.warning("task %s failed: %s", o.ctx.task.id, o.error)
                else:
                    self.stats.lost += 1
        for o in outcomes:
            if o.ctx.permit is not None and not o.ctx.permit.released and not o.ctx.permit.standby:
                # Its slot went back with its outcome, just written: a standby may take it.
                self._line.poke(o.ctx.permit.platform)
        self.stats.last_finish_at = time.monotonic()

    def _fail(self, o: _Outcome) -> Any:
        assert o.error is not None
        try:
            return self.queue.fail(o.ctx.task, o.error, retryable=o.retryable, retry_after=o.retry_after)
        except (psycopg.DataError, QueueInputError) as exc:
            # The error text itself was refused (the queue already makes it storable): keep the
            # failure, in words the database takes.
            o.error = f"the error could not be stored ({_first_line(exc)}): {type(exc).__name__}"
            return self.queue.fail(o.ctx.task, o.error, retryable=o.retryable, retry_after=o.retry_after)

    def _contained(self, o: _Outcome, record: Callable[..., Any], *args: Any) -> Any:
        """Record one task's outcome; a refusal of the database for this task's data is logged
        and left to the lease (recovery gives the task back), never raised to the other tasks."""
        try:
            return record(*args)
        except (psycopg.DataError, QueueInputError) as exc:
            self.log.error("task %s: its outcome could not be recorded: %s", o.ctx.task.id, _first_line(exc))
            return None

    def _heartbeat_loop(self) -> None:
        while not self._heartbeats_stop.wait(self.heartbeat_seconds):
            if self._session is not None and not self._session.check():
                self.log.warning("worker session lost and not yet registered again; leases hold meanwhile")
            self.heartbeat()

    def heartbeat(self) -> set[int]:
        """Extend every held lease now; flags the tasks whose lease was lost. Returns those ids."""
        with self._lock:
            held = dict(self._in_flight)
        try:
            owned = self.queue.heartbeat(self.worker_id, [c.task for c in held.values()])
        except Exception:
            # A missed heartbeat is not fatal: the lease outlives several intervals.
            self.log.exception("heartbeat failed")
            return set()
        # A task completed meanwhile (in its handler's transaction, or by the batch that _record
        # just wrote: it left _in_flight) is no longer owned, and not lost.
        with self._lock:
            still_held = set(self._in_flight)
        lost = {i for i in set(held) - owned if not held[i].completed and i in still_held}
        for task_id in lost:
            held[task_id].lease_lost.set()
            self.log.warning("lease lost on task %s: its result will be discarded", task_id)
        return lost
