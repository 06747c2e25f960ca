"""The crawl's pure parts, no database: menu validation and hashing, Retry-After, the per-host
rate (GCRA), platform settings and adapters, and the handler registry's TQ_HANDLERS overrides."""

import base64
import email.utils
import hashlib
import itertools
import json
import math
import re
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tq_pipelines.crawl import http as http_mod
from tq_pipelines.crawl import menu as menu_module
from tq_pipelines.crawl.http import HostLimits, PoliteClient, _Host, host_key, retry_after_seconds
from tq_pipelines.crawl.menu import (
    MAX_PRODUCTS,
    MenuValidationError,
    encode_menu,
    menu_hash,
    normalise_menu,
)
from tq_pipelines.crawl.platforms import (
    CrawlServices,
    GenericJsonAdapter,
    PlatformSettings,
    PlatformSettingsError,
    adapter_factory,
    load_platform_settings,
)
from tq_pipelines.handlers import BUILTIN, HandlerRegistryError, load_handlers, noop
from tq_pipelines.queue.worker import PermanentTaskError, TransientTaskError


def product(**fields: Any) -> dict[str, Any]:
    """A valid raw product; keyword arguments replace (or, with None, drop) fields."""
    raw: dict[str, Any] = {
        "id": "p1",
        "name": "Blue Dream",
        "category": "flower",
        "price": "10",
        "in_stock": True,
    }
    raw.update(fields)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.fixture
