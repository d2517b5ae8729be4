"""SandboxFusion's POST /run_code through the node's HTTP (issue 17: 500 snippets/s), beside the raw limit.

One private node with a token file; `--n` Python snippets (each prints a sum, so each verdict is checked)
run `--concurrency` at a time. Rows, in one run:

- raw fork + snippet: the limit without isolation. One warm python3 per core (holding the worker's default
  modules) forks a child per snippet that runs it (compile, exec) with stdout on a pipe the parent reads,
  then waits for it: what a fresh process per snippet costs with nothing else.
- POST /run_code (node HTTP): SandboxFusion's request shape posted to the node's /run_code by a lean
  keep-alive HTTP/1.1 driver (plain sockets and selectors, one request in flight per connection) in a
  process of its own, as verl's client would be on another machine: its CPU is reported apart.
- `--aiohttp`: the same posted by aiohttp from this process (the client most Python code uses).
- `--shoal-client`: client.run_code over the node's TCP protocol.
- `--gateway`: the same HTTP through a gateway (one more hop).

    PYTHONPATH=src .venv/bin/python bench/bench_fusion.py [--n 2000] [--concurrency 32] [--rounds 1]

Per row: snippets/s, p50/p99 latency and CPU-ms per snippet split node (the node process, its reaped
children included; the gateway's added on the gateway row) / sandbox (the cgroup parent holding every
function worker and every snippet's child, from cpuacct) / client (the driving process), and the
machine's (all cores from /proc/stat: the machine is shared, so it includes others' load). `rate bound`
is what 2 cores would give at node + sandbox CPU (the client elsewhere) and at node + sandbox + client
(the client here). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from _common import machine_cpu_s, pct, process_cpu_s, sandboxes_cpu_s

CORES = os.cpu_count() or 1
PYTHON3 = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

RAW = r"""
import json, math, re, collections, itertools, functools, typing, string, heapq, gc, os, resource, sys, time
gc.collect(); gc.freeze()
n, first = int(sys.argv[1]), int(sys.argv[2])
lat = []
u0 = resource.getrusage(resource.RUSAGE_SELF); c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
for i in range(first, first + n):
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        exec(compile(f"print(sum(range({i})))", "main.py", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
        os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert out == f"{sum(range(i))}\n".encode(), out
    lat.append(time.perf_counter() - t)
u1 = resource.getrusage(resource.RUSAGE_SELF); c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((u0, u1), (c0, c1)) for f in ("ru_utime", "ru_stime"))
print(json.dumps({"lat": lat, "cpu": cpu}))
"""


def snippet(i: int) -> tuple[str, str]:
    return f"print(sum(range({i})))", f"{sum(range(i))}\n"


def body_of(i: int) -> bytes:
    code, _ = snippet(i)
    return json.dumps({"code": code, "language": "python", "run_timeout": 10, "compile_timeout": 10,
                       "memory_limit_MB": 256, "files": {}, "fetch_files": []}).encode()  # fmt: skip


# ------------------------------------------------------------------ the lean driver (its own process)


def drive(address: str, token: str, first: int, n: int, concurrency: int) -> dict:
    """POST n snippets over `concurrency` keep-alive connections, one in flight on each; check each verdict."""
    host, port = address.rsplit(":", 1)
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    selector = selectors.DefaultSelector()
    latencies: list[float] = []
    bad: list[str] = []
    state = {"next": first}

    def send(conn: dict) -> None:
        i = conn["i"] = state["next"]
        state["next"] += 1
        body = body_of(i)
        head = (f"POST /run_code HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        conn["t"] = time.perf_counter()
        conn["sock"].sendall(head.encode() + body)

    started = time.perf_counter()
    for _ in range(min(concurrency, n)):
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = {"sock": sock, "buf": b""}
        selector.register(sock, selectors.EVENT_READ, conn)
        send(conn)
    done = 0
    while done < n:
        for key, _ in selector.select():
            conn = key.data
            data = conn["sock"].recv(1 << 16)
            if not data:
                raise ConnectionError("the node closed a keep-alive connection")
            buf = conn["buf"] = conn["buf"] + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            head = buf[:end].lower()
            at = head.index(b"content-length:") + 15
            length = int(head[at:].split(b"\r\n", 1)[0])
            if len(buf) < end + 4 + length:
                continue
            answer = json.loads(buf[end + 4 : end + 4 + length])
            conn["buf"] = buf[end + 4 + length :]
            latencies.append(time.perf_counter() - conn["t"])
            if answer.get("status") != "Success" or answer["run_result"]["stdout"] != snippet(conn["i"])[1]:
                bad.append(json.dumps(answer)[:300])
            done += 1
            if state["next"] < first + n:
                send(conn)
    wall = time.perf_counter() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime
    return {"lat": latencies, "cpu": cpu, "wall": wall, "bad": bad}


# ------------------------------------------------------------------ rows


class Row:
    def __init__(self, name: str) -> None:
        self.name = name
        self.rates: list[float] = []
        self.lat: list[float] = []
        self.cpu: dict[str, list[float]] = {"machine": [], "node": [], "sandbox": [], "client": []}


def timed(row: Row, n: int, run, node=None, hops: tuple[int, ...] = ()) -> None:  # type: ignore[no-untyped-def]
    """Run `run()` (-> (wall, latencies, client CPU s)) and add its rate and CPU per snippet to the row;
    `hops`: pids of processes on the way (a gateway) counted with the node."""
    pids = ([node.pid] if node else []) + list(hops)
    machine = machine_cpu_s()
    own = sum(process_cpu_s(pid) for pid in pids)
    boxes = sandboxes_cpu_s(node.cgroup_parent) if node else 0.0
    wall, latencies, client = run()
    row.cpu["machine"].append((machine_cpu_s() - machine) * 1e3 / n)
    if node:
        row.cpu["node"].append((sum(process_cpu_s(pid) for pid in pids) - own) * 1e3 / n)
        row.cpu["sandbox"].append((sandboxes_cpu_s(node.cgroup_parent) - boxes) * 1e3 / n)
    if client is not None:
        row.cpu["client"].append(client * 1e3 / n)
    row.rates.append(n / wall)
    row.lat += latencies


def raw_fork(n: int) -> tuple[float, list[float], None]:
    """The raw limit: one warm python3 per core forking a child per snippet (its CPU counted as 'sandbox')."""
    per = n // CORES
    started = time.perf_counter()
    procs = [
        subprocess.Popen([PYTHON3, "-c", RAW, str(per), str(k * per)], stdout=subprocess.PIPE) for k in range(CORES)
    ]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    wall = time.perf_counter() - started
    raw_cpu.append(sum(o["cpu"] for o in outs))
    return wall * n / (per * CORES), [x for o in outs for x in o["lat"]], None


raw_cpu: list[float] = []


def lean_http(address: str, token: str, n: int, c: int) -> tuple[float, list[float], float]:
    argv = [sys.executable, __file__, "--drive", address, token, str(n), str(c)]
    out = json.loads(subprocess.run(argv, capture_output=True, check=True, text=True).stdout)
    if out["bad"]:
        raise AssertionError(f"{len(out['bad'])} wrong answers, e.g. {out['bad'][0]}")
    return out["wall"], out["lat"], out["cpu"]


def in_process(run: Callable[[], Awaitable[tuple[float, list[float]]]]) -> tuple[float, list[float], float]:
    """A client run in this process: its wall time, per-request times and this process's CPU seconds."""
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    wall, times = asyncio.run(run())
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, times, u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime


def aiohttp_http(address: str, token: str, n: int, c: int) -> tuple[float, list[float], float]:
    import aiohttp

    async def run() -> tuple[float, list[float]]:
        times: list[float] = []
        gate = asyncio.Semaphore(c)
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c), headers=headers) as session:

            async def one(i: int) -> None:
                async with gate:
                    started = time.perf_counter()
                    async with session.post(f"http://{address}/run_code", data=body_of(i)) as response:
                        answer = await response.json()
                    times.append(time.perf_counter() - started)
                assert answer["status"] == "Success" and answer["run_result"]["stdout"] == snippet(i)[1], answer

            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - started, times

    return in_process(run)


