"""`tq` as an operator runs it: each bad input and each database it cannot use ends, within
seconds, as one line on stderr (``tq <command>: <reason>``) and exit code 2, never a traceback.

Every run is a real subprocess of the installed console script (or ``python -m tq_pipelines``)
with TQ_DATABASE_URL set, so the embedded server is never started.
"""

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.helpers import add_stores
from tq_pipelines.queue.api import RESYNC_DAYS_AHEAD, RESYNC_DAYS_BACK

ROOT = Path(__file__).resolve().parents[2]
TQ = [str(Path(sys.executable).with_name("tq"))]
MODULE = [sys.executable, "-m", "tq_pipelines"]
CLOSED_PORT = "postgresql://tq:s3cr3t-pw@127.0.0.1:1/queue"
# A correctness bound (the check gives up after 5 s), with room for a loaded CI machine.
BOUND_SECONDS = 8.0
TODAY = datetime.now(UTC).date()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def line(self) -> str:
        """The one line on stderr (asserts there is exactly one, and no traceback)."""
        assert "Traceback" not in self.stderr, self.stderr
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        return lines[0]


def tq(*args: str, url: str, entry: list[str] = TQ, timeout: float = 60) -> Run:
    env = {**os.environ, "TQ_DATABASE_URL": url}
    env.pop("TQ_PLATFORMS_FILE", None)
    started = time.monotonic()
    proc = subprocess.run(
        [*entry, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def refused(run: Run, command: str) -> str:
    """The run failed as it should: exit 2, one line on stderr naming the command; its reason."""
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    line = run.line
    assert line.startswith(f"tq {command}: "), line
    return line.removeprefix(f"tq {command}: ")


def task_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM worker_tasks").fetchone()[0]


# -- arguments refused as they are parsed ------------------------------------------------------

PARSE_ERRORS = [
    (["generate", "--date", "0001-01-01"], "--date", "0001-01-01"),
    (["generate", "--date", "2026-13-01"], "--date", "2026-13-01"),
    (
        ["generate", "--date", (TODAY + timedelta(days=RESYNC_DAYS_AHEAD + 1)).isoformat()],
        "--date",
        "outside",
    ),
    (["generate", "--date", (TODAY - timedelta(days=RESYNC_DAYS_BACK + 1)).isoformat()], "--date", "outside"),
    (["generate", "--batches", "0"], "--batches", "1 to 24"),
    (["generate", "--batches", "25"], "--batches", "1 to 24"),
    (["generate", "--batches", "six"], "--batches", "'six'"),
    (["generate", "--platform", ""], "--platform", "''"),
    (["generate", "--platform", "   "], "--platform", "'   '"),
    (["generate", "--platform", "p" * 51], "--platform", "1 to 50 characters"),
    (["recover", "--threshold-minutes", "99999999999"], "--threshold-minutes", "99999999999"),
    (["recover", "--threshold-minutes", "0"], "--threshold-minutes", "1 to 10080"),
    (["dev", "--port", "0"], "--port", "1 to 65535"),
    (["dev", "--port", "70000"], "--port", "70000"),
    (["dev", "--demo-stores", "0"], "--demo-stores", "1 to 10000"),
    (["demo", "--stores", "-5"], "--stores", "-5"),
    (["db", "restart"], "action", "restart"),
]


@pytest.mark.parametrize(
    ("args", "argument", "value"), [pytest.param(a, n, v, id=" ".join(a)[:40]) for a, n, v in PARSE_ERRORS]
)
def test_a_bad_argument_is_one_line_before_anything_runs(args: list[str], argument: str, value: str):
    # The database is unreachable: a reason about the argument proves nothing was tried first.
    reason = refused(tq(*args, url=CLOSED_PORT), args[0])
    assert reason.startswith(f"argument {argument}: "), reason
    assert value in reason, reason
    assert "cannot connect" not in reason


@pytest.mark.parametrize(
    "args",
    [["generate", "--date", "0001-01-01"], ["recover", "--threshold-minutes", "99999999999"], ["status"]],
    ids=" ".join,
)
def test_python_m_tq_pipelines_ends_the_same_way(args: list[str]):
    by_script, by_module = tq(*args, url=CLOSED_PORT), tq(*args, url=CLOSED_PORT, entry=MODULE)
    assert refused(by_module, args[0]) == refused(by_script, args[0])


def test_platforms_sync_without_a_file_is_one_line():
    reason = refused(tq("platforms", "--sync", url=CLOSED_PORT), "platforms")
    assert "TQ_PLATFORMS_FILE" in reason


# -- the queue's refusals, in the database's words ----------------------------------------------


def test_generate_for_an_unknown_platform_fails_in_the_databases_words(db_url: str, conn: psycopg.Connection):
    add_stores(conn, 3)
    reason = refused(tq("generate", "--platform", "dutchi", url=db_url), "generate")
    assert "platforms must name only known platforms (unknown: 'dutchi')" in reason
    assert "Known platforms: dutchie." in reason  # the hint
    assert task_count(db_url) == 0
    done = tq("generate", "--platform", "dutchie", url=db_url)
    assert (done.returncode, done.stderr) == (0, "")
    assert task_count(db_url) == 3


def test_generate_on_a_database_without_stores_says_no_platform_is_known(db_url: str):
    reason = refused(tq("generate", url=db_url), "generate")
    assert "unknown: 'dutchie'" in reason and "No platform is known yet." in reason


def test_an_unmigrated_database_is_named_as_such(empty_db_url: str):
    reason = refused(tq("status", url=empty_db_url), "status")
    assert 'relation "v_worker_capacity" does not exist' in reason
    assert "tq migrate" in reason


def test_a_migration_error_is_one_line(empty_db_url: str):
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE tq_migrations (version TEXT PRIMARY KEY, name TEXT, checksum TEXT)")
        conn.execute("INSERT INTO tq_migrations VALUES ('9999', 'from_the_future', 'x')")
    reason = refused(tq("migrate", url=empty_db_url), "migrate")
    assert "9999_from_the_future.sql" in reason


def test_a_platforms_file_that_cannot_be_read_is_one_line(db_url: str, tmp_path: Path):
    missing = tmp_path / "nowhere.toml"
    reason = refused(tq("platforms", "--sync", "--file", str(missing), url=db_url), "platforms")
    assert str(missing) in reason


# -- a database that cannot be used: within 5 s, libpq's reason, the password masked -------------


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: what a hung server or a firewall that
    swallows packets looks like to a client (libpq waits for its connect_timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for s in accepted:
        s.close()
    listener.close()


def unreachable_urls(pg_server: str) -> dict[str, tuple[str, str]]:
    """Per way of failing: a URL (each with a password, which must not be printed) and the words
    of libpq's reason."""
    server = conninfo_to_dict(pg_server)
    role = f"tq_no_such_role_{uuid.uuid4().hex[:8]}"
    database = f"tq_no_such_db_{uuid.uuid4().hex[:8]}"
    return {
        "closed-port": (CLOSED_PORT, "Connection refused"),
        "unknown-role": (
            make_conninfo(pg_server, user=role, password="s3cr3t-pw"),
            f'role "{role}" does not exist',
        ),
        "unknown-host": (
            make_conninfo(pg_server, host="nohost.invalid", password="s3cr3t-pw"),
            "nohost.invalid",
        ),
        "unknown-database": (
            make_conninfo(
                pg_server, dbname=database, password="s3cr3t-pw", user=server.get("user") or "postgres"
            ),
            f'database "{database}" does not exist',
        ),
    }


WAYS = ["closed-port", "unknown-role", "unknown-host", "unknown-database"]
COMMANDS = [["status"], ["generate"], ["recover"], ["migrate"]]
UNREACHABLE = [(c, w) for c in COMMANDS for w in WAYS] + [
    (c, "closed-port")
    for c in (["platforms"], ["platforms", "--sync", "--file", "x.toml"], ["demo", "--seed"])
]


@pytest.mark.parametrize(
    ("args", "how"), [pytest.param(c, w, id=f"{' '.join(c)}-{w}") for c, w in UNREACHABLE]
)
def test_a_database_that_cannot_be_used_is_one_line_within_seconds(pg_server: str, args: list[str], how: str):
    url, words = unreachable_urls(pg_server)[how]
    run = tq(*args, url=url)
    reason = refused(run, args[0])
    assert run.seconds < BOUND_SECONDS, run.seconds
    assert reason.startswith("cannot connect to the database TQ_DATABASE_URL = "), reason
    assert words in reason, reason
    assert "s3cr3t-pw" not in run.stderr + run.stdout


def test_a_server_that_never_answers_is_given_up_on_after_5_seconds(silent_server: int):
    """Before, the pool waited 30 s and ended in a PoolTimeout traceback."""
    run = tq("status", url=f"postgresql://tq:s3cr3t-pw@127.0.0.1:{silent_server}/queue")
    reason = refused(run, "status")
    # The check's own 5 s, plus the bound the other cases get for starting the interpreter.
    assert run.seconds < 5 + BOUND_SECONDS, run.seconds
    assert "timeout" in reason.lower(), reason
    assert "s3cr3t-pw" not in run.stderr
