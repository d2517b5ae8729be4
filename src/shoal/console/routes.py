"""The console's HTTP routes under /console/: the page, its static files, a JSON API and the terminal.

Every answer comes from operations of the table called through the `Backend` for the logged-in viewer, so
a project's console shows and touches only what its token may (a sandbox of another project is "not
found", as over TCP). What the console does to a sandbox (the terminal's keystrokes, file listings and
downloads, a screenshot) is the operator's, not the agent's: it runs with operator=True, unlogged, so a
trainer's step count on the same sandbox never moves (docs/CONSOLE.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any

from aiohttp import WSMsgType, web

from shoal import netguard
from shoal.console import views
from shoal.console.backend import Backend, Viewer
from shoal.console.sessions import COOKIE, SESSION_S, Sessions
from shoal.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    SandboxLostError,
    ShoalError,
    from_wire,
    to_wire,
)

PREFIX = "/console"
STATIC = Path(__file__).parent / "static"
DOWNLOAD_MAX = 256 << 20  # the largest file a download reads (file_read's own cap)
PTY_CMD = "if command -v bash >/dev/null 2>&1; then exec bash -il; else exec sh -i; fi"  # as sb.pty() runs
PTY_FOLLOW_S = 60.0  # one follow read of the terminal's output (then the next, from its offset)
VNC_PORT = 5900  # a screen's VNC stream, as shoal/view.py opens it
PTY_MAX = 1000  # the largest terminal side (columns or rows) a page may ask for
STEPS_PAGE = 200
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

log = logging.getLogger("shoal.console")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(exc: BaseException) -> web.Response:
    kind, message, expected = to_wire(exc)
    if not expected:
        log.error("console request failed", exc_info=exc)
    wire = from_wire(kind, message)
    status = 500
    for cls, code in ((AuthenticationError, 401), (NotFoundError, 404), (FileNotFoundError, 404),
                      (InvalidRequestError, 400), (SandboxLostError, 410), (PermissionError, 403),
                      (IsADirectoryError, 400), (NotADirectoryError, 400), (ShoalError, 409)):  # fmt: skip
        if isinstance(wire, cls):
            status = code
            break
    return web.json_response({"error": kind, "message": message}, status=status, headers=HEADERS)


def _size(cols: Any, rows: Any) -> tuple[int, int]:
    """A terminal's size from a page: whole numbers in 1..PTY_MAX, 80x24 when not given."""
    try:
        size = (int(cols or 80), int(rows or 24))
    except (TypeError, ValueError):
        raise InvalidRequestError(f"a terminal's size is two whole numbers, not {cols!r} x {rows!r}") from None
    if not all(0 < side <= PTY_MAX for side in size):
        raise InvalidRequestError(f"a terminal of {size[0]} x {size[1]}: each side is 1 to {PTY_MAX}")
    return size


