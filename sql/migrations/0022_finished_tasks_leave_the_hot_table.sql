-- Finished tasks leave the hot table.
--
-- worker_tasks held every task it was ever given until retention deleted it, days later: a
-- queue of a few hundred live tasks in a table of millions of finished ones. Every scan of it
-- (an analyst's count, a report, the lineage sensor's row count) read the history: 252,197
-- finished tasks when the long-horizon bench's readers began (docs/BENCHMARKS.md, "Finished
-- tasks out of the hot table (0022)"). Now archive_tasks moves tasks finished before a
-- given time into worker_task_history, a batch per call, in one statement (a DELETE whose rows
-- the INSERT takes): a task is in exactly one of the two tables at any snapshot. The drain
-- sensor calls it every tick for tasks finished over a minute ago; prune_tasks archives what is
-- left before its horizon and then prunes the history. The completions themselves do not change:
-- a finished task stays in worker_tasks for that minute, so a read of it right after its
-- completion finds it there.
--
-- v_tasks is every task, both tables: what get_task, the rollup, the views and the resync
-- progress read. A finished task never changes again (no function revives one), so moving it
-- loses nothing a caller could still act on.
--
-- A resync day's tasks are made once per store (generate_resync_tasks): the unique index of
-- worker_tasks could no longer say so once the finished ones leave it. worker_task_resyncs keeps
-- the keys of the tasks made, for as long as the tasks are kept: prune_tasks deletes a key with
-- its task. A key is inserted before its task, ON CONFLICT DO NOTHING, so that two generators of
-- one day make each task once under any isolation level.

------------------------------------------------------------------------------------------------
-- The history table and the keys.
------------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS worker_task_history (
  id INTEGER PRIMARY KEY,
  role VARCHAR(50) NOT NULL,
  dispensary_id INTEGER,
  platform VARCHAR(50),
  status VARCHAR(20) NOT NULL CHECK (status IN ('completed', 'failed', 'cancelled')),
  priority INTEGER NOT NULL,
  scheduled_for TIMESTAMPTZ,
  worker_id VARCHAR(100),
  claimed_at TIMESTAMPTZ,
  started_at TIMESTAMPTZ,
  completed_at TIMESTAMPTZ NOT NULL,
  last_heartbeat_at TIMESTAMPTZ,
  result JSONB,
  error_message TEXT,
  retry_count INTEGER NOT NULL,
  max_retries INTEGER NOT NULL,
  created_at TIMESTAMPTZ NOT NULL,
  updated_at TIMESTAMPTZ NOT NULL,
  resync_date DATE,
  due_at TIMESTAMPTZ NOT NULL,
  payload JSONB NOT NULL,
  send_at TIMESTAMPTZ,
  lease_hash BYTEA
);
COMMENT ON TABLE worker_task_history IS
  'Finished tasks (completed, failed, cancelled), moved out of worker_tasks by archive_tasks; v_tasks reads both';
-- Retention and the rollup by completion time; v_task_history and the first hour by creation;
-- a store's tasks; a resync day's progress.
CREATE INDEX idx_worker_task_history_completed ON worker_task_history (completed_at);
CREATE INDEX idx_worker_task_history_created ON worker_task_history (created_at DESC, id DESC);
CREATE INDEX idx_worker_task_history_dispensary ON worker_task_history (dispensary_id)
  WHERE dispensary_id IS NOT NULL;
CREATE INDEX idx_worker_task_history_resync ON worker_task_history (role, resync_date)
  WHERE resync_date IS NOT NULL;
INSERT INTO tq_relations (relation_name) VALUES ('worker_task_history') ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS worker_task_resyncs (
  resync_date DATE NOT NULL,
  role VARCHAR(50) NOT NULL,
  dispensary_id INTEGER NOT NULL,
  PRIMARY KEY (resync_date, role, dispensary_id)
);
COMMENT ON TABLE worker_task_resyncs IS
  'One row per resync task made (generate_resync_tasks), kept as long as the task: a day''s task is made once per store';
