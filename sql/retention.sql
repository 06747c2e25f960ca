-- Retention (tq_pipelines/retention.py): the horizons as the database's times, and one batch of
-- deletes per statement, each its own short transaction that skips rows someone else holds. The
-- batches are functions, so that the worker role, which may not DELETE, can run the prune:
-- prune_tasks (it keeps the hourly rollup of what it deletes), prune_completion_log,
-- prune_workers and prune_product_history (migration 0009). Each refuses a horizon younger than
-- its safety floor in tq_retention (min_*_days), which only the admin changes.

-- name: retention_cutoffs
-- The task horizon is a whole UTC hour, so that each hour of the rollup is whole or frozen.
SELECT
  date_trunc('hour', now() AT TIME ZONE 'UTC' - make_interval(days => %(tasks_days)s)) AT TIME ZONE 'UTC'
    AS tasks_before,
  (now() AT TIME ZONE 'UTC')::DATE - %(completion_log_days)s::INTEGER AS completion_log_before,
  -- In UTC, as the prune functions check their floors: a daylight-saving change moves neither.
  (now() AT TIME ZONE 'UTC' - make_interval(days => %(workers_days)s)) AT TIME ZONE 'UTC' AS workers_before,
  (now() AT TIME ZONE 'UTC' - make_interval(days => %(product_history_days)s)) AT TIME ZONE 'UTC'
    AS product_history_before;

-- name: retention_floors
-- The safety floors in days (migration 0009): no prune function deletes younger rows.
SELECT min_tasks_days, min_completion_log_days, min_workers_days, min_product_history_days
FROM tq_retention;

-- name: retention_watermark
-- Before it the rollup's hours stay as they are; NULL: no task was ever pruned.
SELECT nullif(tasks_pruned_before, '-infinity') AS tasks_pruned_before FROM tq_retention;

-- name: prune_tasks_batch
SELECT deleted, hours_rolled_up FROM prune_tasks(%(before)s, %(limit)s);

-- name: count_prunable_tasks
-- What prune_tasks would delete: finished tasks, archived or not (v_tasks), one branch per index.
SELECT
  (SELECT count(*)
   FROM v_tasks t
   WHERE t.status IN ('completed', 'failed')
     AND t.completed_at < %(before)s
     AND t.created_at < %(before)s)
  + (SELECT count(*)
     FROM v_tasks t
     WHERE t.status = 'cancelled'
       AND t.completed_at < %(before)s
       AND t.created_at < %(before)s) AS n;

-- name: prune_completion_log_batch
SELECT prune_completion_log(%(before)s, %(limit)s) AS deleted;

-- name: count_prunable_completion_log
SELECT count(*) AS n FROM task_completion_log WHERE date < %(before)s;

-- name: prune_workers_batch
-- Workers silent since before the horizon (offline or not) that hold no claimed or running task.
SELECT prune_workers(%(before)s, %(limit)s) AS deleted;

-- name: count_prunable_workers
SELECT count(*) AS n
FROM worker_registry w
WHERE coalesce(w.last_heartbeat_at, w.started_at) < %(before)s
  AND NOT EXISTS (
    SELECT 1
    FROM worker_tasks t
    WHERE t.worker_id = w.worker_id
      AND t.status IN ('claimed', 'running')
  );

-- name: prune_product_history_batch
-- A page of the primary key after after_id: its rows past the horizon deleted, and whether it
-- reached rows an hour younger than the horizon (the end: ids follow observed_at).
SELECT deleted, last_id, reached_young FROM prune_product_history(%(after_id)s, %(before)s, %(limit)s);

-- name: count_prunable_product_history
SELECT count(*) AS n FROM product_history WHERE observed_at < %(before)s;
