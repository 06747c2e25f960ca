-- Fleet-wide politeness: each platform's limits are queue state that every claimer shares,
-- whatever process or machine it runs in (docs/QUEUE.md, "Platform limits").
--
-- - tq_platforms holds a platform's limits (loaded from the platforms file) and its live state:
--   tasks in flight, the GCRA of its request starts, its pause and its error streak.
-- - Claims take a platform's tasks only while it has room, in turns across platforms, and give
--   each task the time its first request may start (worker_tasks.send_at).
-- - A task holds a slot of its platform from its claim (which sets send_at) until it gives it back
--   after its last request (platform_release clears send_at) or stops being claimed or running.
--   Triggers on worker_tasks keep in_flight equal to the tasks holding a slot for every writer
--   (completion, failure, deferral, cancellation, recovery, anyone's SQL), in the writer's own
--   transaction: a slot cannot outlive its task's lease.
-- - platform_request / platform_error: a task's further requests take starts from the same GCRA,
--   and errors trip the platform's breaker for every worker.

------------------------------------------------------------------------------------------------
-- The platforms. Only platforms with a row are limited; tasks of other platforms (or none) are
-- claimed as before.
------------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS tq_platforms (
  platform VARCHAR(50) PRIMARY KEY CHECK (platform <> ''),
  -- Limits (sync_platform_limits, from the platforms file).
  max_in_flight INTEGER NOT NULL CHECK (max_in_flight BETWEEN 1 AND 10000),
  requests_per_second DOUBLE PRECISION NOT NULL CHECK (requests_per_second >= 0.001 AND requests_per_second <= 10000),
  burst INTEGER NOT NULL CHECK (burst BETWEEN 1 AND 10000),
  pause_after_errors INTEGER NOT NULL DEFAULT 5 CHECK (pause_after_errors BETWEEN 1 AND 1000),
  pause_seconds DOUBLE PRECISION NOT NULL DEFAULT 5 CHECK (pause_seconds >= 0.1 AND pause_seconds <= 86400),
  max_pause_seconds DOUBLE PRECISION NOT NULL DEFAULT 600
    CHECK (max_pause_seconds <= 86400 AND max_pause_seconds >= pause_seconds),
  -- State.
  in_flight INTEGER NOT NULL DEFAULT 0 CHECK (in_flight >= 0),   -- claimed + running tasks
  tat TIMESTAMPTZ NOT NULL DEFAULT '-infinity',                   -- GCRA: theoretical arrival time
  paused_until TIMESTAMPTZ,
  pause_reason TEXT,
  -- Pauses in a row without a healthy answer: the backoff's exponent. While > 0 and the pause is
  -- over, the platform is half-open: one probe task at a time, until it answers.
  pauses INTEGER NOT NULL DEFAULT 0 CHECK (pauses >= 0),
  probe_task_id INTEGER,
  probe_sent BOOLEAN NOT NULL DEFAULT false,                      -- the probe's request went out
  error_streak INTEGER NOT NULL DEFAULT 0 CHECK (error_streak >= 0),
  errors_total BIGINT NOT NULL DEFAULT 0,
  last_error TEXT,
  last_error_at TIMESTAMPTZ,
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
) WITH (fillfactor = 50);  -- rewritten by every claim and release: room for HOT updates

COMMENT ON TABLE tq_platforms IS
  'Per-platform politeness limits shared by every claimer, and their live state (kept by the queue)';

-- When the claim let a task's first request start (its platform's rate). Set while the task
-- holds a slot of its platform; NULL: no limit, or the slot was given back.
ALTER TABLE worker_tasks ADD COLUMN IF NOT EXISTS send_at TIMESTAMPTZ;

