"""Alerts: failed runs, and the queue's health (stuck tasks, failure rate, drain time)."""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Self

import dagster as dg
from pydantic import Field

from tq_pipelines.defs.alerting import Alert, AlertResource, Delivery, alert_id
from tq_pipelines.defs.freshness import (
    DEFAULT_FAILURE_RATE,
    DEFAULT_SLA_HOURS,
    DEFAULT_STALE_SHARE,
    MAX_SLA_HOURS,
    stale_store_problems,
)
from tq_pipelines.defs.resources import QueueResource, settings_validator
from tq_pipelines.handlers import HOW_TO_PLUG_IN, HandlerRegistryError, load_handlers

# The delivery of one failed run's alert. Dagster handles up to 5 failed runs in a tick
# (DAGSTER_RUN_STATUS_SENSOR_PROCESS_LIMIT): 5 times this stays under its 60 s limit on a tick.
RUN_ALERT_SECONDS = 8.0
# queue_health_sensor's checks and deliveries together, under Dagster's 60 s limit with room:
# a tick that overruns it saves no cursor, and its alerts go out again.
TICK_SECONDS = 18.0
# A channel failing tick after tick waits base, 2x, 4x, 8x, then 16x AlertResource.retry_backoff_seconds.
MAX_BACKOFF_DOUBLINGS = 4


@dg.run_failure_sensor(name="run_failure_alert_sensor", default_status=dg.DefaultSensorStatus.RUNNING)
def run_failure_alert_sensor(context: dg.RunFailureSensorContext, alerts: AlertResource) -> None:
    """Every failed run of this code location, to the log, the webhook and Slack."""
    run = context.dagster_run
    role = run.tags.get("tq/role")
    # A step failure's data carries the error (a SerializableErrorInfo) of what went wrong.
    errors = [
        f"{e.step_key}: {error.message.strip()}"
        for e in context.get_step_failure_events()
        if (error := getattr(e.event_specific_data, "error", None)) is not None
    ]
    alert = Alert(
        title=f"{run.job_name} failed" + (f" (role {role})" if role else ""),
        text="\n".join([context.failure_event.message or "run failed", *errors]),
        url=alerts.run_url(run.run_id),
        id=alert_id("run_failure", run.run_id),
    )
    # Sent once: Dagster's cursor moves past the run whatever the channels did.
    alerts.deliver([alert], context.log, deadline_seconds=RUN_ALERT_SECONDS)


class HealthThresholds(dg.ConfigurableResource):
    """When queue_health_sensor raises an alert. Bounds checked as QueueResource's are."""

    failure_rate: float = Field(
        default=DEFAULT_FAILURE_RATE, ge=0, le=1, description="Share of a role's finished tasks failing"
    )
    min_finished: int = Field(
        default=20, ge=1, le=1_000_000, description="Finished tasks in the hour before a rate counts"
    )
    resync_hour_utc: int = Field(default=0, ge=0, le=23, description="When the next resync lands")
    platform_window_minutes: int = Field(
        default=10, ge=1, le=1440, description="Window of the platform check"
    )
    platform_error_rate: float = Field(
        default=0.5, ge=0, le=1, description="Share of a platform's tasks ending in an error"
    )
    platform_min_errors: int = Field(
        default=10, ge=1, le=1_000_000, description="Errors in the window before it counts"
    )
    queued_run_seconds: int = Field(
        default=600, ge=1, le=86_400, description="A drain run queued this long, not started, alerts"
    )
    store_sla_hours: int = Field(
        default=DEFAULT_SLA_HOURS,
        ge=1,
        le=MAX_SLA_HOURS,
        description="A store is stale with no successful crawl in this many hours",
    )
    stale_store_share: float = Field(
        default=DEFAULT_STALE_SHARE,
        ge=0,
        le=1,
        description="Share of a platform's enabled stores stale before it alerts",
    )

    _check_setting = settings_validator()


def hours_to_next_resync(now: datetime, resync_hour_utc: int) -> float:
    next_run = now.replace(hour=resync_hour_utc, minute=0, second=0, microsecond=0)
    if next_run <= now:
        next_run += timedelta(days=1)
    return (next_run - now).total_seconds() / 3600


# Each check: what it finds wrong now, keyed so that a problem that persists is sent once. A key
# that disappears (the problem cleared) and comes back is sent again.
Problems = dict[str, Alert]


def stuck_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    stuck = tq.queue.stuck_tasks(tq.stale_threshold_minutes)
    if not stuck:
        return {}
    return {
        "stuck": Alert(
            "Tasks stuck past the stale threshold",
            f"{stuck} task(s) claimed or running with no sign of life for over "
            f"{tq.stale_threshold_minutes} minutes; is recover_stale_tasks_schedule running?",
        )
    }


