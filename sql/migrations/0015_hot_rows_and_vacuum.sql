-- 0015: fewer hot rows, and vacuum that keeps up with the hot tables.
--
-- Under a steady stream and beside a transaction that holds its snapshot (an analyst's query, a
-- forgotten BEGIN), no dead row version can be reclaimed: a row updated many times a second
-- grows a chain of versions that every later reader of that row walks. Measured by
-- bench/held_xmin.py and bench/long_horizon.py (docs/BENCHMARKS.md). No guarantee changes:
--
-- - A worker's counts of completed and failed tasks leave its registry row: each completion
--   batch updated that one row (and its heartbeat index) until now, the hottest row of the
--   queue after the platforms'. A batch now appends a row to worker_tallies (an INSERT leaves
--   no dead version behind it); the worker's heartbeat, its deregistration and prune_workers
--   fold the tallies into worker_registry. v_workers shows the registry with what is not
--   folded yet, so the counts read there are exact at any moment.
-- - worker_registry loses idx_worker_registry_heartbeat (last_heartbeat_at): with no index
--   on the heartbeat's column, a heartbeat is a HOT update, pruned within its page.
-- - Storage settings for the hot tables: room in each page for HOT updates (fillfactor) where
--   an update keeps its indexed columns (a store's active task, a worker's heartbeat); vacuum
--   as soon as a few hundred rows are dead in the small hot tables (their size does not
--   scale the threshold: a 5,000-row table would otherwise wait for 1,000 dead rows and the
--   queue's history for millions), at full speed there (they are a few pages); and for
--   worker_tasks, whose history makes it large, a threshold that follows its live tasks rather
--   than its history.
--
-- Safe to run twice.

------------------------------------------------------------------------------------------------
-- Tallies: a worker's counts, appended, folded into its registry row later.
------------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS worker_tallies (
  worker_id VARCHAR(100) NOT NULL,
  completed INTEGER NOT NULL DEFAULT 0,
  failed INTEGER NOT NULL DEFAULT 0
);
COMMENT ON TABLE worker_tallies IS
  'Tasks a worker completed or failed, one row per batch, not yet folded into worker_registry';
INSERT INTO tq_relations (relation_name) VALUES ('worker_tallies') ON CONFLICT DO NOTHING;

COMMENT ON COLUMN worker_registry.tasks_completed IS
  'Completed tasks, as of the worker''s last heartbeat (v_workers adds the tallies not folded yet)';
COMMENT ON COLUMN worker_registry.tasks_failed IS
  'Failed task attempts, as of the worker''s last heartbeat (v_workers adds the tallies not folded yet)';

-- Folds the tallies of one worker (or, given NULL, of every worker) into the registry. The
-- registry row is locked before its tallies are taken (every fold keeps that order, so two
-- never deadlock), and a row another transaction holds is left to its own fold. Tallies of a
-- worker id with no registry row are dropped: there was no row to count them on before.
CREATE OR REPLACE FUNCTION tq_fold_tallies(p_worker_id VARCHAR) RETURNS VOID AS $$
BEGIN
  WITH owners AS (
    SELECT w.worker_id
    FROM worker_registry w
    WHERE CASE WHEN p_worker_id IS NULL
               THEN w.worker_id IN (SELECT x.worker_id FROM worker_tallies x)
               ELSE w.worker_id = p_worker_id END
    ORDER BY w.id
    FOR NO KEY UPDATE SKIP LOCKED
  ),
  folded AS (
    DELETE FROM worker_tallies t
    USING owners o
    WHERE t.worker_id = o.worker_id
    RETURNING t.worker_id, t.completed, t.failed
  )
  UPDATE worker_registry w
  SET tasks_completed = w.tasks_completed + f.completed,
      tasks_failed = w.tasks_failed + f.failed
  FROM (
    SELECT d.worker_id, sum(d.completed) AS completed, sum(d.failed) AS failed
    FROM folded d
    GROUP BY d.worker_id
  ) f
  WHERE w.worker_id = f.worker_id;

  IF p_worker_id IS NULL THEN
    DELETE FROM worker_tallies t
    WHERE NOT EXISTS (SELECT 1 FROM worker_registry w WHERE w.worker_id = t.worker_id);
  END IF;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE VIEW v_workers AS
SELECT
  w.worker_id,
  w.role,
  w.status,
  w.pod_name,
  w.hostname,
  w.started_at,
  w.last_heartbeat_at,
  w.heartbeat_seconds,
  w.session_bound,
  w.tasks_completed + coalesce(t.completed, 0) AS tasks_completed,
  w.tasks_failed + coalesce(t.failed, 0) AS tasks_failed
FROM worker_registry w
LEFT JOIN (
  SELECT x.worker_id, sum(x.completed) AS completed, sum(x.failed) AS failed
  FROM worker_tallies x
  GROUP BY x.worker_id
) t ON t.worker_id = w.worker_id;
COMMENT ON VIEW v_workers IS 'The registry of workers with their exact counts (folded and not yet folded tallies)';
INSERT INTO tq_relations (relation_name) VALUES ('v_workers') ON CONFLICT DO NOTHING;

------------------------------------------------------------------------------------------------
-- Completions and failures append a tally instead of updating the registry row.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION worker_completed(p_worker_id VARCHAR, p_count INTEGER) RETURNS VOID AS $$
BEGIN
  IF p_count IS NULL OR p_count NOT BETWEEN 0 AND 100000 THEN
    PERFORM tq_refuse('worker_completed', 'count', p_count::TEXT, 'must be between 0 and 100000',
      'The tasks a worker completed in its handlers'' own transactions since it last said so: one batch''s '
      'worth (a claim takes at most 1000).');
  END IF;
  IF p_count > 0 AND p_worker_id IS NOT NULL THEN
    INSERT INTO worker_tallies (worker_id, completed) VALUES (p_worker_id, p_count);
  END IF;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_tasks_timed(
  p_task_ids INTEGER[],
  p_leases UUID[],
  p_results JSONB[],
  p_began_after DOUBLE PRECISION[],
  p_ended_after DOUBLE PRECISION[]
) RETURNS INTEGER[] AS $$
DECLARE
  v_done INTEGER[];
BEGIN
  PERFORM tq_check_leases('complete_tasks_timed', p_task_ids, p_leases);
  IF cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_results)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_began_after)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_ended_after) THEN
    RAISE EXCEPTION 'complete_tasks_timed: % task ids, % results, % begin and % end times',
      cardinality(p_task_ids), cardinality(p_results), cardinality(p_began_after), cardinality(p_ended_after)
      USING ERRCODE = '22023',
            HINT = 'Give one result, one begin and one end time (or NULL) per task id, in the same order.';
  END IF;

  WITH done AS (
    UPDATE worker_tasks t
    SET status = 'completed',
        result = r.result,
        error_message = NULL,
        started_at = CASE
          WHEN r.began IS NULL THEN coalesce(t.started_at, t.claimed_at)
          ELSE least(t.claimed_at + make_interval(secs => greatest(r.began, 0)), now()) END,
        completed_at = CASE
          WHEN r.ended IS NULL THEN now()
          ELSE least(t.claimed_at + make_interval(secs => greatest(r.ended, coalesce(r.began, 0), 0)), now()) END
    FROM unnest(p_task_ids, p_leases, p_results, p_began_after, p_ended_after) AS r (id, lease, result, began, ended)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.id, t.worker_id
  ),
  -- Each worker's count (a batch is one worker's), appended in the same statement.
  counted AS (
    INSERT INTO worker_tallies (worker_id, completed)
    SELECT d.worker_id, count(*)
    FROM done d
    WHERE d.worker_id IS NOT NULL
    GROUP BY d.worker_id
  )
  SELECT coalesce(array_agg(d.id ORDER BY d.id), '{}') INTO v_done FROM done d;
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION fail_task(
  p_task_id INTEGER,
  p_lease UUID,
  p_error TEXT,
  p_retryable BOOLEAN DEFAULT true,
  p_retry_after INTERVAL DEFAULT NULL
) RETURNS TEXT AS $$
DECLARE
  v_again BOOLEAN;
  v_worker VARCHAR;
  v_status TEXT;
