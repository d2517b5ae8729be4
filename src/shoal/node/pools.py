"""Warm pools: ready sandboxes per spec shape, claimed by `create` and refilled in the background.

Sandboxes that differ only in late-bound fields (env, labels, workdir, files, TTL) share a pool; those
fields are bound when a sandbox is claimed, so a claim costs a dictionary pop plus at most one agent call.

A burst of claims is served before the pool refills: a refill is a whole create per member, which competes
with the claims for the node's event loop and the machine's CPU (issue 12: claims p99 10 ms behind their
own refills). So a claim that leaves the pool at least half full starts the refill only once claims have
paused for REFILL_PAUSE_S (at the latest REFILL_MAX_DELAY_S after the first), and one that leaves it less
than half full starts it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from shoal.node.sandbox import Sandbox
from shoal.protocol import SandboxSpec

log = logging.getLogger("shoal.pools")

Maker = Callable[[SandboxSpec], Awaitable[Sandbox]]
Destroyer = Callable[[Sandbox], Awaitable[None]]
REFILL_PAUSE_S = 0.05
REFILL_MAX_DELAY_S = 1.0


class WarmPools:
    def __init__(self, make: Maker, destroy: Destroyer, refill_concurrency: int = 2) -> None:
        self._make = make
        self._destroy = destroy
        self._targets: dict[str, tuple[SandboxSpec, int]] = {}
        self._ready: dict[str, deque[Sandbox]] = {}
        self._inflight: dict[str, int] = {}
        self._refilling: dict[str, asyncio.Task] = {}
        self._slots = asyncio.Semaphore(refill_concurrency)
        self._deferred: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # key -> (first claim, timer)
        self._last_claim: dict[str, float] = {}
        self.hits = 0
        self.misses = 0

    def take(self, spec: SandboxSpec) -> Sandbox | None:
        key = spec.pool_key()
        ready = self._ready.get(key)
        if not ready:
            if key in self._targets:
                self.misses += 1
            return None
        sandbox = ready.popleft()
        self.hits += 1
        target = self._targets.get(key)
        if target is None or 2 * len(ready) < target[1]:
            self._kick(key)
        else:
            self._kick_after_claims(key)
        return sandbox

    def _kick_after_claims(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        now = self._last_claim[key] = loop.time()
        if key not in self._deferred:
            self._deferred[key] = (now, loop.call_later(REFILL_PAUSE_S, self._deferred_kick, key))

    def _deferred_kick(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        first, _ = self._deferred[key]
        due = min(self._last_claim.get(key, first) + REFILL_PAUSE_S, first + REFILL_MAX_DELAY_S)
        if loop.time() < due:  # claims go on: wait for them to pause
            self._deferred[key] = (first, loop.call_at(due, self._deferred_kick, key))
            return
        del self._deferred[key]
        self._kick(key)

    async def configure(self, spec: SandboxSpec, size: int) -> None:
        """Keep `size` ready sandboxes of `spec`'s shape (0 removes the pool and its sandboxes)."""
        key = spec.pool_key()
        if size <= 0:
            self._targets.pop(key, None)
            extra = list(self._ready.pop(key, ()))
            await asyncio.gather(*(self._destroy(s) for s in extra), return_exceptions=True)
            return
        self._targets[key] = (spec, size)
        ready = self._ready.setdefault(key, deque())
        while len(ready) > size:
            await self._destroy(ready.pop())
        self._kick(key)

    async def wait_full(self, spec: SandboxSpec, timeout: float = 120.0) -> None:
        key = spec.pool_key()
        async with asyncio.timeout(timeout):
            while key in self._targets and len(self._ready.get(key, ())) < self._targets[key][1]:
                await asyncio.sleep(0.02)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            key: {"target": size, "ready": len(self._ready.get(key, ())), "inflight": self._inflight.get(key, 0)}
            for key, (_, size) in self._targets.items()
        }

    def _kick(self, key: str) -> None:
        task = self._refilling.get(key)
        if task is None or task.done():
            self._refilling[key] = asyncio.create_task(self._refill(key))

    async def _refill(self, key: str) -> None:
        failures = 0
        while key in self._targets:
            spec, size = self._targets[key]
            ready = self._ready.setdefault(key, deque())
            missing = size - len(ready) - self._inflight.get(key, 0)
            if missing <= 0:
                return
            self._inflight[key] = self._inflight.get(key, 0) + 1
            try:
                async with self._slots:
                    sandbox = await self._make(spec)
            except Exception as exc:
                failures += 1
                log.warning("pool %s: refill failed (%s); retrying", key, exc)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
                continue
            finally:
                self._inflight[key] -= 1
            if key in self._targets:  # the deque of now: a resize to 0 and back meanwhile replaced `ready`
                self._ready.setdefault(key, deque()).append(sandbox)
            else:
                await self._destroy(sandbox)

    async def drain(self) -> None:
        """Stop refilling and destroy every ready sandbox (node shutdown)."""
        self._targets.clear()
        for _, timer in self._deferred.values():
            timer.cancel()
        self._deferred.clear()
        for task in self._refilling.values():
            task.cancel()
        await asyncio.gather(*self._refilling.values(), return_exceptions=True)
        every = [s for ready in self._ready.values() for s in ready]
        self._ready.clear()
        await asyncio.gather(*(self._destroy(s) for s in every), return_exceptions=True)
