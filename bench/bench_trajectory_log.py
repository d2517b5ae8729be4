"""The trajectory log alone, in this process: a logged step's intent and durable result (TrajectoryLog.begin +
append, answered after the fsync that covers it), one sandbox at a time or many at once. No node, no
sandbox: what the log costs a step, by CPU-ms of this process (from getrusage, all threads) and latency.

    PYTHONPATH=src python bench/bench_trajectory_log.py [--n 2000] [--concurrency 1] [--dir DIR]

Before/after on a noisy machine: alternate two trees, e.g.
    for i in 1 2 3; do for t in /tmp/before/src src; do
        PYTHONPATH=$t python bench/bench_trajectory_log.py --concurrency 16 --n 300; done; done
The log's files go to a fresh directory under --dir (default $SHOAL_HOME or /var/lib/shoal: the node's disk).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct  # noqa: E402

from shoal.node.trajectory import TrajectoryLog  # noqa: E402

ARGS = {"cmd": ["true"], "env": {}, "cwd": None}
RESULT = {"exit_code": 0, "stdout": b"", "stderr": b"", "duration_s": 0.001}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(log: TrajectoryLog, n: int, concurrency: int) -> None:
    seconds: list[float] = []

    async def step(sandbox: str, seq: int) -> None:
        t = time.perf_counter()
        await log.begin(sandbox, seq, "exec", "k" * 32, ARGS, time.time())
        await log.append(sandbox, seq, "exec", "k" * 32, ARGS, RESULT, None, time.time())
        seconds.append(time.perf_counter() - t)

    names = [f"s{i}" for i in range(concurrency)]
    for name in names:
        await log.open_sandbox(name, None, "busybox", {})
    for seq in range(50):  # warm: the files' blocks exist, AIO is set up
        await asyncio.gather(*(step(name, seq) for name in names))
    seconds.clear()
    cpu0, wall0 = cpu_s(), time.perf_counter()
    for seq in range(50, 50 + n):
        await asyncio.gather(*(step(name, seq) for name in names))
    cpu, wall, steps = cpu_s() - cpu0, time.perf_counter() - wall0, n * concurrency
    tree = os.environ.get("PYTHONPATH", "")
    print(
        f"{tree}: {concurrency} at once, {steps} steps: {cpu * 1e3 / steps:.3f} CPU-ms/step, "
        f"p50 {pct(seconds, 0.5) * 1e3:.3f} ms p99 {pct(seconds, 0.99) * 1e3:.3f} ms, {steps / wall:.0f} steps/s, "
        f"load {os.getloadavg()[0]:.1f}"
    )


async def main(args: argparse.Namespace) -> None:
    base = Path(args.dir or os.environ.get("SHOAL_HOME") or "/var/lib/shoal")
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-trajectory-log-", dir=base))
    log = TrajectoryLog(directory / "trajectory.db", reserve_bytes=0)
    try:
        await run(log, args.n, args.concurrency)
    finally:
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=2000, help="steps per sandbox")
    parser.add_argument("--concurrency", type=int, default=1, help="sandboxes stepping at once")
    parser.add_argument("--dir", help="where the log's files go (a fresh directory under it)")
    asyncio.run(main(parser.parse_args()))
