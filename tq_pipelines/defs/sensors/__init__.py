"""Sensors: the queue drainer and the alerts."""
