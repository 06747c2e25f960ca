"""``tq``: the command line of the queue (``python -m tq_pipelines`` works too).

Every error ends as one line on stderr, ``tq <command>: <reason>``, and exit code 2: arguments
are checked as they are parsed, the database is reached (or not, with libpq's reason) within
5 seconds before anything runs, and the queue's refusals arrive in the database's own words.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import IO, NoReturn

import psycopg

from tq_pipelines.crawl.platforms import PlatformSettingsError, load_platform_settings, sync_limits
from tq_pipelines.db import (
    DatabaseUnreachable,
    check_connection,
    dagster_database_url,
    database_url,
    embedded,
    sqlalchemy_url,
)
from tq_pipelines.db.grant import DEFAULT_WORKER_SETTINGS, GrantError, check, grant, worker_settings
from tq_pipelines.db.migrate import DEFAULT_LOCK_WAIT_SECONDS, MigrationError, migrate
from tq_pipelines.queue.api import QueueInputError, TaskQueue, resync_window
from tq_pipelines.queue.redact import redact_conninfo, redact_text
from tq_pipelines.queue.retention import RetentionSettings, RetentionSettingsError, prune
from tq_pipelines_demo.fleet import seed_demo, start_demo

# Bounds of the arguments checked as they are parsed. The database checks the queue's own again
# (generate_resync_tasks, recover_stale_tasks) and stays the authority on them.
BATCHES = (1, 24)
THRESHOLD_MINUTES = (1, 10_080)
DEMO_STORES = (1, 10_000)
PORTS = (1, 65_535)
LOCK_WAIT_SECONDS = (1, 3600)
PLATFORM_NAME_CHARS = 50

# tq dev keeps the Dagster webserver and daemon up: a process that dies is restarted after a
# delay growing with its deaths in a row within DEV_QUICK_EXIT_SECONDS of starting, and after
# DEV_QUICK_EXITS of those (a broken config) tq dev stops with the reason.
DEV_QUICK_EXIT_SECONDS = 30.0
DEV_QUICK_EXITS = 3
DEV_RESTART_DELAYS = (1.0, 3.0)
# What the processes get to stop after SIGTERM before SIGKILL.
DEV_STOP_SECONDS = 20.0


class CommandError(Exception):
    """A command refused to go on; the message is the reason, for the one line on stderr."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (``tq generate: argument --batches: ...``) and
    exit code 2, without the usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _parse_day(text: str) -> date:
    """A UTC day within the window generate_resync_tasks takes."""
    try:
        day = date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None
    first, last = resync_window(datetime.now(UTC).date())
    if not first <= day <= last:
        raise argparse.ArgumentTypeError(
            f"{text} is outside the days a resync takes: from {first} to {last} (UTC; older days' "
            "tasks would all be due at once, ahead of every other task)"
        )
    return day


def _int_between(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``; ``what`` says what it counts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low} to {high} ({what})")
        return value

    return parse


def _seconds_between(low: int, high: int, what: str) -> Callable[[str], float]:
    """An argparse type: seconds from ``low`` to ``high``; ``what`` says what they bound."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds from {low} to {high} ({what})"
            )
        return value

    return parse


def _duration(name: str) -> Callable[[str], str]:
    """An argparse type: a duration for the worker role's setting ``name`` (30s, 5min, 0)."""

    def parse(text: str) -> str:
        try:
            return worker_settings({name: text})[name]
        except GrantError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _platform_name(text: str) -> str:
    name = text.strip()
    if not name or len(name) > PLATFORM_NAME_CHARS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a platform name: 1 to {PLATFORM_NAME_CHARS} characters (dispensaries.menu_type)"
        )
    return name


def _database(*, start: bool = True) -> str:
    """The queue database's URL, once a first connection has succeeded (within 5 s, else
    :class:`DatabaseUnreachable` with libpq's reason).

    Without ``start`` (commands that only read) an embedded server that is not running is
    refused rather than started: a server nobody stops would be left behind.
    """
    if start or os.environ.get("TQ_DATABASE_URL"):
        url = database_url()
    else:
        running = embedded.running_url()
        if running is None:
            raise CommandError(
                f"the embedded database is not running (no server on {embedded.default_pgdata()}): "
                "start it with `make dev` or `tq db start`, or set TQ_DATABASE_URL"
            )
        url = running
    check_connection(url)
    return url


