"""The menu simulator's counting at the server: the per-request log, the one-off outage window, and
``politeness_report`` (requests in flight, request starts per second) over synthetic and real logs."""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest

from tq_pipelines_demo.simulator import (
    LOG_MAX,
    PlatformProfile,
    RemotePlatform,
    SimulatedPlatform,
    Simulator,
    SimulatorProcess,
    Stats,
    politeness_report,
)

BASE = 1_700_000_000.0  # a realistic time.time(), on a calendar second


def report(
    log: list[tuple[float, float, int]],
    *,
    max_in_flight: int = 4,
    requests_per_second: float = 5.0,
    burst: int = 0,
    windows: Iterable[tuple[str, float, float]] = (),
) -> dict[str, Any]:
    return politeness_report(
        log,
        max_in_flight=max_in_flight,
        requests_per_second=requests_per_second,
        burst=burst,
        windows=windows,
    )


def at(*times: float, length: float = 0.01, status: int = 200) -> list[tuple[float, float, int]]:
    """Requests arriving at BASE + each time, each in flight for ``length`` seconds."""
    return [(BASE + t, BASE + t + length, status) for t in times]


# -- politeness_report on logs with a known answer ---------------------------------------------------


def test_empty_log() -> None:
    r = report([], windows=[("any", BASE, BASE + 10)])
    assert r == {
        "requests": 0,
        "max_in_flight": 0,
        "over_in_flight": 0,
        "max_starts_per_second": 0,
        "seconds_over_rate": 0,
        "max_starts_sliding_1s": 0,
        "windows": {"any": {"requests": 0, "answers": {}}},
    }


def test_overlapping_intervals() -> None:
    # In flight: 1 at 0, 2 at 1, 3 at 2, 2 at 3, 3 at 4, 2 at 5, 1 at 6, 2 at 7, 1 at 8, 0 at 10.
    log = [
        (BASE + 0, BASE + 10, 200),
        (BASE + 1, BASE + 3, 200),
        (BASE + 2, BASE + 5, 200),
        (BASE + 4, BASE + 6, 200),
        (BASE + 7, BASE + 8, 200),
    ]
    r = report(log, max_in_flight=2)
    assert r["requests"] == 5
    assert r["max_in_flight"] == 3
    assert r["over_in_flight"] == 2  # the arrivals at 2 and at 4
    assert report(log, max_in_flight=3)["over_in_flight"] == 0
    assert report(log, max_in_flight=1)["over_in_flight"] == 4  # every arrival but the first
    # The log's order does not matter.
    assert report(log[::-1], max_in_flight=2) == r


def test_over_in_flight_counts_each_arrival_once() -> None:
    # Six at once against a limit of 4: the fifth and the sixth arrival go over, once each,
    # however long they stay in flight.
    log = at(0.0, 0.001, 0.002, 0.003, 0.004, 0.005, length=5.0)
    r = report(log, max_in_flight=4)
    assert (r["max_in_flight"], r["over_in_flight"]) == (6, 2)


def test_departure_at_an_arrival_goes_first() -> None:
    # Back to back: each request leaves at the very instant the next arrives.
    log = [(BASE + n, BASE + n + 1, 200) for n in range(5)]
    r = report(log, max_in_flight=1)
    assert (r["max_in_flight"], r["over_in_flight"]) == (1, 0)
    # Arrivals at the same instant do overlap.
    same = [(BASE, BASE + 1, 200)] * 3
    assert report(same, max_in_flight=1)["max_in_flight"] == 3
    assert report(same, max_in_flight=1)["over_in_flight"] == 2


def test_a_burst_in_one_second() -> None:
    burst = [n / 10 for n in range(10)]  # ten in the second BASE
    log = at(*burst, 1.5, 1.6, 2.1, 2.2, 2.3)  # then two, then three
    r = report(log, requests_per_second=2, burst=1)  # up to 3 a second
    assert r["max_starts_per_second"] == 10
    assert r["seconds_over_rate"] == 1  # the second with three is not over
    assert r["max_starts_sliding_1s"] == 10
    assert report(log, requests_per_second=1, burst=1)["seconds_over_rate"] == 2
    assert report(log, requests_per_second=10, burst=0)["seconds_over_rate"] == 0


