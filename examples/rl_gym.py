"""64 parallel episodes through Gymnasium (`shoal.rl.gym.ShoalVectorEnv`) beside the native SDK.

    python examples/rl_gym.py [EPISODES] [ROUNDS]

The scripted policy plays rl_common.STEPS; the reward is read from the sandbox after the last step.
"""

from __future__ import annotations

from rl_common import IMAGE, OPTIONS, REWARD, STEPS, compare, native_round

from shoal.rl.gym import ShoalVectorEnv


async def reward(episode, result) -> float:  # noqa: ANN001
    if result.stdout.strip() != "42":  # only the last step prints; the others score 0 without a round trip
        return 0.0
    return float((await episode.exec(REWARD)).stdout.strip())


def gym_round(n: int) -> list[float]:
    env = ShoalVectorEnv(n, image=IMAGE, reward_fn=reward, max_steps=len(STEPS), **OPTIONS)
    try:
        env.reset(seed=0)
        for step in STEPS:
            _, rewards, _, _, _ = env.step([step] * n)
        return [float(r) for r in rewards]
    finally:
        env.close()


if __name__ == "__main__":
    compare("gym", gym_round, native_round)
