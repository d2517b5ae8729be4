"""The shoal guest agent (PID 1 inside sandboxes) and its asyncio client."""

from __future__ import annotations

from pathlib import Path

from shoal.cbuild import static_binary
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
    """Path of the static ``shoal-agent`` binary, (re)building it with gcc if stale (linked with musl where
    musl-gcc is there: a static glibc start costs ~1 CPU-ms of CPUID exits under virtualization, see cbuild)."""
    return static_binary(_BINARY, _SOURCES, musl=True)
