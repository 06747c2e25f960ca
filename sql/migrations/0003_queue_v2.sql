-- The queue as it is meant to work: repairs the original 074 (see docs/QUEUE.md) and adds what a
-- worker needs. Safe on a fresh database and on one where 074 was applied statement by statement;
-- rows already there are kept.

-- Views are rebuilt below; they pin column types that this migration widens.
DROP VIEW IF EXISTS v_worker_capacity;
DROP VIEW IF EXISTS v_task_history;

------------------------------------------------------------------------------------------------
-- Roles are data: a deployment adds its own with an INSERT. Tasks, workers and claims with a
-- role that is not here are refused instead of waiting forever for a worker that never comes.
------------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS worker_task_roles (
  role VARCHAR(50) PRIMARY KEY,
  description TEXT NOT NULL DEFAULT '',
  -- fail_task backs off retry_base_seconds * 2^retry_count, capped, with jitter.
  retry_base_seconds INTEGER NOT NULL DEFAULT 30 CHECK (retry_base_seconds >= 0),
  retry_cap_seconds INTEGER NOT NULL DEFAULT 3600 CHECK (retry_cap_seconds >= 0)
);

INSERT INTO worker_task_roles (role, description)
VALUES
  ('store_discovery', 'List the stores of a platform'),
  ('entry_point_discovery', 'Resolve a store''s menu entry point'),
  ('product_discovery', 'First crawl of a store''s menu'),
  ('product_resync', 'Daily refresh of a store''s menu'),
  ('analytics_refresh', 'Recompute the analytics')
ON CONFLICT (role) DO NOTHING;

-- Adopted rows keep whatever roles they use.
INSERT INTO worker_task_roles (role)
SELECT role FROM worker_tasks
UNION
SELECT role FROM worker_registry
ON CONFLICT (role) DO NOTHING;

------------------------------------------------------------------------------------------------
-- worker_tasks: fill the NULLs the original allowed but every function assumes away.
------------------------------------------------------------------------------------------------
UPDATE worker_tasks SET priority = 0 WHERE priority IS NULL;
UPDATE worker_tasks SET retry_count = 0 WHERE retry_count IS NULL;
UPDATE worker_tasks SET max_retries = 3 WHERE max_retries IS NULL;
UPDATE worker_tasks SET created_at = coalesce(updated_at, now()) WHERE created_at IS NULL;
UPDATE worker_tasks SET updated_at = created_at WHERE updated_at IS NULL;
-- Nothing ever wrote 'stale', and it is no longer a status; a row holding it is a task to give back.
UPDATE worker_tasks
SET status = 'pending', worker_id = NULL, claimed_at = NULL, started_at = NULL, last_heartbeat_at = NULL
WHERE status = 'stale';

ALTER TABLE worker_tasks
  ALTER COLUMN platform TYPE VARCHAR(50),
  ALTER COLUMN priority SET NOT NULL,
  ALTER COLUMN retry_count SET NOT NULL,
  ALTER COLUMN max_retries SET NOT NULL,
  ALTER COLUMN created_at SET NOT NULL,
  ALTER COLUMN updated_at SET NOT NULL,
  DROP CONSTRAINT IF EXISTS valid_status,
  ADD CONSTRAINT valid_status
    CHECK (status IN ('pending', 'claimed', 'running', 'completed', 'failed', 'cancelled')),
  DROP CONSTRAINT IF EXISTS valid_retries,
  ADD CONSTRAINT valid_retries CHECK (retry_count >= 0 AND max_retries >= 0),
  DROP CONSTRAINT IF EXISTS worker_tasks_role_fkey,
  ADD CONSTRAINT worker_tasks_role_fkey FOREIGN KEY (role) REFERENCES worker_task_roles (role),
  -- The UTC day a resync task belongs to: the key that makes generate_resync_tasks idempotent.
  ADD COLUMN IF NOT EXISTS resync_date DATE,
  -- When the task may run: its schedule, else its creation. Claim order is priority, then due_at.
  ADD COLUMN IF NOT EXISTS due_at TIMESTAMPTZ
    GENERATED ALWAYS AS (coalesce(scheduled_for, created_at)) STORED;

ALTER TABLE worker_registry
  DROP CONSTRAINT IF EXISTS worker_registry_role_fkey,
  ADD CONSTRAINT worker_registry_role_fkey FOREIGN KEY (role) REFERENCES worker_task_roles (role);

-- Indexes. Every claim, start and completion rewrites index entries (status is in the partial
-- predicates), so the original's unused or replaced indexes go. idx_worker_tasks_running indexed
-- last_heartbeat_at, which made every heartbeat a non-HOT update.
DROP INDEX IF EXISTS idx_worker_tasks_pending;
DROP INDEX IF EXISTS idx_worker_tasks_scheduled;
DROP INDEX IF EXISTS idx_worker_tasks_claimed;
DROP INDEX IF EXISTS idx_worker_tasks_running;
DROP INDEX IF EXISTS idx_worker_tasks_history;

