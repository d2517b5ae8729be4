"""The live view of a sandbox's screen: noVNC in a browser, through a node's or a gateway's HTTP port.

`shoal view ID` (`sb.view()`) answers `<base>/view/<sandbox_id>/5900.<key>/`: the key is the one
`sb.expose(5900)` answers, so the same rules open it (it dies with the sandbox). That page loads noVNC
(Debian's `novnc` package, served from /usr/share/novnc under `/novnc/`: nothing is fetched at run time)
and opens the websocket `.../websockify` next to it, which this module bridges to a raw byte stream of the
sandbox's VNC server, opened like any exposed port (shoal/portrelay.py `open_port`): x11vnc on
127.0.0.1:5900 in a desktop container, QEMU's own VNC server (a unix socket beside the VM) for a `vm`.
Only the stream's opener decides who gets in (the node checks the key; the gateway passes it on).

Like portrelay, this module sits at the bottom: it imports nothing from node or cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
from pathlib import Path

from aiohttp import WSMsgType, web

from shoal import netguard, portrelay

VNC_PORT = 5900  # the port a screen's VNC stream is opened as (portrelay.Target.port)
NOVNC_DIR = Path("/usr/share/novnc")
PREFIX = "/view/"
_CHUNK = 1 << 16

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>shoal view {sandbox}</title>
<style>html,body{{margin:0;height:100%;background:#202020;color:#ddd;font:14px sans-serif}}
#screen{{width:100%;height:calc(100% - 22px)}}#status{{height:22px;padding:2px 6px}}</style></head>
<body><div id="status">connecting to {sandbox}...</div><div id="screen"></div>
<script type="module">
{script}
</script></body></html>
"""
_SCRIPT = """import RFB from "../../../novnc/core/rfb.js";
const status = document.getElementById("status");
const url = new URL("websockify", location.href);
url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
const rfb = new RFB(document.getElementById("screen"), url.href, {wsProtocols: ["binary"]});
rfb.scaleViewport = true;
const state = (text, name) => { status.textContent = text; document.body.dataset.state = name; };
rfb.addEventListener("connect", () => state("connected: {sandbox}", "connected"));
rfb.addEventListener("disconnect", (e) => state(e.detail.clean ? "disconnected" : "disconnected (error)", "closed"));
window.shoalView = rfb;"""
_MISSING = "noVNC is not installed on this host: `apt-get install novnc` (it serves the view's page)"


def view_url(expose_url: str) -> str:
    """The view URL for the URL `expose(VNC_PORT)` answered (same base, key and sandbox)."""
    return expose_url.replace("/ports/", PREFIX, 1)


def _target(request: web.Request) -> portrelay.Target:
    sandbox_id = request.match_info["sandbox"]
    port_text, _, key = request.match_info["portkey"].partition(".")
    if port_text != str(VNC_PORT) or not key:
        raise portrelay.RelayError(400, "InvalidRequestError", f"a view URL is {PREFIX}<sandbox_id>/5900.<key>/")
    peer = request.remote or ""
    return portrelay.Target(sandbox_id, VNC_PORT, key, peer=peer, secure=request.secure, raw=True)


def _refusal(exc: BaseException) -> web.Response:
    refusal = portrelay.status_of(exc)
    return web.json_response({"error": refusal.kind, "message": str(refusal)}, status=refusal.status)


def mount(app: web.Application, open_port: portrelay.OpenTunnel) -> None:
    """Add the view's page, its websocket and noVNC's files to `app` (a node's or a gateway's)."""

    async def page(request: web.Request) -> web.StreamResponse:
        try:
            _target(request)
        except portrelay.RelayError as exc:
            return _refusal(exc)
        if not (NOVNC_DIR / "core" / "rfb.js").exists():
            return web.json_response({"error": "NotFoundError", "message": _MISSING}, status=404)
        sandbox = html.escape(request.match_info["sandbox"])
        body = _PAGE.format(sandbox=sandbox, script=_SCRIPT.replace("{sandbox}", sandbox))
        return web.Response(text=body, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def websockify(request: web.Request) -> web.StreamResponse:
        try:
            reader, writer = await open_port(_target(request))
        except Exception as exc:  # refused (key, no sandbox, nothing listening): the reason, with its status
            return _refusal(exc)
        netguard.mark_authenticated(request.transport)
        ws = web.WebSocketResponse(protocols=("binary",), max_msg_size=0)
        try:
            await ws.prepare(request)
            await _bridge(ws, reader, writer)
        finally:
            writer.close()
        return ws

    async def no_slash(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(request.path + "/")

    app.add_routes(
        [
            web.get(PREFIX + "{sandbox}/{portkey}/", page),
            web.get(PREFIX + "{sandbox}/{portkey}", no_slash),
            web.get(PREFIX + "{sandbox}/{portkey}/websockify", websockify),
        ]
    )
    if NOVNC_DIR.is_dir():
        app.router.add_static("/novnc/", NOVNC_DIR, follow_symlinks=True)


async def _bridge(ws: web.WebSocketResponse, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Websocket binary messages <-> the VNC byte stream, until either side ends."""

    async def up() -> None:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                writer.write(msg.data)
                await writer.drain()
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                break

    async def down() -> None:
        while data := await reader.read(_CHUNK):
            await ws.send_bytes(data)

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError, RuntimeError):
                await task
        await ws.close()
