"""What stands between a TCP port and a peer that has not (yet) shown a token.

Nodes (cluster/front.py), gateways (cluster/gateway.py) and the gateway's HTTP API (cluster/http.py) accept
connections from anyone who can reach the port; before this module a peer without a token could make them
buffer 256 MiB frames, hold connections forever (until the fd limit locked real clients out) and flood the
log with EMFILE lines. So every TCP listener here goes through `serve_tcp`, which

- caps connections per peer address (`max_per_peer`, authenticated or not) and unauthenticated connections
  per peer and in total (`max_preauth_per_peer`, `max_preauth`): a connection over a cap is closed at once;
- backs off when the process is out of file descriptors (EMFILE/ENFILE/ENOBUFS/ENOMEM) instead of spinning,
  logging once per episode (and once when it recovers);
- hands the handler a `ConnectionGuard`, which `protocol.dispatch_requests` consults: before authentication
  a frame may be at most `preauth_frame` bytes, requests are served one at a time, and the token must come
  within `auth_timeout_s`; after it, a connection with nothing in flight and no frame for `idle_timeout_s`
  is closed (the client reopens it on its next request);
- holds each peer address to `inflight_bytes` of request frames read and not yet answered (`PeerBudget`):
  past it, that peer's next frame is not read until earlier requests end, so a token holder cannot make the
  process buffer 256 MiB frames on each of its 1024 connections; TCP's own flow control then slows the peer.

Settings come from the environment (`Limits.from_env`, documented in docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shoal import settings

log = logging.getLogger("shoal.netguard")

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class Limits:
    preauth_frame: int = 16 << 10  # bytes: an auth request is a token, not a file
    auth_timeout_s: float = 10.0  # a peer must authenticate this soon after connecting
    idle_timeout_s: float = 900.0  # an authenticated connection with nothing in flight is closed after this
    max_per_peer: int = 1024  # connections from one address, authenticated or not
    max_preauth_per_peer: int = 32  # unauthenticated connections from one address
    max_preauth: int = 1024  # unauthenticated connections in total
    reader_limit: int = 1 << 16  # StreamReader buffer high-water mark (reading pauses above twice this)
    inflight_bytes: int = 1 << 30  # request bytes one peer may have read and not yet answered

    @classmethod
    def from_env(cls) -> Limits:
        return cls(
            preauth_frame=settings.PREAUTH_FRAME.get(),
            auth_timeout_s=settings.AUTH_TIMEOUT_S.get(),
            idle_timeout_s=settings.CONN_IDLE_TIMEOUT_S.get(),
            max_per_peer=settings.MAX_CONN_PER_PEER.get(),
            max_preauth_per_peer=settings.MAX_PREAUTH_PER_PEER.get(),
            max_preauth=settings.MAX_PREAUTH.get(),
            inflight_bytes=settings.PEER_INFLIGHT_MB.get() << 20,
        )


class PeerBudget:
    """Bytes of request frames each peer address has in flight (read, and the request not yet ended).

    `acquire` waits while the peer's bytes plus the new frame's would pass the limit, except when the peer
    has nothing in flight (a frame larger than the limit alone still goes through, one at a time), so a
    peer can always make progress; `release` wakes the peer's waiters."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: collections.Counter[str] = collections.Counter()
        self._waiters: dict[str, list[asyncio.Future]] = collections.defaultdict(list)

    async def acquire(self, peer: str, size: int) -> None:
        while self.held[peer] and self.held[peer] + size > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[peer].append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters.get(peer, ()):
                    self._waiters[peer].remove(waiter)
        self.held[peer] += size

    def release(self, peer: str, size: int) -> None:
        self.held[peer] -= size
        if self.held[peer] <= 0:
            del self.held[peer]
        for waiter in self._waiters.pop(peer, []):
            if not waiter.done():
                waiter.set_result(None)