-- A store's pending work for a role, best first (the claim's pick within a store) ...
CREATE INDEX IF NOT EXISTS idx_worker_tasks_store_pending
  ON worker_tasks (dispensary_id, role, priority DESC, due_at, id)
  WHERE status = 'pending' AND dispensary_id IS NOT NULL;
-- ... and earliest due (the store's next due time).
CREATE INDEX IF NOT EXISTS idx_worker_tasks_store_due
  ON worker_tasks (dispensary_id, role, due_at)
  WHERE status = 'pending' AND dispensary_id IS NOT NULL;
-- Tasks without a store (store_discovery, analytics_refresh) are claimed straight from here.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_loose_pending
  ON worker_tasks (role, priority DESC, due_at, id)
  WHERE status = 'pending' AND dispensary_id IS NULL;
-- Active tasks without a store; those with one are in idx_worker_tasks_unique_active_store. With
-- the pending indexes above they cover all unfinished work: capacity counts and stale recovery
-- never walk history. (One index over all unfinished work would cost every claim, start and
-- completion an extra index entry.)
CREATE INDEX IF NOT EXISTS idx_worker_tasks_loose_active
  ON worker_tasks (worker_id)
  WHERE status IN ('claimed', 'running') AND dispensary_id IS NULL;
-- Finished work by time: capacity's last hour and the hourly rollup.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_finished
  ON worker_tasks (completed_at)
  WHERE status IN ('completed', 'failed');
-- v_task_history's order.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_created
  ON worker_tasks (created_at DESC, id DESC);
CREATE UNIQUE INDEX IF NOT EXISTS idx_worker_tasks_resync_once
  ON worker_tasks (role, dispensary_id, resync_date)
  WHERE resync_date IS NOT NULL;

------------------------------------------------------------------------------------------------
-- Per-store state, kept by triggers so that every writer keeps it true.
--
-- A claim must find an idle store with due work without walking the pending tasks of busy
-- stores. worker_task_stores holds each store's active task; its row lock serialises everything
-- that touches the store's claim state. worker_task_heads holds, per store and role with pending
-- work, the claim-order key (priority, due_at) of the store's best due task, else of its next
-- task to come due; recheck_at is when a task not yet due could overtake that head. A claim
-- reads heads in claim order, so a busy store costs it one row, not one per pending task.
------------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS worker_task_stores (
  dispensary_id INTEGER PRIMARY KEY REFERENCES dispensaries (id) ON DELETE CASCADE,
  active_task_id INTEGER
);

CREATE TABLE IF NOT EXISTS worker_task_heads (
  role VARCHAR(50) NOT NULL,
  dispensary_id INTEGER NOT NULL REFERENCES worker_task_stores (dispensary_id) ON DELETE CASCADE,
  priority INTEGER NOT NULL,
  due_at TIMESTAMPTZ NOT NULL,
  recheck_at TIMESTAMPTZ,
  PRIMARY KEY (role, dispensary_id)
);

CREATE INDEX IF NOT EXISTS idx_worker_task_heads_order
  ON worker_task_heads (role, priority DESC, due_at, dispensary_id);
CREATE INDEX IF NOT EXISTS idx_worker_task_heads_recheck
  ON worker_task_heads (role, recheck_at)
  WHERE recheck_at IS NOT NULL;

-- Re-derive the heads of the given (store, role) pairs from their pending tasks. Callers hold
-- the stores' row locks.
CREATE OR REPLACE FUNCTION tq_refresh_heads(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
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
      (SELECT min(t.due_at)
       FROM worker_tasks t
       WHERE t.dispensary_id = k.dispensary_id
         AND t.role = k.role
         AND t.status = 'pending'
         AND t.due_at > greatest(now(), h.due_at)
         AND t.priority > h.priority) AS recheck_at
    FROM keys k
    LEFT JOIN LATERAL (
      SELECT c.priority, c.due_at
      FROM (
        -- the best due task in claim order ...
        (SELECT t.priority, t.due_at
         FROM worker_tasks t
         WHERE t.dispensary_id = k.dispensary_id
           AND t.role = k.role
           AND t.status = 'pending'
           AND t.due_at <= now()
         ORDER BY t.priority DESC, t.due_at, t.id
         LIMIT 1)
        UNION ALL
        -- ... else the next to come due
        (SELECT t.priority, t.due_at
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
  )
  INSERT INTO worker_task_heads AS h (role, dispensary_id, priority, due_at, recheck_at)
  SELECT f.role, f.dispensary_id, f.priority, f.due_at, f.recheck_at
  FROM fresh f
  WHERE f.priority IS NOT NULL
  ORDER BY f.dispensary_id, f.role
  ON CONFLICT (role, dispensary_id) DO UPDATE
  SET priority = excluded.priority,
      due_at = excluded.due_at,
      recheck_at = excluded.recheck_at
  WHERE (h.priority, h.due_at, h.recheck_at)
    IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at);
END;
$$ LANGUAGE plpgsql
-- Array arguments make the planner try a custom plan on every call; the generic one is as
-- good here, and re-planning cost about half of a claim.
SET plan_cache_mode = force_generic_plan;

-- Lock the given stores' rows in store order (so that two such lockers cannot deadlock) and
-- re-derive their heads. A claim holding a store's row makes us wait; claims never wait for us.
CREATE OR REPLACE FUNCTION tq_lock_and_refresh(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
BEGIN
  IF p_stores IS NULL THEN
    RETURN;
  END IF;
  PERFORM 1
  FROM worker_task_stores s
  WHERE s.dispensary_id = ANY (p_stores)
  ORDER BY s.dispensary_id
  FOR UPDATE;
  PERFORM tq_refresh_heads(p_stores, p_roles);
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_inserted() RETURNS TRIGGER AS $$
BEGIN
  INSERT INTO worker_task_stores (dispensary_id)
  SELECT DISTINCT dispensary_id FROM new_tasks WHERE dispensary_id IS NOT NULL
  ON CONFLICT (dispensary_id) DO NOTHING;

  -- Rows inserted as already active (only direct INSERTs do that) make their store busy.
  UPDATE worker_task_stores s
  SET active_task_id = n.id
  FROM new_tasks n
  WHERE n.status IN ('claimed', 'running')
    AND s.dispensary_id = n.dispensary_id;

  PERFORM tq_lock_and_refresh(array_agg(p.dispensary_id), array_agg(p.role))
  FROM (
    SELECT DISTINCT dispensary_id, role FROM new_tasks
    WHERE status = 'pending' AND dispensary_id IS NOT NULL
  ) p;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

-- One call per UPDATE statement, set-based: a claim or completion of 20 tasks costs a few
-- statements here, not 20 trigger calls.
CREATE OR REPLACE FUNCTION tq_tasks_updated() RETURNS TRIGGER AS $$
DECLARE
  v_moved BOOLEAN;
  v_freed BOOLEAN;
  v_busied BOOLEAN;
  v_queue_changed BOOLEAN;
BEGIN
  -- One pass to learn what changed, so that a start or a heartbeat costs one statement here.
  SELECT
    coalesce(bool_or(n.dispensary_id IS NOT NULL AND n.dispensary_id IS DISTINCT FROM o.dispensary_id), false),
    coalesce(bool_or(
      o.status IN ('claimed', 'running') AND o.dispensary_id IS NOT NULL
      AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
    ), false),
    coalesce(bool_or(
      n.status IN ('claimed', 'running') AND n.dispensary_id IS NOT NULL
      AND (o.status NOT IN ('claimed', 'running') OR o.dispensary_id IS DISTINCT FROM n.dispensary_id)
    ), false),
    coalesce(bool_or(
      (o.status = 'pending' OR n.status = 'pending')
      AND coalesce(o.dispensary_id, n.dispensary_id) IS NOT NULL
      AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at)
          IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at)
    ), false)
  INTO v_moved, v_freed, v_busied, v_queue_changed
  FROM old_tasks o
  JOIN new_tasks n ON n.id = o.id;

  IF v_moved THEN
    -- A task moved to a store never seen before (only direct UPDATEs do that).
    INSERT INTO worker_task_stores (dispensary_id)
    SELECT DISTINCT n.dispensary_id
    FROM new_tasks n
    JOIN old_tasks o ON o.id = n.id
    WHERE n.dispensary_id IS NOT NULL
      AND n.dispensary_id IS DISTINCT FROM o.dispensary_id
    ON CONFLICT (dispensary_id) DO NOTHING;
  END IF;

  IF v_freed THEN
    -- Stores whose active task finished, went back to pending, was cancelled or moved: idle.
    -- Locked in store order first, like every other multi-store locker (tq_lock_and_refresh),
    -- so that a batch completion or recovery cannot deadlock with a bulk insert.
    PERFORM 1
    FROM worker_task_stores s
    WHERE s.dispensary_id IN (
        SELECT o.dispensary_id
        FROM old_tasks o
        JOIN new_tasks n ON n.id = o.id
        WHERE o.status IN ('claimed', 'running')
          AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
      )
    ORDER BY s.dispensary_id
    FOR UPDATE;
    UPDATE worker_task_stores s
    SET active_task_id = NULL
    FROM old_tasks o
    JOIN new_tasks n ON n.id = o.id
    WHERE o.status IN ('claimed', 'running')
      AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
      AND s.dispensary_id = o.dispensary_id
      AND s.active_task_id = o.id;
  END IF;

  IF v_busied THEN
    -- Stores whose task became active: busy. (Claims already hold these rows' locks.)
    UPDATE worker_task_stores s
    SET active_task_id = n.id
    FROM new_tasks n
    JOIN old_tasks o ON o.id = n.id
    WHERE n.status IN ('claimed', 'running')
      AND (o.status NOT IN ('claimed', 'running') OR o.dispensary_id IS DISTINCT FROM n.dispensary_id)
      AND s.dispensary_id = n.dispensary_id;
  END IF;

  IF v_queue_changed THEN
    -- Heads of every (store, role) whose pending work changed: a task left it (claimed,
    -- cancelled, moved) or joined it (a retry, a recovery) or changed its place in claim order.
    PERFORM tq_lock_and_refresh(array_agg(k.dispensary_id), array_agg(k.role))
    FROM (
      SELECT o.dispensary_id, o.role
      FROM old_tasks o
      JOIN new_tasks n ON n.id = o.id
      WHERE o.status = 'pending'
        AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at)
            IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at)
      UNION
      SELECT n.dispensary_id, n.role
      FROM new_tasks n
      JOIN old_tasks o ON o.id = n.id
      WHERE n.status = 'pending'
        AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at)
            IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at)
    ) k
    WHERE k.dispensary_id IS NOT NULL;
  END IF;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_deleted() RETURNS TRIGGER AS $$
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
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_truncated() RETURNS TRIGGER AS $$
BEGIN
  DELETE FROM worker_task_heads;
  UPDATE worker_task_stores SET active_task_id = NULL WHERE active_task_id IS NOT NULL;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS worker_tasks_inserted ON worker_tasks;
