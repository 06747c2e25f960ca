-- Named statements called by tq_pipelines (see tq_pipelines/db/queries.py). Every statement is a
-- thin call of a function from sql/migrations, so that the rules live in one place: the database.

-- name: claim_tasks
-- Each task with its lease token (0013), the proof every later call on it presents.
SELECT (c.task).*, c.lease AS lease_token
FROM claim_tasks(%(role)s, %(worker_id)s, %(max_tasks)s, %(start)s) c;

-- name: start_task
SELECT start_task(%(task_id)s, %(lease)s) AS ok;

-- name: start_tasks
SELECT start_tasks(%(task_ids)s, %(leases)b::UUID[]) AS ids;

-- name: heartbeat_tasks
SELECT heartbeat_tasks(%(worker_id)s, %(task_ids)s, %(leases)b::UUID[]) AS ids;

-- name: complete_task
SELECT complete_task(%(task_id)s, %(lease)s, %(result)s) AS ok;

-- name: complete_task_tx
SELECT complete_task_tx(%(task_id)s, %(lease)s, %(result)s) AS ok;

-- name: worker_completed
SELECT worker_completed(%(worker_id)s, %(count)s);

-- name: complete_tasks
SELECT complete_tasks(%(task_ids)s, %(leases)b::UUID[], %(results)s::JSONB[]) AS ids;

-- name: complete_tasks_timed
SELECT complete_tasks_timed(
  %(task_ids)s, %(leases)b::UUID[], %(results)s::JSONB[], %(began)s::FLOAT8[], %(ended)s::FLOAT8[]
) AS ids;

-- name: fail_task
SELECT fail_task(%(task_id)s, %(lease)s, %(error)s, %(retryable)s, %(retry_after)s) AS status;

-- name: defer_task
SELECT defer_task(%(task_id)s, %(lease)s, %(delay)s) AS ok;

-- name: cancel_task
SELECT cancel_task(%(task_id)s) AS ok;

-- name: register_worker
SELECT register_worker(%(worker_id)s, %(role)s, %(pod_name)s, %(hostname)s, %(heartbeat_seconds)s::FLOAT8);

-- name: session_ping
-- A worker session's connection, checked at each heartbeat.
SELECT 1;

-- name: register_worker_session
-- On the worker's own connection: the registration, and the session lock that it holds while
-- the worker lives (0011).
SELECT register_worker_session(%(worker_id)s, %(role)s, %(pod_name)s, %(hostname)s,
                               %(heartbeat_seconds)s::FLOAT8) AS registry_id;

-- name: listen_slot_free
-- On the worker's session connection: slots other workers' shares give back (0032).
LISTEN tq_slot_free;

-- name: worker_sessions
SELECT worker_id, status, silent_seconds, heartbeat_seconds, session_alive
FROM worker_sessions(%(worker_ids)s);

-- name: release_dead_workers
SELECT workers, recovered, failed
FROM release_dead_workers(%(worker_ids)s);

-- name: deregister_worker
SELECT deregister_worker(%(worker_id)s) AS ok;

-- name: expire_leases
SELECT recovered, failed FROM expire_leases(%(intervals)s, 30, %(min_seconds)s);

-- name: recover_stale_tasks
SELECT recovered, failed, workers_offline
FROM recover_stale_tasks_report(%(threshold_minutes)s);

-- name: generate_resync_tasks
SELECT generate_resync_tasks(%(batches_per_day)s, %(day)s, %(platforms)s) AS created;

-- name: refresh_task_completion_log
SELECT refresh_task_completion_log(%(day)s, %(hour)s) AS rows;

-- name: completion_log_hour
SELECT role, tasks_created, tasks_completed, tasks_failed,
       avg_duration_sec, min_duration_sec, max_duration_sec
FROM task_completion_log
WHERE date = %(day)s
  AND hour = %(hour)s
ORDER BY role;

-- name: enqueue_task
-- One task, every argument checked by the database before it is written (migration 0008).
SELECT enqueue_task(
  %(role)s, %(dispensary_id)s, %(platform)s, %(priority)s, %(scheduled_for)s, %(max_retries)s,
  %(payload)s::JSONB
) AS id;

