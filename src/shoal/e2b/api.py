"""E2B's control-plane REST API (the routes the pinned `e2b` SDK calls), answered by shoal.

| E2B route                                | shoal                                                  |
|------------------------------------------|--------------------------------------------------------|
| POST /v2/sandboxes (and /sandboxes)      | `create(image=template, ttl_s=timeout, env, labels)`   |
| GET /v2/sandboxes (and /sandboxes)       | `list(labels=metadata filter)`, state filter           |
| GET /sandboxes/{id}                      | `get(id)`                                              |
| DELETE /sandboxes/{id}                   | `kill(id)`                                             |
| POST /sandboxes/{id}/timeout, /refreshes | `keepalive(ttl_s)`                                     |
| POST /sandboxes/{id}/pause               | `pause()` (409 if already paused)                      |
| POST /v2/sandboxes/{id}/connect, /resume | `resume()` if paused, then `keepalive(ttl_s)`          |
| GET /sandboxes/{id}/metrics              | `usage()`: one sample, now (see `metrics`)             |
| GET /templates                           | the images the node or gateway can start               |

Errors are E2B's `{"code", "message"}` bodies with the status codes the SDK maps to its exceptions
(401 -> AuthenticationException, 404 -> NotFoundException, ...).
"""

from __future__ import annotations

import datetime
import time
import urllib.parse
from typing import Any

from aiohttp import web

from shoal.client.aio import AsyncSandbox, reachable_url
from shoal.e2b.backend import RESERVED_PREFIX, SELF_DISPLAY_IMAGES, TEMPLATE_LABEL, Backend
from shoal.errors import (
    AuthenticationError,
    CapacityError,
    ImageNotFoundError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    SandboxLostError,
    SandboxNotFoundError,
    ShoalError,
)

ENVD_VERSION = "0.5.7"  # the envd features this layer answers (see docs/E2B.md); newer ones stay off in the SDK
DEFAULT_TIMEOUT_S = 300
NOMINAL_CPUS, NOMINAL_MEMORY_MB = 1, 512  # what get_info and get_metrics report (a sandbox has no fixed size)
_STATUS = [
    (AuthenticationError, 401),
    (QuotaExceededError, 429),
    (ImageNotFoundError, 404),
    (NotFoundError, 404),
    (InvalidRequestError, 400),
    (SandboxLostError, 404),
    (CapacityError, 503),
]


def api_key(request: web.Request) -> str | None:
    key = request.headers.get("X-API-KEY")
    if key:
        return key
    auth = request.headers.get("Authorization", "")
    return auth[7:] if auth.startswith("Bearer ") else None


def envd_error_response(exc: BaseException) -> web.Response:
    """An error on an in-sandbox route: a sandbox that is gone (or another project's) gets what E2B's proxy
    answers, 502 "... was not found", which the SDK turns into SandboxNotRunningException / is_running False."""
    if isinstance(exc, SandboxNotFoundError):
        message = f"The sandbox was not found ({type(exc).__name__}: {exc})"
        return web.json_response({"code": 502, "message": message}, status=502)
    return error_response(exc)


def error_response(exc: BaseException) -> web.Response:
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    return web.json_response({"code": status, "message": f"{type(exc).__name__}: {exc}"}, status=status)


