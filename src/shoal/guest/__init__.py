"""The shoal guest agent (PID 1 inside sandboxes) and its asyncio client."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shoal.guest.client import AgentClient, AgentError, ExecProcess, ExitInfo, FileEntry

__all__ = [
    "AgentClient",
    "AgentError",
    "ExecProcess",
    "ExitInfo",
    "FileEntry",
    "agent_binary_path",
]

_DIR = Path(__file__).resolve().parent
_SOURCE = _DIR / "agent.c"
_SOURCES = (_SOURCE, _DIR / "procs.c")  # agent.c includes procs.c: one translation unit
_BINARY = _DIR / "shoal-agent"


def agent_binary_path() -> str:
    """Path of the static ``shoal-agent`` binary, (re)building it with gcc if stale."""
    try:
        if _BINARY.stat().st_mtime >= max(src.stat().st_mtime for src in _SOURCES):
            return str(_BINARY)
    except FileNotFoundError:
        if not _SOURCE.exists():
            raise RuntimeError(f"shoal-agent source missing: {_SOURCE}") from None
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError(
            f"cannot build {_BINARY}: gcc not found; install gcc and the static libc "
            "(e.g. `apt-get install gcc libc6-dev`) or run `make` in that directory"
        )
    fd, tmp = tempfile.mkstemp(prefix=".shoal-agent-", dir=_DIR)
    os.close(fd)
    try:
        cmd = [gcc, "-O2", "-static", "-Wall", "-Wextra", "-o", tmp, str(_SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building {_BINARY} with gcc failed (need gcc and static libc, e.g. "
                f"`apt-get install gcc libc6-dev`):\n{proc.stderr.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, _BINARY)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(_BINARY)
