-- 0013: lease tokens. A worker acts only on what it holds, and proves it with more than a name.
--
-- Until now every call on a held task was fenced by the worker id, which the caller passes: any
-- worker could complete, fail, defer, heartbeat or spend the platform slot of another's task by
-- naming it. A claim now hands out, per task, a lease token (gen_random_uuid: 122 bits from the
-- server's strong random source); the table keeps only its SHA-256 (worker_tasks.lease_hash),
-- so a worker that reads worker_tasks learns nothing it could present. Every call that acts on a
-- held task takes (task id, token) instead of (task id, worker id) and does nothing unless the
-- task is claimed or running under that very token: a stale token (the task was given back and
-- claimed again) is as wrong as a forged one. Worker ids stay, as labels for people.
--
-- Besides:
-- - the handlers' writes (store_menu, mark_store_gone, save_entry_point, upsert_listed_stores)
--   need a held task of the right role, and act on that task's store or platform only;
-- - a platform's error is reported for a held task (on the task's own platform), and only the
--   holder of a half-open platform's probe reopens it;
-- - URLs a platform hands back (a store's menu URL) stay on the platform's hosts
--   (tq_platforms.hosts, loaded by the sync; a relative path stays under the base URL);
-- - the admin's acts: the sync of the limits, pausing and resuming a platform by hand, and
--   cancelling a task (tq_api.for_worker = false: tq grant gives the worker none of them);
-- - register_worker and deregister_worker leave a live registration alone.

------------------------------------------------------------------------------------------------
-- The token's hash, and what the admin alone may call.
------------------------------------------------------------------------------------------------

ALTER TABLE worker_tasks ADD COLUMN IF NOT EXISTS lease_hash BYTEA;
COMMENT ON COLUMN worker_tasks.lease_hash IS
  'SHA-256 of the lease token the last claim handed out: a call on the task presents the token';

-- Inlined (SQL, IMMUTABLE): a NULL token hashes to NULL, which matches nothing.
CREATE OR REPLACE FUNCTION tq_lease_hash(p_lease UUID) RETURNS BYTEA AS $$
  SELECT sha256(uuid_send(p_lease));
$$ LANGUAGE sql IMMUTABLE;

ALTER TABLE tq_api ADD COLUMN IF NOT EXISTS for_worker BOOLEAN NOT NULL DEFAULT true;
COMMENT ON COLUMN tq_api.for_worker IS
  'false: the admin''s alone (tq grant gives the worker no EXECUTE on it)';

ALTER TABLE tq_platforms ADD COLUMN IF NOT EXISTS hosts TEXT[];
COMMENT ON COLUMN tq_platforms.hosts IS
  'The hosts the platform''s URLs may name (the platforms file''s hosts, default its base URL''s); NULL: not loaded';

-- The worker roles of the database as it was: whoever may claim. They get the new functions
-- below and lose the admin's (tq grant, run again, gives the same).
CREATE TEMPORARY TABLE tq_0013_workers ON COMMIT DROP AS
SELECT DISTINCT a.grantee::REGROLE AS role
FROM pg_proc p
CROSS JOIN LATERAL aclexplode(p.proacl) a
WHERE p.oid = 'claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN)'::REGPROCEDURE
  AND a.privilege_type = 'EXECUTE'
  AND a.grantee <> p.proowner
  AND a.grantee <> 0;

------------------------------------------------------------------------------------------------
-- The calls fenced by a worker id go; their lease-fenced successors follow.
------------------------------------------------------------------------------------------------

DROP FUNCTION IF EXISTS claim_task(VARCHAR, VARCHAR);
DROP FUNCTION IF EXISTS claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN);
DROP FUNCTION IF EXISTS start_task(INTEGER, VARCHAR);
DROP FUNCTION IF EXISTS start_tasks(VARCHAR, INTEGER[]);
DROP FUNCTION IF EXISTS heartbeat_tasks(VARCHAR, INTEGER[]);
DROP FUNCTION IF EXISTS complete_task(INTEGER, VARCHAR, JSONB);
DROP FUNCTION IF EXISTS complete_task_tx(INTEGER, VARCHAR, JSONB);
DROP FUNCTION IF EXISTS complete_tasks(VARCHAR, INTEGER[], JSONB[]);
DROP FUNCTION IF EXISTS complete_tasks_timed(VARCHAR, INTEGER[], JSONB[], DOUBLE PRECISION[], DOUBLE PRECISION[]);
DROP FUNCTION IF EXISTS fail_task(INTEGER, VARCHAR, TEXT, BOOLEAN, INTERVAL);
DROP FUNCTION IF EXISTS defer_task(INTEGER, VARCHAR, INTERVAL);
DROP FUNCTION IF EXISTS task_still_owned(INTEGER, VARCHAR);
DROP FUNCTION IF EXISTS platform_request(INTEGER, VARCHAR, BOOLEAN);
DROP FUNCTION IF EXISTS platform_release(INTEGER, VARCHAR);
DROP FUNCTION IF EXISTS platform_error(VARCHAR, INTEGER, TEXT, INTERVAL);
DROP FUNCTION IF EXISTS platform_answered(VARCHAR, INTEGER);
DROP FUNCTION IF EXISTS register_worker(VARCHAR, VARCHAR, VARCHAR, VARCHAR);
DROP FUNCTION IF EXISTS register_worker(VARCHAR, VARCHAR, VARCHAR, VARCHAR, DOUBLE PRECISION);
DELETE FROM tq_api WHERE function_name = 'claim_task';

-- The handlers' writes keep their bodies as helpers; the API's functions of those names check
-- the lease, then call them for the task's store or platform.
ALTER FUNCTION store_menu(INTEGER, TEXT, JSONB) RENAME TO tq_store_menu;
ALTER FUNCTION mark_store_gone(INTEGER, VARCHAR) RENAME TO tq_mark_store_gone;
ALTER FUNCTION save_entry_point(INTEGER, VARCHAR, TEXT, TEXT) RENAME TO tq_save_entry_point;
ALTER FUNCTION upsert_listed_stores(VARCHAR, JSONB) RENAME TO tq_upsert_listed_stores;
ALTER FUNCTION sync_platform_limits(JSONB) RENAME TO tq_sync_limits;
ALTER FUNCTION tq_store_menu(INTEGER, TEXT, JSONB) SECURITY INVOKER RESET ALL;
ALTER FUNCTION tq_mark_store_gone(INTEGER, VARCHAR) SECURITY INVOKER RESET ALL;
ALTER FUNCTION tq_save_entry_point(INTEGER, VARCHAR, TEXT, TEXT) SECURITY INVOKER RESET ALL;
ALTER FUNCTION tq_upsert_listed_stores(VARCHAR, JSONB) SECURITY INVOKER RESET ALL;
ALTER FUNCTION tq_sync_limits(JSONB) SECURITY INVOKER RESET ALL;

