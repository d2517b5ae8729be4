"""The console's HTTP routes under /console/: the page, its static files, a JSON API and the terminal.

Every answer comes from operations of the table called through the `Backend` for the logged-in viewer, so
a project's console shows and touches only what its token may (a sandbox of another project is "not
found", as over TCP). Steps the console takes (the terminal's shell, file listings and downloads, a
screenshot) are steps of the sandbox like any client's and appear in its trajectory log.
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
SHELL_TIMEOUT_S = 600.0  # one terminal command's limit
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

    async def call(viewer: Viewer, op: str, **args: Any) -> Any:
        return await backend.call(viewer, op, args)

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
            "network": views.jsonable(spec.get("network", "none")),
            "limits": {k: spec.get(k) for k in ("cpu", "memory_mb", "pids", "disk_mb")},
            "usage": used,
            "screen": spec.get("screen") or (info["image"] == "desktop" or None),
            "processes": processes,
            "status": record.get("status"),
            "reason": record.get("reason"),
            "steps": [views.step_row(s) for s in steps],
            "more_steps": len(steps) >= STEPS_PAGE,
            "log_note": log_note,
        }

    async def files(request: web.Request, viewer: Viewer) -> Any:
        path = request.query.get("path") or "/"
        entries = await call(viewer, "file_list", sandbox_id=request.match_info["id"], path=path)
        entries.sort(key=lambda e: (e["kind"] != "dir", e["name"]))
        return {"path": path, "entries": entries}

    async def download(request: web.Request, viewer: Viewer) -> Any:
        path = request.query.get("path")
        if not path:
            raise InvalidRequestError("give the file's path: ?path=/dir/file")
        data = await call(viewer, "file_read", sandbox_id=request.match_info["id"], path=path, max_bytes=DOWNLOAD_MAX)
        name = PurePosixPath(path).name.replace('"', "") or "file"
        headers = dict(HEADERS, **{"Content-Disposition": f'attachment; filename="{name}"'})
        return web.Response(body=data, content_type="application/octet-stream", headers=headers)

    async def screenshot(request: web.Request, viewer: Viewer) -> Any:
        shot = await call(viewer, "gui", sandbox_id=request.match_info["id"], action="screenshot", args=None)
        return web.Response(body=shot["png"], content_type="image/png", headers=HEADERS)

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

    async def shell(request: web.Request) -> web.StreamResponse:
        """A websocket running one persistent shell (sb.shell()): each text message {"cmd"} runs in it and is
        answered {"stdout", "stderr", "exit_code"}; the shell closes with the socket."""
        try:
            viewer = viewer_of(request)
            same_origin(request)
        except Exception as exc:
            return _error(exc)
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        sandbox_id = request.match_info["id"]
        shell_id = None
        try:
            shell_id = await call(viewer, "shell_open", sandbox_id=sandbox_id)
            await ws.send_json({"ready": shell_id})
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                cmd = str((json.loads(msg.data) or {}).get("cmd", ""))
                try:
                    r = await call(viewer, "shell_run", shell_id=shell_id, cmd=cmd, timeout=SHELL_TIMEOUT_S)
                    answer = {"stdout": views.jsonable(r["stdout"]), "stderr": views.jsonable(r["stderr"]),
                              "exit_code": r["exit_code"], "timed_out": r.get("timed_out", False)}  # fmt: skip
                except ShoalError as exc:
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                await ws.send_json(answer)
        except Exception as exc:  # the shell could not open (or the socket broke): say why, then close
            if not ws.closed:
                await ws.send_json({"error": f"{to_wire(exc)[0]}: {to_wire(exc)[1]}"})
        finally:
            if shell_id is not None:
                await asyncio.shield(_close_shell(viewer, shell_id))
            await ws.close()
        return ws

    async def _close_shell(viewer: Viewer, shell_id: str) -> None:
        try:
            await call(viewer, "shell_close", shell_id=shell_id)
        except Exception as exc:  # the sandbox may be gone already
            log.debug("console shell %s did not close: %s", shell_id, exc)

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
    app.router.add_get(PREFIX + "/api/sandboxes/{id}/shell", shell)
    app.router.add_get(PREFIX + "/api/trajectory", api(trajectory))
    app.router.add_get(PREFIX + "/api/trajectory/export", api(export))
    app.router.add_post(PREFIX + "/api/trajectory/replay", api(replay))
