"""task_queue_sensor: launches drain runs for roles with ready work, within each role's cap."""

import math
import time
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from tq_pipelines.handlers import load_handlers
from tq_pipelines.jobs import DrainConfig, drain_tasks_job, drain_worker_id, generate_resync_tasks_job
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


# A drain run that has not registered its worker this long after it started is taken for dead
# (its process could not even reach the queue).
STARTUP_GRACE_SECONDS = 300.0
# A registered drain run is dead when its worker's heartbeats stopped for this many intervals.
SILENT_INTERVALS = 2.5


def fail_dead_drain_runs(context: dg.SensorEvaluationContext, tq: QueueResource) -> list[str]:
    """Mark failed the drain runs Dagster believes STARTED whose process is gone (killed, OOM,
    evicted pod): their worker's heartbeats in worker_registry stopped. The local run launcher
    cannot tell; without this such runs would hold their role's cap for good. Returns their ids."""
    runs = context.instance.get_runs(
        dg.RunsFilter(job_name=drain_tasks_job.name, statuses=[dg.DagsterRunStatus.STARTED])
    )
    by_worker = {}
    for run in runs:
        ops: Any = run.run_config.get("ops", {})
        role = ops.get("drain_role_tasks", {}).get("config", {}).get("role") or run.tags.get("tq/role")
        if role:
            by_worker[drain_worker_id(role, run.run_id)] = run
    if not by_worker:
        return []
    alive = tq.queue.worker_liveness(list(by_worker))
    dead = []
    for worker_id, run in by_worker.items():
        seen = alive.get(worker_id)
        if seen is None:
            record = context.instance.get_run_record_by_id(run.run_id)
            started = record.start_time if record else None
            if started is None or time.time() - started < STARTUP_GRACE_SECONDS:
                continue
            why = f"its worker never registered in {STARTUP_GRACE_SECONDS:.0f} s"
        elif seen["status"] == "offline" or seen["silent_seconds"] <= max(
            10.0, SILENT_INTERVALS * seen["heartbeat_seconds"]
        ):
            continue  # alive, or done and finishing
        else:
            why = f"its worker {worker_id} has been silent for {seen['silent_seconds']:.0f} s"
        context.instance.report_run_failed(
            run, message=f"drain run presumed dead: {why}; its tasks come back with their leases"
        )
        dead.append(run.run_id)
    return dead


@dg.sensor(job=drain_tasks_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING)
def task_queue_sensor(context: dg.SensorEvaluationContext, tq: QueueResource) -> dg.SensorResult:
    """One drain run per ``tasks_per_run`` ready tasks of a role, no more than its idle stores
    can feed (a claim takes one task per store), up to the role's cap less the runs of that role
    already queued or running. The roles are worker_task_roles'; one without a handler gets no
    run (queue_health_sensor alerts on it)."""
    caps = tq.run_caps
    handlers = load_handlers()
    for run_id in fail_dead_drain_runs(context, tq):
        context.log.warning(
            "drain run %s presumed dead (its worker stopped heartbeating): marked failed", run_id
        )
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
    for role in caps:
        ready, claimable = work.get(role, (0, 0))
        if not ready:
            continue
        if role not in handlers:
            waiting.append(f"{role}: {ready} ready and no handler, not drained")
            context.log.warning("role %s has %s ready tasks and no handler: no drain run", role, ready)
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
