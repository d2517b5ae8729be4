"""The node's hot path (issue 12): CPU per operation and latency beside the raw tools, in one run.

    python bench/bench_hotpath.py [--n 100] [--live 500,1000,3000] [--only exec,claim] [--profile DIR]
                                  [--runtimes crun,shoal] [--live-runtime shoal]

Prints, for the container kind on image busybox:
  - node CPU-ms per create+close and per exec `true` (utime+stime of the node's own process, all its threads,
    from /proc/<pid>/stat; the runtimes it spawns are not in it) and whole-machine CPU-ms per op (/proc/stat:
    on a shared machine this includes other work, so read it as an upper bound);
  - cold create p50/p99 beside raw `crun run -d` of a prepared bundle and a whole bwrap cycle, per runtime
    (--runtimes: crun and shoal's own launcher, runtime="shoal", by default);
  - create+exec+close at 16 concurrent; warm-pool claim p50/p99; exec `true` p50/p99; exec throughput over
    16 sandboxes; the trajectory log's added latency per exec (record=True vs record=False);
  - the create rate with 0 and with each --live N sandboxes alive, the time to create them and the node's
    mount table size at each (3,000 is the issue's figure: slow, optional);
  - shoal CPU-ms per op: the node, the runtimes it spawns and the sandboxes' cgroups (not other work on the
    machine), beside the raw tools' own CPU measured the same way.
Each row sits beside the issue's target with met / not met, and beside the raw limit measured in the same run
(indented rows): an exec straight to the sandbox's agent socket from this process (the agent's fork and exec
and one Unix socket, no node, client or log; on a kept connection as the node's, and on a new connection
per exec, which adds an accept and a handler fork), 16 of those loops at once, an fdatasync on the node's disk (what
a durable step costs at least), a node round trip that does nothing (`get`), raw `crun exec`.
`--profile DIR` also records py-spy flame stacks of the node (create+close and exec loops) into DIR (needs
py-spy, in the [dev] extra, and root).
CPU-ms is the trustworthy figure on a loaded machine; latencies move with the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode, launcher_cpu_seconds, pct  # noqa: E402

import shoal  # noqa: E402
from shoal import cgroups  # noqa: E402
from shoal.guest import AgentClient  # noqa: E402

IMAGE = "busybox"
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
TTL = 600.0
rows: list[tuple[str, str, str, bool | None]] = []


def node_user_sys_ms(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_MS, int(fields[12]) * TICK_MS  # utime, stime (fields 14, 15)


def shoal_cpu_ms(pid: int) -> float:
    """CPU of everything shoal runs for its sandboxes, not of the other work on a shared machine: the node,
    the children it reaped (the runtimes it spawns: `crun run`, ...) and the sandboxes' cgroups (agents, and
    the runtime's container init once it joined its cgroup). Kernel threads' work (RCU, cgroup teardown) is
    not in it: the machine figure bounds that from above."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = sum(int(v) for v in fields[11:15]) * TICK_MS  # utime, stime, cutime, cstime
    own += launcher_cpu_seconds(pid) * 1e3  # runtime="shoal": its launcher runs on, unreaped
    return own + (cgroups.cpu_seconds(os.environ["SHOAL_CGROUP_PARENT"]) or 0.0) * 1e3


def machine_cpu_ms() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) * TICK_MS  # all but idle and iowait


class Meter:
    """CPU-ms per op of the node process and of the whole machine over a block of `ops` operations."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> Meter:
        self.user0, self.sys0 = node_user_sys_ms(self.pid)
        self.shoal0 = shoal_cpu_ms(self.pid)
        self.machine0, self.wall0 = machine_cpu_ms(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        user, sys_ = node_user_sys_ms(self.pid)
        self.user, self.sys = user - self.user0, sys_ - self.sys0
        self.node = self.user + self.sys
        self.shoal = shoal_cpu_ms(self.pid) - self.shoal0
        self.machine = machine_cpu_ms() - self.machine0
        self.wall = time.perf_counter() - self.wall0

    def per(self, ops: int) -> tuple[float, float]:
        return self.node / ops, self.machine / ops


def row(name: str, value: str, target: str = "", met: bool | None = None) -> None:
    rows.append((name, value, target, met))
    mark = "" if met is None else ("met" if met else "NOT MET")
    print(f"  {name:<46} {value:<44} {target:<22} {mark}", flush=True)


def lat(seconds: list[float]) -> str:
    return f"p50 {statistics.median(seconds) * 1e3:.2f} ms, p99 {pct(seconds, 0.99) * 1e3:.2f} ms"


def raw(mode: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_raw.py")), mode, str(n)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def raw_row(name: str, mode: str, n: int) -> None:
    """A raw tool's row; a failure of the raw loop (a busy machine) is printed, not fatal to the run."""
    try:
        row(name, lat(raw(mode, n)["seconds"]))
    except subprocess.CalledProcessError as exc:
        row(name, f"failed: {(exc.stderr or '').strip().splitlines()[-1:]}")


