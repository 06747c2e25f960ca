"""Jobs that run the queue: daily resync generation, stale recovery, and draining a role."""

import dagster as dg
from pydantic import Field

from tq_pipelines.handlers import load_handlers
from tq_pipelines.partitions import resync_partitions_def
from tq_pipelines.queue import ROLES
from tq_pipelines.resources import QueueResource
from tq_pipelines.worker import Worker

# Every op below talks to the queue database; pools cap how many do so at once. Drains have a
# pool of their own so that long drain runs never hold off recovery, resync or the rollup.
DB_POOL = "tq_database"
DRAIN_POOL = "tq_drain"

# Ops report through output metadata and return nothing (Nothing outputs skip the IO manager).


class ResyncConfig(dg.Config):
    batches_per_day: int = Field(default=6, ge=1, le=24, description="Batches spread evenly over the UTC day")
    platforms: list[str] = Field(
        default=["dutchie"], min_length=1, description="Platforms (menu_type) to resync"
    )


@dg.op(pool=DB_POOL, out=dg.Out(dg.Nothing))
def generate_resync_tasks(context: dg.OpExecutionContext, config: ResyncConfig, tq: QueueResource):
    """Create the product_resync tasks of the partition's UTC day. Idempotent."""
    day = context.partition_time_window.start.date()
    created = tq.queue.generate_resync(
        day=day, batches_per_day=config.batches_per_day, platforms=config.platforms
    )
    context.log.info("created %s product_resync tasks for %s", created, day)
    return dg.Output(
        None,
        metadata={
            "date": day.isoformat(),
            "created": dg.MetadataValue.int(created),
            "batches_per_day": config.batches_per_day,
            "platforms": ", ".join(config.platforms),
        },
    )


@dg.job(partitions_def=resync_partitions_def, executor_def=dg.in_process_executor, tags={"tq/kind": "resync"})
def generate_resync_tasks_job() -> None:
    generate_resync_tasks()


class RecoverConfig(dg.Config):
    stale_threshold_minutes: int = Field(default=10, ge=1, description="Silence after which a lease expires")


@dg.op(pool=DB_POOL, out=dg.Out(dg.Nothing))
def recover_stale_tasks(context: dg.OpExecutionContext, config: RecoverConfig, tq: QueueResource):
    """Give back the tasks of workers silent past the threshold; mark those workers offline."""
    report = tq.queue.recover_stale(config.stale_threshold_minutes)
    if report.recovered or report.failed or report.workers_offline:
        context.log.warning(
            "recovered %s, failed %s, workers offline %s",
            report.recovered,
            report.failed,
            report.workers_offline,
        )
    return dg.Output(
        None,
        metadata={
            "recovered": dg.MetadataValue.int(report.recovered),
            "failed": dg.MetadataValue.int(report.failed),
            "workers_offline": dg.MetadataValue.int(report.workers_offline),
            "stale_threshold_minutes": config.stale_threshold_minutes,
        },
    )


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "recovery"})
def recover_stale_tasks_job() -> None:
    recover_stale_tasks()


class DrainConfig(dg.Config):
    role: str = Field(description="The role whose tasks this run drains")
    batch_size: int = Field(default=50, ge=1, le=1000, description="Tasks per claim when handlers run inline")
    concurrency: int = Field(default=1, ge=1, le=256, description="Handlers running at once (1: inline)")
    time_budget_seconds: float = Field(default=600, gt=0, description="Stop claiming after this long")
    heartbeat_seconds: float = Field(default=30, gt=0, description="Lease heartbeat interval")


@dg.op(pool=DRAIN_POOL, out=dg.Out(dg.Nothing))
def drain_role_tasks(context: dg.OpExecutionContext, config: DrainConfig, tq: QueueResource):
    """Claim and run the role's tasks until the queue is empty or the time budget is spent.

    A handler exception fails its task, not the run; only the queue itself failing fails the run,
    and whatever it held is given back by recover_stale_tasks.
    """
    if config.role not in ROLES:
        raise dg.Failure(f"role {config.role!r} is not a known role ({', '.join(ROLES)})")
    handler = load_handlers()[config.role]
    worker = Worker(
        tq.queue,
        config.role,
        handler,
        worker_id=f"{config.role}@run:{context.run_id}"[:100],
        batch_size=config.batch_size,
        concurrency=config.concurrency,
        heartbeat_seconds=config.heartbeat_seconds,
        time_budget_seconds=config.time_budget_seconds,
        logger=context.log,  # type: ignore[arg-type]
    )
    stats = worker.run()
    done = stats.completed + stats.failed + stats.retried
    context.log.info(
        "%s: %s completed, %s retried, %s failed, %s lost in %.1f s",
        config.role,
        stats.completed,
        stats.retried,
        stats.failed,
        stats.lost,
        stats.drain_seconds,
    )
    return dg.Output(
        None,
        metadata={
            "role": config.role,
            "worker_id": worker.worker_id,
            "claimed": dg.MetadataValue.int(stats.claimed),
            "completed": dg.MetadataValue.int(stats.completed),
            "retried": dg.MetadataValue.int(stats.retried),
            "failed": dg.MetadataValue.int(stats.failed),
            "lost": dg.MetadataValue.int(stats.lost),
            "drain_seconds": dg.MetadataValue.float(round(stats.drain_seconds, 3)),
            "tasks_per_second": dg.MetadataValue.float(round(stats.tasks_per_second, 1)),
            "mean_handler_seconds": dg.MetadataValue.float(
                round(stats.handler_seconds / done, 4) if done else 0.0
            ),
        },
    )


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "drain"})
def drain_tasks_job() -> None:
    drain_role_tasks()
