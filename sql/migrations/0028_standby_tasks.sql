-- 0028: a task next in line for a slot of its worker's: claimed and prepared before a slot frees.
--
-- Measured (docs/BENCHMARKS.md, "Next in line (0028)"): in a crawl bound by in-flight slots, a
-- slot stood empty about 15 to 20 ms between two requests at the platform (100 ms each). Traced
-- in the drain, from one task's answer to the next task's request: the hand-off's call (claim
-- the next task under the platform's row lock, 4 to 5 ms), a thread to start, the handler's read
-- of its store (2 to 4 ms, on a pooled connection), and for a third of the tasks a second
-- platform_request, their thread having reached it more than 10 ms after the start given.
--
-- A worker holding slots of a platform may now keep a few tasks of that platform claimed without
-- a slot ("standby", send_at NULL): their handlers run up to their first request and wait there.
-- platform_pass moves a slot from a task done with its requests to one of them in one short
-- statement: the slot never leaves the worker, so the quota and the fair share are as they were,
-- and nothing is picked under the platform's row lock; the standby's thread sends at once.
-- * platform_standby(task, lease): from a task holding a slot, claim the next due task of its
--   role and platform for its worker, without a slot. The worker's tasks of that platform
--   without a slot (standbys, and tasks that passed theirs and are finishing) stay fewer than
--   twice the slots it holds there, counted under a lock of the worker and platform; none while
--   the platform is paused, none for a platform without limits.
-- * platform_pass(task, lease, next, next lease, replace): both tasks the caller's (each lease),
--   of one worker and one platform; the first holds a slot, the next none. The slot moves with
--   a new start, as a hand-off's, and with ``replace`` the next due task is claimed as a standby
--   in the same UPDATE (the line keeps its length, and a slot moved costs one transaction, as a
--   hand-off does). Paused, or with the quota or the share gone since (holds, more workers),
--   the first's slot is given back alone: 'paused' or 'full'.
-- A standby task with no slot passed to it asks platform_request, which gives it a slot only
-- within the limits (0027). The claim's order of a platform is one function now, tq_pick_next,
-- for tq_claim_next (hand-offs) and platform_standby; and the slots a worker holds one,
-- tq_worker_slots, for tq_worker_room (claims, hand-offs, passes) and platform_standby.
--
-- Safe to run twice.

-- The worker's tasks of a platform with no slot: platform_standby's count.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_standby ON worker_tasks (worker_id, platform)
WHERE status IN ('claimed', 'running') AND send_at IS NULL AND platform IS NOT NULL;

-- The slots a worker holds on a platform, leaving out one task (a hand-off's or a pass's, whose
-- slot counts as given back): the fair share's count for claims, hand-offs, passes and standbys.
CREATE OR REPLACE FUNCTION tq_worker_slots(p_worker_id VARCHAR, p_platform VARCHAR, p_except INTEGER)
RETURNS INTEGER AS $$
  SELECT count(*)::INTEGER
  FROM worker_tasks t  -- idx_worker_tasks_holding
  WHERE t.worker_id = p_worker_id
    AND t.platform = p_platform
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL
    AND t.id IS DISTINCT FROM p_except;
$$ LANGUAGE sql STABLE;

-- The room a worker's fair share leaves it on a platform, ``p_except``'s slot given back.
DROP FUNCTION IF EXISTS tq_worker_room(tq_platforms, VARCHAR, VARCHAR);
CREATE OR REPLACE FUNCTION tq_worker_room(
  l tq_platforms, p_role VARCHAR, p_worker_id VARCHAR, p_except INTEGER DEFAULT NULL
) RETURNS INTEGER AS $$
  SELECT greatest(0, tq_fair_share(l.max_in_flight, p_role) - tq_worker_slots(p_worker_id, l.platform, p_except));
$$ LANGUAGE sql STABLE;

-- The next due task of a role on a platform, in the order of every claim (0016, 0017, 0024):
-- its row and its store's locked, SKIP LOCKED. NULL when none.
CREATE OR REPLACE FUNCTION tq_pick_next(p_role VARCHAR, p_platform VARCHAR)
RETURNS INTEGER AS $$
DECLARE
  v_store_key RECORD;
  v_floor RECORD;
  v_loose RECORD;
  v_id INTEGER;
