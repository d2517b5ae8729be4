"""Function workers as the node sees them: a container sandbox running `worker.py`, and per-image pools.

A `WorkerPool` keeps warm workers of one shape (image, runtime, pre-imported modules). A call leases one
worker for its duration; when none is idle the pool starts another, within the node-wide budget, so pool
sizes follow demand; idle workers above the warm minimum are retired after `IDLE_S`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shoal import settings
from shoal.errors import ImageError, SandboxLostError
from shoal.substrates.function import limits as call_limits
from shoal.substrates.function.limits import CallLimits

log = logging.getLogger("shoal.functions")

WORKER_DIR = "/run/shoal-fn"
SOCKET = f"{WORKER_DIR}/worker.sock"
CALL_UID = CALL_GID = 65534  # "nobody": calls hold no capabilities and own nothing outside their scratch dirs
IDLE_S = settings.FN_IDLE_S.get()
GROW_AFTER_S = 0.05
INPUT_BYTES_PER_S = 20 << 20  # the worker writes a call's inputs before its first step starts: allow for it
RECYCLE_AFTER = 10_000  # calls; a fresh worker now and then bounds whatever slowly accumulates
_LEN = struct.Struct(">I")
_SOURCE = Path(__file__).with_name("worker.py")
# msgspec rather than json: the request and the reply of every call cross here (the worker, under the
# image's python without shoal, speaks plain JSON with json.dumps and json.loads)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class WorkerKey:
    image: str
    runtime: str
    modules: tuple[str, ...]


@dataclass(eq=False)
class Worker:
    key: WorkerKey
    sandbox: Any  # the node's container sandbox hosting the worker (shoal.node.sandbox.Sandbox)
    dirs: list[Path]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    process: Any  # the agent's ExecProcess running worker.py
    python: str
    limits: CallLimits | None = None
    calls: int = 0
    ooms: int = 0  # the call cgroup's OOM kill count when last read
    idle_since: float = field(default_factory=time.monotonic)
    broken: bool = False
    aborting: asyncio.Future | None = None
    watcher: asyncio.Future | None = None  # drains the worker process's own output; marks it broken on exit
    occupied: call_limits.Occupancy = field(init=False)
    # which call cgroup directories a call's child joins, with and without a cpu limit: every cgroup a
    # child joins costs it a migration, so the cpu hierarchy only when a cpu limit applies
    join_all: list[int] = field(init=False)
    join_no_cpu: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.occupied = call_limits.Occupancy(self.dirs)
        self.join_all = list(range(len(self.dirs)))
        self.join_no_cpu = [i for i, d in enumerate(self.dirs) if not call_limits.is_cpu(d)]

    def close(self) -> None:
        """Release what the node holds open for this worker (its call cgroup's pids.current)."""
        self.occupied.close()

    async def run(
        self, request: dict[str, Any], limits: CallLimits, budget_s: float, kill_after: float | None = None
    ) -> dict[str, Any]:
        """Send one request and wait for its reply; a cancelled caller aborts the call in the worker.

        The worker enforces the steps' timeouts; `kill_after` (their sum plus a grace, plus time to write
        the inputs) is the node's backstop for a worker starved of CPU by its own call (a fork bomb): the
        node then empties the call cgroup itself and the step that was killed reports a timeout.
        """
        if limits != self.limits:
            await asyncio.to_thread(call_limits.apply, self.dirs, limits)
            self.limits = limits
        request["join"] = self.join_all if limits.cpu else self.join_no_cpu
        request["pids"] = limits.pids
        body = _encode(request)
        self.calls += 1
        killed = False
        if kill_after is not None:
            kill_after += len(body) / INPUT_BYTES_PER_S
        try:
            self.writer.write(_LEN.pack(len(body)) + body)
            reading = asyncio.ensure_future(self._read())
            try:  # asyncio.wait, not wait_for(shield(...)): one future and one timer per call fewer
                if kill_after is not None and kill_after < budget_s:
                    done, _ = await asyncio.wait({reading}, timeout=kill_after)
                    if not done:
                        killed = True
                        await self._empty_call_cgroup()
                        budget_s -= kill_after
                if not reading.done():
                    await asyncio.wait({reading}, timeout=budget_s)
                if not reading.done():
                    raise TimeoutError(f"no answer within {budget_s:.0f} s")
                reply = reading.result()
            finally:
                if not reading.done():
                    reading.cancel()
                    await asyncio.gather(reading, return_exceptions=True)
        except asyncio.CancelledError:
            self.aborting = asyncio.ensure_future(self._abort())
            raise
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.broken = True
            raise SandboxLostError(f"function worker {self.sandbox.id} stopped answering: {exc}") from exc
        if self.occupied():  # the call left processes the worker could not kill
            await self._empty_call_cgroup()
        reply["oom_killed"], reply["oom_kills"] = False, 0
        if any(step.get("signal") == 9 for step in reply.get("steps", ())):  # only a SIGKILL can be an OOM kill
            ooms = await asyncio.to_thread(call_limits.oom_kills, self.dirs)
            reply["oom_killed"], reply["oom_kills"] = ooms > self.ooms, max(0, ooms - self.ooms)
            self.ooms = ooms
            if killed:  # the node's kill at the deadline: the step ran out of time
                for step in reversed(reply["steps"]):
                    if step.get("signal") == 9:
                        step["timed_out"] = True
                        break
        return reply

    async def _empty_call_cgroup(self) -> None:
        """Kill everything in the call cgroup (forks frozen); its limits are written again before the next call."""
        self.limits = None
        if not await asyncio.to_thread(call_limits.kill_all, self.dirs):
            self.broken = True
            log.warning("function worker %s: its call cgroup would not empty; replacing the worker", self.sandbox.id)

    async def _read(self) -> dict[str, Any]:
        (length,) = _LEN.unpack(await self.reader.readexactly(4))
        return _decode(await self.reader.readexactly(length))

    async def _abort(self) -> None:
        """The caller went away mid-call: stop the call, read its (discarded) reply, keep the worker usable."""
        try:
            body = b'{"abort":true}'
            self.writer.write(_LEN.pack(len(body)) + body)
            await asyncio.wait_for(self._read(), 10)
        except Exception:  # noqa: BLE001 - the pool retires a broken worker
            self.broken = True


Starter = Callable[[WorkerKey], Awaitable[Worker]]
Stopper = Callable[[Worker], Awaitable[None]]


class WorkerPool:
    """Warm workers of one key; `lease()` hands out an idle one or waits for one (starting more if allowed)."""

    def __init__(self, key: WorkerKey, start: Starter, stop: Stopper, may_grow: Callable[[], bool]) -> None:
        self.key = key
        self._start = start
        self._stop = stop
        self._may_grow = may_grow
        self.idle: deque[Worker] = deque()
        self.busy: set[Worker] = set()
        self.starting = 0
        self.warm = 0
        self.waiters: deque[asyncio.Future[Worker]] = deque()
        self.tasks: set[asyncio.Task] = set()
        self.last_error: BaseException | None = None

    @property
    def size(self) -> int:
        return len(self.idle) + len(self.busy) + self.starting

    async def lease(self) -> Worker:
        while self.idle:
            worker = self.idle.pop()  # the most recently used: its pages are warm
            if worker.broken:  # died while idle (its process exited): replace it
                self._spawn(self._stop(worker))
                continue
            self.busy.add(worker)
            return worker
        future: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        if self.size == 0:
            self.grow()
        else:  # a busy worker usually frees up within milliseconds; start another only if the wait persists
            asyncio.get_running_loop().call_later(GROW_AFTER_S, self.grow)
        try:
            worker = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())
            else:
                try:
                    self.waiters.remove(future)
                except ValueError:
                    pass
            raise
        return worker

    def grow(self) -> None:
        """Start workers while calls wait for more than are starting (or the pool is below its warm size)."""
        while self.starting < len(self.waiters) or self.size < self.warm:
            # within the budget (evicting another pool's idle worker if need be); a pool without any
            # worker gets one regardless, so a call never waits on workers that can never serve it
            if not self._may_grow() and self.size > 0:
                break
            self.starting += 1
            self._spawn(self._start_one())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start_one(self) -> None:
        try:
            worker = await self._start(self.key)
        except Exception as exc:
            self.starting -= 1
            self.last_error = exc
            log.warning("function pool %s: a worker failed to start: %s", self.key, exc)
            while self.waiters:  # they would wait forever: tell them why
                future = self.waiters.popleft()
                if not future.done():
                    future.set_exception(exc)
            return
        self.starting -= 1
        self.last_error = None
        self.busy.add(worker)
        self.release(worker)

    def release(self, worker: Worker) -> None:
        """Return a leased worker: to a waiting call, to the idle set, or (if broken or old) to be replaced."""
        self.busy.discard(worker)
        if worker.aborting is not None:  # an abort is in flight: release once it has settled
            self.busy.add(worker)
            self._spawn(self._release_after_abort(worker))
            return
        if worker.broken or worker.calls >= RECYCLE_AFTER:
            self._spawn(self._stop(worker))
            self.grow()
            return
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                self.busy.add(worker)
                future.set_result(worker)
                return
        worker.idle_since = time.monotonic()
        self.idle.append(worker)

    async def _release_after_abort(self, worker: Worker) -> None:
        assert worker.aborting is not None
        await worker.aborting
        worker.aborting = None
        self.busy.discard(worker)
        self.release(worker)

    def retire_idle(self, now: float, idle_s: float) -> list[Worker]:
        """Idle workers past `idle_s` beyond the warm minimum, removed from the pool (the caller stops them)."""
        doomed = []
        while len(self.idle) > self.warm and self.idle and now - self.idle[0].idle_since > idle_s:
            doomed.append(self.idle.popleft())
        return doomed

    def evict_one(self) -> Worker | None:
        return self.idle.popleft() if self.idle and self.size > self.warm else None

    def stats(self) -> dict[str, int]:
        return {
            "idle": len(self.idle),
            "busy": len(self.busy),
            "starting": self.starting,
            "waiting": len(self.waiters),
            "warm": self.warm,
        }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def hand_over(sock: socket.socket, procs: list[int], pids: list[int]) -> None:
    """The hello frame: b"h" and the number of cgroup.procs descriptors, carrying those, then pids.max and
    pids.current (if any)."""
    fds = [*procs, *pids]
    rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))
    sock.sendmsg([b"h" + bytes([len(procs)])], [rights])


def worker_source() -> bytes:
    return _SOURCE.read_bytes()


def no_python_error(image: str) -> ImageError:
    return ImageError(
        f"image {image!r} has no python3, which function workers need: use 'debian' or 'debian-dev', "
        "or an image with python3 on its PATH"
    )
