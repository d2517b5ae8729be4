"""What TLS costs on the network ports: exec round trips and connection setup, plain TCP next to TLS, in one run.

    PYTHONPATH=src python bench/bench_tls.py [--n 300]

Two local clusters (shoal.cluster.local) of one node and one gateway each, one plain and one with a CA made
for the run; the same sandbox work through each, direct to the node and through the gateway (whose hop to
the node is TLS too). Rows give p50/p99 and the node's + gateway's CPU-ms per op. Everything shares this
machine's cores, so read the columns side by side, not as absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import shoal
from shoal.cluster.local import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402


def row(name: str, seconds: list[float], cpu_s: float) -> str:
    p50, p99 = statistics.median(seconds) * 1e3, pct(seconds, 0.99) * 1e3
    return f"  {name:<40} p50 {p50:8.3f} ms   p99 {p99:8.3f} ms   {cpu_s * 1e3 / len(seconds):6.3f} CPU-ms/op"


async def measure(lc: LocalCluster, n: int, label: str) -> None:
    token = lc.project_tokens["default"]
    pids = [lc.nodes[0].pid, lc.gateways[0].proc.pid]
    ca = str(lc.ca) if lc.ca else None
    for where, address in (("node", lc.nodes[0].address), ("gateway", lc.gateways[0].address)):
        url = f"{lc.scheme}{address}"
        async with shoal.AsyncClient(url, token=token, tls_ca=ca) as client:
            sb = await client.create(image="busybox", pool=False, ttl_s=600)
            try:
                for _ in range(20):  # warm up
                    await sb.exec("true")
                times = []
                cpu0 = sum(cpu_seconds(p) for p in pids)
                for _ in range(n):
                    t = time.perf_counter()
                    await sb.exec("true")
                    times.append(time.perf_counter() - t)
                print(row(f"{label} exec('true') via {where}", times, sum(cpu_seconds(p) for p in pids) - cpu0))
            finally:
                await sb.close()
        times = []
        cpu0 = sum(cpu_seconds(p) for p in pids)
        for _ in range(max(20, n // 10)):
            t = time.perf_counter()
            conn = shoal.AsyncClient(url, token=token, tls_ca=ca)
            await conn.connect()  # TCP (+ TLS handshake) + auth
            times.append(time.perf_counter() - t)
            await conn.close()
        print(row(f"{label} connect+auth to {where}", times, sum(cpu_seconds(p) for p in pids) - cpu0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        clusters = []
        try:
            for tls in (False, True):
                lc = LocalCluster(
                    Path(tmp) / ("tls" if tls else "plain"), nodes=1, prefix="bt" if tls else "bp", tls=tls
                )
                clusters.append(lc)
                lc.add_gateway()
            time.sleep(2)  # the gateways' first polls
            print(f"bench_tls: {args.n} sequential execs per row, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
            for lc in clusters:
                asyncio.run(measure(lc, args.n, "TLS  " if lc.ca else "plain"))
        finally:
            for lc in clusters:
                lc.stop()


if __name__ == "__main__":
    main()
