"""The fleet at a glance: per platform, how many enabled stores have no successful crawl within the
SLA, since when, and an alert when their share passes a threshold."""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import dagster as dg
from psycopg.rows import dict_row
from pydantic import Field

from tq_pipelines.db.queries import query
from tq_pipelines.defs.alerting import Alert
from tq_pipelines.defs.lineage import CRAWL_OWNERS, DISPENSARIES, FLEET, PRODUCTS, STORE_FRESHNESS
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.defs.run_tags import MAINTENANCE_TAGS
from tq_pipelines.queue.api import TaskQueue

# A daily resync spreads a platform's stores over the day in batches: a store is crawled again
# within 24 hours, plus its batch's drain time. 26 hours leaves two for that.
DEFAULT_SLA_HOURS = 26
MAX_SLA_HOURS = 720
DEFAULT_STALE_SHARE = 0.05
# The share of a role's finished tasks in an hour that may fail before it is a problem.
DEFAULT_FAILURE_RATE = 0.2
STALE_SHARE_CHECK = "stale_share_below_threshold"

WHAT_TO_DO = (
    "Look first for a 'platform {platform} is failing' or 'is paused' alert and at `tq status`; then "
    "check that today's generate_resync_tasks run covered {platform} (the platforms file, "
    "TQ_PLATFORMS_FILE, lists it) and that drain runs of product_resync keep up; failed "
    "product_resync and entry_point_discovery tasks of {platform} (worker_tasks.error_message) "
    "name the stores that fail and why."
)


@dataclass(frozen=True)
class PlatformFreshness:
    """One platform's stores against the SLA, as measured at ``measured_at`` (the database's now)."""

    platform: str
    enabled: int  # crawl_enabled, with a platform, not gone
    stale: int  # no successful crawl within the SLA
    never_crawled: int  # no successful crawl ever, within the SLA's grace or not
    stale_never_crawled: int  # of the stale: never crawled at all
    oldest_crawl_at: datetime | None  # the least recent last successful crawl
    measured_at: datetime

    @property
    def stale_share(self) -> float:
        return self.stale / self.enabled if self.enabled else 0.0

    @property
    def oldest_crawl_hours(self) -> float | None:
        if self.oldest_crawl_at is None:
            return None
        return (self.measured_at - self.oldest_crawl_at).total_seconds() / 3600


def _check_sla_hours(sla_hours: float) -> None:
    if not 1 <= sla_hours <= MAX_SLA_HOURS:
        raise ValueError(f"sla_hours must be from 1 to {MAX_SLA_HOURS} hours, got {sla_hours!r}")


def _check_threshold(threshold: float) -> None:
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold (a share of stores) must be from 0 to 1, got {threshold!r}")


def store_freshness_by_platform(queue: TaskQueue, sla_hours: float) -> list[PlatformFreshness]:
    """Every platform with enabled stores, in name order; one query."""
    _check_sla_hours(sla_hours)
    with queue.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query("store_freshness"), {"sla_hours": sla_hours}).fetchall()
    return [
        PlatformFreshness(
            platform=r["platform"],
            enabled=r["enabled"],
            stale=r["stale"],
            never_crawled=r["never_crawled"],
            stale_never_crawled=r["stale_never_crawled"],
            # Shown as UTC whatever the session's time zone.
            oldest_crawl_at=r["oldest_crawl_at"].astimezone(UTC) if r["oldest_crawl_at"] else None,
            measured_at=r["measured_at"].astimezone(UTC),
        )
        for r in rows
    ]


def _since(p: PlatformFreshness) -> str:
    """Since when the platform's stale stores have had no menu, in words."""
    parts = []
    if p.stale > p.stale_never_crawled and p.oldest_crawl_at is not None:
        # Stale stores are older than fresh ones: the oldest crawl of all is one of theirs.
        parts.append(
            f"the oldest last successful crawl was at {p.oldest_crawl_at:%Y-%m-%d %H:%M} UTC "
            f"({p.oldest_crawl_hours:.0f} h ago)"
        )
    if p.stale_never_crawled:
        parts.append(f"never crawled: {p.stale_never_crawled} of them")
    return "; ".join(parts)


def stale_store_problems(queue: TaskQueue, sla_hours: float, threshold: float) -> dict[str, Alert]:
    """One alert per platform whose share of enabled stores with no successful crawl within
    ``sla_hours`` passes ``threshold``, keyed ``stale:<platform>`` (for queue_health_sensor)."""
    _check_threshold(threshold)
    problems: dict[str, Alert] = {}
    for p in store_freshness_by_platform(queue, sla_hours):
        if p.stale and p.stale_share > threshold:
            problems[f"stale:{p.platform}"] = Alert(
                f"stale menus on {p.platform}: {p.stale} of {p.enabled} stores",
                f"{p.stale} of {p.enabled} enabled stores on {p.platform} ({p.stale_share:.1%}, threshold "
                f"{threshold:.1%}) have no successful crawl in the last {sla_hours:g} h; {_since(p)}. "
                + WHAT_TO_DO.format(platform=p.platform),
            )
    return problems


