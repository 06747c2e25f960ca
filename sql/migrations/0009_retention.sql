-- Retention: what the queue deletes, and what it keeps.
--
-- - Finished tasks (completed, failed, cancelled) past their horizon go in small batches, each
--   its own short transaction that skips rows someone else holds (prune_tasks): no long lock,
--   no long transaction, and the statement triggers of a delete of finished rows touch neither
--   worker_task_stores, worker_task_heads nor tq_platforms (they act on pending and active rows
--   only).
-- - The hourly rollup outlives the raw rows. tq_retention.tasks_pruned_before records up to when
--   tasks were pruned; refresh_task_completion_log leaves the hours before it as they are, so a
--   backfill never rewrites a pruned hour with the smaller numbers of what remains. Before a
--   batch goes, the rollup of every hour it touches is made if missing (or if it was made before
--   its hour ended), so nothing is lost even if the hourly asset never ran.
-- - worker_registry, product_history and task_completion_log are pruned by the prune's other
--   batches (sql/retention.sql), in the same way.
-- - Every prune function refuses a horizon younger than its safety floor (tq_retention's
--   min_*_days: 7 days of tasks, 90 of the rollup, 1 of silent workers, 30 of product history),
--   whoever calls it. The worker role may call them (0010) but not change the floors; the admin
--   does: UPDATE tq_retention SET min_tasks_days = 3;

CREATE TABLE IF NOT EXISTS tq_retention (
  id BOOLEAN PRIMARY KEY DEFAULT true CHECK (id),
  tasks_pruned_before TIMESTAMPTZ NOT NULL DEFAULT '-infinity'
    -- A whole UTC hour: every hour is then either all there or frozen.
    CHECK (tasks_pruned_before = '-infinity'
           OR date_trunc('hour', tasks_pruned_before AT TIME ZONE 'UTC') = tasks_pruned_before AT TIME ZONE 'UTC'),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  -- Safety floors, in days: no prune function deletes rows younger than these, whoever calls it.
  -- The prune functions are SECURITY DEFINER and the worker role may call them; the floors are
  -- what keeps a worker (or a wrong setting) from erasing the history. Only the admin, who owns
  -- this table, changes them: UPDATE tq_retention SET min_tasks_days = 3;
  -- Finished tasks (prune_tasks).
  min_tasks_days INTEGER NOT NULL DEFAULT 7 CHECK (min_tasks_days BETWEEN 1 AND 36500),
  -- The hourly rollup (prune_completion_log): it outlives the tasks it counts.
  min_completion_log_days INTEGER NOT NULL DEFAULT 90
    CHECK (min_completion_log_days BETWEEN 1 AND 36500),
  -- Registry rows of silent workers (prune_workers); a busy worker's row is never pruned.
  min_workers_days INTEGER NOT NULL DEFAULT 1 CHECK (min_workers_days BETWEEN 1 AND 36500),
  -- Price and stock changes (prune_product_history).
  min_product_history_days INTEGER NOT NULL DEFAULT 30
    CHECK (min_product_history_days BETWEEN 1 AND 36500),
  CONSTRAINT tq_retention_rollup_outlives_tasks CHECK (min_completion_log_days >= min_tasks_days)
);
-- updated_at -infinity: never pruned (and the seed row the same in every database).
INSERT INTO tq_retention (id, updated_at) VALUES (true, '-infinity') ON CONFLICT (id) DO NOTHING;

COMMENT ON TABLE tq_retention IS
  'One row: finished tasks were pruned up to tasks_pruned_before; task_completion_log keeps the hours before it as they are';
COMMENT ON COLUMN tq_retention.min_tasks_days IS
  'prune_tasks refuses a horizon younger than this many days; the admin lowers or raises it';
COMMENT ON COLUMN tq_retention.min_completion_log_days IS
  'prune_completion_log refuses a horizon younger than this many days (at least min_tasks_days)';
COMMENT ON COLUMN tq_retention.min_workers_days IS
  'prune_workers refuses a horizon younger than this many days';
