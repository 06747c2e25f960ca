"""The Definitions of tq_pipelines load and carry the names operators and the UI rely on, with the
schedules and sensors described. No database needed: resources resolve only when something runs."""

from datetime import UTC, datetime

import dagster as dg
import pytest

from tq_pipelines.definitions import defs
from tq_pipelines.defs.resync import generate_resync_tasks_schedule

JOBS = {
    "generate_resync_tasks_job",
    "recover_stale_tasks_job",
    "drain_tasks_job",
    "task_completion_log_job",
    "enqueue_store_discovery_job",
    "enqueue_analytics_refresh_job",
    "store_freshness_job",
    "prune_job",
}
SCHEDULES = {
    "generate_resync_tasks_schedule": ("5 0 * * *", "generate_resync_tasks_job"),
    "recover_stale_tasks_schedule": ("*/5 * * * *", "recover_stale_tasks_job"),
    "task_completion_log_schedule": ("5 * * * *", "task_completion_log_job"),
    "task_completion_log_current_hour_schedule": ("*/5 * * * *", "task_completion_log_job"),
    "store_freshness_schedule": ("2-59/5 * * * *", "store_freshness_job"),
    "prune_schedule": ("30 3 * * *", "prune_job"),
    "store_discovery_schedule": ("0 23 * * *", "enqueue_store_discovery_job"),
    "analytics_refresh_schedule": ("*/15 * * * *", "enqueue_analytics_refresh_job"),
}
SENSORS = {
    "task_queue_sensor",
    "resync_catchup_sensor",
    "resync_progress_sensor",
    "table_rows_sensor",
    "queue_health_sensor",
    "run_failure_alert_sensor",
    "platform_status_sensor",
}


@pytest.fixture(scope="module")
def repo() -> dg.RepositoryDefinition:
    return defs.get_repository_def()


def test_definitions_validate_loadable():
    dg.Definitions.validate_loadable(defs)


def test_jobs_schedules_sensors_and_asset_exist(repo: dg.RepositoryDefinition):
    assert set(repo.job_names) >= JOBS
    assert {s.name for s in repo.schedule_defs} == set(SCHEDULES)
    assert {s.name for s in repo.sensor_defs} == SENSORS
    asset_keys = set(repo.assets_defs_by_key)
    assert dg.AssetKey("task_completion_log") in asset_keys
    assert dg.AssetKey("platform_limits") in asset_keys  # observed by platform_status_sensor
    assert dg.AssetKey("store_freshness") in asset_keys
    check_keys = repo.assets_defs_by_key[dg.AssetKey("task_completion_log")].check_keys
    assert dg.AssetCheckKey(dg.AssetKey("task_completion_log"), "failure_rate_below_threshold") in check_keys
    # The resources every job, schedule and sensor asks for are bound.
    assert {"tq", "crawl", "alerts", "health"} <= set(repo.get_top_level_resources())


MAINTENANCE = {
    "recover_stale_tasks_job",
    "task_completion_log_job",
    "store_freshness_job",
    "generate_resync_tasks_job",
    "prune_job",
}


def test_maintenance_jobs_go_ahead_of_drain_runs_in_the_run_queue(repo: dg.RepositoryDefinition):
    """Every maintenance job carries dagster/priority 10 (docs/DEPLOYMENT.md, "Limits that
    matter"); no other job does, so none of them waits behind a queued drain run."""
    priority = {name: repo.get_job(name).tags.get("dagster/priority") for name in JOBS}
    assert {name for name, p in priority.items() if p == "10"} == MAINTENANCE, priority
    assert all(p is None for name, p in priority.items() if name not in MAINTENANCE), priority


def test_every_schedule_and_sensor_runs_by_default(repo: dg.RepositoryDefinition):
    for schedule in repo.schedule_defs:
        assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING, schedule.name
    for sensor in repo.sensor_defs:
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING, sensor.name


def test_schedule_crons_targets_and_timezone(repo: dg.RepositoryDefinition):
    for name, (cron, job_name) in SCHEDULES.items():
        schedule = repo.get_schedule_def(name)
        assert schedule.cron_schedule == cron, name
        assert schedule.execution_timezone == "UTC", name
        assert schedule.job_name == job_name, name


def test_sensor_targets(repo: dg.RepositoryDefinition):
    assert repo.get_sensor_def("task_queue_sensor").job_name == "drain_tasks_job"
    assert repo.get_sensor_def("queue_health_sensor").targets == []


# Evaluating a schedule made by build_schedule_from_partitioned_job calls
# JobDefinition.run_request_for_partition, which Dagster 1.13 itself deprecates: a warning raised
# inside Dagster that this project cannot avoid.
dagster_deprecates_itself = pytest.mark.filterwarnings(
    "ignore:Function `JobDefinition.run_request_for_partition` is deprecated:DeprecationWarning"
)


@dagster_deprecates_itself
def test_resync_schedule_at_0005_utc_requests_the_same_day():
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 6, 2, 0, 5, tzinfo=UTC)) as ctx:
        data = generate_resync_tasks_schedule.evaluate_tick(ctx)
    assert [r.partition_key for r in data.run_requests or []] == ["2026-06-02"]


@dagster_deprecates_itself
def test_resync_schedule_from_the_repository_requests_the_same_day(repo: dg.RepositoryDefinition):
    """The schedule as the daemon sees it (resolved in the repository), late in the UTC day."""
    schedule = repo.get_schedule_def("generate_resync_tasks_schedule")
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 6, 2, 0, 5, tzinfo=UTC)) as ctx:
        data = schedule.evaluate_tick(ctx)
    assert [r.partition_key for r in data.run_requests or []] == ["2026-06-02"]


@dagster_deprecates_itself
def test_rollup_schedule_at_1105_requests_the_closed_hour(repo: dg.RepositoryDefinition):
    # An asset-job schedule is resolved by the repository; the module object is unresolved.
    schedule = repo.get_schedule_def("task_completion_log_schedule")
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 6, 1, 11, 5, tzinfo=UTC)) as ctx:
        data = schedule.evaluate_tick(ctx)
    assert [r.partition_key for r in data.run_requests or []] == ["2026-06-01-10:00"]


@dagster_deprecates_itself
def test_rollup_schedule_at_0005_requests_the_last_hour_of_the_previous_day(repo: dg.RepositoryDefinition):
    schedule = repo.get_schedule_def("task_completion_log_schedule")
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 6, 2, 0, 5, tzinfo=UTC)) as ctx:
        data = schedule.evaluate_tick(ctx)
    assert [r.partition_key for r in data.run_requests or []] == ["2026-06-01-23:00"]