-- The task held under p_lease, its row locked (FOR SHARE: recovery cannot give it away before
-- the caller's transaction ends); refused in words when it is not held so, or not of p_roles.
CREATE OR REPLACE FUNCTION tq_held_task(p_function TEXT, p_task_id INTEGER, p_lease UUID, p_roles TEXT[])
RETURNS worker_tasks AS $$
DECLARE
  t worker_tasks;
BEGIN
  SELECT * INTO t
  FROM worker_tasks w
  WHERE w.id = p_task_id
    AND w.status IN ('claimed', 'running')
    AND w.lease_hash = tq_lease_hash(p_lease)
  FOR SHARE;
  IF NOT FOUND THEN
    RAISE EXCEPTION '%: task % is not held under this lease', p_function, coalesce(p_task_id::TEXT, 'NULL')
      USING ERRCODE = 'insufficient_privilege',
            DETAIL = 'It finished, went back to the queue, or was claimed under another lease.',
            HINT = 'Act on a task only with the lease token its claim returned, while it is claimed or running.';
  END IF;
  IF NOT t.role = ANY (p_roles) THEN
    RAISE EXCEPTION '%: task % is a % task; only % tasks may call it',
      p_function, p_task_id, t.role, array_to_string(p_roles, ', ')
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN t;
END;
$$ LANGUAGE plpgsql;

-- A URL a platform handed back, checked against the platform's hosts: a path (under the base
-- URL) or http(s) on one of them, with no user info and nothing a parser could read two ways.
CREATE OR REPLACE FUNCTION tq_url_allowed(p_url TEXT, p_hosts TEXT[]) RETURNS BOOLEAN AS $$
  SELECT CASE
    WHEN p_url ~ '^/(?!/)[^\s\\]*$' THEN true
    ELSE coalesce(
      lower(substring(p_url FROM '^[Hh][Tt][Tt][Pp][Ss]?://([A-Za-z0-9.-]+)(?::[0-9]{1,5})?(?:[/?#][^\s\\]*)?$'))
        = ANY (p_hosts),
      false)
  END;
$$ LANGUAGE sql IMMUTABLE;

-- A URL for an error message: its scheme and host only (user info, a path or a query may carry
-- a secret).
CREATE OR REPLACE FUNCTION tq_url_shown(p_url TEXT) RETURNS TEXT AS $$
  -- Only a plain scheme://host[:port] is shown: anything else before the path (user info, which
  -- may hold '/', '?' or '#') hides the whole URL.
  SELECT coalesce(
    substring(p_url FROM '^([A-Za-z][A-Za-z0-9+.-]*://[A-Za-z0-9.-]+(?::[0-9]{1,5})?)(?:[/?#]|$)') || '/...',
    '(a URL not shown: no plain scheme://host)');
$$ LANGUAGE sql IMMUTABLE;

