"""platform_status_sensor: the platforms' fleet-wide limits, loaded from the platforms file, and
their live state (in flight, pause, errors) shown in the UI as observations of ``platform_limits``."""

import json
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg

from tq_pipelines.defs.lineage import CRAWL_OWNERS, FLEET, PLATFORM_LIMITS, POSTGRES, table_reference
from tq_pipelines.defs.resources import CrawlResource, QueueResource


# An observable asset, not a bare spec: the UI shows its latest observation and offers "Observe"
# (a run doing what the sensor does) rather than a materialisation it could never have.
@dg.multi_observable_source_asset(
    name="observe_platform_limits",
    specs=[
        dg.AssetSpec(
            PLATFORM_LIMITS,
            description=(
                "Each platform's politeness limits as every claimer enforces them (tq_platforms), and "
                "their state: tasks in flight, pause and errors. Observed by platform_status_sensor "
                "every 30 s when anything changes, else every 5 minutes."
            ),
            group_name=FLEET,
            owners=CRAWL_OWNERS,
            kinds=POSTGRES,
            metadata=table_reference("tq_platforms"),
        )
    ],
)
def platform_limits_asset(tq: QueueResource) -> Iterator[dg.ObserveResult]:
    rows = tq.queue.platform_status()
    yield dg.ObserveResult(asset_key=PLATFORM_LIMITS, metadata=observation(rows).metadata)


# An observation at least this often, and at every change of a platform's state or limits.
OBSERVE_EVERY_SECONDS = 300


def describe(row: dict[str, Any]) -> str:
    """One platform in words, for the tick's message and the alerts."""
    text = f"{row['platform']}: {row['state']}, {row['in_flight']}/{row['max_in_flight']} in flight"
    if row["state"] == "paused":
        text += f", {row['pause_seconds_left']:.0f} s left ({row['pause_reason']})"
    elif row["state"] == "probing":
        text += f", probe out after {row['pauses']} pause(s)"
    if row["error_streak"]:
        text += f", {row['error_streak']} error(s) in a row"
    return text


def observation(rows: list[dict[str, Any]]) -> dg.AssetObservation:
    metadata: dict[str, Any] = {"dagster/row_count": dg.MetadataValue.int(len(rows))}
    for r in rows:
        p = r["platform"]
        metadata[f"{p} state"] = r["state"]
        metadata[f"{p} in_flight"] = dg.MetadataValue.int(r["in_flight"])
        metadata[f"{p} max_in_flight"] = dg.MetadataValue.int(r["max_in_flight"])
        metadata[f"{p} requests_per_second"] = dg.MetadataValue.float(float(r["requests_per_second"]))
        metadata[f"{p} paused"] = dg.MetadataValue.int(int(r["state"] in ("paused", "probing")))
        metadata[f"{p} pause_seconds_left"] = dg.MetadataValue.float(round(float(r["pause_seconds_left"]), 1))
        metadata[f"{p} errors_total"] = dg.MetadataValue.int(r["errors_total"])
        if r["pause_reason"]:
            metadata[f"{p} pause_reason"] = r["pause_reason"]
    return dg.AssetObservation(PLATFORM_LIMITS, metadata=metadata)


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def platform_status_sensor(
    context: dg.SensorEvaluationContext, tq: QueueResource, crawl: CrawlResource
) -> dg.SensorResult:
    """Loads the platforms file's limits into the queue (so that an edit reaches every claimer
    within a tick, drain runs or not), then reports each platform's state."""
    settings = crawl.settings()
    changed = tq.load_platform_limits(settings, context.log) if settings else 0
    if changed:
        context.log.info("limits of %s platform(s) loaded from the platforms file", changed)
    rows = tq.queue.platform_status()
    states = {
        r["platform"]: [r["state"], r["max_in_flight"], float(r["requests_per_second"]), r["burst"]]
        for r in rows
    }
    last = json.loads(context.cursor) if context.cursor else {}
    now = time.time()
    due = states != last.get("states") or now - last.get("observed_at", 0) >= OBSERVE_EVERY_SECONDS
    events = [observation(rows)] if rows and due else []
    context.update_cursor(
        json.dumps({"states": states, "observed_at": now if events else last.get("observed_at", 0)})
    )
    message = "; ".join(describe(r) for r in rows) or "no platform has limits (no platforms file?)"
    return dg.SensorResult(asset_events=events, skip_reason=message)
