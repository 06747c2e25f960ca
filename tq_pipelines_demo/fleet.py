"""The demo fleet: the menu simulator on 127.0.0.1, a platforms file pointing at it, and the first
store_discovery tasks. `tq demo` runs it alone; `tq dev` runs it beside Dagster."""

from dataclasses import dataclass
from pathlib import Path

from tq_pipelines.crawl.handlers import enqueue_store_discovery
from tq_pipelines.crawl.platforms import load_platform_settings, sync_limits
from tq_pipelines.db.queries import query
from tq_pipelines.queue.api import TaskQueue
from tq_pipelines_demo.simulator import Simulator, demo_profiles


@dataclass
class DemoFleet:
    simulator: Simulator
    platforms_file: Path

    def stop(self) -> None:
        self.simulator.stop()


def start_demo(folder: Path, *, stores_per_platform: int = 100, seed: int = 7) -> DemoFleet:
    """Serve the three demo platforms and write ``folder/platforms.toml`` for them."""
    simulator = Simulator(demo_profiles(stores_per_platform, seed)).start()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "platforms.toml"
    # Limits low enough to see politeness at work in the run metadata, high enough to be quick.
    path.write_text(
        "# Written by the demo at each start: the simulator's ports change.\n"
        + simulator.platforms_toml(max_in_flight=4, requests_per_second=20, timeout_seconds=5)
    )
    return DemoFleet(simulator, path)


def seed_demo(database_url: str, fleet: DemoFleet) -> int:
    """Load the demo platforms' limits and queue store_discovery for every platform and region;
    returns the tasks created."""
    settings = load_platform_settings(fleet.platforms_file)
    with TaskQueue.connect(database_url) as queue:
        sync_limits(queue, settings)
        return enqueue_store_discovery(queue, settings)


def enqueue_demo_resyncs(queue: TaskQueue) -> int:
    """A product_resync for every crawlable store with none pending or running (the demo's
    crawl schedule); returns how many were created."""
    with queue.pool.connection() as conn:
        return conn.execute(query("enqueue_demo_resyncs")).rowcount
