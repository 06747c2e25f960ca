"""Alerts: always to the log; to a generic webhook and to Slack when they are configured.

Every delivery is bounded: a short timeout per request, the channels in parallel threads, and one
deadline for all of them, so that a receiver that hangs cannot hold up the sensor that sends."""

import hashlib
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import dagster as dg
from pydantic import Field

from tq_pipelines.defs.resources import settings_validator
from tq_pipelines.queue.redact import redact_text, redact_url

log = logging.getLogger(__name__)

DEFAULT_WEBSERVER_URL = "http://localhost:3000"
# The channels besides the log, in the order they are reported.
REMOTE_CHANNELS = ("webhook", "slack")


def _why(exc: Exception) -> str:
    """A failed delivery in one line: the HTTP status, else the error's class and message."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"{type(exc).__name__}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def alert_id(*parts: str) -> str:
    """A stable id made of ``parts`` (an alert's key and when it first appeared, or a run's id).
    Sent with the alert, so that a receiver can drop a delivery it already has: one that timed
    out on our side after it arrived comes again with the same id."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Alert:
    title: str
    text: str
    severity: str = "error"  # "error" or "warning"
    url: str | None = None
    id: str = ""  # empty: derived from the content when delivered

    def as_json(self) -> dict[str, str | None]:
        return {
            "id": self.id,
            "title": self.title,
            "text": self.text,
            "severity": self.severity,
            "url": self.url,
        }


