"""Role handlers: a registry from role to the function that does one task of that role.

Built-in handlers (:data:`BUILTIN`) are the crawl handlers of :mod:`tq_pipelines.crawl.handlers`.
A deployment plugs its own in through the entry point group ``tq_pipelines.handlers`` (name =
role, value = ``module:function``); an entry point replaces the built-in handler of the same role.
``TQ_HANDLERS`` ("role=module:function,...") overrides both, for one process, without packaging.

The roles themselves are rows of ``worker_task_roles``: a role a deployment adds there has no
built-in handler, and gets one through either way above. A role without a handler is not drained
(the sensor says so, and queue_health_sensor alerts while it has ready tasks).
"""

import os
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points

from tq_pipelines.crawl.handlers import HANDLERS
from tq_pipelines.queue.api import JSON, Task
from tq_pipelines.queue.worker import Handler, TaskContext

ENTRY_POINT_GROUP = "tq_pipelines.handlers"
HOW_TO_PLUG_IN = (
    f"register one under the entry point group {ENTRY_POINT_GROUP} (name = role, value = module:function) "
    "or set TQ_HANDLERS=role=module:function"
)


class HandlerRegistryError(RuntimeError):
    """A role has no handler, or a plugged-in handler cannot be loaded."""


def noop(task: Task, ctx: TaskContext) -> JSON:
    """Does nothing and says so: the placeholder until a role gets real work."""
    return {"handler": "noop", "role": task.role}


BUILTIN: Mapping[str, Handler] = HANDLERS


def _overrides(spec: str) -> list[EntryPoint]:
    """TQ_HANDLERS entries as entry points, so that they load and fail the same way."""
    found = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        role, sep, value = item.partition("=")
        if not sep or ":" not in value:
            raise HandlerRegistryError(f"TQ_HANDLERS: {item!r} is not role=module:function")
        found.append(EntryPoint(role.strip(), value.strip(), "TQ_HANDLERS"))
    return found


def load_handlers(roles: Iterable[str] = ()) -> dict[str, Handler]:
    """The handlers there are: built-ins, overridden by entry points, then by TQ_HANDLERS.
    Raises if one cannot be loaded, or if one of ``roles`` has none."""
    handlers: dict[str, Handler] = dict(BUILTIN)
    plugged = [*entry_points(group=ENTRY_POINT_GROUP), *_overrides(os.environ.get("TQ_HANDLERS", ""))]
    for ep in plugged:
        try:
            handler = ep.load()
        except Exception as exc:
            raise HandlerRegistryError(
                f"handler entry point {ep.name} = {ep.value} failed to load: {exc}"
            ) from exc
        if not callable(handler):
            raise HandlerRegistryError(f"handler entry point {ep.name} = {ep.value} is not callable")
        handlers[ep.name] = handler
    missing = [r for r in roles if r not in handlers]
    if missing:
        raise HandlerRegistryError(f"no handler for role(s) {', '.join(missing)}; {HOW_TO_PLUG_IN}")
    return handlers
