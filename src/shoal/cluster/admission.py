"""Admission control: a bounded, fair queue with deadlines in front of placement.

A create takes a slot before it is placed; there are as many slots as the cluster view has room for
(`capacity()`, minus the creates already holding one). When there is no room the create waits in its
project's FIFO; projects are served round-robin, so one project's burst of 32,000 does not starve another's
handful. A wait ends at its deadline with a CapacityError that says why; the queue is bounded so a client
that floods it is told to slow down instead of the gateway running out of memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from shoal.errors import CapacityError


class AdmissionQueue:
    def __init__(self, capacity: Callable[[], int], *, max_waiting: int = 200_000, timeout: float = 600.0) -> None:
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.inflight = 0
        self.admitted = 0
        self.timeouts = 0
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._ring: collections.deque[str] = collections.deque()

    def depth(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def depth_by_project(self) -> dict[str, int]:
        return {p: len(q) for p, q in self._waiting.items()}

    def _room(self) -> bool:
        return self.capacity() - self.inflight > 0

    async def acquire(self, project: str, deadline: float, *, front: bool = False) -> None:
        """Wait for a slot (until `deadline`, loop time); `front` puts a retry ahead of its project's queue."""
        if not self._waiting and self._room():
            self.inflight += 1
            self.admitted += 1
            return
        depth = self.depth()
        if depth >= self.max_waiting and not front:
            raise CapacityError(
                f"the admission queue is full ({depth} creates waiting): slow down, or add nodes or gateways"
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        queue = self._waiting.setdefault(project, collections.deque())
        if project not in self._ring:
            self._ring.append(project)
        (queue.appendleft if front else queue.append)(future)
        self.pump()
        try:
            await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                self.release()  # granted just as the wait ended: hand the slot on
            else:
                future.cancel()
                self._drop(project, future)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.timeouts += 1
            raise CapacityError(
                f"no node had room for this sandbox before the admission deadline ({self.timeout:g} s; "
                f"{self.depth()} more creates wait): close sandboxes, add nodes, or raise SHOAL_MAX_SANDBOXES "
                "on the nodes or SHOAL_ADMISSION_TIMEOUT on the gateway"
            ) from None

    def release(self) -> None:
        self.inflight -= 1
        self.pump()

    def pump(self) -> None:
        """Grant slots while there is room, one project at a time in turn."""
        while self._ring and self._room():
            project = self._ring[0]
            queue = self._waiting.get(project)
            while queue and queue[0].done():
                queue.popleft()
            if not queue:
                self._ring.popleft()
                self._waiting.pop(project, None)
                continue
            future = queue.popleft()
            self._ring.rotate(-1)
            if not queue:
                self._waiting.pop(project, None)
                self._ring.remove(project)
            self.inflight += 1
            self.admitted += 1
            future.set_result(None)

    def _drop(self, project: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(project)
        if queue is None:
            return
        try:
            queue.remove(future)
        except ValueError:
            pass
        if not queue:
            self._waiting.pop(project, None)
            if project in self._ring:
                self._ring.remove(project)
