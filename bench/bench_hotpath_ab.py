"""Before/after on a shared, noisy machine: two nodes (one per source tree), the same exec and claim loops
alternated round by round, so both meet the same load.

    python bench/bench_hotpath_ab.py BEFORE_SRC [AFTER_SRC] [--rounds 4] [--n 100] [--only exec,bare,claim,tput]
                                     [--image busybox]   (e.g. --image desktop --only claim --n 10: issue 15's row)

BEFORE_SRC / AFTER_SRC are `src` directories of two checkouts (e.g. `git worktree add /tmp/before <commit>`,
then /tmp/before/src; AFTER_SRC defaults to this tree's). Prints per variant: logged exec `true` (`exec`),
the same with record=False (`bare`), warm-pool claims (`claim`) and exec throughput over 16 sandboxes
(`tput`): p50/p99 latency, node CPU-ms per op (utime+stime of each node process from /proc, all threads) and
the per-round CPU figures, whose spread shows how far the load moved them.

`create` (sequential create -> close; latency of the create; with neither `exec` nor `bare`, no other
sandbox of the image is alive: a cold create) and `conc` (create + exec `true` + close,
16 at a time) run on --runtime (R, or BEFORE:AFTER: `src src --runtime crun:shoal` compares two runtimes
on one tree; `default` names none, so each node picks: `--runtime default` against a tree from before
SHOAL_RUNTIME shows what a user who names no runtime gains) and also print shoal's CPU per op: the node
with the children it reaped (the runtimes; or its running shoal-launcher) and its sandboxes' cgroups, as
bench_hotpath's "shoal CPU" counts it, and the machine's (all processes, noisy); with `create`, raw
`crun run -d` of a prepared bundle and a bwrap cycle run in the same rounds.
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
from _common import IMAGES, cpu_seconds, launcher_cpu_seconds, pct  # noqa: E402

import shoal  # noqa: E402
from shoal import cgroups  # noqa: E402

IMAGE = "busybox"
TTL = 600.0
RUN = f"shoal-bench-ab-{os.getpid()}"  # homes and cgroup parents of this run's nodes: two runs at once do not mix


def start_node(name: str, src: str) -> str:
    """A node running the sources in `src`, with its own home and cgroup parent; its home."""
    home = f"/tmp/{RUN}-{name}"
    env = dict(os.environ, PYTHONPATH=src, SHOAL_HOME=home, SHOAL_IMAGES=IMAGES,
               SHOAL_CGROUP_PARENT=f"{RUN}-{name}")  # fmt: skip
    code = "import shoal; c = shoal.Client(); c.status(); c.close()"  # the client starts the node
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return home


def stop_node(home: str) -> None:
    try:
        pid = int(Path(home, "node.lock").read_text())
        os.kill(pid, 15)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def shoal_cpu_s(v: Variant) -> float:
    """The node, the runtimes it reaped (or its running shoal-launcher) and its sandboxes' cgroups (what a
    create costs shoal, all in)."""
    fields = Path(f"/proc/{v.pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = sum(int(x) for x in fields[11:15]) * TICK_S + launcher_cpu_seconds(v.pid)
    return own + (cgroups.cpu_seconds(f"{RUN}-{v.name}") or 0.0)


def machine_cpu_s() -> float:
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) * TICK_S


class Variant:
    def __init__(self, name: str, client: shoal.AsyncClient, pid: int, runtime: str | None = "crun") -> None:
        self.name, self.client, self.pid = name, client, pid
        self.runtime = None if runtime == "default" else runtime  # default: name none, the node's choice
        self.seconds: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.rates: list[float] = []
        self.conc_rates: list[float] = []
        self.extra: dict[str, list[tuple[float, float]]] = {}  # what -> per round (shoal, machine) CPU-ms/op
        self.logged: shoal.AsyncSandbox | None = None
        self.unlogged: shoal.AsyncSandbox | None = None

    def add(self, what: str, seconds: list[float], cpu_ms: float) -> None:
        self.seconds.setdefault(what, []).extend(seconds)
        self.cpu.setdefault(what, []).append(cpu_ms)


async def exec_round(v: Variant, sb: shoal.AsyncSandbox, what: str, n: int) -> None:
    seconds, cpu0 = [], cpu_seconds(v.pid)
    for _ in range(n):
        t = time.perf_counter()
        await sb.exec(["true"])
        seconds.append(time.perf_counter() - t)
    v.add(what, seconds, (cpu_seconds(v.pid) - cpu0) * 1e3 / n)


async def claim_round(v: Variant, n: int) -> None:
    await v.client.set_pool("container", IMAGE, n, wait=True, ttl_s=TTL)
    await asyncio.sleep(0.5)  # the pool's last member settles
    seconds, cpu0 = [], cpu_seconds(v.pid)
    for _ in range(n):
        t = time.perf_counter()
        await v.client.create(image=IMAGE, env={"LATE": "1"}, labels={"ab": "claim"}, ttl_s=TTL)
        seconds.append(time.perf_counter() - t)
    v.add("claim", seconds, (cpu_seconds(v.pid) - cpu0) * 1e3 / n)  # a refill past half the pool included
    await v.client.set_pool("container", IMAGE, 0)
    await v.client.close_all(labels={"ab": "claim"})


async def create_round(v: Variant, n: int) -> None:
    seconds, cpu0, shoal0, machine0 = [], cpu_seconds(v.pid), shoal_cpu_s(v), machine_cpu_s()
    for _ in range(n):
        t = time.perf_counter()
        sb = await v.client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=v.runtime)
        seconds.append(time.perf_counter() - t)
        await sb.close()
    v.add("create", seconds, (cpu_seconds(v.pid) - cpu0) * 1e3 / n)
    v.extra.setdefault("create", []).append(
        ((shoal_cpu_s(v) - shoal0) * 1e3 / n, (machine_cpu_s() - machine0) * 1e3 / n)
    )


async def concurrent_round(v: Variant, n: int) -> None:
    gate = asyncio.Semaphore(16)

    async def one() -> None:
        async with gate:
            sb = await v.client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=v.runtime)
            await sb.exec(["true"])
            await sb.close()

    cpu0, shoal0, machine0, t = cpu_seconds(v.pid), shoal_cpu_s(v), machine_cpu_s(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t
    v.add("conc", [], (cpu_seconds(v.pid) - cpu0) * 1e3 / n)
    v.extra.setdefault("conc", []).append(((shoal_cpu_s(v) - shoal0) * 1e3 / n, (machine_cpu_s() - machine0) * 1e3 / n))
    v.conc_rates.append(n / wall)


def raw_round(raws: dict[str, list], n: int) -> None:
    """bench/_raw.py's `crun run -d` of prepared bundles and bwrap cycles, in the same rounds."""
    for mode in ("crun-create", "bwrap"):
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("_raw.py")), mode, str(n)],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode == 0:
            raws.setdefault(mode, []).append(json.loads(out.stdout))


