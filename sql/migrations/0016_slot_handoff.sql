-- 0016: a platform's freed slot goes to the next task at once, runs share a platform evenly, and
-- a request the client gave up on keeps its slot while the platform may still be serving it.
-- Measured by bench/crawl_throughput.py (docs/BENCHMARKS.md, "Crawl throughput against the
-- politeness bound").
--
-- - platform_handoff(task, lease): a task done with its platform's requests gives its slot back
--   and, in the same transaction, its worker claims (and starts) the next due task of that
--   platform under the same limits. The platform's row stays locked from the release to the
--   claim: the slot is never seen free, and never counted twice. A drain run no longer waits
--   for its main loop between one request's end and the next task's claim.
-- - Fair shares: a worker takes no more of a platform's slots than ceil(max_in_flight / live
--   workers of its role) (alive: not offline, heard from within 2.5 heartbeat intervals, at
--   least 10 s), in claims and hand-offs alike. A run that holds more than its share (it came
--   first) hands off nothing until it is back within it, so the slots it frees go to the others.
-- - platform_abandon(task, lease, seconds): the client gave up on a request (a timeout) that
--   the platform may still be serving. The task's slot becomes a hold on the platform's row
--   (tq_platforms.busy_until), counted against max_in_flight until that time, whatever becomes
--   of the task or its process: nothing has to come back to free it.
--
-- Safe to run twice.

------------------------------------------------------------------------------------------------
-- Holds: slots of requests abandoned by their client, each busy until its time.
------------------------------------------------------------------------------------------------

ALTER TABLE tq_platforms ADD COLUMN IF NOT EXISTS busy_until TIMESTAMPTZ[] NOT NULL DEFAULT '{}';
COMMENT ON COLUMN tq_platforms.busy_until IS
  'Slots held by requests the client gave up on (a timeout), each until the platform can no longer be serving it';

-- The holds still running. (PL/pgSQL here and below: its plans are kept between calls, where a
-- SQL function that cannot be inlined is planned at every call, in every claim.)
CREATE OR REPLACE FUNCTION tq_platform_held(l tq_platforms) RETURNS INTEGER AS $$
BEGIN
  IF cardinality(l.busy_until) = 0 THEN
    RETURN 0;
  END IF;
  RETURN (SELECT count(*) FROM unnest(l.busy_until) AS u (until) WHERE u.until > now());
END;
$$ LANGUAGE plpgsql STABLE;

-- As 0006's, with the holds taking slots as tasks do.
CREATE OR REPLACE FUNCTION tq_platform_quota(l tq_platforms) RETURNS INTEGER AS $$
  SELECT CASE
    WHEN l.paused_until > now() THEN 0
    WHEN l.pauses > 0 THEN
      CASE WHEN l.probe_task_id IS NULL AND l.in_flight + tq_platform_held(l) < l.max_in_flight
           THEN 1 ELSE 0 END
    ELSE greatest(0, least(
      l.max_in_flight - l.in_flight - tq_platform_held(l),
      -- starts s_i = max(now, base + i*T - tau) with s_i <= now + 1 s
      floor((1.0 + tq_platform_tolerance(l.burst, l.requests_per_second)
             - extract(EPOCH FROM greatest(l.tat, now()) - now())) * l.requests_per_second)::INTEGER + 1))
  END;
$$ LANGUAGE sql STABLE;

------------------------------------------------------------------------------------------------
-- Fair shares of a platform's slots between the live workers of a role.
------------------------------------------------------------------------------------------------

-- The tasks a worker holds a slot with, per platform: what its share is measured against.
CREATE INDEX IF NOT EXISTS idx_worker_tasks_holding
  ON worker_tasks (worker_id, platform)
  WHERE status IN ('claimed', 'running') AND send_at IS NOT NULL;

