"""`tq grant` and `tq prune` as an operator runs them: the worker role grant makes can claim and
complete through the queue's functions only; prune counts, deletes in batches and refuses bad horizons."""

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.helpers import add_stores, add_tasks

ROOT = Path(__file__).resolve().parents[2]
TQ = str(Path(sys.executable).with_name("tq"))


def tq(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TQ, *args],
        cwd=ROOT,
        env={**os.environ, "TQ_DATABASE_URL": url, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def drop_roles(pg_server: str, db_url: str, names: list[str]) -> None:
    """Give back what the roles own or hold in the test's database, then drop them."""
    owner = conninfo_to_dict(pg_server).get("user") or "postgres"
    with psycopg.connect(db_url, autocommit=True) as conn:
        for name in names:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(
                    sql.SQL("REASSIGN OWNED BY {} TO {}").format(sql.Identifier(name), sql.Identifier(owner))
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def worker_role(pg_server: str, db_url: str) -> Iterator[str]:
    name = f"tq_cliworker_{uuid.uuid4().hex[:10]}"
    yield name
    drop_roles(pg_server, db_url, [name])


@pytest.fixture
def admin_role(pg_server: str, db_url: str) -> Iterator[str]:
    """The queue's owner: tq grant refuses a worker while the queue's functions are a superuser's."""
    name = f"tq_cliadmin_{uuid.uuid4().hex[:10]}"
    yield name
    drop_roles(pg_server, db_url, [name])


def test_tq_grant_makes_a_worker_that_drains_through_the_functions_only(
    db_url: str, worker_role: str, admin_role: str
):
    secret = f"pw-{uuid.uuid4().hex}"
    done = tq(
        "grant",
        "--worker-role",
        worker_role,
        "--admin-role",
        admin_role,
        "--worker-password-env",
        "TQ_W_PW",
        url=db_url,
        TQ_W_PW=secret,
    )
    assert done.returncode == 0, done.stderr
    assert worker_role in done.stdout
    assert secret not in done.stdout + done.stderr
    with psycopg.connect(db_url, autocommit=True) as conn:
        add_tasks(conn, "product_resync", add_stores(conn, 2), 1)
        # Only the SCRAM verifier of the password reached the server.
        stored = conn.execute(
            "SELECT rolpassword FROM pg_authid WHERE rolname = %s", (worker_role,)
        ).fetchone()
        assert stored is not None and stored[0].startswith("SCRAM-SHA-256$")

    with psycopg.connect(make_conninfo(db_url, user=worker_role), autocommit=True) as worker:
        worker.execute("SELECT register_worker('w1', 'product_resync', NULL, NULL, 30)")
        claimed = worker.execute(
            "SELECT (c.task).id, c.lease FROM claim_tasks('product_resync', 'w1', 10) c"
        ).fetchall()
        assert len(claimed) == 2
        ok = worker.execute("SELECT complete_task(%s, %s, '{}')", claimed[0]).fetchone()
        assert ok == (True,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            worker.execute("UPDATE worker_tasks SET status = 'completed' WHERE id = %s", (claimed[1][0],))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            worker.execute("TRUNCATE worker_tasks")
    with psycopg.connect(db_url, autocommit=True) as conn:
        statuses = dict(conn.execute("SELECT id, status FROM v_tasks").fetchall())
    assert statuses == {claimed[0][0]: "completed", claimed[1][0]: "claimed"}


def test_tq_grant_refuses_a_password_variable_that_is_not_set(db_url: str, worker_role: str):
    done = tq("grant", "--worker-role", worker_role, "--worker-password-env", "TQ_UNSET_PW", url=db_url)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "tq grant: --worker-password-env TQ_UNSET_PW: that environment variable is unset or empty"
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (worker_role,)).fetchone() is None


def test_tq_prune_counts_then_deletes_old_finished_tasks_and_refuses_a_bad_horizon(db_url: str):
    with psycopg.connect(db_url, autocommit=True) as conn:
        stores = add_stores(conn, 3)
        conn.execute(
            """
            INSERT INTO worker_tasks (role, dispensary_id, platform, status, created_at, completed_at)
            SELECT 'product_resync', s, 'dutchie', 'completed', now() - make_interval(days => d),
                   now() - make_interval(days => d)
            FROM unnest(%s::int[]) AS s CROSS JOIN (VALUES (40), (2)) AS ages(d)
            """,
            (stores,),
        )

    def old_and_young() -> tuple[int, int]:
        with psycopg.connect(db_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE completed_at < now() - interval '30 days'),"
                " count(*) FILTER (WHERE completed_at >= now() - interval '30 days') FROM v_tasks"
            ).fetchone()
        assert row is not None
        return row[0], row[1]

    refused = tq("prune", "--tasks-days", "0", url=db_url)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("tq prune: tasks_days must be from 1"), refused.stderr
    counted = tq("prune", "--dry-run", url=db_url)
    assert counted.returncode == 0, counted.stderr
    assert "would delete" in counted.stdout and old_and_young() == (3, 3)
    pruned = tq("prune", "--batch-size", "2", url=db_url)
    assert pruned.returncode == 0, pruned.stderr
    worker_tasks_line = next(line for line in pruned.stdout.splitlines() if line.startswith("worker_tasks"))
    assert "deleted          3 rows in     2 batches" in worker_tasks_line
    assert old_and_young() == (0, 3)


def test_tq_platforms_loads_pauses_and_resumes_as_the_admin_and_the_worker_may_not(
    db_url: str, tmp_path: Path, worker_role: str, admin_role: str
):
    """The admin's acts from a shell: limits and hosts loaded from the platforms file, a pause by
    hand and its end. As the worker role each is refused in one line, and nothing changes."""
    path = tmp_path / "platforms.toml"
    path.write_text(
        '[platforms.dutchie]\nbase_url = "https://menus.example.com/dutchie"\nmax_in_flight = 3\n'
        'requests_per_second = 7\nhosts = ["menus.example.com", "cdn.example.com"]\n'
    )
    state = (
        "SELECT max_in_flight, requests_per_second, hosts, paused_until IS NOT NULL, pause_reason "
        "FROM tq_platforms"
    )
    loaded = tq("platforms", "--sync", "--file", str(path), url=db_url)
    assert loaded.returncode == 0, loaded.stderr
    assert "1 platform(s) changed" in loaded.stdout
    paused = tq("platforms", "--pause", "dutchie=120", "--reason", "their maintenance", url=db_url)
    assert paused.returncode == 0, paused.stderr
    assert "dutchie paused until" in paused.stdout and "their maintenance" in paused.stdout
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute(state).fetchall() == [
            (3, 7, ["cdn.example.com", "menus.example.com"], True, "their maintenance")
        ]

    tq("grant", "--worker-role", worker_role, "--admin-role", admin_role, url=db_url).check_returncode()
    as_worker = make_conninfo(db_url, user=worker_role)
    with psycopg.connect(db_url, autocommit=True) as conn:
        before = conn.execute(state).fetchall()
    path.write_text(path.read_text().replace("max_in_flight = 3", "max_in_flight = 200"))
    for args in (
        ("--sync", "--file", str(path)),
        ("--resume", "dutchie"),
        ("--pause", "dutchie=86400"),
    ):
        refused = tq("platforms", *args, url=as_worker)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "the admin's acts" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, args
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute(state).fetchall() == before

    resumed = tq("platforms", "--resume", "dutchie", url=db_url)
    assert resumed.returncode == 0, resumed.stderr
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute("SELECT paused_until FROM tq_platforms").fetchone() == (None,)
    bad = tq("platforms", "--pause", "dutchie=0", url=db_url)
    assert bad.returncode == 2 and "SECONDS from 1 to 86400" in bad.stderr