def fresh_modules() -> Iterator[None]:
    """Modules the test imports from tmp_path are forgotten afterwards."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write_module(directory: Path, source: str) -> str:
    """A module of its own name under ``directory`` (on sys.path); returns the name."""
    name = f"tq_test_mod_{uuid.uuid4().hex[:10]}"
    (directory / f"{name}.py").write_text(source)
    return name


# ------------------------------------------------------------------------------------------------
# normalise_menu
# ------------------------------------------------------------------------------------------------


def test_normalise_menu_normalises_fields_and_sorts_by_id():
    raw = [
        product(
            id="  b-2 ",
            name="  Blue \t  Dream\n",
            brand="  Acme   Farms ",
            category=" FLOWER ",
            price="$12.5",
            thc=" 21.456 ",
            cbd=0,
            in_stock=False,
        ),
        product(id=42, name="Gummies", brand="", category="Edibles", price=7, in_stock=True),
        product(id="a", name="Pre Roll", category="PRE-ROLLS", price=9.999, thc=None, in_stock=True),
    ]
    got = normalise_menu(raw)
    assert [p["id"] for p in got] == ["42", "a", "b-2"]  # text order; the int id became text
    by_id = {p["id"]: p for p in got}
    assert by_id["b-2"] == {
        "id": "b-2",
        "name": "Blue Dream",
        "brand": "Acme Farms",
        "category": "flower",
        "price": "12.50",
        "thc": "21.46",
        "cbd": "0.00",
        "in_stock": False,
    }
    assert by_id["42"]["price"] == "7.00"
    assert by_id["42"]["brand"] is None  # empty text is no brand
    assert by_id["a"]["price"] == "10.00"  # quantized half up
    assert by_id["a"]["category"] == "pre-rolls"
    assert by_id["a"]["thc"] is None and by_id["a"]["cbd"] is None  # optional, absent
    for p in got:
        assert isinstance(p["price"], str) and Decimal(p["price"]).as_tuple().exponent == -2


def test_normalise_menu_accepts_an_empty_menu_and_the_bounds():
    assert normalise_menu([]) == []
    (p,) = normalise_menu([product(price=0, thc=100, cbd="0")])
    assert (p["price"], p["thc"], p["cbd"]) == ("0.00", "100.00", "0.00")


def test_a_number_seen_before_is_checked_against_each_fields_bounds():
    """Numbers are parsed once per text (a menu repeats them): the bounds are still each field's,
    and a text that is no number stays refused."""
    (p,) = normalise_menu([product(price="150", thc=None, in_stock=False)])
    assert p["price"] == "150.00"
    with pytest.raises(MenuValidationError, match=r"thc must be between 0 and 100, got '150'"):
        normalise_menu([product(price="150", thc="150")])
    for _ in range(2):
        with pytest.raises(MenuValidationError, match=r"price is not a number: '1,5'"):
            normalise_menu([product(price="1,5")])
    # The same number in other texts, and "-0", hash as one.
    same = [normalise_menu([product(price=v)])[0]["price"] for v in (12.5, "12.50", "$12.5", " 12.500 ")]
    assert same == ["12.50"] * 4
    assert normalise_menu([product(price="-0")])[0]["price"] == "0.00"
    # A long text is parsed alike, and not kept: a platform cannot fill the cache with them.
    kept = menu_module._parse_number_cached.cache_info().currsize
    assert normalise_menu([product(price="0" * 40 + "12.5")])[0]["price"] == "12.50"
    assert menu_module._parse_number_cached.cache_info().currsize == kept


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(product(name=None), r"product #0 \(id 'p1'\): name is missing", id="missing-name"),
        pytest.param(product(name="   "), r"product #0 \(id 'p1'\): name is missing", id="blank-name"),
        pytest.param(product(id=None), r"product #0: id is missing", id="missing-id"),
        pytest.param(product(id=1.5), r"product #0 \(id 1.5\): id must be text", id="float-id"),
        pytest.param(product(category=None), r"category is missing", id="missing-category"),
        pytest.param(product(price=None), r"product #0 \(id 'p1'\): price is missing", id="missing-price"),
        pytest.param(
            product(price=-1), r"product #0 \(id 'p1'\): price must be between 0", id="negative-price"
        ),
        pytest.param(product(price="-0.01"), r"price must be between 0", id="negative-price-text"),
        pytest.param(product(price=float("nan")), r"product #0 \(id 'p1'\): price must be between", id="nan"),
        pytest.param(product(price="NaN"), r"price must be between", id="nan-text"),
        pytest.param(product(price=float("inf")), r"product #0 \(id 'p1'\): price must be between", id="inf"),
        pytest.param(product(price="Infinity"), r"price must be between", id="inf-text"),
        pytest.param(product(price="abc"), r"product #0 \(id 'p1'\): price is not a number: 'abc'", id="abc"),
        pytest.param(product(price=True), r"price must be a number, got bool", id="bool-price"),
        pytest.param(product(price=[1]), r"price must be a number, got list", id="list-price"),
        pytest.param(product(price=1e9), r"price must be between", id="price-too-big"),
        pytest.param(product(thc=100.01), r"product #0 \(id 'p1'\): thc must be between 0 and 100", id="thc"),
        pytest.param(product(cbd=-1), r"cbd must be between 0 and 100", id="cbd"),
        pytest.param(
            product(in_stock="yes"), r"product #0 \(id 'p1'\): in_stock must be true or false", id="stock"
        ),
        pytest.param(product(in_stock=1), r"in_stock must be true or false, got 1", id="stock-int"),
        pytest.param(product(in_stock=None), r"in_stock must be true or false, got None", id="stock-missing"),
        pytest.param(product(name="a\x00b"), r"name holds a NUL character", id="nul"),
        pytest.param(product(name={"en": "x"}), r"name must be text, got dict", id="name-dict"),
    ],
)
def test_normalise_menu_refuses_a_bad_product_naming_it_and_the_field(raw: dict[str, Any], expected: str):
    good = product(id="p0")
    with pytest.raises(MenuValidationError, match=expected.replace("#0", "#1")):
        normalise_menu([good, raw])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(["p"], r"product #0: a product must be an object, got str", id="string"),
        pytest.param([None], r"product #0: a product must be an object, got NoneType", id="null"),
        pytest.param([[1, 2]], r"product #0: a product must be an object, got list", id="list"),
        pytest.param(
            [product(id="a"), product(id="b"), product(id=" a ")],
            r"product #2: id 'a' appears twice",
            id="duplicate-id",
        ),
        pytest.param(
            [product(id=7), product(id="7")], r"product #1: id '7' appears twice", id="dup-int-text"
        ),
        pytest.param({"products": []}, r"menu products must be a list, got dict", id="not-a-list"),
        pytest.param("[]", r"menu products must be a list, got str", id="json-text"),
        pytest.param(None, r"menu products must be a list, got NoneType", id="none"),
    ],
)
def test_normalise_menu_refuses_bad_shapes(raw: Any, expected: str):
    with pytest.raises(MenuValidationError, match=expected):
        normalise_menu(raw)


def test_normalise_menu_refuses_too_many_products_before_looking_at_them():
    with pytest.raises(MenuValidationError, match=f"{MAX_PRODUCTS + 1} products, more than {MAX_PRODUCTS}"):
        normalise_menu([None] * (MAX_PRODUCTS + 1))


def test_normalise_menu_names_at_most_three_problems_then_how_many_more():
    raw = [product(id=f"p{n}", price=-n - 1) for n in range(5)]
    with pytest.raises(MenuValidationError) as info:
        normalise_menu(raw)
    message = str(info.value)
    assert message.startswith("menu failed validation: ")
    assert [f"product #{n}" in message for n in range(5)] == [True, True, True, False, False]
    assert message.endswith("(and 2 more)")

    with pytest.raises(MenuValidationError) as info:
        normalise_menu(raw[:3])
    assert "more)" not in str(info.value)
    assert str(info.value).count("price must be between") == 3


def test_menu_validation_error_is_permanent():
    assert issubclass(MenuValidationError, PermanentTaskError)
    with pytest.raises(PermanentTaskError):
        normalise_menu(42)


def test_normalise_menu_accepts_the_largest_price_the_column_holds():
    (p,) = normalise_menu([product(price="99999999.99")])
    assert p["price"] == "99999999.99"


# ------------------------------------------------------------------------------------------------
# menu_hash
# ------------------------------------------------------------------------------------------------


def test_menu_hash_ignores_order_and_spelling_but_not_a_price():
    a = [
        product(id="x", name="Blue Dream", category="flower", price="12.5", in_stock=True),
        product(id="y", name="Gummies", brand="Acme", category="edibles", price=7, thc=5, in_stock=False),
    ]
    b = [
        product(
            id=" y",
            name=" Gummies ",
            brand="Acme ",
            category="EDIBLES",
            price="$7.00",
            thc="5.0",
            in_stock=False,
        ),
        product(id="x", name="Blue   Dream", category=" Flower", price=12.50, in_stock=True),
    ]
    digest = menu_hash(normalise_menu(a))
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert menu_hash(normalise_menu(b)) == digest
    assert menu_hash(normalise_menu(list(reversed(a)))) == digest

    changed = [dict(a[0], price="12.51"), a[1]]
    assert menu_hash(normalise_menu(changed)) != digest
    flipped = [dict(a[0], in_stock=False), a[1]]
    assert menu_hash(normalise_menu(flipped)) != digest
    assert menu_hash(normalise_menu(a[:1])) != digest
    assert menu_hash([]) != digest

    # The text stored is the text hashed: it reads back as the menu, non-ASCII names included.
    named = [dict(a[0], name="Crème brûlée \u00b7 1 g"), a[1]]
    text, named_digest = encode_menu(normalise_menu(named))
    assert json.loads(text) == normalise_menu(named)
    assert named_digest == hashlib.sha256(text.encode()).hexdigest() == menu_hash(normalise_menu(named))


# ------------------------------------------------------------------------------------------------
# Retry-After and host keys
# ------------------------------------------------------------------------------------------------


def test_retry_after_seconds_reads_delta_seconds():
    assert retry_after_seconds("120") == 120.0
    assert retry_after_seconds(" 30 ") == 30.0
    assert retry_after_seconds("0") == 0.0


def test_retry_after_seconds_reads_an_http_date():
    ahead = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 55 <= retry_after_seconds(ahead) <= 61  # the date has whole seconds
    past = email.utils.formatdate(time.time() - 3600, usegmt=True)
    assert retry_after_seconds(past) == 0.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "1.5", "12 seconds", "Mon, 99 Foo 2020"])
def test_retry_after_seconds_is_none_for_garbage(value: str | None):
    assert retry_after_seconds(value) is None


def test_retry_after_seconds_is_none_for_a_superscript_digit():
    assert retry_after_seconds("²") is None


def test_host_key_is_scheme_host_and_port():
    assert host_key("https://Menus.example.com:8443/a/b?x=1") == "https://Menus.example.com:8443"
    assert host_key("http://example.com/a") == "http://example.com"
    assert host_key("http://example.com/a") != host_key("https://example.com/a")


# ------------------------------------------------------------------------------------------------
# The per-host rate: GCRA
# ------------------------------------------------------------------------------------------------


def test_gcra_allows_a_burst_of_max_in_flight_then_one_per_interval():
    host = _Host(HostLimits(max_in_flight=3, requests_per_second=10))
    delays = [host.reserve_start(math.inf) for _ in range(7)]
    assert delays[:3] == [0.0, 0.0, 0.0]
    assert delays[3] == pytest.approx(0.1, abs=0.02)
    for before, after in itertools.pairwise(delays[3:]):
        assert after - before == pytest.approx(0.1, abs=0.02)
    assert delays[6] == pytest.approx(0.4, abs=0.02)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_gcra_on_a_fake_clock_refills_after_idle_and_honours_a_pause(monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    monkeypatch.setattr(http_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    host = _Host(HostLimits(max_in_flight=2, requests_per_second=4))  # interval 0.25 s
    assert [host.reserve_start(math.inf) for _ in range(4)] == [0.0, 0.0, 0.25, 0.5]
    clock.now += 0.25  # one interval later: the next slot is 0.5 s after the last
    assert host.reserve_start(math.inf) == pytest.approx(0.5)
    clock.now += 60  # idle: a full burst again, no more
    assert [host.reserve_start(math.inf) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.25)]
    clock.now += 60
    host.paused_until = clock.now + 10  # a 429 with Retry-After 10
    assert host.reserve_start(math.inf) == pytest.approx(10.0)
    assert host.reserve_start(math.inf) == pytest.approx(10.0)  # the burst is allowed at the end of the pause
    assert host.reserve_start(math.inf) == pytest.approx(10.25)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_in_flight": 0},
        {"max_in_flight": -1},
        {"requests_per_second": 0},
        {"requests_per_second": -1.0},
        {"slot_wait_seconds": -0.1},
    ],
)
def test_host_limits_refuse_impossible_values(kwargs: dict[str, Any]):
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        HostLimits(**kwargs)


def test_host_limits_accept_the_smallest_sane_values():
    limits = HostLimits(max_in_flight=1, requests_per_second=0.01, slot_wait_seconds=0)
    assert (limits.max_in_flight, limits.requests_per_second, limits.slot_wait_seconds) == (1, 0.01, 0)


# ------------------------------------------------------------------------------------------------
# Platform settings
# ------------------------------------------------------------------------------------------------


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "platforms.toml"
    path.write_text(text)
    return path


def test_load_platform_settings_reads_a_good_file_with_defaults(tmp_path: Path):
    path = write_toml(
        tmp_path,
        """
        [platforms.dutchie]
        base_url = "https://menus.example.com/dutchie"
        regions = ["north", "south"]
        max_in_flight = 2
        requests_per_second = 5

        [platforms.jane]
        base_url = "http://jane.example.com"
        """,
    )
    settings = load_platform_settings(path)
    assert sorted(settings) == ["dutchie", "jane"]
    d = settings["dutchie"]
    assert d.regions == ["north", "south"]
    assert (d.max_in_flight, d.requests_per_second) == (2, 5.0)
    assert d.limits() == HostLimits(2, 5.0, 5.0)
    j = settings["jane"]
    assert j.adapter == "generic"
    assert j.regions == []
    assert (j.stores_path, j.store_path, j.menu_path) == (
        "/stores",
        "/stores/{directory_id}",
        "/menus/{platform_id}",
    )
    assert (j.max_in_flight, j.requests_per_second, j.slot_wait_seconds) == (4, 10.0, 5.0)
    assert (j.timeout_seconds, j.max_pages) == (10.0, 100)
    assert load_platform_settings(str(path)) == settings  # a str path does as well


@pytest.mark.parametrize(
    ("table", "key"),
    [
        pytest.param(
            'base_url = "https://x.test"\nbase_ulr = "https://y.test"', "base_ulr", id="unknown-key"
        ),
        pytest.param('base_url = "x.test"', "base_url", id="no-scheme"),
        pytest.param('base_url = "ftp://x.test"', "base_url", id="ftp"),
        pytest.param("max_in_flight = 1", "base_url", id="no-base-url"),
        pytest.param('base_url = "https://x.test"\nmax_in_flight = 0', "max_in_flight", id="max-in-flight-0"),
        pytest.param(
            'base_url = "https://x.test"\nmax_in_flight = 257', "max_in_flight", id="max-in-flight-257"
        ),
        pytest.param(
            'base_url = "https://x.test"\nrequests_per_second = 0', "requests_per_second", id="rps-0"
        ),
        pytest.param('base_url = "https://x.test"\nregions = "north"', "regions", id="regions-not-list"),
        pytest.param('base_url = "https://x.test"\nmax_pages = 0', "max_pages", id="max-pages-0"),
        # Bounds that keep every wait of a handler inside a lease.
        pytest.param(
            'base_url = "https://x.test"\nrequests_per_second = 1e-9', "requests_per_second", id="rps-1e-9"
        ),
        pytest.param(
            'base_url = "https://x.test"\nslot_wait_seconds = 1e9', "slot_wait_seconds", id="slot-wait-1e9"
        ),
        pytest.param(
            'base_url = "https://x.test"\ntimeout_seconds = 1e9', "timeout_seconds", id="timeout-1e9"
        ),
        pytest.param('base_url = "https://x.test"\ntimeout_seconds = 0', "timeout_seconds", id="timeout-0"),
        pytest.param('base_url = "https://x.test"\nburst = 0', "burst", id="burst-0"),
        pytest.param(
            'base_url = "https://x.test"\npause_seconds = 1e9', "pause_seconds", id="pause-seconds-1e9"
        ),
    ],
)
def test_load_platform_settings_names_the_file_platform_and_key(tmp_path: Path, table: str, key: str):
    path = write_toml(
        tmp_path, f'[platforms.good]\nbase_url = "https://ok.test"\n\n[platforms.bad]\n{table}\n'
    )
    with pytest.raises(PlatformSettingsError) as info:
        load_platform_settings(path)
    message = str(info.value)
    assert str(path) in message
    assert "[platforms.bad]" in message
    assert f"{key}:" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", "has no [platforms.<name>] table", id="empty"),
        pytest.param("[other]\nx = 1\n", "has no [platforms.<name>] table", id="no-platforms"),
        pytest.param("[platforms]\n", "has no [platforms.<name>] table", id="empty-platforms"),
        pytest.param('platforms = "dutchie"\n', "has no [platforms.<name>] table", id="platforms-not-table"),
        pytest.param("[platforms.a\nbase_url = 1\n", "is not TOML", id="invalid-toml"),
        pytest.param(
            '[platforms.a]\nbase_url = "https://x"\nbase_url = "https://y"\n', "is not TOML", id="dup-key"
        ),
    ],
)
def test_load_platform_settings_refuses_a_file_without_platforms(tmp_path: Path, text: str, expected: str):
    path = write_toml(tmp_path, text)
    with pytest.raises(PlatformSettingsError, match=re.escape(expected)) as info:
        load_platform_settings(path)
    assert str(path) in str(info.value)


def test_load_platform_settings_names_a_platform_that_is_not_a_table(tmp_path: Path):
    path = write_toml(tmp_path, "[platforms]\ndutchie = 1\n")
    with pytest.raises(PlatformSettingsError, match=r"\[platforms\.dutchie\]") as info:
        load_platform_settings(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_load_platform_settings_refuses_an_unreadable_file(tmp_path: Path, where: str):
    path = tmp_path / "nope.toml"
    if where == "directory":
        path.mkdir()
    with pytest.raises(PlatformSettingsError, match="cannot read platforms file") as info:
        load_platform_settings(path)
    assert str(path) in str(info.value)


def test_load_platform_settings_refuses_a_file_that_is_not_utf8(tmp_path: Path):
    path = tmp_path / "platforms.toml"
    path.write_bytes(b'\xff\xfe[platforms.a]\nbase_url = "https://x.test"\n')
    with pytest.raises(PlatformSettingsError) as info:
        load_platform_settings(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("base_url", "path", "expected"),
    [
        ("https://x.test/api", "/stores", "https://x.test/api/stores"),
        ("https://x.test/api/", "/stores", "https://x.test/api/stores"),
        ("https://x.test/api//", "stores", "https://x.test/api/stores"),
        ("https://x.test/api", "stores/7", "https://x.test/api/stores/7"),
        ("https://x.test", "/stores", "https://x.test/stores"),
        ("https://x.test/", "menus/a%2Fb", "https://x.test/menus/a%2Fb"),
        ("https://x.test/api", "/stores?page=2&region=n", "https://x.test/api/stores?page=2&region=n"),
        ("https://x.test/api", "https://cdn.test/m.json", "https://cdn.test/m.json"),
    ],
)
def test_platform_settings_url_joins_under_the_base(base_url: str, path: str, expected: str):
    assert PlatformSettings(base_url=base_url).url(path) == expected


def test_platform_settings_are_frozen_and_refuse_unknown_keys():
    s = PlatformSettings(base_url="https://x.test")
    with pytest.raises(ValidationError, match="frozen"):
        s.base_url = "https://y.test"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        PlatformSettings(base_url="https://x.test", regoins=["n"])  # type: ignore[call-arg]


# ------------------------------------------------------------------------------------------------
# Adapters
# ------------------------------------------------------------------------------------------------


def test_adapter_factory_generic():
    assert adapter_factory("generic") is GenericJsonAdapter


@pytest.mark.parametrize(
    "spec",
    ["nosuchmodule_tq_xyz:x", "json:no_such_attribute", "json", ":loads", "json:__name__"],
)
def test_adapter_factory_refuses_what_it_cannot_load(spec: str):
    with pytest.raises(PlatformSettingsError, match=re.escape(f"adapter {spec!r}")):
        adapter_factory(spec)


def test_crawl_services_refuses_an_adapter_that_does_not_load():
    settings = {"p": PlatformSettings(base_url="https://x.test", adapter="nosuchmodule_tq_xyz:make")}
    with pytest.raises(PlatformSettingsError, match="nosuchmodule_tq_xyz"):
        CrawlServices(settings)


def test_adapter_factory_refuses_a_module_that_does_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
):
    name = write_module(tmp_path, "def make(settings, http):\n    return (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PlatformSettingsError, match=name):
        adapter_factory(f"{name}:make")


CUSTOM_ADAPTER = """
from tq_pipelines.crawl.platforms import EntryPoint, StoreListing