def agent_of(sb: shoal.AsyncSandbox, keep: bool = True) -> AgentClient:
    """The sandbox's agent socket, reached from this process as the node reaches it: with `keep`, an exec's
    connection is kept for the next (as the node does); without, every exec dials its own (the agent forks
    a handler per exec, as it did before kept connections)."""
    record = json.loads((Path(os.environ["SHOAL_HOME"]) / "sandboxes" / sb.id / "record.json").read_text())
    agent = AgentClient(record["node"]["agent_socket"])  # where the node dials it (the bundle's, on tmpfs)
    if not keep:
        agent.KEEP = 0
    return agent


async def raw_agent_exec(agent: AgentClient) -> float:
    """One exec of `true` straight to the agent: (connect,) request, pid, exit frame."""
    t = time.perf_counter()
    run = await agent.exec_run(["true"], env={"PATH": "/bin:/usr/bin"})
    try:
        while run.exit is None and run.error is None:
            await run.wait(None)
    finally:
        run.close()
    return time.perf_counter() - t


def raw_fsync(directory: Path, n: int, gap: float = 0.0) -> tuple[list[float], float]:
    """fdatasync after a 4 KiB overwrite, in the node's home (the log's disk), `gap` seconds apart: seconds each,
    CPU-ms each. Apart as an exec loop's steps come, more of them meet a new clock tick, and on ext4 without a
    journal such an fdatasync also writes the file's inode block (bench/bench_logpath.py)."""
    path = directory / "bench-fsync.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"\0" * (1 << 20))
        os.fsync(fd)
        seconds, cpu0 = [], time.process_time()
        for i in range(n):
            if gap:
                time.sleep(gap)
            t = time.perf_counter()
            os.pwrite(fd, b"x" * 4096, (i % 256) * 4096)
            os.fdatasync(fd)
            seconds.append(time.perf_counter() - t)
        return seconds, (time.process_time() - cpu0) * 1e3 / n
    finally:
        os.close(fd)
        path.unlink()


class Profiler:
    """py-spy recording the node while a block runs (collapsed stacks per block, for a flame graph)."""

    def __init__(self, directory: str | None, pid: int) -> None:
        self.directory, self.pid, self.proc = directory, pid, None

    def start(self, name: str) -> None:
        if not self.directory:
            return
        binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        out = Path(self.directory) / f"{name}.txt"  # collapsed stacks: flamegraph.pl or speedscope draw them
        self.proc = subprocess.Popen(
            [binary, "record", "-p", str(self.pid), "-o", str(out), "-r", "200", "-f", "raw", "--threads"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)
            self.proc = None


async def create_close(client: shoal.AsyncClient, n: int, pid: int, prof: Profiler, runtime: str) -> list[float]:
    """Rows of sequential create+close on `runtime` (crun's rows keep their names; others are tagged)."""
    tag = "" if runtime == "crun" else f" [{runtime}]"
    creates, cycles = [], []
    prof.start(f"create_close_{runtime}")
    with Meter(pid) as meter:
        for _ in range(n):
            t = time.perf_counter()
            sb = await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)
            creates.append(time.perf_counter() - t)
            await sb.close()
            cycles.append(time.perf_counter() - t)
    prof.stop()
    node, machine = meter.per(n)
    # the same with one sandbox of the image alive, as on a node in use: its layer stays mounted, while above
    # every create mounts it (erofs) and every close unmounts it
    holder = await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)
    try:
        with Meter(pid) as held:
            for _ in range(n):
                sb = await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)
                await sb.close()
    finally:
        await holder.close()
    node_held, machine_held = held.per(n)
    split = f"user {held.user / n:.1f} + sys {held.sys / n:.1f}"
    row(f"node CPU per create+close{tag}", f"{node_held:.2f} ms ({split}; {node:.2f} alone)", "<= 3 ms",
        node_held <= 3)  # fmt: skip
    row(f"shoal CPU per create+close{tag}", f"{held.shoal / n:.2f} ms ({meter.shoal / n:.2f} alone)")
    row(f"machine CPU per create+close{tag}", f"{machine_held:.2f} ms ({machine:.2f} ms alone)")
    row(f"create+close, sequential{tag}", f"{lat(cycles)}, {n / meter.wall:.0f}/s")
    return creates


