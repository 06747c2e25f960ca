-- One trust boundary, first part: nothing a caller passes switches a platform's politeness off,
-- and the worker role can do no more than its functions let it (issue 15, items 1 and 5).
--
-- A task's platform is its store's.
-- The platform limits (tq_platforms) key on worker_tasks.platform; the crawl goes to the store's
-- dispensaries.menu_type. A task enqueued with no platform, or another one, was claimed without
-- its store's limits while its requests went to that store's platform. Now:
-- - enqueue_task and enqueue_task_once refuse a given platform that is not the store's
--   (22023, in words, through tq_check_task); given none, the task takes its store's;
-- - a task of no store has the platform it names: its platform argument, or its payload's
--   "platform" (store_discovery's handler lists that one), and the two may not differ;
-- - triggers on worker_tasks keep this true for every writer of an unfinished task (the queue's
--   functions, generate_resync_tasks and upsert_listed_stores among them, and anyone's SQL): an
--   insert with no platform takes the store's, one with another platform is refused, and a task
--   moved to another store (or opened again) follows its new store;
-- - a store's platform may change only while none of its tasks is claimed or running: a trigger
--   on dispensaries refuses the change (55006) while one is, since that task's requests keep the
--   limits of the platform it was claimed for, and moves the store's pending tasks (and so their
--   heads) to the new platform. It locks the store's worker_task_stores row first, as claims do,
--   so a claim in progress finishes before it looks and no claim starts until it commits; and
--   an insert of a task reads the store's platform FOR SHARE, so a change and an insert never
--   pass each other unseen.
-- Unfinished tasks whose platform disagrees are set right below, once. Finished ones keep the
-- platform they ran on. Drain runs' permits key on the task's platform (worker.PlatformPermit,
-- from the claim's send_at), and the crawl handlers refuse a task whose store is on another
-- platform, which the rules above leave no way to make.
--
-- Sizes and counters a caller feeds are bounded:
-- - a task's payload and result are at most 1 MB (1048576 bytes, as jsonb), refused in words
--   above it (the enqueues name themselves; a result is refused by a trigger, whichever function
--   completes the task); an error text is cut at 8192 characters, the cut marked, as
--   tq_pipelines.queue.storable_text cuts it;
-- - worker_registry.tasks_completed and tasks_failed are BIGINT, and worker_completed takes at
--   most 100000 at a time: a worker could add 2147483647 - n to another's count, and that
--   worker's next completions failed with 22003;
-- - sync_platform_limits takes at most 1000 platforms, and leaves at most 1000 with limits.
--
-- The worker role (tq grant, docs/DEPLOYMENT.md "Roles and privileges", "Threat model"):
-- - tq_worker_write_routes lists every way a role could change the queue other than through its
--   functions: SUPERUSER, CREATEROLE, BYPASSRLS or REPLICATION of any role it can act as;
--   membership in pg_write_all_data, pg_execute_server_program, pg_write_server_files,
--   pg_read_server_files or pg_signal_backend; INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES or
--   TRIGGER on a queue relation, or UPDATE on one of its sequences, held by the role, by a role
--   it is a member of (inherited or only through SET ROLE) or by PUBLIC; CREATE in the schema,
--   where an overload could stand in for a helper the queue's functions call;
-- - tq_grant_worker refuses a worker that has any of those routes, and refuses to grant while
--   the queue's SECURITY DEFINER functions belong to a superuser.
-- What PostgreSQL lets every role do to itself (ALTER ROLE on its own password and settings)
-- no grant takes away: tq grant sets the worker's timeouts and `tq grant --check` reports a
-- setting that differs (docs/DEPLOYMENT.md).
--
-- Safe to run twice: functions are replaced, triggers dropped and made again, the columns' type
-- changed only while they are INTEGER, and the repair of platforms changes only rows that
-- disagree.

------------------------------------------------------------------------------------------------
-- A task's platform is its store's.
------------------------------------------------------------------------------------------------

-- As in 0008, with the platform held to the store's (or, for a task of no store, to its
-- payload's) and the payload's size bounded.
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
DECLARE
  v_store_platform VARCHAR;
BEGIN
  PERFORM tq_require_role(p_role);
  IF p_dispensary_id IS NOT NULL THEN
    SELECT d.menu_type INTO v_store_platform FROM dispensaries d WHERE d.id = p_dispensary_id;
    IF NOT FOUND THEN
      PERFORM tq_refuse(p_function, 'dispensary_id', p_dispensary_id::TEXT, 'must be the id of a store in dispensaries',
        'Give a dispensaries.id, or NULL for a task of no store (a platform''s listing, the analytics).');
    END IF;
  END IF;
  IF p_platform IS NOT NULL AND (btrim(p_platform) = '' OR length(p_platform) > 50) THEN
    PERFORM tq_refuse(p_function, 'platform', tq_shown(p_platform), 'must be NULL or a name of 1 to 50 characters',
      'The platform whose limits the task''s requests keep (dispensaries.menu_type); NULL for none.');
  END IF;
  -- The limits a task keeps are its platform's; its requests go to its store's platform.
  IF p_dispensary_id IS NOT NULL AND p_platform IS NOT NULL AND p_platform IS DISTINCT FROM v_store_platform THEN
    PERFORM tq_refuse(p_function, 'platform', tq_shown(p_platform),
      format('must be that of store %s, %s (dispensaries.menu_type)', p_dispensary_id, tq_shown(v_store_platform)),
      'Leave it out (NULL): a store''s task takes its store''s platform, whose limits its requests keep.');
  END IF;
  IF p_dispensary_id IS NULL AND p_platform IS NOT NULL AND jsonb_typeof(p_payload -> 'platform') = 'string'
     AND p_platform IS DISTINCT FROM p_payload ->> 'platform' THEN
    PERFORM tq_refuse(p_function, 'platform', tq_shown(p_platform),
      format('must be the one the payload names, %s', tq_shown(p_payload ->> 'platform')),
      'A task of no store keeps the limits of the platform it names: name it once (platform, or the '
      'payload''s "platform"), or the same in both.');
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
  -- Measured before the shape: a 20 MB value is not shown, only its size.
  IF pg_column_size(p_payload) > 1048576 THEN
    PERFORM tq_refuse(p_function, 'payload', format('%s bytes', pg_column_size(p_payload)),
      'must be at most 1 MB (1048576 bytes)',
      'A payload holds a role''s parameters: keep large data in a table of its own and put its key here.');
  END IF;
  IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' THEN
    PERFORM tq_refuse(p_function, 'payload', tq_shown(p_payload::TEXT), 'must be a JSON object',
      'The role''s parameters as a JSON object, e.g. {"platform": "dutchie", "region": "north"}; {} for none.');
  END IF;
END;
$$ LANGUAGE plpgsql STABLE;

-- The platform an unfinished task must have: its store's, or for a task of no store the one its
-- payload names (1 to 50 characters; else it has the one it was given, or none). A task with no
-- platform takes it; one with another is refused; on an update that leaves the platform as it
-- was (the task moved to another store, or opened again) the task follows its store. The store's
-- row is read FOR SHARE: a change of its platform (tq_store_platform_changed) waits for this
-- transaction, and this one for it, so that neither misses the other.
CREATE OR REPLACE FUNCTION tq_task_platform() RETURNS TRIGGER AS $$
DECLARE
  v_platform VARCHAR;
  v_rule TEXT;
BEGIN
  IF NEW.dispensary_id IS NOT NULL THEN
    SELECT d.menu_type INTO v_platform FROM dispensaries d WHERE d.id = NEW.dispensary_id FOR SHARE;
    IF NOT FOUND THEN
      RETURN NEW;  -- the foreign key refuses it
    END IF;
    v_rule := format('must be that of store %s, %s (dispensaries.menu_type)', NEW.dispensary_id, tq_shown(v_platform));
  ELSIF jsonb_typeof(NEW.payload -> 'platform') = 'string' AND length(NEW.payload ->> 'platform') BETWEEN 1 AND 50 THEN
    v_platform := NEW.payload ->> 'platform';
    v_rule := format('must be the one its payload names, %s', tq_shown(v_platform));
  ELSE
    RETURN NEW;
  END IF;
  IF NEW.platform IS NULL OR (TG_OP = 'UPDATE' AND NEW.platform IS NOT DISTINCT FROM OLD.platform) THEN
    NEW.platform := v_platform;
  ELSIF NEW.platform IS DISTINCT FROM v_platform THEN
    PERFORM tq_refuse(format('worker_tasks (task %s)', coalesce(NEW.id::TEXT, 'new')), 'platform',
      tq_shown(NEW.platform), v_rule,
      'A task keeps the limits of its platform while its requests go to its store''s: leave the platform '
      'NULL and the store''s is taken.');
  END IF;
  RETURN NEW;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS worker_tasks_platform_inserted ON worker_tasks;
CREATE TRIGGER worker_tasks_platform_inserted
  BEFORE INSERT ON worker_tasks
  FOR EACH ROW
  WHEN (NEW.status IN ('pending', 'claimed', 'running')
        AND (NEW.dispensary_id IS NOT NULL OR NEW.payload ? 'platform'))
  EXECUTE FUNCTION tq_task_platform();

-- Claims, heartbeats and outcomes change none of these columns but the status, and leave the
-- WHEN false: they pay one comparison per row, not a call.
DROP TRIGGER IF EXISTS worker_tasks_platform_updated ON worker_tasks;
CREATE TRIGGER worker_tasks_platform_updated
  BEFORE UPDATE OF dispensary_id, platform, payload, status ON worker_tasks
  FOR EACH ROW
  WHEN (NEW.status IN ('pending', 'claimed', 'running')
        AND (NEW.dispensary_id IS DISTINCT FROM OLD.dispensary_id
             OR NEW.platform IS DISTINCT FROM OLD.platform
             OR NEW.payload IS DISTINCT FROM OLD.payload
             OR OLD.status NOT IN ('pending', 'claimed', 'running')))
  EXECUTE FUNCTION tq_task_platform();

-- A store changes platform: refused while one of its tasks is claimed or running (its requests
-- keep the limits of the platform it was claimed for); its pending tasks follow it.
CREATE OR REPLACE FUNCTION tq_store_platform_changed() RETURNS TRIGGER AS $$
DECLARE
  v_active INTEGER;
BEGIN
  -- The store's queue row, as a claim locks it: a claim in progress commits first (and this
  -- sees its task), a later one skips the store until this commits.
  SELECT s.active_task_id INTO v_active
  FROM worker_task_stores s
  WHERE s.dispensary_id = NEW.id
  FOR UPDATE;
  IF v_active IS NOT NULL THEN
    RAISE EXCEPTION 'dispensaries: the platform (menu_type) of store % cannot change from % to % while its task % is claimed or running',
      NEW.id, tq_shown(OLD.menu_type), tq_shown(NEW.menu_type), v_active
      USING ERRCODE = 'object_in_use',
            HINT = format('That task''s requests keep the limits of %s. Change it once the task is done (or '
                          'cancelled: SELECT cancel_task(%s)); the store''s pending tasks follow it.',
                          tq_shown(OLD.menu_type), v_active);
  END IF;
  UPDATE worker_tasks t
  SET platform = NEW.menu_type
  WHERE t.dispensary_id = NEW.id
    AND t.status = 'pending'
    AND t.platform IS DISTINCT FROM NEW.menu_type;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS dispensaries_platform_changed ON dispensaries;
CREATE TRIGGER dispensaries_platform_changed
  AFTER UPDATE OF menu_type ON dispensaries
  FOR EACH ROW
  WHEN (NEW.menu_type IS DISTINCT FROM OLD.menu_type)
  EXECUTE FUNCTION tq_store_platform_changed();

-- As in 0008, but a store listed again gets its entry_point_discovery on its own platform
-- (dispensaries.menu_type), which may differ from the listing's (a store moved by hand, or one
-- a deployment had before its store_crawl_state row).
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
      SELECT 'entry_point_discovery', d.id, d.menu_type
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

