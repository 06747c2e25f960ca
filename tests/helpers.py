"""Setup and audit helpers shared by the tests."""

import psycopg


def add_stores(
    conn: psycopg.Connection, count: int, *, platform: str = "dutchie", enabled: bool = True
) -> list[int]:
    """Insert ``count`` crawlable stores; returns their ids in order."""
    rows = conn.execute(
        """
        INSERT INTO dispensaries (name, menu_type, platform_dispensary_id, crawl_enabled)
        SELECT 'store ' || g, %s, 'pid-' || g, %s
        FROM generate_series(1, %s) AS g
        RETURNING id
        """,
        (platform, enabled, count),
    ).fetchall()
    return sorted(r[0] for r in rows)


def add_tasks(
    conn: psycopg.Connection, role: str, store_ids: list[int], per_store: int, *, adjacent: bool = True
) -> int:
    """``per_store`` pending tasks for each store, one INSERT. Adjacent: a store's tasks have
    consecutive ids (the hard layout for a claim); else interleaved round-robin."""
    conn.execute(
        """
        INSERT INTO worker_tasks (role, dispensary_id, platform)
        SELECT %(role)s, s.id, 'dutchie'
        FROM unnest(%(stores)s::int[]) WITH ORDINALITY AS s(id, n)
        CROSS JOIN generate_series(1, %(per)s) AS k
        ORDER BY CASE WHEN %(adjacent)s THEN s.n ELSE k END, CASE WHEN %(adjacent)s THEN k ELSE s.n END
        """,
        {"role": role, "stores": store_ids, "per": per_store, "adjacent": adjacent},
    )
    return len(store_ids) * per_store


def status_counts(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM v_tasks GROUP BY status").fetchall())


def assert_store_state_consistent(conn: psycopg.Connection) -> None:
    """worker_task_stores and worker_task_heads agree with worker_tasks."""
    wrong_active = conn.execute(
        """
        SELECT s.dispensary_id, s.active_task_id, t.id
        FROM worker_task_stores s
        FULL JOIN (SELECT id, dispensary_id FROM worker_tasks
                   WHERE status IN ('claimed', 'running') AND dispensary_id IS NOT NULL) t
          ON t.dispensary_id = s.dispensary_id
        WHERE s.active_task_id IS DISTINCT FROM t.id
        """
    ).fetchall()
    assert wrong_active == [], f"store active task disagrees with worker_tasks: {wrong_active}"
    # Every (store, role) with pending work has a head holding the claim-order key and platform of
    # its best due task, else of its next task to come due. (Heads of deleted tasks may linger.)
    wrong_heads = conn.execute(
        """
        WITH expected AS (
          SELECT DISTINCT ON (dispensary_id, role)
            dispensary_id, role, priority, due_at, coalesce(platform, '') AS platform
          FROM worker_tasks
          WHERE status = 'pending' AND dispensary_id IS NOT NULL
          ORDER BY dispensary_id, role, (due_at <= now()) DESC,
                   CASE WHEN due_at <= now() THEN -priority END, due_at, priority DESC, id
        )
        SELECT e.dispensary_id, e.role, e.priority, e.due_at, e.platform, h.priority, h.due_at, h.platform
        FROM expected e
        LEFT JOIN worker_task_heads h ON h.role = e.role AND h.dispensary_id = e.dispensary_id
        WHERE (h.priority, h.due_at, h.platform) IS DISTINCT FROM (e.priority, e.due_at, e.platform)
        """
    ).fetchall()
    assert wrong_heads == [], f"heads disagree with the pending tasks: {wrong_heads}"
    # No head below its claim floor (its role, platform and priority's: 0017), where a claim
    # would not look for it.
    below = conn.execute(
        """
        SELECT h.role, h.platform, h.priority, h.dispensary_id, h.due_at, f.floor
        FROM worker_task_heads h
        LEFT JOIN (SELECT role, platform, priority, min(floor) AS floor
                   FROM worker_task_floors GROUP BY role, platform, priority) f
          ON f.role = h.role AND f.platform = h.platform AND f.priority = h.priority
        WHERE f.floor IS NULL OR h.due_at < f.floor
        """
    ).fetchall()
    assert below == [], f"heads below their claim floor: {below}"


def assert_platform_counters_consistent(conn: psycopg.Connection) -> None:
    """Every tq_platforms row counts exactly its platform's tasks holding a slot (claimed or
    running, send_at set), and its probe (if any) is claimed or running."""
    wrong = conn.execute(
        """
        SELECT l.platform, l.in_flight, coalesce(t.n, 0) AS actual
        FROM tq_platforms l
        LEFT JOIN (SELECT platform, count(*) AS n FROM worker_tasks
                   WHERE status IN ('claimed', 'running') AND send_at IS NOT NULL
                   GROUP BY platform) t ON t.platform = l.platform
        WHERE l.in_flight <> coalesce(t.n, 0)
        """
    ).fetchall()
    assert wrong == [], f"tq_platforms.in_flight disagrees with the tasks in flight: {wrong}"
    stale_probes = conn.execute(
        """
        SELECT l.platform, l.probe_task_id
        FROM tq_platforms l
        WHERE l.probe_task_id IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM worker_tasks t
                          WHERE t.id = l.probe_task_id AND t.platform = l.platform
                            AND t.status IN ('claimed', 'running'))
        """
    ).fetchall()
    assert stale_probes == [], f"a platform's probe is not one of its tasks in flight: {stale_probes}"
