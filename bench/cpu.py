"""Where a bench's CPU went, from /proc: the machine's busy cores and single processes' CPU time.

Linux only, and only for processes on this machine (a local PostgreSQL's backends included).
"""

import os
import resource
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of a process and all its threads, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy() -> float:
    """CPU seconds the whole machine has spent on anything but idle and iowait since boot."""
    head = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(x) for x in head[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


def own_cpu() -> float:
    """CPU seconds of this process, all its threads."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


class Span:
    """Cores used over a span of wall time: the machine's, processes named by pid (e.g. a
    simulator) while they live, and CPU seconds measured elsewhere (e.g. reported by children)."""

    def __init__(self, **pids: int) -> None:
        self.pids = pids
        self.t, self.busy = time.monotonic(), machine_busy()
        self.start = {k: proc_cpu(p) or 0.0 for k, p in pids.items()}
        self.last = dict(self.start)

    def poll(self) -> None:
        """Read the named processes again (call it before they exit)."""
        for k, p in self.pids.items():
            if (c := proc_cpu(p)) is not None:
                self.last[k] = c

    def cores(self, **cpu_seconds: float) -> dict[str, float]:
        """Cores used since the span began; "rest" is the machine's less every part named."""
        self.poll()
        dt = time.monotonic() - self.t
        out = {"machine": (machine_busy() - self.busy) / dt}
        out |= {k: (self.last[k] - self.start[k]) / dt for k in self.pids}
        out |= {k: v / dt for k, v in cpu_seconds.items()}
        out["rest"] = out["machine"] - sum(v for k, v in out.items() if k != "machine")
        return {k: round(v, 2) for k, v in out.items()} | {"of": float(os.cpu_count() or 1)}
