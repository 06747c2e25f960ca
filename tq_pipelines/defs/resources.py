"""Dagster resources: the queue (a psycopg pool per run or sensor tick) and the crawl settings."""

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tq_pipelines.crawl.platforms import (
    CrawlServices,
    PlatformSettings,
    PlatformSettingsError,
    load_platform_settings,
    sync_limits,
)
from tq_pipelines.db import check_connection
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines.queue.redact import redact_text

# A role's drain runs at once, from default_runs_per_role or a role_caps entry.
MAX_RUNS_PER_ROLE = 64


class QueueSettingsError(ValueError):
    """A setting is wrong; the message names it."""


def is_env_var(value: object) -> bool:
    """An ``EnvVar``/``EnvVar.int`` placeholder: a name until Dagster resolves it at setup."""
    return isinstance(value, dg.EnvVar) or hasattr(value, "env_var_name")


def check_setting(cls: type, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """A resource setting's type and bounds, refused in one sentence that names it.

    An EnvVar is let through as it is: Dagster builds the resource again from the resolved values
    when a run or a sensor tick starts, and this check refuses a bad value then, before setup.
    """
    if is_env_var(value):
        return value
    try:
        return handler(value)
    except ValidationError as exc:
        reason = "; ".join(e["msg"] for e in exc.errors())
        raise PydanticCustomError(
            "setting",
            "{setting} = {value} is refused: {reason}",
            {
                "setting": f"{cls.__name__}.{info.field_name}",
                "value": redact_text(repr(value))[:200],
                "reason": reason,
            },
        ) from None


def settings_validator() -> Any:
    """:func:`check_setting` on every field of the class it is assigned in."""
    return field_validator("*", mode="wrap")(check_setting)


def parse_role_caps(spec: str) -> dict[str, int]:
    """``"role=N,role=N"`` as a dict; raises naming the setting on a malformed entry or a cap
    out of bounds. Which roles exist is the database's to say (:meth:`QueueResource.caps`)."""
    caps: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        role, sep, value = item.partition("=")
        role = role.strip()
        if not sep or not role:
            raise QueueSettingsError(f"role_caps (TQ_ROLE_CAPS): {item!r} is not role=N")
        try:
            cap = int(value)
        except ValueError:
            raise QueueSettingsError(
                f"role_caps (TQ_ROLE_CAPS): {item!r}: {value.strip()!r} is not a whole number of runs"
            ) from None
        if not 0 <= cap <= MAX_RUNS_PER_ROLE:
            raise QueueSettingsError(
                f"role_caps (TQ_ROLE_CAPS): {item!r}: a cap is from 0 to {MAX_RUNS_PER_ROLE} runs"
            )
        caps[role] = cap
    return caps


class QueueResource(dg.ConfigurableResource):
    """The task queue. One connection pool per run (or sensor tick), closed at its end.

    Every setting is checked for type and bounds when the resource is built (a literal value: when
    the Definitions load) or when a run or tick starts (a value from an EnvVar); role_caps is also
    checked against the roles in worker_task_roles then.
    """

    database_url: str
    pool_max_size: int = Field(default=8, ge=1, le=100, description="Connections per run or tick")
    # "role=N,role=N": how many drain runs of a role may exist at once (default_runs_per_role
    # for roles not named); empty falls back to TQ_ROLE_CAPS. Checked before anything runs.
    role_caps: str = ""
    default_runs_per_role: int = Field(default=2, ge=0, le=MAX_RUNS_PER_ROLE)
    stale_threshold_minutes: int = Field(default=10, ge=1, le=10_080)
    # task_queue_sensor asks for one drain run per tasks_per_run ready tasks (within the caps);
    # each run drains until the queue is empty or its time budget is spent.
    tasks_per_run: int = Field(default=500, ge=1, le=1_000_000)
    drain_batch_size: int = Field(default=50, ge=1, le=1000)
    # Handlers running at once in a drain run; 0 sizes it from the platforms' politeness limits
    # for roles that make HTTP requests, and runs the others inline.
    drain_concurrency: int = Field(default=0, ge=0, le=256)
    # A drain run stays while its role has work coming, polling every drain_idle_poll_seconds
    # (the pickup latency while a run is live), and ends after drain_idle_exit_seconds with
    # nothing claimed (longer than the demo's and the schedules' gaps between arrivals), or when
    # its time budget is spent (4 h: new code reaches the runs within it): few, long runs. An
    # idle run costs about 0.1 CPU s a minute, 125 MB and two connections (docs/BENCHMARKS.md).
    drain_time_budget_seconds: float = Field(default=14_400, gt=0, le=86_400)
    drain_idle_poll_seconds: float = Field(default=0.5, ge=0.05, le=60)
    drain_idle_exit_seconds: float = Field(default=1800, ge=0, le=86_400)
    # Failed and cancelled tasks finished longer ago than this leave worker_tasks for
    # worker_task_history, a batch per task_queue_sensor tick (v_tasks reads both; a completion
    # moves its task itself): the hot table holds the queue, not its past.
    archive_after_seconds: float = Field(default=60, ge=0, le=86_400)
    archive_batch_size: int = Field(default=5000, ge=1, le=100_000)
    # The admin's database URL, for the admin's acts (loading the platforms' limits); empty falls
    # back to TQ_ADMIN_DATABASE_URL, then to database_url. A worker role may not load limits.
    admin_database_url: str = ""

    _queue: TaskQueue | None = PrivateAttr(default=None)
    _caps: dict[str, int] = PrivateAttr(default_factory=dict)

    @field_validator("*", mode="wrap")
    @classmethod
    def _check_setting(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        value = check_setting(cls, value, handler, info)
        if info.field_name == "role_caps" and not is_env_var(value):
            try:
                parse_role_caps(value)
            except QueueSettingsError as exc:
                raise PydanticCustomError("setting", "{message}", {"message": str(exc)}) from None
        return value

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        named = parse_role_caps(self._caps_spec())  # TQ_ROLE_CAPS is read here, not at import
        # One plain connection first: it fails within seconds, with libpq's reason and the
        # password masked, where a pool would retry in the background until its timeout.
        check_connection(self.database_url, setting="TQ_DATABASE_URL (the queue resource's database_url)")
        try:
            queue = TaskQueue.connect(self.database_url, min_size=1, max_size=self.pool_max_size)
        except Exception as exc:
            reason = redact_text(str(exc), [self.database_url])
            raise QueueSettingsError(
                f"cannot open a pool on the queue database (TQ_DATABASE_URL / database_url): {reason}"
            ) from None
        try:
            # A cap for a role the database does not have fails here, before any task.
            self._caps = self._caps_of(named, queue.roles())
        except BaseException:
            queue.close()
            raise
        self._queue = queue

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    @property
    def queue(self) -> TaskQueue:
        if self._queue is None:
            raise RuntimeError("QueueResource used outside of a run or tick")
        return self._queue

    @property
    def run_caps(self) -> dict[str, int]:
        """Every role of worker_task_roles, in name order, with its run cap: read once when the
        run or tick began."""
        if self._queue is None:
            raise RuntimeError("QueueResource used outside of a run or tick")
        return self._caps

    def load_platform_limits(
        self, settings: Mapping[str, PlatformSettings], log: logging.Logger
    ) -> int | None:
        """Load the platforms file's limits as the admin; returns how many changed. When the
        admin URL's role may not (a worker's), the limits loaded stay: returns None, and raises
        if one of ``settings``' platforms has none loaded (its requests would go unlimited)."""
        admin_url = self.admin_database_url or os.environ.get("TQ_ADMIN_DATABASE_URL", "")
        try:
            if not admin_url or admin_url == self.database_url:
                return sync_limits(self.queue, settings)
            with TaskQueue.connect(admin_url, min_size=1, max_size=1) as admin:
                return sync_limits(admin, settings)
        except psycopg.errors.InsufficientPrivilege:
            pass
        loaded = {r["platform"] for r in self.queue.platform_status()}
        missing = sorted(set(settings) - loaded)
        if missing:
            raise QueueSettingsError(
                f"platform(s) {', '.join(missing)} have no limits loaded, and this role may not load them: "
                "load them as the admin (tq platforms --sync, or set TQ_ADMIN_DATABASE_URL for "
                "platform_status_sensor)"
            )
        log.debug("platform limits left as loaded (this database role is not the admin's)")
        return None

    def _caps_spec(self) -> str:
        return self.role_caps or os.environ.get("TQ_ROLE_CAPS", "")

    def caps(self, roles: Iterable[str]) -> dict[str, int]:
        """The run cap of each of ``roles`` (worker_task_roles'): its role_caps entry, else
        default_runs_per_role. Raises naming the setting on a bad entry or one for a role that
        is not among ``roles``."""
        return self._caps_of(parse_role_caps(self._caps_spec()), roles)

    def _caps_of(self, named: dict[str, int], roles: Iterable[str]) -> dict[str, int]:
        roles = list(roles)
        unknown = sorted(set(named) - set(roles))
        if unknown:
            raise QueueSettingsError(
                f"role_caps (TQ_ROLE_CAPS) names {', '.join(unknown)}, not a role of worker_task_roles "
                f"({', '.join(roles)}): add the role (INSERT INTO worker_task_roles) or drop its cap"
            )
        return {role: named.get(role, self.default_runs_per_role) for role in roles}


class CrawlResource(dg.ConfigurableResource):
    """Where the platforms are: a TOML file (docs/PLATFORMS.md). Empty falls back to
    TQ_PLATFORMS_FILE; with neither, drain runs of the HTTP roles' built-in handlers fail before
    claiming. A wrong file fails the op that reads it (:class:`dagster.Failure`, naming the file
    and the key), before any task is touched."""

    platforms_file: str = ""

    def path(self) -> Path | None:
        spec = self.platforms_file or os.environ.get("TQ_PLATFORMS_FILE", "")
        return Path(spec) if spec else None

    def settings(self) -> dict[str, PlatformSettings]:
        """The platforms, validated; {} without a file. Raises naming the file and key at fault."""
        path = self.path()
        if path is None:
            return {}
        try:
            return load_platform_settings(path)
        except PlatformSettingsError as exc:
            raise dg.Failure(f"platforms_file (TQ_PLATFORMS_FILE): {exc}") from exc

    def services(self) -> CrawlServices | None:
        """A fresh HTTP client and adapters for one run; the caller closes it."""
        settings = self.settings()
        if not settings:
            return None
        try:
            return CrawlServices(settings)
        except PlatformSettingsError as exc:  # an adapter that cannot be loaded
            raise dg.Failure(f"platforms_file (TQ_PLATFORMS_FILE) {self.path()}: {exc}") from exc
