"""HTTP for handlers: urllib3 with a pool manager per host, politeness per platform and per host,
and errors classified.

The limit that counts is the platform's, shared by every worker of the fleet: each request of a
task (redirect hops included, whatever host they name) goes through the task's
:class:`~tq_pipelines.queue.worker.PlatformPermit`, which waits for the start PostgreSQL gives it and
defers the task while the platform is paused. Answers that speak of the platform (5xx, 429, a
timeout, a refused connection) go to the platform's breaker; a task that meets a pause is given
back, not failed. A request given up at its timeout once it reached the host may still be served
there: the permit keeps its slot taken, fleet-wide, until the host's own timeout has passed
(``server_timeout_seconds``).

The second line, within this process, per host (scheme, name and port): at most
``max_in_flight`` requests at once and at most ``requests_per_second`` started. A handler that
cannot get a slot within ``slot_wait_seconds`` defers its task (:class:`DeferTask`) instead of
holding a worker thread. A 429 with Retry-After pauses the host for that long.
"""

import builtins
import email.utils
import json
import os
import threading
import time
import urllib.request
from collections.abc import Collection
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import unquote, urlencode, urljoin, urlsplit

import certifi
import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    LocationValueError,
    ProtocolError,
    ReadTimeoutError,
)

from tq_pipelines.queue.api import MAX_DELAY_SECONDS
from tq_pipelines.queue.redact import redact_text, redact_url
from tq_pipelines.queue.worker import (
    DeferTask,
    PermanentTaskError,
    PlatformPermit,
    TransientTaskError,
    current_permit,
)

# Redirect hops followed by hand, so that each is a request under the platform's limits.
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset((301, 302, 303, 307, 308))


class GoneError(PermanentTaskError):
    """HTTP 410: the platform says the thing asked for is gone for good. ``url`` is as errors show
    it: credentials and token parameters masked."""

    def __init__(self, url: str, status: int = 410) -> None:
        url = redact_text(url)
        super().__init__(f"HTTP {status} for {url}")
        self.url = url
        self.status = status


@dataclass(frozen=True)
class HostLimits:
    max_in_flight: int = 4
    requests_per_second: float = 10.0
    slot_wait_seconds: float = 5.0
    # How long the host may go on serving a request from its arrival (its own timeout): a
    # request the client gave up on holds its platform's slot until then.
    server_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        if (
            self.max_in_flight < 1
            or self.requests_per_second <= 0
            or self.slot_wait_seconds < 0
            or not 0 <= self.server_timeout_seconds <= 3600
        ):
            raise ValueError(
                "max_in_flight must be >= 1, requests_per_second > 0, slot_wait_seconds >= 0 and "
                "server_timeout_seconds between 0 and 3600"
            )


class _Host:
    """One host's slots (a semaphore), its token bucket and its pause."""

    def __init__(self, limits: HostLimits) -> None:
        self.limits = limits
        self.slots = threading.BoundedSemaphore(limits.max_in_flight)
        self.lock = threading.Lock()
        self.due = 0.0  # the rate's theoretical start of the next request (monotonic)
        self.paused_until = 0.0

    def _earliest(self, now: float) -> tuple[float, float]:
        """(the rate's due time, the earliest start) under GCRA: a burst of up to
        ``max_in_flight`` after an idle spell, then one per interval; no start while paused.
        Call with the lock held."""
        interval = 1.0 / self.limits.requests_per_second
        due = max(self.due, now)
        start = max(now, due - interval * (self.limits.max_in_flight - 1), self.paused_until)
        return due, start

    def reserve_start(self, max_wait: float) -> float | None:
        """Take the earliest start if it is at most ``max_wait`` away; returns the wait, or None,
        reserving nothing, when it is further (the caller defers its task)."""
        with self.lock:
            now = time.monotonic()
            due, start = self._earliest(now)
            if start - now > max_wait:
                return None
            self.due = max(due, start) + 1.0 / self.limits.requests_per_second
            return start - now

    def next_start_in(self) -> float:
        """How long until a request could start (for a deferred task's delay)."""
        with self.lock:
            now = time.monotonic()
            return self._earliest(now)[1] - now