COMMENT ON COLUMN tq_retention.min_product_history_days IS
  'prune_product_history refuses a horizon younger than this many days';

-- Cancelled tasks are outside idx_worker_tasks_finished; without this each prune batch of them
-- would scan the table. Partial: it costs only the rows it holds. Building it reads the whole
-- table and holds off writes meanwhile (0.2 s for a million rows); on a large table, create it
-- by hand first with CREATE INDEX CONCURRENTLY and the same name, and this does nothing.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_cancelled
  ON worker_tasks (completed_at)
  WHERE status = 'cancelled';

-- Recomputes one UTC hour's per-role rows from worker_tasks (every known role gets a row, zeros
-- included, so that plots have no gaps) and returns the number of rows written. With
-- p_keep_pruned it writes nothing for an hour before tq_retention.tasks_pruned_before; the test
-- is part of the one statement that reads worker_tasks, so a prune that commits meanwhile is
-- seen whole (its mark and its deletes) or not at all.
CREATE OR REPLACE FUNCTION tq_rollup_hour(p_date DATE, p_hour INTEGER, p_keep_pruned BOOLEAN)
RETURNS INTEGER AS $$
DECLARE
  v_start TIMESTAMPTZ;
  v_rows INTEGER;
BEGIN
  v_start := (p_date::TIMESTAMP AT TIME ZONE 'UTC') + make_interval(hours => p_hour);

  INSERT INTO task_completion_log AS l (
    role, date, hour, tasks_created, tasks_completed, tasks_failed,
    avg_duration_sec, min_duration_sec, max_duration_sec, updated_at
  )
  SELECT
    r.role, p_date, p_hour,
    coalesce(c.created, 0), coalesce(f.completed, 0), coalesce(f.failed, 0),
    f.avg_sec, f.min_sec, f.max_sec, now()
  FROM worker_task_roles r
  LEFT JOIN (
    SELECT role, count(*) AS created
    FROM worker_tasks
    WHERE created_at >= v_start AND created_at < v_start + INTERVAL '1 hour'
    GROUP BY role
  ) c ON c.role = r.role
  LEFT JOIN (
    SELECT
      role,
      count(*) FILTER (WHERE status = 'completed') AS completed,
      count(*) FILTER (WHERE status = 'failed') AS failed,
      round(avg(extract(EPOCH FROM completed_at - started_at)) FILTER (WHERE status = 'completed'), 2) AS avg_sec,
      round(min(extract(EPOCH FROM completed_at - started_at)) FILTER (WHERE status = 'completed'), 2) AS min_sec,
      round(max(extract(EPOCH FROM completed_at - started_at)) FILTER (WHERE status = 'completed'), 2) AS max_sec
    FROM worker_tasks
    WHERE status IN ('completed', 'failed')
      AND completed_at >= v_start AND completed_at < v_start + INTERVAL '1 hour'
    GROUP BY role
  ) f ON f.role = r.role
  WHERE NOT p_keep_pruned
     OR v_start >= (SELECT k.tasks_pruned_before FROM tq_retention k)
  ON CONFLICT (role, date, hour) DO UPDATE
  SET tasks_created = excluded.tasks_created,
      tasks_completed = excluded.tasks_completed,
      tasks_failed = excluded.tasks_failed,
      avg_duration_sec = excluded.avg_duration_sec,
      min_duration_sec = excluded.min_duration_sec,
      max_duration_sec = excluded.max_duration_sec,
      updated_at = excluded.updated_at;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  RETURN v_rows;
END;
$$ LANGUAGE plpgsql;

-- As before for the hours whose tasks are all there; 0 rows written, the numbers kept, for an
-- hour whose finished tasks were pruned.
CREATE OR REPLACE FUNCTION refresh_task_completion_log(p_date DATE, p_hour INTEGER)
RETURNS INTEGER AS $$
BEGIN
  IF p_date IS NULL THEN
    RAISE EXCEPTION 'refresh_task_completion_log: the date must not be NULL'
      USING ERRCODE = '22023',
            HINT = 'pass the UTC day of the hour to recompute, e.g. 2026-06-01';
  END IF;
  IF p_hour IS NULL OR p_hour NOT BETWEEN 0 AND 23 THEN
    RAISE EXCEPTION 'refresh_task_completion_log: the hour must be from 0 to 23, got %',
      coalesce(p_hour::TEXT, 'NULL')
      USING ERRCODE = '22023',
            HINT = 'hours are UTC hours of the day: 0 is 00:00-01:00 UTC, 23 is 23:00-24:00 UTC';
  END IF;
  RETURN tq_rollup_hour(p_date, p_hour, true);