def platform_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    problems: Problems = {}
    for p in tq.queue.platform_errors(limits.platform_window_minutes):
        total = p["errors"] + p["completed"]
        if p["errors"] >= limits.platform_min_errors and p["errors"] / total > limits.platform_error_rate:
            problems[f"platform:{p['platform']}"] = Alert(
                f"platform {p['platform']} is failing",
                f"{p['errors']} of {total} tasks on {p['platform']} ended in an error in the last "
                f"{limits.platform_window_minutes} minutes (retried or failed). Latest: {p['last_error']}",
            )
    for p in tq.queue.platform_status():
        if p["state"] in ("paused", "probing"):
            # One alert per outage: the key holds while the platform pauses and probes.
            problems[f"paused:{p['platform']}"] = Alert(
                f"platform {p['platform']} is paused",
                f"every worker holds off {p['platform']} ({p['pauses']} pause(s) in a row"
                + (f", {p['pause_seconds_left']:.0f} s left" if p["state"] == "paused" else ", probing")
                + f"): {p['pause_reason']}. Its tasks wait without spending retries.",
            )
    return problems


def capacity_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    problems: Problems = {}
    horizon = hours_to_next_resync(now, limits.resync_hour_utc)
    for c in tq.queue.capacity():
        finished = c.completed_last_hour + c.failed_last_hour
        if finished >= limits.min_finished and c.failed_last_hour / finished > limits.failure_rate:
            problems[f"failure_rate:{c.role}"] = Alert(
                f"{c.role}: failure rate {c.failed_last_hour / finished:.0%} in the last hour",
                f"{c.failed_last_hour} of {finished} finished tasks failed"
                f" (threshold {limits.failure_rate:.0%}).",
            )
        if c.estimated_hours_to_drain is not None and c.estimated_hours_to_drain > horizon:
            problems[f"drain:{c.role}"] = Alert(
                f"{c.role}: queue will not drain before the next resync",
                f"{c.pending_tasks} pending, estimated {c.estimated_hours_to_drain:.1f} h to drain with "
                f"{c.active_workers} worker(s); the next resync is in {horizon:.1f} h.",
                severity="warning",
            )
    return problems


def handler_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    """Roles with ready tasks and no handler: task_queue_sensor launches no run for them, so
    nothing drains them (a role added to worker_task_roles without its handler, or a plug-in
    missing from this code location)."""
    try:
        handlers = load_handlers()
    except HandlerRegistryError as exc:
        return {"handlers": Alert("role handlers cannot be loaded", f"{exc}: no role is drained")}
    problems: Problems = {}
    for role, (ready, _) in sorted(tq.queue.claimable().items()):
        if ready and role not in handlers:
            problems[f"no_handler:{role}"] = Alert(
                f"role {role} has {ready} ready tasks and no handler",
                f"task_queue_sensor launches no drain run for {role}, so its tasks wait: "
                f"{HOW_TO_PLUG_IN} in the code location's environment (sensors and runs); "
                "or, if the role is retired, cancel its pending tasks.",
            )
    return problems


def stale_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    """Platforms whose share of stores with no successful crawl within the SLA passes the limit."""
    return stale_store_problems(tq.queue, limits.store_sla_hours, limits.stale_store_share)


PROBLEM_CHECKS: tuple[Callable[[QueueResource, HealthThresholds, datetime], Problems], ...] = (
    stuck_problems,
    platform_problems,
    capacity_problems,
    handler_problems,
    stale_problems,
)


def queue_problems(tq: QueueResource, limits: HealthThresholds, now: datetime) -> Problems:
    """What is wrong with the queue now (every check of :data:`PROBLEM_CHECKS`), keyed so that an
    unchanged problem is not re-sent."""
    problems: Problems = {}
    for check in PROBLEM_CHECKS:
        problems.update(check(tq, limits, now))
    return problems


@dataclass
class Tracked:
    """A problem the sensor knows of: since when, its alert's id, the channels that took the
    alert, and how many of its deliveries failed (the more, the later it is tried)."""

    since: str
    id: str
    took: set[str] = field(default_factory=set)
    failures: int = 0


@dataclass
class Backoff:
    """A channel that failed ``failures`` ticks in a row, tried again from ``retry_at``."""

    failures: int
    retry_at: str


