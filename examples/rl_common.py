"""Shared by examples/rl_*.py: the same 64-episode workload through an adapter and through the native SDK,
alternating rounds (so machine noise hits both alike), printing episodes/s and node CPU-ms per episode."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import shoal
from shoal.config import Paths

# one episode: three commands, then the reward read from the sandbox's state
STEPS = ["echo 41 > /tmp/a", "expr $(cat /tmp/a) + 1 > /tmp/b", "cat /tmp/b"]
REWARD = "test $(cat /tmp/b) = 42 && echo 1 || echo 0"
IMAGE = "busybox"
OPTIONS = {"pool": False, "ttl_s": 600, "labels": {"example": "rl"}}


def node_cpu_ms() -> float:
    """The node's CPU time, its reaped children (runtimes, helpers) included."""
    pid = int(Paths.from_env().lock.read_text())
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) * 1000 / os.sysconf("SC_CLK_TCK")


async def native_episodes(client: shoal.AsyncClient, n: int, *, shell: bool = False) -> list[float]:
    async def one() -> float:
        async with await client.create("container", IMAGE, **OPTIONS) as sb:
            if shell:
                async with await sb.shell() as sh:
                    for step in STEPS:
                        await sh.run(step, timeout=60)
            else:
                for step in STEPS:
                    await sb.exec(step, timeout=60)
            return float((await sb.exec(REWARD, timeout=60)).stdout.strip())

    return list(await asyncio.gather(*(one() for _ in range(n))))


def native_round(n: int, *, shell: bool = False) -> list[float]:
    async def run() -> list[float]:
        async with shoal.AsyncClient() as client:
            return await native_episodes(client, n, shell=shell)

    return asyncio.run(run())


def compare(name: str, adapter_round: Callable[[int], list[float]], native: Callable[[int], list[float]]) -> None:
    episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    native_round(4)  # warm up: the node is started, the image mounted
    runs: dict[str, list[tuple[float, float]]] = {name: [], "native": []}
    for r in range(rounds):
        order = [(name, adapter_round), ("native", native)]
        for label, fn in order if r % 2 == 0 else order[::-1]:
            cpu0, t0 = node_cpu_ms(), time.perf_counter()
            rewards = fn(episodes)
            wall, cpu = time.perf_counter() - t0, node_cpu_ms() - cpu0
            assert rewards == [1.0] * episodes, f"{label}: rewards {rewards}"
            runs[label].append((episodes / wall, cpu / episodes))
            print(f"round {r} {label:>8}: {episodes / wall:6.1f} episodes/s, node {cpu / episodes:6.1f} CPU-ms/episode")
    print(f"\n{episodes} parallel episodes x {rounds} rounds, median over rounds:")
    med = {k: (statistics.median(x for x, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    for label, (eps, cpu) in med.items():
        print(f"  {label:>8}: {eps:6.1f} episodes/s   node {cpu:6.1f} CPU-ms/episode")
    paired = [n[0] / a[0] - 1 for a, n in zip(runs[name], runs["native"], strict=True)]  # same round, adjacent
    print(
        f"  adapter wall time vs native: median of per-round pairs {statistics.median(paired):+.1%} "
        f"(rounds: {', '.join(f'{p:+.0%}' for p in paired)}; target <= +5%)"
    )