class ConnectionGuard:
    """One accepted connection's standing: counted against its peer's caps until it closes."""

    def __init__(self, listener: Listener, peer: str) -> None:
        self.listener = listener
        self.limits = listener.limits
        self.peer = peer
        self.opened = time.monotonic()
        self.auth_deadline = self.opened + self.limits.auth_timeout_s
        self.authenticated = False
        self.tls = listener.ssl is not None  # plain TCP: tokens only from loopback peers (shoal/tls.py)
        # set by the handler: does the session now hold an identity? (checked after each pre-auth request)
        self.is_authenticated: Callable[[], bool] = lambda: False

    async def reserve(self, size: int) -> None:
        """Wait until this peer may have `size` more request bytes in flight; `unreserve` when that ends."""
        await self.listener.budget.acquire(self.peer, size)

    def unreserve(self, size: int) -> None:
        self.listener.budget.release(self.peer, size)

    def check_authenticated(self) -> bool:
        if not self.authenticated and self.is_authenticated():
            self.authenticated = True
            self.listener._promote(self)
        return self.authenticated

    def release(self) -> None:
        self.listener._release(self)


def mark_authenticated(transport: asyncio.BaseTransport | None) -> None:
    """An HTTP request on `transport` carried an accepted token: the connection leaves the first-request
    deadline (and the unauthenticated caps). Only a valid token may do this: a public or refused request
    must not, or a peer without a token could send one and then drip the next request's headers for ever
    (aiohttp has no header timeout)."""
    if transport is not None:
        transport._shoal_authenticated = True  # type: ignore[attr-defined]


class _Watched(asyncio.Protocol):
    """Passes everything to `inner` (an HTTP server's protocol) and resolves `closed` when the connection ends."""

    def __init__(self, inner: asyncio.Protocol, closed: asyncio.Future) -> None:
        self.inner = inner
        self.closed = closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            self.inner.connection_lost(exc)
        finally:
            if not self.closed.done():
                self.closed.set_result(None)


