-- Bad input refused in words, before anything changes.
--
-- Every queue function a caller passes arguments to checks them first and refuses a bad one with
-- SQLSTATE 22023 (invalid_parameter_value): the message names the function, the argument and the
-- value it got; the HINT says what would be accepted. Callers no longer meet raw check,
-- foreign-key or value-too-long errors from inside a function (a 101-character worker id, a
-- negative max_retries, an unknown store), nor silent no-ops (a resync of platform '', or of a
-- day two thousand years ago that would have put its tasks ahead of every other).
-- The plain enqueue becomes a function, enqueue_task, so that the database is the one place that
-- decides what a task may be. The functions redefined here keep their bodies from 0003..0007
-- but for their checks.

------------------------------------------------------------------------------------------------
-- How a function refuses an argument: "<function>: <argument> <rule>, got <value>", and a hint.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_refuse(
  p_function TEXT,
  p_argument TEXT,
  p_value TEXT,
  p_rule TEXT,
  p_hint TEXT
) RETURNS VOID AS $$
BEGIN
  RAISE EXCEPTION '%',
    concat_ws(': ', p_function, format('%s %s, got %s', p_argument, p_rule, coalesce(p_value, 'NULL')))
    USING ERRCODE = 'invalid_parameter_value', HINT = p_hint;
END;
$$ LANGUAGE plpgsql;

-- A text value as a message shows it: quoted, and cut short when long (with its length).
CREATE OR REPLACE FUNCTION tq_shown(p_value TEXT) RETURNS TEXT AS $$
  SELECT CASE
    WHEN p_value IS NULL THEN 'NULL'
    WHEN length(p_value) > 40 THEN quote_literal(left(p_value, 40)) || format('... (%s characters)', length(p_value))
    ELSE quote_literal(p_value)
  END;
$$ LANGUAGE sql IMMUTABLE;

