"""Partitions, all in UTC, from the deployment's first hour: a new deployment has no partition
before its first day, so nothing shows as missing that could never have been filled.

The first hour is read once, when the code location loads (partitions are fixed then):
``TQ_FIRST_DAY`` (YYYY-MM-DD) when set; else, with ``TQ_DATABASE_URL`` set, the hour of the
oldest task or rollup row in the queue's database (the current hour while it holds none);
else, with no database configured (the tests, tools that load the code alone), FALLBACK_FIRST_DAY.
"""

import logging
import os
from datetime import UTC, date, datetime

import dagster as dg
import psycopg

from tq_pipelines.db.queries import query
from tq_pipelines.queue.redact import redact_text

FALLBACK_FIRST_DAY = date(2026, 1, 1)
# A load must not hang on a database that does not answer: the code server has a deadline.
CONNECT_TIMEOUT_SECONDS = 3

log = logging.getLogger(__name__)


def _this_hour() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def database_first_hour(database_url: str) -> datetime:
    """The UTC hour of the oldest task or task_completion_log row; the current hour when there
    is none yet (a new deployment)."""
    with psycopg.connect(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=True) as conn:
        row = conn.execute(query("deployment_first_hour")).fetchone()
    first = row[0] if row else None
    return first.astimezone(UTC) if first is not None else _this_hour()


def first_hour() -> datetime:
    """Where the partitions start (see the module's docstring)."""
    # Partitions are fixed when the code location loads: this is read then, not per run.
    explicit = os.environ.get("TQ_FIRST_DAY", "").strip()
    if explicit:
        try:
            day = date.fromisoformat(explicit)
        except ValueError:
            raise ValueError(f"TQ_FIRST_DAY = {explicit!r} is not a day (YYYY-MM-DD)") from None
        return datetime(day.year, day.month, day.day, tzinfo=UTC)
    url = os.environ.get("TQ_DATABASE_URL")
    if not url:
        return datetime(FALLBACK_FIRST_DAY.year, FALLBACK_FIRST_DAY.month, FALLBACK_FIRST_DAY.day, tzinfo=UTC)
    try:
        return database_first_hour(url)
    except psycopg.Error as exc:
        # The partitions still load (from today) so that the code location does; every run
        # needs the database anyway and fails on its own until it is back.
        log.warning(
            "partitions start today: the queue database could not be read (%s)",
            redact_text(" ".join(str(exc).split()), [url]),
        )
        return _this_hour().replace(hour=0)


FIRST_HOUR = first_hour()
FIRST_DAY = FIRST_HOUR.date()

# end_offset=1: today's partition exists, so that the early-morning schedule resyncs today.
resync_partitions_def = dg.DailyPartitionsDefinition(
    start_date=FIRST_DAY.isoformat(), timezone="UTC", end_offset=1
)

# end_offset=1: the current hour is a partition, materialised every few minutes while it fills
# (task_completion_log_current_hour_schedule) and made final once it has closed.
hourly_partitions_def = dg.HourlyPartitionsDefinition(
    start_date=FIRST_HOUR.strftime("%Y-%m-%d-%H:%M"), timezone="UTC", end_offset=1
)