-- Unfinished tasks made before this migration: each gets the platform the rules above give it.
-- A task claimed or running keeps its slot, moved to its store's platform by the counters'
-- triggers (0006) if it held one.
UPDATE worker_tasks t
SET platform = d.menu_type
FROM dispensaries d
WHERE d.id = t.dispensary_id
  AND t.status IN ('pending', 'claimed', 'running')
  AND t.platform IS DISTINCT FROM d.menu_type;

UPDATE worker_tasks t
SET platform = t.payload ->> 'platform'
WHERE t.dispensary_id IS NULL
  AND t.status IN ('pending', 'claimed', 'running')
  AND jsonb_typeof(t.payload -> 'platform') = 'string'
  AND length(t.payload ->> 'platform') BETWEEN 1 AND 50
  AND t.platform IS DISTINCT FROM t.payload ->> 'platform';

------------------------------------------------------------------------------------------------
-- What a caller may store: a payload or a result of at most 1 MB, an error text of at most 8192
-- characters. One trigger for every writer, so that no function that completes or enqueues
-- can be missed; its WHEN costs a size lookup per row, no call, on the claim's path none.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION tq_task_sizes() RETURNS TRIGGER AS $$
BEGIN
  IF pg_column_size(NEW.payload) > 1048576 THEN
    PERFORM tq_refuse(format('worker_tasks (task %s)', NEW.id), 'payload',
      format('%s bytes', pg_column_size(NEW.payload)), 'must be at most 1 MB (1048576 bytes)',
      'A payload holds a role''s parameters: keep large data in a table of its own and put its key here.');
  END IF;
  IF pg_column_size(NEW.result) > 1048576 THEN
    PERFORM tq_refuse(format('worker_tasks (task %s)', NEW.id), 'result',
      format('%s bytes', pg_column_size(NEW.result)), 'must be at most 1 MB (1048576 bytes)',
      'A task''s result is its summary (counts, a hash): what it fetched belongs in tables of its own.');
  END IF;
  IF length(NEW.error_message) > 8192 THEN
    -- As tq_pipelines.queue.storable_text cuts it: the first characters and how many went.
    NEW.error_message := left(NEW.error_message,
        8192 - length(format(' [... cut: %s more characters]', to_char(length(NEW.error_message) - 8192, 'FM999,999,999,999'))))
      || format(' [... cut: %s more characters]', to_char(length(NEW.error_message) - 8192, 'FM999,999,999,999'));
  END IF;
  RETURN NEW;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS worker_tasks_sizes ON worker_tasks;
