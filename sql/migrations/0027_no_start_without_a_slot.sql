-- 0027: a request's start goes only to a task that holds one of its platform's slots.
--
-- The slots count the tasks whose send_at is set (the counting triggers). platform_request took
-- a start for any held task, with or without a slot: a task that had given its slot back
-- (platform_release) or passed it on (platform_handoff), and was still its worker's, was told
-- 'go' while the freed slot served another task, one request more in flight than the limit
-- (tests/integration/test_lease_attacks.py, a worker's attack through plain SQL). A task
-- claimed before its platform had limits took starts the same way, never counted.
--
-- Such a task now takes a slot first, under the platform's row lock and within the same
-- quota and fair share as a claim (tq_platform_quota, tq_worker_room): its send_at is set, the
-- triggers count it, and it keeps the slot until it gives it back as any other task. With no
-- slot free the answer is 'full' with a wait, and nothing is written. A slot taken here commits
-- as the other slot bookkeeping does (0025): a crash may lose it, as it may lose a hand-off.
--
-- Safe to run twice.

CREATE OR REPLACE FUNCTION platform_request(p_task_id INTEGER, p_lease UUID, p_first BOOLEAN)
RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION) AS $$
DECLARE
  v_platform VARCHAR;
  v_role VARCHAR;
  v_worker VARCHAR;
  v_send_at TIMESTAMPTZ;
  v_holds BOOLEAN;
  l tq_platforms;
  v_now TIMESTAMPTZ;
  v_base TIMESTAMPTZ;
  v_decision TEXT := 'go';
BEGIN
  PERFORM tq_slot_commit();  -- 0025
  SELECT t.platform, t.send_at, t.role, t.worker_id INTO v_platform, v_send_at, v_role, v_worker
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running');
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION;
    RETURN;
  END IF;
  v_holds := v_send_at IS NOT NULL;

  SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_platform;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'go'::TEXT, 0::DOUBLE PRECISION;
    RETURN;
  END IF;
  -- The start the claim reserved, if still good; else the next one, under the row's lock.
  IF NOT coalesce(p_first, true)
     OR v_send_at IS NULL
     OR v_send_at < now() - make_interval(secs => tq_platform_grace(l.burst, l.requests_per_second)) THEN
    v_send_at := NULL;
    SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_platform FOR UPDATE;
  END IF;

  IF l.paused_until > now() THEN
    RETURN QUERY SELECT 'paused'::TEXT, extract(EPOCH FROM l.paused_until - now())::DOUBLE PRECISION;
    RETURN;
  END IF;
  IF l.pauses > 0 AND l.probe_task_id IS DISTINCT FROM p_task_id THEN
    RETURN QUERY SELECT 'paused'::TEXT, l.pause_seconds;
    RETURN;
  END IF;
  -- No slot, no start: a slot first, as a claim would take it (0027).
  IF NOT v_holds AND (tq_platform_quota(l) < 1 OR tq_worker_room(l, v_role, v_worker) < 1) THEN
    RETURN QUERY SELECT 'full'::TEXT, 0.25::DOUBLE PRECISION;
    RETURN;
  END IF;
  IF l.pauses > 0 THEN
    -- The probe asks the platform: its answer decides (platform_answered, platform_error).
    v_decision := 'probe';
    IF NOT l.probe_sent THEN
      UPDATE tq_platforms p SET probe_sent = true WHERE p.platform = v_platform AND p.probe_task_id = p_task_id;
    END IF;
  END IF;

  IF v_send_at IS NOT NULL THEN
    RETURN QUERY SELECT v_decision, greatest(extract(EPOCH FROM v_send_at - now()), 0)::DOUBLE PRECISION;
    RETURN;
  END IF;

  -- The next start: one interval past the platform's last, less its tolerance, and not before now.
  v_now := clock_timestamp();
  v_base := greatest(l.tat, v_now);
  UPDATE tq_platforms p
  SET tat = v_base + make_interval(secs => 1 / p.requests_per_second)
  WHERE p.platform = v_platform;
  IF NOT v_holds THEN
    -- Counted by the triggers from here: the slot is the task's until it gives it back.
    UPDATE worker_tasks t
    SET send_at = greatest(v_base - make_interval(secs => tq_platform_tolerance(l.burst, l.requests_per_second)), v_now)
    WHERE t.id = p_task_id;
  END IF;
  RETURN QUERY SELECT
    v_decision,
    greatest(extract(EPOCH FROM v_base - v_now) - tq_platform_tolerance(l.burst, l.requests_per_second), 0)
      ::DOUBLE PRECISION;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