-- name: enqueue_task_once
SELECT enqueue_task_once(
  %(role)s, %(dispensary_id)s, %(platform)s, %(priority)s, %(scheduled_for)s, %(payload)s::JSONB
) AS id;

-- name: archive_tasks
-- Finished tasks out of the hot table, on the database's clock (migration 0022).
SELECT archive_tasks(now() - make_interval(secs => %(seconds)s), %(limit)s) AS moved;

-- name: get_task
-- In the queue or archived (v_tasks).
SELECT * FROM v_tasks WHERE id = %(task_id)s;

-- name: worker_capacity
SELECT * FROM v_worker_capacity ORDER BY role;

-- name: list_roles
SELECT role FROM worker_task_roles ORDER BY role;

-- name: stuck_tasks
-- Active tasks whose owner has been silent past the threshold: what recovery will give back.
SELECT count(*) AS stuck
FROM worker_tasks
WHERE id IN (
    SELECT id FROM worker_tasks WHERE status IN ('claimed', 'running') AND dispensary_id IS NOT NULL
    UNION ALL
    SELECT id FROM worker_tasks WHERE status IN ('claimed', 'running') AND dispensary_id IS NULL
  )
  AND coalesce(last_heartbeat_at, started_at, claimed_at, updated_at)
      < now() - make_interval(mins => %(threshold_minutes)s);

-- name: migrations_lock
-- One migrator at a time; a second waits here (a bounded wait: lock_timeout_set), then finds the
-- work done.
SELECT pg_advisory_lock(%(key)s);

-- name: migrations_unlock
SELECT pg_advisory_unlock(%(key)s);

-- name: lock_timeout_get
SELECT current_setting('lock_timeout') AS value;

-- name: lock_timeout_set
-- For this session: the migrator's bounded wait for its lock, then the setting as it was.
SELECT set_config('lock_timeout', %(value)s, false);

-- name: migrations_lock_holders
-- Who holds the migrators' lock: a one-key advisory lock shows in pg_locks as classid = the
-- key's high 32 bits, objid = its low 32 bits, objsubid = 1. pg_stat_activity shows another
-- role's session's times and state only to a superuser or pg_read_all_stats (NULL otherwise).
SELECT l.pid, a.usename::TEXT, a.application_name, a.backend_start, a.state, a.state_change
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
  AND l.classid = (%(key)s::BIGINT >> 32)::OID
  AND l.objid = (%(key)s::BIGINT & 4294967295)::OID
  AND l.objsubid = 1
  AND l.granted
ORDER BY l.pid;

