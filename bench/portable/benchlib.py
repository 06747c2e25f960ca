"""What the portable adapters (``*-bench/main.py``) share: the long-horizon protocol of
hardbyte/postgresql-job-queue-benchmarking (CONTRIBUTING_ADAPTERS.md, section 3).

- env in: :func:`env_int`, :func:`env_str`, :func:`instance_id`;
- JSONL out on stdout (one record a line, flushed): :class:`Emitter`;
- pickup latency percentiles over a rolling window in bounded memory: :class:`RollingHistogram`;
- offered load: :class:`OfferedLoad` turns ``PRODUCER_MODE`` / ``PRODUCER_RATE`` /
  ``PRODUCER_RATE_CONTROL_FILE`` / ``PRODUCER_PACING`` (``ENQUEUE <n>`` tokens on stdin) /
  ``TARGET_DEPTH`` into a count of jobs to insert, credited on real elapsed time, and
  :class:`Backlog` hands them to the producer threads;
- clock-aligned sampling: :func:`next_aligned_tick`.

Every adapter writes the same effect table, ``bench_done(task_id bigint, at timestamptz)``, one
row per completed job from inside its handler (:data:`BENCH_DONE_DDL`), so that one audit
counts the jobs lost and the jobs completed twice (README.md of each adapter).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable

# No unique constraint: a job whose effect happened twice shows up as two rows.
BENCH_DONE_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_done (task_id BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())"
)

# The metrics that describe the whole system rather than one replica: only instance 0 emits
# them (as the harness's own adapters do), so that a multi-replica run reports one observation.
OBSERVER_METRICS = frozenset({"queue_depth", "producer_target_rate"})


def env_str(key: str, default: str) -> str:
    value = os.environ.get(key)
    return value if value not in (None, "") else default


def env_int(key: str, default: int) -> int:
    value = os.environ.get(key)
    if value in (None, ""):
        return default
    return int(float(value))


def env_float(key: str, default: float) -> float:
    value = os.environ.get(key)
    if value in (None, ""):
        return default
    return float(value)


def database_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL must be set (the per-system database, created by the harness)")
    return url


def instance_id() -> int:
    """``BENCH_INSTANCE_ID``: the replica's index, 0 when run alone."""
    try:
        return int(os.environ.get("BENCH_INSTANCE_ID", "0"))
    except ValueError:
        return 0


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log(system: str, message: str) -> None:
    """stderr is the adapter's log; stdout is telemetry only."""
    print(f"[{system}-bench {instance_id()}] {message}", file=sys.stderr, flush=True)


class Emitter:
    """JSONL records on stdout, every one stamped with the system and the replica's index."""

    def __init__(self, system: str) -> None:
        self.system = system
        self.instance = instance_id()
        self._lock = threading.Lock()

    def record(self, record: dict) -> None:
        record.setdefault("instance_id", self.instance)
        line = json.dumps(record)
        with self._lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass  # the reader is gone: nothing left to tell

    def descriptor(self, **fields: object) -> None:
        self.record({"kind": "descriptor", "system": self.system, "started_at": now_iso(), **fields})

    def samples(self, t: str, metrics: Iterable[tuple[str, float, float]]) -> None:
        for metric, value, window_s in metrics:
            if metric in OBSERVER_METRICS and self.instance != 0:
                continue
            self.record(
                {
                    "t": t,
                    "system": self.system,
                    "kind": "adapter",
                    "subject_kind": "adapter",
                    "subject": "",
                    "metric": metric,
                    "value": round(float(value), 3),
                    "window_s": window_s,
                }
            )


