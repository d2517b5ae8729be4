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
# Operations whose answer the Unix socket sends from the log's fsync completion (trajectory.Answer): their
# service method returns its step's result (NodeService._step) as it is, with nothing after the step.
ANSWERED_AT_FSYNC = frozenset({"exec", "shell_run", "file_write", "file_untar", "file_read", "file_list",
                               "file_stat", "file_mkdir", "file_remove"})  # fmt: skip


class _Op:
    """An entry of the operation table bound to the NodeService method that implements it."""

    def __init__(self, spec: ops.Op, method: Callable[..., Any]) -> None:
        self.spec = spec
        self.method = method
        self.streams = spec.streams

    def arguments(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.spec.kwargs(args)


class _UnixConnection(asyncio.Protocol):
    """One client of the node's Unix socket, read by a callback of the loop: each request frame is decoded
    where it lands and its task made at once. `handle` (TCP, with sessions and netguard) reads with a
    StreamReader and a reader task instead, which per request cost a loop pass, a future and the task's
    wake-up (issue 12: loop passes were a quarter of the node's CPU per exec). What it serves is the same:
    requests run concurrently, `cancel` cancels one, a connection that goes away abandons the rest
    (trajectory.abandon: a logged step finishes), `port_connect` turns the connection into a byte stream."""

    def __init__(self, server: NodeServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.buf = bytearray()
        self.tasks: dict[int, asyncio.Task] = {}
        self.stream: asyncio.StreamReaderProtocol | None = None  # after port_connect: the relay's streams
        self.paused = False  # the transport's write buffer is over its high-water mark
        self.drained: list[asyncio.Future] = []
        self.lost = False
        self.ended = False  # the client half-closed: close once the requests still running ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections += 1

    def data_received(self, data: bytes) -> None:
        if self.stream is not None:
            self.stream.data_received(data)
            return
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        try:
            while end - pos >= 4:
                (length,) = protocol.LENGTH.unpack_from(buf, pos)
                if length > protocol.MAX_FRAME:
                    raise ValueError(f"frame of {length} bytes exceeds the {protocol.MAX_FRAME}-byte limit")
                if end - pos - 4 < length:
                    break
                request = protocol.decode_request(bytes(buf[pos + 4 : pos + 4 + length]))
                pos += 4 + length
                if request.op == PORT_CONNECT and not self.tasks:
                    self._take_over(request, bytes(buf[pos:]))
                    return
                self._start(request)
        except Exception as exc:  # as dispatch_requests: a malformed frame ends the connection
            log.warning("dropping a connection after a malformed frame: %s", exc)
            self.transport.close()
            return
        del buf[:pos]

    def _start(self, request: Request) -> None:
        if request.op == "cancel":  # the client gave up on an earlier request
            rid = int(request.args.get("request_id", -1))
            victim = self.tasks.get(rid)
            if victim is not None:
                victim.cancel()
                # a task cancelled before its first step never enters _serve_one: its end unlists it
                victim.add_done_callback(lambda _t: self._done(rid))
            return
        self.tasks[request.id] = self.loop.create_task(self._serve_one(request))

    async def _serve_one(self, request: Request) -> None:
        """Serve one request and unlist it, in its own task: not a done callback, which costs every request
        a Handle and a loop pass of its own after the answer (issue 12: 6.5 passes per exec before). An
        answer sent from the log's fsync completion unlists it when it is sent."""
        later = None
        if request.op in ANSWERED_AT_FSYNC:

            def later(response: Response) -> None:
                if not self.lost:
                    self.transport.write(protocol.encode(response))
                self._done(request.id)

        deferred = False
        try:
            deferred = await self.server._serve(request, self.send, send_later=later)
        finally:
            if not deferred:
                self._done(request.id)

    def _done(self, request_id: int) -> None:
        self.tasks.pop(request_id, None)
        if self.ended and not self.tasks:
            self.transport.close()

    def _take_over(self, request: Request, rest: bytes) -> None:
        """`port_connect`: from here the connection's bytes go to a StreamReader that the relay reads."""
        self.buf = bytearray()
        reader = asyncio.StreamReader(limit=1 << 16)
        self.stream = asyncio.StreamReaderProtocol(reader)
        self.stream.connection_made(self.transport)
        if self.paused:
            self.stream.pause_writing()
        if rest:
            self.stream.data_received(rest)
        writer = asyncio.StreamWriter(self.transport, self.stream, reader, self.loop)

        async def send(message: Response) -> None:
            writer.write(protocol.encode(message))

        async def relay() -> None:
            try:
                await self.server._port_connect(request, (reader, writer), send, None)
            finally:
                writer.close()

        self.tasks[request.id] = self.loop.create_task(relay())

    async def send(self, message: Response) -> None:
        if self.lost:
            raise ConnectionResetError("the client's connection is closed")
        self.transport.write(protocol.encode(message))
        if self.paused:  # a slow reader (streamed output, large reads): wait for room, as writer.drain does
            waiter = self.loop.create_future()
            self.drained.append(waiter)
            await waiter

    def pause_writing(self) -> None:
        self.paused = True
        if self.stream is not None:
            self.stream.pause_writing()

    def resume_writing(self) -> None:
        self.paused = False
        if self.stream is not None:
            self.stream.resume_writing()
        self._wake_writers(None)

    def _wake_writers(self, exc: BaseException | None) -> None:
        waiters, self.drained = self.drained, []
        for waiter in waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)

    def eof_received(self) -> bool | None:
        """The client stopped sending: abandon what runs (a logged step finishes and can still answer, the
        connection being only half-closed), close once nothing runs."""
        if self.stream is not None:
            return self.stream.eof_received()
        self.ended = True
        for task in list(self.tasks.values()):
            trajectory.abandon(task)
        return bool(self.tasks) or None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections -= 1
        self._wake_writers(ConnectionResetError("the client's connection is closed"))
        if self.stream is not None:
            self.stream.connection_lost(exc)
            return
        for task in list(self.tasks.values()):
            trajectory.abandon(task)


class NodeServer:
    def __init__(self, service: NodeService) -> None:
        self.service = service
        self.ops = {name: _Op(ops.OPS[name], getattr(service, name)) for name in ops.NODE_OPS}
        self.connections = 0
        # called as observer(op, seconds, error_type_or_None) after each request (metrics)
        self.observers: list[Callable[[str, float, str | None], None]] = []

    def unix_connection(self) -> asyncio.Protocol:
        """The protocol serving one client of the node's Unix socket (`loop.create_unix_server`)."""
        return _UnixConnection(self)

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

    async def _serve(
        self,
        request: Request,
        send: Callable[[Response], Any],
        session: Any = None,
        send_later: Callable[[Response], None] | None = None,
    ) -> bool:
        """Answer `request` through `send`; True if the answer was left to `send_later` instead, which the
        trajectory log calls once its fsync covers the step the request logged (trajectory.Answer)."""
        started = time.monotonic()
        answer = None
        if send_later is not None:
            answer = trajectory.Answer()
            trajectory.ANSWER.set(answer)  # this request's own task: its context
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
        if answer is not None and send_later is not None:

            def answered(error: Exception | None) -> None:
                reply = response if error is None else protocol.error_response(request, error)
                self._observe(request.op, started, reply)
                send_later(reply)

            if answer.owed(answered):
                return True
        self._observe(request.op, started, response)
        try:
            await send(response)
        except (ConnectionError, RuntimeError):
            pass
        return False

    def _observe(self, op: str, started: float, response: Response) -> None:
        error = response.error.type if response.error is not None else None
        for observer in self.observers:
            observer(op, time.monotonic() - started, error)
