"""With no TQ_DATABASE_URL, commands that only read use the embedded database only when it is
running: they never start one (nobody would stop it). `tq db start` starts it for them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TQ = str(Path(sys.executable).with_name("tq"))


def tq(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``tq`` with its embedded server's data under ``home`` (TQ_HOME) and no database configured."""
    env = {**os.environ, "TQ_HOME": str(home)}
    for name in ("TQ_DATABASE_URL", "TQ_PLATFORMS_FILE"):
        env.pop(name, None)
    return subprocess.run(
        [TQ, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "args", [["status"], ["platforms"], ["prune", "--dry-run"], ["db", "url"]], ids=" ".join
)
def test_a_read_only_command_says_the_embedded_database_is_not_running(tmp_path: Path, args: list[str]):
    home = tmp_path / "tq"
    done = tq(*args, home=home)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.strip() == (
        f"tq {args[0]}: the embedded database is not running (no server on {home / 'pgdata'}): "
        "start it with `make dev` or `tq db start`, or set TQ_DATABASE_URL"
    )
    assert not (home / "pgdata").exists()


def test_tq_db_start_starts_it_and_a_read_only_command_then_uses_it(tmp_path: Path):
    home = tmp_path / "tq"
    try:
        started = tq("db", "start", home=home)
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert url.startswith("postgresql://"), url
        assert (home / "pgdata" / "postmaster.pid").is_file()
        assert tq("db", "url", home=home).stdout.strip() == url
        # Reached, not refused: the database is there, its schema is not (yet).
        status = tq("status", home=home)
        assert status.returncode == 2
        assert 'relation "v_worker_capacity" does not exist' in status.stderr, status.stderr
    finally:
        stopped = tq("db", "stop", home=home)
    assert stopped.stdout.strip() == "stopped"
    assert tq("status", home=home).stderr.startswith("tq status: the embedded database is not running")
