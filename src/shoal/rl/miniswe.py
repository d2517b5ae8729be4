"""mini-swe-agent on shoal: an environment class its config names by dotted path, instead of Docker.

    environment:
      environment_class: shoal.rl.miniswe.ShoalEnvironment     # was: docker
      image: debian                                            # a shoal image (what `shoal image ls` lists)
      cwd: /work
      timeout: 60
      sandbox: {cpu: 1, memory_mb: 1024, runtime: runsc}     # anything client.create takes

Each action runs as `interpreter + [command]` (bash -lc by default, as DockerEnvironment) in a fresh
process of one sandbox, stderr merged into stdout, so directory changes do not persist between actions
(mini-swe-agent's own rule). A timeout gives returncode -1 and `exception_info`, with the output so far; the
first line `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` of a successful action ends the run (`Submitted`), as in
every mini-swe-agent environment. `trajectory=` names the sandbox's trajectory, so a restarted rollout with
the same name attaches to the same sandbox. The sandbox is closed by `cleanup()` (or when the object goes).
Only the public SDK is used (shoal.client).
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from shoal.client import Client

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ShoalEnvironmentConfig(BaseModel):
    image: str = "debian"
    kind: str = "container"
    cwd: str = "/"
    """Working directory of every action (made if missing)."""
    env: dict[str, str] = {}
    forward_env: list[str] = []
    """Variables copied from this process's environment when set (`env` wins on a conflict)."""
    timeout: int = 30
    interpreter: list[str] = ["bash", "-lc"]
    address: str | None = None
    """shoal://host:port of a gateway or node; None: the local node (started on demand)."""
    token: str | None = None
    home: str | None = None
    """SHOAL_HOME of the local node (None: the default)."""
    trajectory: str | None = None
    sandbox: dict[str, Any] = {}
    """Further arguments of client.create: cpu, memory_mb, network, runtime, ttl_s, labels..."""


class ShoalEnvironment:
    def __init__(
        self, *, config_class: type = ShoalEnvironmentConfig, logger: logging.Logger | None = None, **kwargs: Any
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.client: Client | None = None
        self.sandbox: Any = None
        options: dict[str, Any] = {"home": self.config.home} if self.config.home else {}
        self.client = Client(self.config.address, token=self.config.token, **options)
        try:
            create = {"ttl_s": 2 * 3600, **self.config.sandbox}
            if self.config.trajectory is not None:
                create["trajectory"] = self.config.trajectory
            self.sandbox = self.client.create(self.config.kind, image=self.config.image, **create)
            if self.config.cwd not in ("", "/"):
                self.sandbox.files.mkdir(self.config.cwd)
        except BaseException:
            self.cleanup()
            raise
        self.logger.info("started shoal sandbox %s (%s)", self.sandbox.id, self.config.image)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run one action; the dict DockerEnvironment answers (output, returncode, exception_info)."""
        command = action.get("command", "")
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None} | self.config.env
        limit = timeout or self.config.timeout
        try:
            result = self.sandbox.exec(
                [*self.config.interpreter, command], cwd=cwd or self.config.cwd, env=env, timeout=limit,
                merge_stderr=True,
            )  # fmt: skip
            text = result.stdout
            if result.timed_out:
                output = {
                    "output": text,
                    "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: timed out after {limit} s",
                    "extra": {"exception_type": "TimeoutExpired", "exception": f"timed out after {limit} s"},
                }
            else:
                output = {"output": text, "returncode": result.exit_code, "exception_info": ""}
        except Exception as e:  # noqa: BLE001 - the agent sees every failure as an observation, like Docker's
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                    "sandbox_id": self.sandbox.id if self.sandbox is not None else None,
                }
            }
        }

    def cleanup(self) -> None:
        """Close the sandbox and the client (idempotent)."""
        sandbox, self.sandbox = self.sandbox, None
        client, self.client = self.client, None
        try:
            if sandbox is not None:
                sandbox.close()
        finally:
            if client is not None:
                client.close()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the client may be half gone
            pass
