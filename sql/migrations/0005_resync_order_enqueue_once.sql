-- The daily resync, with each batch's tasks in round-robin platform order. Claims take equally
-- due stores in store order; with a whole batch due at one instant, a batch was one platform
-- after another, and a drain run worked one platform's host at a time (that host's politeness
-- limit became the whole run's) while the other hosts sat idle. Now the tasks of a batch fall
-- due a millisecond apart, platforms in turn: a batch of 10,000 stores opens over 10 seconds.
-- Batches are still even and the call is still idempotent.
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
  ORDER BY s.n
  ON CONFLICT (role, dispensary_id, resync_date) WHERE resync_date IS NOT NULL DO NOTHING;
  GET DIAGNOSTICS v_created = ROW_COUNT;
  RETURN v_created;
END;
$$ LANGUAGE plpgsql;

-- A task unless one of the same role, store and payload is pending or active: for periodic
-- enqueuers and handlers that may run twice. Returns the new id, or NULL when there was one.
-- The advisory lock makes check-then-insert safe between concurrent callers (each statement of
-- a plpgsql function sees what committed before it, so the check after the lock is current).
CREATE OR REPLACE FUNCTION enqueue_task_once(
  p_role VARCHAR,
  p_dispensary_id INTEGER DEFAULT NULL,
  p_platform VARCHAR DEFAULT NULL,
  p_priority INTEGER DEFAULT 0,
  p_scheduled_for TIMESTAMPTZ DEFAULT NULL,
  p_payload JSONB DEFAULT '{}'
) RETURNS INTEGER AS $$
DECLARE
  v_id INTEGER;
BEGIN
  p_payload := coalesce(p_payload, '{}');
  PERFORM pg_advisory_xact_lock(
    hashtext('tq:enqueue_once:' || p_role || ':' || coalesce(p_dispensary_id::TEXT, '-')));
  IF EXISTS (
    SELECT 1
    FROM worker_tasks t
    WHERE t.role = p_role
      AND (t.dispensary_id = p_dispensary_id OR (p_dispensary_id IS NULL AND t.dispensary_id IS NULL))
      AND t.payload = p_payload
      AND t.status IN ('pending', 'claimed', 'running')
  ) THEN
    RETURN NULL;
  END IF;
  INSERT INTO worker_tasks (role, dispensary_id, platform, priority, scheduled_for, payload)
  VALUES (p_role, p_dispensary_id, p_platform, coalesce(p_priority, 0), p_scheduled_for, p_payload)
  RETURNING id INTO v_id;
  RETURN v_id;
END;
$$ LANGUAGE plpgsql;

-- Heartbeats no longer wait on a task whose handler is writing: a handler's transaction holds its
-- task row FOR SHARE (so that recovery cannot give the task away before its commit), and a
-- heartbeat blocked there while holding other rows could deadlock with a completion. A row held
-- that way is the caller's by the last committed state; it is reported owned and beaten next time.
CREATE OR REPLACE FUNCTION heartbeat_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[]) RETURNS INTEGER[] AS $$
DECLARE
  v_owned INTEGER[];
BEGIN
  WITH lockable AS (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id = ANY (p_task_ids)
      AND t.worker_id = p_worker_id
      AND t.status IN ('claimed', 'running')
    ORDER BY t.id
    FOR NO KEY UPDATE SKIP LOCKED
  ),
  beaten AS (
    UPDATE worker_tasks t
    SET last_heartbeat_at = now()
    FROM lockable l
    WHERE t.id = l.id
    RETURNING t.id
  ),
  busy AS (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id = ANY (p_task_ids)
      AND t.worker_id = p_worker_id
      AND t.status IN ('claimed', 'running')
      AND t.id NOT IN (SELECT l.id FROM lockable l)
  )
  SELECT coalesce(array_agg(x.id ORDER BY x.id), '{}') INTO v_owned
  FROM (SELECT b.id FROM beaten b UNION ALL SELECT b.id FROM busy b) x;

  UPDATE worker_registry
  SET last_heartbeat_at = now(),
      status = CASE WHEN cardinality(v_owned) > 0 THEN 'active' ELSE 'idle' END
  WHERE worker_id = p_worker_id;
  RETURN v_owned;
END;
$$ LANGUAGE plpgsql;