BEGIN
  SELECT coalesce(p_retryable, true) AND t.retry_count < t.max_retries, t.worker_id
  INTO v_again, v_worker
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;

  IF v_again THEN
    UPDATE worker_tasks t
    SET status = 'pending',
        retry_count = t.retry_count + 1,
        scheduled_for = now() + greatest(
          tq_retry_delay(t.role, t.retry_count),
          least(greatest(p_retry_after, INTERVAL '0'), INTERVAL '1 day')),
        worker_id = NULL,
        claimed_at = NULL,
        started_at = NULL,
        last_heartbeat_at = NULL,
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  ELSE
    UPDATE worker_tasks t
    SET status = 'failed',
        started_at = coalesce(t.started_at, t.claimed_at),
        completed_at = now(),
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  END IF;

  IF v_worker IS NOT NULL THEN
    INSERT INTO worker_tallies (worker_id, failed) VALUES (v_worker, 1);
  END IF;
  RETURN v_status;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The heartbeat, deregistration and pruning fold the tallies.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION heartbeat_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[], p_leases UUID[])
RETURNS INTEGER[] AS $$
DECLARE
  v_owned INTEGER[];
BEGIN
  PERFORM tq_check_leases('heartbeat_tasks', p_task_ids, p_leases);
  WITH held AS (
    SELECT t.id
    FROM worker_tasks t
    JOIN unnest(p_task_ids, p_leases) AS r (id, lease) ON r.id = t.id
    WHERE t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
  ),
  lockable AS (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id IN (SELECT h.id FROM held h)
    ORDER BY t.id
    FOR NO KEY UPDATE SKIP LOCKED
  ),
  -- The lease again here: a task recovered and claimed again between the read above and its
  -- lock is another's, and the update's recheck of the newest row sees that.
  beaten AS (
    UPDATE worker_tasks t
    SET last_heartbeat_at = now()
    FROM lockable l, unnest(p_task_ids, p_leases) AS r (id, lease)
    WHERE t.id = l.id
      AND r.id = t.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  ),
  -- Locked by a writer of their own (the handler's transaction): still held.
  busy AS (
    SELECT h.id FROM held h WHERE h.id NOT IN (SELECT l.id FROM lockable l)
  )
  SELECT coalesce(array_agg(x.id ORDER BY x.id), '{}') INTO v_owned
  FROM (SELECT b.id FROM beaten b UNION ALL SELECT b.id FROM busy b) x;

  -- The label's row notes a sign of life only from a caller that proved one lease (or held
  -- none): forged tokens would otherwise keep a dead worker's row from going offline.
  UPDATE worker_registry
  SET last_heartbeat_at = now(),
      status = CASE WHEN cardinality(v_owned) > 0 THEN 'active' ELSE 'idle' END
  WHERE worker_id = p_worker_id
    AND status <> 'offline'
    AND (cardinality(v_owned) > 0 OR coalesce(cardinality(p_task_ids), 0) = 0);
  -- Folding changes no total (v_workers reads the same before and after), so any caller may.
  PERFORM tq_fold_tallies(p_worker_id);
  RETURN v_owned;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION deregister_worker(p_worker_id VARCHAR) RETURNS BOOLEAN AS $$