def shoal_client(address: str, token: str, n: int, c: int) -> tuple[float, list[float], float]:
    import shoal

    async def run() -> tuple[float, list[float]]:
        times: list[float] = []
        gate = asyncio.Semaphore(c)
        async with shoal.AsyncClient(f"shoal://{address}", token=token) as client:

            async def one(i: int) -> None:
                code, expected = snippet(i)
                async with gate:
                    started = time.perf_counter()
                    result = await client.run_code(code, "python", memory_mb=256)
                    times.append(time.perf_counter() - started)
                assert result.ok and result.stdout == expected, result

            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - started, times

    return in_process(run)


def report(rows: dict[str, Row], n: int, c: int, loads: list[float]) -> None:
    print(f"{n} python snippets per row, {c} at a time, {CORES} cores, load {min(loads):.1f}-{max(loads):.1f}; medians")
    print(f"{'way':<34} {'/s':>6} {'p50 ms':>7} {'p99 ms':>7} | CPU-ms per snippet: {'node':>5} {'sandbox':>7} "
          f"{'client':>6} {'machine':>7} | rate bound: client elsewhere / here")  # fmt: skip
    for row in rows.values():
        cpu = {k: statistics.median(v) if v else None for k, v in row.cpu.items()}
        show = {k: "-" if v is None else f"{v:.2f}" for k, v in cpu.items()}
        inside = (cpu["node"] or 0) + (cpu["sandbox"] or 0)
        here = inside + (cpu["client"] or 0)
        bound = f"{CORES * 1e3 / inside:5.0f} / {CORES * 1e3 / here:5.0f}/s" if inside else ""
        print(f"{row.name:<34} {statistics.median(row.rates):>6.0f} {pct(row.lat, 0.5) * 1e3:>7.2f} "
              f"{pct(row.lat, 0.99) * 1e3:>7.2f} | {'':>19} {show['node']:>5} {show['sandbox']:>7} {show['client']:>6} "
              f"{show['machine']:>7} | {bound}")  # fmt: skip
    print("raw fork: its CPU (the forking interpreters and their children) under 'sandbox'. "
          "Target: POST /run_code >= 500/s")  # fmt: skip


