"""The hourly rollup ``task_completion_log``, one UTC hour per partition. The current hour is one
too: materialised every few minutes while it fills, made final once it has closed."""

from datetime import UTC, datetime

import dagster as dg
from pydantic import Field

from tq_pipelines.jobs import DB_POOL
from tq_pipelines.partitions import hourly_partitions_def
from tq_pipelines.resources import QueueResource

FAILURE_RATE_CHECK = "failure_rate_below_threshold"


class RollupConfig(dg.Config):
    failure_rate_threshold: float = Field(
        default=0.2, ge=0, le=1, description="The check fails when failed / (completed + failed) passes this"
    )


@dg.asset(
    partitions_def=hourly_partitions_def,
    pool=DB_POOL,
    kinds={"postgres"},
    check_specs=[dg.AssetCheckSpec(FAILURE_RATE_CHECK, asset="task_completion_log")],
    description="Per-role tasks created, completed and failed, and task durations, per UTC hour.",
)
def task_completion_log(
    context: dg.AssetExecutionContext, config: RollupConfig, tq: QueueResource
) -> dg.MaterializeResult:
    """Recompute the hour from worker_tasks and upsert it (idempotent, so backfills are safe)."""
    window = context.partition_time_window
    day, hour = window.start.date(), window.start.hour
    # Read before the refresh: a run that ends after the hour closed may still count as partial,
    # never the other way round.
    closed = window.end <= datetime.now(UTC)
    tq.queue.refresh_completion_log(day, hour)
    rows = tq.queue.completion_log(day, hour)
    created = sum(r["tasks_created"] for r in rows)
    completed = sum(r["tasks_completed"] for r in rows)
    failed = sum(r["tasks_failed"] for r in rows)
    finished = completed + failed
    failure_rate = failed / finished if finished else 0.0
    durations = [float(r["avg_duration_sec"]) for r in rows if r["avg_duration_sec"] is not None]
    metadata: dict[str, dg.MetadataValue] = {
        "tasks_created": dg.MetadataValue.int(created),
        "tasks_completed": dg.MetadataValue.int(completed),
        "tasks_failed": dg.MetadataValue.int(failed),
        "failure_rate": dg.MetadataValue.float(round(failure_rate, 4)),
        "max_role_avg_duration_sec": dg.MetadataValue.float(max(durations, default=0.0)),
        "hour_closed": dg.MetadataValue.bool(closed),
        "by_role": dg.MetadataValue.md(_role_table(rows)),
    }
    for r in rows:  # one plot per role and measure in the UI; every role, zeros included
        metadata[f"{r['role']}_created"] = dg.MetadataValue.int(r["tasks_created"])
        metadata[f"{r['role']}_completed"] = dg.MetadataValue.int(r["tasks_completed"])
        metadata[f"{r['role']}_failed"] = dg.MetadataValue.int(r["tasks_failed"])
    check = dg.AssetCheckResult(
        check_name=FAILURE_RATE_CHECK,
        passed=failure_rate <= config.failure_rate_threshold,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "failure_rate": dg.MetadataValue.float(round(failure_rate, 4)),
            "threshold": dg.MetadataValue.float(config.failure_rate_threshold),
            "finished": dg.MetadataValue.int(finished),
        },
    )
    return dg.MaterializeResult(metadata=metadata, check_results=[check])


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
)