CREATE TRIGGER worker_tasks_inserted
  AFTER INSERT ON worker_tasks
  REFERENCING NEW TABLE AS new_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_inserted();

DROP TRIGGER IF EXISTS worker_tasks_updated ON worker_tasks;
CREATE TRIGGER worker_tasks_updated
  AFTER UPDATE ON worker_tasks
  REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_updated();

DROP TRIGGER IF EXISTS worker_tasks_deleted ON worker_tasks;
CREATE TRIGGER worker_tasks_deleted
  AFTER DELETE ON worker_tasks
  REFERENCING OLD TABLE AS old_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_deleted();

DROP TRIGGER IF EXISTS worker_tasks_truncated ON worker_tasks;
CREATE TRIGGER worker_tasks_truncated
  AFTER TRUNCATE ON worker_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_truncated();

CREATE OR REPLACE FUNCTION update_worker_tasks_timestamp() RETURNS TRIGGER AS $$
BEGIN
  NEW.updated_at = now();
  RETURN NEW;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS worker_tasks_updated_at ON worker_tasks;
CREATE TRIGGER worker_tasks_updated_at
  BEFORE UPDATE ON worker_tasks
  FOR EACH ROW
  EXECUTE FUNCTION update_worker_tasks_timestamp();

-- Adopted rows: build the state they imply (the triggers above keep it from here on).
INSERT INTO worker_task_stores (dispensary_id)
SELECT DISTINCT dispensary_id FROM worker_tasks WHERE dispensary_id IS NOT NULL
ON CONFLICT (dispensary_id) DO NOTHING;

