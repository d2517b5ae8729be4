"""Wire models shared by the client and the node: serialisable, transport-neutral.

A connection carries length-prefixed msgpack frames. The client sends `Request`s, each with an `id`
unique on the connection; the node answers each with exactly one `Response` carrying the same id, and
before it, for streaming operations, any number of `Event`s with that id. Requests on one connection are
served concurrently.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from shoal.errors import to_wire

log = logging.getLogger("shoal.protocol")

PROTOCOL_VERSION = 1
MAX_FRAME = 256 << 20
LENGTH = struct.Struct(">I")  # a frame's header: the body's length

KINDS = ("function", "container", "microvm", "vm")


UNSET = msgspec.UNSET  # a create argument left out: the node's default applies (e.g. ttl_s)
Unset = msgspec.UnsetType


class SandboxSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything `create` accepts. Fields that only bind at claim time are marked late-bound."""

    kind: str = "container"
    image: str = "debian"
    layers: list[str] = []  # images whose layers stack on top of `image`, bottom first
    # a container's runtime: "crun", "runc", "runsc" or "shoal"; None: the node's default (SHOAL_RUNTIME, by
    # default "auto": shoal's launcher where the host supports it, else crun), which the node writes in here
    runtime: str | None = None
    cpu: float | None = None
    memory_mb: int | None = None
    pids: int | None = 1024
    # ttl_s / idle_timeout_s left unset take the node's defaults (SHOAL_DEFAULT_TTL_S, SHOAL_DEFAULT_IDLE_S);
    # None, sent explicitly, means no limit. UNSET is never sent, so the node tells the two apart.
    ttl_s: float | None | msgspec.UnsetType = msgspec.UNSET
    env: dict[str, str] = {}  # late-bound
    workdir: str | None = None  # late-bound
    labels: dict[str, str] = {}  # late-bound
    files: dict[str, bytes] = {}  # late-bound: written before create returns
    user: str | None = None
    owner: str | None = None
    output_cap_bytes: int | None = None
    pool: bool = True
    network: str | list[str] | dict[str, bool] = "none"  # late-bound: "none", a preset, rules, {"pypi": True}
    disk_mb: int | None = None  # cap on what the sandbox may write (its overlay upper)
    # container: an empty in-memory file system (tmpfs, charged to the sandbox's memory) at each of these
    # absolute paths. The function kind's workers use it for the directories calls write: creating and
    # removing files there costs far less than in the overlay's upper on the host's disk
    tmpfs: list[str] = []
    preimport: list[str] = []  # function kind: modules its warm workers import before forking calls
    idle_timeout_s: float | None | msgspec.UnsetType = msgspec.UNSET  # late-bound: idle this long ends (pauses) it
    on_timeout: str = "kill"  # late-bound: "kill" | "pause", when ttl_s or idle_timeout_s runs out
    trajectory: str | None = None  # late-bound: a name; create() with a live trajectory's name attaches
    record: bool = True  # late-bound: log every step (durably, before its result returns)
    snapshot: str | None = None  # microvm/vm: restore this snapshot (memory + disk) instead of booting
    screen: list[int] | None = None  # [width, height]: start an X display (image 'desktop': 1280x800); []: none

    def pool_key(self) -> str:
        """Sandboxes that differ only in late-bound fields share a warm pool."""
        cpu = "" if self.cpu is None else f"{self.cpu:g}"
        image = "+".join([self.image, *self.layers])
        disk = f":disk={self.disk_mb}" if self.disk_mb else ""
        disk += f":tmpfs={','.join(self.tmpfs)}" if self.tmpfs else ""
        screen = f":screen={self.screen[0]}x{self.screen[1]}" if self.screen else ""
        if self.screen == []:  # no display: not the same sandboxes as the image's default screen
            screen = ":screen=none"
        return f"{self.kind}:{image}:{self.runtime or ''}:cpu={cpu}:mem={self.memory_mb}:pids={self.pids}{disk}{screen}"


