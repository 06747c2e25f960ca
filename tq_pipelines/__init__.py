"""tq_pipelines: a PostgreSQL task queue for a crawler fleet, run under Dagster.

The queue itself (:mod:`tq_pipelines.queue.api`, :mod:`tq_pipelines.queue.worker`) knows nothing of Dagster.
"""

from tq_pipelines.queue.api import QueueInputError, RecoveryReport, RoleCapacity, Task, TaskQueue

__all__ = ["QueueInputError", "RecoveryReport", "RoleCapacity", "Task", "TaskQueue"]