UPDATE worker_task_stores s
SET active_task_id = t.id
FROM worker_tasks t
WHERE t.dispensary_id = s.dispensary_id
  AND t.status IN ('claimed', 'running');

SELECT tq_refresh_heads(array_agg(dispensary_id), array_agg(role))
FROM (SELECT DISTINCT dispensary_id, role FROM worker_tasks WHERE status = 'pending' AND dispensary_id IS NOT NULL) p;

------------------------------------------------------------------------------------------------
-- Argument checks shared by the functions below. SQLSTATE 22023 (invalid_parameter_value).
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_require_role(p_role VARCHAR) RETURNS VOID AS $$
BEGIN
  IF p_role IS NULL OR NOT EXISTS (SELECT 1 FROM worker_task_roles WHERE role = p_role) THEN
    RAISE EXCEPTION 'unknown role: %', coalesce(quote_literal(p_role), 'NULL')
      USING ERRCODE = '22023',
            HINT = 'known roles: ' || (SELECT string_agg(role, ', ' ORDER BY role) FROM worker_task_roles);
  END IF;
END;
$$ LANGUAGE plpgsql STABLE;

CREATE OR REPLACE FUNCTION tq_require_worker(p_worker_id VARCHAR) RETURNS VOID AS $$
BEGIN
  IF p_worker_id IS NULL OR btrim(p_worker_id) = '' THEN
    RAISE EXCEPTION 'worker_id must not be empty' USING ERRCODE = '22023';
  END IF;
END;
$$ LANGUAGE plpgsql IMMUTABLE;

