"""Gymnasium environments whose actions are shell commands run in a shoal sandbox.

    env = ShoalEnv(image="debian", reward_fn=lambda ep, result: 1.0 if result.exit_code == 0 else 0.0)
    obs, info = env.reset(seed=0)            # a fresh sandbox (from a warm pool when one matches the options)
    obs, reward, terminated, truncated, info = env.step("ls /")

An observation is {"output": stdout+stderr (printable ASCII, cut to `max_output` characters), "exit_code":
0..255}; `info` has the full stdout, stderr, exit code and timed_out. `reward_fn(episode, result)` (plain or
async) scores the sandbox's state, typically by `await episode.exec("pytest -q")`; `done_fn(episode, result)`
ends an episode early. `reset()` closes the previous sandbox and opens a fresh one; `close()` frees it.

With `trajectory="run7"`, episode k runs trajectory "run7/k": a rollout killed and started again re-issues
the same commands and they come back from the log (no command runs twice), see shoal.rl.episode.

`ShoalVectorEnv(n, ...)` steps N sandboxes concurrently (one request per sandbox in flight at once, on one
connection), with Gymnasium's next-step autoreset.
"""

from __future__ import annotations

import asyncio
import inspect
import string
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from shoal.client import AsyncClient, ExecResult
from shoal.rl.episode import Episode, Runner

CHARSET = frozenset(string.printable)
RewardFn = Callable[[Episode, ExecResult], Any]


def text_space(max_length: int) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=CHARSET)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Slot:
    """One environment's episodes, on the async SDK: what ShoalEnv runs on its loop and ShoalVectorEnv gathers."""

    def __init__(
        self,
        options: dict[str, Any],
        reward_fn: RewardFn | None,
        done_fn: RewardFn | None,
        max_steps: int,
        timeout: float,
        max_output: int,
        setup: str | None,
        trajectory: str | None,
    ):
        self.options = options
        self.reward_fn = reward_fn
        self.done_fn = done_fn
        self.max_steps = max_steps
        self.timeout = timeout
        self.max_output = max_output
        self.setup = setup
        self.trajectory = trajectory
        self.episodes = 0
        self.steps = 0
        self.episode: Episode | None = None

    def observe(self, result: ExecResult | None) -> tuple[dict[str, Any], dict[str, Any]]:
        if result is None:
            return {"output": "", "exit_code": 0}, {}
        text = result.stdout + result.stderr
        text = "".join(c if c in CHARSET else "?" for c in text[: self.max_output])
        obs = {"output": text, "exit_code": result.exit_code & 0xFF}
        info = {
            "stdout": result.stdout,
            "stderr": result.stderr,
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
        }
        return obs, info

    async def reset(self, client: AsyncClient) -> tuple[dict[str, Any], dict[str, Any]]:
        await self.close()
        name = None if self.trajectory is None else f"{self.trajectory}/{self.episodes}"
        self.episodes += 1
        self.steps = 0
        self.episode = await Episode.open(client, name, **self.options)
        result = await self.episode.exec(self.setup, timeout=self.timeout) if self.setup else None
        return self.observe(result)

    async def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self.episode is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        result = await self.episode.exec(str(action), timeout=self.timeout)
        self.steps += 1
        reward = float(await _maybe_await(self.reward_fn(self.episode, result))) if self.reward_fn else 0.0
        terminated = bool(await _maybe_await(self.done_fn(self.episode, result))) if self.done_fn else False
        obs, info = self.observe(result)
        return obs, reward, terminated, self.steps >= self.max_steps and not terminated, info

    async def close(self) -> None:
        if self.episode is not None:
            episode, self.episode = self.episode, None
            await episode.close()


def _slot(
    kind: str,
    image: str,
    reward_fn: RewardFn | None,
    done_fn: RewardFn | None,
    max_steps: int,
    timeout: float,
    max_output: int,
    setup: str | None,
    trajectory: str | None,
    options: dict[str, Any],
) -> _Slot:
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps}: an episode needs at least one step")
    return _Slot(
        dict(options, kind=kind, image=image), reward_fn, done_fn, max_steps, timeout, max_output, setup, trajectory
    )


