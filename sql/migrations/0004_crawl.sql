-- What the role handlers keep: task parameters, each store's crawl state, products with their
-- price and stock history, and per-store analytics. Also: retries that honour Retry-After, and
-- deferring a task without spending a retry.

------------------------------------------------------------------------------------------------
-- Task parameters (store_discovery: platform and region). A constant default adds the column
-- without rewriting the table, and INSERTs that name no payload keep working.
------------------------------------------------------------------------------------------------
ALTER TABLE worker_tasks ADD COLUMN IF NOT EXISTS payload JSONB NOT NULL DEFAULT '{}';
ALTER TABLE worker_tasks DROP CONSTRAINT IF EXISTS payload_is_object;
-- NOT VALID, then VALIDATE: the check of existing rows does not block writers.
ALTER TABLE worker_tasks
  ADD CONSTRAINT payload_is_object CHECK (jsonb_typeof(payload) = 'object') NOT VALID;
ALTER TABLE worker_tasks VALIDATE CONSTRAINT payload_is_object;

------------------------------------------------------------------------------------------------
-- Crawl state per store. Kept beside dispensaries, not in it: of a deployment's own dispensaries
-- table the handlers use id, name, menu_type, platform_dispensary_id and crawl_enabled
-- (store_discovery inserts stores, entry_point_discovery sets the platform id, a store the
-- platform says is gone has crawl_enabled cleared).
------------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS store_crawl_state (
  dispensary_id INTEGER PRIMARY KEY REFERENCES dispensaries (id) ON DELETE CASCADE,
  platform VARCHAR(50),
  directory_id TEXT,                    -- the store's key in its platform's store directory
  region TEXT,
  menu_url TEXT,                        -- the entry point, once resolved
  menu_hash TEXT,                       -- of the last menu stored: an equal menu is skipped
  first_listed_at TIMESTAMPTZ,
  last_listed_at TIMESTAMPTZ,
  resolved_at TIMESTAMPTZ,
  last_crawl_at TIMESTAMPTZ,            -- last menu fetched, changed or not
  last_change_at TIMESTAMPTZ,           -- last menu that differed from the one before
  gone_at TIMESTAMPTZ,                  -- the platform answered 404/410 for the store
  UNIQUE (platform, directory_id)
);

CREATE TABLE IF NOT EXISTS products (
  id BIGSERIAL PRIMARY KEY,
  dispensary_id INTEGER NOT NULL REFERENCES dispensaries (id) ON DELETE CASCADE,
  external_id TEXT NOT NULL,            -- the product's id on the platform
  name TEXT NOT NULL,
  brand TEXT,
  category TEXT NOT NULL,
  price NUMERIC(10, 2) NOT NULL CHECK (price >= 0),
  thc_percent NUMERIC(5, 2),
  cbd_percent NUMERIC(5, 2),
  in_stock BOOLEAN NOT NULL,
  first_seen_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  last_seen_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  changed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  gone_at TIMESTAMPTZ,                  -- off the menu since; NULL while listed
  UNIQUE (dispensary_id, external_id)
);

-- One row per change only: a product whose price and stock did not move writes nothing.
CREATE TABLE IF NOT EXISTS product_history (
  id BIGSERIAL PRIMARY KEY,
  product_id BIGINT NOT NULL REFERENCES products (id) ON DELETE CASCADE,
  dispensary_id INTEGER NOT NULL,
  observed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  change VARCHAR(10) NOT NULL CHECK (change IN ('new', 'changed', 'gone', 'back')),
  price NUMERIC(10, 2),
  old_price NUMERIC(10, 2),
  in_stock BOOLEAN,
  old_in_stock BOOLEAN
);
CREATE INDEX IF NOT EXISTS idx_product_history_product ON product_history (product_id, observed_at);
CREATE INDEX IF NOT EXISTS idx_product_history_store ON product_history (dispensary_id, observed_at);

CREATE TABLE IF NOT EXISTS store_analytics (
  dispensary_id INTEGER PRIMARY KEY REFERENCES dispensaries (id) ON DELETE CASCADE,
  platform VARCHAR(50),
  products_listed INTEGER NOT NULL,
  products_in_stock INTEGER NOT NULL,
  price_changes_24h INTEGER NOT NULL,
  price_changes_7d INTEGER NOT NULL,
  last_success_at TIMESTAMPTZ,          -- last menu stored (or found unchanged)
  last_change_at TIMESTAMPTZ,
  refreshed_at TIMESTAMPTZ NOT NULL
);

-- Freshness is computed at read time: a stored age would be wrong a minute later.
CREATE OR REPLACE VIEW v_store_freshness AS
SELECT
  a.*,
  extract(EPOCH FROM now() - a.last_success_at) / 3600 AS hours_since_success
FROM store_analytics a;

