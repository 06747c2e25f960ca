"""The fleet at a glance: store_freshness and its check, and the stale-menu alert, against stores
set up with known crawl times (fresh, stale, never crawled, gone or disabled) on two platforms."""

from datetime import UTC, datetime
from typing import Any

import dagster as dg
import psycopg
import pytest
from pydantic import ValidationError

from tq_pipelines.defs.freshness import (
    STALE_SHARE_CHECK,
    stale_store_problems,
    store_freshness,
    store_freshness_by_platform,
    store_freshness_job,
    store_freshness_schedule,
)
from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.rollup import task_completion_log, task_completion_log_job
from tq_pipelines.defs.schedules import (
    task_completion_log_current_hour_schedule,
    task_completion_log_schedule,
)
from tq_pipelines.queue.api import TaskQueue


def add_store(
    conn: psycopg.Connection,
    platform: str | None,
    *,
    crawled_hours_ago: float | None = None,
    listed_hours_ago: float | None = None,
    resolved_hours_ago: float | None = None,
    enabled: bool = True,
    gone: bool = False,
    crawl_state: bool = True,
) -> int:
    """A store with its crawl state as the handlers would leave it, times relative to the
    database's now."""
    [store] = conn.execute(
        "INSERT INTO dispensaries (name, menu_type, platform_dispensary_id, crawl_enabled) "
        "VALUES ('store', %s, 'pid', %s) RETURNING id",
        (platform, enabled and not gone),
    ).fetchone()  # type: ignore[misc]
    if crawl_state:
        conn.execute(
            """
            INSERT INTO store_crawl_state (
              dispensary_id, platform, directory_id, first_listed_at, resolved_at, last_crawl_at, gone_at)
            VALUES (
              %(id)s, %(platform)s, %(id)s::TEXT,
              now() - %(listed)s * INTERVAL '1 hour',
              now() - %(resolved)s * INTERVAL '1 hour',
              now() - %(crawled)s * INTERVAL '1 hour',
              CASE WHEN %(gone)s THEN now() END)
            """,
            {
                "id": store,
                "platform": platform,
                "listed": listed_hours_ago,
                "resolved": resolved_hours_ago,
                "crawled": crawled_hours_ago,
                "gone": gone,
            },
        )
    return int(store)


@pytest.fixture
def fleet(conn: psycopg.Connection) -> dict[str, Any]:
    """dutchie: 12 counted stores, 3 stale (25 %), 3 never crawled; jane: 5 counted, 1 stale (20 %).
    Returns when the oldest dutchie crawl happened."""
    for hours in (0.5, 1, 2, 5, 10, 20, 25):  # fresh
        add_store(conn, "dutchie", crawled_hours_ago=hours, listed_hours_ago=400, resolved_hours_ago=400)
    add_store(conn, "dutchie", crawled_hours_ago=30, listed_hours_ago=400)  # stale
    oldest = add_store(conn, "dutchie", crawled_hours_ago=50, listed_hours_ago=400)  # stale, the oldest
    add_store(conn, "dutchie", listed_hours_ago=40, resolved_hours_ago=39)  # never crawled, stale
    add_store(conn, "dutchie", listed_hours_ago=2)  # never crawled, new: within the SLA
    add_store(conn, "dutchie", crawl_state=False)  # added by hand, never crawled: no time to count from
    # Not counted however old their last crawl: gone, disabled by hand, no platform.
    add_store(conn, "dutchie", crawled_hours_ago=300, gone=True)
    add_store(conn, "dutchie", crawled_hours_ago=300, enabled=False)
    add_store(conn, None, crawled_hours_ago=300)
    for hours in (1, 3, 8, 12):
        add_store(conn, "jane", crawled_hours_ago=hours)
    add_store(conn, "jane", crawled_hours_ago=27)
    [oldest_at] = conn.execute(
        "SELECT last_crawl_at FROM store_crawl_state WHERE dispensary_id = %s", (oldest,)
    ).fetchone()  # type: ignore[misc]
    return {"oldest_at": oldest_at.astimezone(UTC)}


def materialize(db_url: str, **config: Any) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [store_freshness],
        resources={"tq": QueueResource(database_url=db_url)},
        run_config={"ops": {"store_freshness": {"config": config}}},
    )


# -- the figures ---------------------------------------------------------------------------------


