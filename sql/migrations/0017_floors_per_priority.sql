-- 0017: the claim floors per priority, and raised under a lock that keeps every head above its
-- floor. Measured by bench/long_horizon.py and bench/held_xmin.py (docs/BENCHMARKS.md, "Ten
-- minutes of a held snapshot").
--
-- 0015's floor was one per role and platform, but the heads' claim order (and their index) puts
-- priority before due_at: a scan from the floor had to read every index entry of the platform,
-- dead or alive, of each priority above the one it took, and the dead ones of its own below the
-- floor cost a heap visit each while a snapshot pins them. Under a transaction held open for
-- ten minutes at 100 tasks/s that was most of a claim's time. Floors are now per role, platform
-- and priority, and each claim scans each priority in use from its own floor: the scan starts at
-- the first live head (EXPLAIN after 30k tasks under a held snapshot: 54 buffers and 0.06 ms,
-- against 301 and 1.5 ms with 0015's floor).
--
-- The raise no longer reads from the start of the index either (the dead entries again), so it
-- can no longer be the one that repairs a head left below its floor by a race (0015: a head
-- written by a transaction still open while a claim raised the floor past it, found by the next
-- raise). The race is closed instead: a head's writer that finds its floor low enough holds a
-- shared advisory lock on it from that check to its commit; a claim raises only floors whose
-- lock it gets at once, exclusively. A writer that cannot have the lock at once, or must lower
-- the floor, adds a row of its own (a floor is the least of its rows) and a raise touches only
-- the rows it read: no one waits on a floor, so no order of writes can deadlock there. Once a
-- minute a raise looks from the start of the index instead, a net under all this; a floor with
-- no live head then is deleted, so the claims probe only the priorities in use.
--
-- Safe to run twice.

------------------------------------------------------------------------------------------------
-- The floors, keyed by priority.
------------------------------------------------------------------------------------------------

-- Rebuilt from the heads, their writers kept out meanwhile. Claims write floors then heads and
-- head writers the other way round, so the two locks are taken together or not at all (NOWAIT,
-- retried for up to a minute): a migration under traffic neither deadlocks with it nor makes
-- it wait behind a lock queue.
DO $$
BEGIN
  FOR attempt IN 1..1200 LOOP
    BEGIN
      LOCK TABLE worker_task_heads IN SHARE MODE NOWAIT;
      LOCK TABLE worker_task_floors IN ACCESS EXCLUSIVE MODE NOWAIT;
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      PERFORM pg_sleep(0.05);  -- the failed attempt's locks went with its subtransaction
    END;
  END LOOP;
  RAISE EXCEPTION 'worker_task_heads and worker_task_floors stayed locked for a minute'
    USING HINT = 'Run tq migrate again at a quieter moment.';
END;
$$;

-- A floor may have several rows: its value is their least. A writer that must lower a floor adds
-- a row of its own rather than update one, so that writers never wait for each other (nor for a
-- claim) here, whatever order their statements lower floors in.
ALTER TABLE worker_task_floors ADD COLUMN IF NOT EXISTS priority INTEGER;
ALTER TABLE worker_task_floors ADD COLUMN IF NOT EXISTS swept_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity';
COMMENT ON TABLE worker_task_floors IS
  'Per role, platform and priority with pending work: no live head comes due before the least floor of its rows, where claims begin their walk (kept by triggers and claims)';
COMMENT ON COLUMN worker_task_floors.swept_at IS
  'When a raise last looked for the earliest live head from the start of the index rather than from the floor';

DELETE FROM worker_task_floors WHERE priority IS NULL;
ALTER TABLE worker_task_floors ALTER COLUMN priority SET NOT NULL;
ALTER TABLE worker_task_floors DROP CONSTRAINT IF EXISTS worker_task_floors_pkey;
CREATE INDEX IF NOT EXISTS idx_worker_task_floors
  ON worker_task_floors (role, platform, priority, floor);
INSERT INTO worker_task_floors (role, platform, priority, floor)
SELECT h.role, h.platform, h.priority, min(h.due_at)
FROM worker_task_heads h
WHERE NOT EXISTS (SELECT 1 FROM worker_task_floors f
                  WHERE f.role = h.role AND f.platform = h.platform AND f.priority = h.priority)
GROUP BY h.role, h.platform, h.priority;

-- The advisory lock of one floor (two-key form: apart from every one-key lock, as tq migrate's).
CREATE OR REPLACE FUNCTION tq_floor_lock_key(p_role VARCHAR, p_platform VARCHAR, p_priority INTEGER)
RETURNS INTEGER AS $$
  SELECT hashtext(p_role || '/' || p_platform || '/' || p_priority::TEXT);
$$ LANGUAGE sql IMMUTABLE;

-- A head was written (due p_due) under this floor: keep the floor at or below it. Almost always
-- a read finds a row at or below the head, and nothing is written; the shared lock, held to the
-- writer's commit, keeps every raise away until the head is visible to it. When the lock is not
-- to be had at once (a claim is raising this floor) or the transaction reads an older snapshot
-- than its statement's, or no row is low enough, the writer adds a row at its head's due time:
-- nothing then waits, and a raise leaves alone the rows it did not read. True when it wrote.
CREATE OR REPLACE FUNCTION tq_lower_floor(p_role VARCHAR, p_platform VARCHAR, p_priority INTEGER, p_due TIMESTAMPTZ)
RETURNS BOOLEAN AS $$
BEGIN
  IF p_due IS NULL THEN
    RETURN false;
  END IF;
  IF current_setting('transaction_isolation') = 'read committed'
     AND pg_try_advisory_xact_lock_shared(hashtext('worker_task_floors'),
                                          tq_floor_lock_key(p_role, p_platform, p_priority)) THEN
    PERFORM 1
    FROM worker_task_floors f
    WHERE f.role = p_role AND f.platform = p_platform AND f.priority = p_priority AND f.floor <= p_due;
    IF FOUND THEN
      RETURN false;
    END IF;
  END IF;
  INSERT INTO worker_task_floors (role, platform, priority, floor)
  VALUES (p_role, p_platform, p_priority, p_due);
  RETURN true;
END;
$$ LANGUAGE plpgsql;

-- 0015's signature, for a head writer whose call began before this migration committed (it
-- runs 0015's body, which knows no priority): a row at its due time under every priority in use
-- on the platform. Nothing of 0017 calls it.
CREATE OR REPLACE FUNCTION tq_lower_floor(p_role VARCHAR, p_platform VARCHAR, p_due TIMESTAMPTZ)
RETURNS BOOLEAN AS $$
BEGIN
  INSERT INTO worker_task_floors (role, platform, priority, floor)
  SELECT p_role, p_platform, h.priority, p_due
  FROM (SELECT DISTINCT x.priority FROM worker_task_heads x
        WHERE x.role = p_role AND x.platform = p_platform) h
  WHERE p_due IS NOT NULL;
  RETURN p_due IS NOT NULL;
END;
$$ LANGUAGE plpgsql;

-- The role's floors not raised in the last second whose lock is free (no writer between its
-- check and its commit), each to its earliest live head, read from the floor itself (one index
-- probe), capped at a second before now, in one row. Only the rows read before the heads are
-- touched: a row added since belongs to a head this raise may not have seen. Once a minute a
-- floor's earliest head is looked for from the start of the index instead (a walk over the
-- dead heads, where a snapshot pins them): should a head ever be below its floor, by a way not
-- foreseen here, it is claimed within the minute; and a floor with no live head then is deleted.
CREATE OR REPLACE FUNCTION tq_raise_floors(p_role VARCHAR) RETURNS VOID AS $$
DECLARE
  f RECORD;
  v_rows TID[];
  v_floor TIMESTAMPTZ;
  v_swept TIMESTAMPTZ;
  v_sweep BOOLEAN;
  v_min TIMESTAMPTZ;
BEGIN
  -- With an older snapshot than the statement's, a raise could miss a committed head.
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RETURN;
  END IF;
  FOR f IN
    SELECT DISTINCT x.platform, x.priority
    FROM worker_task_floors x
    WHERE x.role = p_role AND x.raised_at < now() - INTERVAL '1 second'
    ORDER BY x.platform, x.priority
  LOOP
    CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtext('worker_task_floors'),
                                                tq_floor_lock_key(p_role, f.platform, f.priority));
    SELECT array_agg(x.ctid ORDER BY x.floor), min(x.floor), max(x.swept_at)
    INTO v_rows, v_floor, v_swept
    FROM worker_task_floors x
    WHERE x.role = p_role AND x.platform = f.platform AND x.priority = f.priority;
    CONTINUE WHEN v_rows IS NULL;
    v_sweep := v_swept < now() - INTERVAL '1 minute';
    SELECT h.due_at INTO v_min
    FROM worker_task_heads h
    WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
      AND h.due_at >= CASE WHEN v_sweep THEN '-infinity' ELSE v_floor END
    ORDER BY h.due_at
    LIMIT 1;
    IF NOT FOUND AND v_sweep THEN
      DELETE FROM worker_task_floors x WHERE x.ctid = ANY (v_rows);
    ELSE
      UPDATE worker_task_floors x
      SET floor = least(coalesce(v_min, 'infinity'), now() - INTERVAL '1 second'),
          raised_at = now(),
          swept_at = CASE WHEN v_sweep THEN now() ELSE v_swept END
      WHERE x.ctid = v_rows[1];
      IF cardinality(v_rows) > 1 THEN
        DELETE FROM worker_task_floors x WHERE x.ctid = ANY (v_rows[2:]);
      END IF;
    END IF;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- The heads' writers: each head's own floor.
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION tq_refresh_head(p_store INTEGER, p_role VARCHAR) RETURNS VOID AS $$
DECLARE
  v_priority INTEGER;
  v_due TIMESTAMPTZ;
  v_platform VARCHAR;
  v_recheck TIMESTAMPTZ;
