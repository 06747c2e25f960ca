"""The demo fleet of `tq dev`: a menu simulator serving three platforms, and its seeding. Not
part of the queue or the crawl: production code never imports it."""