END;
$$ LANGUAGE plpgsql;

-- Deletes one batch of at most p_limit finished tasks (completed, failed or cancelled) that
-- finished, and were created, before p_before (a whole UTC hour, at least
-- tq_retention.min_tasks_days ago), in one transaction, skipping rows another transaction holds.
-- First it moves the watermark to p_before and makes the rollup of each hour the batch touches
-- if it is missing or was made before its hour ended. Returns the tasks deleted (0: nothing left
-- to prune but held rows) and the hours rolled up.
CREATE OR REPLACE FUNCTION prune_tasks(p_before TIMESTAMPTZ, p_limit INTEGER)
RETURNS TABLE (deleted INTEGER, hours_rolled_up INTEGER) AS $$
DECLARE
  v_ids INTEGER[];
  v_hour TIMESTAMP;
BEGIN
  IF p_before IS NULL OR date_trunc('hour', p_before AT TIME ZONE 'UTC') <> p_before AT TIME ZONE 'UTC' THEN
    RAISE EXCEPTION 'prune_tasks: before must be a whole UTC hour, got %', coalesce(p_before::TEXT, 'NULL')
      USING ERRCODE = '22023',
            HINT = 'e.g. date_trunc(''hour'', now() - interval ''30 days''), in UTC';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 100000 THEN
    RAISE EXCEPTION 'prune_tasks: the batch size must be from 1 to 100000, got %',
      coalesce(p_limit::TEXT, 'NULL')
      USING ERRCODE = '22023',
            HINT = 'a few thousand rows keep each transaction short';
  END IF;
  PERFORM tq_check_prune('prune_tasks', p_before, p_limit, 'min_tasks_days');

  -- One batch at a time: a batch that rolls up an hour must not see another's deletes of it
  -- half-way. The watermark moves in the same transaction as the first delete under it, and
  -- never back.
  PERFORM 1 FROM tq_retention FOR UPDATE;
  UPDATE tq_retention
  SET tasks_pruned_before = p_before,
      updated_at = now()
  WHERE tasks_pruned_before < p_before;

  -- Oldest first, through the two partial indexes on completed_at; locked in id order, rows
  -- held elsewhere skipped, and each row's status and times checked again once locked.
  SELECT array_agg(t.id ORDER BY t.id) INTO v_ids
  FROM (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id IN (
        SELECT c.id
        FROM (
          (SELECT f.id, f.completed_at
           FROM worker_tasks f
           WHERE f.status IN ('completed', 'failed')
             AND f.completed_at < p_before
             AND f.created_at < p_before
           ORDER BY f.completed_at
           LIMIT p_limit)
          UNION ALL
          (SELECT x.id, x.completed_at
           FROM worker_tasks x
           WHERE x.status = 'cancelled'
             AND x.completed_at < p_before
             AND x.created_at < p_before
           ORDER BY x.completed_at
           LIMIT p_limit)
        ) c
        ORDER BY c.completed_at, c.id
        LIMIT p_limit
      )
      AND t.status IN ('completed', 'failed', 'cancelled')
      AND t.completed_at < p_before
      AND t.created_at < p_before
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
  ) t;

  deleted := 0;
  hours_rolled_up := 0;
  IF v_ids IS NULL THEN
    RETURN NEXT;
    RETURN;
  END IF;

  -- Hours whose rollup a delete would change: made now unless a row made after the hour ended
  -- is there. Once a batch made it, it is such a row, so each hour is rolled up once.
  FOR v_hour IN
    SELECT DISTINCT h.start
    FROM worker_tasks t
    CROSS JOIN LATERAL (
      VALUES (date_trunc('hour', t.created_at AT TIME ZONE 'UTC')),
             (date_trunc('hour', t.completed_at AT TIME ZONE 'UTC'))
    ) h (start)
    WHERE t.id = ANY (v_ids)
      AND NOT EXISTS (
        SELECT 1
        FROM task_completion_log l
        WHERE l.role = t.role
          AND l.date = h.start::DATE
          AND l.hour = extract(HOUR FROM h.start)::INTEGER
          AND (l.updated_at AT TIME ZONE 'UTC') >= h.start + INTERVAL '1 hour'
      )
    ORDER BY h.start
  LOOP
    PERFORM tq_rollup_hour(v_hour::DATE, extract(HOUR FROM v_hour)::INTEGER, false);
    hours_rolled_up := hours_rolled_up + 1;
  END LOOP;

  DELETE FROM worker_tasks t WHERE t.id = ANY (v_ids);
  GET DIAGNOSTICS deleted = ROW_COUNT;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The prune job's other batches (sql/retention.sql), as functions like prune_tasks: a batch
