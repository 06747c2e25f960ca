"""task_queue_sensor: launches drain runs for roles with ready work, within each role's cap."""

import math
import time
from datetime import UTC, datetime

import dagster as dg

from tq_pipelines.jobs import DrainConfig, drain_tasks_job, generate_resync_tasks_job
from tq_pipelines.queue import ROLES
from tq_pipelines.resources import QueueResource
from tq_pipelines.schedules import RESYNC_HOUR_UTC, RESYNC_MINUTE

FAILED = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
# Runs of one day's resync before the catch-up gives up until the next day (each failure alerts).
CATCHUP_ATTEMPTS = 3

IN_FLIGHT = [
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.CANCELING,
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


@dg.sensor(job=drain_tasks_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING)
def task_queue_sensor(context: dg.SensorEvaluationContext, tq: QueueResource) -> dg.SensorResult:
    """One drain run per ``tasks_per_run`` ready tasks of a role, no more than its idle stores
    can feed (a claim takes one task per store), up to the role's cap less the runs of that role
    already queued or running."""
    caps = tq.caps()
    # The short lease: a dead worker's tasks (and stores, and platform slots) come back within
    # a few of its heartbeat intervals, before this tick counts what is claimable.
    expired = tq.queue.expire_leases()
    if expired.recovered or expired.failed:
        context.log.warning(
            "leases expired: %s tasks back to pending, %s failed (out of retries)",
            expired.recovered,
            expired.failed,
        )
    work = tq.queue.claimable()
    # Run keys are remembered forever; a tick counter and the time keep them from colliding.
    tick = int(context.cursor or 0) + 1
    stamp = int(time.time())
    requests: list[dg.RunRequest] = []
    waiting: list[str] = []
    for role in ROLES:
        ready, claimable = work.get(role, (0, 0))
        if not ready:
            continue
        in_flight = context.instance.get_run_ids(
            dg.RunsFilter(job_name=drain_tasks_job.name, tags={"tq/role": role}, statuses=IN_FLIGHT)
        )
        wanted = min(
            caps[role] - len(in_flight),
            math.ceil(ready / tq.tasks_per_run),
            math.ceil(claimable / tq.drain_batch_size),
        )
        waiting.append(f"{role}: {ready} ready, {claimable} claimable now, {len(in_flight)} runs in flight")
        config = DrainConfig(
            role=role,
            batch_size=tq.drain_batch_size,
            concurrency=tq.drain_concurrency,
            time_budget_seconds=tq.drain_time_budget_seconds,
        )
        requests.extend(
            dg.RunRequest(
                run_key=f"{role}:{tick}:{stamp}:{i}",
                run_config=dg.RunConfig(ops={"drain_role_tasks": config}),
                tags={"tq/role": role},
            )
            for i in range(max(wanted, 0))
        )
    skip = None if requests else ("; ".join(waiting) or "no ready tasks")
    return dg.SensorResult(run_requests=requests, skip_reason=skip, cursor=str(tick))


@dg.sensor(
    job=generate_resync_tasks_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING
)
def resync_catchup_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    """Today's resync when its scheduled tick was missed (the daemon was down at the time, or the
    instance is new) or its run failed: until one succeeds or is under way, at most
    CATCHUP_ATTEMPTS runs a day."""
    now = datetime.now(UTC)
    day = now.date().isoformat()
    if (now.hour, now.minute) < (RESYNC_HOUR_UTC, RESYNC_MINUTE):
        return dg.SkipReason(f"the schedule runs {day} at {RESYNC_HOUR_UTC:02}:{RESYNC_MINUTE:02} UTC")
    runs = context.instance.get_runs(
        dg.RunsFilter(job_name=generate_resync_tasks_job.name, tags={"dagster/partition": day})
    )
    if any(r.status not in FAILED for r in runs):
        return dg.SkipReason(f"{day} already has a resync run")
    if len(runs) >= CATCHUP_ATTEMPTS:
        return dg.SkipReason(f"{day}: {len(runs)} resync runs failed; not trying again today")
    # A failed run is tried again, under a new key (run keys are remembered for good).
    return dg.RunRequest(run_key=f"catchup:{day}:{len(runs)}", partition_key=day)
