"""Trivial isolated calls per second: shoal's function workers side by side with raw fork and python3 -c.

    PYTHONPATH=src .venv/bin/python bench/bench_function.py [--calls 2000] [--concurrency 8] [--rounds 3]

Ways (interleaved per round, so load from other users hits all alike; medians over rounds):
- shoal call(source)  `client.call("1")`: node → warm worker → fresh forked child (own cgroup, nobody,
                       no network) → JSON result; the full isolated path
- shoal map(function) `client.map(fn, items)` with a cloudpickled function
- shoal exec          `sandbox.exec(["true"])` on a function sandbox: fork + exec of a binary per call
- raw fork            this machine's floor for fork-per-call: os.fork + pipe + waitpid in plain Python
                       processes (one per core), no isolation, no IPC beyond the pipe
- python3 -c          a new interpreter per call (what a harness without warm workers pays)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import shoal

# a real interpreter, not a version-manager shim (a shell script that costs ~250 ms per start here)
PYTHON3 = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

RAW_FORK = r"""
import os, sys, time, json
n = int(sys.argv[1])
for _ in range(n):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps({"ok": True, "value": "1"}).encode())
        os._exit(0)
    os.close(w)
    json.loads(os.read(r, 1 << 16))
    os.close(r)
    os.waitpid(pid, 0)
"""


async def timed(n: int, concurrency: int, one) -> tuple[float, list[float]]:  # noqa: ANN001
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def run() -> None:
        async with gate:
            start = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(n)))
    return time.perf_counter() - start, latencies


async def shoal_ways(n: int, concurrency: int, home: str | None) -> dict[str, tuple[float, list[float]]]:
    out = {}
    async with shoal.AsyncClient(home=home) as client:
        await client.set_pool("function", "debian", size=concurrency, wait=True)
        await asyncio.gather(*(client.call("1") for _ in range(concurrency * 4)))  # warm every worker
        out["shoal call(source)"] = await timed(n, concurrency, lambda: client.call("1"))

        async for _ in client.map(lambda x: x, range(concurrency * 4), concurrency=concurrency):
            pass  # warm the workers that hold cloudpickle
        start = time.perf_counter()
        count = 0
        async for value in client.map(lambda x: x, range(n), concurrency=concurrency):
            assert not isinstance(value, Exception), value
            count += 1
        out["shoal map(function)"] = (time.perf_counter() - start, [])

        sandbox = await client.create("function", image="debian")
        out["shoal exec"] = await timed(n, concurrency, lambda: sandbox.exec(["true"]))
        await sandbox.close()
        await client.set_pool("function", "debian", size=0)
    return out


def raw_fork(n: int) -> float:
    drivers = os.cpu_count() or 1
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", RAW_FORK, str(n // drivers)]) for _ in range(drivers)]
    for proc in procs:
        proc.wait()
    return time.perf_counter() - start


async def python_c(n: int, concurrency: int) -> tuple[float, list[float]]:
    async def one() -> None:
        proc = await asyncio.create_subprocess_exec(PYTHON3, "-c", "1")
        await proc.wait()

    return await timed(n, concurrency, one)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--home", default=os.environ.get("SHOAL_HOME"))
    args = parser.parse_args()
    n = args.calls
    seconds: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for way, (elapsed, lat) in asyncio.run(shoal_ways(n, args.concurrency, args.home)).items():
            seconds.setdefault(way, []).append(elapsed)
            latencies.setdefault(way, []).extend(lat)
        seconds.setdefault("raw fork (no isolation)", []).append(raw_fork(n))
        slow = max(50, n // 20)  # python3 -c is slow: time fewer, scale
        elapsed, lat = asyncio.run(python_c(slow, args.concurrency))
        seconds.setdefault("python3 -c per call", []).append(elapsed * n / slow)
        latencies.setdefault("python3 -c per call", []).extend(lat)
    load = os.getloadavg()[0]
    print(
        f"{n} calls per way, concurrency {args.concurrency}, {os.cpu_count()} cores, load {load:.1f}, "
        f"{args.rounds} rounds (median)"
    )
    print(f"{'way':<26} {'calls/s':>9} {'lat p50 ms':>11} {'lat p99 ms':>11}")
    for way, samples in seconds.items():
        rate = n / statistics.median(samples)
        lat = sorted(latencies.get(way, []))
        p50 = f"{lat[len(lat) // 2] * 1000:.2f}" if lat else "-"
        p99 = f"{lat[int(len(lat) * 0.99)] * 1000:.2f}" if lat else "-"
        print(f"{way:<26} {rate:>9.0f} {p50:>11} {p99:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
