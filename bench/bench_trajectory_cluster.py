"""Trajectories across nodes: what resolving a trajectory name through a gateway costs, next to the same
operation by sandbox ID (routed with no lookup) and directly on the node that holds it.

    PYTHONPATH=src python bench/bench_trajectory_cluster.py [--n 300] [--nodes 2]

A name is resolved by asking every healthy node (`trajectory_find`, one round trip to each, in parallel);
an ID names its node. Everything runs on this machine (nodes and gateways are separate processes talking
real TCP), so the figures include the other work sharing its cores. Gateway CPU-ms per operation is read
from /proc for the gateway process over each measured loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import shoal
from shoal.cluster.local import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402


async def measure(name: str, n: int, gateway_pid: int | None, op: Callable[[int], Awaitable[Any]]) -> None:
    times = []
    cpu0 = cpu_seconds(gateway_pid) if gateway_pid else 0.0
    for i in range(n):
        started = time.perf_counter()
        await op(i)
        times.append(time.perf_counter() - started)
    cpu = (cpu_seconds(gateway_pid) - cpu0) / n * 1e3 if gateway_pid else float("nan")
    p50, p99 = statistics.median(times) * 1e3, pct(times, 0.99) * 1e3
    gateway = f"gateway CPU {cpu:6.3f} ms/op" if gateway_pid else " " * 26
    print(f"  {name:<52} p50 {p50:8.3f} ms   p99 {p99:8.3f} ms   {gateway}  (n={n})", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="operations per measure")
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-traj-") as tmp:
        lc = LocalCluster(Path(tmp), nodes=args.nodes, prefix="bt")
        try:
            gw1, gw2 = lc.add_gateway(), lc.add_gateway()
            token = lc.project_tokens["default"]
            first = shoal.AsyncClient(f"shoal://{gw1.address}", token=token)
            other = shoal.AsyncClient(f"shoal://{gw2.address}", token=token)
            await first.connect()
            await other.connect()
            deadline = time.monotonic() + 60
            while sum(n["healthy"] for n in (await first.call("cluster_status", {}))["nodes"].values()) < args.nodes:
                assert time.monotonic() < deadline, "nodes did not come up"
                await asyncio.sleep(0.1)
            name = f"bench/{os.getpid()}"
            sandbox = await first.create(image="busybox", pool=False, ttl_s=900, trajectory=name)
            for i in range(8):
                await sandbox.exec(f"echo {i}")
            holder = next(n for n in lc.nodes if sandbox.id.startswith(n.node_id + "-"))
            direct = shoal.AsyncClient(f"shoal://{holder.address}", token=token)
            await direct.connect()
            print(f"{args.nodes} nodes, 2 gateways, one sandbox {sandbox.id} running trajectory {name!r}")
            pid = gw2.proc.pid

            print("attach (the handle a restarted trainer gets back):")
            await measure("through a gateway, by sandbox ID", args.n, pid, lambda _i: other.attach(sandbox.id))
            await measure("through a gateway, by trajectory name", args.n, pid, lambda _i: other.attach(name))
            await measure("directly on its node, by trajectory name", args.n, None, lambda _i: direct.attach(name))
            print("log page (log_steps, 8 steps):")
            page = {"since": 0, "limit": 256}
            await measure("through a gateway, by sandbox ID", args.n, pid,
                          lambda _i: other.call("log_steps", {"target": sandbox.id, **page}))  # fmt: skip
            await measure("through a gateway, by trajectory name", args.n, pid,
                          lambda _i: other.call("log_steps", {"target": name, **page}))  # fmt: skip
            print("create(trajectory=) of a live name (finds the sandbox, makes nothing):")
            await measure("through the other gateway", args.n, pid,
                          lambda _i: other.create(image="busybox", pool=False, trajectory=name))  # fmt: skip
            print("create + close of a new sandbox (a container is made each time):")
            count = max(10, args.n // 10)

            async def plain(_i: int) -> None:
                await (await other.create(image="busybox", pool=False)).close()

            made = iter(range(1 << 30))

            async def named(_i: int) -> None:
                fresh = f"{name}/new{next(made)}"
                await (await other.create(image="busybox", pool=False, trajectory=fresh)).close()

            for _ in range(2):  # interleaved rounds: the machine's load drifts
                await measure("no trajectory", count, pid, plain)
                await measure("a new trajectory name (lookup + home node)", count, pid, named)
            await sandbox.close()
            for client in (first, other, direct):
                await client.close()
        finally:
            lc.stop()


if __name__ == "__main__":
    asyncio.run(main())
