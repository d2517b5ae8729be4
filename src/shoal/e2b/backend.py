"""The E2B layer's view of shoal: one shoal `AsyncClient` per API key, and sandbox handles by ID.

An E2B API key *is* a shoal token: every request is made with the caller's own token, so the node or gateway
enforces projects, quotas and sandbox ownership exactly as for native clients (another project's sandbox ID is
simply not found). The envd access token handed to the SDK is the same key, which lets the in-sandbox routes
(sent with `X-Access-Token`, not the API key) act as the same caller without any state in this process.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shoal.client.aio import AsyncClient, AsyncSandbox
from shoal.errors import AuthenticationError, SandboxNotFoundError

# labels this layer keeps on a sandbox for itself; they are not part of the user's E2B metadata
TEMPLATE_LABEL = "e2b.template"
RESERVED_PREFIX = "e2b."
# images whose E2B sandboxes start without shoal's own X display: e2b-desktop starts `Xvfb :0` itself, at the
# resolution its create asks for, then Xfce on it (docs/E2B.md)
SELF_DISPLAY_IMAGES = ("desktop",)
MAX_CLIENTS = 64
MAX_HANDLES = 4096


@dataclass(frozen=True)
class Target:
    """Where shoal is: an address for `AsyncClient` (`shoal://host:port` or a node's Unix socket) or None
    for the local node, plus the template -> image map ("base" is E2B's default template). A node serving
    E2B's API in its own process gives a `connector` (token -> opener of an in-process connection,
    cluster/inproc.py): its callers then reach it without a socket, with the same checks as over TCP."""

    address: str | None = None
    templates: tuple[tuple[str, str], ...] = (("base", "debian"),)
    connector: Callable[[str | None], Callable[[], Awaitable[Any]]] | None = None

    def image_for(self, template: str) -> str:
        return dict(self.templates).get(template, template)


class Backend:
    def __init__(self, target: Target) -> None:
        self.target = target
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()
        self._handles: OrderedDict[tuple[str, str], AsyncSandbox] = OrderedDict()
        self._lock = asyncio.Lock()

    async def client(self, token: str | None) -> AsyncClient:
        key = token or ""
        client = self._clients.get(key)
        if client is not None:
            self._clients.move_to_end(key)
            return client
        if self.target.address and self.target.address.startswith(("shoal://", "shoals://")) and not token:
            raise AuthenticationError("no API key: set E2B_API_KEY to a shoal token")
        async with self._lock:
            client = self._clients.get(key)
            if client is None:
                connect = self.target.connector
                client = AsyncClient(
                    self.target.address,
                    token=token or None,
                    owner="e2b",
                    connector=connect(token or None) if connect else None,
                )
                try:
                    await client.connect()
                except BaseException:
                    await client.close()
                    raise
                self._clients[key] = client
                while len(self._clients) > MAX_CLIENTS:
                    _, old = self._clients.popitem(last=False)
                    await old.close()
        return client

    async def sandbox(self, token: str | None, sandbox_id: str) -> AsyncSandbox:
        key = (token or "", sandbox_id)
        handle = self._handles.get(key)
        if handle is not None:
            self._handles.move_to_end(key)
            return handle
        handle = await (await self.client(token)).get(sandbox_id)
        self.remember(token, handle)
        return handle

    def remember(self, token: str | None, handle: AsyncSandbox) -> None:
        self._handles[(token or "", handle.id)] = handle
        while len(self._handles) > MAX_HANDLES:
            self._handles.popitem(last=False)

    def forget(self, sandbox_id: str) -> None:
        for key in [k for k in self._handles if k[1] == sandbox_id]:
            del self._handles[key]

    async def close(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        self._handles.clear()
        for client in clients:
            await client.close()


def is_gone(exc: BaseException) -> bool:
    return isinstance(exc, SandboxNotFoundError)
