"""Cluster benchmark: the gateway's added cost, placement speed, a burst of creates across nodes, admission.

    PYTHONPATH=src python bench/bench_cluster.py [--burst 1000] [--nodes 3]

Everything runs on this machine: nodes and the gateway are separate processes (shoal.cluster.local) talking
real TCP. They share its cores, so figures for more nodes here measure contention, not scale; the model at
the end shows the arithmetic for a cluster of separate machines.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import shoal
from shoal.cluster import placement
from shoal.cluster.local import LocalCluster
from shoal.cluster.placement import NodeView

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402


def line(name: str, seconds: list[float], wall: float | None = None) -> str:
    p50, p99 = statistics.median(seconds) * 1e3, pct(seconds, 0.99) * 1e3
    rate = f"{len(seconds) / wall:8.1f}/s" if wall else " " * 10
    return f"  {name:<46} p50 {p50:8.3f} ms   p99 {p99:8.3f} ms  {rate}  (n={len(seconds)})"


async def timed(coro_factory, count: int, concurrency: int) -> tuple[list[float], float, list]:  # noqa: ANN001
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []
    results: list = []

    async def one(i: int) -> None:
        async with gate:
            t = time.perf_counter()
            results.append(await coro_factory(i))
            times.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return times, time.perf_counter() - start, results


async def overhead(lc: LocalCluster, n: int) -> None:
    token = lc.project_tokens["default"]
    gw = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=token)
    direct = shoal.AsyncClient(f"shoal://{lc.nodes[0].address}", token=token)
    await gw.connect()
    await direct.connect()
    sb = await direct.create(image="busybox", pool=False)
    print(f"\n== gateway overhead per operation (sequential, one sandbox on {lc.nodes[0].node_id}) ==")
    for op in ("get", "exec true"):
        for name, client in (("direct to the node", direct), ("through the gateway", gw)):
            handle = await client.get(sb.id)

            async def call(op: str = op, client: shoal.AsyncClient = client, handle=handle) -> None:  # noqa: ANN001
                await (client.get(sb.id) if op == "get" else handle.exec("true"))

            for _ in range(50):
                await call()
            times = []
            for _ in range(n if op == "get" else n // 4):
                t = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t)
            print(line(f"{op:<10} {name}", times))
    for name, client in (("direct to the node", direct), ("through the gateway", gw)):
        times = []
        for _ in range(n // 20):
            t = time.perf_counter()
            made = await client.create(image="busybox", pool=False)
            await made.close()
            times.append(time.perf_counter() - t)
        print(line(f"create+close {name}", times))
    await sb.close()
    await gw.close()
    await direct.close()


async def burst(lc: LocalCluster, count: int, concurrency: int) -> dict:
    token = lc.project_tokens["default"]
    gw = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=token)
    directs = [shoal.AsyncClient(f"shoal://{n.address}", token=token) for n in lc.nodes]
    await gw.connect()
    for d in directs:
        await d.connect()
    print(
        f"\n== burst of {count} creates (busybox, no pool, concurrency {concurrency}) across {len(lc.nodes)} nodes =="
    )
    out = {}
    gw_pid = lc.gateways[0].proc.pid
    for name, factory in (
        (
            "direct (client round-robins the nodes)",
            lambda i: directs[i % len(directs)].create(image="busybox", pool=False),
        ),
        ("through the gateway (placement)", lambda i: gw.create(image="busybox", pool=False)),
    ):
        cpu0 = cpu_seconds(gw_pid)
        times, wall, made = await timed(factory, count, concurrency)
        gw_cpu = cpu_seconds(gw_pid) - cpu0
        spread = {}
        for s in made:
            node = s.id.rsplit("-", 1)[0]
            spread[node] = spread.get(node, 0) + 1
        print(line(f"create, {name}", times, wall) + f"  spread {dict(sorted(spread.items()))}")
        if "gateway" in name:
            print(f"  gateway CPU: {gw_cpu:.2f} s for {count} creates = {1e3 * gw_cpu / count:.3f} ms per create")
            out = {"rate": count / wall, "gw_cpu_per_create": gw_cpu / count, "p50": statistics.median(times)}
        closing = time.perf_counter()
        await asyncio.gather(*(s.close() for s in made))
        print(f"  closed {len(made)} in {time.perf_counter() - closing:.1f} s")
    await gw.close()
    for d in directs:
        await d.close()
    return out


async def scaling(workdir: Path, sizes: list[int], count: int, concurrency: int) -> dict[int, float]:
    print(f"\n== create throughput through one gateway as nodes are added ({count} creates each) ==")
    rates = {}
    for size in sizes:
        lc = LocalCluster(workdir / f"scale{size}", nodes=size, prefix=f"bs{size}n")
        try:
            lc.add_gateway()
            await wait_up(lc, size)
            client = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=lc.project_tokens["default"])
            await client.connect()
            times, wall, made = await timed(
                lambda i, client=client: client.create(image="busybox", pool=False), count, concurrency
            )
            rates[size] = count / wall
            print(line(f"{size} node(s)", times, wall))
            await asyncio.gather(*(s.close() for s in made))
            await client.close()
        finally:
            lc.stop()
    return rates


async def admission(workdir: Path, count: int) -> None:
    capacity = 40
    print(f"\n== admission: {count} creates (ttl 1 s) against {capacity} slots (2 nodes x {capacity // 2}) ==")
    lc = LocalCluster(workdir / "admission", nodes=2, max_sandboxes=capacity // 2, prefix="ba")
    try:
        lc.add_gateway()
        await wait_up(lc, 2)
        client = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=lc.project_tokens["default"])
        await client.connect()
        admin = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=lc.cluster_token)
        depths: list[int] = []

        async def watch() -> None:
            while True:
                depths.append((await admin.call("cluster_status"))["queue_depth"])
                await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())

        async def create(_i: int) -> object:
            try:
                return await client.create(image="busybox", pool=False, ttl_s=1)
            except shoal.ShoalError as exc:
                return exc

        times, wall, made = await timed(create, count, count)
        watcher.cancel()
        await admin.close()
        failed = [m for m in made if isinstance(m, Exception)]
        print(line("create (queueing included)", times, wall) + f"  failures {len(failed)}, max queue {max(depths)}")
        if failed:
            print(f"  first failure: {failed[0]!r}")
        await client.close_all()
        await client.close()
    finally:
        lc.stop()


async def wait_up(lc: LocalCluster, count: int) -> None:
    admin = shoal.AsyncClient(f"shoal://{lc.gateways[0].address}", token=lc.cluster_token)
    for _ in range(200):
        view = await admin.call("cluster_status")
        if sum(n["healthy"] for n in view["nodes"].values()) >= count:
            break
        await asyncio.sleep(0.05)
    await admin.close()


def placement_speed() -> float:
    rng = random.Random(1)
    nodes = [
        NodeView(node_id=f"n{i}", host="h", port=i, healthy=True, kinds=frozenset({"container"}),
                 images=frozenset({"debian"}), max_sandboxes=2400, polled=rng.randrange(2400))
        for i in range(160)
    ]  # fmt: skip
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        choice = placement.choose(nodes, "container", "debian", set(), 32, 2, rng)
        choice.delta += 1
    per = (time.perf_counter() - start) / n
    print(f"\n== placement decision over 160 nodes (power-of-2): {per * 1e6:.1f} us = {1 / per:,.0f}/s per core ==")
    return per


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    per_decision = placement_speed()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-cluster-") as tmp:
        workdir = Path(tmp)
        lc = LocalCluster(workdir / "main", nodes=args.nodes, prefix="bc")
        try:
            lc.add_gateway()
            await wait_up(lc, args.nodes)
            await overhead(lc, args.ops)
            figures = await burst(lc, args.burst, args.concurrency)
        finally:
            lc.stop()
        rates = await scaling(workdir, [1, 2, 3], max(200, args.burst // 4), args.concurrency)
        await admission(workdir, 300)
    per_node = rates[1]
    gw_cost = figures["gw_cpu_per_create"]
    print("\n== model: 160 nodes against the reference design's 5,000 creates/s ==")
    print(f"  one node here (2 cores, shared with its gateway and client): {per_node:.0f} creates/s")
    print(f"  nodes on separate machines add their rates: 160 x {per_node:.0f} = {160 * per_node:,.0f} creates/s")
    print(f"  one gateway core spends {gw_cost * 1e3:.3f} ms per create (placement {per_decision * 1e6:.0f} us of it)"
          f" -> {1 / gw_cost:,.0f} creates/s per gateway core")  # fmt: skip
    need = 5000 * gw_cost
    print(f"  5,000 creates/s need 5000 x {gw_cost * 1e3:.3f} ms = {need:.2f} gateway cores: "
          f"{max(1, int(need) + 1)} stateless gateway process(es)")  # fmt: skip
    print(f"  nodes needed at {per_node:.0f}/s each: 5000 / {per_node:.0f} = {5000 / per_node:.0f} (of 160)")


if __name__ == "__main__":
    asyncio.run(main())
