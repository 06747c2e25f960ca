"""``tq``: the command line of the queue (``python -m tq_pipelines`` works too)."""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, date, datetime
from pathlib import Path

from tq_pipelines.crawl.platforms import PlatformSettingsError, load_platform_settings, sync_limits
from tq_pipelines.db import dagster_database_url, database_url, embedded, sqlalchemy_url
from tq_pipelines.db.migrate import MigrationError, migrate
from tq_pipelines.demo import seed_demo, start_demo
from tq_pipelines.queue import QueueInputError, TaskQueue


def _parse_day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None


def _cmd_migrate(args: argparse.Namespace) -> int:
    url = database_url()
    applied = migrate(url)
    print("applied: " + ", ".join(applied) if applied else "up to date")
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    if args.action == "stop":
        print("stopped" if embedded.stop() else "not running")
    else:
        print(database_url())
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    with TaskQueue.connect(database_url()) as queue:
        created = queue.generate_resync(
            day=args.date, batches_per_day=args.batches, platforms=args.platform or ["dutchie"]
        )
    print(f"created {created} product_resync tasks for {args.date}")
    return 0


def _cmd_recover(args: argparse.Namespace) -> int:
    with TaskQueue.connect(database_url()) as queue:
        report = queue.recover_stale(args.threshold_minutes)
    print(json.dumps(dataclasses.asdict(report)))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    with TaskQueue.connect(database_url()) as queue:
        rows = queue.capacity()
    header = ("role", "pending", "ready", "claimed", "running", "done/h", "failed/h", "workers")
    print("{:<24}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}".format(*header))
    for r in rows:
        print(
            f"{r.role:<24}{r.pending_tasks:>9}{r.ready_tasks:>9}{r.claimed_tasks:>9}{r.running_tasks:>9}"
            f"{r.completed_last_hour:>9}{r.failed_last_hour:>9}{r.active_workers:>9}"
        )
    return 0


def _cmd_platforms(args: argparse.Namespace) -> int:
    """Each platform's fleet-wide limits and state; with --sync, loaded from the platforms file first."""
    with TaskQueue.connect(database_url()) as queue:
        if args.sync:
            path = args.file or os.environ.get("TQ_PLATFORMS_FILE")
            if not path:
                print("tq platforms --sync: no platforms file (--file or TQ_PLATFORMS_FILE)", file=sys.stderr)
                return 2
            changed = sync_limits(queue, load_platform_settings(path))
            print(f"limits loaded from {path}: {changed} platform(s) changed")
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


def _cmd_dev(args: argparse.Namespace) -> int:
    """Database up and migrated, then `dagster dev` in the foreground; Ctrl-C stops it all."""
    home = Path(args.home).resolve()
    if not (home / "dagster.yaml").is_file() or not (home / "workspace.yaml").is_file():
        print(
            f"tq dev: no dagster.yaml and workspace.yaml in {home} (run it from the checkout)",
            file=sys.stderr,
        )
        return 2
    own_server = not os.environ.get("TQ_DATABASE_URL")
    url = database_url()
    applied = migrate(url)
    print(f"tq dev: queue database {'embedded, ' if own_server else ''}migrated ({len(applied)} new)")
    env = {
        **os.environ,
        "TQ_DATABASE_URL": url,
        "TQ_DAGSTER_PG_URL": sqlalchemy_url(dagster_database_url(url)),
        "DAGSTER_HOME": str(home),
    }
    fleet = None
    if (own_server or args.demo) and not args.no_demo:
        fleet = start_demo(embedded.default_pgdata().parent / "demo", stores_per_platform=args.demo_stores)
        created = seed_demo(url, fleet)
        env |= {"TQ_PLATFORMS_FILE": str(fleet.platforms_file), "TQ_DEMO": "1"}
        served = ", ".join(f"{n} on {p.base_url}" for n, p in fleet.simulator.platforms.items())
        print(f"tq dev: demo fleet: {served}; {created} store_discovery tasks queued (--no-demo to skip)")
    dagster = Path(sys.executable).with_name("dagster")
    cmd = [str(dagster), "dev", "-w", str(home / "workspace.yaml"), "-h", args.host, "-p", str(args.port)]
    print(f"tq dev: Dagster UI on http://{args.host}:{args.port} (Ctrl-C stops everything)", flush=True)
    child = subprocess.Popen(cmd, env=env, cwd=home)
    # Ctrl-C reaches the whole foreground group; SIGTERM (kill, timeout) reaches only us, so
    # pass it on as the SIGINT that dagster dev shuts down cleanly on.
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGINT))
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                # From a terminal dagster dev got the same SIGINT; otherwise pass it on. A
                # second one is harmless: it is already shutting down.
                child.send_signal(signal.SIGINT)
    finally:
        if child.poll() is None:
            child.kill()
        if fleet is not None:
            fleet.stop()
        if own_server:
            embedded.stop()
            print("tq dev: embedded PostgreSQL stopped; data kept in", embedded.default_pgdata())