def host_key(url: str) -> str:
    """Scheme, host and port: the unit of the per-host limits, and how messages name a host
    (never with the credentials a URL may carry)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date), at most the queue's longest delay
    (a day; a longer one is taken as a day); None if unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value), MAX_DELAY_SECONDS)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(max(0.0, when.timestamp() - time.time()), MAX_DELAY_SECONDS)


class PoliteClient:
    """GETs JSON under per-host limits; raises the worker's error classes for what went wrong."""

    def __init__(self, *, timeout_seconds: float = 10.0, user_agent: str = "tq_pipelines") -> None:
        self.timeout_seconds = timeout_seconds
        self.headers = urllib3.make_headers(user_agent=user_agent, accept_encoding=True)
        self.headers["Accept"] = "application/json"
        # urllib3, a pool manager per host: the client's work sits between a request's answer and
        # the next request of its slot, and urllib3 takes about half of httpx's time there
        # (bench/client_gap.py).
        self._managers: dict[str, urllib3.PoolManager] = {}
        self._closed = False
        self._hosts: dict[str, _Host] = {}
        self._limits: dict[str, HostLimits] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            managers, self._managers, self._closed = list(self._managers.values()), {}, True
        for manager in managers:
            manager.clear()

    def _manager(self, key: str) -> urllib3.PoolManager:
        with self._lock:
            if self._closed:
                raise RuntimeError("this PoliteClient is closed")
            manager = self._managers.get(key)
            if manager is None:
                manager = self._managers[key] = _manager_for(key, self.headers)
            return manager

    def __enter__(self) -> "PoliteClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_limits(self, base_url: str, limits: HostLimits) -> None:
        """Limits for the host of ``base_url``; hosts not set get :class:`HostLimits` defaults."""
        with self._lock:
            self._limits[host_key(base_url)] = limits
            self._hosts.pop(host_key(base_url), None)

    def _host(self, key: str) -> _Host:
        with self._lock:
            host = self._hosts.get(key)
            if host is None:
                host = self._hosts[key] = _Host(self._limits.get(key, HostLimits()))
            return host

    def get_json(
        self,
        url: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        allowed_hosts: Collection[str] | None = None,
    ) -> Any:
        """The JSON body of a GET, redirects followed. Timeouts, connection errors, 429 and 5xx
        raise :class:`TransientTaskError` (or :class:`DeferTask` when they paused the platform);
        410 :class:`GoneError`; other 4xx and a body that is not JSON :class:`PermanentTaskError`;
        a paused platform or a saturated host :class:`DeferTask`. With ``allowed_hosts``, a URL
        (the first or a redirect's) on any other host is refused before it is requested."""
        permit = current_permit.get()
        if params:
            url += ("&" if urlsplit(url).query else "?") + urlencode(params)
        for _ in range(MAX_REDIRECTS + 1):
            if allowed_hosts is not None:
                _check_host(url, allowed_hosts)
            response, host = self._send(url, timeout, permit)
            location = response.headers.get("Location")
            if response.status not in REDIRECT_STATUSES or location is None:
                return self._body(url, response, host, permit)
            url = urljoin(url, location)
        raise PermanentTaskError(redact_text(f"more than {MAX_REDIRECTS} redirects from GET {url}"))

    def _send(
        self, url: str, timeout: float | None, permit: PlatformPermit | None
    ) -> tuple[urllib3.BaseHTTPResponse, _Host]:
        key = host_key(url)
        try:
            if not key.startswith(("http://", "https://")):
                raise LocationValueError("not an http(s) URL")
            parts = urllib3.util.parse_url(url)
            manager = self._manager(key)
        except LocationValueError as exc:
            raise PermanentTaskError(redact_text(f"cannot request {url}: {exc}")) from None
        # Credentials in the URL are sent as Basic auth (and never shown: redact_text).
        headers = self.headers
        if parts.auth is not None:
            headers = {**headers, **urllib3.make_headers(basic_auth=unquote(parts.auth))}
        host = self._host(key)
        wait = host.limits.slot_wait_seconds
        seconds = self.timeout_seconds if timeout is None else timeout
        # The platform's start first (fleet-wide), then this process's host slot.
        with permit.request() if permit is not None else nullcontext():
            if not host.slots.acquire(timeout=wait):
                raise DeferTask(max(1.0, wait), f"{key}: {host.limits.max_in_flight} requests in flight")
            try:
                delay = host.reserve_start(wait)
                if delay is None:
                    later = host.next_start_in()
                    raise DeferTask(max(later, 1.0), f"{key}: paused or rate-limited for {later:.1f} s")
                if delay > 0:
                    time.sleep(delay)
                sent = time.monotonic()
                try:
                    return manager.urlopen(
                        "GET",
                        parts._replace(auth=None).url,  # not in a proxy's request line
                        headers=headers,
                        redirect=False,
                        retries=False,
                        timeout=urllib3.Timeout(connect=seconds, read=seconds),
                    ), host
                except HTTPError as exc:
                    reached = _reached_the_host(exc)
                    if reached and permit is not None:
                        # The request reached the host, which may go on serving it after we gave
                        # up: its slot stays taken until the host's own timeout has passed.
                        elapsed = time.monotonic() - sent
                        permit.abandon(max(0.0, host.limits.server_timeout_seconds - elapsed))
                    if reached or type(exc) is ConnectTimeoutError:
                        _platform_trouble(permit, f"timeout on GET {url}: {type(exc).__name__}", None, exc)
                    _platform_trouble(permit, f"connection error on GET {url}: {exc}", None, exc)
            finally:
                host.slots.release()

    @staticmethod
    def _body(
        url: str, response: urllib3.BaseHTTPResponse, host: _Host, permit: PlatformPermit | None
    ) -> Any:
        status = response.status
        url = redact_text(url)
        if status == 429 or status >= 500:
            after = retry_after_seconds(response.headers.get("Retry-After"))
            if status == 429 and after:
                with host.lock:
                    host.paused_until = max(host.paused_until, time.monotonic() + after)
            message = f"HTTP {status} for {url}" + (f" (Retry-After {after:.0f} s)" if after else "")
            _platform_trouble(permit, message, after)
        if permit is not None:
            permit.report_answer()  # the platform answered: a probe's answer reopens it
        if status == 410:
            raise GoneError(url, status)
        # A 404 fails the task but does not switch the store off: a wrong path in the settings or a
        # proxy's hiccup answers 404 too, and one of those must not silence a whole platform.
        if status >= 400:
            text = response.data[:200].decode("utf-8", "replace")
            raise PermanentTaskError(redact_text(f"HTTP {status} for {url}: {text}"))
        try:
            return json.loads(response.data)
        except ValueError as exc:
            raise PermanentTaskError(redact_text(f"{url} did not answer JSON: {exc}")) from exc