------------------------------------------------------------------------------------------------
-- The claim: as 0008's, and each task claimed gets a fresh lease token, returned beside it.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION claim_tasks(
  p_role VARCHAR,
  p_worker_id VARCHAR,
  p_max_tasks INTEGER,
  p_start BOOLEAN DEFAULT false
) RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_want INTEGER := p_max_tasks;
  v_work VARCHAR[];
  v_platforms VARCHAR[];
  v_quotas INTEGER[];
  v_stores INTEGER[];
  v_store_platforms VARCHAR[];
  v_loose INTEGER[];
  v_skip INTEGER[] := '{}';
  v_claimed INTEGER;
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  IF p_max_tasks IS NULL OR p_max_tasks NOT BETWEEN 1 AND 1000 THEN
    PERFORM tq_refuse('claim_tasks', 'max_tasks', p_max_tasks::TEXT, 'must be between 1 and 1000',
      'A claim takes 1 to 1000 tasks at once.');
  END IF;

  -- The platforms with pending work of this role ('' for none): skip scans of the heads and of
  -- store-less tasks, one index probe per platform.
  WITH RECURSIVE heads (platform) AS (
    (SELECT h.platform FROM worker_task_heads h WHERE h.role = p_role ORDER BY h.platform LIMIT 1)
    UNION ALL
    SELECT (SELECT h.platform FROM worker_task_heads h
            WHERE h.role = p_role AND h.platform > x.platform
            ORDER BY h.platform LIMIT 1)
    FROM heads x
    WHERE x.platform IS NOT NULL
  ),
  loose (platform) AS (
    (SELECT coalesce(t.platform, '') FROM worker_tasks t
     WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL
     ORDER BY coalesce(t.platform, '') LIMIT 1)
    UNION ALL
    SELECT (SELECT coalesce(t.platform, '') FROM worker_tasks t
            WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL
              AND coalesce(t.platform, '') > x.platform
            ORDER BY coalesce(t.platform, '') LIMIT 1)
    FROM loose x
    WHERE x.platform IS NOT NULL
  )
  SELECT array_agg(DISTINCT w.platform ORDER BY w.platform)
  INTO v_work
  FROM (SELECT platform FROM heads UNION ALL SELECT platform FROM loose) w
  WHERE w.platform IS NOT NULL;

  IF v_work IS NULL THEN
    PERFORM tq_require_role(p_role);
    RETURN;
  END IF;

  -- The limited platforms among them, locked in platform order (every locker of several
  -- platform rows takes them in this order), before any store: writers lock stores, then
  -- platforms, and a claim waits only here. Claims of one platform queue here; that is what
  -- makes its limits exact.
  PERFORM 1
  FROM tq_platforms l
  WHERE l.platform = ANY (v_work)
  ORDER BY l.platform
  FOR UPDATE;

  -- Heads that a task not yet due at their last derivation may now overtake.
  SELECT array_agg(r.dispensary_id)
  INTO v_stores
  FROM (
    SELECT h.dispensary_id
    FROM worker_task_heads h
    JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
    WHERE h.role = p_role
      AND h.recheck_at <= now()
    ORDER BY h.recheck_at
    LIMIT 100
    FOR UPDATE OF s SKIP LOCKED
  ) r;
  IF v_stores IS NOT NULL THEN
    PERFORM tq_refresh_heads(v_stores, array_fill(p_role, ARRAY[cardinality(v_stores)]));
  END IF;

  -- A store picked below can come back empty only when its best task is locked by another
  -- writer (a cancel); try again without it rather than return less than is due. Each pass
  -- leaves out at least one more store, so the loop ends.
  LOOP
    SELECT
      array_agg(w.platform),
      array_agg(CASE WHEN l.platform IS NULL THEN p_max_tasks ELSE tq_platform_quota(l) END)
    INTO v_platforms, v_quotas
    FROM unnest(v_work) AS w (platform)
    LEFT JOIN tq_platforms l ON l.platform = w.platform;

    -- Per platform with room, its best idle stores with due work (from the heads) and its best
    -- store-less tasks; then the platforms take turns: every platform's first, then every
    -- platform's second, ... Locking the store row serialises the claims of one store.
    WITH room AS (
      SELECT r.platform, least(r.quota, v_want) AS quota
      FROM unnest(v_platforms, v_quotas) AS r (platform, quota)
      WHERE r.quota > 0
    ),
    by_store AS (
      SELECT c.*
      FROM room r
      CROSS JOIN LATERAL (
        SELECT h.priority, h.due_at, h.dispensary_id, NULL::INTEGER AS task_id, h.platform
        FROM worker_task_heads h
        JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
        WHERE h.role = p_role
          AND h.platform = r.platform
          AND h.due_at <= now()
          AND s.active_task_id IS NULL
          AND h.dispensary_id <> ALL (v_skip)
        ORDER BY h.priority DESC, h.due_at, h.dispensary_id
        LIMIT r.quota
        FOR UPDATE OF s SKIP LOCKED
      ) c
    ),
    loose AS (
      SELECT c.*
      FROM room r
      CROSS JOIN LATERAL (
        SELECT t.priority, t.due_at, NULL::INTEGER AS dispensary_id, t.id AS task_id, r.platform
        FROM worker_tasks t
        WHERE t.role = p_role
          AND coalesce(t.platform, '') = r.platform
          AND t.status = 'pending'
          AND t.dispensary_id IS NULL
          AND t.due_at <= now()
        ORDER BY t.priority DESC, t.due_at, t.id
        LIMIT r.quota
        FOR UPDATE OF t SKIP LOCKED
      ) c
    ),
    turns AS (
      SELECT
        b.*,
        row_number() OVER (PARTITION BY b.platform ORDER BY b.priority DESC, b.due_at) AS turn
      FROM (SELECT * FROM by_store UNION ALL SELECT * FROM loose) b
    ),
    best AS (
      SELECT t.*
      FROM turns t
      JOIN room r ON r.platform = t.platform
      WHERE t.turn <= r.quota
      ORDER BY t.turn, t.priority DESC, t.due_at, t.platform
      LIMIT v_want
    )
    SELECT
      array_agg(dispensary_id) FILTER (WHERE dispensary_id IS NOT NULL),
      array_agg(platform) FILTER (WHERE dispensary_id IS NOT NULL),
      array_agg(task_id) FILTER (WHERE task_id IS NOT NULL)
    INTO v_stores, v_store_platforms, v_loose
    FROM best;

    IF v_stores IS NULL AND v_loose IS NULL THEN
      RETURN;
    END IF;

    -- Each task of a limited platform gets its first request's start from the platform's GCRA,
    -- in turn order (base = max(tat, now); start i = max(now, base + i/rate - tolerance)),
    -- and the platform's tat moves past them. The statement triggers mark the stores busy,
    -- re-derive their heads and count the platforms' new tasks in flight.
    RETURN QUERY
    WITH picked AS (
      SELECT t.id, t.priority, t.due_at, coalesce(t.platform, '') AS platform
      FROM unnest(v_stores, v_store_platforms) AS s (dispensary_id, platform)
      CROSS JOIN LATERAL (
        SELECT t.id, t.priority, t.due_at, t.platform
        FROM worker_tasks t
        WHERE t.dispensary_id = s.dispensary_id
          AND t.role = p_role
          AND t.status = 'pending'
          AND t.due_at <= now()
        ORDER BY t.priority DESC, t.due_at, t.id
        LIMIT 1
        FOR UPDATE OF t SKIP LOCKED
      ) t
      WHERE coalesce(t.platform, '') = s.platform
      UNION ALL
      SELECT t.id, t.priority, t.due_at, coalesce(t.platform, '')
      FROM worker_tasks t
      WHERE t.id = ANY (v_loose)
    ),
    timed AS (
      SELECT
        p.id,
        p.platform,
        CASE WHEN l.platform IS NOT NULL THEN
          greatest(
            now(),
            greatest(l.tat, now())
              + make_interval(secs => (row_number() OVER (PARTITION BY p.platform
                                                          ORDER BY p.priority DESC, p.due_at, p.id) - 1)
                                      / l.requests_per_second
                                      - tq_platform_tolerance(l.burst, l.requests_per_second)))
        END AS send_at,
        -- The lease: 122 random bits, shown to the claimer once and kept only as a hash.
        gen_random_uuid() AS token
      FROM picked p
      LEFT JOIN tq_platforms l ON l.platform = p.platform
    ),
    paced AS (
      UPDATE tq_platforms l
      SET tat = greatest(l.tat, now()) + make_interval(secs => c.n / l.requests_per_second),
          -- A half-open platform's one task is its probe.
          probe_task_id = CASE WHEN l.pauses > 0 THEN c.first_id ELSE l.probe_task_id END,
          probe_sent = CASE WHEN l.pauses > 0 THEN false ELSE l.probe_sent END,
          updated_at = now()
      FROM (SELECT m.platform, count(*) AS n, min(m.id) AS first_id FROM timed m GROUP BY m.platform) c
      WHERE l.platform = c.platform
    ),
    claimed AS (
      UPDATE worker_tasks t
      SET status = CASE WHEN p_start THEN 'running' ELSE 'claimed' END,
          worker_id = p_worker_id,
          claimed_at = now(),
          started_at = CASE WHEN p_start THEN now() END,
          completed_at = NULL,
          send_at = m.send_at,
          -- A fresh lease: a recovered task's old heartbeat must not count against its new owner.
          last_heartbeat_at = now(),
          lease_hash = tq_lease_hash(m.token)
      FROM timed m
      WHERE t.id = m.id
      RETURNING t AS claimed_row, m.token
    )
    SELECT c.claimed_row, c.token
    FROM claimed c
    ORDER BY (c.claimed_row).send_at NULLS FIRST, (c.claimed_row).priority DESC, (c.claimed_row).due_at,
             (c.claimed_row).id;

    GET DIAGNOSTICS v_claimed = ROW_COUNT;
    v_want := v_want - v_claimed;
    EXIT WHEN v_want <= 0
      OR v_claimed = coalesce(cardinality(v_stores), 0) + coalesce(cardinality(v_loose), 0);
    -- Stores that yielded nothing (we still hold their rows): re-derive their heads, in case
    -- the head outlived its task (a deleted row), and leave them out of the next attempt.
    v_stores := ARRAY(
      SELECT s.dispensary_id
      FROM worker_task_stores s
      WHERE s.dispensary_id = ANY (v_stores)
        AND s.active_task_id IS NULL
    );
    EXIT WHEN cardinality(v_stores) = 0;
    PERFORM tq_refresh_heads(v_stores, array_fill(p_role, ARRAY[cardinality(v_stores)]));
    v_skip := v_skip || v_stores;
  END LOOP;
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

COMMENT ON FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN) IS
  'Claim (and, with p_start, start) up to N due tasks of a role, at most one per store, each with its lease token';

------------------------------------------------------------------------------------------------
-- A worker's calls on its tasks: (task id, lease token). A wrong, stale or missing token is the
-- same as a task no longer held: nothing written, the same answer as a lost lease.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION start_task(p_task_id INTEGER, p_lease UUID) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'running',
      started_at = coalesce(started_at, now()),
      last_heartbeat_at = now()
  WHERE id = p_task_id
    AND lease_hash = tq_lease_hash(p_lease)
    AND status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- The lists of task ids and of their tokens, one token per id, in the same order.
