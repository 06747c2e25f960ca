"""Crawling: platform adapters over polite HTTP, menu normalisation, the role handlers, and a
menu simulator for the demo and the tests. Knows nothing of Dagster."""