async def create_rows(client: shoal.AsyncClient, n: int, pid: int, prof: Profiler, runtimes: list[str]) -> None:
    """create+close on each runtime, then cold create beside raw `crun run -d` and a bwrap cycle."""
    creates = {runtime: await create_close(client, n, pid, prof, runtime) for runtime in runtimes}
    rc, rb = raw("crun-create", n), raw("bwrap", n)
    bwrap_p50 = statistics.median(rb["seconds"])
    for runtime, seconds in creates.items():
        tag = "" if runtime == "crun" else f" [{runtime}]"
        row(f"cold create -> ready{tag}", lat(seconds), "<= bwrap cycle p50", statistics.median(seconds) <= bwrap_p50)
    row("  raw crun run -d (prepared bundle)", f"{lat(rc['seconds'])}, {rc['cpu_ms']:.1f} CPU-ms")
    row("  raw crun cycle: overlay, run -d, delete", f"{rc['cycle_cpu_ms']:.1f} CPU-ms")
    row("  raw bwrap cycle (`true`, ro layer)", f"{lat(rb['seconds'])}, {rb['cpu_ms']:.1f} CPU-ms")


async def concurrent_cycles(client: shoal.AsyncClient, n: int, pid: int, runtime: str) -> None:
    gate = asyncio.Semaphore(16)

    async def one() -> None:
        async with gate:
            sb = await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)
            await sb.exec(["true"])
            await sb.close()

    with Meter(pid) as meter:
        await asyncio.gather(*(one() for _ in range(n)))
    rate = n / meter.wall
    node, machine = meter.per(n)
    tag = "" if runtime == "crun" else f" [{runtime}]"
    row(f"create+exec+close, 16 concurrent{tag}", f"{rate:.0f}/s (node {node:.2f}, shoal {meter.shoal / n:.1f}, "
        f"machine {machine:.1f} CPU-ms/op)", ">= 150/s", rate >= 150)  # fmt: skip


async def claims(client: shoal.AsyncClient, n: int) -> None:
    await client.set_pool("container", IMAGE, n, wait=True, ttl_s=TTL)
    seconds, claimed = [], []
    for _ in range(n):
        t = time.perf_counter()
        claimed.append(await client.create(image=IMAGE, env={"LATE": "1"}, labels={"bench": "claim"}, ttl_s=TTL))
        seconds.append(time.perf_counter() - t)
    await client.set_pool("container", IMAGE, 0)
    trips = []
    for sb in claimed:
        t = time.perf_counter()
        await client.get(sb.id)
        trips.append(time.perf_counter() - t)
    await client.close_all(labels={"bench": "claim"})
    p50, p99 = statistics.median(seconds) * 1e3, pct(seconds, 0.99) * 1e3
    row("warm-pool claim", lat(seconds), "<= 1 / 5 ms", p50 <= 1 and p99 <= 5)
    row("  node round trip that does nothing (get)", lat(trips))


async def exec_loop(sb: shoal.AsyncSandbox, n: int) -> list[float]:
    seconds = []
    for _ in range(n):
        t = time.perf_counter()
        await sb.exec(["true"])
        seconds.append(time.perf_counter() - t)
    return seconds


