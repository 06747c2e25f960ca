"""The demo's Dagster job and schedule: a resync of every store every 10 minutes, so that the demo
fleet keeps crawling, retrying and failing over on its first day (production resyncs daily).
tq_pipelines.definitions adds them when `tq dev` or `tq demo` serves the simulator."""

import dagster as dg

from tq_pipelines.defs.resources import QueueResource
from tq_pipelines_demo.fleet import enqueue_demo_resyncs


@dg.op(out=dg.Out(dg.Nothing))
def enqueue_demo_crawl(context: dg.OpExecutionContext, tq: QueueResource):
    """A product_resync for every crawlable store that has none pending or running."""
    created = enqueue_demo_resyncs(tq.queue)
    context.log.info("queued %s demo resyncs", created)
    return dg.Output(None, metadata={"created": dg.MetadataValue.int(created)})


@dg.job(executor_def=dg.in_process_executor, tags={"tq/kind": "demo"})
def demo_crawl_job() -> None:
    enqueue_demo_crawl()


demo_crawl_schedule = dg.ScheduleDefinition(
    name="demo_crawl_schedule",
    job=demo_crawl_job,
    cron_schedule="*/10 * * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
