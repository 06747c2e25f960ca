"""The one Dagster Definitions of tq_pipelines."""

import os

import dagster as dg

from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.bindings import crawl_resource, queue_resource
from tq_pipelines.defs.freshness import store_freshness, store_freshness_job, store_freshness_schedule
from tq_pipelines.defs.jobs import (
    drain_tasks_job,
    enqueue_analytics_refresh_job,
    enqueue_store_discovery_job,
    recover_stale_tasks_job,
)
from tq_pipelines.defs.lineage import observable_tables, table_rows_sensor
from tq_pipelines.defs.prune import prune_job, prune_schedule
from tq_pipelines.defs.resync import (
    backfill_finished,
    generate_resync_tasks,
    generate_resync_tasks_job,
    generate_resync_tasks_schedule,
    resync_catchup_sensor,
    resync_progress_sensor,
)
from tq_pipelines.defs.rollup import task_completion_log, task_completion_log_job
from tq_pipelines.defs.schedules import (
    analytics_refresh_schedule,
    recover_stale_tasks_schedule,
    store_discovery_schedule,
    task_completion_log_current_hour_schedule,
    task_completion_log_schedule,
)
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor, run_failure_alert_sensor
from tq_pipelines.defs.sensors.platforms import platform_limits_asset, platform_status_sensor
from tq_pipelines.defs.sensors.queue import task_queue_sensor
from tq_pipelines.handlers import load_handlers
from tq_pipelines_demo.dagster import demo_crawl_schedule

# A plugged-in handler that cannot be loaded is an error here, at load, not a failed task at 3 a.m.
# A role with no handler at all is not: roles are rows of worker_task_roles, and one without a
# handler is reported by task_queue_sensor and queue_health_sensor.
load_handlers()

# Set by `tq dev` and `tq demo` when they serve the menu simulator.
DEMO = os.environ.get("TQ_DEMO") == "1"

defs = dg.Definitions(
    # One lineage: platforms and stores, the daily resync, the queue, the menus and their
    # history, and what is computed from them; each asset links to the code that defines it.
    assets=dg.with_source_code_references(
        [
            platform_limits_asset,
            *observable_tables,
            generate_resync_tasks,
            task_completion_log,
            store_freshness,
        ]
    ),
    asset_checks=[backfill_finished],
    jobs=[
        generate_resync_tasks_job,
        recover_stale_tasks_job,
        drain_tasks_job,
        task_completion_log_job,
        enqueue_store_discovery_job,
        enqueue_analytics_refresh_job,
        store_freshness_job,
        prune_job,
    ],
    schedules=[
        generate_resync_tasks_schedule,
        recover_stale_tasks_schedule,
        task_completion_log_schedule,
        task_completion_log_current_hour_schedule,
        store_freshness_schedule,
        prune_schedule,
        store_discovery_schedule,
        analytics_refresh_schedule,
        *([demo_crawl_schedule] if DEMO else []),
    ],
    sensors=[
        task_queue_sensor,
        resync_catchup_sensor,
        resync_progress_sensor,
        table_rows_sensor,
        queue_health_sensor,
        run_failure_alert_sensor,
        platform_status_sensor,
    ],
    resources={
        "tq": queue_resource,
        "crawl": crawl_resource,
        "alerts": AlertResource(),
        "health": HealthThresholds(),
    },
)