CREATE OR REPLACE FUNCTION tq_check_leases(p_function TEXT, p_task_ids INTEGER[], p_leases UUID[])
RETURNS VOID AS $$
BEGIN
  IF cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_leases) THEN
    RAISE EXCEPTION '%: % task ids and % lease tokens', p_function,
      coalesce(cardinality(p_task_ids)::TEXT, 'NULL'), coalesce(cardinality(p_leases)::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give each task id with the lease token its claim returned, in the same order.';
  END IF;
  IF cardinality(p_task_ids) > 1000 THEN
    PERFORM tq_refuse(p_function, 'task_ids', format('%s tasks', cardinality(p_task_ids)),
      'must list at most 1000 tasks', 'A claim takes at most 1000 tasks: act on one claim''s worth at a time.');
  END IF;
END;
$$ LANGUAGE plpgsql IMMUTABLE;

CREATE OR REPLACE FUNCTION start_tasks(p_task_ids INTEGER[], p_leases UUID[]) RETURNS INTEGER[] AS $$
DECLARE
  v_started INTEGER[];
BEGIN
  PERFORM tq_check_leases('start_tasks', p_task_ids, p_leases);
  WITH started AS (
    UPDATE worker_tasks t
    SET status = 'running',
        started_at = coalesce(t.started_at, now()),
        last_heartbeat_at = now()
    FROM unnest(p_task_ids, p_leases) AS r (id, lease)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_started FROM started;
  RETURN v_started;
END;
$$ LANGUAGE plpgsql;

-- The leases extended (the ids still held); the worker's registry row, a label, says it is
-- alive (idle when it holds nothing).
CREATE OR REPLACE FUNCTION heartbeat_tasks(p_worker_id VARCHAR, p_task_ids INTEGER[], p_leases UUID[])
RETURNS INTEGER[] AS $$
DECLARE
  v_owned INTEGER[];
BEGIN
  PERFORM tq_check_leases('heartbeat_tasks', p_task_ids, p_leases);
  WITH held AS (
    SELECT t.id
    FROM worker_tasks t
    JOIN unnest(p_task_ids, p_leases) AS r (id, lease) ON r.id = t.id
    WHERE t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
  ),
  lockable AS (
    SELECT t.id
    FROM worker_tasks t
    WHERE t.id IN (SELECT h.id FROM held h)
    ORDER BY t.id
    FOR NO KEY UPDATE SKIP LOCKED
  ),
  -- The lease again here: a task recovered and claimed again between the read above and its
  -- lock is another's, and the update's recheck of the newest row sees that.
  beaten AS (
    UPDATE worker_tasks t
    SET last_heartbeat_at = now()
    FROM lockable l, unnest(p_task_ids, p_leases) AS r (id, lease)
    WHERE t.id = l.id
      AND r.id = t.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  ),
  -- Locked by a writer of their own (the handler's transaction): still held.
  busy AS (
    SELECT h.id FROM held h WHERE h.id NOT IN (SELECT l.id FROM lockable l)
  )
  SELECT coalesce(array_agg(x.id ORDER BY x.id), '{}') INTO v_owned
  FROM (SELECT b.id FROM beaten b UNION ALL SELECT b.id FROM busy b) x;

  -- The label's row notes a sign of life only from a caller that proved one lease (or held
  -- none): forged tokens would otherwise keep a dead worker's row from going offline.
  UPDATE worker_registry
  SET last_heartbeat_at = now(),
      status = CASE WHEN cardinality(v_owned) > 0 THEN 'active' ELSE 'idle' END
  WHERE worker_id = p_worker_id
    AND status <> 'offline'
    AND (cardinality(v_owned) > 0 OR coalesce(cardinality(p_task_ids), 0) = 0);
  RETURN v_owned;
END;
$$ LANGUAGE plpgsql;

-- In the handler's own transaction: the completion commits with its writes.
CREATE OR REPLACE FUNCTION complete_task_tx(p_task_id INTEGER, p_lease UUID, p_result JSONB)
RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks
  SET status = 'completed',
      result = p_result,
      error_message = NULL,
      started_at = coalesce(started_at, claimed_at),
      completed_at = now()
  WHERE id = p_task_id
    AND lease_hash = tq_lease_hash(p_lease)
    AND status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_task(p_task_id INTEGER, p_lease UUID, p_result JSONB) RETURNS BOOLEAN AS $$
DECLARE
  v_worker VARCHAR;
BEGIN
  UPDATE worker_tasks
  SET status = 'completed',
      result = p_result,
      error_message = NULL,
      started_at = coalesce(started_at, claimed_at),
      completed_at = now()
  WHERE id = p_task_id
    AND lease_hash = tq_lease_hash(p_lease)
    AND status IN ('claimed', 'running')
  RETURNING worker_id INTO v_worker;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  PERFORM worker_completed(v_worker, 1);
  RETURN true;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_tasks_timed(
  p_task_ids INTEGER[],
  p_leases UUID[],
  p_results JSONB[],
  p_began_after DOUBLE PRECISION[],
  p_ended_after DOUBLE PRECISION[]
) RETURNS INTEGER[] AS $$
DECLARE
  v_done INTEGER[];
BEGIN
  PERFORM tq_check_leases('complete_tasks_timed', p_task_ids, p_leases);
  IF cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_results)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_began_after)
     OR cardinality(p_task_ids) IS DISTINCT FROM cardinality(p_ended_after) THEN
    RAISE EXCEPTION 'complete_tasks_timed: % task ids, % results, % begin and % end times',
      cardinality(p_task_ids), cardinality(p_results), cardinality(p_began_after), cardinality(p_ended_after)
      USING ERRCODE = '22023',
            HINT = 'Give one result, one begin and one end time (or NULL) per task id, in the same order.';
  END IF;

  WITH done AS (
    UPDATE worker_tasks t
    SET status = 'completed',
        result = r.result,
        error_message = NULL,
        started_at = CASE
          WHEN r.began IS NULL THEN coalesce(t.started_at, t.claimed_at)
          ELSE least(t.claimed_at + make_interval(secs => greatest(r.began, 0)), now()) END,
        completed_at = CASE
          WHEN r.ended IS NULL THEN now()
          ELSE least(t.claimed_at + make_interval(secs => greatest(r.ended, coalesce(r.began, 0), 0)), now()) END
    FROM unnest(p_task_ids, p_leases, p_results, p_began_after, p_ended_after) AS r (id, lease, result, began, ended)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.id, t.worker_id
  ),
  -- Each worker's count (a batch is one worker's), in the same statement.
  counted AS (
    UPDATE worker_registry w
    SET tasks_completed = w.tasks_completed + c.n, last_heartbeat_at = now()
    FROM (SELECT d.worker_id, count(*) AS n FROM done d GROUP BY d.worker_id) c
    WHERE w.worker_id = c.worker_id
  )
  SELECT coalesce(array_agg(d.id ORDER BY d.id), '{}') INTO v_done FROM done d;
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION complete_tasks(p_task_ids INTEGER[], p_leases UUID[], p_results JSONB[])
RETURNS INTEGER[] AS $$
BEGIN
  RETURN complete_tasks_timed(
    p_task_ids, p_leases, p_results,
    array_fill(NULL::DOUBLE PRECISION, ARRAY[coalesce(cardinality(p_task_ids), 0)]),
    array_fill(NULL::DOUBLE PRECISION, ARRAY[coalesce(cardinality(p_task_ids), 0)]));
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION fail_task(
  p_task_id INTEGER,
  p_lease UUID,
  p_error TEXT,
  p_retryable BOOLEAN DEFAULT true,
  p_retry_after INTERVAL DEFAULT NULL
) RETURNS TEXT AS $$
DECLARE
  v_again BOOLEAN;
  v_worker VARCHAR;
  v_status TEXT;