------------------------------------------------------------------------------------------------
-- store_discovery: upsert a platform's listing. New stores get a dispensaries row, a crawl
-- state and an entry_point_discovery task; a store listed again after it was gone is crawled
-- again. Returns one row per listed store.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION upsert_listed_stores(p_platform VARCHAR, p_stores JSONB)
RETURNS TABLE (dispensary_id INTEGER, directory_id TEXT, created BOOLEAN) AS $$
DECLARE
  s RECORD;
  v_id INTEGER;
  v_gone TIMESTAMPTZ;
BEGIN
  IF p_platform IS NULL OR p_platform = '' THEN
    RAISE EXCEPTION 'platform must not be empty' USING ERRCODE = '22023';
  END IF;
  -- Two listings of one platform at once would both see a store as new.
  PERFORM pg_advisory_xact_lock(hashtext('tq:listing:' || p_platform));
  IF EXISTS (
    SELECT 1 FROM jsonb_to_recordset(p_stores) AS x (id TEXT) WHERE x.id IS NULL OR x.id = ''
  ) THEN
    RAISE EXCEPTION 'every listed store needs a non-empty id' USING ERRCODE = '22023';
  END IF;
  FOR s IN
    SELECT DISTINCT ON (x.id) x.id, x.name, x.region
    FROM jsonb_to_recordset(p_stores) AS x (id TEXT, name TEXT, region TEXT)
    ORDER BY x.id
  LOOP
    SELECT c.dispensary_id, c.gone_at INTO v_id, v_gone
    FROM store_crawl_state c
    WHERE c.platform = p_platform AND c.directory_id = s.id
    FOR UPDATE;
    IF FOUND THEN
      UPDATE store_crawl_state c
      SET last_listed_at = now(), region = coalesce(s.region, c.region), gone_at = NULL
      WHERE c.dispensary_id = v_id;
      -- Gone, now back: crawl it again (a store disabled by hand has no gone_at and stays so).
      IF v_gone IS NOT NULL THEN
        UPDATE dispensaries d SET crawl_enabled = true WHERE d.id = v_id;
      END IF;
      -- Still unresolved (gone before it was, or its entry point failed): try again.
      INSERT INTO worker_tasks (role, dispensary_id, platform)
      SELECT 'entry_point_discovery', d.id, p_platform
      FROM dispensaries d
      WHERE d.id = v_id
        AND d.crawl_enabled
        AND d.platform_dispensary_id IS NULL
        AND NOT EXISTS (
          SELECT 1 FROM worker_tasks t
          WHERE t.dispensary_id = v_id
            AND t.role = 'entry_point_discovery'
            AND t.status IN ('pending', 'claimed', 'running'));
      dispensary_id := v_id; directory_id := s.id; created := false;
    ELSE
      INSERT INTO dispensaries (name, menu_type, crawl_enabled)
      VALUES (coalesce(nullif(s.name, ''), s.id), p_platform, true)
      RETURNING id INTO v_id;
      INSERT INTO store_crawl_state (dispensary_id, platform, directory_id, region, first_listed_at, last_listed_at)
      VALUES (v_id, p_platform, s.id, s.region, now(), now());
      INSERT INTO worker_tasks (role, dispensary_id, platform)
      VALUES ('entry_point_discovery', v_id, p_platform);
      dispensary_id := v_id; directory_id := s.id; created := true;
    END IF;
    RETURN NEXT;
  END LOOP;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- product_discovery / product_resync: store a normalised menu. p_products is a JSON array of
-- {id, name, brand, category, price, thc, cbd, in_stock} with unique ids. A menu whose hash
-- equals the last one stored is skipped. Returns the counts the task reports.
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION store_menu(p_dispensary_id INTEGER, p_menu_hash TEXT, p_products JSONB)
RETURNS TABLE (unchanged BOOLEAN, seen INTEGER, new INTEGER, changed INTEGER, gone INTEGER) AS $$
DECLARE
  v_hash TEXT;