DECLARE
  v_done BOOLEAN;
BEGIN
  UPDATE worker_registry w
  SET status = 'offline', last_heartbeat_at = now()
  WHERE w.worker_id = p_worker_id
    AND w.status <> 'offline'
    AND coalesce(tq_session_pid(w), pg_backend_pid()) = pg_backend_pid()
    AND (w.session_bound OR NOT EXISTS (
           SELECT 1 FROM worker_tasks t
           WHERE t.worker_id = p_worker_id AND t.status IN ('claimed', 'running')));
  v_done := FOUND;
  PERFORM tq_fold_tallies(p_worker_id);
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION prune_workers(p_before TIMESTAMPTZ, p_limit INTEGER) RETURNS INTEGER AS $$
DECLARE
  v_deleted INTEGER;
BEGIN
  PERFORM tq_check_prune('prune_workers', p_before, p_limit, 'min_workers_days');
  -- Every worker's tallies first: those of workers that never heartbeat end here.
  PERFORM tq_fold_tallies(NULL);
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

------------------------------------------------------------------------------------------------
-- Claim floors: where a claim's walk of the heads begins.
--
-- A head is inserted when its store gets pending work and deleted when the work is claimed, so
-- the dead index entries of worker_task_heads gather at the front of the claim order, before
-- every live head; while a snapshot pins them, each claim used to visit every one (a heap
-- fetch each) before reaching live work. A floor per role and platform is a time no live head
-- comes due before: the claims' scans check due_at >= floor in the index itself, so a dead head
-- below it is passed over without a visit. Writers keep the floor at or below their heads
-- (tq_lower_floor: a read, and a write only for a head due before the floor, as a backfilled or
-- recovered task can be); a claim raises its role's floors to the earliest live head at most
-- once a second (tq_raise_floors). A head written by a transaction still open while a raise
-- ran may stay below the floor until the next raise: claimed a second or two late, never lost.
-- The claim and claim_wait that use the floors are 0016's (it redefines both for its own ends).
------------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS worker_task_floors (
  role VARCHAR(50) NOT NULL,
  platform VARCHAR(50) NOT NULL,
  floor TIMESTAMPTZ NOT NULL,
  raised_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
  PRIMARY KEY (role, platform)
);
COMMENT ON TABLE worker_task_floors IS
  'Per role and platform: no live head comes due before floor, where claims begin their walk (kept by triggers and claims)';
