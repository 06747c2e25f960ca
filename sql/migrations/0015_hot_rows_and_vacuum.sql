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

-- The claim: as 0013's, raising its role's floors first, and walking the heads from them.
CREATE OR REPLACE FUNCTION claim_tasks(
  p_role VARCHAR,
  p_worker_id VARCHAR,
  p_max_tasks INTEGER,
  p_start BOOLEAN DEFAULT false
) RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_want INTEGER := p_max_tasks;
  v_work VARCHAR[];
  v_platforms VARCHAR[];
  v_quotas INTEGER[];
  v_stores INTEGER[];
  v_store_platforms VARCHAR[];
  v_loose INTEGER[];
  v_skip INTEGER[] := '{}';
  v_claimed INTEGER;
  v_floors TIMESTAMPTZ[];
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  IF p_max_tasks IS NULL OR p_max_tasks NOT BETWEEN 1 AND 1000 THEN
    PERFORM tq_refuse('claim_tasks', 'max_tasks', p_max_tasks::TEXT, 'must be between 1 and 1000',
      'A claim takes 1 to 1000 tasks at once.');
  END IF;

  PERFORM tq_raise_floors(p_role);

  -- The platforms with pending work of this role ('' for none): one probe of the heads per
  -- platform that ever had any, from its floor, and a skip scan of the store-less tasks.
  WITH RECURSIVE heads (platform) AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1 FROM worker_task_heads h
                  WHERE h.role = p_role AND h.platform = f.platform AND h.due_at >= f.floor)
  ),
  loose (platform) AS (
    (SELECT coalesce(t.platform, '') FROM worker_tasks t
     WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL
     ORDER BY coalesce(t.platform, '') LIMIT 1)
    UNION ALL
    SELECT (SELECT coalesce(t.platform, '') FROM worker_tasks t
            WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL
              AND coalesce(t.platform, '') > x.platform
            ORDER BY coalesce(t.platform, '') LIMIT 1)
    FROM loose x
    WHERE x.platform IS NOT NULL
  )
  SELECT array_agg(DISTINCT w.platform ORDER BY w.platform)
  INTO v_work
  FROM (SELECT platform FROM heads UNION ALL SELECT platform FROM loose) w
  WHERE w.platform IS NOT NULL;

  IF v_work IS NULL THEN
    PERFORM tq_require_role(p_role);
    RETURN;
  END IF;

  -- The limited platforms among them, locked in platform order (every locker of several
  -- platform rows takes them in this order), before any store: writers lock stores, then
  -- platforms, and a claim waits only here. Claims of one platform queue here; that is what
  -- makes its limits exact.
  PERFORM 1
  FROM tq_platforms l
  WHERE l.platform = ANY (v_work)
  ORDER BY l.platform
  FOR UPDATE;

  -- Heads that a task not yet due at their last derivation may now overtake.
  SELECT array_agg(r.dispensary_id)
  INTO v_stores
  FROM (
    SELECT h.dispensary_id
    FROM worker_task_heads h
    JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
    WHERE h.role = p_role
      AND h.recheck_at <= now()
    ORDER BY h.recheck_at
    LIMIT 100
    FOR UPDATE OF s SKIP LOCKED
  ) r;
  IF v_stores IS NOT NULL THEN
    PERFORM tq_refresh_heads(v_stores, array_fill(p_role, ARRAY[cardinality(v_stores)]));
  END IF;

  -- A store picked below can come back empty only when its best task is locked by another
  -- writer (a cancel); try again without it rather than return less than is due. Each pass
  -- leaves out at least one more store, so the loop ends.
  LOOP
    SELECT
      array_agg(w.platform),
      array_agg(CASE WHEN l.platform IS NULL THEN p_max_tasks ELSE tq_platform_quota(l) END),
      array_agg(coalesce(f.floor, '-infinity'))
    INTO v_platforms, v_quotas, v_floors
    FROM unnest(v_work) AS w (platform)
    LEFT JOIN tq_platforms l ON l.platform = w.platform
    LEFT JOIN worker_task_floors f ON f.role = p_role AND f.platform = w.platform;

    -- Per platform with room, its best idle stores with due work (from the heads) and its best
    -- store-less tasks; then the platforms take turns: every platform's first, then every
    -- platform's second, ... Locking the store row serialises the claims of one store.
    WITH room AS (
      SELECT r.platform, least(r.quota, v_want) AS quota, r.floor
      FROM unnest(v_platforms, v_quotas, v_floors) AS r (platform, quota, floor)
      WHERE r.quota > 0
    ),
    by_store AS (
      SELECT c.*
      FROM room r
      CROSS JOIN LATERAL (
        SELECT h.priority, h.due_at, h.dispensary_id, NULL::INTEGER AS task_id, h.platform
        FROM worker_task_heads h
        JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
        WHERE h.role = p_role
          AND h.platform = r.platform
          AND h.due_at >= r.floor  -- checked in the index: dead heads below it cost no visit
          AND h.due_at <= now()
          AND s.active_task_id IS NULL
          AND h.dispensary_id <> ALL (v_skip)
        ORDER BY h.priority DESC, h.due_at, h.dispensary_id
        LIMIT r.quota
        FOR UPDATE OF s SKIP LOCKED
      ) c
    ),
    loose AS (
      SELECT c.*
      FROM room r
      CROSS JOIN LATERAL (
        SELECT t.priority, t.due_at, NULL::INTEGER AS dispensary_id, t.id AS task_id, r.platform
        FROM worker_tasks t
        WHERE t.role = p_role
          AND coalesce(t.platform, '') = r.platform
          AND t.status = 'pending'
          AND t.dispensary_id IS NULL
          AND t.due_at <= now()
        ORDER BY t.priority DESC, t.due_at, t.id
        LIMIT r.quota
        FOR UPDATE OF t SKIP LOCKED
      ) c
    ),
    turns AS (
      SELECT
        b.*,
        row_number() OVER (PARTITION BY b.platform ORDER BY b.priority DESC, b.due_at) AS turn
      FROM (SELECT * FROM by_store UNION ALL SELECT * FROM loose) b
    ),
    best AS (
      SELECT t.*
      FROM turns t
      JOIN room r ON r.platform = t.platform
      WHERE t.turn <= r.quota
      ORDER BY t.turn, t.priority DESC, t.due_at, t.platform
      LIMIT v_want
    )
    SELECT
      array_agg(dispensary_id) FILTER (WHERE dispensary_id IS NOT NULL),
      array_agg(platform) FILTER (WHERE dispensary_id IS NOT NULL),
      array_agg(task_id) FILTER (WHERE task_id IS NOT NULL)
    INTO v_stores, v_store_platforms, v_loose
    FROM best;

    IF v_stores IS NULL AND v_loose IS NULL THEN
      RETURN;
    END IF;

    -- Each task of a limited platform gets its first request's start from the platform's GCRA,
    -- in turn order (base = max(tat, now); start i = max(now, base + i/rate - tolerance)),
    -- and the platform's tat moves past them. The statement triggers mark the stores busy,
    -- re-derive their heads and count the platforms' new tasks in flight.
    RETURN QUERY
    WITH picked AS (
      SELECT t.id, t.priority, t.due_at, coalesce(t.platform, '') AS platform
      FROM unnest(v_stores, v_store_platforms) AS s (dispensary_id, platform)
      CROSS JOIN LATERAL (
        SELECT t.id, t.priority, t.due_at, t.platform
        FROM worker_tasks t
        WHERE t.dispensary_id = s.dispensary_id
          AND t.role = p_role
          AND t.status = 'pending'
          AND t.due_at <= now()
        ORDER BY t.priority DESC, t.due_at, t.id
        LIMIT 1
        FOR UPDATE OF t SKIP LOCKED
      ) t
      WHERE coalesce(t.platform, '') = s.platform
      UNION ALL
      SELECT t.id, t.priority, t.due_at, coalesce(t.platform, '')
      FROM worker_tasks t
      WHERE t.id = ANY (v_loose)
    ),
    timed AS (
      SELECT
        p.id,
        p.platform,
        CASE WHEN l.platform IS NOT NULL THEN
          greatest(
            now(),
            greatest(l.tat, now())
              + make_interval(secs => (row_number() OVER (PARTITION BY p.platform
                                                          ORDER BY p.priority DESC, p.due_at, p.id) - 1)
                                      / l.requests_per_second
                                      - tq_platform_tolerance(l.burst, l.requests_per_second)))
        END AS send_at,
        -- The lease: 122 random bits, shown to the claimer once and kept only as a hash.
        gen_random_uuid() AS token
      FROM picked p
      LEFT JOIN tq_platforms l ON l.platform = p.platform
    ),
    paced AS (
      UPDATE tq_platforms l
      SET tat = greatest(l.tat, now()) + make_interval(secs => c.n / l.requests_per_second),
          -- A half-open platform's one task is its probe.
          probe_task_id = CASE WHEN l.pauses > 0 THEN c.first_id ELSE l.probe_task_id END,
          probe_sent = CASE WHEN l.pauses > 0 THEN false ELSE l.probe_sent END,
          updated_at = now()
      FROM (SELECT m.platform, count(*) AS n, min(m.id) AS first_id FROM timed m GROUP BY m.platform) c
      WHERE l.platform = c.platform
    ),
    claimed AS (
      UPDATE worker_tasks t
      SET status = CASE WHEN p_start THEN 'running' ELSE 'claimed' END,
          worker_id = p_worker_id,
          claimed_at = now(),
          started_at = CASE WHEN p_start THEN now() END,
          completed_at = NULL,
          send_at = m.send_at,
          -- A fresh lease: a recovered task's old heartbeat must not count against its new owner.
          last_heartbeat_at = now(),
          lease_hash = tq_lease_hash(m.token)
      FROM timed m
      WHERE t.id = m.id
      RETURNING t AS claimed_row, m.token
    )
    SELECT c.claimed_row, c.token
    FROM claimed c
    ORDER BY (c.claimed_row).send_at NULLS FIRST, (c.claimed_row).priority DESC, (c.claimed_row).due_at,
             (c.claimed_row).id;

    GET DIAGNOSTICS v_claimed = ROW_COUNT;
    v_want := v_want - v_claimed;
    EXIT WHEN v_want <= 0
      OR v_claimed = coalesce(cardinality(v_stores), 0) + coalesce(cardinality(v_loose), 0);
    -- Stores that yielded nothing (we still hold their rows): re-derive their heads, in case
    -- the head outlived its task (a deleted row), and leave them out of the next attempt.
    v_stores := ARRAY(
      SELECT s.dispensary_id
      FROM worker_task_stores s
      WHERE s.dispensary_id = ANY (v_stores)
        AND s.active_task_id IS NULL
    );
    EXIT WHEN cardinality(v_stores) = 0;
    PERFORM tq_refresh_heads(v_stores, array_fill(p_role, ARRAY[cardinality(v_stores)]));
    v_skip := v_skip || v_stores;
  END LOOP;
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