@dataclass
class Delivery:
    """What one delivery did: the channels each alert (by id) reached, and for each channel that
    failed, the id of the alert it was on when it failed or ran out of time."""

    took: dict[str, set[str]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class _Channel(threading.Thread):
    """One channel's alerts, sent in order; stops at the first failure, or before the next alert
    once told to. A daemon: a receiver that never answers must not hold up the process's exit."""

    def __init__(self, name: str, post: Callable[[Alert], None], alerts: list[Alert]) -> None:
        super().__init__(name=f"tq-alert-{name}", daemon=True)
        self.channel = name
        self.post = post
        self.alerts = alerts
        self.lock = threading.Lock()
        self.stopped = False
        self.took: list[str] = []
        self.error: Exception | None = None

    def run(self) -> None:
        for alert in self.alerts:
            with self.lock:
                if self.stopped:
                    return
            try:
                self.post(alert)
            except Exception as exc:
                with self.lock:
                    self.error = exc
                return
            with self.lock:
                self.took.append(alert.id)

    def stop(self) -> tuple[list[str], Exception | None]:
        """Send nothing more; what was taken and the error, as of now."""
        with self.lock:
            self.stopped = True
            return list(self.took), self.error


class AlertResource(dg.ConfigurableResource):
    """Where alerts go. Empty settings fall back, at send time, to TQ_ALERT_WEBHOOK_URL,
    TQ_SLACK_TOKEN, TQ_SLACK_CHANNEL and TQ_DAGSTER_URL; a channel with nothing configured is off."""

    webhook_url: str = ""
    slack_token: str = ""
    slack_channel: str = ""
    slack_api_url: str = Field(
        default="https://slack.com/api/", description="Slack's Web API (GovSlack and proxies differ)"
    )
    webserver_base_url: str = Field(
        default="",
        description=f"Dagster's UI, for links; empty: TQ_DAGSTER_URL, else {DEFAULT_WEBSERVER_URL}",
    )
    timeout_seconds: float = Field(
        default=5.0, gt=0, le=10, description="Each request to the webhook or Slack (connect, each read)"
    )
    # 15 s leaves a tick of queue_health_sensor time for its checks within 20 s, far from
    # Dagster's 60 s limit on a sensor tick.
    deadline_seconds: float = Field(
        default=15.0, gt=0, le=15, description="All the deliveries of one tick, the channels in parallel"
    )
    retry_backoff_seconds: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="queue_health_sensor's wait before it tries a failed channel again, doubled "
        "with each failure in a row, up to 16 times this",
    )

    _check_setting = settings_validator()

    def _targets(self) -> tuple[str, str, str]:
        webhook = (self.webhook_url or os.environ.get("TQ_ALERT_WEBHOOK_URL", "")).strip()
        token = (self.slack_token or os.environ.get("TQ_SLACK_TOKEN", "")).strip()
        channel = (self.slack_channel or os.environ.get("TQ_SLACK_CHANNEL", "")).strip()
        return webhook, token, channel

    def configured_channels(self) -> set[str]:
        """The channels :meth:`deliver` tries, the log included."""
        webhook, token, channel = self._targets()
        return {"log"} | ({"webhook"} if webhook else set()) | ({"slack"} if token and channel else set())

    def send(self, alert: Alert, logger: logging.Logger | None = None) -> list[str]:
        """Deliver ``alert`` once to every configured channel (see :meth:`deliver`); returns the
        channels it reached, the log first."""
        [reached] = self.deliver([alert], logger).took.values()
        return [c for c in ("log", *REMOTE_CHANNELS) if c in reached]

    def deliver(
        self,
        alerts: Sequence[Alert],
        logger: logging.Logger | None = None,
        *,
        done: Mapping[str, Collection[str]] | None = None,
        channels: Collection[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> Delivery:
        """Deliver each alert to each of ``channels`` (default: every configured one) that has not
        taken it yet (``done``, by alert id), within ``deadline_seconds`` (at most
        :attr:`deadline_seconds`). An alert without an id gets one from its content.

        The log takes every alert at once. The webhook and Slack each get a thread that sends in
        order and stops at its first failure; what is not through by the deadline is left to the
        caller (a late thread sends nothing more, and what it still takes is not counted). A
        failure is logged, never raised: an alert must not fail the sensor that sends it.

        What is logged and sent goes through :func:`~tq_pipelines.queue.redact.redact_text`, the webhook
        URL and the Slack token counted as secrets: a failed delivery names the webhook by its
        host only (for Slack, Teams and Discord the path is the secret) and says why it failed,
        without a traceback (a URL error quotes the URL)."""
        logger = logger or log
        budget = (
            self.deadline_seconds
            if deadline_seconds is None
            else min(deadline_seconds, self.deadline_seconds)
        )
        deadline = time.monotonic() + budget
        webhook, token, slack_channel = self._targets()
        secrets = [s for s in (webhook, token) if s]

        def shown(text: str) -> str:
            return redact_text(text, secrets)

        cleaned = [
            replace(a, title=shown(a.title), text=shown(a.text), url=shown(a.url) if a.url else None)
            for a in alerts
        ]
        cleaned = [a if a.id else replace(a, id=alert_id(a.title, a.text, a.url or "")) for a in cleaned]
        done = done or {}
        wanted = self.configured_channels() if channels is None else set(channels)
        result = Delivery(took={a.id: set() for a in cleaned})

        def todo(channel: str) -> list[Alert]:
            return [a for a in cleaned if channel in wanted and channel not in done.get(a.id, ())]

        for a in todo("log"):
            level = logging.ERROR if a.severity == "error" else logging.WARNING
            logger.log(level, "ALERT %s: %s%s", a.title, a.text, f" ({a.url})" if a.url else "")
            result.took[a.id].add("log")

        posts: dict[str, Callable[[Alert], None]] = {}
        if webhook:
            posts["webhook"] = self._webhook_post(webhook)
        if token and slack_channel:
            posts["slack"] = self._slack_post(token, slack_channel)
        threads = [
            _Channel(name, post, pending)
            for name, post in posts.items()
            if (pending := todo(name)) and budget > 0
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for t in threads:
            took, error = t.stop()
            for i in took:
                result.took[i].add(t.channel)
            if error is None and len(took) == len(t.alerts):
                continue
            result.failed[t.channel] = t.alerts[len(took)].id
            why = shown(_why(error)) if error else f"no answer within the {budget:g} s deadline"
            left = len(t.alerts) - len(took) - 1
            more = f" ({left} more alert(s) not sent)" if left else ""
            if t.channel == "webhook":
                logger.error("alert webhook %s failed: %s%s", redact_url(webhook), why, more)
            else:
                logger.error("alert to Slack channel %s failed: %s%s", slack_channel, why, more)
        return result

    def _webhook_post(self, url: str) -> Callable[[Alert], None]:
        def post(alert: Alert) -> None:
            request = urllib.request.Request(
                url,
                data=json.dumps(alert.as_json()).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                    response.read(64 * 1024)
            except urllib.error.HTTPError as exc:
                exc.close()  # it holds the connection, and outlives this call
                raise

        return post

    def _slack_post(self, token: str, channel: str) -> Callable[[Alert], None]:
        def post(alert: Alert) -> None:
            from slack_sdk import WebClient

            # The client's own retries are off: a channel that fails waits for the sensor's backoff.
            client = WebClient(
                token=token,
                base_url=self.slack_api_url,
                timeout=max(1, math.ceil(self.timeout_seconds)),
                retry_handlers=[],
            )
            text = f"*{alert.title}*\n{alert.text}" + (
                f"\n<{alert.url}|Open in Dagster>" if alert.url else ""
            )
            client.chat_postMessage(channel=channel, text=text)

        return post

    def webserver_url(self) -> str:
        """Dagster's UI: the setting, else TQ_DAGSTER_URL (read now), else localhost."""
        base = (
            self.webserver_base_url or os.environ.get("TQ_DAGSTER_URL", "").strip() or DEFAULT_WEBSERVER_URL
        )
        return base.rstrip("/")

    def run_url(self, run_id: str) -> str:
        return f"{self.webserver_url()}/runs/{run_id}"