INSERT INTO tq_relations (relation_name) VALUES ('worker_task_floors') ON CONFLICT DO NOTHING;

INSERT INTO worker_task_floors (role, platform, floor)
SELECT h.role, h.platform, min(h.due_at)
FROM worker_task_heads h
GROUP BY h.role, h.platform
ON CONFLICT (role, platform) DO UPDATE
SET floor = least(worker_task_floors.floor, excluded.floor);

-- True when it wrote. Almost every head comes due after its floor: then nothing is locked.
CREATE OR REPLACE FUNCTION tq_lower_floor(p_role VARCHAR, p_platform VARCHAR, p_due TIMESTAMPTZ)
RETURNS BOOLEAN AS $$
BEGIN
  PERFORM 1
  FROM worker_task_floors f
  WHERE f.role = p_role AND f.platform = p_platform AND f.floor <= p_due;
  IF FOUND OR p_due IS NULL THEN
    RETURN false;
  END IF;
  INSERT INTO worker_task_floors AS f (role, platform, floor)
  VALUES (p_role, p_platform, p_due)
  ON CONFLICT (role, platform) DO UPDATE
  SET floor = excluded.floor
  WHERE excluded.floor < f.floor;
  RETURN true;
END;
$$ LANGUAGE plpgsql;

-- The role's floors not raised in the last second, each to its earliest live head (one index
-- probe per priority in use), or a second before now when it has none. A floor another claim is
-- raising is skipped.
CREATE OR REPLACE FUNCTION tq_raise_floors(p_role VARCHAR) RETURNS VOID AS $$
DECLARE
  f RECORD;
  v_min TIMESTAMPTZ;
BEGIN
  FOR f IN
    SELECT x.platform
    FROM worker_task_floors x
    WHERE x.role = p_role AND x.raised_at < now() - INTERVAL '1 second'
    ORDER BY x.platform
    FOR NO KEY UPDATE SKIP LOCKED
  LOOP
    WITH RECURSIVE firsts (priority, due_at) AS (
      (SELECT h.priority, h.due_at FROM worker_task_heads h
       WHERE h.role = p_role AND h.platform = f.platform
       ORDER BY h.priority DESC, h.due_at LIMIT 1)
      UNION ALL
      SELECT n.priority, n.due_at
      FROM firsts p
      CROSS JOIN LATERAL (
        SELECT h.priority, h.due_at FROM worker_task_heads h
        WHERE h.role = p_role AND h.platform = f.platform AND h.priority < p.priority
        ORDER BY h.priority DESC, h.due_at LIMIT 1
      ) n
    )
    SELECT min(x.due_at) INTO v_min FROM firsts x;
    UPDATE worker_task_floors x
    SET floor = least(coalesce(v_min, 'infinity'), now() - INTERVAL '1 second'),
        raised_at = now()
    WHERE x.role = p_role AND x.platform = f.platform;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

-- Heads keep their floors: the store's one head (an enqueue, a change of one task) ...
CREATE OR REPLACE FUNCTION tq_refresh_head(p_store INTEGER, p_role VARCHAR) RETURNS VOID AS $$
DECLARE
  v_priority INTEGER;
  v_due TIMESTAMPTZ;
  v_platform VARCHAR;
  v_recheck TIMESTAMPTZ;
BEGIN
  SELECT t.priority, t.due_at, coalesce(t.platform, '') INTO v_priority, v_due, v_platform
  FROM worker_tasks t
  WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending' AND t.due_at <= now()
  ORDER BY t.priority DESC, t.due_at, t.id
  LIMIT 1;
  IF NOT FOUND THEN
    SELECT t.priority, t.due_at, coalesce(t.platform, '') INTO v_priority, v_due, v_platform
    FROM worker_tasks t
    WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending' AND t.due_at > now()
    ORDER BY t.due_at, t.priority DESC, t.id
    LIMIT 1;
    IF NOT FOUND THEN
      DELETE FROM worker_task_heads h WHERE h.role = p_role AND h.dispensary_id = p_store;
      RETURN;
    END IF;
  END IF;
  SELECT min(t.due_at) INTO v_recheck
  FROM worker_tasks t
  WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending'
    AND t.due_at > greatest(now(), v_due) AND t.priority > v_priority;
  INSERT INTO worker_task_heads AS h (role, dispensary_id, priority, due_at, recheck_at, platform)
  VALUES (p_role, p_store, v_priority, v_due, v_recheck, v_platform)
  ON CONFLICT (role, dispensary_id) DO UPDATE
  SET priority = excluded.priority,
      due_at = excluded.due_at,
      recheck_at = excluded.recheck_at,
      platform = excluded.platform
  WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
    IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform);
  PERFORM tq_lower_floor(p_role, v_platform, v_due);