-- ceil(max_in_flight / the role's live workers): the most of a platform's slots one worker of
-- the role takes. Every live worker then gets room; the shares add up to at least the limit, so
-- none is left unused while every worker wants its share. A worker that is not registered
-- counts as one.
CREATE OR REPLACE FUNCTION tq_fair_share(p_max_in_flight INTEGER, p_role VARCHAR) RETURNS INTEGER AS $$
BEGIN
  RETURN ceil(p_max_in_flight::NUMERIC / greatest(1, (
    SELECT count(*)
    FROM worker_registry w
    WHERE w.role = p_role
      AND w.status <> 'offline'
      AND w.last_heartbeat_at > now() - make_interval(secs => greatest(2.5 * coalesce(w.heartbeat_seconds, 30), 10))
  )))::INTEGER;
END;
$$ LANGUAGE plpgsql STABLE;

-- How many more of the platform's slots the worker may take: its share less what it holds.
CREATE OR REPLACE FUNCTION tq_worker_room(l tq_platforms, p_role VARCHAR, p_worker_id VARCHAR)
RETURNS INTEGER AS $$
BEGIN
  RETURN greatest(0, tq_fair_share(l.max_in_flight, p_role) - (
    SELECT count(*)::INTEGER
    FROM worker_tasks t  -- idx_worker_tasks_holding
    WHERE t.worker_id = p_worker_id
      AND t.platform = l.platform
      AND t.status IN ('claimed', 'running')
      AND t.send_at IS NOT NULL));
END;
$$ LANGUAGE plpgsql STABLE;

------------------------------------------------------------------------------------------------
-- The claim: 0013's, raising its role's floors (0015) first and walking the heads from them,
-- within the worker's share of each platform.
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
  v_floors TIMESTAMPTZ[];
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  IF p_max_tasks IS NULL OR p_max_tasks NOT BETWEEN 1 AND 1000 THEN
    PERFORM tq_refuse('claim_tasks', 'max_tasks', p_max_tasks::TEXT, 'must be between 1 and 1000',
      'A claim takes 1 to 1000 tasks at once.');
  END IF;

  PERFORM tq_raise_floors(p_role);

  -- The platforms with pending work of this role ('' for none): one probe of the heads per
  -- platform that ever had any, from its floor, and a skip scan of the store-less tasks.
  WITH RECURSIVE heads (platform) AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1 FROM worker_task_heads h
                  WHERE h.role = p_role AND h.platform = f.platform AND h.due_at >= f.floor)
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
      array_agg(CASE WHEN l.platform IS NULL THEN p_max_tasks
                   ELSE least(tq_platform_quota(l), tq_worker_room(l, p_role, p_worker_id)) END),
      array_agg(coalesce(f.floor, '-infinity'))
    INTO v_platforms, v_quotas, v_floors
    FROM unnest(v_work) AS w (platform)
    LEFT JOIN tq_platforms l ON l.platform = w.platform
    LEFT JOIN worker_task_floors f ON f.role = p_role AND f.platform = w.platform;

    -- Per platform with room, its best idle stores with due work (from the heads) and its best
    -- store-less tasks; then the platforms take turns: every platform's first, then every
    -- platform's second, ... Locking the store row serialises the claims of one store.
    WITH room AS (
      SELECT r.platform, least(r.quota, v_want) AS quota, r.floor
      FROM unnest(v_platforms, v_quotas, v_floors) AS r (platform, quota, floor)
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
          AND h.due_at >= r.floor  -- checked in the index: dead heads below it cost no visit
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
-- The hand-off and the abandoned request.
------------------------------------------------------------------------------------------------

-- One task of one platform, for a hand-off: claim_tasks' choice (the best idle store's best due
-- task, or the best due store-less task, whichever comes first in claim order) within the
-- platform's limits and the worker's share, in a few index probes. It runs with the platform's
-- row locked, and every hand-off of the platform queues there: it must be short. Nothing when a
-- store or task it would take is locked by another writer (the next full claim sees to it).
CREATE OR REPLACE FUNCTION tq_claim_next(p_role VARCHAR, p_worker_id VARCHAR, p_platform VARCHAR)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  l tq_platforms;
  v_store_task INTEGER;
  v_store_key RECORD;
  v_loose RECORD;
  v_id INTEGER;
  v_token UUID := gen_random_uuid();
