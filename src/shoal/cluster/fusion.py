"""SandboxFusion's `POST /run_code` and `POST /run_jupyter` on the node's and the gateway's HTTP, served by the
`fn_run_code` operation.

Code-RL reward functions (verl's sandbox-fusion helper, the `sandbox-fusion` client package) speak this API;
pointing their endpoint at shoal makes them score on shoal's warm function workers without changes.

Request (SandboxFusion's RunCodeRequest; verl adds memory_limit_MB):
    {code, language, compile_timeout, run_timeout, stdin, files: {path: base64}, fetch_files: [path],
     memory_limit_MB}
Response (RunCodeResponse):
    {status: Success|Failed|SandboxError, message, compile_result, run_result, files: {path: base64}}
    each result {status: Finished|TimeLimitExceeded|Error, execution_time, return_code, stdout, stderr}

A program that runs over its memory limit is killed: its run_result is Finished with the kill's return code
and the response says `memory limit exceeded` in `message` (SandboxFusion has no status of its own for it).

`POST /run_jupyter` (RunJupyterRequest: {cells, cell_timeout, total_timeout, kernel: python3, files,
fetch_files}) runs the cells in order in ONE Python process sharing one namespace, as a notebook's kernel
would, through the same `fn_run_code` (a small driver program, JUPYTER_DRIVER): no Jupyter kernel, so rich
display is the value of a cell's last expression as `{"text/plain": repr}`; every cell runs even after
another raised, each with its stdout, stderr, display and error (ename, evalue, traceback) like
SandboxFusion's runner; `cell_timeout` interrupts a cell (TimeoutError in its error), `total_timeout` the
whole run (driver TimeLimitExceeded, status Failed).

Authentication: the same tokens as the rest of the API, as `Authorization: Bearer <token>` or as HTTP basic
auth with the token as password, which is what `requests` sends for an endpoint written
`http://shoal:<token>@host:port` (the sandbox-fusion client has no header option).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from shoal.errors import AuthenticationError, ShoalError

IMAGE = "debian-dev"  # python3, bash, gcc and g++: what the languages below need
MAX_MEMORY_MB = 65536

# the language names SandboxFusion uses that shoal's run_code runs (see substrates/function/languages.py)
LANGUAGES = {"python": "python", "python3": "python", "cpp": "c++", "c++": "c++", "c": "c", "bash": "bash"}

_FAILED = {
    "compile_error": "compile error",
    "compile_timeout": "compile time limit exceeded",
    "runtime_error": "",
    "timeout": "time limit exceeded",
    "memory_exceeded": "memory limit exceeded",
}


def token_of(request: web.Request) -> str | None:
    """The token from `Authorization: Bearer <token>` or `Basic base64(user:<token>)`."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip()).decode().partition(":")[2] or None
        except (binascii.Error, UnicodeDecodeError):
            raise AuthenticationError("malformed basic authorization header") from None
    return header.removeprefix("Bearer ").strip() or None


class FusionRequestError(ShoalError):
    """The request is not one shoal can run (answered as SandboxFusion's SandboxError)."""


