"""Large files through the node (issue 18 item 7): throughput, the node's peak memory, and a neighbour's
exec latency while another sandbox moves a large file; medians and p99 in milliseconds.

    files.write / files.read of SIZE MiB   vs the raw tool: `cat` of the same bytes on the host (page cache)
    node peak RSS growth (VmHWM)           while the file goes in and out
    neighbour `true` exec latency          idle, beside repeated writes, beside repeated reads

Run as root:  PYTHONPATH=src python bench/bench_bigfiles.py [--size-mb 64] [--n 40]
It starts its own node (SHOAL_HOME=/tmp/shoal-bench-bigfiles unless set) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import shoal
from shoal.client.launch import spawn_background
from shoal.config import Paths


def stats(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return f"median {statistics.median(ms):7.1f} ms   p99 {p99:7.1f} ms   (n={len(ms)})"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def node_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--n", type=int, default=40)
    args = parser.parse_args()
    home = os.environ.setdefault("SHOAL_HOME", "/tmp/shoal-bench-bigfiles")
    os.environ.setdefault("SHOAL_CGROUP_PARENT", "shoal-bench-bigfiles")
    os.environ.setdefault("SHOAL_IMAGES", "/var/lib/shoal/store")
    paths = Paths.from_env()
    if not paths.socket.exists():
        spawn_background(paths)
    data = os.urandom(args.size_mb << 20)
    local = Path(home) / "bench-big.bin"
    local.write_bytes(data)
    pid = int(paths.lock.read_text())
    with (
        shoal.Client(home=home) as client,
        client.create(image="busybox", pool=False, ttl_s=900) as mover,
        client.create(image="busybox", pool=False, ttl_s=900) as neighbour,
    ):
        mover.files.write("/warm", b"x")
        hwm_before = status_kb(pid, "VmHWM")
        print(f"moving {args.size_mb} MiB (5 times each way)")
        for label, fn in (
            ("raw: cat on the host", lambda: subprocess.run(["cat", str(local)], stdout=subprocess.DEVNULL)),
            ("files.write", lambda: mover.files.write("/big", data)),
            ("files.write_from", lambda: mover.files.write_from(local, "/big")),
            ("files.read", lambda: mover.files.read("/big")),
        ):
            cpu = node_cpu_ms(pid)
            samples = timed(fn, 5)
            rate = args.size_mb / statistics.median(samples)
            cpu_per_op = (node_cpu_ms(pid) - cpu) / 5
            print(f"  {label:<22}{stats(samples)}   {rate:6.0f} MiB/s   node CPU {cpu_per_op:6.0f} ms/op")
        grown = (status_kb(pid, "VmHWM") - hwm_before) / 1024
        print(f"  node peak RSS growth  {grown:.0f} MiB (file {args.size_mb} MiB)")

        print("neighbour `true` exec latency")
        print(f"  idle                         {stats(timed(lambda: neighbour.exec('true'), args.n))}")
        for label, fn in (("beside writes", lambda: mover.files.write("/big", data)),
                          ("beside reads", lambda: mover.files.read("/big"))):  # fmt: skip
            stop = threading.Event()

            def loop(f: Callable[[], object] = fn, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    f()

            thread = threading.Thread(target=loop, daemon=True)
            thread.start()
            time.sleep(0.5)
            samples = timed(lambda: neighbour.exec("true"), args.n)
            stop.set()
            thread.join()
            print(f"  {label:<29}{stats(samples)}")
    local.unlink(missing_ok=True)
    print(f"(bench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    if os.environ.get("SHOAL_BENCH_KEEP_NODE") != "1":
        os.kill(pid, 15)


if __name__ == "__main__":
    main()
