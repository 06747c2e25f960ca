"""``tq``: the command line of the queue (``python -m tq_pipelines`` works too)."""

import argparse
import dataclasses
import json
import sys
from datetime import UTC, date, datetime

from tq_pipelines.db import database_url, embedded
from tq_pipelines.db.migrate import MigrationError, migrate
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (QueueInputError, MigrationError) as exc:
        print(f"tq: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
