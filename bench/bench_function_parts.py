"""Where a function call's CPU goes, process by process: the node, the worker, a zygote (a tree that has one)
and the calls' children, per call, with the page faults of each, beside a bare fork of an interpreter of
the worker's size in the same run (issue 12 and 17: the floor under `call` and `POST /run_code`).

    sudo PYTHONPATH=src .venv/bin/python bench/bench_function_parts.py [--calls 1000] [--way run_code|call|map]
        [--rounds 2]

(`map`: --calls items of one `map(lambda x: x, ...)` at concurrency 1, isolated per item; figures per item.)

One private node, ONE worker (SHOAL_FN_MAX_WORKERS=1), calls one after another, so every figure is per
call and nothing queues. Read from /proc of the worker's processes (root needed: they are the sandbox's):
utime+stime and minflt of the worker (its own), of its reaped children (the calls: cutime/cminflt), and of
its child that lives across calls (a zygote, where a tree forks calls from one). The baseline forks a
python3 holding the same modules (json, re, typing, ...: RssAnon printed) and measures parent and child CPU
and faults of fork + _exit, and of fork + compile/exec of a one-line snippet + _exit. On this PVM guest a
page fault exits to the hypervisor: a copy-on-write fault costs ~3-5 us, so faults are the unit to watch.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shoal
from shoal.cluster.local import LocalCluster

TICK = os.sysconf("SC_CLK_TCK")
PYTHON3 = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

BASELINE = r"""
import json, math, re, collections, itertools, functools, typing, string, heapq, gc, os, resource, sys
gc.collect(); gc.freeze()
try:
    import ctypes; ctypes.CDLL(None).malloc_trim(0)
except Exception:
    pass
