"""Jobs that run the queue: stale recovery, draining a role, and the periodic tasks no store triggers."""

import gc
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, NoReturn

import dagster as dg
from pydantic import Field, ValidationError

from tq_pipelines.crawl.handlers import HTTP_ROLES, enqueue_store_discovery
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.resync import generate_resync_tasks_job  # noqa: F401 (importable from here too)
from tq_pipelines.defs.run_tags import MAINTENANCE_TAGS
from tq_pipelines.handlers import BUILTIN, HOW_TO_PLUG_IN, load_handlers
from tq_pipelines.queue.worker import Worker

# Ops report through output metadata and return nothing (Nothing outputs skip the IO manager).


class RecoverConfig(dg.Config):
    stale_threshold_minutes: int = Field(default=10, ge=1, description="Silence after which a lease expires")


@dg.op(out=dg.Out(dg.Nothing))
def recover_stale_tasks(context: dg.OpExecutionContext, config: RecoverConfig, tq: QueueResource):
    """Give back the tasks of workers silent past the threshold; mark those workers offline.
    Then check the platforms' slot counters against the tasks really in flight, and repair."""
    report = tq.queue.recover_stale(config.stale_threshold_minutes)
    if report.recovered or report.failed or report.workers_offline:
        context.log.warning(
            "recovered %s, failed %s, workers offline %s",
            report.recovered,
            report.failed,
            report.workers_offline,
        )
    drift = tq.queue.repair_platform_counters()
    for d in drift:
        context.log.warning(
            "platform %s counted %s tasks in flight, had %s%s: repaired",
            d["platform"],
            d["counted"],
            d["in_flight"],
            " (and a probe no longer running)" if d["probe_cleared"] else "",
        )
    return dg.Output(
        None,
        metadata={
            "recovered": dg.MetadataValue.int(report.recovered),
            "failed": dg.MetadataValue.int(report.failed),
            "workers_offline": dg.MetadataValue.int(report.workers_offline),
            "platform_counters_repaired": dg.MetadataValue.int(len(drift)),
            "stale_threshold_minutes": config.stale_threshold_minutes,
        },
    )


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "recovery", **MAINTENANCE_TAGS})
def recover_stale_tasks_job() -> None:
    recover_stale_tasks()


class DrainConfig(dg.Config):
    role: str = Field(
        min_length=1, max_length=50, description="The role whose tasks this run drains (worker_task_roles)"
    )
    batch_size: int = Field(default=50, ge=1, le=1000, description="Tasks per claim when handlers run inline")
    concurrency: int = Field(
        default=0,
        ge=0,
        le=256,
        description="Handlers running at once (1: inline; 0: twice the platforms' max_in_flight for "
        "HTTP roles, else inline)",
    )
    time_budget_seconds: float = Field(
        default=600, gt=0, le=86_400, description="Stop claiming after this long (at most a day)"
    )
    idle_poll_seconds: float = Field(
        default=0.5,
        ge=0.05,
        le=60,
        description="With nothing to do, claim again this often: the pickup latency of a live run",
    )
    idle_exit_seconds: float = Field(
        default=0,
        ge=0,
        le=86_400,
        description="Stay this long with nothing claimed before the run ends (0: end as soon as the "
        "queue is empty; task_queue_sensor's runs stay, see QueueResource.drain_idle_exit_seconds)",
    )
    heartbeat_seconds: float = Field(default=30, gt=0, le=3600, description="Lease heartbeat interval")
    platform_wait_seconds: float = Field(
        default=10,
        ge=0,
        le=600,
        description="With nothing running, how long to wait for platforms (paused, full or "
        "rate-limited) to take the role's due work before the run ends",
    )


