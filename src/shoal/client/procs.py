"""Background processes and terminals: `sb.exec(..., background=True)`, `sb.pty()`, `sb.process(id)`.

A background process lives in the sandbox (the guest agent keeps it), not in this client: it survives the
client's death and dies with the sandbox. A handle holds the process's ID and where its reads have got to
(`stdout_offset`, `stderr_offset`); any client can make a handle for an ID (`sb.process(id)`, IDs from
`sb.processes(background=True)`) and read from any offset the agent still holds (the last
`output_cap_bytes` of each stream; what is older is replaced by a marker naming how much was cut).
Starting one, writing to it and signalling it are steps of the trajectory; reads and resizes are not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from shoal import protocol
from shoal.client.results import ExecResult
from shoal.errors import ProcessNotFoundError
from shoal.protocol import OutputChunk

# a terminal's default program: a login shell, bash where the image has it
DEFAULT_PTY_CMD = "if command -v bash >/dev/null 2>&1; then exec bash -il; else exec sh -i; fi"


_IDLE = object()


async def _next(queue: asyncio.Queue[Any], idle: float | None) -> Any:
    """The queue's next item; _IDLE if `idle` seconds pass without one."""
    if idle is None or not queue.empty():
        return await queue.get()  # (a queue with an item answers without suspending)
    try:
        async with asyncio.timeout(idle):
            return await queue.get()
    except TimeoutError:
        return _IDLE