------------------------------------------------------------------------------------------------
-- Heads and store-less tasks by platform, so that a claim can take each platform's best.
------------------------------------------------------------------------------------------------
ALTER TABLE worker_task_heads ADD COLUMN IF NOT EXISTS platform VARCHAR(50) NOT NULL DEFAULT '';
DROP INDEX IF EXISTS idx_worker_task_heads_order;
CREATE INDEX IF NOT EXISTS idx_worker_task_heads_platform
  ON worker_task_heads (role, platform, priority DESC, due_at, dispensary_id);

DROP INDEX IF EXISTS idx_worker_tasks_loose_pending;
CREATE INDEX IF NOT EXISTS idx_worker_tasks_loose_pending_platform
  ON worker_tasks (role, (coalesce(platform, '')), priority DESC, due_at, id)
  WHERE status = 'pending' AND dispensary_id IS NULL;

-- As in 0003, plus the platform of the store's head task ('' for none).
CREATE OR REPLACE FUNCTION tq_refresh_heads(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
BEGIN
  WITH keys AS (
    SELECT DISTINCT k.dispensary_id, k.role
    FROM unnest(p_stores, p_roles) AS k (dispensary_id, role)
    WHERE k.dispensary_id IS NOT NULL
  ),
  fresh AS (
    SELECT
      k.dispensary_id,
      k.role,
      h.priority,
      h.due_at,
      h.platform,
      (SELECT min(t.due_at)
       FROM worker_tasks t
       WHERE t.dispensary_id = k.dispensary_id
         AND t.role = k.role
         AND t.status = 'pending'
         AND t.due_at > greatest(now(), h.due_at)
         AND t.priority > h.priority) AS recheck_at
    FROM keys k
    LEFT JOIN LATERAL (
      SELECT c.priority, c.due_at, c.platform
      FROM (
        -- the best due task in claim order ...
        (SELECT t.priority, t.due_at, coalesce(t.platform, '') AS platform
         FROM worker_tasks t
         WHERE t.dispensary_id = k.dispensary_id
           AND t.role = k.role
           AND t.status = 'pending'
           AND t.due_at <= now()
         ORDER BY t.priority DESC, t.due_at, t.id
         LIMIT 1)
        UNION ALL
        -- ... else the next to come due
        (SELECT t.priority, t.due_at, coalesce(t.platform, '') AS platform
         FROM worker_tasks t
         WHERE t.dispensary_id = k.dispensary_id
           AND t.role = k.role
           AND t.status = 'pending'
           AND t.due_at > now()
         ORDER BY t.due_at, t.priority DESC, t.id
         LIMIT 1)
      ) c
      LIMIT 1
    ) h ON true
  ),
  gone AS (
    DELETE FROM worker_task_heads h
    USING fresh f
    WHERE h.role = f.role
      AND h.dispensary_id = f.dispensary_id
      AND f.priority IS NULL
  )
  INSERT INTO worker_task_heads AS h (role, dispensary_id, priority, due_at, recheck_at, platform)
  SELECT f.role, f.dispensary_id, f.priority, f.due_at, f.recheck_at, f.platform
  FROM fresh f
  WHERE f.priority IS NOT NULL
  ORDER BY f.dispensary_id, f.role
  ON CONFLICT (role, dispensary_id) DO UPDATE
  SET priority = excluded.priority,
      due_at = excluded.due_at,
      recheck_at = excluded.recheck_at,
      platform = excluded.platform
  WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
    IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform);
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

------------------------------------------------------------------------------------------------
-- Slots: a task holds one while it is claimed or running with a send_at; tasks taking or giving
-- back a slot are applied to their platforms' rows.
------------------------------------------------------------------------------------------------