CREATE TRIGGER worker_tasks_sizes
  BEFORE INSERT OR UPDATE OF payload, result, error_message ON worker_tasks
  FOR EACH ROW
  WHEN (pg_column_size(NEW.payload) > 1048576
        OR pg_column_size(NEW.result) > 1048576
        OR pg_column_size(NEW.error_message) > 8192)
  EXECUTE FUNCTION tq_task_sizes();

------------------------------------------------------------------------------------------------
-- Counters a caller feeds.
------------------------------------------------------------------------------------------------
DO $$
BEGIN
  IF (SELECT atttypid FROM pg_attribute
      WHERE attrelid = 'worker_registry'::REGCLASS AND attname = 'tasks_completed') = 'integer'::REGTYPE THEN
    ALTER TABLE worker_registry
      ALTER COLUMN tasks_completed TYPE BIGINT,
      ALTER COLUMN tasks_failed TYPE BIGINT;
  END IF;
END;
$$;

-- As in 0007, with the count bounded: a batch's completions, never 2147483647.
CREATE OR REPLACE FUNCTION worker_completed(p_worker_id VARCHAR, p_count INTEGER) RETURNS VOID AS $$
BEGIN
  IF p_count IS NULL OR p_count NOT BETWEEN 0 AND 100000 THEN
    PERFORM tq_refuse('worker_completed', 'count', p_count::TEXT, 'must be between 0 and 100000',
      'The tasks a worker completed in its handlers'' own transactions since it last said so: one batch''s '
      'worth (a claim takes at most 1000).');
  END IF;
  UPDATE worker_registry
  SET tasks_completed = tasks_completed + p_count, last_heartbeat_at = now()
  WHERE worker_id = p_worker_id;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- A sync of at most 1000 platforms, leaving at most 1000 with limits.
