"""Secrets kept out of what gets printed: logs, exceptions, run metadata and alerts.

A database URL or conninfo keeps its user, host, port and database and loses its password (and
any other secret parameter); a webhook URL keeps its scheme and host and loses its path and
query, which for Slack, Teams and Discord webhooks are the secret itself.
"""

import os
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

MASK = "***"

# Query parameters that hold a secret: libpq's, and the usual names of tokens, keys and signatures
# (signed URLs: S3, CloudFront, Azure SAS).
_SECRET_PARAMS = frozenset(
    {
        "password",
        "sslpassword",
        "passfile",
        "sslkey",
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "api_key",
        "apikey",
        "client_secret",
        "key",
        "secret",
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "key-pair-id",
        "policy",
    }
)
# libpq keywords whose values are secrets.
_SECRET_KEYWORDS = frozenset({"password", "sslpassword"})
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
# Shorter strings are never masked wherever they appear: that would mangle ordinary words.
_MIN_SECRET = 4

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>|]+")
_DATABASE_SCHEME = re.compile(r"^\s*postgres(?:ql)?://", re.IGNORECASE)
# Hosts whose webhook URLs carry the secret in the path: Slack, Discord, Teams (Office 365
# connectors and Power Automate workflows), Google Chat. Found in text, they keep only the host.
_WEBHOOK_HOST = re.compile(
    r"(?:^|\.)(?:hooks\.slack\.com|discord(?:app)?\.com|webhook\.office\.com|outlook\.office(?:365)?\.com"
    r"|logic\.azure\.com|environment\.api\.powerplatform\.com|chat\.googleapis\.com)$",
    re.IGNORECASE,
)
# password=..., as in a conninfo or a libpq environment dump, quoted or not.
_KEYWORD = re.compile(
    r"\b((?:pg)?(?:ssl)?password)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)",
    re.IGNORECASE,
)
# 'password': '...' as in the repr of a dict of connection parameters.
_DICT_ITEM = re.compile(r"""(["'])((?:ssl)?password)\1(\s*:\s*)(["'])(?:(?!\4).)*\4""", re.IGNORECASE)
# Slack tokens: bot, user, app-level, configuration and refresh tokens.
_SLACK_TOKEN = re.compile(r"\b(?:xox[abposre]|xapp|xoxe\.xox[bp])-[0-9A-Za-z-]{8,}")


def _is_database_url(url: str) -> bool:
    return bool(_DATABASE_SCHEME.match(url))


def _is_url(text: str) -> bool:
    """A URL rather than a key=value conninfo (whose values may hold '://')."""
    return "://" in text.split("=", 1)[0]


def _redact_database_url(url: str) -> str:
    """A postgres:// URL split the way that keeps a password whole even when it holds '/', '?'
    or '@' unencoded: the credentials run to the last '@' (one in the query too makes this mask
    more than the credentials, never less)."""
    scheme, _, rest = url.strip().partition("://")
    userinfo, at, rest = rest.rpartition("@")
    hosts, qmark, query = rest.partition("?")
    user, colon, _password = userinfo.partition(":")
    auth = f"{user}{':' + MASK if colon else ''}{at}"
    if qmark:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={MASK}" if k.lower() in _SECRET_PARAMS else f"{k}={v}" for k, v in pairs)
    return f"{scheme}://{auth}{hosts}{qmark}{query}"


def redact_url(url: str) -> str:
    """``url`` safe to print. Database URLs keep everything but secrets; other URLs (webhooks)
    keep only their scheme, host and port."""
    if _is_database_url(url):
        return _redact_database_url(url)
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return MASK
    if ":" in host:
        host = f"[{host}]"
    tail = "/" + MASK if (parts.path.strip("/") or parts.query or parts.fragment) else ""
    return urlunsplit((parts.scheme, host + port, tail, "", ""))


def redact_conninfo(conninfo: str) -> str:
    """A libpq URL or key=value string, its password (and sslpassword) masked; a string libpq
    cannot read is masked whole."""
    if _is_url(conninfo):
        return redact_url(conninfo)
    try:
        conninfo_to_dict(conninfo)
    except Exception:
        return MASK + " (not a valid URL or conninfo, hidden whole)"
    # libpq read it, so every value is a bare word or a quoted string: the pattern finds them.
    return _KEYWORD.sub(lambda m: f"{m.group(1)}={MASK}", conninfo)