------------------------------------------------------------------------------------------------
-- Claiming
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION claim_tasks(
  p_role VARCHAR,
  p_worker_id VARCHAR,
  p_max_tasks INTEGER,
  p_start BOOLEAN DEFAULT false
) RETURNS SETOF worker_tasks AS $$
DECLARE
  v_want INTEGER := p_max_tasks;
  v_stores INTEGER[];
  v_loose INTEGER[];
  v_skip INTEGER[] := '{}';
  v_claimed INTEGER;
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  IF p_max_tasks IS NULL OR p_max_tasks NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'max_tasks must be between 1 and 1000, got %', coalesce(p_max_tasks::TEXT, 'NULL')
      USING ERRCODE = '22023';
  END IF;

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
    -- Idle stores with due work, from the heads, and store-less tasks, best first overall.
    -- Locking the store row serialises the claims of one store: a claim that loses the race
    -- skips the store instead of tripping over idx_worker_tasks_unique_active_store.
    WITH by_store AS (
      SELECT h.priority, h.due_at, h.dispensary_id, NULL::INTEGER AS task_id
      FROM worker_task_heads h
      JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
      WHERE h.role = p_role
        AND h.due_at <= now()
        AND s.active_task_id IS NULL
        AND h.dispensary_id <> ALL (v_skip)
      ORDER BY h.priority DESC, h.due_at, h.dispensary_id
      LIMIT v_want
      FOR UPDATE OF s SKIP LOCKED
    ),
    loose AS (
      SELECT t.priority, t.due_at, NULL::INTEGER AS dispensary_id, t.id AS task_id
      FROM worker_tasks t
      WHERE t.role = p_role
        AND t.status = 'pending'
        AND t.dispensary_id IS NULL
        AND t.due_at <= now()
      ORDER BY t.priority DESC, t.due_at, t.id
      LIMIT v_want
      FOR UPDATE OF t SKIP LOCKED
    ),
    best AS (
      SELECT * FROM by_store
      UNION ALL
      SELECT * FROM loose
      ORDER BY priority DESC, due_at
      LIMIT v_want
    )
    SELECT
      array_agg(dispensary_id) FILTER (WHERE dispensary_id IS NOT NULL),
      array_agg(task_id) FILTER (WHERE task_id IS NOT NULL)
    INTO v_stores, v_loose
    FROM best;

    IF v_stores IS NULL AND v_loose IS NULL THEN
      IF cardinality(v_skip) = 0 THEN
        -- Checked here, off the hot path: an unknown role is an error, not an empty queue.
        PERFORM tq_require_role(p_role);
      END IF;
      RETURN;
    END IF;

    -- The statement trigger marks the stores busy and re-derives their heads.
    RETURN QUERY
    WITH picked AS (
      SELECT t.id
      FROM unnest(v_stores) AS s (dispensary_id)
      CROSS JOIN LATERAL (
        SELECT t.id
        FROM worker_tasks t
        WHERE t.dispensary_id = s.dispensary_id
          AND t.role = p_role
          AND t.status = 'pending'
          AND t.due_at <= now()
        ORDER BY t.priority DESC, t.due_at, t.id
        LIMIT 1
        FOR UPDATE OF t SKIP LOCKED
      ) t
      UNION ALL
      SELECT unnest(v_loose)
    ),
    claimed AS (
      UPDATE worker_tasks t
      SET status = CASE WHEN p_start THEN 'running' ELSE 'claimed' END,
          worker_id = p_worker_id,
          claimed_at = now(),
          started_at = CASE WHEN p_start THEN now() END,
          completed_at = NULL,
          -- A fresh lease: a recovered task's old heartbeat must not count against its new owner.
          last_heartbeat_at = now()
      FROM picked p
      WHERE t.id = p.id
      RETURNING t.*
    )
    SELECT * FROM claimed c ORDER BY c.priority DESC, c.due_at, c.id;

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

-- The original single claim, kept for old callers. Returns NULL when nothing is due (a row of
-- NULLs under SELECT *); claim_tasks returns no row instead.
CREATE OR REPLACE FUNCTION claim_task(p_role VARCHAR, p_worker_id VARCHAR) RETURNS worker_tasks AS $$
DECLARE
  v_task worker_tasks;
BEGIN
  SELECT * INTO v_task FROM claim_tasks(p_role, p_worker_id, 1, false);
  RETURN v_task;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- A worker's calls on its tasks. Each is fenced: it acts only while the task is claimed or
-- running by that worker, and otherwise changes nothing and says so (false, NULL, or a shorter
-- array).
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION start_task(p_task_id INTEGER, p_worker_id VARCHAR) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'running',
      started_at = coalesce(started_at, now()),
      last_heartbeat_at = now()
  WHERE id = p_task_id
    AND worker_id = p_worker_id
    AND status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION start_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[]) RETURNS INTEGER[] AS $$
DECLARE
  v_started INTEGER[];
BEGIN
  WITH started AS (
    UPDATE worker_tasks
    SET status = 'running',
        started_at = coalesce(started_at, now()),
        last_heartbeat_at = now()
    WHERE id = ANY (p_task_ids)
      AND worker_id = p_worker_id
      AND status IN ('claimed', 'running')
    RETURNING id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_started FROM started;
  RETURN v_started;
END;
$$ LANGUAGE plpgsql;

-- Returns the ids still owned, so that a worker learns which leases it lost.
CREATE OR REPLACE FUNCTION heartbeat_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[]) RETURNS INTEGER[] AS $$
DECLARE
  v_owned INTEGER[];
