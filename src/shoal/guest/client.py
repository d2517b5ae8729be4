"""Asyncio client for the shoal guest agent (``agent.c``).

Every operation opens its own connection to the agent's Unix socket, except the node's exec step
(``exec_run``): its connection is kept for the next exec when the command left nothing running, so an exec
on a kept connection costs the agent one process, the command's (a vfork-style clone that sends the pid
frame and execs), instead of an accept and two forks.  A background
start is sent on a connection dialled ahead (the spare: dialled once the previous start got its pid, so the
agent forks the handler that becomes the next keeper while no start waits on it).  Frames are
``u32 length (type byte + payload) | u8 type | payload``, all integers big-endian.

Two ways to run a command: ``exec`` (an ExecProcess on asyncio streams, read one frame at a time: shells,
the GUI helper, function workers) and ``exec_run`` (an ExecRun: the node's exec step, its hot path, read by
a callback of the event loop straight off the socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as _errno
import math
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from shoal.protocol import cut_marker

__all__ = [
    "AgentClient",
    "AgentError",
    "Attached",
    "BackgroundEntry",
    "BackgroundStatus",
    "ExecProcess",
    "ExecRun",
    "ExitInfo",
    "FileEntry",
    "ProcessEntry",
    "control_frames",
]

MAX_FRAME = 16 << 20
_CHUNK = 1 << 20
_HDR = struct.Struct(">IB")
_STAT = struct.Struct(">BIIIQq")
_EXIT = struct.Struct(">iiQQ")
_U32 = struct.Struct(">I")
_CUT = struct.Struct(">IQ")
_KINDS = {ord("f"): "file", ord("d"): "dir", ord("l"): "symlink"}
_ERRNO_CLASSES: dict[int, type[OSError]] = {
    _errno.ENOENT: FileNotFoundError,
    _errno.EISDIR: IsADirectoryError,
    _errno.ENOTDIR: NotADirectoryError,
    _errno.EACCES: PermissionError,
    _errno.EPERM: PermissionError,
    _errno.EEXIST: FileExistsError,
    _errno.ECONNREFUSED: ConnectionRefusedError,
}

EXEC_STDIN_PIPE = 1
EXEC_MERGE_STDERR = 2
EXEC_BG_FOLLOW = 4  # 'B': the starter follows the process on the same connection
EXEC_KEEP_CONN = 8  # 'E': the agent may keep the connection for the next exec (its exit frame says if it does)
EXEC_HOLD_PID = 16  # 'E': the agent sends the pid with the command's first output or exit (ExecRun: held_pid)
WRITE_MKDIRS = 1
WRITE_APPEND = 2


@dataclass(frozen=True)
class ExitInfo:
    """How a command ended; ``exit_code`` is 128+signal if it was killed."""

    exit_code: int
    signal: int
    stdout_dropped: int
    stderr_dropped: int


@dataclass(frozen=True)
class ProcessEntry:
    """A process in the sandbox; ``exec_id`` is the exec that started it (None once that is unknown)."""

    pid: int
    ppid: int
    exec_id: int | None
    state: str
    command: str


@dataclass(frozen=True)
class FileEntry:
    """One stat record; ``kind`` is "file", "dir", "symlink" or "other"."""

    name: str
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime: float
    target: str


class AgentError(OSError):
    """An error reported by the agent (errno + the agent's message)."""

    @classmethod
    def from_frame(cls, payload: bytes) -> OSError:
        """Build the exception for a 'Z' payload, mapping common errnos to builtin subclasses."""
        code = _U32.unpack_from(payload)[0] if len(payload) >= 4 else _errno.EIO
        message = payload[4:].decode("utf-8", "replace")
        return _ERRNO_CLASSES.get(code, cls)(code, message)


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _HDR.pack(len(payload) + 1, kind[0]) + payload


def _cstr(value: str) -> bytes:
    data = os.fsencode(value)
    if b"\0" in data:
        raise ValueError(f"NUL byte in {value!r}")
    return data + b"\0"


def _parse_stat(payload: bytes) -> FileEntry:
    kind, mode, uid, gid, size, mtime_ns = _STAT.unpack_from(payload)
    name, target = payload[_STAT.size :].split(b"\0")[:2]
    return FileEntry(
        name=os.fsdecode(name),
        kind=_KINDS.get(kind, "other"),
        mode=mode,
        uid=uid,
        gid=gid,
        size=size,
        mtime=mtime_ns / 1e9,
        target=os.fsdecode(target),
    )


class _Conn:
    """One connection to the agent."""

    __slots__ = ("path", "reader", "writer")

    def __init__(self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.path = path
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, path: str) -> _Conn:
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        except (FileNotFoundError, ConnectionError) as exc:
            raise ConnectionError(f"cannot connect to shoal agent at {path}: {exc}") from exc
        return cls(path, reader, writer)

    async def send(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        try:
            await self.writer.drain()
        except ConnectionError as exc:
            raise ConnectionError(f"shoal agent at {self.path} dropped the connection") from exc

    async def recv(self) -> tuple[int, bytes]:
        try:
            length, kind = _HDR.unpack(await self.reader.readexactly(5))
            if length == 0 or length > MAX_FRAME:
                raise AgentError(_errno.EPROTO, f"bad frame length {length} from agent")
            payload = await self.reader.readexactly(length - 1) if length > 1 else b""
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ConnectionError(f"shoal agent at {self.path} closed the connection unexpectedly") from exc
        return kind, payload

    async def expect(self, *kinds: bytes) -> tuple[int, bytes]:
        """Receive a frame of one of ``kinds``; raise the agent's error for 'Z'."""
        kind, payload = await self.recv()
        if kind == ord("Z"):
            raise AgentError.from_frame(payload)
        if kind not in {k[0] for k in kinds}:
            raise AgentError(_errno.EPROTO, f"unexpected frame {chr(kind)!r} from agent")
        return kind, payload

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


async def _dial(path: str) -> socket.socket:
    """A non-blocking socket connected to the agent at `path` (ConnectionError naming it if it is not there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.connect(path)  # a Unix socket connects at once unless the agent's backlog is full
        except BlockingIOError:
            await asyncio.get_running_loop().sock_connect(sock, path)
    except (FileNotFoundError, ConnectionError) as exc:
        sock.close()
        raise ConnectionError(f"cannot connect to shoal agent at {path}: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


async def _send_now(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes | memoryview) -> None:
    """Send `data` on a non-blocking socket: straight away, the loop finishing what did not fit."""
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        await loop.sock_sendall(sock, memoryview(data)[sent:])


class _SockConn:
    """One short request-and-answer connection to the agent (background start, attach, the one-answer
    requests) on a plain non-blocking socket read with the loop's sock_recv: what _Conn does without a
    transport, a StreamReader and a StreamWriter made and torn down per request, which cost the node more
    CPU than those requests' own work (py-spy under bench/bench_e2b.py: two per E2B `commands.run`)."""

    __slots__ = ("path", "sock", "buf", "loop")

    _RECV = 1 << 16

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path, self.sock = path, sock
        self.buf = bytearray()
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, path: str) -> _SockConn:
        return cls(path, await _dial(path))

    async def send(self, data: bytes | memoryview) -> None:
        try:
            await _send_now(self.loop, self.sock, data)
        except OSError as exc:
            raise ConnectionError(f"shoal agent at {self.path} dropped the connection") from exc

    async def _fill(self, size: int) -> None:
        while len(self.buf) < size:
            try:
                data = await self.loop.sock_recv(self.sock, self._RECV)
            except OSError as exc:
                raise ConnectionError(f"shoal agent at {self.path} dropped the connection: {exc}") from exc
            if not data:
                raise ConnectionError(f"shoal agent at {self.path} closed the connection unexpectedly")
            self.buf += data

    async def recv(self) -> tuple[int, bytes]:
        await self._fill(5)
        length, kind = _HDR.unpack_from(self.buf)
        if length == 0 or length > MAX_FRAME:
            raise AgentError(_errno.EPROTO, f"bad frame length {length} from agent")
        await self._fill(4 + length)
        payload = bytes(self.buf[5 : 4 + length])
        del self.buf[: 4 + length]
        return kind, payload

    expect = _Conn.expect

    async def close(self) -> None:
        self.sock.close()  # idempotent; no reader is left registered (sock_recv removes its own)


async def _send_payload(conn: _Conn, data: bytes | bytearray | memoryview) -> int:
    """Stream `data` as D frames and a closing C on a W (write) or T (untar) request, take the agent's A answer
    (a u64 count) and close the connection; the one body of both requests."""
    try:
        view = memoryview(data)  # no copy: a large write must not hold its data twice
        for off in range(0, len(view), _CHUNK):
            chunk = view[off : off + _CHUNK]
            conn.writer.write(_HDR.pack(len(chunk) + 1, ord("D")))
            await conn.send(chunk)
        await conn.send(_frame(b"C"))
        _, payload = await conn.expect(b"A")
        return struct.unpack(">Q", payload)[0]
    finally:
        await conn.close()


class ExecProcess:
    """A running command: one open connection streaming its output."""

    def __init__(self, conn: _Conn, pid: int, handler_pid: int | None = None) -> None:
        self._conn = conn
        self.pid = pid
        self.handler_pid = handler_pid  # the exec's ID in `processes()` and `kill_processes(exec_id)`
        self.exit: ExitInfo | None = None
        self._closed = False

    async def next_output(self) -> tuple[str, bytes] | None:
        """Next ("stdout"|"stderr", chunk), or None once the command has exited."""
        if self.exit is not None:
            return None
        kind, payload = await self._conn.expect(b"O", b"R", b"Q", b"X")
        if kind == ord("O"):
            return "stdout", payload
        if kind == ord("R"):
            return "stderr", payload
        if kind == ord("Q"):  # the output cap cut the middle of a stream; its tail follows
            stream, omitted = _CUT.unpack_from(payload)
            return ("stderr" if stream else "stdout"), cut_marker(omitted)
        self.exit = ExitInfo(*_EXIT.unpack_from(payload))
        await self.close()
        return None

    async def collect(self) -> tuple[bytes, bytes, ExitInfo]:
        """Read all remaining output; return (stdout, stderr, exit info)."""
        out: list[bytes] = []
        err: list[bytes] = []
        while (item := await self.next_output()) is not None:
            (out if item[0] == "stdout" else err).append(item[1])
        assert self.exit is not None
        return b"".join(out), b"".join(err), self.exit

    async def write_stdin(self, data: bytes) -> None:
        """Feed bytes to the command's stdin (requires ``stdin_pipe=True``)."""
        if self.exit is not None or self._closed:
            raise BrokenPipeError("process has exited")
        view = memoryview(data)
        for off in range(0, len(view), _CHUNK):
            await self._conn.send(_frame(b"I", bytes(view[off : off + _CHUNK])))

    async def close_stdin(self) -> None:
        """Close the command's stdin."""
        if self.exit is None and not self._closed:
            await self._conn.send(_frame(b"C"))

    async def kill(self, sig: int = 9) -> None:
        """Send ``sig`` to the command's whole process tree; no-op after exit."""
        if self.exit is not None or self._closed:
            return
        with contextlib.suppress(ConnectionError):
            await self._conn.send(_frame(b"K", _U32.pack(sig)))

    async def close(self) -> None:
        """Close the connection; the agent kills the tree if it is still running."""
        if not self._closed:
            self._closed = True
            await self._conn.close()

    async def __aenter__(self) -> ExecProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Watch:
    """What a connection to the agent is registered with in the loop's selector, once, when it is dialled: who
    reads it (an exec's ExecRun, or the AgentClient watching it idle) changes by assigning `reader`, not by an
    add_reader per exec (a Handle, a selector lookup and a namedtuple rebuilt, twice per exec: issue 12)."""

    __slots__ = ("reader",)

    def __init__(self, reader: Callable[[], None]) -> None:
        self.reader = reader

    def __call__(self) -> None:
        self.reader()


class ExecRun:
    """One command of the node's exec step, on a plain non-blocking socket that a reader callback of the
    event loop drains: every frame that arrived is parsed where it lands, output accumulates in place and
    the step is woken once per event it cares about (the exit; a chunk to stream; its deadline; the start
    only for a caller that asked to wait for it).

    Why not ExecProcess: a transport, a StreamReader and a coroutine (plus a task in the node's loop) per
    frame cost the node more CPU than the rest of an exec step (issue 12, py-spy under bench_hotpath)."""

    _RECV = 1 << 16

    def __init__(
        self,
        path: str,
        request: bytes,
        stream: bool,
        keeper: AgentClient | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        on_start: Callable[[ExecRun], Any] | None = None,
        held_pid: bool = False,
    ) -> None:
        self._path, self._request, self._keeper, self._on_start = path, request, keeper, on_start
        # The request asked the agent to hold the pid frame (EXEC_HOLD_PID): the command may run before its pid
        # is on the way, so a connection that ends before the pid is sent again only if the agent cannot have
        # read the request (`_fail`).
        self._held_pid = held_pid
        self._sent_more = False  # frames went after the request (send): an unread one proves nothing
        self._sock: socket.socket | None = None
        self._watch: _Watch | None = None
        self._from_keeper = False  # sent on a kept connection: if that ends before the pid, send it on a new one
        self._redial = False  # ... which `wait` does (it may have to wait for the connect)
        self._kept = False  # the exit frame said the agent's handler serves the next exec on this connection
        self._sending = False  # a frame may be half written: the connection cannot carry another exec
        # the caller's loop if it has it: each asyncio.get_running_loop() is a getpid() system call
        self._loop = loop or asyncio.get_running_loop()
        self._buf = bytearray()
        self._waiter: asyncio.Future | None = None
        self._wake_on_start = False
        self._reading = self._closed = False
        self._registered = False  # the socket is in the loop's selector (this run's reader, or a keeper's watch)
        # the agent answered with the pid: the command runs; or, the pid held, the connection ended once the agent
        # read the request (its handler killed from inside: `kill -9 -1`), and the command may have run (pid 0)
        self.started = False
        self.pid = 0
        self.handler_pid: int | None = None  # the exec's ID in `processes()` and `kill_processes(exec_id)`
        self.exec_id: Any = None  # what `on_start` returned (the node's name for this exec)
        self.stdout, self.stderr = bytearray(), bytearray()
        self.chunks: list[tuple[str, bytes]] | None = [] if stream else None  # to stream, in order
        self.exit: ExitInfo | None = None
        self.error: BaseException | None = None  # the connection broke, or the agent answered 'Z'
        self.last_output = time.monotonic()

    @classmethod
    async def start(
        cls,
        path: str,
        request: bytes,
        stream: bool,
        keeper: AgentClient | None = None,
        on_start: Callable[[ExecRun], Any] | None = None,
        wait_start: bool = True,
        held_pid: bool = False,
    ) -> ExecRun:
        """Send `request` on a kept connection of `keeper`'s if one is alive, else on a new one; with
        `wait_start`, return once the agent answered with the pid (raising its error, or ConnectionError, if it
        did not start the command), else at once: `on_start` is then called from the loop's callback when the
        pid comes, and the caller finds a failure to start as `error` with `started` False, after `wait`.
        A kept connection that ends before the pid came is dialled again, by `wait` (the agent starts a
        command only once its pid is on the way; the handler of a kept connection can be killed from inside
        the sandbox), so that exec costs no loop pass and no task wake-up at its start (issue 12). With
        `held_pid` (the request has EXEC_HOLD_PID) it is dialled again only if the agent cannot have read
        the request (`_fail`)."""
        loop = asyncio.get_running_loop()
        kept = keeper._take_kept(loop) if keeper is not None else None
        run = cls(path, request, stream, keeper, loop, on_start, held_pid)
        try:
            if kept is not None:
                try:
                    await run._send_on(*kept)
                except ConnectionError:
                    run._drop_connection()
                    kept = None  # the kept connection was gone: dial a new one
            if kept is None:
                await run._send_on(await _dial(path), None)
            if wait_start:
                run._wake_on_start = True
                while not run.started and run.error is None:
                    await run.wait(None)
                if run.error is not None and not run.started:
                    raise run.error
        except BaseException:
            run.close()
            raise
        return run

    async def _send_on(self, sock: socket.socket, watch: _Watch | None) -> None:
        """Send the request on `sock`, read by this run from now on (`watch`: it is a kept connection, still
        registered with that watch, which this run's reader takes over before anything can arrive)."""
        self._sock, self._from_keeper = sock, watch is not None
        if watch is None:
            watch = _Watch(self._readable)
            self._loop.add_reader(sock.fileno(), watch)
        else:
            watch.reader = self._readable
        self._watch = watch
        self._registered = self._reading = True
        self._sending = True
        await _send_now(self._loop, sock, self._request)
        self._sending = False

    def _drop_connection(self) -> None:
        self._stop_reading()
        if self._sock is not None:
            self._sock.close()

    async def _send_again(self) -> None:
        """The kept connection ended before the pid came: the request on a new connection."""
        self._redial = False
        self._buf.clear()
        try:
            await self._send_on(await _dial(self._path), None)
        except ConnectionError as exc:
            self._drop_connection()
            self.error = exc

    def _readable(self) -> None:
        try:
            data = self._sock.recv(self._RECV)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # ECONNRESET: the agent's end closed with bytes of ours unread
            unread = isinstance(exc, ConnectionResetError)
            self._fail(ConnectionError(f"shoal agent at {self._path} dropped the connection: {exc}"), unread)
            return
        if not data:
            self._fail(ConnectionError(f"shoal agent at {self._path} closed the connection unexpectedly"), False)
            return
        buf = self._buf
        buf += data
        pos, end_of_data = 0, len(buf)
        while end_of_data - pos >= 5 and self._reading:
            length, kind = _HDR.unpack_from(buf, pos)
            if length == 0 or length > MAX_FRAME:
                self._fail(AgentError(_errno.EPROTO, f"bad frame length {length} from agent"))
                return
            end = pos + 4 + length
            if end > end_of_data:
                break
            self._frame(kind, bytes(buf[pos + 5 : end]))
            pos = end
        del buf[:pos]

    def _frame(self, kind: int, payload: bytes) -> None:
        if kind == ord("O") or kind == ord("R"):
            (self.stdout if kind == ord("O") else self.stderr).extend(payload)
            self.last_output = time.monotonic()
            if self.chunks is not None:
                self.chunks.append(("stdout" if kind == ord("O") else "stderr", payload))
                self._wake()
        elif kind == ord("X"):
            self.exit = ExitInfo(*_EXIT.unpack_from(payload))
            self._kept = len(payload) > _EXIT.size and payload[_EXIT.size] == 1  # older agents: never
            self._reading = False  # still registered: close() hands a kept connection over as it is
            self._wake()
        elif kind == ord("P") and not self.started:
            self.pid = _U32.unpack_from(payload)[0]
            self.handler_pid = _U32.unpack_from(payload, 4)[0] if len(payload) >= 8 else None  # older agents
            self.started = True
            if self._on_start is not None:
                self.exec_id = self._on_start(self)
            if self._wake_on_start:
                self._wake()
        elif kind == ord("Q"):  # the output cap cut the middle of a stream; its tail follows
            stream, omitted = _CUT.unpack_from(payload)
            marker = cut_marker(omitted)
            (self.stderr if stream else self.stdout).extend(marker)
            if self.chunks is not None:
                self.chunks.append(("stderr" if stream else "stdout", marker))
        elif kind == ord("Z"):
            self._fail(AgentError.from_frame(payload))
        else:
            self._fail(AgentError(_errno.EPROTO, f"unexpected frame {chr(kind)!r} from agent"))

    def _fail(self, exc: BaseException, unread: bool = True) -> None:
        """The connection broke (`unread`: with bytes of ours the agent never read) or the agent answered 'Z'."""
        if not self.started and self._held_pid and isinstance(exc, ConnectionError) and (self._sent_more or not unread):
            # Its pid held, the command may have started and its handler been killed (`kill -9 -1`): it is
            # never sent again. Only a reset with nothing sent but the request (a frame the handler parses only
            # whole) shows that the request was not read, so nothing ran (a kept connection: sent anew).
            self.started = True
        if not self.started and self._from_keeper and isinstance(exc, ConnectionError) and not self._closed:
            self._drop_connection()  # a kept connection's handler that went away: `wait` sends it anew
            self._redial = True
        else:
            self._stop_reading()
            self.error = exc
        self._wake()

    def _stop_reading(self) -> None:
        self._reading = False
        if self._registered:
            self._registered = False
            self._loop.remove_reader(self._sock.fileno())  # type: ignore[union-attr]

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, limit: float | None) -> None:
        """Return once the command exited or the connection broke (`exit`, `error`: before the start if
        `started` is still False), a chunk waits in `chunks`, or time.monotonic() reached `limit`."""
        while self._redial and not self._closed:
            await self._send_again()
        if self.exit is not None or self.error is not None or self.chunks:
            return
        self._waiter = waiter = self._loop.create_future()
        deadlines = None
        if limit is not None:  # loop time: monotonic
            deadlines = self._keeper._deadlines_of(self._loop) if self._keeper is not None else _Deadlines(self._loop)
            deadlines.add(waiter, limit)
        try:
            await waiter
        finally:
            self._waiter = None
            if deadlines is not None:
                deadlines.discard(waiter)
        while self._redial and not self._closed:
            await self._send_again()

    async def send(self, frames: bytes) -> None:
        """Frames to the command (control_frames: stdin, close stdin, a signal); dropped once it has exited
        (its exit frame may arrive before the node fed it stdin)."""
        if self.exit is not None:
            return
        if self._closed or self._sock is None:
            raise BrokenPipeError("the command's connection is closed")
        self._sending = self._sent_more = True
        try:
            await self._loop.sock_sendall(self._sock, frames)
        except OSError as exc:
            raise ConnectionError(f"shoal agent at {self._path} dropped the connection") from exc
        self._sending = False

    async def kill(self, sig: int = 9) -> None:
        """Send ``sig`` to the command's whole process tree; no-op after exit."""
        with contextlib.suppress(ConnectionError, BrokenPipeError):
            await self.send(_frame(b"K", _U32.pack(sig)))

    def close(self) -> None:
        """Close the connection (the agent kills the tree if it is still running), or hand it back to the
        AgentClient for its next exec if the agent kept it: the command ended, leaving nothing, and every frame
        of this exec was read and written whole."""
        if not self._closed:
            self._closed = True
            self._reading = False
            clean = self._kept and self.error is None and not self._buf and not self._sending and self._registered
            if clean and self._keeper is not None and self._keeper._keep(self._sock, self._loop, self._watch):
                self._registered = False  # the keeper watches it now
                return
            self._drop_connection()


