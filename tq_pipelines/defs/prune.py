"""Retention under Dagster: the daily prune of the queue's tables and of Dagster's own runs.

Schedule and sensor ticks are trimmed by Dagster's daemons (``retention:`` in dagster.yaml);
runs and their event logs are not, so the prune op deletes the finished runs past the horizon, a
bounded number per prune.
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from pydantic import Field

from tq_pipelines.defs.jobs import checked_op_config
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.defs.run_tags import MAINTENANCE_TAGS
from tq_pipelines.queue.retention import (
    LIMITS,
    TABLES,
    PruneReport,
    RetentionSettings,
    RetentionSettingsError,
    prune,
)

_D = RetentionSettings()

# Only these are finished: a run queued, starting, started or cancelling is left alone.
FINISHED_RUN_STATUSES = [
    dg.DagsterRunStatus.SUCCESS,
    dg.DagsterRunStatus.FAILURE,
    dg.DagsterRunStatus.CANCELED,
]


def _bounded(name: str, description: str) -> Any:
    """A field with the default and bounds of the retention setting ``name``."""
    low, high = LIMITS[name]
    return Field(default=getattr(_D, name), ge=low, le=high, description=description)


class PruneConfig(dg.Config):
    """The retention settings (tq_pipelines.queue.retention.RetentionSettings), and Dagster's runs."""

    tasks_days: int = _bounded("tasks_days", "Completed, failed and cancelled tasks older than this go")
    completion_log_days: int = _bounded(
        "completion_log_days", "Hourly rollup rows older than this go (at least tasks_days)"
    )
    workers_days: int = _bounded(
        "workers_days", "Registry rows of workers silent this long, holding no task, go"
    )
    product_history_days: int = _bounded("product_history_days", "Price and stock changes older than this go")
    batch_size: int = _bounded("batch_size", "Rows per delete, each its own short transaction")
    pause_seconds: float = _bounded("pause_seconds", "Sleep between batches")
    time_budget_seconds: float = _bounded(
        "time_budget_seconds", "No batch starts after this long; the rest waits for the next prune"
    )
    dagster_runs_days: int = Field(
        default=30,
        ge=1,
        le=36_500,
        description="Finished Dagster runs (and their event logs) older than this go",
    )
    # About 1,000 scheduled runs a day (recovery, the rollup's current hour and the freshness every
    # 5 minutes) and the drain runs: a daily prune must delete several days' worth to catch up
    # after a pause; each run goes with its events, 100 runs a page.
    dagster_runs_per_prune: int = Field(
        default=10_000,
        ge=0,
        le=100_000,
        description="At most this many Dagster runs deleted per prune, oldest first (0: none)",
    )
    dry_run: bool = Field(default=False, description="Count what would go; delete nothing")

    def settings(self) -> RetentionSettings:
        """The queue's settings; raises RetentionSettingsError naming one out of bounds."""
        return RetentionSettings(
            tasks_days=self.tasks_days,
            completion_log_days=self.completion_log_days,
            workers_days=self.workers_days,
            product_history_days=self.product_history_days,
            batch_size=self.batch_size,
            pause_seconds=self.pause_seconds,
            time_budget_seconds=self.time_budget_seconds,
        )


def finished_runs_before(instance: dg.DagsterInstance, before: datetime, limit: int) -> list[str]:
    """Ids of at most ``limit`` runs that finished (succeeded, failed or were cancelled) before
    ``before``, oldest first. A run's last update is its end once it has finished."""
    if limit <= 0:
        return []
    records = instance.get_run_records(
        filters=dg.RunsFilter(statuses=FINISHED_RUN_STATUSES, updated_before=before.astimezone(UTC)),
        limit=limit,
        order_by="update_timestamp",
        ascending=True,
    )
    return [r.dagster_run.run_id for r in records]


def trim_dagster_runs(
    instance: dg.DagsterInstance, *, older_than_days: int, limit: int, page: int = 100, dry_run: bool = False
) -> int:
    """Delete at most ``limit`` finished runs older than ``older_than_days``, with their event
    logs, a page at a time; returns how many went (or would go)."""
    before = datetime.now(UTC) - timedelta(days=older_than_days)
    if dry_run:
        return len(finished_runs_before(instance, before, limit))
    deleted = 0
    while deleted < limit and (run_ids := finished_runs_before(instance, before, min(page, limit - deleted))):
        for run_id in run_ids:
            instance.delete_run(run_id)
        deleted += len(run_ids)
    return deleted


# Bad settings (bounds, and the rule between two of them) make no run.
prune_run_config = checked_op_config(
    "prune_job", "prune_old_rows", PruneConfig, lambda config: config.settings()
)


@dg.op(out=dg.Out(dg.Nothing))
def prune_old_rows(context: dg.OpExecutionContext, config: PruneConfig, tq: QueueResource):
    """Delete finished tasks, long-gone workers, old price history and rollup rows past their
    horizons, in short batches; then the finished Dagster runs past theirs."""
    try:
        settings = config.settings()
    except RetentionSettingsError as exc:
        raise dg.Failure(f"prune config: {exc}") from None
    report = prune(tq.queue, settings, dry_run=config.dry_run, log=context.log)
    runs = trim_dagster_runs(
        context.instance,
        older_than_days=config.dagster_runs_days,
        limit=config.dagster_runs_per_prune,
        dry_run=config.dry_run,
    )
    context.log.info("%s %s finished Dagster runs", "would delete" if config.dry_run else "deleted", runs)
    metadata: dict[str, dg.RawMetadataValue] = {
        "dry_run": config.dry_run,
        "rows": dg.MetadataValue.int(report.rows),
        "hours_rolled_up": dg.MetadataValue.int(report.hours_rolled_up),
        "dagster_runs": dg.MetadataValue.int(runs),
        "finished": report.finished,
        "by_table": dg.MetadataValue.md(_table(report)),
        "tasks_before": report.cutoffs["tasks_before"].isoformat(),
        "rollup_kept_before": str(report.rollup_kept_before),
    }
    for table in TABLES:
        t = report.tables[table]
        metadata[f"{table}_rows"] = dg.MetadataValue.int(t.rows)
        metadata[f"{table}_batches"] = dg.MetadataValue.int(t.batches)
        metadata[f"{table}_seconds"] = dg.MetadataValue.float(round(t.seconds, 3))
    return dg.Output(None, metadata=metadata)


def _table(report: PruneReport) -> str:
    lines = ["| table | rows | batches | seconds | done |", "|---|---:|---:|---:|---|"]
    for name, t in report.tables.items():
        lines.append(
            f"| {name} | {t.rows} | {t.batches} | {t.seconds:.2f} | {'yes' if t.finished else 'no'} |"
        )
    return "\n".join(lines)


@dg.job(
    executor_def=dg.in_process_executor,
    tags={"tq/kind": "prune", **MAINTENANCE_TAGS},
    config=prune_run_config,
)
def prune_job() -> None:
    prune_old_rows()


# 03:30 UTC: off-peak, between the day's resync (00:05) and the discovery (23:00).
prune_schedule = dg.ScheduleDefinition(
    name="prune_schedule",
    job=prune_job,
    cron_schedule="30 3 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
