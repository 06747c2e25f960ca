-- What the Dagster assets read: where the partitions start, how each resync day is getting on,
-- and the sizes of the tables in the asset graph (tq_pipelines/partitions.py, resync.py,
-- lineage.py). Reads only, of relations the worker role may read.

-- name: deployment_first_hour
-- The UTC hour of the oldest task or rollup row: before it there is nothing to roll up or
-- resync. NULL on a database that holds neither yet (a new deployment).
SELECT date_trunc('hour', least(
         (SELECT t.created_at
          FROM v_tasks t
          ORDER BY t.created_at
          LIMIT 1),
         (SELECT (l.date + make_interval(hours => l.hour)) AT TIME ZONE 'UTC'
          FROM task_completion_log l
          ORDER BY l.date, l.hour
          LIMIT 1)
       ), 'UTC') AS first_hour;

-- name: resync_day_progress
-- Per resync day asked for: its product_resync tasks by state. A day with none has no row.
SELECT
  t.resync_date AS day,
  count(*) AS tasks,
  count(*) FILTER (WHERE t.status = 'pending') AS pending,
  count(*) FILTER (WHERE t.status IN ('claimed', 'running')) AS running,
  count(*) FILTER (WHERE t.status = 'completed') AS completed,
  count(*) FILTER (WHERE t.status = 'failed') AS failed,
  count(*) FILTER (WHERE t.status = 'cancelled') AS cancelled
FROM v_tasks t
WHERE t.role = 'product_resync'
  AND t.resync_date = ANY (%(days)s::DATE[])
GROUP BY t.resync_date
ORDER BY t.resync_date;

-- name: resync_open_days
-- The resync days with product_resync tasks not finished. Two arms, so that each can read its
-- partial index of unfinished tasks rather than the whole history.
SELECT DISTINCT u.day
FROM (
  SELECT t.resync_date AS day
  FROM worker_tasks t
  WHERE t.status = 'pending'
    AND t.dispensary_id IS NOT NULL
    AND t.role = 'product_resync'
  UNION ALL
  SELECT t.resync_date
  FROM worker_tasks t
  WHERE t.status IN ('claimed', 'running')
    AND t.dispensary_id IS NOT NULL
    AND t.role = 'product_resync'
) u
WHERE u.day IS NOT NULL
ORDER BY u.day;

-- name: resync_unfinished
-- The product_resync tasks not finished, by whether they are today's work (of today or later, or
-- of no day: a demo crawl, one queued by hand) or a past day's (a backfill), and the database's
-- UTC day. A past day's tasks are due at once and the claim takes the oldest due task first: they
-- are created only while there is no current work for them to go ahead of.
SELECT
  (now() AT TIME ZONE 'UTC')::DATE AS today,
  count(*) FILTER (WHERE t.resync_date IS NULL OR t.resync_date >= (now() AT TIME ZONE 'UTC')::DATE)
    AS current,
  count(*) FILTER (WHERE t.resync_date < (now() AT TIME ZONE 'UTC')::DATE) AS past
FROM worker_tasks t
WHERE t.role = 'product_resync'
  AND t.status IN ('pending', 'claimed', 'running');

-- name: resync_day_state
-- One resync day for the catch-up: its tasks, and the stores a resync would give one (as
-- generate_resync_tasks chooses them, whatever the platform).
SELECT
  (SELECT count(*)
   FROM v_tasks t
   WHERE t.role = 'product_resync'
     AND t.resync_date = %(day)s) AS tasks,
  (SELECT count(*)
   FROM dispensaries d
   WHERE d.crawl_enabled
     AND d.menu_type IS NOT NULL
     AND d.platform_dispensary_id IS NOT NULL) AS stores;

-- name: table_row_counts
-- The rows of the tables the asset graph draws. Counted where that is cheap (worker_tasks holds
-- the queue and the last minute's finished tasks: 0022); products, product_history and
-- worker_task_history (millions of rows, not the worker's to read) from the statistics'
-- live-row count, which trails the writes by a few seconds.
SELECT 'dispensaries' AS relation, (SELECT count(*) FROM dispensaries) AS row_count, false AS estimated
UNION ALL
SELECT 'store_analytics', (SELECT count(*) FROM store_analytics), false
UNION ALL
SELECT 'worker_tasks', (SELECT count(*) FROM worker_tasks), false
UNION ALL
SELECT 'worker_task_history',
       (SELECT s.n_live_tup FROM pg_stat_user_tables s WHERE s.relid = 'worker_task_history'::REGCLASS),
       true
UNION ALL
SELECT 'products', (SELECT s.n_live_tup FROM pg_stat_user_tables s WHERE s.relid = 'products'::REGCLASS), true
UNION ALL
SELECT 'product_history',
       (SELECT s.n_live_tup FROM pg_stat_user_tables s WHERE s.relid = 'product_history'::REGCLASS),
       true;
