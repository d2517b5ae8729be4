"""The E2B port's connection protocol: `commands.run`'s Start answered without aiohttp, every other request
handed to aiohttp.

Each `commands.run` is one `POST /process.Process/Start` on a kept-alive HTTP/1.1 connection, and aiohttp's
per-request machinery (its parser's Python objects, the request and response objects, the handler task,
middlewares, routing) cost about as much node CPU as the command's own step (bench/bench_e2b.py). This
protocol owns the connection, reads each request's head itself and:

- a Start in the SDK's one shape (connect.py: Connect JSON, identity encoding, HTTP/1.1) whose key this
  connection has had accepted already (`_e2b_key`, set by the server's middleware) is run here: the same
  `ProcessService.start` and frames as connect.py, written straight to the transport, chunked;
- anything else (the first request of a connection, which establishes its key; control-plane calls; files;
  other RPCs; a Start the fast path does not take) goes, byte for byte, to an aiohttp `RequestHandler` that
  sees the connection through `_HandlerTransport`. The request's end is found from its framing
  (Content-Length or chunked) so the next request can be looked at again; an upgrade, an unknown framing
  or an unparsable head gives the rest of the connection to aiohttp for good.

HTTP/1.1 clients (hyper, httpx, aiohttp's) send a request only once the previous response is complete; a
request that arrives while aiohttp still answers one (pipelining) also gives the connection to aiohttp for
good, so responses always go out in request order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from e2b.envd.process import process_pb

from shoal.e2b.connect import CONTENT_TYPE, MAX_START_BYTES, Context, run_start
from shoal.e2b.envd import ProcessService

START_PATH = "/process.Process/Start"
MAX_HEAD = 64 << 10  # a longer head goes to aiohttp, which answers it (431)
MAX_LINE = 4096  # of a chunk-size or trailer line
IDLE_CLOSE_S = 3630.0  # an idle kept-alive connection is closed after this long (aiohttp's own default)
INFLIGHT = "_e2b_inflight"  # on the connection's transport: requests given to aiohttp and not yet answered
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"

_DATA, _SIZE, _CRLF, _TRAILER, _DONE = range(5)


class FramingError(ValueError):
    pass


class _Body:
    """Where one request's body ends in the connection's bytes (Content-Length or chunked) and, if asked,
    its payload."""

    __slots__ = ("chunked", "left", "line", "state")

    def __init__(self, length: int, chunked: bool) -> None:
        self.chunked = chunked
        self.left = length
        self.line = bytearray()
        self.state = _SIZE if chunked else (_DATA if length else _DONE)

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def feed(self, data: bytearray, out: bytearray | None = None) -> int:
        """How many bytes from the start of `data` belong to this body; its payload is added to `out`."""
        i, n = 0, len(data)
        while i < n and self.state != _DONE:
            if self.state == _DATA:
                take = min(self.left, n - i)
                if out is not None:
                    out += data[i : i + take]
                i += take
                self.left -= take
                if not self.left:
                    self.state = _CRLF if self.chunked else _DONE
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self.line += data[i:]
                if len(self.line) > MAX_LINE:
                    raise FramingError("chunk line too long")
                return n
            line = bytes(self.line + data[i:j]).strip()
            self.line.clear()
            i = j + 1
            if self.state == _SIZE:
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise FramingError(f"bad chunk size {line[:20]!r}") from None
                if size < 0:
                    raise FramingError("bad chunk size")
                self.left, self.state = size, (_DATA if size else _TRAILER)
            elif self.state == _CRLF:
                if line:
                    raise FramingError("chunk data longer than its size")
                self.state = _SIZE
            elif not line:  # the empty line that ends the trailers
                self.state = _DONE
        return i


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:40]!r}")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return method, target, version, headers


def _framing(method: str, version: str, headers: dict[str, str]) -> _Body | None:
    """The body's framing, or None where this protocol does not follow the connection (aiohttp takes it)."""
    if version != "HTTP/1.1" or method == "CONNECT" or "upgrade" in headers:
        return None
    te = headers.get("transfer-encoding")
    if te is not None:
        return _Body(0, True) if te.strip().lower() == "chunked" else None
    length = headers.get("content-length", "0")
    if not length.isdigit():
        return None
    return _Body(int(length), False)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _HandlerTransport(asyncio.Transport):
    """The connection as one aiohttp RequestHandler sees it. Once retired (a later request went elsewhere) it
    neither writes nor closes. Attributes other than its own (netguard's and the server's marks on the
    connection) are the real transport's."""

    __slots__ = ("_real", "_retired", "_front")

    def __init__(self, real: asyncio.Transport, front: FrontProtocol) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_retired", False)
        object.__setattr__(self, "_front", front)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HandlerTransport.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._real, name, value)

    def write(self, data: Any) -> None:
        if not self._retired:
            self._real.write(data)

    def writelines(self, list_of_data: Any) -> None:
        if not self._retired:
            self._real.writelines(list_of_data)

    def write_eof(self) -> None:
        if not self._retired:
            self._real.write_eof()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def close(self) -> None:
        if not self._retired:
            self._real.close()

    def abort(self) -> None:
        if not self._retired:
            self._real.abort()

    def is_closing(self) -> bool:
        return self._retired or self._real.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        if not self._retired:
            self._real.pause_reading()

    def resume_reading(self) -> None:
        if not self._retired:
            self._real.resume_reading()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._real.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._real.get_protocol()