-- One entry per task that took a slot (+1) or gave it back (-1, with its new status).
-- Rows are locked in platform order, so that writers of several platforms cannot deadlock.
-- A completed task is a healthy answer: the error streak starts over. The probe of a half-open
-- platform that sent its request and completed closes the breaker (platform_answered closes it
-- sooner, at the answer, whatever the task then does with it); a probe that ends otherwise
-- (deferred, retried, failed, recovered, cancelled, or done without asking the platform
-- anything) lets another task probe.
CREATE OR REPLACE FUNCTION tq_platforms_apply(
  p_platforms VARCHAR[], p_deltas INTEGER[], p_task_ids INTEGER[], p_outcomes VARCHAR[]
) RETURNS VOID AS $$
BEGIN
  IF p_platforms IS NULL THEN
    RETURN;
  END IF;
  PERFORM 1
  FROM tq_platforms l
  WHERE l.platform = ANY (p_platforms)
  ORDER BY l.platform
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN;  -- none of these platforms is limited
  END IF;

  UPDATE tq_platforms l
  SET in_flight = greatest(l.in_flight + c.delta, 0),
      error_streak = CASE WHEN c.completed > 0 THEN 0 ELSE l.error_streak END,
      pauses = CASE WHEN l.probe_sent AND l.probe_task_id = ANY (c.answered) THEN 0 ELSE l.pauses END,
      paused_until = CASE
        WHEN l.probe_sent AND l.probe_task_id = ANY (c.answered) THEN NULL ELSE l.paused_until END,
      probe_task_id = CASE WHEN l.probe_task_id = ANY (c.released) THEN NULL ELSE l.probe_task_id END,
      probe_sent = CASE WHEN l.probe_task_id = ANY (c.released) THEN false ELSE l.probe_sent END,
      updated_at = now()
  FROM (
    SELECT
      x.platform,
      sum(x.delta)::INTEGER AS delta,
      count(*) FILTER (WHERE x.outcome = 'completed') AS completed,
      coalesce(array_agg(x.task_id) FILTER (WHERE x.delta < 0), '{}') AS released,
      coalesce(array_agg(x.task_id) FILTER (WHERE x.outcome = 'completed'), '{}') AS answered
    FROM unnest(p_platforms, p_deltas, p_task_ids, p_outcomes) AS x (platform, delta, task_id, outcome)
    GROUP BY x.platform
  ) c
  WHERE l.platform = c.platform;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_platforms_inserted() RETURNS TRIGGER AS $$
BEGIN
  -- Only direct INSERTs create active rows.
  PERFORM tq_platforms_apply(array_agg(n.platform), array_agg(1), array_agg(n.id), array_agg(NULL::VARCHAR))
  FROM new_tasks n
  WHERE n.status IN ('claimed', 'running')
    AND n.send_at IS NOT NULL
    AND n.platform IS NOT NULL;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_platforms_updated() RETURNS TRIGGER AS $$
BEGIN
  -- No platform has limits: nothing to count (the bare queue pays one probe of an empty table).
  PERFORM 1 FROM tq_platforms LIMIT 1;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  -- One pass over the changed rows; heartbeats and starts take or give back no slot.
  PERFORM tq_platforms_apply(array_agg(m.platform), array_agg(m.delta), array_agg(m.id), array_agg(m.outcome))
  FROM old_tasks o
  JOIN new_tasks n ON n.id = o.id
  CROSS JOIN LATERAL (
    SELECT
      o.status IN ('claimed', 'running') AND o.send_at IS NOT NULL AND o.platform IS NOT NULL,
      n.status IN ('claimed', 'running') AND n.send_at IS NOT NULL AND n.platform IS NOT NULL
  ) h (old_holds, new_holds)
  CROSS JOIN LATERAL (
    SELECT o.platform, -1, o.id, n.status::VARCHAR
    WHERE h.old_holds AND NOT (h.new_holds AND n.platform = o.platform)
    UNION ALL
    SELECT n.platform, 1, n.id, NULL
    WHERE h.new_holds AND NOT (h.old_holds AND n.platform = o.platform)
  ) m (platform, delta, id, outcome);
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_platforms_deleted() RETURNS TRIGGER AS $$
BEGIN
  PERFORM tq_platforms_apply(array_agg(o.platform), array_agg(-1), array_agg(o.id), array_agg('deleted'::VARCHAR))
  FROM old_tasks o
  WHERE o.status IN ('claimed', 'running')
    AND o.send_at IS NOT NULL
    AND o.platform IS NOT NULL;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION tq_tasks_platforms_truncated() RETURNS TRIGGER AS $$
