"""Database plumbing: where the server is, named queries, migrations, the embedded server."""

import os

from tq_pipelines.db import embedded


def database_url() -> str:
    """``TQ_DATABASE_URL`` when set, else the embedded server (started if it is not running)."""
    return os.environ.get("TQ_DATABASE_URL") or embedded.start()
