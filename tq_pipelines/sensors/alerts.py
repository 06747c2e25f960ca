"""Alerts: failed runs, and the queue's health (stuck tasks, failure rate, drain time)."""

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import dagster as dg
from pydantic import Field

from tq_pipelines.alerts import Alert, AlertResource
from tq_pipelines.freshness import DEFAULT_SLA_HOURS, DEFAULT_STALE_SHARE, MAX_SLA_HOURS, stale_store_problems
from tq_pipelines.handlers import HOW_TO_PLUG_IN, HandlerRegistryError, load_handlers
from tq_pipelines.resources import QueueResource, settings_validator


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
    alerts.send(
        Alert(
            title=f"{run.job_name} failed" + (f" (role {role})" if role else ""),
            text="\n".join([context.failure_event.message or "run failed", *errors]),
            url=alerts.run_url(run.run_id),
        ),
        context.log,
    )


class HealthThresholds(dg.ConfigurableResource):
    """When queue_health_sensor raises an alert. Bounds checked as QueueResource's are."""

    failure_rate: float = Field(default=0.2, ge=0, le=1)
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


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def queue_health_sensor(
    context: dg.SensorEvaluationContext, tq: QueueResource, alerts: AlertResource, health: HealthThresholds
) -> dg.SkipReason:
    """Alerts once when a problem appears (and again if it clears and comes back)."""
    problems = queue_problems(tq, health, datetime.now(UTC))
    already = set(json.loads(context.cursor)) if context.cursor else set()
    sent = set()
    for key in sorted(problems.keys() - already):
        # Remembered only once every configured channel took it; otherwise tried next tick.
        if set(alerts.send(problems[key], context.log)) >= alerts.configured_channels():
            sent.add(key)
    context.update_cursor(json.dumps(sorted((problems.keys() & already) | sent)))
    return dg.SkipReason("healthy" if not problems else "alerting: " + ", ".join(sorted(problems)))
