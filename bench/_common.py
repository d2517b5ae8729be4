"""Helpers shared by the benchmarks: percentiles, tables, a private node."""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

from shoal.config import Paths
from shoal.demo import meminfo_used_mb  # noqa: F401 - re-exported for the benchmarks
from shoal.node.daemon import running_pid

IMAGES = os.environ.get("SHOAL_IMAGES", "/var/lib/shoal/store")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc: the figure that survives a noisy host."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launcher_pids(parent_pid: int) -> list[int]:
    """The shoal-launcher processes whose parent is `parent_pid` (a node's launcher, or a launcher's spare)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if (
            stat[stat.find("(") + 1 : stat.rfind(")")] == "shoal-launcher"
            and int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid
        ):
            found.append(int(proc.name))
    return found


def launcher_cpu_seconds(node_pid: int) -> float:
    """CPU the node's running shoal-launcher (runtime="shoal") has used: a child the node reaps only when it
    stops, so the node's cutime/cstime miss it while it serves. Its own time only: the sandboxes it reaps are
    counted in their cgroups already."""
    total = 0.0
    for pid in launcher_pids(node_pid):
        try:
            total += cpu_seconds(pid)
        except OSError:  # it exited since
            pass
    return total


def machine_cpu_s() -> float:
    """CPU the whole machine has used so far (/proc/stat: every core, all but idle and iowait), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU a process and its reaped children have used so far (utime stime cutime cstime), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(x) for x in stat[11:15]) / os.sysconf("SC_CLK_TCK")


def sandboxes_cpu_s(cgroup_parent: str) -> float:
    """CPU of everything in the node's sandboxes (the function workers and every call's child), from the
    cgroup parent they live under (v1 cpuacct or v2 cpu.stat); 0 if neither is readable."""
    root = Path("/sys/fs/cgroup")
    try:
        return int((root / "cpuacct" / cgroup_parent / "cpuacct.usage").read_text()) / 1e9
    except OSError:
        pass
    try:
        for line in (root / cgroup_parent / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def summary(name: str, seconds: list[float], wall: float | None = None) -> str:
    p50, p99 = statistics.median(seconds) * 1e3, pct(seconds, 0.99) * 1e3
    rate = f"{len(seconds) / wall:8.1f}/s" if wall else " " * 10
    return f"  {name:<44} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms  {rate}  (n={len(seconds)})"


class BenchNode:
    """A node of the benchmark's own (own home and cgroup parent), stopped at the end."""

    def __init__(self, name: str) -> None:
        self.home = Path(f"/tmp/shoal-bench-{name}")
        os.environ.update(SHOAL_HOME=str(self.home), SHOAL_IMAGES=IMAGES, SHOAL_CGROUP_PARENT=f"shoal-bench-{name}")
        # a node already serving this home is another run's (two sessions running one bench at once): this run
        # uses it but must not stop it at its end (`--name` gives a run a home of its own)
        self.foreign = self._holder()
        if self.foreign is not None:
            print(f"note: node {self.foreign} already serves {self.home} (another run's?): left running at the end")

    def _holder(self) -> int | None:
        """The pid of the node holding this home's lock (its flock, not a pid left in the file: pids are reused
        quickly, so a stale node.lock named live processes of others), or None."""
        return running_pid(Paths(home=self.home, images=Path(IMAGES)))

    def stop(self) -> None:
        pid = self._holder()
        if pid is None or pid == self.foreign:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            return
        for _ in range(600):
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.05)
