"""Politeness measured where the requests land: the menu simulator's real HTTP servers log every
request's arrival and departure, and ``politeness_report`` turns the log into requests in flight
and starts per second. The crawl runs through real drain runs (Dagster, in process) or the
worker, against the test's own database.

- several drain runs at once keep each platform's limits at the server;
- an outage (503 with Retry-After) pauses the platform for every run: a few probes reach it, no
  retry is spent, and every store is crawled once it is back;
- a 5xx burst trips the breaker after ``pause_after_errors``: the rest are given back untried;
- redirect hops are requests under the platform's limits (the rate counts both hops);
- a handler that meets a paused platform gives its task back through the HTTP client.
"""

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg.rows import dict_row

from tests.dagster_helpers import failure_text, op_metadata
from tests.integration.test_crawl_dagster import add_simulated_stores, drain, write_platforms
from tq_pipelines.crawl.handlers import crawl_menu
from tq_pipelines.crawl.platforms import CrawlServices, load_platform_settings, sync_limits
from tq_pipelines.queue.api import JSON, Task, TaskQueue
from tq_pipelines.queue.worker import TaskContext, Worker
from tq_pipelines_demo.simulator import (
    PlatformProfile,
    Simulator,
    SimulatorProcess,
    platforms_toml,
    politeness_report,
)

PLATFORMS = ("dutchie", "jane")
ROLE = "product_discovery"
EPSILON = 0.002  # seconds: timestamps in PostgreSQL have microseconds, the server's log floats


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from the shell decides where the platforms are or which handlers run."""
    for name in ("TQ_PLATFORMS_FILE", "TQ_HANDLERS", "TQ_ROLE_CAPS", "TQ_ALERT_WEBHOOK_URL"):
        monkeypatch.delenv(name, raising=False)


def profiles_of(stores: int, latency_ms: float, profiles: dict[str, dict[str, Any]]) -> list[PlatformProfile]:
    """PLATFORMS' profiles, each with its own settings if given; menus do not change in a test."""
    common = {"stores": stores, "latency_ms": latency_ms, "jitter": 0.5, "change_seconds": 86_400, "seed": 11}
    return [PlatformProfile(name, **(common | profiles.get(name, {}))) for name in PLATFORMS]


@pytest.fixture
def simulate() -> Iterator[Callable[..., SimulatorProcess]]:
    """``simulate(stores=40, latency_ms=60, jane={"rate_500": 1.0})``: a started simulator of
    PLATFORMS in a process of its own: the arrivals it logs are the platforms' clock, which a stall
    of the drains' process (pytest's, here) does not move. Stopped at the end."""
    started: list[SimulatorProcess] = []

    def start(*, stores: int, latency_ms: float, **profiles: dict[str, Any]) -> SimulatorProcess:
        started.append(SimulatorProcess(profiles_of(stores, latency_ms, profiles)))
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def simulate_here() -> Iterator[Callable[..., Simulator]]:
    """As ``simulate``, served from the test's own process, so that a test can change a platform's
    behaviour as it runs; its arrival times can be late by a stall of this process."""
    started: list[Simulator] = []

    def start(*, stores: int, latency_ms: float, **profiles: dict[str, Any]) -> Simulator:
        started.append(Simulator(profiles_of(stores, latency_ms, profiles)).start())
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


def platforms_file(
    tmp_path: Path, sim: Simulator | SimulatorProcess, per_platform: dict[str, dict[str, Any]]
) -> Path:
    """A platforms file for the simulator with each platform's own settings."""
    return write_platforms(
        tmp_path,
        "\n".join(
            platforms_toml({name: sim.platforms[name].base_url}, **settings)
            for name, settings in per_platform.items()
        ),
    )


def drains_at_once(db_url: str, path: Path, runs: int, **config: Any) -> list[dg.ExecuteInProcessResult]:
    """``runs`` drain runs of ROLE started together, each in its own thread with its own queue
    and crawl resources (so its own HTTP client and per-host limits); returns their results."""
    barrier = threading.Barrier(runs)
    results: list[dg.ExecuteInProcessResult | None] = [None] * runs
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = drain(db_url, ROLE, path, **config)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"drain-{i}") for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a drain run did not end"
    assert errors == []
    done = [r for r in results if r is not None]
    assert len(done) == runs
    for r in done:
        assert r.success, failure_text(r)
    return done


