-- An analyst's scan of the queue's tables runs in one process.
--
-- A full scan of worker_tasks (a count, a report over its history) plans as a parallel scan
-- once the table passes min_parallel_table_scan_size (8 MB): the backend and up to
-- max_parallel_workers_per_gather (2) workers, three cores for one query, taken from the
-- drain runs that share the server (docs/BENCHMARKS.md, "Analysts' scans in one process").
-- With parallel_workers = 0 no plan over these tables is parallel: such a scan takes one core
-- however large the table, and waits longer for its answer. The claim, the enqueue and the
-- completions read a few rows each through indexes, where no parallel plan is chosen; the
-- project's one full scan of its own, the lineage sensor's row count of worker_tasks, now
-- takes one core too. An operator who would rather give a report the cores can take the
-- setting back on a table: ALTER TABLE worker_tasks RESET (parallel_workers).

ALTER TABLE worker_tasks SET (parallel_workers = 0);
ALTER TABLE worker_task_heads SET (parallel_workers = 0);
ALTER TABLE worker_task_stores SET (parallel_workers = 0);
ALTER TABLE worker_registry SET (parallel_workers = 0);
ALTER TABLE worker_tallies SET (parallel_workers = 0);
ALTER TABLE worker_task_floors SET (parallel_workers = 0);
ALTER TABLE tq_platforms SET (parallel_workers = 0);
ALTER TABLE task_completion_log SET (parallel_workers = 0);
