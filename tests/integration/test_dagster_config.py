"""Bad settings refused in words before anything runs.

Every setting of the queue resource and the health thresholds: a literal out of bounds when the
Definitions are built; a value from an EnvVar when the tick or the run starts, before any task is
touched. A drain run's config: at launch (what the webserver and the daemon do before they create
a run), so that no run exists to fail at its first step.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg
import psycopg
import pytest

# The webserver's launch path, in process: the GraphQL mutation the UI's Launchpad sends.
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext, WorkspaceRequestContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster_graphql.client.query import LAUNCH_PIPELINE_EXECUTION_MUTATION
from dagster_graphql.test.utils import execute_dagster_graphql, infer_job_selector
from pydantic import ValidationError

from tests.dagster_helpers import failure_text
from tests.helpers import add_stores, add_tasks, status_counts
from tq_pipelines.defs.alerting import AlertResource
from tq_pipelines.defs.jobs import drain_tasks_job, generate_resync_tasks_job
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.sensors.alerts import HealthThresholds, queue_health_sensor
from tq_pipelines.defs.sensors.queue import task_queue_sensor

ROLE = "product_resync"
ENV = "TQ_TEST_C_SETTING"


def error_text(exc: BaseException) -> str:
    """The exception's message and its causes'."""
    texts = []
    seen: BaseException | None = exc
    while seen is not None:
        texts.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


# -- literal values: refused when the Definitions are built -------------------------------------

BAD_LITERALS = [
    (QueueResource, "pool_max_size", 0),
    (QueueResource, "pool_max_size", 101),
    (QueueResource, "default_runs_per_role", -1),
    (QueueResource, "default_runs_per_role", 65),
    (QueueResource, "stale_threshold_minutes", 0),
    (QueueResource, "stale_threshold_minutes", 10_081),
    (QueueResource, "tasks_per_run", 0),
    (QueueResource, "drain_batch_size", 0),
    (QueueResource, "drain_batch_size", 1001),
    (QueueResource, "drain_concurrency", -1),
    (QueueResource, "drain_concurrency", 257),
    (QueueResource, "drain_time_budget_seconds", 0),
    (QueueResource, "drain_time_budget_seconds", -5.0),
    (QueueResource, "drain_time_budget_seconds", 86_401),
    (QueueResource, "pool_max_size", "eight"),
    (HealthThresholds, "failure_rate", 1.5),
    (HealthThresholds, "min_finished", 0),
    (HealthThresholds, "resync_hour_utc", 24),
    (HealthThresholds, "platform_window_minutes", 0),
    (HealthThresholds, "platform_error_rate", -0.1),
    (HealthThresholds, "platform_min_errors", 0),
]


def build(cls: type, **settings: Any) -> dg.Definitions:
    extra = {"database_url": "postgresql://tq@127.0.0.1:1/tq"} if cls is QueueResource else {}
    return dg.Definitions(resources={"r": cls(**extra, **settings)})


@pytest.mark.parametrize(("cls", "setting", "value"), BAD_LITERALS)
def test_a_literal_out_of_bounds_fails_when_the_definitions_are_built(cls: type, setting: str, value: Any):
    with pytest.raises(ValidationError) as raised:
        build(cls, **{setting: value})
    assert f"{cls.__name__}.{setting} = {value!r} is refused: Input should be" in str(raised.value)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("product_resync", "'product_resync' is not role=N"),
        ("=3", "'=3' is not role=N"),
        ("product_resync=lots", "'lots' is not a whole number of runs"),
        ("product_resync=-1", "a cap is from 0 to 64 runs"),
        ("product_resync=65", "a cap is from 0 to 64 runs"),
    ],
)
def test_a_malformed_role_caps_fails_when_the_definitions_are_built(spec: str, words: str):
    with pytest.raises(ValidationError) as raised:
        build(QueueResource, role_caps=spec)
    assert "role_caps (TQ_ROLE_CAPS)" in str(raised.value)
    assert words in str(raised.value)


def test_the_bounds_themselves_are_accepted():
    build(
        QueueResource,
        pool_max_size=100,
        default_runs_per_role=0,
        stale_threshold_minutes=10_080,
        tasks_per_run=1,
        drain_batch_size=1000,
        drain_concurrency=256,
        drain_time_budget_seconds=86_400,
        # A role the built-ins do not have: only the database can say whether it exists.
        role_caps="a_role_added_later=64, product_resync=0",
    )
    build(HealthThresholds, failure_rate=1, min_finished=1, resync_hour_utc=23, platform_error_rate=0)


# -- values from the environment: refused when the tick or the run starts ------------------------

BAD_FROM_ENV = [
    ("pool_max_size", "0"),
    ("pool_max_size", "101"),
    ("default_runs_per_role", "-1"),
    ("stale_threshold_minutes", "0"),
    ("tasks_per_run", "0"),  # was a ZeroDivisionError on every tick
    ("drain_batch_size", "1001"),
    ("drain_concurrency", "-1"),
]


def evaluate_queue_sensor(instance: dg.DagsterInstance, tq: QueueResource) -> Any:
    with dg.build_sensor_context(instance=instance, resources={"tq": tq}) as ctx:
        return task_queue_sensor.evaluate_tick(ctx)


def resync(tq: QueueResource, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    return generate_resync_tasks_job.execute_in_process(
        resources={"tq": tq, "crawl": CrawlResource()},
        partition_key="2026-06-01",
        instance=instance,
        raise_on_error=False,
    )


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def queued_work(conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Ready tasks a tick would launch runs for, and stores a resync would create tasks for."""
    monkeypatch.delenv("TQ_ROLE_CAPS", raising=False)
    monkeypatch.setenv("TQ_HANDLERS", f"{ROLE}=tq_pipelines.handlers:noop")
    stores = add_stores(conn, 4)
    add_tasks(conn, ROLE, stores, 1)
    return stores