------------------------------------------------------------------------------------------------

-- As in 0008, with both counts bounded.
CREATE OR REPLACE FUNCTION sync_platform_limits(p_limits JSONB) RETURNS INTEGER AS $$
DECLARE
  v_changed INTEGER;
  v_total BIGINT;
  v_bad TEXT;
  v_field RECORD;
  v_hint TEXT := 'Each platform: {"platform": a name of 1 to 50 characters, "max_in_flight": 1 to 10000, '
    '"requests_per_second": 0.001 to 10000, "burst": 1 to 10000 (default max_in_flight), '
    '"pause_after_errors": 1 to 1000 (default 5), "pause_seconds": 0.1 to 86400 (default 5), '
    '"max_pause_seconds": pause_seconds to 86400 (default 600)}; counts are whole numbers.';
BEGIN
  -- The count first: a list of 20,000 is refused before it is read element by element.
  IF jsonb_typeof(p_limits) = 'array' AND jsonb_array_length(p_limits) > 1000 THEN
    PERFORM tq_refuse('sync_platform_limits', 'limits', format('%s platforms', jsonb_array_length(p_limits)),
      'must list at most 1000 platforms',
      'A platforms file names the platforms a fleet crawls: a few, never more than 1000.');
  END IF;
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

  -- Nor may syncs add up to more: one sync at a time counts the platforms it would add.
  PERFORM pg_advisory_xact_lock(hashtext('tq:sync_platform_limits'));
  SELECT count(*) INTO v_total
  FROM (
    SELECT l.platform FROM tq_platforms l
    UNION
    SELECT x.platform FROM jsonb_to_recordset(p_limits) AS x (platform TEXT)
  ) k;
  IF v_total > 1000 THEN
    PERFORM tq_refuse('sync_platform_limits', 'limits', format('%s platforms in all', v_total),
      'must leave at most 1000 platforms with limits, counting those loaded before',
      format('%s platforms have limits already; delete those no file names any more '
             '(DELETE FROM tq_platforms WHERE platform = ...), as the admin.',
             (SELECT count(*) FROM tq_platforms)));
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
-- The worker role: no route around the queue's functions.
------------------------------------------------------------------------------------------------

