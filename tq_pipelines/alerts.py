"""Alerts: always to the log; to a generic webhook and to Slack when they are configured."""

import json
import logging
import os
import urllib.request
from dataclasses import dataclass

import dagster as dg

log = logging.getLogger(__name__)


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
        raised: an alert must not fail the sensor that sends it."""
        logger = logger or log
        level = logging.ERROR if alert.severity == "error" else logging.WARNING
        logger.log(level, "ALERT %s: %s%s", alert.title, alert.text, f" ({alert.url})" if alert.url else "")
        reached = ["log"]
        webhook = self.webhook_url or os.environ.get("TQ_ALERT_WEBHOOK_URL", "")
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
            except Exception:
                logger.exception("alert webhook %s failed", webhook)
        token = self.slack_token or os.environ.get("TQ_SLACK_TOKEN", "")
        channel = self.slack_channel or os.environ.get("TQ_SLACK_CHANNEL", "")
        if token and channel:
            try:
                from dagster_slack import SlackResource

                text = f"*{alert.title}*\n{alert.text}" + (
                    f"\n<{alert.url}|Open in Dagster>" if alert.url else ""
                )
                SlackResource(token=token).get_client().chat_postMessage(channel=channel, text=text)
                reached.append("slack")
            except Exception:
                logger.exception("alert to Slack channel %s failed", channel)
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
