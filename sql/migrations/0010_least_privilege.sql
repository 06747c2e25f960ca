-- Least privilege: the queue's functions are the worker's only way to change anything.
--
-- Two roles use the queue database (docs/DEPLOYMENT.md, "Roles and privileges"):
-- - the admin role owns the schema and runs `tq migrate` and `tq grant`: by default the role that
--   migrates; `tq grant --admin-role` makes a role of its own the owner of everything here (no
--   superuser: the queue's functions run with the owner's rights);
-- - the worker role (`tq grant --worker-role`: Dagster's code location, its drain runs, schedules
--   and sensors, any Worker) reads the queue and calls its functions, and nothing else: it
--   cannot set a task's status by hand, write worker_task_roles or the platforms' settings, nor
--   DROP, TRUNCATE, ALTER or CREATE anything.
--
-- Which function is what, by name:
-- - tq_* functions are internal helpers and trigger functions. They run with their caller's
--   rights (the owner's, inside the queue's functions) and nobody else may call them.
-- - Every other function is the queue's API: SECURITY DEFINER, with its search_path pinned to
--   this schema and then pg_temp, so that nothing the caller makes (a temporary table named
--   worker_tasks, say) stands in for the queue's own objects.
-- - EXECUTE is revoked from PUBLIC on every function, and PUBLIC holds nothing on the tables.
--
-- CREATE OR REPLACE FUNCTION resets SECURITY DEFINER and the search_path (the grants stay): every
-- later migration that creates or replaces a function ends with CALL tq_secure_functions(); a
-- test fails when one does not. Roles are cluster-wide, so no migration creates them: `tq grant`
-- (tq_pipelines/db/grant.py) does, calling tq_grant_admin and tq_grant_worker below. It is
-- idempotent; run it again after a migration that adds a function.

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
-- The hardening, applied to every function of the schema: by this migration, and by every later
-- one that creates or replaces a function (CALL tq_secure_functions(); as its last statement).
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
      p.oid::REGPROCEDURE AS signature,
      p.prokind,
      p.prorettype = 'trigger'::REGTYPE AS is_trigger,
      p.proname NOT LIKE 'tq\_%' AS is_api,
      p.prosecdef AND ('search_path=' || v_path) = ANY (coalesce(p.proconfig, '{}')) AS is_secured
    FROM pg_proc p
    WHERE p.pronamespace = current_schema()::REGNAMESPACE
      AND p.prokind IN ('f', 'p')
      AND NOT EXISTS (
        SELECT 1 FROM pg_depend d
        WHERE d.classid = 'pg_proc'::REGCLASS AND d.objid = p.oid AND d.deptype = 'e'
      )
    ORDER BY p.oid
  LOOP
    v_kind := CASE f.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END;
    EXECUTE format('REVOKE EXECUTE ON %s %s FROM PUBLIC', v_kind, f.signature);
    IF f.is_api AND NOT f.is_trigger AND NOT f.is_secured THEN
      -- SET adds to the function's other settings (claim_tasks' plan_cache_mode stays).
      EXECUTE format('ALTER %s %s SECURITY DEFINER SET search_path = %s', v_kind, f.signature, v_path);
    END IF;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- What `tq grant` gives each role, in this database. Run by a superuser or the owner.
------------------------------------------------------------------------------------------------