BEGIN
  UPDATE tq_platforms SET in_flight = 0, probe_task_id = NULL, probe_sent = false
  WHERE in_flight <> 0 OR probe_task_id IS NOT NULL;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

-- Named to fire after the store triggers of 0003 (triggers fire in name order): a writer locks
-- stores before platforms, as claims do.
DROP TRIGGER IF EXISTS worker_tasks_zplatforms_inserted ON worker_tasks;
CREATE TRIGGER worker_tasks_zplatforms_inserted
  AFTER INSERT ON worker_tasks
  REFERENCING NEW TABLE AS new_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_platforms_inserted();

DROP TRIGGER IF EXISTS worker_tasks_zplatforms_updated ON worker_tasks;
CREATE TRIGGER worker_tasks_zplatforms_updated
  AFTER UPDATE ON worker_tasks
  REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_platforms_updated();

DROP TRIGGER IF EXISTS worker_tasks_zplatforms_deleted ON worker_tasks;
CREATE TRIGGER worker_tasks_zplatforms_deleted
  AFTER DELETE ON worker_tasks
  REFERENCING OLD TABLE AS old_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_platforms_deleted();

DROP TRIGGER IF EXISTS worker_tasks_zplatforms_truncated ON worker_tasks;
CREATE TRIGGER worker_tasks_zplatforms_truncated
  AFTER TRUNCATE ON worker_tasks
  FOR EACH STATEMENT
  EXECUTE FUNCTION tq_tasks_platforms_truncated();

-- The store triggers of 0003 must also see a pending task change platform: heads carry it.
CREATE OR REPLACE FUNCTION tq_tasks_updated() RETURNS TRIGGER AS $$
DECLARE
  v_moved BOOLEAN;
  v_freed BOOLEAN;
  v_busied BOOLEAN;
  v_queue_changed BOOLEAN;
