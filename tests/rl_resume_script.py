"""A rollout through shoal.rl adapters that a test kills and starts again (tests/test_rl.py).

argv: HOME ADAPTER(gym|verl) NAME. Prints one JSON line per round; every command appends a line to a file in
its sandbox and prints the file's line count, so a command that ran twice shows as a count too high.
"""

import asyncio
import json
import sys

HOME, ADAPTER, NAME = sys.argv[1], sys.argv[2], sys.argv[3]
STEP = "echo x >> /tmp/ran; wc -l < /tmp/ran"


def gym_rollout() -> None:
    from shoal.rl.gym import ShoalVectorEnv

    env = ShoalVectorEnv(
        2, image="busybox", pool=False, ttl_s=300, max_steps=3, trajectory=NAME, client_options={"home": HOME}
    )
    env.reset(seed=0)
    for round_ in range(8):
        obs, _, _, _, _ = env.step([STEP, STEP])
        ff = [ep.fast_forwarded if ep else 0 for ep in env.episodes]
        print(json.dumps({"round": round_, "outputs": [o.strip() for o in obs["output"]], "ff": ff}), flush=True)
    env.close()
    print(json.dumps({"done": True}), flush=True)


async def verl_rollout() -> None:
    from shoal.rl.verl import ShoalTool

    tool = ShoalTool({"image": "busybox", "pool": False, "ttl_s": 300, "client": {"home": HOME}}, None)
    ids = [f"{NAME}-req{i}" for i in range(2)]
    for i in ids:
        await tool.create(i)
    for round_ in range(4):
        results = await asyncio.gather(*(tool.execute(i, {"command": STEP}) for i in ids))
        outputs = [r[0].text.split("\n")[0].strip() for r in results]
        ff = [tool.episode(i).fast_forwarded for i in ids]
        print(json.dumps({"round": round_, "outputs": outputs, "ff": ff}), flush=True)
    for i in ids:
        await tool.release(i)
    await tool.aclose()
    print(json.dumps({"done": True}), flush=True)


if ADAPTER == "gym":
    gym_rollout()
else:
    asyncio.run(verl_rollout())
