"""64 parallel episodes through skyrl-gym (`skyrl_gym.make("shoal")`) beside the native SDK.

    python examples/rl_skyrl.py [EPISODES] [ROUNDS]

skyrl-gym's Env API is blocking, so the episodes run on 64 threads (as SkyRL's generator runs env steps in a
thread pool); the native side runs the same commands on one asyncio loop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import skyrl_gym
from rl_common import IMAGE, OPTIONS, REWARD, STEPS, compare, native_round

import shoal.rl.skyrl  # noqa: F401 - registers "shoal"


def episode(_: int) -> float:
    env = skyrl_gym.make(
        "shoal", env_config={"image": IMAGE, "max_turns": len(STEPS), "reward_command": REWARD, **OPTIONS}
    )
    try:
        env.init([{"role": "user", "content": "compute 41 + 1 into /tmp/b"}])
        for step in STEPS:
            out = env.step(f"<bash>{step}</bash>")
        return float(out["reward"])
    finally:
        env.close()


def skyrl_round(n: int) -> list[float]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(episode, range(n)))


if __name__ == "__main__":
    compare("skyrl", skyrl_round, native_round)
