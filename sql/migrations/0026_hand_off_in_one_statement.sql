-- 0026: a hand-off moves the slot in one UPDATE of the two tasks, and its platform's row is
-- written once.
--
-- Measured (docs/BENCHMARKS.md, "The platform row and the WAL flush (0025)"): a hand-off gave
-- its slot back in one UPDATE of worker_tasks and claimed the next task in another, so every
-- statement trigger of the table ran twice, and the platform's row, locked throughout, was
-- written three times: one slot out (tq_platforms_apply), the GCRA's tat, one slot in. The
-- hand-offs of a platform take turns on that row, so what they cost the server in the turn is
-- how many a second a platform can pass on.
--
-- Now platform_handoff locks the task, and tq_claim_next, told which task hands its slot over,
-- counts that slot free as if it had been given back first (the same quota and fair share as
-- before), then clears the old task's send_at and starts the new task in one UPDATE. Its
-- triggers see one slot out and one in: tq_platforms_apply writes a platform's row only when
-- something of it changes (a count, the breaker, the probe), so the row is written once, with
-- the start. When no task is claimed (none due, the platform paused or at its rate, the worker
-- past its share, a platform with no limits), the slot is given back alone, as before.
--
-- Safe to run twice.

CREATE OR REPLACE FUNCTION tq_platforms_apply(
  p_platforms VARCHAR[], p_deltas INTEGER[], p_task_ids INTEGER[], p_outcomes VARCHAR[]
) RETURNS VOID AS $$
BEGIN
  IF p_platforms IS NULL THEN
    RETURN;
  END IF;
  PERFORM 1
  FROM tq_platforms l
  WHERE l.platform = ANY (p_platforms)
  ORDER BY l.platform
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN;  -- none of these platforms is limited
  END IF;

  UPDATE tq_platforms l
  SET in_flight = greatest(l.in_flight + c.delta, 0),
      error_streak = CASE WHEN c.completed > 0 THEN 0 ELSE l.error_streak END,
      pauses = CASE WHEN l.probe_sent AND l.probe_task_id = ANY (c.answered) THEN 0 ELSE l.pauses END,
      paused_until = CASE
        WHEN l.probe_sent AND l.probe_task_id = ANY (c.answered) THEN NULL ELSE l.paused_until END,
      probe_task_id = CASE WHEN l.probe_task_id = ANY (c.released) THEN NULL ELSE l.probe_task_id END,
      probe_sent = CASE WHEN l.probe_task_id = ANY (c.released) THEN false ELSE l.probe_sent END,
      updated_at = now()
  FROM (
    SELECT
      x.platform,
      sum(x.delta)::INTEGER AS delta,
      count(*) FILTER (WHERE x.outcome = 'completed') AS completed,
      coalesce(array_agg(x.task_id) FILTER (WHERE x.delta < 0), '{}') AS released,
      coalesce(array_agg(x.task_id) FILTER (WHERE x.outcome = 'completed'), '{}') AS answered
    FROM unnest(p_platforms, p_deltas, p_task_ids, p_outcomes) AS x (platform, delta, task_id, outcome)
    GROUP BY x.platform
  ) c
  WHERE l.platform = c.platform
    -- Nothing to write for a slot that only passed from one task to the next (0026).
    AND (c.delta <> 0
         OR (c.completed > 0 AND l.error_streak <> 0)
         OR l.probe_task_id = ANY (c.released)
         OR l.probe_task_id = ANY (c.answered));
END;
$$ LANGUAGE plpgsql;

DROP FUNCTION IF EXISTS tq_claim_next(VARCHAR, VARCHAR, VARCHAR);

-- The next due task of one platform for a worker, started with the slot p_handing_over gives
-- up (the task that hands it on, or NULL for a free slot): the claim's order and limits, for
-- one task, in a few index probes.
CREATE OR REPLACE FUNCTION tq_claim_next(
  p_role VARCHAR, p_worker_id VARCHAR, p_platform VARCHAR, p_handing_over INTEGER
) RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  l tq_platforms;
  v_passed INTEGER := CASE WHEN p_handing_over IS NULL THEN 0 ELSE 1 END;
  v_store_task INTEGER;
  v_store_key RECORD;
  v_floor RECORD;
  v_loose RECORD;
  v_id INTEGER;
  v_token UUID := gen_random_uuid();