BEGIN
  INSERT INTO store_crawl_state (dispensary_id, platform)
  SELECT d.id, d.menu_type FROM dispensaries d WHERE d.id = p_dispensary_id
  ON CONFLICT ON CONSTRAINT store_crawl_state_pkey DO NOTHING;
  -- Serialises writers of one store (the queue already runs one task per store at a time).
  SELECT c.menu_hash INTO v_hash
  FROM store_crawl_state c
  WHERE c.dispensary_id = p_dispensary_id
  FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no store with id %', p_dispensary_id USING ERRCODE = '22023';
  END IF;

  IF p_menu_hash IS NULL OR p_menu_hash = '' THEN
    RAISE EXCEPTION 'store_menu needs the menu''s hash' USING ERRCODE = '22023';
  END IF;
  IF EXISTS (
    SELECT 1
    FROM jsonb_to_recordset(p_products) AS x (id TEXT)
    GROUP BY x.id
    HAVING x.id IS NULL OR count(*) > 1
  ) THEN
    RAISE EXCEPTION 'every product needs an id, and each id once' USING ERRCODE = '22023';
  END IF;

  seen := jsonb_array_length(p_products);
  IF v_hash IS NOT DISTINCT FROM p_menu_hash THEN
    UPDATE store_crawl_state c SET last_crawl_at = now() WHERE c.dispensary_id = p_dispensary_id;
    unchanged := true; new := 0; changed := 0; gone := 0;
    RETURN NEXT;
    RETURN;
  END IF;

  WITH incoming AS (
    SELECT *
    FROM jsonb_to_recordset(p_products) AS x (
      id TEXT, name TEXT, brand TEXT, category TEXT, price NUMERIC, thc NUMERIC, cbd NUMERIC, in_stock BOOLEAN)
  ),
  old AS (
    SELECT p.* FROM products p WHERE p.dispensary_id = p_dispensary_id
  ),
  diff AS (
    SELECT
      i.*,
      o.price AS old_price,
      o.in_stock AS old_in_stock,
      CASE
        WHEN o.id IS NULL THEN 'new'
        WHEN o.gone_at IS NOT NULL THEN 'back'
        WHEN (o.price, o.in_stock) IS DISTINCT FROM (i.price, i.in_stock) THEN 'changed'
      END AS change
    FROM incoming i
    LEFT JOIN old o ON o.external_id = i.id
  ),
  upserted AS (
    INSERT INTO products AS p (
      dispensary_id, external_id, name, brand, category, price, thc_percent, cbd_percent, in_stock)
    SELECT p_dispensary_id, d.id, d.name, d.brand, d.category, d.price, d.thc, d.cbd, d.in_stock
    FROM diff d
    ORDER BY d.id
    ON CONFLICT (dispensary_id, external_id) DO UPDATE
    SET name = excluded.name,
        brand = excluded.brand,
        category = excluded.category,
        price = excluded.price,
        thc_percent = excluded.thc_percent,
        cbd_percent = excluded.cbd_percent,
        in_stock = excluded.in_stock,
        last_seen_at = now(),
        changed_at = CASE
          WHEN p.gone_at IS NOT NULL OR (p.price, p.in_stock) IS DISTINCT FROM (excluded.price, excluded.in_stock)
          THEN now() ELSE p.changed_at END,
        gone_at = NULL
    RETURNING p.id, p.external_id
  ),
  history AS (
    INSERT INTO product_history (product_id, dispensary_id, change, price, old_price, in_stock, old_in_stock)
    SELECT u.id, p_dispensary_id, d.change, d.price, d.old_price, d.in_stock, d.old_in_stock
    FROM upserted u
    JOIN diff d ON d.id = u.external_id
    WHERE d.change IS NOT NULL
  ),
  vanished AS (
    UPDATE products p
    SET gone_at = now(), changed_at = now()
    FROM old o
    WHERE p.id = o.id
      AND o.gone_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM incoming i WHERE i.id = o.external_id)
    RETURNING p.id, p.price, p.in_stock
  ),
  vanished_history AS (
    INSERT INTO product_history (product_id, dispensary_id, change, old_price, old_in_stock)
    SELECT v.id, p_dispensary_id, 'gone', v.price, v.in_stock
    FROM vanished v
  )
  SELECT
    count(*) FILTER (WHERE d.change = 'new'),
    count(*) FILTER (WHERE d.change IN ('changed', 'back')),
    (SELECT count(*) FROM vanished)
  INTO new, changed, gone
  FROM diff d;

  UPDATE store_crawl_state c
  SET menu_hash = p_menu_hash,
      last_crawl_at = now(),
      last_change_at = CASE WHEN new + changed + gone > 0 OR c.menu_hash IS NULL THEN now() ELSE c.last_change_at END
  WHERE c.dispensary_id = p_dispensary_id;
  unchanged := false;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- analytics_refresh: recompute store_analytics in one transaction. Readers see the old rows or