class FrontProtocol(asyncio.Protocol):
    """See the module docstring. `handler_factory`: aiohttp's (web.AppRunner.server)."""

    def __init__(self, service: ProcessService, handler_factory: Callable[[], Any]) -> None:
        self._service = service
        self._factory = handler_factory
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._inner: Any = None  # the current aiohttp RequestHandler
        self._inner_transport: _HandlerTransport | None = None
        self._forwarding: _Body | None = None  # the body of the request aiohttp is being given
        self._passthrough = False  # aiohttp has the connection for good
        self._fast: asyncio.Task | None = None  # a Start being answered here
        self._fast_body: _Body | None = None  # what is left of its request's body
        self._collect: tuple[bytearray, _Body, bytearray, dict[str, str]] | None = None  # raw, body, payload, headers
        self._paused = False
        self._drained: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None  # one timer per connection, not one per request
        self._active = False  # bytes came since the idle timer was set
        self._pending = b""  # bytes for aiohttp held back while a Start here still answers

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._passthrough:
            self._inner.data_received(data)
            return
        self._active = True
        self._buf += data
        try:
            self._pump()
        except (FramingError, ValueError):
            self._give_up()

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        return None

    def pause_writing(self) -> None:
        self._paused = True
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
        if self._inner is not None:
            self._inner.connection_lost(exc)

    # -- routing requests

    def _pump(self) -> None:
        while self._buf:
            if self._forwarding is not None:  # the rest of a request aiohttp is answering
                used = self._forwarding.feed(self._buf)
                chunk = bytes(self._buf[:used])
                del self._buf[:used]
                if chunk:
                    self._inner.data_received(chunk)
                if not self._forwarding.done:
                    return
                self._forwarding = None
                continue
            if self._collect is not None:  # a Start's body, until its one message is whole
                if not self._collect_start():
                    return
                continue
            if self._fast_body is not None:  # what the SDK sends after its Start's message (the body's end)
                used = self._fast_body.feed(self._buf)
                del self._buf[:used]
                if not self._fast_body.done:
                    return
                self._fast_body = None
                continue
            if self._fast is not None or self._busy():
                # a new request while one is still being answered (pipelining): in order, by aiohttp alone
                self._give_up()
                return
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    self._give_up()
                return
            head = bytes(self._buf[: end + 4])
            method, target, version, headers = _parse_head(head)
            body = _framing(method, version, headers)
            if body is None:
                self._give_up()
                return
            del self._buf[: end + 4]
            if method == "POST" and target == START_PATH and self._takes(headers):
                self._collect = (bytearray(head), body, bytearray(), headers)
                continue
            self._forward(head, body)

    def _busy(self) -> bool:
        return bool(getattr(self._transport, INFLIGHT, 0))

    def _takes(self, headers: dict[str, str]) -> bool:
        """A Start in the SDK's shape from a key this connection had accepted (server.py's middleware)."""
        token = headers.get("x-access-token")
        return (
            token is not None
            and token == getattr(self._transport, "_e2b_key", None)
            and headers.get("content-type") == CONTENT_TYPE
            and headers.get("connect-content-encoding", "identity") == "identity"
            and "expect" not in headers
            and "close" not in headers.get("connection", "").lower()
        )

    def _collect_start(self) -> bool:
        """Read the Start's body until its one envelope is whole; then answer it here, or (not the shape the
        fast path takes) give what was read to aiohttp. False: more bytes are needed."""
        assert self._collect is not None
        raw, body, payload, headers = self._collect
        used = body.feed(self._buf, payload)
        raw += self._buf[:used]
        del self._buf[:used]
        if len(payload) < 5:
            if body.done:
                self._collect = None
                self._forward(bytes(raw), body)
            return body.done
        size = int.from_bytes(payload[1:5], "big")
        if payload[0] != 0 or size > MAX_START_BYTES:
            self._collect = None
            self._forward(bytes(raw), body)
            return True
        if len(payload) < 5 + size:
            if body.done:  # the body ended before its message did: connectrpc answers that
                self._collect = None
                self._forward(bytes(raw), body)
            return body.done
        try:
            message = process_pb.StartRequest.from_json(bytes(payload[5 : 5 + size]), ignore_unknown_fields=True)
            timeout = headers.get("connect-timeout-ms")
            timeout_ms = int(timeout) if timeout else None
        except Exception:  # noqa: BLE001 - connectrpc decodes it again and answers with its error
            self._collect = None
            self._forward(bytes(raw), body)
            return True
        self._collect = None
        self._retire()
        self._fast_body = None if body.done else body
        self._fast = asyncio.ensure_future(self._answer(message, headers, timeout_ms))
        self._fast.add_done_callback(self._answered)
        return True

    def _forward(self, raw: bytes, body: _Body) -> None:
        """Give one request (its bytes so far; the rest of its body as it comes) to aiohttp."""
        if self._inner is None:
            self._new_inner()
        assert self._transport is not None
        setattr(self._transport, INFLIGHT, getattr(self._transport, INFLIGHT, 0) + 1)  # until server.py's answer
        self._inner.data_received(raw)
        self._forwarding = None if body.done else body

    def _new_inner(self) -> None:
        assert self._transport is not None
        self._inner_transport = _HandlerTransport(self._transport, self)
        self._inner = self._factory()
        self._inner.connection_made(self._inner_transport)
        if self._paused:
            self._inner.pause_writing()

    def _retire(self) -> None:
        """The current aiohttp handler answered its last request on this connection: let it go."""
        if self._inner is None:
            return
        inner, self._inner = self._inner, None
        assert self._inner_transport is not None
        self._inner_transport._retired = True
        self._inner_transport = None
        inner.connection_lost(None)

    def _give_up(self) -> None:
        """aiohttp takes the connection for good, with what is buffered."""
        self._passthrough = True
        if self._inner is None:
            self._new_inner()
        data, self._buf = bytes(self._buf), bytearray()
        if self._fast is not None and not self._fast.done():
            self._pending = data  # given once the Start here has ended (responses stay in order)
            return
        if data:
            self._inner.data_received(data)

    # -- the fast path

    async def _answer(self, message: Any, headers: dict[str, str], timeout_ms: int | None) -> None:
        started = False

        async def write(frame: bytes) -> None:
            nonlocal started
            data = _chunk(frame)
            if not started:
                data, started = _HEAD + data, True
            await self._write(data)

        with contextlib.suppress(ConnectionError):  # the client went away: the command goes on, detached
            end = await run_start(self._service, message, Context(headers, timeout_ms), write)
            await self._write((b"" if started else _HEAD) + _chunk(end) + b"0\r\n\r\n")

    async def _write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)
        if self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _answered(self, _task: asyncio.Task) -> None:
        self._fast = None
        if self._passthrough:
            data, self._pending = self._pending, b""
            if data:
                self._inner.data_received(data)
            return
        if self._buf:
            try:
                self._pump()
            except (FramingError, ValueError):
                self._give_up()
        if self._idle is None and self._fast is None and self._transport is not None:
            self._active = False
            self._idle = asyncio.get_running_loop().call_later(IDLE_CLOSE_S, self._close_idle)

    def _close_idle(self) -> None:
        """Close a connection nothing came on for IDLE_CLOSE_S (one aiohttp answers has aiohttp's own timer)."""
        self._idle = None
        if self._passthrough or self._transport is None:
            return
        if self._active or self._fast is not None or self._inner is not None:
            self._active = False
            self._idle = asyncio.get_running_loop().call_later(IDLE_CLOSE_S, self._close_idle)
            return
        self._transport.close()