n, work = int(sys.argv[1]), sys.argv[2]
anon = [l.split()[1] for l in open("/proc/self/status") if l.startswith("RssAnon")][0]
null = os.open("/dev/null", os.O_WRONLY)
def usage(who):
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime, u.ru_minflt
p0, c0 = usage(resource.RUSAGE_SELF), usage(resource.RUSAGE_CHILDREN)
for i in range(n):
    pid = os.fork()
    if pid == 0:
        if work == "snippet":
            os.dup2(null, 1)
            exec(compile(f"print(sum(range({i})))", "main.py", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
p1, c1 = usage(resource.RUSAGE_SELF), usage(resource.RUSAGE_CHILDREN)
print(anon, (p1[0] - p0[0]) * 1e3 / n, (p1[1] - p0[1]) / n, (c1[0] - c0[0]) * 1e3 / n, (c1[1] - c0[1]) / n)
"""


def stat(pid: int) -> dict[str, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return {
        "flt": int(fields[7]),
        "cflt": int(fields[8]),
        "cpu": (int(fields[11]) + int(fields[12])) / TICK,
        "ccpu": (int(fields[13]) + int(fields[14])) / TICK,
    }


def status(pid: int) -> str:
    keep = ("RssAnon", "RssFile", "VmPTE")
    rows = [line.split(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines()]
    return " ".join(f"{k}={v.strip().replace(' kB', 'k')}" for k, v in rows if k in keep)


def worker_processes(cgroup_parent: str) -> list[tuple[int, int]]:
    """(pid, ppid) of the processes running worker.py under this node's cgroup parent."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                b"/run/shoal-fn/worker.py" in (proc / "cmdline").read_bytes()
                and cgroup_parent in (proc / "cgroup").read_text()
            ):
                found.append((int(proc.name), int((proc / "stat").read_text().rpartition(")")[2].split()[1])))
        except (OSError, ValueError):
            continue
    return found


def shoal_parts(lc: LocalCluster, way: str, n: int) -> str:
    node = lc.nodes[0]

    async def run() -> str:
        async with shoal.AsyncClient(f"shoal://{node.address}", token=lc.project_tokens["bench"]) as client:

            async def items(n: int) -> None:  # map: n items, one batch after another on the one worker
                assert [v async for v in client.map(lambda x: x, range(n), concurrency=1)] == list(range(n))

            async def one(i: int) -> None:
                if way == "call":
                    assert await client.call("1") == 1
                else:
                    result = await client.run_code(f"print(sum(range({i})))")
                    assert result.run is not None and result.run.stdout_bytes == f"{sum(range(i))}\n".encode()

            for i in range(50 if way != "map" else 0):  # the worker starts and warms up
                await one(i)
            if way == "map":
                await items(200)
            procs = worker_processes(node.cgroup_parent)
            pids = {pid for pid, _ in procs}
            worker = next(pid for pid, ppid in procs if ppid not in pids)
            zygotes = [pid for pid, ppid in procs if ppid == worker]
            memory = f"worker {status(worker)}" + (f"; zygote {status(zygotes[0])}" if zygotes else "")
            w0, z0, node0 = stat(worker), [stat(z) for z in zygotes[:1]], stat(node.pid)
            start = time.perf_counter()
            if way == "map":
                await items(n)
            for i in range(n if way != "map" else 0):
                await one(i)
            elapsed = time.perf_counter() - start
            w1, z1, node1 = stat(worker), [stat(z) for z in zygotes[:1]], stat(node.pid)

            def per(a: dict, b: dict, cpu: str, flt: str) -> str:
                return f"{(b[cpu] - a[cpu]) * 1e3 / n:6.3f} ms {(b[flt] - a[flt]) / n:6.1f} flt"

            parts = [
                f"node {(node1['cpu'] - node0['cpu']) * 1e3 / n:6.3f} ms",
                f"worker {per(w0, w1, 'cpu', 'flt')}",
                f"children {per(w0, w1, 'ccpu', 'cflt')}",
            ]
            if z0:
                parts.append(f"zygote {per(z0[0], z1[0], 'cpu', 'flt')}")
            sandbox = (w1["cpu"] - w0["cpu"] + w1["ccpu"] - w0["ccpu"]) * 1e3 / n
            sandbox += sum(b["cpu"] - a["cpu"] for a, b in zip(z0, z1, strict=True)) * 1e3 / n
            return (
                f"shoal {way:<8} {elapsed * 1e3 / n:6.2f} ms/call sequential | " + " | ".join(parts)
                + f" | sandbox total {sandbox:.3f} ms\n    {memory}"
            )  # fmt: skip

    return asyncio.run(run())


def baseline(n: int, work: str) -> str:
    out = subprocess.run([PYTHON3, "-c", BASELINE, str(n), work], capture_output=True, text=True, check=True)
    anon, parent, parent_flt, child, child_flt = out.stdout.split()
    return (
        f"raw fork {work:<8} (python3 with the default modules, RssAnon {anon} kB): parent {float(parent):6.3f} ms "
        f"{float(parent_flt):6.1f} flt | child {float(child):6.3f} ms {float(child_flt):6.1f} flt | total "
        f"{float(parent) + float(child):.3f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--way", choices=("run_code", "call", "map", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: it reads /proc of the sandbox's processes", file=sys.stderr)
        return 2
    os.environ["SHOAL_FN_MAX_WORKERS"] = "1"
    ways = ("run_code", "call") if args.way == "both" else (args.way,)
    workdir = Path(tempfile.mkdtemp(prefix="shoal-bench-fnparts-"))
    lc = LocalCluster(workdir, nodes=1, projects={"bench": {}}, prefix="bfp")
    lines = []
    try:
        for round_ in range(args.rounds):
            lines.append(f"round {round_ + 1}, load {os.getloadavg()[0]:.1f}")
            lines.append(baseline(args.calls, "exit"))
            lines.append(baseline(args.calls, "snippet"))
            for way in ways:
                lines.append(shoal_parts(lc, way, args.calls))
            print("\n".join(lines[-2 - len(ways) - 1 :]), flush=True)
    finally:
        lc.stop()
        if str(workdir) not in Path("/proc/mounts").read_text():
            shutil.rmtree(workdir, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"(bench client CPU {usage.ru_utime + usage.ru_stime:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
