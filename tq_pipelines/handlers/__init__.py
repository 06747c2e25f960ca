"""Role handlers: a registry from role to the function that does one task of that role.

Built-in handlers are listed in :data:`BUILTIN`. A deployment plugs its own in through the entry
point group ``tq_pipelines.handlers`` (name = role, value = ``module:function``); an entry point
replaces the built-in handler of the same role.
"""

from collections.abc import Mapping
from importlib.metadata import entry_points

from tq_pipelines.queue import JSON, ROLES, Task
from tq_pipelines.worker import Handler, TaskContext

ENTRY_POINT_GROUP = "tq_pipelines.handlers"


class HandlerRegistryError(RuntimeError):
    """A role has no handler, or a plugged-in handler cannot be loaded."""


def noop(task: Task, ctx: TaskContext) -> JSON:
    """Does nothing and says so: the placeholder until a role gets real work."""
    return {"handler": "noop", "role": task.role}


BUILTIN: Mapping[str, Handler] = dict.fromkeys(ROLES, noop)


def load_handlers(roles: tuple[str, ...] = ROLES) -> dict[str, Handler]:
    """The handler of every role: built-ins, overridden by entry points. Raises if one is missing."""
    handlers: dict[str, Handler] = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
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
        raise HandlerRegistryError(
            f"no handler for role(s) {', '.join(missing)}; register one under {ENTRY_POINT_GROUP}"
        )
    return handlers
