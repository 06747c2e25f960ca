-- The shape of the public schema, read from pg_catalog (see tq_pipelines/db/schema.py). Two
-- databases with equal answers have the same schema. The answers name objects, never OIDs, and
-- every query orders all its rows (in the "C" collation, so that the database's own collation
-- does not matter). The migration runner's tq_migrations table and the members of extensions
-- are left out: neither is the queue's schema. Run after catalog_session, in one transaction.

-- name: catalog_session
-- Every name that pg_get_*def prints comes out schema-qualified, whatever the caller's
-- search_path; local to the snapshot's transaction.
SELECT pg_catalog.set_config('search_path', '', true);

-- name: catalog_relations
-- Tables, views, sequences, composite types: what they are, not what they hold.
SELECT
  c.relname::TEXT AS relation,
  c.relkind::TEXT AS kind,
  c.relpersistence::TEXT AS persistence,
  am.amname::TEXT AS access_method,
  c.reloptions::TEXT AS options,
  c.relrowsecurity AS row_security,
  c.relforcerowsecurity AS force_row_security,
  pg_get_partkeydef(c.oid) AS partition_key,
  pg_get_expr(c.relpartbound, c.oid) AS partition_bound,
  (SELECT string_agg(p.relname, ', ' ORDER BY p.relname COLLATE "C")
   FROM pg_inherits i
   JOIN pg_class p ON p.oid = i.inhparent
   WHERE i.inhrelid = c.oid) AS parents
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_am am ON am.oid = c.relam AND c.relkind IN ('r', 'p', 'm')
WHERE n.nspname = 'public'
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S', 'c')
  AND c.relname <> 'tq_migrations'
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend d
    WHERE d.classid = 'pg_class'::REGCLASS AND d.objid = c.oid AND d.deptype = 'e'
  )
ORDER BY c.relname COLLATE "C";

-- name: catalog_columns
-- Columns of tables, views and composite types. position counts live columns only, so that a
-- column dropped long ago does not make two equal tables differ.
SELECT
  c.relname::TEXT AS relation,
  row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
  a.attname::TEXT AS column_name,
  format_type(a.atttypid, a.atttypmod) AS data_type,
  a.attnotnull AS not_null,
  CASE WHEN a.attgenerated = '' THEN pg_get_expr(d.adbin, d.adrelid) END AS default_expr,
  CASE WHEN a.attgenerated <> '' THEN pg_get_expr(d.adbin, d.adrelid) END AS generated_expr,
  a.attgenerated::TEXT AS generated_kind,
  a.attidentity::TEXT AS identity,
  CASE WHEN a.attcollation <> t.typcollation THEN co.collname::TEXT END AS collation
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE n.nspname = 'public'
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
  AND c.relname <> 'tq_migrations'
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend e
    WHERE e.classid = 'pg_class'::REGCLASS AND e.objid = c.oid AND e.deptype = 'e'
  )
ORDER BY c.relname COLLATE "C", a.attnum;

-- name: catalog_constraints
-- Constraints of tables and domains. PostgreSQL 18 also lists NOT NULL as constraints (contype
-- 'n'); columns.not_null says the same on every version, so those are left out.
SELECT
  coalesce(r.relname, ty.typname)::TEXT AS owner,
  con.conname::TEXT AS constraint_name,
  con.contype::TEXT AS kind,
  pg_get_constraintdef(con.oid) AS definition
FROM pg_constraint con
JOIN pg_namespace n ON n.oid = con.connamespace
LEFT JOIN pg_class r ON r.oid = con.conrelid
LEFT JOIN pg_type ty ON ty.oid = con.contypid
WHERE n.nspname = 'public'
  AND con.contype <> 'n'
  AND r.relname IS DISTINCT FROM 'tq_migrations'
ORDER BY coalesce(r.relname, ty.typname) COLLATE "C", con.conname COLLATE "C";

-- name: catalog_indexes
SELECT
  t.relname::TEXT AS relation,
  i.relname::TEXT AS index_name,
  pg_get_indexdef(x.indexrelid) AS definition,
  x.indisclustered AS clustered,
  x.indisreplident AS replica_identity
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = 'public'
  AND t.relname <> 'tq_migrations'
ORDER BY t.relname COLLATE "C", i.relname COLLATE "C";

-- name: catalog_views
SELECT
  c.relname::TEXT AS view_name,
  c.relkind::TEXT AS kind,
  pg_get_viewdef(c.oid, true) AS definition
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public'
  AND c.relkind IN ('v', 'm')
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend d
    WHERE d.classid = 'pg_class'::REGCLASS AND d.objid = c.oid AND d.deptype = 'e'
  )
ORDER BY c.relname COLLATE "C";

-- name: catalog_functions
-- pg_get_functiondef has the body verbatim and every attribute (language, volatility, strictness,
-- security, SET options); it refuses aggregates, which keep only their signature here.
SELECT
  p.proname::TEXT AS function_name,
  pg_get_function_identity_arguments(p.oid) AS arguments,
  p.prokind::TEXT AS kind,
  pg_get_function_result(p.oid) AS result,
  CASE WHEN p.prokind <> 'a' THEN pg_get_functiondef(p.oid) END AS definition
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend d
    WHERE d.classid = 'pg_proc'::REGCLASS AND d.objid = p.oid AND d.deptype = 'e'
  )
