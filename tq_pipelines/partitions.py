"""Partitions, all in UTC."""

import dagster as dg

# end_offset=1: today's partition exists, so that the early-morning schedule resyncs today.
resync_partitions_def = dg.DailyPartitionsDefinition(start_date="2026-01-01", timezone="UTC", end_offset=1)

# end_offset=1: the current hour is a partition, materialised every few minutes while it fills
# (task_completion_log_current_hour_schedule) and made final once it has closed.
hourly_partitions_def = dg.HourlyPartitionsDefinition(
    start_date="2026-01-01-00:00", timezone="UTC", end_offset=1
)