def test_figures_per_platform(queue: TaskQueue, fleet: dict[str, Any]):
    by_platform = {p.platform: p for p in store_freshness_by_platform(queue, 26)}
    assert set(by_platform) == {"dutchie", "jane"}
    dutchie, jane = by_platform["dutchie"], by_platform["jane"]
    assert (dutchie.enabled, dutchie.stale, dutchie.never_crawled, dutchie.stale_never_crawled) == (
        12,
        3,
        3,
        1,
    )
    assert dutchie.stale_share == 0.25
    assert dutchie.oldest_crawl_at == fleet["oldest_at"]
    assert dutchie.oldest_crawl_hours == pytest.approx(50, abs=0.1)
    assert (jane.enabled, jane.stale, jane.never_crawled) == (5, 1, 0)
    assert jane.stale_share == 0.2


def test_the_sla_decides_what_is_stale(queue: TaskQueue, fleet: dict[str, Any]):
    # 60 h: nothing on either platform is that old, the store listed 40 h ago included.
    assert {p.platform: p.stale for p in store_freshness_by_platform(queue, 60)} == {"dutchie": 0, "jane": 0}
    # 4 h: the six crawls older than that, and the never-crawled store listed 40 h ago.
    assert {p.platform: p.stale for p in store_freshness_by_platform(queue, 4)} == {"dutchie": 7, "jane": 3}


def test_a_crawl_makes_a_stale_store_fresh(conn: psycopg.Connection, queue: TaskQueue):
    store = add_store(conn, "dutchie", crawled_hours_ago=40)
    [before] = store_freshness_by_platform(queue, 26)
    assert before.stale == 1
    conn.execute("SELECT * FROM tq_store_menu(%s, 'a hash', '[]')", (store,))  # a menu stored: a success
    [after] = store_freshness_by_platform(queue, 26)
    assert (after.stale, after.enabled) == (0, 1)


def test_an_empty_fleet_has_no_platforms(queue: TaskQueue):
    assert store_freshness_by_platform(queue, 26) == []
    assert stale_store_problems(queue, 26, 0.0) == {}


# -- the asset, its metadata and its check --------------------------------------------------------


def test_asset_metadata_per_platform_and_totals(db_url: str, fleet: dict[str, Any]):
    result = materialize(db_url)
    assert result.success
    [materialization] = result.asset_materializations_for_node("store_freshness")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["sla_hours"] == 26
    assert (meta["stores_enabled"], meta["stores_stale"], meta["never_crawled"]) == (17, 4, 3)
    assert meta["stale_share"] == round(4 / 17, 4)
    assert (meta["dutchie_enabled"], meta["dutchie_stale"], meta["dutchie_never_crawled"]) == (12, 3, 3)
    assert meta["dutchie_stale_share"] == 0.25
    assert meta["dutchie_oldest_crawl_hours"] == pytest.approx(50, abs=0.1)
    assert (meta["jane_enabled"], meta["jane_stale"], meta["jane_stale_share"]) == (5, 1, 0.2)
    # Plotted: every per-platform entry is a number.
    for key, value in materialization.metadata.items():
        if key.startswith(("dutchie_", "jane_")):
            assert isinstance(value, dg.IntMetadataValue | dg.FloatMetadataValue), key
    table = meta["by_platform"]
    assert "| dutchie | 12 | 3 | 25.0% | 3 | " + f"{fleet['oldest_at']:%Y-%m-%d %H:%M}" in table
    assert "| jane | 5 | 1 | 20.0% | 0 | " in table


@pytest.mark.parametrize(
    ("threshold", "passed", "over"),
    [
        (0.05, False, "dutchie, jane"),
        (0.2, False, "dutchie"),  # jane's 20 % does not pass 20 %
        (0.24, False, "dutchie"),
        (0.25, True, "none"),  # nor dutchie's 25 % 25 %
    ],
)
def test_check_around_the_threshold(
    db_url: str, fleet: dict[str, Any], threshold: float, passed: bool, over: str
):
    result = materialize(db_url, stale_share_threshold=threshold)
    assert result.success  # the check fails, the measurement is still recorded
    [check] = result.get_asset_check_evaluations()
    assert check.check_name == STALE_SHARE_CHECK
    assert check.passed is passed
    assert check.severity == dg.AssetCheckSeverity.ERROR
    assert check.metadata["platforms_over"].value == over
    assert check.metadata["worst_share"].value == 0.25
    assert check.metadata["threshold"].value == threshold


def test_check_follows_the_configured_sla(db_url: str, fleet: dict[str, Any]):
    result = materialize(db_url, sla_hours=60, stale_share_threshold=0.0)
    [check] = result.get_asset_check_evaluations()
    assert check.passed
    [materialization] = result.asset_materializations_for_node("store_freshness")
    assert materialization.metadata["sla_hours"].value == 60
    assert materialization.metadata["stores_stale"].value == 0


