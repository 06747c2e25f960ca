-- The stores the queue works on. A deployment that already has a dispensaries table keeps its own:
-- the queue reads only id, name, menu_type, platform_dispensary_id and crawl_enabled.
CREATE TABLE IF NOT EXISTS dispensaries (
  id SERIAL PRIMARY KEY,
  name TEXT NOT NULL,
  menu_type VARCHAR(50),                -- the store's platform: dutchie, jane, treez, ...
  platform_dispensary_id TEXT,          -- the store's id on its platform; NULL until resolved
  crawl_enabled BOOLEAN NOT NULL DEFAULT true,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
