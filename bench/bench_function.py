"""Function-kind throughput (issue 12 and 17): calls/s, map items/s and SandboxFusion snippets/s beside a
bare fork of a warm interpreter, in one run, with p50/p99 and CPU-ms per call, and each target met or not.

    PYTHONPATH=src .venv/bin/python bench/bench_function.py [--calls 2000] [--map-items 10000]
        [--snippets 500] [--concurrency 8] [--rounds 1] [--profile DIR]

One private node (LocalCluster: own home, cgroup parent, a project token, TCP and HTTP). Ways:
- raw fork            the floor: os.fork + pipe + JSON + waitpid in plain warm interpreters (one per core),
                       no isolation, no IPC beyond the pipe
- shoal call(source)  `client.call("1")`: client → node → warm worker → fresh forked child (own cgroup,
                       nobody, no network) → JSON result; the full isolated path, one round trip per call
- shoal map(function) `client.map(fn, items)`, a cloudpickled function: batches of items per worker round
                       trip, each item still a fresh child with nothing of the item before it left
- map(function, batch iso) the same with isolation="batch": a batch's items in ONE child (function loaded
                       once, items see what earlier ones of their batch left): the opt-in, weaker mode
- shoal exec          `sandbox.exec(["true"])` on a function sandbox: fork + exec of a binary per call
- POST /run_code      SandboxFusion's API on the node's HTTP (aiohttp client, keep-alive): a python snippet
                       each, its printed sum checked
- python3 -c          a new interpreter per call (what a harness without warm workers pays)

CPU-ms per op is the machine's (all cores from /proc/stat: it includes other users' load on a shared host),
and for shoal the node process's own and its sandboxes' (the cgroup parent holding the function workers and
every call's child), the figure to set beside the raw fork's own CPU. `--profile DIR` also records py-spy
flame data of the node during the shoal ways (py-spy is in the [dev] extra). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from _common import machine_cpu_s, pct, process_cpu_s, sandboxes_cpu_s

import shoal
from shoal.cluster.local import LocalCluster

PYTHON3 = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
TARGETS = {  # issue 12 (calls, map) and issue 17 (SandboxFusion through HTTP)
    "shoal call(source)": 1000.0,
    "shoal map(function)": 2000.0,
    "map(function, batch iso)": 2000.0,
    "POST /run_code (node HTTP)": 500.0,
}

RAW_FORK = r"""
import json, os, sys, time
n = int(sys.argv[1])
lat = []
for _ in range(n):
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps({"ok": True, "value": "1"}).encode())
        os._exit(0)
    os.close(w)
    json.loads(os.read(r, 1 << 16))
    os.close(r)
    os.waitpid(pid, 0)
    lat.append(time.perf_counter() - t)
print(json.dumps(lat))
"""


def own_cpu_s() -> float:
    """This process's CPU (the clients of the shoal ways: aiohttp, shoal's client)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Row:
    def __init__(self, name: str) -> None:
        self.name = name
        self.rates: list[float] = []
        self.latencies: list[float] = []
        self.machine_ms: list[float] = []
        self.node_ms: list[float] = []
        self.sandbox_ms: list[float] = []
        self.client_ms: list[float] = []


async def timed(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def run(i: int) -> None:
        async with gate:
            start = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(n)))
    return time.perf_counter() - start, latencies


def measure(row: Row, n: int, run: Callable[[], Awaitable[tuple[float, list[float]]]], node: Any = None) -> None:
    machine = machine_cpu_s()
    own = process_cpu_s(node.pid) if node else 0.0
    boxes = sandboxes_cpu_s(node.cgroup_parent) if node else 0.0
    client = own_cpu_s()
    elapsed, latencies = asyncio.run(run())
    row.client_ms.append((own_cpu_s() - client) * 1e3 / n)
    row.rates.append(n / elapsed)
    row.latencies += latencies
    row.machine_ms.append((machine_cpu_s() - machine) * 1e3 / n)
    if node:
        row.node_ms.append((process_cpu_s(node.pid) - own) * 1e3 / n)
        row.sandbox_ms.append((sandboxes_cpu_s(node.cgroup_parent) - boxes) * 1e3 / n)