BEGIN
  -- One pass to learn what changed, so that a start or a heartbeat costs one statement here.
  SELECT
    coalesce(bool_or(n.dispensary_id IS NOT NULL AND n.dispensary_id IS DISTINCT FROM o.dispensary_id), false),
    coalesce(bool_or(
      o.status IN ('claimed', 'running') AND o.dispensary_id IS NOT NULL
      AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
    ), false),
    coalesce(bool_or(
      n.status IN ('claimed', 'running') AND n.dispensary_id IS NOT NULL
      AND (o.status NOT IN ('claimed', 'running') OR o.dispensary_id IS DISTINCT FROM n.dispensary_id)
    ), false),
    coalesce(bool_or(
      (o.status = 'pending' OR n.status = 'pending')
      AND coalesce(o.dispensary_id, n.dispensary_id) IS NOT NULL
      AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at, n.platform)
          IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at, o.platform)
    ), false)
  INTO v_moved, v_freed, v_busied, v_queue_changed
  FROM old_tasks o
  JOIN new_tasks n ON n.id = o.id;

  IF v_moved THEN
    INSERT INTO worker_task_stores (dispensary_id)
    SELECT DISTINCT n.dispensary_id
    FROM new_tasks n
    JOIN old_tasks o ON o.id = n.id
    WHERE n.dispensary_id IS NOT NULL
      AND n.dispensary_id IS DISTINCT FROM o.dispensary_id
    ON CONFLICT (dispensary_id) DO NOTHING;
  END IF;

  IF v_freed THEN
    PERFORM 1
    FROM worker_task_stores s
    WHERE s.dispensary_id IN (
        SELECT o.dispensary_id
        FROM old_tasks o
        JOIN new_tasks n ON n.id = o.id
        WHERE o.status IN ('claimed', 'running')
          AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
      )
    ORDER BY s.dispensary_id
    FOR UPDATE;
    UPDATE worker_task_stores s
    SET active_task_id = NULL
    FROM old_tasks o
    JOIN new_tasks n ON n.id = o.id
    WHERE o.status IN ('claimed', 'running')
      AND (n.status NOT IN ('claimed', 'running') OR n.dispensary_id IS DISTINCT FROM o.dispensary_id)
      AND s.dispensary_id = o.dispensary_id
      AND s.active_task_id = o.id;
  END IF;

  IF v_busied THEN
    UPDATE worker_task_stores s
    SET active_task_id = n.id
    FROM new_tasks n
    JOIN old_tasks o ON o.id = n.id
    WHERE n.status IN ('claimed', 'running')
      AND (o.status NOT IN ('claimed', 'running') OR o.dispensary_id IS DISTINCT FROM n.dispensary_id)
      AND s.dispensary_id = n.dispensary_id;
  END IF;

  IF v_queue_changed THEN
    PERFORM tq_lock_and_refresh(array_agg(k.dispensary_id), array_agg(k.role))
    FROM (
      SELECT o.dispensary_id, o.role
      FROM old_tasks o
      JOIN new_tasks n ON n.id = o.id
      WHERE o.status = 'pending'
        AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at, n.platform)
            IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at, o.platform)
      UNION
      SELECT n.dispensary_id, n.role
      FROM new_tasks n
      JOIN old_tasks o ON o.id = n.id
      WHERE n.status = 'pending'
        AND (n.status, n.dispensary_id, n.role, n.priority, n.due_at, n.platform)
            IS DISTINCT FROM (o.status, o.dispensary_id, o.role, o.priority, o.due_at, o.platform)
    ) k
    WHERE k.dispensary_id IS NOT NULL;
  END IF;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The GCRA's burst tolerance: how far ahead of the steady pace a start may be. (burst - 1)
-- intervals, less 0.1 s: a request reaches its platform a little after the start it was given
-- (a thread wakes late, a busy machine), and two requests that meet there must still leave the
-- platform's every second within requests_per_second + burst.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_platform_tolerance(p_burst INTEGER, p_rate DOUBLE PRECISION)
RETURNS DOUBLE PRECISION AS $$
  SELECT greatest((p_burst - 1) / p_rate - 0.1, 0);
$$ LANGUAGE sql IMMUTABLE;

------------------------------------------------------------------------------------------------
-- How many tasks a claim may take from a platform now, from its locked row: none while paused;
-- one probe while half-open; else its free slots, and no more starts than its rate allows
-- within a second (the GCRA: one start per 1/rate, a burst of up to `burst` after an idle spell).
-- Those tasks wait at most that second for their first request (send_at).
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_platform_quota(l tq_platforms) RETURNS INTEGER AS $$
  SELECT CASE
    WHEN l.paused_until > now() THEN 0
    WHEN l.pauses > 0 THEN
      CASE WHEN l.probe_task_id IS NULL AND l.in_flight < l.max_in_flight THEN 1 ELSE 0 END
    ELSE greatest(0, least(
      l.max_in_flight - l.in_flight,
      -- starts s_i = max(now, base + i*T - tau) with s_i <= now + 1 s
      floor((1.0 + tq_platform_tolerance(l.burst, l.requests_per_second)
             - extract(EPOCH FROM greatest(l.tat, now()) - now())) * l.requests_per_second)::INTEGER + 1))
  END;
$$ LANGUAGE sql STABLE;

------------------------------------------------------------------------------------------------
-- Claiming, platform by platform.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION claim_tasks(
  p_role VARCHAR,
  p_worker_id VARCHAR,
  p_max_tasks INTEGER,
  p_start BOOLEAN DEFAULT false
) RETURNS SETOF worker_tasks AS $$
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
    RAISE EXCEPTION 'max_tasks must be between 1 and 1000, got %', coalesce(p_max_tasks::TEXT, 'NULL')
      USING ERRCODE = '22023';
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
        END AS send_at
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
          last_heartbeat_at = now()
      FROM timed m
      WHERE t.id = m.id
      RETURNING t.*
    )
    SELECT * FROM claimed c ORDER BY c.send_at NULLS FIRST, c.priority DESC, c.due_at, c.id;

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