INSERT INTO tq_relations (relation_name) VALUES ('worker_task_resyncs') ON CONFLICT DO NOTHING;

INSERT INTO worker_task_resyncs (resync_date, role, dispensary_id)
SELECT DISTINCT t.resync_date, t.role, t.dispensary_id
FROM worker_tasks t
WHERE t.resync_date IS NOT NULL AND t.dispensary_id IS NOT NULL
ON CONFLICT DO NOTHING;

-- The columns named, here and in every copy between the tables below, so that the two tables'
-- column orders need not agree. (A column a deployment added to worker_tasks is not carried
-- into the history: add it there, and to these lists, in a migration of its own.)
CREATE VIEW v_tasks AS
SELECT
    id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
    started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
    created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash
FROM worker_tasks
UNION ALL
SELECT
    id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
    started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
    created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash
FROM worker_task_history;
COMMENT ON VIEW v_tasks IS
  'Every task: those in the queue or finished in the last minutes (worker_tasks) and those archived (worker_task_history)';
INSERT INTO tq_relations (relation_name) VALUES ('v_tasks') ON CONFLICT DO NOTHING;

------------------------------------------------------------------------------------------------
-- The move.
------------------------------------------------------------------------------------------------

CREATE FUNCTION archive_tasks(p_finished_before TIMESTAMPTZ, p_limit INTEGER) RETURNS INTEGER AS $$
DECLARE
  v_moved INTEGER;
BEGIN
  IF p_finished_before IS NULL THEN
    PERFORM tq_refuse('archive_tasks', 'finished_before', NULL, 'must be a time',
      'Tasks finished before it move to worker_task_history: e.g. now() - interval ''1 minute''.');
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 100000 THEN
    PERFORM tq_refuse('archive_tasks', 'limit', p_limit::TEXT, 'must be between 1 and 100000',
      'The tasks moved per call: a few thousand keep each transaction short.');
  END IF;
  -- Oldest first, through the two partial indexes on completed_at; locked in id order, a row
  -- held elsewhere (a prune) skipped. A finished task is never updated again, so the DELETE
  -- takes the rows as they were read.
  WITH picked AS (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id IN (
        SELECT c.id
        FROM (
          (SELECT f.id, f.completed_at
           FROM worker_tasks f
           WHERE f.status IN ('completed', 'failed')
             AND f.completed_at < p_finished_before
           ORDER BY f.completed_at
           LIMIT p_limit)
          UNION ALL
          (SELECT x.id, x.completed_at
           FROM worker_tasks x
           WHERE x.status = 'cancelled'
             AND x.completed_at < p_finished_before
           ORDER BY x.completed_at
           LIMIT p_limit)
        ) c
        ORDER BY c.completed_at, c.id
        LIMIT p_limit
      )
      AND t.status IN ('completed', 'failed', 'cancelled')
      AND t.completed_at < p_finished_before
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
  ),
  moved AS (
    DELETE FROM worker_tasks t
    USING picked p
    WHERE t.id = p.id
    RETURNING t.*
  )
  INSERT INTO worker_task_history (
      id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
      started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
      created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash)
  SELECT
      id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
      started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
      created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash
  FROM moved;
  GET DIAGNOSTICS v_moved = ROW_COUNT;
  RETURN v_moved;
END;
$$ LANGUAGE plpgsql;
COMMENT ON FUNCTION archive_tasks(TIMESTAMPTZ, INTEGER) IS
  'Move up to N tasks finished before a time from worker_tasks to worker_task_history, oldest first';

-- What a database migrated before 0022 finished moves now, in the migration's transaction: with
-- a long history, as long as copying it once (docs/DEPLOYMENT.md).
INSERT INTO worker_task_history (
    id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
    started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
    created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash)
SELECT
    id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
    started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
    created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash
FROM worker_tasks
WHERE status IN ('completed', 'failed', 'cancelled') AND completed_at IS NOT NULL;
DELETE FROM worker_tasks t
USING worker_task_history h
WHERE t.id = h.id;

