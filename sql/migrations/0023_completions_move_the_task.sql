-- A completion moves its task into the history.
--
-- Since 0022 a completed task stayed in worker_tasks for a minute, until archive_tasks moved it:
-- three versions of every task in the hot table (the insert, the claim, the completion's
-- update), and the completion's version was a whole new row with an entry in five indexes, only
-- to be deleted a minute later. Under a held snapshot (an analyst's REPEATABLE READ scan, an
-- open transaction) none of those versions can be reclaimed, and every scan of the table walks
-- them (docs/BENCHMARKS.md, "Completions move the task (0023)").
--
-- Now complete_task, complete_task_tx and complete_tasks_timed delete the task from worker_tasks
-- and insert it, completed, into worker_task_history in one statement, as archive_tasks does:
-- two versions per task in the hot table, and no index entry for the completion there. A
-- completed task is read through v_tasks (get_task, the rollup, the views), as an archived one
-- is. Failed and cancelled tasks still stay a minute and are archived (they are rarer, and a
-- failure may be retried by hand from worker_tasks).
--
-- What the completion's UPDATE did through the triggers the DELETE does now: the delete
-- triggers free the task's store and give back its platform slot, and a deleted task whose row
-- is in the history is a completed one, so the platform hears 'completed' (the streak of errors
-- ends, a probe is answered) and the resync key stays.

------------------------------------------------------------------------------------------------
-- The completions.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION complete_task_tx(p_task_id INTEGER, p_lease UUID, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  WITH done AS (
    DELETE FROM worker_tasks t
    WHERE t.id = p_task_id
      AND t.lease_hash = tq_lease_hash(p_lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.*
  )
  INSERT INTO worker_task_history (
      id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
      started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
      created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash)
  SELECT
      d.id, d.role, d.dispensary_id, d.platform, 'completed', d.priority, d.scheduled_for,
      d.worker_id, d.claimed_at, coalesce(d.started_at, d.claimed_at), now(), d.last_heartbeat_at,
      p_result, NULL, d.retry_count, d.max_retries, d.created_at, now(), d.resync_date, d.due_at,
      d.payload, d.send_at, d.lease_hash
  FROM done d;
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_task(p_task_id INTEGER, p_lease UUID, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  IF NOT complete_task_tx(p_task_id, p_lease, p_result) THEN
    RETURN false;
  END IF;
  PERFORM worker_completed((SELECT h.worker_id FROM worker_task_history h WHERE h.id = p_task_id), 1);
  RETURN true;
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
    DELETE FROM worker_tasks t
    USING unnest(p_task_ids, p_leases, p_results, p_began_after, p_ended_after) AS r (id, lease, result, began, ended)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.*, r.result AS new_result, r.began, r.ended
  ),
  moved AS (
    INSERT INTO worker_task_history (
        id, role, dispensary_id, platform, status, priority, scheduled_for, worker_id, claimed_at,
        started_at, completed_at, last_heartbeat_at, result, error_message, retry_count, max_retries,
        created_at, updated_at, resync_date, due_at, payload, send_at, lease_hash)
    SELECT
        d.id, d.role, d.dispensary_id, d.platform, 'completed', d.priority, d.scheduled_for,
        d.worker_id, d.claimed_at,
        CASE
          WHEN d.began IS NULL THEN coalesce(d.started_at, d.claimed_at)
          ELSE least(d.claimed_at + make_interval(secs => greatest(d.began, 0)), now()) END,
        CASE
          WHEN d.ended IS NULL THEN now()
          ELSE least(d.claimed_at + make_interval(secs => greatest(d.ended, coalesce(d.began, 0), 0)), now()) END,
        d.last_heartbeat_at, d.new_result, NULL, d.retry_count, d.max_retries, d.created_at, now(),
        d.resync_date, d.due_at, d.payload, d.send_at, d.lease_hash
    FROM done d
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

-- A result is held to its size where the completion writes it now.
CREATE TRIGGER worker_task_history_sizes
  BEFORE INSERT ON worker_task_history
  FOR EACH ROW
  WHEN (pg_column_size(NEW.payload) > 1048576 OR pg_column_size(NEW.result) > 1048576
        OR pg_column_size(NEW.error_message) > 8192)
  EXECUTE FUNCTION tq_task_sizes();

------------------------------------------------------------------------------------------------
-- The delete triggers do what the completion's update did.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_tasks_deleted() RETURNS trigger AS $$
BEGIN
  -- A deleted active task (a completion, now) frees its store. The stores are locked in order
  -- first, as the update trigger does: a batch of completions and a claim take them alike.
  PERFORM 1
  FROM worker_task_stores s
  WHERE s.dispensary_id IN (
      SELECT o.dispensary_id FROM old_tasks o WHERE o.status IN ('claimed', 'running')
    )
  ORDER BY s.dispensary_id
  FOR UPDATE;
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
  -- A resync task deleted, not moved (no row of it in the history now), takes its day's key
  -- with it: the day may be made again for its store, as when a unique index of worker_tasks
  -- was the key (0022).
  DELETE FROM worker_task_resyncs k
  USING old_tasks o
  WHERE o.resync_date IS NOT NULL
    AND k.resync_date = o.resync_date AND k.role = o.role AND k.dispensary_id = o.dispensary_id
    AND NOT EXISTS (SELECT 1 FROM worker_task_history h WHERE h.id = o.id);
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_platforms_deleted() RETURNS trigger AS $$
BEGIN
  -- No platform has limits: nothing to count (as the update trigger).
  PERFORM 1 FROM tq_platforms LIMIT 1;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  -- A task holding a slot that is in the history now was completed (only a completion moves an
  -- active task): the platform hears its answer. Any other delete gives the slot back unanswered.
  PERFORM tq_platforms_apply(
      array_agg(o.platform), array_agg(-1), array_agg(o.id),
      array_agg(coalesce(h.status, 'deleted')::VARCHAR))
  FROM old_tasks o
  LEFT JOIN worker_task_history h ON h.id = o.id
  WHERE o.status IN ('claimed', 'running')
    AND o.send_at IS NOT NULL
    AND o.platform IS NOT NULL;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

COMMENT ON TABLE worker_task_history IS
  'Finished tasks: completed ones moved by their completion (0023), failed and cancelled ones by archive_tasks; v_tasks reads both';

CALL tq_secure_functions();
