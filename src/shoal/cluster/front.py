"""The node protocol over TCP: the same frames as the Unix socket, behind a token (a project per token).

The first request on a TCP connection must be `auth {"token": ...}`. A project's connection sees and
touches only its own sandboxes, snapshots, trajectory names and images (cluster/tenancy.py) and is held to
its quotas. A cluster connection (a gateway) names the project per request in the reserved argument
`_project`; the gateway then enforces quotas cluster-wide, so the node does not count them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shoal import tls
from shoal.cluster.auth import Identity, Tokens
from shoal.cluster.tenancy import Tenancy
from shoal.config import parse_hostport, write_address
from shoal.errors import AuthenticationError
from shoal.netguard import ConnectionGuard, Listener, serve_tcp
from shoal.node.server import NodeServer
from shoal.protocol import Request
from shoal.settings import E2B, HTTP, PARENT_PID, TCP

log = logging.getLogger("shoal.tcp")


class ProjectSession:
    """One authenticated TCP connection; a project's requests are resolved by `Tenancy` (cluster/tenancy.py)."""

    ops = ("auth",)

    def __init__(self, projects: Tenancy, guard: ConnectionGuard | None = None) -> None:
        self.projects = projects
        self.guard = guard
        self.identity: Identity | None = None

    async def serve(self, request: Request) -> Any:
        if self.guard is not None and not self.guard.tls:
            tls.refuse_plaintext(self.guard.peer, f"node {self.projects.service.settings.node_id}")
        self.identity = self.projects.tokens.authenticate(request.args.get("token"))
        settings = self.projects.service.settings
        return {"node_id": settings.node_id, "project": self.identity.project, "cluster": self.identity.cluster}

    async def call(self, op: str, args: dict[str, Any], invoke: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
        if self.identity is None:
            raise AuthenticationError(
                "not authenticated: the first request on a TCP connection must be auth with a token "
                "(shoal.Client('shoal://host:port', token=...))"
            )
        args = dict(args)
        project = args.pop("_project", None) if self.identity.cluster else self.identity.project
        if project is None:  # the cluster itself: everything, no quotas
            result = await invoke(args)
            if op == "status":
                result = dict(result, projects=self.projects.all_usage(), usage_as_of=time.time())
            return result
        return await self.projects.call(project, op, args, invoke, enforce=not self.identity.cluster)


async def listen(server: NodeServer, tokens: Tokens, where: str, home: Path) -> Listener:
    """Serve the node protocol on TCP at `where` (host:port) and write the bound address to home/node.addr.
    Peers are held to shoal.netguard's limits until they authenticate (and after, per address and idle)."""
    projects = Tenancy(server.service, tokens)
    server.projects = projects  # type: ignore[attr-defined]
    host, port = parse_hostport(where)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, guard: ConnectionGuard) -> None:
        session = ProjectSession(projects, guard)
        guard.is_authenticated = lambda: session.identity is not None
        await server.handle(reader, writer, session, guard)

    tcp = await serve_tcp(handle, host, port, name="node tcp", ssl=tls.server_context())
    bound = tcp.sockets[0].getsockname()
    write_address(home / "node.addr", bound[0], bound[1])
    log.info("node protocol on tcp %s:%d (token required%s)", bound[0], bound[1], ", TLS" if tcp.ssl else "")
    return tcp


async def serve_network(server: NodeServer, paths: Any, stop: asyncio.Event) -> list[Callable[[], Awaitable[None]]]:
    """Start what the environment asks for; returns closers. SHOAL_TCP=host:port needs SHOAL_TOKENS;
    SHOAL_HTTP=host:port serves /metrics and /healthz; SHOAL_PARENT_PID stops the node when that process
    (a supervisor such as the Ray node agent) is gone, so a node never outlives its supervisor."""
    import os

    from shoal.errors import NodeError

    closers: list[Callable[[], Awaitable[None]]] = []
    where = TCP.get()
    if where:
        tokens = Tokens.from_env()
        if tokens is None:
            raise NodeError("SHOAL_TCP is set but SHOAL_TOKENS is not: a node on the network needs a token file")
        tcp = await listen(server, tokens, where, paths.home)

        async def close_tcp() -> None:
            tcp.close()

        closers.append(close_tcp)
    e2b_where = E2B.get()
    if e2b_where and not where:
        raise NodeError("SHOAL_E2B is set but SHOAL_TCP is not: E2B's API is served over the node's TCP protocol")
    if where:
        from shoal.cluster.inproc import connector
        from shoal.e2b.server import Target, default_target, own_address, serve_handoffs, start

        host, port = tcp.sockets[0].getsockname()[:2]
        address = own_address(host, port)  # what the API names (URLs it hands out); its requests skip the socket
        projects = server.projects  # type: ignore[attr-defined] - set by listen()
        target = default_target(address, connector(server, lambda: ProjectSession(projects), address))
        if e2b_where:
            closers.append(await start(target, e2b_where, paths.home / "node.e2b"))
        # `shoal e2b serve --handoff` on this host hands its port over: served here, with its template map
        closers.append(
            await serve_handoffs(
                lambda templates: Target(address, templates, target.connector), paths.home / "e2b.handoff"
            )
        )
    http_where = HTTP.get()
    if http_where:
        from shoal.cluster.http import serve_node_http

        closers.append(await serve_node_http(server, http_where, paths.home, ProjectSession))
    parent = PARENT_PID.get()
    if parent:

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.5)
                if os.getppid() != int(parent):
                    log.warning("supervisor %s is gone: shutting down", parent)
                    stop.set()
                    return

        watcher = asyncio.create_task(watch())

        async def close_watch() -> None:
            watcher.cancel()

        closers.append(close_watch)
    return closers
