-- Worker sessions: a worker's life is its connection's, so that a worker killed -9 gives back
-- what it held in seconds, not at the end of its lease.
--
-- A worker that registers through register_worker_session holds, on a connection of its own
-- for as long as it runs, a session-level advisory lock keyed on its registry row
-- (pg_advisory_lock(7471, worker_registry.id)). PostgreSQL drops the lock when that connection
-- ends: the process exited or was killed (its kernel closes the socket), or its pod went away.
-- Whether the lock is held is a fact of the server (pg_locks), not something a caller says, so:
-- - release_dead_workers gives back the tasks of the workers it is named whose session is gone:
--   whoever names them (the drain sensor, for runs Dagster marked failed), a live worker's tasks
--   stay where they are;
-- - register_worker_session refuses to take over a registration whose session is alive.
-- A worker registered the old way (register_worker, no session) is untouched by both: its
-- leases end by silence (expire_leases, recover_stale_tasks) as before.
--
-- A server restart ends every session: a worker registered before the server last started is not
-- taken for dead by its lock (it registers again on a new connection at its next heartbeat);
-- its leases end by silence, as before.
--
-- What the lock cannot see: a host that vanishes without closing its sockets (a node lost, a
-- network cut) leaves the server waiting on TCP keepalives; such a worker's tasks come back by
-- lease expiry, as before.

ALTER TABLE worker_registry
  ADD COLUMN IF NOT EXISTS session_bound BOOLEAN NOT NULL DEFAULT false;
COMMENT ON COLUMN worker_registry.session_bound IS
  'The worker holds its session lock (pg_advisory_lock(7471, id)) while it runs: no lock, no worker';

-- Is the worker's session alive? True while its lock is held, false once it is not, NULL when
-- the lock says nothing: no session, or one that began before the server last started (the
-- restart ended it, not the worker). The lock is looked up in pg_locks (readable by every role);
-- the two-key form of an advisory lock shows as classid = key 1, objid = key 2, objsubid = 2.
CREATE OR REPLACE FUNCTION tq_session_alive(w worker_registry)
RETURNS BOOLEAN AS $$
  SELECT CASE
    WHEN EXISTS (
      SELECT 1
      FROM pg_locks l
      WHERE l.locktype = 'advisory'
        AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
        AND l.classid = 7471::OID
        AND l.objid = w.id::OID
        AND l.objsubid = 2
        AND l.granted
    ) THEN true
    WHEN w.session_bound AND w.started_at > pg_postmaster_start_time() THEN false
  END;
$$ LANGUAGE sql STABLE;

CREATE OR REPLACE FUNCTION register_worker_session(
  p_worker_id VARCHAR(100),
  p_role VARCHAR(50),
  p_pod_name VARCHAR(100),
  p_hostname VARCHAR(100),
  p_heartbeat_seconds DOUBLE PRECISION
) RETURNS INTEGER AS $$
DECLARE
  v_id INTEGER;
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  SELECT w.id INTO v_id FROM worker_registry w WHERE w.worker_id = p_worker_id;
  -- The lock first: a registration alive on another connection is never overwritten. Taken
  -- again on the same connection, the lock is the caller's already (it counts up, harmless).
  IF v_id IS NOT NULL AND NOT pg_try_advisory_lock(7471, v_id) THEN
    RAISE EXCEPTION 'register_worker_session: worker % is registered and alive on another connection',
      tq_shown(p_worker_id)
      USING ERRCODE = '55P03',
            HINT = 'Worker ids name one live worker; give this one its own (default_worker_id).';
  END IF;
  PERFORM register_worker(p_worker_id, p_role, p_pod_name, p_hostname, p_heartbeat_seconds);
  IF v_id IS NULL THEN
    SELECT w.id INTO v_id FROM worker_registry w WHERE w.worker_id = p_worker_id;
    IF NOT pg_try_advisory_lock(7471, v_id) THEN
      RAISE EXCEPTION 'register_worker_session: the session lock of worker % is held by another connection',
        tq_shown(p_worker_id)
        USING ERRCODE = '55P03',
              HINT = 'Another connection took the lock of this new registration; register again.';
    END IF;
  END IF;
  UPDATE worker_registry SET session_bound = true WHERE id = v_id AND NOT session_bound;
  RETURN v_id;
END;
$$ LANGUAGE plpgsql;

-- The tasks of the named workers whose session has ended go back to pending now (a retry
-- spent, as when a lease expires: the handler may have begun), or fail when out of retries;
-- the workers go offline. Workers without a session, whose session is alive, or already offline
-- (they deregistered, or were released before) are left alone.
CREATE OR REPLACE FUNCTION release_dead_workers(p_worker_ids VARCHAR(100)[])
RETURNS TABLE(workers INTEGER, recovered INTEGER, failed INTEGER) AS $$
BEGIN
  IF p_worker_ids IS NULL OR cardinality(p_worker_ids) > 1000 THEN
    PERFORM tq_refuse('release_dead_workers', 'worker_ids', coalesce(cardinality(p_worker_ids)::TEXT, 'NULL'),
      'must list at most 1000 workers',
      'The ids of workers believed dead (drain runs Dagster marked failed), in batches of up to 1000.');
  END IF;
  WITH dead AS (
    SELECT w.id, w.worker_id
    FROM worker_registry w
    WHERE w.worker_id = ANY(p_worker_ids)
      AND w.status <> 'offline'
      AND tq_session_alive(w) IS false
  ),
  released AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
        retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
        error_message = format('worker %s is gone (its session ended)', t.worker_id),
        worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
        claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
        last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
        completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
    FROM dead d
    WHERE t.worker_id = d.worker_id
      AND t.status IN ('claimed', 'running')
    RETURNING t.status
  ),
  gone AS (
    UPDATE worker_registry w
    SET status = 'offline'
    FROM dead d
    WHERE w.id = d.id
      AND w.status <> 'offline'
    RETURNING w.id
  )
  SELECT
    (SELECT count(*)::INTEGER FROM dead),
    (SELECT count(*)::INTEGER FROM released r WHERE r.status = 'pending'),
    (SELECT count(*)::INTEGER FROM released r WHERE r.status = 'failed')
  INTO workers, recovered, failed;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

-- worker_liveness for the drain sensor: whether each worker's session is alive (NULL when its
-- lock says nothing, see tq_session_alive).
CREATE OR REPLACE FUNCTION worker_sessions(p_worker_ids VARCHAR(100)[])
RETURNS TABLE(
  worker_id VARCHAR(100),
  status VARCHAR(20),
  silent_seconds DOUBLE PRECISION,
  heartbeat_seconds DOUBLE PRECISION,
  session_alive BOOLEAN
) AS $$
  SELECT w.worker_id, w.status,
         extract(EPOCH FROM now() - w.last_heartbeat_at)::FLOAT8,
         coalesce(w.heartbeat_seconds, 30)::FLOAT8,
         tq_session_alive(w)
  FROM worker_registry w
  WHERE w.worker_id = ANY(p_worker_ids);
$$ LANGUAGE sql STABLE;

INSERT INTO tq_api (function_name) VALUES
  ('register_worker_session'), ('release_dead_workers'), ('worker_sessions')
ON CONFLICT DO NOTHING;
CALL tq_secure_functions();
