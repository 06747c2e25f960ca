"""The daily resync as an asset: ``product_resync``, one partition per UTC day.

Materialising a day creates that day's product_resync tasks (idempotent: one per store and day).
resync_progress_sensor follows each day's tasks until all have finished, as observations of the
day's partition (pending, running, completed, failed), and keeps the check ``backfill_finished``
true to them: it passes only once no past day has a task unfinished or waits to be queued. So a
backfill shows the days' work until it is done, not until it is queued. A past day is queued only
while no newer resync work is unfinished: its tasks are due at once and the claim takes the
oldest due task first, so they would otherwise go ahead of today's. Until then the day is held,
and the sensor queues it once the role is idle. ``generate_resync_tasks_job`` materialises the
asset (the schedule, the catch-up, `dagster job backfill`).
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import dagster as dg
from psycopg.rows import dict_row
from pydantic import Field

from tq_pipelines.db.queries import query
from tq_pipelines.defs.bindings import crawl_resource, queue_resource
from tq_pipelines.defs.lineage import DISPENSARIES, POSTGRES, PRODUCT_RESYNC, QUEUE, QUEUE_OWNERS
from tq_pipelines.defs.partitions import resync_partitions_def
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.run_tags import MAINTENANCE_TAGS
from tq_pipelines.queue.api import TaskQueue

BACKFILL_CHECK = "backfill_finished"

# 00:05 UTC: the day's resync, for that same day (the partitions have end_offset=1).
RESYNC_HOUR_UTC, RESYNC_MINUTE = 0, 5


class ResyncConfig(dg.Config):
    batches_per_day: int = Field(default=6, ge=1, le=24, description="Batches spread evenly over the UTC day")
    platforms: list[str] = Field(
        default=[],
        description="Platforms (menu_type) to resync; empty: every platform in TQ_PLATFORMS_FILE, "
        "or dutchie without one",
    )


@dataclass(frozen=True)
class DayProgress:
    """One resync day's product_resync tasks by state."""

    day: date
    tasks: int = 0
    pending: int = 0
    running: int = 0  # claimed or running
    completed: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def unfinished(self) -> int:
        return self.pending + self.running

    @property
    def finished(self) -> bool:
        """Every task of the day has an outcome (and the day has tasks)."""
        return self.tasks > 0 and self.unfinished == 0

    def state(self) -> list[int]:
        return [self.tasks, self.pending, self.running, self.completed, self.failed, self.cancelled]

    def metadata(self) -> dict[str, Any]:
        done = self.tasks - self.unfinished
        return {
            "dagster/row_count": dg.MetadataValue.int(self.tasks),
            "tasks": dg.MetadataValue.int(self.tasks),
            "pending": dg.MetadataValue.int(self.pending),
            "running": dg.MetadataValue.int(self.running),
            "completed": dg.MetadataValue.int(self.completed),
            "failed": dg.MetadataValue.int(self.failed),
            "cancelled": dg.MetadataValue.int(self.cancelled),
            "finished_share": dg.MetadataValue.float(round(done / self.tasks, 4) if self.tasks else 0.0),
        }

    def describe(self, *, held: bool = False) -> str:
        if held:
            return f"{self.day}: held until no newer product_resync task is unfinished"
        if not self.tasks:
            return f"{self.day}: no task (no store was known when the day was resynced)"
        return (
            f"{self.day}: {self.tasks - self.unfinished} of {self.tasks} finished "
            f"({self.pending} pending, {self.running} running, {self.failed} failed)"
        )


def day_progress(queue: TaskQueue, days: Sequence[date]) -> dict[date, DayProgress]:
    """Every day of ``days``, with zeros for a day that has no task."""
    with queue.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query("resync_day_progress"), {"days": list(days)}).fetchall()
    found = {r["day"]: DayProgress(**r) for r in rows}
    return {d: found.get(d, DayProgress(d)) for d in days}


def open_days(queue: TaskQueue) -> list[date]:
    """The resync days with tasks not finished."""
    with queue.pool.connection() as conn:
        return [r[0] for r in conn.execute(query("resync_open_days")).fetchall()]


@dataclass(frozen=True)
class Unfinished:
    """product_resync tasks not finished, as the database's UTC day sees them."""

    today: date
    current: int  # of today or later, or of no day (a demo crawl, one queued by hand)
    past: int  # of an earlier day: backfills