BEGIN
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = p_platform FOR UPDATE;
  IF NOT FOUND OR l.pauses > 0 THEN
    RETURN;
  END IF;
  -- The slot handed over counts as given back already: the platform's (its quota) and the
  -- worker's (its fair share, tq_worker_room without that task).
  l.in_flight := greatest(l.in_flight - v_passed, 0);
  IF tq_platform_quota(l) < 1
     OR tq_fair_share(l.max_in_flight, p_role) <= (
          SELECT count(*)
          FROM worker_tasks t  -- idx_worker_tasks_holding
          WHERE t.worker_id = p_worker_id
            AND t.platform = l.platform
            AND t.status IN ('claimed', 'running')
            AND t.send_at IS NOT NULL
            AND t.id IS DISTINCT FROM p_handing_over) THEN
    RETURN;
  END IF;

  -- The best idle store: the priorities in use from the highest, each from its floor.
  SELECT NULL::INTEGER AS priority, NULL::TIMESTAMPTZ AS due_at, NULL::INTEGER AS dispensary_id
  INTO v_store_key;
  FOR v_floor IN
    SELECT f.priority, min(f.floor) AS floor
    FROM worker_task_floors f
    WHERE f.role = p_role AND f.platform = p_platform
    GROUP BY f.priority
    ORDER BY f.priority DESC
  LOOP
    SELECT h.priority, h.due_at, h.dispensary_id INTO v_store_key
    FROM worker_task_heads h
    JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id + 0  -- + 0: not a merge key (0020)
    WHERE h.role = p_role
      AND h.platform = p_platform
      AND h.priority = v_floor.priority
      AND h.due_at >= v_floor.floor
      AND h.due_at <= now()
      AND s.active_task_id IS NULL
    ORDER BY h.due_at, h.dispensary_id
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED;
    EXIT WHEN FOUND;
  END LOOP;

  SELECT t.id, t.priority, t.due_at INTO v_loose
  FROM worker_tasks t
  WHERE t.role = p_role
    AND coalesce(t.platform, '') = p_platform
    AND t.status = 'pending'
    AND t.dispensary_id IS NULL
    AND t.due_at <= now()
  ORDER BY t.priority DESC, t.due_at, t.id
  LIMIT 1
  FOR UPDATE OF t SKIP LOCKED;

  IF v_store_key.dispensary_id IS NOT NULL
     AND (v_loose.id IS NULL OR (v_store_key.priority, v_loose.due_at) >= (v_loose.priority, v_store_key.due_at)) THEN
    SELECT t.id INTO v_store_task
    FROM worker_tasks t
    WHERE t.dispensary_id = v_store_key.dispensary_id
      AND t.role = p_role
      AND t.status = 'pending'
      AND t.due_at <= now()
      AND coalesce(t.platform, '') = p_platform
    ORDER BY t.priority DESC, t.due_at, t.id
    LIMIT 1
    FOR UPDATE OF t SKIP LOCKED;
    v_id := v_store_task;
  ELSE
    v_id := v_loose.id;
  END IF;
  IF v_id IS NULL THEN
    RETURN;
  END IF;

  -- The GCRA as in a claim of one: its start, and tat one interval further.
  UPDATE tq_platforms p
  SET tat = greatest(p.tat, now()) + make_interval(secs => 1 / p.requests_per_second),
      updated_at = now()
  WHERE p.platform = p_platform;
  -- One statement moves the slot: the old task's send_at goes, the new task starts with its own.
  -- Its triggers mark the store busy, re-derive its head, and count one slot out and one in.
  RETURN QUERY
  WITH moved AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.id = v_id THEN 'running' ELSE t.status END,
        worker_id = CASE WHEN t.id = v_id THEN p_worker_id ELSE t.worker_id END,
        claimed_at = CASE WHEN t.id = v_id THEN now() ELSE t.claimed_at END,
        started_at = CASE WHEN t.id = v_id THEN now() ELSE t.started_at END,
        completed_at = CASE WHEN t.id = v_id THEN NULL ELSE t.completed_at END,
        send_at = CASE WHEN t.id = v_id
                       THEN greatest(now(), greatest(l.tat, now())
                                     - make_interval(secs => tq_platform_tolerance(l.burst, l.requests_per_second)))
                  END,
        last_heartbeat_at = CASE WHEN t.id = v_id THEN now() ELSE t.last_heartbeat_at END,
        lease_hash = CASE WHEN t.id = v_id THEN tq_lease_hash(v_token) ELSE t.lease_hash END
    WHERE t.id = v_id OR t.id = p_handing_over
    RETURNING t
  )
  SELECT m.t, v_token FROM moved m WHERE (m.t).id = v_id;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION platform_handoff(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_role VARCHAR;
  v_worker VARCHAR;
  v_platform VARCHAR;
BEGIN
  PERFORM tq_slot_commit();  -- 0025
  SELECT t.role, t.worker_id, t.platform INTO v_role, v_worker, v_platform
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN;
  END IF;
  IF v_platform IS NOT NULL AND v_worker IS NOT NULL THEN
    RETURN QUERY SELECT c.task, c.lease FROM tq_claim_next(v_role, v_worker, v_platform, p_task_id) c;
    IF FOUND THEN
      RETURN;  -- the slot went with the claim
    END IF;
  END IF;
  -- Nothing to pass it to: the slot goes back.
  UPDATE worker_tasks t SET send_at = NULL WHERE t.id = p_task_id;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