def test_sliding_and_calendar_seconds_differ() -> None:
    # Three late in one second and three early in the next: within the calendar rate of 3 a second,
    # yet six starts within 0.7 s.
    log = at(0.6, 0.7, 0.8, 1.1, 1.2, 1.3)
    r = report(log, requests_per_second=3, burst=0)
    assert r["max_starts_per_second"] == 3
    assert r["seconds_over_rate"] == 0
    assert r["max_starts_sliding_1s"] == 6
    assert report(log, requests_per_second=2, burst=0)["seconds_over_rate"] == 2


def test_sliding_window_is_half_open() -> None:
    assert report(at(0.5, 1.5))["max_starts_sliding_1s"] == 1  # exactly 1 s apart
    assert report(at(0.5, 1.499))["max_starts_sliding_1s"] == 2
    assert report(at(0.5, 1.5, 1.5))["max_starts_sliding_1s"] == 2


def test_windows_count_arrivals_by_status() -> None:
    log = at(0.0, 0.5, status=200) + at(1.0, 1.2, 1.4, status=503) + at(1.9, status=0) + at(2.0, 2.5)
    windows = [
        ("before", BASE, BASE + 1),
        ("outage", BASE + 1, BASE + 2),  # half-open: the arrival at 2.0 is not in it
        ("after", BASE + 2, BASE + 3),
        ("none", BASE + 10, BASE + 20),
    ]
    r = report(log, windows=windows)
    assert r["windows"] == {
        "before": {"requests": 2, "answers": {200: 2}},
        "outage": {"requests": 4, "answers": {0: 1, 503: 3}},
        "after": {"requests": 2, "answers": {200: 2}},
        "none": {"requests": 0, "answers": {}},
    }
    assert r["requests"] == 8


def test_the_log_is_bounded() -> None:
    stats = Stats()
    assert stats.log.maxlen == LOG_MAX
    assert LOG_MAX >= 100_000


# -- the outage windows ------------------------------------------------------------------------------


def test_in_outage_one_off_and_periodic() -> None:
    started = BASE + 0.25
    one_off = SimulatedPlatform(
        PlatformProfile("one", stores=1, outage_start_seconds=10, outage_seconds=5), started_at=started
    )
    assert not one_off.in_outage(started + 9.999)
    assert one_off.in_outage(started + 10)
    assert one_off.in_outage(started + 14.999)
    assert not one_off.in_outage(started + 15)
    assert one_off.outage_window() == (started + 10, started + 15)

    periodic = SimulatedPlatform(
        PlatformProfile("periodic", stores=1, outage_every_seconds=100, outage_seconds=10), started_at=started
    )
    assert periodic.in_outage(BASE + 5)  # on the wall clock, not since the start
    assert not periodic.in_outage(BASE + 10)
    assert periodic.in_outage(BASE + 100)
    assert periodic.outage_window() is None

    both = SimulatedPlatform(
        PlatformProfile(
            "both", stores=1, outage_every_seconds=100, outage_seconds=10, outage_start_seconds=50
        ),
        started_at=BASE,
    )
    assert both.in_outage(BASE + 5) and both.in_outage(BASE + 55)
    assert not both.in_outage(BASE + 45) and not both.in_outage(BASE + 65)

    never = SimulatedPlatform(PlatformProfile("never", stores=1, outage_start_seconds=0), started_at=BASE)
    assert not never.in_outage(BASE)  # no outage_seconds, no outage


# -- real servers ------------------------------------------------------------------------------------


@pytest.fixture
def platform(request: pytest.FixtureRequest) -> Iterator[SimulatedPlatform]:
    profile: PlatformProfile = request.param
    sim = SimulatedPlatform(profile).start()
    try:
        yield sim
    finally:
        sim.stop()


TINY = PlatformProfile("tiny", stores=3, latency_ms=50, jitter=0.0)


