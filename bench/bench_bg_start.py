"""A background process started and followed in one request (what the E2B layer's `commands.run` starts:
`procs.start_streaming`, `proc_start` with `stream`) against the streamed exec of the same argv, with the
async client; optionally before/after: two nodes (one per source tree), the four rows taking turns op by op
so a shared machine's load falls on all of them alike.

    PYTHONPATH=src python bench/bench_bg_start.py [BEFORE_SRC] [--n 300]

BEFORE_SRC: the `src` of another checkout (`git worktree add --detach /tmp/before <commit>`), whose node runs
that tree. Prints p50/p99 and node CPU-ms per op (utime+stime of the node process from /proc) and what a
background start adds over the exec (a keeper in the sandbox: listed, re-attachable, outliving its client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402

from shoal.client import procs  # noqa: E402
from shoal.client.aio import AsyncClient  # noqa: E402
from shoal.cluster.local import LocalCluster  # noqa: E402

SDK_ARGV = ["/bin/bash", "-l", "-c", "true"]  # what e2b's commands.run("true") asks envd to start
EXEC, BACKGROUND = "exec(argv, streamed)", "background, started+followed"


async def run(clusters: dict[str, LocalCluster], n: int) -> None:
    async with contextlib.AsyncExitStack() as stack:
        rows, pids = {}, {}
        for name, lc in clusters.items():
            client = await stack.enter_async_context(
                AsyncClient(f"shoal://{lc.nodes[0].address}", token=lc.project_tokens["default"])
            )
            sb = await client.create(image="debian", ttl_s=600)
            stack.push_async_callback(sb.close)

            async def exec_streamed(sb=sb) -> None:
                await sb.exec(SDK_ARGV, on_stdout=lambda _data: None)

            async def background_followed(sb=sb) -> None:
                args = {"sandbox_id": sb.id, "cmd": SDK_ARGV, "open_stdin": False}
                async for _ in procs.start_streaming(sb, args, timeout=60, idle=30):
                    pass

            rows[f"{name:<6} {EXEC}"], rows[f"{name:<6} {BACKGROUND}"] = exec_streamed, background_followed
            pids[f"{name:<6} {EXEC}"] = pids[f"{name:<6} {BACKGROUND}"] = lc.nodes[0].pid
        for fn in rows.values():
            for _ in range(10):
                await fn()  # warm up (a second background start finds the spare connection, where there is one)
        times: dict[str, list[float]] = {k: [] for k in rows}
        cpu = dict.fromkeys(rows, 0.0)
        for _ in range(n):
            for key, fn in rows.items():
                c0, t0 = cpu_seconds(pids[key]), time.perf_counter()
                await fn()
                times[key].append(time.perf_counter() - t0)
                cpu[key] += cpu_seconds(pids[key]) - c0
        print(f"{n} of each, alternated; load average at the end {os.getloadavg()[0]:.1f}")
        for key in rows:
            print(
                f"  {key:<42} p50 {statistics.median(times[key]) * 1e3:6.2f} ms"
                f"  p99 {pct(times[key], 0.99) * 1e3:7.2f} ms  node CPU-ms/op {cpu[key] / n * 1e3:5.2f}"
            )
        for name in clusters:
            b, e = f"{name:<6} {BACKGROUND}", f"{name:<6} {EXEC}"
            extra = statistics.median(times[b]) - statistics.median(times[e])
            print(
                f"  -> {name}: a background start adds {extra * 1e3:+.2f} ms p50, {(cpu[b] - cpu[e]) / n * 1e3:+.2f} "
                "node CPU-ms over the exec"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", nargs="?", default=None)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-bg-start-"))
    trees = {"after": str(Path(__file__).resolve().parents[1] / "src")}
    if args.before:
        trees = {"before": args.before, **trees}
    saved = os.environ.get("PYTHONPATH")
    clusters: dict[str, LocalCluster] = {}
    try:
        for name, src in trees.items():
            os.environ["PYTHONPATH"] = src  # the node process runs this tree
            clusters[name] = LocalCluster(workdir / name, nodes=1, prefix=f"bg{name[0]}")
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
        asyncio.run(run(clusters, args.n))
    finally:
        for lc in clusters.values():
            lc.stop()


if __name__ == "__main__":
    main()
