"""TaskQueue: the Python API over the queue's SQL functions. Knows nothing of Dagster."""

import dataclasses
import json
import logging
import math
import os
import select
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal, Self

import psycopg
from psycopg.rows import RowFactory, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from tq_pipelines.db.queries import query

_log = logging.getLogger(__name__)

Status = Literal["pending", "claimed", "running", "completed", "failed", "cancelled"]
JSON = Any  # whatever json.dumps accepts

ROLES = (
    "store_discovery",
    "entry_point_discovery",
    "product_discovery",
    "product_resync",
    "analytics_refresh",
)


# fail_task and defer_task never push a task further than this (Retry-After included).
MAX_DELAY_SECONDS = 86_400.0

# The UTC days generate_resync_tasks takes, counted from today: the same two numbers as SQL's
# tq_resync_window() (migration 0008), which decides; the command line checks them before it
# connects.
RESYNC_DAYS_BACK = 1826
RESYNC_DAYS_AHEAD = 7

# What PostgreSQL's INTEGER holds: a Python int outside it never reaches the function's own check.
_INT32 = (-(2**31), 2**31 - 1)

# Error texts are kept to this many characters: enough for a traceback's gist, never a whole page.
MAX_TEXT_CHARS = 8192


def storable_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` as PostgreSQL can store it: no NUL (text refuses it), at most ``limit``
    characters, the cut marked with how much was left out."""
    text = text.replace("\x00", "")
    if len(text) <= limit:
        return text
    marker = f" [... cut: {len(text) - limit:,} more characters]"
    return text[: max(0, limit - len(marker))] + marker


class QueueInputError(ValueError):
    """The queue refused an argument (unknown role, batch count out of range, ...): the server's
    message (which names the argument and the value), its detail and its hint (what would be
    accepted), and the SQLSTATE; or the same from a check the database cannot make."""

    def __init__(
        self, message: str, *, detail: str | None = None, hint: str | None = None, sqlstate: str | None = None
    ) -> None:
        super().__init__("; ".join(p for p in (message, detail, hint) if p))
        self.message = message
        self.detail = detail
        self.hint = hint
        self.sqlstate = sqlstate

    @classmethod
    def from_server(cls, exc: psycopg.Error) -> "QueueInputError":
        diag = exc.diag
        return cls(
            diag.message_primary or str(exc),
            detail=diag.message_detail,
            hint=diag.message_hint,
            sqlstate=exc.sqlstate,
        )


# Errors that say an argument was refused: data exceptions (class 22: 22023 invalid parameter,
# 22001 too long, 22003 out of range, 22007/22008 bad date or time, ...) and the constraints a
# value can break (NOT NULL, foreign key, CHECK). psycopg's own refusals (a NUL in a string) are
# DataErrors without a SQLSTATE.
_INPUT_SQLSTATES = frozenset({"23502", "23503", "23514"})


def _is_input_error(exc: psycopg.Error) -> bool:
    return isinstance(exc, psycopg.DataError) or exc.sqlstate in _INPUT_SQLSTATES


def resync_window(today: date) -> tuple[date, date]:
    """The first and last UTC day generate_resync_tasks takes, ``today`` being today's UTC date."""
    return today - timedelta(days=RESYNC_DAYS_BACK), today + timedelta(days=RESYNC_DAYS_AHEAD)


@dataclass(frozen=True, slots=True)
class Task:
    id: int
    role: str
    dispensary_id: int | None
    platform: str | None
    status: Status
    priority: int
    scheduled_for: datetime | None
    worker_id: str | None
    claimed_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    last_heartbeat_at: datetime | None
    result: JSON
    error_message: str | None
    retry_count: int
    max_retries: int
    created_at: datetime
    updated_at: datetime
    resync_date: date | None
    due_at: datetime
    payload: dict[str, Any]
    # When the claim let the task's first request start (its platform's rate); None: no limit.
    send_at: datetime | None = None
    # The claim's lease token (a claimed task only): the proof every call on the task presents.
    lease_token: uuid.UUID | None = field(default=None, repr=False)

    @property
    def lease(self) -> "Lease":
        """The task's lease, as its claim handed it out."""
        if self.lease_token is None:
            raise ValueError(f"task {self.id} carries no lease token: only a claim's tasks do")
        return Lease(self.id, self.lease_token)


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed task's id and its lease token: what every call that acts on the task presents.
    The token is the claim's secret (the database keeps only its hash): never logged or shown."""

    task_id: int
    token: uuid.UUID = field(repr=False)

    @property
    def params(self) -> dict[str, Any]:
        """The parameters of the queue's lease-fenced queries: ``task_id`` and ``lease``."""
        return {"task_id": self.task_id, "lease": self.token}


# A call on a held task takes the task as its claim returned it, or its lease.
Held = Task | Lease


def _lease(held: Held) -> Lease:
    return held.lease if isinstance(held, Task) else held


def _leases(held: Sequence[Held]) -> tuple[list[int], list[uuid.UUID]]:
    """Ids and tokens, in id order: the order every multi-row writer locks in."""
    leases = sorted((_lease(h) for h in held), key=lambda x: x.task_id)
    return [x.task_id for x in leases], [x.token for x in leases]


_TASK_FIELDS = tuple(f.name for f in dataclasses.fields(Task))


def task_row(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], Task]:
    """A psycopg row factory for ``worker_tasks`` rows: positional, no dict per row. Columns
    added by later migrations are ignored until the class learns them; fields the database
    does not have yet (an older schema) keep their defaults."""
    names = [c.name for c in cursor.description or ()]
    positions = [names.index(f) for f in _TASK_FIELDS if f in names] if names else []
    return lambda values: Task(*[values[i] for i in positions])


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    recovered: int
    failed: int
    workers_offline: int


@dataclass(frozen=True, slots=True)
class RoleCapacity:
    role: str
    pending_tasks: int
    ready_tasks: int
    claimed_tasks: int
    running_tasks: int
    completed_last_hour: int
    failed_last_hour: int
    active_workers: int
    avg_duration_sec: float | None
    tasks_per_worker_hour: float | None
    estimated_hours_to_drain: float | None


@dataclass(frozen=True, slots=True)
class PlatformLimits:
    """A platform's politeness limits, shared by every claimer (``tq_platforms``)."""

    platform: str
    max_in_flight: int
    requests_per_second: float
    burst: int | None = None  # None: max_in_flight
    pause_after_errors: int = 5
    pause_seconds: float = 5.0
    max_pause_seconds: float = 600.0
    # The hosts its URLs may name (a store's menu URL, redirects); None: left as loaded.
    hosts: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestDecision:
    """What the platform says to one request of a task: 'go' after ``wait_seconds``; 'probe'
    (the same, and the task is the probe of a half-open platform: report its answer); 'paused'
    (give the task back for ``wait_seconds``); 'full' (the task holds no slot, having given its
    own back, and none is free: give it back); 'lost' (the task is no longer the worker's)."""

    decision: Literal["go", "probe", "paused", "full", "lost"]
    wait_seconds: float


def _float(value: Decimal | float | None) -> float | None:
    return None if value is None else float(value)


class TaskQueue:
    """The queue over a psycopg connection pool; every call is one short transaction.

    Methods that act on a claimed task take it as the claim returned it (a :class:`Task`), or its
    :class:`Lease`, and are fenced by its lease token: they do nothing (and return False, None or
    fewer ids) unless the task is still held under that token. Worker ids are labels.
    """

    def __init__(self, pool: ConnectionPool, *, owns_pool: bool = False) -> None:
        self.pool = pool
        self._owns_pool = owns_pool

    @classmethod
    def connect(cls, conninfo: str, *, min_size: int = 1, max_size: int = 4) -> Self:
        """A queue with its own pool, closed by :meth:`close` (or ``with``)."""
        pool = ConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True},
            open=True,
            name="tq",
        )
        pool.wait(timeout=30)
        return cls(pool, owns_pool=True)

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _cursor(self, row_factory: RowFactory[Any] = dict_row) -> Iterator[psycopg.Cursor[Any]]:
        with self.pool.connection() as conn, conn.cursor(row_factory=row_factory) as cur:
            try:
                yield cur
            except psycopg.Error as exc:
                if _is_input_error(exc):
                    raise QueueInputError.from_server(exc) from exc
                raise

    def _one(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        with self._cursor() as cur:
            row = cur.execute(query(name), params).fetchone()
        assert row is not None, name
        return row

    # Claiming ---------------------------------------------------------------------------------

    def claim(self, role: str, worker_id: str) -> Task | None:
        """The best due task of ``role``, now claimed under a new lease (``worker_id`` labels
        it); None when nothing is due."""
        tasks = self.claim_many(role, worker_id, 1)
        return tasks[0] if tasks else None

    def claim_many(self, role: str, worker_id: str, max_tasks: int, *, start: bool = False) -> list[Task]:
        """Up to ``max_tasks`` due tasks of ``role``, at most one per store, best first, each with
        its lease token (``Task.lease``).

        With ``start`` they are running at once (one update per task instead of two), for a
        worker that begins every task it claims straight away.
        """
        _require_int32("max_tasks", max_tasks)
        params = {"role": role, "worker_id": worker_id, "max_tasks": max_tasks, "start": start}
        with self._cursor(task_row) as cur:
            return cur.execute(query("claim_tasks"), params).fetchall()

    # A worker's calls on its tasks ------------------------------------------------------------

    def start(self, held: Held) -> bool:
        lease = _lease(held)
        return bool(self._one("start_task", lease.params)["ok"])

    def start_many(self, held: Sequence[Held]) -> set[int]:
        """Mark tasks running; returns the ids started (the others are no longer held)."""
        ids, tokens = _leases(held)
        return set(self._one("start_tasks", {"task_ids": ids, "leases": tokens})["ids"])

    def heartbeat(self, worker_id: str, held: Sequence[Held]) -> set[int]:
        """Extend the leases; returns the ids still held (the rest were lost). The registry row of
        ``worker_id`` notes that it is alive."""
        ids, tokens = _leases(held)
        row = self._one("heartbeat_tasks", {"worker_id": worker_id, "task_ids": ids, "leases": tokens})
        return set(row["ids"])

    def complete(self, held: Held, result: JSON = None) -> bool:
        lease = _lease(held)
        params = {**lease.params, "result": _jsonb(result, "result")}
        return bool(self._one("complete_task", params)["ok"])

    def complete_many(self, results: Mapping[Lease, JSON]) -> set[int]:
        """Complete several tasks in one transaction; returns the ids completed."""
        return self.complete_many_json(
            {x: _json_text(r, f"result of task {x.task_id}") for x, r in results.items()}
        )

    def complete_many_json(
        self,
        results: Mapping[Lease, str],
        times: Mapping[int, tuple[float, float]] | None = None,
    ) -> set[int]:
        """:meth:`complete_many` with results already serialised to JSON text; ``times`` gives,
        per task id, when its handler began and ended in seconds after its claim (the worker's
        own measure), so that its recorded duration is its handler's."""
        if not results:
            return set()
        # Sent as arrays and cast in SQL: one parameter each, whatever the batch size. In id
        # order, the order every multi-row writer locks in, so that two of them cannot deadlock.
        leases = sorted(results, key=lambda x: x.task_id)
        ids = [x.task_id for x in leases]
        params: dict[str, Any] = {
            "task_ids": ids,
            "leases": [x.token for x in leases],
            "results": [results[x] for x in leases],
        }
        if times is None:
            return set(self._one("complete_tasks", params)["ids"])
        for i in ids:
            # NaN and infinity have no place on a timeline; the SQL would fail on them unnamed.
            if i in times and not all(math.isfinite(t) for t in times[i]):
                raise QueueInputError(
                    f"complete_tasks_timed: times of task {i} must be finite seconds, got {times[i]!r}",
                    hint="Give when the handler began and ended, in seconds after the task's claim.",
                )
        params["began"] = [times[i][0] if i in times else None for i in ids]
        params["ended"] = [times[i][1] if i in times else None for i in ids]
        return set(self._one("complete_tasks_timed", params)["ids"])

    def fail(
        self,
        held: Held,
        error: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> Status | None:
        """Record a failure: returns 'pending' (retried after a backoff, and no sooner than
        ``retry_after`` seconds) or 'failed', or None when the task is no longer held."""
        lease = _lease(held)
        params = {
            **lease.params,
            "error": storable_text(error),
            "retryable": retryable,
            "retry_after": None if retry_after is None else _interval(retry_after, "retry_after"),
        }
        status: Status | None = self._one("fail_task", params)["status"]
        return status

    def defer(self, held: Held, delay_seconds: float) -> bool:
        """Give a task back untried, due again in ``delay_seconds``, without spending a retry."""
        lease = _lease(held)
        params = {**lease.params, "delay": _interval(delay_seconds, "delay_seconds")}
        return bool(self._one("defer_task", params)["ok"])

    def cancel(self, task_id: int) -> bool:
        """Cancel a task that has not finished; False when it had. The admin's (tq grant gives
        the worker role no EXECUTE on it)."""
        return bool(self._one("cancel_task", {"task_id": task_id})["ok"])

    # Workers and maintenance ------------------------------------------------------------------

    def register_worker(
        self,
        worker_id: str,
        role: str,
        *,
        pod_name: str | None = None,
        hostname: str | None = None,
        heartbeat_seconds: float = 30.0,
    ) -> None:
        """Register (or re-register) a worker and the interval it heartbeats at: its leases
        expire after a few of those intervals of silence (:meth:`expire_leases`)."""
        self._one(
            "register_worker",
            {
                "worker_id": worker_id,
                "role": role,
                "pod_name": pod_name,
                "hostname": hostname,
                "heartbeat_seconds": heartbeat_seconds,
            },
        )

    def worker_completed(self, worker_id: str, count: int) -> None:
        """Count completions written in handlers' own transactions in the worker's registry
        (0 to 100,000 at a time: the database refuses more)."""
        _require_int32("count", count)
        self._one("worker_completed", {"worker_id": worker_id, "count": count})

    def open_session(
        self,
        worker_id: str,
        role: str,
        *,
        pod_name: str | None = None,
        hostname: str | None = None,
        heartbeat_seconds: float = 30.0,
        on_slot_free: "SlotFreeHandler | None" = None,
    ) -> "WorkerSession":
        """Register ``worker_id`` on a connection of its own that holds the worker's session
        lock until :meth:`WorkerSession.close`: when the process dies, the server knows, and
        :meth:`release_dead_workers` gives its tasks back at once. Refused
        (:class:`QueueInputError`, SQLSTATE 55P03) while another live session holds the id.

        With ``on_slot_free``, the session also hears the slots that workers' shares give back
        (0032) and calls it, from a thread of its own, with each one's role, platform and
        worker: a hint to claim, never a permission."""
        session = WorkerSession(self, worker_id, role, pod_name, hostname, heartbeat_seconds, on_slot_free)
        session.bind()
        if on_slot_free is not None:
            session.listen()
        return session

    def worker_liveness(self, worker_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per registered worker among ``worker_ids``: status, silent_seconds (since its last
        heartbeat), heartbeat_seconds (its interval) and session_alive (whether the connection
        it registered on is still there; None for a worker registered without one)."""
        with self._cursor() as cur:
            rows = cur.execute(query("worker_sessions"), {"worker_ids": list(worker_ids)}).fetchall()
        return {r["worker_id"]: r for r in rows}

    def release_dead_workers(self, worker_ids: Sequence[str]) -> RecoveryReport:
        """Give back now the tasks of those of ``worker_ids`` whose session has ended (their
        process is gone), and mark them offline. A worker whose session is alive, or that has
        none, is left alone, whoever names it."""
        recovered = failed = workers = 0
        ids = list(worker_ids)
        for start in range(0, len(ids), 1000):  # the function takes up to 1000 at a time
            row = self._one("release_dead_workers", {"worker_ids": ids[start : start + 1000]})
            recovered, failed, workers = (
                recovered + row["recovered"],
                failed + row["failed"],
                workers + row["workers"],
            )
        return RecoveryReport(recovered, failed, workers)

    def deregister_worker(self, worker_id: str) -> bool:
        return bool(self._one("deregister_worker", {"worker_id": worker_id})["ok"])

    def expire_leases(self, intervals: float = 2.5, *, min_seconds: float = 10.0) -> RecoveryReport:
        """Give back, within seconds, the tasks of workers silent for ``intervals`` of their own
        heartbeat intervals (never less than ``min_seconds``): the short lease.
        :meth:`recover_stale` stays the backstop."""
        params = {"intervals": float(intervals), "min_seconds": float(min_seconds)}
        row = self._one("expire_leases", params)
        return RecoveryReport(row["recovered"], row["failed"], 0)

    def archive_finished(self, older_than_seconds: float = 60.0, *, limit: int = 5000) -> int:
        """Move up to ``limit`` tasks finished more than ``older_than_seconds`` ago from
        ``worker_tasks`` to ``worker_task_history``, oldest first; returns how many moved. Since
        0023 these are failed and cancelled tasks (a completion moves its own). ``v_tasks`` reads
        both: only the hot table gets smaller."""
        if not (isinstance(older_than_seconds, int | float) and 0 <= older_than_seconds < 10**9):
            raise QueueInputError(
                "archive_tasks: older_than_seconds must be a finite number of seconds >= 0, "
                f"got {older_than_seconds!r}",
                hint="Tasks finished longer ago than this move to worker_task_history (the sensor's: 60).",
            )
        _require_int32("limit", limit)
        params = {"seconds": float(older_than_seconds), "limit": limit}
        return int(self._one("archive_tasks", params)["moved"])

    def recover_stale(self, threshold_minutes: int = 10) -> RecoveryReport:
        """Give back the tasks of workers silent past the threshold."""
        _require_int32("stale_threshold_minutes", threshold_minutes)
        return RecoveryReport(**self._one("recover_stale_tasks", {"threshold_minutes": threshold_minutes}))

    def generate_resync(
        self,
        *,
        day: date,
        batches_per_day: int = 6,
        platforms: Sequence[str] = ("dutchie",),
    ) -> int:
        """Create the product_resync tasks of the UTC day ``day``; returns how many were new."""
        if isinstance(platforms, str):
            # list("dutchie") would ask for platforms 'd', 'u', 't', ...
            raise QueueInputError(
                f"generate_resync_tasks: platforms must be a list of names, got the string {platforms!r}",
                hint=f"Give [{platforms!r}] for one platform.",
            )
        _require_int32("batches_per_day", batches_per_day)
        params = {"batches_per_day": batches_per_day, "day": day, "platforms": list(platforms)}
        return int(self._one("generate_resync_tasks", params)["created"])

    def refresh_completion_log(self, day: date, hour: int) -> int:
        """Recompute ``task_completion_log`` for one UTC hour; returns the rows written."""
        _require_int32("hour", hour)
        return int(self._one("refresh_task_completion_log", {"day": day, "hour": hour})["rows"])

    def completion_log(self, day: date, hour: int) -> list[dict[str, Any]]:
        with self._cursor() as cur:
            return cur.execute(query("completion_log_hour"), {"day": day, "hour": hour}).fetchall()

    def enqueue(
        self,
        role: str,
        dispensary_id: int | None = None,
        *,
        platform: str | None = None,
        priority: int = 0,
        scheduled_for: datetime | None = None,
        max_retries: int = 3,
        payload: Mapping[str, JSON] | None = None,
    ) -> int:
        """Add one task; returns its id. ``payload`` holds the role's parameters (a JSON object
        of at most 1 MB). The database checks every argument (``enqueue_task`` in SQL) and refuses
        a bad one with a :class:`QueueInputError` naming it.

        ``platform``: leave it out for a store's task, which takes its store's
        (``dispensaries.menu_type``), the platform whose limits its requests keep; another one is
        refused. A task of no store has the platform given here, or its payload's ``"platform"``,
        or none (the two may not differ)."""
        for name, value in (
            ("dispensary_id", dispensary_id),
            ("priority", priority),
            ("max_retries", max_retries),
        ):
            _require_int32(name, value)
        params = {
            "role": role,
            "dispensary_id": dispensary_id,
            "platform": platform,
            "priority": priority,
            "scheduled_for": scheduled_for,
            "max_retries": max_retries,
            "payload": _jsonb(payload, "payload"),
        }
        return int(self._one("enqueue_task", params)["id"])

    def enqueue_once(
        self,
        role: str,
        dispensary_id: int | None = None,
        *,
        platform: str | None = None,
        priority: int = 0,
        scheduled_for: datetime | None = None,
        payload: Mapping[str, JSON] | None = None,
    ) -> int | None:
        """:meth:`enqueue` unless a task of the same role, store and payload is pending or active;
        returns the new id, or None when there was one already. ``platform`` as for :meth:`enqueue`."""
        for name, value in (("dispensary_id", dispensary_id), ("priority", priority)):
            _require_int32(name, value)
        params = {
            "role": role,
            "dispensary_id": dispensary_id,
            "platform": platform,
            "priority": priority,
            "scheduled_for": scheduled_for,
            "payload": _jsonb(payload, "payload"),
        }
        new_id = self._one("enqueue_task_once", params)["id"]
        return None if new_id is None else int(new_id)

    def get(self, task_id: int) -> Task | None:
        with self._cursor(task_row) as cur:
            task: Task | None = cur.execute(query("get_task"), {"task_id": task_id}).fetchone()
        return task

    def capacity(self) -> list[RoleCapacity]:
        """``v_worker_capacity``, one entry per known role."""
        with self._cursor() as cur:
            rows = cur.execute(query("worker_capacity")).fetchall()
        # numeric columns arrive as Decimal; callers want floats
        return [RoleCapacity(**(r | {k: _float(r[k]) for k in _FLOAT_COLUMNS})) for r in rows]

    def claimable(self) -> dict[str, tuple[int, int]]:
        """Per role: (ready tasks, tasks a claim could take now). They differ when the stores
        of ready tasks are busy: one active task per store, whatever its role."""
        with self._cursor() as cur:
            rows = cur.execute(query("claimable_now")).fetchall()
        return {r["role"]: (r["ready"], r["claimable"]) for r in rows}

    def platform_errors(self, minutes: int) -> list[dict[str, Any]]:
        """Per platform over the last ``minutes``: tasks completed, tasks that ended in an error
        (failed, or back for a retry), and the latest error."""
        _require_int32("minutes", minutes)
        with self._cursor() as cur:
            return cur.execute(query("platform_errors"), {"minutes": minutes}).fetchall()

    # Platforms -----------------------------------------------------------------------------------

    def sync_platform_limits(self, limits: Sequence[PlatformLimits]) -> int:
        """Load platforms' limits and hosts (keeping their live state); returns how many changed.
        The admin's (tq grant gives the worker role no EXECUTE on it)."""
        rows = [dataclasses.asdict(x) for x in limits]
        return int(self._one("sync_platform_limits", {"limits": _jsonb(rows, "limits")})["changed"])

    def platform_pause(self, platform: str, seconds: float, reason: str = "") -> datetime:
        """Pause a platform by hand (1 s to a day); returns when the pause ends. The admin's."""
        params = {"platform": platform, "seconds": float(seconds), "reason": storable_text(reason, 1000)}
        until: datetime = self._one("platform_pause", params)["until"]
        return until

    def platform_resume(self, platform: str) -> None:
        """End a platform's pause at once, with no probe. The admin's."""
        self._one("platform_resume", {"platform": platform})

    def platform_request(self, held: Held, *, first: bool) -> RequestDecision:
        """May this request of the task start, and when (see ``platform_request`` in SQL)."""
        lease = _lease(held)
        row = self._one("platform_request", {**lease.params, "first": first})
        return RequestDecision(row["decision"], float(row["wait_seconds"]))

    def platform_error(self, held: Held, error: str, *, retry_after: float | None = None) -> float | None:
        """Report an error that speaks of the task's platform (5xx, timeout, 429) to its breaker;
        returns the seconds its pause has left when the platform is now paused, else None (also
        when the task is no longer held: nothing is counted)."""
        lease = _lease(held)
        params = {
            **lease.params,
            "error": storable_text(error),
            "retry_after": None if retry_after is None else _interval(retry_after, "retry_after"),
        }
        row = self._one("platform_error", params)
        return float(row["wait_seconds"]) if row["paused"] else None

    def platform_release(self, held: Held) -> bool:
        """The task is done with its platform's requests: its slot goes back now, not at its
        outcome. Returns whether it held one."""
        lease = _lease(held)
        return bool(self._one("platform_release", lease.params)["released"])

    def platform_handoff(self, held: Held) -> Task | None:
        """The task is done with its platform's requests: its slot goes back and, in the same
        transaction, its worker claims and starts the next due task of that platform, within the
        limits and the worker's fair share. Returns that task (with its lease), or None."""
        lease = _lease(held)
        with self._cursor(task_row) as cur:
            rows: list[Task] = cur.execute(query("platform_handoff"), lease.params).fetchall()
        return rows[0] if rows else None

    def platform_standby(self, held: Held) -> Task | None:
        """From a task holding a slot of its platform: claim the next due task of that platform
        for the same worker, without a slot (a standby: it waits for :meth:`platform_relay`). At
        most as many as the worker holds slots there; None when none is due, or the platform is
        paused or has no limits."""
        lease = _lease(held)
        with self._cursor(task_row) as cur:
            rows: list[Task] = cur.execute(query("platform_standby"), lease.params).fetchall()
        return rows[0] if rows else None

    def platform_standbys(self, role: str, worker_id: str, most: int) -> list[Task]:
        """For a worker holding no slot of a full platform: up to ``most`` due tasks of ``role``
        claimed for it without a slot, at most two a platform, to wait at their first request for
        a slot that another worker's share gives back. An empty list for a worker the fair share
        does not count (not registered for the role, or gone)."""
        with self._cursor(task_row) as cur:
            rows: list[Task] = cur.execute(
                query("platform_standbys"), {"role": role, "worker_id": worker_id, "most": most}
            ).fetchall()
        return rows

    def platform_pass(
        self, held: Held, standby: Held, *, replace: bool = False
    ) -> tuple[RequestDecision, Task | None]:
        """Move the slot of ``held`` (done with its requests) to ``standby``, a task of the same
        worker and platform holding none: 'go' after ``wait_seconds`` (its first request's start),
        and with ``replace`` the next due task of the platform, claimed as a standby in its place
        (None when none is due). 'paused' or 'full' when the platform paused or the limits shrank
        meanwhile: the slot went back alone. 'lost' when either task is not the caller's, or they
        do not match: nothing moved."""
        row, new = self._pass("platform_pass", held, standby, replace=replace)
        return RequestDecision(row["decision"], float(row["wait_seconds"])), new

    def platform_relay(
        self, held: Held, standby: Held, *, replace: bool = False, sent: bool = False
    ) -> tuple[RequestDecision, bool, Task | None]:
        """:meth:`platform_pass` that may also give ``standby`` a relay (True): the start of the
        next request of its slot, reckoned now, for the standby it passes the slot to in turn to
        send at once. Given only where the rate has room for it (0031). With ``sent``, the
        record of a request ``standby`` already sent on the relay of ``held``: the slot moves
        whatever the limits say now ('go', no start), or nothing moves ('lost')."""
        row, new = self._pass("platform_relay", held, standby, replace=replace, sent=sent)
        return RequestDecision(row["decision"], float(row["wait_seconds"])), bool(row["relay"]), new

    def _pass(
        self, name: str, held: Held, standby: Held, **params: Any
    ) -> tuple[dict[str, Any], Task | None]:
        """One of the pass queries (``platform_pass``, ``platform_relay``): its row, and the
        standby it claimed in the slot's place, if any."""
        lease, nxt = _lease(held), _lease(standby)
        row = self._one(name, {**lease.params, "next_id": nxt.task_id, "next_lease": nxt.token, **params})
        new = Task(**{f: row[f] for f in _TASK_FIELDS if f in row}) if row["id"] is not None else None
        return row, new

    def platform_abandon(self, held: Held, busy_seconds: float) -> bool:
        """The client gave up on the task's request, which the platform may serve for up to
        ``busy_seconds`` more: the task's slot stays taken until then, whatever becomes of the
        task. Returns whether the task held a slot."""
        lease = _lease(held)
        params = {**lease.params, "busy_seconds": float(busy_seconds)}
        return bool(self._one("platform_abandon", params)["held"])

    def platform_answered(self, held: Held) -> bool:
        """The task is its half-open platform's probe and got an answer (not a 5xx or 429): the
        platform is back for every worker. Returns whether this closed its breaker."""
        lease = _lease(held)
        return bool(self._one("platform_answered", lease.params)["closed"])

    def claim_wait(self, role: str) -> float | None:
        """None when ``role`` has no due work; else the seconds until a claim could take some
        (0 when it could now; the rest of a pause; a short poll for a full platform)."""
        wait = self._one("claim_wait", {"role": role})["wait"]
        return None if wait is None else float(wait)

    def platform_status(self) -> list[dict[str, Any]]:
        """``v_platform_status``: each limited platform's state, limits, pause and errors."""
        with self._cursor() as cur:
            return cur.execute(query("platform_status")).fetchall()

    def repair_platform_counters(self) -> list[dict[str, Any]]:
        """Set each platform's in-flight count to its tasks really in flight; returns the rows
        that were wrong (empty while the triggers keep them, which is always but for writes
        around them)."""
        with self._cursor() as cur:
            return cur.execute(query("repair_platform_counters")).fetchall()

    def roles(self) -> list[str]:
        """The roles in ``worker_task_roles``, by name: the built-in ones and any a deployment added."""
        with self._cursor() as cur:
            return [r["role"] for r in cur.execute(query("list_roles")).fetchall()]

    def stuck_tasks(self, threshold_minutes: int) -> int:
        """Active tasks whose owner has been silent past the threshold."""
        _require_int32("threshold_minutes", threshold_minutes)
        return int(self._one("stuck_tasks", {"threshold_minutes": threshold_minutes})["stuck"])


_FLOAT_COLUMNS = ("avg_duration_sec", "tasks_per_worker_hour", "estimated_hours_to_drain")


def _interval(seconds: float, argument: str) -> timedelta:
    """Seconds as an interval; the SQL caps delays at a day, so anything longer (even inf) is a
    day here too, rather than an overflow. NaN is no delay at all: refused."""
    if math.isnan(seconds):
        raise QueueInputError(
            f"{argument} must be a number of seconds, got NaN",
            hint="Give 0 or more seconds; delays are capped at a day.",
        )
    return timedelta(seconds=min(max(seconds, 0.0), MAX_DELAY_SECONDS))


def _json_text(value: JSON, argument: str) -> str:
    """``value`` as JSON text; NaN and infinity (which json.dumps writes and PostgreSQL refuses)
    and values JSON has no form for are refused naming ``argument``."""
    hint = "Give JSON values only: objects, lists, text, finite numbers, true, false and None."
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        raise QueueInputError(
            f"{argument} holds NaN or infinity, which JSON has no form for", hint=hint
        ) from None
    except TypeError as exc:
        raise QueueInputError(f"{argument} cannot be stored as JSON: {exc}", hint=hint) from None


def _jsonb(value: JSON, argument: str) -> Jsonb | None:
    if value is None:
        return None
    text = _json_text(value, argument)
    return Jsonb(value, dumps=lambda _: text)  # checked once, serialised once


def _require_int32(argument: str, value: int | None) -> None:
    """A Python int PostgreSQL's INTEGER cannot hold would fail as an unknown function, not as
    the refused argument it is: refused here, naming it."""
    if value is not None and not _INT32[0] <= value <= _INT32[1]:
        raise QueueInputError(
            f"{argument} must fit a 32-bit integer, got {value}",
            hint=f"The queue's functions take {argument} as an INTEGER ({_INT32[0]} to {_INT32[1]}), "
            "and most take far less: the refusal of a smaller value says how much.",
        )


# A slot given back to the share of ``worker`` of ``role`` on ``platform`` (0032).
SlotFreeHandler = Callable[[str, str, str], None]


class WorkerSession:
    """A worker's registration, held by a connection of its own (see :meth:`TaskQueue.open_session`).

    The connection holds the session lock and, when asked, listens for slots given back (0032);
    :meth:`check` (the worker's heartbeat calls it) notices a connection lost with the server (a
    restart, a network cut) and registers again on a new one."""

    def __init__(
        self,
        queue: TaskQueue,
        worker_id: str,
        role: str,
        pod_name: str | None,
        hostname: str | None,
        heartbeat_seconds: float,
        on_slot_free: SlotFreeHandler | None = None,
    ) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self.params = {
            "worker_id": worker_id,
            "role": role,
            "pod_name": pod_name,
            "hostname": hostname,
            "heartbeat_seconds": heartbeat_seconds,
        }
        self.conn: psycopg.Connection[Any] | None = None
        self.on_slot_free = on_slot_free
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        # Written to by close(): the listener's wait on the socket ends at once.
        self._wake_r, self._wake_w = -1, -1

    def bind(self) -> None:
        """Connect and register, taking the session lock (and listening, when asked to)."""
        pool = self.queue.pool
        # The pool's own settings (they may be callables, resolved at each connection).
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = (pool.kwargs() if callable(pool.kwargs) else pool.kwargs) or {}
        conn: psycopg.Connection[Any] = psycopg.Connection.connect(conninfo, **{**kwargs, "autocommit": True})
        try:
            conn.execute(query("register_worker_session"), self.params)
            if self.on_slot_free is not None:
                conn.execute(query("listen_slot_free"))
        except psycopg.Error as exc:
            conn.close()
            if exc.sqlstate == "55P03" or _is_input_error(exc):
                raise QueueInputError.from_server(exc) from exc
            raise
        self.conn = conn

    def listen(self) -> None:
        """Hear slots given back (0032) in a thread of its own until :meth:`close`."""
        if self._listener is None:
            self._wake_r, self._wake_w = os.pipe()
            self._listener = threading.Thread(target=self._listen, name="tq-slot-free", daemon=True)
            self._listener.start()

    def _listen(self) -> None:
        # The connection's lock is taken only to read what arrived: the heartbeat's check uses
        # the same connection meanwhile, and a notification it reads waits in psycopg's backlog,
        # which notifies() gives first.
        while not self._closing.is_set():
            conn = self.conn
            try:
                if conn is None or conn.closed:
                    raise psycopg.OperationalError("no session connection")
                ready, _, _ = select.select([conn.fileno(), self._wake_r], [], [], 1.0)
                if self._closing.is_set():
                    break
                if ready:
                    for n in conn.notifies(timeout=0):
                        self._heard(n.payload)
            except (psycopg.Error, OSError, ValueError):
                # Lost: the heartbeat's check binds again; the hint is missed meanwhile, the
                # next claim finds the slot.
                self._closing.wait(0.25)

    def _heard(self, payload: str) -> None:
        assert self.on_slot_free is not None
        try:
            slot = json.loads(payload)
            role, platform, worker = slot["role"], slot["platform"], slot["worker"]
        except (ValueError, TypeError, KeyError):
            return  # not the queue's (anyone may NOTIFY): a hint, never a permission
        if all(isinstance(v, str) for v in (role, platform, worker)):
            try:
                self.on_slot_free(role, platform, worker)
            except Exception:
                _log.exception("slot-free handler failed")

    def check(self) -> bool:
        """True when the session is alive; else registers again (False if that fails too)."""
        try:
            if self.conn is not None and not self.conn.closed:
                self.conn.execute(query("session_ping"))
                return True
        except psycopg.Error:
            pass
        self._drop()
        try:
            self.bind()
        except psycopg.Error:
            return False
        return True

    def close(self) -> None:
        """Deregister (offline) and end the session. On the session's own connection: the
        database leaves a registration whose session is alive to that session alone."""
        self._closing.set()
        if self._listener is not None:
            with suppress(OSError):
                os.write(self._wake_w, b"x")
            self._listener.join()
            for fd in (self._wake_r, self._wake_w):
                with suppress(OSError):
                    os.close(fd)
            self._listener = None
        try:
            if self.conn is not None and not self.conn.closed:
                with suppress(psycopg.OperationalError):
                    self.conn.execute(query("deregister_worker"), {"worker_id": self.worker_id})
        finally:
            self._drop()

    def _drop(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            with suppress(psycopg.Error):
                conn.close()