def _reason(exc: BaseException) -> str:
    """The one line an error ends as: its own words for the errors of each layer, the type's
    name too for anything else; secrets masked, whitespace folded."""
    if isinstance(
        exc,
        QueueInputError
        | DatabaseUnreachable
        | MigrationError
        | PlatformSettingsError
        | CommandError
        | GrantError
        | RetentionSettingsError,
    ):
        text = str(exc)
    elif isinstance(exc, psycopg.Error):
        text = f"the database refused: {exc.diag.message_primary or exc}"
        if exc.sqlstate:
            text += f" (SQLSTATE {exc.sqlstate})"
        if exc.sqlstate in ("42P01", "42883"):  # undefined table, function
            text += "; is the database migrated? (tq migrate)"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(redact_text(text).split())


def _cmd_migrate(args: argparse.Namespace) -> int:
    url = _database()
    applied = migrate(url, lock_wait_seconds=args.lock_wait_seconds)
    print("applied: " + ", ".join(applied) if applied else "up to date")
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    if args.action == "stop":
        print("stopped" if embedded.stop() else "not running")
    elif os.environ.get("TQ_DATABASE_URL"):
        print(redact_conninfo(database_url()))  # shown without its password
    else:
        # The embedded server's URL has an empty password: printed as is, it can be used.
        print(embedded.start() if args.action == "start" else _database(start=False))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    with TaskQueue.connect(_database()) as queue:
        created = queue.generate_resync(
            day=args.date, batches_per_day=args.batches, platforms=args.platform or ["dutchie"]
        )
    print(f"created {created} product_resync tasks for {args.date}")
    return 0


def _cmd_recover(args: argparse.Namespace) -> int:
    with TaskQueue.connect(_database()) as queue:
        report = queue.recover_stale(args.threshold_minutes)
    print(json.dumps(dataclasses.asdict(report)))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    with TaskQueue.connect(_database(start=False)) as queue:
        rows = queue.capacity()
    header = ("role", "pending", "ready", "claimed", "running", "done/h", "failed/h", "workers")
    print("{:<24}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}".format(*header))
    for r in rows:
        print(
            f"{r.role:<24}{r.pending_tasks:>9}{r.ready_tasks:>9}{r.claimed_tasks:>9}{r.running_tasks:>9}"
            f"{r.completed_last_hour:>9}{r.failed_last_hour:>9}{r.active_workers:>9}"
        )
    return 0


def _pause_spec(text: str) -> tuple[str, float]:
    """NAME=SECONDS for --pause."""
    name, sep, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = float("nan")
    if not sep or not 1 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=SECONDS, SECONDS from 1 to 86400")
    return _platform_name(name), value


def _cmd_platforms(args: argparse.Namespace) -> int:
    """Each platform's fleet-wide limits and state; with --sync, loaded from the platforms file first."""
    path: str | None = args.file or os.environ.get("TQ_PLATFORMS_FILE")
    if args.sync and not path:
        raise CommandError("--sync needs a platforms file: give --file or set TQ_PLATFORMS_FILE")
    acts = args.sync or args.pause or args.resume
    with TaskQueue.connect(_database(start=bool(acts))) as queue:
        try:
            if args.sync and path:
                changed = sync_limits(queue, load_platform_settings(path))
                print(f"limits loaded from {path}: {changed} platform(s) changed")
            for name, seconds in args.pause or ():
                until = queue.platform_pause(name, seconds, args.reason or "paused by hand (tq platforms)")
                print(f"{name} paused until {until:%Y-%m-%d %H:%M:%S %Z}")
            for name in args.resume or ():
                queue.platform_resume(name)
                print(f"{name} resumed")
        except psycopg.errors.InsufficientPrivilege as exc:
            raise CommandError(
                f"{_reason(exc)}: loading limits, pausing and resuming are the admin's acts; "
                "run this with the admin's TQ_DATABASE_URL (the role tq grant names --admin-role)"
            ) from None
        rows = queue.platform_status()
    header = ("platform", "state", "in flight", "req/s", "burst", "pause left", "errors", "pause reason")
    print("{:<16}{:<9}{:>11}{:>8}{:>7}{:>12}{:>8}  {}".format(*header))
    for r in rows:
        print(
            f"{r['platform']:<16}{r['state']:<9}{r['in_flight']:>5}/{r['max_in_flight']:<5}"
            f"{r['requests_per_second']:>8g}{r['burst']:>7}{r['pause_seconds_left']:>11.0f}s"
            f"{r['errors_total']:>8}  {r['pause_reason'] or ''}"
        )
    return 0


