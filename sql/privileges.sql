-- Roles and privileges (tq_pipelines/db/grant.py, `tq grant`). What each role may do in the
-- database is migration 0010's (tq_grant_admin, tq_grant_worker, tq_secure_functions); these
-- statements create the roles, which are cluster-wide, and call those procedures.
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
