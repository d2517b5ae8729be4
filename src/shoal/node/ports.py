"""The node's side of `sb.expose(port)`: keys, the URL, and the byte stream to a port inside a sandbox.

The stream is the guest agent's port relay (agent.c 'F'): the agent connects to 127.0.0.1:port inside the
sandbox and copies bytes over its own channel, so this works alike for crun, runc, runsc (gVisor's own
network stack) and VMs (the serial mux), and never opens the sandbox's network policy.

Keys are derived, not stored: HMAC(the node's secret, sandbox ID[, port]), the secret kept in
`$SHOAL_HOME/ports.secret` (0600), so a key survives a node restart with its sandbox and means nothing once
the sandbox is closed (the relay then finds no sandbox). The URL's base is the node's HTTP (SHOAL_HTTP,
cluster/http.py sets `base`), or else a relay listener on 127.0.0.1 started at the first expose (ports and the
live view of a screen, shoal/view.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

from aiohttp import web

from shoal import portrelay, view
from shoal.portrelay import RelayError, Stream, Target


class NodePorts:
    def __init__(self, home: Path) -> None:
        self.secret_path = home / "ports.secret"
        self._secret: bytes | None = None
        self.base: str | None = None  # the node's HTTP URL, if it serves one
        self._loopback: asyncio.AbstractServer | None = None
        self._starting: asyncio.Lock | None = None
        self._runner: web.AppRunner | None = None

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            try:
                self._secret = self.secret_path.read_bytes()
            except FileNotFoundError:
                fresh = secrets.token_bytes(32)
                fd = os.open(self.secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, fresh)
                finally:
                    os.close(fd)
                self._secret = fresh
        return self._secret

    def key(self, sandbox_id: str, port: int | None) -> str:
        return portrelay.port_key(self.secret, sandbox_id, port)

    def key_opens(self, target: Target) -> bool:
        return portrelay.check_key(self.secret, target)

    async def url_base(self, open_port: portrelay.OpenTunnel) -> str:
        """The node's HTTP, or its loopback relay (started now if need be)."""
        if self.base is not None:
            return self.base
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._loopback is None:

                async def open_keyed(target: Target) -> Stream:
                    if not self.key_opens(target):
                        raise RelayError(
                            401, "AuthenticationError",
                            "this port URL needs its key: use the URL sb.expose(port) answered",
                        )  # fmt: skip
                    return await open_port(target)

                app = web.Application()
                view.mount(app, open_keyed)  # the live view of a screen (noVNC) on the same listener
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                self._loopback, port = await portrelay.serve_loopback(open_keyed, inner=self._runner.server)
                self._loopback_base = f"http://127.0.0.1:{port}"
        return self._loopback_base

    async def close(self) -> None:
        if self._loopback is not None:
            self._loopback.close()
            self._loopback = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