def _password_from(variable: str | None, flag: str) -> str | None:
    """A password from the environment variable a flag names: never from an argument, which
    every user of the machine can read in the process list."""
    if variable is None:
        return None
    password = os.environ.get(variable)
    if not password:
        raise CommandError(f"{flag} {variable}: that environment variable is unset or empty")
    return password


def _cmd_grant(args: argparse.Namespace) -> int:
    """The worker role (and the admin role) of the queue database, created or updated; with
    --check, what differs from that, one line each, and exit code 1 if anything does."""
    settings = {
        "statement_timeout": args.statement_timeout,
        "lock_timeout": args.lock_timeout,
        "idle_in_transaction_session_timeout": args.idle_in_transaction_timeout,
    }
    if args.check:
        if args.admin_role or args.worker_password_env or args.admin_password_env:
            raise CommandError("--check changes nothing: give it --worker-role and the timeouts only")
        findings = check(
            _database(start=False), worker_role=args.worker_role, settings=settings, setting="TQ_DATABASE_URL"
        )
        for line in findings:
            print(line)
        if findings:
            print(
                f"tq grant --check: {len(findings)} difference(s); tq grant puts the settings back",
                file=sys.stderr,
            )
            return 1
        print(f"{args.worker_role}: as tq grant leaves it")
        return 0
    done = grant(
        _database(),
        worker_role=args.worker_role,
        admin_role=args.admin_role,
        worker_password=_password_from(args.worker_password_env, "--worker-password-env"),
        admin_password=_password_from(args.admin_password_env, "--admin-password-env"),
        settings=settings,
        setting="TQ_DATABASE_URL",
    )
    for line in done:
        print(line)
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    """Old finished tasks, workers, rollup hours and product history, deleted in short batches."""
    settings = RetentionSettings(
        tasks_days=args.tasks_days,
        completion_log_days=args.completion_log_days,
        workers_days=args.workers_days,
        product_history_days=args.product_history_days,
        batch_size=args.batch_size,
        pause_seconds=args.pause_seconds,
        time_budget_seconds=args.time_budget_seconds,
    )
    report = prune(_database(start=not args.dry_run), settings, dry_run=args.dry_run)
    verb = "would delete" if report.dry_run else "deleted"
    for name, table in report.tables.items():
        print(
            f"{name:<22}{verb} {table.rows:>10,} rows in {table.batches:>5} batches, {table.seconds:7.1f} s"
            + ("" if table.finished else "  (time budget spent: the rest waits for the next prune)")
        )
    if report.hours_rolled_up:
        print(f"task_completion_log: {report.hours_rolled_up} hours rolled up before their tasks went")
    return 0


