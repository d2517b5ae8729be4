"""Deterministic replay: run a recorded trajectory again in a fresh sandbox and compare every outcome.

The fresh sandbox gets the recorded spec (optionally another image) and each logged step is issued again
in order; its own steps are logged as usual. A step differs when its outcome does: exit code, stdout,
stderr, timed_out or signal for commands; the value (or error) for file operations. Durations, shell IDs
and file mtimes are not compared. Snapshot steps are listed as skipped, not re-run, and so are steps whose
input payload the log kept only as a digest (steps.BULK_BYTES); a large read is compared by digest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from shoal.errors import InvalidRequestError, SandboxNotFoundError
from shoal.node.trajectory import Step, _error
from shoal.protocol import ExecRequest, SandboxSpec, convert
from shoal.steps import BULK_ARGS, BULK_BYTES, bulk, is_bulk

if TYPE_CHECKING:
    from shoal.node.trajectory import TrajectoryLog
    from shoal.protocol import SandboxInfo


class ReplayHost(Protocol):
    """The node operations a replay issues (shoal.node.service.NodeService is one)."""

    trajectory: TrajectoryLog

    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    async def exec(self, req: ExecRequest) -> Any: ...

    async def shell_open(self, sandbox_id: str) -> str: ...

    async def shell_run(self, shell_id: str, **args: Any) -> Any: ...

    async def proc_start(self, sandbox_id: str, **args: Any) -> Any: ...

    async def kill(self, sandbox_id: str, reason: str = ...) -> bool: ...


EXEC_FIELDS = ("exit_code", "stdout", "stderr", "timed_out", "signal")
NOT_REPLAYED = {"sandbox_snapshot": "a replay must not overwrite the image the original run committed"}
_roundtrip = msgspec.msgpack.Decoder().decode
_encode = msgspec.msgpack.Encoder().encode


async def replay(service: ReplayHost, sandbox_id: str, image: str | None, keep: bool) -> dict[str, Any]:
    record = service.trajectory.sandbox(sandbox_id)
    if record is None:
        raise SandboxNotFoundError(f"sandbox {sandbox_id} has no trajectory record to replay")
    spec = convert(record["spec"], SandboxSpec)
    # the replay's sandbox gets the node's default lifetimes (it may be kept), not the original's
    unset = msgspec.UNSET
    spec = msgspec.structs.replace(spec, image=image or spec.image, trajectory=None, ttl_s=unset, idle_timeout_s=unset)
    steps = list(service.trajectory.steps(sandbox_id))
    info = await service.create(spec)
    shells: dict[str, Any] = {}  # logged shell and background process IDs -> the replay's
    differences: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        for step in steps:
            if step.op in NOT_REPLAYED:
                skipped.append({"seq": step.seq, "step": step.describe(), "why": NOT_REPLAYED[step.op]})
                continue
            name = BULK_ARGS.get(step.op)
            if name and is_bulk(step.args.get(name)):
                why = f"its {name} ({step.args[name]['size']} bytes) was logged as a digest only (over {BULK_BYTES})"
                skipped.append({"seq": step.seq, "step": step.describe(), "why": why})
                continue
            try:
                outcome: Any = _roundtrip(_encode(await _issue(service, info.id, step, shells)))
                error = None
            except Exception as exc:
                outcome, error = None, _error(exc)
            differences += _compare(step, outcome, error)
    finally:
        if not keep:
            await service.kill(info.id, reason="replay finished")
    return {
        "source": sandbox_id,
        "sandbox_id": info.id,
        "image": spec.image,
        "steps": len(steps),
        "differences": differences,
        "skipped": skipped,
    }


async def _issue(service: ReplayHost, sandbox_id: str, step: Step, shells: dict[str, Any]) -> Any:
    args = dict(step.args)
    if step.op == "exec":
        return await service.exec(ExecRequest(sandbox_id=sandbox_id, **args))
    if step.op == "shell_open":
        shell_id = await service.shell_open(sandbox_id)
        if isinstance(step.result, str):
            shells[step.result] = shell_id
        return shell_id
    if step.op == "shell_run":
        shell_id = shells.get(args.pop("shell_id"), "")
        return await service.shell_run(shell_id, **args)
    if step.op.startswith("file_"):
        return await getattr(service, step.op)(sandbox_id, **args)
    if step.op == "proc_start":  # the replay's process has its own ID: later steps are mapped to it
        started = await service.proc_start(sandbox_id, **args)
        if isinstance(step.result, dict):
            shells[f"proc:{step.result.get('id')}"] = started["id"]
        return started
    if step.op in ("proc_input", "proc_signal"):
        args["id"] = shells.get(f"proc:{args.get('id')}", -1)
        return await getattr(service, step.op)(sandbox_id, **args)
    raise InvalidRequestError(f"step {step.seq} ({step.op}) cannot be replayed")


def _compare(step: Step, outcome: Any, error: tuple[str, str] | None) -> list[dict[str, Any]]:
    base = {"seq": step.seq, "step": step.describe()}
    logged_error = (step.error_type, step.error) if step.error_type else None
    if (logged_error is None) != (error is None):
        return [{**base, "field": "error", "logged": logged_error, "replayed": error}]
    if error is not None or step.op in ("shell_open", "proc_start", "proc_input", "proc_signal"):
        return []  # a background process's ID, pid and offsets are its own; what it printed is read, not logged
    if step.op in ("exec", "shell_run"):
        return [
            {**base, "field": name, "logged": step.result.get(name), "replayed": outcome.get(name)}
            for name in EXEC_FIELDS
            if step.result.get(name) != outcome.get(name)
        ]
    if is_bulk(step.result) and isinstance(outcome, bytes):  # a large read: compare digests
        if bulk(outcome) != step.result:
            return [{**base, "field": "result", "logged": step.result, "replayed": bulk(outcome)}]
        return []
    if _without_mtime(step.result) != _without_mtime(outcome):
        return [{**base, "field": "result", "logged": step.result, "replayed": outcome}]
    return []


def _without_mtime(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "mtime"}
    if isinstance(value, list):
        return [_without_mtime(v) for v in value]
    return value
