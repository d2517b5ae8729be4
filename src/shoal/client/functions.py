"""Stateless calls: `call`, `map` and `run_code` on the node's warm function workers.

Functions go INTO the sandbox cloudpickled (by value when defined in __main__ or a notebook); what comes
back is JSON text, parsed here with `json.loads`: a result can never run code in the client.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shoal import protocol
from shoal.client.results import ExecResult
from shoal.errors import ShoalError
from shoal.protocol import SandboxSpec


class RpcClient(Protocol):
    """What these helpers need of shoal.client.aio.AsyncClient (which imports this module)."""

    async def rpc(self, op: str, args: dict[str, Any] | None = None, **kw: Any) -> Any: ...


PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
_SPEC_FIELDS = set(SandboxSpec.__struct_fields__) - {"kind", "files", "pool", "labels", "ttl_s", "owner"}


class FunctionError(ShoalError):
    """A call did not return a value: it raised, timed out, ran out of memory or crashed.

    `type` is the exception's class name inside the sandbox ("ZeroDivisionError", ...) or one of
    "TimeoutError", "MemoryError", "WorkerCrashed", "ResultTooLarge"; `remote_traceback`, `stdout`
    and `stderr` are what the call printed.
    """

    def __init__(self, outcome: dict[str, Any]) -> None:
        error = outcome["error"] or {}
        self.type: str = error.get("type", "Exception")
        self.message: str = error.get("message", "")
        self.remote_traceback: str = error.get("traceback", "")
        self.stdout: str = outcome.get("stdout", b"").decode("utf-8", "replace")
        self.stderr: str = outcome.get("stderr", b"").decode("utf-8", "replace")
        self.timed_out: bool = bool(outcome.get("timed_out"))
        self.oom_killed: bool = bool(outcome.get("oom_killed"))
        super().__init__(f"{self.type}: {self.message}")


@dataclass(frozen=True)
class RunCodeResult:
    """`status` is ok | compile_error | compile_timeout | runtime_error | timeout | memory_exceeded."""

    status: str
    compile: ExecResult | None
    run: ExecResult | None
    files: dict[str, bytes | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stdout(self) -> str:
        return self.run.stdout if self.run else ""


def _spec(image: str, limits: dict[str, Any]) -> dict[str, Any]:
    unknown = set(limits) - _SPEC_FIELDS
    if unknown:
        raise TypeError(f"unexpected arguments {sorted(unknown)}; limits and options: {sorted(_SPEC_FIELDS)}")
    return protocol.to_builtins(SandboxSpec(kind="function", image=image, **limits))


def _payload(fn: Callable[..., Any] | str, args: tuple, kwargs: dict[str, Any] | None, entry: str | None) -> dict:
    if isinstance(fn, str):
        try:
            json.dumps([list(args), kwargs or {}])
        except TypeError as exc:
            raise TypeError(f"arguments to Python source must be JSON data ({exc}); pass a function instead") from exc
        return {"source": fn, "entry": entry, "args": list(args), "kwargs": kwargs or {}}
    if not callable(fn):
        raise TypeError(f"call() takes a function or Python source, not {type(fn).__name__}")
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - a dependency of shoal
        raise ShoalError("calling a Python function needs cloudpickle: pip install cloudpickle") from exc
    return {"pickle": cloudpickle.dumps(fn), "args": cloudpickle.dumps((args, kwargs or {})), "python": PYTHON}


def _value(outcome: dict[str, Any]) -> Any:
    if not outcome["ok"]:
        raise FunctionError(outcome)
    try:
        return json.loads(outcome["value"])
    except ValueError:
        message = "the call put something other than JSON on its result channel"
        raise FunctionError({**outcome, "error": {"type": "MalformedResult", "message": message}}) from None


async def call(
    client: RpcClient,
    fn: Callable[..., Any] | str,
    *args: Any,
    kwargs: dict[str, Any] | None = None,
    entry: str | None = None,
    image: str = "debian",
    timeout: float | None = 60.0,
    sandbox_id: str | None = None,
    **limits: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` in a fresh isolated worker and return its (JSON) value.

    `fn` is a function, or Python source: then `entry` names the function to call, or without `entry`
    the value of the source's last expression is returned. Limits: memory_mb, cpu, pids, env, workdir.
    Raises FunctionError if the call raised, timed out, ran out of memory or crashed.
    """
    outcome = await client.rpc(
        "fn_call",
        {
            "spec": _spec(image, limits),
            "call": _payload(fn, args, kwargs, entry),
            "timeout": timeout,
            "sandbox_id": sandbox_id,
        },
    )
    return _value(outcome)


MAX_BATCH = 64  # items per round trip at most: results stream back a batch at a time


