"""CPU time of a spawned cluster's processes, so a report can say where the time went.

Linux only (reads /proc/PID/stat); elsewhere, or for a process that has gone, nothing is
reported. Includes the process's threads, not its children.
"""

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far; None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class CpuProbe:
    """Samples the CPU seconds of named processes: `start()` before a run, `stop()` after."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self._start: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        return {name: s for name, pid in self.pids.items() if (s := cpu_seconds(pid)) is not None}

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> dict[str, float]:
        """{process name: CPU seconds used since start()}."""
        end = self._sample()
        return {name: round(end[name] - self._start[name], 3) for name in end if name in self._start}


def cluster_probe(cluster) -> CpuProbe:
    """A probe over every process of a `pdq.ops.up.Cluster` (and its private Redis, if any)."""
    pids = {child.name: child.process.pid for child in cluster.children}
    redis_proc = getattr(cluster.redis, "process", None)
    if redis_proc is not None:
        pids["redis"] = redis_proc.pid
    return CpuProbe(pids)