def _set_none(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _Deadlines:
    """The deadlines of the ExecRun.wait calls of one AgentClient (a sandbox's execs), behind one timer of the
    loop. A wait adds its waiter with its deadline and discards it when it returns; the timer is armed again
    only for a deadline earlier than the one it is armed for, so a sandbox's execs one after another (each
    with the client's default timeout, each ending long before it) share one timer instead of making and
    cancelling one each (a TimerHandle, a heap push and a cancelled entry the loop pops later, per exec:
    issue 12). The timer can fire for waits that are gone: it wakes those due, then arms for the earliest
    left, if any."""

    __slots__ = ("loop", "waits", "timer", "at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waits: dict[asyncio.Future, float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.at = math.inf  # when the timer fires (inf: no timer)

    def add(self, waiter: asyncio.Future, when: float) -> None:
        self.waits[waiter] = when
        if when < self.at:
            if self.timer is not None:
                self.timer.cancel()
            self.at, self.timer = when, self.loop.call_at(when, self._fire)

    def discard(self, waiter: asyncio.Future) -> None:
        self.waits.pop(waiter, None)

    def _fire(self) -> None:
        self.at, self.timer = math.inf, None
        now = self.loop.time()
        earliest = math.inf
        for waiter, when in list(self.waits.items()):
            if when <= now:
                del self.waits[waiter]
                _set_none(waiter)
            elif when < earliest:
                earliest = when
        if earliest < math.inf:  # later than now: fires on a later pass
            self.at, self.timer = earliest, self.loop.call_at(earliest, self._fire)


def _exec_payload(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    cap: int,
    stdin_pipe: bool,
    merge: bool,
    more_flags: int = 0,
) -> bytes:
    """An exec request ('E', and the start of a background one, 'B'): see parse_exec in agent.c."""
    if not argv:
        raise ValueError("argv must not be empty")
    if not 0 <= cap < 1 << 32:
        raise ValueError("cap_bytes must fit in 32 bits (0 = unlimited)")
    flags = (EXEC_STDIN_PIPE if stdin_pipe else 0) | (EXEC_MERGE_STDERR if merge else 0) | more_flags
    parts = [struct.pack(">IIII", cap, uid, gid, flags), _cstr(cwd), _U32.pack(len(argv))]
    parts += [_cstr(a) for a in argv]
    parts.append(_env_block(env))
    return b"".join(parts)


_ENV_BLOCKS: dict[tuple, bytes] = {}  # a sandbox's environment, encoded once: the same at nearly every exec


def _env_block(env: dict[str, str]) -> bytes:
    """`env` as the agent reads it (count, then KEY=VALUE NUL-terminated). Kept by content: encoding it
    anew was half of encoding an exec request (issue 12: 7.7 -> 3.9 µs, timeit)."""
    items: tuple | None = tuple(env.items())
    try:
        block = _ENV_BLOCKS.get(items)
    except TypeError:  # a value that is not hashable (not a str): encoded as before, not kept
        block, items = None, None
    if block is None:
        parts = [_U32.pack(len(env))]
        for key, value in env.items():
            if "=" in key or not key:
                raise ValueError(f"invalid environment variable name {key!r}")
            parts.append(_cstr(f"{key}={value}"))
        block = b"".join(parts)
        if items is not None:
            if len(_ENV_BLOCKS) >= 256:  # many sandboxes' or requests' own environments: start over
                _ENV_BLOCKS.clear()
            _ENV_BLOCKS[items] = block
    return block


@dataclass(frozen=True)
class BackgroundStatus:
    """Where a background process's output stands (its totals: the offsets to read on from), and how it
    ended (exit_code and signal are meaningful once running is False)."""

    stdout_offset: int
    stderr_offset: int
    running: bool
    exit_code: int
    signal: int


@dataclass(frozen=True)
class BackgroundEntry:
    """A background process the agent keeps (procs.c): `id` is its keeper's pid, which names it."""

    id: int
    pid: int
    running: bool
    exit_code: int
    signal: int
    pty: bool
    stdout_total: int
    stderr_total: int


def control_frames(
    *, stdin: bytes = b"", eof: bool = False, signal: int | None = None, size: tuple[int, int] | None = None
) -> bytes:
    """Frames for a background process: stdin bytes, close stdin, a signal, a terminal size (rows, cols)."""
    view, parts = memoryview(stdin), []
    for off in range(0, len(view), _CHUNK):
        parts.append(_frame(b"I", bytes(view[off : off + _CHUNK])))
    if eof:
        parts.append(_frame(b"C"))
    if signal is not None:
        parts.append(_frame(b"K", _U32.pack(signal)))
    if size is not None:
        parts.append(_frame(b"W", struct.pack(">HH", *size)))
    return b"".join(parts)


class Attached:
    """A connection to a background process's keeper: its output from the offsets asked for, then its
    status; while following, input, signals and resizes go the same way."""

    READ, FOLLOW, CONTROL = 0, 1, 2

    def __init__(self, conn: _Conn, pid: int, id: int, pty: bool, offsets: tuple[int, int]) -> None:
        self._conn = conn
        self.pid, self.id, self.pty = pid, id, pty
        self.offsets = list(offsets)  # where each stream continues
        self.status: BackgroundStatus | None = None

    async def next(self) -> tuple[str, bytes] | None:
        """The next ("stdout"|"stderr", chunk); None once the status came (then in `status`)."""
        while self.status is None:
            kind, payload = await self._conn.expect(b"O", b"R", b"Q", b"Y")
            if kind in (ord("O"), ord("R")):
                k = int(kind == ord("R"))
                self.offsets[k] += len(payload)
                return ("stderr" if k else "stdout"), payload
            if kind == ord("Q"):  # the ring no longer holds what came before: the stream continues there
                k, offset = _CUT.unpack_from(payload)
                omitted = offset - self.offsets[k]
                self.offsets[k] = offset
                return ("stderr" if k else "stdout"), cut_marker(omitted)
            self.status = BackgroundStatus(*_BG_STATUS.unpack_from(payload))
            await self.close()
        return None

    async def send(self, frames: bytes) -> None:
        await self._conn.send(frames)

    async def close(self) -> None:
        await self._conn.close()


_BG_STATUS = struct.Struct(">QQ?ii")
_BG_ENTRY = struct.Struct(">II?ii?QQ")
_ATTACH = struct.Struct(">IBQQ")


def _waiting(sock: socket.socket) -> bool:
    """Does the handler at the other end of this idle connection still wait for a request (no EOF, error or
    unasked-for bytes on it)? Closes it if not."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        pass
    sock.close()
    return False


def _unwatch(sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """Take a kept connection out of `loop`'s selector and close it."""
    if not loop.is_closed():
        loop.remove_reader(sock.fileno())
    sock.close()


class AgentClient:
    """Client for one agent socket. It holds up to KEEP idle exec connections (each an agent handler waiting
    in the sandbox for its next exec) and, once it started a background process, one spare connection for
    the next (its handler forked ahead, waiting for its first request); close() closes them.

    An idle kept connection stays in the event loop's selector, watched by `_idle` (its handler ended, or
    sent what nobody asked for: it is closed): the next exec takes it over by pointing its _Watch at its own
    reader, with no epoll_ctl, add_reader or MSG_PEEK probe per exec (issue 12). An EOF the loop has not seen
    yet shows as a send error or an EOF before the pid (a reset, if the pid is held), and the exec dials again
    (ExecRun.start, .wait, ._fail)."""

    KEEP = 2

    def __init__(self, socket_path: str, hold_pid: bool = False) -> None:
        self.socket_path = socket_path
        # exec_run without wait_start asks the agent to hold the pid frame (EXEC_HOLD_PID): only where the socket
        # is the agent handler's own (not a VM's bridge), so that a reset tells a request the handler never read
        self.hold_pid = hold_pid
        self._kept: list[tuple[socket.socket, asyncio.AbstractEventLoop, _Watch]] = []  # watched in that loop
        self._spare: socket.socket | None = None
        self._closed = False
        self._deadlines: _Deadlines | None = None  # of this client's exec waits (ExecRun.wait), in one loop

    def _deadlines_of(self, loop: asyncio.AbstractEventLoop) -> _Deadlines:
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self._deadlines = _Deadlines(loop)
        return deadlines

    def _take_kept(self, loop: asyncio.AbstractEventLoop | None = None) -> tuple[socket.socket, _Watch] | None:
        """A kept connection (still registered in this loop's selector) and its watch, or None."""
        loop = loop or asyncio.get_running_loop()
        while self._kept:
            sock, owner, watch = self._kept.pop()
            if owner is loop:
                return sock, watch
            _unwatch(sock, owner)
        return None

    def _idle(self, sock: socket.socket) -> None:
        """A kept connection became readable while idle: its handler is gone (EOF) or out of step."""
        for i, (kept, owner, _) in enumerate(self._kept):
            if kept is sock:
                del self._kept[i]
                _unwatch(sock, owner)
                return

    def _take_spare(self) -> socket.socket | None:
        sock, self._spare = self._spare, None
        return sock if sock is not None and _waiting(sock) else None

    def _drop_spare(self) -> None:
        """Close the spare before a request the agent's reserve may serve (hello, process list, kills): a spare
        dialled at the sandbox's pids limit went to the reserve, which serves one connection at a time and
        would wait (up to 5 s) for a request on it before taking the next."""
        if self._spare is not None:
            self._spare.close()
            self._spare = None

    def _dial_spare(self) -> None:
        """Connect the next background start's connection now: the agent accepts it and forks its handler
        while the command just started runs, not while the next start waits (a fork in the sandbox is the
        larger part of a start's latency on a nested VM: bench/bench_e2b.py). Never waits: a backlog that
        is full, or an agent that is gone, leaves no spare (the next start dials as before)."""
        if self._closed or self._spare is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            return
        self._spare = sock

    def _keep(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, watch: _Watch) -> bool:
        """Keep `sock` (registered in `loop`'s selector with `watch`) for the next exec."""
        if self._closed or len(self._kept) >= self.KEEP:
            return False
        watch.reader = lambda: self._idle(sock)
        self._kept.append((sock, loop, watch))
        return True

    def close(self) -> None:
        """Close the kept exec connections (their handlers in the sandbox exit) and keep none from now on
        (the sandbox is going away); the client stays usable."""
        self._closed = True
        kept, self._kept = self._kept, []
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        for sock, owner, _ in kept:
            _unwatch(sock, owner)

    async def _request(self, kind: bytes, payload: bytes, conn_type: type = _Conn) -> _Conn:
        conn = await conn_type.open(self.socket_path)
        try:
            await conn.send(_frame(kind, payload))
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _opened(self, kind: bytes, payload: bytes, reply: bytes, conn_type: type = _Conn) -> tuple[_Conn, bytes]:
        """Send a request whose connection stays open past its first reply (`reply`): the connection and that
        reply's payload; the connection is closed if the reply does not come."""
        conn = await self._request(kind, payload, conn_type)
        try:
            return conn, (await conn.expect(reply))[1]
        except BaseException:
            await conn.close()
            raise

    async def _simple(self, kind: bytes, payload: bytes) -> bytes:
        conn = await self._request(kind, payload, _SockConn)
        try:
            return (await conn.expect(b"A"))[1]
        finally:
            await conn.close()

    async def identity(
        self, hostname: str, machine_id: str, seed: bytes, realtime_ns: int, pids: int = 0, disk_mb: int = 0
    ) -> None:
        """Give a booted or restored VM its own identity (hostname, machine id, entropy ≤512 bytes, wall clock)
        and its sandbox's limits, which the template it was restored from cannot know: `pids` bounds the
        guest cgroup every command runs in, `disk_mb` what the sandbox may write (0: no limit, no cap)."""
        payload = hostname.encode() + b"\0" + machine_id.encode() + b"\0"
        payload += struct.pack(">QII", realtime_ns, pids, disk_mb) + seed
        await self._simple(b"I", payload)

    async def hello(self) -> tuple[int, str]:
        """Return (agent pid, agent version)."""
        self._drop_spare()
        payload = await self._simple(b"H", b"")
        return _U32.unpack_from(payload)[0], payload[4:].decode()

    async def processes(self) -> list[ProcessEntry]:
        """The sandbox's processes other than the agent's own, each with the exec (handler pid) it belongs to."""
        self._drop_spare()
        payload = await self._simple(b"Q", b"")
        (count,), offset, entries = _U32.unpack_from(payload), 4, []
        for _ in range(count):
            pid, ppid, exec_id = struct.unpack_from(">III", payload, offset)
            end = payload.index(b"\0", offset + 13)
            command = payload[offset + 13 : end].decode("utf-8", "replace")
            entries.append(ProcessEntry(pid, ppid, exec_id or None, chr(payload[offset + 12]), command))
            offset = end + 1
        return entries

    async def kill_processes(self, exec_id: int | None = None) -> tuple[int, int]:
        """SIGKILL the processes of exec `exec_id` (all but the agent's if None), until none is left; needs
        no fork in the sandbox (served by the agent's reserve at the pids limit). Returns (killed, left)."""
        self._drop_spare()
        payload = await self._simple(b"K", _U32.pack(exec_id or 0))
        killed, left = struct.unpack_from(">II", payload)
        return killed, left

    async def open_port(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw byte stream to 127.0.0.1:`port` inside the sandbox, relayed by the agent over its own channel
        (the sandbox's network policy is not involved). ConnectionRefusedError if nothing listens there; the
        caller closes the writer."""
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is not in 1-65535")
        conn, _ = await self._opened(b"F", _U32.pack(port), b"A")
        return conn.reader, conn.writer

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        cap_bytes: int = 1 << 20,
        stdin_pipe: bool = False,
        merge_stderr: bool = False,
    ) -> ExecProcess:
        """Start ``argv``; the caller must read output until None and close the process."""
        payload = _exec_payload(argv, env, cwd, uid, gid, cap_bytes, stdin_pipe, merge_stderr)
        conn, payload = await self._opened(b"E", payload, b"P")
        handler = _U32.unpack_from(payload, 4)[0] if len(payload) >= 8 else None  # older agents: pid only
        return ExecProcess(conn, _U32.unpack_from(payload)[0], handler)

    async def exec_run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        cap_bytes: int = 1 << 20,
        stdin_pipe: bool = False,
        merge_stderr: bool = False,
        stream: bool = False,
        on_start: Callable[[ExecRun], Any] | None = None,
        wait_start: bool = True,
    ) -> ExecRun:
        """Start ``argv``: return once the agent answered with its pid, or with `wait_start` False once the
        request is sent (`on_start(run)` runs when the pid comes, its result kept in `run.exec_id`; a failure
        to start shows after `wait` as `run.error` with `run.started` False). The output accumulates in the
        ExecRun (and in its `chunks` too if `stream`). The caller waits on it (ExecRun.wait) and closes it."""
        held = self.hold_pid and not wait_start  # a caller that waits for the pid gets it at once
        flags = EXEC_KEEP_CONN | (EXEC_HOLD_PID if held else 0)
        payload = _exec_payload(argv, env, cwd, uid, gid, cap_bytes, stdin_pipe, merge_stderr, flags)
        request = _frame(b"E", payload)
        return await ExecRun.start(self.socket_path, request, stream, self, on_start, wait_start, held)

    async def background(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        ring_bytes: int = 1 << 20,
        stdin_pipe: bool = True,
        merge_stderr: bool = False,
        size: tuple[int, int] | None = None,
    ) -> tuple[int, int]:
        """Start ``argv`` as a background process (on a terminal of ``size`` = (rows, cols) if given), which
        outlives this connection; returns (pid, id). Its output is kept in rings of ``ring_bytes`` per stream."""
        pid, keeper, _ = await self._background(argv, env, cwd, uid, gid, ring_bytes, stdin_pipe, merge_stderr, size)
        return pid, keeper

    async def background_follow(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        ring_bytes: int = 1 << 20,
        stdin_pipe: bool = True,
        merge_stderr: bool = False,
        size: tuple[int, int] | None = None,
    ) -> tuple[int, int, Attached | None]:
        """`background`, and its output followed from the start on the same connection (an Attached in FOLLOW
        mode; the caller closes it): no second connection (and fork of a handler in the sandbox) per command.
        None for the Attached from an agent that does not know the flag (it closed the connection): attach."""
        return await self._background(argv, env, cwd, uid, gid, ring_bytes, stdin_pipe, merge_stderr, size, True)

    async def _background(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        uid: int,
        gid: int,
        ring_bytes: int,
        stdin_pipe: bool,
        merge_stderr: bool,
        size: tuple[int, int] | None,
        follow: bool = False,
    ) -> tuple[int, int, Attached | None]:
        rows, cols = size or (0, 0)
        if size is not None and not (0 < rows < 1 << 16 and 0 < cols < 1 << 16):
            raise ValueError(f"terminal size must be 1..65535 rows and columns, not {size}")
        flags = EXEC_BG_FOLLOW if follow else 0
        payload = _exec_payload(argv, env, cwd, uid, gid, ring_bytes, stdin_pipe, merge_stderr, flags)
        payload += _U32.pack(rows << 16 | cols)
        request = _frame(b"B", payload)
        conn, reply = await self._started_on_spare(request)
        attached = None
        try:
            if reply is None:  # no spare, or its handler went away before answering: a new connection
                conn = await self._request(b"B", payload, _SockConn)
                _, reply = await conn.expect(b"P")
            self._dial_spare()
            pid, keeper = struct.unpack_from(">II", reply)
            if follow:
                with contextlib.suppress(ConnectionError):  # an older agent closed it: the caller attaches
                    _, reply = await conn.expect(b"P")
                    attached = Attached(conn, pid, keeper, bool(struct.unpack_from(">II?", reply)[2]), (0, 0))
        finally:
            if attached is None and conn is not None:
                await conn.close()
        return pid, keeper, attached

    async def _started_on_spare(self, request: bytes) -> tuple[_SockConn | None, bytes | None]:
        """Send a background start on the spare connection; (conn, the 'P' reply), or (None, None) if there is
        no spare or it did not start the command: its idle handler was killed from inside the sandbox (`kill
        -9 -1`), which the liveness check misses only in the instant between it and the send (a handler killed
        after it forked the command would be killed by the same `kill -1` as the command), or it answered an
        error (the agent may have passed the spare to its reserve, dialled at the sandbox's pids limit, which
        a start now need not meet). The start is then sent on a new connection, which answers for itself."""
        sock = self._take_spare()
        if sock is None:
            return None, None
        conn = _SockConn(self.socket_path, sock)
        try:
            await conn.send(request)
            return conn, (await conn.expect(b"P"))[1]
        except OSError:  # ConnectionError, or the agent's error answer (AgentError or the errno's builtin class)
            await conn.close()
            return None, None
        except BaseException:
            await conn.close()
            raise

    async def attach(self, id: int, mode: int, offsets: tuple[int, int] = (0, 0), frames: bytes = b"") -> Attached:
        """Connect to background process `id` (Attached.READ, FOLLOW or CONTROL), sending `frames` first."""
        conn, payload = await self._opened(b"A", _ATTACH.pack(id, mode, *offsets) + frames, b"P", _SockConn)
        pid, keeper, pty = struct.unpack_from(">II?", payload)
        return Attached(conn, pid, keeper, pty, offsets)

    async def control(self, id: int, frames: bytes) -> BackgroundStatus:
        """Send `frames` (control_frames) to background process `id`; its status once they were taken."""
        attached = await self.attach(id, Attached.CONTROL, frames=frames)
        try:
            while await attached.next() is not None:
                pass
        finally:
            await attached.close()
        assert attached.status is not None
        return attached.status

    async def background_list(self) -> list[BackgroundEntry]:
        """The background processes the agent keeps (running, or ended and not yet collected)."""
        payload = await self._simple(b"J", b"")
        count = _U32.unpack_from(payload)[0]
        return [BackgroundEntry(*_BG_ENTRY.unpack_from(payload, 4 + i * _BG_ENTRY.size)) for i in range(count)]

    async def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """Return the contents of ``path``; errors if it is larger than ``max_bytes``."""
        return b"".join([chunk async for chunk in self.read_file_chunks(path, max_bytes)])

    async def read_file_chunks(self, path: str, max_bytes: int = 64 << 20) -> AsyncIterator[bytes]:
        """The contents of ``path`` as the agent sends them (chunks of at most 64 KiB), never all held at
        once; raises (after the chunks so far) if it is larger than ``max_bytes``."""
        conn = await self._request(b"G", struct.pack(">Q", max_bytes) + _cstr(path))
        try:
            await conn.expect(b"N")
            while True:
                kind, payload = await conn.expect(b"D", b"A")
                if kind == ord("A"):
                    return
                yield payload
        finally:
            await conn.close()

    async def write_file(
        self,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        mkdirs: bool = True,
        append: bool = False,
    ) -> int:
        """Write ``data`` to ``path`` (atomically unless appending); return bytes written."""
        flags = (WRITE_MKDIRS if mkdirs else 0) | (WRITE_APPEND if append else 0)
        conn = await self._request(b"W", struct.pack(">IIII", mode, uid, gid, flags) + _cstr(path))
        return await _send_payload(conn, data)

    async def untar(self, path: str, data: bytes, *, uid: int = 0, gid: int = 0) -> int:
        """Unpack a tar stream (ustar/GNU: files, directories, symlinks) into directory ``path`` (made if
        missing) as ``uid:gid``; returns the entries made. Absolute or '..' member names are refused and no
        link already in the tree is followed (see ``do_untar`` in agent.c)."""
        conn = await self._request(b"T", struct.pack(">II", uid, gid) + _cstr(path))
        return await _send_payload(conn, data)

    async def list_dir(self, path: str, recursive: bool = False) -> list[FileEntry]:
        """List ``path``; recursive names are relative to it and symlinks are not followed."""
        conn = await self._request(b"L", bytes([1 if recursive else 0]) + _cstr(path))
        try:
            entries: list[FileEntry] = []
            while True:
                kind, payload = await conn.expect(b"N", b"A")
                if kind == ord("A"):
                    return entries
                entries.append(_parse_stat(payload))
        finally:
            await conn.close()

    async def stat(self, path: str) -> FileEntry | None:
        """lstat ``path``; None if it does not exist."""
        conn = await self._request(b"S", _cstr(path))
        try:
            _, payload = await conn.expect(b"N")
            await conn.expect(b"A")
            return _parse_stat(payload)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            await conn.close()

    async def mkdir(self, path: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0, parents: bool = True) -> None:
        """Create a directory (and missing parents if ``parents``)."""
        payload = struct.pack(">IIIB", mode, uid, gid, 1 if parents else 0) + _cstr(path)
        await self._simple(b"M", payload)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink or directory (``recursive`` for non-empty ones)."""
        await self._simple(b"U", bytes([1 if recursive else 0]) + _cstr(path))
