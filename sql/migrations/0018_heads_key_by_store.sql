-- 0018: the heads' primary key leads with the store, so that no plan can walk a role's heads
-- through it. Measured by bench/long_horizon.py (docs/BENCHMARKS.md, "A held snapshot: the
-- stalls were plans").
--
-- Under a transaction held open, a role's heads table holds a handful of live rows and every
-- head deleted since the snapshot (one per task). ANALYZE counts only the live ones, so every
-- index on (role, ...) looks alike to the planner, one row at about the same cost; the
-- generic plans of the claim's look for work, the raise's probe and tq_refresh_heads' delete
-- went, after one analysis in two, from idx_worker_task_heads_platform (positioned at the
-- floor: a few buffers) to worker_task_heads_pkey on role alone, which visits every dead head
-- of the role: 30,000 to 115,000 buffers a statement eight minutes in, claims ten times
-- slower, a backlog for the minute until the next analysis flipped them back. Keyed
-- (dispensary_id, role), the primary key still serves every lookup of one store's head and the
-- upserts' ON CONFLICT (role, dispensary_id), and reads a role's heads only by a scan of the
-- whole index. A bitmap of that scan was still chosen, once, for the look for work (a
-- materialised scan of the role's heads, 1,300 buffers, against one probe per floor): the
-- functions that walk a role's heads plan without bitmap scans, so that the probe positioned at
-- the floor is the one cheap path left to them.
--
-- The floors, for the same reason: under a held snapshot every version of a floor row stays,
-- and each read of the floor visited them all (2,000 versions, some 10,000 buffers a claim
-- and 2,000 an enqueue eight minutes in). Most were rows that writers added because a claim
-- held the floor's lock (its raise), each deleted by the next raise; a writer now waits for
-- that lock, a claim's remaining milliseconds, polling up to 20 ms, before it adds a row. And
-- the floor value is no longer in the index, so that a raise is a HOT update: its versions
-- chain within a page instead of adding an index entry each.
--
-- Safe to run twice.

-- Claims and head writers hold row locks on the heads while they lock other rows: the table's
-- lock is taken only when free (NOWAIT, retried for up to a minute), so the migration neither
-- deadlocks with them nor queues every writer behind it.
DO $$
BEGIN
  FOR attempt IN 1..1200 LOOP
    BEGIN
      LOCK TABLE worker_task_heads IN ACCESS EXCLUSIVE MODE NOWAIT;
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      PERFORM pg_sleep(0.05);  -- the failed attempt's lock went with its subtransaction
    END;
  END LOOP;
  RAISE EXCEPTION 'worker_task_heads stayed locked for a minute'
    USING HINT = 'Run tq migrate again at a quieter moment.';
END;
$$;

DO $$
BEGIN
  IF (SELECT a.attname
      FROM pg_index i
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
      WHERE i.indexrelid = 'worker_task_heads_pkey'::regclass) <> 'dispensary_id' THEN
    ALTER TABLE worker_task_heads
      DROP CONSTRAINT worker_task_heads_pkey,
      ADD CONSTRAINT worker_task_heads_pkey PRIMARY KEY (dispensary_id, role);
  END IF;
END;
$$;

ALTER FUNCTION claim_tasks(VARCHAR, VARCHAR, INTEGER, BOOLEAN) SET enable_bitmapscan = off;
ALTER FUNCTION tq_claim_next(VARCHAR, VARCHAR, VARCHAR) SET enable_bitmapscan = off;
ALTER FUNCTION claim_wait(VARCHAR) SET enable_bitmapscan = off;
ALTER FUNCTION tq_raise_floors(VARCHAR) SET enable_bitmapscan = off;

DROP INDEX IF EXISTS idx_worker_task_floors;
CREATE INDEX IF NOT EXISTS idx_worker_task_floors_key ON worker_task_floors (role, platform, priority);

-- A head was written (due p_due) under this floor: keep the floor at or below it. Almost always
-- a read finds a row at or below the head, and nothing is written; the shared lock, held to the
-- writer's commit, keeps every raise away until the head is visible to it. A claim raising this
-- floor holds the lock exclusively to its commit: the writer polls for it (never queued behind
-- the claim) for up to 20 ms. When the lock is not had by then (a claim in a long transaction),
-- or the transaction reads an older snapshot than its statement's, or no row is low enough, the
-- writer adds a row at its head's due time, which a raise that did not read it leaves alone.
-- True when it wrote.
CREATE OR REPLACE FUNCTION tq_lower_floor(p_role VARCHAR, p_platform VARCHAR, p_priority INTEGER, p_due TIMESTAMPTZ)
RETURNS BOOLEAN AS $$
DECLARE
  v_key INTEGER;
BEGIN
  IF p_due IS NULL THEN
    RETURN false;
  END IF;
  IF current_setting('transaction_isolation') = 'read committed' THEN
    v_key := tq_floor_lock_key(p_role, p_platform, p_priority);
    FOR attempt IN 1..20 LOOP
      IF pg_try_advisory_xact_lock_shared(hashtext('worker_task_floors'), v_key) THEN
        PERFORM 1
        FROM worker_task_floors f
        WHERE f.role = p_role AND f.platform = p_platform AND f.priority = p_priority AND f.floor <= p_due;
        IF FOUND THEN
          RETURN false;
        END IF;
        EXIT;
      END IF;
      PERFORM pg_sleep(0.001);
    END LOOP;
  END IF;
  INSERT INTO worker_task_floors (role, platform, priority, floor)
  VALUES (p_role, p_platform, p_priority, p_due);
  RETURN true;
END;
$$ LANGUAGE plpgsql;

CALL tq_secure_functions();
