-- Least privilege: the queue's functions are the worker's only way to change anything.
--
-- Two roles use the queue database (docs/DEPLOYMENT.md, "Roles and privileges"):
-- - the admin role runs `tq migrate` and `tq grant`: by default the role that migrates;
--   `tq grant --admin-role` makes a role of its own the owner of the queue's objects and gives
--   it CREATE in the schema (no superuser: the queue's functions run with the owner's rights);
-- - the worker role (`tq grant --worker-role`: Dagster's code location, its drain runs, schedules
--   and sensors, any Worker) reads the queue and calls its functions, and nothing else: it
--   cannot set a task's status by hand, write worker_task_roles or the platforms' settings, nor
--   DROP, TRUNCATE, ALTER or CREATE anything.
--
-- The queue may share its database, and its schema, with another application (an adopted
-- database): everything here acts on the queue's own objects only, named in two registries, and
-- leaves every other object of the schema as it is (owner, SECURITY, grants, PUBLIC's EXECUTE).
-- - tq_relations: the queue's tables and views (their indexes and sequences go with them), but
--   for those named tq_*, which are the queue's by their prefix.
-- - tq_api: the queue's functions not named tq_*. Each is SECURITY DEFINER, with its search_path
--   pinned to this schema and then pg_temp, so that nothing the caller makes (a temporary table
--   named worker_tasks, say) stands in for the queue's own objects; the worker may call it. A
--   trigger function listed there (update_worker_tasks_timestamp) stays as it is, and nobody but
--   its trigger calls it.
-- - tq_* functions are the queue's by their prefix: internal helpers and trigger functions. They
--   run with their caller's rights (the owner's, inside the queue's functions) and nobody else
--   may call them.
-- - PUBLIC holds nothing on the queue's relations and no EXECUTE on the queue's functions.
--
-- Rules for every later migration:
-- - one that adds an API function registers it and ends by securing it:
--     INSERT INTO tq_api (function_name) VALUES ('new_function') ON CONFLICT DO NOTHING;
--     CALL tq_secure_functions();
-- - one that creates or replaces any function ends with CALL tq_secure_functions(): CREATE OR
--   REPLACE FUNCTION resets SECURITY DEFINER and the search_path (the grants stay). A test fails
--   when a function of the schema not named tq_* is not SECURITY DEFINER, so an unregistered one
--   is caught;
-- - one that adds a table or view not named tq_* registers it:
--     INSERT INTO tq_relations (relation_name) VALUES ('new_table') ON CONFLICT DO NOTHING;
--   (and, if the worker reads it, adds it to tq_grant_worker's list).
-- Roles are cluster-wide, so no migration creates them: `tq grant` (tq_pipelines/db/grant.py)
-- does, calling tq_grant_admin and tq_grant_worker below. It is idempotent; run it again after a
-- migration that adds a function.

------------------------------------------------------------------------------------------------
-- The registries: what is the queue's, by name.
------------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS tq_relations (
  -- Those named tq_* are the queue's by their name (tq_migrations, the runner's, among them).
  relation_name TEXT PRIMARY KEY
    CHECK (relation_name NOT LIKE 'tq\_%')
);
COMMENT ON TABLE tq_relations IS
  'The queue''s tables and views (but tq_*, the queue''s by name): owned by its admin, closed to PUBLIC';

INSERT INTO tq_relations (relation_name) VALUES
  ('worker_tasks'), ('worker_task_roles'), ('worker_task_heads'), ('worker_task_stores'),
  ('worker_registry'), ('task_completion_log'),
  ('dispensaries'), ('products'), ('product_history'), ('store_analytics'), ('store_crawl_state'),
  ('v_worker_capacity'), ('v_platform_status'), ('v_store_freshness'), ('v_task_history')
ON CONFLICT (relation_name) DO NOTHING;

CREATE TABLE IF NOT EXISTS tq_api (
  -- Every overload of the name is the queue's.
  function_name TEXT PRIMARY KEY
    CHECK (function_name NOT LIKE 'tq\_%')
);
COMMENT ON TABLE tq_api IS
  'The queue''s functions not named tq_*: SECURITY DEFINER, search_path pinned, callable by its worker';

-- Those of 0001..0010 (a name whose function this database lacks is harmless).
INSERT INTO tq_api (function_name) VALUES
  ('cancel_task'), ('claim_task'), ('claim_tasks'), ('claim_wait'), ('complete_task'),
  ('complete_task_tx'), ('complete_tasks'), ('complete_tasks_timed'), ('defer_task'),
  ('deregister_worker'), ('enqueue_demo_resyncs'), ('enqueue_task'), ('enqueue_task_once'),
  ('expire_leases'), ('fail_task'), ('generate_resync_tasks'), ('heartbeat_tasks'),
  ('mark_store_gone'), ('platform_answered'), ('platform_error'), ('platform_release'),
  ('platform_request'), ('prune_completion_log'), ('prune_product_history'), ('prune_tasks'),
  ('prune_workers'), ('recover_stale_tasks'), ('recover_stale_tasks_report'),
  ('refresh_store_analytics'), ('refresh_task_completion_log'), ('register_worker'),
  ('repair_platform_counters'), ('save_entry_point'), ('start_task'), ('start_tasks'),
  ('store_menu'), ('sync_platform_limits'), ('task_still_owned'), ('upsert_listed_stores'),
  ('worker_completed'),
  -- the trigger function of worker_tasks.updated_at (0002): the queue's, never anybody's to call
  ('update_worker_tasks_timestamp')
ON CONFLICT (function_name) DO NOTHING;

-- The queue's relations in the current schema: those named tq_* and the registered ones, and
-- the sequences their columns own. Not an extension's.
CREATE OR REPLACE FUNCTION tq_queue_relations()
RETURNS TABLE (relation REGCLASS, relkind "char") AS $$
  WITH own AS (
    SELECT c.oid, c.relkind
    FROM pg_class c
    WHERE c.relnamespace = current_schema()::REGNAMESPACE
      AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND (c.relname LIKE 'tq\_%' OR EXISTS (SELECT 1 FROM tq_relations r WHERE r.relation_name = c.relname))
      AND NOT EXISTS (
        SELECT 1 FROM pg_depend e
        WHERE e.classid = 'pg_class'::REGCLASS AND e.objid = c.oid AND e.deptype = 'e')
  )
  SELECT o.oid::REGCLASS, o.relkind FROM own o
  UNION ALL
  SELECT s.oid::REGCLASS, s.relkind
  FROM pg_class s
  JOIN pg_depend d
    ON d.classid = 'pg_class'::REGCLASS AND d.objid = s.oid AND d.deptype IN ('a', 'i')
   AND d.refclassid = 'pg_class'::REGCLASS
  JOIN own o ON o.oid = d.refobjid
  WHERE s.relkind = 'S'
$$ LANGUAGE sql STABLE;

-- The queue's functions and procedures in the current schema: every overload of a registered
-- name, and those named tq_*; is_api for the registered ones. Not an extension's.
CREATE OR REPLACE FUNCTION tq_queue_functions()
RETURNS TABLE (signature REGPROCEDURE, prokind "char", is_api BOOLEAN, is_trigger BOOLEAN) AS $$
  SELECT
    p.oid::REGPROCEDURE,
    p.prokind,
    EXISTS (SELECT 1 FROM tq_api a WHERE a.function_name = p.proname),
    p.prorettype = 'trigger'::REGTYPE
  FROM pg_proc p
  WHERE p.pronamespace = current_schema()::REGNAMESPACE
    AND p.prokind IN ('f', 'p')
    AND (p.proname LIKE 'tq\_%' OR EXISTS (SELECT 1 FROM tq_api a WHERE a.function_name = p.proname))
    AND NOT EXISTS (
      SELECT 1 FROM pg_depend e
      WHERE e.classid = 'pg_proc'::REGCLASS AND e.objid = p.oid AND e.deptype = 'e')
  ORDER BY p.oid
$$ LANGUAGE sql STABLE;

------------------------------------------------------------------------------------------------
-- The handlers' writes that were plain statements become functions: the worker has no INSERT,
-- UPDATE or DELETE on any table.
------------------------------------------------------------------------------------------------

-- entry_point_discovery: the store's platform id and menu URL. A store that resolves is not gone:
-- if it was marked so, crawling is switched back on (a store disabled by hand, with no gone_at,
-- stays disabled).
CREATE OR REPLACE FUNCTION save_entry_point(
  p_dispensary_id INTEGER,
  p_platform VARCHAR,
  p_platform_id TEXT,
  p_menu_url TEXT
) RETURNS VOID AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM dispensaries d WHERE d.id = p_dispensary_id) THEN
    RAISE EXCEPTION 'save_entry_point: dispensary_id must be a store of dispensaries, got %',
      coalesce(p_dispensary_id::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the id of the store whose entry point was resolved.';
  END IF;
  IF p_platform IS NULL OR btrim(p_platform) = '' OR length(p_platform) > 50 THEN
    -- As tq_refuse words it (0008), raised here so that 0010 needs no other migration.
    RAISE EXCEPTION 'save_entry_point: platform %, got %',
      CASE WHEN length(p_platform) > 50 THEN 'must be at most 50 characters' ELSE 'must not be empty' END,
      CASE WHEN p_platform IS NULL THEN 'NULL'
           WHEN length(p_platform) > 40
             THEN quote_literal(left(p_platform, 40)) || format('... (%s characters)', length(p_platform))
           ELSE quote_literal(p_platform) END
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'The store''s platform: a name of 1 to 50 characters (dispensaries.menu_type).';
  END IF;
  WITH old AS (
    SELECT c.gone_at FROM store_crawl_state c WHERE c.dispensary_id = p_dispensary_id
  ),
  state AS (
    INSERT INTO store_crawl_state (dispensary_id, platform, menu_url, resolved_at)
    VALUES (p_dispensary_id, p_platform, p_menu_url, now())
    ON CONFLICT (dispensary_id) DO UPDATE
    SET menu_url = excluded.menu_url, resolved_at = now(), gone_at = NULL
  )
  UPDATE dispensaries
  SET platform_dispensary_id = p_platform_id,
      crawl_enabled = crawl_enabled OR EXISTS (SELECT 1 FROM old WHERE old.gone_at IS NOT NULL)
  WHERE id = p_dispensary_id;
END;
$$ LANGUAGE plpgsql;

-- The platform says the store is gone: no more crawls until a listing names it again.
CREATE OR REPLACE FUNCTION mark_store_gone(p_dispensary_id INTEGER, p_platform VARCHAR)
RETURNS VOID AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM dispensaries d WHERE d.id = p_dispensary_id) THEN
    RAISE EXCEPTION 'mark_store_gone: dispensary_id must be a store of dispensaries, got %',
      coalesce(p_dispensary_id::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the id of the store the platform no longer has.';
  END IF;
  IF p_platform IS NULL OR btrim(p_platform) = '' OR length(p_platform) > 50 THEN
    -- As tq_refuse words it (0008), raised here so that 0010 needs no other migration.
    RAISE EXCEPTION 'mark_store_gone: platform %, got %',
      CASE WHEN length(p_platform) > 50 THEN 'must be at most 50 characters' ELSE 'must not be empty' END,
      CASE WHEN p_platform IS NULL THEN 'NULL'
           WHEN length(p_platform) > 40
             THEN quote_literal(left(p_platform, 40)) || format('... (%s characters)', length(p_platform))
           ELSE quote_literal(p_platform) END
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'The store''s platform: a name of 1 to 50 characters (dispensaries.menu_type).';
  END IF;
  WITH state AS (
    INSERT INTO store_crawl_state (dispensary_id, platform, gone_at)
    VALUES (p_dispensary_id, p_platform, now())
    ON CONFLICT (dispensary_id) DO UPDATE SET gone_at = now()
  )
  UPDATE dispensaries SET crawl_enabled = false
  WHERE id = p_dispensary_id;
END;
$$ LANGUAGE plpgsql;

-- Taken by a handler in the transaction that writes its results: the row lock holds off recovery
-- until the commit, and no row means the lease is gone and nothing must be written. A function
-- because SELECT ... FOR SHARE needs UPDATE rights on the table, which the worker must not have;
-- the lock is the transaction's, so it outlives the call.
CREATE OR REPLACE FUNCTION task_still_owned(p_task_id INTEGER, p_worker_id VARCHAR)
RETURNS TABLE (owned INTEGER) AS $$
  SELECT 1
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.worker_id = p_worker_id
    AND t.status IN ('claimed', 'running')
  FOR SHARE;
$$ LANGUAGE sql;

-- The demo's crawl schedule: a product_resync for every crawlable store without one pending or
-- running, the platforms in turn a millisecond apart (as generate_resync_tasks opens a batch).
-- One row per task created, so that the caller's row count is the number created.
CREATE OR REPLACE FUNCTION enqueue_demo_resyncs() RETURNS SETOF INTEGER AS $$
  INSERT INTO worker_tasks (role, dispensary_id, platform, scheduled_for)
  SELECT
    'product_resync',
    s.id,
    s.menu_type,
    now() + (row_number() OVER (ORDER BY s.turn, s.menu_type, s.id) - 1) * INTERVAL '1 millisecond'
  FROM (
    SELECT d.id, d.menu_type, row_number() OVER (PARTITION BY d.menu_type ORDER BY d.id) AS turn
    FROM dispensaries d
    WHERE d.crawl_enabled
      AND d.platform_dispensary_id IS NOT NULL
      AND NOT EXISTS (
        SELECT 1
        FROM worker_tasks t
        WHERE t.dispensary_id = d.id
          AND t.role = 'product_resync'
          AND t.status IN ('pending', 'claimed', 'running'))
  ) s
  ORDER BY s.turn, s.menu_type, s.id
  RETURNING id;
$$ LANGUAGE sql;

------------------------------------------------------------------------------------------------
-- The hardening, applied to the queue's functions (tq_queue_functions): by this migration, and by
-- every later one that creates or replaces a function (CALL tq_secure_functions(); as its last
-- statement). Other functions of the schema are left as they are.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE PROCEDURE tq_secure_functions() AS $$
DECLARE
  -- The schema the migration runs in, then pg_temp: a caller's temporary objects come last.
  v_path TEXT := format('%I, pg_temp', current_schema());
  v_kind TEXT;
  f RECORD;
BEGIN
  IF current_schema() IS NULL THEN
    RAISE EXCEPTION 'tq_secure_functions: no schema to secure: the search_path names none that exists'
      USING ERRCODE = 'invalid_schema_name',
            HINT = 'Call it in the session that migrates, whose search_path starts with the queue''s schema.';
  END IF;
  FOR f IN
    SELECT
      q.signature,
      q.prokind,
      q.is_api AND NOT q.is_trigger AS hardened,
      p.prosecdef AND ('search_path=' || v_path) = ANY (coalesce(p.proconfig, '{}')) AS is_secured
    FROM tq_queue_functions() q
    JOIN pg_proc p ON p.oid = q.signature
  LOOP
    v_kind := CASE f.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END;
    EXECUTE format('REVOKE EXECUTE ON %s %s FROM PUBLIC', v_kind, f.signature);
    IF f.hardened AND NOT f.is_secured THEN
      -- SET adds to the function's other settings (claim_tasks' plan_cache_mode stays).
      EXECUTE format('ALTER %s %s SECURITY DEFINER SET search_path = %s', v_kind, f.signature, v_path);
    END IF;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- What `tq grant` gives each role, in this database. Run by a superuser or the owner.