def assert_refused_before_anything_ran(
    instance: dg.DagsterInstance, conn: psycopg.Connection, tq: QueueResource, words: list[str]
) -> None:
    """The tick raises and the run fails, each naming the setting; no task was touched."""
    with pytest.raises(dg.DagsterError) as raised:
        evaluate_queue_sensor(instance, tq)
    text = error_text(raised.value)
    assert all(w in text for w in words), text
    assert "ZeroDivisionError" not in text

    result = resync(tq, instance)
    assert not result.success
    text = failure_text(result)
    assert all(w in text for w in words), text
    assert status_counts(conn) == {"pending": 4}  # no resync task created, none claimed


@pytest.mark.parametrize(("setting", "value"), BAD_FROM_ENV)
def test_a_value_from_the_environment_out_of_bounds_fails_the_tick_and_the_run(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    queued_work: list[int],
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    value: str,
):
    monkeypatch.setenv(ENV, value)
    from_env: dict[str, Any] = {setting: dg.EnvVar.int(ENV)}  # a name until the resource's setup
    tq = QueueResource(database_url=db_url, **from_env)
    assert_refused_before_anything_ran(
        instance, conn, tq, [f"QueueResource.{setting} = {int(value)!r} is refused"]
    )


@pytest.mark.parametrize(
    ("caps", "words"),
    [
        ("product_resync=lots", "'lots' is not a whole number of runs"),
        ("no_such_role=1", "names no_such_role, not a role of worker_task_roles"),
    ],
)
@pytest.mark.parametrize("source", ["EnvVar", "TQ_ROLE_CAPS"])
def test_role_caps_from_the_environment_are_checked_when_the_tick_and_the_run_start(
    instance: dg.DagsterInstance,
    db_url: str,
    conn: psycopg.Connection,
    queued_work: list[int],
    monkeypatch: pytest.MonkeyPatch,
    caps: str,
    words: str,
    source: str,
):
    if source == "EnvVar":
        monkeypatch.setenv(ENV, caps)
        tq = QueueResource(database_url=db_url, role_caps=dg.EnvVar(ENV))
    else:
        monkeypatch.setenv("TQ_ROLE_CAPS", caps)
        tq = QueueResource(database_url=db_url)
    assert_refused_before_anything_ran(instance, conn, tq, ["role_caps (TQ_ROLE_CAPS)", words])


