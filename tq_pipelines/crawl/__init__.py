"""Crawling: platform adapters over polite HTTP, menu normalisation and the role handlers. Knows
nothing of Dagster (the menu simulator the demo and the tests crawl is tq_pipelines_demo's)."""
