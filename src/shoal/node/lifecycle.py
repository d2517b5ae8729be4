"""Lifetimes: pause/resume (freeze + memory reclaim), TTL and idle timeouts, and the reaper enforcing them.

Pause freezes every process of the sandbox (the runtime's `pause`: the cgroup freezer) and then asks the
kernel to reclaim the sandbox's memory:
  cgroup v2: `memory.reclaim` (proactive reclaim of file and, with swap, anonymous pages);
  cgroup v1: `memory.force_empty` (reclaims what it can from a cgroup that still has tasks).
Without swap only page cache can go; anonymous memory stays resident while paused. The figure reclaimed is
measured and returned. Any request to a paused sandbox resumes it first (`awake`).

Timeouts: `ttl_s` counts from creation (or `keepalive`), `idle_timeout_s` from the last request that
finished (a running command is never idle). `on_timeout="kill"` closes the sandbox; `"pause"` pauses it,
and a TTL re-arms when the sandbox is resumed.

The reaper also forgets the trajectory logs of sandboxes closed more than SHOAL_LOG_RETENTION_S ago.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shoal import cgroups
from shoal.errors import UnsupportedKindError
from shoal.node.sandbox import Sandbox, State

if TYPE_CHECKING:
    from shoal.config import NodeSettings
    from shoal.node.trajectory import TrajectoryLog
    from shoal.substrates import Substrate


class LifecycleHost(Protocol):
    """What pause/resume and the reaper need of the node (shoal.node.service.NodeService is one)."""

    substrates: dict[str, Substrate]
    sandboxes: dict[str, Sandbox]
    settings: NodeSettings
    trajectory: TrajectoryLog

    def persist(self, sandbox: Sandbox) -> None: ...

    async def kill(self, sandbox_id: str, reason: str = ...) -> None: ...

    async def resumed(self, sandbox: Sandbox) -> None: ...


log = logging.getLogger("shoal.node")
ON_TIMEOUT = ("kill", "pause")


def memory_usage(cgroup_path: str) -> int:
    """Bytes charged to the sandbox's memory cgroup (0 if unknown)."""
    return cgroups.memory_current(cgroup_path) or 0


def reclaim_memory(cgroup_path: str) -> None:
    """Ask the kernel to reclaim as much of the cgroup's memory as it can (best effort, see module doc)."""
    rel = cgroup_path.lstrip("/")
    if cgroups.layout() == "v2":
        target, value = cgroups.ROOT / rel / "memory.reclaim", str(max(memory_usage(cgroup_path), 1 << 20))
    else:
        target, value = cgroups.ROOT / "memory" / rel / "memory.force_empty", "0"
    try:
        Path(target).write_text(value)
    except OSError as exc:  # EAGAIN/EBUSY: it reclaimed what it could, not all of it
        if exc.errno not in (errno.EAGAIN, errno.EBUSY, errno.ENOENT):
            log.warning("memory reclaim of %s failed: %s", cgroup_path, exc)


class Lifecycle:
    """Pause/resume and the reaper. One per node; sandboxes are the service's."""

    def __init__(self, service: LifecycleHost) -> None:
        self.service = service
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget(self, sandbox_id: str) -> None:
        self._locks.pop(sandbox_id, None)

    async def pause(self, sandbox: Sandbox) -> dict[str, Any]:
        async with self._lock(sandbox.id):
            if sandbox.state is State.PAUSED:
                return {"id": sandbox.id, "state": "paused", "reclaimed_bytes": 0, "seconds": 0.0}
            substrate = self.service.substrates[sandbox.spec.kind]
            if not substrate.capabilities.pause:
                raise UnsupportedKindError(f"{sandbox.spec.kind} sandboxes cannot be paused; close it or set a ttl_s")
            start = time.monotonic()
            before = memory_usage(sandbox.instance.cgroup_path)
            sandbox.state = State.PAUSED  # first: a request the pause cuts off (a VM's) must not mark it lost
            try:
                await substrate.pause(sandbox.instance)
            except BaseException:
                sandbox.state = State.READY
                raise
            await asyncio.to_thread(reclaim_memory, sandbox.instance.cgroup_path)
            after = memory_usage(sandbox.instance.cgroup_path)
            self.service.persist(sandbox)
            return {
                "id": sandbox.id,
                "state": "paused",
                "memory_before": before,
                "memory_after": after,
                "reclaimed_bytes": max(0, before - after),
                "seconds": time.monotonic() - start,
            }

    async def resume(self, sandbox: Sandbox) -> None:
        async with self._lock(sandbox.id):
            if sandbox.state is not State.PAUSED:
                return
            await self.service.substrates[sandbox.spec.kind].resume(sandbox.instance)
            await self.service.resumed(sandbox)
            sandbox.state = State.READY
            sandbox.last_active = time.time()
            if sandbox.expires_at is None and sandbox.spec.ttl_s and sandbox.spec.on_timeout == "pause":
                sandbox.expires_at = time.time() + sandbox.spec.ttl_s
            self.service.persist(sandbox)

    async def awake(self, sandbox: Sandbox) -> None:
        """Resume a paused sandbox before a request uses it (transparent resume)."""
        if sandbox.state is State.PAUSED:
            await self.resume(sandbox)

    def due(self, sandbox: Sandbox, now: float) -> str | None:
        """Why this sandbox's lifetime ran out now, or None."""
        if sandbox.expires_at is not None and sandbox.expires_at <= now:
            return f"its ttl of {sandbox.spec.ttl_s:g} s expired"
        idle = sandbox.spec.idle_timeout_s
        working = sandbox.busy or sandbox.inflight  # inflight: also steps whose client went away
        if idle and sandbox.state is State.READY and not working and sandbox.last_active + idle <= now:
            return f"it was idle for {idle:g} s (idle_timeout_s)"
        return None

    async def reap_once(self) -> None:
        now = time.time()
        for sandbox in list(self.service.sandboxes.values()):
            reason = self.due(sandbox, now)
            if reason is None:
                continue
            try:
                if sandbox.spec.on_timeout == "pause":
                    sandbox.expires_at = None  # re-armed on resume
                    if sandbox.state is not State.PAUSED:
                        await self.pause(sandbox)
                    log.info("paused %s: %s", sandbox.id, reason)
                else:
                    await self.service.kill(sandbox.id, reason=reason)
            except Exception as exc:  # keep reaping the others
                log.warning("reaper: could not end %s (%s): %s", sandbox.id, reason, exc)

    async def reap_forever(self, interval: float = 0.25) -> None:
        retention = self.service.settings.log_retention_s
        pruned_at = 0.0
        while True:
            await asyncio.sleep(interval)
            await self.reap_once()
            if time.time() - pruned_at >= min(60.0, retention / 2):
                pruned_at = time.time()
                try:
                    await self.service.trajectory.prune(pruned_at - retention)
                except Exception as exc:  # a full disk: try again later
                    log.warning("could not prune old trajectory logs: %s", exc)
