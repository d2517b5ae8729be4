"""HTTP surfaces: /metrics and /healthz on nodes and gateways, and the web console under /console/ on both
(shoal/console); on gateways also a JSON control API (`/v1/...`, described by `/openapi.json`) so any
language can create sandboxes, run commands and move files.

Authentication: `Authorization: Bearer <token>`, the same tokens as the binary protocol.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from shoal import console, netguard, ops, portrelay, settings, tls, view
from shoal.cluster import fusion
from shoal.cluster.consoles import GatewayConsole, NodeConsole
from shoal.cluster.metrics import CONTENT_TYPE, node_metrics
from shoal.config import parse_hostport, write_address
from shoal.errors import (
    AuthenticationError,
    CapacityError,
    DivergenceError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    SandboxLostError,
    ShoalError,
    from_wire,
    to_wire,
)
from shoal.netguard import serve_tcp

SHUTDOWN_GRACE_S = 5.0  # at a stop, how long requests still in flight may run on

log = logging.getLogger("shoal.http")

_STATUS = [
    (AuthenticationError, 401),
    (FileNotFoundError, 404),
    (IsADirectoryError, 400),
    (NotADirectoryError, 400),
    (FileExistsError, 409),
    (PermissionError, 403),
    (DivergenceError, 409),
    (QuotaExceededError, 403),
    (NotFoundError, 404),
    (InvalidRequestError, 400),
    (SandboxLostError, 410),
    (CapacityError, 503),
]


async def _start(
    app: web.Application, where: str, addr_file: Any = None, ports: portrelay.OpenTunnel | None = None
) -> tuple[Callable[[], Awaitable[None]], str]:
    """Serve `app` on host:port (port 0: any free one); write the bound host:port to `addr_file` if given.
    With `ports`, requests for sandbox ports (shoal/portrelay.py) are relayed through it instead. Returns the
    closer and the URL served.

    Connections come through shoal.netguard (per-peer caps, EMFILE back-off); one that has not sent a
    request with an accepted token (or console session, or port key) within the auth timeout is closed, and
    aiohttp closes idle keep-alive ones."""
    host, port = parse_hostport(where)
    # shutdown_timeout: requests in flight at a SIGTERM get this long, not aiohttp's 60 s (a client that
    # never finishes its body held a stopping gateway that long)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=30, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    factory: Callable[[], Any] = runner.server
    if ports is not None:
        relay = ports

        def factory() -> Any:
            return portrelay.Demux(runner.server, relay)

    ssl = tls.server_context()
    listener = await serve_tcp(None, host, port, name="http", protocol_factory=factory, ssl=ssl)
    bound = listener.sockets[0].getsockname()
    if addr_file is not None:
        write_address(addr_file, bound[0], bound[1])
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"{'https' if ssl else 'http'}://{shown}:{bound[1]}"

    async def close() -> None:
        listener.close()
        await listener.wait_closed()
        await runner.cleanup()

    return close, url


def mark_authenticated(request: web.Request) -> None:
    """The request's token was accepted (see netguard.mark_authenticated; public ones do not count)."""
    netguard.mark_authenticated(request.transport)


async def serve_node_http(
    server: Any, where: str, home: Any = None, session: Callable[[Any], Any] | None = None
) -> Callable[[], Awaitable[None]]:
    """/metrics and /healthz (public), and SandboxFusion's POST /run_code (cluster/fusion.py) behind the
    node's tokens (the ones its TCP port takes: SHOAL_TCP with SHOAL_TOKENS). `session(projects)` makes the
    per-request project session (cluster/front.py passes its ProjectSession; front imports this module)."""
    registry = node_metrics(server)

    def authenticate(request: web.Request) -> None:
        projects = getattr(server, "projects", None)
        if projects is None:
            raise AuthenticationError(
                "this node takes no tokens, so its HTTP runs no code: start it with SHOAL_TCP and SHOAL_TOKENS"
            )
        if session is None:
            raise AuthenticationError("this node's HTTP was started without project sessions, so it runs no code")
        if not request.secure:
            tls.refuse_plaintext(request.remote or "", f"node {server.service.settings.node_id} HTTP")
        checked = session(projects)
        checked.identity = projects.tokens.authenticate(fusion.token_of(request))
        request["session"] = checked
        mark_authenticated(request)

    async def run_code(request: web.Request, args: dict[str, Any]) -> Any:
        op = server.ops["fn_run_code"]

        async def invoke(checked: dict[str, Any]) -> Any:
            return await op.method(**op.arguments(checked))

        return await request["session"].call("fn_run_code", args, invoke)

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "node_id": server.service.settings.node_id})

    async def open_port(target: portrelay.Target) -> portrelay.Stream:
        """An sb.expose request: its key, or a token of the sandbox's project (or the cluster's)."""
        service = server.service
        if not service.ports.key_opens(target):
            projects = getattr(server, "projects", None)
            if target.token is None or projects is None:
                raise portrelay.RelayError(
                    401, "AuthenticationError",
                    "this port URL needs its key (the URL sb.expose answered) or Authorization: Bearer <token>",
                )  # fmt: skip
            if not target.secure:
                tls.refuse_plaintext(target.peer, f"node {service.settings.node_id} HTTP")
            ident = projects.tokens.authenticate(target.token)
            if not ident.cluster and projects.owner(target.sandbox_id) not in (None, ident.project):
                raise portrelay.RelayError(
                    404, "SandboxNotFoundError", f"no sandbox {target.sandbox_id} in project {ident.project!r}"
                )
        return await service.open_port(target.sandbox_id, target.port)

    app = web.Application(client_max_size=MAX_BODY)
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz)])
    app.add_routes(fusion.routes(authenticate, run_code, _error))
    console.mount(app, NodeConsole(server, registry, session))
    view.mount(app, open_port)  # the live view of a screen: its websocket opens port 5900 like sb.expose
    close, url = await _start(app, where, None if home is None else Path(home) / "node.http", open_port)
    server.service.ports.base = url  # sb.expose answers URLs through this
    return close