------------------------------------------------------------------------------------------------
-- A task's requests. Every request of a task to its platform asks first (one short call):
--   'go'     start after wait_seconds (the first: what the claim reserved; a further one: the
--            next start the platform's rate allows);
--   'probe'  the same, and the task is the probe of a half-open platform: report its answer
--            (platform_answered, or platform_error);
--   'paused' the platform is paused (or a probe is out): give the task back for wait_seconds;
--   'lost'   the task is no longer this worker's.
-- Tasks of a platform without limits always 'go' at once.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION platform_request(p_task_id INTEGER, p_worker_id VARCHAR, p_first BOOLEAN)
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
    AND t.worker_id = p_worker_id
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

-- A task done with its platform's requests gives its slot back before it finishes (it goes on to
-- store what it fetched): the slot covers requests, not the work after them. Returns whether it
-- held one.
CREATE OR REPLACE FUNCTION platform_release(p_task_id INTEGER, p_worker_id VARCHAR) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks t
  SET send_at = NULL
  WHERE t.id = p_task_id
    AND t.worker_id = p_worker_id
    AND t.status IN ('claimed', 'running')
    AND t.send_at IS NOT NULL;
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- The platform answered the probe of its half-open breaker (any answer but a 5xx or a 429: the
-- platform is back): every worker may send again. Returns whether it closed the breaker.
CREATE OR REPLACE FUNCTION platform_answered(p_platform VARCHAR, p_task_id INTEGER) RETURNS BOOLEAN AS $$
BEGIN
  UPDATE tq_platforms p
  SET pauses = 0,
      paused_until = NULL,
      probe_task_id = NULL,
      probe_sent = false,
      error_streak = 0,
      updated_at = now()
  WHERE p.platform = p_platform
    AND p.probe_task_id = p_task_id
    AND p.probe_sent;
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;

-- A request of a task to its platform failed in a way that speaks of the platform (5xx, a
-- timeout, a refused connection, 429). Returns whether the platform is now paused, and for how
-- long: a task that met a pause is given back, not failed.
--
-- The platform pauses for every worker when the server said how long (p_retry_after: a 503 or
-- 429 with Retry-After), when pause_after_errors such errors came in a row (no completion in
-- between), or when a half-open platform's probe failed. The first pause lasts Retry-After (else
-- pause_seconds); each pause after a failed probe lasts longer: pause_seconds * 2^pauses, at
-- least Retry-After, at most max_pause_seconds. Errors met during a pause extend nothing.
CREATE OR REPLACE FUNCTION platform_error(
  p_platform VARCHAR,
  p_task_id INTEGER,
  p_error TEXT,
  p_retry_after INTERVAL DEFAULT NULL
) RETURNS TABLE (paused BOOLEAN, wait_seconds DOUBLE PRECISION) AS $$
DECLARE
  l tq_platforms;
  v_error TEXT := left(coalesce(nullif(p_error, ''), 'unknown error'), 1000);
  -- NULL when the server said nothing (greatest and least would turn a NULL into a bound).
  v_after DOUBLE PRECISION := CASE
    WHEN p_retry_after IS NOT NULL THEN least(greatest(extract(EPOCH FROM p_retry_after), 0), 86400)
  END;
  v_for DOUBLE PRECISION;
