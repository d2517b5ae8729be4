"""User arguments → resources: the bounds and defaults of cpu, memory_mb, pids and disk_mb, in one place.

Why one module: `memory_mb` had a different default in each file that needed one (the node's cap for
containers, 256/512 MB for VM guests, 1024 MB for a function call, 512 MB in quota accounting). Every
reader now asks `memory_mb(kind, requested, node_default)` here, and the node checks every request with
`check(spec)`, so a bad value fails the same way whatever the kind.
"""

from __future__ import annotations

import functools
import os
import posixpath
from typing import Any

from shoal import settings
from shoal.errors import InvalidRequestError

MIN_MEMORY_MB = 8
MIN_VM_MEMORY_MB = 64  # a Debian kernel and the agent do not boot in less
MIN_DISK_MB = 4
MIN_PIDS = 4  # the agent, its reserve, a request's handler and one command
# A guest's RAM is fixed when it boots, so a VM always has a size; these are the sizes without memory_mb.
VM_MEMORY_MB = {"microvm": 256, "vm": 512}
# What a create without cpu / memory_mb counts against its project's quota (the gateway and nodes agree).
QUOTA_CPU = 1.0
QUOTA_MEMORY_MB = 512


@functools.cache
def host_memory_mb() -> int:
    """The host's memory, read once per process (a sysinfo call each time cost every request ~5 us)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


@functools.cache
def host_cores() -> int:
    """os.cpu_count(), read once per process: it opens and reads /sys/devices/system/cpu/online each time,
    and `check` runs on every request (every function call)."""
    return os.cpu_count() or 1


def container_default_memory_mb() -> int:
    """4 GiB, or half the host's memory if that is less: one sandbox that names no memory_mb cannot take
    the host down with it (and its neighbours and the node). SHOAL_DEFAULT_MEMORY_MB overrides."""
    return min(4096, host_memory_mb() // 2)


def memory_mb(kind: str, requested: int | None, node_default: int = 0) -> int | None:
    """The memory cap of a sandbox of `kind` that asked for `requested` (None: not named). `node_default` is
    the node's cap for containers (0: none). None means no cap (a container with the node default off)."""
    if requested is not None:
        return requested
    if kind in VM_MEMORY_MB:
        return VM_MEMORY_MB[kind]
    if kind == "function":
        return settings.FN_MEMORY_MB.get()
    return node_default or None


def check(spec: Any, cores: int | None = None, total_mb: int | None = None) -> None:
    """Refuse resource arguments no sandbox of `spec.kind` can have here, naming the bound."""
    cores = cores or host_cores()
    if spec.cpu is not None and not 0 < spec.cpu <= cores:
        raise InvalidRequestError(f"cpu={spec.cpu} is impossible here: this node has {cores} cores")
    if spec.memory_mb is not None:
        least = MIN_VM_MEMORY_MB if spec.kind in VM_MEMORY_MB else MIN_MEMORY_MB
        if spec.memory_mb < least:
            raise InvalidRequestError(f"memory_mb={spec.memory_mb}: a {spec.kind} needs at least {least} MB")
        total_mb = total_mb or host_memory_mb()
        if spec.memory_mb > total_mb:
            raise InvalidRequestError(f"memory_mb={spec.memory_mb} exceeds this node's {total_mb} MB")
    if spec.pids is not None and spec.pids < MIN_PIDS:
        raise InvalidRequestError(
            f"pids={spec.pids}: a sandbox needs at least {MIN_PIDS} (its agent, the agent's reserve, the handler "
            "of a request and one command)"
        )
    if spec.disk_mb is not None and spec.disk_mb < MIN_DISK_MB:
        raise InvalidRequestError(f"disk_mb={spec.disk_mb} is below the minimum of {MIN_DISK_MB} MB")
    check_tmpfs(spec.kind, list(getattr(spec, "tmpfs", None) or []))


MAX_TMPFS = 8
_NOT_TMPFS = ("/proc", "/sys", "/dev", "/.shoal")  # the runtime's and the agent's own mounts


def check_tmpfs(kind: str, paths: list[str]) -> None:
    """`tmpfs`: containers only; at most MAX_TMPFS absolute, normalised paths, none of the system mounts."""
    if not paths:
        return
    if kind != "container":
        raise InvalidRequestError(f"tmpfs: only containers mount in-memory file systems, not {kind} sandboxes")
    if len(paths) > MAX_TMPFS:
        raise InvalidRequestError(f"tmpfs: at most {MAX_TMPFS} paths, not {len(paths)}")
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
            raise InvalidRequestError(f"tmpfs: {path!r} is not an absolute, normalised directory path below /")
        if any(path == root or path.startswith(root + "/") for root in _NOT_TMPFS):
            raise InvalidRequestError(f"tmpfs: {path!r} is under {', '.join(_NOT_TMPFS)}, which the runtime mounts")


def quota_cost(spec: dict[str, Any]) -> tuple[float, int]:
    """The (cpu, memory_mb) a create request counts against its project."""
    return float(spec.get("cpu") or QUOTA_CPU), int(spec.get("memory_mb") or QUOTA_MEMORY_MB)
