"""Dagster resources: the queue (a psycopg pool per run or sensor tick) and the crawl settings."""

import os
from pathlib import Path

import dagster as dg
import psycopg
from pydantic import PrivateAttr

from tq_pipelines.crawl.platforms import (
    CrawlServices,
    PlatformSettings,
    PlatformSettingsError,
    load_platform_settings,
)
from tq_pipelines.queue import ROLES, TaskQueue


class QueueSettingsError(ValueError):
    """A setting is wrong; the message names it."""


class QueueResource(dg.ConfigurableResource):
    """The task queue. One connection pool per run (or sensor tick), closed at its end."""

    database_url: str
    pool_max_size: int = 8
    # "role=N,role=N": how many drain runs of a role may exist at once (default_runs_per_role
    # for roles not named); empty falls back to TQ_ROLE_CAPS. Checked before anything runs.
    role_caps: str = ""
    default_runs_per_role: int = 2
    stale_threshold_minutes: int = 10
    # task_queue_sensor asks for one drain run per tasks_per_run ready tasks (within the caps);
    # each run drains until the queue is empty or its time budget is spent.
    tasks_per_run: int = 500
    drain_batch_size: int = 50
    # Handlers running at once in a drain run; 0 sizes it from the platforms' politeness limits
    # for roles that make HTTP requests, and runs the others inline.
    drain_concurrency: int = 0
    drain_time_budget_seconds: float = 600

    _queue: TaskQueue | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self.caps()  # fail on a bad cap before any task is touched
        try:
            # One plain connection first: it fails fast, with libpq's reason, where a pool would
            # retry in the background until its timeout.
            psycopg.connect(self.database_url, connect_timeout=10).close()
            self._queue = TaskQueue.connect(self.database_url, min_size=1, max_size=self.pool_max_size)
        except Exception as exc:
            raise QueueSettingsError(
                f"cannot reach the queue database (TQ_DATABASE_URL / database_url): {exc}"
            ) from exc

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    @property
    def queue(self) -> TaskQueue:
        if self._queue is None:
            raise RuntimeError("QueueResource used outside of a run or tick")
        return self._queue

    def caps(self) -> dict[str, int]:
        """Per-role run caps from ``role_caps``; raises naming the setting on a bad entry."""
        if self.default_runs_per_role < 0:
            raise QueueSettingsError(f"default_runs_per_role must be >= 0, got {self.default_runs_per_role}")
        caps = dict.fromkeys(ROLES, self.default_runs_per_role)
        spec = self.role_caps or os.environ.get("TQ_ROLE_CAPS", "")
        for item in filter(None, (p.strip() for p in spec.split(","))):
            role, sep, value = item.partition("=")
            role = role.strip()
            if not sep or role not in ROLES:
                raise QueueSettingsError(
                    f"role_caps (TQ_ROLE_CAPS): {item!r} is not role=N for a known role ({', '.join(ROLES)})"
                )
            try:
                caps[role] = int(value)
            except ValueError:
                raise QueueSettingsError(
                    f"role_caps (TQ_ROLE_CAPS): {item!r}: {value!r} is not a number"
                ) from None
            if caps[role] < 0:
                raise QueueSettingsError(f"role_caps (TQ_ROLE_CAPS): {item!r}: a cap cannot be negative")
        return caps


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