BEGIN
  SELECT t.priority, t.due_at, coalesce(t.platform, '') INTO v_priority, v_due, v_platform
  FROM worker_tasks t
  WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending' AND t.due_at <= now()
  ORDER BY t.priority DESC, t.due_at, t.id
  LIMIT 1;
  IF NOT FOUND THEN
    SELECT t.priority, t.due_at, coalesce(t.platform, '') INTO v_priority, v_due, v_platform
    FROM worker_tasks t
    WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending' AND t.due_at > now()
    ORDER BY t.due_at, t.priority DESC, t.id
    LIMIT 1;
    IF NOT FOUND THEN
      DELETE FROM worker_task_heads h WHERE h.role = p_role AND h.dispensary_id = p_store;
      RETURN;
    END IF;
  END IF;
  SELECT min(t.due_at) INTO v_recheck
  FROM worker_tasks t
  WHERE t.dispensary_id = p_store AND t.role = p_role AND t.status = 'pending'
    AND t.due_at > greatest(now(), v_due) AND t.priority > v_priority;
  INSERT INTO worker_task_heads AS h (role, dispensary_id, priority, due_at, recheck_at, platform)
  VALUES (p_role, p_store, v_priority, v_due, v_recheck, v_platform)
  ON CONFLICT (role, dispensary_id) DO UPDATE
  SET priority = excluded.priority,
      due_at = excluded.due_at,
      recheck_at = excluded.recheck_at,
      platform = excluded.platform
  WHERE (h.priority, h.due_at, h.recheck_at, h.platform)
    IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform);
  PERFORM tq_lower_floor(p_role, v_platform, v_priority, v_due);
