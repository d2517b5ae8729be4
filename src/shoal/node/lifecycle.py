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

The reaper wakes only for the next deadline (issue 12: scanning every sandbox 4x/s cost ~15 CPU-ms/s with
3,000 live): a heap holds, per sandbox, the earliest moment its lifetime may run out. Entries are checked
lazily: a deadline that moved later (a request, keepalive) makes the wake a no-op that re-arms the later
one; whatever can move one earlier (create, claim, keepalive, resume, adoption) calls `arm`.

The reaper also forgets the trajectory logs of sandboxes closed more than SHOAL_LOG_RETENTION_S ago.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
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

    async def kill(self, sandbox_id: str, reason: str = ...) -> bool: ...

    async def resumed(self, sandbox: Sandbox) -> None: ...


log = logging.getLogger("shoal.node")
ON_TIMEOUT = ("kill", "pause")
RETRY_S = 1.0  # a pause the reaper could not do is tried again this much later
MAX_SLEEP_S = 30.0  # the reaper looks again at least this often (wall-clock jumps move deadlines)


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
        self._deadlines: list[tuple[float, str]] = []  # (when, sandbox ID): a heap, stale entries skipped
        self._armed: dict[str, float] = {}  # sandbox ID -> its live entry in the heap
        self._wake = asyncio.Event()  # an entry earlier than the one the reaper sleeps for was pushed

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget(self, sandbox_id: str) -> None:
        self._locks.pop(sandbox_id, None)
        self._armed.pop(sandbox_id, None)  # its heap entry is skipped when it comes up
        if len(self._deadlines) > 2 * len(self._armed) + 1024:  # closed sandboxes' entries far in the future
            self._deadlines = [(when, i) for i, when in self._armed.items()]
            heapq.heapify(self._deadlines)

    def deadline(self, sandbox_id: str) -> float | None:
        """When the reaper next looks at `sandbox_id` (None: never, until something arms it)."""
        return self._armed.get(sandbox_id)

    @property
    def heap_size(self) -> int:
        """Entries in the reaper's heap, stale ones included (a figure for tests and metrics)."""
        return len(self._deadlines)

    def next_check(self, sandbox: Sandbox, now: float) -> float | None:
        """The earliest moment `sandbox`'s lifetime may run out, as far as is known now (None: never)."""
        when = sandbox.expires_at
        idle = sandbox.spec.idle_timeout_s
        if idle and sandbox.state is State.READY:
            # working: idle cannot run out before it stops (it stamps last_active then), so not before now+idle
            idle_at = now + idle if sandbox.busy or sandbox.inflight else sandbox.last_active + idle
            when = idle_at if when is None else min(when, idle_at)
        return when

    def arm(self, sandbox: Sandbox) -> None:
        """Have the reaper check `sandbox` at its next deadline. Call it whenever a deadline may have moved
        earlier (a later one needs nothing: the earlier check finds nothing due and re-arms)."""
        when = self.next_check(sandbox, time.time())
        if when is not None:
            self._push(sandbox.id, when)

    def _push(self, sandbox_id: str, when: float) -> None:
        armed = self._armed.get(sandbox_id)
        if armed is not None and armed <= when:
            return  # an earlier check is pending: it re-arms then
        self._armed[sandbox_id] = when
        heapq.heappush(self._deadlines, (when, sandbox_id))
        if self._deadlines[0][1] == sandbox_id:
            self._wake.set()

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
                self.arm(sandbox)  # its idle timer applies again
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
            self.arm(sandbox)

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
        """End or pause every sandbox whose lifetime ran out (all of them, not only the armed: a check by hand)."""
        for sandbox in list(self.service.sandboxes.values()):
            self.arm(sandbox)
        await self.reap_due()

    async def reap_due(self) -> None:
        """Act on the heap's entries that are due; re-arm the sandboxes whose deadline moved on."""
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:  # (forget may rebuild the list meanwhile)
            when, sandbox_id = heapq.heappop(self._deadlines)
            if self._armed.get(sandbox_id) != when:
                continue  # superseded by an earlier entry, or the sandbox is gone
            del self._armed[sandbox_id]
            sandbox = self.service.sandboxes.get(sandbox_id)
            if sandbox is None:
                continue
            reason = self.due(sandbox, now)
            if reason is None:
                self.arm(sandbox)  # it moved later (a request, keepalive): wait for that
                continue
            await self._end(sandbox, reason)

    async def _end(self, sandbox: Sandbox, reason: str) -> None:
        try:
            if sandbox.spec.on_timeout == "pause":
                sandbox.expires_at = None  # re-armed on resume
                if sandbox.state is not State.PAUSED:
                    await self.pause(sandbox)
                log.info("paused %s: %s", sandbox.id, reason)
            else:
                await self.service.kill(sandbox.id, reason=reason)
        except Exception as exc:  # keep reaping the others; try this one again a little later
            log.warning("reaper: could not end %s (%s): %s", sandbox.id, reason, exc)
            if sandbox.id in self.service.sandboxes:
                self._push(sandbox.id, time.time() + RETRY_S)

    async def reap_forever(self) -> None:
        """Sleep until the earliest deadline (or a new earlier one, or the next prune of old logs), act on it."""
        retention = self.service.settings.log_retention_s
        prune_every = max(0.25, min(60.0, retention / 2))
        pruned_at = 0.0
        while True:
            now = time.time()
            wake_at = min(pruned_at + prune_every, now + MAX_SLEEP_S)
            if self._deadlines:
                wake_at = min(wake_at, self._deadlines[0][0])
            self._wake.clear()
            if wake_at > now:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wake_at - now):
                        await self._wake.wait()
            await self.reap_due()
            if time.time() - pruned_at >= prune_every:
                pruned_at = time.time()
                try:
                    await self.service.trajectory.prune(pruned_at - retention)
                except Exception as exc:  # a full disk: try again later
                    log.warning("could not prune old trajectory logs: %s", exc)
