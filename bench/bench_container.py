"""Container substrate benchmark: shoal side by side with raw crun and bubblewrap, in one run.

    python bench/bench_container.py [--quick] [--density N]

(a) create → first exec → close, sequential and concurrent, vs raw `crun run/exec/delete` and `bwrap`
(b) warm-pool claim; (c) exec round trip of `true` vs `crun exec`; (d) host memory per idle sandbox.
Figures are medians and p99 over this run; the machine is shared, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode, meminfo_used_mb, summary  # noqa: E402

import shoal  # noqa: E402

IMAGE = "busybox"


def raw(mode: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_raw.py")), mode, str(n)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


async def cycle(client: shoal.AsyncClient) -> float:
    t = time.perf_counter()
    sb = await client.create(image=IMAGE, pool=False)
    await sb.exec("true")
    await sb.close()
    return time.perf_counter() - t


async def bench_cycles(client: shoal.AsyncClient, n: int, concurrency: int) -> tuple[list[float], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with gate:
            return await cycle(client)

    start = time.perf_counter()
    seconds = await asyncio.gather(*(one() for _ in range(n)))
    return list(seconds), time.perf_counter() - start


async def bench_create_only(client: shoal.AsyncClient, n: int) -> list[float]:
    seconds = []
    for _ in range(n):
        t = time.perf_counter()
        sb = await client.create(image=IMAGE, pool=False)
        seconds.append(time.perf_counter() - t)
        await sb.close()
    return seconds


async def bench_claims(client: shoal.AsyncClient, n: int) -> list[float]:
    await client.set_pool("container", IMAGE, n, wait=True)
    claimed, seconds = [], []
    for _ in range(n):
        t = time.perf_counter()
        claimed.append(await client.create(image=IMAGE, env={"LATE": "1"}, labels={"bench": "claim"}))
        seconds.append(time.perf_counter() - t)
    status = await client.status()
    await client.set_pool("container", IMAGE, 0)
    await client.close_all(labels={"bench": "claim"})
    assert status["pool_hits"] >= n, status
    return seconds


async def bench_exec(client: shoal.AsyncClient, n: int) -> list[float]:
    sb = await client.create(image=IMAGE, pool=False)
    seconds = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            await sb.exec(["true"])
            seconds.append(time.perf_counter() - t)
    finally:
        await sb.close()
    return seconds


def cgroup_memory_mb(sandbox_id: str) -> float:
    """Memory charged to one sandbox's cgroup (its processes, page cache and kernel objects)."""
    parent = os.environ["SHOAL_CGROUP_PARENT"]
    for path in (f"/sys/fs/cgroup/memory/{parent}/{sandbox_id}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/{parent}/{sandbox_id}/memory.current"):  # fmt: skip
        try:
            return int(Path(path).read_text()) / 2**20
        except OSError:
            continue
    return float("nan")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def bench_density(client: shoal.AsyncClient, n: int) -> tuple[float, float, float]:
    node_pid = (await client.status())["pid"]
    before, node_before = meminfo_used_mb(), rss_mb(node_pid)
    start = time.perf_counter()
    made = await client.create_many(n, image=IMAGE, pool=False, labels={"bench": "density"}, concurrency=16)
    wall = time.perf_counter() - start
    ok = [s for s in made if isinstance(s, shoal.AsyncSandbox)]
    await asyncio.sleep(2)
    charged = statistics.mean(cgroup_memory_mb(s.id) for s in ok)
    node_share = (rss_mb(node_pid) - node_before) / max(1, len(ok))
    host_delta = (meminfo_used_mb() - before) / max(1, len(ok))
    print(f"  per sandbox: {charged:.2f} MiB charged to its cgroup + {node_share:.3f} MiB of node memory; "
          f"host MemAvailable delta {host_delta:.2f} MiB (noisy on a shared machine)")  # fmt: skip
    per = charged + node_share
    answered = sum(r.exit_code == 0 for r in await asyncio.gather(*(s.exec("true") for s in ok[:: max(1, n // 50)])))
    closed = await client.close_all(labels={"bench": "density"})
    print(f"  density: {len(ok)}/{n} live ({wall:.1f} s to create), {answered} sampled answered, {closed} closed")
    return per, len(ok), wall


async def main(args: argparse.Namespace) -> None:
    node = BenchNode("container")
    n = 30 if args.quick else 100
    try:
        async with shoal.AsyncClient() as client:
            await cycle(client)  # warm: node, image, agent binary
            print(f"shoal container benchmark — image {IMAGE}, {n} iterations per row\n")
            print("(a) create → exec `true` → close")
            seq, seq_wall = await bench_cycles(client, n, 1)
            print(summary("shoal, sequential", seq, seq_wall))
            for concurrency in (4, 16):
                con, con_wall = await bench_cycles(client, n * 2, concurrency)
                print(summary(f"shoal, {concurrency} concurrent", con, con_wall))
            rc = raw("crun", n)
            print(summary("raw crun run -d + exec + delete, sequential", rc["seconds"], rc["wall"]))
            rb = raw("bwrap", n)
            print(summary("raw bwrap true (ro layer, no overlay), sequential", rb["seconds"], rb["wall"]))
            ratio = statistics.median(seq) / statistics.median(rc["seconds"])
            print(f"  → shoal / raw crun (sequential p50): {ratio:.2f}x\n")
            print("(a') cold create → ready")
            cold = await bench_create_only(client, n)
            print(summary("shoal create (no pool)", cold))
            rcc = raw("crun-create", n)
            print(summary("raw crun run -d", rcc["seconds"]))
            print("\n(b) warm-pool claim (late-bound env + labels)")
            print(summary("shoal create from a warm pool", await bench_claims(client, min(n, 50))))
            print("\n(c) exec round trip of `true`")
            ex = await bench_exec(client, n * 3)
            print(summary("shoal sb.exec(['true'])", ex))
            rex = raw("crun-exec", n)
            print(summary("raw crun exec true", rex["seconds"]))
            print(f"  → crun exec / shoal exec (p50): {statistics.median(rex['seconds']) / statistics.median(ex):.1f}x")
            print(f"\n(d) density: {args.density} idle sandboxes")
            per, live, _ = await bench_density(client, args.density)
            print(f"  host memory per idle sandbox ≈ {per:.2f} MiB ({live} live)")
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--density", type=int, default=1000)
    asyncio.run(main(parser.parse_args()))
