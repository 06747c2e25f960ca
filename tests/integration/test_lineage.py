"""The asset graph tells the story: stores, the daily resync, the queue, menus and their history,
analytics, the hourly rollup, store freshness and the platforms' limits in one lineage, each with
its group, owners, kind, description and code reference; the tables Dagster does not write are
observable (their latest observation shown, no materialisation offered) with row counts."""

from pathlib import Path

import dagster as dg
import psycopg
import pytest

from tests.helpers import add_stores, add_tasks
from tq_pipelines.definitions import defs
from tq_pipelines.defs.lineage import table_rows_sensor
from tq_pipelines.defs.resources import QueueResource

NAMED = {
    "dispensaries",
    "worker_tasks",
    "worker_task_history",
    "products",
    "product_history",
    "store_analytics",
    "task_completion_log",
    "store_freshness",
    "platform_limits",
    "product_resync",
}
OBSERVED = {
    "dispensaries",
    "worker_tasks",
    "worker_task_history",
    "products",
    "product_history",
    "store_analytics",
    "platform_limits",
}
MATERIALISED = {"product_resync", "task_completion_log", "store_freshness"}
# A few edges that carry the story, upstream -> downstream.
EDGES = {
    ("platform_limits", "dispensaries"),
    ("dispensaries", "product_resync"),
    ("product_resync", "worker_tasks"),
    ("worker_tasks", "products"),
    ("products", "product_history"),
    ("product_history", "store_analytics"),
    ("worker_tasks", "task_completion_log"),
    ("worker_tasks", "worker_task_history"),
    ("worker_task_history", "task_completion_log"),
    ("dispensaries", "store_freshness"),
}


@pytest.fixture(scope="module")
def specs() -> dict[str, dg.AssetSpec]:
    return {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()}


def test_the_asset_graph_is_one_connected_lineage(specs: dict[str, dg.AssetSpec]):
    assert set(specs) == NAMED
    edges = {(dep.asset_key.to_user_string(), key) for key, spec in specs.items() for dep in spec.deps}
    assert edges >= EDGES
    assert {a for a, _ in edges} | {b for _, b in edges} <= NAMED  # no placeholder assets
    # Connected, ignoring direction: one component holding every asset.
    reached, frontier = set(), ["platform_limits"]
    while frontier:
        key = frontier.pop()
        if key not in reached:
            reached.add(key)
            frontier += [b for a, b in edges if a == key] + [a for a, b in edges if b == key]
    assert reached == NAMED


def test_every_asset_has_group_owners_kind_description_and_code(specs: dict[str, dg.AssetSpec]):
    for key, spec in specs.items():
        assert spec.group_name in {"fleet", "queue", "menus"}, key
        assert spec.owners and all(o.startswith("team:") for o in spec.owners), key
        assert "postgres" in spec.kinds, key
        assert spec.description and len(spec.description) > 40, key
        references = spec.metadata["dagster/code_references"].code_references
        kinds = set()
        for reference in references:
            path = Path(reference.file_path)
            assert path.is_file(), (key, path)
            line = path.read_text().splitlines()[reference.line_number - 1]
            if path.suffix == ".sql":  # the migration that creates the table, at its CREATE TABLE
                assert "CREATE TABLE" in line, (key, line)
            kinds.add(path.suffix)
        # A table links to its migration (and to the code observing it); the rest to its code.
        assert kinds >= ({".sql"} if key in OBSERVED else {".py"}), key


def test_tables_are_observable_and_the_computed_assets_materialisable():
    repo = defs.get_repository_def()
    for key, assets_def in repo.assets_defs_by_key.items():
        name = key.to_user_string()
        if name in OBSERVED:
            assert assets_def.is_observable and not assets_def.is_materializable, name
        else:
            assert name in MATERIALISED and assets_def.is_materializable, name


def test_the_materialised_assets_have_freshness_policies(specs: dict[str, dg.AssetSpec]):
    for key in MATERIALISED:
        assert isinstance(specs[key].freshness_policy, dg.FreshnessPolicy), key


def tick(instance: dg.DagsterInstance, db_url: str, cursor: str | None = None) -> dg.SensorResult:
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"tq": QueueResource(database_url=db_url)}
    ) as ctx:
        result = table_rows_sensor(ctx)
    assert isinstance(result, dg.SensorResult)
    return result


def rows(result: dg.SensorResult) -> dict[str, int | None]:
    found = {}
    for event in result.asset_events:
        assert isinstance(event, dg.AssetObservation)
        count = event.metadata.get("dagster/row_count")
        found[event.asset_key.to_user_string()] = count.value if count is not None else None
    return found


def test_table_rows_sensor_reports_row_counts_as_they_change(db_url: str, conn: psycopg.Connection):
    stores = add_stores(conn, 4)
    add_tasks(conn, "product_resync", stores, 2)
    with dg.instance_for_test() as instance:
        first = tick(instance, db_url)
        counts = rows(first)
        assert set(counts) == {
            "dispensaries",
            "worker_tasks",
            "worker_task_history",
            "products",
            "product_history",
            "store_analytics",
        }
        assert (counts["dispensaries"], counts["worker_tasks"], counts["store_analytics"]) == (4, 8, 0)
        estimated = {
            e.asset_key.to_user_string(): e.metadata["row_count_estimated"].value for e in first.asset_events
        }
        assert estimated == {
            "dispensaries": False,
            "worker_tasks": False,
            "worker_task_history": True,
            "store_analytics": False,
            "products": True,
            "product_history": True,
        }

        # Nothing changed: no observation until the half-hourly one.
        assert rows(tick(instance, db_url, first.cursor)) == {}
        add_stores(conn, 1)
        assert rows(tick(instance, db_url, first.cursor)) == {"dispensaries": 5}