class Adapter:
    def __init__(self, settings, http):
        self.settings = settings
        self.http = http

    def list_stores(self, region):
        return [StoreListing("s-1", "Store One", region)]

    def resolve_entry_point(self, directory_id):
        return EntryPoint("pid-" + directory_id)

    def fetch_menu(self, entry):
        return [{"id": 1, "name": "x", "category": "c", "price": 1, "in_stock": True}]

def make(settings, http):
    return Adapter(settings, http)
"""


def test_crawl_services_uses_a_custom_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
):
    name = write_module(tmp_path, CUSTOM_ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_toml(
        tmp_path,
        f"""
        [platforms.custom]
        base_url = "https://custom.test/api"
        adapter = "{name}:make"
        max_in_flight = 7
        requests_per_second = 3
        timeout_seconds = 2.5

        [platforms.plain]
        base_url = "https://plain.test"
        max_in_flight = 2
        """,
    )
    with CrawlServices.from_file(path) as services:
        custom = services.adapter("custom")
        module = sys.modules[name]
        assert type(custom) is module.Adapter
        assert custom.settings == services.settings["custom"]
        assert custom.http is services.http
        assert custom.list_stores("north")[0].region == "north"
        assert type(services.adapter("plain")) is GenericJsonAdapter
        # Each platform's politeness is set on its host.
        host = services.http._host(host_key("https://custom.test/api/stores"))
        assert host.limits == HostLimits(7, 3.0, 5.0)
        assert services.http._host("https://plain.test").limits.max_in_flight == 2
        assert services.max_in_flight() == 9
        with pytest.raises(PermanentTaskError, match=r"platform 'nope' has no settings.*custom, plain"):
            services.adapter("nope")
        with pytest.raises(PermanentTaskError, match="has no settings"):
            services.adapter(None)


# ------------------------------------------------------------------------------------------------
# Handler registry: TQ_HANDLERS
# ------------------------------------------------------------------------------------------------


def test_load_handlers_without_overrides_is_the_builtins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TQ_HANDLERS", raising=False)
    assert load_handlers() == dict(BUILTIN)


def test_tq_handlers_overrides_a_role(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TQ_HANDLERS", " analytics_refresh = tq_pipelines.handlers:noop , ")
    handlers = load_handlers()
    assert handlers["analytics_refresh"] is noop
    assert BUILTIN["analytics_refresh"] is not noop
    assert handlers["product_resync"] is BUILTIN["product_resync"]  # the others are kept


def test_tq_handlers_can_supply_a_role_with_no_builtin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
):
    monkeypatch.delenv("TQ_HANDLERS", raising=False)
    name = write_module(tmp_path, "def handle(task, ctx):\n    return {'custom': True}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HandlerRegistryError, match="no handler for role\\(s\\) custom_role"):
        load_handlers(("custom_role",))
    monkeypatch.setenv("TQ_HANDLERS", f"custom_role={name}:handle,product_resync=tq_pipelines.handlers:noop")
    handlers = load_handlers((*BUILTIN, "custom_role"))
    assert handlers["custom_role"] is sys.modules[name].handle
    assert handlers["product_resync"] is noop


@pytest.mark.parametrize("spec", ["x", "role=nomodule", "analytics_refresh", "a=b,c"])
def test_tq_handlers_refuses_a_malformed_entry(monkeypatch: pytest.MonkeyPatch, spec: str):
    monkeypatch.setenv("TQ_HANDLERS", spec)
    with pytest.raises(HandlerRegistryError, match=r"TQ_HANDLERS: .* is not role=module:function"):
        load_handlers()


def test_tq_handlers_names_a_module_that_does_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_modules: None
):
    monkeypatch.setenv("TQ_HANDLERS", "analytics_refresh=tq_no_such_module_xyz:handle")
    with pytest.raises(HandlerRegistryError, match="tq_no_such_module_xyz:handle failed to load"):
        load_handlers()

    broken = write_module(tmp_path, "raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TQ_HANDLERS", f"analytics_refresh={broken}:handle")
    with pytest.raises(HandlerRegistryError, match=f"{broken}:handle failed to load: broken on import"):
        load_handlers()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("analytics_refresh=tq_pipelines.handlers:no_such_function", "failed to load"),
        ("analytics_refresh=tq_pipelines.handlers:ENTRY_POINT_GROUP", "is not callable"),
    ],
)
def test_tq_handlers_refuses_a_missing_or_uncallable_function(
    monkeypatch: pytest.MonkeyPatch, spec: str, expected: str
):
    monkeypatch.setenv("TQ_HANDLERS", spec)
    with pytest.raises(HandlerRegistryError, match=expected):
        load_handlers()


def test_a_start_further_than_the_wait_reserves_nothing():
    host = _Host(HostLimits(max_in_flight=1, requests_per_second=1))
    assert host.reserve_start(math.inf) == 0.0
    # The next start is a second away: refused at a shorter wait, and refusing reserves nothing.
    for _ in range(5):
        assert host.reserve_start(0.1) is None
    assert host.next_start_in() == pytest.approx(1.0, abs=0.05)
    assert host.reserve_start(math.inf) == pytest.approx(1.0, abs=0.05)


def test_a_longest_pause_below_the_first_is_refused_in_words(tmp_path: Path):
    path = write_toml(
        tmp_path, '[platforms.p]\nbase_url = "https://x.test"\npause_seconds = 60\nmax_pause_seconds = 10\n'
    )
    with pytest.raises(
        PlatformSettingsError, match=r"max_pause_seconds \(10.0\) is below pause_seconds \(60.0\)"
    ):
        load_platform_settings(path)


def test_a_closed_polite_client_sends_nothing_and_opens_no_pool():
    """One connection pool per host, made on first use: after close, a request is refused instead
    of opening a pool that nothing would close."""
    client = PoliteClient(timeout_seconds=1)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.get_json("http://127.0.0.1:9/menu")
    assert client._managers == {}


@pytest.fixture
def forward_proxy() -> Iterator[tuple[str, list[tuple[str, str | None, str | None]]]]:
    """A forward HTTP proxy that answers every request itself: its URL, and what it was asked
    (the request's target, its Proxy-Authorization, its Authorization)."""
    asked: list[tuple[str, str | None, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            asked.append(
                (self.path, self.headers.get("Proxy-Authorization"), self.headers.get("Authorization"))
            )
            body = json.dumps({"via": "proxy"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_environment_s_proxy_carries_the_requests_but_not_those_it_exempts(
    forward_proxy: tuple[str, list[tuple[str, str | None, str | None]]], monkeypatch: pytest.MonkeyPatch
):
    """HTTP_PROXY is used, with its credentials; the URL's own go in its Authorization header, not
    in the request line; a host in NO_PROXY is asked directly (here a name that does not resolve:
    a connection error, and the proxy hears nothing)."""
    proxy, asked = forward_proxy
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.replace("http://", "http://fleet:pa%40ss@"))
    monkeypatch.setenv("NO_PROXY", "direct.invalid")
    with PoliteClient(timeout_seconds=5) as client:
        assert client.get_json("http://menu:s3cret@menus.invalid/menus/1", {"page": 2}) == {"via": "proxy"}
        with pytest.raises(
            TransientTaskError, match=re.escape("connection error on GET http://direct.invalid/")
        ):
            client.get_json("http://direct.invalid/menus/1")
    basic = "Basic {}".format
    assert asked == [
        (
            "http://menus.invalid/menus/1?page=2",
            basic(base64.b64encode(b"fleet:pa@ss").decode()),
            basic(base64.b64encode(b"menu:s3cret").decode()),
        )
    ]
