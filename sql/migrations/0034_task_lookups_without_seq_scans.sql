-- 0034: the lookups of one task (by its id and lease, or by its store) plan without sequential
-- scans, whatever the statistics and the session's settings say.
--
-- Measured (docs/BENCHMARKS.md, "A backlog planned as one head (0033)", what is left): after an
-- autovacuum ANALYZE of a nearly empty worker_tasks (a queue that keeps up), the lookup of one
-- task by its id in the handler's transaction (task_still_owned, complete_task_tx) and the
-- enqueue's check for a store's pending task were planned as sequential scans of the table
-- (estimated cost 17, about 9 pages). When a backlog then built, each call read every row: 710
-- rows and 135 buffers for one task, the completion path 4 to 8 times its buffers, and at 1.5x
-- the offered load the queue went 3,513 deep for a minute, until the next ANALYZE.
--
-- Each of these statements has an index that finds its rows (the primary key, the store's
-- partial indexes): the functions of the enqueue, the handler's transaction, the completions,
-- heartbeats, failures and deferrals, and the heads' refresh they run, now plan with
-- enable_seqscan = off and enable_indexscan = on, as the claim's do (0018, 0033).
--
-- Safe to run twice.

ALTER FUNCTION enqueue_task_once(VARCHAR, INTEGER, VARCHAR, INTEGER, TIMESTAMPTZ, JSONB)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION task_still_owned(INTEGER, UUID)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION complete_task_tx(INTEGER, UUID, JSONB)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION complete_tasks(INTEGER[], UUID[], JSONB[])
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION complete_tasks_timed(INTEGER[], UUID[], JSONB[], DOUBLE PRECISION[], DOUBLE PRECISION[])
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION heartbeat_tasks(VARCHAR, INTEGER[], UUID[])
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION fail_task(INTEGER, UUID, TEXT, BOOLEAN, INTERVAL)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION defer_task(INTEGER, UUID, INTERVAL)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION tq_refresh_head(INTEGER, VARCHAR)
  SET enable_seqscan = off SET enable_indexscan = on;
ALTER FUNCTION tq_refresh_heads(INTEGER[], VARCHAR[])
  SET enable_seqscan = off SET enable_indexscan = on;

CALL tq_secure_functions();
