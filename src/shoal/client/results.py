"""What client calls return."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import ShoalError
from shoal.protocol import ExecResult as WireExecResult
from shoal.protocol import FileEntry, SandboxInfo

__all__ = ["CommandError", "ExecResult", "FileEntry", "SandboxInfo"]


class CommandError(ShoalError):
    """Raised by `ExecResult.check()` for a command that failed or timed out."""

    def __init__(self, result: ExecResult) -> None:
        reason = "timed out" if result.timed_out else f"exited {result.exit_code}"
        super().__init__(f"command {reason}: {result.stderr[-500:]!r}")
        self.result = result


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command. `stdout`/`stderr` are text (UTF-8, invalid bytes replaced);
    the raw bytes are in `stdout_bytes`/`stderr_bytes`."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration_s: float
    timed_out: bool = False
    truncated: bool = False  # the output cap cut the middle of an output (see `stdout_omitted`)
    signal: int = 0
    oom_killed: bool = False
    stdout_omitted: int = 0  # bytes of stdout cut between the kept head and tail, where a marker line stands
    stderr_omitted: int = 0
    exec_id: int | None = None  # this exec's processes that outlive it: sb.processes(), sb.kill_processes(exec_id)

    @classmethod
    def from_wire(cls, raw: dict | WireExecResult) -> ExecResult:
        if isinstance(raw, dict):
            raw = WireExecResult(**raw)
        return cls(
            exit_code=raw.exit_code,
            stdout_bytes=raw.stdout,
            stderr_bytes=raw.stderr,
            duration_s=raw.duration_s,
            timed_out=raw.timed_out,
            truncated=raw.truncated,
            signal=raw.signal,
            oom_killed=raw.oom_killed,
            stdout_omitted=raw.stdout_omitted,
            stderr_omitted=raw.stderr_omitted,
            exec_id=raw.exec_id,
        )

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """Return self if the command succeeded, else raise CommandError."""
        if not self.ok:
            raise CommandError(self)
        return self
