"""The node's transport: length-prefixed msgpack requests over a stream socket (Unix here; TCP later).

Each request runs as its own task, so one connection carries many concurrent operations; a request whose
connection goes away is cancelled (an exec's process tree is then killed by the agent).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from shoal import protocol
from shoal.errors import InvalidRequestError, ShoalError
from shoal.node.service import NodeService
from shoal.node.trajectory import detached_tasks
from shoal.protocol import ErrorInfo, Request, Response

log = logging.getLogger("shoal.server")

OPS = [
    "hello", "create", "get", "list", "kill", "close_all", "keepalive", "exec",
    "file_write", "file_read", "file_list", "file_stat", "file_mkdir", "file_remove", "file_untar",
    "shell_open", "shell_run", "shell_close", "pool_set", "image_build", "image_list", "status",
    "image_ls", "image_inspect", "image_rm", "image_prune", "image_tag", "image_squash", "image_import", "image_export",
    "image_pull", "image_push",
    "sandbox_snapshot",
    "set_network",
    "fn_call", "fn_run_code",
    "attach", "pause", "resume", "pause_all", "resume_all", "log_steps", "replay",
    "vm_snapshot", "vm_snapshot_delete", "fork",
    "settings_env",
]  # fmt: skip


class _Op:
    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        hints = typing.get_type_hints(method)
        params = inspect.signature(method).parameters
        self.types = {name: hints.get(name, Any) for name in params if name != "emit"}
        self.streams = "emit" in params

    def arguments(self, args: dict[str, Any]) -> dict[str, Any]:
        unknown = set(args) - set(self.types)
        if unknown:
            raise InvalidRequestError(f"unknown arguments {sorted(unknown)}")
        try:
            return {k: protocol.convert(v, self.types[k]) for k, v in args.items()}
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"invalid request: {exc}") from None


class NodeServer:
    def __init__(self, service: NodeService) -> None:
        self.service = service
        self.ops = {name: _Op(getattr(service, name)) for name in OPS}
        self.connections = 0
        # called as observer(op, seconds, error_type_or_None) after each request (metrics)
        self.observers: list[Callable[[str, float, str | None], None]] = []

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Any = None, guard: Any = None
    ) -> None:
        """Serve one connection. `session` (TCP: a token-authenticated project, see cluster/front.py) wraps each
        request: `session.serve(request)` answers its own ops (`session.ops`), `session.call(op, args,
        invoke)` checks and rewrites the others around `invoke(args)`. `guard` (shoal.netguard) holds a TCP peer
        to its pre-auth and idle limits."""
        self.connections += 1
        lock = asyncio.Lock()

        async def send(message: Response) -> None:
            writer.write(protocol.encode(message))
            if writer.transport.get_write_buffer_size() > 1 << 20:
                async with lock:
                    await writer.drain()

        try:
            # a step whose client is gone finishes and is logged (detached), then the task is cancelled
            await protocol.dispatch_requests(
                reader,
                lambda request: self._serve(request, send, session),
                abandon=detached_tasks.add,
                guard=guard,
            )
        finally:
            self.connections -= 1
            writer.close()

    async def _serve(self, request: Request, send: Callable[[Response], Any], session: Any = None) -> None:
        started = time.monotonic()
        error: str | None = None
        try:
            if session is not None and request.op in session.ops:
                result = await session.serve(request)
            else:
                op = self.ops.get(request.op)
                if op is None:
                    raise InvalidRequestError(f"unknown operation {request.op!r}")

                async def invoke(args: dict[str, Any]) -> Any:
                    kwargs = op.arguments(args)
                    if op.streams:

                        async def emit(event: Any) -> None:
                            await send(Response(id=request.id, event=event))

                        kwargs["emit"] = emit
                    return await op.method(**kwargs)

                if session is None:
                    result = await invoke(request.args)
                else:
                    result = await session.call(request.op, request.args, invoke)
            response = Response(id=request.id, result=result)
        except asyncio.CancelledError:
            response = Response(id=request.id, error=ErrorInfo(type="CancelledError", message="cancelled"))
        except ShoalError as exc:
            response = Response(id=request.id, error=ErrorInfo(type=type(exc).__name__, message=str(exc)))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError) as exc:
            response = Response(id=request.id, error=ErrorInfo(type=type(exc).__name__, message=str(exc)))
        except Exception as exc:
            log.exception("operation %s failed", request.op)
            message = f"{type(exc).__name__}: {exc}"
            response = Response(id=request.id, error=ErrorInfo(type="ShoalError", message=message))
        if response.error is not None:
            error = response.error.type
        for observer in self.observers:
            observer(request.op, time.monotonic() - started, error)
        try:
            await send(response)
        except (ConnectionError, RuntimeError):
            pass
