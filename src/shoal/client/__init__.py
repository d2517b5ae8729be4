"""The shoal SDK."""

from shoal.client.aio import AsyncClient, AsyncFiles, AsyncSandbox, AsyncShell, ExecStream, ReplayReport
from shoal.client.results import CommandError, ExecResult, FileEntry, SandboxInfo
from shoal.client.sync import Client, Files, Sandbox, Shell

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncShell",
    "Client",
    "CommandError",
    "ExecResult",
    "ExecStream",
    "FileEntry",
    "Files",
    "ReplayReport",
    "Sandbox",
    "SandboxInfo",
    "Shell",
]