class RollingHistogram:
    """Percentiles of the last ``window_s`` seconds in bounded memory: one sparse log-bucket
    histogram per second (buckets ``ratio`` apart: 1.001 keeps 3 significant figures), the
    seconds older than the window dropped. Thread-safe."""

    def __init__(self, window_s: int = 30, ratio: float = 1.001, floor_ms: float = 0.001) -> None:
        self.window_s = window_s
        self._log_ratio = math.log(ratio)
        self._ratio = ratio
        self._floor = floor_ms
        self._slots: dict[int, dict[int, int]] = {}
        self._lock = threading.Lock()

    def record(self, value_ms: float, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        value = max(value_ms, self._floor)
        bucket = int(math.log(value / self._floor) / self._log_ratio)
        with self._lock:
            slot = self._slots.get(second)
            if slot is None:
                slot = self._slots[second] = {}
                for old in [s for s in self._slots if s <= second - self.window_s - 1]:
                    del self._slots[old]
            slot[bucket] = slot.get(bucket, 0) + 1

    def percentiles(self, ps: Iterable[float], now: float | None = None) -> list[float]:
        """The values at quantiles ``ps`` (0..1) of the window ending at ``now``; 0.0 when empty."""
        second = int(time.monotonic() if now is None else now)
        merged: dict[int, int] = {}
        with self._lock:
            for s, slot in self._slots.items():
                if s > second - self.window_s:
                    for bucket, count in slot.items():
                        merged[bucket] = merged.get(bucket, 0) + count
        ps = list(ps)
        total = sum(merged.values())
        if not total:
            return [0.0 for _ in ps]
        ordered = sorted(merged.items())
        out = []
        for p in ps:
            rank = max(1, math.ceil(p * total))
            seen = 0
            for bucket, count in ordered:
                seen += count
                if seen >= rank:
                    # The bucket's geometric middle.
                    out.append(self._floor * self._ratio ** (bucket + 0.5))
                    break
        return out


def next_aligned_tick(every_s: float, now: float | None = None) -> float:
    """The next wall-clock multiple of ``every_s`` (epoch seconds), so that every adapter's
    samples fall on the same instants."""
    now = time.time() if now is None else now
    return (math.floor(now / every_s) + 1) * every_s


class Backlog:
    """Jobs offered and not yet handed to a producer: a count, so it costs no memory. Capped
    (``cap``): what the producers cannot take up is dropped and counted, not inserted later in a
    burst that no one offered. While the database is unreachable the producers drop what is
    offered (counted as failed) instead of queueing it."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self.pending = 0
        self.dropped = 0
        self._cond = threading.Condition()

    def add(self, n: int) -> None:
        with self._cond:
            room = self.cap - self.pending
            take = min(n, max(0, room))
            self.pending += take
            self.dropped += n - take
            if take:
                self._cond.notify_all()

    def take(self, most: int, timeout: float) -> int:
        """Up to ``most`` jobs to insert now; 0 after ``timeout`` seconds with none offered."""
        with self._cond:
            if not self.pending:
                self._cond.wait(timeout)
            n = min(most, self.pending)
            self.pending -= n
            return n

    def drain(self) -> int:
        with self._cond:
            n, self.pending = self.pending, 0
            return n


class OfferedLoad:
    """The offered load of the run, handed to ``offer(n)`` from a thread of its own.

    - ``PRODUCER_MODE=fixed`` with ``PRODUCER_PACING=harness``: the harness writes
      ``ENQUEUE <n>`` lines on stdin, each offered as it comes (at most ``PRODUCER_BATCH_MAX``).
    - ``PRODUCER_MODE=fixed`` otherwise: ``PRODUCER_RATE`` jobs/s (or the number in
      ``PRODUCER_RATE_CONTROL_FILE``, read every half second), credited on real elapsed time
      every ``PRODUCER_BATCH_MS`` and offered in chunks of at most ``PRODUCER_BATCH_MAX``.
    - ``PRODUCER_MODE=depth-target``: tops the queue up to ``TARGET_DEPTH`` (``depth()``).
    """

    def __init__(
        self,
        offer: Callable[[int], None],
        stop: threading.Event,
        depth: Callable[[], int] = lambda: 0,
    ) -> None:
        self.offer = offer
        self.stop = stop
        self.depth = depth
        self.mode = env_str("PRODUCER_MODE", "fixed")
        self.rate = env_float("PRODUCER_RATE", 800)
        self.control_file = os.environ.get("PRODUCER_RATE_CONTROL_FILE") or None
        self.pacing = env_str("PRODUCER_PACING", "adapter")
        self.batch_max = max(1, env_int("PRODUCER_BATCH_MAX", 128))
        self.batch_ms = max(1, env_int("PRODUCER_BATCH_MS", 10))
        self.target_depth = env_int("TARGET_DEPTH", 1000)
        self.current_rate = 0.0 if self.mode == "depth-target" else self.rate
        self._rate_read_at = 0.0

    @property
    def harness_paced(self) -> bool:
        return self.mode == "fixed" and self.pacing == "harness"

    def target_rate(self) -> float:
        """``PRODUCER_RATE``, or the control file's number when there is one (read at most
        twice a second; an unreadable file keeps the last value)."""
        now = time.monotonic()
        if self.control_file and now - self._rate_read_at >= 0.5:
            self._rate_read_at = now
            try:
                with open(self.control_file) as fh:
                    self.current_rate = float(fh.read().strip())
            except (OSError, ValueError):
                pass
        elif not self.control_file:
            self.current_rate = self.rate
        return self.current_rate

    def start(self) -> threading.Thread:
        if self.harness_paced:
            target = self._tokens
        else:
            target = self._depth if self.mode == "depth-target" else self._fixed
        thread = threading.Thread(target=target, name="offered-load", daemon=True)
        thread.start()
        return thread

    def _fixed(self) -> None:
        period = self.batch_ms / 1000.0
        last = time.monotonic()
        credit = 0.0
        while not self.stop.is_set():
            sleep_for = period - (time.monotonic() - last)
            if sleep_for > 0 and self.stop.wait(sleep_for):
                return
            now = time.monotonic()
            rate = self.target_rate()
            credit += max(0.0, rate) * (now - last)  # real elapsed time, not the nominal period
            last = now
            if rate <= 0:
                credit = 0.0
            while credit >= 1.0:
                n = min(int(credit), self.batch_max)
                credit -= n
                self.offer(n)

    def _tokens(self) -> None:
        # A daemon thread blocked in readline() is left behind at exit.
        for raw in sys.stdin:
            if self.stop.is_set():
                return
            self.target_rate()  # keeps producer_target_rate true when the harness moves it
            line = raw.strip()
            if not line.startswith("ENQUEUE "):
                continue
            try:
                n = int(line.split(" ", 1)[1])
            except ValueError:
                continue
            if n > 0:
                self.offer(min(n, self.batch_max))

    def _depth(self) -> None:
        while not self.stop.is_set():
            room = self.target_depth - self.depth()
            if room > 0:
                self.offer(min(room, self.batch_max))
            # The depth is polled every 0.2 s: offering faster would overshoot the target.
            if self.stop.wait(0.2):
                return


class Telemetry:
    """Counters and latency windows of one adapter, and the sampler thread that reports them
    every ``SAMPLE_EVERY_S`` on wall-clock multiples. Counters may be bumped from any thread."""

    COUNTERS = ("enqueued", "enqueue_failed", "completed", "worker_restarts")

    def __init__(self, emitter: Emitter, load: OfferedLoad, backlog: Backlog) -> None:
        self.emit = emitter
        self.load = load
        self.backlog = backlog
        self.every = max(1, env_int("SAMPLE_EVERY_S", 5))
        self.counts = dict.fromkeys(self.COUNTERS, 0)
        self.pickup = RollingHistogram(30)
        self.end_to_end = RollingHistogram(30)
        self.enqueue_call = RollingHistogram(30)
        self.depth = 0
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(stop,), name="sampler", daemon=True)
        thread.start()
        return thread

    def _run(self, stop: threading.Event) -> None:
        last, last_t, last_dropped = self.snapshot(), time.monotonic(), 0
        tick = next_aligned_tick(self.every)
        while not stop.wait(max(0.0, tick - time.time())):
            tick += self.every
            now = time.monotonic()
            dt = max(0.001, now - last_t)
            cur, dropped = self.snapshot(), self.backlog.dropped
            rate = {k: (cur[k] - last[k]) / dt for k in cur}
            p50, p95, p99 = self.pickup.percentiles((0.5, 0.95, 0.99))
            e50, e95, e99 = self.end_to_end.percentiles((0.5, 0.95, 0.99))
            c50, c95, c99 = self.enqueue_call.percentiles((0.5, 0.95, 0.99))
            w = float(self.every)
            self.emit.samples(
                now_iso(),
                [
                    ("claim_p50_ms", p50, 30.0),
                    ("claim_p95_ms", p95, 30.0),
                    ("claim_p99_ms", p99, 30.0),
                    ("enqueue_rate", rate["enqueued"], w),
                    ("completion_rate", rate["completed"], w),
                    ("queue_depth", float(self.depth), 0.0),
                    ("producer_target_rate", self.load.current_rate, 0.0),
                    ("end_to_end_p50_ms", e50, 30.0),
                    ("end_to_end_p95_ms", e95, 30.0),
                    ("end_to_end_p99_ms", e99, 30.0),
                    ("producer_call_p50_ms", c50, 30.0),
                    ("producer_call_p95_ms", c95, 30.0),
                    ("producer_call_p99_ms", c99, 30.0),
                    ("enqueue_failed_rate", rate["enqueue_failed"], w),
                    ("enqueue_dropped_rate", (dropped - last_dropped) / dt, w),
                    ("worker_restarts", float(cur["worker_restarts"] - last["worker_restarts"]), w),
                ],
            )
            last, last_t, last_dropped = cur, now, dropped
