"""The queue core: TaskQueue (api), the Worker loop (worker), retention and redaction. Plain
Python over PostgreSQL; nothing here imports Dagster."""
