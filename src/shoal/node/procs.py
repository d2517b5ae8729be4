"""The node's side of background processes and terminals (`sb.exec(..., background=True)`, `sb.pty()`).

The process lives in the sandbox, kept by the guest agent (guest/procs.c): not by this node's request, nor
by the client's connection, so it survives both (a client that dies, a node restart with a container that
is re-adopted) and dies with the sandbox. Its output stays in the agent's rings (the last
`output_cap_bytes` of each stream, counted from the start), so any client reads on from the offsets it has
(`proc_read`), and a new client finds it with `proc_list` and reattaches by its ID. Starting one and
writing to it (`proc_start`, `proc_input`, `proc_signal`) are steps of the trajectory; reads and resizes
are not. The functions here speak to the agent; NodeService adds the sandbox lookup, steps and errors.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.errors import CapacityError, InvalidRequestError, ProcessNotFoundError, ShoalError
from shoal.guest import AgentClient, AgentError
from shoal.guest.client import Attached, BackgroundStatus, control_frames
from shoal.protocol import OutputChunk

Emit = Callable[[Any], Awaitable[None]]
DEFAULT_TERM = "xterm-256color"
READ_MAX_BYTES = 16 << 20  # one proc_read answers at most this much; the offsets say where to go on


def agent_error(exc: AgentError, sandbox_id: str, id: int | None) -> ShoalError:
    """The typed error for what the agent answered about a background process."""
    if exc.errno == errno.ESRCH:
        return ProcessNotFoundError(
            f"no background process {id} in sandbox {sandbox_id}: it was never started there, or it ended and "
            "the agent let it go (a few minutes after its end; sb.processes(background=True) lists the ones kept)"
        )
    if exc.errno in (errno.EAGAIN, errno.ENOBUFS, errno.EBUSY, errno.ENOMEM):
        return CapacityError(f"sandbox {sandbox_id}: {exc.strerror or exc}")
    if exc.errno == errno.EINVAL:
        return InvalidRequestError(f"sandbox {sandbox_id}: {exc.strerror or exc}")
    return ShoalError(f"sandbox {sandbox_id}: background process {id}: {exc.strerror or exc}")


def terminal_size(pty: dict[str, int] | None) -> tuple[int, int] | None:
    """(rows, cols) from {"cols": c, "rows": r}; a typed error for anything else."""
    if pty is None:
        return None
    cols, rows = pty.get("cols"), pty.get("rows")
    if not isinstance(cols, int) or not isinstance(rows, int) or not (0 < cols < 65536 and 0 < rows < 65536):
        raise InvalidRequestError(f"a terminal needs cols and rows between 1 and 65535, not {pty}")
    return rows, cols


def status_dict(status: BackgroundStatus) -> dict[str, Any]:
    return {
        "stdout_offset": status.stdout_offset,
        "stderr_offset": status.stderr_offset,
        "running": status.running,
        "exit_code": None if status.running else status.exit_code,
        "signal": None if status.running else status.signal,
    }


async def start(
    agent: AgentClient,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    ring_bytes: int,
    merge_stderr: bool,
    size: tuple[int, int] | None,
    stdin: bytes | None,
    open_stdin: bool = True,
    follow: list[Attached] | None = None,
) -> dict[str, Any]:
    """Start it; with `follow` (a list), it is also followed from its start on the same connection to the
    agent, whose Attached is appended there (see `read`; the caller closes it), when the agent can."""
    if size is not None:
        env = {"TERM": DEFAULT_TERM, **env}
    options = dict(env=env, cwd=cwd, uid=uid, gid=gid, ring_bytes=ring_bytes, merge_stderr=merge_stderr, size=size,
                   stdin_pipe=open_stdin or bool(stdin))  # fmt: skip
    if follow is None:
        pid, id = await agent.background(argv, **options)
    else:
        pid, id, attached = await agent.background_follow(argv, **options)
        if attached is not None:
            follow.append(attached)
    if stdin:
        await agent.control(id, control_frames(stdin=stdin, eof=not open_stdin))
    return {"id": id, "pid": pid, "pty": size is not None}


async def read(
    agent: AgentClient,
    id: int,
    offsets: tuple[int, int],
    *,
    follow: bool,
    timeout: float | None,
    max_bytes: int,
    emit: Emit | None,
) -> dict[str, Any]:
    """Output from `offsets`: what there is now, or (follow) until the process ended or `timeout` passed;
    with `emit`, a follower's output goes out as events instead of in the answer."""
    attached = await agent.attach(id, Attached.FOLLOW if follow else Attached.READ, offsets)
    return await read_attached(attached, id, follow=follow, timeout=timeout, max_bytes=max_bytes, emit=emit)


async def read_attached(
    attached: Attached, id: int, *, follow: bool, timeout: float | None, max_bytes: int, emit: Emit | None
) -> dict[str, Any]:
    """`read` on a connection attached already (`start` with follow); closes it."""
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout if timeout is not None else None
    try:
        while True:
            if deadline is None:
                item = await attached.next()
            else:  # asyncio.timeout, not wait_for: no task per item (3.11's wait_for wraps the read in one)
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        item = await attached.next()
                except TimeoutError:
                    break
            if item is None:
                break
            stream, data = item
            if emit is not None and follow:
                await emit(OutputChunk(stream=stream, data=data))
                continue
            (out if stream == "stdout" else err).extend(data)
            if len(out) + len(err) >= max_bytes:
                break
    finally:
        await attached.close()
    status = attached.status
    result = {"id": id, "pid": attached.pid, "pty": attached.pty, "stdout": bytes(out), "stderr": bytes(err)}
    if status is None:  # stopped early (timeout, max_bytes): where it stands is where this read got to
        result.update(stdout_offset=attached.offsets[0], stderr_offset=attached.offsets[1], running=True)
        result.update(exit_code=None, signal=None)
    else:
        result.update(status_dict(status))
    return result


async def control(agent: AgentClient, id: int, frames: bytes) -> dict[str, Any]:
    return {"id": id, **status_dict(await agent.control(id, frames))}


async def listing(agent: AgentClient, commands: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {
            "id": e.id,
            "pid": e.pid,
            "pty": e.pty,
            "running": e.running,
            "exit_code": None if e.running else e.exit_code,
            "signal": None if e.running else e.signal,
            "stdout_offset": e.stdout_total,
            "stderr_offset": e.stderr_total,
            "command": commands.get(e.id),
        }
        for e in await agent.background_list()
    ]