BEGIN
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
    SELECT t.id INTO v_id
    FROM worker_tasks t
    WHERE t.dispensary_id = v_store_key.dispensary_id
      AND t.role = p_role
      AND t.status = 'pending'
      AND t.due_at <= now()
      AND coalesce(t.platform, '') = p_platform
    ORDER BY t.priority DESC, t.due_at, t.id
    LIMIT 1
    FOR UPDATE OF t SKIP LOCKED;
    RETURN v_id;
  END IF;
  RETURN v_loose.id;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION tq_claim_next(
  p_role VARCHAR, p_worker_id VARCHAR, p_platform VARCHAR, p_handing_over INTEGER
) RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  l tq_platforms;
  v_passed INTEGER := CASE WHEN p_handing_over IS NULL THEN 0 ELSE 1 END;
  v_id INTEGER;
  v_token UUID := gen_random_uuid();
BEGIN
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = p_platform FOR UPDATE;
  IF NOT FOUND OR l.pauses > 0 THEN
    RETURN;
  END IF;
  l.in_flight := greatest(l.in_flight - v_passed, 0);
  IF tq_platform_quota(l) < 1 OR tq_worker_room(l, p_role, p_worker_id, p_handing_over) < 1 THEN
    RETURN;
  END IF;

  v_id := tq_pick_next(p_role, p_platform);
  IF v_id IS NULL THEN
    RETURN;
  END IF;

  UPDATE tq_platforms p
  SET tat = greatest(p.tat, now()) + make_interval(secs => 1 / p.requests_per_second),
      updated_at = now()
  WHERE p.platform = p_platform;
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

