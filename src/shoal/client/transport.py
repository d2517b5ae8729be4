"""One multiplexed connection to a node: many concurrent requests, responses matched by id."""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Callable
from typing import Any

from shoal import protocol, tls
from shoal.errors import NodeError, from_wire
from shoal.protocol import Request


def _error(kind: str, message: str) -> Exception:
    return from_wire(kind, message)


class _Call:
    __slots__ = ("future", "on_event", "on_orphan", "abandoned")

    def __init__(self, future: asyncio.Future, on_event: Callable[[Any], None] | None) -> None:
        self.future = future
        self.on_event = on_event
        self.on_orphan: Callable[[Any], None] | None = None
        self.abandoned = False


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        self._reader = reader
        self._writer = writer
        self.address = address
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._closed: BaseException | None = None
        self._reader_task = asyncio.create_task(self._read_loop())
        self.identity: Any = None

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @classmethod
    async def open_unix(cls, path: str) -> Connection:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
        return cls(reader, writer, path)

    @property
    def broken(self) -> bool:
        """The node went away (not closed by us): a new connection may succeed."""
        return self._closed is not None and not isinstance(self._closed, ConnectionAbortedError)

    @classmethod
    async def open_tcp(
        cls,
        host: str,
        port: int,
        token: str | None,
        *,
        tls_context: ssl.SSLContext | None = None,
        tls_ca: str | None = None,
        plaintext_ok: bool = False,
    ) -> Connection:
        """A TCP connection to a node or gateway, authenticated with `token` before anything else.

        With `tls_context` (shoal/tls.py) the connection is TLS and the server's certificate is verified; a
        token is not sent in clear to a host off loopback unless `plaintext_ok` or SHOAL_PLAINTEXT_TOKENS."""
        address = f"{tls.SCHEME_TLS if tls_context else tls.SCHEME_PLAIN}{host}:{port}"
        if tls_context is None and token and not plaintext_ok:
            tls.refuse_plaintext(host, f"client to {address}")
        try:
            reader, writer = await asyncio.open_connection(
                host, port, limit=1 << 24, ssl=tls_context, server_hostname=host if tls_context else None
            )
        except ssl.SSLError as exc:
            raise tls.explain(exc, address, tls_ca) from exc
        conn = cls(reader, writer, address)
        try:
            conn.identity = await conn.call("auth", {"token": token})
        except NodeError as exc:
            await conn.close()
            if tls_context is None and "lost the connection" in str(exc):
                raise NodeError(f"{exc} (if it serves TLS, use shoals://{host}:{port} with its CA)") from exc
            raise
        except BaseException:
            await conn.close()
            raise
        return conn

    async def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[Any], None] | None = None,
        on_orphan: Callable[[Any], None] | None = None,
    ) -> Any:
        """Send one request and wait for its response; cancelling this call cancels it on the node.

        `on_orphan(result)` runs if the node finishes the request after this call was cancelled, so a
        result that nobody awaits (a sandbox created for a cancelled task) can be released.
        """
        if self._closed is not None:
            raise NodeError(f"the connection to the node at {self.address} is closed: {self._closed}")
        request_id = next(self._ids)
        call = _Call(asyncio.get_running_loop().create_future(), on_event)
        self._calls[request_id] = call
        self._writer.write(protocol.encode(Request(id=request_id, op=op, args=args or {})))
        try:
            if self._writer.transport.get_write_buffer_size() > 1 << 20:
                await self._writer.drain()
            return await asyncio.shield(call.future)
        except asyncio.CancelledError:
            if not call.future.done() and self._closed is None:
                call.abandoned = True
                call.on_orphan = on_orphan
                cancel = Request(id=next(self._ids), op="cancel", args={"request_id": request_id})
                self._writer.write(protocol.encode(cancel))
            elif on_orphan and call.future.done() and not call.future.cancelled() and not call.future.exception():
                on_orphan(call.future.result())  # answered, but we were cancelled before resuming: release it
            raise
        finally:
            if not call.abandoned:
                self._calls.pop(request_id, None)

    async def _read_loop(self) -> None:
        try:
            while True:
                body = await protocol.read_frame(self._reader)
                if body is None:
                    raise ConnectionResetError("the node closed the connection")
                response = protocol.decode_response(body)
                call = self._calls.get(response.id)
                if call is None:
                    continue
                if response.event is not None:
                    if call.on_event is not None:
                        call.on_event(response.event)
                    continue
                if call.abandoned:  # the caller was cancelled; the node answered anyway
                    self._calls.pop(response.id, None)
                    if call.on_orphan is not None and response.error is None:
                        call.on_orphan(response.result)
                    continue
                if response.error is not None:
                    call.future.set_exception(_error(response.error.type, response.error.message))
                else:
                    call.future.set_result(response.result)
        except Exception as exc:
            self._closed = exc
            self._fail_calls(NodeError(f"lost the connection to the node at {self.address}: {exc}"))

    def _fail_calls(self, failure: Exception) -> None:
        """Answer every call still waiting with `failure`: no answer can come any more."""
        for call in self._calls.values():
            if not call.future.done() and not call.abandoned:
                call.future.set_exception(failure)
        self._calls.clear()

    async def close(self) -> None:
        """Close the connection; calls still waiting on it fail (a gateway closes a node connection whose
        health poll timed out while other requests were in flight on it: they waited for ever)."""
        if self._closed is None:
            self._closed = ConnectionAbortedError("closed by the client")
        self._reader_task.cancel()
        self._fail_calls(NodeError(f"the connection to the node at {self.address} was closed with this call in flight"))
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except Exception:  # noqa: S110 - closing anyway
            pass