async def throughput_round(v: Variant, per: int) -> None:
    made = await v.client.create_many(16, image=IMAGE, pool=False, ttl_s=TTL, labels={"ab": "tput"}, concurrency=8)
    sandboxes = [s for s in made if isinstance(s, shoal.AsyncSandbox)]

    async def loop(sb: shoal.AsyncSandbox) -> None:
        for _ in range(per):
            await sb.exec(["true"])

    try:
        cpu0, t = cpu_seconds(v.pid), time.perf_counter()
        await asyncio.gather(*(loop(s) for s in sandboxes))
        wall, total = time.perf_counter() - t, per * len(sandboxes)
        v.rates.append(total / wall)
        v.add("tput", [], (cpu_seconds(v.pid) - cpu0) * 1e3 / total)
    finally:
        await v.client.close_all(labels={"ab": "tput"})


async def main(args: argparse.Namespace) -> None:
    trees = {"before": args.before, "after": args.after}
    runtimes = dict(zip(trees, (args.runtime.split(":") * 2)[:2], strict=True))
    homes: dict[str, str] = {}
    variants: list[Variant] = []
    raws: dict[str, list] = {}
    try:
        for name, src in trees.items():
            homes[name] = start_node(name, src)
            client = shoal.AsyncClient(home=homes[name], autostart=False)
            await client.__aenter__()
            variants.append(Variant(name, client, (await client.status())["pid"], runtimes[name]))
        only = args.only.split(",")
        # only the exec rows keep sandboxes alive: without them `create` is a cold create (no other sandbox of
        # the image alive, so its layers are mounted by the create unless the node kept them: the linger)
        for v in variants if {"exec", "bare"} & set(only) else []:
            v.logged = await v.client.create(image=IMAGE, pool=False, ttl_s=TTL)
            v.unlogged = await v.client.create(image=IMAGE, pool=False, ttl_s=TTL, record=False)
            for sb in (v.logged, v.unlogged):
                for _ in range(10):
                    await sb.exec(["true"])
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:  # alternate who goes first
                if "exec" in only:
                    await exec_round(v, v.logged, "exec", args.n)  # type: ignore[arg-type]
                if "bare" in only:
                    await exec_round(v, v.unlogged, "bare", args.n)  # type: ignore[arg-type]
                if "claim" in only:
                    await claim_round(v, min(args.n, 30))
                if "tput" in only:
                    await throughput_round(v, max(5, args.n // 4))
                if "create" in only:
                    await create_round(v, args.n)
                if "conc" in only:
                    await concurrent_round(v, args.n)
            if "create" in only:
                raw_round(raws, args.n)
    finally:
        for v in variants:
            for sb in (v.logged, v.unlogged):
                if sb is not None:
                    await sb.close()
            await v.client.__aexit__(None, None, None)
        for home in homes.values():
            stop_node(home)
            subprocess.run(["rm", "-rf", "--one-file-system", home], check=False)  # the node closed its sandboxes
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds of n={args.n}, alternated; runtime of "
          f"create/conc: before {runtimes['before']}, after {runtimes['after']}")  # fmt: skip
    for what in args.only.split(","):
        for v in variants:
            cpu = v.cpu.get(what, [])
            rounds = ", ".join(f"{c:.2f}" for c in cpu)
            if what == "conc":
                rate = statistics.median(v.conc_rates)
                shoal_ms = statistics.median(x[0] for x in v.extra["conc"])
                machine_ms = statistics.median(x[1] for x in v.extra["conc"])
                print(f"  {what:<5} {v.name:<6} {rate:7.0f}/s       node {statistics.median(cpu):.2f}, shoal "
                      f"{shoal_ms:.2f}, machine {machine_ms:.1f} CPU-ms/op ({rounds})")  # fmt: skip
                continue
            if what == "tput":
                rate, node = statistics.median(v.rates), statistics.median(cpu)
                print(f"  {what:<5} {v.name:<6} {rate:7.0f}/s       node {node:.2f} CPU-ms/op ({rounds})")
                continue
            s = v.seconds[what]
            p50, p99 = statistics.median(s) * 1e3, pct(s, 0.99) * 1e3
            extra = ""
            if what in v.extra:
                extra = (f", shoal {statistics.median(x[0] for x in v.extra[what]):.2f}, machine "
                         f"{statistics.median(x[1] for x in v.extra[what]):.1f}")  # fmt: skip
            print(f"  {what:<5} {v.name:<6} p50 {p50:6.2f} ms p99 {p99:7.2f} ms  node {statistics.median(cpu):.2f}"
                  f"{extra} CPU-ms/op ({rounds})")  # fmt: skip
        if what == "create":
            for mode, label in (("crun-create", "raw crun run -d"), ("bwrap", "raw bwrap cycle")):
                runs = raws.get(mode, [])
                s = [x for r in runs for x in r["seconds"]]
                if s:
                    cpu_ms = statistics.median(r["cpu_ms"] for r in runs)
                    print(f"  {label:<18} p50 {statistics.median(s) * 1e3:6.2f} ms p99 {pct(s, 0.99) * 1e3:7.2f} ms  "
                          f"{cpu_ms:.2f} CPU-ms/op")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("before", help="src directory of the 'before' tree")
    parser.add_argument("after", nargs="?", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--n", type=int, default=100, help="execs per round (claims: at most 30)")
    parser.add_argument("--only", default="exec,bare,claim,tput", help="also: create, conc")
    parser.add_argument("--image", default=IMAGE)
    parser.add_argument("--runtime", default="crun", help="runtime of the create/conc rounds: R, or BEFORE:AFTER "
                        "(e.g. `src src --runtime crun:shoal` compares the runtimes on one tree); `default` "
                        "names none: each node's own (SHOAL_RUNTIME)")  # fmt: skip
    arguments = parser.parse_args()
    IMAGE = arguments.image
    asyncio.run(main(arguments))