class AsyncProcess:
    """A background process (or a terminal's program) in a sandbox; see the module docstring."""

    def __init__(self, sandbox: Any, info: dict[str, Any]) -> None:
        self.sandbox = sandbox  # the AsyncSandbox (aio.py imports this module, so not named here)
        self.id: int = info["id"]  # names it in the sandbox (sb.process(id)); its keeper's pid there
        self.pid: int = info["pid"]
        self.pty: bool = bool(info.get("pty"))
        self.command: str | None = info.get("command")
        self.stdout_offset = 0  # the next read starts here
        self.stderr_offset = 0
        self.running = True
        self.exit_code: int | None = None
        self.exit_signal: int | None = None  # the signal that ended it, if one did
        self._started = time.monotonic()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exit {self.exit_code}"
        return f"<AsyncProcess {self.id} pid {self.pid} {state} in {self.sandbox.id}>"

    def _args(self, **more: Any) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox.id, "id": self.id, **more}

    def _update(self, answer: dict[str, Any]) -> dict[str, Any]:
        self.running = answer["running"]
        self.exit_code, self.exit_signal = answer.get("exit_code"), answer.get("signal")
        if "pid" in answer:
            self.pid = answer["pid"]
        return answer

    def _read_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A proc_read answer: the process's state, and the handle's offsets move to where it stopped."""
        self._update(answer)
        self.stdout_offset, self.stderr_offset = answer["stdout_offset"], answer["stderr_offset"]
        return answer

    def _chunk(self, item: Any) -> OutputChunk:
        """A streamed output event; the handle's offset of its stream moves past it."""
        chunk = protocol.convert(item, OutputChunk)
        if chunk.stream == "stdout":
            self.stdout_offset += len(chunk.data)
        else:
            self.stderr_offset += len(chunk.data)
        return chunk

    async def read(self, *, stdout_offset: int | None = None, stderr_offset: int | None = None) -> tuple[bytes, bytes]:
        """The output since this handle's offsets (or the ones given) up to now, as (stdout, stderr); the
        handle's offsets move past it. Does not wait."""
        answer = await self._read(stdout_offset, stderr_offset, follow=False)
        return answer["stdout"], answer["stderr"]

    async def _read(self, out: int | None, err: int | None, **options: Any) -> dict[str, Any]:
        args = self._args(
            stdout_offset=self.stdout_offset if out is None else out,
            stderr_offset=self.stderr_offset if err is None else err,
            **options,
        )
        return self._read_answer(await self.sandbox.client.call("proc_read", args))

    async def stream(self, *, timeout: float | None = None, idle: float | None = None) -> AsyncIterator[OutputChunk]:
        """Output as it is printed, from this handle's offsets, until the process ends (or `timeout` passes);
        the offsets move on, so a later call (from this handle or another) continues where this one stopped.
        `idle`: yield None whenever that many seconds pass without output (a relay's keepalive)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        args = self._args(stdout_offset=self.stdout_offset, stderr_offset=self.stderr_offset, follow=True, stream=True)
        if timeout is not None:
            args["timeout"] = timeout
        task = asyncio.ensure_future(self.sandbox.client.call("proc_read", args, on_event=queue.put_nowait))
        task.add_done_callback(lambda _t: queue.put_nowait(None))
        try:
            while (item := await _next(queue, idle)) is not None:
                if item is _IDLE:
                    yield None  # type: ignore[misc]
                    continue
                yield self._chunk(item)
            self._read_answer(task.result())
        finally:
            if not task.done():
                task.cancel()

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait until it ends (or `timeout` passes: then `timed_out` is set and it keeps running); the result
        holds the output from this handle's offsets on."""
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            answer = await self._read(None, None, follow=True, timeout=left)
            out += answer["stdout"]
            err += answer["stderr"]
            if not self.running or (deadline is not None and time.monotonic() >= deadline):
                break
        return ExecResult(
            exit_code=self.exit_code if self.exit_code is not None else -1,
            stdout_bytes=bytes(out),
            stderr_bytes=bytes(err),
            duration_s=time.monotonic() - self._started,
            timed_out=self.running,
            signal=self.exit_signal or 0,
            exec_id=self.id,
        )

    async def send_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        """Write to its stdin (a terminal: type it); `eof` then closes stdin (a terminal gets ^D)."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        args = self._args(data=payload, eof=True) if eof else self._args(data=payload)
        self._update(await self.sandbox._step("proc_input", args))

    async def close_stdin(self) -> None:
        await self.send_stdin(b"", eof=True)

    async def signal(self, signal: int = 15) -> None:
        """Send `signal` to its process group and everything it started."""
        self._update(await self.sandbox._step("proc_signal", self._args(signal=int(signal))))

    async def kill(self) -> None:
        """SIGKILL it and everything it started."""
        await self.signal(9)

    async def resize(self, cols: int, rows: int) -> None:
        """Resize its terminal (it gets SIGWINCH); for processes started with a pty."""
        self._update(await self.sandbox.client.call("proc_resize", self._args(cols=cols, rows=rows)))

    async def refresh(self) -> AsyncProcess:
        """Ask where it stands (running, exit code) without reading output."""
        for entry in await self.sandbox.processes(background=True):
            if entry["id"] == self.id:
                self._update(entry)
                return self
        raise ProcessNotFoundError(f"no background process {self.id} in sandbox {self.sandbox.id} (any more)")


async def start(sandbox: Any, args: dict[str, Any]) -> AsyncProcess:
    return AsyncProcess(sandbox, await sandbox._step("proc_start", args))


async def start_streaming(
    sandbox: Any, args: dict[str, Any], *, timeout: float | None = None, idle: float | None = None
) -> AsyncIterator[AsyncProcess | OutputChunk | None]:
    """Start a background process and follow it in one request (`proc_start` with stream): yields its
    AsyncProcess once it started, then its output as it is printed, until it ends or `timeout` passes (the
    handle then still says running); None whenever `idle` seconds pass without output. What `start` then
    `stream` do, without a second request per command (the E2B layer's Start, issue 13)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    call_args = {**args, "stream": True} if timeout is None else {**args, "stream": True, "timeout": timeout}

    async def call() -> Any:
        try:
            return await sandbox._step("proc_start", call_args, on_event=queue.put_nowait)
        finally:  # the end, from the task itself: a done callback would wake the reader one loop pass later
            queue.put_nowait(None)

    task = asyncio.ensure_future(call())
    proc: AsyncProcess | None = None
    try:
        while (item := await _next(queue, idle if proc is not None else None)) is not None:
            if item is _IDLE:
                yield None
                continue
            if proc is None:  # the first event: the start's answer
                proc = AsyncProcess(sandbox, item)
                yield proc
                continue
            yield proc._chunk(item)
        answer = task.result()
        if proc is None:  # fast-forwarded from the trajectory log: its answer is the logged start; follow it now
            proc = AsyncProcess(sandbox, answer)
            yield proc
            async for chunk in proc.stream(timeout=timeout, idle=idle):
                yield chunk
            return
        proc._read_answer(answer)
    finally:
        if not task.done():
            task.cancel()