@dataclass
class HealthCursor:
    """queue_health_sensor's cursor: every current problem, and the channels backing off."""

    alerts: dict[str, Tracked] = field(default_factory=dict)
    backoff: dict[str, Backoff] = field(default_factory=dict)

    @classmethod
    def load(cls, text: str | None, channels: set[str], now: datetime) -> Self:
        data = json.loads(text) if text else {}
        if isinstance(data, list):
            # The cursor of earlier versions: the keys every channel had taken.
            since = now.isoformat()
            return cls({k: Tracked(since, alert_id(k, since), set(channels)) for k in data})
        return cls(
            {
                k: Tracked(a["since"], a["id"], set(a["took"]), a["failures"])
                for k, a in data.get("alerts", {}).items()
            },
            {c: Backoff(b["failures"], b["retry_at"]) for c, b in data.get("backoff", {}).items()},
        )

    def dump(self) -> str:
        return json.dumps(
            {
                "alerts": {
                    k: {"id": a.id, "since": a.since, "took": sorted(a.took), "failures": a.failures}
                    for k, a in sorted(self.alerts.items())
                },
                "backoff": {
                    c: {"failures": b.failures, "retry_at": b.retry_at} for c, b in self.backoff.items()
                },
            }
        )

    def track(self, problems: Problems, channels: set[str], now: datetime) -> None:
        """Forget the problems that cleared (sent or not: what they said no longer holds), start
        the new ones, and drop the backoff of channels no longer configured."""
        self.alerts = {k: a for k, a in self.alerts.items() if k in problems}
        for key in problems.keys() - self.alerts.keys():
            since = now.isoformat()
            self.alerts[key] = Tracked(since, alert_id(key, since))
        self.backoff = {c: b for c, b in self.backoff.items() if c in channels}

    def ready(self, channels: set[str], now: datetime) -> set[str]:
        return {
            c
            for c in channels
            if c not in self.backoff or datetime.fromisoformat(self.backoff[c].retry_at) <= now
        }

    def due(self, channels: set[str]) -> list[str]:
        """The keys of alerts one of ``channels`` has not taken; those that failed least first."""
        waiting = [k for k, a in self.alerts.items() if channels - a.took]
        return sorted(waiting, key=lambda k: (self.alerts[k].failures, self.alerts[k].since, k))

    def record(self, keys: list[str], delivery: Delivery, now: datetime, backoff_seconds: float) -> None:
        by_id = {self.alerts[k].id: self.alerts[k] for k in keys}
        for i, took in delivery.took.items():
            by_id[i].took |= took
        for channel in set().union(*delivery.took.values()) - delivery.failed.keys() - {"log"}:
            self.backoff.pop(channel, None)
        for channel, i in delivery.failed.items():
            by_id[i].failures += 1
            failures = self.backoff[channel].failures + 1 if channel in self.backoff else 1
            wait = backoff_seconds * 2 ** min(failures - 1, MAX_BACKOFF_DOUBLINGS)
            self.backoff[channel] = Backoff(failures, (now + timedelta(seconds=wait)).isoformat())

    def waiting(self, channels: set[str]) -> str:
        """The alerts not yet delivered, per channel, in words ("" if none)."""
        parts = []
        for c in sorted(channels):
            count = sum(c not in a.took for a in self.alerts.values())
            if count:
                retry = self.backoff.get(c)
                when = f", next try {datetime.fromisoformat(retry.retry_at):%H:%M:%S} UTC" if retry else ""
                parts.append(f"{count} for {c}{when}")
        return "; waiting: " + ", ".join(parts) if parts else ""


def stalled_run_problems(instance: dg.DagsterInstance, limits: HealthThresholds, now: datetime) -> Problems:
    """Roles whose drain runs have waited in Dagster's run queue past the limit: whatever holds
    them (max_concurrent_runs, the tq/kind=drain or tq/role limits, runs that do not end), the
    role is not drained and its tasks wait."""
    queued = instance.get_run_records(
        dg.RunsFilter(
            job_name="drain_tasks_job",
            statuses=[dg.DagsterRunStatus.QUEUED],
            created_before=now - timedelta(seconds=limits.queued_run_seconds),
        )
    )
    waiting: dict[str, list[float]] = {}
    for record in queued:
        role = record.dagster_run.tags.get("tq/role", "?")
        waiting.setdefault(role, []).append((now - record.create_timestamp).total_seconds())
    return {
        f"queued_runs:{role}": Alert(
            f"{role}: drain runs queued for {max(seconds) / 60:.0f} minutes",
            f"{len(seconds)} drain run(s) of {role} have waited over {limits.queued_run_seconds} s "
            "to start: the run queue's limits hold them (dagster.yaml: max_concurrent_runs, the "
            "tq/kind=drain and tq/role limits). See Overview > Runs, queued runs, for what holds them.",
        )
        for role, seconds in sorted(waiting.items())
    }


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def queue_health_sensor(
    context: dg.SensorEvaluationContext, tq: QueueResource, alerts: AlertResource, health: HealthThresholds
) -> dg.SkipReason:
    """Alerts once when a problem appears (and again if it clears and comes back), each alert with
    a stable id. What a channel has not taken waits in the cursor and is tried on later ticks, a
    failing channel backing off; a channel that took an alert never gets it again. The tick ends
    within :data:`TICK_SECONDS` whatever the channels do, its cursor saved."""
    started = time.monotonic()
    now = datetime.now(UTC)
    problems = queue_problems(tq, health, now) | stalled_run_problems(context.instance, health, now)
    channels = alerts.configured_channels()
    state = HealthCursor.load(context.cursor, channels, now)
    state.track(problems, channels, now)
    ready = state.ready(channels, now)
    try:
        if keys := state.due(ready):
            delivery = alerts.deliver(
                [replace(problems[k], id=state.alerts[k].id) for k in keys],
                context.log,
                done={state.alerts[k].id: state.alerts[k].took for k in keys},
                channels=ready,
                deadline_seconds=TICK_SECONDS - (time.monotonic() - started),
            )
            state.record(keys, delivery, datetime.now(UTC), alerts.retry_backoff_seconds)
    finally:
        context.update_cursor(state.dump())
    summary = "healthy" if not problems else "alerting: " + ", ".join(sorted(problems))
    return dg.SkipReason(summary + state.waiting(channels))