ORDER BY p.proname COLLATE "C", pg_get_function_identity_arguments(p.oid) COLLATE "C";

-- name: catalog_triggers
-- Internal triggers (those behind foreign keys) are the constraints' business.
SELECT
  c.relname::TEXT AS relation,
  tg.tgname::TEXT AS trigger_name,
  pg_get_triggerdef(tg.oid) AS definition,
  tg.tgenabled::TEXT AS enabled
FROM pg_trigger tg
JOIN pg_class c ON c.oid = tg.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public'
  AND NOT tg.tgisinternal
  AND c.relname <> 'tq_migrations'
ORDER BY c.relname COLLATE "C", tg.tgname COLLATE "C";

-- name: catalog_sequences
-- Parameters and owner, not the current value (that is data).
SELECT
  c.relname::TEXT AS sequence_name,
  format_type(s.seqtypid, NULL) AS data_type,
  s.seqstart AS start_value,
  s.seqincrement AS increment,
  s.seqmin AS min_value,
  s.seqmax AS max_value,
  s.seqcache AS cache,
  s.seqcycle AS cycle,
  owner_table.relname::TEXT AS owned_by_table,
  owner_column.attname::TEXT AS owned_by_column,
  dep.deptype::TEXT AS ownership
FROM pg_sequence s
JOIN pg_class c ON c.oid = s.seqrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_depend dep
  ON dep.classid = 'pg_class'::REGCLASS
  AND dep.objid = c.oid
  AND dep.refclassid = 'pg_class'::REGCLASS
  AND dep.refobjsubid > 0
  AND dep.deptype IN ('a', 'i')
LEFT JOIN pg_class owner_table ON owner_table.oid = dep.refobjid
LEFT JOIN pg_attribute owner_column
  ON owner_column.attrelid = dep.refobjid AND owner_column.attnum = dep.refobjsubid
WHERE n.nspname = 'public'
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend e
    WHERE e.classid = 'pg_class'::REGCLASS AND e.objid = c.oid AND e.deptype = 'e'
  )
ORDER BY c.relname COLLATE "C";

-- name: catalog_types
-- Enums, domains, ranges and base types defined in the schema. Row types of tables, array types
-- and multiranges come with their owner and are left out.
SELECT
  t.typname::TEXT AS type_name,
  t.typtype::TEXT AS kind,
  CASE t.typtype
    WHEN 'e' THEN (
      SELECT string_agg(quote_literal(e.enumlabel), ', ' ORDER BY e.enumsortorder)
      FROM pg_enum e
      WHERE e.enumtypid = t.oid
    )
    WHEN 'd' THEN format_type(t.typbasetype, t.typtypmod)
    WHEN 'r' THEN (
      SELECT format_type(r.rngsubtype, NULL)
      FROM pg_range r
      WHERE r.rngtypid = t.oid
    )
  END AS definition,
  t.typnotnull AS not_null,
  t.typdefault AS default_expr
FROM pg_type t
JOIN pg_namespace n ON n.oid = t.typnamespace
LEFT JOIN pg_class c ON c.oid = t.typrelid
WHERE n.nspname = 'public'
  AND (t.typrelid = 0 OR c.relkind = 'c')
  AND NOT EXISTS (SELECT 1 FROM pg_type elem WHERE elem.typarray = t.oid)
  AND NOT EXISTS (SELECT 1 FROM pg_range mr WHERE mr.rngmultitypid = t.oid)
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend d
    WHERE d.classid = 'pg_type'::REGCLASS AND d.objid = t.oid AND d.deptype = 'e'
  )
ORDER BY t.typname COLLATE "C";

-- name: catalog_extensions
-- Name and schema only: the version is the server's business.
SELECT
  e.extname::TEXT AS extension_name,
  n.nspname::TEXT AS schema_name
FROM pg_extension e
JOIN pg_namespace n ON n.oid = e.extnamespace
ORDER BY e.extname COLLATE "C";

-- name: catalog_comments
-- COMMENT ON anything in the schema, named by pg_identify_object (for example "table column",
-- "public.worker_tasks.role").
SELECT
  o.type AS object_type,
  o.identity AS object_name,
  d.description
FROM pg_description d
CROSS JOIN LATERAL pg_identify_object(d.classoid, d.objoid, d.objsubid) AS o
WHERE o.schema = 'public'
  AND o.identity NOT LIKE 'public.tq\_migrations%'
  AND o.identity NOT LIKE '% on public.tq\_migrations'
  AND NOT EXISTS (
    SELECT 1 FROM pg_depend e
    WHERE e.classid = d.classoid AND e.objid = d.objoid AND e.deptype = 'e'
  )
ORDER BY o.type COLLATE "C", o.identity COLLATE "C", d.description COLLATE "C";

-- name: schema_scratch_create
-- A database to migrate and dump (tq_pipelines.db.schema); template0 has nothing that a site
-- may have added to template1.
CREATE DATABASE {name} TEMPLATE template0;

-- name: schema_scratch_drop
DROP DATABASE IF EXISTS {name} WITH (FORCE);