-- deletes and locks rows (FOR UPDATE SKIP LOCKED), and the worker role that runs the prune job
-- holds no DELETE or UPDATE rights (0010). None deletes rows younger than its floor in
-- tq_retention (min_*_days), which only the admin changes, so a worker cannot use them to empty
-- a table, nor a mistyped setting erase the history.
------------------------------------------------------------------------------------------------

-- p_before: the horizon, rows before it go; p_limit: rows per batch, as the prune's batch_size;
-- p_floor: the tq_retention column of the caller's floor; p_shown: p_before as the caller gave
-- it, for the message. Refuses what a prune never asks.
CREATE OR REPLACE FUNCTION tq_check_prune(
  p_function TEXT,
  p_before TIMESTAMPTZ,
  p_limit INTEGER,
  p_floor TEXT,
  p_shown TEXT DEFAULT NULL
) RETURNS VOID AS $$
DECLARE
  v_days INTEGER;
BEGIN
  SELECT CASE p_floor
           WHEN 'min_tasks_days' THEN k.min_tasks_days
           WHEN 'min_completion_log_days' THEN k.min_completion_log_days
           WHEN 'min_workers_days' THEN k.min_workers_days
           WHEN 'min_product_history_days' THEN k.min_product_history_days
         END
  INTO v_days
  FROM tq_retention k;
  IF v_days IS NULL THEN
    -- No row (deleted by hand) or a floor this function does not know: refuse every prune.
    RAISE EXCEPTION '%: no floor % in tq_retention', p_function, p_floor
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'tq_retention holds one row; the admin restores it: '
                   'INSERT INTO tq_retention DEFAULT VALUES;';
  END IF;
  -- In UTC, as the prune computes its horizons: a daylight-saving change does not move the floor.
  IF p_before IS NULL
     OR p_before AT TIME ZONE 'UTC' > (now() AT TIME ZONE 'UTC') - make_interval(days => v_days) THEN
    RAISE EXCEPTION '%: before must be at least % days ago (tq_retention.%), got %',
      p_function, v_days, p_floor, coalesce(p_shown, p_before::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value',
            HINT = format('Rows younger than the floor stay, whoever asks. To prune closer, the admin (the '
                          'owner of tq_retention) lowers it: UPDATE tq_retention SET %s = <days>;', p_floor);
  END IF;
  IF p_limit IS NULL OR p_limit < 1 OR p_limit > 100000 THEN
    RAISE EXCEPTION '%: limit must be from 1 to 100000 rows, got %', p_function, coalesce(p_limit::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the rows per batch (the prune''s batch_size).';
  END IF;
END;
$$ LANGUAGE plpgsql STABLE;

-- One batch of the rollup's rows of days before p_before; returns how many went. The rollup is
-- small (a row per role and hour): no index on date is worth its upkeep. Its floor is what keeps
-- the rollup of pruned hours, which cannot be made again: min_completion_log_days is at least
-- min_tasks_days, and the rollup of an hour whose tasks are still there can be recomputed.
CREATE OR REPLACE FUNCTION prune_completion_log(p_before DATE, p_limit INTEGER)
RETURNS INTEGER AS $$
DECLARE
  v_deleted INTEGER;
BEGIN
  PERFORM tq_check_prune('prune_completion_log', p_before::TIMESTAMP AT TIME ZONE 'UTC', p_limit,
    'min_completion_log_days', coalesce(p_before::TEXT, 'NULL'));
  WITH doomed AS (
    SELECT l.id
    FROM task_completion_log l
    WHERE l.date < p_before
    ORDER BY l.id
    LIMIT p_limit
    FOR UPDATE SKIP LOCKED
  ),
  gone AS (
    DELETE FROM task_completion_log l
    USING doomed d
    WHERE l.id = d.id
    RETURNING l.id
  )
  SELECT count(*)::INTEGER INTO v_deleted FROM gone;
  RETURN v_deleted;
END;
$$ LANGUAGE plpgsql;

-- One batch of workers silent since before p_before (offline or not) that hold no claimed or
-- running task; returns how many went. Nothing references worker_registry: finished tasks keep
-- their worker_id as text.
CREATE OR REPLACE FUNCTION prune_workers(p_before TIMESTAMPTZ, p_limit INTEGER)
RETURNS INTEGER AS $$
DECLARE
  v_deleted INTEGER;
BEGIN
  PERFORM tq_check_prune('prune_workers', p_before, p_limit, 'min_workers_days');
  WITH busy AS (
    -- One branch per partial index over active tasks.
    SELECT t.worker_id
    FROM worker_tasks t
    WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NOT NULL
    UNION
    SELECT t.worker_id
    FROM worker_tasks t
    WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NULL
  ),
  doomed AS (
    SELECT w.id
    FROM worker_registry w
    WHERE coalesce(w.last_heartbeat_at, w.started_at) < p_before
      AND NOT EXISTS (SELECT 1 FROM busy b WHERE b.worker_id = w.worker_id)
    ORDER BY w.id
    LIMIT p_limit
    FOR UPDATE SKIP LOCKED
  ),
  gone AS (
    DELETE FROM worker_registry w
    USING doomed d
    WHERE w.id = d.id
    RETURNING w.id
  )
  SELECT count(*)::INTEGER INTO v_deleted FROM gone;
  RETURN v_deleted;
END;
$$ LANGUAGE plpgsql;

-- One page of product_history. It has no index on observed_at (each would cost every menu change
-- a write), but ids follow observed_at (both are taken at insert): walk the primary key a page
-- at a time from after p_after_id, delete the page's rows past the horizon, and say when the
-- page reached rows an hour younger than it (the end: everything after is younger still).
CREATE OR REPLACE FUNCTION prune_product_history(p_after_id BIGINT, p_before TIMESTAMPTZ, p_limit INTEGER)
RETURNS TABLE (deleted INTEGER, last_id BIGINT, reached_young BOOLEAN) AS $$
BEGIN
  PERFORM tq_check_prune('prune_product_history', p_before, p_limit, 'min_product_history_days');
  RETURN QUERY
  WITH page AS (
    SELECT h.id, h.observed_at
    FROM product_history h
    WHERE h.id > coalesce(p_after_id, 0)
    ORDER BY h.id
    LIMIT p_limit
  ),
  doomed AS (
    SELECT h.id
    FROM product_history h
    WHERE h.id IN (SELECT p.id FROM page p)
      AND h.observed_at < p_before
    ORDER BY h.id
    FOR UPDATE SKIP LOCKED
  ),
  gone AS (
    DELETE FROM product_history h
    USING doomed d
    WHERE h.id = d.id
    RETURNING h.id
  )
  SELECT
    (SELECT count(*) FROM gone)::INTEGER,
    (SELECT max(p.id) FROM page p),
    coalesce((SELECT bool_or(p.observed_at >= p_before + INTERVAL '1 hour') FROM page p), false);
END;
$$ LANGUAGE plpgsql;
