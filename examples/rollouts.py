"""An RL-style rollout loop: one coroutine per trajectory, each in its own sandbox, reward from its state.

    python examples/rollouts.py [N]

Each "policy" here is a fixed list of shell steps standing in for model-written commands; the reward is
read from the sandbox's files after the episode, as a trainer's reward function would.
"""

from __future__ import annotations

import asyncio
import random
import sys

import shoal

TASK = "Write the sum of the numbers in /work/input.txt to /work/answer.txt"


def policy(seed: int) -> list[str]:
    """A stand-in for the model: a correct episode, or one with a bug, at random."""
    good = ["cd /work", "ls", "awk '{s+=$1} END {print s}' input.txt > answer.txt", "cat answer.txt"]
    bad = ["cd /work", "head -n 1 input.txt > answer.txt"]
    return good if random.Random(seed).random() < 0.7 else bad


async def episode(client: shoal.AsyncClient, seed: int) -> float:
    numbers = [random.Random(seed + i).randint(1, 100) for i in range(10)]
    async with await client.create(
        "container", image="debian", memory_mb=256, ttl_s=300, labels={"example": "rollouts"},
        files={"/work/input.txt": "\n".join(map(str, numbers)) + "\n"},
    ) as sb:  # fmt: skip
        async with await sb.shell() as sh:
            for step in policy(seed):
                await sh.run(step, timeout=30)
        answer = (await sb.files.read_text("/work/answer.txt")).strip()
        return 1.0 if answer == str(sum(numbers)) else 0.0


async def main(n: int) -> None:
    async with shoal.AsyncClient() as client:
        rewards = await asyncio.gather(*(episode(client, seed) for seed in range(n)), return_exceptions=True)
        failed = [r for r in rewards if isinstance(r, BaseException)]
        scores = [r for r in rewards if isinstance(r, float)]
        mean = sum(scores) / max(1, len(scores))
        print(f"{TASK}\n{len(scores)} episodes, mean reward {mean:.2f}, {len(failed)} failed")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 16))
