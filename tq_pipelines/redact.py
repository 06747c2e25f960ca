"""Secrets kept out of what gets printed: logs, exceptions, run metadata and alerts.

A database URL or conninfo keeps its user, host, port and database and loses its password (and
any other secret parameter); a webhook URL keeps its scheme and host and loses its path and
query, which for Slack, Teams and Discord webhooks are the secret itself.
"""

import os
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

MASK = "***"

# Query parameters that hold a secret: libpq's, and the usual names of tokens and signatures.
_SECRET_PARAMS = frozenset(
    {
        "password",
        "sslpassword",
        "passfile",
        "sslkey",
        "token",
        "access_token",
        "key",
        "secret",
        "sig",
        "signature",
    }
)
# Environment variables whose values are secrets wherever they appear.
SECRET_ENV = (
    "TQ_DATABASE_URL",
    "TQ_TEST_DATABASE_URL",
    "TQ_DAGSTER_DATABASE_URL",
    "TQ_DAGSTER_PG_URL",
    "TQ_ALERT_WEBHOOK_URL",
    "TQ_SLACK_TOKEN",
    "PGPASSWORD",
)

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_KEYWORD = re.compile(r"\b(password|sslpassword)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` safe to print. Database URLs keep everything but secrets; other URLs (webhooks)
    keep only their scheme and host."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return MASK
    if not parts.scheme.startswith("postgres"):
        tail = "/" + MASK if (parts.path.strip("/") or parts.query) else ""
        return urlunsplit((parts.scheme, host + port, tail, "", ""))
    auth = ""
    if parts.username is not None:
        auth = parts.username + (":" + MASK if parts.password is not None else "") + "@"
    query = urlencode(
        [(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)], safe="*"
    )
    return urlunsplit((parts.scheme, auth + host + port, parts.path, query, ""))


def redact_conninfo(conninfo: str) -> str:
    """A libpq URL or key=value string, its password masked."""
    if "://" in conninfo:
        return redact_url(conninfo)
    try:
        conninfo_to_dict(conninfo)
    except Exception:
        return MASK + " (not a valid URL or conninfo, hidden whole)"
    return _KEYWORD.sub(lambda m: f"{m.group(1)}={MASK}", conninfo)


def _mask_credentials(url: str) -> str:
    """Any URL with its password and secret query parameters masked, its path kept (an HTTP
    error's URL stays useful); known secret URLs are masked whole by :func:`redact_text`."""
    try:
        parts = urlsplit(url)
        if parts.password is None and not parts.query:
            return url
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(":" + parts.password + "@", ":" + MASK + "@", 1)
        query = "&".join(
            f"{k}={MASK}" if k.lower() in _SECRET_PARAMS else f"{k}={v}"
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return MASK


def _env_secrets() -> list[str]:
    found = []
    for name in SECRET_ENV:
        value = os.environ.get(name, "")
        if not value:
            continue
        found.append(value)
        try:
            parts = urlsplit(value)
            if parts.password:
                found.append(parts.password)
        except ValueError:
            pass
    return found


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every value of ``secrets`` and of the secret environment variables
    (:data:`SECRET_ENV`) replaced by its redacted form wherever it appears, and every other URL
    and conninfo stripped of passwords and secret parameters."""
    for secret in sorted({*secrets, *_env_secrets()}, key=len, reverse=True):
        if len(secret) >= 4:  # never mask a short common string everywhere
            shown = redact_conninfo(secret) if ("://" in secret or "=" in secret) else MASK
            text = text.replace(secret, shown)
    text = _URL.sub(lambda m: _mask_credentials(m.group(0)), text)
    return _KEYWORD.sub(lambda m: f"{m.group(1)}={MASK}", text)
