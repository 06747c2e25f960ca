"""Retention: finished tasks, long-gone workers, old price history and the hourly rollup past
their horizons, deleted in small batches. Knows nothing of Dagster.

Each batch is one short transaction that skips rows another holds, so pruning never makes a
worker wait for long. The hourly rollup (``task_completion_log``) outlives the tasks it counts:
an hour is rolled up before its first task is deleted, and is never recomputed afterwards.
"""

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import TaskQueue

# In the order they are pruned: tasks first, as they may roll up an hour the rollup's own
# horizon then removes.
TABLES = ("worker_tasks", "task_completion_log", "worker_registry", "product_history")

# Inclusive bounds of each setting. A century of days keeps a table for good.
LIMITS: dict[str, tuple[float, float]] = {
    "tasks_days": (1, 36_500),
    "completion_log_days": (1, 36_500),
    "workers_days": (1, 36_500),
    "product_history_days": (1, 36_500),
    "batch_size": (1, 100_000),
    "pause_seconds": (0, 60),
    "time_budget_seconds": (1, 86_400),
}


class RetentionSettingsError(ValueError):
    """A retention setting is out of bounds; the message names it and what is accepted."""


@dataclass(frozen=True)
class RetentionSettings:
    """How long each table keeps its rows, and how hard a prune may push."""

    # Completed, failed and cancelled tasks, by when they finished.
    tasks_days: int = 30
    # The hourly rollup: longer than the tasks it counts.
    completion_log_days: int = 400
    # Registry rows of workers silent this long and holding no task.
    workers_days: int = 7
    # Price and stock changes, by when they were seen.
    product_history_days: int = 365
    # Rows per delete, each its own transaction.
    batch_size: int = 5_000
    # Sleep between batches, so that the queue's own writes get the disk and the locks.
    pause_seconds: float = 0.05
    # No batch starts after this long; what is left waits for the next prune.
    time_budget_seconds: float = 3_600

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low, high = LIMITS[f.name]
            whole = f.type is int
            kind = "a whole number" if whole else "a number"
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise RetentionSettingsError(
                    f"{f.name} must be {kind} from {low:g} to {high:g}, got {value!r}"
                )
            if math.isnan(value) or not low <= value <= high:
                raise RetentionSettingsError(f"{f.name} must be from {low:g} to {high:g}, got {value!r}")
        if self.completion_log_days < self.tasks_days:
            raise RetentionSettingsError(
                f"completion_log_days ({self.completion_log_days}) must be at least tasks_days "
                f"({self.tasks_days}): the hourly rollup outlives the tasks it counts"
            )


@dataclass
class TablePrune:
    """What a prune did to one table (or, in a dry run, would do)."""

    rows: int = 0
    batches: int = 0
    seconds: float = 0.0
    # False when the time budget ran out before the table was done.
    finished: bool = False


@dataclass
class PruneReport:
    dry_run: bool
    # The horizons, as the database's times: rows before them go.
    cutoffs: dict[str, datetime | date]
    tables: dict[str, TablePrune] = field(default_factory=lambda: {t: TablePrune() for t in TABLES})
    # Hours of the rollup made just before their tasks went (missing, or made before the hour ended).
    hours_rolled_up: int = 0
    # tq_retention.tasks_pruned_before after the prune: the rollup keeps the hours before it as
    # they are (None: no task was ever pruned).
    rollup_kept_before: datetime | None = None

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())

    @property
    def finished(self) -> bool:
        return all(t.finished for t in self.tables.values())


def prune(
    conninfo_or_queue: str | TaskQueue,
    settings: RetentionSettings | None = None,
    *,
    dry_run: bool = False,
    log: logging.Logger | None = None,
) -> PruneReport:
    """Delete what is past each table's horizon, in batches; returns per table the rows deleted,
    batches and seconds. A dry run counts the rows instead and deletes nothing.

    Raises RetentionSettingsError, before anything is deleted, when a horizon is younger than the
    database's safety floor for its table (tq_retention.min_*_days, the admin's to change)."""
    settings = settings or RetentionSettings()
    log = log or logging.getLogger(__name__)
    with _cursor(conninfo_or_queue) as cur:
        _check_floors(cur, settings)
        report = PruneReport(
            dry_run=dry_run, cutoffs=_one(cur, "retention_cutoffs", dataclasses.asdict(settings))
        )
        if dry_run:
            _count(cur, settings, report)
        else:
            _delete(cur, settings, report)
        report.rollup_kept_before = _one(cur, "retention_watermark", {})["tasks_pruned_before"]
    for name, t in report.tables.items():
        log.info(
            "%s: %s %s rows in %s batches, %.1f s%s",
            name,
            "would delete" if dry_run else "deleted",
            t.rows,
            t.batches,
            t.seconds,
            "" if t.finished else " (time budget spent: the rest waits for the next prune)",
        )
    return report