------------------------------------------------------------------------------------------------
-- A key lives as long as its task, in either table.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_tasks_deleted() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
  -- A deleted active task frees its store ...
  UPDATE worker_task_stores s
  SET active_task_id = NULL
  FROM old_tasks o
  WHERE o.status IN ('claimed', 'running')
    AND s.dispensary_id = o.dispensary_id
    AND s.active_task_id = o.id;
  -- ... and deleted pending work leaves its store's head.
  PERFORM tq_lock_and_refresh(array_agg(k.dispensary_id), array_agg(k.role))
  FROM (
    SELECT DISTINCT dispensary_id, role FROM old_tasks
    WHERE status = 'pending' AND dispensary_id IS NOT NULL
  ) k;
  -- A resync task deleted, not archived (no row of it in the history now), takes its day's key
  -- with it: the day may be made again for its store, as when a unique index of worker_tasks
  -- was the key (0022).
  DELETE FROM worker_task_resyncs k
  USING old_tasks o
  WHERE o.resync_date IS NOT NULL
    AND k.resync_date = o.resync_date AND k.role = o.role AND k.dispensary_id = o.dispensary_id
    AND NOT EXISTS (SELECT 1 FROM worker_task_history h WHERE h.id = o.id);
  RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION tq_tasks_truncated() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
  DELETE FROM worker_task_heads;
  UPDATE worker_task_stores SET active_task_id = NULL WHERE active_task_id IS NOT NULL;
  -- The keys of the tasks gone with it (those archived keep theirs).
  DELETE FROM worker_task_resyncs k
  WHERE NOT EXISTS (
    SELECT 1 FROM worker_task_history h
    WHERE h.role = k.role AND h.resync_date = k.resync_date AND h.dispensary_id = k.dispensary_id);
  RETURN NULL;
END;
$$;

CREATE FUNCTION tq_history_deleted() RETURNS trigger AS $$
BEGIN
  DELETE FROM worker_task_resyncs k
  USING old_tasks o
  WHERE o.resync_date IS NOT NULL
    AND k.resync_date = o.resync_date AND k.role = o.role AND k.dispensary_id = o.dispensary_id;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE FUNCTION tq_history_truncated() RETURNS trigger AS $$
BEGIN
  DELETE FROM worker_task_resyncs k
  WHERE NOT EXISTS (
    SELECT 1 FROM worker_tasks t  -- idx_worker_tasks_resync_once
    WHERE t.role = k.role AND t.dispensary_id = k.dispensary_id AND t.resync_date = k.resync_date);
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER worker_task_history_deleted
  AFTER DELETE ON worker_task_history
  REFERENCING OLD TABLE AS old_tasks
  FOR EACH STATEMENT EXECUTE FUNCTION tq_history_deleted();
CREATE TRIGGER worker_task_history_truncated
  AFTER TRUNCATE ON worker_task_history
  FOR EACH STATEMENT EXECUTE FUNCTION tq_history_truncated();

------------------------------------------------------------------------------------------------
-- The day's resync made once through the keys; the prune and the rollup on both tables.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION generate_resync_tasks(p_batches_per_day integer DEFAULT 6, p_date date DEFAULT ((now() AT TIME ZONE 'UTC'::text))::date, p_platforms text[] DEFAULT '{dutchie}'::text[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
  v_created INTEGER;
  v_window RECORD;
  v_unknown TEXT;