BEGIN
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = p_platform FOR UPDATE;
  IF NOT FOUND OR l.pauses > 0 OR tq_platform_quota(l) < 1 OR tq_worker_room(l, p_role, p_worker_id) < 1 THEN
    RETURN;
  END IF;

  SELECT h.priority, h.due_at, h.dispensary_id INTO v_store_key
  FROM worker_task_heads h
  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
  WHERE h.role = p_role
    AND h.platform = p_platform
    AND h.due_at >= coalesce((SELECT f.floor FROM worker_task_floors f
                              WHERE f.role = p_role AND f.platform = p_platform), '-infinity')
    AND h.due_at <= now()
    AND s.active_task_id IS NULL
  ORDER BY h.priority DESC, h.due_at, h.dispensary_id
  LIMIT 1
  FOR UPDATE OF s SKIP LOCKED;

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
    SELECT t.id INTO v_store_task
    FROM worker_tasks t
    WHERE t.dispensary_id = v_store_key.dispensary_id
      AND t.role = p_role
      AND t.status = 'pending'
      AND t.due_at <= now()
      AND coalesce(t.platform, '') = p_platform
    ORDER BY t.priority DESC, t.due_at, t.id
    LIMIT 1
    FOR UPDATE OF t SKIP LOCKED;
    v_id := v_store_task;
  ELSE
    v_id := v_loose.id;
  END IF;
  IF v_id IS NULL THEN
    RETURN;
  END IF;

  -- The GCRA as in a claim of one: its start, and tat one interval further.
  UPDATE tq_platforms p
  SET tat = greatest(p.tat, now()) + make_interval(secs => 1 / p.requests_per_second),
      updated_at = now()
  WHERE p.platform = p_platform;
  -- The statement triggers mark the store busy, re-derive its head and count the slot.
  RETURN QUERY
  UPDATE worker_tasks t
  SET status = 'running',
      worker_id = p_worker_id,
      claimed_at = now(),
      started_at = now(),
      completed_at = NULL,
      send_at = greatest(now(), greatest(l.tat, now())
                                - make_interval(secs => tq_platform_tolerance(l.burst, l.requests_per_second))),
      last_heartbeat_at = now(),
      lease_hash = tq_lease_hash(v_token)
  WHERE t.id = v_id
  RETURNING t, v_token;
END;
$$ LANGUAGE plpgsql;

-- The task is done with its platform's requests: its slot goes back (as platform_release), and
-- its worker claims and starts the next due task of the platform if the limits and its share
-- allow, in one transaction. The release locks the task's row, then (its trigger) the
-- platform's, as every writer does; the claim then finds the platform's row already held.
-- A half-open platform is left to the full claims, which choose its probe: a task handed off is
-- claimed while its platform is open, and that claim is its first request's permission (it
-- starts at its send_at without asking platform_request again).
-- No row: nothing claimed (none due, no room, half-open, or the task did not hold a slot).
CREATE OR REPLACE FUNCTION platform_handoff(p_task_id INTEGER, p_lease UUID)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  v_role VARCHAR;
  v_worker VARCHAR;
  v_platform VARCHAR;
BEGIN
  UPDATE worker_tasks t
  SET send_at = NULL
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL
  RETURNING t.role, t.worker_id, t.platform INTO v_role, v_worker, v_platform;
  IF NOT FOUND OR v_platform IS NULL OR v_worker IS NULL THEN
    RETURN;
  END IF;
  RETURN QUERY SELECT c.task, c.lease FROM tq_claim_next(v_role, v_worker, v_platform) c;
END;
$$ LANGUAGE plpgsql;

COMMENT ON FUNCTION platform_handoff(INTEGER, UUID) IS
  'Give the task''s platform slot back and claim the next due task of that platform for its worker, at once';

-- The client gave up on the task's request (a timeout): the platform may serve it for up to
-- p_busy_seconds more (its server-side timeout). The task's slot becomes a hold until then, in
-- the same transaction (never seen free); the task goes on to report its error and end as any
-- other. Returns whether the task held a slot.
CREATE OR REPLACE FUNCTION platform_abandon(p_task_id INTEGER, p_lease UUID, p_busy_seconds DOUBLE PRECISION)
RETURNS BOOLEAN AS $$
DECLARE
  v_platform VARCHAR;
BEGIN
  IF p_busy_seconds IS NULL OR p_busy_seconds NOT BETWEEN 0 AND 3600 THEN
    PERFORM tq_refuse('platform_abandon', 'busy_seconds', coalesce(p_busy_seconds::TEXT, 'NULL'),
      'must be between 0 and 3600',
      'How long the platform may still be serving the abandoned request, in seconds: its server-side timeout.');
  END IF;
  UPDATE worker_tasks t
  SET send_at = NULL
  WHERE t.id = p_task_id
    AND t.lease_hash = tq_lease_hash(p_lease)
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL
  RETURNING t.platform INTO v_platform;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  IF p_busy_seconds > 0 THEN
    -- Holds that ended are dropped as a new one comes.
    UPDATE tq_platforms l
    SET busy_until = ARRAY(SELECT u FROM unnest(l.busy_until) AS u WHERE u > now() ORDER BY u)
                     || (now() + make_interval(secs => p_busy_seconds)),
        updated_at = now()
    WHERE l.platform = v_platform;
  END IF;
  RETURN true;
