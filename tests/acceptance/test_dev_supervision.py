"""`tq dev` as a developer runs it, on a real database and a real Dagster instance: the daemon
killed -9 comes back while the webserver keeps answering, and SIGTERM stops every process; a
process that dies at every start ends it with one line, and a port already taken is refused first."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[2]
TQ = str(Path(sys.executable).with_name("tq"))
T = TypeVar("T")
DAEMON_HEALTH = (
    "{ instance { daemonHealth { allDaemonStatuses { daemonType required lastHeartbeatTime } } } }"
)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    started: int  # clock ticks after boot: tells a pid apart from a later process with the same number

    @property
    def cmdline(self) -> str:
        try:
            return Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""


def processes() -> dict[int, Proc]:
    """Every process on the machine, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(entry.name)] = Proc(int(entry.name), int(fields[1]), fields[0], int(fields[19]))
    return found


def descendants(pid: int) -> list[Proc]:
    table = processes()
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for proc in table.values():
            if proc.ppid == parent:
                found.append(proc)
                todo.append(proc.pid)
    return found


def running(proc: Proc) -> bool:
    now = processes().get(proc.pid)
    return now is not None and now.started == proc.started and now.state not in ("Z", "X")


def started_for(home: Path) -> list[Proc]:
    """The running processes whose environment names ``home`` as DAGSTER_HOME: whatever tq dev
    started, however deep, orphans included."""
    marker = b"\0DAGSTER_HOME=" + str(home).encode() + b"\0"
    found = []
    for proc in processes().values():
        try:
            environ = b"\0" + Path(f"/proc/{proc.pid}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ and proc.state not in ("Z", "X"):
            found.append(proc)
    return found


def children_named(pid: int, name: str) -> list[Proc]:
    return [p for p in descendants(pid) if p.ppid == pid and name in p.cmdline]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status, response.read()


def heartbeats(base: str) -> dict[str, float | None]:
    """Each required daemon's last heartbeat (epoch seconds), as the webserver reads it."""
    _, body = get(f"{base}/graphql", {"query": DAEMON_HEALTH})
    statuses = json.loads(body)["data"]["instance"]["daemonHealth"]["allDaemonStatuses"]
    return {s["daemonType"]: s["lastHeartbeatTime"] for s in statuses if s["required"]}


def wait_for(what: str, check: Callable[[], T], timeout: float, tq_dev: subprocess.Popen, log: Path) -> T:
    """``check()``'s first truthy result within ``timeout`` seconds; fails early if tq dev ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert tq_dev.poll() is None, (
            f"tq dev ended ({tq_dev.returncode}) before {what}:\n{log.read_text()[-4000:]}"
        )
        try:
            result = check()
        except (OSError, KeyError, TypeError):  # not answering yet (URLError is an OSError)
            pass
        else:
            if result:
                return result
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture
def dagster_database(db_url: str, pg_server: str) -> Iterator[str]:
    """The name of the database tq dev creates for Dagster's runs and events, dropped after."""
    name = f"{conninfo_to_dict(db_url)['dbname']}_dagster"
    yield name
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def dev_home(tmp_path: Path) -> Path:
    """A DAGSTER_HOME of the checkout's dagster.yaml and workspace.yaml, so nothing is written
    into the checkout."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    for name in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(ROOT / name, home / name)
    return home


def dev_env(db_url: str, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "TQ_DATABASE_URL": db_url, "TQ_HOME": str(tmp_path / "tq")}
    for name in ("TQ_PLATFORMS_FILE", "TQ_ROLE_CAPS", "TQ_DAGSTER_DATABASE_URL", "DAGSTER_HOME"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_a_killed_daemon_comes_back_and_sigterm_stops_everything(
    db_url: str, dagster_database: str, tmp_path: Path
):
    home = dev_home(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dev_env(db_url, tmp_path)
    log = tmp_path / "tq_dev.log"
    seen: dict[int, Proc] = {}
    with log.open("wb") as out:
        tq_dev = subprocess.Popen(
            [TQ, "dev", "--home", str(home), "--no-demo", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for("webserver", lambda: get(f"{base}/server_info")[0] == 200, 180, tq_dev, log)
        first = wait_for(
            "heartbeats of every daemon",
            lambda: (beats := heartbeats(base)) and all(beats.values()) and beats,
            180,
            tq_dev,
            log,
        )
        assert {"SENSOR", "SCHEDULER", "QUEUED_RUN_COORDINATOR"} <= set(first), first
        [webserver] = children_named(tq_dev.pid, "dagster-webserver")
        [daemon] = children_named(tq_dev.pid, "dagster-daemon")
        # The daemon's own code server is among them: it must be gone too at the end.
        seen |= {p.pid: p for p in descendants(tq_dev.pid)}
        assert any(p.ppid == daemon.pid for p in seen.values()), [p.cmdline for p in seen.values()]

        failures: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    status, _ = get(f"{base}/server_info")
                    if status != 200:
                        failures.append(f"HTTP {status}")
                except OSError as exc:
                    failures.append(repr(exc))
                stop.wait(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        killed_at = time.time()
        os.kill(daemon.pid, signal.SIGKILL)

        [new_daemon] = wait_for(
            "new daemon",
            lambda: [p for p in children_named(tq_dev.pid, "dagster-daemon") if p.pid != daemon.pid],
            60,
            tq_dev,
            log,
        )
        beats = wait_for(
            "heartbeats of the new daemon",
            lambda: (b := heartbeats(base)) and all((t or 0) > killed_at for t in b.values()) and b,
            180,
            tq_dev,
            log,
        )
        stop.set()
        watcher.join()
        assert set(beats) == set(first)
        assert failures == [], failures
        # The same process (pid and start time; its run state comes and goes).
        assert running(webserver) and [
            (p.pid, p.started) for p in children_named(tq_dev.pid, "dagster-webserver")
        ] == [(webserver.pid, webserver.started)]
        output = log.read_text()
        assert f"dagster-daemon (pid {daemon.pid}) died after" in output, output[-4000:]
        assert "killed by SIGKILL; restarting it" in output
        assert f"dagster-daemon restarted (pid {new_daemon.pid})" in output

        seen |= {p.pid: p for p in descendants(tq_dev.pid)}
        tq_dev.send_signal(signal.SIGTERM)
        assert tq_dev.wait(timeout=90) == 0, log.read_text()[-4000:]
        left = [f"{p.pid} {p.cmdline}" for p in seen.values() if running(p)]
        assert left == [], left
        assert started_for(home) == []
        output = log.read_text()
        assert output.count("tq dev: stopping") == 1
        # The console is INFO and up, without Dagster's beta warnings.
        assert "DEBUG" not in output and "BetaWarning" not in output
    finally:
        if tq_dev.poll() is None:
            tq_dev.kill()
            tq_dev.wait()
        for proc in [*seen.values(), *started_for(home)]:
            if running(proc):
                os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_process_that_dies_at_every_start_stops_tq_dev_with_one_line(
    db_url: str, dagster_database: str, tmp_path: Path
):
    home = dev_home(tmp_path)
    (home / "dagster.yaml").write_text("storage: [\n")  # no instance can load this
    try:
        done = subprocess.run(
            [TQ, "dev", "--home", str(home), "--no-demo", "--port", str(free_port())],
            cwd=tmp_path,
            env=dev_env(db_url, tmp_path),
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 2, done.stdout[-4000:] + done.stderr
        [line] = done.stderr.strip().splitlines()
        assert re.fullmatch(
            r"tq dev: dagster-(daemon|webserver) died 3 times in a row within 30 s of starting "
            r"\(last: exit code 1\); not restarting it \(its output is above\)",
            line,
        ), line
        name = line.split()[2]
        assert f"{name} restarted" in done.stdout
        assert "restarting it in 1 s" in done.stdout and "restarting it in 3 s" in done.stdout
        assert "yaml" in done.stdout  # the reason each time, from the process itself
        assert started_for(home) == []
    finally:
        for proc in started_for(home):
            os.kill(proc.pid, signal.SIGKILL)


def test_a_port_already_taken_is_one_line_before_anything_starts(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [TQ, "dev", "--home", str(dev_home(tmp_path)), "--no-demo", "--port", str(port)],
            cwd=tmp_path,
            # Unreachable: a reason about the port proves nothing was tried first.
            env=dev_env("postgresql://tq@127.0.0.1:1/queue", tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"tq dev: cannot listen on 127.0.0.1:{port}: Address already in use (another --port or --host?)\n"
    )