def mount(app: web.Application, backend: Backend) -> None:
    """Add the console's routes to `app` (the host's aiohttp application). Its requests must reach these
    handlers without the host's Bearer-token check: the console authenticates by its session cookie."""
    sessions = Sessions()

    def viewer_of(request: web.Request) -> Viewer:
        backend.check_transport(request.remote or "", request.secure)
        viewer = sessions.viewer(request.cookies.get(COOKIE))
        netguard.mark_authenticated(request.transport)  # a live session: past the first-request deadline
        return viewer

    def same_origin(request: web.Request) -> None:
        """What acts (the terminal, a replay) is refused from another site's page (its Origin names it)."""
        origin = request.headers.get("Origin")
        if origin is not None and origin.split("://", 1)[-1] != request.host:
            raise AuthenticationError(f"the console acts only from its own pages, not from {origin}")

    def api(handler: Callable[[web.Request, Viewer], Awaitable[Any]]) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                result = await handler(request, viewer_of(request))
            except web.HTTPException:
                raise
            except Exception as exc:
                return _error(exc)
            if isinstance(result, web.StreamResponse):
                return result
            return web.json_response(result, headers=HEADERS, dumps=lambda v: json.dumps(views.jsonable(v)))

        return wrapped

    async def call(viewer: Viewer, op: str, on_event: Callable[[Any], None] | None = None, **args: Any) -> Any:
        return await backend.call(viewer, op, args, on_event)

    # ------------------------------------------------------------------ page and login

    async def index(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers=HEADERS)

    async def to_index(_request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(PREFIX + "/")

    async def login(request: web.Request) -> web.StreamResponse:
        try:
            backend.check_transport(request.remote or "", request.secure)
            body = await request.json() if request.can_read_body else {}
            token = body.get("token") if isinstance(body, dict) else None
            viewer = backend.authenticate(token.strip() if isinstance(token, str) else None)
            netguard.mark_authenticated(request.transport)
        except json.JSONDecodeError:
            return _error(InvalidRequestError('the login body is JSON: {"token": ...}'))
        except Exception as exc:
            return _error(exc)
        response = web.json_response(_me(viewer), headers=HEADERS)
        response.set_cookie(
            COOKIE, sessions.open(viewer), path=PREFIX, httponly=True, samesite="Strict", secure=request.secure,
            max_age=SESSION_S,
        )  # fmt: skip
        return response

    async def logout(request: web.Request) -> web.StreamResponse:
        sessions.close(request.cookies.get(COOKIE))
        response = web.json_response({"ok": True}, headers=HEADERS)
        response.del_cookie(COOKIE, path=PREFIX)
        return response

    def _me(viewer: Viewer) -> dict[str, Any]:
        return {"project": viewer.project, "cluster": viewer.cluster, "where": backend.where}

    async def me(_request: web.Request, viewer: Viewer) -> Any:
        return _me(viewer)

    # ------------------------------------------------------------------ the farm

    async def overview(_request: web.Request, viewer: Viewer) -> Any:
        status, infos = await asyncio.gather(call(viewer, "status"), call(viewer, "list", labels=None))
        try:
            cluster = await call(viewer, "cluster_status")
        except InvalidRequestError:  # a node: it has no cluster view, its status is the whole of it
            cluster = None
        figures = backend.figures()
        nodes = views.nodes(status, cluster)
        return {
            "time": time.time(),
            "where": backend.where,
            "nodes": nodes,
            "sandboxes": len(infos),
            "by_kind_state": views.by_kind_state(infos),
            "creating": (cluster or {}).get("creating", status.get("creating", 0)),
            "queue_depth": (cluster or {}).get("queue_depth", figures.get("queue_depth", 0)),
            "creates_total": figures.get("creates_total", 0),
            "latency": figures.get("latency", {}),
        }

    # ------------------------------------------------------------------ sandboxes

    async def sandboxes(request: web.Request, viewer: Viewer) -> Any:
        filters = views.Filters.from_query(request.query)
        infos = await call(viewer, "list", labels=filters.labels or None)
        return views.page(infos, filters, time.time())

    async def sandbox(request: web.Request, viewer: Viewer) -> Any:
        sandbox_id = request.match_info["id"]
        info = await call(viewer, "get", sandbox_id=sandbox_id)
        record: dict[str, Any] = {}
        steps: list[dict[str, Any]] = []
        log_note = None
        try:
            logged = await call(viewer, "log_steps", target=sandbox_id, since=0, limit=STEPS_PAGE)
            record, steps = logged.get("sandbox") or {}, logged["steps"]
        except ShoalError as exc:
            log_note = f"{type(exc).__name__}: {exc}"
        try:
            used: dict[str, Any] | str = await call(viewer, "usage", sandbox_id=sandbox_id)
        except ShoalError as exc:
            used = f"{type(exc).__name__}: {exc}"
        processes: list[dict[str, Any]] | str = "not asked: the sandbox is not ready (a paused one would resume)"
        if info["state"] == "ready":
            try:
                processes = await call(viewer, "processes", sandbox_id=sandbox_id)
            except ShoalError as exc:
                processes = f"{type(exc).__name__}: {exc}"
        spec = record.get("spec") or {}
        return {
            "info": views.row(info, time.time())
            | {
                "created_at": info["created_at"],
                "workdir": info["workdir"],
                "on_timeout": info["on_timeout"],
                "idle_timeout_s": info["idle_timeout_s"],
                "expires_at": info["expires_at"],
            },
            "spec": views.spec_shown(spec),
            "network": views.jsonable(info.get("network", spec.get("network", "none"))),  # now, after set_network
            "network_at_create": views.jsonable(spec.get("network", "none")),
            "limits": {k: spec.get(k) for k in ("cpu", "memory_mb", "pids", "disk_mb")},
            "usage": used,
            "screen": spec.get("screen") or (info["image"] == "desktop" or None),
            "live_view": info["kind"] == "vm" and bool(spec.get("screen")),  # QEMU's VNC (shoal/view.py)
            "processes": processes,
            "status": record.get("status"),
            "reason": record.get("reason"),
            "steps": [views.step_row(s) for s in steps],
            "more_steps": len(steps) >= STEPS_PAGE,
            "log_note": log_note,
        }

    async def files(request: web.Request, viewer: Viewer) -> Any:
        path = request.query.get("path") or "/"
        entries = await call(viewer, "file_list", sandbox_id=request.match_info["id"], path=path, operator=True)
        entries.sort(key=lambda e: (e["kind"] != "dir", e["name"]))
        return {"path": path, "entries": entries}

    async def download(request: web.Request, viewer: Viewer) -> Any:
        path = request.query.get("path")
        if not path:
            raise InvalidRequestError("give the file's path: ?path=/dir/file")
        data = await call(
            viewer, "file_read", sandbox_id=request.match_info["id"], path=path, max_bytes=DOWNLOAD_MAX, operator=True
        )
        name = PurePosixPath(path).name.replace('"', "") or "file"
        headers = dict(HEADERS, **{"Content-Disposition": f'attachment; filename="{name}"'})
        return web.Response(body=data, content_type="application/octet-stream", headers=headers)

    async def screenshot(request: web.Request, viewer: Viewer) -> Any:
        shot = await call(
            viewer, "gui", sandbox_id=request.match_info["id"], action="screenshot", args=None, operator=True
        )
        return web.Response(body=shot["png"], content_type="image/png", headers=HEADERS)

    async def live_view(request: web.Request, viewer: Viewer) -> Any:
        """Where the live view of a screen is (noVNC, shoal/view.py): the path of `expose(5900)` under /view/,
        on this same host (a node's and a gateway's HTTP both serve it). The key in it opens that stream only."""
        exposed = await call(viewer, "expose", sandbox_id=request.match_info["id"], port=VNC_PORT)
        return {"path": exposed["path"].replace("/ports/", "/view/", 1)}

    # ------------------------------------------------------------------ trajectories

    async def trajectory(request: web.Request, viewer: Viewer) -> Any:
        target = request.query.get("target") or ""
        since = int(request.query.get("since") or 0)
        limit = min(1000, max(1, int(request.query.get("limit") or STEPS_PAGE)))
        logged = await call(viewer, "log_steps", target=target, since=since, limit=limit)
        record = logged.get("sandbox") or {}
        steps = logged["steps"]
        return {
            "sandbox": {k: record.get(k) for k in ("id", "trajectory", "image", "status", "reason", "created_at")},
            "steps": [views.step_row(s) for s in steps],
            "since": since,
            "next": steps[-1]["seq"] + 1 if len(steps) >= limit else None,
        }

    async def replay(request: web.Request, viewer: Viewer) -> Any:
        """Re-run the trajectory in a fresh sandbox (removed after) and list each step whose outcome differs."""
        same_origin(request)
        report = await call(viewer, "replay", target=request.query.get("target") or "", image=None, keep=False)
        for row in report["differences"]:
            for side in ("logged", "replayed"):
                row[side] = views.shown(row[side])
        return report

    async def export(request: web.Request, viewer: Viewer) -> Any:
        """The whole log as JSONL (one step per line, as `shoal log export` writes it), page by page."""
        target = request.query.get("target") or ""
        first = await call(viewer, "log_steps", target=target, since=0, limit=STEPS_PAGE)
        name = str((first.get("sandbox") or {}).get("id") or "trajectory")
        headers = dict(HEADERS, **{"Content-Disposition": f'attachment; filename="{name}.jsonl"'})
        response = web.StreamResponse(headers=headers)
        response.content_type = "application/x-ndjson"
        await response.prepare(request)
        page = first
        while True:
            lines = "".join(json.dumps(views.jsonable(step)) + "\n" for step in page["steps"])
            await response.write(lines.encode())
            if len(page["steps"]) < STEPS_PAGE:
                break
            since = page["steps"][-1]["seq"] + 1
            page = await call(viewer, "log_steps", target=target, since=since, limit=STEPS_PAGE)
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ the terminal

    async def terminal(request: web.Request) -> web.StreamResponse:
        """A websocket on a terminal in the sandbox (a PTY kept by its agent, docs/PROCESSES.md): keystrokes
        ({"input"}) go to proc_input, a window's size ({"resize": [cols, rows]}) to proc_resize, and what the
        terminal prints comes back as binary messages, streamed by proc_read from the offset shown so far.
        `?id=N` reattaches to terminal N if it still runs (a reloaded page); else a login shell starts. The
        terminal outlives the socket (it ends with `exit` or with the sandbox). Its acts are the operator's,
        not the agent's: they run unlogged (operator=True), so a trainer's step count never moves."""
        try:
            viewer = viewer_of(request)
            same_origin(request)
            cols, rows = _size(request.query.get("cols"), request.query.get("rows"))
        except Exception as exc:
            return _error(exc)
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        sandbox_id = request.match_info["id"]
        pump = None
        try:
            proc_id, reattached = await _attach(viewer, sandbox_id, request.query.get("id"), cols, rows)
            await ws.send_json({"attached": proc_id, "reattached": reattached})
            pump = asyncio.ensure_future(_pump(viewer, sandbox_id, proc_id, ws))
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                order = json.loads(msg.data) or {}
                if "input" in order:
                    data = str(order["input"]).encode()
                    await call(viewer, "proc_input", sandbox_id=sandbox_id, id=proc_id, data=data, operator=True)
                elif "resize" in order:
                    cols, rows = _size(*order["resize"])
                    await call(viewer, "proc_resize", sandbox_id=sandbox_id, id=proc_id, cols=cols, rows=rows)
        except Exception as exc:  # the terminal could not start (or ended under a keystroke): say why, then close
            if not ws.closed:
                await ws.send_json({"error": f"{to_wire(exc)[0]}: {to_wire(exc)[1]}"})
        finally:
            if pump is not None:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
            await ws.close()
        return ws

    async def _attach(viewer: Viewer, sandbox_id: str, wanted: str | None, cols: int, rows: int) -> tuple[int, bool]:
        if wanted and wanted.isdigit():
            for proc in await call(viewer, "proc_list", sandbox_id=sandbox_id):
                if proc["id"] == int(wanted) and proc["pty"] and proc["running"]:
                    await call(viewer, "proc_resize", sandbox_id=sandbox_id, id=proc["id"], cols=cols, rows=rows)
                    return proc["id"], True
        started = await call(viewer, "proc_start", sandbox_id=sandbox_id, cmd=PTY_CMD, pty={"cols": cols, "rows": rows},
                             operator=True)  # fmt: skip
        return started["id"], False

    async def _pump(viewer: Viewer, sandbox_id: str, proc_id: int, ws: web.WebSocketResponse) -> None:
        """The terminal's output to the socket, from offset 0 (a reattached page redraws what the terminal
        keeps), one follow read after another, each streaming chunks as they are printed."""
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def send() -> None:
            while (data := await chunks.get()) is not None:
                await ws.send_bytes(data)

        def on_event(event: Any) -> None:
            data = event.get("data") if isinstance(event, dict) else None
            if isinstance(data, bytes) and data:
                chunks.put_nowait(data)

        sender = asyncio.ensure_future(send())
        offset = 0
        try:
            while not ws.closed:
                answer = await call(viewer, "proc_read", on_event=on_event, sandbox_id=sandbox_id, id=proc_id,
                                    stdout_offset=offset, follow=True, stream=True, timeout=PTY_FOLLOW_S)  # fmt: skip
                if answer.get("stdout"):  # what the answer itself carries (not streamed)
                    chunks.put_nowait(answer["stdout"])
                offset = answer["stdout_offset"]
                if not answer["running"]:
                    chunks.put_nowait(None)
                    await sender
                    await ws.send_json({"exit": answer["exit_code"], "signal": answer["signal"]})
                    await ws.close()
                    return
        finally:
            sender.cancel()

    app.router.add_get(PREFIX, to_index)
    app.router.add_get(PREFIX + "/", index)
    app.router.add_static(PREFIX + "/static/", STATIC, append_version=False)
    app.router.add_post(PREFIX + "/api/login", login)
    app.router.add_post(PREFIX + "/api/logout", logout)
    app.router.add_get(PREFIX + "/api/me", api(me))
    app.router.add_get(PREFIX + "/api/overview", api(overview))
    app.router.add_get(PREFIX + "/api/sandboxes", api(sandboxes))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}", api(sandbox))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/files", api(files))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/download", api(download))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/screenshot", api(screenshot))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/view", api(live_view))
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/terminal", terminal)
    app.router.add_get(PREFIX + "/api/trajectory", api(trajectory))
    app.router.add_get(PREFIX + "/api/trajectory/export", api(export))
    app.router.add_post(PREFIX + "/api/trajectory/replay", api(replay))