class StoreFreshnessConfig(dg.Config):
    sla_hours: int = Field(
        default=DEFAULT_SLA_HOURS,
        ge=1,
        le=MAX_SLA_HOURS,
        description="A store is stale with no successful crawl in this many hours",
    )
    stale_share_threshold: float = Field(
        default=DEFAULT_STALE_SHARE,
        ge=0,
        le=1,
        description="The check fails when a platform's share of stale stores passes this",
    )


@dg.asset(
    key=STORE_FRESHNESS,
    deps=[DISPENSARIES, PRODUCTS],
    group_name=FLEET,
    owners=CRAWL_OWNERS,
    kinds={"postgres"},
    # Materialised every five minutes (store_freshness_schedule).
    freshness_policy=dg.FreshnessPolicy.time_window(
        fail_window=timedelta(minutes=30), warn_window=timedelta(minutes=15)
    ),
    check_specs=[
        dg.AssetCheckSpec(
            STALE_SHARE_CHECK,
            asset=STORE_FRESHNESS,
            description="No platform has more than the threshold's share of its enabled stores stale",
        )
    ],
    description="Per platform: enabled stores, those with no successful crawl within the SLA (stale), "
    "those never crawled, and the age of the oldest menu.",
)
def store_freshness(
    context: dg.AssetExecutionContext, config: StoreFreshnessConfig, tq: QueueResource
) -> dg.MaterializeResult:
    """Measure every platform's stores against the SLA; the metadata is plotted per platform."""
    platforms = store_freshness_by_platform(tq.queue, config.sla_hours)
    enabled = sum(p.enabled for p in platforms)
    stale = sum(p.stale for p in platforms)
    metadata: dict[str, dg.MetadataValue] = {
        "dagster/row_count": dg.MetadataValue.int(len(platforms)),
        "sla_hours": dg.MetadataValue.int(config.sla_hours),
        "stores_enabled": dg.MetadataValue.int(enabled),
        "stores_stale": dg.MetadataValue.int(stale),
        "stale_share": dg.MetadataValue.float(round(stale / enabled if enabled else 0.0, 4)),
        "never_crawled": dg.MetadataValue.int(sum(p.never_crawled for p in platforms)),
        "by_platform": dg.MetadataValue.md(_platform_table(platforms)),
    }
    for p in platforms:  # one plot per platform and measure in the UI
        metadata[f"{p.platform}_enabled"] = dg.MetadataValue.int(p.enabled)
        metadata[f"{p.platform}_stale"] = dg.MetadataValue.int(p.stale)
        metadata[f"{p.platform}_stale_share"] = dg.MetadataValue.float(round(p.stale_share, 4))
        metadata[f"{p.platform}_never_crawled"] = dg.MetadataValue.int(p.never_crawled)
        if p.oldest_crawl_hours is not None:
            metadata[f"{p.platform}_oldest_crawl_hours"] = dg.MetadataValue.float(
                round(p.oldest_crawl_hours, 2)
            )
    over = [p for p in platforms if p.stale_share > config.stale_share_threshold]
    check = dg.AssetCheckResult(
        check_name=STALE_SHARE_CHECK,
        passed=not over,
        severity=dg.AssetCheckSeverity.ERROR,
        description=(
            "; ".join(f"{p.platform}: {p.stale} of {p.enabled} stale ({p.stale_share:.1%})" for p in over)
            or None
        ),
        metadata={
            "threshold": dg.MetadataValue.float(config.stale_share_threshold),
            "sla_hours": dg.MetadataValue.int(config.sla_hours),
            "worst_share": dg.MetadataValue.float(
                round(max((p.stale_share for p in platforms), default=0.0), 4)
            ),
            "platforms_over": dg.MetadataValue.text(", ".join(p.platform for p in over) or "none"),
        },
    )
    return dg.MaterializeResult(metadata=metadata, check_results=[check])


def _platform_table(platforms: list[PlatformFreshness]) -> str:
    lines = [
        "| platform | enabled | stale | share | never crawled | oldest crawl (UTC) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for p in platforms:
        oldest = (
            f"{p.oldest_crawl_at:%Y-%m-%d %H:%M} ({p.oldest_crawl_hours:.1f} h ago)"
            if p.oldest_crawl_at is not None
            else "never"
        )
        lines.append(
            f"| {p.platform} | {p.enabled} | {p.stale} | {p.stale_share:.1%} | {p.never_crawled} | {oldest} |"
        )
    return "\n".join(lines)


store_freshness_job = dg.define_asset_job(
    "store_freshness_job",
    selection=[store_freshness],
    executor_def=dg.in_process_executor,
    tags={"tq/kind": "freshness", **MAINTENANCE_TAGS},
)

# Every five minutes, two minutes off the rollup's and the recovery's ticks so their runs do not
# all start at once.
store_freshness_schedule = dg.ScheduleDefinition(
    name="store_freshness_schedule",
    job=store_freshness_job,
    cron_schedule="2-59/5 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
