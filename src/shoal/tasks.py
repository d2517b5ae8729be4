"""Background tasks with an owner: every task a component starts belongs to it and ends with it.

`asyncio.create_task` alone keeps only a weak reference (a task nobody holds can vanish mid-flight), drops
its exception until garbage collection ("Task exception was never retrieved"), and outlives the component
that started it. A `TaskOwner` holds its tasks, logs a failure with the owner's name when it happens, and
`close()` cancels and awaits all of them, so a stopped gateway or client leaves nothing running. Unlike an
`asyncio.TaskGroup`, one failed background task does not cancel its siblings: a poller of one node failing
must not stop the pollers of the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("shoal.tasks")


class TaskOwner:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task | None:
        """Run `coro` as a task owned here. Once the owner is closed nothing starts: the coroutine is closed
        unstarted and None returned (a callback racing the shutdown must not raise into its caller)."""
        if self._closed:
            coro.close()
            log.debug("%s is closed: not starting %s", self.owner, name or coro.__qualname__)
            return None
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}: {name or coro.__qualname__}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> None:
        """Give the running tasks up to `timeout` seconds to finish on their own."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def close(self) -> None:
        """Cancel every task and wait until each has ended; later `spawn`s are refused."""
        self._closed = True
        while self._tasks:  # a task's cleanup may not spawn more (refused), but loop until all are gone
            pending = set(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
