-- 0032: a slot that a worker's share gives back is announced to the role's other workers.
--
-- Measured (docs/BENCHMARKS.md, "A slot given back is heard at once"): four drain runs start
-- 0.3 to 0.7 s apart on two cores. The first takes every slot of a platform while it is alone;
-- as the others register its share shrinks, and its passes and hand-offs give slots back (0016,
-- 0028). The others found those slots at their next claim, up to a quarter of a second later:
-- 3 to 4.5 s of a platform's slot time, all in a crawl's first 1.7 s.
--
-- Such a slot is now announced: NOTIFY tq_slot_free, whose payload is the JSON object
-- {"role", "platform", "worker"} (the worker that gave it back). A worker listens on its
-- session's connection and claims when it hears one. The notification is a hint, never a
-- permission: a worker that hears it claims through the same limits and shares as ever, and a
-- forged one costs a claim that comes back short.
-- Only slots refused by the share are announced. One given back for a pause, a full quota or an
-- empty queue is of no use to another worker of the role, and a NOTIFY serialises the commits of
-- the transactions that send one.

-- After a pass or a hand-off of ``p_task_id`` that moved nothing: announce its slot when it went
-- back free (the platform has room) because its worker is at its share.
CREATE OR REPLACE FUNCTION tq_slot_refused(p_task_id INTEGER) RETURNS VOID AS $$
DECLARE
  t worker_tasks;
  l tq_platforms;
BEGIN
  SELECT * INTO t FROM worker_tasks w WHERE w.id = p_task_id;
  IF NOT FOUND OR t.worker_id IS NULL OR t.platform IS NULL OR t.send_at IS NOT NULL THEN
    RETURN;  -- the slot is still held (or there was none)
  END IF;
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = t.platform;
  IF FOUND AND tq_platform_quota(l) >= 1 AND tq_worker_room(l, t.role, t.worker_id) < 1 THEN
    PERFORM pg_notify('tq_slot_free',
                      json_build_object('role', t.role, 'platform', t.platform, 'worker', t.worker_id)::TEXT);
  END IF;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION platform_pass(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, task worker_tasks, lease UUID) AS $$
DECLARE
  r RECORD;
BEGIN
  SELECT * INTO r FROM tq_pass(p_task_id, p_lease, p_next_id, p_next_lease, p_replace, false, false);
  IF r.decision = 'full' THEN
    PERFORM tq_slot_refused(p_task_id);
  END IF;
  RETURN QUERY SELECT r.decision, r.wait_seconds, r.task, r.lease;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION platform_relay(
  p_task_id INTEGER, p_lease UUID, p_next_id INTEGER, p_next_lease UUID, p_replace BOOLEAN,
  p_sent BOOLEAN
) RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION, relay BOOLEAN, task worker_tasks, lease UUID) AS $$
DECLARE
  r RECORD;
BEGIN
  SELECT * INTO r FROM tq_pass(p_task_id, p_lease, p_next_id, p_next_lease, p_replace, p_sent, true);
  IF r.decision = 'full' THEN
    PERFORM tq_slot_refused(p_task_id);
  END IF;
  RETURN QUERY SELECT r.decision, r.wait_seconds, r.relay, r.task, r.lease;
END;
$$ LANGUAGE plpgsql;

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
  PERFORM tq_slot_refused(p_task_id);
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
