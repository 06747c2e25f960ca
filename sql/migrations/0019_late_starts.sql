-- 0019: a start is good for a moment only. A request sent well after the start its platform gave
-- it would arrive among the starts given after it, and a second of the platform could hear more
-- than its rate and burst (measured at the server: six arrivals in one second at 4/s, burst 1,
-- once a drain's process stalled a quarter of a second). Such a request now takes a new start.
--
-- platform_request(first => true) hands a task the start its claim reserved (send_at) only
-- while that start is less than the platform's grace in the past; a task whose handler began
-- later takes the next start, as a further request does. The grace is half the platform's
-- margin, how far one request may fall behind the next before they would break the limit: one
-- interval and as much of the burst as the tolerance leaves out (tq_platform_grace). The
-- worker asks again, first => true, when it woke late for the start it was given; the start of
-- a further request is not kept, so a late one asks first => false (docs/QUEUE.md, "Late starts").
--
-- And a new start is reckoned from the platform's row once locked and from the clock then, not
-- from the statement's start: a call that waited for the row would otherwise start its request
-- in the past, as close to the one before as the wait was long. A task claimed before its
-- platform had limits takes its start under the row's lock too.
--
-- Safe to run twice.

------------------------------------------------------------------------------------------------
-- How long after its start a request may still be sent: half of what the GCRA leaves between a
-- start and the limit. In a steady stream the starts are one interval apart and the limit allows
-- `burst` in a second beyond `rate`; after an idle spell the tolerance (burst - 1 intervals, less
-- 0.1 s) spends all of the burst but one interval and 0.1 s. At least 10 ms, the worker's own
-- measure of a late wake: at a rate that never binds, a handler's first request, a few
-- milliseconds after its claim, keeps its start instead of taking the platform's row lock.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_platform_grace(p_burst INTEGER, p_rate DOUBLE PRECISION)
RETURNS DOUBLE PRECISION AS $$
  SELECT greatest((p_burst / p_rate - tq_platform_tolerance(p_burst, p_rate)) / 2, 0.01);
$$ LANGUAGE sql IMMUTABLE;

CREATE OR REPLACE FUNCTION platform_request(p_task_id INTEGER, p_lease UUID, p_first BOOLEAN)
RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION) AS $$
DECLARE
  v_platform VARCHAR;
  v_send_at TIMESTAMPTZ;
  l tq_platforms;
  v_now TIMESTAMPTZ;
  v_base TIMESTAMPTZ;
  v_decision TEXT := 'go';
BEGIN
  SELECT t.platform, t.send_at INTO v_platform, v_send_at
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running');
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'lost'::TEXT, 0::DOUBLE PRECISION;
    RETURN;
  END IF;

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
  RETURN QUERY SELECT
    v_decision,
    greatest(extract(EPOCH FROM v_base - v_now) - tq_platform_tolerance(l.burst, l.requests_per_second), 0)
      ::DOUBLE PRECISION;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
