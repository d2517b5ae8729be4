"""Start helper programs without blocking the event loop and without a thread per child.

`posix_spawn` (vfork-fast) starts the child; a pidfd registered with the event loop says when it exited.
A cancelled wait kills and reaps the child, so a cancelled create leaves no stray runtime process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import Awaitable, Callable, Sequence

# Calls a spawn (a function returning the child's pid) where it must run; awaits its pid.
Starter = Callable[[Callable[[], int]], Awaitable[int]]


async def run(
    argv: Sequence[str],
    *,
    log_path: str = "/dev/null",
    pass_fd: int | None = None,
    timeout: float | None = 60.0,
    starter: Starter | None = None,
) -> int:
    """Run `argv` with stdin from /dev/null, stdout+stderr appended to `log_path`; return its status.

    `pass_fd`, if given, is made fd 3 of the child (the runtime hands it on to the sandbox). `starter`, if
    given, calls the spawn where it must happen (e.g. on a thread inside another mount namespace) and
    returns the child's pid.
    """
    begin = functools.partial(start, argv, log_path=log_path, pass_fd=pass_fd)
    if starter is None:
        pid = begin()
    else:  # a cancel while the starter's thread spawns must still reap what it started
        started = asyncio.ensure_future(starter(begin))
        try:
            pid = await asyncio.shield(started)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                _kill_and_reap(await started)
            raise
    return await wait(pid, timeout=timeout)


def start(argv: Sequence[str], *, log_path: str = "/dev/null", pass_fd: int | None = None) -> int:
    """posix_spawn `argv` as `run` describes; its pid (the caller reaps it)."""
    actions: list[tuple] = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    spare = None
    if pass_fd is not None:
        if pass_fd == 3:  # dup2(3, 3) would not clear close-on-exec
            spare = pass_fd = os.dup(pass_fd)
        actions.append((os.POSIX_SPAWN_DUP2, pass_fd, 3))
    try:
        return os.posix_spawnp(argv[0], list(argv), os.environ, file_actions=actions)
    finally:
        if spare is not None:
            os.close(spare)


async def wait(pid: int, *, timeout: float | None = None) -> int:
    """Wait for child `pid` to exit and reap it; on cancel or timeout, SIGKILL and reap it."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout)
    except BaseException:
        _kill_and_reap(pid)
        raise
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def wait_pidfd(pidfd: int, *, timeout: float | None = None) -> None:
    """Wait until the process behind `pidfd` (not necessarily our child) has exited."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout)
    finally:
        loop.remove_reader(pidfd)


async def kill_cgroup_init(pid: int, cgroup_path: str) -> bool:
    """SIGKILL `pid`, a sandbox's init (the kernel then kills the rest of its PID namespace), and wait for it
    to exit; False (nothing done) unless `pid` is provably in `cgroup_path`, i.e. not a recycled pid."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            if f"{cgroup_path}\n" not in handle.read():
                return False
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await wait_pidfd(pidfd, timeout=10)
    except (OSError, TimeoutError):
        return False
    finally:
        os.close(pidfd)
    return True


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
