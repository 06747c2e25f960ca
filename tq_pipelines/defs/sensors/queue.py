"""task_queue_sensor: launches drain runs for roles with ready work, within each role's cap, and
gives back at once what dead drain runs held."""

import json
import math
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from tq_pipelines.defs.jobs import DrainConfig, drain_tasks_job, drain_worker_id
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.handlers import load_handlers

FAILED = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)

QUEUED = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED]
RUNNING = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
IN_FLIGHT = QUEUED + RUNNING

# Drain runs that ended this recently are looked at again each tick: whatever their worker held
# goes back as soon as its session is gone (a run Dagster marked failed may still be exiting).
ENDED_LOOKBACK_SECONDS = 600


# A drain run started this long ago has had time to claim: work still claimable beside it means
# it is saturated.
SETTLED_SECONDS = 15.0


def _role_of(run: dg.DagsterRun) -> str | None:
    ops: Any = run.run_config.get("ops", {})
    return ops.get("drain_role_tasks", {}).get("config", {}).get("role") or run.tags.get("tq/role")


def release_dead_drain_runs(
    context: dg.SensorEvaluationContext, tq: QueueResource
) -> tuple[set[str], dict[str, int]]:
    """Give back now what the workers of dead drain runs held: those Dagster marked failed or
    canceled lately, and those it still believes started whose worker's session is gone (the
    database saw their connection end). Returns the run ids Dagster believes alive that are dead,
    and what was given back."""
    ended_after = datetime.fromtimestamp(time.time() - ENDED_LOOKBACK_SECONDS, UTC)
    records = [
        *context.instance.get_run_records(dg.RunsFilter(job_name=drain_tasks_job.name, statuses=RUNNING)),
        *context.instance.get_run_records(
            dg.RunsFilter(job_name=drain_tasks_job.name, statuses=list(FAILED), updated_after=ended_after)
        ),
    ]
    workers = {}
    for record in records:
        role = _role_of(record.dagster_run)
        if role:
            workers[drain_worker_id(role, record.dagster_run.run_id)] = record.dagster_run
    if not workers:
        return set(), {"workers": 0, "recovered": 0, "failed": 0}
    sessions = tq.queue.worker_liveness(list(workers))
    zombies = {
        run.run_id
        for worker_id, run in workers.items()
        if run.status in RUNNING
        and (s := sessions.get(worker_id)) is not None
        and s["session_alive"] is False
        and s["status"] != "offline"  # not one that deregistered and is ending
    }
    report = tq.queue.release_dead_workers(list(workers))
    given = {"workers": report.workers_offline, "recovered": report.recovered, "failed": report.failed}
    return zombies, given


def _cursor(context: dg.SensorEvaluationContext) -> tuple[str, int, set[str]]:
    """The sensor's epoch (new when the cursor is reset), tick counter, and the roles that had
    claimable work at the last tick. Run keys are remembered for good, so each tick's keys are
    its own, and a tick evaluated twice (its cursor not saved) asks for the same runs again,
    which Dagster launches once."""
    try:
        saved = json.loads(context.cursor or "")
        return str(saved["epoch"]), int(saved["tick"]) + 1, set(saved.get("backlog", []))
    except (ValueError, TypeError, KeyError):
        return uuid.uuid4().hex[:8], 1, set()