def test_an_unreachable_database_from_the_environment_fails_the_tick_in_words(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(ENV, "postgresql://tq:s3cret-pw@127.0.0.1:1/tq")
    with pytest.raises(dg.DagsterError) as raised:
        evaluate_queue_sensor(instance, QueueResource(database_url=dg.EnvVar(ENV)))
    text = error_text(raised.value)
    assert "cannot connect to the database TQ_DATABASE_URL" in text
    assert "127.0.0.1" in text
    assert "s3cret-pw" not in text


def test_a_health_threshold_from_the_environment_out_of_bounds_fails_the_tick(
    instance: dg.DagsterInstance, db_url: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(ENV, "0")
    resources = {
        "tq": QueueResource(database_url=db_url),
        "alerts": AlertResource(),
        "health": HealthThresholds(min_finished=dg.EnvVar.int(ENV)),
    }
    with (
        pytest.raises(dg.DagsterError) as raised,
        dg.build_sensor_context(instance=instance, resources=resources) as ctx,
    ):
        queue_health_sensor.evaluate_tick(ctx)
    assert "HealthThresholds.min_finished = 0 is refused" in error_text(raised.value)


# -- a drain run's config: refused at launch, before the run exists ------------------------------

BAD_DRAIN_CONFIGS = [
    ({"role": ROLE, "batch_size": 0}, "batch_size = 0: Input should be greater than or equal to 1"),
    ({"role": ROLE, "batch_size": 1001}, "batch_size = 1001: Input should be less than or equal to 1000"),
    ({"role": ROLE, "concurrency": 257}, "concurrency = 257"),
    ({"role": ROLE, "time_budget_seconds": -1}, "time_budget_seconds = -1.0: Input should be greater than 0"),
    ({"role": ROLE, "time_budget_seconds": 86_401}, "time_budget_seconds = 86401.0"),
    ({"role": ROLE, "heartbeat_seconds": 0}, "heartbeat_seconds = 0.0"),
    ({"role": ROLE, "platform_wait_seconds": 601}, "platform_wait_seconds = 601.0"),
    ({"role": ""}, "role = '': String should have at least 1 character"),
    ({"role": "r" * 51}, "String should have at most 50 characters"),
    ({"role": ROLE, "batch_sise": 10}, 'unexpected config entry "batch_sise"'),
    ({}, 'Missing required config entry "role"'),
]


def drain_run_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"ops": {"drain_role_tasks": {"config": config}}}


def test_a_drain_config_keeps_its_shape_and_passes_loggers_and_resources_through():
    run_config = {
        **drain_run_config({"role": ROLE, "batch_size": 7}),
        "loggers": {"console": {"config": {"log_level": "WARNING"}}},  # as bench/fleet_politeness.py
    }
    resolved = dg.validate_run_config(drain_tasks_job, run_config)
    assert resolved["ops"]["drain_role_tasks"]["config"]["batch_size"] == 7
    assert resolved["loggers"]["console"]["config"]["log_level"] == "WARNING"
    # What passes through is still checked by Dagster against the job.
    with pytest.raises(dg.DagsterInvalidConfigError, match="no_such_logger"):
        dg.validate_run_config(drain_tasks_job, {**run_config, "loggers": {"no_such_logger": {}}})


@pytest.mark.parametrize(("config", "words"), BAD_DRAIN_CONFIGS)
def test_a_bad_drain_config_does_not_validate(config: dict[str, Any], words: str):
    with pytest.raises(dg.DagsterInvalidConfigError) as raised:
        dg.validate_run_config(drain_tasks_job, drain_run_config(config))
    assert words in str(raised.value)


@pytest.mark.parametrize(("config", "words"), BAD_DRAIN_CONFIGS)
def test_a_bad_drain_config_run_in_process_is_refused_before_the_run_exists(
    instance: dg.DagsterInstance, db_url: str, conn: psycopg.Connection, config: dict[str, Any], words: str
):
    add_tasks(conn, ROLE, add_stores(conn, 2), 1)
    with pytest.raises(dg.DagsterInvalidConfigError) as raised:
        drain_tasks_job.execute_in_process(
            run_config=drain_run_config(config),
            resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
            instance=instance,
        )
    assert words in str(raised.value)
    assert instance.get_runs() == []
    assert status_counts(conn) == {"pending": 2}


@pytest.fixture(scope="module")
def launchpad() -> Iterator[tuple[dg.DagsterInstance, WorkspaceRequestContext]]:
    """The code location loaded as the webserver loads it, on an instance whose launches are
    queued (the run is created, no process is started)."""
    overrides = {
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}
    }
    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name="tq_pipelines.definitions"))
    with pytest.MonkeyPatch.context() as mp:
        # Resolved at launch, used only when the run starts: never connected to here.
        mp.setenv("TQ_DATABASE_URL", "postgresql://tq@127.0.0.1:1/never-connected")
        with (
            dg.instance_for_test(overrides=overrides) as instance,
            WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as workspace,
        ):
            yield instance, workspace.create_request_context()


# Dagster's own snapshot of the code location reads a deprecated property of every schedule
# (dagster/_core/remote_representation/external_data.py, ScheduleSnap.from_def): not our code.
snapshot_warning = pytest.mark.filterwarnings(
    "ignore:Property `ScheduleDefinition.environment_vars` is deprecated:DeprecationWarning"
)


def launch(context: WorkspaceRequestContext, config: dict[str, Any]) -> dict[str, Any]:
    """What the Launchpad's Launch button sends."""
    params = {"selector": infer_job_selector(context, drain_tasks_job.name), "runConfigData": config}
    result = execute_dagster_graphql(
        context, LAUNCH_PIPELINE_EXECUTION_MUTATION, variables={"executionParams": params}
    )
    return result.data["launchPipelineExecution"]


@snapshot_warning
def test_a_good_drain_config_launched_from_the_ui_creates_a_run(
    launchpad: tuple[dg.DagsterInstance, WorkspaceRequestContext],
):
    instance, context = launchpad
    before = instance.get_runs_count()
    answer = launch(context, drain_run_config({"role": ROLE, "batch_size": 10}))
    assert answer["__typename"] == "LaunchRunSuccess", answer
    assert answer["run"]["status"] == "QUEUED"
    assert instance.get_runs_count() == before + 1


@snapshot_warning
@pytest.mark.parametrize(("config", "words"), BAD_DRAIN_CONFIGS)
def test_a_bad_drain_config_launched_from_the_ui_is_refused_and_creates_no_run(
    launchpad: tuple[dg.DagsterInstance, WorkspaceRequestContext], config: dict[str, Any], words: str
):
    instance, context = launchpad
    before = instance.get_runs_count()
    answer = launch(context, drain_run_config(config))
    assert answer["__typename"] in ("PythonError", "RunConfigValidationInvalid"), answer
    said = answer.get("message", "") + " ".join(e["message"] for e in answer.get("errors", []))
    assert words in said
    assert instance.get_runs_count() == before