-- the new ones, never a mix, and never wait (row locks only).
------------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION refresh_store_analytics() RETURNS TABLE (stores INTEGER, removed INTEGER) AS $$
BEGIN
  -- Two refreshes at once would only do the same work twice; the second waits for the first.
  PERFORM pg_advisory_xact_lock(hashtext('tq:store_analytics'));

  WITH listed AS (
    SELECT
      p.dispensary_id,
      count(*) AS products_listed,
      count(*) FILTER (WHERE p.in_stock) AS products_in_stock
    FROM products p
    WHERE p.gone_at IS NULL
    GROUP BY p.dispensary_id
  ),
  price_changes AS (
    SELECT
      h.dispensary_id,
      count(*) FILTER (WHERE h.observed_at > now() - INTERVAL '24 hours') AS day,
      count(*) AS week
    FROM product_history h
    WHERE h.change = 'changed'
      AND h.price IS DISTINCT FROM h.old_price
      AND h.observed_at > now() - INTERVAL '7 days'
    GROUP BY h.dispensary_id
  )
  INSERT INTO store_analytics AS a (
    dispensary_id, platform, products_listed, products_in_stock, price_changes_24h, price_changes_7d,
    last_success_at, last_change_at, refreshed_at)
  SELECT
    c.dispensary_id,
    c.platform,
    coalesce(l.products_listed, 0),
    coalesce(l.products_in_stock, 0),
    coalesce(pc.day, 0),
    coalesce(pc.week, 0),
    c.last_crawl_at,  -- store_menu sets it only for a menu stored (or found unchanged)
    c.last_change_at,
    now()
  FROM store_crawl_state c
  LEFT JOIN listed l ON l.dispensary_id = c.dispensary_id
  LEFT JOIN price_changes pc ON pc.dispensary_id = c.dispensary_id
  ORDER BY c.dispensary_id
  ON CONFLICT (dispensary_id) DO UPDATE
  SET platform = excluded.platform,
      products_listed = excluded.products_listed,
      products_in_stock = excluded.products_in_stock,
      price_changes_24h = excluded.price_changes_24h,
      price_changes_7d = excluded.price_changes_7d,
      last_success_at = excluded.last_success_at,
      last_change_at = excluded.last_change_at,
      refreshed_at = excluded.refreshed_at;
  GET DIAGNOSTICS stores = ROW_COUNT;

  DELETE FROM store_analytics a
  WHERE NOT EXISTS (SELECT 1 FROM store_crawl_state c WHERE c.dispensary_id = a.dispensary_id);
  GET DIAGNOSTICS removed = ROW_COUNT;
  RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

------------------------------------------------------------------------------------------------
-- Failures: Retry-After, and deferral.
------------------------------------------------------------------------------------------------
DROP FUNCTION IF EXISTS fail_task(INTEGER, VARCHAR, TEXT, BOOLEAN);

-- As before, plus p_retry_after: the server's Retry-After. The retry waits for the longer of it
-- (capped at a day) and the role's backoff.
CREATE OR REPLACE FUNCTION fail_task(
  p_task_id INTEGER,
  p_worker_id VARCHAR,
  p_error TEXT,
  p_retryable BOOLEAN DEFAULT true,
  p_retry_after INTERVAL DEFAULT NULL
) RETURNS TEXT AS $$
DECLARE
  v_again BOOLEAN;
  v_status TEXT;
BEGIN
  SELECT coalesce(p_retryable, true) AND t.retry_count < t.max_retries
  INTO v_again
  FROM worker_tasks t
  WHERE t.id = p_task_id
    AND t.worker_id = p_worker_id
    AND t.status IN ('claimed', 'running')
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;

  IF v_again THEN
    UPDATE worker_tasks t
    SET status = 'pending',
        retry_count = t.retry_count + 1,
        scheduled_for = now() + greatest(
          tq_retry_delay(t.role, t.retry_count),
          least(greatest(p_retry_after, INTERVAL '0'), INTERVAL '1 day')),
        worker_id = NULL,
        claimed_at = NULL,
        started_at = NULL,
        last_heartbeat_at = NULL,
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  ELSE
    UPDATE worker_tasks t
    SET status = 'failed',
        started_at = coalesce(t.started_at, t.claimed_at),
        completed_at = now(),
        error_message = coalesce(nullif(p_error, ''), 'unknown error')
    WHERE t.id = p_task_id
    RETURNING t.status INTO v_status;
  END IF;

  UPDATE worker_registry
  SET tasks_failed = tasks_failed + 1, last_heartbeat_at = now()
  WHERE worker_id = p_worker_id;
  RETURN v_status;
END;
$$ LANGUAGE plpgsql;

-- Gives a task back untried, due again after p_delay, without spending a retry: for work the
-- worker chose not to start (its platform's host is saturated or its circuit is open).
CREATE OR REPLACE FUNCTION defer_task(p_task_id INTEGER, p_worker_id VARCHAR, p_delay INTERVAL)
RETURNS BOOLEAN AS $$
BEGIN
  UPDATE worker_tasks t
  SET status = 'pending',
      scheduled_for = now() + least(greatest(coalesce(p_delay, INTERVAL '0'), INTERVAL '0'), INTERVAL '1 day'),
      worker_id = NULL,
      claimed_at = NULL,
      started_at = NULL,
      last_heartbeat_at = NULL
  WHERE t.id = p_task_id
    AND t.worker_id = p_worker_id
    AND t.status IN ('claimed', 'running');
  RETURN FOUND;
END;
$$ LANGUAGE plpgsql;