-- name: migrations_table
CREATE TABLE IF NOT EXISTS tq_migrations (
  version TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  checksum TEXT NOT NULL,
  applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version, name, checksum FROM tq_migrations ORDER BY version;

-- name: migrations_record
INSERT INTO tq_migrations (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s);


-- name: database_exists
SELECT 1 FROM pg_database WHERE datname = %(name)s;

-- name: create_database
-- {name} is a psycopg.sql.Identifier: CREATE DATABASE takes no bound parameters.
CREATE DATABASE {name};

-- name: claimable_now
-- Per role: ready tasks, and how many a claim could take right now: idle stores with due work
-- and due store-less tasks, per platform no more than the platform has room for (none while it
-- is paused, one probe while half-open). Busy stores' tasks are ready but not claimable.
WITH room AS (
  SELECT
    l.platform,
    CASE
      WHEN l.paused_until > now() THEN 0
      WHEN l.pauses > 0 THEN
        CASE WHEN l.probe_task_id IS NULL AND l.in_flight + h.held < l.max_in_flight THEN 1 ELSE 0 END
      ELSE greatest(l.max_in_flight - l.in_flight - h.held, 0)
    END AS free
  FROM tq_platforms l
  -- Slots held after a timeout (0016) are taken as tasks' are.
  CROSS JOIN LATERAL (SELECT count(*) AS held FROM unnest(l.busy_until) AS u WHERE u > now()) h
),
due AS (
  SELECT h.role, h.platform, count(*) AS n
  FROM worker_task_heads h
  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id
  WHERE h.due_at <= now() AND s.active_task_id IS NULL
  GROUP BY h.role, h.platform
  UNION ALL
  SELECT role, coalesce(platform, ''), count(*)
  FROM worker_tasks
  WHERE status = 'pending' AND due_at <= now() AND dispensary_id IS NULL
  GROUP BY role, coalesce(platform, '')
),
claimable AS (
  SELECT d.role, sum(CASE WHEN r.platform IS NULL THEN d.n ELSE least(d.n, r.free) END) AS n
  FROM due d
  LEFT JOIN room r ON r.platform = d.platform
  GROUP BY d.role
)
SELECT r.role,
       coalesce(ready.n, 0) AS ready,
       coalesce(c.n, 0)::BIGINT AS claimable
FROM worker_task_roles r
LEFT JOIN claimable c ON c.role = r.role
LEFT JOIN (
  -- one branch per partial pending index, as in v_worker_capacity
  SELECT role, count(*) AS n
  FROM (
    SELECT role FROM worker_tasks
    WHERE status = 'pending' AND dispensary_id IS NOT NULL AND due_at <= now()
    UNION ALL
    SELECT role FROM worker_tasks
    WHERE status = 'pending' AND dispensary_id IS NULL AND due_at <= now()
  ) due
  GROUP BY role
) ready ON ready.role = r.role
ORDER BY r.role;

-- name: task_still_owned
-- Taken by a handler in the transaction that writes its results: one row while the lease holds,
-- locked until the commit (recovery waits for it); none when the lease is gone.
SELECT owned FROM task_still_owned(%(task_id)s, %(lease)s);

-- name: sync_platform_limits
SELECT sync_platform_limits(%(limits)s) AS changed;

-- name: platform_request
SELECT decision, wait_seconds FROM platform_request(%(task_id)s, %(lease)s, %(first)s);

-- name: platform_release
SELECT platform_release(%(task_id)s, %(lease)s) AS released;

-- name: platform_handoff
-- The slot goes back and the next due task of the platform is claimed for the same worker (0016).
SELECT (c.task).*, c.lease AS lease_token FROM platform_handoff(%(task_id)s, %(lease)s) c;

-- name: platform_standby
-- The next due task of the platform, claimed for the same worker without a slot (0028).
SELECT (c.task).*, c.lease AS lease_token FROM platform_standby(%(task_id)s, %(lease)s) c;

-- name: platform_standbys
-- Due tasks of full platforms where the worker holds no slot, claimed for it without one (0035).
SELECT (c.task).*, c.lease AS lease_token FROM platform_standbys(%(role)s, %(worker_id)s, %(most)s) c;

-- name: platform_pass
-- The slot moves from a task to its worker's standby task of the platform, with a start, and
-- with replace the next due task is claimed as a standby in its place (0028).
SELECT c.decision, c.wait_seconds, (c.task).*, c.lease AS lease_token
FROM platform_pass(%(task_id)s, %(lease)s, %(next_id)s, %(next_lease)s, %(replace)s) c;

-- name: platform_relay
-- platform_pass with a relay for the slot's new holder, or (sent) the record of a relayed request
-- (0031).
SELECT c.decision, c.wait_seconds, c.relay, (c.task).*, c.lease AS lease_token
FROM platform_relay(%(task_id)s, %(lease)s, %(next_id)s, %(next_lease)s, %(replace)s, %(sent)s) c;

-- name: platform_abandon
SELECT platform_abandon(%(task_id)s, %(lease)s, %(busy_seconds)s::FLOAT8) AS held;

-- name: platform_answered
SELECT platform_answered(%(task_id)s, %(lease)s) AS closed;

-- name: platform_error
SELECT paused, wait_seconds FROM platform_error(%(task_id)s, %(lease)s, %(error)s, %(retry_after)s);

-- name: platform_pause
SELECT platform_pause(%(platform)s, %(seconds)s::FLOAT8, %(reason)s) AS until;

-- name: platform_resume
SELECT platform_resume(%(platform)s) AS resumed;

-- name: claim_wait
SELECT claim_wait(%(role)s) AS wait;

-- name: platform_status
SELECT * FROM v_platform_status ORDER BY platform;

-- name: platform_counter_drift
-- Platforms whose slot counter differs from their tasks holding a slot (claimed or running,
-- send_at set): none while the triggers keep them. What repair_platform_counters would change.
SELECT l.platform, l.in_flight, count(t.id) AS holding
FROM tq_platforms l
LEFT JOIN worker_tasks t
  ON t.platform = l.platform AND t.status IN ('claimed', 'running') AND t.send_at IS NOT NULL
GROUP BY l.platform, l.in_flight
HAVING l.in_flight <> count(t.id)
ORDER BY l.platform;

-- name: repair_platform_counters
SELECT platform, counted, in_flight, probe_cleared FROM repair_platform_counters();

-- name: upsert_listed_stores
-- The handlers' writes name their task and its lease (0013): they act on its store or platform.
SELECT * FROM upsert_listed_stores(%(task_id)s, %(lease)s, %(stores)s);

-- name: store_entry_point
SELECT d.id, d.name, d.menu_type, d.platform_dispensary_id, d.crawl_enabled,
       c.directory_id, c.menu_url, c.gone_at
FROM dispensaries d
LEFT JOIN store_crawl_state c ON c.dispensary_id = d.id
WHERE d.id = %(dispensary_id)s;

-- name: save_entry_point
-- A store that resolves is not gone: crawling comes back on if it was marked gone (migration 0010).
-- Its menu URL stays on the platform's hosts (0013).
SELECT save_entry_point(%(task_id)s, %(lease)s, %(platform_id)s, %(menu_url)s);

-- name: mark_store_gone
-- The platform says the store is gone: no more crawls until a listing names it again.
SELECT mark_store_gone(%(task_id)s, %(lease)s);

-- name: store_menu
SELECT * FROM store_menu(%(task_id)s, %(lease)s, %(menu_hash)s, %(products)s);

-- name: refresh_store_analytics
SELECT * FROM refresh_store_analytics();

-- name: analytics_summary
SELECT
  count(*) AS stores,
  count(*) FILTER (WHERE last_success_at < now() - INTERVAL '26 hours' OR last_success_at IS NULL)
    AS stale_stores,
  coalesce(sum(products_listed), 0) AS products_listed,
  coalesce(sum(price_changes_24h), 0) AS price_changes_24h
FROM store_analytics;

-- name: platform_errors
-- Per platform over the window: tasks that ended in an error (failed, or given back for a retry)
-- against tasks completed. Feeds the platform-failing alert. Both branches stay on partial
-- indexes (finished tasks by completed_at, pending tasks).
WITH recent AS (
  SELECT t.platform, t.status, t.error_message, t.updated_at
  FROM v_tasks t
  WHERE t.status IN ('completed', 'failed')
    AND t.completed_at > now() - make_interval(mins => %(minutes)s)
  UNION ALL
  SELECT t.platform, t.status, t.error_message, t.updated_at
  FROM worker_tasks t
  WHERE t.status = 'pending'
    AND t.retry_count > 0
    AND t.updated_at > now() - make_interval(mins => %(minutes)s)
)
SELECT
  r.platform,
  count(*) FILTER (WHERE r.status = 'completed') AS completed,
  count(*) FILTER (WHERE r.status <> 'completed') AS errors,
  (array_agg(r.error_message ORDER BY r.updated_at DESC) FILTER (WHERE r.status <> 'completed'))[1]
    AS last_error
FROM recent r
WHERE r.platform IS NOT NULL
GROUP BY r.platform
ORDER BY r.platform;

-- name: enqueue_demo_resyncs
-- The demo's crawl schedule (migration 0010): one row per task created, the caller's rowcount.
SELECT id FROM enqueue_demo_resyncs() AS id;
