"""The queue and crawl resources the code location binds, in one place: a job resolved on its own
(generate_resync_tasks_job) keeps the resources it was resolved with, so it must be given these."""

import dagster as dg

from tq_pipelines.defs.resources import CrawlResource, QueueResource

queue_resource = QueueResource(database_url=dg.EnvVar("TQ_DATABASE_URL"))
crawl_resource = CrawlResource()