def _manager_for(key: str, headers: dict[str, str]) -> urllib3.PoolManager:
    """The pools of one host (``scheme://host:port``), through the proxy the environment names
    for it (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, minus ``NO_PROXY``), and for https
    trusting ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` if set, else certifi's bundle."""
    scheme, _, netloc = key.partition("://")
    options: dict[str, Any] = {
        # The pool must not be the bottleneck: the per-host limits are. Past 256 idle
        # connections a request opens a new one rather than wait for one.
        "maxsize": 256,
        "block": False,
        # No retry and no redirect of urllib3's own: each hop is a request under the limits
        # (get_json), and a retry is the queue's.
        "retries": False,
    }
    if scheme == "https":
        if os.environ.get("SSL_CERT_FILE"):
            options["ca_certs"] = os.environ["SSL_CERT_FILE"]
        elif os.environ.get("SSL_CERT_DIR"):
            options["ca_cert_dir"] = os.environ["SSL_CERT_DIR"]
        else:
            options["ca_certs"] = certifi.where()
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    # proxy_bypass_environment reads NO_PROXY as urllib does (not in the stubs: private by name only).
    if not proxy or urllib.request.proxy_bypass_environment(netloc, proxies):  # type: ignore[attr-defined]
        return urllib3.PoolManager(headers=headers, **options)
    auth = urllib3.util.parse_url(proxy).auth
    proxy_headers = urllib3.make_headers(proxy_basic_auth=unquote(auth)) if auth else None
    return urllib3.ProxyManager(proxy, headers=headers, proxy_headers=proxy_headers, **options)


def _reached_the_host(exc: HTTPError) -> bool:
    """A timeout once the request was on its way: while it was written, or while its answer was
    awaited (urllib3 reports the first as a ProtocolError around the socket's timeout)."""
    return isinstance(exc, ReadTimeoutError) or (
        isinstance(exc, ProtocolError) and any(isinstance(a, builtins.TimeoutError) for a in exc.args)
    )


def _check_host(url: str, allowed_hosts: Collection[str]) -> None:
    """Refuse a URL that is not http(s), carries user info, or names a host not in the list; the
    error shows its scheme and host only (a path or a query may carry a secret)."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        ok = parts.scheme in ("http", "https") and host in allowed_hosts and "@" not in parts.netloc
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError:
        ok = False
    if not ok:
        hosts = ", ".join(sorted(allowed_hosts))
        raise PermanentTaskError(
            f"refused to request {redact_url(url)}: not on the platform's hosts ({hosts})"
        )


def _platform_trouble(
    permit: PlatformPermit | None, message: str, retry_after: float | None, cause: Exception | None = None
) -> NoReturn:
    """An answer that speaks of the platform: its breaker hears of it. If the platform is now
    paused (this answer tripped it, or it was already), the task is given back untried for the
    pause; otherwise it is a transient failure. The message (stored with the task and the
    platform) has the URL's credentials and token parameters masked."""
    message = redact_text(message)
    if permit is not None:
        pause = permit.report_error(message, retry_after=retry_after)
        if pause is not None:
            raise DeferTask(
                max(pause, 1.0), f"{message}; platform {permit.platform} paused for {pause:.0f} s"
            ) from cause
    raise TransientTaskError(message, retry_after=retry_after) from cause
