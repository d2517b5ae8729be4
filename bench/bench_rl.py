"""The four RL adapters (gym, verl, skyrl, swerex) beside the native SDK, in one run on one node.

    PYTHONPATH=src python bench/bench_rl.py [--episodes 64] [--rounds 5] [--only skyrl,gym]

Each round runs, for every adapter in turn (the order rotates each round), the examples' 64-episode rollout
through the adapter (examples/rl_<adapter>.py: three commands and a reward read from the sandbox, busybox)
and the same requests through the native SDK, the two adjacent and their order alternating, so the drift of
a shared machine falls on both alike. Printed per adapter: episodes/s (median of rounds), the node's CPU-ms
per episode (its reaped children, the runtime, included) and this process's (the adapter's own work), and the
wall-time overhead as the median of the per-round pairs, each pair listed. The node is the benchmark's own
(SHOAL_HOME=/tmp/shoal-bench-rl), stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from _common import BenchNode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="gym,verl,skyrl,swerex")
    args = parser.parse_args()
    node = BenchNode("rl")
    try:
        import rl_common
        import rl_gym
        import rl_skyrl
        import rl_swerex
        import rl_verl

        native = rl_common.native_round
        adapters = {
            "gym": (rl_gym.gym_round, native),
            "verl": (lambda n: asyncio.run(rl_verl.trajectories(n)), native),
            "skyrl": (rl_skyrl.skyrl_round, native),
            "swerex": (lambda n: asyncio.run(rl_swerex.episodes(n)), lambda n: native(n, shell=True)),
        }
        names = [n for n in args.only.split(",") if n in adapters]
        native(4)  # warm up: the node is started, the image mounted
        n = args.episodes
        runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {k: {"adapter": [], "native": []} for k in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                pair = [("adapter", adapters[name][0]), ("native", adapters[name][1])]
                for side, fn in pair if r % 2 == 0 else pair[::-1]:
                    node0, cpu0, t0 = rl_common.node_cpu_ms(), time.process_time(), time.perf_counter()
                    rewards = fn(n)
                    wall = time.perf_counter() - t0
                    node_ms, client_ms = rl_common.node_cpu_ms() - node0, (time.process_time() - cpu0) * 1e3
                    assert rewards == [1.0] * n, f"{name} {side}: rewards {rewards}"
                    runs[name][side].append((n / wall, node_ms / n, client_ms / n))
                    print(
                        f"round {r} {name:>6} {side:>7}: {n / wall:5.1f} episodes/s  CPU-ms/episode: node"
                        f" {node_ms / n:5.1f}  client {client_ms / n:5.2f}",
                        flush=True,
                    )
        print(f"\n{n} parallel episodes x {args.rounds} rounds (medians of rounds):")
        for name in names:
            a, b = runs[name]["adapter"], runs[name]["native"]
            paired = [x[0] / y[0] - 1 for y, x in zip(a, b, strict=True)]  # native eps/s over adapter's - 1
            med = [statistics.median(v[i] for v in side) for side in (a, b) for i in range(3)]
            print(
                f"  {name:>6}: adapter {med[0]:5.1f} / native {med[3]:5.1f} episodes/s;"
                f" node CPU-ms/ep {med[1]:5.1f} / {med[4]:5.1f}; client CPU-ms/ep {med[2]:5.2f} / {med[5]:5.2f};"
                f" wall vs native {statistics.median(paired):+.1%} ({', '.join(f'{p:+.0%}' for p in paired)})"
            )
    finally:
        node.stop()


if __name__ == "__main__":
    main()
