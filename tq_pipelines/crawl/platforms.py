"""Platforms: each is an adapter behind one small interface, configured from a TOML file.

The file (``TQ_PLATFORMS_FILE``) has one table per platform, named as the stores' ``menu_type``::

    [platforms.dutchie]
    base_url = "https://menus.example.com/dutchie"
    regions = ["north", "south"]     # what store_discovery lists
    max_in_flight = 4                 # politeness: for the whole fleet, in PostgreSQL
    requests_per_second = 10
    hosts = ["menus.example.com"]     # the hosts its URLs may name (default: base_url's)

Every key is documented on :class:`PlatformSettings`; docs/PLATFORMS.md has the protocol of the
generic adapter and how to write another.
"""

import importlib
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol
from urllib.parse import quote, urljoin, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tq_pipelines.crawl.http import HostLimits, PoliteClient
from tq_pipelines.queue.api import PlatformLimits, TaskQueue
from tq_pipelines.queue.worker import PermanentTaskError


class PlatformSettingsError(ValueError):
    """The platforms file is missing, unreadable or wrong; the message says where."""


# A host name as the queue keeps it (tq_platforms.hosts): lower case, no scheme, port or path.
_HOST = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$"


class PlatformSettings(BaseModel):
    """One platform's settings. Unknown keys are refused, so a typo is an error, not a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(pattern=r"^https?://", description="Root of the platform's menu API")
    adapter: str = Field(default="generic", description="'generic', or module:factory(settings, http)")
    regions: list[str] = Field(default_factory=list, description="Regions store_discovery lists")
    stores_path: str = "/stores"
    store_path: str = "/stores/{directory_id}"
    menu_path: str = "/menus/{platform_id}"
    # The platform's limits, for every worker of the fleet (tq_platforms), whatever host a
    # request names; the same figures cap each host within one process.
    max_in_flight: int = Field(default=4, ge=1, le=256, description="Requests in flight at once")
    requests_per_second: float = Field(default=10.0, ge=0.001, le=10_000, description="Request starts")
    burst: int | None = Field(
        default=None, ge=1, le=10_000, description="Starts at once after an idle spell (max_in_flight)"
    )
    # The breaker: a 503/429 with Retry-After, or this many 5xx/timeouts in a row, pause the
    # platform; after a pause one probe goes first; each failed probe pauses longer.
    pause_after_errors: int = Field(default=5, ge=1, le=1000)
    pause_seconds: float = Field(default=5.0, ge=0.1, le=86_400)
    max_pause_seconds: float = Field(default=600.0, ge=0.1, le=86_400)
    # Bounded so that no setting can make a handler wait past a lease: a thread waits at most
    # slot_wait_seconds for a host slot and timeout_seconds for an answer.
    slot_wait_seconds: float = Field(default=5.0, ge=0, le=60)
    timeout_seconds: float = Field(default=10.0, ge=0.1, le=300)
    # The platform's own timeout: how long it may go on serving a request from its arrival. A
    # request the client gave up on (timeout_seconds) keeps its slot taken until then, for the
    # whole fleet (tq_platforms.busy_until), so that the limit counts what the platform serves.
    server_timeout_seconds: float = Field(
        default=30.0,
        ge=0,
        le=600,
        description="How long the platform may serve a request the client gave up on",
    )
    max_pages: int = Field(default=100, ge=1, le=10_000, description="Store directory pages followed at most")
    # Every URL the crawl follows (pages, menu URLs, redirect hops) and every menu URL the queue
    # stores must name one of these hosts: a platform cannot send the crawler elsewhere.
    hosts: list[Annotated[str, Field(pattern=_HOST)]] | None = Field(
        default=None, min_length=1, max_length=20, description="Hosts its URLs may name (default: base_url's)"
    )

    @model_validator(mode="after")
    def _pauses_in_order(self) -> "PlatformSettings":
        if self.max_pause_seconds < self.pause_seconds:
            raise ValueError(
                f"max_pause_seconds ({self.max_pause_seconds}) is below pause_seconds ({self.pause_seconds})"
            )
        return self

    def allowed_hosts(self) -> tuple[str, ...]:
        """The hosts the platform's URLs may name: ``hosts``, else the base URL's host."""
        if self.hosts:
            return tuple(sorted(set(self.hosts)))
        return ((urlsplit(self.base_url).hostname or "").lower(),)

    def limits(self) -> HostLimits:
        return HostLimits(
            self.max_in_flight, self.requests_per_second, self.slot_wait_seconds, self.server_timeout_seconds
        )

    def platform_limits(self, name: str) -> PlatformLimits:
        """The limits the queue enforces for the whole fleet."""
        return PlatformLimits(
            name,
            self.max_in_flight,
            self.requests_per_second,
            self.burst,
            self.pause_after_errors,
            self.pause_seconds,
            self.max_pause_seconds,
            self.allowed_hosts(),
        )

    def url(self, path: str) -> str:
        return urljoin(self.base_url.rstrip("/") + "/", path.lstrip("/"))


def load_platform_settings(path: str | Path) -> dict[str, PlatformSettings]:
    """The platforms of a TOML file; raises :class:`PlatformSettingsError` naming the bad key."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise PlatformSettingsError(f"platforms file {path} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise PlatformSettingsError(f"cannot read platforms file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PlatformSettingsError(f"platforms file {path} is not TOML: {exc}") from exc
    tables = data.get("platforms")
    if not isinstance(tables, dict) or not tables:
        raise PlatformSettingsError(f"platforms file {path} has no [platforms.<name>] table")
    settings: dict[str, PlatformSettings] = {}
    for name, table in tables.items():
        try:
            settings[name] = PlatformSettings.model_validate(table)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise PlatformSettingsError(f"platforms file {path}, [platforms.{name}]: {problems}") from None
    return settings


def sync_limits(queue: TaskQueue, settings: Mapping[str, PlatformSettings]) -> int:
    """Load the platforms' limits into the queue, where every claimer shares them; returns how
    many changed. The platforms file stays the one place an operator edits."""
    return queue.sync_platform_limits([s.platform_limits(name) for name, s in sorted(settings.items())])


@dataclass(frozen=True)
class StoreListing:
    directory_id: str
    name: str
    region: str | None = None


@dataclass(frozen=True)
class EntryPoint:
    platform_id: str
    menu_url: str | None = None


class PlatformAdapter(Protocol):
    """What the handlers need of a platform. Errors are the worker's classes (see crawl.http)."""

    def list_stores(self, region: str | None) -> list[StoreListing]: ...

    def resolve_entry_point(self, directory_id: str) -> EntryPoint: ...

    def fetch_menu(self, entry: EntryPoint) -> Any:
        """The menu's products in the generic shape (validated by the handler)."""
        ...


AdapterFactory = Callable[[PlatformSettings, PoliteClient], PlatformAdapter]


def _clean(text: str) -> str:
    """No NUL (jsonb and text refuse it) and no surrounding whitespace."""
    return text.replace("\x00", "").strip()


def _field(data: Any, key: str, where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise PermanentTaskError(f"{where}: expected an object with {key!r}, got {str(data)[:200]}")
    return data[key]


class GenericJsonAdapter:
    """A JSON-over-HTTP menu API (docs/PLATFORMS.md):

    - ``GET stores_path?region=R`` → ``{"stores": [{"id", "name", "region"}], "next": path|null}``
    - ``GET store_path`` → ``{"platform_id": ..., "menu_url": ...|null}``
    - ``GET menu_url`` (else ``menu_path``) → ``{"products": [...]}``
    """

    def __init__(self, settings: PlatformSettings, http: PoliteClient) -> None:
        self.settings = settings
        self.http = http
        self.hosts = settings.allowed_hosts()

    def _get(self, url: str, params: dict[str, Any] | None = None) -> Any:
        return self.http.get_json(
            url, params, timeout=self.settings.timeout_seconds, allowed_hosts=self.hosts
        )

    def list_stores(self, region: str | None) -> list[StoreListing]:
        url: str | None = self.settings.url(self.settings.stores_path)
        params = {"region": region} if region else None
        stores: list[StoreListing] = []
        for _ in range(self.settings.max_pages):
            if url is None:
                break
            page = self._get(url, params)
            for item in _field(page, "stores", url):
                ident = _field(item, "id", url)
                if isinstance(ident, bool) or not isinstance(ident, str | int) or str(ident).strip() == "":
                    raise PermanentTaskError(f"{url}: a store's id must be a non-empty string, got {ident!r}")
                stores.append(
                    StoreListing(
                        directory_id=_clean(str(ident)),
                        name=_clean(str(item.get("name") or ident)),
                        region=_clean(str(item["region"])) if item.get("region") else region,
                    )
                )
            nxt = page.get("next")
            # The next link carries its own query string.
            url, params = (self.settings.url(nxt) if nxt else None), None
        else:
            if url is not None:
                raise PermanentTaskError(
                    f"store directory {self.settings.stores_path} has more than max_pages "
                    f"({self.settings.max_pages}) pages"
                )
        return stores

    def resolve_entry_point(self, directory_id: str) -> EntryPoint:
        url = self.settings.url(self.settings.store_path.format(directory_id=quote(directory_id, safe="")))
        body = self._get(url)
        platform_id = _field(body, "platform_id", url)
        if not isinstance(platform_id, str | int) or str(platform_id) == "":
            raise PermanentTaskError(f"{url}: platform_id must be a non-empty string, got {platform_id!r}")
        # Kept as the platform gave it: a path stays relative to base_url, which may move.
        menu_url = body.get("menu_url")
        return EntryPoint(str(platform_id), str(menu_url) if menu_url else None)

    def fetch_menu(self, entry: EntryPoint) -> Any:
        path = entry.menu_url or self.settings.menu_path.format(platform_id=quote(entry.platform_id, safe=""))
        url = self.settings.url(path)
        return _field(self._get(url), "products", url)


def adapter_factory(spec: str) -> AdapterFactory:
    """'generic', or 'module:callable' taking (settings, http)."""
    if spec == "generic":
        return GenericJsonAdapter
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except Exception as exc:  # whatever importing a deployment's module raises
        raise PlatformSettingsError(f"adapter {spec!r} cannot be loaded: {exc}") from exc
    if not callable(factory):
        raise PlatformSettingsError(f"adapter {spec!r} is not callable")
    return factory  # type: ignore[no-any-return]


class CrawlServices:
    """What the crawl handlers share in one process: the HTTP client and an adapter per platform."""

    def __init__(self, settings: Mapping[str, PlatformSettings], *, http: PoliteClient | None = None) -> None:
        timeout = max((s.timeout_seconds for s in settings.values()), default=10.0)
        self.http = http or PoliteClient(timeout_seconds=timeout)
        self.settings = dict(settings)
        self.adapters: dict[str, PlatformAdapter] = {}
        try:
            for name, s in self.settings.items():
                self.http.set_limits(s.base_url, s.limits())
                try:
                    self.adapters[name] = adapter_factory(s.adapter)(s, self.http)
                except PlatformSettingsError as exc:
                    raise PlatformSettingsError(f"[platforms.{name}]: {exc}") from exc
        except BaseException:
            if http is None:
                self.http.close()
            raise

    @classmethod
    def from_file(cls, path: str | Path) -> "CrawlServices":
        return cls(load_platform_settings(path))

    def adapter(self, platform: str | None) -> PlatformAdapter:
        try:
            return self.adapters[platform or ""]
        except KeyError:
            raise PermanentTaskError(
                f"platform {platform!r} has no settings (TQ_PLATFORMS_FILE); "
                f"configured: {', '.join(sorted(self.adapters)) or 'none'}"
            ) from None

    def max_in_flight(self) -> int:
        """Requests the limits allow at once over all platforms: the threads a drain run needs."""
        return sum(s.max_in_flight for s in self.settings.values())

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "CrawlServices":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