def unfinished(queue: TaskQueue) -> Unfinished:
    with queue.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query("resync_unfinished")).fetchone()
    assert row is not None
    return Unfinished(**row)


def day_state(queue: TaskQueue, day: date) -> tuple[int, int]:
    """The day's tasks, and the stores a resync would give one."""
    with queue.pool.connection() as conn:
        row = conn.execute(query("resync_day_state"), {"day": day}).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def backfill_result(past: Sequence[DayProgress], held: Sequence[date] = ()) -> dict[str, Any]:
    """The check ``backfill_finished`` over the past days still running (``past``) and those held:
    its outcome, description and metadata."""
    held_days = sorted(set(held))
    running = [p for p in past if p.unfinished and p.day not in held_days]
    lines = [
        "| day | state | tasks | pending | running | completed | failed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in sorted([*running, *(DayProgress(d) for d in held_days)], key=lambda p: p.day):
        state = "held" if p.day in held_days else "in progress"
        lines.append(
            f"| {p.day} | {state} | {p.tasks} | {p.pending} | {p.running} | {p.completed} | {p.failed} |"
        )
    parts = [p.describe() for p in running] + [DayProgress(d).describe(held=True) for d in held_days]
    return {
        "passed": not running and not held_days,
        "severity": dg.AssetCheckSeverity.WARN,
        "description": "; ".join(parts) or "no past day has a task to run",
        "metadata": {
            "days_in_progress": dg.MetadataValue.int(len(running)),
            "days_held": dg.MetadataValue.int(len(held_days)),
            "tasks_unfinished": dg.MetadataValue.int(sum(p.unfinished for p in running)),
            "days": dg.MetadataValue.md("\n".join(lines)),
        },
    }


def past_days_running(queue: TaskQueue, today: date) -> list[DayProgress]:
    """The past resync days with tasks not finished."""
    days = [d for d in open_days(queue) if d < today]
    return list(day_progress(queue, days).values()) if days else []


@dg.multi_asset(
    name="generate_resync_tasks",
    specs=[
        dg.AssetSpec(
            PRODUCT_RESYNC,
            deps=[DISPENSARIES],
            description=(
                "One partition per UTC day: materialising it queues that day's product_resync tasks, "
                "one per enabled store, spread over the day in batches (idempotent). A day's "
                "observations count its tasks by state until all have finished; the check "
                f"{BACKFILL_CHECK} passes once no past day has a task unfinished or is held (a past "
                "day waits while newer resync work is unfinished)."
            ),
            group_name=QUEUE,
            owners=QUEUE_OWNERS,
            kinds=POSTGRES,
            # Absent while a past day is held: its tasks are not queued yet.
            skippable=True,
            # The schedule materialises today's partition at 00:05 UTC.
            freshness_policy=dg.FreshnessPolicy.cron(
                deadline_cron="30 0 * * *", lower_bound_delta=timedelta(minutes=30)
            ),
        )
    ],
    partitions_def=resync_partitions_def,
    # One day per run: a day is one statement, and each run's result is that day's.
    backfill_policy=dg.BackfillPolicy.multi_run(1),
)
def generate_resync_tasks(
    context: dg.AssetExecutionContext, config: ResyncConfig, tq: QueueResource, crawl: CrawlResource
) -> Iterator[dg.MaterializeResult]:
    """Create the product_resync tasks of the partition's UTC day (idempotent); a past day only
    while no newer resync work is unfinished."""
    day = date.fromisoformat(context.partition_key)
    settings = crawl.settings()
    if settings:
        # The file's platforms are known to the queue (and limited) before any store is listed.
        tq.load_platform_limits(settings, context.log)
    platforms = config.platforms or sorted(settings) or ["dutchie"]
    waiting = unfinished(tq.queue)
    if day < waiting.today and waiting.current:
        context.log.info(
            "%s held: %s product_resync tasks of today or of no day are unfinished; "
            "resync_progress_sensor queues the day once there are none",
            day,
            waiting.current,
        )
        context.log_event(
            dg.AssetObservation(
                PRODUCT_RESYNC,
                partition=day.isoformat(),
                metadata={"held": True, "newer_unfinished": dg.MetadataValue.int(waiting.current)},
            )
        )
        return
    created = tq.queue.generate_resync(day=day, batches_per_day=config.batches_per_day, platforms=platforms)
    context.log.info("created %s product_resync tasks for %s", created, day)
    progress = day_progress(tq.queue, [day])[day]
    yield dg.MaterializeResult(
        asset_key=PRODUCT_RESYNC,
        metadata={
            "date": day.isoformat(),
            "created": dg.MetadataValue.int(created),
            "batches_per_day": config.batches_per_day,
            "platforms": ", ".join(platforms),
            "backfill": dg.MetadataValue.bool(day < waiting.today),
            **progress.metadata(),
        },
    )


@dg.asset_check(
    asset=PRODUCT_RESYNC,
    name=BACKFILL_CHECK,
    description="No past resync day has a product_resync task unfinished, or waits to be queued "
    "(held): a backfill's days are done. Evaluated after each materialisation, and by "
    "resync_progress_sensor (which also knows the held days) whenever the past days change.",
)
def backfill_finished(context: dg.AssetCheckExecutionContext, tq: QueueResource) -> dg.AssetCheckResult:
    today = unfinished(tq.queue).today
    return dg.AssetCheckResult(**backfill_result(past_days_running(tq.queue, today)))


RESYNC_TAGS = {"tq/kind": "resync", **MAINTENANCE_TAGS}

_resync_job = dg.define_asset_job(
    "generate_resync_tasks_job",
    selection=dg.AssetSelection.assets(PRODUCT_RESYNC),
    executor_def=dg.in_process_executor,
    tags=RESYNC_TAGS,
    description="Queue the day's product_resync tasks (product_resync, one partition per UTC day).",
)

# Resolved here, so that it is a JobDefinition like the other jobs (execute_in_process, and
# importable from tq_pipelines.defs.jobs). A resolved job keeps its resources: the code location's.
generate_resync_tasks_job = dg.Definitions(
    assets=[generate_resync_tasks],
    asset_checks=[backfill_finished],
    jobs=[_resync_job],
    resources={"tq": queue_resource, "crawl": crawl_resource},
).resolve_job_def(_resync_job.name)

generate_resync_tasks_schedule = dg.build_schedule_from_partitioned_job(
    generate_resync_tasks_job,
    name="generate_resync_tasks_schedule",
    hour_of_day=RESYNC_HOUR_UTC,
    minute_of_hour=RESYNC_MINUTE,
    default_status=dg.DefaultScheduleStatus.RUNNING,
)


# -- the catch-up: today's resync when it is missing, failed, or found no store -------------------

# Runs of one day's resync before the catch-up gives up until the next day (each failure alerts).
CATCHUP_ATTEMPTS = 3

IN_FLIGHT = [
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


@dg.sensor(
    job=generate_resync_tasks_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING
)
def resync_catchup_sensor(
    context: dg.SensorEvaluationContext, tq: QueueResource
) -> dg.RunRequest | dg.SkipReason:
    """Today's resync until today has its tasks: when the scheduled tick was missed (the daemon
    was down, the instance is new), when its run failed, or when it ran before any store was
    known (0 tasks is no success). Waits while no store is known, and makes at most
    CATCHUP_ATTEMPTS runs a day."""
    now = datetime.now(UTC)
    day = now.date().isoformat()
    if (now.hour, now.minute) < (RESYNC_HOUR_UTC, RESYNC_MINUTE):
        return dg.SkipReason(f"the schedule runs {day} at {RESYNC_HOUR_UTC:02}:{RESYNC_MINUTE:02} UTC")
    tasks, stores = day_state(tq.queue, now.date())
    if tasks:
        return dg.SkipReason(f"{day} has its {tasks} resync tasks")
    if not stores:
        return dg.SkipReason(
            f"{day}: no store is known yet; the resync is tried once store discovery finds some"
        )
    runs = context.instance.get_runs(
        dg.RunsFilter(job_name=generate_resync_tasks_job.name, tags={"dagster/partition": day})
    )
    if any(r.status in IN_FLIGHT for r in runs):
        return dg.SkipReason(f"a resync run of {day} is under way")
    if len(runs) >= CATCHUP_ATTEMPTS:
        return dg.SkipReason(f"{day}: {len(runs)} resync runs made no task; not trying again today")
    # A new key per attempt (run keys are remembered for good).
    return dg.RunRequest(run_key=f"catchup:{day}:{len(runs)}", partition_key=day)


# -- progress: each day's tasks until they have all finished, and the held days ----------------

# Observations of product_resync read per tick (the rest on the next ones).
EVENTS_PER_TICK = 500


def _held_since(instance: dg.DagsterInstance, after: int | None) -> tuple[set[date], int | None]:
    """The past days held since event storage id ``after`` (from the start when None), and the
    last storage id read. A held run reports the day as an observation with ``held``."""
    held: set[date] = set()
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=PRODUCT_RESYNC, after_storage_id=after),
        limit=EVENTS_PER_TICK,
        ascending=True,
    ).records
    for record in records:
        event = record.asset_observation
        if event is not None and event.partition and "held" in event.metadata:
            held.add(date.fromisoformat(event.partition))
    return held, (records[-1].storage_id if records else after)


