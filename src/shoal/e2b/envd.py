"""The in-sandbox `envd` API the E2B SDK talks to, answered by shoal's agent through the node.

The Connect-RPC services are the ones generated into the pinned `e2b` package (`process.Process`,
`filesystem.Filesystem`), served by `connectrpc`; this module only implements their methods:

- processes: `Start` runs `sb.exec` (bash -l -c, as the SDK sends it) with its output streamed as events. The
  process belongs to this server, not to the request, so a background command outlives its stream and can
  be listed, re-attached (`Connect`) and killed (`SendSignal`: the exec is cancelled, which kills its whole
  process tree in the sandbox). PIDs are this layer's handles, not the sandbox's kernel PIDs. The stream's
  deadline (the SDK's command `timeout`) is the command's timeout, so a timed-out command is killed too.
- filesystem: stat, list, mkdir, move, remove through shoal's file operations; watching polls the tree.

The sandbox is named by the `E2b-Sandbox-Id` header and the caller by `X-Access-Token` (see backend.py).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import posixpath
import stat as stat_module
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf import timestamp_pb

from shoal.client.aio import AsyncSandbox
from shoal.e2b.backend import Backend
from shoal.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    SandboxNotFoundError,
    ShoalError,
)

KEEPALIVE_S = 30.0
WATCH_POLL_S = 0.2
MAX_WATCHERS = 4096
TIMED_OUT = "command timed out"

# stdin=True: shoal's exec takes stdin up front, so the command reads a FIFO in the sandbox instead. A keeper
# process holds a write end of the FIFO (inherited at fork, so it is held before anyone writes) until
# close_stdin kills it; then the command reads EOF. Each send_stdin is one short exec writing to the FIFO.
STDIN_WRAPPER = r"""
f=$1; shift
mkdir -p "${f%/*}" && rm -f "$f" && mkfifo "$f" || exit 127
exec 3<>"$f"
sleep infinity >&3 2>/dev/null 3>&- &
echo $! > "$f.keeper"
exec 3>&-
"$@" < "$f"
status=$?
kill "$(cat "$f.keeper")" 2>/dev/null
rm -f "$f" "$f.keeper"
exit $status
"""
WAIT_FIFO = (
    'i=0; while [ ! -p "$1" ] || [ ! -s "$1.keeper" ]; do i=$((i+1)); [ $i -gt 1000 ] && exit 3; sleep 0.01; done; '
)
STDIN_WRITE = WAIT_FIFO + 'cat > "$1"'
STDIN_CLOSE = WAIT_FIFO + 'kill "$(cat "$1.keeper")"'
_pids = itertools.count(1000)


def connect_error(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    code = Code.INTERNAL
    if isinstance(exc, AuthenticationError):
        code = Code.UNAUTHENTICATED
    elif isinstance(exc, SandboxNotFoundError):
        # what E2B's proxy answers for a sandbox that is gone; the SDK raises SandboxNotRunningException
        return ConnectError(Code.UNAVAILABLE, f"The sandbox was not found ({type(exc).__name__}: {exc})")
    elif isinstance(exc, NotFoundError):
        code = Code.NOT_FOUND
    elif isinstance(exc, InvalidRequestError):
        code = Code.INVALID_ARGUMENT
    elif isinstance(exc, QuotaExceededError):
        code = Code.RESOURCE_EXHAUSTED
    return ConnectError(code, f"{type(exc).__name__}: {exc}")


def caller(headers: Any) -> tuple[str | None, str]:
    sandbox_id = headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise ConnectError(Code.INVALID_ARGUMENT, "no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this server")
    return headers.get("x-access-token") or None, sandbox_id


def username(headers: Any) -> str | None:
    """The user the SDK asks for (HTTP basic auth `user:`); E2B's default "user" is the sandbox's own user."""
    auth = headers.get("authorization", "")
    if not auth.startswith("Basic "):
        return None
    try:
        name = base64.b64decode(auth[6:]).decode().split(":", 1)[0]
    except ValueError:
        return None
    return None if name in ("", "user") else name


def _stdin_bytes(value: process_pb.ProcessInput | None) -> bytes:
    match value.input if value is not None else None:
        case Oneof(field="stdin", value=data):
            return data
        case Oneof(field="pty", value=_):
            raise ConnectError(Code.UNIMPLEMENTED, "PTY sessions are not supported by shoal's E2B layer")
    return b""


def _event(kind: str, value: Any) -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=Oneof(kind, value))


def _data(stream: str, chunk: bytes) -> process_pb.ProcessEvent:
    return _event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(stream, chunk)))


def _end(exit_code: int, status: str, *, exited: bool = True, error: str | None = None) -> process_pb.ProcessEvent:
    end = process_pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=exited, status=status, error=error)
    return _event("end", end)


@dataclass
class Proc:
    pid: int
    sandbox_id: str
    config: process_pb.ProcessConfig
    tag: str | None
    subscribers: set[asyncio.Queue] = field(default_factory=set)
    task: asyncio.Task | None = None
    ended: process_pb.ProcessEvent | None = None
    fifo: str | None = None  # the stdin FIFO in the sandbox when started with stdin=True
    sandbox: AsyncSandbox | None = None

    def publish(self, event: process_pb.ProcessEvent) -> None:
        for queue in self.subscribers:
            queue.put_nowait(event)

    def finish(self, event: process_pb.ProcessEvent) -> None:
        if self.ended is None:
            self.ended = event
            self.publish(event)


class Processes:
    """Commands started through envd, by sandbox and PID; each runs as a task of this server."""

    def __init__(self) -> None:
        self.procs: dict[int, Proc] = {}

    def of(self, sandbox_id: str) -> list[Proc]:
        return [p for p in self.procs.values() if p.sandbox_id == sandbox_id and p.ended is None]

    def find(self, sandbox_id: str, selector: process_pb.ProcessSelector | None) -> Proc:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                proc = self.procs.get(pid)
                if proc is not None and proc.sandbox_id == sandbox_id and proc.ended is None:
                    return proc
                raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
            case Oneof(field="tag", value=tag):
                for proc in self.of(sandbox_id):
                    if proc.tag == tag:
                        return proc
                raise ConnectError(Code.NOT_FOUND, f"process with tag {tag!r} not found")
        raise ConnectError(Code.INVALID_ARGUMENT, "no process selector")

    def start(
        self,
        sandbox: AsyncSandbox,
        config: process_pb.ProcessConfig,
        tag: str | None,
        user: str | None,
        timeout: Any,
        stdin: bool = False,
    ) -> tuple[Proc, asyncio.Queue]:
        proc = Proc(next(_pids), sandbox.id, config, tag, sandbox=sandbox)
        queue: asyncio.Queue = asyncio.Queue()
        proc.subscribers.add(queue)
        self.procs[proc.pid] = proc
        argv = [config.cmd, *config.args]
        if stdin:
            proc.fifo = f"/tmp/.shoal-e2b/stdin-{os.urandom(8).hex()}"
            argv = ["/bin/bash", "-c", STDIN_WRAPPER, "shoal-e2b-stdin", proc.fifo, *argv]

        async def run() -> None:
            try:
                result = await sandbox.exec(
                    argv,
                    timeout=timeout,
                    env=dict(config.envs) or None,
                    cwd=config.cwd if config.has_field("cwd") and config.cwd else None,
                    user=user,
                    on_stdout=lambda chunk: proc.publish(_data("stdout", chunk)),
                    on_stderr=lambda chunk: proc.publish(_data("stderr", chunk)),
                )
                if result.timed_out:
                    proc.finish(_end(-1, "signal: killed", exited=False, error=TIMED_OUT))
                elif result.signal:
                    proc.finish(_end(-1, f"signal: {result.signal}", exited=False))
                else:
                    proc.finish(_end(result.exit_code, f"exit status {result.exit_code}"))
            except asyncio.CancelledError:
                proc.finish(_end(-1, "signal: killed", exited=False))
            except Exception as exc:  # the stream must end with an end event whatever happened
                proc.finish(_end(-1, "error", exited=False, error=f"{type(exc).__name__}: {exc}"))
            finally:
                self.procs.pop(proc.pid, None)

        proc.task = asyncio.ensure_future(run())
        return proc, queue

    async def write_stdin(self, proc: Proc, data: bytes, *, close: bool = False) -> None:
        if proc.fifo is None or proc.sandbox is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {proc.pid} was not started with stdin=True")
        script = STDIN_CLOSE if close else STDIN_WRITE
        try:
            # stdin=b"" is not sent: an empty stdin to a command that exits at once can be reported by the node
            # as "the command's handler was killed" (seen ~1 in 3 times)
            argv = ["/bin/sh", "-c", script, "sh", proc.fifo]
            result = await proc.sandbox.exec(argv, stdin=data or None, timeout=60)
        except ShoalError as exc:
            raise connect_error(exc) from None
        if result.exit_code != 0:
            detail = result.stderr.strip()[-300:] or f"exit {result.exit_code}"
            raise ConnectError(Code.FAILED_PRECONDITION, f"stdin of process {proc.pid} is closed ({detail})")

    async def kill(self, proc: Proc) -> None:
        if proc.task is not None and not proc.task.done():
            proc.task.cancel()
            await asyncio.wait([proc.task])

    async def kill_sandbox(self, sandbox_id: str) -> None:
        for proc in self.of(sandbox_id):
            await self.kill(proc)

    async def close(self) -> None:
        for proc in list(self.procs.values()):
            await self.kill(proc)


async def _stream(proc: Proc, queue: asyncio.Queue, wrap: Any) -> AsyncIterator[Any]:
    """Yield `proc`'s events (wrapped in the RPC's response message) until its end event."""
    try:
        while True:
            if queue.empty():
                try:
                    async with asyncio.timeout(KEEPALIVE_S):
                        event = await queue.get()
                except TimeoutError:
                    event = _event("keepalive", process_pb.ProcessEvent.KeepAlive())
            else:
                event = queue.get_nowait()
            if event.event is not None and event.event.field == "end":
                if event.event.value.error == TIMED_OUT:  # the stream's deadline (the command timeout) passed
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the command ran out of time and was killed")
                yield wrap(event=event)
                return
            yield wrap(event=event)
    finally:
        proc.subscribers.discard(queue)


class ProcessService:
    """`process.Process` (see the module docstring)."""

    def __init__(self, backend: Backend, processes: Processes) -> None:
        self.backend = backend
        self.processes = processes

    async def _sandbox(self, ctx: Any) -> AsyncSandbox:
        token, sandbox_id = caller(ctx.request_headers)
        try:
            return await self.backend.sandbox(token, sandbox_id)
        except Exception as exc:
            raise connect_error(exc) from None

    async def list(self, request: process_pb.ListRequest, ctx: Any) -> process_pb.ListResponse:
        sandbox = await self._sandbox(ctx)
        infos = [process_pb.ProcessInfo(config=p.config, pid=p.pid, tag=p.tag) for p in self.processes.of(sandbox.id)]
        return process_pb.ListResponse(processes=infos)

    async def start(self, request: process_pb.StartRequest, ctx: Any) -> AsyncIterator[process_pb.StartResponse]:
        sandbox = await self._sandbox(ctx)
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "PTY sessions are not supported by shoal's E2B layer (docs/E2B.md)")
        config = request.process or process_pb.ProcessConfig()
        timeout_ms = ctx.timeout_ms
        timeout = timeout_ms / 1000 if timeout_ms else None
        tag = request.tag if request.has_field("tag") else None
        user = username(ctx.request_headers)
        proc, queue = self.processes.start(sandbox, config, tag, user, timeout, stdin=bool(request.stdin))
        yield process_pb.StartResponse(event=_event("start", process_pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for item in _stream(proc, queue, process_pb.StartResponse):
            yield item

    async def connect(self, request: process_pb.ConnectRequest, ctx: Any) -> AsyncIterator[process_pb.ConnectResponse]:
        sandbox = await self._sandbox(ctx)
        proc = self.processes.find(sandbox.id, request.process)
        queue: asyncio.Queue = asyncio.Queue()
        proc.subscribers.add(queue)
        yield process_pb.ConnectResponse(event=_event("start", process_pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for item in _stream(proc, queue, process_pb.ConnectResponse):
            yield item

    async def update(self, request: process_pb.UpdateRequest, ctx: Any) -> process_pb.UpdateResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "PTY resize is not supported by shoal's E2B layer")

    async def stream_input(self, request: Any, ctx: Any) -> process_pb.StreamInputResponse:
        """Client-streamed input: a start event naming the process, then data events, in order."""
        sandbox = await self._sandbox(ctx)
        proc: Proc | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    proc = self.processes.find(sandbox.id, start.process)
                case Oneof(field="data", value=data):
                    if proc is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event")
                    await self.processes.write_stdin(proc, _stdin_bytes(data.input))
        return process_pb.StreamInputResponse()

    async def send_input(self, request: process_pb.SendInputRequest, ctx: Any) -> process_pb.SendInputResponse:
        sandbox = await self._sandbox(ctx)
        proc = self.processes.find(sandbox.id, request.process)
        await self.processes.write_stdin(proc, _stdin_bytes(request.input))
        return process_pb.SendInputResponse()

    async def close_stdin(self, request: process_pb.CloseStdinRequest, ctx: Any) -> process_pb.CloseStdinResponse:
        sandbox = await self._sandbox(ctx)
        proc = self.processes.find(sandbox.id, request.process)
        await self.processes.write_stdin(proc, b"", close=True)
        return process_pb.CloseStdinResponse()

    async def send_signal(self, request: process_pb.SendSignalRequest, ctx: Any) -> process_pb.SendSignalResponse:
        sandbox = await self._sandbox(ctx)
        proc = self.processes.find(sandbox.id, request.process)
        await self.processes.kill(proc)  # SIGTERM and SIGKILL both end the whole process tree
        return process_pb.SendSignalResponse()


_TYPES = {"file": filesystem_pb.FileType.FILE, "dir": filesystem_pb.FileType.DIRECTORY}


def entry_info(path: str, entry: Any) -> filesystem_pb.EntryInfo:
    kind = _TYPES.get(entry.kind, filesystem_pb.FileType.FILE)
    mtime = timestamp_pb.Timestamp(seconds=int(entry.mtime), nanos=int((entry.mtime % 1) * 1e9))
    mode = entry.mode
    return filesystem_pb.EntryInfo(
        name=posixpath.basename(path.rstrip("/")) or "/",
        type=kind,
        path=path,
        size=entry.size,
        mode=stat_module.S_IMODE(mode) | (stat_module.S_IFDIR if entry.kind == "dir" else 0),
        permissions=stat_module.filemode(mode if stat_module.S_IFMT(mode) else mode | stat_module.S_IFREG)[1:],
        owner="root",
        group="root",
        modified_time=mtime,
        symlink_target=entry.target or None,
        is_symlink=entry.kind == "symlink",
    )


def _absolute(sandbox: AsyncSandbox, path: str) -> str:
    """E2B reports absolute paths; a relative one is relative to the sandbox's working directory."""
    return posixpath.normpath(posixpath.join(sandbox.info.workdir or "/", path))


