-- Leases that end in seconds, and times that tell the truth.
--
-- - A worker registers its heartbeat interval; expire_leases gives back, within seconds, the
--   tasks of a worker whose heartbeats stopped for a few of its own intervals (a dead process's
--   stores are claimable again in about a minute, not at the next 5-minute recovery).
-- - complete_tasks_timed records when each handler began and ended (as offsets from the claim,
--   measured by the worker: no clock of its own is trusted), so that a batch completed at once
--   and tasks run one after another in a batch keep their true durations.
-- - A completed task carries no error of an earlier attempt.
-- - v_worker_capacity: throughput from what completed in the last hour and the time it took,
--   whatever the concurrency.

ALTER TABLE worker_registry ADD COLUMN IF NOT EXISTS heartbeat_seconds DOUBLE PRECISION
  CHECK (heartbeat_seconds > 0);

-- As register_worker, with the interval the worker heartbeats at.
CREATE OR REPLACE FUNCTION register_worker(
  p_worker_id VARCHAR,
  p_role VARCHAR,
  p_pod_name VARCHAR,
  p_hostname VARCHAR,
  p_heartbeat_seconds DOUBLE PRECISION
) RETURNS VOID AS $$
BEGIN
  IF p_heartbeat_seconds IS NULL OR p_heartbeat_seconds <= 0 OR p_heartbeat_seconds > 3600 THEN
    RAISE EXCEPTION 'heartbeat_seconds must be above 0 and at most 3600, got %',
      coalesce(p_heartbeat_seconds::TEXT, 'NULL')
      USING ERRCODE = '22023';
  END IF;
  PERFORM register_worker(p_worker_id, p_role, p_pod_name, p_hostname);
  UPDATE worker_registry SET heartbeat_seconds = p_heartbeat_seconds WHERE worker_id = p_worker_id;
END;
$$ LANGUAGE plpgsql;

-- Gives back the tasks whose owner has been silent for p_intervals of its own heartbeat
-- intervals (workers that registered none: default_heartbeat_seconds), and never less than
-- p_min_seconds: the short lease. A task out of retries fails, as in recover_stale_tasks, which
-- stays the backstop for everything else.
CREATE OR REPLACE FUNCTION expire_leases(
  p_intervals DOUBLE PRECISION DEFAULT 2.5,
  p_default_heartbeat_seconds DOUBLE PRECISION DEFAULT 30,
  p_min_seconds DOUBLE PRECISION DEFAULT 10
) RETURNS TABLE (recovered INTEGER, failed INTEGER) AS $$
BEGIN
  IF p_intervals IS NULL OR p_intervals < 1.5 OR p_min_seconds IS NULL OR p_min_seconds < 1
     OR p_default_heartbeat_seconds IS NULL OR p_default_heartbeat_seconds <= 0 THEN
    RAISE EXCEPTION 'expire_leases needs at least 1.5 intervals, 1 s and a positive default, got %, %, %',
      p_intervals, p_min_seconds, p_default_heartbeat_seconds
      USING ERRCODE = '22023';
  END IF;
  WITH lease AS (
    SELECT
      a.id,
      greatest(p_min_seconds, p_intervals * coalesce(w.heartbeat_seconds, p_default_heartbeat_seconds)) AS seconds
    FROM (
      -- One branch per partial index over active tasks.
      SELECT t.id, t.worker_id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NOT NULL
      UNION ALL
      SELECT t.id, t.worker_id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NULL
    ) a
    LEFT JOIN worker_registry w ON w.worker_id = a.worker_id
  ),
  expired AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
        retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
        error_message = format('lease expired: worker %s silent for over %s s', t.worker_id, round(l.seconds)),
        worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
        claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
        last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
        completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
    FROM lease l
    WHERE t.id = l.id
      AND t.status IN ('claimed', 'running')
      AND coalesce(t.last_heartbeat_at, t.started_at, t.claimed_at, t.updated_at)
          < now() - make_interval(secs => l.seconds)
    RETURNING t.status
  )
  SELECT
    count(*) FILTER (WHERE e.status = 'pending')::INTEGER,
    count(*) FILTER (WHERE e.status = 'failed')::INTEGER
  INTO recovered, failed
  FROM expired e;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