BEGIN
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = p_platform FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT false, 0::DOUBLE PRECISION;
    RETURN;
  END IF;

  IF l.paused_until > now() THEN
    UPDATE tq_platforms p
    SET errors_total = p.errors_total + 1, last_error = v_error, last_error_at = now(), updated_at = now()
    WHERE p.platform = p_platform;
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
    WHERE p.platform = p_platform;
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
  WHERE p.platform = p_platform;
  RETURN QUERY SELECT true, v_for;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Limits from the platforms file. Upserts the given platforms' limits; their state (in flight,
-- rate, pause) is kept. A new platform's count starts from its tasks already in flight.
-- Platforms not named keep their row and limits. Returns the platforms whose limits changed.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION sync_platform_limits(p_limits JSONB) RETURNS INTEGER AS $$
DECLARE
  v_changed INTEGER;
  v_bad TEXT;
BEGIN
  IF p_limits IS NULL OR jsonb_typeof(p_limits) <> 'array' THEN
    RAISE EXCEPTION 'platform limits must be a JSON array of objects' USING ERRCODE = '22023';
  END IF;
  SELECT string_agg(coalesce(quote_literal(b.platform), 'NULL'), ', ') INTO v_bad
  FROM (
    SELECT x.platform
    FROM jsonb_to_recordset(p_limits) AS x (platform TEXT)
    GROUP BY x.platform
    HAVING x.platform IS NULL OR x.platform = '' OR count(*) > 1
  ) b;
  IF v_bad IS NOT NULL THEN
    RAISE EXCEPTION 'each platform needs a non-empty name, once: %', v_bad USING ERRCODE = '22023';
  END IF;

  INSERT INTO tq_platforms AS l (
    platform, max_in_flight, requests_per_second, burst, pause_after_errors, pause_seconds,
    max_pause_seconds, in_flight)
  SELECT
    x.platform,
    x.max_in_flight,
    x.requests_per_second,
    coalesce(x.burst, x.max_in_flight),
    coalesce(x.pause_after_errors, 5),
    coalesce(x.pause_seconds, 5),
    coalesce(x.max_pause_seconds, 600),
    (SELECT count(*)
     FROM worker_tasks t
     WHERE t.id IN (
         SELECT a.id FROM worker_tasks a
         WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NOT NULL
         UNION ALL
         SELECT a.id FROM worker_tasks a
         WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NULL)
       AND t.platform = x.platform
       AND t.status IN ('claimed', 'running')
       AND t.send_at IS NOT NULL)
  FROM jsonb_to_recordset(p_limits) AS x (
    platform TEXT, max_in_flight INTEGER, requests_per_second DOUBLE PRECISION, burst INTEGER,
    pause_after_errors INTEGER, pause_seconds DOUBLE PRECISION, max_pause_seconds DOUBLE PRECISION)
  ORDER BY x.platform
  ON CONFLICT (platform) DO UPDATE
  SET max_in_flight = excluded.max_in_flight,
      requests_per_second = excluded.requests_per_second,
      burst = excluded.burst,
      pause_after_errors = excluded.pause_after_errors,
      pause_seconds = excluded.pause_seconds,
      max_pause_seconds = excluded.max_pause_seconds,
      updated_at = now()
  WHERE (l.max_in_flight, l.requests_per_second, l.burst, l.pause_after_errors, l.pause_seconds,
         l.max_pause_seconds)
    IS DISTINCT FROM (excluded.max_in_flight, excluded.requests_per_second, excluded.burst,
                      excluded.pause_after_errors, excluded.pause_seconds, excluded.max_pause_seconds);
  GET DIAGNOSTICS v_changed = ROW_COUNT;
  RETURN v_changed;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The check: counters against the tasks really holding slots. The triggers keep them equal; a
