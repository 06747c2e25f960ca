"""Schedules. Every one is RUNNING by default: `make dev` shows a live system. The daily
resync's is with its asset (tq_pipelines/defs/resync.py)."""

from datetime import datetime, timedelta

import dagster as dg

from tq_pipelines.defs.jobs import (
    enqueue_analytics_refresh_job,
    enqueue_store_discovery_job,
    recover_stale_tasks_job,
)
from tq_pipelines.defs.partitions import FIRST_HOUR, hourly_partitions_def
from tq_pipelines.defs.rollup import task_completion_log_job

recover_stale_tasks_schedule = dg.ScheduleDefinition(
    name="recover_stale_tasks_schedule",
    job=recover_stale_tasks_job,
    cron_schedule="*/5 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)


def _hour_run_request(at: datetime, *, once: bool) -> dg.RunRequest | dg.SkipReason:
    """A run of task_completion_log for the UTC hour holding ``at``; with ``once``, one run per
    hour whatever the tick's retries. Its partition's tag (Dagster's documented dagster/partition)
    is set here, as Dagster's own partitioned schedules set it, so that evaluating the schedule
    needs no repository."""
    if at < FIRST_HOUR:
        # The hour before a new deployment's first: not a partition.
        return dg.SkipReason(
            f"{at:%Y-%m-%d %H}:00 UTC is before the first partition ({FIRST_HOUR:%Y-%m-%d %H}:00)"
        )
    key = hourly_partitions_def.get_partition_key_for_timestamp(at.timestamp())
    return dg.RunRequest(
        run_key=key if once else None,
        partition_key=key,
        tags={"dagster/partition": key},
    )


# Five minutes past each hour: the hour that just closed, made final. (The partitions have
# end_offset=1, so the last partition at that time is the hour that has just begun.)
@dg.schedule(
    name="task_completion_log_schedule",
    job=task_completion_log_job,
    cron_schedule="5 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
def task_completion_log_schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    return _hour_run_request(context.scheduled_execution_time - timedelta(hours=1), once=True)


# Every five minutes: the current hour so far, so that its numbers and plots move within minutes
# (the rollup is recomputed whole each time, so this is safe to repeat).
@dg.schedule(
    name="task_completion_log_current_hour_schedule",
    job=task_completion_log_job,
    cron_schedule="*/5 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
def task_completion_log_current_hour_schedule(
    context: dg.ScheduleEvaluationContext,
) -> dg.RunRequest | dg.SkipReason:
    # No run key: every tick of the hour makes its run.
    return _hour_run_request(context.scheduled_execution_time, once=False)


# An hour before the resync: stores found today are resolved in time to be resynced tomorrow.
store_discovery_schedule = dg.ScheduleDefinition(
    name="store_discovery_schedule",
    job=enqueue_store_discovery_job,
    cron_schedule="0 23 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)

analytics_refresh_schedule = dg.ScheduleDefinition(
    name="analytics_refresh_schedule",
    job=enqueue_analytics_refresh_job,
    cron_schedule="*/15 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