END;
$$ LANGUAGE plpgsql;

COMMENT ON FUNCTION platform_abandon(INTEGER, UUID, DOUBLE PRECISION) IS
  'The client gave up on the task''s request: its slot stays taken for p_busy_seconds, whatever becomes of the task';

------------------------------------------------------------------------------------------------
-- What reads the room: holds count as tasks in flight, and the heads are looked at from the
-- floors (0015).
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION claim_wait(p_role VARCHAR) RETURNS DOUBLE PRECISION AS $$
  WITH due AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1
                  FROM worker_task_heads h
                  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
                  WHERE h.role = p_role AND h.platform = f.platform
                    AND h.due_at >= f.floor AND h.due_at <= now() AND s.active_task_id IS NULL)
    UNION
    SELECT DISTINCT coalesce(t.platform, '')
    FROM worker_tasks t
    WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL AND t.due_at <= now()
  )
  SELECT min(CASE
    WHEN l.platform IS NULL THEN 0
    WHEN l.paused_until > now() THEN extract(EPOCH FROM l.paused_until - now())
    WHEN l.pauses > 0 AND l.probe_task_id IS NOT NULL THEN 0.5
    WHEN l.in_flight + tq_platform_held(l) >= l.max_in_flight THEN 0.25
    ELSE greatest(
      extract(EPOCH FROM greatest(l.tat, now()) - now())
        - tq_platform_tolerance(l.burst, l.requests_per_second) - 1,
      0)
  END)::DOUBLE PRECISION
  FROM due d
  LEFT JOIN tq_platforms l ON l.platform = d.platform;
$$ LANGUAGE sql STABLE;

-- As 0006's, full also with holds, and the holds shown (appended: the view keeps its columns).
CREATE OR REPLACE VIEW v_platform_status AS
SELECT
  l.platform,
  CASE
    WHEN l.paused_until > now() THEN 'paused'
    WHEN l.pauses > 0 THEN 'probing'
    WHEN l.in_flight + h.held >= l.max_in_flight THEN 'full'
    ELSE 'open'
  END AS state,
  l.in_flight,
  l.max_in_flight,
  l.requests_per_second,
  l.burst,
  CASE WHEN l.paused_until > now() THEN l.paused_until END AS paused_until,
  CASE WHEN l.paused_until > now() THEN extract(EPOCH FROM l.paused_until - now()) ELSE 0 END
    AS pause_seconds_left,
  l.pause_reason,
  l.pauses,
  l.probe_task_id,
  l.error_streak,
  l.errors_total,
  l.last_error,
  l.last_error_at,
  l.updated_at,
  h.held AS held_after_timeout,
  h.until AS held_until
FROM tq_platforms l
CROSS JOIN LATERAL (
  SELECT count(*)::INTEGER AS held, max(u) AS until FROM unnest(l.busy_until) AS u WHERE u > now()
) h;

COMMENT ON VIEW v_platform_status IS
  'Per platform: limits, tasks in flight, slots held after a timeout, pause and errors';

------------------------------------------------------------------------------------------------
-- Registered, and granted to the worker roles of before.
------------------------------------------------------------------------------------------------

INSERT INTO tq_api (function_name) VALUES ('platform_handoff'), ('platform_abandon')
ON CONFLICT DO NOTHING;

DO $$
DECLARE
  r RECORD;
BEGIN
  FOR r IN
    SELECT DISTINCT format('GRANT EXECUTE ON FUNCTION %s TO %s', f.signature, a.grantee::REGROLE) AS statement
    FROM pg_proc p
    CROSS JOIN LATERAL aclexplode(p.proacl) a
    CROSS JOIN (VALUES ('platform_handoff(INTEGER, UUID)'::REGPROCEDURE),
                       ('platform_abandon(INTEGER, UUID, DOUBLE PRECISION)'::REGPROCEDURE)) AS f (signature)
    WHERE p.oid = 'claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN)'::REGPROCEDURE
      AND a.privilege_type = 'EXECUTE'
      AND a.grantee <> p.proowner
      AND a.grantee <> 0
  LOOP
    EXECUTE r.statement;
  END LOOP;
END;
$$;

CALL tq_secure_functions();
