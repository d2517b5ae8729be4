"""The lifetime reaper's idle cost (issue 12): node CPU-ms per second with N live sandboxes and no requests.

    python bench/bench_reaper.py BEFORE_SRC [AFTER_SRC] [--live 1000] [--seconds 20]

Two nodes (one per source tree, as bench_hotpath_ab.py) each hold N sandboxes with a TTL and an idle timeout
far away; then both sit idle for the same window and each node's CPU (utime+stime from /proc) is divided by
it. A reaper that scans every sandbox on a timer costs in proportion to N; one that sleeps until the next
deadline costs nothing until one comes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds  # noqa: E402
from bench_hotpath_ab import start_node, stop_node  # noqa: E402

import shoal  # noqa: E402

TTL = 3600.0


async def main(args: argparse.Namespace) -> None:
    homes: dict[str, str] = {}
    clients: dict[str, shoal.AsyncClient] = {}
    pids: dict[str, int] = {}
    try:
        for name, src in (("before", args.before), ("after", args.after)):
            homes[name] = start_node(f"reaper-{name}", src)
            clients[name] = client = shoal.AsyncClient(home=homes[name], autostart=False)
            await client.__aenter__()
            pids[name] = (await client.status())["pid"]
        for name, client in clients.items():
            t = time.perf_counter()
            made = await client.create_many(
                args.live, image="busybox", pool=False, ttl_s=TTL, idle_timeout_s=TTL, labels={"bench": "reaper"},
                concurrency=8,
            )  # fmt: skip
            failed = [m for m in made if isinstance(m, Exception)]
            print(f"{name}: {args.live - len(failed)} live in {time.perf_counter() - t:.0f} s ({len(failed)} failed)")
        await asyncio.sleep(3)  # creates' tails settle
        cpu0, t = {n: cpu_seconds(p) for n, p in pids.items()}, time.perf_counter()
        await asyncio.sleep(args.seconds)
        wall = time.perf_counter() - t
        print(f"load average {os.getloadavg()[0]:.1f}; idle window {wall:.0f} s, both nodes at once")
        for name, pid in pids.items():
            per_s = (cpu_seconds(pid) - cpu0[name]) * 1e3 / wall
            print(f"  {name:<6} {args.live} live: node {per_s:.2f} CPU-ms per second idle")
    finally:
        for client in clients.values():
            await client.close_all(labels={"bench": "reaper"})
            await client.__aexit__(None, None, None)
        for home in homes.values():
            stop_node(home)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("before", help="src directory of the 'before' tree")
    parser.add_argument("after", nargs="?", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--live", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    asyncio.run(main(parser.parse_args()))
