-- 0029: two functions of the slot's path keep their plans.
--
-- A function in LANGUAGE sql whose body reads a table is planned again at every call from a new
-- statement: PostgreSQL 15 caches no plan for it (plpgsql caches its statements' plans for the
-- session). Two such functions run for every task of a limited platform:
-- * tq_worker_slots, the fair share's count, under the platform's row lock in every claim,
--   hand-off, pass and standby claim (0028). Measured on a server of the bench's own
--   (pg_stat_statements, track = all; bench/slot_handoffs.py --pass): 0.355 ms a call, of which
--   its query ran 0.032; and by pgbench, one call per transaction from a plpgsql function, 0.21
--   to 0.22 ms against 0.09 to 0.10 in plpgsql (0.07 for the transaction alone).
-- * task_still_owned, which opens every handler transaction (ctx.transaction()): 0.18 to 0.22 ms
--   a call against 0.10 in plpgsql.
-- Both are now plpgsql, with the same queries: the same answers, the same locks.
--
-- Safe to run twice.

CREATE OR REPLACE FUNCTION tq_worker_slots(p_worker_id VARCHAR, p_platform VARCHAR, p_except INTEGER)
RETURNS INTEGER AS $$
BEGIN
  RETURN (
    SELECT count(*)::INTEGER
    FROM worker_tasks t  -- idx_worker_tasks_holding
    WHERE t.worker_id = p_worker_id
      AND t.platform = p_platform
      AND t.status IN ('claimed', 'running')
      AND t.send_at IS NOT NULL
      AND t.id IS DISTINCT FROM p_except
  );
END;
$$ LANGUAGE plpgsql STABLE;

-- One row while the lease holds, locked until the commit (recovery waits for it); none when the
-- lease is gone (0013).
CREATE OR REPLACE FUNCTION task_still_owned(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (owned INTEGER) AS $$
BEGIN
  RETURN QUERY
  SELECT 1
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
  FOR SHARE;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
