"""Persistent shells: one long-lived shell process per session; cwd and env survive between commands.

Each command is sent as `eval '<cmd>' </dev/null` followed by a marker line carrying `$?` on stdout and a
marker on stderr; output is everything before the markers. Captured output per command is capped.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from shoal.errors import InvalidRequestError
from shoal.guest import ExecProcess
from shoal.protocol import ExecResult, HeadTail


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class _Cutter:
    """Collects one stream until the marker line arrives, its head and tail under `cap` (see HeadTail)."""

    def __init__(self, marker: bytes, cap: int, wants_code: bool) -> None:
        self.marker = marker
        self.cap = cap
        self.wants_code = wants_code
        self.window = len(marker) + 32
        self.buf = bytearray()
        self.kept = HeadTail(cap)
        self.done = False
        self.code = 0

    def _keep(self, data: bytes | bytearray) -> None:
        self.kept.feed(data)

    def feed(self, data: bytes) -> None:
        self.buf += data
        idx = self.buf.find(self.marker)
        if idx < 0:
            if len(self.buf) > self.window:
                cut = len(self.buf) - self.window
                self._keep(self.buf[:cut])
                del self.buf[:cut]
            return
        end = self.buf.find(b"\n", idx + len(self.marker))
        if end < 0:
            return
        self._keep(self.buf[: max(0, idx - 1)])  # drop the newline the marker printf adds first
        if self.wants_code:
            digits = bytes(self.buf[idx + len(self.marker) : end])
            self.code = int(digits or b"0")
        self.buf.clear()
        self.done = True


class ShellSession:
    def __init__(self, shell_id: str, sandbox_id: str, proc: ExecProcess, cap: int) -> None:
        self.id = shell_id
        self.sandbox_id = sandbox_id
        self.proc = proc
        self.cap = cap
        self.lock = asyncio.Lock()
        self.closed = False
        self._pending: asyncio.Future | None = None

    async def run(self, cmd: str, timeout: float | None, idle_timeout: float | None) -> ExecResult:
        if self.closed:
            raise InvalidRequestError(f"shell {self.id} has exited; open a new one with sandbox.shell()")
        async with self.lock:
            return await self._run(cmd, timeout, idle_timeout)

    async def _run(self, cmd: str, timeout: float | None, idle_timeout: float | None) -> ExecResult:
        nonce = secrets.token_hex(8)
        marker = f"__SHOAL_{nonce}__"
        script = (
            f"eval {shell_quote(cmd)} </dev/null\n"
            f"__shoal_rc=$?; printf '\\n{marker}%d\\n' \"$__shoal_rc\"; printf '\\n{marker}\\n' >&2\n"
        )
        out = _Cutter(marker.encode(), self.cap, True)
        err = _Cutter(marker.encode(), self.cap, False)
        start = time.monotonic()
        last_output = start
        timed_out = False
        await self.proc.write_stdin(script.encode())
        while not (out.done and err.done):
            now = time.monotonic()
            waits = [timeout - (now - start)] if timeout else []
            if idle_timeout:
                waits.append(idle_timeout - (now - last_output))
            wait = max(0.0, min(waits)) if waits else None
            if self._pending is None:
                self._pending = asyncio.ensure_future(self.proc.next_output())
            done, _ = await asyncio.wait({self._pending}, timeout=wait)
            if not done:
                timed_out = True
                break
            item = self._pending.result()
            self._pending = None
            if item is None:  # the shell itself exited (e.g. `exit`)
                self.closed = True
                code = self.proc.exit.exit_code if self.proc.exit else -1
                out._keep(out.buf)
                err._keep(err.buf)
                return self._result(out, err, code, start, False)
            last_output = time.monotonic()
            (out if item[0] == "stdout" else err).feed(item[1])
        if timed_out:
            await self.close()
            out._keep(out.buf)
            err._keep(err.buf)
            return self._result(out, err, 124, start, True)
        return self._result(out, err, out.code, start, False)

    def _result(self, out: _Cutter, err: _Cutter, code: int, start: float, timed_out: bool) -> ExecResult:
        return ExecResult(
            exit_code=code,
            stdout=out.kept.value(),
            stderr=err.kept.value(),
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
            truncated=bool(out.kept.omitted or err.kept.omitted),
            stdout_omitted=out.kept.omitted,
            stderr_omitted=err.kept.omitted,
        )

    async def close(self) -> None:
        self.closed = True
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        try:
            await self.proc.kill(9)
        except Exception:  # noqa: S110 - connection already gone
            pass
        await self.proc.close()
