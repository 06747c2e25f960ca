-- 0035: a worker that holds no slot of a full platform keeps standbys there too, so that a slot
-- another worker's share gives back is used at once.
--
-- Measured (docs/BENCHMARKS.md, "A slot given back is heard at once (0032)", what is left): with
-- four drain runs of one role sharing a platform bound by its slots, the first run to claim takes
-- them all, and when its first requests end (0.10-0.19 s in) its passes are refused by its share.
-- The slots it gives back are announced (0032), but a run holding no slot of the platform had no
-- standby there (platform_standby claims from a task holding a slot): it claimed, started a
-- thread, ran the handler up to its request, and the slots stood empty 100-250 ms meanwhile.
--
-- * platform_standbys(role, worker, most): up to ``most`` due tasks of the role, claimed for the
--   worker without a slot (send_at NULL), each of a limited platform that is full (every slot
--   taken) and not paused, of which the worker holds no slot: at most two there, the count
--   taken under platform_standby's lock of the worker and platform. A worker that holds a slot
--   keeps its line from that slot (platform_standby, twice its slots).
--   Only for a worker registered for the role and alive as the fair share counts it (its
--   heartbeat fresh, not offline): standbys are for runs that wait for their share.
-- A standby's slot comes as before: passed on by its worker (platform_pass, platform_relay), or
-- asked for at its first request (platform_request), which gives one only within the limits and
-- the share (0027). Standbys hold stores, never slots: the limits and the shares are as they were.
--
-- platform_standby and platform_standbys share their bound (tq_standby_room) and their claim of
-- one task (tq_take_standby).
--
-- Safe to run twice.

-- How many more standbys the worker may keep on the platform, ``p_most`` in all: counted under a
-- lock of the worker and platform, held to the commit, so that two claims at once cannot both
-- pass the bound.
CREATE OR REPLACE FUNCTION tq_standby_room(p_worker_id VARCHAR, p_platform VARCHAR, p_most INTEGER)
RETURNS INTEGER AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(hashtext('tq_standby/' || p_worker_id || '/' || p_platform));
  RETURN p_most - (
    SELECT count(*)::INTEGER
    FROM worker_tasks t  -- idx_worker_tasks_standby
    WHERE t.worker_id = p_worker_id
      AND t.platform = p_platform
      AND t.status IN ('claimed', 'running')
      AND t.send_at IS NULL);
END;
$$ LANGUAGE plpgsql;

-- A task tq_pick_next picked, claimed for the worker as a standby: running, no slot, a new lease.
CREATE OR REPLACE FUNCTION tq_take_standby(p_task_id INTEGER, p_worker_id VARCHAR)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_token UUID := gen_random_uuid();
BEGIN
  RETURN QUERY
  WITH claimed AS (
    UPDATE worker_tasks t
    SET status = 'running',
        worker_id = p_worker_id,
        claimed_at = now(),
        started_at = now(),
        completed_at = NULL,
        send_at = NULL,
        last_heartbeat_at = now(),
        lease_hash = tq_lease_hash(v_token)
    WHERE t.id = p_task_id
    RETURNING t
  )
  SELECT c.t, v_token FROM claimed c;
END;
$$ LANGUAGE plpgsql;

-- As in 0028, its bound and claim now shared with platform_standbys.
CREATE OR REPLACE FUNCTION platform_standby(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_role VARCHAR;
  v_worker VARCHAR;
  v_platform VARCHAR;
  v_id INTEGER;
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
  IF tq_standby_room(v_worker, v_platform, 2 * tq_worker_slots(v_worker, v_platform, NULL)) <= 0 THEN
    RETURN;
  END IF;
  v_id := tq_pick_next(v_role, v_platform);
  IF v_id IS NULL THEN
    RETURN;
  END IF;
  RETURN QUERY SELECT * FROM tq_take_standby(v_id, v_worker);
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION platform_standbys(p_role VARCHAR, p_worker_id VARCHAR, p_most INTEGER)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_platform VARCHAR;
  v_left INTEGER := p_most;
  v_room INTEGER;
  v_id INTEGER;
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  IF p_most IS NULL OR p_most NOT BETWEEN 1 AND 1000 THEN
    PERFORM tq_refuse('platform_standbys', 'most', p_most::TEXT, 'must be between 1 and 1000',
      'A worker claims 1 to 1000 standby tasks at once.');
  END IF;
  PERFORM tq_require_role(p_role);
  -- A worker the fair share counts (tq_fair_share): one that is gone waits for no share.
  IF NOT EXISTS (
    SELECT 1
    FROM worker_registry w
    WHERE w.worker_id = p_worker_id
      AND w.role = p_role
      AND w.status <> 'offline'
      AND w.last_heartbeat_at > now() - make_interval(secs => greatest(2.5 * coalesce(w.heartbeat_seconds, 30), 10))
  ) THEN
    RETURN;
  END IF;
  FOR v_platform IN
    SELECT l.platform
    FROM tq_platforms l
    WHERE l.in_flight + tq_platform_held(l) >= l.max_in_flight  -- every slot taken, holds too
      AND l.pauses = 0
      AND NOT coalesce(l.paused_until > now(), false)
    ORDER BY l.platform
  LOOP
    EXIT WHEN v_left = 0;
    -- A holder's line is platform_standby's.
    CONTINUE WHEN tq_worker_slots(p_worker_id, v_platform, NULL) > 0;
    v_room := tq_standby_room(p_worker_id, v_platform, 2);
    WHILE v_room > 0 AND v_left > 0 LOOP
      -- Its store is locked until the commit, and the UPDATE's trigger marks it active: the
      -- next pick passes it by.
      v_id := tq_pick_next(p_role, v_platform);
      EXIT WHEN v_id IS NULL;
      RETURN QUERY SELECT * FROM tq_take_standby(v_id, p_worker_id);
      v_room := v_room - 1;
      v_left := v_left - 1;
    END LOOP;
  END LOOP;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexscan = on;

INSERT INTO tq_api (function_name) VALUES ('platform_standbys') ON CONFLICT DO NOTHING;

CALL tq_secure_functions();