def _batch_size(items: Iterable[Any], concurrency: int) -> int:
    """Items per round trip: enough to spread what is known of the work over `concurrency` batches four
    times over (so every worker stays busy and results keep coming), at most MAX_BATCH; 8 for iterators."""
    try:
        count = len(items)  # type: ignore[arg-type]
    except TypeError:
        return 8
    return max(1, min(MAX_BATCH, -(-count // (4 * concurrency))))


async def map_calls(
    client: RpcClient,
    fn: Callable[..., Any] | str,
    items: Iterable[Any],
    *,
    concurrency: int = 32,
    batch: int | None = None,
    entry: str | None = None,
    image: str = "debian",
    timeout: float | None = 60.0,
    star: bool = False,
    isolation: Literal["item", "batch"] = "item",
    **limits: Any,
) -> AsyncIterator[Any]:
    """Yield `fn(item)` for each item, in order, `concurrency` at a time; a failed item yields its FunctionError.

    With `star=True` each item is an argument tuple. The function is pickled and sent once per batch:
    `batch` items (default: sized to the work, at most 64) go to one worker in one round trip, each still
    in a fresh child of its own with nothing of the previous item's left (files, processes, IPC); results
    come back a batch at a time, in order. Leaving the loop early cancels the batches in flight.

    `isolation="batch"` trades that per-item isolation for speed: the items of a batch run one after
    another in ONE forked child, the function unpickled once, so an item sees what the items before it in
    its batch left (globals, module state, files, processes). Each item still gets its own result or error,
    output and timeout; an item that ends the process (crash, timeout, memory) fails alone and the rest of
    its batch run in a fresh child. Batches never share. Use it for pure functions only.
    """
    if isolation not in ("item", "batch"):
        raise ValueError(f"isolation must be 'item' or 'batch', not {isolation!r}")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if batch is not None and not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be between 1 and {MAX_BATCH}")
    size = batch or _batch_size(items, concurrency)
    spec = _spec(image, limits)
    if isinstance(fn, str):
        call: dict[str, Any] = {"source": fn, "entry": entry}

        def arguments(item: Any) -> Any:
            args = list(item) if star else [item]
            try:
                json.dumps(args)
            except TypeError as exc:
                raise TypeError(f"arguments to Python source must be JSON data ({exc}); pass a function") from exc
            return args
    else:
        import cloudpickle

        call = {"pickle": cloudpickle.dumps(fn), "python": PYTHON}

        def arguments(item: Any) -> Any:
            return cloudpickle.dumps((tuple(item) if star else (item,), {}))

    async def one(chunk: list[Any]) -> list[Any]:
        args = {"spec": spec, "call": call, "items": chunk, "timeout": timeout}
        if isolation != "item":  # the default is left out: a node without the option runs it as before
            args["isolation"] = isolation
        outcomes = await client.rpc("fn_map", args)
        values: list[Any] = []
        for outcome in outcomes:
            try:
                values.append(_value(outcome))
            except FunctionError as exc:
                values.append(exc)
        return values

    pending: deque[asyncio.Task[list[Any]]] = deque()
    iterator = iter(items)
    try:
        while True:
            chunk = [arguments(item) for _, item in zip(range(size), iterator, strict=False)]
            if not chunk:
                break
            pending.append(asyncio.ensure_future(one(chunk)))
            if len(pending) >= concurrency:
                for value in await pending.popleft():
                    yield value
        while pending:
            for value in await pending.popleft():
                yield value
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def run_code(
    client: RpcClient,
    code: str,
    language: str = "python",
    *,
    stdin: bytes | str | None = None,
    files: dict[str, bytes | str] | None = None,
    compile_timeout: float | None = 30.0,
    run_timeout: float | None = 10.0,
    output_files: Iterable[str] = (),
    image: str = "debian-dev",
    **limits: Any,
) -> RunCodeResult:
    """Compile (c, c++) and run a program (python, bash, c, c++) in a fresh worker, in /work.

    `files` are written next to it first; `output_files` (paths relative to /work) come back in `.files`.
    """
    raw = await client.rpc(
        "fn_run_code",
        {
            "spec": _spec(image, limits),
            "code": code,
            "language": language,
            "stdin": stdin.encode() if isinstance(stdin, str) else stdin,
            "files": {k: v.encode() if isinstance(v, str) else v for k, v in (files or {}).items()},
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "output_files": list(output_files),
        },
    )
    return RunCodeResult(
        status=raw["status"],
        compile=None if raw["compile"] is None else ExecResult.from_wire(raw["compile"]),
        run=None if raw["run"] is None else ExecResult.from_wire(raw["run"]),
        files=raw["files"],
    )
