-- 0024: the heads are probed and deleted by their keys, whatever ANALYZE says.
--
-- Measured (docs/BENCHMARKS.md, "Plans that followed a nearly empty ANALYZE (0024)"): under
-- readers, a minute-long stall began a few seconds after an autovacuum ANALYZE and ended after
-- the next. A queue that keeps up is nearly empty when autovacuum analyses it, and the statistics
-- then say worker_task_heads holds a head or two, while a reader's snapshot keeps every dead head
-- and index entry in place. To a planner that believes the table holds one row, reading all of it
-- costs one page, and two of the claim's statements did so, auto_explain showed:
--
-- * tq_refresh_heads, run by the claim's trigger, deleted the claimed stores' heads (USING fresh)
--   through idx_worker_task_heads_platform with only role positioned, for each store: 0.96 s of
--   a claim of 50, after 150,000 tasks under a held snapshot. Joined on the whole key instead,
--   the DELETE read worker_task_heads_store_role whole, in store order, as the join's outer side
--   (20,347 buffers for 50 heads); positioned on the given stores and joined, it read them all
--   once per store. So it has no join now.
-- * claim_tasks' first look for work probed the heads of each floor with a semi-join that read
--   the role's heads once, with no condition on platform, priority or floor (587 buffers, 73
--   with the floor's). claim_wait, which an idle worker calls, probes the same way.
--
-- Now:
-- * The DELETE takes the keys left with no pending task as arrays, each computed once, and is
--   positioned on their stores (h.dispensary_id = ANY (...), the leading column of
--   worker_task_heads_store_role), the exact keys a filter: no join, so no join order and no
--   merge for the planner to choose. tq_refresh_head's delete of one head compares the whole
--   key, dispensary_id and role || ''.
-- * The floors' probes (claim_tasks, claim_wait) are LATERAL subqueries with LIMIT 1: planned on
--   their own with the floor's values as parameters, so every condition positions the scan.
--
-- The statements are patched in place, as in 0020: every other line of those functions, their
-- settings and grants stay as they are. Safe to run twice.

DO $$
DECLARE
  v_fn REGPROCEDURE;
  v_old TEXT;
  v_new TEXT;
  v_def TEXT;
  v_patched INTEGER := 0;
BEGIN
  FOR v_fn, v_old, v_new IN VALUES
    ('tq_refresh_head(integer, varchar)'::REGPROCEDURE,
     $o$
      DELETE FROM worker_task_heads h WHERE h.role = p_role AND h.dispensary_id = p_store;
$o$,
     $n$
      -- The whole key (0024): a condition on role alone could scan every head of the role.
      DELETE FROM worker_task_heads h WHERE h.dispensary_id = p_store AND h.role || '' = p_role || '';
$n$),
    ('tq_refresh_heads(integer[], varchar[])'::REGPROCEDURE,
     $o$
    USING fresh f
    WHERE h.role = f.role
      AND h.dispensary_id = f.dispensary_id
      AND f.priority IS NULL
$o$,
     $n$
    -- By the keys left with no pending task, as arrays taken once (0024), positioned on their
    -- stores: a join to fresh lets a planner that believes the heads few read them all.
    WHERE h.dispensary_id = ANY (ARRAY(SELECT f.dispensary_id FROM fresh f WHERE f.priority IS NULL))
      AND h.dispensary_id || ' ' || h.role
          = ANY (ARRAY(SELECT f.dispensary_id || ' ' || f.role FROM fresh f WHERE f.priority IS NULL))
$n$),
    ('claim_tasks(varchar, varchar, integer, boolean)'::REGPROCEDURE,
     $o$
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1 FROM worker_task_heads h
                  WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
                    AND h.due_at >= f.floor)
$o$,
     $n$
    FROM worker_task_floors f
    -- LATERAL ... LIMIT 1, not EXISTS (0024): planned on its own, the floor's values position
    -- the probe; a semi-join may read the role's heads whole when they look few.
    CROSS JOIN LATERAL (SELECT 1 FROM worker_task_heads h
                        WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
                          AND h.due_at >= f.floor
                        LIMIT 1) h
    WHERE f.role = p_role
$n$),
    ('claim_wait(varchar)'::REGPROCEDURE,
     $o$
    FROM worker_task_floors f
    WHERE f.role = p_role
      AND EXISTS (SELECT 1
                  FROM worker_task_heads h
                  JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id + 0  -- + 0: not a merge key (0020)
                  WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
                    AND h.due_at >= f.floor AND h.due_at <= now() AND s.active_task_id IS NULL)
$o$,
     $n$
    FROM worker_task_floors f
    -- LATERAL ... LIMIT 1, not EXISTS (0024), as in claim_tasks.
    CROSS JOIN LATERAL (SELECT 1
                        FROM worker_task_heads h
                        JOIN worker_task_stores s ON s.dispensary_id = h.dispensary_id + 0  -- + 0: not a merge key (0020)
                        WHERE h.role = p_role AND h.platform = f.platform AND h.priority = f.priority
                          AND h.due_at >= f.floor AND h.due_at <= now() AND s.active_task_id IS NULL
                        LIMIT 1) h
    WHERE f.role = p_role
$n$)
  LOOP
    v_def := pg_get_functiondef(v_fn);
    IF strpos(v_def, v_old) > 0 THEN
      EXECUTE replace(v_def, v_old, v_new);
      v_patched := v_patched + 1;
    ELSIF strpos(v_def, v_new) = 0 THEN
      RAISE EXCEPTION '0024: % has no statement to patch', v_fn;
    END IF;
  END LOOP;
  RAISE NOTICE '0024: % function(s) patched', v_patched;
END;
$$;

CALL tq_secure_functions();
