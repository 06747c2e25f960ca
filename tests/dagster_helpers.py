"""Helpers for tests that run Dagster jobs and sensors: run results read back as plain values,
and a real webhook on 127.0.0.1 for alerts."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import dagster as dg
import pytest


def op_metadata(result: dg.ExecuteInProcessResult, op: str) -> dict[str, Any]:
    """The metadata of the op's output, as plain values."""
    [event] = [e for e in result.events_for_node(op) if e.event_type == dg.DagsterEventType.STEP_OUTPUT]
    return {k: v.value for k, v in event.step_output_data.metadata.items()}


def _chain(error: Any) -> str:
    messages = []
    while error is not None:
        messages.append(error.message)
        error = error.cause
    return "\n".join(messages)


def failure_text(result: dg.ExecuteInProcessResult) -> str:
    """Every error message of the run's failed steps and failed resource inits, causes included."""
    texts = []
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.STEP_FAILURE:
            texts.append(_chain(event.step_failure_data.error))
        elif event.event_type == dg.DagsterEventType.RESOURCE_INIT_FAILURE:
            texts.append(_chain(event.engine_event_data.error))
    return "\n".join(texts)


class Webhook:
    """An HTTP server on 127.0.0.1 that records the JSON of every POST."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self.refuse_next = 0  # answer that many POSTs with 503, as a webhook that is down would
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                post = {"path": self.path, "content_type": self.headers["Content-Type"], **json.loads(body)}
                if hook.refuse_next > 0:
                    hook.refuse_next -= 1
                    hook.refused.append(post)
                    self.send_response(503)
                else:
                    hook.posts.append(post)
                    self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/tq"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def titles(self) -> list[str]:
        return [p["title"] for p in self.posts]


@pytest.fixture
def webhook(monkeypatch: pytest.MonkeyPatch) -> Iterator[Webhook]:
    for name in ("TQ_ALERT_WEBHOOK_URL", "TQ_SLACK_TOKEN", "TQ_SLACK_CHANNEL"):
        monkeypatch.delenv(name, raising=False)
    hook = Webhook()
    hook.thread.start()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()
    hook.thread.join()