class _Console:
    """The console of ``tq dev``: its own lines and the Dagster processes' output, whole lines
    at a time, without the noise."""

    # Run workers print every event at DEBUG (dagster.yaml's python_logs decides), and each
    # process that loads the definitions warns once per beta parameter it meets.
    DEBUG_RECORD = re.compile(rb" - (?:\x1b\[[0-9;]*m)?DEBUG(?:\x1b\[[0-9;]*m)? - ")
    BETA_WARNING = re.compile(rb": (?:Beta|Preview)Warning: ")

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        self._write(f"tq dev: {text}\n".encode())

    def _write(self, line: bytes) -> None:
        out = getattr(sys.stdout, "buffer", None)
        # A console gone (a closed pipe) must not stop the pumps: a child whose output is no
        # longer read would block on its next line.
        with self._lock, contextlib.suppress(OSError):
            if out is None:
                sys.stdout.write(line.decode(errors="replace"))
            else:
                out.write(line)
            sys.stdout.flush()

    def pump(self, stream: IO[bytes]) -> None:
        """Copy a child's output until every process holding the pipe has closed it."""
        skip = 0
        for line in iter(stream.readline, b""):
            if skip and (line.startswith(b"  ") or not line.strip()):
                skip -= 1  # the source line (and blank line) printed under a warning
                continue
            skip = 0
            if self.BETA_WARNING.search(line):
                skip = 2
            elif not self.DEBUG_RECORD.search(line):
                self._write(line)
        stream.close()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Supervised:
    """One Dagster process that ``tq dev`` keeps running: restarted with backoff when it dies,
    given up on after a few deaths in a row soon after starting.

    Each start is a session of its own, so that what the process started (its code server, the
    run workers the daemon's code server launches) can be stopped with it. The group of a
    process that died is left alone: a code server finishes its runs and exits by itself once
    its parent's heartbeats stop. Every group is stopped when ``tq dev`` stops.
    """

    def __init__(self, name: str, argv: list[str], *, env: dict[str, str], cwd: Path, console: _Console):
        self.name, self.argv, self.env, self.cwd, self.console = name, argv, env, cwd, console
        self.proc: subprocess.Popen[bytes] | None = None
        self.groups: list[int] = []
        self.pumps: list[threading.Thread] = []
        self.started_at = 0.0
        self.quick_exits = 0
        self.restart_at: float | None = None

    def start(self) -> None:
        proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=self.console.pump, args=(proc.stdout,), name=self.name, daemon=True)
        pump.start()
        self.proc, self.started_at, self.restart_at = proc, time.monotonic(), None
        self.groups.append(proc.pid)
        self.pumps.append(pump)

    def check(self) -> None:
        """Restart the process if it is due; notice if it died (raises after too many quick deaths)."""
        now = time.monotonic()
        if self.proc is None:
            if self.restart_at is not None and now >= self.restart_at:
                self.start()
                self.console.say(f"{self.name} restarted (pid {self.pid})")
            return
        code = self.proc.poll()
        if code is None:
            return
        ran = now - self.started_at
        self.quick_exits = self.quick_exits + 1 if ran < DEV_QUICK_EXIT_SECONDS else 0
        how = _describe_exit(code)
        pid, self.proc = self.proc.pid, None
        if self.quick_exits >= DEV_QUICK_EXITS:
            raise CommandError(
                f"{self.name} died {self.quick_exits} times in a row within {DEV_QUICK_EXIT_SECONDS:.0f} s "
                f"of starting (last: {how}); not restarting it (its output is above)"
            )
        delay = DEV_RESTART_DELAYS[min(max(self.quick_exits - 1, 0), len(DEV_RESTART_DELAYS) - 1)]
        self.restart_at = now + delay
        self.console.say(
            f"{self.name} (pid {pid}) died after {ran:.0f} s: {how}; restarting it in {delay:.0f} s"
        )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        """Whether any process it started (or their children) is still running."""
        if self.proc is not None and self.proc.poll() is None:
            return True
        return any(_group_alive(g) for g in self.groups)

    def send(self, sig: signal.Signals) -> None:
        for group in self.groups:
            _signal_group(group, sig)


def _stop_all(children: list[_Supervised], console: _Console, signals: list[int]) -> None:
    """SIGTERM to every group the children ever had; SIGKILL to what is left after
    DEV_STOP_SECONDS, or at once on a second Ctrl-C."""
    asked = len(signals)
    for child in children:
        child.send(signal.SIGTERM)
    deadline = time.monotonic() + DEV_STOP_SECONDS
    while any(c.alive() for c in children):
        if len(signals) > asked or time.monotonic() > deadline:
            left = ", ".join(c.name for c in children if c.alive())
            console.say(f"{left} did not stop: killed")
            for child in children:
                child.send(signal.SIGKILL)
            break
        time.sleep(0.1)
    for child in children:
        if child.proc is not None:
            child.proc.wait()
        for pump in child.pumps:
            pump.join(timeout=2)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the webserver could not listen on ``host:port`` (None if it can): said at once,
    rather than after the webserver has died a few times."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _cmd_dev(args: argparse.Namespace) -> int:
    """Database up and migrated, then the Dagster webserver and daemon, each restarted if it
    dies; Ctrl-C (or SIGTERM) stops it all."""
    home = Path(args.home).resolve()
    if not (home / "dagster.yaml").is_file() or not (home / "workspace.yaml").is_file():
        raise CommandError(
            f"no dagster.yaml and workspace.yaml in {home} (run it from the checkout, or give --home)"
        )
    refused = _cannot_listen(args.host, args.port)
    if refused:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {refused} (another --port or --host?)")
    own_server = not os.environ.get("TQ_DATABASE_URL")
    url = _database()
    applied = migrate(url)
    console = _Console()
    console.say(f"queue database {'embedded, ' if own_server else ''}migrated ({len(applied)} new)")
    env = {
        **os.environ,
        "TQ_DATABASE_URL": url,
        "TQ_DAGSTER_PG_URL": sqlalchemy_url(dagster_database_url(url)),
        "DAGSTER_HOME": str(home),
    }
    fleet = None
    children: list[_Supervised] = []
    signals: list[int] = []
    try:
        if (own_server or args.demo) and not args.no_demo:
            fleet = start_demo(
                embedded.default_pgdata().parent / "demo", stores_per_platform=args.demo_stores
            )
            created = seed_demo(url, fleet)
            env |= {"TQ_PLATFORMS_FILE": str(fleet.platforms_file), "TQ_DEMO": "1"}
            served = ", ".join(f"{n} on {p.base_url}" for n, p in fleet.simulator.platforms.items())
            console.say(f"demo fleet: {served}; {created} store_discovery tasks queued (--no-demo to skip)")
        bin_dir = Path(sys.executable).parent
        workspace = ["-w", str(home / "workspace.yaml")]
        levels = ["--code-server-log-level", "warning"]
        address = ["-h", args.host, "-p", str(args.port), "--dagster-log-level", "info"]
        children = [
            _Supervised(
                "dagster-webserver",
                [str(bin_dir / "dagster-webserver"), *workspace, *address, *levels],
                env=env,
                cwd=home,
                console=console,
            ),
            _Supervised(
                "dagster-daemon",
                [str(bin_dir / "dagster-daemon"), "run", *workspace, "--log-level", "info", *levels],
                env=env,
                cwd=home,
                console=console,
            ),
        ]
        # The children are sessions of their own, out of reach of the terminal's Ctrl-C: it is
        # passed on from here. A handler (not SIG_IGN) also leaves them SIGINT's default.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: signals.append(signum))
        console.say(f"Dagster UI on http://{args.host}:{args.port} (Ctrl-C stops everything)")
        for child in children:
            child.start()
        while not signals:
            for child in children:
                child.check()
            time.sleep(0.2)
        console.say("stopping (Ctrl-C again to kill)")
        return 0
    finally:
        _stop_all(children, console, signals)
        if fleet is not None:
            fleet.stop()
        if own_server:
            embedded.stop()
            console.say(f"embedded PostgreSQL stopped; data kept in {embedded.default_pgdata()}")