BEGIN
  IF p_batches_per_day IS NULL OR p_batches_per_day NOT BETWEEN 1 AND 24 THEN
    PERFORM tq_refuse('generate_resync_tasks', 'batches_per_day', p_batches_per_day::TEXT,
      'must be between 1 and 24',
      'The UTC day''s tasks are spread over 1 to 24 equal batches (the default, 6: one every 4 hours).');
  END IF;
  SELECT * INTO v_window FROM tq_resync_window();
  IF p_date IS NULL OR p_date NOT BETWEEN v_window.first_day AND v_window.last_day THEN
    PERFORM tq_refuse('generate_resync_tasks', 'date', p_date::TEXT,
      format('must be a UTC day from %s to %s', v_window.first_day, v_window.last_day),
      format('Give a day at most %s days back (a backfill) and %s days ahead: an older day''s tasks '
             'would all be due at once, ahead of every other task.',
             (now() AT TIME ZONE 'UTC')::DATE - v_window.first_day,
             v_window.last_day - (now() AT TIME ZONE 'UTC')::DATE));
  END IF;
  IF p_platforms IS NULL OR cardinality(p_platforms) = 0
     OR EXISTS (SELECT 1 FROM unnest(p_platforms) AS x (platform) WHERE coalesce(btrim(x.platform), '') = '') THEN
    PERFORM tq_refuse('generate_resync_tasks', 'platforms', coalesce(quote_literal(p_platforms::TEXT), 'NULL'),
      'must name at least one platform, and no empty name', tq_known_platforms_hint());
  END IF;
  -- A platform that no store and no limits name is most likely misspelt: 0 tasks would hide it.
  SELECT string_agg(quote_literal(u.platform), ', ' ORDER BY u.platform) INTO v_unknown
  FROM (SELECT DISTINCT x.platform FROM unnest(p_platforms) AS x (platform)) u
  WHERE NOT EXISTS (SELECT 1 FROM tq_platforms l WHERE l.platform = u.platform)
    AND NOT EXISTS (SELECT 1 FROM dispensaries d WHERE d.menu_type = u.platform);
  IF v_unknown IS NOT NULL THEN
    PERFORM tq_refuse('generate_resync_tasks', 'platforms', quote_literal(p_platforms::TEXT),
      format('must name only known platforms (unknown: %s)', v_unknown), tq_known_platforms_hint());
  END IF;

  WITH eligible AS (
    SELECT
      d.id,
      d.menu_type,
      -- The store's place within its platform: the round-robin key.
      row_number() OVER (PARTITION BY d.menu_type ORDER BY d.id) AS turn
    FROM dispensaries d
    WHERE d.crawl_enabled
      AND d.menu_type = ANY (p_platforms)
      AND d.platform_dispensary_id IS NOT NULL
  ),
  ordered AS (
    SELECT
      e.id,
      e.menu_type,
      row_number() OVER (ORDER BY e.turn, e.menu_type, e.id) - 1 AS n,
      count(*) OVER () AS total
    FROM eligible e
  ),
  stores AS (
    SELECT
      o.id,
      o.menu_type,
      o.n,
      o.n * p_batches_per_day / o.total AS batch,
      row_number() OVER (PARTITION BY o.n * p_batches_per_day / o.total ORDER BY o.n) - 1 AS place
    FROM ordered o
  ),
  -- The day's key of each store first: a store whose key is there (its task made before, in
  -- the queue or archived, and not pruned) gets none. A second generator of the day waits here
  -- for the first's keys and skips them.
  keyed AS (
    INSERT INTO worker_task_resyncs (resync_date, role, dispensary_id)
    SELECT p_date, 'product_resync', s.id
    FROM stores s
    ORDER BY s.id
    ON CONFLICT DO NOTHING
    RETURNING dispensary_id
  )
  INSERT INTO worker_tasks (role, dispensary_id, platform, scheduled_for, priority, resync_date)
  SELECT
    'product_resync',
    s.id,
    s.menu_type,
    (p_date::TIMESTAMP AT TIME ZONE 'UTC')
      + s.batch * (INTERVAL '24 hours' / p_batches_per_day)
      + s.place * INTERVAL '1 millisecond',
    0,
    p_date
  FROM stores s
  JOIN keyed k ON k.dispensary_id = s.id
  ORDER BY s.n
  ON CONFLICT (role, dispensary_id, resync_date) WHERE resync_date IS NOT NULL DO NOTHING;
  GET DIAGNOSTICS v_created = ROW_COUNT;
  RETURN v_created;
