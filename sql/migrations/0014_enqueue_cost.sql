-- 0014: the cost of an enqueue. Each enqueue is one single-row INSERT, and paid for work that only
-- a few INSERTs need; enqueue_task_once besides planned its duplicate check anew on every call.
-- Measured by bench/enqueue_cost.py (docs/BENCHMARKS.md); no guarantee changes:
--
-- - enqueue_task_once looks for a duplicate with one query per kind of task, each of which an
--   index answers (a store's pending tasks, its one active task; the pending and active tasks of
--   no store). The one query with "store = $2 OR ($2 IS NULL AND store IS NULL)" had no plan good
--   for every call: it was planned again on each (a fifth of a millisecond) and then read every
--   task the store ever had. The advisory lock stays: concurrent callers still make one task.
-- - tq_tasks_inserted (after each INSERT statement) reads the new rows once, into arrays, and
--   does only what they need: it set stores busy with an UPDATE joined to the new rows on every
--   INSERT, although only direct INSERTs of active rows have any.
-- - worker_tasks_zplatforms_inserted is a row trigger whose WHEN holds only for a row inserted as
--   holding a platform's slot (direct INSERTs again): a pending task no longer calls anything.
--   tq_platforms_apply sums per platform, so one call per row counts as one call per statement.
-- - tq_lock_and_refresh, given one store's key (one enqueue; a change of one pending task),
--   re-derives that head with tq_refresh_head: the head of tq_refresh_heads, by the same rule,
--   in plain statements on the store's index instead of a join over arrays.
-- - tq_task_platform words its refusal only when it refuses.
--
-- Safe to run twice: every function is replaced, every trigger dropped first.

------------------------------------------------------------------------------------------------
-- enqueue_task_once: a duplicate check per kind of task, each on its index.
------------------------------------------------------------------------------------------------

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
  PERFORM tq_check_task('enqueue_task_once', p_role, p_dispensary_id, p_platform, coalesce(p_priority, 0),
                        p_scheduled_for, NULL, p_payload);
  PERFORM pg_advisory_xact_lock(
    hashtext('tq:enqueue_once:' || p_role || ':' || coalesce(p_dispensary_id::TEXT, '-')));
  -- The same role, store and payload, pending, claimed or running: no new task. Each query's
  -- conditions are those of a partial index, so that one plan serves every call.
  IF p_dispensary_id IS NOT NULL THEN
    IF EXISTS (
         SELECT 1 FROM worker_tasks t  -- idx_worker_tasks_store_pending
         WHERE t.dispensary_id = p_dispensary_id AND t.role = p_role AND t.payload = p_payload
           AND t.status = 'pending' AND t.dispensary_id IS NOT NULL)
       OR EXISTS (
         SELECT 1 FROM worker_tasks t  -- idx_worker_tasks_unique_active_store
         WHERE t.dispensary_id = p_dispensary_id AND t.role = p_role AND t.payload = p_payload
           AND t.status IN ('claimed', 'running') AND t.dispensary_id IS NOT NULL) THEN
      RETURN NULL;
    END IF;
  ELSIF EXISTS (
          SELECT 1 FROM worker_tasks t  -- idx_worker_tasks_loose_pending_platform
          WHERE t.role = p_role AND t.payload = p_payload
            AND t.status = 'pending' AND t.dispensary_id IS NULL)
        OR EXISTS (
          SELECT 1 FROM worker_tasks t  -- idx_worker_tasks_loose_active
          WHERE t.role = p_role AND t.payload = p_payload
            AND t.status IN ('claimed', 'running') AND t.dispensary_id IS NULL) THEN
    RETURN NULL;
  END IF;
  INSERT INTO worker_tasks (role, dispensary_id, platform, priority, scheduled_for, payload)
  VALUES (p_role, p_dispensary_id, p_platform, coalesce(p_priority, 0), p_scheduled_for, p_payload)
  RETURNING id INTO v_id;
  RETURN v_id;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- After an INSERT: one pass over the new rows, then only the work they need.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_tasks_inserted() RETURNS TRIGGER AS $$
DECLARE
  v_stores INTEGER[];
  v_active BOOLEAN;
  v_pending_stores INTEGER[];
  v_pending_roles VARCHAR[];
