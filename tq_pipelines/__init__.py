"""tq_pipelines: a PostgreSQL task queue for a crawler fleet, run under Dagster.

The queue itself (:mod:`tq_pipelines.queue`, :mod:`tq_pipelines.worker`) knows nothing of Dagster.
"""

from tq_pipelines.queue import QueueInputError, RecoveryReport, RoleCapacity, Task, TaskQueue

__all__ = ["QueueInputError", "RecoveryReport", "RoleCapacity", "Task", "TaskQueue"]