def _error(exc: BaseException) -> web.Response:
    """The HTTP form of the one exception-to-wire mapping (errors.to_wire), with a status per error class."""
    kind, message, expected = to_wire(exc)
    if not expected:
        log.error("HTTP request failed", exc_info=exc)
    wire = from_wire(kind, message)
    status = next((code for cls, code in _STATUS if isinstance(wire, cls)), 500)
    return web.json_response({"error": kind, "message": message}, status=status)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


MAX_BODY = settings.HTTP_MAX_BODY.get()
PUBLIC = {"/healthz", "/metrics", "/openapi.json"}


async def serve_gateway_http(gateway: Any, where: str, addr_file: Any = None) -> Callable[[], Awaitable[None]]:
    @web.middleware
    async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """The token is checked from the headers before any body is read (an unauthenticated peer cannot
        make the gateway buffer one); bodies are capped at MAX_BODY (SHOAL_HTTP_MAX_BODY, 413 above)."""
        if request.path in PUBLIC or request.path == console.PREFIX or request.path.startswith(console.PREFIX + "/"):
            return await handler(request)  # the console authenticates by its own session (shoal/console)
        if request.path.startswith((view.PREFIX, "/novnc/")):
            return await handler(request)  # a view's websocket is opened by its key (shoal/view.py)
        try:
            if not request.secure:
                tls.refuse_plaintext(request.remote or "", f"gateway {gateway.name} HTTP")
            request["identity"] = gateway.tokens.authenticate(fusion.token_of(request))
        except ShoalError as exc:
            return _error(exc)
        mark_authenticated(request)
        if request.content_length is not None and request.content_length > MAX_BODY:
            return web.json_response(
                {"error": "InvalidRequestError", "message": f"body over {MAX_BODY} bytes (SHOAL_HTTP_MAX_BODY)"},
                status=413,
            )
        return await handler(request)

    async def dispatch(request: web.Request, op: str, args: dict[str, Any]) -> Any:
        return await gateway.dispatch(request["identity"], op, args, lambda _e: None)

    async def call(request: web.Request, op: str, args: dict[str, Any]) -> web.Response:
        try:
            result = msgspec.to_builtins(await dispatch(request, op, args), builtin_types=(bytes,))
        except Exception as exc:  # every failure: a JSON error with the status of its class
            return _error(exc)
        if isinstance(result, bytes):
            return web.Response(body=result, content_type="application/octet-stream")
        return web.json_response(_jsonable(result))

    async def body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            data = await request.json()
        except json.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"the body is not JSON: {exc}") from exc
        return data if isinstance(data, dict) else {}

    async def create(request: web.Request) -> web.Response:
        spec = await body(request)
        files = spec.get("files")
        if isinstance(files, dict):
            spec["files"] = {k: base64.b64decode(v) for k, v in files.items()}  # files are base64 in JSON
        return await call(request, "create", {"spec": spec})

    async def list_(request: web.Request) -> web.Response:
        labels = dict(item.split("=", 1) for item in request.query.getall("label", []))
        return await call(request, "list", {"labels": labels or None})

    async def get(request: web.Request) -> web.Response:
        return await call(request, "get", {"sandbox_id": request.match_info["id"]})

    async def delete(request: web.Request) -> web.Response:
        return await call(request, "kill", {"sandbox_id": request.match_info["id"]})

    async def exec_(request: web.Request) -> web.Response:
        req = await body(request)
        req["sandbox_id"] = request.match_info["id"]
        if isinstance(req.get("stdin"), str):
            req["stdin"] = req["stdin"].encode()
        req.pop("stream", None)
        return await call(request, "exec", {"req": req})

    async def read_file(request: web.Request) -> web.Response:
        return await call(request, "file_read", {"sandbox_id": request.match_info["id"], "path": request.query["path"]})

    async def write_file(request: web.Request) -> web.Response:
        data = await request.read()
        args = {"sandbox_id": request.match_info["id"], "path": request.query["path"], "data": data}
        return await call(request, "file_write", args)

    async def generic(request: web.Request) -> web.Response:
        """POST /v1/ops/<name>: any operation of the table, its arguments as a JSON object (bytes base64)."""
        try:
            op = ops.get(request.match_info["name"])
            args = op.convert(await body(request))  # checked and typed here: bytes arrive as base64
            raw = msgspec.to_builtins(args, builtin_types=(bytes,))
            result = await dispatch(request, op.name, {k: v for k, v in raw.items() if k in args.__struct_fields__})
        except web.HTTPException:
            raise
        except Exception as exc:
            return _error(exc)
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")  # bytes: base64

    async def cluster(request: web.Request) -> web.Response:
        return await call(request, "cluster_status", {})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=gateway.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "gateway": gateway.name, "nodes_up": len(gateway.healthy())})

    async def openapi(_request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def run_code(request: web.Request, args: dict[str, Any]) -> Any:
        return await dispatch(request, "fn_run_code", args)

    async def open_port(target: portrelay.Target) -> portrelay.Stream:
        """An sb.expose request: the key goes to the node, which checks it; or a token, whose project must
        own the sandbox (the node checks that too)."""
        project = None
        if target.key is None:
            if target.token is None:
                raise portrelay.RelayError(
                    401, "AuthenticationError",
                    "this port URL needs its key (the URL sb.expose answered) or Authorization: Bearer <token>",
                )  # fmt: skip
            if not target.secure:
                tls.refuse_plaintext(target.peer, f"gateway {gateway.name} HTTP")
            ident = gateway.tokens.authenticate(target.token)
            project = None if ident.cluster else ident.project
        return await gateway.open_port(target, project)

    app = web.Application(middlewares=[authenticate], client_max_size=MAX_BODY)
    app.add_routes(fusion.routes(lambda _request: None, run_code, _error))  # authenticated by the middleware
    app.add_routes(
        [
            web.post("/v1/sandboxes", create),
            web.get("/v1/sandboxes", list_),
            web.get("/v1/sandboxes/{id}", get),
            web.delete("/v1/sandboxes/{id}", delete),
            web.post("/v1/sandboxes/{id}/exec", exec_),
            web.get("/v1/sandboxes/{id}/files", read_file),
            web.put("/v1/sandboxes/{id}/files", write_file),
            web.get("/v1/cluster", cluster),
            web.post("/v1/ops/{name}", generic),
            web.get("/metrics", metrics),
            web.get("/healthz", healthz),
            web.get("/openapi.json", openapi),
        ]
    )
    console.mount(app, GatewayConsole(gateway))
    view.mount(app, open_port)  # the key in a view URL goes to the node, as for sb.expose
    close, url = await _start(app, where, addr_file, open_port)
    gateway.http_url = url
    return close


def _route(summary: str, op: str, body: str | None = None, query: list[str] | None = None) -> dict[str, Any]:
    """A REST route's OpenAPI entry: it calls operation `op` (see /v1/ops/<op> for its full schema)."""
    entry: dict[str, Any] = {
        "summary": summary,
        "description": f"operation `{op}` ({ops.OPS[op].doc})",
        "security": [{"bearer": []}],
        "responses": {"200": {"description": "ok"}},
    }
    if body:
        entry["requestBody"] = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}}
    params = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}] if "{id}" in summary else []
    params += [{"name": q, "in": "query", "required": True, "schema": {"type": "string"}} for q in query or []]
    if params:
        entry["parameters"] = params
    return entry


