"""Alerts: always to the log; to a generic webhook and to Slack when they are configured."""

import json
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

import dagster as dg

from tq_pipelines.redact import redact_text, redact_url

log = logging.getLogger(__name__)


def _why(exc: Exception) -> str:
    """A failed delivery in one line: the HTTP status, else the error's class and message."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"{type(exc).__name__}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Alert:
    title: str
    text: str
    severity: str = "error"  # "error" or "warning"
    url: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return {"title": self.title, "text": self.text, "severity": self.severity, "url": self.url}


class AlertResource(dg.ConfigurableResource):
    """Where alerts go. Empty settings fall back, at send time, to TQ_ALERT_WEBHOOK_URL,
    TQ_SLACK_TOKEN and TQ_SLACK_CHANNEL; a channel with nothing configured is off."""

    webhook_url: str = ""
    slack_token: str = ""
    slack_channel: str = ""
    webserver_base_url: str = "http://localhost:3000"
    timeout_seconds: float = 10.0

    def send(self, alert: Alert, logger: logging.Logger | None = None) -> list[str]:
        """Deliver ``alert``; returns the channels it reached. A failing channel is logged, never
        raised: an alert must not fail the sensor that sends it.

        What is logged and sent goes through :func:`~tq_pipelines.redact.redact_text`, the webhook
        URL and the Slack token counted as secrets: a failed delivery names the webhook by its
        host only (for Slack, Teams and Discord the path is the secret) and says why it failed,
        without a traceback (a URL error quotes the URL)."""
        logger = logger or log
        webhook = (self.webhook_url or os.environ.get("TQ_ALERT_WEBHOOK_URL", "")).strip()
        token = (self.slack_token or os.environ.get("TQ_SLACK_TOKEN", "")).strip()
        channel = self.slack_channel or os.environ.get("TQ_SLACK_CHANNEL", "")
        secrets = [s for s in (webhook, token) if s]

        def shown(text: str) -> str:
            return redact_text(text, secrets)

        alert = Alert(
            title=shown(alert.title),
            text=shown(alert.text),
            severity=alert.severity,
            url=shown(alert.url) if alert.url else None,
        )
        level = logging.ERROR if alert.severity == "error" else logging.WARNING
        logger.log(level, "ALERT %s: %s%s", alert.title, alert.text, f" ({alert.url})" if alert.url else "")
        reached = ["log"]
        if webhook:
            try:
                request = urllib.request.Request(
                    webhook,
                    data=json.dumps(alert.as_json()).encode(),
                    headers={"Content-Type": "application/json"},
                    method="POST",
                )
                with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                    response.read()
                reached.append("webhook")
            except Exception as exc:
                logger.error("alert webhook %s failed: %s", redact_url(webhook), shown(_why(exc)))
        if token and channel:
            try:
                from dagster_slack import SlackResource

                text = f"*{alert.title}*\n{alert.text}" + (
                    f"\n<{alert.url}|Open in Dagster>" if alert.url else ""
                )
                SlackResource(token=token).get_client().chat_postMessage(channel=channel, text=text)
                reached.append("slack")
            except Exception as exc:
                logger.error("alert to Slack channel %s failed: %s", channel, shown(_why(exc)))
        return reached

    def configured_channels(self) -> set[str]:
        """The channels :meth:`send` tries, the log included."""
        channels = {"log"}
        if self.webhook_url or os.environ.get("TQ_ALERT_WEBHOOK_URL"):
            channels.add("webhook")
        if (self.slack_token or os.environ.get("TQ_SLACK_TOKEN")) and (
            self.slack_channel or os.environ.get("TQ_SLACK_CHANNEL")
        ):
            channels.add("slack")
        return channels

    def run_url(self, run_id: str) -> str:
        return f"{self.webserver_base_url.rstrip('/')}/runs/{run_id}"