def _cmd_demo(args: argparse.Namespace) -> int:
    """The simulator in the foreground, its platforms file, and the first discovery tasks."""
    folder = Path(args.folder).resolve() if args.folder else embedded.default_pgdata().parent / "demo"
    fleet = start_demo(folder, stores_per_platform=args.stores)
    for name, platform in fleet.simulator.platforms.items():
        print(f"tq demo: {name} on {platform.base_url} ({platform.profile.stores} stores)")
    if args.seed:
        created = seed_demo(database_url(), fleet)
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
    parser = argparse.ArgumentParser(prog="tq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("migrate", help="apply the migrations in sql/migrations").set_defaults(func=_cmd_migrate)

    db = sub.add_parser("db", help="the database: print its URL (starting the embedded one) or stop it")
    db.add_argument("action", choices=["url", "stop"], nargs="?", default="url")
    db.set_defaults(func=_cmd_db)

    gen = sub.add_parser("generate", help="create a day's product_resync tasks (idempotent)")
    gen.add_argument("--date", type=_parse_day, default=datetime.now(UTC).date(), help="UTC day")
    gen.add_argument("--batches", type=int, default=6, help="batches per day, 1..24")
    gen.add_argument("--platform", action="append", help="platform to resync (repeatable)")
    gen.set_defaults(func=_cmd_generate)

    rec = sub.add_parser("recover", help="give back the tasks of silent workers")
    rec.add_argument("--threshold-minutes", type=int, default=10)
    rec.set_defaults(func=_cmd_recover)

    sub.add_parser("status", help="v_worker_capacity, one line per role").set_defaults(func=_cmd_status)

    plat = sub.add_parser("platforms", help="each platform's fleet-wide limits, in flight, pause and errors")
    plat.add_argument("--sync", action="store_true", help="load the limits from the platforms file first")
    plat.add_argument("--file", help="the platforms file (default TQ_PLATFORMS_FILE)")
    plat.set_defaults(func=_cmd_platforms)

    dev = sub.add_parser("dev", help="database up and migrated, then the Dagster UI and daemon")
    dev.add_argument("--home", default=".", help="folder with dagster.yaml and workspace.yaml")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=3000)
    dev.add_argument("--no-demo", action="store_true", help="no menu simulator and no demo tasks")
    dev.add_argument("--demo", action="store_true", help="the demo fleet also with TQ_DATABASE_URL set")
    dev.add_argument("--demo-stores", type=int, default=100, help="demo stores per platform")
    dev.set_defaults(func=_cmd_dev)

    demo = sub.add_parser("demo", help="serve the menu simulator (three platforms) until Ctrl-C")
    demo.add_argument("--stores", type=int, default=100, help="stores per platform")
    demo.add_argument("--folder", help="where to write platforms.toml (default .tq/demo)")
    demo.add_argument("--seed", action="store_true", help="also queue store_discovery tasks in the database")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (QueueInputError, MigrationError, PlatformSettingsError) as exc:
        print(f"tq: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