def checked_op_config(
    job_name: str, op_name: str, config_class: type[dg.Config], check: Callable[[Any], object] = lambda c: c
) -> dg.ConfigMapping:
    """A job config mapping that builds ``config_class`` (and runs ``check`` on it) for the job's
    one op, and refuses in words (the key, the value, what is accepted) when a value is wrong.

    Dagster checks a run config against its schema (keys, types) before the run is created, but a
    Config's pydantic bounds only when the op starts: a bad value would make a run that fails at
    its first step. A config mapping runs while the run config is resolved, which the webserver,
    the daemon and execute_in_process do before they create the run. The run config keeps the
    op's shape; resources, loggers and execution pass through to Dagster's own checks."""

    def refuse(values: dict[str, Any], wrong: str) -> NoReturn:
        raise dg.DagsterInvalidConfigError(
            f"{job_name}: config of {op_name} refused before the run is created: {wrong}", [], values
        )

    @dg.config_mapping(
        config_schema={
            "ops": {op_name: {"config": config_class.to_config_schema().as_field()}},
            "resources": dg.Field(dg.Permissive(), is_required=False),
            "loggers": dg.Field(dg.Permissive(), is_required=False),
            "execution": dg.Field(dg.Permissive(), is_required=False),
        }
    )
    def mapping(values: dict[str, Any]) -> dict[str, Any]:
        try:
            config = config_class(**values["ops"][op_name]["config"])
            check(config)
        except ValidationError as exc:
            refuse(
                values,
                "; ".join(
                    f"{'.'.join(map(str, e['loc']))} = {e.get('input')!r}: {e['msg']}" for e in exc.errors()
                ),
            )
        except ValueError as exc:  # the check's own words
            refuse(values, str(exc))
        return {**values, "ops": {op_name: {"config": config.model_dump()}}}

    return mapping


drain_run_config = checked_op_config("drain_tasks_job", "drain_role_tasks", DrainConfig)


def drain_worker_id(role: str, run_id: str) -> str:
    """The queue's name for the worker of a drain run: how the sensor finds a run's heartbeats."""
    return f"{role}@run:{run_id}"[:100]


# Threads for an HTTP role: twice what the hosts accept, so that a saturated host leaves threads
# for the others (its tasks wait at most slot_wait_seconds, then are deferred).
MAX_AUTO_CONCURRENCY = 128


