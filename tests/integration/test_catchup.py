"""resync_catchup_sensor requests today's resync once when its scheduled run is missing."""

from datetime import UTC, datetime

import dagster as dg

from tq_pipelines.sensors.queue import resync_catchup_sensor


def test_catchup_requests_todays_resync_once():
    now = datetime.now(UTC)
    with dg.instance_for_test() as instance:
        result = resync_catchup_sensor(dg.build_sensor_context(instance=instance))
        if (now.hour, now.minute) < (0, 5):
            assert isinstance(result, dg.SkipReason)
            return
        assert isinstance(result, dg.RunRequest)
        assert result.partition_key == now.date().isoformat()
        assert result.run_key == f"catchup:{now.date().isoformat()}"
