"""SWE-ReX on shoal: `ShoalDeployment` starts a sandbox; its `ShoalRuntime` runs SWE-ReX's bash sessions,
commands and file operations there, so SWE-agent style tooling needs no Docker.

    deployment = ShoalDeployment(image="debian", ttl_s=3600)          # instead of DockerDeployment(image=...)
    await deployment.start()
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    obs = await runtime.run_in_session(BashAction(command="cd /tmp && ls"))

A SWE-ReX session is a shoal shell (`sb.shell()`: state such as the directory and variables persists between
commands). `check` raises SWE-ReX's own `NonZeroExitCodeError`, as its runtimes
do. Interactive commands (`is_interactive_command`, `expect`) are not supported: they raise
`NotImplementedError` naming the gap.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileResponse,
    UploadResponse,
    WriteFileResponse,
)

from shoal.client import AsyncClient, AsyncSandbox, AsyncShell


class ShoalRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface over one shoal sandbox."""

    def __init__(self, sandbox: AsyncSandbox, *, logger: logging.Logger | None = None):
        super().__init__()
        self.sandbox = sandbox
        self.logger = logger or logging.getLogger("shoal.rl.swerex")
        self._sessions: dict[str, AsyncShell] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await self.sandbox.refresh()
        except Exception as e:  # noqa: BLE001 - any failure means "not alive", with the reason
            return IsAliveResponse(is_alive=False, message=str(e))
        return IsAliveResponse(is_alive=info.state in ("ready", "paused"), message=info.state)

    async def create_session(self, request: Any) -> CreateBashSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session!r} already exists")
        shell = await self.sandbox.shell()
        self._sessions[request.session] = shell
        output = ""
        for source in request.startup_source:
            output += (await shell.run(f"source {shlex.quote(source)}", timeout=request.startup_timeout)).stdout
        return CreateBashSessionResponse(output=output)

    async def run_in_session(self, action: Any) -> BashObservation:
        shell = self._sessions.get(action.session)
        if shell is None:
            raise SessionDoesNotExistError(f"no session {action.session!r}: create_session first")
        if isinstance(action, BashInterruptAction) or action.is_interactive_command or action.expect:
            raise NotImplementedError("shoal's SWE-ReX runtime runs whole commands: interactive input is not supported")
        result = await shell.run(action.command, timeout=action.timeout)
        if result.timed_out:
            self._sessions.pop(action.session, None)  # a timeout kills a shoal shell
            raise CommandTimeoutError(f"{action.command!r} timed out after {action.timeout} s")
        exit_code = None if action.check == "ignore" else result.exit_code
        obs = BashObservation(output=result.stdout + result.stderr, exit_code=exit_code)
        if action.check == "raise" and result.exit_code != 0:
            raise NonZeroExitCodeError(
                f"{action.error_msg or 'command failed'}: {action.command!r} exited {result.exit_code}: {obs.output}"
            )
        return obs

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        shell = self._sessions.pop(request.session, None)
        if shell is None:
            raise SessionDoesNotExistError(f"no session {request.session!r}")
        await shell.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        cmd = command.command
        if isinstance(cmd, list) and command.shell:
            cmd = shlex.join(cmd)
        elif isinstance(cmd, str) and not command.shell:
            cmd = shlex.split(cmd)
        result = await self.sandbox.exec(
            cmd, timeout=command.timeout, env=command.env, cwd=command.cwd, merge_stderr=command.merge_output_streams
        )
        response = CommandResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)
        if result.timed_out:
            raise CommandTimeoutError(f"{command.command!r} timed out after {command.timeout} s")
        if command.check and result.exit_code != 0:
            raise NonZeroExitCodeError(f"{command.error_msg or 'command failed'}: {command.command!r}: {response}")
        return response

    async def read_file(self, request: Any) -> ReadFileResponse:
        data = await self.sandbox.files.read(request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", errors=request.errors or "strict"))

    async def write_file(self, request: Any) -> WriteFileResponse:
        parent = str(Path(request.path).parent)
        await self.sandbox.exec(["mkdir", "-p", parent])
        await self.sandbox.files.write(request.path, request.content)
        return WriteFileResponse()

    async def upload(self, request: Any) -> UploadResponse:
        source = Path(request.source_path)
        if source.is_dir():
            await self.sandbox.files.upload(source, request.target_path)
        else:
            await self.sandbox.exec(["mkdir", "-p", str(Path(request.target_path).parent)])
            await self.sandbox.files.write(request.target_path, source.read_bytes())
        return UploadResponse()

    async def close(self) -> CloseResponse:
        for name in list(self._sessions):
            await self._sessions.pop(name).close()
        return CloseResponse()


class ShoalDeployment(AbstractDeployment):
    """Starts a shoal sandbox (`create_options`: kind, image, cpu, memory_mb, ttl_s (default one hour),
    network, ...) and hands out its `ShoalRuntime`; `stop()` closes it. `client`: AsyncClient options, or a
    connected `shoal.AsyncClient` to share between many deployments on one event loop (it stays open)."""

    def __init__(
        self,
        *,
        client: dict[str, Any] | AsyncClient | None = None,
        logger: logging.Logger | None = None,
        **create_options: Any,
    ):
        self.logger = logger or logging.getLogger("shoal.rl.swerex")
        self._shared = client if isinstance(client, AsyncClient) else None
        self._client_options = {} if self._shared else dict(client or {})
        self._create_options = {"kind": "container", "image": "debian", "ttl_s": 3600.0, **create_options}
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncClient | None = None
        self._runtime: ShoalRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        self._hooks.on_custom_step("Starting shoal sandbox")
        self._client = self._shared or await AsyncClient(**self._client_options).connect()
        try:
            sandbox = await self._client.create(**self._create_options)
        except BaseException:
            if self._shared is None:
                await self._client.close()
            self._client = None
            raise
        self._runtime = ShoalRuntime(sandbox, logger=self.logger)

    async def stop(self) -> None:
        runtime, self._runtime = self._runtime, None
        client, self._client = self._client, None
        try:
            if runtime is not None:
                await runtime.close()
                await runtime.sandbox.close()
        finally:
            if client is not None and client is not self._shared:
                await client.close()

    @property
    def runtime(self) -> ShoalRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError("call start() first")
        return self._runtime