BEGIN
  SELECT coalesce(p_retryable, true) AND t.retry_count < t.max_retries, t.worker_id
  INTO v_again, v_worker
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;

  IF v_again THEN
    UPDATE worker_tasks t
    SET status = 'pending',
        retry_count = t.retry_count + 1,
        scheduled_for = now() + greatest(
          tq_retry_delay(t.role, t.retry_count),
          least(greatest(p_retry_after, INTERVAL '0'), INTERVAL '1 day')),
        worker_id = NULL,
        claimed_at = NULL,
        started_at = NULL,
        last_heartbeat_at = NULL,
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  ELSE
    UPDATE worker_tasks t
    SET status = 'failed',
        started_at = coalesce(t.started_at, t.claimed_at),
        completed_at = now(),
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  END IF;

  UPDATE worker_registry
  SET tasks_failed = tasks_failed + 1, last_heartbeat_at = now()
  WHERE worker_id = v_worker;
  RETURN v_status;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION defer_task(p_task_id INTEGER, p_lease UUID, p_delay INTERVAL) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks t
  SET status = 'pending',
      scheduled_for = now() + least(greatest(coalesce(p_delay, INTERVAL '0'), INTERVAL '0'), INTERVAL '1 day'),
      worker_id = NULL,
      claimed_at = NULL,
      started_at = NULL,
      last_heartbeat_at = NULL
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- Taken by a handler in the transaction that writes its results: one row while the lease holds,
-- locked until the commit (recovery waits for it); none when the lease is gone.
CREATE OR REPLACE FUNCTION task_still_owned(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (owned INTEGER) AS $$
  SELECT 1
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
  FOR SHARE;
$$ LANGUAGE sql;

------------------------------------------------------------------------------------------------
-- The platform calls of a held task: its own platform's slot, start, errors and probe.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION platform_request(p_task_id INTEGER, p_lease UUID, p_first BOOLEAN)
RETURNS TABLE (decision TEXT, wait_seconds DOUBLE PRECISION) AS $$
DECLARE
  v_platform VARCHAR;
  v_send_at TIMESTAMPTZ;
  l tq_platforms;
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

  IF coalesce(p_first, true) THEN
    SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_platform;
  ELSE
    SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_platform FOR UPDATE;
  END IF;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'go'::TEXT, 0::DOUBLE PRECISION;
    RETURN;
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

  IF coalesce(p_first, true) AND v_send_at IS NOT NULL THEN
    RETURN QUERY SELECT v_decision, greatest(extract(EPOCH FROM v_send_at - now()), 0)::DOUBLE PRECISION;
    RETURN;
  END IF;

  -- A further request (or a task claimed before its platform had limits): the next start.
  v_base := greatest(l.tat, now());
  UPDATE tq_platforms p
  SET tat = v_base + make_interval(secs => 1 / p.requests_per_second)
  WHERE p.platform = v_platform;
  RETURN QUERY SELECT
    v_decision,
    greatest(extract(EPOCH FROM v_base - now()) - tq_platform_tolerance(l.burst, l.requests_per_second), 0)
      ::DOUBLE PRECISION;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION platform_release(p_task_id INTEGER, p_lease UUID) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks t
  SET send_at = NULL
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL;
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- An answer of the task's platform that speaks of the platform (5xx, 429, a timeout), counted by
-- its breaker. Only a held task reports, on its own platform; the pause it causes is bounded by
-- the platform's max_pause_seconds, which the admin's sync sets.
CREATE OR REPLACE FUNCTION platform_error(
  p_task_id INTEGER,
  p_lease UUID,
  p_error TEXT,
  p_retry_after INTERVAL DEFAULT NULL
) RETURNS TABLE (paused BOOLEAN, wait_seconds DOUBLE PRECISION) AS $$
DECLARE
  v_platform VARCHAR;
  l tq_platforms;
  v_error TEXT := left(coalesce(nullif(p_error, ''), 'unknown error'), 1000);
  -- NULL when the server said nothing (greatest and least would turn a NULL into a bound).
  v_after DOUBLE PRECISION := CASE
    WHEN p_retry_after IS NOT NULL THEN least(greatest(extract(EPOCH FROM p_retry_after), 0), 86400)
  END;
  v_for DOUBLE PRECISION;
BEGIN
  SELECT t.platform INTO v_platform
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running');
  IF NOT FOUND THEN
    RETURN QUERY SELECT false, 0::DOUBLE PRECISION;
    RETURN;
  END IF;
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = v_platform FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT false, 0::DOUBLE PRECISION;
    RETURN;
  END IF;

  IF l.paused_until > now() THEN
    UPDATE tq_platforms p
    SET errors_total = p.errors_total + 1, last_error = v_error, last_error_at = now(), updated_at = now()
    WHERE p.platform = v_platform;
    RETURN QUERY SELECT true, extract(EPOCH FROM l.paused_until - now())::DOUBLE PRECISION;
    RETURN;
  END IF;

  IF v_after IS NULL
     AND l.error_streak + 1 < l.pause_after_errors
     AND NOT (l.pauses > 0 AND l.probe_task_id = p_task_id) THEN
    UPDATE tq_platforms p
    SET error_streak = p.error_streak + 1,
        errors_total = p.errors_total + 1,
        last_error = v_error,
        last_error_at = now(),
        updated_at = now()
    WHERE p.platform = v_platform;
    RETURN QUERY SELECT false, 0::DOUBLE PRECISION;
    RETURN;
  END IF;

  v_for := least(
    l.max_pause_seconds,
    greatest(
      coalesce(v_after, 0),
      CASE WHEN l.pauses = 0 AND v_after IS NOT NULL THEN 0
           ELSE l.pause_seconds * power(2, least(l.pauses, 30)) END));
  UPDATE tq_platforms p
  SET paused_until = now() + make_interval(secs => v_for),
      pause_reason = v_error,
      pauses = p.pauses + 1,
      probe_task_id = NULL,
      probe_sent = false,
      error_streak = 0,
      errors_total = p.errors_total + 1,
      last_error = v_error,
      last_error_at = now(),
      updated_at = now()
  WHERE p.platform = v_platform;
  RETURN QUERY SELECT true, v_for;
END;
$$ LANGUAGE plpgsql;

-- The probe of a half-open platform got an answer: the platform is back for every worker. Only
-- the probe's holder may say so.
CREATE OR REPLACE FUNCTION platform_answered(p_task_id INTEGER, p_lease UUID) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE tq_platforms p
  SET pauses = 0,
      paused_until = NULL,
      probe_task_id = NULL,
      probe_sent = false,
      error_streak = 0,
      updated_at = now()
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND p.platform = t.platform
    AND p.probe_task_id = t.id
    AND p.probe_sent;
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The handlers' writes: a held task of the right role, on its own store or platform.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION store_menu(p_task_id INTEGER, p_lease UUID, p_menu_hash TEXT, p_products JSONB)
RETURNS TABLE (unchanged BOOLEAN, seen INTEGER, new INTEGER, changed INTEGER, gone INTEGER) AS $$
DECLARE
  t worker_tasks := tq_held_task('store_menu', p_task_id, p_lease, ARRAY['product_discovery', 'product_resync']);
BEGIN
  RETURN QUERY SELECT * FROM tq_store_menu(t.dispensary_id, p_menu_hash, p_products);
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION mark_store_gone(p_task_id INTEGER, p_lease UUID) RETURNS VOID AS $$
DECLARE
  t worker_tasks := tq_held_task('mark_store_gone', p_task_id, p_lease,
                                 ARRAY['entry_point_discovery', 'product_discovery', 'product_resync']);
BEGIN
  PERFORM tq_mark_store_gone(t.dispensary_id, t.platform);
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION save_entry_point(p_task_id INTEGER, p_lease UUID, p_platform_id TEXT, p_menu_url TEXT)
RETURNS VOID AS $$
DECLARE
  t worker_tasks := tq_held_task('save_entry_point', p_task_id, p_lease, ARRAY['entry_point_discovery']);
  v_hosts TEXT[];
BEGIN
  IF p_menu_url IS NOT NULL THEN
    SELECT l.hosts INTO v_hosts FROM tq_platforms l WHERE l.platform = t.platform;
    IF NOT tq_url_allowed(p_menu_url, v_hosts) THEN
      RAISE EXCEPTION 'save_entry_point: menu_url % is not on the hosts of platform % (%)',
        tq_url_shown(p_menu_url), quote_literal(t.platform), coalesce(array_to_string(v_hosts, ', '), 'none loaded')
        USING ERRCODE = 'invalid_parameter_value',
              HINT = 'A menu URL is a path under the platform''s base URL, or http(s) on a host of its hosts '
                     '(the platforms file''s hosts, default the base URL''s host), with no user info.';
    END IF;
  END IF;
  PERFORM tq_save_entry_point(t.dispensary_id, t.platform, p_platform_id, p_menu_url);
END;
$$ LANGUAGE plpgsql;

-- A listing of the task's platform (store_discovery), at most 10,000 stores a call.
CREATE OR REPLACE FUNCTION upsert_listed_stores(p_task_id INTEGER, p_lease UUID, p_stores JSONB)
RETURNS TABLE (dispensary_id INTEGER, directory_id TEXT, created BOOLEAN) AS $$
DECLARE
  t worker_tasks := tq_held_task('upsert_listed_stores', p_task_id, p_lease, ARRAY['store_discovery']);
BEGIN
  IF jsonb_typeof(p_stores) = 'array' AND jsonb_array_length(p_stores) > 10000 THEN
    PERFORM tq_refuse('upsert_listed_stores', 'stores', format('%s stores', jsonb_array_length(p_stores)),
      'must list at most 10000 stores', 'One region''s listing of one platform: a few hundred stores.');
  END IF;
  RETURN QUERY SELECT * FROM tq_upsert_listed_stores(coalesce(t.platform, t.payload ->> 'platform'), p_stores);
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Registrations: a live one is left alone.
------------------------------------------------------------------------------------------------

-- The backend holding a worker's session lock (0011), or NULL.
CREATE OR REPLACE FUNCTION tq_session_pid(w worker_registry) RETURNS INTEGER AS $$
  SELECT l.pid
  FROM pg_locks l
  WHERE l.locktype = 'advisory'
    AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
    AND l.classid = 7471::OID
    AND l.objid = w.id::OID
    AND l.objsubid = 2
    AND l.granted
  LIMIT 1;
$$ LANGUAGE sql STABLE;

-- Register (or re-register) a worker. Refused while the registration is alive elsewhere: its
-- session lock held by another connection, or (a worker without a session) its heartbeat within
-- its lease. A new registration under a live worker's id could shorten its leases, or mark it
-- offline, and so take its tasks.
CREATE OR REPLACE FUNCTION register_worker(
  p_worker_id VARCHAR,
  p_role VARCHAR,
  p_pod_name VARCHAR DEFAULT NULL,
  p_hostname VARCHAR DEFAULT NULL,
  p_heartbeat_seconds DOUBLE PRECISION DEFAULT NULL
) RETURNS VOID AS $$
DECLARE
  w worker_registry;
  v_pid INTEGER;
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  PERFORM tq_require_role(p_role);
  IF p_heartbeat_seconds IS NOT NULL AND NOT (p_heartbeat_seconds > 0 AND p_heartbeat_seconds <= 3600) THEN
    PERFORM tq_refuse('register_worker', 'heartbeat_seconds', p_heartbeat_seconds::TEXT,
      'must be above 0 and at most 3600',
      'The seconds between the worker''s heartbeats; its leases end after a few of them of silence.');
  END IF;
  IF length(p_pod_name) > 100 THEN
    PERFORM tq_refuse('register_worker', 'pod_name', tq_shown(p_pod_name), 'must be at most 100 characters',
      'The pod the worker runs in, up to 100 characters (worker_registry.pod_name), or NULL.');
  END IF;
  IF length(p_hostname) > 100 THEN
    PERFORM tq_refuse('register_worker', 'hostname', tq_shown(p_hostname), 'must be at most 100 characters',
      'The host the worker runs on, up to 100 characters (worker_registry.hostname), or NULL.');
  END IF;

  SELECT * INTO w FROM worker_registry r WHERE r.worker_id = p_worker_id FOR UPDATE;
  IF FOUND THEN
    v_pid := tq_session_pid(w);
    IF v_pid IS DISTINCT FROM pg_backend_pid() AND (
         v_pid IS NOT NULL
         OR (NOT w.session_bound
             AND w.status <> 'offline'
             AND w.last_heartbeat_at > now() - make_interval(
                   secs => greatest(10, 2.5 * coalesce(w.heartbeat_seconds, 30))))
         -- A registration without a session that still holds tasks: taken over, its heartbeat
         -- interval would decide when its tasks' leases end.
         OR (NOT w.session_bound AND EXISTS (
               SELECT 1 FROM worker_tasks t
               WHERE t.worker_id = p_worker_id AND t.status IN ('claimed', 'running'))))
    THEN
      RAISE EXCEPTION 'register_worker: worker % is registered and alive', tq_shown(p_worker_id)
        USING ERRCODE = '55P03',
              DETAIL = CASE WHEN v_pid IS NOT NULL THEN 'Its session is held by another connection.'
                            ELSE 'It heartbeat within its lease, or holds tasks.' END,
              HINT = 'Worker ids name one live worker; give this one its own (default_worker_id).';
    END IF;
  END IF;

  INSERT INTO worker_registry AS r (
    worker_id, role, pod_name, hostname, started_at, last_heartbeat_at, status, heartbeat_seconds)
  VALUES (p_worker_id, p_role, p_pod_name, p_hostname, now(), now(), 'active', p_heartbeat_seconds)
  ON CONFLICT (worker_id) DO UPDATE
  SET role = excluded.role,
      pod_name = excluded.pod_name,
      hostname = excluded.hostname,
      started_at = now(),
      last_heartbeat_at = now(),
      status = 'active',
      heartbeat_seconds = excluded.heartbeat_seconds;
END;
$$ LANGUAGE plpgsql;

-- Offline, unless its session is alive on another connection (the worker deregisters on its
-- own session's connection), or, without a session, while it holds tasks (offline, its id
-- could be registered again with another heartbeat interval, which decides its leases).
CREATE OR REPLACE FUNCTION deregister_worker(p_worker_id VARCHAR) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_registry w
  SET status = 'offline', last_heartbeat_at = now()
  WHERE w.worker_id = p_worker_id
    AND w.status <> 'offline'
    AND coalesce(tq_session_pid(w), pg_backend_pid()) = pg_backend_pid()
    AND (w.session_bound OR NOT EXISTS (
           SELECT 1 FROM worker_tasks t
           WHERE t.worker_id = p_worker_id AND t.status IN ('claimed', 'running')));
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The admin's acts: the limits, and a platform paused or resumed by hand.
------------------------------------------------------------------------------------------------

-- As 0012's (now tq_sync_limits), and each platform's hosts: "hosts", a list of 1 to 20 host
-- names (lower case, no port), the hosts its URLs may name.
CREATE OR REPLACE FUNCTION sync_platform_limits(p_limits JSONB) RETURNS INTEGER AS $$
DECLARE
  v_bad RECORD;
  v_changed INTEGER;
BEGIN
  IF jsonb_typeof(p_limits) = 'array' THEN
    SELECT x.e ->> 'platform' AS platform, x.e -> 'hosts' AS hosts
    INTO v_bad
    FROM jsonb_array_elements(p_limits) WITH ORDINALITY AS x (e, n)
    WHERE jsonb_typeof(x.e) = 'object'
      AND x.e ? 'hosts'
      AND jsonb_typeof(x.e -> 'hosts') <> 'null'
      AND (jsonb_typeof(x.e -> 'hosts') <> 'array'
           OR jsonb_array_length(x.e -> 'hosts') NOT BETWEEN 1 AND 20
           OR EXISTS (
             SELECT 1 FROM jsonb_array_elements(x.e -> 'hosts') AS h (v)
             WHERE jsonb_typeof(h.v) <> 'string'
                OR (h.v #>> '{}') !~ '^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$'
                OR length(h.v #>> '{}') > 253))
    ORDER BY x.n
    LIMIT 1;
    IF FOUND THEN
      PERFORM tq_refuse('sync_platform_limits', format('hosts of platform %s', quote_literal(v_bad.platform)),
        tq_shown(v_bad.hosts::TEXT), 'must be a list of 1 to 20 host names in lower case',
        'The hosts a platform''s URLs may name, e.g. ["menus.example.com"]: no scheme, port or path.');
    END IF;
  END IF;
  PERFORM tq_sync_limits(p_limits);
  UPDATE tq_platforms l
  SET hosts = x.hosts, updated_at = now()
  FROM (
    SELECT e ->> 'platform' AS platform,
           CASE WHEN jsonb_typeof(e -> 'hosts') = 'array'
                THEN ARRAY(SELECT jsonb_array_elements_text(e -> 'hosts') ORDER BY 1) END AS hosts
    FROM jsonb_array_elements(p_limits) AS e
  ) x
  WHERE l.platform = x.platform
    AND x.hosts IS NOT NULL  -- no "hosts": left as loaded
    AND l.hosts IS DISTINCT FROM x.hosts;
  -- Changed: inserted or updated by this transaction, limits or hosts.
  SELECT count(*) INTO v_changed
  FROM tq_platforms l
  WHERE l.platform IN (SELECT e ->> 'platform' FROM jsonb_array_elements(p_limits) AS e)
    AND l.updated_at = now();
  RETURN v_changed;
END;
$$ LANGUAGE plpgsql;

-- Pause a platform by hand for p_seconds (up to a day): no claims, and its tasks' requests wait;
-- then one probe first, as after any pause.
CREATE OR REPLACE FUNCTION platform_pause(p_platform VARCHAR, p_seconds DOUBLE PRECISION, p_reason TEXT)
RETURNS TIMESTAMPTZ AS $$
DECLARE
  v_until TIMESTAMPTZ;
BEGIN
  IF p_seconds IS NULL OR p_seconds NOT BETWEEN 1 AND 86400 THEN
    PERFORM tq_refuse('platform_pause', 'seconds', coalesce(p_seconds::TEXT, 'NULL'), 'must be between 1 and 86400',
      'How long the platform stays paused, in seconds: up to a day; resume it sooner with platform_resume.');
  END IF;
  UPDATE tq_platforms p
  SET paused_until = now() + make_interval(secs => p_seconds),
      pause_reason = left(coalesce(nullif(p_reason, ''), 'paused by hand'), 1000),
      pauses = p.pauses + 1,
      probe_task_id = NULL,
      probe_sent = false,
      error_streak = 0,
      updated_at = now()
  WHERE p.platform = p_platform
  RETURNING p.paused_until INTO v_until;
  IF NOT FOUND THEN
    PERFORM tq_refuse('platform_pause', 'platform', tq_shown(p_platform), 'must be a platform with limits',
      tq_known_platforms_hint());
  END IF;
  RETURN v_until;
END;
$$ LANGUAGE plpgsql;

-- Resume a platform at once: no pause, no probe, its error streak forgotten.
CREATE OR REPLACE FUNCTION platform_resume(p_platform VARCHAR) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE tq_platforms p
  SET paused_until = NULL,
      pauses = 0,
      probe_task_id = NULL,
      probe_sent = false,
      error_streak = 0,
      updated_at = now()
  WHERE p.platform = p_platform;
  IF NOT FOUND THEN
    PERFORM tq_refuse('platform_resume', 'platform', tq_shown(p_platform), 'must be a platform with limits',
      tq_known_platforms_hint());
  END IF;
  RETURN true;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Registered, and granted.
------------------------------------------------------------------------------------------------

INSERT INTO tq_api (function_name, for_worker) VALUES
  ('platform_pause', false), ('platform_resume', false)
ON CONFLICT DO NOTHING;
UPDATE tq_api SET for_worker = false
WHERE function_name IN ('sync_platform_limits', 'cancel_task', 'platform_pause', 'platform_resume');

-- As 0012's, granting the worker no function of the admin's.
CREATE OR REPLACE PROCEDURE tq_grant_worker(p_role NAME) AS $$
DECLARE
  v_schema TEXT := current_schema();
  -- Read by the named queries of the worker's paths (sql/*.sql), by name.
  v_reads CONSTANT TEXT[] := ARRAY[
    'worker_tasks',         -- get_task, stuck_tasks, claimable_now, platform_errors, prune counts
    'worker_task_roles',    -- task_roles: the roles the sensors and drain runs serve
    'worker_task_heads',    -- claimable_now
    'worker_task_stores',   -- claimable_now
    'tq_platforms',         -- claimable_now, platform_counter_drift
    'worker_registry',      -- worker_liveness (dead drain runs), count_prunable_workers
    'task_completion_log',  -- completion_log_hour (the rollup asset)
    'dispensaries',         -- store_entry_point (the crawl handlers)
    'store_crawl_state',    -- store_entry_point
    'store_analytics',      -- analytics_summary (analytics_refresh), store freshness
    'product_history',      -- count_prunable_product_history (a dry-run prune)
    'tq_retention',         -- retention_watermark, retention_floors
    'v_worker_capacity',    -- TaskQueue.capacity: queue_health_sensor, tq status
    'v_platform_status',    -- TaskQueue.platform_status: the platform sensors, tq platforms
    'v_store_freshness',    -- store freshness
    'v_task_history'        -- the tasks with their stores, for whoever looks
  ];
  v_owner TEXT;
  v_routes BIGINT;
  v_route TEXT;
  r RECORD;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_worker: role % does not exist', quote_ident(p_role)
      USING ERRCODE = 'undefined_object', HINT = 'Create it first (tq grant does).';
  END IF;
  IF (SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % is a superuser or bypasses row security', quote_ident(p_role)
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the worker a role of its own, with LOGIN and no other attribute.';
  END IF;
  -- The database's owner is implicitly a member of pg_database_owner, which owns schema public:
  -- it may DROP the queue's tables there, and take CONNECT from others.
  IF pg_has_role(p_role, (SELECT d.datdba FROM pg_database d WHERE d.datname = current_database()), 'MEMBER')
  THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % owns database %, or is a member of its owner %',
      quote_ident(p_role), quote_ident(current_database()),
      (SELECT d.datdba::REGROLE::TEXT FROM pg_database d WHERE d.datname = current_database())
      USING ERRCODE = 'invalid_parameter_value',
            HINT = format('Give the worker a role of its own that owns no database, or give the database '
                          'another owner: ALTER DATABASE %I OWNER TO <the admin role>;', current_database());
  END IF;
  -- A role that is, or can become, an owner of the queue's objects or of its schema has all
  -- their rights.
  SELECT o.owner::REGROLE::TEXT INTO v_owner
  FROM (
    SELECT c.relowner AS owner FROM tq_queue_relations() q JOIN pg_class c ON c.oid = q.relation
    UNION
    SELECT p.proowner FROM tq_queue_functions() q JOIN pg_proc p ON p.oid = q.signature
    UNION
    SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = v_schema
  ) o
  WHERE pg_has_role(p_role, o.owner, 'MEMBER')
  LIMIT 1;
  IF v_owner IS NOT NULL THEN
    RAISE EXCEPTION
      'tq_grant_worker: worker role % is, or is a member of, %, which owns schema % or objects of the queue in it',
      quote_ident(p_role), v_owner, v_schema
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the worker a role of its own, member of no role that owns the queue or its schema.';
  END IF;
  -- A SECURITY DEFINER function runs with its owner's rights: owned by a superuser, any flaw in
  -- one (or a helper it calls) would hand the worker the whole cluster.
  SELECT string_agg(DISTINCT o.rolname::TEXT, ', ') INTO v_owner
  FROM tq_queue_functions() q
  JOIN pg_proc p ON p.oid = q.signature
  JOIN pg_roles o ON o.oid = p.proowner
  WHERE p.prosecdef
    AND o.rolsuper;
  IF v_owner IS NOT NULL THEN
    RAISE EXCEPTION 'tq_grant_worker: the queue''s functions run as %, a superuser: the worker would call them '
      'with a superuser''s rights', v_owner
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give them an owner of their own, without SUPERUSER: tq grant --admin-role tq_admin '
                   '(run once as a superuser) makes it and hands them over.';
  END IF;

  FOR r IN
    SELECT format('REVOKE ALL ON %s %s FROM %I',
             CASE q.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, q.relation, p_role) AS statement
    FROM tq_queue_relations() q
    UNION ALL
    SELECT format('REVOKE ALL ON %s %s FROM %I',
             CASE q.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, q.signature, p_role)
    FROM tq_queue_functions() q
  LOOP
    EXECUTE r.statement;
  END LOOP;
  EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM %I', v_schema, p_role);
  -- PUBLIC has CONNECT unless the database's owner took it away; only the owner may give it.
  IF NOT has_database_privilege(p_role, current_database(), 'CONNECT') THEN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), p_role);
  END IF;
  EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
  FOR r IN
    SELECT q.relation
    FROM tq_queue_relations() q
    JOIN pg_class c ON c.oid = q.relation
    WHERE c.relname = ANY (v_reads)
      AND q.relkind <> 'S'
    ORDER BY c.relname
  LOOP
    EXECUTE format('GRANT SELECT ON %s TO %I', r.relation, p_role);
  END LOOP;
  FOR r IN
    SELECT q.signature, q.prokind
    FROM tq_queue_functions() q
    JOIN pg_proc p ON p.oid = q.signature
    WHERE q.is_api AND NOT q.is_trigger
      -- The admin's functions (0013) stay the admin's.
      AND NOT EXISTS (SELECT 1 FROM tq_api a WHERE a.function_name = p.proname AND NOT a.for_worker)
  LOOP
    EXECUTE format('GRANT EXECUTE ON %s %s TO %I',
      CASE r.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, r.signature, p_role);
  END LOOP;
  -- What the role holds now is what it was given, unless it can reach more by another route (a
  -- predefined role, another role's grants, PUBLIC's): that, tq grant cannot take back without
  -- changing roles that may serve others. Refused, and the transaction with it.
  SELECT count(*), string_agg(w.route, '; ') INTO v_routes, v_route
  FROM tq_worker_write_routes(p_role) w;
  IF v_routes > 0 THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % can change the queue outside its functions (% route%): %',
      quote_ident(p_role), v_routes, CASE WHEN v_routes > 1 THEN 's' ELSE '' END, v_route
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Take each away (REVOKE <role> FROM <worker>; REVOKE ... FROM PUBLIC; ALTER ROLE ... NOCREATEROLE), '
                   'or give the worker a role of its own, member of no other role.';
  END IF;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();

-- The worker roles of before: the new calls, none of the admin's.
DO $$
DECLARE
  r RECORD;
BEGIN
  FOR r IN
    SELECT format('%s EXECUTE ON %s %s %s %s',
             CASE WHEN a.for_worker THEN 'GRANT' ELSE 'REVOKE' END,
             CASE q.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, q.signature,
             CASE WHEN a.for_worker THEN 'TO' ELSE 'FROM' END, w.role) AS statement
    FROM tq_0013_workers w
    CROSS JOIN tq_queue_functions() q
    JOIN pg_proc p ON p.oid = q.signature
    JOIN tq_api a ON a.function_name = p.proname
    WHERE NOT q.is_trigger
  LOOP
    EXECUTE r.statement;
  END LOOP;
END;
$$;
