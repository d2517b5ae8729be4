"""`shoal e2b serve`: one HTTP port that answers both E2B's control-plane API and envd, backed by shoal.

Point an unmodified E2B program at it with the SDK's own settings:

    E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT E2B_API_KEY=<shoal token> python agent.py

The SDK sends every in-sandbox request to `E2B_SANDBOX_URL` with the headers `E2b-Sandbox-Id` and
`E2b-Sandbox-Port`, so one port routes them all: envd's port (49983) to the Connect services and file routes,
the code interpreter's port (49999) to `interpreter.py`.
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import json
import logging
import os
import posixpath
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication

from shoal import netguard, tls
from shoal.config import parse_hostport, write_address
from shoal.e2b import interpreter
from shoal.e2b.api import ControlPlane, api_key, envd_error_response
from shoal.e2b.asgi import call_asgi
from shoal.e2b.backend import Backend, Target
from shoal.e2b.connect import serve_start
from shoal.e2b.envd import FilesystemService, Processes, ProcessService
from shoal.e2b.front import INFLIGHT, FrontProtocol
from shoal.errors import AuthenticationError, InvalidRequestError, NotFoundError

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0  # at a stop, how long requests still in flight may run on


def _envd_caller(request: web.Request) -> tuple[str | None, str]:
    sandbox_id = request.headers.get("E2b-Sandbox-Id")
    if not sandbox_id:
        raise InvalidRequestError("no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this server")
    return request.headers.get("X-Access-Token") or api_key(request), sandbox_id


def _part_filename(part: Any) -> str | None:
    """The multipart filename as sent: the SDK puts the sandbox path there, and aiohttp's own parser strips
    its leading slash."""
    message = email.message.Message()
    message["Content-Disposition"] = part.headers.get("Content-Disposition", "")
    return message.get_filename()


class E2BServer:
    def __init__(self, target: Target) -> None:
        self.backend = Backend(target)
        self.processes = Processes()
        self.control = ControlPlane(self.backend)
        self.process_service = ProcessService(self.backend, self.processes)
        self.rpc = {
            "/process.Process/": ProcessASGIApplication(self.process_service),
            "/filesystem.Filesystem/": FilesystemASGIApplication(FilesystemService(self.backend)),
        }
        self.interpreter = interpreter.Interpreter(self.backend)

    @web.middleware
    async def _authenticated(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """A request whose key the target accepts lets its connection past netguard's first-request deadline;
        one without a key or with a refused one does not (the handler answers it as before). A connection's
        later requests with the key it was accepted with go straight on (its peer and so the plaintext
        verdict do not change; the key is checked again by every call it makes)."""
        try:
            return await self._admitted(request, handler, request.transport)
        finally:
            # one request fewer that aiohttp answers on this connection (front.py counts them in): front.py
            # answers nothing of its own on a connection while one is (a pipelining client), responses in order
            count = getattr(request.transport, INFLIGHT, 0)
            if count:
                setattr(request.transport, INFLIGHT, count - 1)

    async def _admitted(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]], transport: Any
    ) -> Any:
        token = request.headers.get("X-Access-Token") or api_key(request)
        if token and getattr(transport, "_e2b_key", None) == token:
            return await handler(request)
        if token and not request.secure:  # the same plaintext policy as every port (shoal/tls.py)
            try:
                tls.refuse_plaintext(request.remote or "", "E2B API")
            except AuthenticationError as exc:
                return web.json_response({"code": 401, "message": str(exc)}, status=401)
        try:
            await self.backend.client(token)
        except Exception:  # noqa: BLE001 - the handler makes the error response
            pass
        else:
            netguard.mark_authenticated(transport)
            if token and transport is not None:
                transport._e2b_key = token  # type: ignore[attr-defined]
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._authenticated])
        app.add_routes(self.control.routes())
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/files", self.download),
                web.post("/files", self.upload),
                *self.interpreter.routes(),
                web.post("/process.Process/Start", self.process_start),  # the hot path (connect.py)
                web.post("/process.Process/{method}", self.connect_rpc),
                web.post("/filesystem.Filesystem/{method}", self.connect_rpc),
            ]
        )
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _app: web.Application) -> None:
        await self.processes.close()
        await self.backend.close()

    async def connect_rpc(self, request: web.Request) -> web.StreamResponse:
        prefix = request.path[: request.path.rindex("/") + 1]
        return await call_asgi(self.rpc[prefix], request)

    async def process_start(self, request: web.Request) -> web.StreamResponse:
        """`commands.run`: the SDK's one shape of request (Connect JSON, no compression) is served directly
        (connect.py); any other goes through connectrpc like the rest."""
        response, head = await serve_start(self.process_service, request)
        if response is None:
            return await call_asgi(self.rpc["/process.Process/"], request, head)
        return response

    async def health(self, request: web.Request) -> web.Response:
        try:
            token, sandbox_id = _envd_caller(request)
            sandbox = await self.backend.sandbox(token, sandbox_id)
            await sandbox.refresh()
        except Exception as exc:
            return envd_error_response(exc)
        return web.Response(status=204)

    async def download(self, request: web.Request) -> web.StreamResponse:
        try:
            token, sandbox_id = _envd_caller(request)
            path = request.query.get("path") or ""
            sandbox = await self.backend.sandbox(token, sandbox_id)
            entry = await sandbox.files.stat(path)
            if entry is None:
                raise NotFoundError(f"no such file: {path}")
            if entry.kind == "dir":
                raise InvalidRequestError(f"{path} is a directory")
            data = await sandbox.files.read(path)
        except Exception as exc:
            return envd_error_response(exc)
        return web.Response(body=data, content_type="application/octet-stream")

    async def upload(self, request: web.Request) -> web.StreamResponse:
        """envd's `POST /files`: each file streamed into the sandbox as it arrives (files.write_stream), never
        held whole. The SDK sends one multipart part per file named by its path (and `?path=` as well when it
        sends one file); a first part without a name, or a raw octet-stream body, goes to `?path=`."""
        try:
            token, sandbox_id = _envd_caller(request)
            sandbox = await self.backend.sandbox(token, sandbox_id)
            query_path = request.query.get("path")
            written = []

            async def put(path: str, chunks: AsyncIterator[bytes]) -> None:
                if not path:
                    raise InvalidRequestError("upload without a path: name the file (?path= or the part's filename)")
                parent = posixpath.dirname(path)
                if parent and await sandbox.files.stat(parent) is None:
                    await sandbox.files.mkdir(parent)
                await sandbox.files.write_stream(path, chunks)
                written.append({"name": posixpath.basename(path), "type": "file", "path": path})

            if request.content_type.startswith("multipart/"):
                reader = await request.multipart()
                async for part in reader:
                    if part.name != "file":  # type: ignore[union-attr]
                        continue
                    named = _part_filename(part)
                    path = query_path if query_path and not written else (named or query_path or "")
                    await put(path, _chunks(part.read_chunk))  # type: ignore[union-attr]
            else:
                await put(query_path or "", _chunks(request.content.read))
        except Exception as exc:
            return envd_error_response(exc)
        return web.json_response(written)


async def _chunks(read: Callable[[int], Awaitable[bytes]], size: int = 1 << 20) -> AsyncIterator[bytes]:
    """What `read(size)` returns until it returns nothing (an aiohttp body or multipart part, as it arrives)."""
    while chunk := await read(size):
        yield chunk


async def start(
    target: Target, listen: str, addr_file: Any = None, sock: socket.socket | None = None
) -> Callable[[], Awaitable[None]]:
    """Serve on `listen` (port 0: any free one), or on `sock` (a listening socket handed over: see
    serve_handoffs); write the bound host:port to `addr_file`; returns the closer. Also used by a node
    (SHOAL_E2B) or a gateway (`--e2b`) to serve E2B's API in its own process."""
    # shutdown_timeout: a request still in flight (a body never finished, a long stream) gets this long at a
    # SIGTERM, not aiohttp's 60 s, so a stopping gateway or node exits promptly
    server = E2BServer(target)
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    # each connection is front.py's: commands.run's Start answered without aiohttp, the rest by aiohttp
    front = functools.partial(FrontProtocol, server.process_service, runner.server)
    # through netguard like every other port: per-peer caps, and a connection that shows no accepted key
    # within SHOAL_AUTH_TIMEOUT_S is closed (aiohttp alone held an idle or slowly dripping one for ever)
    # TLS with the node's or gateway's certificate (SHOAL_TLS_CERT/KEY), like their other ports: E2B API keys
    # are shoal tokens
    ssl = tls.server_context()
    if sock is None:
        host, port = parse_hostport(listen)
        listener = await netguard.serve_tcp(None, host, port, name="e2b", protocol_factory=front, ssl=ssl)
    else:
        sock.setblocking(False)
        listener = netguard.Listener(None, sock, netguard.Limits.from_env(), "e2b", front, ssl)
    bound = listener.sockets[0].getsockname()
    if addr_file:
        write_address(addr_file, bound[0], bound[1])

    async def close() -> None:
        listener.close()
        await listener.wait_closed()
        await runner.cleanup()

    return close