END;
$$;

CREATE OR REPLACE FUNCTION prune_tasks(p_before timestamp with time zone, p_limit integer) RETURNS TABLE(deleted integer, hours_rolled_up integer)
    LANGUAGE plpgsql
    AS $$
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

  -- Tasks finished before the horizon and not archived yet (no drain sensor moved them) go to
  -- the history first: the prune below reads only the history.
  PERFORM archive_tasks(p_before, p_limit);

  -- One batch at a time: a batch that rolls up an hour must not see another's deletes of it
  -- half-way. The watermark moves in the same transaction as the first delete under it, and
  -- never back.
  PERFORM 1 FROM tq_retention FOR UPDATE;
  UPDATE tq_retention
  SET tasks_pruned_before = p_before,
      updated_at = now()
  WHERE tasks_pruned_before < p_before;

  -- Oldest first; locked in id order, rows held elsewhere skipped.
  SELECT array_agg(t.id ORDER BY t.id) INTO v_ids
  FROM (
    SELECT t.id
    FROM worker_task_history t
    WHERE t.id IN (
        SELECT f.id
        FROM worker_task_history f
        WHERE f.completed_at < p_before
          AND f.created_at < p_before
        ORDER BY f.completed_at
        LIMIT p_limit
      )
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
    FROM worker_task_history t
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

  -- A resync task's key goes with it (the history's delete trigger): its day may be made again
  -- by a backfill, as before 0022.
  DELETE FROM worker_task_history t WHERE t.id = ANY (v_ids);
  GET DIAGNOSTICS deleted = ROW_COUNT;
  RETURN NEXT;
END;
$$;

CREATE OR REPLACE FUNCTION tq_rollup_hour(p_date date, p_hour integer, p_keep_pruned boolean) RETURNS integer
    LANGUAGE plpgsql
    AS $$
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
    FROM v_tasks
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
    FROM v_tasks
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
$$;