------------------------------------------------------------------------------------------------

-- The admin role owns the queue's relations and functions (the queue's functions then run with
-- its rights) and may create in the schema: later migrations run as it. The schema's owner, and
-- every object of the schema that is not the queue's, stay as they are.
CREATE OR REPLACE PROCEDURE tq_grant_admin(p_role NAME) AS $$
DECLARE
  v_schema TEXT := current_schema();
  v_statements TEXT[];
  v_statement TEXT;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_admin: role % does not exist', quote_ident(p_role)
      USING ERRCODE = 'undefined_object', HINT = 'Create it first (tq grant does).';
  END IF;
  IF (SELECT rolsuper FROM pg_roles WHERE rolname = p_role) THEN
    RAISE EXCEPTION 'tq_grant_admin: admin role % is a superuser', quote_ident(p_role)
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'The queue''s functions run with their owner''s rights: give them a role of its own, without SUPERUSER.';
  END IF;
  EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO %I', current_database(), p_role);
  EXECUTE format('GRANT USAGE, CREATE ON SCHEMA %I TO %I', v_schema, p_role);
  -- Tables and views (their indexes and owned sequences go with them), then functions. Listed
  -- first: a registry cannot change owner while the query that reads it is open.
  SELECT array_agg(x.statement) INTO v_statements
  FROM (
    SELECT format('ALTER %s %s OWNER TO %I',
             CASE q.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                            WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
             q.relation, p_role) AS statement
    FROM tq_queue_relations() q
    JOIN pg_class c ON c.oid = q.relation
    WHERE q.relkind <> 'S'
      AND c.relowner <> p_role::REGROLE
    UNION ALL
    SELECT format('ALTER %s %s OWNER TO %I',
             CASE q.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, q.signature, p_role)
    FROM tq_queue_functions() q
    JOIN pg_proc p ON p.oid = q.signature
    WHERE p.proowner <> p_role::REGROLE
  ) x;
  FOREACH v_statement IN ARRAY coalesce(v_statements, '{}') LOOP
    EXECUTE v_statement;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