END;
$$ LANGUAGE plpgsql;


CREATE OR REPLACE FUNCTION tq_refresh_heads(p_stores INTEGER[], p_roles VARCHAR[]) RETURNS VOID AS $$
DECLARE
  v_lowered INTEGER;
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
  ),
  written AS (
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
      IS DISTINCT FROM (excluded.priority, excluded.due_at, excluded.recheck_at, excluded.platform)
    RETURNING h.role, h.platform, h.priority, h.due_at
  )
  -- No head below its floor: one call per floor written, which reads unless it must lower.
  SELECT count(*) INTO v_lowered
  FROM (SELECT w.role, w.platform, w.priority, min(w.due_at) AS due
        FROM written w
        GROUP BY w.role, w.platform, w.priority
        ORDER BY w.role, w.platform, w.priority) m
  WHERE tq_lower_floor(m.role, m.platform, m.priority, m.due);
END;
$$ LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan;

------------------------------------------------------------------------------------------------
-- The claim, the hand-off's claim and claim_wait: 0016's, each priority from its own floor.
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

  -- The platforms with pending work of this role ('' for none): one probe of the heads per
  -- floor (a platform and priority in use), from the floor, and a skip scan of the store-less
  -- tasks.
  WITH RECURSIVE heads (platform) AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1 FROM worker_task_heads h
                  WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
                    AND h.due_at >= f.floor)
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
    PERFORM tq_raise_floors(p_role);  -- an idle role's floors rise (and go) too
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

  -- The role's floors raised, for the scans below (and the next claim's look for work). Nothing
  -- waits here, nor for this: a floor being written is skipped, and its writers add rows.
  PERFORM tq_raise_floors(p_role);

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
                   ELSE least(tq_platform_quota(l), tq_worker_room(l, p_role, p_worker_id)) END)
    INTO v_platforms, v_quotas
    FROM unnest(v_work) AS w (platform)
    LEFT JOIN tq_platforms l ON l.platform = w.platform;

    -- Per platform with room, its best idle stores with due work (from the heads, each
    -- priority in use from its floor) and its best store-less tasks; then the platforms take
    -- turns: every platform's first, then every platform's second, ... Locking the store row
    -- serialises the claims of one store.
    WITH room AS (
      SELECT r.platform, least(r.quota, v_want) AS quota
      FROM unnest(v_platforms, v_quotas) AS r (platform, quota)
      WHERE r.quota > 0
    ),
    by_store AS (
      SELECT c.*
      FROM room r
      CROSS JOIN LATERAL (
        SELECT x.priority, min(x.floor) AS floor
        FROM worker_task_floors x
        WHERE x.role = p_role AND x.platform = r.platform
        GROUP BY x.priority
      ) f
      CROSS JOIN LATERAL (
        SELECT h.priority, h.due_at, h.dispensary_id, NULL::INTEGER AS task_id, h.platform
        FROM worker_task_heads h
        JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
        WHERE h.role = p_role
          AND h.platform = r.platform
          AND h.priority = f.priority
          AND h.due_at >= f.floor  -- the scan starts here: dead heads below it cost no visit
          AND h.due_at <= now()
          AND s.active_task_id IS NULL
          AND h.dispensary_id <> ALL (v_skip)
        ORDER BY h.due_at, h.dispensary_id
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
        row_number() OVER (PARTITION BY b.platform ORDER BY b.priority DESC, b.due_at, b.dispensary_id) AS turn
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

CREATE OR REPLACE FUNCTION tq_claim_next(p_role VARCHAR, p_worker_id VARCHAR, p_platform VARCHAR)
RETURNS TABLE (task worker_tasks, lease UUID) AS $$
DECLARE
  l tq_platforms;
  v_store_task INTEGER;
  v_store_key RECORD;
  v_floor RECORD;
  v_loose RECORD;
  v_id INTEGER;
  v_token UUID := gen_random_uuid();
BEGIN
  SELECT * INTO l FROM tq_platforms p WHERE p.platform = p_platform FOR UPDATE;
  IF NOT FOUND OR l.pauses > 0 OR tq_platform_quota(l) < 1 OR tq_worker_room(l, p_role, p_worker_id) < 1 THEN
    RETURN;
  END IF;

  -- The best idle store: the priorities in use from the highest, each from its floor.
  SELECT NULL::INTEGER AS priority, NULL::TIMESTAMPTZ AS due_at, NULL::INTEGER AS dispensary_id
  INTO v_store_key;
  FOR v_floor IN
    SELECT f.priority, min(f.floor) AS floor
    FROM worker_task_floors f
    WHERE f.role = p_role AND f.platform = p_platform
    GROUP BY f.priority
    ORDER BY f.priority DESC
  LOOP
    SELECT h.priority, h.due_at, h.dispensary_id INTO v_store_key
    FROM worker_task_heads h
    JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
    WHERE h.role = p_role
      AND h.platform = p_platform
      AND h.priority = v_floor.priority
      AND h.due_at >= v_floor.floor
      AND h.due_at <= now()
      AND s.active_task_id IS NULL
    ORDER BY h.due_at, h.dispensary_id
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED;
    EXIT WHEN FOUND;
  END LOOP;

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

CREATE OR REPLACE FUNCTION claim_wait(p_role VARCHAR) RETURNS DOUBLE PRECISION AS $$
  WITH due AS (
    SELECT f.platform
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1
                  FROM worker_task_heads h
                  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
                  WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
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

CALL tq_secure_functions();
