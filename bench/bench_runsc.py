"""gVisor (runsc) beside crun through the node: create+close and exec `true` p50/p99, with node CPU-ms per op.

Why: runsc's platform decides what a guest process costs (docs/SECURITY.md); this bench puts the runsc figures
next to crun's in one run so a runsc upgrade or a platform change can be judged on this noisy host.

    PYTHONPATH=src python bench/bench_runsc.py [--n 40] [--platform systrap] [--runtimes crun,runsc]

--platform sets SHOAL_RUNSC_PLATFORM for the bench's own node (default: the node's choice, see
substrates/container/runtime.py). Run as root; it starts its own node and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode, cpu_seconds, pct  # noqa: E402

import shoal  # noqa: E402
from shoal.client.launch import spawn_background  # noqa: E402
from shoal.config import Paths  # noqa: E402


def row(name: str, seconds: list[float], cpu_ms: float) -> None:
    p50, p99 = statistics.median(seconds) * 1e3, pct(seconds, 0.99) * 1e3
    print(f"  {name:<28} p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   node CPU {cpu_ms:6.2f} ms/op  (n={len(seconds)})")


def bench(client: shoal.Client, node_pid: int, runtime: str, n: int) -> None:
    version = subprocess.run([runtime, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"{runtime} ({version})")
    times = []
    cpu0 = cpu_seconds(node_pid)
    for _ in range(n):
        t = time.perf_counter()
        sb = client.create(image="busybox", pool=False, ttl_s=300, runtime=runtime)
        sb.close()
        times.append(time.perf_counter() - t)
    row("create+close", times, (cpu_seconds(node_pid) - cpu0) * 1e3 / n)
    with client.create(image="busybox", pool=False, ttl_s=300, runtime=runtime) as sb:
        sb.exec("true")
        times = []
        cpu0 = cpu_seconds(node_pid)
        for _ in range(n * 5):
            t = time.perf_counter()
            sb.exec("true")
            times.append(time.perf_counter() - t)
        row("exec true", times, (cpu_seconds(node_pid) - cpu0) * 1e3 / (n * 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40, help="creates per runtime (execs: 5x)")
    parser.add_argument("--platform", help="gVisor platform for this node (SHOAL_RUNSC_PLATFORM)")
    parser.add_argument("--runtimes", default="crun,runsc")
    args = parser.parse_args()
    if args.platform:
        os.environ["SHOAL_RUNSC_PLATFORM"] = args.platform
    node = BenchNode("runsc")
    paths = Paths.from_env()
    if not paths.socket.exists():
        spawn_background(paths)
    try:
        with shoal.Client(home=str(node.home)) as client:
            pid = int(paths.lock.read_text())
            for runtime in args.runtimes.split(","):
                if shutil.which(runtime) is None:
                    print(f"{runtime}: not installed, skipped")
                    continue
                bench(client, pid, runtime, args.n)
    finally:
        node.stop()


if __name__ == "__main__":
    main()