-- complete_task for a handler's own transaction (TaskContext.complete): the fenced completion,
-- without the worker's registry row, which every handler transaction of the worker would
-- otherwise hold until its commit, one after another. The worker counts these completions in
-- its registry in one statement per batch (worker_completed). A completed task carries no error
-- of an earlier attempt.
CREATE OR REPLACE FUNCTION complete_task_tx(p_task_id INTEGER, p_worker_id VARCHAR, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'completed',
      result = p_result,
      error_message = NULL,
      started_at = coalesce(started_at, claimed_at),
      completed_at = now()
  WHERE id = p_task_id
    AND worker_id = p_worker_id
    AND status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION worker_completed(p_worker_id VARCHAR, p_count INTEGER) RETURNS VOID AS $$
  UPDATE worker_registry
  SET tasks_completed = tasks_completed + greatest(p_count, 0), last_heartbeat_at = now()
  WHERE worker_id = p_worker_id;
$$ LANGUAGE sql;

-- The single completion: complete_task_tx, counted in the worker's registry at once.
CREATE OR REPLACE FUNCTION complete_task(p_task_id INTEGER, p_worker_id VARCHAR, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  IF NOT complete_task_tx(p_task_id, p_worker_id, p_result) THEN
    RETURN false;
  END IF;
  PERFORM worker_completed(p_worker_id, 1);
  RETURN true;
END;
$$ LANGUAGE plpgsql;

-- complete_tasks, with when each handler began and ended: seconds after the task's claim, as
-- the worker measured them. A batch written at once, or tasks run one after another, keep
-- their true times (never later than now). NULL offsets keep the old times.
CREATE OR REPLACE FUNCTION complete_tasks_timed(
  p_worker_id VARCHAR,
  p_task_ids INTEGER[],
  p_results JSONB[],
  p_began_after DOUBLE PRECISION[],
  p_ended_after DOUBLE PRECISION[]
) RETURNS INTEGER[] AS $$
DECLARE
  v_done INTEGER[];
BEGIN
  IF cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_results)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_began_after)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_ended_after) THEN
    RAISE EXCEPTION 'complete_tasks_timed: % task ids, % results, % begin and % end times',
      cardinality(p_task_ids), cardinality(p_results), cardinality(p_began_after), cardinality(p_ended_after)
      USING ERRCODE = '22023';
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
    FROM unnest(p_task_ids, p_results, p_began_after, p_ended_after) AS r (id, result, began, ended)
    WHERE t.id = r.id
      AND t.worker_id = p_worker_id
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_done FROM done;

  IF cardinality(v_done) > 0 THEN
    PERFORM worker_completed(p_worker_id, cardinality(v_done));
  END IF;
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[], p_results JSONB[])
RETURNS INTEGER[] AS $$
BEGIN
  RETURN complete_tasks_timed(
    p_worker_id, p_task_ids, p_results,
    array_fill(NULL::DOUBLE PRECISION, ARRAY[coalesce(cardinality(p_task_ids), 0)]),
    array_fill(NULL::DOUBLE PRECISION, ARRAY[coalesce(cardinality(p_task_ids), 0)]));
END;
$$ LANGUAGE plpgsql;

-- Throughput from what completed in the last hour, whatever the concurrency of each worker: the
-- pace is those completions over the time they took (first start to last completion);
-- tasks_per_worker_hour divides it among the workers that completed any (rows without a worker
-- count as one), and the time to drain is the pending tasks at that pace (with workers active).
DROP VIEW IF EXISTS v_worker_capacity;
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
    count(DISTINCT worker_id) FILTER (WHERE status = 'completed') AS completing_workers,
    -- The hours the work of the last hour took: from its first start to its last completion
    -- (at least 10 ms), so that a burst of a few minutes is not read as an hour's pace.
    greatest(
      extract(EPOCH FROM max(completed_at) FILTER (WHERE status = 'completed')
                       - min(started_at) FILTER (WHERE status = 'completed')),
      0.01) / 3600.0 AS busy_hours,
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
    WHEN c.completed_last_hour > 0
    THEN c.completed_last_hour / c.busy_hours / greatest(c.completing_workers, 1)
  END AS tasks_per_worker_hour,
  CASE
    WHEN l.active_workers > 0 AND c.completed_last_hour > 0
    THEN l.pending_tasks * c.busy_hours / c.completed_last_hour
  END AS estimated_hours_to_drain
FROM worker_task_roles r
LEFT JOIN live l ON l.role = r.role
LEFT JOIN recent c ON c.role = r.role;

COMMENT ON VIEW v_worker_capacity IS 'Real-time capacity planning metrics per role';