BEGIN
  WITH owned AS (
    UPDATE worker_tasks
    SET last_heartbeat_at = now()
    WHERE id = ANY (p_task_ids)
      AND worker_id = p_worker_id
      AND status IN ('claimed', 'running')
    RETURNING id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_owned FROM owned;

  UPDATE worker_registry
  SET last_heartbeat_at = now(),
      status = CASE WHEN cardinality(v_owned) > 0 THEN 'active' ELSE 'idle' END
  WHERE worker_id = p_worker_id;
  RETURN v_owned;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_task(p_task_id INTEGER, p_worker_id VARCHAR, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'completed',
      result = p_result,
      started_at = coalesce(started_at, claimed_at),
      completed_at = now()
  WHERE id = p_task_id
    AND worker_id = p_worker_id
    AND status IN ('claimed', 'running');
  IF NOT FOUND THEN
    RETURN false;
  END IF;

  UPDATE worker_registry
  SET tasks_completed = tasks_completed + 1, last_heartbeat_at = now()
  WHERE worker_id = p_worker_id;
  RETURN true;
END;
$$ LANGUAGE plpgsql;

-- Completes many tasks in one transaction; returns the ids it completed.
CREATE OR REPLACE FUNCTION complete_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[], p_results JSONB[])
RETURNS INTEGER[] AS $$
DECLARE
  v_done INTEGER[];
BEGIN
  IF cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_results) THEN
    RAISE EXCEPTION 'complete_tasks: % task ids but % results',
      cardinality(p_task_ids), cardinality(p_results)
      USING ERRCODE = '22023';
  END IF;

  WITH done AS (
    UPDATE worker_tasks t
    SET status = 'completed',
        result = r.result,
        started_at = coalesce(t.started_at, t.claimed_at),
        completed_at = now()
    FROM unnest(p_task_ids, p_results) AS r (id, result)
    WHERE t.id = r.id
      AND t.worker_id = p_worker_id
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_done FROM done;

  IF cardinality(v_done) > 0 THEN
    UPDATE worker_registry
    SET tasks_completed = tasks_completed + cardinality(v_done), last_heartbeat_at = now()
    WHERE worker_id = p_worker_id;
  END IF;
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

-- Backoff before retry number p_retry_count + 1: base * 2^retries, capped, with jitter in
-- [50%, 100%] so that tasks that failed together do not come back together.
CREATE OR REPLACE FUNCTION tq_retry_delay(p_role VARCHAR, p_retry_count INTEGER) RETURNS INTERVAL AS $$
  SELECT make_interval(secs =>
    least(r.retry_base_seconds * power(2, least(p_retry_count, 30)), r.retry_cap_seconds)
    * (0.5 + random() / 2))
  FROM worker_task_roles r
  WHERE r.role = p_role;
$$ LANGUAGE sql VOLATILE;

-- Returns the task's new status: 'pending' (to be retried after a backoff) while retries remain
-- and the error is retryable, else 'failed'; NULL when the worker does not own the task.
CREATE OR REPLACE FUNCTION fail_task(
  p_task_id INTEGER,
  p_worker_id VARCHAR,
  p_error TEXT,
  p_retryable BOOLEAN DEFAULT true
) RETURNS TEXT AS $$
DECLARE
  v_again BOOLEAN;
  v_status TEXT;
BEGIN
  SELECT coalesce(p_retryable, true) AND t.retry_count < t.max_retries
  INTO v_again
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.worker_id = p_worker_id
    AND t.status IN ('claimed', 'running')
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;

  IF v_again THEN
    UPDATE worker_tasks t
    SET status = 'pending',
        retry_count = t.retry_count + 1,
        scheduled_for = now() + tq_retry_delay(t.role, t.retry_count),
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

  UPDATE worker_registry
  SET tasks_failed = tasks_failed + 1, last_heartbeat_at = now()
  WHERE worker_id = p_worker_id;
  RETURN v_status;
END;
$$ LANGUAGE plpgsql;

-- Cancels a task that has not finished. An owner learns of it at its next heartbeat, and its
-- complete_task/fail_task calls are refused.
CREATE OR REPLACE FUNCTION cancel_task(p_task_id INTEGER) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'cancelled',
      completed_at = now()
  WHERE id = p_task_id
    AND status IN ('pending', 'claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Workers and recovery
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION register_worker(
  p_worker_id VARCHAR,
  p_role VARCHAR,
  p_pod_name VARCHAR DEFAULT NULL,
  p_hostname VARCHAR DEFAULT NULL
) RETURNS VOID AS $$
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  PERFORM tq_require_role(p_role);
  INSERT INTO worker_registry AS w (worker_id, role, pod_name, hostname, started_at, last_heartbeat_at, status)
  VALUES (p_worker_id, p_role, p_pod_name, p_hostname, now(), now(), 'active')
  ON CONFLICT (worker_id) DO UPDATE
  SET role = excluded.role,
      pod_name = excluded.pod_name,
      hostname = excluded.hostname,
      started_at = now(),
      last_heartbeat_at = now(),
      status = 'active';
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION deregister_worker(p_worker_id VARCHAR) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_registry
  SET status = 'offline', last_heartbeat_at = now()
  WHERE worker_id = p_worker_id
    AND status <> 'offline';
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- Gives back the tasks of workers silent for longer than the threshold, counted from their last
-- sign of life (heartbeat, else start, else claim); a task out of retries fails instead. Workers
-- silent as long are marked offline.
CREATE OR REPLACE FUNCTION recover_stale_tasks_report(stale_threshold_minutes INTEGER DEFAULT 10)
RETURNS TABLE (recovered INTEGER, failed INTEGER, workers_offline INTEGER) AS $$
DECLARE
  v_cutoff TIMESTAMPTZ;
BEGIN
  IF stale_threshold_minutes IS NULL OR stale_threshold_minutes < 1 THEN
    RAISE EXCEPTION 'stale_threshold_minutes must be at least 1, got %',
      coalesce(stale_threshold_minutes::TEXT, 'NULL')
      USING ERRCODE = '22023';
  END IF;
  v_cutoff := now() - make_interval(mins => stale_threshold_minutes);

  WITH expired AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
        retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
        error_message = format('lease expired: worker %s silent for over %s minutes',
                               t.worker_id, stale_threshold_minutes),
        worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
        claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
        last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
        completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
    WHERE t.id IN (
        -- One branch per partial index over active tasks.
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NOT NULL
        UNION ALL
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NULL
      )
      AND t.status IN ('claimed', 'running')
      AND coalesce(t.last_heartbeat_at, t.started_at, t.claimed_at, t.updated_at) < v_cutoff
    RETURNING t.status
  )
  SELECT
    count(*) FILTER (WHERE e.status = 'pending'),
    count(*) FILTER (WHERE e.status = 'failed')
  INTO recovered, failed
  FROM expired e;

  UPDATE worker_registry
  SET status = 'offline'
  WHERE status <> 'offline'
    AND last_heartbeat_at < v_cutoff;
  GET DIAGNOSTICS workers_offline = ROW_COUNT;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION recover_stale_tasks(stale_threshold_minutes INTEGER DEFAULT 10)
RETURNS INTEGER AS $$
BEGIN
  RETURN (SELECT r.recovered FROM recover_stale_tasks_report(stale_threshold_minutes) r);
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Daily resync
------------------------------------------------------------------------------------------------
DROP FUNCTION IF EXISTS generate_resync_tasks(INTEGER, DATE);

-- One product_resync task per enabled store of the given platforms for the UTC day p_date, spread
-- evenly over that day in p_batches_per_day batches (6: 00:00, 04:00, ..., 20:00 UTC). Idempotent
-- per store and date, also under concurrent calls. Returns the number of tasks created.
CREATE OR REPLACE FUNCTION generate_resync_tasks(
  p_batches_per_day INTEGER DEFAULT 6,
  p_date DATE DEFAULT (now() AT TIME ZONE 'UTC')::DATE,
  p_platforms TEXT[] DEFAULT '{dutchie}'
) RETURNS INTEGER AS $$
DECLARE
  v_created INTEGER;
BEGIN
  IF p_batches_per_day IS NULL OR p_batches_per_day NOT BETWEEN 1 AND 24 THEN
    RAISE EXCEPTION 'batches_per_day must be between 1 and 24, got %',
      coalesce(p_batches_per_day::TEXT, 'NULL')
      USING ERRCODE = '22023';
  END IF;
  IF p_date IS NULL THEN
    RAISE EXCEPTION 'date must not be NULL' USING ERRCODE = '22023';
  END IF;
  IF p_platforms IS NULL OR cardinality(p_platforms) = 0 THEN
    RAISE EXCEPTION 'platforms must name at least one platform' USING ERRCODE = '22023';
  END IF;

  WITH stores AS (
    SELECT
      d.id,
      d.menu_type,
      row_number() OVER (ORDER BY d.id) - 1 AS n,
      count(*) OVER () AS total
    FROM dispensaries d
    WHERE d.crawl_enabled
      AND d.menu_type = ANY (p_platforms)
      AND d.platform_dispensary_id IS NOT NULL
  )
  INSERT INTO worker_tasks (role, dispensary_id, platform, scheduled_for, priority, resync_date)
  SELECT
    'product_resync',
    s.id,
    s.menu_type,
    (p_date::TIMESTAMP AT TIME ZONE 'UTC')
      + (s.n * p_batches_per_day / s.total) * (INTERVAL '24 hours' / p_batches_per_day),
    0,
    p_date
  FROM stores s
  ORDER BY s.id
  ON CONFLICT (role, dispensary_id, resync_date) WHERE resync_date IS NOT NULL DO NOTHING;
  GET DIAGNOSTICS v_created = ROW_COUNT;
  RETURN v_created;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Hourly rollup. Hours are UTC hours whatever the session TimeZone.
------------------------------------------------------------------------------------------------
ALTER TABLE task_completion_log
  ALTER COLUMN date SET DEFAULT (now() AT TIME ZONE 'UTC')::DATE,
  ALTER COLUMN hour SET DEFAULT extract(HOUR FROM now() AT TIME ZONE 'UTC')::INTEGER,
  DROP CONSTRAINT IF EXISTS valid_hour,
  ADD CONSTRAINT valid_hour CHECK (hour BETWEEN 0 AND 23);

-- Recomputes one UTC hour's per-role row from worker_tasks (every known role gets a row, zeros
-- included, so that plots have no gaps) and returns the number of rows written. Idempotent.
CREATE OR REPLACE FUNCTION refresh_task_completion_log(p_date DATE, p_hour INTEGER)
RETURNS INTEGER AS $$
DECLARE
  v_start TIMESTAMPTZ;
  v_rows INTEGER;