-- The worker role: CONNECT, USAGE on the schema, SELECT on what the workers, jobs, sensors and
-- the asset read, EXECUTE on the queue's API (tq_api), nothing else. Whatever it held on the
-- queue's objects before is taken back first, so a second run after a change takes away what is
-- no longer given.
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
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- PUBLIC: nothing on the queue's relations, no CREATE in the schema (the default since
-- PostgreSQL 15, but a database upgraded from an older one keeps the old grant), no EXECUTE on
-- the queue's functions (tq_secure_functions below).
------------------------------------------------------------------------------------------------
DO $$
DECLARE
  r RECORD;
BEGIN
  FOR r IN SELECT q.relation, q.relkind FROM tq_queue_relations() q LOOP
    EXECUTE format('REVOKE ALL ON %s %s FROM PUBLIC',
      CASE r.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, r.relation);
  END LOOP;
  -- Only the schema's owner may; a migrator that is not leaves it to them (with a warning).
  IF pg_has_role((SELECT nspowner FROM pg_namespace WHERE nspname = current_schema()), 'USAGE') THEN
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', current_schema());
  ELSE
    RAISE WARNING 'CREATE on schema % is the owner''s to revoke from PUBLIC', current_schema();
  END IF;
END;
$$;

CALL tq_secure_functions();