Cursor = psycopg.Cursor[dict[str, Any]]


@contextmanager
def _cursor(target: str | TaskQueue) -> Iterator[Cursor]:
    """An autocommit connection's cursor: every statement its own transaction."""
    if isinstance(target, TaskQueue):
        with target.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            yield cur
    else:
        with psycopg.connect(target, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
            yield cur


# Each setting and its floor in tq_retention.
FLOORS = {
    "tasks_days": "min_tasks_days",
    "completion_log_days": "min_completion_log_days",
    "workers_days": "min_workers_days",
    "product_history_days": "min_product_history_days",
}


def _check_floors(cur: Cursor, settings: RetentionSettings) -> None:
    """Refuse, in words, a horizon the prune functions would refuse (migration 0009's floors)."""
    floors = _one(cur, "retention_floors", {})
    for setting, column in FLOORS.items():
        days, floor = getattr(settings, setting), floors[column]
        if days < floor:
            raise RetentionSettingsError(
                f"{setting} must be at least {floor} days in this database (tq_retention.{column}), "
                f"got {days}: rows younger than the floor are never pruned. To prune closer, the admin "
                f"(the owner of tq_retention) lowers it: UPDATE tq_retention SET {column} = {days};"
            )


def _count(cur: Cursor, settings: RetentionSettings, report: PruneReport) -> None:
    counts = {
        "worker_tasks": ("count_prunable_tasks", "tasks_before"),
        "task_completion_log": ("count_prunable_completion_log", "completion_log_before"),
        "worker_registry": ("count_prunable_workers", "workers_before"),
        "product_history": ("count_prunable_product_history", "product_history_before"),
    }
    for table, (name, cutoff) in counts.items():
        started = time.monotonic()
        row = _one(cur, name, {"before": report.cutoffs[cutoff]})
        t = report.tables[table]
        t.rows = int(row["n"])
        t.batches = math.ceil(t.rows / settings.batch_size)
        t.seconds = time.monotonic() - started
        t.finished = True


def _delete(cur: Cursor, settings: RetentionSettings, report: PruneReport) -> None:
    deadline = time.monotonic() + settings.time_budget_seconds
    limit = settings.batch_size
    c = report.cutoffs

    def tasks() -> Iterator[int]:
        while True:
            row = _one(cur, "prune_tasks_batch", {"before": c["tasks_before"], "limit": limit})
            report.hours_rolled_up += row["hours_rolled_up"]
            if not row["deleted"]:
                return
            yield row["deleted"]

    def simple(name: str, cutoff: str) -> Callable[[], Iterator[int]]:
        def batches() -> Iterator[int]:
            while deleted := _one(cur, name, {"before": c[cutoff], "limit": limit})["deleted"]:
                yield deleted

        return batches

    def product_history() -> Iterator[int]:
        after = 0
        while True:
            params = {"before": c["product_history_before"], "after_id": after, "limit": limit}
            row = _one(cur, "prune_product_history_batch", params)
            if row["deleted"]:
                yield row["deleted"]
            if row["last_id"] is None or row["reached_young"]:
                return
            after = row["last_id"]

    plan: dict[str, Callable[[], Iterator[int]]] = {
        "worker_tasks": tasks,
        "task_completion_log": simple("prune_completion_log_batch", "completion_log_before"),
        "worker_registry": simple("prune_workers_batch", "workers_before"),
        "product_history": product_history,
    }
    for table in TABLES:
        t = report.tables[table]
        if time.monotonic() >= deadline:
            break
        started = time.monotonic()
        batches = plan[table]()
        while True:
            deleted = next(batches, None)
            if deleted is None:
                t.finished = True
                break
            t.rows += deleted
            t.batches += 1
            if time.monotonic() >= deadline:
                break
            if settings.pause_seconds:
                time.sleep(settings.pause_seconds)
        t.seconds = time.monotonic() - started


def _one(cur: Cursor, name: str, params: dict[str, Any]) -> dict[str, Any]:
    try:
        row = cur.execute(query(name), params).fetchone()
    except psycopg.errors.InvalidParameterValue as exc:
        # A floor raised by the admin during the prune: the function's own words and hint.
        hint = exc.diag.message_hint
        raise RetentionSettingsError(f"{exc.diag.message_primary}" + (f" ({hint})" if hint else "")) from None
    assert row is not None, name
    return row