# Every 5 s: a dead run's tasks come back, and an idle role's first run is asked for, within a
# few seconds (a skipped tick costs a few queries; skipped ticks are kept 3 days).
@dg.sensor(job=drain_tasks_job, minimum_interval_seconds=5, default_status=dg.DefaultSensorStatus.RUNNING)
def task_queue_sensor(context: dg.SensorEvaluationContext, tq: QueueResource) -> dg.SensorResult:
    """Drain runs for roles with ready work: as many as the backlog asks for (one per
    ``tasks_per_run`` ready tasks, no more than its idle stores can feed) less the role's runs
    alive or queued, within the role's cap. A drain run stays while work keeps coming, so this
    only tops up. Dead runs' tasks come back first, in this tick. The roles are
    worker_task_roles'; one without a handler gets no run (queue_health_sensor alerts on it)."""
    caps = tq.run_caps
    handlers = load_handlers()
    zombies, given = release_dead_drain_runs(context, tq)
    if given["workers"]:
        context.log.warning(
            "dead drain runs: %s workers' tasks given back (%s pending again, %s failed, out of retries)",
            given["workers"],
            given["recovered"],
            given["failed"],
        )
    for run_id in sorted(zombies):
        context.log.warning(
            "drain run %s: Dagster says it runs, but its worker's connection is gone; not counted "
            "against its role's cap (run monitoring fails it at its dagster/max_runtime)",
            run_id,
        )
    # The short lease: a silent worker's tasks (and stores, and platform slots) come back within
    # a few of its heartbeat intervals, before this tick counts what is claimable.
    expired = tq.queue.expire_leases()
    if expired.recovered or expired.failed:
        context.log.warning(
            "leases expired: %s tasks back to pending, %s failed (out of retries)",
            expired.recovered,
            expired.failed,
        )
    # Finished tasks leave the hot table (0022): one batch a tick, 5,000 by default, more than
    # the fleet finishes in 5 s.
    archived = tq.queue.archive_finished(tq.archive_after_seconds, limit=tq.archive_batch_size)
    if archived:
        context.log.debug("archived %s finished tasks to worker_task_history", archived)
    work = tq.queue.claimable()
    epoch, tick, backlog_before = _cursor(context)
    backlog: set[str] = set()
    now = time.time()
    requests: list[dg.RunRequest] = []
    status: list[str] = []
    for role in caps:
        ready, claimable = work.get(role, (0, 0))
        records = context.instance.get_run_records(
            dg.RunsFilter(job_name=drain_tasks_job.name, tags={"tq/role": role}, statuses=IN_FLIGHT)
        )
        alive = [r for r in records if r.dagster_run.run_id not in zombies]
        queued = [r for r in alive if r.dagster_run.status in QUEUED]
        if not ready and not alive:
            continue
        line = f"{role}: {ready} ready, {claimable} claimable, {len(alive) - len(queued)} runs live"
        if queued:
            # What holds them is the run queue's limits; queue_health_sensor alerts when it lasts.
            waited = now - min(r.create_timestamp.timestamp() for r in queued)
            line += f", {len(queued)} queued (longest {waited:.0f} s)"
        if ready and role not in handlers:
            status.append(f"{role}: {ready} ready and no handler, not drained")
            context.log.warning("role %s has %s ready tasks and no handler: no drain run", role, ready)
            continue
        # As many runs as the backlog asks for; and one more when claimable work waited a whole
        # tick beside live runs (they poll every second or less: they are saturated).
        wanted = min(
            caps[role],
            math.ceil(ready / tq.tasks_per_run),
            math.ceil(claimable / tq.drain_batch_size),
        ) - len(alive)
        if claimable:
            backlog.add(role)
            # Only runs that have been claiming for a while count as saturated: one still
            # starting (its process importing, its first claim not made) is not.
            settled = all(
                r.dagster_run.status == dg.DagsterRunStatus.STARTED
                and (r.start_time is None or now - r.start_time > SETTLED_SECONDS)
                for r in alive
            )
            if wanted <= 0 and role in backlog_before and settled and len(alive) < caps[role]:
                wanted = 1
                line += ", live runs saturated: one more"
        status.append(line)
        config = DrainConfig(
            role=role,
            batch_size=tq.drain_batch_size,
            concurrency=tq.drain_concurrency,
            time_budget_seconds=tq.drain_time_budget_seconds,
            idle_poll_seconds=tq.drain_idle_poll_seconds,
            idle_exit_seconds=tq.drain_idle_exit_seconds,
        )
        requests.extend(
            dg.RunRequest(
                run_key=f"{role}:{epoch}:{tick}:{i}",
                run_config=dg.RunConfig(ops={"drain_role_tasks": config}),
                tags={"tq/role": role, **drain_run_tags(config)},
            )
            for i in range(max(wanted, 0))
        )
    skip = None if requests else ("; ".join(status) or "no ready tasks")
    if requests and status:
        context.log.info("; ".join(status))
    cursor = json.dumps({"epoch": epoch, "tick": tick, "backlog": sorted(backlog)})
    return dg.SensorResult(run_requests=requests, skip_reason=skip, cursor=cursor)


# A drain run stops claiming at its time budget, then its handlers have stop_grace_seconds; past
# this margin more, run monitoring fails it (a run whose process is gone but that Dagster still
# believes started).
MAX_RUNTIME_MARGIN_SECONDS = 300


def drain_run_tags(config: DrainConfig) -> dict[str, str]:
    return {"dagster/max_runtime": str(int(config.time_budget_seconds + MAX_RUNTIME_MARGIN_SECONDS))}
