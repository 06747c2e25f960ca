"""task_completion_log backfills 24 hours per run (BackfillPolicy.multi_run): one run rolls up every
hour of its range, each hour materialised with its own figures. The daemon's own backfill is in
tests/acceptance/test_rollup_backfill.py."""

from datetime import UTC, datetime, timedelta

import dagster as dg
import psycopg

from tq_pipelines.defs.resources import CrawlResource, QueueResource
from tq_pipelines.defs.rollup import HOURS_PER_BACKFILL_RUN, task_completion_log

ROLE = "product_resync"
START = datetime(2026, 6, 1, tzinfo=UTC)
HOURS = [START + timedelta(hours=h) for h in range(48)]
KEYS = [h.strftime("%Y-%m-%d-%H:00") for h in HOURS]


def ranged_run(instance: dg.DagsterInstance, db_url: str, first: str, last: str) -> dg.ExecuteInProcessResult:
    """One run of a range, tagged as the backfill daemon tags the runs of a multi-run policy."""
    return dg.materialize(
        [task_completion_log],
        instance=instance,
        resources={"tq": QueueResource(database_url=db_url), "crawl": CrawlResource()},
        tags={"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last},
    )


def test_the_rollup_backfills_a_day_per_run():
    policy = task_completion_log.backfill_policy
    assert policy is not None and policy.max_partitions_per_run == HOURS_PER_BACKFILL_RUN == 24


def test_48_hours_in_two_runs_fill_every_hour_with_its_own_figures(db_url: str, conn: psycopg.Connection):
    # Hour h has h completed tasks (created and finished in it).
    conn.execute(
        """
        INSERT INTO worker_tasks (role, status, created_at, started_at, completed_at)
        SELECT %(role)s, 'completed', t, t, t + interval '1 second'
        FROM generate_series(0, 47) AS h
        CROSS JOIN LATERAL generate_series(1, h) AS k
        CROSS JOIN LATERAL (SELECT %(start)s::timestamptz + h * interval '1 hour' + k * interval '1 second')
          AS x (t)
        """,
        {"role": ROLE, "start": START},
    )
    with dg.instance_for_test() as instance:
        runs = [ranged_run(instance, db_url, KEYS[i], KEYS[i + 23]) for i in (0, 24)]
        assert all(r.success for r in runs)
        materialised = {}
        for run in runs:
            for m in run.asset_materializations_for_node("task_completion_log"):
                materialised[m.partition] = {k: v.value for k, v in m.metadata.items()}
        assert sorted(materialised) == KEYS
        assert instance.get_materialized_partitions(dg.AssetKey("task_completion_log")) == set(KEYS)
        for h, key in enumerate(KEYS):
            assert (materialised[key]["tasks_completed"], materialised[key][f"{ROLE}_completed"]) == (h, h), (
                key
            )
            assert materialised[key]["hour_closed"] is True
        # One check result per run, over its 24 hours.
        assert [c.metadata["hours"].value for r in runs for c in r.get_asset_check_evaluations()] == [24, 24]

    logged = dict(
        conn.execute(
            "SELECT date + make_interval(hours => hour), tasks_completed FROM task_completion_log "
            "WHERE role = %s ORDER BY 1",
            (ROLE,),
        ).fetchall()
    )
    assert [logged[h.replace(tzinfo=None)] for h in HOURS] == list(range(48))
