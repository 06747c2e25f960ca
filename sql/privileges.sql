-- Roles and privileges (tq_pipelines/db/grant.py, `tq grant`). What each role may do in the
-- database is migration 0010's (tq_grant_admin, tq_grant_worker, tq_secure_functions) and 0012's
-- (tq_worker_write_routes); these statements create the roles, which are cluster-wide, set the
-- worker's timeouts, and call those procedures.
-- {role} is a psycopg.sql.Identifier and {password} a psycopg.sql.Literal holding a SCRAM
-- verifier made by libpq: role statements take no bound parameters, and the password itself
-- never reaches the server (nor its log).

-- name: privileges_migrated
-- 0010 applied: the procedures below exist.
SELECT to_regprocedure('tq_grant_worker(name)') IS NOT NULL AS migrated;

-- name: role_attributes
SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls, rolcanlogin
FROM pg_roles
WHERE rolname = %(role)s;

-- name: create_login_role
-- No attribute but LOGIN: NOSUPERUSER, NOCREATEDB, NOCREATEROLE, NOREPLICATION, NOBYPASSRLS
-- are the defaults.
CREATE ROLE {role} LOGIN;

-- name: allow_login
ALTER ROLE {role} LOGIN;

-- name: set_role_password
ALTER ROLE {role} PASSWORD {password};

-- name: grant_admin
CALL tq_grant_admin(%(role)s);

-- name: secure_functions
CALL tq_secure_functions();

-- name: grant_worker
CALL tq_grant_worker(%(role)s);

-- name: worker_privileges
-- What the role now holds on the queue's objects: relations it may read, functions it may call,
-- and anything else (none, after tq_grant_worker).
SELECT
  (SELECT count(*)
   FROM tq_queue_relations() q
   WHERE q.relkind <> 'S'
     AND has_table_privilege(%(role)s, q.relation, 'SELECT')) AS readable,
  (SELECT count(*)
   FROM tq_queue_relations() q
   WHERE q.relkind <> 'S'
     AND has_table_privilege(%(role)s, q.relation, 'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER'))
    AS writable,
  (SELECT count(*)
   FROM tq_queue_functions() q
   WHERE has_function_privilege(%(role)s, q.signature, 'EXECUTE')) AS callable;

-- name: function_owners
-- Who the queue's SECURITY DEFINER functions run as.
SELECT DISTINCT r.rolname::TEXT AS owner, r.rolsuper AS superuser
FROM tq_queue_functions() q
JOIN pg_proc p ON p.oid = q.signature
JOIN pg_roles r ON r.oid = p.proowner
WHERE p.prosecdef
ORDER BY 1;

-- name: worker_routes
-- Every way the role could change the queue other than through its functions (0012); none for
-- a worker as tq grant leaves it.
SELECT route FROM tq_worker_write_routes(%(role)s);

-- name: routes_migrated
-- 0012 applied: tq_worker_write_routes exists.
SELECT to_regprocedure('tq_worker_write_routes(name)') IS NOT NULL AS migrated;

-- name: current_database
SELECT current_database() AS name, current_user AS user_name;

-- name: worker_settings
-- The role's own defaults (ALTER ROLE ... SET) that apply in this database: this database's
-- (in_database) and every database's. Readable by every role, as PostgreSQL keeps them.
SELECT
  s.setdatabase <> 0 AS in_database,
  split_part(c.setting, '=', 1) AS name,
  substr(c.setting, strpos(c.setting, '=') + 1) AS value
FROM pg_db_role_setting s
CROSS JOIN LATERAL unnest(s.setconfig) AS c (setting)
WHERE s.setrole = (SELECT r.oid FROM pg_roles r WHERE r.rolname = %(role)s)
  AND s.setdatabase IN (0, (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))
ORDER BY 1 DESC, 2;

-- name: set_worker_setting
-- {name} is a psycopg.sql.Identifier, {value} a psycopg.sql.Literal: ALTER ROLE takes no bound
-- parameters. In the queue's database only: the role may also reach Dagster's storage.
ALTER ROLE {role} IN DATABASE {database} SET {name} = {value};

-- name: reset_worker_setting_in_database
ALTER ROLE {role} IN DATABASE {database} RESET {name};

-- name: reset_worker_setting
ALTER ROLE {role} RESET {name};
