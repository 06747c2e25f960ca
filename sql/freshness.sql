-- Store freshness (tq_pipelines/freshness.py): per platform, the stores the crawl should keep
-- fresh and those whose menu is older than the SLA. Read by the store_freshness asset and by the
-- stale-menu alert of queue_health_sensor, so it is one pass over the stores.

-- name: store_freshness
-- A store counts when it is enabled, has a platform and was not answered 404/410 (gone): the
-- stores a resync or their entry_point_discovery would crawl. store_crawl_state.last_crawl_at is
-- set only when a menu is stored or found unchanged (store_menu): the last successful crawl, read
-- live rather than from store_analytics, which is as old as its last refresh. A store never
-- crawled counts as stale once it was listed or resolved longer ago than the SLA; one with no
-- such time (added by hand and never touched by the crawl) is counted as never crawled only,
-- as there is no moment to measure the SLA from.
-- Both tables are read whole (an aggregate over every enabled store), each once, joined on the
-- store's key: a hash join of two sequential scans, about 10 ms for 10,000 stores.
WITH cutoff AS (
  -- Computed once, not once per store.
  SELECT now() - %(sla_hours)s * INTERVAL '1 hour' AS at
),
stores AS (
  SELECT
    d.menu_type AS platform,
    c.last_crawl_at,
    coalesce(c.last_crawl_at, least(c.first_listed_at, c.resolved_at)) < cutoff.at AS stale
  FROM dispensaries d
  CROSS JOIN cutoff
  LEFT JOIN store_crawl_state c ON c.dispensary_id = d.id
  WHERE d.crawl_enabled
    AND d.menu_type IS NOT NULL
    AND c.gone_at IS NULL
)
SELECT
  s.platform,
  count(*) AS enabled,
  count(*) FILTER (WHERE s.stale) AS stale,
  count(*) FILTER (WHERE s.last_crawl_at IS NULL) AS never_crawled,
  count(*) FILTER (WHERE s.stale AND s.last_crawl_at IS NULL) AS stale_never_crawled,
  min(s.last_crawl_at) AS oldest_crawl_at,
  now() AS measured_at
FROM stores s
GROUP BY s.platform
ORDER BY s.platform;
