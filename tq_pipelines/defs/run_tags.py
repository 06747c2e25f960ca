"""Tags that place a run in the instance's run queue (dagster.yaml)."""

# Run slots are shared through the instance's run queue: drain runs are capped by their tq/kind
# tag below max_concurrent_runs, so the maintenance jobs (recovery, rollup, freshness, resync,
# prune) always find a slot, and these tags put them ahead of queued drain runs. No op claims a
# concurrency pool: a run killed -9 never gives a pool slot back.
MAINTENANCE_TAGS = {"dagster/priority": "10"}
