"""Background processes and PTYs (docs/PROCESSES.md): what an interactive step costs, beside the raw tools.

    PYTHONPATH=src python bench/bench_procs.py [--runs 200]

Rows, interleaved (A, B, C, ..., A, ...) so a drifting load falls on all alike, on a local node (Unix socket):
- raw: a keystroke echoed by `cat` on a host PTY (Python's pty module): the floor of a terminal round trip.
- `sb.exec("true")` for reference, and `sb.exec("true", background=True)` followed to its end (`wait`).
- `send_stdin` (one step: the node logs it, the agent hands it to the process's keeper).
- a keystroke on `sb.pty()` running `cat`: `send_stdin("a")` until the echo arrives on an open `stream()`.
- `read()` of a process's output from an offset (not a step).
p50/p99 per op and CPU-ms per op in the client and in the node (from /proc). The machine is shared: compare
rows within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pty
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import shoal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402


async def measure(rows: dict[str, Callable[[], Awaitable[None]]], count: int, node_pid: int) -> None:
    for fn in rows.values():
        await fn()  # warm up
    times: dict[str, list[float]] = {name: [] for name in rows}
    cpu = dict.fromkeys(rows, 0.0)
    node = dict.fromkeys(rows, 0.0)
    for _ in range(count):
        for name, fn in rows.items():
            c0, n0, t = time.process_time(), cpu_seconds(node_pid), time.perf_counter()
            await fn()
            times[name].append(time.perf_counter() - t)
            cpu[name] += time.process_time() - c0
            node[name] += cpu_seconds(node_pid) - n0
    for name, values in times.items():
        print(
            f"  {name:<44} p50 {statistics.median(values) * 1e3:7.2f} ms  p99 {pct(values, 0.99) * 1e3:7.2f} ms"
            f"  client CPU {cpu[name] / count * 1e3:5.2f} ms  node CPU {node[name] / count * 1e3:5.2f} ms"
        )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()

    pid, fd = pty.fork()  # the raw floor: cat on a host terminal
    if pid == 0:
        os.execvp("cat", ["cat"])

    async def raw_keystroke() -> None:
        os.write(fd, b"a")
        while b"a" not in os.read(fd, 64):
            pass

    async with shoal.AsyncClient() as client:
        node_pid = (await client.status())["pid"]
        async with await client.create(image="busybox", pool=False, ttl_s=900) as sb:
            reader = await sb.exec("cat", background=True)
            term = await sb.pty(80, 24, cmd=["cat"])
            echoes: asyncio.Queue[bytes] = asyncio.Queue()

            async def follow() -> None:
                async for chunk in term.stream():
                    echoes.put_nowait(chunk.data)

            follower = asyncio.ensure_future(follow())

            async def keystroke() -> None:
                await term.send_stdin("a")
                while b"a" not in await echoes.get():
                    pass

            async def background() -> None:
                await (await sb.exec("true", background=True)).wait()

            async def exec_true() -> None:
                await sb.exec("true")

            async def send() -> None:
                await reader.send_stdin("x\n")

            async def read() -> None:
                await reader.read(stdout_offset=0)

            print(f"{args.runs} runs of each row, interleaved, one busybox container:")
            await measure(
                {
                    "raw     keystroke echo on a host PTY (cat)": raw_keystroke,
                    "native  sb.exec('true')": exec_true,
                    "native  exec('true', background=True).wait()": background,
                    "native  proc.send_stdin('x\\n') (a step)": send,
                    "native  keystroke echo on sb.pty() (cat)": keystroke,
                    "native  proc.read() from offset 0": read,
                },
                args.runs,
                node_pid,
            )
            follower.cancel()
    os.kill(pid, 9)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    asyncio.run(main())
