"""The node's transport: length-prefixed msgpack requests over a stream socket (Unix here; TCP later).

Each request runs as its own task, so one connection carries many concurrent operations; a request whose
connection goes away is cancelled (an exec's process tree is then killed by the agent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from shoal import ops, portrelay, protocol
from shoal.errors import AuthenticationError, InvalidRequestError, SandboxNotFoundError
from shoal.node import trajectory
from shoal.node.service import NodeService
from shoal.protocol import Request, Response

log = logging.getLogger("shoal.server")
PORT_CONNECT = "port_connect"  # not an operation of the table: it turns its connection into a byte stream


class _Op:
    """An entry of the operation table bound to the NodeService method that implements it."""

    def __init__(self, spec: ops.Op, method: Callable[..., Any]) -> None:
        self.spec = spec
        self.method = method
        self.streams = spec.streams

    def arguments(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.spec.kwargs(args)


class NodeServer:
    def __init__(self, service: NodeService) -> None:
        self.service = service
        self.ops = {name: _Op(ops.OPS[name], getattr(service, name)) for name in ops.NODE_OPS}
        self.connections = 0
        # called as observer(op, seconds, error_type_or_None) after each request (metrics)
        self.observers: list[Callable[[str, float, str | None], None]] = []

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Any = None, guard: Any = None
    ) -> None:
        """Serve one connection. `session` (TCP: a token-authenticated project, see cluster/front.py) wraps each
        request: `session.serve(request)` answers its own ops (`session.ops`), `session.call(op, args,
        invoke)` checks and rewrites the others around `invoke(args)`. `guard` (shoal.netguard) holds a TCP peer
        to its pre-auth and idle limits."""
        self.connections += 1
        lock = asyncio.Lock()

        async def send(message: Response) -> None:
            writer.write(protocol.encode(message))
            if writer.transport.get_write_buffer_size() > 1 << 20:
                async with lock:
                    await writer.drain()

        try:
            # a logged step whose client is gone finishes and is logged; other requests are cancelled

            async def serve(request: Request) -> None:
                if request.op == PORT_CONNECT:
                    await self._port_connect(request, (reader, writer), send, session)
                else:
                    await self._serve(request, send, session)

            await protocol.dispatch_requests(
                reader, serve, abandon=trajectory.abandon, guard=guard, takeover=frozenset({PORT_CONNECT})
            )
        finally:
            self.connections -= 1
            writer.close()

    async def _port_connect(
        self, request: Request, client: portrelay.Stream, send: Callable[[Response], Any], session: Any
    ) -> None:
        """`port_connect {sandbox_id, port, key?}`: answer, then carry this connection's bytes to the port inside
        the sandbox (a gateway's HTTP relays sb.expose URLs this way). Allowed with the port's key, or for the
        sandbox's project (a project token, or the cluster naming `_project`), or for the cluster or the Unix
        socket (both trusted)."""
        try:
            args = dict(request.args)
            target = portrelay.Target(str(args.get("sandbox_id")), int(args.get("port") or 0), args.get("key"))
            if session is not None:
                if session.identity is None:
                    raise AuthenticationError("not authenticated: port_connect comes after auth")
                project = args.get("_project") if session.identity.cluster else session.identity.project
                if target.key is not None:
                    if not self.service.ports.key_opens(target):
                        raise AuthenticationError(f"the key does not open port {target.port} of {target.sandbox_id}")
                elif project is not None and session.projects.owner(target.sandbox_id) not in (None, project):
                    node = self.service.settings.node_id
                    raise SandboxNotFoundError(f"no sandbox {target.sandbox_id} on node {node} in project {project!r}")
            upstream = await self.service.open_port(target.sandbox_id, target.port)
        except Exception as exc:  # this request's error answer; the connection ends with it
            await send(protocol.error_response(request, exc))
            return
        await send(Response(id=request.id, result={"port": target.port}))
        await portrelay.pipe(client, upstream)

    async def serve_request(self, request: Request, send: Callable[[Response], Any], session: Any = None) -> None:
        """Answer one request through `send` (its events, then its response), as for a request read from a
        connection: an in-process caller (cluster/inproc.py) skips the socket, not the checks."""
        await self._serve(request, send, session)

    def _local_identity(self) -> dict[str, Any]:
        """`auth` on the Unix socket: whoever can open it is root on this machine, the node's admin."""
        return {"node_id": self.service.settings.node_id, "project": None, "cluster": True}

    async def _serve(self, request: Request, send: Callable[[Response], Any], session: Any = None) -> None:
        started = time.monotonic()
        error: str | None = None
        try:
            op = self.ops.get(request.op)
            if session is not None and request.op in session.ops:
                result = await session.serve(request)
            elif op is None:
                if ops.get(request.op).name != "auth":  # ops.get raises for an unknown name, listing the known
                    raise InvalidRequestError(
                        f"operation {request.op!r} is served by a gateway, not by a node "
                        f"({self.service.settings.node_id}); connect to a gateway"
                    )
                result = self._local_identity()
            else:

                async def invoke(args: dict[str, Any]) -> Any:
                    kwargs = op.arguments(args)
                    if op.streams:

                        async def emit(event: Any) -> None:
                            await send(Response(id=request.id, event=event))

                        kwargs["emit"] = emit
                    return await op.method(**kwargs)

                if session is None:
                    result = await invoke(request.args)
                else:
                    result = await session.call(request.op, request.args, invoke)
            response = Response(id=request.id, result=result)
        except (Exception, asyncio.CancelledError) as exc:  # every failure is this request's error response
            response = protocol.error_response(request, exc)
        if response.error is not None:
            error = response.error.type
        for observer in self.observers:
            observer(request.op, time.monotonic() - started, error)
        try:
            await send(response)
        except (ConnectionError, RuntimeError):
            pass
