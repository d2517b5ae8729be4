"""The shoal launcher alone (no node, no client): a create's critical path inside the spare, alternated over two
source trees so both meet the same load.

    python bench/bench_launcher_ab.py BEFORE_SRC [AFTER_SRC] [--rounds 4] [--n 40] [--gap 0.05]

Each round runs, per tree, `--n` sequential creates and destroys of a container sandbox (runtime="shoal", an empty
image layer) through ContainerSubstrate in a process of its own, waiting `--gap` seconds before each so the launcher
has its spare ready (the spare is made while nothing is in flight), and prints: the create's latency (to the
launcher's answer, the agent exec'd) and, from /proc/<pid>/schedstat, the CPU the spare used from the moment the
create's request was sent to the agent's answer to a hello (its setup after the request: mount namespace, overlay,
pivot_root, mounts, seccomp, exec, the agent's start). That CPU is the load-independent figure: on a shared
machine the latency moves with other work, the spare's own CPU much less. Also counted: creates the spare served.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE = r"""
import asyncio, os, shutil, socket, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])  # bench/, for _common
from _common import launcher_pids
from shoal import cgroups
from shoal.images import Image
from shoal.images.store import ImageConfig
from shoal.protocol import SandboxSpec
from shoal.substrates.container.substrate import ContainerSubstrate

def run_ns(pid):
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])

async def main(n, gap):
    tmp = Path(tempfile.mkdtemp(prefix="bench-launcher-"))
    (tmp / "layer").mkdir()
    (tmp / "home" / "sandboxes").mkdir(parents=True)
    parent = f"shoal-bench-launcher-{os.getpid()}"
    substrate = ContainerSubstrate(tmp / "home" / "sandboxes", tmp / "home" / "runtime", cgroup_parent=parent)
    image = Image(name="empty", layers=(tmp / "layer",), config=ImageConfig())
    spec = SandboxSpec(image="empty", runtime="shoal", memory_mb=512, pids=1024, ttl_s=60)
    seconds, spare_us = [], []
    try:
        for i in range(n + 3):  # 3 to warm up: the launcher starts on the first
            await asyncio.sleep(gap)
            launchers = launcher_pids(os.getpid())
            spares = launcher_pids(launchers[0]) if launchers else []
            before = run_ns(spares[0]) if len(spares) == 1 else None
            t = time.perf_counter()
            instance = await substrate.create(f"b{i}", spec, image)
            took = time.perf_counter() - t
            with socket.socket(socket.AF_UNIX) as agent:  # the agent's answer to a hello: it is up
                agent.connect(str(instance.agent_socket))
                agent.sendall(b"\0\0\0\1H")
                agent.recv(64)
            if i >= 3:
                seconds.append(took)
                if before is not None and instance.pid == spares[0]:
                    spare_us.append((run_ns(instance.pid) - before) / 1e3)
            await substrate.destroy(instance)
    finally:
        await substrate.close()
        for directory in cgroups.sandbox_dirs(f"/{parent}"):
            directory.rmdir()
        shutil.rmtree(tmp, ignore_errors=True)
    print(statistics.median(seconds) * 1e3, statistics.median(spare_us or [0]), len(spare_us))

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


def one(src: str, n: int, gap: float) -> tuple[float, float, int]:
    env = dict(os.environ, PYTHONPATH=src)
    argv = [sys.executable, "-c", ONE, str(n), str(gap), str(Path(__file__).resolve().parent)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{src}: {out.stderr.strip()[-2000:]}")
    latency, spare, served = out.stdout.split()
    return float(latency), float(spare), int(served)


def main(args: argparse.Namespace) -> None:
    trees = {"before": args.before, "after": args.after or str(Path(__file__).resolve().parents[1] / "src")}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in trees}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, src in trees.items():
            results[name].append(one(src, args.n, args.gap))
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; {args.rounds} rounds of n={args.n}, alternated")
    for name, rounds in results.items():
        latency = statistics.median(r[0] for r in rounds)
        spare = statistics.median(r[1] for r in rounds)
        each = ", ".join(f"{r[1]:.0f}" for r in rounds)
        served = sum(r[2] for r in rounds)
        print(f"  {name:<6} create p50 {latency:6.2f} ms; spare CPU request -> agent up p50 {spare:5.0f} us "
              f"(rounds: {each}); the spare served {served}/{args.rounds * args.n}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after", nargs="?")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.05)
    main(parser.parse_args())
