"""The five roles' handlers. Each takes a task and its context and returns the task's result.

HTTP goes through the run's :class:`CrawlServices` (``ctx.services``); database writes go through
``ctx.transaction()``, which is fenced by the task's lease: a handler that lost its task writes
nothing. Each handler completes its task in the transaction of its writes (``ctx.complete``), so
the writes and the completion commit together: a crash leaves both or neither, and a task is
never done twice because its completion was lost. Every write is idempotent besides.
"""

from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tq_pipelines.crawl.http import GoneError
from tq_pipelines.crawl.menu import encode_menu, normalise_menu
from tq_pipelines.crawl.platforms import CrawlServices, EntryPoint, PlatformSettings
from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import JSON, Task, TaskQueue
from tq_pipelines.queue.worker import PermanentTaskError, TaskContext


def _services(ctx: TaskContext) -> CrawlServices:
    if not isinstance(ctx.services, CrawlServices):
        raise PermanentTaskError(
            "this worker has no platform settings: set TQ_PLATFORMS_FILE (see docs/PLATFORMS.md)"
        )
    return ctx.services


def _store(ctx: TaskContext, task: Task) -> dict[str, Any]:
    if task.dispensary_id is None:
        raise PermanentTaskError(f"a {task.role} task needs a store (dispensary_id)")
    assert ctx.pool is not None
    with ctx.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query("store_entry_point"), {"dispensary_id": task.dispensary_id}).fetchone()
    if row is None:
        raise PermanentTaskError(f"store {task.dispensary_id} does not exist")
    # The task holds its platform's slot (the permit keys on task.platform); its requests must go
    # to that platform. The queue keeps the two equal (migration 0012): this is the last guard.
    if row["menu_type"] != task.platform:
        raise PermanentTaskError(
            f"store {row['id']} is on platform {row['menu_type']!r}, its task on {task.platform!r}: "
            "its requests would not keep the limits of the platform they go to"
        )
    return row


def _gone(ctx: TaskContext, store: dict[str, Any], exc: GoneError) -> PermanentTaskError:
    """Record that the platform no longer has the store; the error to fail the task with."""
    with ctx.transaction() as cur:
        cur.execute(query("mark_store_gone"), ctx.lease_params())
    return PermanentTaskError(
        f"store gone: {store['menu_type']} answered HTTP {exc.status} for {exc.url}; "
        "crawling is off until store_discovery lists the store again"
    )


def store_discovery(task: Task, ctx: TaskContext) -> JSON:
    """List a platform's stores in one region (payload: platform, region) and upsert them."""
    # The task's own platform first: its permit keys on it (the queue keeps the payload's equal).
    platform = task.platform or task.payload.get("platform")
    region = task.payload.get("region")
    if not platform:
        raise PermanentTaskError(
            "store_discovery needs a platform (payload {'platform': ..., 'region': ...})"
        )
    listings = _services(ctx).adapter(platform).list_stores(region)
    ctx.release_platform()
    ctx.progress("listed", stores=len(listings))
    ctx.check_lease()
    stores = [{"id": s.directory_id, "name": s.name, "region": s.region} for s in listings]
    with ctx.transaction() as cur:
        rows = cur.execute(
            query("upsert_listed_stores"), {**ctx.lease_params(), "stores": Jsonb(stores)}
        ).fetchall()
        result = {
            "platform": platform,
            "region": region,
            "listed": len(rows),
            "new": sum(1 for r in rows if r["created"]),
        }
        ctx.complete(cur, result)
    return result


