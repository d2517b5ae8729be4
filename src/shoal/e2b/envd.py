"""The in-sandbox `envd` API the E2B SDK talks to, answered by shoal's agent through the node.

The Connect-RPC services are the ones generated into the pinned `e2b` package (`process.Process`,
`filesystem.Filesystem`), served by `connectrpc`; this module only implements their methods:

- processes: `Start` starts a shoal background process (docs/PROCESSES.md; on a PTY when the SDK asks for one,
  `sandbox.pty.create`) and streams its output as events. The process lives in the sandbox, not in this
  server nor in the request, so a command outlives its stream, the SDK client and this server, and is
  listed, re-attached (`Connect`, output from then on), written to (`SendInput`, `StreamInput`,
  `CloseStdin`), resized (`Update`) and signalled (`SendSignal`). An E2B PID is the process's shoal ID (its
  keeper's pid in the sandbox; the kernel pid of the command is shoal's `pid`). The stream's deadline (the
  SDK's command `timeout`) is the command's timeout: a started command is killed at it.
- filesystem: stat, list, mkdir, move, remove through shoal's file operations; watching polls the tree.

The sandbox is named by the `E2b-Sandbox-Id` header and the caller by `X-Access-Token` (see backend.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import posixpath
import signal
import stat as stat_module
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf import timestamp_pb

from shoal.client import procs
from shoal.client.aio import AsyncSandbox
from shoal.client.procs import AsyncProcess
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
MAX_KNOWN = 65536  # processes whose SDK config (command, tag) this server remembers for List
SIGNAL_NAMES = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGINT: "interrupt"}


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


def _event(kind: str, value: Any) -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=Oneof(kind, value))


def _data(stream: str, chunk: bytes) -> process_pb.ProcessEvent:
    return _event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(stream, chunk)))


def _end(exit_code: int, status: str, *, exited: bool = True, error: str | None = None) -> process_pb.ProcessEvent:
    end = process_pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=exited, status=status, error=error)
    return _event("end", end)


def _input(value: process_pb.ProcessInput | None) -> tuple[str, bytes]:
    match value.input if value is not None else None:
        case Oneof(field="stdin", value=data):
            return "stdin", data
        case Oneof(field="pty", value=data):
            return "pty", data
    return "stdin", b""


def _size(pty: process_pb.PTY | None) -> dict[str, int] | None:
    if pty is None or pty.size is None:
        return None
    return {"cols": pty.size.cols, "rows": pty.size.rows}


@dataclass
class Proc:
    """What this server knows of a process beyond shoal's own record: how the SDK started it."""

    config: process_pb.ProcessConfig
    tag: str | None
    stdin: bool
    pty: bool