-- A JSON value that is a number (or the text of one, as menus carry prices) from p_low to p_high;
-- with p_whole, a whole number. JSON null and a missing key are not numbers.
CREATE OR REPLACE FUNCTION tq_json_number_between(
  p_value JSONB,
  p_low NUMERIC,
  p_high NUMERIC,
  p_whole BOOLEAN DEFAULT false
) RETURNS BOOLEAN AS $$
  SELECT CASE
    WHEN p_value IS NULL OR jsonb_typeof(p_value) NOT IN ('number', 'string') THEN false
    WHEN p_whole AND (p_value #>> '{}') !~ '^\s*[+-]?[0-9]+\s*$' THEN false
    WHEN (p_value #>> '{}') !~ '^\s*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$' THEN false
    ELSE (p_value #>> '{}')::NUMERIC BETWEEN p_low AND p_high
  END;
$$ LANGUAGE sql IMMUTABLE;

-- A JSON value a text column takes as it is: a non-empty string, or a number.
CREATE OR REPLACE FUNCTION tq_json_text(p_value JSONB) RETURNS BOOLEAN AS $$
  SELECT coalesce(
    jsonb_typeof(p_value) = 'number' OR (jsonb_typeof(p_value) = 'string' AND p_value #>> '{}' <> ''),
    false);
$$ LANGUAGE sql IMMUTABLE;

-- The UTC days generate_resync_tasks takes: back far enough for a backfill, ahead only as far
-- as a schedule could plan. A day outside is refused: an old day's tasks are all due at once,
-- ahead of every task due later (0001-01-01 jumped the whole queue); a far one is a typing error.
-- tq_pipelines.queue.RESYNC_DAYS_BACK and RESYNC_DAYS_AHEAD hold the same two numbers for the
-- command line's checks (a test keeps them equal).
CREATE OR REPLACE FUNCTION tq_resync_window(OUT first_day DATE, OUT last_day DATE) AS $$
  SELECT (now() AT TIME ZONE 'UTC')::DATE - 1826, (now() AT TIME ZONE 'UTC')::DATE + 7;
$$ LANGUAGE sql STABLE;

-- The platforms the queue knows, as a hint: those with limits (tq_platforms) and those of stores.
CREATE OR REPLACE FUNCTION tq_known_platforms_hint() RETURNS TEXT AS $$
  SELECT coalesce('Known platforms: ' || string_agg(k.platform, ', ' ORDER BY k.platform) || '.',
                  'No platform is known yet.')
    || ' A platform is known once a store of it is listed or its limits are loaded (tq platforms --sync).'
  FROM (
    SELECT l.platform::TEXT FROM tq_platforms l
    UNION
    SELECT DISTINCT d.menu_type::TEXT FROM dispensaries d WHERE d.menu_type IS NOT NULL
  ) k (platform);
$$ LANGUAGE sql STABLE;

-- A worker id: 1 to 100 characters (the width of worker_tasks.worker_id), not all blanks. Kept
-- to comparisons: claim_tasks calls it on every claim.
CREATE OR REPLACE FUNCTION tq_require_worker(p_worker_id VARCHAR) RETURNS VOID AS $$
BEGIN
  IF p_worker_id IS NULL OR btrim(p_worker_id) = '' THEN
    PERFORM tq_refuse(NULL, 'worker_id', tq_shown(p_worker_id), 'must not be empty',
      'A worker id is 1 to 100 characters, not all blanks, and unique to one worker process.');
  ELSIF length(p_worker_id) > 100 THEN
    PERFORM tq_refuse(NULL, 'worker_id', tq_shown(p_worker_id), 'must be at most 100 characters',
      'A worker id is 1 to 100 characters, not all blanks (worker_tasks.worker_id is VARCHAR(100)).');
  END IF;
END;
$$ LANGUAGE plpgsql IMMUTABLE;

-- What every enqueue checks before it writes. p_max_retries NULL: not the caller's to give.
CREATE OR REPLACE FUNCTION tq_check_task(
  p_function TEXT,
  p_role VARCHAR,
  p_dispensary_id INTEGER,
  p_platform VARCHAR,
  p_priority INTEGER,
  p_scheduled_for TIMESTAMPTZ,
  p_max_retries INTEGER,
  p_payload JSONB
) RETURNS VOID AS $$
BEGIN
  PERFORM tq_require_role(p_role);
  IF p_dispensary_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM dispensaries d WHERE d.id = p_dispensary_id) THEN
    PERFORM tq_refuse(p_function, 'dispensary_id', p_dispensary_id::TEXT, 'must be the id of a store in dispensaries',
      'Give a dispensaries.id, or NULL for a task of no store (a platform''s listing, the analytics).');
  END IF;
  IF p_platform IS NOT NULL AND (btrim(p_platform) = '' OR length(p_platform) > 50) THEN
    PERFORM tq_refuse(p_function, 'platform', tq_shown(p_platform), 'must be NULL or a name of 1 to 50 characters',
      'The platform whose limits the task''s requests keep (dispensaries.menu_type); NULL for none.');
  END IF;
  IF p_priority IS NULL OR p_priority NOT BETWEEN -1000 AND 1000 THEN
    PERFORM tq_refuse(p_function, 'priority', p_priority::TEXT, 'must be between -1000 and 1000',
      'Due tasks of a higher priority are claimed first; 0 is the default.');
  END IF;
  IF p_scheduled_for IS NOT NULL
     AND NOT (p_scheduled_for BETWEEN now() - INTERVAL '31 days' AND now() + INTERVAL '366 days') THEN
    PERFORM tq_refuse(p_function, 'scheduled_for', p_scheduled_for::TEXT,
      'must be within 31 days before and 366 days after now',
      format('Give a time from %s to %s, or NULL for now: an older time would put the task ahead of '
             'every task due since; a later one is most likely a mistake.',
             date_trunc('second', now() - INTERVAL '31 days'), date_trunc('second', now() + INTERVAL '366 days')));
  END IF;
  IF p_max_retries IS NOT NULL AND p_max_retries NOT BETWEEN 0 AND 100 THEN
    PERFORM tq_refuse(p_function, 'max_retries', p_max_retries::TEXT, 'must be between 0 and 100',
      'How many times a failed task is tried again: 0 (never) to 100; the default is 3.');
  END IF;
  IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' THEN
    PERFORM tq_refuse(p_function, 'payload', tq_shown(p_payload::TEXT), 'must be a JSON object',
      'The role''s parameters as a JSON object, e.g. {"platform": "dutchie", "region": "north"}; {} for none.');
  END IF;
END;
$$ LANGUAGE plpgsql STABLE;

------------------------------------------------------------------------------------------------
-- Enqueueing
------------------------------------------------------------------------------------------------

-- One task; returns its id. What TaskQueue.enqueue sent as a bare INSERT, checked first.
CREATE OR REPLACE FUNCTION enqueue_task(
  p_role VARCHAR,
  p_dispensary_id INTEGER DEFAULT NULL,
  p_platform VARCHAR DEFAULT NULL,
  p_priority INTEGER DEFAULT 0,
  p_scheduled_for TIMESTAMPTZ DEFAULT NULL,
  p_max_retries INTEGER DEFAULT 3,
  p_payload JSONB DEFAULT '{}'
) RETURNS INTEGER AS $$
DECLARE
  v_id INTEGER;
BEGIN
  p_priority := coalesce(p_priority, 0);
  p_max_retries := coalesce(p_max_retries, 3);
  p_payload := coalesce(p_payload, '{}');
  PERFORM tq_check_task('enqueue_task', p_role, p_dispensary_id, p_platform, p_priority, p_scheduled_for,
                        p_max_retries, p_payload);
  INSERT INTO worker_tasks (role, dispensary_id, platform, priority, scheduled_for, max_retries, payload)
  VALUES (p_role, p_dispensary_id, p_platform, p_priority, p_scheduled_for, p_max_retries, p_payload)
  RETURNING id INTO v_id;
  RETURN v_id;
END;
$$ LANGUAGE plpgsql;

COMMENT ON FUNCTION enqueue_task(VARCHAR, INTEGER, VARCHAR, INTEGER, TIMESTAMPTZ, INTEGER, JSONB) IS
  'Add one task after checking every argument; returns its id';

-- As in 0005, its arguments checked first (an unknown role or store was a raw foreign-key error).
CREATE OR REPLACE FUNCTION enqueue_task_once(
  p_role VARCHAR,
  p_dispensary_id INTEGER DEFAULT NULL,
  p_platform VARCHAR DEFAULT NULL,
  p_priority INTEGER DEFAULT 0,
  p_scheduled_for TIMESTAMPTZ DEFAULT NULL,
  p_payload JSONB DEFAULT '{}'
) RETURNS INTEGER AS $$
DECLARE
  v_id INTEGER;
BEGIN
  p_payload := coalesce(p_payload, '{}');
  PERFORM tq_check_task('enqueue_task_once', p_role, p_dispensary_id, p_platform, coalesce(p_priority, 0),
                        p_scheduled_for, NULL, p_payload);
  PERFORM pg_advisory_xact_lock(
    hashtext('tq:enqueue_once:' || p_role || ':' || coalesce(p_dispensary_id::TEXT, '-')));
  IF EXISTS (
    SELECT 1
    FROM worker_tasks t
    WHERE t.role = p_role
      AND (t.dispensary_id = p_dispensary_id OR (p_dispensary_id IS NULL AND t.dispensary_id IS NULL))
      AND t.payload = p_payload
      AND t.status IN ('pending', 'claimed', 'running')
  ) THEN
    RETURN NULL;
  END IF;
  INSERT INTO worker_tasks (role, dispensary_id, platform, priority, scheduled_for, payload)
  VALUES (p_role, p_dispensary_id, p_platform, coalesce(p_priority, 0), p_scheduled_for, p_payload)
  RETURNING id INTO v_id;
  RETURN v_id;
END;
$$ LANGUAGE plpgsql;

-- As in 0005, with the date in a window around today and every platform known.
CREATE OR REPLACE FUNCTION generate_resync_tasks(
  p_batches_per_day INTEGER DEFAULT 6,
  p_date DATE DEFAULT (now() AT TIME ZONE 'UTC')::DATE,
  p_platforms TEXT[] DEFAULT '{dutchie}'
) RETURNS INTEGER AS $$
DECLARE
  v_created INTEGER;
  v_window RECORD;
  v_unknown TEXT;
BEGIN
  IF p_batches_per_day IS NULL OR p_batches_per_day NOT BETWEEN 1 AND 24 THEN
    PERFORM tq_refuse('generate_resync_tasks', 'batches_per_day', p_batches_per_day::TEXT,
      'must be between 1 and 24',
      'The UTC day''s tasks are spread over 1 to 24 equal batches (the default, 6: one every 4 hours).');
  END IF;
  SELECT * INTO v_window FROM tq_resync_window();
  IF p_date IS NULL OR p_date NOT BETWEEN v_window.first_day AND v_window.last_day THEN
    PERFORM tq_refuse('generate_resync_tasks', 'date', p_date::TEXT,
      format('must be a UTC day from %s to %s', v_window.first_day, v_window.last_day),
      format('Give a day at most %s days back (a backfill) and %s days ahead: an older day''s tasks '
             'would all be due at once, ahead of every other task.',
             (now() AT TIME ZONE 'UTC')::DATE - v_window.first_day,
             v_window.last_day - (now() AT TIME ZONE 'UTC')::DATE));
  END IF;
  IF p_platforms IS NULL OR cardinality(p_platforms) = 0
     OR EXISTS (SELECT 1 FROM unnest(p_platforms) AS x (platform) WHERE coalesce(btrim(x.platform), '') = '') THEN
    PERFORM tq_refuse('generate_resync_tasks', 'platforms', coalesce(quote_literal(p_platforms::TEXT), 'NULL'),
      'must name at least one platform, and no empty name', tq_known_platforms_hint());
  END IF;
  -- A platform that no store and no limits name is most likely misspelt: 0 tasks would hide it.
  SELECT string_agg(quote_literal(u.platform), ', ' ORDER BY u.platform) INTO v_unknown
  FROM (SELECT DISTINCT x.platform FROM unnest(p_platforms) AS x (platform)) u
  WHERE NOT EXISTS (SELECT 1 FROM tq_platforms l WHERE l.platform = u.platform)
    AND NOT EXISTS (SELECT 1 FROM dispensaries d WHERE d.menu_type = u.platform);
  IF v_unknown IS NOT NULL THEN
    PERFORM tq_refuse('generate_resync_tasks', 'platforms', quote_literal(p_platforms::TEXT),
      format('must name only known platforms (unknown: %s)', v_unknown), tq_known_platforms_hint());
  END IF;

  WITH eligible AS (
    SELECT
      d.id,
      d.menu_type,
      -- The store's place within its platform: the round-robin key.
      row_number() OVER (PARTITION BY d.menu_type ORDER BY d.id) AS turn
    FROM dispensaries d
    WHERE d.crawl_enabled
      AND d.menu_type = ANY (p_platforms)
      AND d.platform_dispensary_id IS NOT NULL
  ),
  ordered AS (
    SELECT
      e.id,
      e.menu_type,
      row_number() OVER (ORDER BY e.turn, e.menu_type, e.id) - 1 AS n,
      count(*) OVER () AS total
    FROM eligible e
  ),
  stores AS (
    SELECT
      o.id,
      o.menu_type,
      o.n,
      o.n * p_batches_per_day / o.total AS batch,
      row_number() OVER (PARTITION BY o.n * p_batches_per_day / o.total ORDER BY o.n) - 1 AS place
    FROM ordered o
  )
  INSERT INTO worker_tasks (role, dispensary_id, platform, scheduled_for, priority, resync_date)
  SELECT
    'product_resync',
    s.id,
    s.menu_type,
    (p_date::TIMESTAMP AT TIME ZONE 'UTC')
      + s.batch * (INTERVAL '24 hours' / p_batches_per_day)
      + s.place * INTERVAL '1 millisecond',
    0,
    p_date
  FROM stores s
  ORDER BY s.n
  ON CONFLICT (role, dispensary_id, resync_date) WHERE resync_date IS NOT NULL DO NOTHING;
  GET DIAGNOSTICS v_created = ROW_COUNT;
  RETURN v_created;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Workers and recovery
------------------------------------------------------------------------------------------------

-- As in 0003, with an upper bound (a week): 99999999999 minutes was an overflow.
CREATE OR REPLACE FUNCTION recover_stale_tasks_report(stale_threshold_minutes INTEGER DEFAULT 10)
RETURNS TABLE (recovered INTEGER, failed INTEGER, workers_offline INTEGER) AS $$
DECLARE
  v_cutoff TIMESTAMPTZ;
BEGIN
  IF stale_threshold_minutes IS NULL OR stale_threshold_minutes NOT BETWEEN 1 AND 10080 THEN
    PERFORM tq_refuse('recover_stale_tasks', 'stale_threshold_minutes', stale_threshold_minutes::TEXT,
      'must be between 1 and 10080',
      'The minutes of silence after which a worker''s tasks go back to the queue: 1 to 10080 (a week); '
      'the default is 10.');
  END IF;
  v_cutoff := now() - make_interval(mins => stale_threshold_minutes);

  WITH expired AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
        retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
        error_message = format('lease expired: worker %s silent for over %s minutes',
                               t.worker_id, stale_threshold_minutes),
        worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
        claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
        last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
        completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
    WHERE t.id IN (
        -- One branch per partial index over active tasks.
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NOT NULL
        UNION ALL
        SELECT a.id FROM worker_tasks a
        WHERE a.status IN ('claimed', 'running') AND a.dispensary_id IS NULL
      )
      AND t.status IN ('claimed', 'running')
      AND coalesce(t.last_heartbeat_at, t.started_at, t.claimed_at, t.updated_at) < v_cutoff
    RETURNING t.status
  )
  SELECT
    count(*) FILTER (WHERE e.status = 'pending'),
    count(*) FILTER (WHERE e.status = 'failed')
  INTO recovered, failed
  FROM expired e;

  UPDATE worker_registry
  SET status = 'offline'
  WHERE status <> 'offline'
    AND last_heartbeat_at < v_cutoff;
  GET DIAGNOSTICS workers_offline = ROW_COUNT;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

-- As in 0007, each argument checked on its own, with upper bounds (NaN and infinity were taken).
CREATE OR REPLACE FUNCTION expire_leases(
  p_intervals DOUBLE PRECISION DEFAULT 2.5,
  p_default_heartbeat_seconds DOUBLE PRECISION DEFAULT 30,
  p_min_seconds DOUBLE PRECISION DEFAULT 10
) RETURNS TABLE (recovered INTEGER, failed INTEGER) AS $$
BEGIN
  -- NOT BETWEEN refuses NaN too (PostgreSQL sorts it above every number).
  IF p_intervals IS NULL OR p_intervals NOT BETWEEN 1.5 AND 100 THEN
    PERFORM tq_refuse('expire_leases', 'intervals', p_intervals::TEXT, 'must be between 1.5 and 100',
      'A lease ends after this many of its worker''s heartbeat intervals of silence (the default, 2.5).');
  END IF;
  IF p_default_heartbeat_seconds IS NULL
     OR NOT (p_default_heartbeat_seconds > 0 AND p_default_heartbeat_seconds <= 3600) THEN
    PERFORM tq_refuse('expire_leases', 'default_heartbeat_seconds', p_default_heartbeat_seconds::TEXT,
      'must be above 0 and at most 3600',
      'The heartbeat interval of workers that registered none, in seconds (the default, 30).');
  END IF;
  IF p_min_seconds IS NULL OR p_min_seconds NOT BETWEEN 1 AND 86400 THEN
    PERFORM tq_refuse('expire_leases', 'min_seconds', p_min_seconds::TEXT, 'must be between 1 and 86400',
      'No lease ends after less silence than this, in seconds (the default, 10).');
  END IF;
  WITH lease AS (
    SELECT
      a.id,
      greatest(p_min_seconds, p_intervals * coalesce(w.heartbeat_seconds, p_default_heartbeat_seconds)) AS seconds
    FROM (
      -- One branch per partial index over active tasks.
      SELECT t.id, t.worker_id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NOT NULL
      UNION ALL
      SELECT t.id, t.worker_id FROM worker_tasks t
      WHERE t.status IN ('claimed', 'running') AND t.dispensary_id IS NULL
    ) a
    LEFT JOIN worker_registry w ON w.worker_id = a.worker_id
  ),
  expired AS (
    UPDATE worker_tasks t
    SET status = CASE WHEN t.retry_count < t.max_retries THEN 'pending' ELSE 'failed' END,
        retry_count = t.retry_count + CASE WHEN t.retry_count < t.max_retries THEN 1 ELSE 0 END,
        error_message = format('lease expired: worker %s silent for over %s s', t.worker_id, round(l.seconds)),
        worker_id = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.worker_id END,
        claimed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.claimed_at END,
        started_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.started_at END,
        last_heartbeat_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE t.last_heartbeat_at END,
        completed_at = CASE WHEN t.retry_count < t.max_retries THEN NULL ELSE now() END
    FROM lease l
    WHERE t.id = l.id
      AND t.status IN ('claimed', 'running')
      AND coalesce(t.last_heartbeat_at, t.started_at, t.claimed_at, t.updated_at)
          < now() - make_interval(secs => l.seconds)
    RETURNING t.status
  )
  SELECT
    count(*) FILTER (WHERE e.status = 'pending')::INTEGER,
    count(*) FILTER (WHERE e.status = 'failed')::INTEGER
  INTO recovered, failed
  FROM expired e;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

-- As in 0003; a worker id over 100 characters was a raw value-too-long error.
CREATE OR REPLACE FUNCTION register_worker(
  p_worker_id VARCHAR,
  p_role VARCHAR,
  p_pod_name VARCHAR DEFAULT NULL,
  p_hostname VARCHAR DEFAULT NULL
) RETURNS VOID AS $$
BEGIN
  PERFORM tq_require_worker(p_worker_id);
  PERFORM tq_require_role(p_role);
  IF length(p_pod_name) > 100 THEN
    PERFORM tq_refuse('register_worker', 'pod_name', tq_shown(p_pod_name), 'must be at most 100 characters',
      'The pod the worker runs in, up to 100 characters (worker_registry.pod_name), or NULL.');
  END IF;
  IF length(p_hostname) > 100 THEN
    PERFORM tq_refuse('register_worker', 'hostname', tq_shown(p_hostname), 'must be at most 100 characters',
      'The host the worker runs on, up to 100 characters (worker_registry.hostname), or NULL.');
  END IF;
  INSERT INTO worker_registry AS w (worker_id, role, pod_name, hostname, started_at, last_heartbeat_at, status)
  VALUES (p_worker_id, p_role, p_pod_name, p_hostname, now(), now(), 'active')
  ON CONFLICT (worker_id) DO UPDATE
  SET role = excluded.role,
      pod_name = excluded.pod_name,
      hostname = excluded.hostname,
      started_at = now(),
      last_heartbeat_at = now(),
      status = 'active';
END;
$$ LANGUAGE plpgsql;

-- As in 0007, with a hint.
CREATE OR REPLACE FUNCTION register_worker(
  p_worker_id VARCHAR,
  p_role VARCHAR,
  p_pod_name VARCHAR,
  p_hostname VARCHAR,
  p_heartbeat_seconds DOUBLE PRECISION
) RETURNS VOID AS $$
BEGIN
  IF p_heartbeat_seconds IS NULL OR p_heartbeat_seconds <= 0 OR p_heartbeat_seconds > 3600 THEN
    PERFORM tq_refuse('register_worker', 'heartbeat_seconds', p_heartbeat_seconds::TEXT,
      'must be above 0 and at most 3600',
      'The seconds between the worker''s heartbeats; its leases end after a few of them of silence.');
  END IF;
  PERFORM register_worker(p_worker_id, p_role, p_pod_name, p_hostname);
  UPDATE worker_registry SET heartbeat_seconds = p_heartbeat_seconds WHERE worker_id = p_worker_id;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Claiming and completing: checks of a few comparisons, no query more.
------------------------------------------------------------------------------------------------

-- As in 0006, with a hint (its worker id is checked by tq_require_worker, above).
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

-- As in 0007, with a hint.
CREATE OR REPLACE FUNCTION complete_tasks_timed(
  p_worker_id VARCHAR,
  p_task_ids INTEGER[],
  p_results JSONB[],
  p_began_after DOUBLE PRECISION[],
  p_ended_after DOUBLE PRECISION[]
) RETURNS INTEGER[] AS $$
DECLARE
  v_done INTEGER[];
BEGIN
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
    FROM unnest(p_task_ids, p_results, p_began_after, p_ended_after) AS r (id, result, began, ended)
    WHERE t.id = r.id
      AND t.worker_id = p_worker_id
      AND t.status IN ('claimed', 'running')
    RETURNING t.id
  )
  SELECT coalesce(array_agg(id ORDER BY id), '{}') INTO v_done FROM done;

  IF cardinality(v_done) > 0 THEN
    PERFORM worker_completed(p_worker_id, cardinality(v_done));
  END IF;
  RETURN v_done;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Platforms and the crawl's writes
------------------------------------------------------------------------------------------------

-- As in 0006, every limit checked against tq_platforms' constraints before anything is written.
CREATE OR REPLACE FUNCTION sync_platform_limits(p_limits JSONB) RETURNS INTEGER AS $$
DECLARE
  v_changed INTEGER;
  v_bad TEXT;
  v_field RECORD;
  v_hint TEXT := 'Each platform: {"platform": a name of 1 to 50 characters, "max_in_flight": 1 to 10000, '
    '"requests_per_second": 0.001 to 10000, "burst": 1 to 10000 (default max_in_flight), '
    '"pause_after_errors": 1 to 1000 (default 5), "pause_seconds": 0.1 to 86400 (default 5), '
    '"max_pause_seconds": pause_seconds to 86400 (default 600)}; counts are whole numbers.';
BEGIN
  IF p_limits IS NULL OR jsonb_typeof(p_limits) <> 'array'
     OR EXISTS (SELECT 1 FROM jsonb_array_elements(p_limits) AS x (e) WHERE jsonb_typeof(x.e) <> 'object') THEN
    PERFORM tq_refuse('sync_platform_limits', 'limits', tq_shown(p_limits::TEXT),
      'must be a JSON array of objects, one per platform', v_hint);
  END IF;
  SELECT string_agg(coalesce(quote_literal(b.platform), 'NULL'), ', ') INTO v_bad
  FROM (
    SELECT x.platform
    FROM jsonb_to_recordset(p_limits) AS x (platform TEXT)
    GROUP BY x.platform
    HAVING x.platform IS NULL OR btrim(x.platform) = '' OR length(x.platform) > 50 OR count(*) > 1
  ) b;
  IF v_bad IS NOT NULL THEN
    RAISE EXCEPTION 'sync_platform_limits: each platform needs a non-empty name, once (and of at most 50 '
      'characters), got %', v_bad
      USING ERRCODE = 'invalid_parameter_value', HINT = v_hint;
  END IF;
  -- Every limit in range before any is written: a raw check violation named only the constraint.
  SELECT x.e ->> 'platform' AS platform, f.name, f.rule, f.value
  INTO v_field
  FROM jsonb_array_elements(p_limits) WITH ORDINALITY AS x (e, n)
  CROSS JOIN LATERAL (VALUES
    (1, 'max_in_flight', 'must be a whole number from 1 to 10000', x.e -> 'max_in_flight',
        NOT tq_json_number_between(x.e -> 'max_in_flight', 1, 10000, true)),
    (2, 'requests_per_second', 'must be a number from 0.001 to 10000', x.e -> 'requests_per_second',
        NOT tq_json_number_between(x.e -> 'requests_per_second', 0.001, 10000)),
    (3, 'burst', 'must be null or a whole number from 1 to 10000', x.e -> 'burst',
        jsonb_typeof(x.e -> 'burst') <> 'null' AND NOT tq_json_number_between(x.e -> 'burst', 1, 10000, true)),
    (4, 'pause_after_errors', 'must be null or a whole number from 1 to 1000', x.e -> 'pause_after_errors',
        jsonb_typeof(x.e -> 'pause_after_errors') <> 'null'
        AND NOT tq_json_number_between(x.e -> 'pause_after_errors', 1, 1000, true)),
    (5, 'pause_seconds', 'must be null or a number from 0.1 to 86400', x.e -> 'pause_seconds',
        jsonb_typeof(x.e -> 'pause_seconds') <> 'null'
        AND NOT tq_json_number_between(x.e -> 'pause_seconds', 0.1, 86400)),
    (6, 'max_pause_seconds', 'must be null or a number from 0.1 to 86400', x.e -> 'max_pause_seconds',
        jsonb_typeof(x.e -> 'max_pause_seconds') <> 'null'
        AND NOT tq_json_number_between(x.e -> 'max_pause_seconds', 0.1, 86400))
  ) AS f (k, name, rule, value, bad)
  WHERE f.bad
  ORDER BY x.n, f.k
  LIMIT 1;
  IF FOUND THEN
    PERFORM tq_refuse('sync_platform_limits',
      format('%s of platform %s', v_field.name, quote_literal(v_field.platform)),
      coalesce(v_field.value::TEXT, 'missing'), v_field.rule, v_hint);
  END IF;
  SELECT x.e ->> 'platform' AS platform, x.e -> 'pause_seconds' AS pause, x.e -> 'max_pause_seconds' AS max_pause
  INTO v_field
  FROM jsonb_array_elements(p_limits) WITH ORDINALITY AS x (e, n)
  WHERE coalesce((x.e ->> 'max_pause_seconds')::NUMERIC, 600) < coalesce((x.e ->> 'pause_seconds')::NUMERIC, 5)
  ORDER BY x.n
  LIMIT 1;
  IF FOUND THEN
    PERFORM tq_refuse('sync_platform_limits',
      format('max_pause_seconds of platform %s', quote_literal(v_field.platform)),
      coalesce(v_field.max_pause::TEXT, '600 (the default)'),
      format('must not be below its pause_seconds (%s)', coalesce(v_field.pause::TEXT, '5, the default')), v_hint);
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

-- As in 0004, with the platform's width and the listing's shape checked.
CREATE OR REPLACE FUNCTION upsert_listed_stores(p_platform VARCHAR, p_stores JSONB)
RETURNS TABLE (dispensary_id INTEGER, directory_id TEXT, created BOOLEAN) AS $$
DECLARE
  s RECORD;
  v_id INTEGER;
  v_gone TIMESTAMPTZ;
BEGIN
  IF p_platform IS NULL OR btrim(p_platform) = '' OR length(p_platform) > 50 THEN
    PERFORM tq_refuse('upsert_listed_stores', 'platform', tq_shown(p_platform),
      CASE WHEN length(p_platform) > 50 THEN 'must be at most 50 characters' ELSE 'must not be empty' END,
      'The platform the stores were listed on: a name of 1 to 50 characters (dispensaries.menu_type).');
  END IF;
  IF p_stores IS NULL OR jsonb_typeof(p_stores) <> 'array'
     OR EXISTS (SELECT 1 FROM jsonb_array_elements(p_stores) AS x (e) WHERE jsonb_typeof(x.e) <> 'object') THEN
    PERFORM tq_refuse('upsert_listed_stores', 'stores', tq_shown(p_stores::TEXT), 'must be a JSON array of objects',
      'One object per listed store: {"id": its id on the platform, "name": ..., "region": ...}.');
  END IF;
  -- Two listings of one platform at once would both see a store as new.
  PERFORM pg_advisory_xact_lock(hashtext('tq:listing:' || p_platform));
  IF EXISTS (
    SELECT 1 FROM jsonb_to_recordset(p_stores) AS x (id TEXT) WHERE x.id IS NULL OR x.id = ''
  ) THEN
    RAISE EXCEPTION 'upsert_listed_stores: every listed store needs a non-empty id'
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'One object per listed store: {"id": its id on the platform, "name": ..., "region": ...}.';
  END IF;
  FOR s IN
    SELECT DISTINCT ON (x.id) x.id, x.name, x.region
    FROM jsonb_to_recordset(p_stores) AS x (id TEXT, name TEXT, region TEXT)
    ORDER BY x.id
  LOOP
    SELECT c.dispensary_id, c.gone_at INTO v_id, v_gone
    FROM store_crawl_state c
    WHERE c.platform = p_platform AND c.directory_id = s.id
    FOR UPDATE;
    IF FOUND THEN
      UPDATE store_crawl_state c
      SET last_listed_at = now(), region = coalesce(s.region, c.region), gone_at = NULL
      WHERE c.dispensary_id = v_id;
      -- Gone, now back: crawl it again (a store disabled by hand has no gone_at and stays so).
      IF v_gone IS NOT NULL THEN
        UPDATE dispensaries d SET crawl_enabled = true WHERE d.id = v_id;
      END IF;
      -- Still unresolved (gone before it was, or its entry point failed): try again.
      INSERT INTO worker_tasks (role, dispensary_id, platform)
      SELECT 'entry_point_discovery', d.id, p_platform
      FROM dispensaries d
      WHERE d.id = v_id
        AND d.crawl_enabled
        AND d.platform_dispensary_id IS NULL
        AND NOT EXISTS (
          SELECT 1 FROM worker_tasks t
          WHERE t.dispensary_id = v_id
            AND t.role = 'entry_point_discovery'
            AND t.status IN ('pending', 'claimed', 'running'));
      dispensary_id := v_id; directory_id := s.id; created := false;
    ELSE
      INSERT INTO dispensaries (name, menu_type, crawl_enabled)
      VALUES (coalesce(nullif(s.name, ''), s.id), p_platform, true)
      RETURNING id INTO v_id;
      INSERT INTO store_crawl_state (dispensary_id, platform, directory_id, region, first_listed_at, last_listed_at)
      VALUES (v_id, p_platform, s.id, s.region, now(), now());
      INSERT INTO worker_tasks (role, dispensary_id, platform)
      VALUES ('entry_point_discovery', v_id, p_platform);
      dispensary_id := v_id; directory_id := s.id; created := true;
    END IF;
    RETURN NEXT;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

-- As in 0004, every product checked before anything is written.
CREATE OR REPLACE FUNCTION store_menu(p_dispensary_id INTEGER, p_menu_hash TEXT, p_products JSONB)
RETURNS TABLE (unchanged BOOLEAN, seen INTEGER, new INTEGER, changed INTEGER, gone INTEGER) AS $$
DECLARE
  v_hash TEXT;
  v_bad RECORD;
  v_hint TEXT := 'products: a JSON array of {"id", "name", "category": text, "brand": text or null, '
    '"price": a number from 0 to 99999999.99, "thc", "cbd": null or a number from 0 to 100, '
    '"in_stock": true or false}, each id once (tq_pipelines.crawl.menu.normalise_menu makes them).';
BEGIN
  INSERT INTO store_crawl_state (dispensary_id, platform)
  SELECT d.id, d.menu_type FROM dispensaries d WHERE d.id = p_dispensary_id
  ON CONFLICT ON CONSTRAINT store_crawl_state_pkey DO NOTHING;
  -- Serialises writers of one store (the queue already runs one task per store at a time).
  SELECT c.menu_hash INTO v_hash
  FROM store_crawl_state c
  WHERE c.dispensary_id = p_dispensary_id
  FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'store_menu: dispensary_id must be the id of a store: no store with id %',
      coalesce(p_dispensary_id::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value', HINT = 'Give a dispensaries.id.';
  END IF;

  IF p_menu_hash IS NULL OR p_menu_hash = '' THEN
    PERFORM tq_refuse('store_menu', 'menu_hash', tq_shown(p_menu_hash), 'must not be empty',
      'The hash of the normalised menu (tq_pipelines.crawl.menu.menu_hash): an unchanged menu is skipped by it.');
  END IF;
  IF p_products IS NULL OR jsonb_typeof(p_products) <> 'array' THEN
    PERFORM tq_refuse('store_menu', 'products', tq_shown(p_products::TEXT), 'must be a JSON array', v_hint);
  END IF;
  -- The first product the tables would refuse (NOT NULL, numeric(10, 2), a price below 0), by
  -- its place and id, before anything is written.
  SELECT x.n - 1 AS n, x.p ->> 'id' AS id, p.problem
  INTO v_bad
  FROM jsonb_array_elements(p_products) WITH ORDINALITY AS x (p, n)
  CROSS JOIN LATERAL (SELECT CASE
    WHEN jsonb_typeof(x.p) <> 'object' THEN 'is not a JSON object'
    WHEN NOT tq_json_text(x.p -> 'id') THEN 'has no id'
    WHEN NOT tq_json_text(x.p -> 'name') THEN 'has no name'
    WHEN NOT tq_json_text(x.p -> 'category') THEN 'has no category'
    WHEN jsonb_typeof(x.p -> 'brand') <> 'null' AND NOT tq_json_text(x.p -> 'brand')
      THEN 'has a brand that is not text'
    WHEN NOT tq_json_number_between(x.p -> 'price', 0, 99999999.99)
      THEN format('has price %s', coalesce(x.p ->> 'price', 'missing'))
    WHEN jsonb_typeof(x.p -> 'thc') <> 'null' AND NOT tq_json_number_between(x.p -> 'thc', 0, 100)
      THEN format('has thc %s', x.p ->> 'thc')
    WHEN jsonb_typeof(x.p -> 'cbd') <> 'null' AND NOT tq_json_number_between(x.p -> 'cbd', 0, 100)
      THEN format('has cbd %s', x.p ->> 'cbd')
    WHEN jsonb_typeof(x.p -> 'in_stock') IS DISTINCT FROM 'boolean'
      THEN format('has in_stock %s', coalesce(x.p ->> 'in_stock', 'missing'))
  END) AS p (problem)
  WHERE p.problem IS NOT NULL
  ORDER BY x.n
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'store_menu: every product needs an id, a name, a category, a price and in_stock: '
      'product #% (id %) %', v_bad.n, tq_shown(v_bad.id), v_bad.problem
      USING ERRCODE = 'invalid_parameter_value', HINT = v_hint;
  END IF;
  IF EXISTS (
    SELECT 1
    FROM jsonb_to_recordset(p_products) AS x (id TEXT)
    GROUP BY x.id
    HAVING x.id IS NULL OR count(*) > 1
  ) THEN
    RAISE EXCEPTION 'store_menu: every product needs an id, and each id once: %', (
        SELECT string_agg(tq_shown(x.id), ', ' ORDER BY x.id)
        FROM (SELECT y.id FROM jsonb_to_recordset(p_products) AS y (id TEXT) GROUP BY y.id HAVING count(*) > 1) x
      )
      USING ERRCODE = 'invalid_parameter_value', HINT = v_hint;
  END IF;

  seen := jsonb_array_length(p_products);
  IF v_hash IS NOT DISTINCT FROM p_menu_hash THEN
    UPDATE store_crawl_state c SET last_crawl_at = now() WHERE c.dispensary_id = p_dispensary_id;
    unchanged := true; new := 0; changed := 0; gone := 0;
    RETURN NEXT;
    RETURN;
  END IF;

  WITH incoming AS (
    SELECT *
    FROM jsonb_to_recordset(p_products) AS x (
      id TEXT, name TEXT, brand TEXT, category TEXT, price NUMERIC, thc NUMERIC, cbd NUMERIC, in_stock BOOLEAN)
  ),
  old AS (
    SELECT p.* FROM products p WHERE p.dispensary_id = p_dispensary_id
  ),
  diff AS (
    SELECT
      i.*,
      o.price AS old_price,
      o.in_stock AS old_in_stock,
      CASE
        WHEN o.id IS NULL THEN 'new'
        WHEN o.gone_at IS NOT NULL THEN 'back'
        WHEN (o.price, o.in_stock) IS DISTINCT FROM (i.price, i.in_stock) THEN 'changed'
      END AS change
    FROM incoming i
    LEFT JOIN old o ON o.external_id = i.id
  ),
  upserted AS (
    INSERT INTO products AS p (
      dispensary_id, external_id, name, brand, category, price, thc_percent, cbd_percent, in_stock)
    SELECT p_dispensary_id, d.id, d.name, d.brand, d.category, d.price, d.thc, d.cbd, d.in_stock
    FROM diff d
    ORDER BY d.id
    ON CONFLICT (dispensary_id, external_id) DO UPDATE
    SET name = excluded.name,
        brand = excluded.brand,
        category = excluded.category,
        price = excluded.price,
        thc_percent = excluded.thc_percent,
        cbd_percent = excluded.cbd_percent,
        in_stock = excluded.in_stock,
        last_seen_at = now(),
        changed_at = CASE
          WHEN p.gone_at IS NOT NULL OR (p.price, p.in_stock) IS DISTINCT FROM (excluded.price, excluded.in_stock)
          THEN now() ELSE p.changed_at END,
        gone_at = NULL
    RETURNING p.id, p.external_id
  ),
  history AS (
    INSERT INTO product_history (product_id, dispensary_id, change, price, old_price, in_stock, old_in_stock)
    SELECT u.id, p_dispensary_id, d.change, d.price, d.old_price, d.in_stock, d.old_in_stock
    FROM upserted u
    JOIN diff d ON d.id = u.external_id
    WHERE d.change IS NOT NULL
  ),
  vanished AS (
    UPDATE products p
    SET gone_at = now(), changed_at = now()
    FROM old o
    WHERE p.id = o.id
      AND o.gone_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM incoming i WHERE i.id = o.external_id)
    RETURNING p.id, p.price, p.in_stock
  ),
  vanished_history AS (
    INSERT INTO product_history (product_id, dispensary_id, change, old_price, old_in_stock)
    SELECT v.id, p_dispensary_id, 'gone', v.price, v.in_stock
    FROM vanished v
  )
  SELECT
    count(*) FILTER (WHERE d.change = 'new'),
    count(*) FILTER (WHERE d.change IN ('changed', 'back')),
    (SELECT count(*) FROM vanished)
  INTO new, changed, gone
  FROM diff d;

  UPDATE store_crawl_state c
  SET menu_hash = p_menu_hash,
      last_crawl_at = now(),
      last_change_at = CASE WHEN new + changed + gone > 0 OR c.menu_hash IS NULL THEN now() ELSE c.last_change_at END
  WHERE c.dispensary_id = p_dispensary_id;
  unchanged := false;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;
