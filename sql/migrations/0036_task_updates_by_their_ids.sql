-- 0036: the claim, the start, the heartbeat and the completion of a batch of tasks find them by
-- their ids, whatever ANALYZE says.
--
-- Measured (docs/BENCHMARKS.md, "The held snapshot and the readers again, with 0035: not met"):
-- under a held snapshot, completions fell to half the offered rate for 45-65 s every two minutes.
-- In each spell the slow statement was the claim's last, the UPDATE of the picked tasks, joined
-- to them by id (FROM timed m WHERE t.id = m.id). After an autovacuum ANALYZE of a nearly empty
-- worker_tasks the planner counted a dozen rows in it, and joined the picked tasks to a full scan
-- of worker_tasks_pkey, which the snapshot keeps full of dead entries: 111,000 buffers for a
-- claim of 3 to 5 tasks. Neither enable_hashjoin, enable_mergejoin nor enable_material off
-- mends it: the nested loop kept the full scan outside. The completion's DELETE, joined to the
-- unnested ids and leases, took the same plan in a test (9,626 buffers for 4 tasks), as the
-- start's and the heartbeat's may.
--
-- Now:
-- * The claim's UPDATE is positioned on the picked ids, taken once as an array (t.id = ANY
--   (...)): an index condition of the primary key, as tq_refresh_heads' DELETE is (0024); the
--   join to the picked tasks only pairs each with its start and lease.
-- * The start, heartbeat and completion have no join: they find the tasks by t.id = ANY
--   (p_task_ids) and take each task's lease (and result and times) from the arrays at its id's
--   position (array_position). Joined to the unnested arrays and positioned on the ids, the
--   planner rescanned the arrays once per task (2,500 pairs for a batch of 50), a completion
--   a third slower than before. A task id given twice is judged by its first lease.
--
-- The statements are patched in place, as in 0020 and 0024: every other line of those functions,
-- their settings and grants stay as they are. Safe to run twice.

DO $$
DECLARE
  v_fn REGPROCEDURE;
  v_old TEXT;
  v_new TEXT;
  v_def TEXT;
  v_patched INTEGER := 0;
BEGIN
  FOR v_fn, v_old, v_new IN VALUES
    ('claim_tasks(varchar, varchar, integer, boolean)'::REGPROCEDURE,
     $o$
      FROM timed m
      WHERE t.id = m.id
$o$,
     $n$
      FROM timed m
      -- By the picked ids, taken once (0036): joined alone, a planner that believes the table
      -- nearly empty reads its primary key whole.
      WHERE t.id = ANY (ARRAY(SELECT x.id FROM timed x))
        AND t.id = m.id
$n$),
    ('complete_tasks_timed(integer[], uuid[], jsonb[], double precision[], double precision[])'::REGPROCEDURE,
     $o$
    USING unnest(p_task_ids, p_leases, p_results, p_began_after, p_ended_after) AS r (id, lease, result, began, ended)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
      AND t.status IN ('claimed', 'running')
    RETURNING t.*, r.result AS new_result, r.began, r.ended
$o$,
     $n$
    -- By the ids, each task's lease, result and times at its id's position (0036): no join.
    WHERE t.id = ANY (p_task_ids)
      AND t.lease_hash = tq_lease_hash(p_leases[array_position(p_task_ids, t.id)])
      AND t.status IN ('claimed', 'running')
    RETURNING t.*,
      p_results[array_position(p_task_ids, t.id)] AS new_result,
      p_began_after[array_position(p_task_ids, t.id)] AS began,
      p_ended_after[array_position(p_task_ids, t.id)] AS ended
$n$),
    ('start_tasks(integer[], uuid[])'::REGPROCEDURE,
     $o$
    FROM unnest(p_task_ids, p_leases) AS r (id, lease)
    WHERE t.id = r.id
      AND t.lease_hash = tq_lease_hash(r.lease)
$o$,
     $n$
    -- By the ids, each task's lease at its id's position (0036): no join.
    WHERE t.id = ANY (p_task_ids)
      AND t.lease_hash = tq_lease_hash(p_leases[array_position(p_task_ids, t.id)])
$n$),
    ('heartbeat_tasks(varchar, integer[], uuid[])'::REGPROCEDURE,
     $o$
    FROM worker_tasks t
    JOIN unnest(p_task_ids, p_leases) AS r (id, lease) ON r.id = t.id
    WHERE t.lease_hash = tq_lease_hash(r.lease)
$o$,
     $n$
    FROM worker_tasks t
    -- By the ids, each task's lease at its id's position (0036): no join.
    WHERE t.id = ANY (p_task_ids)
      AND t.lease_hash = tq_lease_hash(p_leases[array_position(p_task_ids, t.id)])
$n$),
    ('heartbeat_tasks(varchar, integer[], uuid[])'::REGPROCEDURE,
     $o$
    WHERE t.id IN (SELECT h.id FROM held h)
$o$,
     $n$
    WHERE t.id = ANY (ARRAY(SELECT h.id FROM held h))
$n$),
    ('heartbeat_tasks(varchar, integer[], uuid[])'::REGPROCEDURE,
     $o$
    FROM lockable l, unnest(p_task_ids, p_leases) AS r (id, lease)
    WHERE t.id = l.id
      AND r.id = t.id
      AND t.lease_hash = tq_lease_hash(r.lease)
$o$,
     $n$
    WHERE t.id = ANY (ARRAY(SELECT l.id FROM lockable l))
      AND t.lease_hash = tq_lease_hash(p_leases[array_position(p_task_ids, t.id)])
$n$)
  LOOP
    v_def := pg_get_functiondef(v_fn);
    IF strpos(v_def, v_old) > 0 THEN
      EXECUTE replace(v_def, v_old, v_new);
      v_patched := v_patched + 1;
    ELSIF strpos(v_def, v_new) = 0 THEN
      RAISE EXCEPTION '0036: % has no statement to patch', v_fn;
    END IF;
  END LOOP;
  RAISE NOTICE '0036: % statement(s) patched', v_patched;
END;
$$;

CALL tq_secure_functions();
