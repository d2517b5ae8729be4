"""`sb.adb()`: Android's adb, on the client's machine, connected to the adbd of an agentless vm.

The guest's port 5555 is carried by `sb.forward(5555)` (raw TCP through the node's or gateway's relay; the
guest's own network is private and has no route out), and `adb connect 127.0.0.1:<local port>` makes it a
device of the local adb server. `run(...)` is `adb -s <that device> ...`. Nothing here knows Android: any
adbd behind the guest's port 5555 will do. Needs the `adb` program (Debian: `apt-get install adb`).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from typing import Any

from shoal.errors import InvalidRequestError, ShoalError

ADB_PORT = 5555


def adb_program(program: str = "adb") -> str:
    path = shutil.which(program)
    if path is None:
        raise InvalidRequestError(f"{program!r} is not installed on this machine: `apt-get install adb` (Debian)")
    return path


def _connected(output: str) -> bool:
    return "connected to" in output and "cannot" not in output and "failed" not in output


class AsyncAdb:
    """adb connected through a forward (`await sb.adb()`); `await adb.close()` disconnects and stops it."""

    def __init__(self, forward: Any, program: str = "adb") -> None:
        self.forward = forward
        self.program = adb_program(program)
        self.serial = forward.address  # "127.0.0.1:<local port>": the device's name for adb -s

    async def _adb(self, *args: str, timeout: float | None = 60) -> subprocess.CompletedProcess[str]:
        proc = await asyncio.create_subprocess_exec(
            self.program, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return subprocess.CompletedProcess([self.program, *args], proc.returncode or 0, out.decode(), err.decode())

    async def connect(self, timeout: float = 60) -> AsyncAdb:
        """`adb connect`; ShoalError if adb says it could not (no adbd behind the guest's port, or it refused)."""
        done = await self._adb("connect", self.serial, timeout=timeout)
        if not _connected(done.stdout + done.stderr):
            raise ShoalError(f"adb connect {self.serial} failed: {(done.stdout + done.stderr).strip()[-300:]}")
        return self

    async def run(self, *args: str, timeout: float | None = 120) -> subprocess.CompletedProcess[str]:
        """`adb -s <serial> ARGS...` (e.g. run("shell", "getprop ro.build.version.release"))."""
        return await self._adb("-s", self.serial, *args, timeout=timeout)

    async def close(self) -> None:
        try:
            await self._adb("disconnect", self.serial, timeout=30)
        finally:
            await self.forward.close()

    async def __aenter__(self) -> AsyncAdb:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
