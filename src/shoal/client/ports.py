"""Raw TCP to a port inside a sandbox, over the relay that serves `sb.expose` URLs (shoal/portrelay.py).

A request to the expose URL with `Upgrade: shoal-tcp` is answered `101 Switching Protocols` and from then on
the connection carries the port's bytes both ways, unchanged (no HTTP to the sandbox). `forward` listens on a
local port and does that for each connection it accepts, so any TCP client (a database driver, ssh, redis-cli)
reaches the sandbox's port as 127.0.0.1:<local port>.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.parse
from typing import Any

from shoal.errors import ShoalError

UPGRADE = "shoal-tcp"


async def open_tcp(
    url: str, context: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A byte stream to the port an expose URL names."""
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    reader, writer = await asyncio.open_connection(
        parts.hostname, parts.port or (443 if secure else 80), ssl=(context or True) if secure else None,
        limit=1 << 20,
    )  # fmt: skip
    try:
        writer.write(
            f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: {UPGRADE}\r\n"
            "Connection: Upgrade\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
        if status != b"101":
            body = await asyncio.wait_for(reader.read(4096), 10)
            raise ShoalError(f"the relay at {parts.netloc} refused a TCP stream: {head.splitlines()[0]!r} {body!r}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _pipe(a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            writer.close()

    try:
        await asyncio.gather(one(a[0], b[1]), one(b[0], a[1]))
    finally:
        a[1].close()
        b[1].close()


class PortForward:
    """A local listener whose every connection is a raw TCP stream to a port inside a sandbox."""

    def __init__(self, url: str, context: ssl.SSLContext | None) -> None:
        self.url = url
        self.context = context
        self.server: asyncio.AbstractServer | None = None
        self.address = ""  # "127.0.0.1:<port>" once started
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> PortForward:
        self.server = await asyncio.start_server(self._serve, host, port)
        bound = self.server.sockets[0].getsockname()
        self.address = f"{bound[0]}:{bound[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            upstream = await open_tcp(self.url, self.context)
        except (OSError, ShoalError, asyncio.IncompleteReadError):
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await _pipe((reader, writer), upstream)
        finally:
            self._tasks.discard(task)

    async def close(self) -> None:
        """Stop listening and cut the connections it carries."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks, return_exceptions=True)
