"""An episode's sandbox, named by a trajectory so a restarted rollout fast-forwards instead of re-running.

`Episode.open(client, name, ...)` returns the live sandbox already running trajectory `name` (the handle
counts steps from 0, so re-issued steps come back from the log) or creates it. If that trajectory already
ended (the rollout finished the episode, then died before recording it), the episode is answered from its
log: every re-issued step returns its logged result and nothing runs; a step past the log's end raises
`SandboxClosedError`. Either way a command never runs twice.

`Runner` is an event loop on a daemon thread, for the blocking adapters (Gymnasium, skyrl-gym) that drive the
async SDK; `shared_client(options)` is one such loop and one connection per process and option set, shared by
every environment that asks (many envs stepped from many threads then cost one loop and one connection).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from shoal.client import AsyncClient, AsyncSandbox, ExecResult
from shoal.errors import DivergenceError, SandboxClosedError, ShoalError
from shoal.steps import step_key

T = TypeVar("T")
DEFAULT_TTL_S = 3600.0  # an adapter never makes a sandbox without a lifetime: a dead trainer's sandboxes end


class Episode:
    """One episode: `exec`, `sandbox` (None once ended), `fast_forwarded` (steps answered from the log)."""

    def __init__(self, name: str | None, sandbox: AsyncSandbox | None, log: list[dict[str, Any]] | None = None):
        self.name = name
        self.sandbox = sandbox
        self._log = log or []
        self._next = 0  # next log entry an ended episode answers
        self._replayed = 0

    @classmethod
    async def open(
        cls, client: AsyncClient, name: str | None, *, kind: str = "container", image: str = "debian", **options: Any
    ) -> Episode:
        options.setdefault("ttl_s", DEFAULT_TTL_S)
        if name is not None:
            options["trajectory"] = name
        try:
            return cls(name, await client.create(kind, image, **options))
        except SandboxClosedError:
            if name is None:
                raise
            return cls(name, None, (await client.log(name))["steps"])

    @property
    def fast_forwarded(self) -> int:
        return self.sandbox.fast_forwarded if self.sandbox is not None else self._replayed

    async def exec(self, cmd: str, *, timeout: float | None = 60.0, **options: Any) -> ExecResult:
        """Run `cmd` (a logged step: re-issued after a restart, it returns the logged result)."""
        if self.sandbox is not None:
            return await self.sandbox.exec(cmd, timeout=timeout, **options)
        return ExecResult.from_wire(self._from_log("exec", {"cmd": cmd, **options}))

    def _from_log(self, op: str, args: dict[str, Any]) -> Any:
        if self._next >= len(self._log):
            raise SandboxClosedError(
                f"trajectory {self.name!r} ended after {len(self._log)} steps: this step was never run; "
                "start a new trajectory name to run more"
            )
        logged = self._log[self._next]
        if logged["op"] != op or logged["key"] != step_key(op, args):
            raise DivergenceError(
                f"trajectory {self.name!r} step {logged['seq']} was {logged['summary']!r}, not this {op}"
            )
        self._next += 1
        self._replayed += 1
        if logged["error_type"] is not None:
            raise ShoalError(f"step {logged['seq']} of {self.name!r} failed: {logged['error_type']}: {logged['error']}")
        return logged["result"]

    async def close(self) -> None:
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await sandbox.close()


class Runner:
    """An event loop on a daemon thread; `run(coro)` blocks until the coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="shoal-rl", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


_shared: dict[str, tuple[Runner, AsyncClient]] = {}
_shared_lock = threading.Lock()


def shared_client(options: dict[str, Any] | None = None) -> tuple[Runner, AsyncClient]:
    """The process's loop thread and connected client for these AsyncClient options (made on first use)."""
    key = json.dumps(options or {}, sort_keys=True, default=str)
    with _shared_lock:
        if key not in _shared:
            runner = Runner()
            try:
                client = runner.run(AsyncClient(**(options or {})).connect())
            except BaseException:
                runner.stop()
                raise
            if not _shared:
                atexit.register(_close_shared)
            _shared[key] = (runner, client)
        return _shared[key]


def _close_shared() -> None:
    with _shared_lock:
        for runner, client in _shared.values():
            try:
                runner.run(client.close())
            finally:
                runner.stop()
        _shared.clear()
