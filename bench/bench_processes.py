"""Processes an exec leaves running: a fork bomb that holds every pid, beside a neighbour. Milliseconds.

    neighbour `true`      exec latency in another sandbox: idle host vs beside the bomb
    bomb CPU              cores the bomb's sandbox used (its cgroup's CPU time / wall time)
    4 spinners            busy loops left running: the default cap (SHOAL_DEFAULT_CPU=1) bounds their cores
    kill_processes        from the call until the sandbox lists nothing but its agent (pids exhausted)
    raw: runtime exec     `<runtime> exec <id> kill -9 -1`, the way without the agent: it needs a fork
    host load             the load average when it ends: compare the idle and beside-the-bomb rows under it

Run as root:  PYTHONPATH=src python bench/bench_processes.py [--n 20] [--runtime crun]
It starts its own node (SHOAL_HOME=/tmp/shoal-bench-processes unless set) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import shoal
from shoal import cgroups
from shoal.client.launch import spawn_background
from shoal.config import Paths

BOMB = "bash -c 'bomb() { bomb | bomb & }; bomb' >/dev/null 2>&1; echo started"


def stats(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p50, p99 = ms[len(ms) // 2], ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return f"p50 {p50:7.1f} ms   p99 {p99:7.1f} ms   (n={len(ms)})"


def cpu_seconds(cgroup: str) -> float:
    rel = cgroup.strip("/")
    if cgroups.layout() == "v2":
        for line in (cgroups.ROOT / rel / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
    return int((cgroups.ROOT / "cpuacct" / rel / "cpuacct.usage").read_text()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--runtime", default="crun", choices=["crun", "runc"])
    args = parser.parse_args()
    home = os.environ.setdefault("SHOAL_HOME", "/tmp/shoal-bench-processes")
    parent = os.environ.setdefault("SHOAL_CGROUP_PARENT", "shoal-bench-processes")
    os.environ.setdefault("SHOAL_IMAGES", "/var/lib/shoal/store")
    paths = Paths.from_env()
    if not paths.socket.exists():
        spawn_background(paths)
    try:
        with (
            shoal.Client(home=home) as client,
            client.create(image="busybox", pool=False, ttl_s=1800) as neighbour,
            client.create(image="debian", pool=False, ttl_s=1800, pids=64, runtime=args.runtime) as bombed,
        ):
            idle = []
            for _ in range(args.n):
                start = time.perf_counter()
                neighbour.exec("true")
                idle.append(time.perf_counter() - start)
            beside, kills, raw, cores = [], [], [], []
            for _ in range(args.n):
                bombed.exec(BOMB, timeout=60)
                while len(bombed.processes()) < 40:
                    time.sleep(0.05)
                used, wall = cpu_seconds(f"/{parent}/{bombed.id}"), time.perf_counter()
                start = time.perf_counter()
                neighbour.exec("true")
                beside.append(time.perf_counter() - start)
                time.sleep(0.5)
                cores.append((cpu_seconds(f"/{parent}/{bombed.id}") - used) / (time.perf_counter() - wall))
                start = time.perf_counter()
                bombed.kill_processes()
                while bombed.processes():
                    time.sleep(0.005)
                kills.append(time.perf_counter() - start)
            bombed.exec("for i in 1 2 3 4; do (while :; do :; done) & done", timeout=60)  # spinners left running
            used, wall = cpu_seconds(f"/{parent}/{bombed.id}"), time.perf_counter()
            spin = []
            for _ in range(args.n):
                start = time.perf_counter()
                neighbour.exec("true")
                spin.append(time.perf_counter() - start)
                time.sleep(0.1)
            spin_cores = (cpu_seconds(f"/{parent}/{bombed.id}") - used) / (time.perf_counter() - wall)
            bombed.kill_processes()
            bombed.exec(BOMB, timeout=60)  # once more, for the runtime's own way
            while len(bombed.processes()) < 40:
                time.sleep(0.05)
            start = time.perf_counter()
            done = subprocess.run(
                [args.runtime, "--root", str(paths.runtime_state / args.runtime), "exec", bombed.id, "kill", "-9",
                 "-1"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            raw.append(time.perf_counter() - start)
            left = len(bombed.processes())
            bombed.kill_processes()
            print(f"fork bomb in a pids=64 {args.runtime} sandbox, left running by its exec")
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"  host load (1/5/15 min)         {load} on {os.cpu_count()} CPUs (others' work slows both rows)")
            print(f"  neighbour `true`, idle host    {stats(idle)}")
            print(f"  neighbour `true`, beside bomb  {stats(beside)}")
            median = sorted(cores)[len(cores) // 2]
            print(f"  bomb CPU (cores)               median {median:.2f}   max {max(cores):.2f}")
            print(f"  kill_processes until empty     {stats(kills)}")
            print(f"  4 spinners left running: they use {spin_cores:.2f} cores (default cap 1)")
            print(f"  neighbour `true`, beside them  {stats(spin)}")
            outcome = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-120:]}"
            print(f"  raw: {args.runtime} exec kill -9 -1   {raw[0] * 1000:7.1f} ms, {outcome}; {left} processes left")
    finally:
        if os.environ.get("SHOAL_BENCH_KEEP_NODE") != "1":
            os.kill(int(paths.lock.read_text()), 15)


if __name__ == "__main__":
    main()
