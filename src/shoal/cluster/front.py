"""The node protocol over TCP: the same frames as the Unix socket, behind a token (a project per token).

The first request on a TCP connection must be `auth {"token": ...}`. A project's connection sees and
touches only its own sandboxes (they carry the label `shoal.project`) and is held to its quotas. A cluster
connection (a gateway) names the project per request in the reserved argument `_project`; the gateway then
enforces quotas cluster-wide, so the node does not count them again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shoal.cluster.auth import PROJECT_LABEL, Identity, Tokens, Usage, cost, sandbox_of
from shoal.config import parse_hostport
from shoal.errors import AuthenticationError, SandboxNotFoundError
from shoal.netguard import ConnectionGuard, Listener, serve_tcp
from shoal.node.server import NodeServer
from shoal.node.service import NodeService
from shoal.protocol import Request

log = logging.getLogger("shoal.tcp")

PROJECT_OPS = {
    "hello", "create", "get", "list", "kill", "close_all", "keepalive", "exec", "file_write", "file_untar", "file_read",
    "file_list", "file_stat", "file_mkdir", "file_remove", "shell_open", "shell_run", "shell_close",
    "image_list", "status", "image_ls", "image_inspect", "sandbox_snapshot", "set_network", "fn_call", "fn_run_code",
    "pause", "resume", "vm_snapshot", "vm_snapshot_delete", "fork",
}  # fmt: skip


class NodeProjects:
    """Per-node accounting of what each project holds, for quotas and for the gateway's cluster view."""

    def __init__(self, service: NodeService, tokens: Tokens) -> None:
        self.service = service
        self.tokens = tokens
        self.owned: dict[str, dict[str, tuple[float, int]]] = collections.defaultdict(dict)
        self.reserved: dict[str, Usage] = collections.defaultdict(Usage)

    def usage(self, project: str) -> Usage:
        live = self.service.sandboxes
        owned = self.owned[project]
        for gone in [sid for sid in owned if sid not in live]:
            del owned[gone]
        total = Usage(**vars(self.reserved[project]))
        for cpu, mem in owned.values():
            total.add(cpu, mem)
        return total

    def all_usage(self) -> dict[str, dict[str, Any]]:
        return {p: self.usage(p).as_dict() for p in list(self.owned)}

    def owner(self, sandbox_id: str) -> str | None:
        """The project of a live sandbox; '' if it has none; None if the node does not hold it."""
        sandbox = self.service.sandboxes.get(sandbox_id)
        return None if sandbox is None else sandbox.spec.labels.get(PROJECT_LABEL, "")


class ProjectSession:
    """One authenticated TCP connection."""

    ops = ("auth",)

    def __init__(self, projects: NodeProjects) -> None:
        self.projects = projects
        self.identity: Identity | None = None

    async def serve(self, request: Request) -> Any:
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
                result = dict(result, projects=self.projects.all_usage())
            return result
        enforce = not self.identity.cluster
        if op not in PROJECT_OPS:
            raise AuthenticationError(f"operation {op!r} needs a cluster (admin) token, not project {project!r}'s")
        sandbox_id = sandbox_of(op, args)
        if sandbox_id is not None:
            owner = self.projects.owner(sandbox_id)
            if owner is not None and owner != project:
                node = self.projects.service.settings.node_id
                raise SandboxNotFoundError(f"no sandbox {sandbox_id} on node {node} in project {project!r}")
        if op in ("list", "close_all"):
            args["labels"] = {**(args.get("labels") or {}), PROJECT_LABEL: project}
            return await invoke(args)
        if op == "status":
            result = await invoke(args)
            return dict(result, projects={project: self.projects.usage(project).as_dict()})
        if op != "create":
            return await invoke(args)
        spec = dict(args.get("spec") or {})
        spec["labels"] = {**(spec.get("labels") or {}), PROJECT_LABEL: project}
        args["spec"] = spec
        cpu, mem = cost(spec)
        if enforce:
            self.projects.tokens.check(project, self.projects.usage(project), cpu, mem)
        reserved = self.projects.reserved[project]
        reserved.add(cpu, mem)
        try:
            info = await invoke(args)
        finally:
            reserved.add(cpu, mem, -1)
        self.projects.owned[project][info.id] = (cpu, mem)
        return info


async def listen(server: NodeServer, tokens: Tokens, where: str, home: Path) -> Listener:
    """Serve the node protocol on TCP at `where` (host:port) and write the bound address to home/node.addr.
    Peers are held to shoal.netguard's limits until they authenticate (and after, per address and idle)."""
    projects = NodeProjects(server.service, tokens)
    server.projects = projects  # type: ignore[attr-defined]
    host, port = parse_hostport(where)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, guard: ConnectionGuard) -> None:
        session = ProjectSession(projects)
        guard.is_authenticated = lambda: session.identity is not None
        await server.handle(reader, writer, session, guard)

    tcp = await serve_tcp(handle, host, port, name="node tcp")
    bound = tcp.sockets[0].getsockname()
    (home / "node.addr").write_text(f"{bound[0]}:{bound[1]}\n")
    log.info("node protocol on tcp %s:%d (token required)", bound[0], bound[1])
    return tcp


async def serve_network(server: NodeServer, paths: Any, stop: asyncio.Event) -> list[Callable[[], Awaitable[None]]]:
    """Start what the environment asks for; returns closers. SHOAL_TCP=host:port needs SHOAL_TOKENS;
    SHOAL_HTTP=host:port serves /metrics and /healthz; SHOAL_PARENT_PID stops the node when that process
    (a supervisor such as the Ray node agent) is gone, so a node never outlives its supervisor."""
    import os

    from shoal.errors import NodeError

    closers: list[Callable[[], Awaitable[None]]] = []
    where = os.environ.get("SHOAL_TCP")
    if where:
        tokens = Tokens.from_env()
        if tokens is None:
            raise NodeError("SHOAL_TCP is set but SHOAL_TOKENS is not: a node on the network needs a token file")
        tcp = await listen(server, tokens, where, paths.home)

        async def close_tcp() -> None:
            tcp.close()

        closers.append(close_tcp)
    http_where = os.environ.get("SHOAL_HTTP")
    if http_where:
        from shoal.cluster.http import serve_node_http

        closers.append(await serve_node_http(server, http_where, paths.home))
    parent = os.environ.get("SHOAL_PARENT_PID")
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