-- Every way p_role could change the queue other than by calling its functions, one line each;
-- none for a worker as tq_grant_worker leaves it. It acts as itself and as every role it is a
-- member of, directly or not, inherited or only through SET ROLE (pg_has_role's MEMBER); PUBLIC's
-- grants count for each (has_*_privilege includes them, and pg_write_all_data's).
CREATE OR REPLACE FUNCTION tq_worker_write_routes(p_role NAME)
RETURNS TABLE (route TEXT) AS $$
  WITH who AS (
    SELECT
      r.oid,
      r.rolname,
      r.rolsuper,
      r.rolcreaterole,
      r.rolbypassrls,
      r.rolreplication,
      CASE WHEN r.rolname = p_role THEN quote_ident(p_role)
           ELSE format('%s, through %s', quote_ident(p_role), quote_ident(r.rolname)) END AS label
    FROM pg_roles r
    WHERE pg_has_role(p_role, r.oid, 'MEMBER')
  ),
  relation_rights AS (
    SELECT w.label, q.relation, string_agg(k.privilege, ', ' ORDER BY k.n) AS privileges
    FROM who w
    CROSS JOIN tq_queue_relations() q
    CROSS JOIN (VALUES
      (1, 'INSERT', true), (2, 'UPDATE', true), (3, 'DELETE', false), (4, 'TRUNCATE', false),
      (5, 'REFERENCES', true), (6, 'TRIGGER', false)) AS k (n, privilege, by_column)
    WHERE q.relkind <> 'S'
      AND CASE WHEN k.by_column THEN has_any_column_privilege(w.oid, q.relation, k.privilege)
               ELSE has_table_privilege(w.oid, q.relation, k.privilege) END
    GROUP BY w.label, q.relation
  )
  SELECT format('%s has %s', w.label, a.attribute)
  FROM who w
  CROSS JOIN LATERAL (VALUES
    (1, w.rolsuper, 'SUPERUSER: it may do anything'),
    (2, w.rolcreaterole, 'CREATEROLE: it may make itself a member of pg_write_all_data'),
    (3, w.rolbypassrls, 'BYPASSRLS'),
    (4, w.rolreplication, 'REPLICATION: it may stream the database''s every row')) AS a (n, held, attribute)
  WHERE a.held
  UNION ALL
  SELECT format('%s is a member of %s', quote_ident(p_role), p.why)
  FROM who w
  JOIN (VALUES
    ('pg_write_all_data', 'pg_write_all_data: it may write every table'),
    ('pg_execute_server_program', 'pg_execute_server_program: it may run programs as the server (COPY ... PROGRAM)'),
    ('pg_write_server_files', 'pg_write_server_files: it may write the server''s files'),
    ('pg_read_server_files', 'pg_read_server_files: it may read the server''s files, its data directory''s among them'),
    ('pg_signal_backend', 'pg_signal_backend: it may end other workers'' sessions (and so take their tasks) and the admin''s')
  ) AS p (rolname, why) ON p.rolname = w.rolname
  UNION ALL
  -- One line per role: the rights and the relations they cover, the first few named.
  SELECT format('%s may %s %s of the queue''s tables directly (%s)',
           x.label, x.privileges, count(*),
           string_agg(x.relation::TEXT, ', ' ORDER BY x.relation::TEXT) FILTER (WHERE x.n <= 4)
             || CASE WHEN count(*) > 4 THEN ', ...' ELSE '' END)
  FROM (
    SELECT r.*, row_number() OVER (PARTITION BY r.label, r.privileges ORDER BY r.relation::TEXT) AS n
    FROM relation_rights r
  ) x
  GROUP BY x.label, x.privileges
  UNION ALL
  SELECT format('%s may set %s of the queue''s sequences (setval: %s)', w.label, count(*),
           string_agg(q.relation::TEXT, ', ' ORDER BY q.relation::TEXT))
  FROM who w
  CROSS JOIN tq_queue_relations() q
  WHERE q.relkind = 'S'
    AND has_sequence_privilege(w.oid, q.relation, 'UPDATE')
  GROUP BY w.label
  UNION ALL
  SELECT format('%s may CREATE in schema %s, where a function of its own could stand in for a helper '
                'the queue''s functions call', w.label, quote_ident(current_schema()))
  FROM who w
  WHERE has_schema_privilege(w.oid, current_schema(), 'CREATE')
$$ LANGUAGE sql STABLE;

-- As in 0010, and refused for a worker that could write the queue by another route, or while the
-- queue's functions run as a superuser.
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
    WHERE q.is_api AND NOT q.is_trigger
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
