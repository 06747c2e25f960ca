-- 0025: a platform slot's bookkeeping commits without waiting for its WAL flush.
--
-- Measured (docs/BENCHMARKS.md, "The platform row and the WAL flush (0025)"): in a crawl bound
-- by in-flight slots, every hand-off and every late start locks its platform's row in
-- tq_platforms, and held it through its commit's fdatasync. The hand-offs of a platform queued
-- behind each other's flushes: sampled in pg_stat_activity, most of platform_handoff's time was
-- IO:WALSync, LWLock:WALWrite, or Lock:transactionid on the hand-off before it.
--
-- platform_handoff, platform_request and platform_release now set synchronous_commit off for
-- their transaction when it has written nothing before them (one statement in autocommit, as
-- TaskQueue calls them), so the row's lock goes as soon as the commit is written. What that may
-- lose in a crash of the server is the last fraction of a second of slot bookkeeping, whole
-- transactions and in order, never a task or an effect:
-- * a lost hand-off or claim leaves its next task due again, and its worker, which may have sent
--   its first request, finds the lease gone at its first write (the writes are fenced by it);
-- * a lost release or start leaves a slot taken or a start reserved a moment longer;
-- * any later transaction that commits with a flush (a handler's, a completion) flushes every
--   one of them before it, so nothing durable ever stands on a lost hand-off.
-- A caller's own transaction that already wrote keeps its flush; one that calls these first and
-- writes after does not wait for it either (docs/QUEUE.md, "Platform limits").
--
-- Safe to run twice.

CREATE OR REPLACE FUNCTION tq_slot_commit() RETURNS VOID AS $$
BEGIN
  IF txid_current_if_assigned() IS NULL THEN
    PERFORM set_config('synchronous_commit', 'off', true);
  END IF;
END;
$$ LANGUAGE plpgsql;

COMMENT ON FUNCTION tq_slot_commit() IS
  'Slot bookkeeping in a transaction that wrote nothing before: commit without waiting for the WAL flush (0025)';

DO $$
DECLARE
  v_fn REGPROCEDURE;
  v_def TEXT;
  v_patched INTEGER := 0;
BEGIN
  FOR v_fn IN VALUES
    ('platform_handoff(integer, uuid)'::REGPROCEDURE),
    ('platform_request(integer, uuid, boolean)'::REGPROCEDURE),
    ('platform_release(integer, uuid)'::REGPROCEDURE)
  LOOP
    v_def := pg_get_functiondef(v_fn);
    IF strpos(v_def, 'tq_slot_commit()') = 0 THEN
      EXECUTE regexp_replace(v_def, E'\nBEGIN\n', E'\nBEGIN\n  PERFORM tq_slot_commit();  -- 0025\n');
      v_patched := v_patched + 1;
    END IF;
  END LOOP;
  RAISE NOTICE '0025: % function(s) patched', v_patched;
END;
$$;

CALL tq_secure_functions();