-- The last hour's completions and failures, archived or not.
CREATE OR REPLACE VIEW v_worker_capacity AS
 WITH unfinished AS (
         SELECT worker_tasks.role,
            worker_tasks.status,
            worker_tasks.due_at,
            worker_tasks.worker_id
           FROM worker_tasks
          WHERE (((worker_tasks.status)::text = 'pending'::text) AND (worker_tasks.dispensary_id IS NOT NULL))
        UNION ALL
         SELECT worker_tasks.role,
            worker_tasks.status,
            worker_tasks.due_at,
            worker_tasks.worker_id
           FROM worker_tasks
          WHERE (((worker_tasks.status)::text = 'pending'::text) AND (worker_tasks.dispensary_id IS NULL))
        UNION ALL
         SELECT worker_tasks.role,
            worker_tasks.status,
            worker_tasks.due_at,
            worker_tasks.worker_id
           FROM worker_tasks
          WHERE (((worker_tasks.status)::text = ANY ((ARRAY['claimed'::character varying, 'running'::character varying])::text[])) AND (worker_tasks.dispensary_id IS NOT NULL))
        UNION ALL
         SELECT worker_tasks.role,
            worker_tasks.status,
            worker_tasks.due_at,
            worker_tasks.worker_id
           FROM worker_tasks
          WHERE (((worker_tasks.status)::text = ANY ((ARRAY['claimed'::character varying, 'running'::character varying])::text[])) AND (worker_tasks.dispensary_id IS NULL))
        ), live AS (
         SELECT unfinished.role,
            count(*) FILTER (WHERE ((unfinished.status)::text = 'pending'::text)) AS pending_tasks,
            count(*) FILTER (WHERE (((unfinished.status)::text = 'pending'::text) AND (unfinished.due_at <= now()))) AS ready_tasks,
            count(*) FILTER (WHERE ((unfinished.status)::text = 'claimed'::text)) AS claimed_tasks,
            count(*) FILTER (WHERE ((unfinished.status)::text = 'running'::text)) AS running_tasks,
            count(DISTINCT unfinished.worker_id) FILTER (WHERE ((unfinished.status)::text = ANY ((ARRAY['claimed'::character varying, 'running'::character varying])::text[]))) AS active_workers
           FROM unfinished
          GROUP BY unfinished.role
        ), recent AS (
         SELECT t.role,
            count(*) FILTER (WHERE ((t.status)::text = 'completed'::text)) AS completed_last_hour,
            count(*) FILTER (WHERE ((t.status)::text = 'failed'::text)) AS failed_last_hour,
            count(DISTINCT t.worker_id) FILTER (WHERE ((t.status)::text = 'completed'::text)) AS completing_workers,
            (GREATEST(EXTRACT(epoch FROM (max(t.completed_at) FILTER (WHERE ((t.status)::text = 'completed'::text)) - min(t.started_at) FILTER (WHERE ((t.status)::text = 'completed'::text)))), 0.01) / 3600.0) AS busy_hours,
            avg(EXTRACT(epoch FROM (t.completed_at - t.started_at))) FILTER (WHERE ((t.status)::text = 'completed'::text)) AS avg_duration_sec
           FROM v_tasks t
          WHERE (((t.status)::text = ANY ((ARRAY['completed'::character varying, 'failed'::character varying])::text[])) AND (t.completed_at > (now() - '01:00:00'::interval)))
          GROUP BY t.role
        )
 SELECT r.role,
    COALESCE(l.pending_tasks, (0)::bigint) AS pending_tasks,
    COALESCE(l.ready_tasks, (0)::bigint) AS ready_tasks,
    COALESCE(l.claimed_tasks, (0)::bigint) AS claimed_tasks,
    COALESCE(l.running_tasks, (0)::bigint) AS running_tasks,
    COALESCE(c.completed_last_hour, (0)::bigint) AS completed_last_hour,
    COALESCE(c.failed_last_hour, (0)::bigint) AS failed_last_hour,
    COALESCE(l.active_workers, (0)::bigint) AS active_workers,
    c.avg_duration_sec,
        CASE
            WHEN (c.completed_last_hour > 0) THEN (((c.completed_last_hour)::numeric / c.busy_hours) / (GREATEST(c.completing_workers, (1)::bigint))::numeric)
            ELSE NULL::numeric
        END AS tasks_per_worker_hour,
        CASE
            WHEN ((l.active_workers > 0) AND (c.completed_last_hour > 0)) THEN (((l.pending_tasks)::numeric * c.busy_hours) / (c.completed_last_hour)::numeric)
            ELSE NULL::numeric
        END AS estimated_hours_to_drain
   FROM ((worker_task_roles r
     LEFT JOIN live l ON (((l.role)::text = (r.role)::text)))
     LEFT JOIN recent c ON (((c.role)::text = (r.role)::text)));

CREATE OR REPLACE VIEW v_task_history AS
SELECT
  t.id,
  t.role,
  t.dispensary_id,
  d.name AS dispensary_name,
  t.platform,
  t.status,
  t.priority,
  t.worker_id,
  t.scheduled_for,
  t.claimed_at,
  t.started_at,
  t.completed_at,
  t.error_message,
  t.retry_count,
  t.created_at,
  EXTRACT(EPOCH FROM (t.completed_at - t.started_at)) AS duration_sec
FROM v_tasks t
LEFT JOIN dispensaries d ON d.id = t.dispensary_id
ORDER BY t.created_at DESC, t.id DESC;

------------------------------------------------------------------------------------------------
-- Registered, and granted: archive_tasks to the worker roles of before (the drain sensor runs
-- it), v_tasks for their reads, which tq_grant_worker now lists.
------------------------------------------------------------------------------------------------

INSERT INTO tq_api (function_name) VALUES ('archive_tasks') ON CONFLICT DO NOTHING;

CREATE OR REPLACE PROCEDURE tq_grant_worker(IN p_role name)
    LANGUAGE plpgsql
    AS $$