-- A drain run that found nothing: as 0006's, its look at the heads from the floors too.
CREATE OR REPLACE FUNCTION claim_wait(p_role VARCHAR) RETURNS DOUBLE PRECISION AS $$
  WITH due AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1
                  FROM worker_task_heads h
                  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
                  WHERE h.role = p_role AND h.platform = f.platform
                    AND h.due_at >= f.floor AND h.due_at <= now() AND s.active_task_id IS NULL)
    UNION
    SELECT DISTINCT coalesce(t.platform, '')
    FROM worker_tasks t
    WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL AND t.due_at <= now()
  )
  SELECT min(CASE
    WHEN l.platform IS NULL THEN 0
    WHEN l.paused_until > now() THEN extract(EPOCH FROM l.paused_until - now())
    WHEN l.pauses > 0 AND l.probe_task_id IS NOT NULL THEN 0.5
    WHEN l.in_flight >= l.max_in_flight THEN 0.25
    ELSE greatest(
      extract(EPOCH FROM greatest(l.tat, now()) - now())
        - tq_platform_tolerance(l.burst, l.requests_per_second) - 1,
      0)
  END)::DOUBLE PRECISION
  FROM due d
  LEFT JOIN tq_platforms l ON l.platform = d.platform;
$$ LANGUAGE sql STABLE;

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
