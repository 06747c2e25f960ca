-- 0033: a claim walks the due heads in their order, whatever the statistics say.
--
-- Measured (docs/BENCHMARKS.md, "A backlog planned as one head (0033)"): at 1.5x the offered
-- load, tq alone fell to 230-290 completions a second for 45 to 85 s, its queue 4,500 deep,
-- twice in two runs, each time starting within 25 s of an autovacuum ANALYZE of the queue's
-- tables and ending after the next. auto_explain caught the claim's statement in the spell: the
-- statistics of a queue that keeps up (one head or two due) made a bitmap scan of
-- idx_worker_task_heads_platform look as cheap as its ordered scan, and the claim read every due
-- head of the platform, joined each to its store and sorted them all to take 4: 2,851 to 4,980
-- heads and 8,624 to 15,054 buffers, 13 to 17 ms a claim. Each claim then cost more as the backlog it was to drain
-- grew, and the backlog grew because claims cost more.
--
-- The index's order is the claim's (role, platform, priority, then due_at, dispensary_id): read
-- in order, a LIMIT stops at the stores it takes. The functions that walk the due heads in that
-- order (the claim, the next task of a hand-off, a pass or a standby, and the look for work) now
-- plan without bitmap scans, and with index scans whatever the session's settings; as 0018 did
-- for sequential scans.
--
-- Safe to run twice.

ALTER FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN)
  SET enable_bitmapscan = off SET enable_indexscan = on;
ALTER FUNCTION tq_pick_next(VARCHAR, VARCHAR)
  SET enable_bitmapscan = off SET enable_indexscan = on;
ALTER FUNCTION claim_wait(VARCHAR)
  SET enable_bitmapscan = off SET enable_indexscan = on;

CALL tq_secure_functions();
