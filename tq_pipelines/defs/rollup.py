"""The hourly rollup ``task_completion_log``, one UTC hour per partition. The current hour is one
too: materialised every few minutes while it fills, made final once it has closed. A backfill
runs 24 hours per run, each hour with its own materialisation."""

from datetime import UTC, datetime, timedelta

import dagster as dg
from pydantic import Field

from tq_pipelines.defs.freshness import DEFAULT_FAILURE_RATE
from tq_pipelines.defs.lineage import (
    QUEUE,
    QUEUE_OWNERS,
    TASK_COMPLETION_LOG,
    WORKER_TASK_HISTORY,
    WORKER_TASKS,
    table_reference,
)
from tq_pipelines.defs.partitions import hourly_partitions_def
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.defs.run_tags import MAINTENANCE_TAGS

FAILURE_RATE_CHECK = "failure_rate_below_threshold"
# Hours per run of a backfill: a day's hours take about a second to roll up, against a run's
# start-up of a few seconds; 400 days are 400 runs, not 9,600.
HOURS_PER_BACKFILL_RUN = 24


class RollupConfig(dg.Config):
    failure_rate_threshold: float = Field(
        default=DEFAULT_FAILURE_RATE,
        ge=0,
        le=1,
        description="The check fails when failed / (completed + failed) passes this",
    )


@dg.asset(
    key=TASK_COMPLETION_LOG,
    deps=[WORKER_TASKS, WORKER_TASK_HISTORY],
    partitions_def=hourly_partitions_def,
    backfill_policy=dg.BackfillPolicy.multi_run(HOURS_PER_BACKFILL_RUN),
    group_name=QUEUE,
    owners=QUEUE_OWNERS,
    kinds={"postgres"},
    metadata=table_reference("task_completion_log"),
    # The current hour is materialised every five minutes.
    freshness_policy=dg.FreshnessPolicy.time_window(
        fail_window=timedelta(minutes=30), warn_window=timedelta(minutes=15)
    ),
    check_specs=[
        dg.AssetCheckSpec(
            FAILURE_RATE_CHECK,
            asset=TASK_COMPLETION_LOG,
            description="Failed over finished tasks, in the hours of the run, below the threshold",
        )
    ],
    description="Per-role tasks created, completed and failed, and task durations, per UTC hour.",
)
def task_completion_log(
    context: dg.AssetExecutionContext, config: RollupConfig, tq: QueueResource
) -> dg.MaterializeResult:
    """Recompute each hour of the run from worker_tasks and upsert it (idempotent, so backfills
    are safe); each hour's materialisation carries that hour's figures."""
    window = context.partition_time_window
    now = datetime.now(UTC)
    hours = []
    at = window.start
    while at < window.end:
        hours.append(at)
        at += timedelta(hours=1)
    finished = failed = 0
    for hour in hours:
        # Read before the refresh: a run that ends after the hour closed may still count as
        # partial, never the other way round.
        closed = hour + timedelta(hours=1) <= now
        tq.queue.refresh_completion_log(hour.date(), hour.hour)
        rows = tq.queue.completion_log(hour.date(), hour.hour)
        hour_failed = sum(r["tasks_failed"] for r in rows)
        finished += sum(r["tasks_completed"] for r in rows) + hour_failed
        failed += hour_failed
        context.add_asset_metadata(
            hour_metadata(rows, closed),
            partition_key=hourly_partitions_def.get_partition_key_for_timestamp(hour.timestamp()),
        )
    failure_rate = failed / finished if finished else 0.0
    check = dg.AssetCheckResult(
        check_name=FAILURE_RATE_CHECK,
        passed=failure_rate <= config.failure_rate_threshold,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "failure_rate": dg.MetadataValue.float(round(failure_rate, 4)),
            "threshold": dg.MetadataValue.float(config.failure_rate_threshold),
            "finished": dg.MetadataValue.int(finished),
            "hours": dg.MetadataValue.int(len(hours)),
        },
    )
    return dg.MaterializeResult(check_results=[check])


def hour_metadata(rows: list[dict], closed: bool) -> dict[str, dg.MetadataValue]:
    """One hour's materialisation metadata, plotted per partition in the UI."""
    created = sum(r["tasks_created"] for r in rows)
    completed = sum(r["tasks_completed"] for r in rows)
    failed = sum(r["tasks_failed"] for r in rows)
    finished = completed + failed
    durations = [float(r["avg_duration_sec"]) for r in rows if r["avg_duration_sec"] is not None]
    metadata: dict[str, dg.MetadataValue] = {
        "dagster/row_count": dg.MetadataValue.int(len(rows)),
        "tasks_created": dg.MetadataValue.int(created),
        "tasks_completed": dg.MetadataValue.int(completed),
        "tasks_failed": dg.MetadataValue.int(failed),
        "failure_rate": dg.MetadataValue.float(round(failed / finished if finished else 0.0, 4)),
        "max_role_avg_duration_sec": dg.MetadataValue.float(max(durations, default=0.0)),
        "hour_closed": dg.MetadataValue.bool(closed),
        "by_role": dg.MetadataValue.md(_role_table(rows)),
    }
    for r in rows:  # one plot per role and measure in the UI; every role, zeros included
        metadata[f"{r['role']}_created"] = dg.MetadataValue.int(r["tasks_created"])
        metadata[f"{r['role']}_completed"] = dg.MetadataValue.int(r["tasks_completed"])
        metadata[f"{r['role']}_failed"] = dg.MetadataValue.int(r["tasks_failed"])
    return metadata


def _role_table(rows: list[dict]) -> str:
    lines = ["| role | created | completed | failed | avg s | max s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['role']} | {r['tasks_created']} | {r['tasks_completed']} | {r['tasks_failed']} "
            f"| {r['avg_duration_sec'] if r['avg_duration_sec'] is not None else '-'} "
            f"| {r['max_duration_sec'] if r['max_duration_sec'] is not None else '-'} |"
        )
    return "\n".join(lines)


task_completion_log_job = dg.define_asset_job(
    "task_completion_log_job",
    selection=[task_completion_log],
    executor_def=dg.in_process_executor,
    tags={"tq/kind": "rollup", **MAINTENANCE_TAGS},
)
