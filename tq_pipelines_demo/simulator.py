"""A menu simulator: real HTTP servers on 127.0.0.1 speaking the generic adapter's protocol.

One server (one port, so one host for the politeness limits) per platform. Stores and menus are
derived from a seed, so every run sees the same fleet; menus change over time (each store every
few ``change_seconds``), a few stores go away, and a share of requests answer 429, 500 or hang
past the client's timeout. A platform can also have outage windows (every request 503): periodic ones on
the wall clock, and a one-off one at a set time after the start.
Each server counts requests, answers and the most requests it ever had in flight, and logs every request's
arrival, departure and status, so that the crawler's politeness can be measured where the requests land:
``politeness_report`` turns such a log into the most requests in flight at once and request starts per
second (calendar and sliding), overall and in given time windows (an outage, say). ``SimulatorProcess``
serves the same fleet from a process of its own, as a platform's servers are, so that a stall of the
client's process cannot move the arrival times its servers log.

Besides the generic adapter's routes, ``GET /go/<path...>`` answers 302 with ``Location: /<path...>`` (the
query string kept), so that a ``menu_path`` or ``menu_url`` under ``/go/`` makes every fetch two requests: a
redirect hop, then the page. Outages and faults hit it as any other request.

Two knobs make a platform hand out URLs that name a host (to test the crawl's allow-list of hosts): with
``redirect_base`` set, ``/go/`` hops answer ``Location: <redirect_base>/<path...>`` (absolute), and with
``menu_url_base`` set, a store's entry point answers ``menu_url`` ``<menu_url_base>/menus/<id>`` (absolute)
instead of the path alone. Both may name another server, or this one by another host name.
"""

import bisect
import contextlib
import json
import multiprocessing as mp
import random
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit
from urllib.request import urlopen

REGIONS = ("north", "south", "east")
CATEGORIES = ("flower", "vape", "edible", "preroll", "concentrate", "tincture")
BRANDS = ("Green Leaf", "Highland", "Sunnyside", "Old Pal", "Kiva", "Wyld", "Stiiizy", "Cresco")
WORDS = ("Blue", "Dream", "Sour", "Diesel", "Gelato", "Haze", "Kush", "Lemon", "Mint", "OG", "Runtz")
PAGE_SIZE = 100
LOG_MAX = 500_000  # request log entries kept per platform (the newest)

# One request as its server saw it: arrival, departure (time.time() floats), status (0: connection broke).
LogEntry = tuple[float, float, int]


@dataclass
class PlatformProfile:
    """How one simulated platform behaves."""

    name: str
    stores: int = 100
    latency_ms: float = 80.0
    jitter: float = 0.5  # latency varies uniformly by +- this share
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_timeout: float = 0.0
    timeout_sleep_seconds: float = 15.0
    retry_after_seconds: int = 2
    gone_share: float = 0.0  # stores that disappear, at random times within gone_within_seconds
    gone_within_seconds: float = 3600.0
    change_seconds: float = 300.0  # a store's menu changes every 1..4 of these
    outage_every_seconds: float = 0.0  # 0: never; windows are on the wall clock
    outage_seconds: float = 0.0  # how long an outage lasts, periodic or one-off; 0: no outages
    outage_start_seconds: float | None = None  # a one-off outage this long after the start; None: none
    outage_retry_after_seconds: int = 30  # the Retry-After header of an outage's 503s
    seed: int = 0
    # URLs that name a host (e.g. "http://localhost:8001"); None: paths, relative to this server.
    redirect_base: str | None = None  # where /go/ hops send the client
    menu_url_base: str | None = None  # what entry points prefix their menu_url with


@dataclass
class _Store:
    directory_id: str
    platform_id: str
    name: str
    region: str
    products: int
    change_every: int
    gone_after: float | None


@dataclass
class Stats:
    """A server's counters (``/_stats`` requests aside). ``log`` holds the newest ``LOG_MAX`` requests as
    (arrival, departure, status); ``answers`` counts the status sent even when the connection then broke,
    where ``log`` says 0."""

    requests: int = 0
    in_flight: int = 0
    answering: int = 0  # answers being written: the client may have read them, the log not yet
    max_in_flight: int = 0
    answers: Counter[int] = field(default_factory=Counter)
    log: deque[LogEntry] = field(default_factory=lambda: deque(maxlen=LOG_MAX))