HANDOFF_MAX = 1 << 16  # bytes of a hand-off's message (its template map)


async def serve_handoffs(make_target: Callable[[tuple], Target], path: Path) -> Callable[[], Awaitable[None]]:
    """Take listening sockets handed over on the Unix socket `path` (mode 0600: the node's own user) by
    `shoal e2b serve --handoff` on this host, and serve E2B's API on each from this process with
    `make_target(templates)` (the node's in-process target): the requests then reach the node with no
    `shoal e2b serve` process and no second socket on their path. Each is served until its hand-off
    connection closes (that process stopped). Returns the closer."""
    loop = asyncio.get_running_loop()
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(16)
    except OSError as exc:  # a home whose path is too long for a Unix socket: the node serves on without it
        listener.close()
        log.warning("no E2B hand-off socket at %s (%s): `shoal e2b serve --handoff` cannot reach this node", path, exc)

        async def nothing() -> None:
            pass

        return nothing
    listener.setblocking(False)
    served: set[asyncio.Task] = set()

    async def adopt(conn: socket.socket) -> None:
        close = None
        try:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await asyncio.wait_for(readable, 10)
            finally:
                loop.remove_reader(conn.fileno())
            # close-on-exec as it arrives (socket.recv_fds drops its flags): processes the node starts later
            # (the launcher) must not hold the port open after the hand-off ends
            message, ancdata, _flags, _addr = conn.recvmsg(HANDOFF_MAX, socket.CMSG_LEN(4), socket.MSG_CMSG_CLOEXEC)
            fds = [
                int.from_bytes(data[i : i + 4], sys.byteorder)
                for level, kind, data in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                for i in range(0, len(data) - len(data) % 4, 4)
            ]
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                return
            sock = socket.socket(fileno=fds[0])
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                sock.close()
                return
            templates = tuple(tuple(pair) for pair in json.loads(message or b"[]"))
            close = await start(make_target(templates), "", None, sock)
            await loop.sock_sendall(conn, b"1")
            while await loop.sock_recv(conn, 256):  # until the serving process closes its end
                pass
        except (OSError, ValueError, TimeoutError) as exc:
            log.warning("an E2B hand-off failed: %s", exc)
        finally:
            conn.close()
            if close is not None:
                await close()

    async def accept() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            task = asyncio.create_task(adopt(conn))
            served.add(task)
            task.add_done_callback(served.discard)

    accepting = asyncio.create_task(accept())

    async def close() -> None:
        accepting.cancel()
        listener.close()
        path.unlink(missing_ok=True)
        for task in list(served):
            task.cancel()
        await asyncio.gather(accepting, *served, return_exceptions=True)

    return close


