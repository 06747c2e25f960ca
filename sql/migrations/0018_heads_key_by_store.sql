-- 0018: no index of the heads but the positioned one can serve a scan of a role's heads, a
-- read of a floor visits a page of its versions, and the sensor's release of dead workers reads no
-- history. Measured by bench/long_horizon.py (docs/BENCHMARKS.md, "A held snapshot: the stalls
-- were plans").
--
-- Under a transaction held open, a role's heads table holds a handful of live rows and every
-- head deleted since the snapshot (one per task). ANALYZE counts only the live ones, so any
-- index with a role column looks to the planner about as cheap as another: the generic plans
-- of the claim's look for work, its ranking of the heads, the raise's probe and
-- tq_refresh_heads' delete went, after one analysis in two, from idx_worker_task_heads_platform
-- (positioned at the floor: a few buffers) to worker_task_heads_pkey on (role, dispensary_id),
-- which visits every dead head of the role: 30,000 to 115,000 buffers a statement eight
-- minutes in, claims ten times slower, a backlog for the minute until the next analysis
-- flipped them back. With the key's columns the other way round PostgreSQL 18 still took it
-- (a scan of the whole index, role being a key column) and PostgreSQL 15 a bitmap of it. So
-- the heads have no primary key now: their uniqueness is a unique index on (dispensary_id,
-- (role || '')), which serves every lookup of one store's heads and the upserts' ON CONFLICT,
-- and which no condition on role can use. The one index left for a scan of a role's heads is
-- the positioned one (and the recheck index, partial on recheck_at), and the functions that
-- walk them plan without sequential scans.
--
-- The floors, for the same reason: under a held snapshot every version of a floor row stays,
-- and each read of the floor visited them all (2,000 versions, some 10,000 buffers a claim
-- and 2,000 an enqueue eight minutes in). Most were rows that writers added because a claim
-- held the floor's lock (its raise), each deleted by the next raise; a writer now waits for
-- that lock, a claim's remaining milliseconds, polling up to 20 ms, before it adds a row. And
-- the floor value is no longer in the index, so that a raise is a HOT update: its versions
-- chain within a page instead of adding an index entry each.
--
-- And release_dead_workers, which the queue sensor calls every tick with the drain runs it
-- knows: its one statement joined the workers it found dead to worker_tasks, and the plan
-- chosen read the whole table, history included, whether any worker was dead or not (8,700
-- buffers a call at 140,000 tasks, growing with the history). It now finds the dead first and
-- returns when there are none, and reads their active tasks through the partial indexes over
-- active tasks, as expire_leases does.
--
-- Safe to run twice.

-- Claims and head writers hold row locks on the heads while they lock other rows: the table's
-- lock is taken only when free (NOWAIT, retried for up to a minute), so the migration neither
-- deadlocks with them nor queues every writer behind it.
DO $$
BEGIN
  FOR attempt IN 1..1200 LOOP
    BEGIN
      LOCK TABLE worker_task_heads IN ACCESS EXCLUSIVE MODE NOWAIT;
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      PERFORM pg_sleep(0.05);  -- the failed attempt's lock went with its subtransaction
    END;
  END LOOP;
  RAISE EXCEPTION 'worker_task_heads stayed locked for a minute'
    USING HINT = 'Run tq migrate again at a quieter moment.';
END;
$$;

ALTER TABLE worker_task_heads DROP CONSTRAINT IF EXISTS worker_task_heads_pkey;
CREATE UNIQUE INDEX IF NOT EXISTS worker_task_heads_store_role
  ON worker_task_heads (dispensary_id, (role || ''));
COMMENT ON INDEX worker_task_heads_store_role IS
  'One head per store and role; on an expression of role, so that no condition on role can use it (a scan of a role''s heads has idx_worker_task_heads_platform alone)';

-- A sequential scan of the heads reads every dead head too: the four functions that walk a
-- role's heads plan without one where an index serves (the generic plan of the look for work
-- chose it in two of eight samples of one run on PostgreSQL 18: 13 ms against 0.2, six
-- minutes into a held snapshot).
ALTER FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN) SET enable_seqscan = off;
ALTER FUNCTION tq_claim_next(VARCHAR, VARCHAR, VARCHAR) SET enable_seqscan = off;
ALTER FUNCTION claim_wait(VARCHAR) SET enable_seqscan = off;
ALTER FUNCTION tq_raise_floors(VARCHAR) SET enable_seqscan = off;

-- The heads' writers, 0017's, upserting on that index.
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
  ON CONFLICT (dispensary_id, (role || '')) DO UPDATE
  SET priority = excluded.priority,
      due_at = excluded.due_at,
      recheck_at = excluded.recheck_at,
      platform = excluded.platform
  WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
    IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform);
  PERFORM tq_lower_floor(p_role, v_platform, v_priority, v_due);
