"""64 parallel SWE-ReX deployments (`shoal.rl.swerex.ShoalDeployment`) beside the native SDK.

    python examples/rl_swerex.py [EPISODES] [ROUNDS]

Each episode: start, a bash session running the scripted policy, the reward as a plain command, stop; the
native side uses a shoal shell the same way.
"""

from __future__ import annotations

import asyncio

from rl_common import IMAGE, OPTIONS, REWARD, STEPS, compare, native_round
from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

import shoal
from shoal.rl.swerex import ShoalDeployment


async def episodes(n: int) -> list[float]:
    client = await shoal.AsyncClient().connect()  # one connection shared by the deployments, as native does

    async def one() -> float:
        deployment = ShoalDeployment(image=IMAGE, client=client, **OPTIONS)
        await deployment.start()
        try:
            runtime = deployment.runtime
            await runtime.create_session(CreateBashSessionRequest())
            for step in STEPS:
                await runtime.run_in_session(BashAction(command=step, timeout=60))
            return float((await runtime.execute(Command(command=REWARD, shell=True, timeout=60))).stdout.strip())
        finally:
            await deployment.stop()

    try:
        return list(await asyncio.gather(*(one() for _ in range(n))))
    finally:
        await client.close()


if __name__ == "__main__":
    compare("swerex", lambda n: asyncio.run(episodes(n)), lambda n: native_round(n, shell=True))