class SimulatedPlatform:
    """One platform's server. ``start()`` binds a free port on 127.0.0.1; ``base_url`` is its root."""

    def __init__(self, profile: PlatformProfile, *, started_at: float | None = None) -> None:
        self.profile = profile
        self.started_at = time.time() if started_at is None else started_at
        self.stats = Stats()
        self._lock = threading.Lock()
        self._logged = threading.Condition(self._lock)  # notified when no answer is being written
        self._random = random.Random(profile.seed ^ zlib.crc32(profile.name.encode()))
        rng = random.Random(zlib.crc32(f"{profile.seed}:{profile.name}".encode()))
        self.stores: dict[str, _Store] = {}
        self.by_platform_id: dict[str, _Store] = {}
        for n in range(profile.stores):
            gone = rng.random() < profile.gone_share
            store = _Store(
                directory_id=f"{profile.name}-{n:05d}",
                platform_id=f"{zlib.crc32(f'{profile.name}{n}'.encode()):08x}",
                name=f"{rng.choice(WORDS)} {rng.choice(('Dispensary', 'Cannabis Co', 'Wellness'))} #{n}",
                region=REGIONS[n % len(REGIONS)],
                products=rng.randint(20, 60),
                change_every=rng.randint(1, 4),
                gone_after=rng.uniform(0, profile.gone_within_seconds) if gone else None,
            )
            self.stores[store.directory_id] = store
            self.by_platform_id[store.platform_id] = store
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- the fleet over time ----------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.time() - self.started_at

    def is_gone(self, store: _Store) -> bool:
        return store.gone_after is not None and self.elapsed() >= store.gone_after

    def in_outage(self, at: float | None = None) -> bool:
        """Whether time ``at`` (default: now) falls in an outage. Periodic outage windows are on the wall
        clock (the first ``outage_seconds`` of every ``outage_every_seconds`` since the epoch), so that
        they line up with the schedules' ticks: with 1200 and 180, every :00, :20 and :40 past the hour.
        The one-off window is [``started_at + outage_start_seconds``, that + ``outage_seconds``).
        A request is judged at its arrival, before its latency."""
        p = self.profile
        now = time.time() if at is None else at
        if not p.outage_seconds:
            return False
        if p.outage_every_seconds and now % p.outage_every_seconds < p.outage_seconds:
            return True
        if p.outage_start_seconds is not None:
            start = self.started_at + p.outage_start_seconds
            return start <= now < start + p.outage_seconds
        return False

    def outage_window(self) -> tuple[float, float] | None:
        """The one-off outage as (start, end) ``time.time()`` floats, or None without one."""
        p = self.profile
        if p.outage_start_seconds is None or not p.outage_seconds:
            return None
        start = self.started_at + p.outage_start_seconds
        return start, start + p.outage_seconds

    def request_log(self) -> list[LogEntry]:
        """A copy of the request log: (arrival, departure, status) per request, oldest first; arrival
        when the server began handling it (before its latency), departure once the answer was written
        or the connection broke (status 0). ``/_stats`` requests are not logged. Every request whose
        answer a client has read is in it: an answer being written is waited for (a second at most)."""
        with self._lock:
            self._await_logged()
            return list(self.stats.log)

    def _await_logged(self) -> None:
        """With the lock held: wait until no answer is being written, so that none a client has
        read is missing from the log (the handler logs a request after writing its answer)."""
        self._logged.wait_for(lambda: not self.stats.answering, timeout=1.0)

    def menu_version(self, store: _Store) -> int:
        return int(self.elapsed() // (self.profile.change_seconds * store.change_every))

    def menu(self, store: _Store, version: int | None = None) -> list[dict[str, Any]]:
        """The store's products at a menu version: the same version gives the same menu."""
        version = self.menu_version(store) if version is None else version
        base = random.Random(zlib.crc32(f"{self.profile.seed}:{store.platform_id}".encode()))
        products = []
        for n in range(store.products):
            category = base.choice(CATEGORIES)
            price = round(base.uniform(5, 80), 2)
            thc = None if category == "tincture" else round(base.uniform(5, 35), 1)
            vary = random.Random(zlib.crc32(f"{store.platform_id}:{n}:{version}".encode()))
            if version and vary.random() < 0.2:  # a fifth of the products move each version
                price = round(price * vary.choice((0.9, 0.95, 1.05, 1.1)), 2)
            products.append(
                {
                    "id": f"p{n}",
                    "name": f"{base.choice(WORDS)} {base.choice(WORDS)} {category.title()}",
                    "brand": base.choice(BRANDS),
                    "category": category,
                    "price": price,
                    "thc": thc,
                    "cbd": round(base.uniform(0, 2), 1),
                    "in_stock": vary.random() > 0.1,
                }
            )
        return products

    # -- HTTP -------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("simulator not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self, port: int = 0) -> "SimulatedPlatform":
        platform = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes; with Nagle on, the body waits for an ACK.
            disable_nagle_algorithm = True

            def do_GET(self) -> None:
                platform._serve(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256

        self._server = Server(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"sim-{self.profile.name}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        if url.path == "/_stats":
            # Light by default; ``?log=1`` adds the request log (possibly large).
            with_log = parse_qs(url.query).get("log", ["0"])[0] not in ("", "0")
            with self._lock:
                self._await_logged()
                body = {
                    "requests": self.stats.requests,
                    "in_flight": self.stats.in_flight,
                    "max_in_flight": self.stats.max_in_flight,
                    "answers": {str(k): v for k, v in self.stats.answers.items()},
                    "logged": len(self.stats.log),
                }
                if with_log:
                    body["log"] = [list(entry) for entry in self.stats.log]
            self._send(request, 200, body)
            return
        with self._lock:
            # The times are taken under the lock, so the log orders requests as the counters do.
            arrival = time.time()
            self.stats.requests += 1
            self.stats.in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
            draw = self._random.random()
            delay = (
                self.profile.latency_ms / 1000 * (1 + self.profile.jitter * (2 * self._random.random() - 1))
            )
        status = sent = 0
        answering = False
        try:
            outage = self.in_outage(arrival)
            time.sleep(max(0.0, delay))
            status, body, headers = self._answer(url.path, parse_qs(url.query), draw, outage=outage)
            if status == -1:  # a hang: the client times out first
                time.sleep(self.profile.timeout_sleep_seconds)
                status, body, headers = 504, {"error": "upstream timeout"}, {}
            with self._lock:
                self.stats.answering += 1
                answering = True
            self._send(request, status, body, headers)
            sent = status
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self._lock:
                if answering:
                    self.stats.answering -= 1
                    if not self.stats.answering:
                        self._logged.notify_all()
                self.stats.in_flight -= 1
                self.stats.answers[status] += 1
                self.stats.log.append((arrival, time.time(), sent))

    def _answer(  # noqa: PLR0911 (one return per route and fault)
        self, path: str, query: dict[str, list[str]], draw: float, *, outage: bool = False
    ) -> tuple[int, Any, dict[str, str]]:
        p = self.profile
        if outage:
            retry_after = str(p.outage_retry_after_seconds)
            return 503, {"error": f"{p.name} is down for maintenance"}, {"Retry-After": retry_after}
        if draw < p.rate_429:
            return 429, {"error": "slow down"}, {"Retry-After": str(p.retry_after_seconds)}
        draw -= p.rate_429
        if draw < p.rate_500:
            return 500, {"error": "internal error"}, {}
        draw -= p.rate_500
        if draw < p.rate_timeout:
            return -1, None, {}
        if path.startswith("/go/"):  # a redirect hop to the rest of the path
            location = path[len("/go") :] + (f"?{urlencode(query, doseq=True)}" if query else "")
            if p.redirect_base is not None:
                location = p.redirect_base.rstrip("/") + location
            return 302, {"location": location}, {"Location": location}
        parts = [unquote(x) for x in path.strip("/").split("/")]
        if parts == ["stores"]:
            region = query["region"][0] if query.get("region") else None
            page = int((query.get("page") or ["0"])[0])
            listed = [
                s
                for s in self.stores.values()
                if (region is None or s.region == region) and not self.is_gone(s)
            ]
            chunk = listed[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            more = (page + 1) * PAGE_SIZE < len(listed)
            nxt = f"/stores?page={page + 1}" + (f"&region={region}" if region else "") if more else None
            stores = [{"id": s.directory_id, "name": s.name, "region": s.region} for s in chunk]
            return 200, {"stores": stores, "next": nxt}, {}
        if len(parts) == 2 and parts[0] == "stores":
            store = self.stores.get(parts[1])
            if store is None:
                return 404, {"error": "no such store"}, {}
            if self.is_gone(store):
                return 410, {"error": "store closed"}, {}
            menu_url = f"/menus/{store.platform_id}"
            if p.menu_url_base is not None:
                menu_url = p.menu_url_base.rstrip("/") + menu_url
            return 200, {"platform_id": store.platform_id, "menu_url": menu_url}, {}
        if len(parts) == 2 and parts[0] == "menus":
            menu_store = self.by_platform_id.get(parts[1])
            if menu_store is None:
                return 404, {"error": "no such menu"}, {}
            if self.is_gone(menu_store):
                return 410, {"error": "store closed"}, {}
            return 200, {"store": menu_store.platform_id, "products": self.menu(menu_store)}, {}
        return 404, {"error": f"no route {path}"}, {}

    @staticmethod
    def _send(
        request: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            request.send_header(k, v)
        request.end_headers()
        request.wfile.write(data)


class Simulator:
    """Several platforms, started and stopped together."""

    def __init__(self, profiles: list[PlatformProfile], *, started_at: float | None = None) -> None:
        started = time.time() if started_at is None else started_at
        self.platforms = {p.name: SimulatedPlatform(p, started_at=started) for p in profiles}

    def start(self) -> "Simulator":
        for p in self.platforms.values():
            p.start()
        return self

    def stop(self) -> None:
        for p in self.platforms.values():
            p.stop()

    def __enter__(self) -> "Simulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def platforms_toml(self, **overrides: Any) -> str:
        """A platforms file pointing the generic adapter at these servers."""
        return platforms_toml({name: p.base_url for name, p in self.platforms.items()}, **overrides)

    def politeness(
        self,
        limits: dict[str, tuple[int, float, int]],
        windows: Iterable[tuple[str, float, float]] = (),
    ) -> dict[str, dict[str, Any]]:
        """``politeness_report`` for each platform named in ``limits`` (name -> (max_in_flight,
        requests_per_second, burst)), over its request log, with the same ``windows`` for each."""
        windows = list(windows)
        return {
            name: politeness_report(
                self.platforms[name].request_log(),
                max_in_flight=max_in_flight,
                requests_per_second=rps,
                burst=burst,
                windows=windows,
            )
            for name, (max_in_flight, rps, burst) in limits.items()
        }


def _serve_in_process(profiles: list[PlatformProfile], started_at: float, conn: Any) -> None:
    """A SimulatorProcess's process: serves until told to stop (anything on ``conn``)."""
    simulator = Simulator(profiles, started_at=started_at).start()
    conn.send({n: p.base_url for n, p in simulator.platforms.items()})
    conn.recv()
    simulator.stop()


class RemotePlatform:
    """A platform served by a :class:`SimulatorProcess`: its stores (the same seed, the same stores),
    its server's ``base_url``, and its server's request log, read from the server (``/_stats``)."""

    def __init__(self, platform: SimulatedPlatform, base_url: str) -> None:
        self._platform = platform
        self.profile = platform.profile
        self.stores = platform.stores
        self.by_platform_id = platform.by_platform_id
        self.base_url = base_url

    def outage_window(self) -> tuple[float, float] | None:
        """As :meth:`SimulatedPlatform.outage_window` (the same profile, the same start)."""
        return self._platform.outage_window()

    def server_stats(self, *, log: bool = False) -> dict[str, Any]:
        """The server's ``/_stats``: requests, in_flight, max_in_flight, answers, logged (and with
        ``log``, the request log as lists)."""
        with urlopen(f"{self.base_url}/_stats?log={int(log)}", timeout=60) as answer:
            stats: dict[str, Any] = json.load(answer)
        return stats

    def request_log(self) -> list[LogEntry]:
        """As :meth:`SimulatedPlatform.request_log`, from the server's process."""
        return [(a, d, s) for a, d, s in self.server_stats(log=True)["log"]]


class SimulatorProcess:
    """The simulator in a process of its own, as a platform's servers are: the arrivals they log are
    stamped by a process the client cannot stall. Served from the client's own process, a request
    that reached the socket on time is stamped late when that process stalls (a garbage collection,
    a thread waiting for the interpreter lock), and lands next to the one after it: a polite
    client would look rude at the server. ``started_at`` (default now) is the fleet's time zero,
    earlier to start with menus already moved on. ``stop()`` ends the process."""

    def __init__(self, profiles: list[PlatformProfile], *, started_at: float | None = None) -> None:
        started = time.time() if started_at is None else started_at
        local = Simulator(profiles, started_at=started)  # the stores, not served
        ctx = mp.get_context("spawn")  # not fork: the caller may hold threads and connections
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_in_process, args=(profiles, started, child), daemon=True)
        self.process.start()
        if not self._conn.poll(60):
            self.process.kill()
            raise RuntimeError("the simulator's process did not start within 60 s")
        urls: dict[str, str] = self._conn.recv()
        self.platforms = {n: RemotePlatform(p, urls[n]) for n, p in local.platforms.items()}

    @property
    def urls(self) -> dict[str, str]:
        return {n: p.base_url for n, p in self.platforms.items()}

    def request_logs(self) -> dict[str, list[LogEntry]]:
        """Every platform's request log, by name."""
        return {n: p.request_log() for n, p in self.platforms.items()}

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __enter__(self) -> "SimulatorProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def politeness_report(
    log: Iterable[LogEntry],
    *,
    max_in_flight: int,
    requests_per_second: float,
    burst: int,
    windows: Iterable[tuple[str, float, float]] = (),
) -> dict[str, Any]:
    """How polite a client was to one server, from the server's log of (arrival, departure, status):

    - ``requests``: how many requests;
    - ``max_in_flight``: the most requests in flight at once (a departure at the same instant as an
      arrival is taken first, so back-to-back requests do not overlap);
    - ``over_in_flight``: the number of arrivals that took the requests in flight above
      ``max_in_flight`` (each arrival counted once, however far above);
    - ``max_starts_per_second``: the most arrivals in one calendar second (``int(arrival)``);
    - ``seconds_over_rate``: the calendar seconds with more than ``requests_per_second + burst`` arrivals;
    - ``max_starts_sliding_1s``: the most arrivals in any window [t, t + 1 s);
    - ``windows``: for each (name, t0, t1), name -> ``{"requests": arrivals in [t0, t1), "answers":
      {status: count}}``.

    O(n log n) in the log's length (plus O(statuses * log n) per window).
    """
    entries = list(log)
    arrivals = sorted(a for a, _, _ in entries)

    # In flight: a sweep over +1 at arrivals and -1 at departures; at equal times -1 sorts first.
    events = sorted([(a, 1) for a, _, _ in entries] + [(d, -1) for _, d, _ in entries])
    in_flight = most = over = 0
    for _, step in events:
        in_flight += step
        if step > 0:
            most = max(most, in_flight)
            if in_flight > max_in_flight:
                over += 1

    per_second = Counter(int(a) for a in arrivals)
    allowed = requests_per_second + burst

    sliding = start = 0
    for end, t in enumerate(arrivals):
        while arrivals[start] + 1.0 <= t:
            start += 1
        sliding = max(sliding, end - start + 1)

    by_status: dict[int, list[float]] = {}
    for a, _, status in entries:
        by_status.setdefault(status, []).append(a)
    for times in by_status.values():
        times.sort()
    window_reports: dict[str, dict[str, Any]] = {}
    for name, t0, t1 in windows:
        answers: dict[int, int] = {}
        for status, times in sorted(by_status.items()):
            n = bisect.bisect_left(times, t1) - bisect.bisect_left(times, t0)
            if n > 0:
                answers[status] = n
        window_reports[name] = {"requests": sum(answers.values()), "answers": answers}

    return {
        "requests": len(entries),
        "max_in_flight": most,
        "over_in_flight": over,
        "max_starts_per_second": max(per_second.values(), default=0),
        "seconds_over_rate": sum(1 for n in per_second.values() if n > allowed),
        "max_starts_sliding_1s": sliding,
        "windows": window_reports,
    }


def platforms_toml(base_urls: dict[str, str], **overrides: Any) -> str:
    """A platforms file for simulated platforms at ``base_urls`` (name -> URL), every one listing
    the simulator's regions, with ``overrides`` (setting -> value) for each."""
    lines = []
    for name, url in base_urls.items():
        lines.append(f"[platforms.{name}]")
        lines.append(f'base_url = "{url}"')
        lines.append(f"regions = {json.dumps(list(REGIONS))}")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in overrides.items())
        lines.append("")
    return "\n".join(lines)


def demo_profiles(stores_per_platform: int = 100, seed: int = 7) -> list[PlatformProfile]:
    """Three platforms for `tq demo`: one healthy, one a little flaky, one with outages."""
    return [
        PlatformProfile(
            "dutchie",
            stores=stores_per_platform,
            latency_ms=60,
            rate_429=0.02,
            seed=seed,
            gone_share=0.02,
            change_seconds=120,
        ),
        PlatformProfile(
            "jane",
            stores=stores_per_platform,
            latency_ms=120,
            rate_500=0.04,
            rate_timeout=0.01,
            seed=seed,
            gone_share=0.02,
            change_seconds=180,
        ),
        PlatformProfile(
            "treez",
            stores=stores_per_platform,
            latency_ms=90,
            rate_429=0.01,
            rate_500=0.02,
            seed=seed,
            change_seconds=240,
            outage_every_seconds=1200,
            outage_seconds=180,
        ),
    ]
