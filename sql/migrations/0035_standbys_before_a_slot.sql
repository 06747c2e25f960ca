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
-- Safe to run twice.

CREATE OR REPLACE FUNCTION platform_standbys(p_role VARCHAR, p_worker_id VARCHAR, p_most INTEGER)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_platform VARCHAR;
  v_left INTEGER := p_most;
  v_room INTEGER;
  v_id INTEGER;
  v_token UUID;
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
    -- Counted under platform_standby's lock: the two at once cannot both pass the bound.
    PERFORM pg_advisory_xact_lock(hashtext('tq_standby/' || p_worker_id || '/' || v_platform));
    v_room := 2 - (
      SELECT count(*)::INTEGER
      FROM worker_tasks t  -- idx_worker_tasks_standby
      WHERE t.worker_id = p_worker_id
        AND t.platform = v_platform
        AND t.status IN ('claimed', 'running')
        AND t.send_at IS NULL);
    WHILE v_room > 0 AND v_left > 0 LOOP
      -- Its store is locked until the commit, and the UPDATE's trigger marks it active: the
      -- next pick passes it by.
      v_id := tq_pick_next(p_role, v_platform);
      EXIT WHEN v_id IS NULL;
      v_token := gen_random_uuid();
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
        WHERE t.id = v_id
        RETURNING t
      )
      SELECT c.t, v_token FROM claimed c;
      v_room := v_room - 1;
      v_left := v_left - 1;
    END LOOP;
  END LOOP;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexscan = on;

INSERT INTO tq_api (function_name) VALUES ('platform_standbys') ON CONFLICT DO NOTHING;

CALL tq_secure_functions();