def entry_point_discovery(task: Task, ctx: TaskContext) -> JSON:
    """Resolve the store's platform id and menu URL, then queue its first crawl."""
    store = _store(ctx, task)
    directory_id = store["directory_id"]
    if not directory_id:
        raise PermanentTaskError(
            f"store {store['id']} has no directory id: store_discovery has not listed it "
            "(a store added by hand needs a store_crawl_state row with its directory_id)"
        )
    try:
        entry = _services(ctx).adapter(store["menu_type"]).resolve_entry_point(directory_id)
    except GoneError as exc:
        raise _gone(ctx, store, exc) from exc
    ctx.release_platform()
    ctx.check_lease()
    with ctx.transaction() as cur:
        try:
            cur.execute(
                query("save_entry_point"),
                {
                    **ctx.lease_params(),
                    "platform_id": entry.platform_id,
                    "menu_url": entry.menu_url,
                },
            )
        except psycopg.errors.InvalidParameterValue as exc:
            # A menu URL off the platform's hosts (shown redacted): asking again gives the same.
            raise PermanentTaskError(exc.diag.message_primary or str(exc)) from None
        row = cur.execute(
            query("enqueue_task_once"),
            {
                "role": "product_discovery",
                "dispensary_id": store["id"],
                "platform": store["menu_type"],
                "priority": 0,
                "scheduled_for": None,
                "payload": None,
            },
        ).fetchone()
        result = {
            "platform_id": entry.platform_id,
            "menu_url": entry.menu_url,
            "queued_discovery": row is not None and row["id"] is not None,
        }
        ctx.complete(cur, result)
    return result


def crawl_menu(task: Task, ctx: TaskContext) -> JSON:
    """product_discovery and product_resync: fetch, validate, and store what changed."""
    store = _store(ctx, task)
    if not store["crawl_enabled"]:
        # Disabled (by hand, or gone) after this task was queued: nothing to crawl.
        return {"skipped": "crawl disabled"}
    if not store["platform_dispensary_id"]:
        raise PermanentTaskError(
            f"store {store['id']} has no platform id yet: entry_point_discovery must resolve it first"
        )
    entry = EntryPoint(store["platform_dispensary_id"], store["menu_url"])
    try:
        raw = _services(ctx).adapter(store["menu_type"]).fetch_menu(entry)
    except GoneError as exc:
        raise _gone(ctx, store, exc) from exc
    ctx.release_platform()  # done with the platform: the slot serves another store while we store
    products = normalise_menu(raw)
    text, digest = encode_menu(products)
    ctx.progress("fetched", products=len(products))
    ctx.check_lease()
    with ctx.transaction() as cur:
        row = cur.execute(
            query("store_menu"),
            {**ctx.lease_params(), "menu_hash": digest, "products": Jsonb(products, dumps=lambda _: text)},
        ).fetchone()
        assert row is not None
        result = {
            "seen": row["seen"],
            "new": row["new"],
            "changed": row["changed"],
            "gone": row["gone"],
            "unchanged": row["unchanged"],
            "menu_hash": digest[:16],
        }
        ctx.complete(cur, result)
    return result


def analytics_refresh(task: Task, ctx: TaskContext) -> JSON:
    """Recompute store_analytics in one transaction; readers never wait."""
    with ctx.transaction() as cur:
        refreshed = cur.execute(query("refresh_store_analytics")).fetchone()
        summary = cur.execute(query("analytics_summary")).fetchone()
        assert refreshed is not None and summary is not None
        result = {**refreshed, **{k: int(v) for k, v in summary.items()}}
        ctx.complete(cur, result)
    return result


HANDLERS = {
    "store_discovery": store_discovery,
    "entry_point_discovery": entry_point_discovery,
    "product_discovery": crawl_menu,
    "product_resync": crawl_menu,
    "analytics_refresh": analytics_refresh,
}

# Roles whose handlers make HTTP requests: their drain runs need platform settings and threads.
HTTP_ROLES = frozenset({"store_discovery", "entry_point_discovery", "product_discovery", "product_resync"})


def enqueue_store_discovery(queue: TaskQueue, settings: dict[str, PlatformSettings]) -> int:
    """One store_discovery task per platform and region (none where one is still queued);
    returns how many were created."""
    created = 0
    for platform, s in sorted(settings.items()):
        regions: list[str | None] = [*s.regions] or [None]
        for region in regions:
            payload = {"platform": platform} | ({"region": region} if region else {})
            created += queue.enqueue_once("store_discovery", platform=platform, payload=payload) is not None
    return created