def _b64(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise FusionRequestError(f"{what} must be base64 text") from None


def to_args(body: dict[str, Any]) -> dict[str, Any]:
    """A SandboxFusion request as the arguments of the `fn_run_code` operation."""
    code = body.get("code")
    if not isinstance(code, str):
        raise FusionRequestError("`code` (a string) is required")
    language = str(body.get("language") or "")
    if language not in LANGUAGES:
        raise FusionRequestError(f"language {language!r} is not supported by shoal; choose one of {sorted(LANGUAGES)}")
    spec: dict[str, Any] = {"kind": "function", "image": IMAGE}
    memory = body.get("memory_limit_MB")
    if memory not in (None, 0, -1):
        if not isinstance(memory, int | float) or not 0 < memory <= MAX_MEMORY_MB:
            raise FusionRequestError(f"memory_limit_MB must be a number of MiB in 1..{MAX_MEMORY_MB}")
        spec["memory_mb"] = int(memory)
    files = body.get("files") or {}
    fetch = body.get("fetch_files") or []
    if not isinstance(files, dict) or not isinstance(fetch, list):
        raise FusionRequestError("`files` is an object {path: base64} and `fetch_files` a list of paths")
    stdin = body.get("stdin")
    return {
        "spec": spec,
        "code": code,
        "language": LANGUAGES[language],
        "stdin": stdin.encode() if isinstance(stdin, str) and stdin else None,
        "files": {str(k): _b64(v, f"files[{k!r}]") for k, v in files.items() if v is not None},
        "compile_timeout": _seconds(body.get("compile_timeout"), 10.0),
        "run_timeout": _seconds(body.get("run_timeout"), 10.0),
        "output_files": [str(p) for p in fetch],
    }


def _seconds(value: Any, default: float) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or value <= 0:
        raise FusionRequestError(f"timeouts are positive numbers of seconds, not {value!r}")
    return float(value)


def _command(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if result is None:
        return None
    text = {k: bytes(result[k]).decode("utf-8", errors="replace") for k in ("stdout", "stderr")}
    return {
        "status": "TimeLimitExceeded" if result["timed_out"] else "Finished",
        "execution_time": result["duration_s"],
        "cpu_time": None,
        "return_code": None if result["timed_out"] else result["exit_code"],
        **text,
    }


def to_response(raw: Any) -> dict[str, Any]:
    """An `fn_run_code` answer as SandboxFusion's RunCodeResponse."""
    raw = msgspec.to_builtins(raw, builtin_types=(bytes,))
    status = raw["status"]
    return {
        "status": "Success" if status == "ok" else "Failed",
        "message": _FAILED.get(status, ""),
        "compile_result": _command(raw.get("compile")),
        "run_result": _command(raw.get("run")),
        "executor_pod_name": None,
        "files": {k: base64.b64encode(bytes(v)).decode() for k, v in (raw.get("files") or {}).items() if v is not None},
    }


def sandbox_error(message: str) -> dict[str, Any]:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None, "files": {}}


JUPYTER_OUT = ".shoal-jupyter.json"
# runs as main.py in the function worker's forked child; CELLS and CELL_TIMEOUT are prepended as literals
JUPYTER_DRIVER = """
import ast, io, json, signal, sys, traceback


class CellTimeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise CellTimeout(f"the cell ran longer than its cell_timeout of {CELL_TIMEOUT}s")


signal.signal(signal.SIGALRM, _alarm)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
real = sys.stdout, sys.stderr
cells = []
for index, source in enumerate(CELLS):
    out, err = io.StringIO(), io.StringIO()
    result = {"stdout": "", "stderr": "", "display": [], "error": [], "status": "ok"}
    sys.stdout, sys.stderr = out, err
    try:
        if CELL_TIMEOUT:
            signal.setitimer(signal.ITIMER_REAL, CELL_TIMEOUT)
        name = f"<cell {index}>"
        tree = ast.parse(source, name)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
            if value is not None:
                result["display"].append({"text/plain": repr(value)})
    except BaseException as exc:
        kind = "TimeoutError" if isinstance(exc, CellTimeout) else type(exc).__name__
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        result["error"].append({"ename": kind, "evalue": str(exc), "traceback": lines})
        result["status"] = "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = real
    result["stdout"], result["stderr"] = out.getvalue(), err.getvalue()
    cells.append(result)
with open(OUT, "w") as handle:
    json.dump(cells, handle)
"""


def jupyter_args(body: dict[str, Any]) -> dict[str, Any]:
    """A RunJupyterRequest as `fn_run_code` arguments: the driver with the cells, the notebook's output file
    fetched with the caller's."""
    cells = body.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
        raise FusionRequestError("`cells` (a list of strings) is required")
    kernel = body.get("kernel") or "python3"
    if kernel != "python3":
        raise FusionRequestError(f"kernel {kernel!r} is not supported; shoal runs 'python3' notebooks")
    cell_timeout = body.get("cell_timeout") or 0
    if not isinstance(cell_timeout, int | float) or cell_timeout < 0:
        raise FusionRequestError("cell_timeout is a number of seconds (0: none)")
    total = _seconds(body.get("total_timeout"), 45.0)
    fetch = body.get("fetch_files") or []
    prelude = f"CELLS = {cells!r}\nCELL_TIMEOUT = {float(cell_timeout)!r}\nOUT = {JUPYTER_OUT!r}\n"
    args = to_args({**body, "code": prelude + JUPYTER_DRIVER, "language": "python", "run_timeout": total,
                    "fetch_files": [*fetch, JUPYTER_OUT] if isinstance(fetch, list) else fetch})  # fmt: skip
    return args


def to_jupyter_response(raw: Any) -> dict[str, Any]:
    """An `fn_run_code` answer of the driver as SandboxFusion's RunJupyterResponse."""
    raw = msgspec.to_builtins(raw, builtin_types=(bytes,))
    files = dict(raw.get("files") or {})
    notebook = files.pop(JUPYTER_OUT, None)
    driver = _command(raw.get("run"))
    cells: list[Any] = []
    if notebook is not None:
        try:
            cells = json.loads(bytes(notebook))
        except ValueError:
            notebook = None
    if notebook is None:
        timed_out = driver is not None and driver["status"] == "TimeLimitExceeded"
        message = "the notebook ran over its total_timeout" if timed_out else "the notebook's driver failed"
    else:
        message = ""
    return {
        "status": "Success" if notebook is not None else "Failed",
        "message": message,
        "driver": driver,
        "cells": cells,
        "executor_pod_name": None,
        "files": {k: base64.b64encode(bytes(v)).decode() for k, v in files.items() if v is not None},
    }


Call = Callable[[web.Request, dict[str, Any]], Awaitable[Any]]  # (request, fn_run_code args) -> its answer
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _json(answer: dict[str, Any]) -> web.Response:
    return web.Response(body=_encode(answer), content_type="application/json")


def routes(
    authenticate: Callable[[web.Request], None], call: Call, error: Callable[[BaseException], web.Response]
) -> list[web.RouteDef]:
    """`POST /run_code`, answering through `call` once `authenticate` passed (before the body is read).
    Authentication failures are HTTP errors (401, via `error`); everything else is a 200 in SandboxFusion's
    shape, a failure of shoal's as SandboxError."""

    def handler(
        shape: str, convert: Callable[[dict[str, Any]], dict[str, Any]], answer: Callable[[Any], dict[str, Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            try:
                authenticate(request)
                try:  # msgspec, not aiohttp's json: a snippet's request and answer are most of the node's JSON
                    body = _decode(await request.read())
                except msgspec.DecodeError as exc:
                    raise FusionRequestError(f"the body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise FusionRequestError(f"the body is a JSON object (SandboxFusion's {shape})")
                result = answer(await call(request, convert(body)))
            except AuthenticationError as exc:
                return error(exc)
            except Exception as exc:  # shoal could not run it: SandboxFusion's SandboxError, with the cause
                if not isinstance(exc, ShoalError):
                    return error(exc)
                return _json(sandbox_error(f"{type(exc).__name__}: {exc}"))
            return _json(result)

        return handle

    return [
        web.post("/run_code", handler("RunCodeRequest", to_args, to_response)),
        web.post("/run_jupyter", handler("RunJupyterRequest", jupyter_args, to_jupyter_response)),
    ]
