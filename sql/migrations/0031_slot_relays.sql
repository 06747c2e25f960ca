-- 0031: a slot relayed to the next task without waiting for the queue, where the rate has room.
--
-- Measured (docs/BENCHMARKS.md, "Relays (0031)"): in a crawl bound by in-flight slots, a slot
-- stood empty 11 to 14 ms between two requests at the platform (100 ms each). Traced in the
-- drain, from one task's answer to its standby's request: the pass's round trip, 6.5 to 9 ms
-- (pg_stat_activity shows about 1.5 ms of it at the server: the rest is waiting for a core, at
-- both ends), a pooled connection 1 to 2 ms, the standby's thread waking 2.7 ms. Every hop of
-- the pass waits for the machine; none is the queue's work.
--
-- A pass may now give the slot's new holder a relay: the start of one more request of that slot,
-- reckoned now (the GCRA's tat moves one more interval). When that task is done with its
-- requests, its standby sends at once on the relay, and the pass is recorded after the request
-- went (platform_relay(..., sent => true)), with a relay for the standby in turn. In the
-- meantime the slot is still counted as the first task's, which this worker alone can give
-- back: the platform never holds more requests than the slots counted.
-- * A relay is given only where it cannot break the limits: the platform not paused nor
--   half-open, the quota and the worker's fair share as for a pass, the rate not binding (its
--   tat not ahead of the clock), and the platform's rate at least 20 times its slots. A relay
--   is used at most a second after it was given, and a slot holds one at a time: in any second
--   at most max_in_flight requests arrive on relays reckoned before it. The GCRA's tolerance
--   keeps 0.1 s of the rate back (tq_platform_tolerance), so those take at most half of it.
-- * A relay not used (no standby in line, the task failed) is a start the rate never sees: only
--   where the rate has room.
-- * platform_relay(sent => true) records what happened: the slot moves when both leases match,
--   one worker and one platform, the first holding a slot and the next none, whatever the
--   limits say now (the request is out; a pause or a smaller limit reaches the next pass). It
--   gives no start and takes no slot: a caller that relays without a relay moves its own slot
--   between its own tasks, nothing else. Anything that does not match moves nothing ('lost').
-- * platform_relay(sent => false) is platform_pass with a relay; platform_pass is unchanged.

CREATE OR REPLACE FUNCTION tq_pass(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN,
  p_sent BOOLEAN, p_relays BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, relay BOOLEAN, task worker_tasks, lease UUID) AS $$
DECLARE
  v_from worker_tasks;
  v_to worker_tasks;
  l tq_platforms;
  v_new INTEGER;
  v_token UUID := gen_random_uuid();
  v_now TIMESTAMPTZ;
  v_base TIMESTAMPTZ;
  v_start TIMESTAMPTZ;
  v_open BOOLEAN;
  v_relay BOOLEAN;
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
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION, false, NULL::worker_tasks, NULL::UUID;
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
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION, false, NULL::worker_tasks, NULL::UUID;
    RETURN;
  END IF;
  -- The rules of a hand-off (tq_claim_next): the passed slot counts as given back first.
  l.in_flight := greatest(l.in_flight - 1, 0);
  v_open := NOT (l.pauses > 0 OR coalesce(l.paused_until > now(), false)
                 OR tq_platform_quota(l) < 1
                 OR tq_worker_room(l, v_to.role, v_from.worker_id, p_task_id) < 1);
  IF NOT v_open AND NOT coalesce(p_sent, false) THEN
    UPDATE worker_tasks t SET send_at = NULL WHERE t.id = p_task_id;
    RETURN QUERY SELECT
      CASE WHEN l.pauses > 0 OR coalesce(l.paused_until > now(), false) THEN 'paused' ELSE 'full' END,
      0.25::DOUBLE PRECISION, false, NULL::worker_tasks, NULL::UUID;
    RETURN;
  END IF;
  IF NOT v_open THEN
    v_new := NULL;  -- a relay's record claims no standby where a pass would not (paused, full)
  END IF;

  -- The next start, reckoned from the clock under the row's lock (0019); a relayed request
  -- went on a start reckoned when its relay was given.
  v_now := clock_timestamp();
  v_base := greatest(l.tat, v_now);
  v_start := CASE WHEN coalesce(p_sent, false) THEN v_now
    ELSE greatest(v_now, v_base - make_interval(secs => tq_platform_tolerance(l.burst, l.requests_per_second))) END;
  v_relay := coalesce(p_relays, false) AND v_open AND l.tat <= v_now
             AND l.max_in_flight <= 0.05 * l.requests_per_second;
  IF v_relay OR NOT coalesce(p_sent, false) THEN
    UPDATE tq_platforms p
    SET tat = (CASE WHEN coalesce(p_sent, false) THEN v_now ELSE v_base + make_interval(secs => 1 / p.requests_per_second) END)
              + CASE WHEN v_relay THEN make_interval(secs => 1 / p.requests_per_second) ELSE interval '0' END,
        updated_at = now()
    WHERE p.platform = l.platform;
  END IF;
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
  SELECT 'go'::TEXT, greatest(extract(EPOCH FROM v_start - v_now), 0)::DOUBLE PRECISION, v_relay,
         m.t, CASE WHEN m.t IS NULL THEN NULL ELSE v_token END
  FROM (SELECT 1) one
  LEFT JOIN moved m ON (m.t).id = v_new;
END;
$$ LANGUAGE plpgsql SET enable_seqscan = off;

CREATE OR REPLACE FUNCTION platform_pass(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, task worker_tasks, lease UUID) AS $$
BEGIN
  RETURN QUERY
  SELECT c.decision, c.wait_seconds, c.task, c.lease
  FROM tq_pass(p_task_id, p_lease, p_next_id, p_next_lease, p_replace, false, false) c;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION platform_relay(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN,
  p_sent BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, relay BOOLEAN, task worker_tasks, lease UUID) AS $$
BEGIN
  RETURN QUERY
  SELECT * FROM tq_pass(p_task_id, p_lease, p_next_id, p_next_lease, p_replace, p_sent, true);
END;
$$ LANGUAGE plpgsql;

INSERT INTO tq_api (function_name) VALUES ('platform_relay') ON CONFLICT DO NOTHING;

CALL tq_secure_functions();
