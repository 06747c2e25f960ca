-- 0030: an unchanged menu is not checked product by product.
--
-- tq_store_menu checked every product of a menu (one pass over the JSON for the tables' rules,
-- one for duplicate ids) before it compared the menu's hash with the stored one. A resync finds
-- most menus unchanged, and then writes nothing of the products: only the crawl's time. The
-- checks now run where the products are written, after that comparison; what they refuse, and
-- how, is unchanged. The argument checks (a store, a hash, an array) still come first.

CREATE OR REPLACE FUNCTION tq_store_menu(p_dispensary_id integer, p_menu_hash text, p_products jsonb) RETURNS TABLE(unchanged boolean, seen integer, new integer, changed integer, gone integer)
    LANGUAGE plpgsql
    AS $$
DECLARE
  v_hash TEXT;
  v_bad RECORD;
  v_hint TEXT := 'products: a JSON array of {"id", "name", "category": text, "brand": text or null, '
    '"price": a number from 0 to 99999999.99, "thc", "cbd": null or a number from 0 to 100, '
    '"in_stock": true or false}, each id once (tq_pipelines.crawl.menu.normalise_menu makes them).';
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
    RAISE EXCEPTION 'store_menu: dispensary_id must be the id of a store: no store with id %',
      coalesce(p_dispensary_id::TEXT, 'NULL')
      USING ERRCODE = 'invalid_parameter_value', HINT = 'Give a dispensaries.id.';
  END IF;

  IF p_menu_hash IS NULL OR p_menu_hash = '' THEN
    PERFORM tq_refuse('store_menu', 'menu_hash', tq_shown(p_menu_hash), 'must not be empty',
      'The hash of the normalised menu (tq_pipelines.crawl.menu.menu_hash): an unchanged menu is skipped by it.');
  END IF;
  IF p_products IS NULL OR jsonb_typeof(p_products) <> 'array' THEN
    PERFORM tq_refuse('store_menu', 'products', tq_shown(p_products::TEXT), 'must be a JSON array', v_hint);
  END IF;
  seen := jsonb_array_length(p_products);
  IF v_hash IS NOT DISTINCT FROM p_menu_hash THEN
    UPDATE store_crawl_state c SET last_crawl_at = now() WHERE c.dispensary_id = p_dispensary_id;
    unchanged := true; new := 0; changed := 0; gone := 0;
    RETURN NEXT;
    RETURN;
  END IF;

  -- The first product the tables would refuse (NOT NULL, numeric(10, 2), a price below 0), by
  -- its place and id, before anything is written. Checked only where the menu is written: an
  -- unchanged menu (most of a resync) writes none of its products (0030).
  SELECT x.n - 1 AS n, x.p ->> 'id' AS id, p.problem
  INTO v_bad
  FROM jsonb_array_elements(p_products) WITH ORDINALITY AS x (p, n)
  CROSS JOIN LATERAL (SELECT CASE
    WHEN jsonb_typeof(x.p) <> 'object' THEN 'is not a JSON object'
    WHEN NOT tq_json_text(x.p -> 'id') THEN 'has no id'
    WHEN NOT tq_json_text(x.p -> 'name') THEN 'has no name'
    WHEN NOT tq_json_text(x.p -> 'category') THEN 'has no category'
    WHEN jsonb_typeof(x.p -> 'brand') <> 'null' AND NOT tq_json_text(x.p -> 'brand')
      THEN 'has a brand that is not text'
    WHEN NOT tq_json_number_between(x.p -> 'price', 0, 99999999.99)
      THEN format('has price %s', coalesce(x.p ->> 'price', 'missing'))
    WHEN jsonb_typeof(x.p -> 'thc') <> 'null' AND NOT tq_json_number_between(x.p -> 'thc', 0, 100)
      THEN format('has thc %s', x.p ->> 'thc')
    WHEN jsonb_typeof(x.p -> 'cbd') <> 'null' AND NOT tq_json_number_between(x.p -> 'cbd', 0, 100)
      THEN format('has cbd %s', x.p ->> 'cbd')
    WHEN jsonb_typeof(x.p -> 'in_stock') IS DISTINCT FROM 'boolean'
      THEN format('has in_stock %s', coalesce(x.p ->> 'in_stock', 'missing'))
  END) AS p (problem)
  WHERE p.problem IS NOT NULL
  ORDER BY x.n
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'store_menu: every product needs an id, a name, a category, a price and in_stock: '
      'product #% (id %) %', v_bad.n, tq_shown(v_bad.id), v_bad.problem
      USING ERRCODE = 'invalid_parameter_value', HINT = v_hint;
  END IF;
  IF EXISTS (
    SELECT 1
    FROM jsonb_to_recordset(p_products) AS x (id TEXT)
    GROUP BY x.id
    HAVING x.id IS NULL OR count(*) > 1
  ) THEN
    RAISE EXCEPTION 'store_menu: every product needs an id, and each id once: %', (
        SELECT string_agg(tq_shown(x.id), ', ' ORDER BY x.id)
        FROM (SELECT y.id FROM jsonb_to_recordset(p_products) AS y (id TEXT) GROUP BY y.id HAVING count(*) > 1) x
      )
      USING ERRCODE = 'invalid_parameter_value', HINT = v_hint;
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
$$;

CALL tq_secure_functions();