class FilesystemService:
    """`filesystem.Filesystem` (see the module docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.watchers: dict[str, tuple[str, str, str, bool, dict[str, tuple]]] = {}

    async def _sandbox(self, ctx: Any) -> AsyncSandbox:
        token, sandbox_id = caller(ctx.request_headers)
        try:
            return await self.backend.sandbox(token, sandbox_id)
        except Exception as exc:
            raise connect_error(exc) from None

    async def _stat(self, sandbox: AsyncSandbox, path: str) -> filesystem_pb.EntryInfo:
        try:
            entry = await sandbox.files.stat(path)
        except ShoalError as exc:
            raise connect_error(exc) from None
        if entry is None:
            raise ConnectError(Code.NOT_FOUND, f"no such file or directory: {path}")
        return entry_info(_absolute(sandbox, path), entry)

    async def stat(self, request: filesystem_pb.StatRequest, ctx: Any) -> filesystem_pb.StatResponse:
        return filesystem_pb.StatResponse(entry=await self._stat(await self._sandbox(ctx), request.path))

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: Any) -> filesystem_pb.MakeDirResponse:
        sandbox = await self._sandbox(ctx)
        try:
            if await sandbox.files.stat(request.path) is not None:
                raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
            await sandbox.files.mkdir(request.path)
        except ShoalError as exc:
            raise connect_error(exc) from None
        return filesystem_pb.MakeDirResponse(entry=await self._stat(sandbox, request.path))

    async def move(self, request: filesystem_pb.MoveRequest, ctx: Any) -> filesystem_pb.MoveResponse:
        sandbox = await self._sandbox(ctx)
        await self._stat(sandbox, request.source)
        try:
            result = await sandbox.exec(["mv", "-f", "--", request.source, request.destination], timeout=60)
        except ShoalError as exc:
            raise connect_error(exc) from None
        if result.exit_code != 0:
            raise ConnectError(Code.INVALID_ARGUMENT, f"move failed: {result.stderr.strip()}")
        return filesystem_pb.MoveResponse(entry=await self._stat(sandbox, request.destination))

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: Any) -> filesystem_pb.ListDirResponse:
        sandbox = await self._sandbox(ctx)
        root = request.path
        info = await self._stat(sandbox, root)
        if info.type != filesystem_pb.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{root} is not a directory")
        depth = request.depth or 1
        try:
            entries = await sandbox.files.list(root, recursive=depth > 1)
        except ShoalError as exc:
            raise connect_error(exc) from None
        base = _absolute(sandbox, root)
        out = [
            entry_info(posixpath.join(base, e.name), e) for e in entries if e.name.count("/") < depth and e.name != "."
        ]
        return filesystem_pb.ListDirResponse(entries=out)

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: Any) -> filesystem_pb.RemoveResponse:
        sandbox = await self._sandbox(ctx)
        await self._stat(sandbox, request.path)
        try:
            await sandbox.files.remove(request.path, recursive=True)
        except ShoalError as exc:
            raise connect_error(exc) from None
        return filesystem_pb.RemoveResponse()

    async def _snapshot(self, sandbox: AsyncSandbox, path: str, recursive: bool) -> dict[str, tuple]:
        try:
            entries = await sandbox.files.list(path, recursive=recursive)
        except ShoalError as exc:
            raise connect_error(exc) from None
        return {e.name: (e.kind, e.size, e.mtime, e.mode) for e in entries if e.name != "."}

    @staticmethod
    def _diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[filesystem_pb.FilesystemEvent]:
        events = []
        for name in sorted(after.keys() - before.keys()):
            events.append(filesystem_pb.FilesystemEvent(name=name, type=filesystem_pb.EventType.CREATE))
        for name in sorted(after.keys() & before.keys()):
            old, new = before[name], after[name]
            if old[:3] != new[:3] and new[0] != "dir":
                events.append(filesystem_pb.FilesystemEvent(name=name, type=filesystem_pb.EventType.WRITE))
            elif old[3] != new[3]:
                events.append(filesystem_pb.FilesystemEvent(name=name, type=filesystem_pb.EventType.CHMOD))
        for name in sorted(before.keys() - after.keys()):
            events.append(filesystem_pb.FilesystemEvent(name=name, type=filesystem_pb.EventType.REMOVE))
        return events

    async def watch_dir(
        self, request: filesystem_pb.WatchDirRequest, ctx: Any
    ) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        sandbox = await self._sandbox(ctx)
        before = await self._snapshot(sandbox, request.path, request.recursive)
        yield filesystem_pb.WatchDirResponse(event=Oneof("start", filesystem_pb.WatchDirResponse.StartEvent()))
        quiet = 0.0
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            after = await self._snapshot(sandbox, request.path, request.recursive)
            events = self._diff(before, after)
            before = after
            for event in events:
                yield filesystem_pb.WatchDirResponse(event=Oneof("filesystem", event))
            quiet = 0.0 if events else quiet + WATCH_POLL_S
            if quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield filesystem_pb.WatchDirResponse(
                    event=Oneof("keepalive", filesystem_pb.WatchDirResponse.KeepAlive())
                )

    async def create_watcher(
        self, request: filesystem_pb.CreateWatcherRequest, ctx: Any
    ) -> filesystem_pb.CreateWatcherResponse:
        token, sandbox_id = caller(ctx.request_headers)
        sandbox = await self._sandbox(ctx)
        await self._stat(sandbox, request.path)
        watcher_id = base64.urlsafe_b64encode(os.urandom(12)).decode()
        snapshot = await self._snapshot(sandbox, request.path, request.recursive)
        self.watchers[watcher_id] = (token or "", sandbox_id, request.path, request.recursive, snapshot)
        while len(self.watchers) > MAX_WATCHERS:  # a client that never removes its watchers cannot grow this
            del self.watchers[next(iter(self.watchers))]
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: filesystem_pb.GetWatcherEventsRequest, ctx: Any
    ) -> filesystem_pb.GetWatcherEventsResponse:
        token, sandbox_id, path, recursive, before = self._watcher(request.watcher_id, ctx)
        after = await self._snapshot(await self._sandbox(ctx), path, recursive)
        self.watchers[request.watcher_id] = (token, sandbox_id, path, recursive, after)
        return filesystem_pb.GetWatcherEventsResponse(events=self._diff(before, after))

    async def remove_watcher(
        self, request: filesystem_pb.RemoveWatcherRequest, ctx: Any
    ) -> filesystem_pb.RemoveWatcherResponse:
        self._watcher(request.watcher_id, ctx)
        del self.watchers[request.watcher_id]
        return filesystem_pb.RemoveWatcherResponse()

    def _watcher(self, watcher_id: str, ctx: Any) -> tuple:
        token, sandbox_id = caller(ctx.request_headers)
        watcher = self.watchers.get(watcher_id)
        if watcher is None or watcher[:2] != (token or "", sandbox_id):
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        return watcher