@pytest.mark.parametrize(
    ("config", "field"),
    [({"sla_hours": 0}, "sla_hours"), ({"stale_share_threshold": 1.5}, "stale_share_threshold")],
)
def test_config_out_of_bounds_is_refused(
    db_url: str, conn: psycopg.Connection, config: dict[str, Any], field: str
):
    add_store(conn, "dutchie", crawled_hours_ago=1)
    with pytest.raises(ValidationError) as raised:
        materialize(db_url, **config)
    assert f"validation error for StoreFreshnessConfig\n{field}\n  Input should be" in str(raised.value)


# -- the alert ------------------------------------------------------------------------------------


def test_stale_store_problems_keys_per_platform_past_the_threshold(queue: TaskQueue, fleet: dict[str, Any]):
    assert set(stale_store_problems(queue, 26, 0.05)) == {"stale:dutchie", "stale:jane"}
    assert set(stale_store_problems(queue, 26, 0.22)) == {"stale:dutchie"}
    assert stale_store_problems(queue, 26, 0.25) == {}
    assert stale_store_problems(queue, 60, 0.0) == {}


def test_stale_store_alert_says_how_many_where_since_when_and_what_to_do(
    queue: TaskQueue, fleet: dict[str, Any]
):
    alert = stale_store_problems(queue, 26, 0.05)["stale:dutchie"]
    assert alert.title == "stale menus on dutchie: 3 of 12 stores"
    assert alert.severity == "error"
    assert "3 of 12 enabled stores on dutchie (25.0%, threshold 5.0%)" in alert.text
    assert "no successful crawl in the last 26 h" in alert.text
    assert (
        f"the oldest last successful crawl was at {fleet['oldest_at']:%Y-%m-%d %H:%M} UTC (50 h ago)"
        in alert.text
    )
    assert "never crawled: 1 of them" in alert.text
    assert "tq status" in alert.text and "TQ_PLATFORMS_FILE" in alert.text

    jane = stale_store_problems(queue, 26, 0.05)["stale:jane"]
    assert "1 of 5 enabled stores on jane (20.0%" in jane.text
    assert "(27 h ago)" in jane.text
    assert "never crawled" not in jane.text


def test_only_never_crawled_stale_stores_say_so(conn: psycopg.Connection, queue: TaskQueue):
    add_store(conn, "treez", listed_hours_ago=30)
    add_store(conn, "treez", crawled_hours_ago=1)
    alert = stale_store_problems(queue, 26, 0.05)["stale:treez"]
    assert "1 of 2 enabled stores on treez" in alert.text
    # The one crawl is fresh: no "oldest crawl" that would read as the stale store's.
    assert "oldest" not in alert.text
    assert "never crawled: 1 of them" in alert.text


@pytest.mark.parametrize(
    ("sla_hours", "threshold", "words"),
    [
        (0, 0.05, "sla_hours must be from 1 to 720 hours, got 0"),
        (721, 0.05, "sla_hours must be from 1 to 720 hours, got 721"),
        (26, -0.1, "threshold (a share of stores) must be from 0 to 1, got -0.1"),
        (26, 1.5, "threshold (a share of stores) must be from 0 to 1, got 1.5"),
    ],
)
def test_stale_store_problems_refuses_bad_arguments(
    queue: TaskQueue, sla_hours: float, threshold: float, words: str
):
    with pytest.raises(ValueError) as raised:
        stale_store_problems(queue, sla_hours, threshold)
    assert str(raised.value) == words


# -- the schedule, and the objects as the lead will register them ---------------------------------


def test_freshness_schedule_runs_every_five_minutes_by_default():
    assert store_freshness_schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    # Two minutes off the rollup's and the recovery's five-minute ticks.
    assert (store_freshness_schedule.cron_schedule, store_freshness_schedule.execution_timezone) == (
        "2-59/5 * * * *",
        "UTC",
    )
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 6, 1, 10, 2, tzinfo=UTC)) as ctx:
        data = store_freshness_schedule.evaluate_tick(ctx)
    assert len(data.run_requests or []) == 1


def test_the_new_objects_load_together():
    defs = dg.Definitions(
        assets=[store_freshness, task_completion_log],
        jobs=[store_freshness_job, task_completion_log_job],
        schedules=[
            store_freshness_schedule,
            task_completion_log_schedule,
            task_completion_log_current_hour_schedule,
        ],
        resources={
            "tq": QueueResource(database_url="postgresql://tq@127.0.0.1:1/tq"),
            "crawl": CrawlResource(),
        },
    )
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    assert repo.get_schedule_def("store_freshness_schedule").job_name == "store_freshness_job"
    check_keys = repo.assets_defs_by_key[dg.AssetKey("store_freshness")].check_keys
    assert check_keys == {dg.AssetCheckKey(dg.AssetKey("store_freshness"), STALE_SHARE_CHECK)}
