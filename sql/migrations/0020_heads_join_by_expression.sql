-- 0020: the heads scans keep their positioned start under a held snapshot, whatever ANALYZE says.
--
-- Measured (docs/BENCHMARKS.md, "The last plan that flipped"): ten minutes of a transaction
-- holding its XID at 300 tasks/s, and twice a minute-long stall began a few seconds after an
-- autovacuum ANALYZE and ended after the next one. auto_explain of the stall: the claim's heads
-- ranking read the role's heads through a full scan of worker_task_heads_store_role
-- (dispensary_id, role || ''), no index condition, every head live or dead (156,035 buffers, 4,688
-- rows to find 5), instead of the positioned scan of idx_worker_task_heads_platform at the floor.
-- 0018 left that index no condition on role to use; the planner still builds a full scan of it,
-- because its order on dispensary_id could serve a merge join with worker_task_stores on the
-- same column, and under a held snapshot the bloated positioned index can look dearer.
--
-- Each join of the heads to their stores now compares s.dispensary_id with h.dispensary_id + 0:
-- the same rows, each store still found through worker_task_stores_pkey, but h.dispensary_id is
-- no longer a merge key, so no plan has a reason to read the heads in store order.
--
-- The four statements are patched in place (claim_tasks: the recheck and the ranking;
-- tq_claim_next; claim_wait): every other line of those functions, their settings and grants
-- stay as they are. Safe to run twice.

DO $$
DECLARE
  v_old CONSTANT TEXT := 'JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id';
  v_new CONSTANT TEXT := 'JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id + 0'
                         '  -- + 0: not a merge key (0020)';
  v_fn REGPROCEDURE;
  v_def TEXT;
  v_patched INTEGER := 0;
BEGIN
  FOREACH v_fn IN ARRAY ARRAY[
    'claim_tasks(varchar, varchar, integer, boolean)'::REGPROCEDURE,
    'tq_claim_next(varchar, varchar, varchar)'::REGPROCEDURE,
    'claim_wait(varchar)'::REGPROCEDURE]
  LOOP
    v_def := pg_get_functiondef(v_fn);
    -- A patched line goes on after h.dispensary_id, so it never matches v_old and a line break.
    IF strpos(v_def, v_old || E'\n') > 0 THEN
      EXECUTE replace(v_def, v_old || E'\n', v_new || E'\n');
      v_patched := v_patched + 1;
    ELSIF strpos(v_def, v_new) = 0 THEN
      RAISE EXCEPTION '0020: % has no join of the heads to their stores to patch', v_fn;
    END IF;
  END LOOP;
  RAISE NOTICE '0020: % function(s) patched', v_patched;
END;
$$;

CALL tq_secure_functions();