def _mask_credentials(url: str) -> str:
    """A URL found in text: a database URL as :func:`redact_url` gives it, a chat webhook's
    down to its host, any other with its password and secret query parameters masked and its
    path kept (an HTTP error's URL stays useful, a run's link stays usable)."""
    if _is_database_url(url):
        return _redact_database_url(url)
    try:
        parts = urlsplit(url)
        if _WEBHOOK_HOST.search(parts.hostname or ""):
            return redact_url(url)
        if parts.password is None and not parts.query:
            return url
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            netloc = f"{userinfo.partition(':')[0]}:{MASK}@{hostport}"
        query = "&".join(
            f"{k}={MASK}" if k.lower() in _SECRET_PARAMS else f"{k}={v}"
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return MASK


def _password_pieces(password: str) -> set[str]:
    """A password as it may be printed: as written, decoded, and cut where a parser that does not
    expect '/', '@', ':', '?' or '#' in it would cut it (libpq then prints the pieces as a host
    or a port)."""
    pieces = {password, unquote(password)}
    pieces.update(re.split(r"[/@:?#]", password))
    return pieces


def secret_pieces(secret: str) -> set[str]:
    """``secret`` and what of it may be printed alone: a URL's or conninfo's password (see
    :func:`_password_pieces`) and a webhook URL's path, which is its secret part."""
    secret = secret.strip()
    pieces = {secret}
    if _is_url(secret):
        rest = secret.partition("://")[2]
        # A database URL's credentials run to its last '@', a '?' in the password included.
        authority = rest if _is_database_url(secret) else rest.partition("?")[0]
        if not _is_database_url(secret):
            authority, slash, path = authority.partition("/")
            if path.strip("/"):
                pieces.add(slash + path)
            tail = rest.partition("?")[2]
            if tail:
                pieces.add(tail)
            if not (path.strip("/") or tail or "@" in authority):
                # Nothing secret in it (a bare host), and masking it would break the links that
                # start with it.
                pieces.discard(secret)
        # Both ways an unencoded '@' may be read: up to the first or the last one.
        if "@" in authority:
            for userinfo in (authority.rpartition("@")[0], authority.partition("@")[0]):
                if ":" in userinfo:
                    pieces |= _password_pieces(userinfo.partition(":")[2])
            after = authority.partition("@")[2]
            if "@" in after:
                pieces.add(after.rpartition("@")[0])
        for key, value in parse_qsl(rest.partition("?")[2], keep_blank_values=True):
            if key.lower() in _SECRET_PARAMS:
                pieces.add(value)
    elif "=" in secret:
        try:
            params = conninfo_to_dict(secret)
        except Exception:
            params = {}
        for key in _SECRET_KEYWORDS:
            if params.get(key):
                pieces |= _password_pieces(str(params[key]))
    return {p for p in pieces if len(p) >= _MIN_SECRET}


def _shown(secret: str) -> str:
    """What stands for a whole secret in text: a URL or conninfo redacted, anything else masked."""
    if _is_url(secret):
        return redact_url(secret)
    if "=" in secret:
        try:
            conninfo_to_dict(secret)
        except Exception:
            return MASK
        return redact_conninfo(secret)
    return MASK


def _env_secrets() -> list[str]:
    return [value for name in SECRET_ENV if (value := os.environ.get(name, "").strip())]


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every value of ``secrets`` and of the secret environment variables
    (:data:`SECRET_ENV`) masked wherever it appears (a URL or conninfo by its redacted form, its
    password and a webhook's path by themselves too), and every other URL, conninfo password and
    Slack token masked."""
    known: dict[str, str] = {}
    for secret in {*secrets, *_env_secrets()}:
        for piece in secret_pieces(secret):
            known.setdefault(piece, _shown(piece) if piece == secret.strip() else MASK)
    # Longest first: a URL goes as a whole before its password alone.
    for piece in sorted(known, key=len, reverse=True):
        text = text.replace(piece, known[piece])
    text = _URL.sub(lambda m: _mask_credentials(m.group(0)), text)
    text = _KEYWORD.sub(lambda m: f"{m.group(1)}={MASK}", text)
    text = _DICT_ITEM.sub(
        lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{MASK}{m.group(4)}", text
    )
    return _SLACK_TOKEN.sub(MASK, text)
