"""HTTP and websocket traffic to a port inside a sandbox, relayed through a node's or gateway's HTTP port.

`sb.expose(port)` answers a URL `<base>/ports/<sandbox_id>/<port>.<key>/`; a request to it (any method,
a websocket upgrade too) is relayed byte for byte to 127.0.0.1:<port> inside the sandbox by the guest agent
(agent.c 'F'), so the sandbox's network policy stays shut. Three ways to say which sandbox port and why the
caller may reach it, all read from the request head only:

- `/ports/<id>/<port>.<key>/rest`: the key that `expose` answered (derived from the node's secret, the
  sandbox and the port; it dies with the sandbox). The sandbox sees `/rest`.
- `/ports/<id>/<port>/rest` with `Authorization: Bearer <token>`: a token of the sandbox's project (or the
  cluster's). The sandbox sees `/rest`; the header is not passed on.
- `Authorization: Basic` with user `<port>-<id>.<key>` (a URL `http://<port>-<id>.<key>@host:port/`, what the
  E2B layer's `get_host` gives: no wildcard DNS needed), any path, passed on unchanged; the key opens
  every port of that sandbox (E2B's traffic token does the same).

With `Upgrade: shoal-tcp` (client/ports.py: `sb.open_tcp`, `sb.forward`) the relay answers 101 and the
connection then carries the port's raw bytes (any TCP protocol), nothing sent to the port first.

Anything else goes to the HTTP server behind (aiohttp's protocol) untouched: `Demux` sits in front of it
at the protocol level, so one port serves both and TLS (terminated before it) covers both. A relayed
request gets `Connection: close` (unless it upgrades): the next request on a kept-alive connection would
carry the prefix again, so the client opens a new connection for it instead.

This module sits at the bottom with netguard: it imports nothing from node or cluster; the node and the
gateway hand it `open_tunnel(target)`, which authorises and opens the byte stream.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("shoal.ports")

MAX_HEAD = 64 << 10  # a request head larger than this is not ours: the HTTP server behind answers it
PREFIX = b"/ports/"
_CHUNK = 1 << 16
_BASIC_USER = re.compile(r"^(\d{1,5})-(.+)\.([0-9a-f]{16,64})$")
RAW_UPGRADE = b"shoal-tcp"  # client/ports.py: a raw TCP stream instead of an HTTP request
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"authorization"}


@dataclass
class Target:
    """Which sandbox port a request asks for, and what it shows to be let in."""

    sandbox_id: str
    port: int
    key: str | None = None  # the expose key (per port) or the sandbox-wide key (Basic form)
    token: str | None = None  # a Bearer token
    head: bytes = b""  # the request head to send on (rewritten)
    peer: str = ""  # the client's address
    secure: bool = False  # it came over TLS
    raw: bool = False  # `Upgrade: shoal-tcp`: answered 101, then raw bytes (no HTTP sent to the port)


class RelayError(Exception):
    """A refusal with its HTTP status (sent as a JSON error, like the HTTP API's)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def port_key(secret: bytes, sandbox_id: str, port: int | None) -> str:
    """The key for one port of a sandbox (port None: the sandbox-wide key, every port)."""
    sandbox_key = hmac.new(secret, f"sandbox:{sandbox_id}".encode(), hashlib.sha256).hexdigest()[:32]
    if port is None:
        return sandbox_key
    return hmac.new(sandbox_key.encode(), f"port:{port}".encode(), hashlib.sha256).hexdigest()[:24]


def check_key(secret: bytes, target: Target) -> bool:
    """Does the target's key open its port (a per-port key, or the sandbox-wide one)?"""
    if not target.key:
        return False
    return any(
        hmac.compare_digest(target.key, port_key(secret, target.sandbox_id, port)) for port in (target.port, None)
    )


def parse(head: bytes) -> Target | None:
    """The target of a request head (up to and including the blank line), None if it is not for a port.
    Raises RelayError for a port request that is malformed."""
    lines = head.split(b"\r\n")
    try:
        method, uri, version = lines[0].split(b" ")
    except ValueError:
        return None
    headers = [line for line in lines[1:] if line]
    auth = next((h.partition(b":")[2].strip() for h in headers if h[:14].lower() == b"authorization:"), b"")
    scheme, _, value = auth.partition(b" ")
    if uri.startswith(PREFIX):
        path, query = uri.partition(b"?")[::2]
        parts = path[len(PREFIX) :].split(b"/", 2)
        if len(parts) < 2 or not parts[0]:
            raise RelayError(400, "InvalidRequestError", "a port URL is /ports/<sandbox_id>/<port>[.<key>]/...")
        port_text, _, key = parts[1].decode("latin-1").partition(".")
        rest = b"/" + (parts[2] if len(parts) > 2 else b"")
        target = Target(parts[0].decode("latin-1"), _port(port_text), key or None)
        if scheme.lower() == b"bearer":
            target.token = value.strip().decode("latin-1") or None
        target.head = _rewrite(method, rest + (b"?" + query if query else b""), version, headers)
        target.raw = any(h[:8].lower() == b"upgrade:" and h[8:].strip().lower() == RAW_UPGRADE for h in headers)
        return target
    if scheme.lower() == b"basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        match = _BASIC_USER.match(user)
        if match is None or password:
            return None  # not ours (SandboxFusion's clients send their token as a Basic password)
        target = Target(match.group(2), _port(match.group(1)), match.group(3))
        target.head = _rewrite(method, uri, version, headers)
        return target
    return None


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RelayError(400, "InvalidRequestError", f"port {text!r} is not a port number (1-65535)")
    return int(text)


def _rewrite(method: bytes, uri: bytes, version: bytes, headers: list[bytes]) -> bytes:
    upgrade = any(h[:8].lower() == b"upgrade:" for h in headers)
    kept = [h for h in headers if h.partition(b":")[0].strip().lower() not in _HOP]
    if upgrade:  # websockets: the Connection header says Upgrade and must stay
        kept += [h for h in headers if h[:11].lower() == b"connection:"]
    else:
        kept.append(b"Connection: close")
    return b"\r\n".join([b" ".join((method, uri, version)), *kept]) + b"\r\n\r\n"


def error_head(status: int, kind: str, message: str) -> bytes:
    body = json.dumps({"error": kind, "message": message}).encode()
    reason = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found"}.get(status, "Bad Gateway")
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
OpenTunnel = Callable[[Target], Awaitable[Stream]]


async def pipe(a: Stream, b: Stream) -> None:
    """Copy bytes both ways until both directions ended (an EOF is passed on as a half-close), then close."""

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            writer.close()  # a broken side ends the other direction too

    try:
        await asyncio.gather(one(a[0], b[1]), one(b[0], a[1]))
    finally:
        for _, writer in (a, b):
            writer.close()


class Demux(asyncio.Protocol):
    """Reads a connection's first request head and either relays the connection to a sandbox port or hands
    it, bytes so far included, to `inner` (the HTTP server's protocol)."""

    def __init__(self, inner: Callable[[], asyncio.Protocol] | None, open_tunnel: OpenTunnel) -> None:
        self.make_inner = inner
        self.open_tunnel = open_tunnel
        self.transport: Any = None
        self.buffer = b""
        self.delegate: asyncio.BaseProtocol | None = None
        self.task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.delegate is not None:
            self.delegate.data_received(data)  # type: ignore[attr-defined]
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 and len(self.buffer) <= MAX_HEAD:
            return
        try:
            target = parse(self.buffer[: end + 4]) if end >= 0 else None
        except RelayError as exc:
            self._refuse(exc)
            return
        if target is None:
            self._hand_over()
        else:
            self._relay(target, self.buffer[end + 4 :])

    def _refuse(self, exc: RelayError) -> None:
        self.delegate = asyncio.Protocol()  # swallow the rest
        self.transport.write(error_head(exc.status, exc.kind, str(exc)))
        self.transport.close()

    def _hand_over(self) -> None:
        if self.make_inner is None:
            self._refuse(RelayError(404, "NotFoundError", "this port serves only /ports/<sandbox_id>/<port>.<key>/"))
            return
        inner = self.make_inner()
        self.delegate = inner
        inner.connection_made(self.transport)
        data, self.buffer = self.buffer, b""
        inner.data_received(data)

    def _relay(self, target: Target, rest: bytes) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_HEAD, loop=loop)
        proto = asyncio.StreamReaderProtocol(reader, loop=loop)
        proto.connection_made(self.transport)
        self.delegate = proto
        self.buffer = b""
        if rest:
            reader.feed_data(rest)
        writer = asyncio.StreamWriter(self.transport, proto, reader, loop)
        peer = self.transport.get_extra_info("peername")
        target.peer = peer[0] if isinstance(peer, tuple) else ""
        target.secure = self.transport.get_extra_info("sslcontext") is not None
        self.task = loop.create_task(self._run(target, (reader, writer)))

    async def _run(self, target: Target, client: Stream) -> None:
        try:
            upstream = await self.open_tunnel(target)
        except Exception as exc:  # every failure is this request's error answer
            log.debug("port relay to %s:%d failed", target.sandbox_id, target.port, exc_info=True)
            refusal = status_of(exc)
            client[1].write(error_head(refusal.status, refusal.kind, str(refusal)))
            client[1].close()
            return
        self.transport._shoal_authenticated = True  # past netguard's first-request deadline
        if target.raw:
            client[1].write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: shoal-tcp\r\nConnection: Upgrade\r\n\r\n")
        else:
            upstream[1].write(target.head)
        await pipe(client, upstream)

    def eof_received(self) -> bool | None:
        if self.delegate is not None:
            return self.delegate.eof_received()  # type: ignore[attr-defined]
        return None

    def pause_writing(self) -> None:
        if self.delegate is not None:
            self.delegate.pause_writing()

    def resume_writing(self) -> None:
        if self.delegate is not None:
            self.delegate.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.delegate is not None:
            self.delegate.connection_lost(exc)
        if self.task is not None and not self.task.done():
            self.task.cancel()


def status_of(exc: BaseException) -> RelayError:
    """A refusal for an exception the tunnel's opener raised (its class name decides the status)."""
    if isinstance(exc, RelayError):
        return exc
    if isinstance(exc, ConnectionRefusedError):
        return RelayError(502, "ConnectionRefusedError", str(exc))
    names = {cls.__name__ for cls in type(exc).__mro__}
    for name, status in (("AuthenticationError", 401), ("NotFoundError", 404), ("InvalidRequestError", 400)):
        if name in names:
            return RelayError(status, type(exc).__name__, str(exc))
    return RelayError(502, type(exc).__name__, str(exc))


async def serve_loopback(
    open_tunnel: OpenTunnel, host: str = "127.0.0.1", inner: Callable[[], asyncio.Protocol] | None = None
) -> tuple[asyncio.AbstractServer, int]:
    """A relay listener (a node without SHOAL_HTTP; `inner` serves what is not a port request); returns it
    and its port."""

    def factory() -> asyncio.Protocol:
        return Demux(inner, open_tunnel)

    server = await asyncio.get_running_loop().create_server(factory, host, 0)
    return server, server.sockets[0].getsockname()[1]
