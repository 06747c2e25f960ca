"""Menus: validate and normalise a platform's products, and hash the result.

A product in the generic shape is an object with ``id``, ``name``, ``category``, ``price`` and
``in_stock``, and optionally ``brand``, ``thc`` and ``cbd`` (percent). A menu that breaks these
rules is refused whole, with the first problems named: storing half of it would mark the rest gone.
"""

import functools
import hashlib
import json
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, TypedDict

from tq_pipelines.queue.worker import PermanentTaskError

MAX_PRODUCTS = 20_000
MAX_PRICE = Decimal("99999999.99")  # numeric(10, 2)
# Built once: a menu checks three numbers of every product.
_ZERO = Decimal(0)
_HUNDRED = Decimal(100)
_CENT = Decimal("0.01")
_ZERO_CENTS = Decimal("0.00")
# The longest number text whose parse is kept (a price has at most 11 characters).
CACHED_NUMBER_TEXT = 32


class MenuValidationError(PermanentTaskError):
    """The menu is not something we can store; the message says what to fix."""


class Product(TypedDict):
    id: str
    name: str
    brand: str | None
    category: str
    price: str  # decimal text: exact in JSON and in numeric(10, 2)
    thc: str | None
    cbd: str | None
    in_stock: bool


def _text(value: Any, field: str, *, required: bool) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise ValueError(f"{field} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"{field} must be text, got {type(value).__name__}")
    text = " ".join(str(value).split())
    if "\x00" in text:
        raise ValueError(f"{field} holds a NUL character")
    return text


def _number(value: Any, field: str, *, low: Decimal, high: Decimal, required: bool) -> str | None:
    if value is None:
        if required:
            raise ValueError(f"{field} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{field} must be a number, got {type(value).__name__}")
    text = str(value).strip().lstrip("$")
    parsed = _parse_number_cached(text) if len(text) <= CACHED_NUMBER_TEXT else _parse_number(text)
    if parsed is None:
        raise ValueError(f"{field} is not a number: {value!r}")
    number, cents = parsed
    if not number.is_finite() or not low <= number <= high:
        raise ValueError(f"{field} must be between {low} and {high}, got {value!r}")
    return cents


def _parse_number(text: str) -> tuple[Decimal, str] | None:
    """A number's text as a Decimal and as its cents, rounded half up ('' where it cannot be:
    not finite, or too large); None when it is no number."""
    try:
        number = Decimal(text)
    except ArithmeticError:
        return None
    try:
        # "-0" and "0" are the same price and must hash the same.
        return number, str(number.quantize(_CENT, rounding=ROUND_HALF_UP) + _ZERO_CENTS)
    except ArithmeticError:
        return number, ""


# Menus repeat their prices and percentages, and a crawl checks three numbers of every product:
# each short text is parsed once. (Longer ones, which no sane menu sends, are not kept.)
_parse_number_cached = functools.lru_cache(maxsize=16384)(_parse_number)


def normalise_product(raw: Any) -> Product:
    if not isinstance(raw, dict):
        raise ValueError(f"a product must be an object, got {type(raw).__name__}")
    in_stock = raw.get("in_stock")
    if not isinstance(in_stock, bool):
        raise ValueError(f"in_stock must be true or false, got {in_stock!r}")
    category = _text(raw.get("category"), "category", required=True)
    return Product(
        id=_text(raw.get("id"), "id", required=True) or "",
        name=_text(raw.get("name"), "name", required=True) or "",
        brand=_text(raw.get("brand"), "brand", required=False),
        category=(category or "").lower(),
        price=_number(raw.get("price"), "price", low=_ZERO, high=MAX_PRICE, required=True) or "0.00",
        thc=_number(raw.get("thc"), "thc", low=_ZERO, high=_HUNDRED, required=False),
        cbd=_number(raw.get("cbd"), "cbd", low=_ZERO, high=_HUNDRED, required=False),
        in_stock=in_stock,
    )


def normalise_menu(raw: Any) -> list[Product]:
    """The menu's products, normalised and sorted by id; raises :class:`MenuValidationError`."""
    if not isinstance(raw, list):
        raise MenuValidationError(f"menu products must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_PRODUCTS:
        raise MenuValidationError(f"menu has {len(raw)} products, more than {MAX_PRODUCTS}")
    products: dict[str, Product] = {}
    problems: list[str] = []
    for n, item in enumerate(raw):
        try:
            product = normalise_product(item)
        except ValueError as exc:
            ident = item.get("id") if isinstance(item, dict) else None
            problems.append(f"product #{n}" + (f" (id {ident!r})" if ident is not None else "") + f": {exc}")
            continue
        if product["id"] in products:
            problems.append(f"product #{n}: id {product['id']!r} appears twice")
        products[product["id"]] = product
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MenuValidationError("menu failed validation: " + "; ".join(problems[:3]) + more)
    return [products[k] for k in sorted(products)]


def encode_menu(products: list[Product]) -> tuple[str, str]:
    """The normalised menu as JSON text, and its sha256: equal for menus that would store the
    same rows. The text is what is stored too, so the menu is encoded once."""
    text = json.dumps(products, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text, hashlib.sha256(text.encode()).hexdigest()


def menu_hash(products: list[Product]) -> str:
    """sha256 of the normalised menu (:func:`encode_menu`)."""
    return encode_menu(products)[1]
