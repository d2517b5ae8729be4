"""A skyrl-gym text environment backed by a shoal sandbox, registered as skyrl-gym id "shoal".

    import shoal.rl.skyrl                      # registers "shoal" (the way skyrl_gym.envs registers its own)
    env = skyrl_gym.make("shoal", env_config={"image": "debian", "ttl_s": 600, "max_turns": 8,
                                              "reward_command": "test -f /work/done && echo 1 || echo 0"},
                         extras={"trajectory": "run7/ep42"})
    prompt, info = env.init([{"role": "user", "content": "make /work/done"}])
    out = env.step("<bash>touch /work/done</bash>")   # out["observations"], out["reward"], out["done"]

An action is the model's text: the command inside its last <bash>...</bash> block is run (no block: the
episode ends). The reward is scored by `reward_command` when the episode ends (its stdout as a number, or its
exit status). skyrl-gym's `Env` API is blocking, so the environment drives the async SDK on a loop thread
shared by all envs of the process (`shoal.rl.episode.shared_client`). `env_config` keys other than the ones
above go to `client.create`; `client` (a dict) to AsyncClient.
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.envs.registration import register, registry

from shoal.client import ExecResult
from shoal.rl.episode import Episode, shared_client

_BASH = re.compile(r"<bash>(.*?)</bash>", re.S)
_ENV_KEYS = {"client", "timeout", "reward_command", "max_turns", "kind", "image"}


class ShoalTextEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        config = dict(env_config or {})
        self.config = config
        self.max_turns = int(config.get("max_turns", 8))
        self.trajectory = (extras or {}).get("trajectory")
        self.episode: Episode | None = None
        # one loop thread and connection per process, shared by every env (SkyRL steps envs from a thread pool)
        self._runner, self._client = shared_client(dict(self.config.get("client", {})))

    async def _open(self) -> Episode:
        options = {k: v for k, v in self.config.items() if k not in _ENV_KEYS}
        return await Episode.open(
            self._client,
            self.trajectory,
            kind=self.config.get("kind", "container"),
            image=self.config.get("image", "debian"),
            **options,
        )

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        if self.episode is None:
            self.episode = self._runner.run(self._open())
        return prompt, {"sandbox_id": self.episode.sandbox.id if self.episode.sandbox else None}

    async def _score(self) -> float:
        command = self.config.get("reward_command")
        if not command or self.episode is None:
            return 0.0
        result = await self.episode.exec(command, timeout=self.config.get("timeout", 60.0))
        try:
            return float(result.stdout.strip())
        except ValueError:
            return 1.0 if result.exit_code == 0 else 0.0

    async def _act(self, command: str, done: bool) -> tuple[ExecResult, float]:
        """The action and, on the last turn, the reward: one hand-over to the loop thread, not two (each is a
        wake-up of this env's thread and of the loop thread, which on a busy machine waits for a core)."""
        assert self.episode is not None
        result = await self.episode.exec(command, timeout=self.config.get("timeout", 60.0))
        return result, (await self._score() if done else 0.0)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.episode is None:
            raise RuntimeError("call init() before step()")
        self.turns += 1
        blocks = _BASH.findall(action)
        if not blocks:
            return BaseTextEnvStepOutput(
                observations=[], reward=self._runner.run(self._score()), done=True, metadata={}
            )
        done = self.turns >= self.max_turns
        result, reward = self._runner.run(self._act(blocks[-1], done))
        text = result.stdout + result.stderr + ("" if result.exit_code == 0 else f"\n[exit code {result.exit_code}]")
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}],
            reward=reward,
            done=done,
            metadata={"exit_code": result.exit_code, "timed_out": result.timed_out},
            postprocessed_action=action,
        )

    def close(self) -> None:
        """Close this episode's sandbox (the shared connection stays for the process's other envs)."""
        if self.episode is not None:
            episode, self.episode = self.episode, None
            self._runner.run(episode.close())


if "shoal" not in registry:
    register(id="shoal", entry_point="shoal.rl.skyrl:ShoalTextEnv")