def _cmd_demo(args: argparse.Namespace) -> int:
    """The simulator in the foreground, its platforms file, and the first discovery tasks."""
    folder = Path(args.folder).resolve() if args.folder else embedded.default_pgdata().parent / "demo"
    url = _database() if args.seed else None  # before the simulator starts: fail fast
    fleet = start_demo(folder, stores_per_platform=args.stores)
    for name, platform in fleet.simulator.platforms.items():
        print(f"tq demo: {name} on {platform.base_url} ({platform.profile.stores} stores)")
    if url is not None:
        try:
            created = seed_demo(url, fleet)
        except BaseException:
            fleet.stop()
            raise
        print(f"tq demo: {created} store_discovery tasks queued")
    print(
        f"tq demo: export TQ_PLATFORMS_FILE={fleet.platforms_file}  (Ctrl-C stops the simulator)", flush=True
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tq", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    mig = sub.add_parser("migrate", help="apply the migrations in sql/migrations")
    mig.add_argument(
        "--lock-wait-seconds",
        type=_seconds_between(*LOCK_WAIT_SECONDS, "the wait for another migrator"),
        default=DEFAULT_LOCK_WAIT_SECONDS,
        help=f"give up, naming the holder, after waiting this long for the migration lock "
        f"(default {DEFAULT_LOCK_WAIT_SECONDS:g})",
    )
    mig.set_defaults(func=_cmd_migrate)

    db = sub.add_parser(
        "db", help="the embedded database: print its URL (url), start it and print it (start), or stop it"
    )
    db.add_argument("action", choices=["url", "start", "stop"], nargs="?", default="url")
    db.set_defaults(func=_cmd_db)

    gen = sub.add_parser("generate", help="create a day's product_resync tasks (idempotent)")
    gen.add_argument(
        "--date", type=_parse_day, default=datetime.now(UTC).date(), help="UTC day (default today)"
    )
    gen.add_argument(
        "--batches",
        type=_int_between(*BATCHES, "batches per UTC day"),
        default=6,
        help="batches per day, 1..24",
    )
    gen.add_argument(
        "--platform", type=_platform_name, action="append", help="platform to resync (repeatable)"
    )
    gen.set_defaults(func=_cmd_generate)

    rec = sub.add_parser("recover", help="give back the tasks of silent workers")
    rec.add_argument(
        "--threshold-minutes",
        type=_int_between(*THRESHOLD_MINUTES, "minutes of silence"),
        default=10,
        help="minutes of silence after which a worker's tasks go back, 1..10080 (default 10)",
    )
    rec.set_defaults(func=_cmd_recover)

    sub.add_parser("status", help="v_worker_capacity, one line per role").set_defaults(func=_cmd_status)

    plat = sub.add_parser("platforms", help="each platform's fleet-wide limits, in flight, pause and errors")
    plat.add_argument("--sync", action="store_true", help="load the limits from the platforms file first")
    plat.add_argument("--file", help="the platforms file (default TQ_PLATFORMS_FILE)")
    plat.add_argument(
        "--pause",
        type=_pause_spec,
        action="append",
        metavar="NAME=SECONDS",
        help="pause a platform by hand for 1..86400 s (repeatable; the admin's)",
    )
    plat.add_argument("--reason", help="why, for --pause (shown in tq platforms and the sensor)")
    plat.add_argument(
        "--resume", type=_platform_name, action="append", metavar="NAME", help="end a platform's pause now"
    )
    plat.set_defaults(func=_cmd_platforms)

    grant_cmd = sub.add_parser(
        "grant", help="create or update the worker role (and the admin role) and their rights"
    )
    grant_cmd.add_argument("--worker-role", required=True, help="the role drain runs and sensors log in as")
    grant_cmd.add_argument("--admin-role", help="the role that owns the schema and migrates (default: as is)")
    grant_cmd.add_argument("--worker-password-env", metavar="VAR", help="set the worker's password from $VAR")
    grant_cmd.add_argument("--admin-password-env", metavar="VAR", help="set the admin's password from $VAR")
    for flag, name in (
        ("--statement-timeout", "statement_timeout"),
        ("--lock-timeout", "lock_timeout"),
        ("--idle-in-transaction-timeout", "idle_in_transaction_session_timeout"),
    ):
        default = DEFAULT_WORKER_SETTINGS[name]
        grant_cmd.add_argument(
            flag, type=_duration(name), default=default, help=f"the worker's {name} here (default {default})"
        )
    grant_cmd.add_argument(
        "--check",
        action="store_true",
        help="change nothing: print what differs from what tq grant sets (settings the worker gave "
        "itself, other routes to the tables), exit code 1 if anything does",
    )
    grant_cmd.set_defaults(func=_cmd_grant)

    defaults = RetentionSettings()
    prune_cmd = sub.add_parser("prune", help="delete what is past its retention, in short batches")
    for flag, help_text in (
        ("--tasks-days", "finished tasks, days after they finished"),
        ("--completion-log-days", "the hourly rollup, days (at least --tasks-days)"),
        ("--workers-days", "registry rows of workers silent this many days and holding no task"),
        ("--product-history-days", "price and stock changes, days"),
        ("--batch-size", "rows per delete, each its own transaction"),
    ):
        name = flag[2:].replace("-", "_")
        default = getattr(defaults, name)
        prune_cmd.add_argument(flag, type=int, default=default, help=f"{help_text} (default {default})")
    prune_cmd.add_argument(
        "--pause-seconds", type=float, default=defaults.pause_seconds, help="sleep between batches"
    )
    prune_cmd.add_argument(
        "--time-budget-seconds",
        type=float,
        default=defaults.time_budget_seconds,
        help="start no batch after this long",
    )
    prune_cmd.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    prune_cmd.set_defaults(func=_cmd_prune)

    dev = sub.add_parser("dev", help="database up and migrated, then the Dagster UI and daemon")
    dev.add_argument("--home", default=".", help="folder with dagster.yaml and workspace.yaml")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=_int_between(*PORTS, "a TCP port"), default=3000)
    dev.add_argument("--no-demo", action="store_true", help="no menu simulator and no demo tasks")
    dev.add_argument("--demo", action="store_true", help="the demo fleet also with TQ_DATABASE_URL set")
    dev.add_argument(
        "--demo-stores",
        type=_int_between(*DEMO_STORES, "stores per platform"),
        default=100,
        help="demo stores per platform",
    )
    dev.set_defaults(func=_cmd_dev)

    demo = sub.add_parser("demo", help="serve the menu simulator (three platforms) until Ctrl-C")
    demo.add_argument(
        "--stores",
        type=_int_between(*DEMO_STORES, "stores per platform"),
        default=100,
        help="stores per platform",
    )
    demo.add_argument("--folder", help="where to write platforms.toml (default .tq/demo)")
    demo.add_argument("--seed", action="store_true", help="also queue store_discovery tasks in the database")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; any error is one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = f"{parser.prog} {args.command}"
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"{command}: {_reason(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
