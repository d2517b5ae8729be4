"""The per-call cgroup of a function worker: `<sandbox cgroup>/call`, limited by the node before each call.

The worker's forked child joins it by writing "0" to `cgroup.procs` files the node opened and handed over
(SCM_RIGHTS), so the resident interpreter stays outside and a call's OOM or fork bomb hits only the call.
The directory is removed with its sandbox (`cgroups.remove` removes children first).
"""

from __future__ import annotations

import os
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