-- difference means someone wrote around them (triggers disabled, a platform row dropped and
-- added back). Repairs, and returns what it repaired.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION repair_platform_counters()
RETURNS TABLE (platform VARCHAR, counted INTEGER, in_flight INTEGER, probe_cleared BOOLEAN) AS $$
#variable_conflict use_column
BEGIN
  PERFORM 1 FROM tq_platforms l ORDER BY l.platform FOR UPDATE;
  RETURN QUERY
  WITH actual AS (
    SELECT t.platform, count(*)::INTEGER AS n
    FROM worker_tasks t
    WHERE t.id IN (
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NOT NULL
        UNION ALL
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NULL)
      AND t.status IN ('claimed', 'running')
      AND t.send_at IS NOT NULL
    GROUP BY t.platform
  ),
  wrong AS (
    SELECT
      l.platform,
      l.in_flight AS counted,
      coalesce(a.n, 0) AS n,
      l.probe_task_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM worker_tasks t
        WHERE t.id = l.probe_task_id AND t.status IN ('claimed', 'running') AND t.platform = l.platform
      ) AS stale_probe
    FROM tq_platforms l
    LEFT JOIN actual a ON a.platform = l.platform
  ),
  fixed AS (
    UPDATE tq_platforms l
    SET in_flight = w.n,
        probe_task_id = CASE WHEN w.stale_probe THEN NULL ELSE l.probe_task_id END,
        probe_sent = CASE WHEN w.stale_probe THEN false ELSE l.probe_sent END,
        updated_at = now()
    FROM wrong w
    WHERE l.platform = w.platform
      AND (w.counted <> w.n OR w.stale_probe)
    RETURNING l.platform, w.counted, w.n, w.stale_probe
  )
  SELECT f.platform, f.counted, f.n, f.stale_probe FROM fixed f ORDER BY f.platform;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- What a drain run that found nothing to claim should do: NULL when the role has no due work;
-- else the seconds until a claim could take some (0 for platforms without limits; the rest of a
-- pause; the next start the rate allows; a short poll for a platform whose slots are all taken).
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION claim_wait(p_role VARCHAR) RETURNS DOUBLE PRECISION AS $$
  WITH due AS (
    SELECT DISTINCT h.platform
    FROM worker_task_heads h
    JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
    WHERE h.role = p_role AND h.due_at <= now() AND s.active_task_id IS NULL
    UNION
    SELECT DISTINCT coalesce(t.platform, '')
    FROM worker_tasks t
    WHERE t.role = p_role AND t.status = 'pending' AND t.dispensary_id IS NULL AND t.due_at <= now()
  )
  SELECT min(CASE
    WHEN l.platform IS NULL THEN 0
    WHEN l.paused_until > now() THEN extract(EPOCH FROM l.paused_until - now())
    WHEN l.pauses > 0 AND l.probe_task_id IS NOT NULL THEN 0.5
    WHEN l.in_flight >= l.max_in_flight THEN 0.25
    ELSE greatest(
      extract(EPOCH FROM greatest(l.tat, now()) - now())
        - tq_platform_tolerance(l.burst, l.requests_per_second) - 1,
      0)
  END)::DOUBLE PRECISION
  FROM due d
  LEFT JOIN tq_platforms l ON l.platform = d.platform;
$$ LANGUAGE sql STABLE;

------------------------------------------------------------------------------------------------
-- What an operator reads: each platform's limits and state, the tasks really in flight, and
-- its errors.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW v_platform_status AS
SELECT
  l.platform,
  CASE
    WHEN l.paused_until > now() THEN 'paused'
    WHEN l.pauses > 0 THEN 'probing'
    WHEN l.in_flight >= l.max_in_flight THEN 'full'
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
  l.updated_at
FROM tq_platforms l;

COMMENT ON VIEW v_platform_status IS 'Per platform: limits, tasks in flight, pause and errors';
COMMENT ON FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN) IS
  'Claim (and, with p_start, start) up to N due tasks of a role, at most one per store, within each platform''s limits';

-- Adopted rows: heads learn their platform.
SELECT tq_refresh_heads(array_agg(dispensary_id), array_agg(role))
FROM (SELECT DISTINCT dispensary_id, role FROM worker_tasks WHERE status = 'pending' AND dispensary_id IS NOT NULL) p;
