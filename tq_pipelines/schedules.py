"""Schedules. Every one is RUNNING by default: `make dev` shows a live system."""

import dagster as dg

from tq_pipelines.assets import task_completion_log_job
from tq_pipelines.jobs import (
    demo_crawl_job,
    enqueue_analytics_refresh_job,
    enqueue_store_discovery_job,
    generate_resync_tasks_job,
    recover_stale_tasks_job,
)

# 00:05 UTC: the day's resync, for that same day (the partitions have end_offset=1).
RESYNC_HOUR_UTC, RESYNC_MINUTE = 0, 5
generate_resync_tasks_schedule = dg.build_schedule_from_partitioned_job(
    generate_resync_tasks_job,
    name="generate_resync_tasks_schedule",
    hour_of_day=RESYNC_HOUR_UTC,
    minute_of_hour=RESYNC_MINUTE,
    default_status=dg.DefaultScheduleStatus.RUNNING,
)

recover_stale_tasks_schedule = dg.ScheduleDefinition(
    name="recover_stale_tasks_schedule",
    job=recover_stale_tasks_job,
    cron_schedule="*/5 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)

# Five minutes past each hour: the hour that just closed.
task_completion_log_schedule = dg.build_schedule_from_partitioned_job(
    task_completion_log_job,
    name="task_completion_log_schedule",
    minute_of_hour=5,
    default_status=dg.DefaultScheduleStatus.RUNNING,
)

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


# Demo only (`tq dev`, `tq demo`): a resync of every store every 10 minutes, so that the demo
# fleet keeps crawling, retrying and failing over on its first day. Production resyncs daily.
demo_crawl_schedule = dg.ScheduleDefinition(
    name="demo_crawl_schedule",
    job=demo_crawl_job,
    cron_schedule="*/10 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