async def execs(client: shoal.AsyncClient, n: int, pid: int, prof: Profiler) -> None:
    logged = await client.create(image=IMAGE, pool=False, ttl_s=TTL)
    unlogged = await client.create(image=IMAGE, pool=False, ttl_s=TTL, record=False)
    try:
        await exec_loop(logged, 20)
        prof.start("exec")
        with Meter(pid) as meter:
            seconds = await exec_loop(logged, n)
        prof.stop()
        with Meter(pid) as bare_meter:
            bare = await exec_loop(unlogged, n)
        # alternate a second time so a load change between the two blocks does not decide the difference
        with Meter(pid) as meter2:
            seconds += await exec_loop(logged, n)
        with Meter(pid) as bare_meter2:
            bare += await exec_loop(unlogged, n)
        agent, dialled = agent_of(unlogged), agent_of(unlogged, keep=False)
        direct, dialling = [], []
        for _ in range(n):  # alternated
            direct.append(await raw_agent_exec(agent))
            dialling.append(await raw_agent_exec(dialled))
        agent.close()
    finally:
        await logged.close()
        await unlogged.close()
    node = (meter.node + meter2.node) / (2 * n)
    machine = (meter.machine + meter2.machine) / (2 * n)
    bare_node = (bare_meter.node + bare_meter2.node) / (2 * n)
    p50 = statistics.median(seconds) * 1e3
    row("node CPU per exec `true` (logged)", f"{node:.2f} ms (unlogged {bare_node:.2f} ms)", "<= 0.3 ms", node <= 0.3)
    row("machine CPU per exec (all processes)", f"{machine:.2f} ms")
    row("exec `true`, one at a time (logged)", lat(seconds), "p50 <= 1.5 ms", p50 <= 1.5)
    row("  same, record=False", lat(bare))
    added = p50 - statistics.median(bare) * 1e3
    row("trajectory log added per exec (p50)", f"{added:.2f} ms, {node - bare_node:.2f} node CPU-ms", "<= 0.3 ms",
        added <= 0.3)  # fmt: skip
    row("  raw: exec to the agent, kept connection", lat(direct))
    row("  raw: same, a new connection per exec", lat(dialling))
    home = Path(os.environ["SHOAL_HOME"])
    fsyncs, fsync_cpu = raw_fsync(home, max(50, n // 2))
    row("  raw: fdatasync on the log's disk", f"{lat(fsyncs)}, {fsync_cpu:.2f} CPU-ms")
    spaced, spaced_cpu = raw_fsync(home, max(50, n // 2), gap=statistics.median(seconds))
    row("  raw: same, one per logged exec's time", f"{lat(spaced)}, {spaced_cpu:.2f} CPU-ms")
    raw_row("  raw crun exec true", "crun-exec", max(20, n // 10))


async def exec_throughput(client: shoal.AsyncClient, per: int, pid: int) -> None:
    made = await client.create_many(16, image=IMAGE, pool=False, ttl_s=TTL, concurrency=8)
    sandboxes = [s for s in made if isinstance(s, shoal.AsyncSandbox)]

    async def direct_loop(agent: AgentClient) -> None:
        for _ in range(per):
            await raw_agent_exec(agent)
        agent.close()

    try:
        await asyncio.gather(*(exec_loop(s, 5) for s in sandboxes))
        with Meter(pid) as meter:
            await asyncio.gather(*(exec_loop(s, per) for s in sandboxes))
        with Meter(pid) as raw_meter:
            await asyncio.gather(*(direct_loop(agent_of(s)) for s in sandboxes))
        with Meter(pid) as dial_meter:
            await asyncio.gather(*(direct_loop(agent_of(s, keep=False)) for s in sandboxes))
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))
    total = per * len(sandboxes)
    rate = total / meter.wall
    node, machine = meter.per(total)
    row("exec throughput, 16 sandboxes", f"{rate:.0f}/s (node {node:.2f}, machine {machine:.2f} CPU-ms/op)",
        ">= 2000/s", rate >= 2000)  # fmt: skip
    raw_rate = total / raw_meter.wall
    row("  raw: 16 loops to the agents, kept conns",
        f"{raw_rate:.0f}/s (machine {raw_meter.per(total)[1]:.2f} CPU-ms/op)")  # fmt: skip
    row("  raw: same, a new connection per exec",
        f"{total / dial_meter.wall:.0f}/s (machine {dial_meter.per(total)[1]:.2f} CPU-ms/op)")  # fmt: skip


async def create_rate(client: shoal.AsyncClient, k: int, pid: int, runtime: str) -> tuple[float, float, float]:
    with Meter(pid) as meter:
        for _ in range(k):
            sb = await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)
            await sb.close()
    return k / meter.wall, meter.node / k, meter.shoal / k


def mount_count(pid: int) -> int:
    with open(f"/proc/{pid}/mountinfo") as handle:
        return sum(1 for _ in handle)


async def flat_rate(client: shoal.AsyncClient, lives: list[int], k: int, pid: int, runtime: str) -> None:
    """The create+close rate with N sandboxes alive, for each N (filled 8 at a time, kept until the end), all
    on `runtime`."""
    tag = "" if runtime == "crun" else f" [{runtime}]"
    made: list = []
    fill_s = 0.0
    base = None
    try:
        for live in lives:
            t = time.perf_counter()
            more = await client.create_many(live - len(made), image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime,
                                            labels={"bench": "live"}, concurrency=8)  # fmt: skip
            fill_s += time.perf_counter() - t
            made += more
            ok = sum(isinstance(s, shoal.AsyncSandbox) for s in made)
            with Meter(pid) as idle:  # what the node spends with nothing asked of it (the reaper's scans)
                await asyncio.sleep(2.0)
            rate, node_ms, shoal_ms = await create_rate(client, k, pid, runtime)
            base = base or rate
            mounts = f"node's mount table {mount_count(pid)}, host's {mount_count(os.getpid())}"
            mounts += f"; node idle {idle.node / idle.wall:.1f} CPU-ms/s"
            row(f"create+close rate, {ok} live{tag}", f"{rate:.1f}/s ({rate / base:.2f}x of 0 live)",
                ">= 0.8x" if ok else "", rate / base >= 0.8 if ok else None)  # fmt: skip
            row("  node / shoal CPU per create+close", f"{node_ms:.2f} / {shoal_ms:.1f} ms; {mounts}")
            if live:
                target = live >= 3000
                row(f"  {ok} created (8 concurrent), cumulative", f"{fill_s:.1f} s ({ok / fill_s:.0f}/s)",
                    "3000 in <= 30 s" if target else "", fill_s <= 30 if target else None)  # fmt: skip
    finally:
        await client.close_all(labels={"bench": "live"})


async def main(args: argparse.Namespace) -> None:
    node = BenchNode(args.name)
    n = args.n
    lives = sorted({0, *(int(v) for v in str(args.live).split(","))})
    try:
        async with shoal.AsyncClient() as client:
            sb = await client.create(image=IMAGE, pool=False, ttl_s=TTL)  # warm: node, image, agent binary
            await sb.exec(["true"])
            await sb.close()
            pid = (await client.status())["pid"]
            runtimes = args.runtimes.split(",")
            for runtime in runtimes[1:]:  # warm: the launcher of runtime="shoal" starts on first use
                await (await client.create(image=IMAGE, pool=False, ttl_s=TTL, runtime=runtime)).close()
            prof = Profiler(args.profile, pid)
            load = os.getloadavg()[0]
            print(f"shoal hot path — image {IMAGE}, n={n}, node pid {pid}, load average {load:.1f}\n")
            print(f"  {'measure':<46} {'this run':<44} {'target':<22}")
            sections = {
                "create": lambda: create_rows(client, n, pid, prof, runtimes),
                "concurrent": lambda: _each(concurrent_cycles(client, 2 * n, pid, r) for r in runtimes),
                "claim": lambda: claims(client, min(n, 50)),
                "exec": lambda: execs(client, 5 * n, pid, prof),
                "throughput": lambda: exec_throughput(client, max(20, n // 2), pid),
                "live": lambda: flat_rate(client, lives, max(20, n // 2), pid, args.live_runtime or runtimes[-1]),
            }
            for name in args.only.split(",") if args.only else sections:
                await sections[name]()
            print(f"\n  load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        node.stop()


async def _each(coros) -> None:  # noqa: ANN001
    for coro in coros:
        await coro


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100, help="iterations per row")
    parser.add_argument("--live", default="200", help="sandboxes alive for the flat-rate rows: N or N1,N2,...")
    parser.add_argument("--only", help="comma-separated sections: create,concurrent,claim,exec,throughput,live")
    parser.add_argument("--profile", metavar="DIR", help="record py-spy flame graphs of the node into DIR")
    parser.add_argument("--runtimes", default="crun,shoal",
                        help="container runtimes of the create and concurrent rows, side by side (crun's rows "
                        "keep their names; the others are tagged [runtime])")  # fmt: skip
    parser.add_argument("--live-runtime", help="runtime of the live rows (default: the last of --runtimes)")
    parser.add_argument("--name", default="hotpath", help="the bench node's home: /tmp/shoal-bench-NAME")
    asyncio.run(main(parser.parse_args()))
