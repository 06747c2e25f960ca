"""The asset graph's story: the stores, the queue, the menus and their history as assets, in one
lineage with the assets Dagster materialises (product_resync, task_completion_log,
store_freshness) and the platforms' limits.

Dagster does not write the tables below: the queue's functions and the crawl handlers do. They
are observable assets: ``table_rows_sensor`` reports their row counts every few minutes (no run),
and "Observe" in the UI does the same in a run.
"""

import json
import re
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import dagster as dg
from psycopg.rows import dict_row

from tq_pipelines.db.queries import query, sql_dir
from tq_pipelines.defs.resources import QueueResource
from tq_pipelines.queue.api import TaskQueue

# Keys, groups and owners of every asset in the graph.
PLATFORM_LIMITS = dg.AssetKey("platform_limits")
DISPENSARIES = dg.AssetKey("dispensaries")
PRODUCT_RESYNC = dg.AssetKey("product_resync")
WORKER_TASKS = dg.AssetKey("worker_tasks")
WORKER_TASK_HISTORY = dg.AssetKey("worker_task_history")
PRODUCTS = dg.AssetKey("products")
PRODUCT_HISTORY = dg.AssetKey("product_history")
STORE_ANALYTICS = dg.AssetKey("store_analytics")
TASK_COMPLETION_LOG = dg.AssetKey("task_completion_log")
STORE_FRESHNESS = dg.AssetKey("store_freshness")

FLEET = "fleet"  # the platforms and their stores, and how fresh their menus are
QUEUE = "queue"  # the tasks: the daily resync, the queue, its hourly rollup
MENUS = "menus"  # what the crawl stores: menus, their history, per-store analytics

QUEUE_OWNERS = ["team:queue"]
CRAWL_OWNERS = ["team:crawl"]
POSTGRES = {"postgres"}

_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)", re.MULTILINE)


@cache
def _table_definitions() -> dict[str, tuple[Path, int]]:
    """Where each table is created: the migration file and line."""
    found: dict[str, tuple[Path, int]] = {}
    for path in sorted((sql_dir() / "migrations").glob("*.sql")):
        text = path.read_text()
        for match in _CREATE_TABLE.finditer(text):
            found.setdefault(match.group(1), (path, text.count("\n", 0, match.start()) + 1))
    return found


def table_reference(table: str) -> dict[str, Any]:
    """Code-reference metadata pointing at the migration that creates ``table`` (none if not
    found: the code location still loads)."""
    where = _table_definitions().get(table)
    if where is None:
        return {}
    path, line = where
    return {
        "dagster/code_references": dg.CodeReferencesMetadataValue(
            code_references=[
                dg.LocalFileCodeReference(
                    file_path=str(path), line_number=line, label=f"CREATE TABLE {table}"
                )
            ]
        ),
        "dagster/table_name": table,
    }