def snippet(i: int) -> tuple[str, str]:
    return f"print(sum(range({i})))", f"{sum(range(i))}\n"


def shoal_ways(lc: LocalCluster, rows: dict[str, Row], args: argparse.Namespace) -> None:
    node = lc.nodes[0]
    token = lc.project_tokens["bench"]
    c = args.concurrency
    url = f"shoal://{node.address}"

    async def warm(way: str) -> None:
        """Grow the way's pool before it is timed (and again each way: idle workers retire after
        SHOAL_FN_IDLE_S, and a way that starts workers while timed would count their start)."""
        async with shoal.AsyncClient(url, token=token) as client:
            if way in ("shoal call(source)", "shoal exec"):
                await asyncio.gather(*(client.call("1") for _ in range(c * 4)))
            elif "map(function" in way:
                async for _ in client.map(lambda x: x, range(c * 16), concurrency=c):
                    pass  # the workers that hold cloudpickle
            else:
                await asyncio.gather(*(client.run_code("print(1)") for _ in range(c * 4)))

    async def calls() -> tuple[float, list[float]]:
        async with shoal.AsyncClient(url, token=token) as client:

            async def one(_i: int) -> None:
                assert await client.call("1") == 1

            return await timed(args.calls, c, one)

    async def mapped(isolation: str = "item") -> tuple[float, list[float]]:
        async with shoal.AsyncClient(url, token=token) as client:
            start = time.perf_counter()
            count = 0
            options = {"isolation": isolation} if isolation != "item" else {}  # an older tree knows only "item"
            async for value in client.map(lambda x: x, range(args.map_items), concurrency=c, **options):
                assert value == count, value
                count += 1
            return time.perf_counter() - start, []

    async def execs() -> tuple[float, list[float]]:
        async with shoal.AsyncClient(url, token=token) as client:
            sandbox = await client.create("function", image="debian", ttl_s=600)
            try:

                async def one(_i: int) -> None:
                    assert (await sandbox.exec(["true"])).exit_code == 0

                return await timed(args.calls, c, one)
            finally:
                await sandbox.close()

    async def fusion() -> tuple[float, list[float]]:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c), headers=headers) as session:

            async def one(i: int) -> None:
                code, expected = snippet(i)
                body = {"code": code, "language": "python", "run_timeout": 10, "compile_timeout": 10,
                        "memory_limit_MB": 256, "files": {}, "fetch_files": []}  # fmt: skip
                async with session.post(f"http://{node.http}/run_code", json=body) as response:
                    answer = await response.json()
                assert answer["status"] == "Success" and answer["run_result"]["stdout"] == expected, answer

            return await timed(args.snippets, c, one)

    ways: list[tuple[str, int, Callable[[], Awaitable[tuple[float, list[float]]]]]] = [
        ("shoal call(source)", args.calls, calls),
        ("shoal map(function)", args.map_items, mapped),
        ("map(function, batch iso)", args.map_items, lambda: mapped("batch")),
        ("shoal exec", args.calls, execs),
        ("POST /run_code (node HTTP)", args.snippets, fusion),
    ]
    for name, n, run in ways:
        if args.ways and not any(w in name for w in args.ways.split(",")):
            continue
        asyncio.run(warm(name))
        profiler = None
        if args.profile:
            out = Path(args.profile) / f"node-{name.split()[1].strip('(/')}.txt"
            spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            argv = [spy, "record", "-p", str(node.pid), "-f", "raw", "-o", str(out), "-r", "200"]
            profiler = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            measure(rows.setdefault(name, Row(name)), n, run, node)
        finally:
            if profiler is not None:
                profiler.send_signal(2)  # py-spy writes its file on SIGINT
                profiler.wait(timeout=60)


