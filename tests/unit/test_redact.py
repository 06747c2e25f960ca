"""Redaction of URLs, conninfo and free text: what is masked, and what stays readable (hosts,
users, databases, a run's link, an HTTP error's path)."""

import pytest

from tq_pipelines.queue.redact import MASK, redact_conninfo, redact_text, redact_url, secret_pieces

SECRET = "S3cr3t-7f1c2d"


@pytest.fixture(autouse=True)
def no_secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TQ_DATABASE_URL",
        "TQ_TEST_DATABASE_URL",
        "TQ_ALERT_WEBHOOK_URL",
        "TQ_SLACK_TOKEN",
        "PGPASSWORD",
    ):
        monkeypatch.delenv(name, raising=False)


def test_a_webhook_url_keeps_scheme_host_and_port_only():
    cases = {
        "https://hooks.slack.com/services/T000/B000/XXXX": "https://hooks.slack.com/***",
        "https://discord.com/api/webhooks/123/tok?wait=true": "https://discord.com/***",
        "https://user:pw@alerts.example.com:8443/hook#frag": "https://alerts.example.com:8443/***",
        "http://[::1]:8080/hook/XXXX": "http://[::1]:8080/***",
        "http://alerts.example.com": "http://alerts.example.com",
        "https://alerts.example.com:notaport/XXXX": MASK,
    }
    assert {url: redact_url(url) for url in cases} == cases


def test_a_database_url_keeps_all_but_its_secrets():
    cases = {
        f"postgresql://tq:{SECRET}@db.internal:5432/tq?sslmode=require&sslpassword={SECRET}": (
            "postgresql://tq:***@db.internal:5432/tq?sslmode=require&sslpassword=***"
        ),
        # Unencoded '@' and '/' in the password: the credentials run to the last '@'.
        f"postgresql://tq:P@ss/{SECRET}@db.internal/tq": "postgresql://tq:***@db.internal/tq",
        f"postgres://tq:{SECRET}@h1:5432,h2:5433/tq": "postgres://tq:***@h1:5432,h2:5433/tq",
        "postgresql://tq@db.internal/tq": "postgresql://tq@db.internal/tq",
        "postgresql://tq:@db.internal/tq": "postgresql://tq:***@db.internal/tq",
    }
    assert {url: redact_url(url) for url in cases} == cases
    assert {url: redact_conninfo(url) for url in cases} == cases
    for url in cases:
        assert SECRET not in redact_text(f"connecting to {url} failed")


def test_a_conninfo_loses_its_passwords():
    cases = {
        f"host=db port=5432 password={SECRET} dbname=tq": "host=db port=5432 password=*** dbname=tq",
        f"host=db password='{SECRET} with \\' spaces' sslpassword={SECRET}": (
            "host=db password=*** sslpassword=***"
        ),
        # A value holding '://' is still a conninfo, not a URL.
        f"password={SECRET}://x host=db": "password=*** host=db",
    }
    assert {c: redact_conninfo(c) for c in cases} == cases
    # One libpq cannot read is hidden whole.
    assert redact_conninfo(f"host=db password {SECRET}").startswith(MASK)
    assert SECRET not in redact_conninfo(f"host=db password {SECRET}")


@pytest.mark.parametrize(
    ("url", "error"),
    [
        # libpq quotes a bad percent token...
        (f"postgresql://tq:{SECRET}%zz@db/tq", f'invalid percent-encoded token: "{SECRET}%zz"'),
        # ... and reads what follows an unencoded '@' as the host.
        (f"postgresql://tq:P@ss-{SECRET}@db/tq", f"failed to resolve host 'ss-{SECRET}@db'"),
    ],
)
def test_a_known_secret_is_masked_whole_and_by_its_pieces(url: str, error: str):
    shown = redact_text(f"{url}: {error}", [url])
    assert SECRET not in shown
    assert shown.startswith("postgresql://tq:***@db/tq: ")


def test_a_known_webhook_is_masked_by_its_path_too_and_a_run_link_stays_usable():
    hook = f"http://127.0.0.1:9/services/T0/B0/{SECRET}"
    run = "http://127.0.0.1:9/runs/0123-abcd"
    text = redact_text(f"posting to {hook} (path /services/T0/B0/{SECRET}) for {run}", [hook])
    assert text == f"posting to http://127.0.0.1:9/*** (path ***) for {run}"
    # A webhook without a path has no secret, and must not break the links that start with it.
    assert redact_text(f"see {run}", ["http://127.0.0.1:9"]) == f"see {run}"


def test_secret_environment_variables_are_masked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TQ_DATABASE_URL", f"host=db user=tq password='{SECRET}'")
    monkeypatch.setenv("TQ_SLACK_TOKEN", f"tok-{SECRET}")
    text = redact_text(f"password was {SECRET}; token tok-{SECRET}")
    assert text == "password was ***; token ***"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        # Any URL: its password and token parameters; the path stays for the error to be useful.
        (
            f"HTTP 500 for https://menus:{SECRET}@api.example.com/v1/stores?page=2&api_key={SECRET}",
            "HTTP 500 for https://menus:***@api.example.com/v1/stores?page=2&api_key=***",
        ),
        # A chat webhook found in text: down to its host.
        (
            f"POST https://hooks.slack.com/services/T0/B0/{SECRET} failed",
            "POST https://hooks.slack.com/*** failed",
        ),
        (f"Authorization: Bearer xoxb-1234-5678-{SECRET}", "Authorization: Bearer ***"),
        (f"PGPASSWORD={SECRET} pg_dump", "PGPASSWORD=*** pg_dump"),
        (f"{{'user': 'tq', 'password': '{SECRET}'}}", "{'user': 'tq', 'password': '***'}"),
    ],
)
def test_unknown_secrets_are_found_by_their_shape(text: str, shown: str):
    assert redact_text(text) == shown
    assert redact_text(shown) == shown  # and redacting again changes nothing


def test_short_strings_are_not_secrets_everywhere():
    # A four-character minimum: a one-letter password must not mask every 'a' of a message.
    assert secret_pieces("postgresql://tq:a@db/tq") == {"postgresql://tq:a@db/tq"}
    assert redact_text("a database", ["postgresql://tq:a@db/tq"]) == "a database"


def test_a_password_holding_a_question_mark_stays_hidden(monkeypatch: pytest.MonkeyPatch):
    # libpq reads the password of this URL as "pa?ss-<secret>": the '?' does not end it.
    secret = "ss-" + SECRET
    url = f"postgresql://u:pa?{secret}@db.internal:5432/queue?sslmode=require"
    assert redact_conninfo(url) == "postgresql://u:***@db.internal:5432/queue?sslmode=require"
    monkeypatch.setenv("TQ_DATABASE_URL", url)
    assert secret not in redact_text(f"connection to {url} failed; password pa?{secret} refused")
