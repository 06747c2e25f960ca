"""Pure functions: no database needed."""

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from tq_pipelines.db import sqlalchemy_url
from tq_pipelines.db.queries import parse, queries
from tq_pipelines.defs.resources import QueueResource, QueueSettingsError
from tq_pipelines.defs.sensors.alerts import hours_to_next_resync


def test_parse_splits_named_blocks_and_refuses_duplicates():
    parsed = parse("-- name: a\nSELECT 1;\n\n-- name: b\n-- a comment\nSELECT %(x)s;\n")
    assert list(parsed) == ["a", "b"]
    assert parsed["b"].as_string(None).endswith("SELECT %(x)s;")
    with pytest.raises(ValueError, match="'a' is defined twice"):
        parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_every_query_the_package_calls_exists():
    # The names TaskQueue and the migrator ask for, checked against the .sql files.
    import inspect
    import re

    import tq_pipelines.db as db_pkg
    import tq_pipelines.db.migrate as migrate_mod
    import tq_pipelines.queue.api as queue_mod

    called = set()
    for module in (queue_mod, migrate_mod, db_pkg):
        called |= set(re.findall(r'query\("(\w+)"\)', inspect.getsource(module)))
        called |= set(re.findall(r'_one\(\s*"(\w+)"', inspect.getsource(module)))
    assert called, "found no query names"
    assert called <= set(queries()), called - set(queries())


@pytest.mark.parametrize(
    ("conninfo", "expected"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/tq",
            "postgresql+psycopg2://postgres@/tq?host=127.0.0.1&port=5432",
        ),
        (
            "postgresql://postgres:@/postgres?host=/srv/tq/.tq/pgdata",
            "postgresql+psycopg2://postgres@/postgres?host=%2Fsrv%2Ftq%2F.tq%2Fpgdata",
        ),
        ("host=db user=u password=p@ss dbname=x", "postgresql+psycopg2://u:p%40ss@/x?host=db"),
    ],
)
def test_sqlalchemy_url(conninfo: str, expected: str):
    assert sqlalchemy_url(conninfo) == expected


def test_role_caps_parse_and_name_the_setting_when_wrong():
    roles = ["product_resync", "store_discovery", "analytics_refresh"]
    caps = QueueResource(database_url="x", role_caps="product_resync=3, store_discovery=0").caps(roles)
    assert caps == {"product_resync": 3, "store_discovery": 0, "analytics_refresh": 2}
    with pytest.raises(QueueSettingsError, match="role_caps"):
        QueueResource(database_url="x", role_caps="nosuchrole=2").caps(roles)
    for bad in ("product_resync", "product_resync=many", "product_resync=-1"):
        with pytest.raises(ValidationError, match="role_caps"):
            QueueResource(database_url="x", role_caps=bad)


@pytest.mark.parametrize(
    ("now", "hour", "expected"),
    [
        (datetime(2026, 6, 1, 22, 0, tzinfo=UTC), 0, 2.0),
        (datetime(2026, 6, 1, 0, 0, tzinfo=UTC), 0, 24.0),
        (datetime(2026, 6, 1, 1, 30, tzinfo=UTC), 3, 1.5),
    ],
)
def test_hours_to_next_resync(now: datetime, hour: int, expected: float):
    assert hours_to_next_resync(now, hour) == expected