BEGIN
  IF p_date IS NULL OR p_hour IS NULL OR p_hour NOT BETWEEN 0 AND 23 THEN
    RAISE EXCEPTION 'need a date and an hour from 0 to 23, got % %',
      coalesce(p_date::TEXT, 'NULL'), coalesce(p_hour::TEXT, 'NULL')
      USING ERRCODE = '22023';
  END IF;
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

------------------------------------------------------------------------------------------------
-- Views: the original columns, computed from unfinished work and the last hour only.
------------------------------------------------------------------------------------------------
CREATE VIEW v_worker_capacity AS
WITH unfinished AS (
  -- One branch per partial index, so that history is never scanned.
  SELECT role, status, due_at, worker_id FROM worker_tasks
  WHERE status = 'pending' AND dispensary_id IS NOT NULL
  UNION ALL
  SELECT role, status, due_at, worker_id FROM worker_tasks
  WHERE status = 'pending' AND dispensary_id IS NULL
  UNION ALL
  SELECT role, status, due_at, worker_id FROM worker_tasks
  WHERE status IN ('claimed', 'running') AND dispensary_id IS NOT NULL
  UNION ALL
  SELECT role, status, due_at, worker_id FROM worker_tasks
  WHERE status IN ('claimed', 'running') AND dispensary_id IS NULL
),
live AS (
  SELECT
    role,
    count(*) FILTER (WHERE status = 'pending') AS pending_tasks,
    count(*) FILTER (WHERE status = 'pending' AND due_at <= now()) AS ready_tasks,
    count(*) FILTER (WHERE status = 'claimed') AS claimed_tasks,
    count(*) FILTER (WHERE status = 'running') AS running_tasks,
    count(DISTINCT worker_id) FILTER (WHERE status IN ('claimed', 'running')) AS active_workers
  FROM unfinished
  GROUP BY role
),
recent AS (
  SELECT
    role,
    count(*) FILTER (WHERE status = 'completed') AS completed_last_hour,
    count(*) FILTER (WHERE status = 'failed') AS failed_last_hour,
    avg(extract(EPOCH FROM completed_at - started_at)) FILTER (WHERE status = 'completed') AS avg_duration_sec
  FROM worker_tasks
  WHERE status IN ('completed', 'failed')
    AND completed_at > now() - INTERVAL '1 hour'
  GROUP BY role
)
SELECT
  r.role,
  coalesce(l.pending_tasks, 0) AS pending_tasks,
  coalesce(l.ready_tasks, 0) AS ready_tasks,
  coalesce(l.claimed_tasks, 0) AS claimed_tasks,
  coalesce(l.running_tasks, 0) AS running_tasks,
  coalesce(c.completed_last_hour, 0) AS completed_last_hour,
  coalesce(c.failed_last_hour, 0) AS failed_last_hour,
  coalesce(l.active_workers, 0) AS active_workers,
  c.avg_duration_sec,
  CASE
    WHEN c.completed_last_hour > 0 THEN 3600.0 / nullif(c.avg_duration_sec, 0)
  END AS tasks_per_worker_hour,
  CASE
    WHEN l.active_workers > 0 AND c.completed_last_hour > 0
    THEN l.pending_tasks / nullif(l.active_workers * (3600.0 / nullif(c.avg_duration_sec, 0)), 0)
  END AS estimated_hours_to_drain
