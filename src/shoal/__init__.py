"""shoal: isolated environments by the thousand for agentic RL, behind one Python interface.

import shoal
with shoal.Client() as client:
    with client.create("container", image="debian") as sb:
        print(sb.exec("echo hi").stdout)
"""

from shoal.client import (
    AsyncClient,
    AsyncSandbox,
    AsyncShell,
    Client,
    CommandError,
    ExecResult,
    FileEntry,
    ReplayReport,
    Sandbox,
    SandboxInfo,
    Shell,
)
from shoal.client.functions import FunctionError, RunCodeResult
from shoal.client.gui import Screenshot
from shoal.client.image import ImageBuilder
from shoal.client.procs import AsyncProcess
from shoal.client.sync import Process
from shoal.errors import (
    AuthenticationError,
    CapacityError,
    DivergenceError,
    ImageError,
    ImageNotFoundError,
    InvalidRequestError,
    NoAgentError,
    NodeError,
    NodeSettingsWarning,
    NoScreenError,
    NotFoundError,
    PayloadNotKeptError,
    ProcessNotFoundError,
    QuotaExceededError,
    SandboxClosedError,
    SandboxLostError,
    SandboxNotFoundError,
    ShellLostError,
    ShoalError,
    TLSError,
    UnsafeEntryWarning,
    UnsupportedKindError,
)
from shoal.protocol import OutputChunk, SandboxSpec

Image = ImageBuilder  # `shoal.Image.from_("debian").run(...)`

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "AsyncClient",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncShell",
    "CapacityError",
    "Client",
    "CommandError",
    "DivergenceError",
    "ExecResult",
    "FileEntry",
    "Image",
    "ImageBuilder",
    "FunctionError",
    "ImageError",
    "ImageNotFoundError",
    "InvalidRequestError",
    "NoAgentError",
    "NoScreenError",
    "NodeError",
    "TLSError",
    "NotFoundError",
    "OutputChunk",
    "PayloadNotKeptError",
    "Process",
    "QuotaExceededError",
    "RunCodeResult",
    "ReplayReport",
    "Sandbox",
    "Screenshot",
    "SandboxClosedError",
    "SandboxInfo",
    "SandboxLostError",
    "SandboxNotFoundError",
    "ProcessNotFoundError",
    "ShellLostError",
    "SandboxSpec",
    "Shell",
    "ShoalError",
    "NodeSettingsWarning",
    "UnsafeEntryWarning",
    "UnsupportedKindError",
]
