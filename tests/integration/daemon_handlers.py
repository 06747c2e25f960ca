"""Handlers the real-daemon tests plug in with TQ_HANDLERS: they hold their task until the file
named by TQ_TEST_RELEASE_FILE exists (then complete it), so a drain run holds tasks while the
test kills it, and the queue drains once the test lets go."""

import os
import time
from typing import Any

from tq_pipelines.queue.api import Task
from tq_pipelines.queue.worker import TaskContext


def hold(task: Task, ctx: TaskContext) -> dict[str, Any]:
    release = os.environ["TQ_TEST_RELEASE_FILE"]
    deadline = time.monotonic() + 600
    while not os.path.exists(release) and not ctx.lost and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"held_by": ctx.worker_id}
