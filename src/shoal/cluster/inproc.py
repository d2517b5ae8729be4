"""A connection to the node that is a function call: what a service hosted in the node process (the E2B API,
SHOAL_E2B) uses instead of a TCP connection to its own port.

It answers what `client.transport.Connection` answers (`call`, `close`, `closed`, `broken`, `identity`) for
`AsyncClient(connector=...)`, and goes through the same checks as a TCP peer with that token: the token is
authenticated (`ProjectSession`, a project sees only its own sandboxes and is held to its quotas) and each
request is served by the node's dispatcher (`NodeServer.serve_request`: the operation table, argument checks,
metrics). Requests and responses still cross msgpack, so the caller gets exactly the types a socket gives;
what goes is the socket: no frames written and read back, no loopback TCP, no netguard, no extra wakeups.

Cancelling a call cancels its request, as a `cancel` frame does; closing the connection abandons the requests
still running (trajectory.abandon), as a connection that went away does (a logged step finishes, the rest are
cancelled).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from shoal import protocol
from shoal.errors import NodeError, from_wire
from shoal.node.server import NodeServer
from shoal.node.trajectory import abandon
from shoal.protocol import Request, Response


def _roundtrip_request(request: Request) -> Request:
    return protocol.decode_request(protocol.encode(request)[protocol.LENGTH.size :])


def _roundtrip_response(response: Response) -> Response:
    return protocol.decode_response(protocol.encode(response)[protocol.LENGTH.size :])


class InProcessConnection:
    def __init__(self, server: NodeServer, session: Any, address: str) -> None:
        self._server = server
        self._session = session
        self.address = address
        self.identity: Any = None
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Task] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return False  # nothing between the caller and the node can break

    async def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[Any], None] | None = None,
        on_orphan: Callable[[Any], None] | None = None,
    ) -> Any:
        if self._closed:
            raise NodeError(f"the connection to the node at {self.address} is closed")
        request = _roundtrip_request(Request(id=next(self._ids), op=op, args=args or {}))
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        orphaned: list[Callable[[Any], None] | None] = []  # set once the caller has given up

        async def send(message: Response) -> None:
            response = _roundtrip_response(message)
            if response.event is not None:
                if on_event is not None and not orphaned:
                    on_event(response.event)
            elif orphaned:
                if orphaned[0] is not None and response.error is None:
                    orphaned[0](response.result)
            elif future.done():
                pass
            elif response.error is not None:
                future.set_exception(from_wire(response.error.type, response.error.message))
            else:
                future.set_result(response.result)

        task = asyncio.create_task(self._server.serve_request(request, send, self._session))
        self._tasks[request.id] = task
        task.add_done_callback(lambda _t, rid=request.id: self._tasks.pop(rid, None))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                orphaned.append(on_orphan)
                task.cancel()  # as the `cancel` frame a socket client sends
            elif on_orphan and not future.cancelled() and future.exception() is None:
                on_orphan(future.result())  # answered, but we were cancelled before resuming: release it
            raise

    async def close(self) -> None:
        """As a connection that went away: the requests still running are detached and cancelled."""
        self._closed = True
        pending = list(self._tasks.values())
        for task in pending:
            abandon(task)
        await asyncio.gather(*pending, return_exceptions=True)


def connector(
    server: NodeServer, session_factory: Callable[[], Any], address: str
) -> Callable[[str | None], Callable[[], Awaitable[InProcessConnection]]]:
    """`session_factory()` makes a fresh TCP session (cluster/front.py's ProjectSession, unauthenticated).
    `connector(server, ...)(token)` is what `AsyncClient(connector=...)` calls to connect as `token`: an
    in-process connection authenticated with it (a bad token raises AuthenticationError, as `auth` does)."""

    def for_token(token: str | None) -> Callable[[], Awaitable[InProcessConnection]]:
        async def open_connection() -> InProcessConnection:
            session = session_factory()
            identity = await session.serve(Request(id=0, op="auth", args={"token": token}))
            conn = InProcessConnection(server, session, address)
            conn.identity = identity
            return conn

        return open_connection

    return for_token
