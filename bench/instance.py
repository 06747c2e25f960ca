"""The Dagster instance a bench's drain runs execute in: ephemeral, logging as deployed."""

from pathlib import Path

import dagster as dg
import yaml

ROOT = Path(__file__).resolve().parents[1]


def deployed_instance() -> dg.DagsterInstance:
    """An ephemeral instance with the ``python_logs`` of the project's dagster.yaml: a run's
    ``context.log`` keeps what a deployed run keeps (INFO up), and a bench does not time the
    storing of every task's DEBUG line, which a deployed run drops."""
    settings = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    return dg.DagsterInstance.ephemeral(settings={"python_logs": settings["python_logs"]})