def _iso(ts: float | None) -> str:
    moment = datetime.datetime.fromtimestamp(ts if ts is not None else time.time(), tz=datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def _metadata(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(RESERVED_PREFIX) and not k.startswith("shoal.")}


def _state(info: Any) -> str:
    return "paused" if info.state == "paused" else "running"


class ControlPlane:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def routes(self) -> list[web.RouteDef]:
        wrap = self._wrap
        return [
            web.post("/v2/sandboxes", wrap(self.create)),
            web.post("/sandboxes", wrap(self.create)),
            web.get("/v2/sandboxes", wrap(self.list)),
            web.get("/sandboxes", wrap(self.list)),
            web.get("/sandboxes/{id}", wrap(self.get)),
            web.delete("/sandboxes/{id}", wrap(self.kill)),
            web.post("/sandboxes/{id}/timeout", wrap(self.set_timeout)),
            web.post("/sandboxes/{id}/refreshes", wrap(self.refresh)),
            web.post("/sandboxes/{id}/pause", wrap(self.pause)),
            web.post("/v2/sandboxes/{id}/connect", wrap(self.connect)),
            web.post("/sandboxes/{id}/connect", wrap(self.connect)),
            web.post("/sandboxes/{id}/resume", wrap(self.connect)),
            web.get("/sandboxes/{id}/metrics", wrap(self.metrics)),
            web.get("/templates", wrap(self.templates)),
        ]

    def _wrap(self, handler: Any) -> Any:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request, api_key(request))
            except web.HTTPException:
                raise
            except Exception as exc:  # every shoal error becomes E2B's error body
                return error_response(exc)

        return run

    async def _domain(self, client: Any, sandbox_id: str) -> str | None:
        """What `get_host(port)` appends to `<port>-<id>.`: `<sandbox key>@<relay host:port>`, so the SDK's
        `f"http://{sbx.get_host(8000)}"` is a URL whose user part `<port>-<id>.<key>` the node's or gateway's
        relay reads as Basic auth (shoal/portrelay.py): no wildcard DNS needed. None where no relay answers
        (a gateway without HTTP)."""
        try:
            access = await client.call("expose", {"sandbox_id": sandbox_id, "port": 80})
        except ShoalError:
            return None
        base = reachable_url(access["url"], client).partition("/ports/")[0]
        return f"{access['sandbox_key']}@{base.partition('://')[2]}"

    def _sandbox_json(self, info: Any, key: str | None, domain: str | None = None) -> dict[str, Any]:
        return {
            "templateID": info.labels.get(TEMPLATE_LABEL, info.image),
            "sandboxID": info.id,
            "clientID": "shoal",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": key or "",
            # e2b-code-interpreter sends this one (not the envd token) on its context routes
            "trafficAccessToken": key or None,
            "domain": domain,
        }

    def _detail_json(self, info: Any, key: str | None, *, listed: bool = False) -> dict[str, Any]:
        body = {
            "templateID": info.labels.get(TEMPLATE_LABEL, info.image),
            "sandboxID": info.id,
            "clientID": "shoal",
            "startedAt": _iso(info.created_at),
            "endAt": _iso(info.expires_at if info.expires_at else info.created_at + 365 * 86400),
            "envdVersion": ENVD_VERSION,
            "cpuCount": NOMINAL_CPUS,
            "memoryMB": NOMINAL_MEMORY_MB,
            "diskSizeMB": 0,
            "state": _state(info),
            "metadata": _metadata(info.labels),
        }
        if not listed:
            body["envdAccessToken"] = key or ""
        return body

    async def create(self, request: web.Request, key: str | None) -> web.Response:
        body = await request.json()
        template = body.get("templateID") or "base"
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise InvalidRequestError("metadata must map strings to strings")
        timeout = body.get("timeout", DEFAULT_TIMEOUT_S)
        client = await self.backend.client(key)
        image = self.backend.target.image_for(template)
        try:
            sandbox = await client.create(
                "container",
                image=image,
                ttl_s=float(timeout) if timeout else None,
                env=dict(body.get("envVars") or {}),
                labels={**metadata, TEMPLATE_LABEL: template},
                on_timeout="pause" if body.get("autoPause") else "kill",
                screen=False if image in SELF_DISPLAY_IMAGES else None,
            )
        except ImageNotFoundError as exc:
            raise ImageNotFoundError(f"template {template!r} (image {image!r}) does not exist: {exc}") from None
        # the create handle numbers its steps from 0 (fast-forward); the E2B layer's concurrent, cancellable
        # requests must append, as the handles `get` returns do: remember one of those for this sandbox
        self.backend.remember(key, AsyncSandbox(client, sandbox.info))
        domain = await self._domain(client, sandbox.id)
        return web.json_response(self._sandbox_json(sandbox.info, key, domain), status=201)

    async def metrics(self, request: web.Request, key: str | None) -> web.Response:
        """`get_metrics()`: shoal keeps no history, so the answer is one sample taken now from the sandbox's
        cgroup (`usage`; a paused sandbox is not resumed): memory charged, and CPU as the average since the
        sandbox started (cumulative CPU seconds over its age), against the nominal 1 CPU / 512 MiB that
        `get_info` reports. A `start`/`end` window that excludes now gets an empty list."""
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        usage = await sandbox.usage()
        now = time.time()
        start, end = request.query.get("start"), request.query.get("end")
        try:
            if (start and int(start) > now) or (end and int(end) < int(now)):
                return web.json_response([])
        except ValueError:
            raise InvalidRequestError("start and end are Unix times in seconds") from None
        age = max(now - sandbox.info.created_at, 1e-3)
        cpu_pct = 100.0 * (usage.get("cpu_s") or 0.0) / age / NOMINAL_CPUS
        sample = {
            "timestamp": _iso(now),
            "timestampUnix": int(now),
            "cpuCount": NOMINAL_CPUS,
            "cpuUsedPct": round(min(cpu_pct, 100.0 * NOMINAL_CPUS), 2),
            "memUsed": int(usage.get("memory_bytes") or 0),
            "memTotal": NOMINAL_MEMORY_MB << 20,
            "memCache": 0,
            "diskUsed": 0,
            "diskTotal": 0,
        }
        return web.json_response([sample])

    async def list(self, request: web.Request, key: str | None) -> web.Response:
        wanted = dict(urllib.parse.parse_qsl(request.query.get("metadata", "")))
        wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in wanted.items()}
        states = {s for s in request.query.get("state", "running,paused").split(",") if s}
        template = request.query.get("template")
        client = await self.backend.client(key)
        infos = [i for i in await client.list(labels=wanted or None) if i.kind != "function"]
        infos = [i for i in infos if i.state not in ("closed", "lost") and _state(i) in states]
        if template:
            infos = [i for i in infos if i.labels.get(TEMPLATE_LABEL, i.image) == template]
        infos.sort(key=lambda i: i.created_at, reverse=request.query.get("order") != "asc")
        return web.json_response([self._detail_json(i, key, listed=True) for i in infos])

    async def get(self, request: web.Request, key: str | None) -> web.Response:
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        info = await sandbox.refresh()
        return web.json_response(self._detail_json(info, key))

    async def kill(self, request: web.Request, key: str | None) -> web.Response:
        sandbox_id = request.match_info["id"]
        client = await self.backend.client(key)
        # never there or another project's -> not found; closed already (killed, expired) -> False: a 404 both,
        # as E2B answers (one call: the kill says whether it closed it, no lookup first)
        killed = await client.kill(sandbox_id)
        self.backend.forget(sandbox_id)
        if not killed:
            raise NotFoundError(f"sandbox {sandbox_id} is closed already")
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request, key: str | None) -> web.Response:
        body = await request.json()
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        await sandbox.keepalive(ttl_s=float(body["timeout"]))
        return web.Response(status=204)

    async def refresh(self, request: web.Request, key: str | None) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        await sandbox.keepalive(ttl_s=float(body["duration"]) if body.get("duration") else None)
        return web.Response(status=204)

    async def pause(self, request: web.Request, key: str | None) -> web.Response:
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        if (await sandbox.refresh()).state == "paused":
            return web.json_response({"code": 409, "message": f"sandbox {sandbox.id} is already paused"}, status=409)
        await sandbox.pause()
        return web.Response(status=204)

    async def connect(self, request: web.Request, key: str | None) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        sandbox = await self.backend.sandbox(key, request.match_info["id"])
        info = await sandbox.refresh()
        if info.state == "paused":
            await sandbox.resume()
        timeout = body.get("timeout")
        if timeout:
            await sandbox.keepalive(ttl_s=float(timeout))
        status = 201 if info.state == "paused" else 200
        domain = await self._domain(sandbox.client, sandbox.id)
        return web.json_response(self._sandbox_json(sandbox.info, key, domain), status=status)

    async def templates(self, request: web.Request, key: str | None) -> web.Response:
        client = await self.backend.client(key)
        names = await client.images()
        aliases = dict(self.backend.target.templates)
        return web.json_response(
            [{"templateID": n, "aliases": [a for a, i in aliases.items() if i == n], "public": True} for n in names]
        )