@dg.op(out=dg.Out(dg.Nothing))
def drain_role_tasks(
    context: dg.OpExecutionContext, config: DrainConfig, tq: QueueResource, crawl: CrawlResource
):
    """Claim and run the role's tasks until the time budget is spent, or the queue has been empty
    for ``idle_exit_seconds`` (at once with the default 0; task_queue_sensor's runs stay).

    A handler exception fails its task, not the run; only the queue itself failing fails the run.
    Whatever a dead run held comes back at task_queue_sensor's next tick (its worker's session
    ends with the process), else by its leases.
    """
    roles = list(tq.run_caps)
    if config.role not in roles:
        raise dg.Failure(
            f"role {config.role!r} is not in worker_task_roles ({', '.join(roles)}): add it with "
            f"INSERT INTO worker_task_roles (role) VALUES ('{config.role}'), or drain a role listed"
        )
    handler = load_handlers().get(config.role)
    if handler is None:  # before any claim: the tasks stay pending for a run that has one
        raise dg.Failure(f"role {config.role!r} has no handler: {HOW_TO_PLUG_IN}")
    with ExitStack() as stack:
        services = crawl.services() if config.role in HTTP_ROLES else None  # before any claim
        if services is not None:
            stack.callback(services.close)
            # The file's limits become every claimer's before this run claims anything.
            tq.load_platform_limits(services.settings, context.log)
        elif config.role in HTTP_ROLES and handler is BUILTIN.get(config.role):
            # Every task would fail for want of settings; fail the run instead, touching none.
            raise dg.Failure(
                f"{config.role} crawls platforms, and no platforms are configured: "
                "set TQ_PLATFORMS_FILE or the crawl resource's platforms_file (docs/PLATFORMS.md)"
            )
        concurrency = config.concurrency or (
            min(2 * services.max_in_flight(), MAX_AUTO_CONCURRENCY) if services else 1
        )
        worker = Worker(
            tq.queue,
            config.role,
            handler,
            worker_id=drain_worker_id(config.role, context.run_id),
            batch_size=config.batch_size,
            concurrency=concurrency,
            heartbeat_seconds=config.heartbeat_seconds,
            time_budget_seconds=config.time_budget_seconds,
            logger=context.log,  # type: ignore[arg-type]
            services=services,
            platform_wait_seconds=config.platform_wait_seconds,
            idle_poll_seconds=config.idle_poll_seconds if config.idle_exit_seconds > 0 else None,
            idle_exit_seconds=config.idle_exit_seconds,
        )
        # What the process holds by now (Dagster, psycopg, the handlers) outlives the drain: out
        # of the collector's reach meanwhile, a full collection walks what the drain made, not
        # 200k objects, and no longer stops every slot's thread for 100 ms or more.
        gc.freeze()
        try:
            stats = worker.run()
        finally:
            gc.unfreeze()
    done = stats.completed + stats.failed + stats.retried
    context.log.info(
        "%s: %s completed, %s retried, %s failed, %s deferred, %s lost in %.1f s"
        " (slots passed on: %s hand-offs, %s to standby tasks)",
        config.role,
        stats.completed,
        stats.retried,
        stats.failed,
        stats.deferred,
        stats.lost,
        stats.drain_seconds,
        stats.hand_offs,
        stats.passes,
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
            "deferred": dg.MetadataValue.int(stats.deferred),
            "lost": dg.MetadataValue.int(stats.lost),
            # Platform slots passed on by handler threads, not the main loop (docs/QUEUE.md).
            "hand_offs": dg.MetadataValue.int(stats.hand_offs),
            "passes_to_standby": dg.MetadataValue.int(stats.passes),
            "standby_claimed": dg.MetadataValue.int(stats.standbys),
            # Of those, claimed while the run held no slot of their platform, full (0035).
            "standby_claimed_before_slot": dg.MetadataValue.int(stats.standbys_before_slot),
            # Of the passes, those whose standby sent on a relay before the pass's record (0031).
            "passes_relayed": dg.MetadataValue.int(stats.relays),
            # Requests re-timed because their thread woke late for the start given (0019).
            "late_starts": dg.MetadataValue.int(stats.late_starts),
            "concurrency": dg.MetadataValue.int(concurrency),
            "drain_seconds": dg.MetadataValue.float(round(stats.drain_seconds, 3)),
            "tasks_per_second": dg.MetadataValue.float(round(stats.tasks_per_second, 1)),
            "mean_handler_seconds": dg.MetadataValue.float(
                round(stats.handler_seconds / done, 4) if done else 0.0
            ),
        },
    )


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "drain"}, config=drain_run_config)
def drain_tasks_job() -> None:
    drain_role_tasks()


# -- periodic work: the tasks no store triggers --------------------------------------------------


@dg.op(out=dg.Out(dg.Nothing))
def enqueue_store_discovery_tasks(context: dg.OpExecutionContext, tq: QueueResource, crawl: CrawlResource):
    """One store_discovery task per configured platform and region (none if one is still queued)."""
    settings = crawl.settings()
    if not settings:
        raise dg.Failure("no platforms configured: set TQ_PLATFORMS_FILE (docs/PLATFORMS.md)")
    created = enqueue_store_discovery(tq.queue, settings)
    context.log.info("queued %s store_discovery tasks", created)
    return dg.Output(
        None,
        metadata={"created": dg.MetadataValue.int(created), "platforms": ", ".join(sorted(settings))},
    )


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "discovery"})
def enqueue_store_discovery_job() -> None:
    enqueue_store_discovery_tasks()


@dg.op(out=dg.Out(dg.Nothing))
def enqueue_analytics_refresh_task(context: dg.OpExecutionContext, tq: QueueResource):
    """One analytics_refresh task, unless one is already queued or running."""
    created = tq.queue.enqueue_once("analytics_refresh") is not None
    return dg.Output(None, metadata={"created": dg.MetadataValue.int(int(created))})


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "analytics"})
def enqueue_analytics_refresh_job() -> None:
    enqueue_analytics_refresh_task()