class SandboxInfo(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    image: str
    state: str
    labels: dict[str, str]
    created_at: float
    expires_at: float | None = None
    owner: str | None = None
    workdir: str = "/"
    trajectory: str | None = None
    steps: int = 0  # steps in its trajectory log
    last_active_at: float = 0.0
    idle_timeout_s: float | None = None
    on_timeout: str = "kill"
    network: str | list[str] | dict[str, bool] = "none"  # the policy now (set_network changes it)


class ExecRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    sandbox_id: str
    cmd: str | list[str]
    timeout: float | None = None
    idle_timeout: float | None = None
    env: dict[str, str] = {}
    cwd: str | None = None
    user: str | None = None
    stdin: bytes | None = None
    output_cap_bytes: int | None = None
    merge_stderr: bool = False
    stream: bool = False
    seq: int | None = None  # the step's place in the trajectory log (None: append)


class ExecResult(msgspec.Struct, kw_only=True):
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    truncated: bool = False  # the output cap cut bytes out of the middle of stdout or stderr
    signal: int = 0
    oom_killed: bool = False
    stdout_omitted: int = 0  # bytes cut between the kept head and tail (where `cut_marker` stands)
    stderr_omitted: int = 0
    exec_id: int | None = None  # names this exec's leftover processes in processes() / kill_processes()


class HeadTail:
    """One output stream under a cap, kept as the agent keeps it: the first `cap - cap // 2` bytes and the
    last `cap // 2`; `omitted` counts the bytes between (0: nothing cut). A cap of 0 keeps everything."""

    def __init__(self, cap: int) -> None:
        self.head_cap, self.tail_cap = cap - cap // 2, cap // 2
        self.unlimited = cap <= 0
        self.head = bytearray()
        self.tail = bytearray()
        self.omitted = 0

    def feed(self, data: bytes | bytearray) -> None:
        if self.unlimited:
            self.head += data
            return
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            over = len(self.tail) - self.tail_cap
            if over > 0:
                self.omitted += over
                del self.tail[:over]

    def value(self) -> bytes:
        return bytes(self.head + (cut_marker(self.omitted) if self.omitted else b"") + self.tail)


def cut_marker(omitted: int) -> bytes:
    """The line that stands in an over-long output where the cap cut `omitted` bytes between head and tail.

    The cap keeps the start and the end of each stream (a test runner's summary, the reward, comes last).
    """
    return f"\n[... shoal: {omitted} bytes omitted by the output cap ...]\n".encode()


# Keys of a node's status that describe that one node: kept per node under "nodes", not combined.
NODE_IDENTITY = frozenset({"node_id", "pid", "uptime_s", "home", "runtime", "nodes", "unreachable"})


def combine_status(per_node: dict[str, dict[str, Any]], unreachable: dict[str, str]) -> dict[str, Any]:
    """One status for several nodes, shaped like one node's: numbers summed, lists merged, dicts combined.

    A node answers `status` in this shape too (a cluster of one), so code reading `sandboxes`, `states`,
    `pools` or `nodes[...]` works the same against a node and a gateway.
    """
    combined: dict[str, Any] = {}
    nodes = {
        node: {k: v for k, v in status.items() if k not in ("nodes", "unreachable")}
        for node, status in per_node.items()
    }
    for status in nodes.values():
        _merge(combined, {k: v for k, v in status.items() if k not in NODE_IDENTITY})
    return {**combined, "nodes": nodes, "unreachable": dict(unreachable)}


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        old = into.get(key)
        if key not in into:
            into[key] = msgspec.json.decode(msgspec.json.encode(value))  # a copy: later merges must not alias
        elif isinstance(old, bool) or isinstance(value, bool):
            into[key] = bool(old) or bool(value)
        elif isinstance(old, (int, float)) and isinstance(value, (int, float)):
            into[key] = old + value
        elif isinstance(old, list) and isinstance(value, list):
            into[key] = old + [v for v in value if v not in old]
        elif isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif old != value:
            into[key] = None  # the nodes disagree on a single value: see each under "nodes"


def merge_image_lists(lists: Any) -> list[dict[str, Any]]:
    """Several nodes' `image_ls` answers as one, by name; each entry's `nodes` names where it is present."""
    merged: dict[str, dict[str, Any]] = {}
    for listing in lists:
        for entry in listing:
            held = merged.setdefault(entry["name"], {**entry, "nodes": []})
            held["nodes"] = sorted({*held["nodes"], *entry.get("nodes", [])})
    return [merged[name] for name in sorted(merged)]


class OutputChunk(msgspec.Struct, kw_only=True):
    stream: str  # "stdout" | "stderr"
    data: bytes


class FileEntry(msgspec.Struct, kw_only=True):
    name: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float
    target: str = ""


class Request(msgspec.Struct, kw_only=True):
    id: int
    op: str
    args: dict[str, Any] = {}


class ErrorInfo(msgspec.Struct, kw_only=True):
    type: str
    message: str


class Response(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int
    result: Any = None
    error: ErrorInfo | None = None
    event: Any = None  # set on streaming events; the final frame has event=None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_response_decoder = msgspec.msgpack.Decoder(Response)


def encode(message: msgspec.Struct) -> bytes:
    """One frame: 4-byte big-endian length, then msgpack."""
    body = _encoder.encode(message)
    return LENGTH.pack(len(body)) + body


def decode_request(body: bytes) -> Request:
    return _request_decoder.decode(body)


def decode_response(body: bytes) -> Response:
    return _response_decoder.decode(body)


def error_response(request: Request, exc: BaseException) -> Response:
    """The response to a request that raised `exc`: the one exception-to-wire mapping (errors.to_wire);
    an unexpected exception (a bug) is logged with its traceback."""
    kind, message, expected = to_wire(exc)
    if not expected:
        log.error("operation %s failed", request.op, exc_info=exc)
    return Response(id=request.id, error=ErrorInfo(type=kind, message=message))


def to_builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def convert(value: Any, type_: Any) -> Any:
    return msgspec.convert(value, type_, strict=False)


async def read_frame(reader, max_frame: int = MAX_FRAME) -> bytes | None:  # type: ignore[no-untyped-def]
    """Read one frame body from an asyncio StreamReader; None at a clean end of stream."""
    length = await read_header(reader)
    if length is None:
        return None
    if length > max_frame:
        raise ValueError(f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    return await reader.readexactly(length)


async def read_header(reader) -> int | None:  # type: ignore[no-untyped-def]
    """The next frame's length; None at a clean end of stream. Cancelling it consumes nothing."""
    try:
        header = await reader.readexactly(4)
    except Exception as exc:  # IncompleteReadError at EOF, ConnectionResetError
        if getattr(exc, "partial", b"") == b"" or isinstance(exc, ConnectionError):
            return None
        raise
    return LENGTH.unpack(header)[0]


async def _read_guarded(reader: Any, guard: Any, busy: Callable[[], bool]) -> bytes | None:
    """One frame under a netguard.ConnectionGuard: before authentication small and before the deadline;
    after it, none at all for idle_timeout_s with nothing in flight ends the connection (None)."""
    limits = guard.limits
    loop = asyncio.get_running_loop()
    if not guard.authenticated:
        async with asyncio.timeout_at(loop.time() + guard.auth_deadline - time.monotonic()):
            return await read_frame(reader, limits.preauth_frame)
    while True:
        try:
            async with asyncio.timeout(limits.idle_timeout_s):  # re-armed while requests run
                length = await read_header(reader)
        except TimeoutError:
            if busy():
                continue
            return None
        if length is None:
            return None
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
        await guard.reserve(length)  # held until the request ends (dispatch_requests), or released here
        try:
            return await reader.readexactly(length)
        except BaseException:
            guard.unreserve(length)
            raise


def _nothing() -> None:
    pass


async def dispatch_requests(
    reader: Any,
    serve: Callable[[Request], Awaitable[None]],
    *,
    after_each: Callable[[], Awaitable[None]] | None = None,
    abandon: Callable[[asyncio.Task], None] | None = None,
    guard: Any = None,
    takeover: frozenset[str] = frozenset(),
) -> None:
    """Serve one connection's requests until the peer goes: each runs as its own task, a `cancel` request
    cancels an earlier one, and on the way out whatever still runs is cancelled (or handed to `abandon`, which
    decides) and awaited. Shared by the node and the gateway.

    With a `guard` (a TCP peer, see shoal.netguard) requests before authentication are small, served one at
    a time and must come before the auth deadline; an idle authenticated connection is closed."""
    tasks: dict[int, asyncio.Task] = {}
    try:
        while True:
            release: Callable[[], None] = _nothing
            if guard is None:
                body = await read_frame(reader)
            elif not guard.check_authenticated():
                try:
                    body = await _read_guarded(reader, guard, lambda: bool(tasks))
                except TimeoutError:
                    log.debug("closing a connection from %s that did not authenticate in time", guard.peer)
                    break
                if body is None:
                    break
                await serve(decode_request(body))  # one at a time until the peer has shown a token
                continue
            else:
                body = await _read_guarded(reader, guard, lambda: bool(tasks))
                if body is not None:  # its bytes count against the peer's budget until its request ends
                    release = functools.partial(guard.unreserve, len(body))
            if body is None:
                break
            try:
                request = decode_request(body)
            except BaseException:
                release()
                raise
            if request.op == "cancel":  # the client gave up on an earlier request
                release()
                victim = tasks.get(int(request.args.get("request_id", -1)))
                if victim is not None:
                    victim.cancel()
                continue
            if request.op in takeover and not tasks:
                release()
                await serve(request)
                break
            task = asyncio.create_task(serve(request))
            tasks[request.id] = task
            task.add_done_callback(lambda _t, rid=request.id: tasks.pop(rid, None))
            task.add_done_callback(lambda _t, release=release: release())
            if after_each is not None:
                await after_each()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    except Exception as exc:  # an unauthenticated peer's junk is not worth a log line each (log floods)
        level = logging.DEBUG if guard is not None and not guard.authenticated else logging.WARNING
        log.log(level, "dropping a connection after a malformed frame: %s", exc)
    finally:
        pending = list(tasks.values())
        for task in pending:
            if abandon is not None:
                abandon(task)  # it decides: cancel the task, or let it finish
            else:
                task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