END;
$$ LANGUAGE plpgsql;

-- ... and the heads of a statement's stores.
CREATE OR REPLACE FUNCTION tq_refresh_heads(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
DECLARE
  v_lowered INTEGER;
BEGIN
  WITH keys AS (
    SELECT DISTINCT k.dispensary_id, k.role
    FROM unnest(p_stores, p_roles) AS k (dispensary_id, role)
    WHERE k.dispensary_id IS NOT NULL
  ),
  fresh AS (
    SELECT
      k.dispensary_id,
      k.role,
      h.priority,
      h.due_at,
      h.platform,
      (SELECT min(t.due_at)
       FROM worker_tasks t
       WHERE t.dispensary_id = k.dispensary_id
         AND t.role = k.role
         AND t.status = 'pending'
         AND t.due_at > greatest(now(), h.due_at)
         AND t.priority > h.priority) AS recheck_at
    FROM keys k
    LEFT JOIN LATERAL (
      SELECT c.priority, c.due_at, c.platform
      FROM (
        -- the best due task in claim order ...
        (SELECT t.priority, t.due_at, coalesce(t.platform, '') AS platform
         FROM worker_tasks t
         WHERE t.dispensary_id = k.dispensary_id
           AND t.role = k.role
           AND t.status = 'pending'
           AND t.due_at <= now()
         ORDER BY t.priority DESC, t.due_at, t.id
         LIMIT 1)
        UNION ALL
        -- ... else the next to come due
        (SELECT t.priority, t.due_at, coalesce(t.platform, '') AS platform
         FROM worker_tasks t
         WHERE t.dispensary_id = k.dispensary_id
           AND t.role = k.role
           AND t.status = 'pending'
           AND t.due_at > now()
         ORDER BY t.due_at, t.priority DESC, t.id
         LIMIT 1)
      ) c
      LIMIT 1
    ) h ON true
  ),
  gone AS (
    DELETE FROM worker_task_heads h
    USING fresh f
    WHERE h.role = f.role
      AND h.dispensary_id = f.dispensary_id
      AND f.priority IS NULL
  ),
  written AS (
    INSERT INTO worker_task_heads AS h (role, dispensary_id, priority, due_at, recheck_at, platform)
    SELECT f.role, f.dispensary_id, f.priority, f.due_at, f.recheck_at, f.platform
    FROM fresh f
    WHERE f.priority IS NOT NULL
    ORDER BY f.dispensary_id, f.role
    ON CONFLICT (role, dispensary_id) DO UPDATE
    SET priority = excluded.priority,
        due_at = excluded.due_at,
        recheck_at = excluded.recheck_at,
        platform = excluded.platform
    WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
      IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform)
    RETURNING h.role, h.platform, h.due_at
  )
  -- No head below its floor: one call per platform written, which reads unless it must lower.
  SELECT count(*) INTO v_lowered
  FROM (SELECT w.role, w.platform, min(w.due_at) AS due FROM written w GROUP BY w.role, w.platform) m
  WHERE tq_lower_floor(m.role, m.platform, m.due);
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

------------------------------------------------------------------------------------------------
-- Storage settings of the hot tables.
------------------------------------------------------------------------------------------------

-- The heartbeat's column unindexed: its update stays in the page (HOT).
DROP INDEX IF EXISTS idx_worker_registry_heartbeat;

-- Small tables updated many times a second: half of each page free for HOT updates, vacuum
-- after 200 dead rows whatever their size, with no cost delay (a few pages each).
ALTER TABLE worker_registry SET (
  fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200,
  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE worker_task_stores SET (
  fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE worker_task_heads SET (
  fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE worker_tallies SET (
  autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE worker_task_floors SET (
  fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 100,
  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE tq_platforms SET (
  autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 100,
  autovacuum_vacuum_cost_delay = 0);
-- The tasks: mostly history. A scale of 1% (not 20%) of its rows keeps the dead versions of
-- the live tasks from waiting for millions; inserts trigger a vacuum too (visibility map
-- kept, so the views' index-only scans stay index-only), and statistics follow the live part.
ALTER TABLE worker_tasks SET (
  autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 5000,
  autovacuum_vacuum_insert_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.01);

CALL tq_secure_functions();