def raw_fork(rows: dict[str, Row], n: int) -> None:
    drivers = os.cpu_count() or 1
    row = rows.setdefault("raw fork (no isolation)", Row("raw fork (no isolation)"))
    machine = machine_cpu_s()
    before = os.times()
    start = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, "-c", RAW_FORK, str(n // drivers)], stdout=subprocess.PIPE)
        for _ in range(drivers)
    ]
    for proc in procs:
        out, _ = proc.communicate()
        row.latencies += [float(x) for x in out.decode().strip("[]\n").split(",") if x.strip()]
    elapsed = time.perf_counter() - start
    after = os.times()
    row.rates.append(n // drivers * drivers / elapsed)
    row.machine_ms.append((machine_cpu_s() - machine) * 1e3 / n)
    own = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    row.sandbox_ms.append(own * 1e3 / n)  # the forking processes' own CPU (with their children)


def python_c(rows: dict[str, Row], n: int, concurrency: int) -> None:
    async def one(_i: int) -> None:
        proc = await asyncio.create_subprocess_exec(PYTHON3, "-c", "1")
        await proc.wait()

    row = rows.setdefault("python3 -c per call", Row("python3 -c per call"))
    measure(row, n, lambda: timed(n, concurrency, one), None)


def report(rows: dict[str, Row], args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    print(
        f"calls {args.calls}, map items {args.map_items}, snippets {args.snippets}; concurrency {args.concurrency}; "
        f"{os.cpu_count()} cores, load {load:.1f}; {args.rounds} round(s), medians"
    )
    print(
        f"{'way':<28} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'machine':>8} {'node':>6} {'calls':>6} {'client':>6}"
        "  target   (CPU ms per op)"
    )
    for name, row in rows.items():
        rate = statistics.median(row.rates)
        p50 = f"{pct(row.latencies, 0.5) * 1e3:.2f}" if row.latencies else "-"
        p99 = f"{pct(row.latencies, 0.99) * 1e3:.2f}" if row.latencies else "-"
        machine = statistics.median(row.machine_ms)
        node = f"{statistics.median(row.node_ms):.2f}" if row.node_ms else "-"
        calls = f"{statistics.median(row.sandbox_ms):.2f}" if row.sandbox_ms else "-"
        client = f"{statistics.median(row.client_ms):.2f}" if row.client_ms else "-"
        target = TARGETS.get(name)
        verdict = f">= {target:.0f}/s {'met' if rate >= target else 'NOT met'}" if target else ""
        print(f"{name:<28} {rate:>8.0f} {p50:>8} {p99:>8} {machine:>8.2f} {node:>6} {calls:>6} {client:>6}  {verdict}")
    print(
        "CPU ms per op: machine = all cores (includes other users' load); node = the node process; calls = "
        "its sandboxes' cgroup (workers and every call's child; for raw fork the forking interpreters); client = "
        "this process (the HTTP or shoal client driving the way)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--map-items", type=int, default=10000)
    parser.add_argument("--snippets", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ways", help="only the ways whose name contains one of these (comma-separated)")
    parser.add_argument("--profile", help="directory for py-spy raw flame data of the node, one file per way")
    args = parser.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows: dict[str, Row] = {}
    # room for every pool these ways use at once (plain, holding cloudpickle, debian-dev): at the default
    # budget one way's pool would evict another's and the timed way would pay for starting workers
    os.environ.setdefault("SHOAL_FN_MAX_WORKERS", str(3 * args.concurrency))
    workdir = Path(tempfile.mkdtemp(prefix="shoal-bench-fn-"))
    lc = LocalCluster(workdir, nodes=1, projects={"bench": {}}, prefix="bfn")
    try:
        for _ in range(args.rounds):
            raw_fork(rows, args.calls)
            shoal_ways(lc, rows, args)
            python_c(rows, max(50, args.calls // 20), args.concurrency)
    finally:
        lc.stop()
        if str(workdir) not in Path("/proc/mounts").read_text():  # nothing left mounted: the run's files go
            shutil.rmtree(workdir, ignore_errors=True)
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
