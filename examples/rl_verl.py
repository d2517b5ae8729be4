"""64 parallel trajectories through verl's tool interface (`shoal.rl.verl.ShoalTool`) beside the native SDK.

    python examples/rl_verl.py [EPISODES] [ROUNDS]

Each trajectory: create, three `execute` calls of the scripted policy, `calc_reward`, `release`, as verl's
rollout worker would call them (no model).
"""

from __future__ import annotations

import asyncio
import contextlib
import io

from rl_common import IMAGE, OPTIONS, REWARD, STEPS, compare, native_round

from shoal.rl.verl import ShoalTool


async def trajectories(n: int) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):  # BaseTool prints its schema
        tool = ShoalTool({"image": IMAGE, "reward_command": REWARD, **OPTIONS})

    async def one() -> float:
        instance_id, _ = await tool.create()
        try:
            for step in STEPS:
                await tool.execute(instance_id, {"command": step})
            return await tool.calc_reward(instance_id)
        finally:
            await tool.release(instance_id)

    try:
        return list(await asyncio.gather(*(one() for _ in range(n))))
    finally:
        await tool.aclose()


if __name__ == "__main__":
    compare("verl", lambda n: asyncio.run(trajectories(n)), native_round)
