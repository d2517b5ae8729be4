"""The per-call cgroup of a function worker: `<sandbox cgroup>/call`, limited by the node before each call.

The worker's forked child joins it by writing "0" to `cgroup.procs` files the node opened and handed over
(SCM_RIGHTS), so the resident interpreter stays outside and a call's OOM or fork bomb hits only the call.
The directory is removed with its sandbox (`cgroups.remove` removes children first).

A call's processes die with it: the worker freezes forks (it holds `pids.max` too and writes 0 there) and
kills what it finds, and the node, which is not starved of CPU by a fork bomb the way the worker is,
empties the cgroup itself when a call overruns its timeout or leaves anything behind (`kill_all`). The
next call then starts in an empty cgroup with its limits written afresh.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from shoal import cgroups

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class CallLimits:
    memory_mb: int
    pids: int
    cpu: float | None


def call_dirs(sandbox_cgroup: str) -> list[Path]:
    """Create the call cgroup in every hierarchy shoal limits; return its directories."""
    rel = sandbox_cgroup.strip("/") + "/call"
    if cgroups.layout() == "v2":
        dirs = [cgroups.ROOT / rel]
    else:
        dirs = [cgroups.ROOT / c / rel for c in CONTROLLERS if (cgroups.ROOT / c / sandbox_cgroup.strip("/")).is_dir()]
    for directory in dirs:
        directory.mkdir(exist_ok=True)
    return dirs


def is_cpu(directory: Path) -> bool:
    """A directory of the v1 cpu hierarchy (joined only by calls with a cpu limit)."""
    return directory.relative_to(cgroups.ROOT).parts[0] == "cpu"


def open_procs(dirs: list[Path]) -> list[int]:
    """Write-only descriptors of each directory's cgroup.procs: what the worker's children write "0" to."""
    return [os.open(directory / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for directory in dirs]


def open_pids(dirs: list[Path]) -> list[int]:
    """Descriptors of the call cgroup's pids.max (write) and pids.current (read), if it has a pids
    controller: the worker sees at a glance whether a call left anything, and stops a fork bomb from
    refilling what it kills by writing 0 to pids.max."""
    for directory in dirs:
        if (directory / "pids.max").exists():
            return [
                os.open(directory / "pids.max", os.O_WRONLY | os.O_CLOEXEC),
                os.open(directory / "pids.current", os.O_RDONLY | os.O_CLOEXEC),
            ]
    return []


class Occupancy:
    """Does any process (of a finished call) remain in the call cgroup? Asked after every call.

    With a pids controller, one pread of its `pids.current` (kept open) answers: every process of a call
    is in the pids hierarchy (calls always join it; see the join list in pool.Worker.run). Without one,
    each hierarchy's `cgroup.procs` is read (open, read, close per directory: several times the cost on
    the node's event loop)."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.current = None
        for directory in dirs:
            if (directory / "pids.current").exists():
                self.current = open(directory / "pids.current", "rb", buffering=0)  # noqa: SIM115 - kept open
                break

    def __call__(self) -> bool:
        if self.current is not None:
            try:
                return os.pread(self.current.fileno(), 32, 0).strip() != b"0"
            except OSError:
                pass
        return occupied(self.dirs)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def occupied(dirs: list[Path]) -> bool:
    """Does any process (of a finished call) remain in the call cgroup?"""
    for directory in dirs:
        try:
            with open(directory / "cgroup.procs", "rb") as handle:
                if handle.read(16).strip():
                    return True
        except OSError:
            continue
    return False


def kill_all(dirs: list[Path], timeout: float = 30.0) -> bool:
    """SIGKILL everything in the call cgroup with forks frozen (pids.max 0; cgroup.kill on v2); True once
    it is empty. The caller writes the limits again before the next call (`apply`)."""
    deadline = time.monotonic() + timeout
    while True:
        members: set[int] = set()
        for directory in dirs:
            for name, value in (("pids.max", 0), ("cgroup.kill", 1)):  # again each round: the worker may thaw
                if (directory / name).exists():
                    _write(directory / name, value, optional=True)
            try:
                members.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
            except OSError:
                continue
        if not members:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def apply(dirs: list[Path], limits: CallLimits) -> None:
    """Set the call cgroup's limits (the cgroup is empty between calls, so lowering never fails)."""
    memory = limits.memory_mb << 20
    quota = int(limits.cpu * CPU_PERIOD_US) if limits.cpu else None
    for directory in dirs:
        if (directory / "memory.max").exists():  # v2
            _write(directory / "memory.max", memory)
            _write(directory / "memory.swap.max", 0, optional=True)
            _write(directory / "pids.max", limits.pids)
            _write(directory / "cpu.max", f"{quota} {CPU_PERIOD_US}" if quota else f"max {CPU_PERIOD_US}")
        elif (directory / "memory.limit_in_bytes").exists():
            swap = directory / "memory.memsw.limit_in_bytes"
            current = int((directory / "memory.limit_in_bytes").read_text())
            order = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            if memory > current:  # memsw must stay >= the memory limit at every step
                order.reverse()
            for name in order:
                if name == "memory.limit_in_bytes" or swap.exists():
                    _write(directory / name, memory)
        elif (directory / "pids.max").exists():
            _write(directory / "pids.max", limits.pids)
        elif (directory / "cpu.cfs_quota_us").exists():
            _write(directory / "cpu.cfs_period_us", CPU_PERIOD_US)
            _write(directory / "cpu.cfs_quota_us", quota or -1)


def oom_kills(dirs: list[Path]) -> int:
    for directory in dirs:
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (directory / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


def _write(path: Path, value: object, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if not optional:
            raise