async def handoff(path: str, listen: str, templates: tuple, addr_file: str | None) -> None:
    """`shoal e2b serve --handoff PATH`: bind `listen`, hand the listening socket to the node at PATH
    (serve_handoffs), and hold it until SIGTERM/SIGINT; the node answers every request on it."""
    host, port = parse_hostport(listen)
    family, type_, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(4096)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(list(templates)).encode()], [sock.fileno()])
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        if await asyncio.wait_for(loop.sock_recv(conn, 1), 30) != b"1":
            raise OSError(f"the node at {path} did not take the E2B port (see its log)")
        bound = sock.getsockname()
        if addr_file:
            write_address(addr_file, bound[0], bound[1])
        await _until_stopped()
    finally:
        conn.close()
        sock.close()


async def _until_stopped() -> None:
    """Return at SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(target: Target, listen: str, addr_file: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT."""
    close = await start(target, listen, addr_file)
    try:
        await _until_stopped()
    finally:
        await close()


def own_address(host: str, port: int) -> str:
    """The address an E2B server inside a node or gateway calls its host at: the port it bound, over TLS when
    that port serves TLS (SHOAL_TLS_CERT; verified against SHOAL_TLS_CA, whose certificates always name the
    loopback addresses), through loopback when it listens on every address."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    scheme = tls.SCHEME_TLS if tls.server_context() is not None else tls.SCHEME_PLAIN
    return f"{scheme}[{local}]:{port}" if ":" in local else f"{scheme}{local}:{port}"


def default_target(address: str, connector: Any = None) -> Target:
    """`address` with the built-in template map (base and the code interpreter's templates); `connector`: see
    Target (a node serving the API in its own process)."""
    return Target(address, tuple({**dict(Target().templates), **interpreter.TEMPLATES}.items()), connector)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="shoal e2b serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="shoal://host:port of a node or gateway (default: local node)")
    parser.add_argument("--listen", default="127.0.0.1:3000", help="host:port to serve on (port 0: any free port)")
    parser.add_argument("--addr-file", default=None, help="write the bound host:port here once serving")
    parser.add_argument(
        "--template", action="append", default=[], metavar="NAME=IMAGE", help="map an E2B template to a shoal image"
    )
    parser.add_argument(
        "--handoff",
        default=None,
        metavar="PATH",
        help="hand the port to the node on this host whose hand-off socket is PATH (its home's e2b.handoff; a node"
        " with SHOAL_TCP): the node answers every request itself, this process only holds the port",
    )
    args = parser.parse_args(argv)
    templates = dict(default_target("").templates)
    for item in args.template:
        name, _, image = item.partition("=")
        templates[name] = image
    if args.handoff:
        asyncio.run(handoff(args.handoff, args.listen, tuple(templates.items()), args.addr_file))
        return 0
    asyncio.run(serve(Target(args.target, tuple(templates.items())), args.listen, args.addr_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