def platform_rows(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return {r["platform"]: r for r in cur.execute("SELECT * FROM v_platform_status").fetchall()}


def tasks_by_store(conn: psycopg.Connection) -> dict[int, tuple[str, int, bool, bool]]:
    """dispensary id -> (status, retry_count, given back (deferred or retried: scheduled_for set),
    due after now)."""
    rows = conn.execute(
        "SELECT dispensary_id, status, retry_count, scheduled_for IS NOT NULL, "
        "       coalesce(scheduled_for > now(), false) "
        "FROM v_tasks WHERE role = %s",
        (ROLE,),
    ).fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def assert_no_slots_held(conn: psycopg.Connection) -> None:
    """Every platform's counter is back at 0 and agrees with the tasks in flight (none)."""
    assert (
        conn.execute(
            "SELECT platform, in_flight FROM tq_platforms WHERE in_flight <> 0 ORDER BY platform"
        ).fetchall()
        == []
    )
    assert conn.execute("SELECT count(*) FROM v_tasks WHERE status IN ('claimed', 'running')").fetchone() == (
        0,
    )


def assert_polite(sim: SimulatorProcess, limits: dict[str, Any], stores: int) -> None:
    """Politeness at each server, which answered each of its ``stores`` once: never more than
    max_in_flight at once, never more starts in a second (calendar or sliding) than the rate plus
    its burst."""
    allowed = limits["requests_per_second"] + limits["burst"]
    for name, platform in sim.platforms.items():
        log = platform.request_log()
        report = politeness_report(log, **limits)
        assert Counter(status for _, _, status in log) == {200: stores}, name
        assert report["max_in_flight"] <= limits["max_in_flight"], (name, report)
        assert report["over_in_flight"] == 0, (name, report)
        assert report["seconds_over_rate"] == 0, (name, report)
        assert report["max_starts_per_second"] <= allowed, (name, report)
        assert report["max_starts_sliding_1s"] <= allowed, (name, report)


# -- 1. several drain runs at once ---------------------------------------------------------------

LIMITS = {"max_in_flight": 2, "requests_per_second": 8, "burst": 2}


def test_drain_runs_at_once_keep_each_platforms_limits_at_the_server(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    stores = 40
    # dutchie answers slowly (250 ms +- 50%): its requests in flight would exceed the limit at its
    # rate; jane quickly (30 ms): its starts would exceed the rate with the slots it has.
    sim = simulate(stores=stores, latency_ms=30, dutchie={"latency_ms": 250})
    path = platforms_file(tmp_path, sim, {name: {**LIMITS, "timeout_seconds": 5} for name in PLATFORMS})
    platform_of = add_simulated_stores(conn, queue, sim)
    assert len(platform_of) == stores * len(PLATFORMS)

    # One task at a time each: no run can hold every slot, so the runs share each platform (a run
    # with threads to spare would take back each slot it frees before the others poll again).
    runs = 4
    results = drains_at_once(db_url, path, runs, concurrency=1, batch_size=1)

    # Every store crawled exactly once: one completed task each, one request each at its platform.
    metas = [op_metadata(r, "drain_role_tasks") for r in results]
    totals = {k: sum(m[k] for m in metas) for k in ("claimed", "completed", "retried", "failed", "lost")}
    assert totals == {
        "claimed": len(platform_of),
        "completed": len(platform_of),
        "retried": 0,
        "failed": 0,
        "lost": 0,
    }
    assert {s: (t[0], t[1]) for s, t in tasks_by_store(conn).items()} == dict.fromkeys(
        platform_of, ("completed", 0)
    )
    products = dict(
        conn.execute("SELECT dispensary_id, count(*) FROM products GROUP BY dispensary_id").fetchall()
    )
    expected = {
        s: sim.platforms[p].by_platform_id[pid].products
        for s, p, pid in conn.execute(
            "SELECT id, menu_type, platform_dispensary_id FROM dispensaries"
        ).fetchall()
    }
    assert products == expected
    # The runs shared the work: every run took tasks, and several took tasks of each platform.
    assert all(m["claimed"] >= 1 for m in metas), metas
    workers = conn.execute(
        "SELECT platform, count(DISTINCT worker_id) FROM v_tasks GROUP BY platform ORDER BY platform"
    ).fetchall()
    assert all(n >= 2 for _, n in workers), workers

    assert_polite(sim, LIMITS, stores)
    assert_no_slots_held(conn)
    assert {p: r["state"] for p, r in platform_rows(conn).items()} == dict.fromkeys(PLATFORMS, "open")


# At 40 requests a second for 2 slots the rate may give relays (0031), and with answers in 17-53 ms
# (up to 57 a second for 2 slots) it binds too: the standby sends on the passer's relay only where
# the rate has room, and the servers hear close to the rate.
RELAY_LIMITS = {"max_in_flight": 2, "requests_per_second": 40, "burst": 2}


def test_relayed_slots_keep_each_platforms_limits_at_the_server(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    """Two drain runs at once, each with its threads and standbys: many passes go on relays,
    sent before the queue records them, and the servers still never have more than 2 requests
    in, nor more starts in any second than the rate and its burst; every store is crawled once."""
    stores = 120
    sim = simulate(stores=stores, latency_ms=35)
    path = platforms_file(tmp_path, sim, {name: {**RELAY_LIMITS, "timeout_seconds": 5} for name in PLATFORMS})
    platform_of = add_simulated_stores(conn, queue, sim)

    metas = [op_metadata(r, "drain_role_tasks") for r in drains_at_once(db_url, path, 2)]
    totals = {k: sum(m[k] for m in metas) for k in ("completed", "retried", "failed", "lost")}
    assert totals == {"completed": len(platform_of), "retried": 0, "failed": 0, "lost": 0}
    assert {s: (t[0], t[1]) for s, t in tasks_by_store(conn).items()} == dict.fromkeys(
        platform_of, ("completed", 0)
    )
    relayed = sum(m["passes_relayed"] for m in metas)
    assert relayed >= len(platform_of) // 10, metas

    assert_polite(sim, RELAY_LIMITS, stores)
    assert_no_slots_held(conn)


# -- 2. an outage -------------------------------------------------------------------------------

OUTAGE_SECONDS = 2.0


def test_an_outage_pauses_its_platform_for_the_run_without_spending_retries(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate_here: Callable[..., Simulator],
    tmp_path: Path,
):
    stores, max_in_flight = 24, 2
    sim = simulate_here(
        stores=stores,
        latency_ms=30,
        dutchie={
            "outage_start_seconds": 0,
            "outage_seconds": OUTAGE_SECONDS,
            "outage_retry_after_seconds": 1,
        },
    )
    limits = {"max_in_flight": max_in_flight, "requests_per_second": 10, "timeout_seconds": 5}
    # Short pauses after a failed probe (0.5 s * 2^pauses, at least Retry-After, at most 2 s).
    path = platforms_file(
        tmp_path,
        sim,
        {
            "dutchie": {**limits, "pause_seconds": 0.5, "max_pause_seconds": 2},
            "jane": limits,
        },
    )
    platform_of = add_simulated_stores(conn, queue, sim)
    down = sim.platforms["dutchie"]
    # The outage starts now, as the crawl does (the simulator's clock started with its servers).
    down.profile.outage_start_seconds = down.elapsed()
    window = down.outage_window()
    assert window is not None

    result = drain(db_url, ROLE, path, platform_wait_seconds=10)
    assert result.success, failure_text(result)
    meta = op_metadata(result, "drain_role_tasks")
    assert (meta["completed"], meta["retried"], meta["failed"], meta["lost"]) == (len(platform_of), 0, 0, 0)
    assert meta["deferred"] >= 1  # the tasks that met the outage were given back

    # Every store of both platforms crawled in the end, and no retry spent on the outage.
    assert {s: t[:2] for s, t in tasks_by_store(conn).items()} == dict.fromkeys(platform_of, ("completed", 0))

    # The server: a few requests during the outage (the first ones in flight, then one probe at a
    # time), against the stores waiting for it; then every store once.
    log = down.request_log()
    report = politeness_report(
        log,
        max_in_flight=max_in_flight,
        requests_per_second=10,
        burst=max_in_flight,
        windows=[("outage", *window)],
    )
    during = report["windows"]["outage"]
    assert during["answers"].get(503, 0) >= 1, (during, log[:5])  # the crawl did meet the outage
    assert during["requests"] <= max_in_flight + 4, during
    assert during["requests"] * 4 <= stores, during
    answers = Counter(status for _, _, status in log)
    assert answers == {503: answers[503], 200: stores}, answers
    assert report["max_in_flight"] <= max_in_flight and report["over_in_flight"] == 0, report

    # The healthy platform kept crawling through the outage.
    healthy = politeness_report(
        sim.platforms["jane"].request_log(),
        max_in_flight=max_in_flight,
        requests_per_second=10,
        burst=max_in_flight,
        windows=[("outage", *window)],
    )
    assert healthy["windows"]["outage"]["answers"].get(200, 0) >= 1, healthy

    rows = platform_rows(conn)
    assert (rows["dutchie"]["state"], rows["dutchie"]["pauses"], rows["dutchie"]["in_flight"]) == (
        "open",
        0,
        0,
    )
    assert rows["dutchie"]["errors_total"] >= 1
    assert "HTTP 503" in rows["dutchie"]["last_error"]
    assert (rows["jane"]["state"], rows["jane"]["errors_total"]) == ("open", 0)
    assert_no_slots_held(conn)


# -- 3. a 5xx burst trips the breaker -----------------------------------------------------------


def test_a_5xx_burst_pauses_the_platform_and_the_rest_wait_untried(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    stores, max_in_flight, pause_after = 12, 2, 3
    sim = simulate(stores=stores, latency_ms=20, jane={"rate_500": 1.0})
    limits = {"max_in_flight": max_in_flight, "requests_per_second": 50, "timeout_seconds": 5}
    path = platforms_file(
        tmp_path,
        sim,
        {"dutchie": limits, "jane": {**limits, "pause_after_errors": pause_after, "pause_seconds": 60}},
    )
    platform_of = add_simulated_stores(conn, queue, sim)

    result = drain(db_url, ROLE, path, platform_wait_seconds=0)  # ends when only jane's work is left
    assert result.success, failure_text(result)
    meta = op_metadata(result, "drain_role_tasks")

    tasks = tasks_by_store(conn)
    jane = {s: t for s, t in tasks.items() if platform_of[s] == "jane"}
    dutchie = {s: t for s, t in tasks.items() if platform_of[s] == "dutchie"}
    assert {t[:2] for t in dutchie.values()} == {("completed", 0)}  # a paused platform costs others nothing
    # The first pause_after - 1 errors were plain failures: a retry each. The next one paused jane.
    retried = [s for s, t in jane.items() if t[1] > 0]
    assert len(retried) == pause_after - 1, jane
    assert all(jane[s] == ("pending", 1, True, True) for s in retried), jane
    # Every other task of jane: pending, no retry spent; those claimed were given back for later.
    rest = {s: t for s, t in jane.items() if s not in retried}
    assert {(t[0], t[1]) for t in rest.values()} == {("pending", 0)}, rest
    deferred = [s for s, t in rest.items() if t[2]]
    assert all(rest[s][3] for s in deferred), rest  # due after now: when the pause ends
    # Claimed when the pause came: tasks holding jane's slots, and the standbys waiting behind
    # them, at most twice the slots (0028).
    assert 1 <= len(deferred) <= 3 * max_in_flight, rest
    assert (meta["retried"], meta["deferred"], meta["failed"]) == (pause_after - 1, len(deferred), 0)

    # The server heard the errors that tripped it and at most what was in flight with the last one.
    log = sim.platforms["jane"].request_log()
    assert {s for _, _, s in log} == {500}
    assert pause_after <= len(log) <= pause_after - 1 + max_in_flight, len(log)
    assert len(log) < len(jane)

    rows = platform_rows(conn)
    assert rows["jane"]["state"] == "paused", rows["jane"]
    assert "HTTP 500" in rows["jane"]["pause_reason"], rows["jane"]
    assert rows["jane"]["pause_seconds_left"] > 30
    assert rows["dutchie"]["state"] == "open"
    assert_no_slots_held(conn)


# -- 4. redirect hops ---------------------------------------------------------------------------


def test_redirect_hops_are_requests_under_the_platforms_rate(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    stores, rate, burst = 8, 4, 1
    sim = simulate(stores=stores, latency_ms=20)
    path = platforms_file(
        tmp_path,
        sim,
        {
            # Every menu is a redirect hop (GET /go/menus/<id> -> 302 /menus/<id>), then the menu.
            "dutchie": {
                "max_in_flight": 4,
                "requests_per_second": rate,
                "burst": burst,
                "menu_path": "/go/menus/{platform_id}",
                "timeout_seconds": 5,
            },
            "jane": {"max_in_flight": 2, "requests_per_second": 50, "timeout_seconds": 5},
        },
    )
    platform_of = add_simulated_stores(conn, queue, sim)

    # Two runs of two threads each, each run with its own HTTP client: only the platform's limits
    # (in PostgreSQL) hold across them, not the per-process host limits. Both take tasks.
    results = drains_at_once(db_url, path, 2, concurrency=2)
    assert all(op_metadata(r, "drain_role_tasks")["claimed"] >= 1 for r in results)
    assert {s: t[:2] for s, t in tasks_by_store(conn).items()} == dict.fromkeys(platform_of, ("completed", 0))
    assert conn.execute(
        "SELECT count(DISTINCT dispensary_id) FROM products p JOIN dispensaries d ON d.id = p.dispensary_id "
        "WHERE d.menu_type = 'dutchie'"
    ).fetchone() == (stores,)

    log = sim.platforms["dutchie"].request_log()
    assert Counter(status for _, _, status in log) == {302: stores, 200: stores}  # two requests per store
    assert Counter(s for _, _, s in sim.platforms["jane"].request_log()) == {200: stores}

    # Every request took its own start from the platform's rate, hops included (a task's further
    # request asks platform_request with first = false): 2N starts at least 1/rate apart. At the
    # server the first to the last arrival spans (2N - 1)/rate, less how late the first arrived
    # after its start (one interval allowed); from the first start PostgreSQL gave, exactly.
    # Were hops free, N starts would do: about half that.
    arrivals = sorted(a for a, _, _ in log)
    assert arrivals[-1] - arrivals[0] >= (2 * stores - 2) / rate, arrivals[-1] - arrivals[0]
    # (send_at is cleared when a task gives its slot back; its claim is no later than its start.)
    [(first_start, tat)] = conn.execute(
        "SELECT extract(EPOCH FROM min(t.claimed_at))::float8, extract(EPOCH FROM max(l.tat))::float8 "
        "FROM v_tasks t JOIN tq_platforms l ON l.platform = t.platform WHERE t.platform = 'dutchie'"
    ).fetchall()
    assert arrivals[0] >= first_start - EPSILON, (arrivals[0], first_start)
    assert arrivals[-1] - first_start >= (2 * stores - 1) / rate - EPSILON, arrivals[-1] - first_start
    # The platform's GCRA moved one interval per request: its tat is 2N intervals past the first.
    assert tat - first_start >= 2 * stores / rate - EPSILON, tat - first_start
    # The same, as counts of starts per second: never more than the rate plus its burst.
    report = politeness_report(log, max_in_flight=4, requests_per_second=rate, burst=burst)
    assert report["seconds_over_rate"] == 0, report
    assert report["max_starts_per_second"] <= rate + burst, report
    offsets = [round(a - arrivals[0], 3) for a in arrivals]
    assert report["max_starts_sliding_1s"] <= rate + burst, (report, offsets)
    assert report["over_in_flight"] == 0, report
    assert_no_slots_held(conn)


# -- 5. a pause met by a handler in the middle of its task ---------------------------------------


def pause_then_fetch(elsewhere: list[Task]) -> Callable[[Task, TaskContext], JSON]:
    """A handler: the platform pauses after this task's claim and before its first request
    (another worker, holding a task of the same platform, met a 503 with Retry-After 30 and
    reported it under its own lease, then gave its task back for a retry); then the built-in
    crawl fetches the menu as usual. The other worker's task goes to ``elsewhere``."""

    def handler(task: Task, ctx: TaskContext) -> JSON:
        assert ctx.permit is not None and task.platform is not None
        queue = ctx.permit.queue
        other = queue.claim("store_discovery", "elsewhere")
        assert other is not None and other.platform == task.platform
        elsewhere.append(other)
        assert queue.platform_error(other, "HTTP 503 elsewhere", retry_after=30) is not None
        assert queue.fail(other, "HTTP 503 elsewhere", retry_after=30) == "pending"
        return crawl_menu(task, ctx)

    return handler


def test_a_handler_meeting_a_paused_platform_defers_without_a_retry(
    db_url: str,
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    sim = simulate(stores=1, latency_ms=5)
    path = platforms_file(tmp_path, sim, {"dutchie": {"max_in_flight": 2, "requests_per_second": 10}})
    settings = load_platform_settings(path)
    sync_limits(queue, settings)
    [store] = [s for s, p in add_simulated_stores(conn, queue, sim).items() if p == "dutchie"]
    conn.execute("DELETE FROM worker_tasks WHERE platform <> 'dutchie'")
    # The other worker's task: one of dutchie's too (a platform error is reported for a held task).
    queue.enqueue("store_discovery", platform="dutchie", payload={"platform": "dutchie"})

    elsewhere: list[Task] = []
    with CrawlServices(settings) as services:
        worker = Worker(
            queue,
            ROLE,
            pause_then_fetch(elsewhere),
            services=services,
            concurrency=2,
            platform_wait_seconds=0,
        )
        stats = worker.run()
    assert (stats.claimed, stats.deferred, stats.retried, stats.failed, stats.completed) == (1, 1, 0, 0, 0)
    [other] = elsewhere
    assert (queue.get(other.id).status, queue.get(other.id).retry_count) == ("pending", 1)

    [(status, retries, error, worker_id, delay)] = conn.execute(
        "SELECT status, retry_count, error_message, worker_id, "
        "       extract(EPOCH FROM scheduled_for - now())::float8 FROM v_tasks WHERE dispensary_id = %s",
        (store,),
    ).fetchall()
    assert (status, retries, error, worker_id) == ("pending", 0, None, None)
    assert 25 < delay <= 30, delay  # due when the pause ends
    assert sim.platforms["dutchie"].request_log() == []  # the server never heard of it
    rows = platform_rows(conn)
    assert (rows["dutchie"]["state"], rows["dutchie"]["in_flight"]) == ("paused", 0)
    assert_no_slots_held(conn)


# -- 6. handlers that begin late ------------------------------------------------------------------


def late_then_fetch(late: int, seconds: float) -> Callable[[Task, TaskContext], JSON]:
    """A handler: the first ``late`` tasks to begin sleep ``seconds`` before their crawl (a thread
    stalled, a busy machine), so their first requests come well after the starts their claim gave
    them; the others crawl at once."""
    begun: list[int] = []
    lock = threading.Lock()

    def handler(task: Task, ctx: TaskContext) -> JSON:
        with lock:
            begun.append(task.id)
            stalled = len(begun) <= late
        if stalled:
            threading.Event().wait(seconds)
        return crawl_menu(task, ctx)

    return handler


def test_requests_that_miss_their_start_take_new_ones(
    conn: psycopg.Connection,
    queue: TaskQueue,
    simulate: Callable[..., SimulatorProcess],
    tmp_path: Path,
):
    """A claim of five tasks gives their first requests the starts 0, 0.25 ... 1 s (4/s, burst 1);
    the first two handlers sleep half a second before theirs. Sent then, with the start of 0.5 s
    and the next ones, six would reach the server within one second; they take new starts after
    the others instead, and every second of the server hears at most rate + burst."""
    stores, rate, burst = 8, 4, 1
    sim = simulate(stores=stores, latency_ms=5)
    path = platforms_file(
        tmp_path,
        sim,
        {"dutchie": {"max_in_flight": 6, "requests_per_second": rate, "burst": burst, "timeout_seconds": 5}},
    )
    settings = load_platform_settings(path)
    sync_limits(queue, settings)
    add_simulated_stores(conn, queue, sim)
    conn.execute("DELETE FROM worker_tasks WHERE platform <> 'dutchie'")

    with CrawlServices(settings) as services:
        worker = Worker(queue, ROLE, late_then_fetch(2, 0.5), services=services, concurrency=6)
        stats = worker.run()
    outcomes = (stats.claimed, stats.completed, stats.deferred, stats.retried, stats.failed)
    assert outcomes == (stores, stores, 0, 0, 0)

    log = sim.platforms["dutchie"].request_log()
    assert Counter(status for _, _, status in log) == {200: stores}
    arrivals = sorted(a for a, _, _ in log)
    offsets = [round(a - arrivals[0], 3) for a in arrivals]
    report = politeness_report(log, max_in_flight=6, requests_per_second=rate, burst=burst)
    assert report["max_starts_sliding_1s"] <= rate + burst, (report, offsets)
    assert report["seconds_over_rate"] == 0, (report, offsets)
    # Each start came from the platform's pace: eight requests at 4/s span 7 intervals (the
    # first may reach the server a little after its start: one interval allowed).
    assert arrivals[-1] - arrivals[0] >= (stores - 2) / rate, offsets
    assert_no_slots_held(conn)
