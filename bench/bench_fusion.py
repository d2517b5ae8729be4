"""SandboxFusion's POST /run_code through the node's and the gateway's HTTP, beside `client.run_code`.

One private node (and a gateway in front of it) with a token file; `--n` Python snippets (each prints a sum,
so each verdict is checked) run `--concurrency` at a time three ways in one run:

- client.run_code: shoal's own client over the node's TCP protocol (the floor for the same work);
- node HTTP: SandboxFusion's request shape posted to the node's /run_code (aiohttp, keep-alive);
- gateway HTTP: the same through a gateway (one more hop).

    PYTHONPATH=src .venv/bin/python bench/bench_fusion.py [--n 500] [--concurrency 32]

Prints snippets/s, p50/p99 latency, and CPU-ms per snippet: the machine's (all cores, /proc/stat; the
machine is shared, so it includes others' load) and the node and gateway processes' own (with their reaped
children). Not asserted anywhere: issue 17's target is 500 snippets/s through HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
from _common import summary

import shoal
from shoal.cluster.local import LocalCluster

TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK  # all but idle and iowait


def process_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(x) for x in stat[11:15]) / TICK  # utime stime cutime cstime


def snippet(i: int) -> tuple[str, str]:
    return f"print(sum(range({i})))", f"{sum(range(i))}\n"


async def over_http(url: str, token: str, n: int, concurrency: int) -> list[float]:
    times: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one(i: int) -> None:
            code, expected = snippet(i)
            body = {"code": code, "language": "python", "run_timeout": 10, "compile_timeout": 10,
                    "memory_limit_MB": 256, "files": {}, "fetch_files": []}  # fmt: skip
            async with gate:
                started = time.perf_counter()
                async with session.post(f"{url}/run_code", json=body) as response:
                    answer = await response.json()
                times.append(time.perf_counter() - started)
            assert answer["status"] == "Success" and answer["run_result"]["stdout"] == expected, answer

        await asyncio.gather(*(one(i) for i in range(n)))
    return times


async def over_client(address: str, token: str, n: int, concurrency: int) -> list[float]:
    times: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with shoal.AsyncClient(f"shoal://{address}", token=token) as client:

        async def one(i: int) -> None:
            code, expected = snippet(i)
            async with gate:
                started = time.perf_counter()
                result = await client.run_code(code, "python", memory_mb=256)
                times.append(time.perf_counter() - started)
            assert result.ok and result.stdout == expected, result

        await asyncio.gather(*(one(i) for i in range(n)))
    return times


def measure(name: str, run, pids: list[int], n: int) -> None:  # type: ignore[no-untyped-def]
    machine, own = machine_cpu_s(), sum(process_cpu_s(p) for p in pids)
    started = time.perf_counter()
    times = asyncio.run(run())
    wall = time.perf_counter() - started
    machine_ms = (machine_cpu_s() - machine) * 1e3 / n
    own_ms = (sum(process_cpu_s(p) for p in pids) - own) * 1e3 / n
    print(f"{summary(name, times, wall)}  cpu/op machine {machine_ms:6.2f} ms, node+gateway {own_ms:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="shoal-bench-fusion-"))
    lc = LocalCluster(workdir, nodes=1, projects={"bench": {}}, prefix="bf")
    try:
        gateway = lc.add_gateway()
        node = lc.nodes[0]
        token = lc.project_tokens["bench"]
        pids = [node.pid, gateway.proc.pid]
        n, c = args.n, args.concurrency
        asyncio.run(over_client(node.address, token, 2 * c, c))  # warm the worker pool
        print(f"{n} python snippets, {c} at a time, {os.cpu_count()} cores")
        measure("client.run_code (node TCP)", lambda: over_client(node.address, token, n, c), pids, n)
        measure("POST /run_code (node HTTP)", lambda: over_http(f"http://{node.http}", token, n, c), pids, n)
        measure("POST /run_code (gateway HTTP)", lambda: over_http(f"http://{gateway.http}", token, n, c), pids, n)
    finally:
        lc.stop()
        if str(workdir) not in Path("/proc/mounts").read_text():  # nothing left mounted: the run's files go
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