CREATE OR REPLACE FUNCTION platform_standby(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_role VARCHAR;
  v_worker VARCHAR;
  v_platform VARCHAR;
  v_id INTEGER;
  v_token UUID := gen_random_uuid();
BEGIN
  SELECT t.role, t.worker_id, t.platform INTO v_role, v_worker, v_platform
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL;
  IF NOT FOUND OR v_worker IS NULL OR v_platform IS NULL
     OR NOT EXISTS (
       SELECT 1 FROM tq_platforms l
       WHERE l.platform = v_platform AND l.pauses = 0 AND NOT coalesce(l.paused_until > now(), false)) THEN
    RETURN;
  END IF;
  -- Counted under a lock of the worker and platform: two calls at once cannot both pass the bound.
  PERFORM pg_advisory_xact_lock(hashtext('tq_standby/' || v_worker || '/' || v_platform));
  IF (SELECT count(*)
      FROM worker_tasks t  -- idx_worker_tasks_standby
      WHERE t.worker_id = v_worker
        AND t.platform = v_platform
        AND t.status IN ('claimed', 'running')
        AND t.send_at IS NULL)
     >= 2 * tq_worker_slots(v_worker, v_platform, NULL) THEN
    RETURN;
  END IF;
  v_id := tq_pick_next(v_role, v_platform);
  IF v_id IS NULL THEN
    RETURN;
  END IF;
  RETURN QUERY
  WITH claimed AS (
    UPDATE worker_tasks t
    SET status = 'running',
        worker_id = v_worker,
        claimed_at = now(),
        started_at = now(),
        completed_at = NULL,
        send_at = NULL,
        last_heartbeat_at = now(),
        lease_hash = tq_lease_hash(v_token)
    WHERE t.id = v_id
    RETURNING t
  )
  SELECT c.t, v_token FROM claimed c;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION platform_pass(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, task worker_tasks, lease UUID) AS $$
DECLARE
  v_from worker_tasks;
  v_to worker_tasks;
  l tq_platforms;
  v_new INTEGER;
  v_token UUID := gen_random_uuid();
  v_now TIMESTAMPTZ;
  v_base TIMESTAMPTZ;
  v_start TIMESTAMPTZ;
BEGIN
  PERFORM tq_slot_commit();  -- 0025
  -- Both rows locked in one statement, in id order: a heartbeat of the worker's tasks locks them too.
  PERFORM 1
  FROM worker_tasks t
  WHERE t.id IN (p_task_id, p_next_id)
  ORDER BY t.id
  FOR UPDATE;
  SELECT * INTO v_from
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL;
  IF FOUND THEN
    SELECT * INTO v_to
    FROM worker_tasks t
    WHERE t.id = p_next_id
      AND t.id <> p_task_id
      AND t.lease_hash = tq_lease_hash(p_next_lease)
      AND t.status IN ('claimed', 'running')
      AND t.send_at IS NULL
      AND t.worker_id = v_from.worker_id
      AND t.platform = v_from.platform;
  END IF;
  IF v_to.id IS NULL THEN
    -- Not the caller's, or not a standby of the same worker and platform: nothing moves.
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION, NULL::worker_tasks, NULL::UUID;
    RETURN;
  END IF;

  -- The next standby in its place, picked before the platform's row is locked: the pick skips
  -- what is locked and waits for nobody, and the row is held for the writes alone.
  IF coalesce(p_replace, false) THEN
    v_new := tq_pick_next(v_to.role, v_from.platform);
  END IF;

  SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_from.platform FOR UPDATE;
  IF NOT FOUND THEN
    -- A platform without limits has no slots to pass (the pick's locks go with the commit).
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION, NULL::worker_tasks, NULL::UUID;
    RETURN;
  END IF;
  -- The rules of a hand-off (tq_claim_next): the passed slot counts as given back first.
  l.in_flight := greatest(l.in_flight - 1, 0);
  IF l.pauses > 0 OR coalesce(l.paused_until > now(), false)
     OR tq_platform_quota(l) < 1
     OR tq_worker_room(l, v_to.role, v_from.worker_id, p_task_id) < 1 THEN
    UPDATE worker_tasks t SET send_at = NULL WHERE t.id = p_task_id;
    RETURN QUERY SELECT
      CASE WHEN l.pauses > 0 OR coalesce(l.paused_until > now(), false) THEN 'paused' ELSE 'full' END,
      0.25::DOUBLE PRECISION, NULL::worker_tasks, NULL::UUID;
    RETURN;
  END IF;

  -- The next start, reckoned from the clock under the row's lock (0019).
  v_now := clock_timestamp();
  v_base := greatest(l.tat, v_now);
  v_start := greatest(v_now, v_base - make_interval(secs => tq_platform_tolerance(l.burst, l.requests_per_second)));
  UPDATE tq_platforms p
  SET tat = v_base + make_interval(secs => 1 / p.requests_per_second),
      updated_at = now()
  WHERE p.platform = l.platform;
  -- One UPDATE, its triggers run once: the slot out of one task and into the next, and the
  -- replacement claimed without one.
  RETURN QUERY
  WITH moved AS (
    UPDATE worker_tasks t
    SET send_at = CASE WHEN t.id = p_next_id THEN v_start END,
        status = CASE WHEN t.id = v_new THEN 'running' ELSE t.status END,
        worker_id = CASE WHEN t.id = v_new THEN v_from.worker_id ELSE t.worker_id END,
        claimed_at = CASE WHEN t.id = v_new THEN now() ELSE t.claimed_at END,
        started_at = CASE WHEN t.id = v_new THEN now() ELSE t.started_at END,
        completed_at = CASE WHEN t.id = v_new THEN NULL ELSE t.completed_at END,
        last_heartbeat_at = CASE WHEN t.id = v_new THEN now() ELSE t.last_heartbeat_at END,
        lease_hash = CASE WHEN t.id = v_new THEN tq_lease_hash(v_token) ELSE t.lease_hash END
    WHERE t.id IN (p_task_id, p_next_id, v_new)
    RETURNING t
  )
  SELECT 'go'::TEXT, greatest(extract(EPOCH FROM v_start - v_now), 0)::DOUBLE PRECISION,
         m.t, CASE WHEN m.t IS NULL THEN NULL ELSE v_token END
  FROM (SELECT 1) one
  LEFT JOIN moved m ON (m.t).id = v_new;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

INSERT INTO tq_api (function_name) VALUES ('platform_standby'), ('platform_pass')
ON CONFLICT DO NOTHING;

CALL tq_secure_functions();