def _in_partitions(day: date) -> bool:
    return resync_partitions_def.has_partition_key(day.isoformat())


@dg.sensor(
    job=generate_resync_tasks_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING
)
def resync_progress_sensor(context: dg.SensorEvaluationContext, tq: QueueResource) -> dg.SensorResult:
    """Follows every resync day with unfinished tasks, and every held day: an observation of
    its tasks by state whenever they change, the last once all have finished; and a result of
    the check ``backfill_finished`` whenever the past days' change. Queues a held past day, the
    oldest first and one at a time, once no product_resync task is unfinished."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    tick = int(cursor.get("tick", 0)) + 1
    held = {date.fromisoformat(d) for d in cursor.get("held", [])}
    seen: dict[str, Any] = cursor.get("seen", {})
    new_held, after = _held_since(context.instance, cursor.get("after"))
    held |= new_held
    followed = {d for d in [*open_days(tq.queue), *held] if _in_partitions(d)}
    followed |= {date.fromisoformat(d) for d in seen}
    progress = day_progress(tq.queue, sorted(followed))
    waiting = unfinished(tq.queue)

    # One observation per day whose tasks moved. (Observations, not partitioned check results:
    # the event log keeps one run-less check result per partition, and a day changes all day.)
    events: list[dg.AssetObservation | dg.AssetCheckEvaluation] = []
    still: dict[str, Any] = {}
    for day, p in progress.items():
        if p.tasks:
            held.discard(day)  # queued since
        is_held = day in held
        state = [*p.state(), is_held]
        key = day.isoformat()
        if seen.get(key) != state:
            events.append(
                dg.AssetObservation(
                    PRODUCT_RESYNC,
                    partition=key,
                    metadata={
                        **p.metadata(),
                        "state": "held" if is_held else ("finished" if p.finished else "in progress"),
                    },
                )
            )
        if is_held or p.unfinished:
            still[key] = state
    past = [p for p in progress.values() if p.day < waiting.today]
    backfill = {k: v for k, v in still.items() if date.fromisoformat(k) < waiting.today}
    if backfill != cursor.get("backfill"):
        result = backfill_result(past, [d for d in held if d < waiting.today])
        events.append(dg.AssetCheckEvaluation(asset_key=PRODUCT_RESYNC, check_name=BACKFILL_CHECK, **result))

    requests = []
    if held and not waiting.current and not waiting.past:
        day = min(held)
        key = day.isoformat()
        in_flight = context.instance.get_run_ids(
            dg.RunsFilter(
                job_name=generate_resync_tasks_job.name, tags={"dagster/partition": key}, statuses=IN_FLIGHT
            )
        )
        if not in_flight:
            requests.append(dg.RunRequest(run_key=f"release:{key}:{tick}", partition_key=key))

    summary = "; ".join(
        p.describe(held=p.day in held) for p in progress.values() if p.day.isoformat() in still
    )
    return dg.SensorResult(
        run_requests=requests,
        asset_events=events,
        cursor=json.dumps(
            {
                "held": sorted(d.isoformat() for d in held),
                "seen": still,
                "backfill": backfill,
                "after": after,
                "tick": tick,
            }
        ),
        skip_reason=None if requests else (summary or "no day in progress"),
    )