-- The admin role owns every object of the schema (the queue's functions then run with its
-- rights) and may create more: later migrations run as it.
CREATE OR REPLACE PROCEDURE tq_grant_admin(p_role NAME) AS $$
DECLARE
  v_schema TEXT := current_schema();
  r RECORD;
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
  -- public belongs to pg_database_owner: the admin creates in it; another schema is its own.
  IF (SELECT nspowner FROM pg_namespace WHERE nspname = v_schema) = 'pg_database_owner'::REGROLE THEN
    EXECUTE format('GRANT USAGE, CREATE ON SCHEMA %I TO %I', v_schema, p_role);
  ELSE
    EXECUTE format('ALTER SCHEMA %I OWNER TO %I', v_schema, p_role);
  END IF;
  -- Relations (a table's sequences and indexes go with it), functions and procedures, types.
  FOR r IN
    SELECT format('ALTER %s %I.%I OWNER TO %I',
             CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                            WHEN 'S' THEN 'SEQUENCE' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
             v_schema, c.relname, p_role) AS statement
    FROM pg_class c
    WHERE c.relnamespace = v_schema::REGNAMESPACE
      AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
      AND c.relowner <> p_role::REGROLE
      -- A sequence owned by a column follows its table.
      AND NOT (c.relkind = 'S' AND EXISTS (
        SELECT 1 FROM pg_depend d
        WHERE d.classid = 'pg_class'::REGCLASS AND d.objid = c.oid AND d.deptype IN ('a', 'i')
          AND d.refclassid = 'pg_class'::REGCLASS))
      AND NOT EXISTS (
        SELECT 1 FROM pg_depend e
        WHERE e.classid = 'pg_class'::REGCLASS AND e.objid = c.oid AND e.deptype = 'e')
    UNION ALL
    SELECT format('ALTER %s %s OWNER TO %I',
             CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE' ELSE 'FUNCTION' END,
             p.oid::REGPROCEDURE, p_role)
    FROM pg_proc p
    WHERE p.pronamespace = v_schema::REGNAMESPACE
      AND p.proowner <> p_role::REGROLE
      AND NOT EXISTS (
        SELECT 1 FROM pg_depend e
        WHERE e.classid = 'pg_proc'::REGCLASS AND e.objid = p.oid AND e.deptype = 'e')
    UNION ALL
    SELECT format('ALTER %s %I.%I OWNER TO %I',
             CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, v_schema, t.typname, p_role)
    FROM pg_type t
    LEFT JOIN pg_class c ON c.oid = t.typrelid
    WHERE t.typnamespace = v_schema::REGNAMESPACE
      AND t.typowner <> p_role::REGROLE
      AND (t.typrelid = 0 OR c.relkind = 'c')
      AND NOT EXISTS (SELECT 1 FROM pg_type elem WHERE elem.typarray = t.oid)
      AND NOT EXISTS (SELECT 1 FROM pg_range mr WHERE mr.rngmultitypid = t.oid)
      AND NOT EXISTS (
        SELECT 1 FROM pg_depend e
        WHERE e.classid = 'pg_type'::REGCLASS AND e.objid = t.oid AND e.deptype = 'e')
  LOOP
    EXECUTE r.statement;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

-- The worker role: CONNECT, USAGE on the schema, SELECT on what the workers, jobs, sensors and
-- the asset read, EXECUTE on the queue's API (its SECURITY DEFINER functions), nothing else.
-- Whatever it held before is taken back first, so a second run after a change takes away what
-- is no longer given.
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
    'tq_retention',         -- retention_watermark
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
  -- A role that is, or can become, an owner of the queue's objects has all their rights.
  SELECT o.owner::REGROLE::TEXT INTO v_owner
  FROM (
    SELECT c.relowner AS owner FROM pg_class c WHERE c.relnamespace = v_schema::REGNAMESPACE
    UNION
    SELECT p.proowner FROM pg_proc p WHERE p.pronamespace = v_schema::REGNAMESPACE
    UNION
    SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = v_schema AND n.nspname <> 'public'
  ) o
  WHERE pg_has_role(p_role, o.owner, 'MEMBER')
  LIMIT 1;
  IF v_owner IS NOT NULL THEN
    RAISE EXCEPTION 'tq_grant_worker: worker role % is, or is a member of, %, which owns objects of schema %',
      quote_ident(p_role), v_owner, v_schema
      USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Give the worker a role of its own, member of no role that owns the queue.';
  END IF;

  EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM %I', v_schema, p_role);
  EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM %I', v_schema, p_role);
  EXECUTE format('REVOKE ALL ON ALL ROUTINES IN SCHEMA %I FROM %I', v_schema, p_role);
  EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM %I', v_schema, p_role);
  -- PUBLIC has CONNECT unless the database's owner took it away; only the owner may give it.
  IF NOT has_database_privilege(p_role, current_database(), 'CONNECT') THEN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), p_role);
  END IF;
  EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
  FOR r IN
    SELECT c.relname
    FROM pg_class c
    WHERE c.relnamespace = v_schema::REGNAMESPACE
      AND c.relname = ANY (v_reads)
      AND c.relkind IN ('r', 'p', 'v', 'm')
    ORDER BY c.relname
  LOOP
    EXECUTE format('GRANT SELECT ON %I.%I TO %I', v_schema, r.relname, p_role);
  END LOOP;
  FOR r IN
    SELECT p.oid::REGPROCEDURE AS signature, p.prokind
    FROM pg_proc p
    WHERE p.pronamespace = v_schema::REGNAMESPACE
      AND p.prosecdef
    ORDER BY p.oid
  LOOP
    EXECUTE format('GRANT EXECUTE ON %s %s TO %I',
      CASE r.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, r.signature, p_role);
  END LOOP;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- PUBLIC: nothing on the tables, no CREATE in the schema (the default since PostgreSQL 15, but a
-- database upgraded from an older one keeps the old grant), no EXECUTE on any function.
------------------------------------------------------------------------------------------------
DO $$
BEGIN
  EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM PUBLIC', current_schema());
  EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM PUBLIC', current_schema());
  -- Only the schema's owner may; a migrator that is not leaves it to them (with a warning).
  IF pg_has_role((SELECT nspowner FROM pg_namespace WHERE nspname = current_schema()), 'USAGE') THEN
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', current_schema());
  ELSE
    RAISE WARNING 'CREATE on schema % is the owner''s to revoke from PUBLIC', current_schema();
  END IF;
END;
$$;

CALL tq_secure_functions();