def alternate(trees: list[str], args: argparse.Namespace) -> int:
    """Before/after: this benchmark on each tree's `src` (its node and the worker it ships), one fresh run per
    tree per round, alternated (A, B, A, B, ...) so both meet the same load; medians per tree."""
    argv = [sys.executable, __file__, "--n", str(args.n), "--concurrency", str(args.concurrency), "--json"]
    argv += ["--no-raw"] if args.no_raw else []
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            out = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
            rows = json.loads(out.stdout.strip().splitlines()[-1])
            runs[tree].append(rows)
            way = rows["POST /run_code, lean client"]
            line = (f"round {round_ + 1} {tree}: load {rows['load']:.1f}  {way['rate']:.0f}/s  p50 {way['p50']:.1f} "
                    f"ms  node {way['node']:.2f} sandbox {way['sandbox']:.2f} client {way['client']:.2f}")  # fmt: skip
            print(line, flush=True)
    print(f"medians over {args.rounds} alternated rounds (CPU-ms per snippet)")
    for tree, rounds in runs.items():
        for name in rounds[0]:
            if name == "load":
                continue
            med = {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]}
            boxes = [r[name]["sandbox"] for r in rounds]
            spread = f"({min(boxes):.2f}-{max(boxes):.2f})"
            print(f"{tree:<28} {name:<34} {med['rate']:5.0f}/s p50 {med['p50']:6.1f} ms  node {med['node']:.2f}  "
                  f"sandbox {med['sandbox']:.2f} {spread}  client {med['client']:.2f}")  # fmt: skip
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":
        address, token, n, c = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(drive(address, token, 0, n, c)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--aiohttp", action="store_true", help="also post with aiohttp from this process")
    parser.add_argument("--shoal-client", action="store_true", help="also client.run_code over the node's TCP")
    parser.add_argument("--gateway", action="store_true", help="also the lean driver through a gateway")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw fork row (profiling the node)")
    parser.add_argument("--trees", help="SRC,SRC: alternate runs on these source trees (before/after)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trees:
        return alternate(args.trees.split(","), args)
    from shoal.cluster.local import LocalCluster

    workdir = Path(tempfile.mkdtemp(prefix="shoal-bench-fusion-"))
    lc = LocalCluster(workdir, nodes=1, projects={"bench": {}}, prefix="bf")
    rows: dict[str, Row] = {}
    loads = [os.getloadavg()[0]]
    try:
        gateway = lc.add_gateway() if args.gateway else None
        node = lc.nodes[0]
        token = lc.project_tokens["bench"]
        n, c = args.n, args.concurrency
        lean_http(node.http, token, 4 * c, c)  # the worker pool grows to what this concurrency keeps busy
        for _ in range(args.rounds):
            if not args.no_raw:
                row = rows.setdefault("raw fork + snippet (no isolation)", Row("raw fork + snippet (no isolation)"))
                timed(row, n, lambda: raw_fork(n))
                row.cpu["sandbox"].append(raw_cpu[-1] * 1e3 / n)
            ways = [("POST /run_code, lean client", lambda: lean_http(node.http, token, n, c), ())]
            if args.aiohttp:
                ways.append(("POST /run_code, aiohttp in-process", lambda: aiohttp_http(node.http, token, n, c), ()))
            if args.shoal_client:
                ways.append(("client.run_code (node TCP)", lambda: shoal_client(node.address, token, n, c), ()))
            if gateway is not None:
                via = (gateway.proc.pid,)  # its CPU counted with the node's
                ways.append(("POST /run_code via gateway, lean", lambda: lean_http(gateway.http, token, n, c), via))
            for name, run, hops in ways:
                timed(rows.setdefault(name, Row(name)), n, run, node, hops)
            loads.append(os.getloadavg()[0])
    finally:
        lc.stop()
        if str(workdir) not in Path("/proc/mounts").read_text():  # nothing left mounted: the run's files go
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        out: dict = {"load": max(loads)}
        for name, row in rows.items():
            out[name] = {k: statistics.median(v) if v else 0.0 for k, v in row.cpu.items()}
            out[name].update(rate=statistics.median(row.rates), p50=pct(row.lat, 0.5) * 1e3)
        print(json.dumps(out))
        return 0
    report(rows, args.n, args.concurrency, loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