class Listener:
    """A listening TCP socket served by our own accept loop (see the module docstring)."""

    def __init__(
        self,
        handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter, ConnectionGuard], Awaitable[None]] | None,
        sock: socket.socket,
        limits: Limits,
        name: str,
        protocol_factory: Callable[[], asyncio.BaseProtocol] | None = None,
        ssl: Any = None,
    ) -> None:
        self.handle = handle
        self.ssl = ssl
        self.protocol_factory = protocol_factory
        self.sock = sock
        self.sockets = [sock]
        self.limits = limits
        self.name = name
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.budget = PeerBudget(limits.inflight_bytes)
        self.preauth_per_peer: collections.Counter[str] = collections.Counter()
        self.preauth = 0
        self.refused = 0  # connections closed at once for being over a cap
        self.starved = 0  # accept() calls that failed for want of file descriptors
        self._tasks: set[asyncio.Task] = set()
        self._accepting = asyncio.create_task(self._accept_loop())

    # -- accounting

    def _admit(self, peer: str) -> ConnectionGuard | None:
        lim = self.limits
        if (
            self.per_peer[peer] >= lim.max_per_peer
            or self.preauth_per_peer[peer] >= lim.max_preauth_per_peer
            or self.preauth >= lim.max_preauth
        ):
            self.refused += 1
            if self.refused in (1, 10, 100, 1000) or self.refused % 10000 == 0:
                log.warning(
                    "%s: refused %d connection(s) over the per-peer caps (latest from %s: %d open, %d unauthenticated)",
                    self.name, self.refused, peer, self.per_peer[peer], self.preauth_per_peer[peer],
                )  # fmt: skip
            return None
        self.per_peer[peer] += 1
        self.preauth_per_peer[peer] += 1
        self.preauth += 1
        return ConnectionGuard(self, peer)

    def _promote(self, guard: ConnectionGuard) -> None:
        self._drop_preauth(guard.peer)

    def _drop_preauth(self, peer: str) -> None:
        self.preauth -= 1
        self.preauth_per_peer[peer] -= 1
        if self.preauth_per_peer[peer] <= 0:
            del self.preauth_per_peer[peer]

    def _release(self, guard: ConnectionGuard) -> None:
        if not guard.authenticated:
            self._drop_preauth(guard.peer)
            guard.authenticated = True  # released once
        if guard.peer in self.per_peer:
            self.per_peer[guard.peer] -= 1
            if self.per_peer[guard.peer] <= 0:
                del self.per_peer[guard.peer]

    # -- accepting

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        delay = 0.0
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EAGAIN):
                        continue
                    raise
                self.starved += 1
                if delay == 0.0:
                    log.error(
                        "%s: out of file descriptors or memory accepting connections (%s): backing off; "
                        "raise the fd limit (ulimit -n) or lower SHOAL_MAX_CONN_PER_PEER",
                        self.name, exc.strerror,
                    )  # fmt: skip
                delay = min(1.0, max(0.01, delay * 2))
                await asyncio.sleep(delay)
                continue
            if delay:
                log.warning("%s: accepting connections again (%d accept(s) failed meanwhile)", self.name, self.starved)
                delay = 0.0
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            guard = self._admit(peer)
            if guard is None:
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn, guard))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, guard: ConnectionGuard) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        if self.protocol_factory is not None:  # an HTTP server: it gets the socket; we watch the deadline
            await self._serve_protocol(conn, guard)
            return
        assert self.handle is not None
        try:
            reader = asyncio.StreamReader(limit=self.limits.reader_limit, loop=loop)
            proto = asyncio.StreamReaderProtocol(reader, loop=loop)
            transport, _ = await loop.connect_accepted_socket(lambda: proto, conn, **self._tls_args())
        except (OSError, TimeoutError):  # includes a failed TLS handshake (ssl.SSLError is an OSError)
            guard.release()
            conn.close()
            return
        writer = asyncio.StreamWriter(transport, proto, reader, loop)
        try:
            await self.handle(reader, writer, guard)
        except Exception:
            log.exception("%s: connection handler failed", self.name)
        finally:
            guard.release()
            writer.close()

    async def _serve_protocol(self, conn: socket.socket, guard: ConnectionGuard) -> None:
        loop = asyncio.get_running_loop()
        closed = loop.create_future()
        factory = self.protocol_factory
        assert factory is not None

        def make() -> asyncio.BaseProtocol:
            return _Watched(factory(), closed)

        try:
            transport, proto = await loop.connect_accepted_socket(make, conn, **self._tls_args())
        except (OSError, TimeoutError):
            guard.release()
            conn.close()
            return
        guard.is_authenticated = lambda: getattr(transport, "_shoal_authenticated", False)
        try:
            remaining = guard.auth_deadline - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(closed), max(0.0, remaining))
            except TimeoutError:
                if not guard.check_authenticated():
                    transport.abort()
                await closed
        finally:
            guard.release()

    def _tls_args(self) -> dict[str, Any]:
        """TLS (if configured): the handshake must end within the auth timeout, like the token."""
        if self.ssl is None:
            return {}
        return {"ssl": self.ssl, "ssl_handshake_timeout": max(0.1, self.limits.auth_timeout_s)}

    def close(self) -> None:
        """Stop accepting; connections already open go on until they end (like asyncio.Server.close)."""
        self._accepting.cancel()
        self.sock.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(self._accepting, return_exceptions=True)


async def serve_tcp(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter, ConnectionGuard], Awaitable[None]] | None,
    host: str,
    port: int,
    *,
    name: str,
    limits: Limits | None = None,
    protocol_factory: Callable[[], Any] | None = None,
    ssl: Any = None,
) -> Listener:
    """Listen on host:port (port 0: any free one) and serve each admitted connection with
    `handle(reader, writer, guard)`, or with `protocol_factory()` (an HTTP server's protocol); with `ssl`
    (an ssl.SSLContext, shoal/tls.py) every connection is TLS."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(4096)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return Listener(handle, sock, limits or Limits.from_env(), name, protocol_factory, ssl)