FROM worker_task_roles r
LEFT JOIN live l ON l.role = r.role
LEFT JOIN recent c ON c.role = r.role;

CREATE VIEW v_task_history AS
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
  extract(EPOCH FROM (t.completed_at - t.started_at)) AS duration_sec
FROM worker_tasks t
LEFT JOIN dispensaries d ON d.id = t.dispensary_id
ORDER BY t.created_at DESC, t.id DESC;

COMMENT ON TABLE worker_tasks IS 'Central task queue for all worker roles';
COMMENT ON TABLE worker_registry IS 'Registry of workers: heartbeats and completed/failed counts';
COMMENT ON TABLE task_completion_log IS 'Hourly (UTC) per-role task completion metrics';
COMMENT ON TABLE worker_task_roles IS 'Known task roles and their retry backoff';
COMMENT ON TABLE worker_task_stores IS 'Per-store claim state: the active task, if any (kept by triggers)';
COMMENT ON TABLE worker_task_heads IS 'Per role and store with pending work: the claim-order key of its next task (kept by triggers)';
COMMENT ON VIEW v_worker_capacity IS 'Real-time capacity planning metrics per role';
COMMENT ON VIEW v_task_history IS 'Task history with dispensary details for UI';
COMMENT ON FUNCTION claim_task(VARCHAR, VARCHAR) IS 'Claim the best due task of a role; NULL when none';
COMMENT ON FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN) IS 'Claim (and, with p_start, start) up to N due tasks of a role, at most one per store';
COMMENT ON FUNCTION recover_stale_tasks(INTEGER) IS 'Give back tasks of silent workers; returns how many went back to pending';
COMMENT ON FUNCTION generate_resync_tasks(INTEGER, DATE, TEXT[]) IS 'Create one day''s product_resync tasks in batches; idempotent';