BEGIN
  -- The statements below take arrays, not the transition table: their plans are kept.
  SELECT
    array_agg(DISTINCT k.dispensary_id),
    coalesce(bool_or(k.active), false),
    array_agg(k.dispensary_id) FILTER (WHERE k.pending),
    array_agg(k.role) FILTER (WHERE k.pending)
  INTO v_stores, v_active, v_pending_stores, v_pending_roles
  FROM (
    SELECT DISTINCT n.dispensary_id, n.role,
      n.status = 'pending' AS pending, n.status IN ('claimed', 'running') AS active
    FROM new_tasks n
    WHERE n.dispensary_id IS NOT NULL
  ) k;
  IF v_stores IS NULL THEN
    RETURN NULL;  -- tasks of no store: no store state to keep
  END IF;

  INSERT INTO worker_task_stores (dispensary_id)
  SELECT s.dispensary_id FROM unnest(v_stores) AS s (dispensary_id)
  ON CONFLICT (dispensary_id) DO NOTHING;

  -- Rows inserted as already active (only direct INSERTs do that) make their store busy.
  IF v_active THEN
    UPDATE worker_task_stores s
    SET active_task_id = n.id
    FROM new_tasks n
    WHERE n.status IN ('claimed', 'running')
      AND s.dispensary_id = n.dispensary_id;
  END IF;

  -- NULL when no row is pending: nothing to lock or refresh.
  PERFORM tq_lock_and_refresh(v_pending_stores, v_pending_roles);
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- One store's head, by the rule of tq_refresh_heads (0006): the claim-order key and platform of
-- its best due task, else of its next task to come due; recheck_at, when a pending task of a
-- higher priority comes due after now and after the head's due time. No pending task: no head.
------------------------------------------------------------------------------------------------

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
END;
$$ LANGUAGE plpgsql;

-- As in 0003: the stores' rows locked in store order, then their heads re-derived.
CREATE OR REPLACE FUNCTION tq_lock_and_refresh(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
BEGIN
  IF p_stores IS NULL THEN
    RETURN;
  END IF;
  IF cardinality(p_stores) = 1 THEN
    IF p_stores[1] IS NOT NULL THEN
      PERFORM 1 FROM worker_task_stores s WHERE s.dispensary_id = p_stores[1] FOR UPDATE;
      PERFORM tq_refresh_head(p_stores[1], p_roles[1]);
    END IF;
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

------------------------------------------------------------------------------------------------
-- A row inserted as holding its platform's slot takes it; no other row calls anything.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_task_platform_taken() RETURNS TRIGGER AS $$
BEGIN
  PERFORM tq_platforms_apply(ARRAY[NEW.platform], ARRAY[1], ARRAY[NEW.id], ARRAY[NULL::VARCHAR]);
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS worker_tasks_zplatforms_inserted ON worker_tasks;
CREATE TRIGGER worker_tasks_zplatforms_inserted
  AFTER INSERT ON worker_tasks
  FOR EACH ROW
  WHEN (NEW.status IN ('claimed', 'running') AND NEW.send_at IS NOT NULL AND NEW.platform IS NOT NULL)
  EXECUTE FUNCTION tq_task_platform_taken();
DROP FUNCTION IF EXISTS tq_tasks_platforms_inserted();

------------------------------------------------------------------------------------------------
-- tq_task_platform (0012): the same rule, worded only for a refusal.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_task_platform() RETURNS TRIGGER AS $$
DECLARE
  v_platform VARCHAR;
BEGIN
  IF NEW.dispensary_id IS NOT NULL THEN
    SELECT d.menu_type INTO v_platform FROM dispensaries d WHERE d.id = NEW.dispensary_id FOR SHARE;
    IF NOT FOUND THEN
      RETURN NEW;  -- the foreign key refuses it
    END IF;
  ELSIF jsonb_typeof(NEW.payload -> 'platform') = 'string' AND length(NEW.payload ->> 'platform') BETWEEN 1 AND 50 THEN
    v_platform := NEW.payload ->> 'platform';
  ELSE
    RETURN NEW;
  END IF;
  IF NEW.platform IS NULL OR (TG_OP = 'UPDATE' AND NEW.platform IS NOT DISTINCT FROM OLD.platform) THEN
    NEW.platform := v_platform;
  ELSIF NEW.platform IS DISTINCT FROM v_platform THEN
    PERFORM tq_refuse(format('worker_tasks (task %s)', coalesce(NEW.id::TEXT, 'new')), 'platform',
      tq_shown(NEW.platform),
      CASE WHEN NEW.dispensary_id IS NOT NULL
        THEN format('must be that of store %s, %s (dispensaries.menu_type)', NEW.dispensary_id, tq_shown(v_platform))
        ELSE format('must be the one its payload names, %s', tq_shown(v_platform)) END,
      'A task keeps the limits of its platform while its requests go to its store''s: leave the platform '
      'NULL and the store''s is taken.');
  END IF;
  RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