END;
$$ LANGUAGE plpgsql;


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
    ON CONFLICT (dispensary_id, (role || '')) DO UPDATE
    SET priority = excluded.priority,
        due_at = excluded.due_at,
        recheck_at = excluded.recheck_at,
        platform = excluded.platform
    WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
      IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform)
    RETURNING h.role, h.platform, h.priority, h.due_at
  )
  -- No head below its floor: one call per floor written, which reads unless it must lower.
  SELECT count(*) INTO v_lowered
  FROM (SELECT w.role, w.platform, w.priority, min(w.due_at) AS due
        FROM written w
        GROUP BY w.role, w.platform, w.priority
        ORDER BY w.role, w.platform, w.priority) m
  WHERE tq_lower_floor(m.role, m.platform, m.priority, m.due);
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

DROP INDEX IF EXISTS idx_worker_task_floors;
CREATE INDEX IF NOT EXISTS idx_worker_task_floors_key ON worker_task_floors (role, platform, priority);

-- A head was written (due p_due) under this floor: keep the floor at or below it. Almost always
-- a read finds a row at or below the head, and nothing is written; the shared lock, held to the
-- writer's commit, keeps every raise away until the head is visible to it. A claim raising this
-- floor holds the lock exclusively to its commit: the writer polls for it (never queued behind
-- the claim) for up to 20 ms. When the lock is not had by then (a claim in a long transaction),
-- or the transaction reads an older snapshot than its statement's, or no row is low enough, the
-- writer adds a row at its head's due time, which a raise that did not read it leaves alone.
-- True when it wrote.
CREATE OR REPLACE FUNCTION tq_lower_floor(p_role VARCHAR, p_platform VARCHAR, p_priority INTEGER, p_due TIMESTAMPTZ)
RETURNS BOOLEAN AS $$
DECLARE
  v_key INTEGER;
BEGIN
  IF p_due IS NULL THEN
    RETURN false;
  END IF;
  IF current_setting('transaction_isolation') = 'read committed' THEN
    v_key := tq_floor_lock_key(p_role, p_platform, p_priority);
    FOR attempt IN 1..20 LOOP
      IF pg_try_advisory_xact_lock_shared(hashtext('worker_task_floors'), v_key) THEN
        PERFORM 1
        FROM worker_task_floors f
        WHERE f.role = p_role AND f.platform = p_platform AND f.priority = p_priority AND f.floor <= p_due;
        IF FOUND THEN
          RETURN false;
        END IF;
        EXIT;
      END IF;
      PERFORM pg_sleep(0.001);
    END LOOP;
  END IF;
  INSERT INTO worker_task_floors (role, platform, priority, floor)
  VALUES (p_role, p_platform, p_priority, p_due);
  RETURN true;
END;
$$ LANGUAGE plpgsql;

-- Workers given as dead whose session has ended: offline, and their active tasks back to
-- pending (a retry spent, as when a lease expires: the handler may have begun), or failed when
-- out of retries. Workers without a session, whose session is alive, or already offline are
-- left alone.
CREATE OR REPLACE FUNCTION release_dead_workers(p_worker_ids VARCHAR(100)[])
RETURNS TABLE (workers INTEGER, recovered INTEGER, failed INTEGER) AS $$
DECLARE
  v_dead VARCHAR[];
BEGIN
  IF p_worker_ids IS NULL OR cardinality(p_worker_ids) > 1000 THEN
    PERFORM tq_refuse('release_dead_workers', 'worker_ids', coalesce(cardinality(p_worker_ids)::TEXT, 'NULL'),
      'must list at most 1000 workers',
      'The ids of workers believed dead (drain runs Dagster marked failed), in batches of up to 1000.');
  END IF;
  -- Offline first: the registry rows stay locked to the commit, so a second caller finds
  -- them offline and releases nothing twice.
  WITH gone AS (
    UPDATE worker_registry w
    SET status = 'offline'
    WHERE w.worker_id = ANY (p_worker_ids)
      AND w.status <> 'offline'
      AND tq_session_alive(w) IS false
    RETURNING w.worker_id
  )
  SELECT array_agg(g.worker_id) INTO v_dead FROM gone g;
  workers := coalesce(cardinality(v_dead), 0);
  recovered := 0;
  failed := 0;
  IF workers > 0 THEN
    WITH active AS (
      -- One branch per partial index over active tasks: the history is not read.
      SELECT t.id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NOT NULL AND t.worker_id = ANY (v_dead)
      UNION ALL
      SELECT t.id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NULL AND t.worker_id = ANY (v_dead)
    ),
    released AS (
      UPDATE worker_tasks t
      SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
          retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
          error_message = format('worker %s is gone (its session ended)', t.worker_id),
          worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
          claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
          started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
          last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
          completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
      FROM active a
      WHERE t.id = a.id
        AND t.status IN ('claimed', 'running')
      RETURNING t.status
    )
    SELECT count(*) FILTER (WHERE r.status = 'pending')::INTEGER,
           count(*) FILTER (WHERE r.status = 'failed')::INTEGER
    INTO recovered, failed
    FROM released r;
  END IF;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