DECLARE
  v_schema TEXT := current_schema();
  -- Read by the named queries of the worker's paths (sql/*.sql), by name.
  v_reads CONSTANT TEXT[] := ARRAY[
    'worker_tasks',         -- stuck_tasks, claimable_now, resync_open_days, resync_unfinished
    'v_tasks',              -- get_task, platform_errors, prune counts, resync_day_progress (0022)
    'worker_task_roles',    -- task_roles: the roles the sensors and drain runs serve
    'worker_task_heads',    -- claimable_now
    'worker_task_stores',   -- claimable_now
    'tq_platforms',         -- claimable_now, platform_counter_drift
    'worker_registry',      -- worker_liveness (dead drain runs), count_prunable_workers
    'task_completion_log',  -- completion_log_hour (the rollup asset)
    'dispensaries',         -- store_entry_point (the crawl handlers)
    'store_crawl_state',    -- store_entry_point
    'store_analytics',      -- analytics_summary (analytics_refresh), store freshness
    'product_history',      -- count_prunable_product_history (a dry-run prune)
    'tq_retention',         -- retention_watermark, retention_floors
    'v_worker_capacity',    -- TaskQueue.capacity: queue_health_sensor, tq status
    'v_platform_status',    -- TaskQueue.platform_status: the platform sensors, tq platforms
    'v_store_freshness',    -- store freshness
    'v_task_history'        -- the tasks with their stores, for whoever looks
  ];
  v_owner TEXT;
  v_routes BIGINT;
  v_route TEXT;
  r RECORD;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_worker: role % does not exist', quote_ident(p_role)
      USING ERRCODE = 'undefined_object', HINT = 'Create it first (tq grant does).';
  END IF;
  IF (SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % is a superuser or bypasses row security', quote_ident(p_role)
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the worker a role of its own, with LOGIN and no other attribute.';
  END IF;
  -- The database's owner is implicitly a member of pg_database_owner, which owns schema public:
  -- it may DROP the queue's tables there, and take CONNECT from others.
  IF pg_has_role(p_role, (SELECT d.datdba FROM pg_database d WHERE d.datname = current_database()), 'MEMBER')
  THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % owns database %, or is a member of its owner %',
      quote_ident(p_role), quote_ident(current_database()),
      (SELECT d.datdba::REGROLE::TEXT FROM pg_database d WHERE d.datname = current_database())
      USING ERRCODE = 'invalid_parameter_value',
            HINT = format('Give the worker a role of its own that owns no database, or give the database '
                          'another owner: ALTER DATABASE %I OWNER TO <the admin role>;', current_database());
  END IF;
  -- A role that is, or can become, an owner of the queue's objects or of its schema has all
  -- their rights.
  SELECT o.owner::REGROLE::TEXT INTO v_owner
  FROM (
    SELECT c.relowner AS owner FROM tq_queue_relations() q JOIN pg_class c ON c.oid = q.relation
    UNION
    SELECT p.proowner FROM tq_queue_functions() q JOIN pg_proc p ON p.oid = q.signature
    UNION
    SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = v_schema
  ) o
  WHERE pg_has_role(p_role, o.owner, 'MEMBER')
  LIMIT 1;
  IF v_owner IS NOT NULL THEN
    RAISE EXCEPTION
      'tq_grant_worker: worker role % is, or is a member of, %, which owns schema % or objects of the queue in it',
      quote_ident(p_role), v_owner, v_schema
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the worker a role of its own, member of no role that owns the queue or its schema.';
  END IF;
  -- A SECURITY DEFINER function runs with its owner's rights: owned by a superuser, any flaw in
  -- one (or a helper it calls) would hand the worker the whole cluster.
  SELECT string_agg(DISTINCT o.rolname::TEXT, ', ') INTO v_owner
  FROM tq_queue_functions() q
  JOIN pg_proc p ON p.oid = q.signature
  JOIN pg_roles o ON o.oid = p.proowner
  WHERE p.prosecdef
    AND o.rolsuper;
  IF v_owner IS NOT NULL THEN
    RAISE EXCEPTION 'tq_grant_worker: the queue''s functions run as %, a superuser: the worker would call them '
      'with a superuser''s rights', v_owner
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give them an owner of their own, without SUPERUSER: tq grant --admin-role tq_admin '
                   '(run once as a superuser) makes it and hands them over.';
  END IF;

  FOR r IN
    SELECT format('REVOKE ALL ON %s %s FROM %I',
             CASE q.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, q.relation, p_role) AS statement
    FROM tq_queue_relations() q
    UNION ALL
    SELECT format('REVOKE ALL ON %s %s FROM %I',
             CASE q.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, q.signature, p_role)
    FROM tq_queue_functions() q
  LOOP
    EXECUTE r.statement;
  END LOOP;
  EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM %I', v_schema, p_role);
  -- PUBLIC has CONNECT unless the database's owner took it away; only the owner may give it.
  IF NOT has_database_privilege(p_role, current_database(), 'CONNECT') THEN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), p_role);
  END IF;
  EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
  FOR r IN
    SELECT q.relation
    FROM tq_queue_relations() q
    JOIN pg_class c ON c.oid = q.relation
    WHERE c.relname = ANY (v_reads)
      AND q.relkind <> 'S'
    ORDER BY c.relname
  LOOP
    EXECUTE format('GRANT SELECT ON %s TO %I', r.relation, p_role);
  END LOOP;
  FOR r IN
    SELECT q.signature, q.prokind
    FROM tq_queue_functions() q
    JOIN pg_proc p ON p.oid = q.signature
    WHERE q.is_api AND NOT q.is_trigger
      -- The admin's functions (0013) stay the admin's.
      AND NOT EXISTS (SELECT 1 FROM tq_api a WHERE a.function_name = p.proname AND NOT a.for_worker)
  LOOP
    EXECUTE format('GRANT EXECUTE ON %s %s TO %I',
      CASE r.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, r.signature, p_role);
  END LOOP;
  -- What the role holds now is what it was given, unless it can reach more by another route (a
  -- predefined role, another role's grants, PUBLIC's): that, tq grant cannot take back without
  -- changing roles that may serve others. Refused, and the transaction with it.
  SELECT count(*), string_agg(w.route, '; ') INTO v_routes, v_route
  FROM tq_worker_write_routes(p_role) w;
  IF v_routes > 0 THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % can change the queue outside its functions (% route%): %',
      quote_ident(p_role), v_routes, CASE WHEN v_routes > 1 THEN 's' ELSE '' END, v_route
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Take each away (REVOKE <role> FROM <worker>; REVOKE ... FROM PUBLIC; ALTER ROLE ... NOCREATEROLE), '
                   'or give the worker a role of its own, member of no other role.';
  END IF;
END;
$$;

DO $$
DECLARE
  r RECORD;
BEGIN
  FOR r IN
    SELECT DISTINCT format('GRANT EXECUTE ON FUNCTION archive_tasks(TIMESTAMPTZ, INTEGER) TO %s',
                           a.grantee::REGROLE) AS statement
    FROM pg_proc p
    CROSS JOIN LATERAL aclexplode(p.proacl) a
    WHERE p.oid = 'claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN)'::REGPROCEDURE
      AND a.privilege_type = 'EXECUTE'
      AND a.grantee <> p.proowner
      AND a.grantee <> 0
    UNION
    SELECT format('GRANT SELECT ON v_tasks TO %s', a.grantee::REGROLE)
    FROM pg_class c
    CROSS JOIN LATERAL aclexplode(c.relacl) a
    WHERE c.oid = 'worker_tasks'::REGCLASS
      AND a.privilege_type = 'SELECT'
      AND a.grantee <> c.relowner
      AND a.grantee <> 0
  LOOP
    EXECUTE r.statement;
  END LOOP;
END;
$$;

CALL tq_secure_functions();