class ShoalEnv(gymnasium.Env):
    """One sandbox per episode; see the module docstring. `options` go to `client.create` (cpu=, memory_mb=,
    ttl_s= (default one hour), network=, pool=, snapshot=, ...). `client_options` go to `shoal.AsyncClient`
    (address, home, token)."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        *,
        kind: str = "container",
        image: str = "debian",
        reward_fn: RewardFn | None = None,
        done_fn: RewardFn | None = None,
        max_steps: int = 32,
        timeout: float = 60.0,
        max_output: int = 4096,
        max_action: int = 4096,
        setup: str | None = None,
        trajectory: str | None = None,
        client_options: dict[str, Any] | None = None,
        **options: Any,
    ):
        self._slot = _slot(kind, image, reward_fn, done_fn, max_steps, timeout, max_output, setup, trajectory, options)
        self.action_space = text_space(max_action)
        self.observation_space = spaces.Dict({"output": text_space(max_output), "exit_code": spaces.Discrete(256)})
        self._client_options = client_options or {}
        self._runner: Runner | None = None
        self._client: AsyncClient | None = None

    @property
    def episode(self) -> Episode | None:
        """The current episode (its `sandbox` is the live `shoal.AsyncSandbox`)."""
        return self._slot.episode

    def _run(self, coro_fn: Callable[[AsyncClient], Any]) -> Any:
        if self._runner is None:
            self._runner = Runner()

        async def with_client() -> Any:
            if self._client is None:
                self._client = await AsyncClient(**self._client_options).connect()
            return await coro_fn(self._client)

        return self._runner.run(with_client())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):  # noqa: ANN201
        super().reset(seed=seed)
        return self._run(self._slot.reset)

    def step(self, action: str):  # noqa: ANN201
        return self._run(lambda _client: self._slot.step(action))

    def close(self) -> None:
        if self._runner is None:
            return

        async def shut(_client: AsyncClient) -> None:
            try:
                await self._slot.close()
            finally:
                await _client.close()
                self._client = None

        try:
            self._run(shut)
        finally:
            self._runner.stop()
            self._runner = None


class ShoalVectorEnv(gymnasium.vector.VectorEnv):
    """N ShoalEnv episodes stepped concurrently (`step_async` sends all N commands at once). Episode i of
    sandbox slot j runs trajectory f"{trajectory}/{j}/{i}" when `trajectory` is set."""

    metadata = {"render_modes": [], "autoreset_mode": gymnasium.vector.AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int,
        *,
        kind: str = "container",
        image: str = "debian",
        reward_fn: RewardFn | None = None,
        done_fn: RewardFn | None = None,
        max_steps: int = 32,
        timeout: float = 60.0,
        max_output: int = 4096,
        max_action: int = 4096,
        setup: str | None = None,
        trajectory: str | None = None,
        client_options: dict[str, Any] | None = None,
        **options: Any,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}: need at least one environment")
        self.num_envs = num_envs
        self._slots = [
            _slot(
                kind,
                image,
                reward_fn,
                done_fn,
                max_steps,
                timeout,
                max_output,
                setup,
                None if trajectory is None else f"{trajectory}/{j}",
                options,
            )
            for j in range(num_envs)
        ]
        self.single_action_space = text_space(max_action)
        self.single_observation_space = spaces.Dict(
            {"output": text_space(max_output), "exit_code": spaces.Discrete(256)}
        )
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self._client_options = client_options or {}
        self._runner = Runner()
        self._client: AsyncClient | None = None
        self._needs_reset = np.zeros(num_envs, dtype=bool)
        self._pending: Any = None

    @property
    def episodes(self) -> list[Episode | None]:
        return [slot.episode for slot in self._slots]

    async def _connected(self) -> AsyncClient:
        if self._client is None:
            self._client = await AsyncClient(**self._client_options).connect()
        return self._client

    def _batch(self, observations: list[dict[str, Any]]) -> Any:
        out = create_empty_array(self.single_observation_space, self.num_envs)
        return concatenate(self.single_observation_space, observations, out)

    def reset(self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None):  # noqa: ANN201
        super().reset(seed=seed)

        async def all_reset() -> list[Any]:
            client = await self._connected()
            return await asyncio.gather(*(slot.reset(client) for slot in self._slots))

        results = self._runner.run(all_reset())
        self._needs_reset[:] = False
        return self._batch([obs for obs, _ in results]), {"infos": [info for _, info in results]}

    def step_async(self, actions: Any) -> None:
        """Send every environment's action now; `step_wait` collects the results."""
        if self._pending is not None:
            raise gymnasium.error.AlreadyPendingCallError("step_async called twice without step_wait", "step")
        needs_reset = self._needs_reset.copy()

        async def one(j: int, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            slot = self._slots[j]
            if needs_reset[j]:  # next-step autoreset: this step only resets
                obs, info = await slot.reset(await self._connected())
                return obs, 0.0, False, False, info
            return await slot.step(action)

        async def all_steps() -> list[Any]:
            await self._connected()
            return await asyncio.gather(*(one(j, a) for j, a in enumerate(actions)))

        self._pending = self._runner.submit(all_steps())

    def step_wait(self):  # noqa: ANN201
        if self._pending is None:
            raise gymnasium.error.NoAsyncCallError("step_wait called without step_async", "step")
        pending, self._pending = self._pending, None
        results = pending.result()
        obs = self._batch([r[0] for r in results])
        rewards = np.array([r[1] for r in results], dtype=np.float64)
        terminated = np.array([r[2] for r in results], dtype=bool)
        truncated = np.array([r[3] for r in results], dtype=bool)
        self._needs_reset = terminated | truncated
        return obs, rewards, terminated, truncated, {"infos": [r[4] for r in results]}

    def step(self, actions: Any):  # noqa: ANN201
        self.step_async(actions)
        return self.step_wait()

    def close_extras(self, **kwargs: Any) -> None:
        async def shut() -> None:
            try:
                await asyncio.gather(*(slot.close() for slot in self._slots))
            finally:
                if self._client is not None:
                    await self._client.close()
                    self._client = None

        try:
            self._runner.run(shut())
        finally:
            self._runner.stop()