REST = {
    "/v1/sandboxes": {
        "post": _route("Create a sandbox (queued while the cluster is full)", "create", "SandboxSpec"),
        "get": _route("List this project's sandboxes", "list"),
    },
    "/v1/sandboxes/{id}": {
        "get": _route("Describe sandbox {id}", "get"),
        "delete": _route("Close sandbox {id}", "kill"),
    },
    "/v1/sandboxes/{id}/exec": {"post": _route("Run a command in sandbox {id}", "exec", "ExecRequest")},
    "/v1/sandboxes/{id}/files": {
        "get": _route("Read a file of sandbox {id} (raw bytes)", "file_read", query=["path"]),
        "put": _route("Write a file of sandbox {id} (raw body)", "file_write", query=["path"]),
    },
    "/v1/cluster": {"get": _route("The gateway's view of the cluster", "cluster_status")},
    "/run_code": {
        "post": _route("SandboxFusion's run_code: its RunCodeRequest in, its RunCodeResponse out", "fn_run_code")
    },
    "/run_jupyter": {
        "post": _route(
            "SandboxFusion's run_jupyter: its RunJupyterRequest in (python3 cells, one namespace), its "
            "RunJupyterResponse out",
            "fn_run_code",
        )
    },
}
OPENAPI: dict[str, Any] = ops.openapi(extra_paths=REST)  # generated from the operation table
