"""Run an ASGI application (the Connect-RPC services generated into the `e2b` SDK) inside aiohttp.

shoal's HTTP surfaces are aiohttp; connectrpc's servers are ASGI apps. This bridge hands one aiohttp request
to an ASGI app and streams its response back (chunked), so one port serves the REST API, the plain HTTP file
routes and the Connect routes without a second web server.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web


async def call_asgi(app: Any, request: web.Request, head: bytes = b"") -> web.StreamResponse:
    """`head`: the start of the body, read from the request already (the app gets it first, then the rest)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode(),
        "root_path": "",
        "query_string": request.query_string.encode(),
        "headers": [(k.lower(), v) for k, v in request.raw_headers],
        "client": tuple(peer[:2]) if peer else None,
        "server": None,
    }
    body_done = False
    disconnected = asyncio.Event()
    response: web.StreamResponse | None = None

    async def receive() -> dict[str, Any]:
        nonlocal body_done, head
        if head:
            chunk, head = head, b""
            return {"type": "http.request", "body": chunk, "more_body": True}
        if body_done:
            await disconnected.wait()  # nothing more will come; ASGI apps wait here for a disconnect
            return {"type": "http.disconnect"}
        chunk = await request.content.readany()
        if not chunk:
            body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for key, value in message.get("headers", []):
                response.headers.add(key.decode("latin-1"), value.decode("latin-1"))
            await response.prepare(request)
        elif message["type"] == "http.response.body":
            assert response is not None
            body = message.get("body", b"")
            if not message.get("more_body", False):
                await response.write_eof(body)  # the last chunk and the end in one send
            elif body:
                await response.write(body)

    try:
        await app(scope, receive, send)
    finally:
        disconnected.set()
    if response is None:
        return web.Response(status=500, text="the RPC handler sent no response")
    return response