# The tables the crawl and the queue write, each with the migration that creates it.
TABLES: dict[dg.AssetKey, tuple[str, dg.AssetSpec]] = {
    spec.key: (table, spec)
    for table, spec in [
        (
            "dispensaries",
            dg.AssetSpec(
                DISPENSARIES,
                deps=[PLATFORM_LIMITS],
                description="The stores: listed from each platform's directory by store_discovery "
                "tasks, resolved to a menu by entry_point_discovery; crawl_enabled ones are resynced daily.",
                group_name=FLEET,
                owners=CRAWL_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("dispensaries"),
            ),
        ),
        (
            "worker_tasks",
            dg.AssetSpec(
                WORKER_TASKS,
                deps=[PRODUCT_RESYNC, DISPENSARIES],
                description="The task queue: one row per task (product_resync, store_discovery, "
                "entry_point_discovery, analytics_refresh, ...), claimed and drained by drain runs "
                "(docs/QUEUE.md).",
                group_name=QUEUE,
                owners=QUEUE_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("worker_tasks"),
            ),
        ),
        (
            "worker_task_history",
            dg.AssetSpec(
                WORKER_TASK_HISTORY,
                deps=[WORKER_TASKS],
                description="Finished tasks: completed ones moved out of worker_tasks by their "
                "completion, failed and cancelled ones a minute after they finished; v_tasks reads "
                "both. Kept 30 days (docs/QUEUE.md).",
                group_name=QUEUE,
                owners=QUEUE_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("worker_task_history"),
            ),
        ),
        (
            "products",
            dg.AssetSpec(
                PRODUCTS,
                deps=[WORKER_TASKS, PLATFORM_LIMITS],
                description="Each store's menu as last crawled by product_resync tasks, within the "
                "platforms' politeness limits; gone_at marks what left the menu.",
                group_name=MENUS,
                owners=CRAWL_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("products"),
            ),
        ),
        (
            "product_history",
            dg.AssetSpec(
                PRODUCT_HISTORY,
                deps=[PRODUCTS],
                description="One row per change of a product's price or stock (new, changed, gone, "
                "back); an unchanged menu writes nothing. Kept 365 days.",
                group_name=MENUS,
                owners=CRAWL_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("product_history"),
            ),
        ),
        (
            "store_analytics",
            dg.AssetSpec(
                STORE_ANALYTICS,
                deps=[PRODUCTS, PRODUCT_HISTORY],
                description="Per store: products listed and in stock, price changes in 24 h and 7 "
                "days, last successful crawl; refreshed by analytics_refresh tasks every 15 minutes.",
                group_name=MENUS,
                owners=CRAWL_OWNERS,
                kinds=POSTGRES,
                metadata=table_reference("store_analytics"),
            ),
        ),
    ]
}


def table_rows(queue: TaskQueue) -> dict[dg.AssetKey, dict[str, Any]]:
    """Each table's rows as observation metadata: ``dagster/row_count``, and whether the count
    is the statistics' estimate (products, product_history) rather than a count."""
    with queue.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query("table_row_counts")).fetchall()
    counts = {}
    for r in rows:
        metadata: dict[str, Any] = {"row_count_estimated": dg.MetadataValue.bool(r["estimated"])}
        if r["row_count"] is not None:
            metadata["dagster/row_count"] = dg.MetadataValue.int(int(r["row_count"]))
        counts[dg.AssetKey(r["relation"])] = metadata
    return counts


def observable_table(table: str, spec: dg.AssetSpec) -> dg.AssetsDefinition:
    """``spec`` as an observable asset: the UI shows its latest observation and "Observe" counts
    its rows in a run. One per table: together they would be one node both upstream and
    downstream of product_resync."""

    @dg.multi_observable_source_asset(name=f"observe_{table}", specs=[spec])
    def observe(tq: QueueResource) -> Iterator[dg.ObserveResult]:
        yield dg.ObserveResult(asset_key=spec.key, metadata=table_rows(tq.queue)[spec.key])

    return observe


observable_tables = [observable_table(table, spec) for table, spec in TABLES.values()]


# An observation at least this often, and whenever a table's row count changes (checked every
# tick): the plots get a point per change, not one per tick.
OBSERVE_EVERY_SECONDS = 1800


@dg.sensor(minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.RUNNING)
def table_rows_sensor(context: dg.SensorEvaluationContext, tq: QueueResource) -> dg.SensorResult:
    """Reports the row counts of the tables in the asset graph as observations, without a run."""
    counts = table_rows(tq.queue)
    last = json.loads(context.cursor) if context.cursor else {}
    now = time.time()
    due = now - last.get("observed_at", 0) >= OBSERVE_EVERY_SECONDS
    events = []
    seen = {}
    for key, metadata in counts.items():
        rows = metadata.get("dagster/row_count")
        value = rows.value if rows is not None else None
        seen[key.to_user_string()] = value
        if due or last.get("rows", {}).get(key.to_user_string(), -1) != value:
            events.append(dg.AssetObservation(key, metadata=metadata))
    cursor = {"rows": seen, "observed_at": now if due else last.get("observed_at", 0)}
    message = ", ".join(f"{k}: {v if v is not None else 'unknown'}" for k, v in seen.items())
    return dg.SensorResult(asset_events=events, cursor=json.dumps(cursor), skip_reason=f"rows: {message}")