class Processes:
    """The E2B view of shoal's background processes (docs/PROCESSES.md): an E2B PID is the process's shoal ID,
    so a process outlives its stream, the SDK client and this server, and any of them finds it again."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, int], Proc] = {}

    def remember(self, sandbox_id: str, pid: int, proc: Proc) -> None:
        self.known[(sandbox_id, pid)] = proc
        while len(self.known) > MAX_KNOWN:
            del self.known[next(iter(self.known))]

    async def running(self, sandbox: AsyncSandbox) -> list[dict[str, Any]]:
        try:
            return [p for p in await sandbox.processes(background=True) if p["running"]]
        except ShoalError as exc:
            raise connect_error(exc) from None

    async def find(self, sandbox: AsyncSandbox, selector: process_pb.ProcessSelector | None) -> dict[str, Any]:
        running = await self.running(sandbox)
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                for entry in running:
                    if entry["id"] == pid:
                        return entry
                raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
            case Oneof(field="tag", value=tag):
                for entry in running:
                    known = self.known.get((sandbox.id, entry["id"]))
                    if known is not None and known.tag == tag:
                        return entry
                raise ConnectError(Code.NOT_FOUND, f"process with tag {tag!r} not found")
        raise ConnectError(Code.INVALID_ARGUMENT, "no process selector")

    def info(self, sandbox_id: str, entry: dict[str, Any]) -> process_pb.ProcessInfo:
        known = self.known.get((sandbox_id, entry["id"]))
        config = known.config if known else process_pb.ProcessConfig(cmd=entry.get("command") or "")
        return process_pb.ProcessInfo(config=config, pid=entry["id"], tag=known.tag if known else None)

    def forget(self, sandbox_id: str) -> None:
        for key in [k for k in self.known if k[0] == sandbox_id]:
            del self.known[key]

    async def close(self) -> None:
        self.known.clear()  # the processes live in their sandboxes, not here


async def _stream(
    proc: AsyncProcess, chunks: AsyncIterator[Any], wrap: Any, kill_at_deadline: bool
) -> AsyncIterator[Any]:
    """Yield `proc`'s output (`chunks`: output chunks, None after KEEPALIVE_S of quiet; they end when it ends or
    its deadline passes) as events wrapped in the RPC's response message, keepalives, and its end event; at
    the deadline (the SDK's command timeout) a started command is killed."""
    try:
        async for item in chunks:
            if item is None:
                yield wrap(event=_event("keepalive", process_pb.ProcessEvent.KeepAlive()))
            else:
                yield wrap(event=_data("pty" if proc.pty else item.stream, item.data))
    except ShoalError as exc:
        raise connect_error(exc) from None
    if proc.running:  # the deadline passed
        if kill_at_deadline:
            with contextlib.suppress(ShoalError):
                await proc.kill()
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the command ran out of time and was killed")
        raise ConnectError(Code.DEADLINE_EXCEEDED, "the connection to the command reached its timeout")
    if proc.exit_signal:
        yield wrap(event=_end(-1, f"signal: {SIGNAL_NAMES.get(proc.exit_signal, proc.exit_signal)}", exited=False))
    else:
        yield wrap(event=_end(proc.exit_code or 0, f"exit status {proc.exit_code or 0}"))


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
        running = await self.processes.running(sandbox)
        return process_pb.ListResponse(processes=[self.processes.info(sandbox.id, e) for e in running])

    async def start(self, request: process_pb.StartRequest, ctx: Any) -> AsyncIterator[process_pb.StartResponse]:
        sandbox = await self._sandbox(ctx)
        config = request.process or process_pb.ProcessConfig()
        timeout_ms = ctx.timeout_ms
        tag = request.tag if request.has_field("tag") else None
        size = _size(request.pty)
        args = {
            "sandbox_id": sandbox.id,
            "cmd": [config.cmd, *config.args],
            "env": dict(config.envs) or None,
            "cwd": config.cwd if config.has_field("cwd") and config.cwd else None,
            "user": username(ctx.request_headers),
            "pty": size,
            "open_stdin": bool(request.stdin) or size is not None,
        }
        timeout = timeout_ms / 1000 if timeout_ms else None
        # started and followed in one request to the node (procs.start_streaming): its first item is the process
        started = procs.start_streaming(
            sandbox, {k: v for k, v in args.items() if v is not None}, timeout=timeout, idle=KEEPALIVE_S
        )
        async with contextlib.aclosing(started):
            try:
                proc = await anext(started)
            except ShoalError as exc:
                raise connect_error(exc) from None
            assert isinstance(proc, AsyncProcess)
            self.processes.remember(sandbox.id, proc.id, Proc(config, tag, bool(request.stdin), size is not None))
            yield process_pb.StartResponse(event=_event("start", process_pb.ProcessEvent.StartEvent(pid=proc.id)))
            async for item in _stream(proc, started, process_pb.StartResponse, kill_at_deadline=True):
                yield item

    async def connect(self, request: process_pb.ConnectRequest, ctx: Any) -> AsyncIterator[process_pb.ConnectResponse]:
        sandbox = await self._sandbox(ctx)
        entry = await self.processes.find(sandbox, request.process)
        proc = AsyncProcess(sandbox, entry)
        proc.stdout_offset, proc.stderr_offset = entry["stdout_offset"], entry["stderr_offset"]  # from now on
        yield process_pb.ConnectResponse(event=_event("start", process_pb.ProcessEvent.StartEvent(pid=proc.id)))
        timeout = ctx.timeout_ms / 1000 if ctx.timeout_ms else None
        chunks = proc.stream(timeout=timeout, idle=KEEPALIVE_S)
        async with contextlib.aclosing(chunks):
            async for item in _stream(proc, chunks, process_pb.ConnectResponse, False):
                yield item

    async def _write(self, sandbox: AsyncSandbox, entry: dict[str, Any], kind: str, data: bytes, eof: bool) -> None:
        known = self.processes.known.get((sandbox.id, entry["id"]))
        if kind == "stdin" and known is not None and not known.stdin and not known.pty:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {entry['id']} was not started with stdin=True")
        try:
            await AsyncProcess(sandbox, entry).send_stdin(data, eof=eof)
        except ShoalError as exc:
            raise connect_error(exc) from None

    async def update(self, request: process_pb.UpdateRequest, ctx: Any) -> process_pb.UpdateResponse:
        sandbox = await self._sandbox(ctx)
        entry = await self.processes.find(sandbox, request.process)
        size = _size(request.pty)
        if size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "no PTY size to change to")
        if not entry["pty"]:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {entry['id']} has no PTY")
        try:
            await AsyncProcess(sandbox, entry).resize(size["cols"], size["rows"])
        except ShoalError as exc:
            raise connect_error(exc) from None
        return process_pb.UpdateResponse()

    async def stream_input(self, request: Any, ctx: Any) -> process_pb.StreamInputResponse:
        """Client-streamed input: a start event naming the process, then data events, in order."""
        sandbox = await self._sandbox(ctx)
        entry: dict[str, Any] | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    entry = await self.processes.find(sandbox, start.process)
                case Oneof(field="data", value=data):
                    if entry is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event")
                    await self._write(sandbox, entry, *_input(data.input), eof=False)
        return process_pb.StreamInputResponse()

    async def send_input(self, request: process_pb.SendInputRequest, ctx: Any) -> process_pb.SendInputResponse:
        sandbox = await self._sandbox(ctx)
        entry = await self.processes.find(sandbox, request.process)
        await self._write(sandbox, entry, *_input(request.input), eof=False)
        return process_pb.SendInputResponse()

    async def close_stdin(self, request: process_pb.CloseStdinRequest, ctx: Any) -> process_pb.CloseStdinResponse:
        sandbox = await self._sandbox(ctx)
        entry = await self.processes.find(sandbox, request.process)
        await self._write(sandbox, entry, "stdin", b"", eof=True)
        return process_pb.CloseStdinResponse()

    async def send_signal(self, request: process_pb.SendSignalRequest, ctx: Any) -> process_pb.SendSignalResponse:
        sandbox = await self._sandbox(ctx)
        entry = await self.processes.find(sandbox, request.process)
        number = int(request.signal.value) if request.signal else 0
        try:
            await AsyncProcess(sandbox, entry).signal(number or signal.SIGKILL)
        except ShoalError as exc:
            raise connect_error(exc) from None
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
