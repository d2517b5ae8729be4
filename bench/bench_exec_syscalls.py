"""The node's system calls and CPU per exec `true` and per logged file write and read (issue 12), kernel counts.

Execs logged and record=False; file writes of 100 bytes and reads of them back, logged.

    PYTHONPATH=<tree>/src python bench/bench_exec_syscalls.py [--n 2000]

Runs one node of the tree on PYTHONPATH (own home, like bench_hotpath) and, per variant, counts with `perf stat`
(needs perf and root) every system call the node's threads enter (`raw_syscalls:sys_enter`) and its epoll_wait
calls (one per event-loop pass), divided by the operations. Unlike CPU-ms or latency these counts do not move with
the machine's load, so two trees compare in one run each: alternate `PYTHONPATH=/tmp/before/src` and `src`.
The node's CPU-ms per exec (utime+stime from /proc, all threads) is printed too; quote the load with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode  # noqa: E402

import shoal  # noqa: E402

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
EVENTS = "raw_syscalls:sys_enter,syscalls:sys_enter_epoll_wait"


def node_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


async def main(n: int) -> None:
    node = BenchNode("exec-syscalls")
    try:
        async with shoal.AsyncClient() as client:
            logged = await client.create(image="busybox", pool=False, ttl_s=600)
            bare = await client.create(image="busybox", pool=False, ttl_s=600, record=False)
            for _ in range(50):  # warm: kept agent connections, the log's AIO context
                await logged.exec(["true"])
                await bare.exec(["true"])
            for _ in range(50):
                await logged.files.write("/f", b"x" * 100)
                await logged.files.read("/f")
            pid = (await client.status())["pid"]
            variants = {
                "logged": lambda: logged.exec(["true"]),
                "record=False": lambda: bare.exec(["true"]),
                "file_write": lambda: logged.files.write("/f", b"x" * 100),  # logged, 100 bytes
                "file_read": lambda: logged.files.read("/f"),  # logged
            }
            for name, step in variants.items():
                with tempfile.NamedTemporaryFile("r", suffix=".perf") as out:
                    perf = subprocess.Popen(["perf", "stat", "-x,", "-e", EVENTS, "-p", str(pid), "-o", out.name],
                                            stderr=subprocess.DEVNULL)  # fmt: skip
                    time.sleep(0.5)  # perf attaches
                    before = node_cpu_ms(pid)
                    for _ in range(n):
                        await step()
                    cpu = (node_cpu_ms(pid) - before) / n
                    perf.send_signal(signal.SIGINT)
                    perf.wait()
                    counts = [line.split(",") for line in out.read().splitlines() if "," in line and line[0] != "#"]
                per = "  ".join(f"{c[2].split(':')[-1]} {int(c[0]) / n:.2f}" for c in counts if c[0].isdigit())
                print(f"{name:<13} node {cpu:.3f} CPU-ms/op  {per}  (load {os.getloadavg()[0]:.1f})")
            await logged.close()
            await bare.close()
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="execs per variant")
    asyncio.run(main(parser.parse_args().n))
