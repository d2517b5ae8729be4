"""verl tools backed by shoal: `ShoalTool` (a `verl.tools.base_tool.BaseTool`) and the code reward path.

`ShoalTool` gives each tool instance its own sandbox: `create` opens it, `execute` runs the model's command
there, `calc_reward` scores the sandbox's state with `reward_command`, `release` closes it (its files and
processes are gone). The instance id is the trajectory name ("verl/<instance id>"), so a rollout that is
preempted and restarted with the same ids re-issues its commands and gets the logged results back instead of
running them twice. Tool config (the `config:` block of verl's tool YAML):

    class_name: shoal.rl.verl.ShoalTool
    config: {image: debian, ttl_s: 3600, timeout: 30, reward_command: "pytest -q >/dev/null && echo 1 || echo 0",
             client: {address: "shoal://gw:7470"}}      # client: options of shoal.AsyncClient (default: local node)

Every other config key goes to `client.create` (cpu, memory_mb, network, pool, ...).

`code_reward(client, code, tests)` and `compute_score(...)` are the sandbox-fusion-style reward: run the
solution on each test's stdin on shoal's function kind (a fresh forked worker per run) and score the fraction
of tests whose stdout matches.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from shoal.client import AsyncClient
from shoal.rl.episode import Episode, Runner

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a bash command in your own sandbox and see its output and exit code.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the bash command to run"}},
            "required": ["command"],
        },
    },
}
_TOOL_KEYS = {"client", "timeout", "reward_command", "kind", "image", "trajectory_prefix"}


class ShoalTool(BaseTool):
    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None):
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(dict(config or {}), schema)
        self._create_options = {k: v for k, v in self.config.items() if k not in _TOOL_KEYS}
        self._episodes: dict[str, Episode] = {}
        self._client: AsyncClient | None = None

    async def _connected(self) -> AsyncClient:
        if self._client is None:
            client = AsyncClient(**self.config.get("client", {}))
            await client.connect()
            if self._client is None:
                self._client = client
            else:
                await client.close()
        return self._client

    def episode(self, instance_id: str) -> Episode:
        """The instance's episode (`.sandbox` is its shoal.AsyncSandbox, `.fast_forwarded` its replayed steps)."""
        return self._episodes[instance_id]

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or kwargs.get("create_kwargs", {}).get("trajectory") or str(uuid4())
        if instance_id not in self._episodes:
            name = f"{self.config.get('trajectory_prefix', 'verl')}/{instance_id}"
            self._episodes[instance_id] = await Episode.open(
                await self._connected(),
                name,
                kind=self.config.get("kind", "container"),
                image=self.config.get("image", "debian"),
                **self._create_options,
            )
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):  # noqa: ANN201
        command = parameters.get("command")
        if not isinstance(command, str):
            return ToolResponse(text="error: the 'command' parameter (a string) is missing"), 0.0, {}
        result = await self.episode(instance_id).exec(command, timeout=self.config.get("timeout", 60.0))
        text = result.stdout + result.stderr
        if result.timed_out:
            text += f"\n[timed out after {self.config.get('timeout', 60.0)} s]"
        elif result.exit_code != 0:
            text += f"\n[exit code {result.exit_code}]"
        return ToolResponse(text=text), 0.0, {"exit_code": result.exit_code, "timed_out": result.timed_out}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """`reward_command`'s stdout as a number, else 1.0 if it exits 0 and 0.0 if not (0.0 with no command)."""
        command = self.config.get("reward_command")
        if not command:
            return 0.0
        result = await self.episode(instance_id).exec(command, timeout=self.config.get("timeout", 60.0))
        try:
            return float(result.stdout.strip())
        except ValueError:
            return 1.0 if result.exit_code == 0 else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        episode = self._episodes.pop(instance_id, None)
        if episode is not None:
            await episode.close()

    async def aclose(self) -> None:
        """Release every instance and close the connection."""
        for instance_id in list(self._episodes):
            await self.release(instance_id)
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


async def code_reward(
    client: AsyncClient, code: str, tests: list[dict[str, str]], *, language: str = "python", **options: Any
) -> float:
    """Fraction of `tests` ({"input": stdin, "output": expected stdout}) the program passes; each run is a
    fresh function-kind worker (`client.run_code`), all tests at once. Options go to `run_code` (image,
    run_timeout, memory_mb, ...)."""
    if not tests:
        raise ValueError("code_reward needs at least one test case")
    options.setdefault("image", "debian" if language in ("python", "bash") else "debian-dev")
    results = await asyncio.gather(
        *(client.run_code(code, language, stdin=t.get("input", ""), **options) for t in tests)
    )
    passed = sum(r.ok and r.stdout.strip() == t["output"].strip() for r, t in zip(results, tests, strict=True))
    return passed / len(tests)


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **client_options: Any
) -> float:
    """verl's custom reward function signature (`custom_reward_function.path` = this module, `name` =
    compute_score): the last ```python block of the response, scored by `code_reward` on the test cases in
    `ground_truth` (JSON list of {"input", "output"})."""
    blocks = _FENCE.findall(solution_str)
    if not blocks:
        return 0.0
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth

    async def score() -> float:
        async with AsyncClient(**client_options) as client:
            return await code_reward(client, blocks[-1], tests)

    runner = Runner()
    try:
        return runner.run(score())
    finally:
        runner.stop()