@pytest.mark.parametrize("platform", [TINY], indirect=True)
def test_a_real_server_logs_concurrent_and_sequential_requests(platform: SimulatedPlatform) -> None:
    url = platform.base_url
    store = next(iter(platform.stores.values()))
    ready = threading.Barrier(6)
    statuses: list[int] = []

    def fire() -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            client.get("/_stats").raise_for_status()  # connect first (not logged), then fire together
            ready.wait(timeout=10)
            statuses.append(client.get("/stores").status_code)

    threads = [threading.Thread(target=fire) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    time.sleep(0.05)  # let the servers' threads log their departures
    with httpx.Client(base_url=url, timeout=10) as client:
        for path in ("/stores", f"/stores/{store.directory_id}", f"/menus/{store.platform_id}"):
            statuses.append(client.get(path).status_code)
        stats = client.get("/_stats").json()
        with_log = client.get("/_stats", params={"log": 1}).json()

    assert statuses == [200] * 9
    log = platform.request_log()
    assert len(log) == 9
    assert all(d - a >= 0.045 and s == 200 for a, d, s in log)  # the 50 ms latency, then the answer
    assert (stats["requests"], stats["max_in_flight"], stats["logged"]) == (9, 6, 9)
    assert "log" not in stats
    assert [tuple(e) for e in with_log["log"]] == log

    r = politeness_report(log, max_in_flight=4, requests_per_second=100, burst=0)
    assert r["requests"] == 9
    assert r["max_in_flight"] == 6 == platform.stats.max_in_flight
    assert r["over_in_flight"] == 2
    assert r["max_starts_sliding_1s"] == 9  # all within well under a second
    assert 5 <= r["max_starts_per_second"] <= 9  # nine in under a second: at most two calendar seconds
    assert r["seconds_over_rate"] == 0
    assert politeness_report(log, max_in_flight=6, requests_per_second=1, burst=0)["over_in_flight"] == 0


OUTAGE = PlatformProfile(
    "outage",
    stores=3,
    latency_ms=10,
    jitter=0.0,
    outage_start_seconds=0,
    outage_seconds=1,
    outage_retry_after_seconds=7,
)


@pytest.mark.parametrize("platform", [OUTAGE], indirect=True)
def test_a_one_off_outage_answers_503_then_recovers(platform: SimulatedPlatform) -> None:
    window = platform.outage_window()
    assert window is not None
    start, end = window
    with httpx.Client(base_url=platform.base_url, timeout=10) as client:
        during = [client.get("/stores") for _ in range(3)]
        time.sleep(max(0.0, end - time.time()) + 0.05)
        after = client.get("/stores")

    assert [r.status_code for r in during] == [503] * 3
    assert {r.headers["Retry-After"] for r in during} == {"7"}
    assert after.status_code == 200
    assert "Retry-After" not in after.headers

    sim = Simulator([])
    sim.platforms["outage"] = platform
    r = sim.politeness({"outage": (1, 2, 0)}, windows=[("outage", start, end), ("after", end, end + 60)])
    assert r["outage"]["requests"] == 4
    assert r["outage"]["windows"] == {
        "outage": {"requests": 3, "answers": {503: 3}},
        "after": {"requests": 1, "answers": {200: 1}},
    }
    assert r["outage"]["max_in_flight"] == 1


PERIODIC_ALWAYS = PlatformProfile(
    "always", stores=1, latency_ms=0, outage_every_seconds=1, outage_seconds=1, outage_retry_after_seconds=3
)


@pytest.mark.parametrize("platform", [PERIODIC_ALWAYS], indirect=True)
def test_a_periodic_outage_uses_the_profiles_retry_after(platform: SimulatedPlatform) -> None:
    with httpx.Client(base_url=platform.base_url, timeout=10) as client:
        response = client.get("/stores")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "3"
    assert platform.request_log()[0][2] == 503


QUICK = PlatformProfile("quick", stores=1, latency_ms=0, jitter=0.0)


@pytest.mark.parametrize("platform", [QUICK], indirect=True)
def test_every_answer_a_client_has_read_is_in_the_log(platform: SimulatedPlatform) -> None:
    # The handler logs a request after writing its answer, so a client can read the answer first;
    # the log waits for answers being written rather than miss them.
    with httpx.Client(base_url=platform.base_url, timeout=10) as client:
        for n in range(1, 301):
            client.get("/stores")
            assert len(platform.request_log()) == n


# Hops and menu URLs that name a host (the crawl's allow-list of hosts is tested against them).
PATHS = PlatformProfile("paths", stores=1, latency_ms=0, jitter=0.0)
HOSTS = PlatformProfile(
    "hosts",
    stores=1,
    latency_ms=0,
    jitter=0.0,
    redirect_base="http://localhost:1/",
    menu_url_base="https://menus.example.com",
)


@pytest.mark.parametrize(
    ("platform", "hop_prefix", "menu_prefix"),
    [(PATHS, "", ""), (HOSTS, "http://localhost:1", "https://menus.example.com")],
    indirect=["platform"],
    ids=["paths", "hosts"],
)
def test_hops_and_menu_urls_are_paths_unless_a_base_is_set(
    platform: SimulatedPlatform, hop_prefix: str, menu_prefix: str
) -> None:
    store = next(iter(platform.stores.values()))
    with httpx.Client(base_url=platform.base_url, timeout=10) as client:
        hop = client.get(f"/go/menus/{store.platform_id}", params={"a": "1"})
        entry = client.get(f"/stores/{store.directory_id}")
    assert hop.status_code == 302
    assert hop.headers["Location"] == f"{hop_prefix}/menus/{store.platform_id}?a=1"
    assert entry.status_code == 200
    assert entry.json() == {
        "platform_id": store.platform_id,
        "menu_url": f"{menu_prefix}/menus/{store.platform_id}",
    }
    # Both requests reached this server, and only these: counted as any other (the log waits for
    # answers being written, and their counts are taken with them).
    assert len(platform.request_log()) == 2
    assert platform.stats.requests == 2
    assert dict(platform.stats.answers) == {302: 1, 200: 1}


def stamp_during_a_stall(platform: SimulatedPlatform | RemotePlatform) -> tuple[float, float, float]:
    """Another process sends ``platform`` one request while this process holds the interpreter lock
    (as a long garbage collection would); returns (when it was sent, when the server stamped its
    arrival, when the stall ended), ``time.time()`` floats."""
    send_at = time.time() + 0.5
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, urllib.request\n"
            f"time.sleep(max(0.0, {send_at!r} - time.time()))\n"
            "sent = time.time()\n"
            f"urllib.request.urlopen({platform.base_url + '/stores'!r}, timeout=30).read()\n"
            "print(sent)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # this thread keeps the lock while it runs: the server's waits
    try:
        stall_end = send_at + 1.5
        while time.time() < stall_end:
            pass
    finally:
        sys.setswitchinterval(interval)
    out, _ = client.communicate(timeout=30)
    [(arrival, _, status)] = platform.request_log()
    assert status == 200
    return float(out), arrival, stall_end


def test_a_simulator_in_its_own_process_stamps_arrivals_that_the_clients_process_cannot_stall() -> None:
    """The drains run in the test's process: a server there stamps a request that reached its
    socket on time only once the process runs again, next to the requests sent after it, so a
    polite client would look rude. A SimulatorProcess stamps it as it came."""
    profile = PlatformProfile("tiny", stores=3, latency_ms=1, jitter=0.0)

    with Simulator([profile]) as here:
        sent, arrival, stall_end = stamp_during_a_stall(here.platforms["tiny"])
    assert sent < stall_end - 0.5, "the request went out after the stall: nothing measured"
    assert arrival >= stall_end - 0.05  # stamped after the stall, not when it came

    with SimulatorProcess([profile]) as remote:
        platform = remote.platforms["tiny"]
        assert remote.process.pid is not None and remote.process.pid != os.getpid()
        assert platform.stores == SimulatedPlatform(profile).stores  # the same seed, the same stores
        sent, arrival, stall_end = stamp_during_a_stall(platform)
    assert sent < stall_end - 0.5, "the request went out after the stall: nothing measured"
    assert arrival - sent < 0.2  # stamped as it came, in the stall
    assert not remote.process.is_alive()
