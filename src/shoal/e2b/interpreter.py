"""`e2b-code-interpreter`'s Jupyter-style API (port 49999: /execute, /contexts) on any image with python3.

A context is a long-lived Python process inside the sandbox (the "kernel", started on first use, listening on a
Unix socket under /tmp/.shoal-e2b), so variables persist between `run_code` calls as in a Jupyter kernel. Each
`run_code` is one `exec` of a small python3 client that hands the code to the kernel and relays its JSON-lines
events (stdout, stderr, the value of the last expression, errors, the execution count) — the same lines the
SDK parses from E2B's server. Only Python is offered; results carry `text` (the repr), not rich MIME data.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from shoal.e2b.api import api_key, envd_error_response
from shoal.e2b.backend import Backend
from shoal.errors import InvalidRequestError

TEMPLATES = {"code-interpreter-v1": "debian", "code-interpreter": "debian"}
DEFAULT_CONTEXT = "default"

KERNEL = r"""
import ast, json, os, socket, sys, time, traceback
path, cwd = sys.argv[1], sys.argv[2]
os.chdir(cwd)
ns = {"__name__": "__main__"}
count = 0
srv = socket.socket(socket.AF_UNIX)
try:
    os.unlink(path)
except OSError:
    pass
srv.bind(path)
srv.listen(16)
real_out, real_err = sys.stdout, sys.stderr
while True:
    conn, _ = srv.accept()
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    req = json.loads(data)
    out = conn.makefile("w", encoding="utf-8")

    def emit(event):
        out.write(json.dumps(event) + "\n")
        out.flush()

    class Stream:  # line-buffered, as a kernel's output arrives
        def __init__(self, name):
            self.name, self.buf = name, ""
        def write(self, text):
            self.buf += text
            if "\n" in self.buf:
                done, _, self.buf = self.buf.rpartition("\n")
                emit({"type": self.name, "text": done + "\n", "timestamp": time.time_ns() // 1000})
            return len(text)
        def flush(self):
            if self.buf:
                emit({"type": self.name, "text": self.buf, "timestamp": time.time_ns() // 1000})
                self.buf = ""

    saved_env = dict(os.environ)
    os.environ.update(req.get("env_vars") or {})
    sys.stdout, sys.stderr = Stream("stdout"), Stream("stderr")
    count += 1
    try:
        tree = ast.parse(req["code"], "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), ns)
            if value is not None:
                emit({"type": "result", "text": repr(value), "is_main_result": True})
    except BaseException as exc:
        emit({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": traceback.format_exc()})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = real_out, real_err
        os.environ.clear()
        os.environ.update(saved_env)
    emit({"type": "number_of_executions", "execution_count": count})
    out.close()
    conn.close()
"""

CLIENT = r"""
import os, socket, subprocess, sys, time
kernel, path, cwd = sys.argv[1], sys.argv[2], sys.argv[3]
request = sys.stdin.buffer.read()
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s
try:
    s = connect()
except OSError:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    kfile = os.path.join(os.path.dirname(path), "kernel.py")
    with open(kfile, "w") as f:
        f.write(kernel)
    subprocess.Popen([sys.executable, kfile, path, cwd], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            s = connect()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
s.sendall(request)
s.shutdown(socket.SHUT_WR)
while chunk := s.recv(65536):
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
"""

STOP = r"""
import os, signal, sys
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1].endswith(b"kernel.py") and argv[2] == sys.argv[1].encode():
            os.kill(int(pid), signal.SIGKILL)
try:
    os.unlink(sys.argv[1])
except OSError:
    pass
"""


class Interpreter:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.contexts: dict[tuple[str, str], dict[str, str]] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/execute", self.execute),
            web.post("/contexts", self.create_context),
            web.get("/contexts", self.list_contexts),
            web.delete("/contexts/{id}", self.remove_context),
            web.post("/contexts/{id}/restart", self.restart_context),
        ]

    async def _sandbox(self, request: web.Request) -> Any:
        sandbox_id = request.headers.get("E2b-Sandbox-Id")
        if not sandbox_id:
            raise InvalidRequestError("no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this server")
        headers = request.headers
        token = headers.get("X-Access-Token") or headers.get("E2B-Traffic-Access-Token") or api_key(request)
        return await self.backend.sandbox(token, sandbox_id)

    def _context(self, sandbox_id: str, context_id: str) -> dict[str, str]:
        return self.contexts.get((sandbox_id, context_id)) or {"id": context_id, "language": "python", "cwd": "/"}

    async def execute(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            sandbox = await self._sandbox(request)
            language = body.get("language") or "python"
            if language != "python":
                raise InvalidRequestError(f"language {language!r} is not offered by shoal's code interpreter: python")
            context = self._context(sandbox.id, body.get("context_id") or DEFAULT_CONTEXT)
        except Exception as exc:
            return envd_error_response(exc)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        payload = json.dumps({"code": body.get("code", ""), "env_vars": body.get("env_vars") or {}})
        sock = f"/tmp/.shoal-e2b/kernel-{context['id']}.sock"
        pending: list[bytes] = []

        def relay(chunk: bytes) -> None:
            pending.append(chunk)

        result = await sandbox.exec(
            ["python3", "-c", CLIENT, KERNEL, sock, context["cwd"]],
            stdin=payload.encode(),
            timeout=None,
            on_stdout=relay,
        )
        # the exec streams events through `relay`; the node delivers them before the result, so write in order
        for chunk in pending:
            await response.write(chunk)
        if result.exit_code != 0:
            error = {"type": "error", "name": "KernelError", "value": result.stderr[-2000:], "traceback": ""}
            await response.write((json.dumps(error) + "\n").encode())
        await response.write_eof()
        return response

    async def create_context(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
            sandbox = await self._sandbox(request)
            if (body.get("language") or "python") != "python":
                raise InvalidRequestError("only python contexts are offered by shoal's code interpreter")
        except Exception as exc:
            return envd_error_response(exc)
        context = {"id": uuid.uuid4().hex, "language": "python", "cwd": body.get("cwd") or "/"}
        self.contexts[(sandbox.id, context["id"])] = context
        return web.json_response(context)

    async def list_contexts(self, request: web.Request) -> web.Response:
        try:
            sandbox = await self._sandbox(request)
        except Exception as exc:
            return envd_error_response(exc)
        found = [c for (sid, _), c in self.contexts.items() if sid == sandbox.id]
        return web.json_response([self._context(sandbox.id, DEFAULT_CONTEXT), *found])

    async def remove_context(self, request: web.Request) -> web.Response:
        return await self._stop(request, forget=True)

    async def restart_context(self, request: web.Request) -> web.Response:
        return await self._stop(request, forget=False)

    async def _stop(self, request: web.Request, *, forget: bool) -> web.Response:
        try:
            sandbox = await self._sandbox(request)
            context_id = request.match_info["id"]
            sock = f"/tmp/.shoal-e2b/kernel-{context_id}.sock"
            await sandbox.exec(["python3", "-c", STOP, sock], timeout=30)
            if forget:
                self.contexts.pop((sandbox.id, context_id), None)
        except Exception as exc:
            return envd_error_response(exc)
        return web.Response(status=204)
