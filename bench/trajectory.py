"""What the trajectory log costs, how fast fast-forward is, and what pause/resume costs and frees.

    SHOAL_HOME=/tmp/traj-bench SHOAL_CGROUP_PARENT=traj-bench PYTHONPATH=src python bench/trajectory.py

Prints medians and p99 (ms) of:
  exec of `true`, one at a time, with the log on (record=True) and off (record=False);
  64 concurrent execs, with the log on and off (group commit: steps per fsync);
  fast-forward: logged steps returned per second, one at a time and 64 in flight;
  pause and resume latency, and memory reclaimed per sandbox (64 MB of page cache + 32 MB anonymous).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("SHOAL_HOME", "/tmp/traj-bench")
os.environ.setdefault("SHOAL_CGROUP_PARENT", "traj-bench")
os.environ.setdefault("SHOAL_IMAGES", "/var/lib/shoal/store")

import shoal  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, samples: list[float]) -> None:
    ms = [s * 1000 for s in samples]
    print(f"{name:<44} n={len(ms):<5} p50={statistics.median(ms):7.3f} ms  p99={pct(ms, 0.99):7.3f} ms")


def fsync_latency(directory: str, n: int = 200) -> list[float]:
    """What one fsync costs on the disk under the log right now (the floor of a durable step)."""
    path = os.path.join(directory, ".fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    samples = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            os.write(fd, b"x" * 256)
            os.fsync(fd)
            samples.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return samples


async def sequential(client: shoal.AsyncClient, record: bool, n: int) -> list[float]:
    sb = await client.create(image="busybox", pool=False, record=record)
    try:
        for _ in range(20):
            await sb.exec("true")
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            await sb.exec("true")
            samples.append(time.perf_counter() - start)
        return samples
    finally:
        await sb.close()


async def concurrent(client: shoal.AsyncClient, record: bool, rounds: int, width: int) -> tuple[list[float], float]:
    sb = await client.create(image="busybox", pool=False, record=record)
    try:
        samples: list[float] = []

        async def one() -> None:
            start = time.perf_counter()
            await sb.exec("true")
            samples.append(time.perf_counter() - start)

        before = (await client.status())["trajectory"]
        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(width)))
        elapsed = time.perf_counter() - start
        after = (await client.status())["trajectory"]
        commits = after["commits"] - before["commits"]
        appended = after["appended"] - before["appended"]
        per_commit = f"{appended / commits:.1f} records/fsync" if commits else "no log writes"
        print(f"  {'on' if record else 'off'}: {len(samples) / elapsed:7.0f} execs/s, {per_commit}")
        return samples, elapsed
    finally:
        await sb.close()


async def fast_forward(client: shoal.AsyncClient, n: int, width: int) -> None:
    sb = await client.create(image="busybox", pool=False)
    try:
        for base in range(0, n, width):
            await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(base, min(n, base + width))))
        again = await client.attach(sb.id)
        start = time.perf_counter()
        for i in range(n):
            await again.exec(f"echo {i}")
        one_at_a_time = n / (time.perf_counter() - start)
        rates = []
        for inflight in (width, 4 * width):
            again = await client.attach(sb.id)
            start = time.perf_counter()
            for base in range(0, n, inflight):
                await asyncio.gather(*(again.exec(f"echo {i}") for i in range(base, min(n, base + inflight))))
            rates.append(f"{inflight} in flight {n / (time.perf_counter() - start):7.0f}/s")
        print(f"fast-forward of {n} logged steps: one at a time {one_at_a_time:7.0f}/s, " + ", ".join(rates))
    finally:
        await sb.close()


async def pause_resume(client: shoal.AsyncClient, count: int) -> None:
    pauses, resumes, reclaimed, before = [], [], [], []
    for _ in range(count):
        sb = await client.create(image="debian", pool=False)
        try:
            await sb.exec("head -c 64M /dev/urandom > /tmp/cache && cat /tmp/cache > /dev/null")
            await sb.exec("nohup sh -c 'x=$(head -c 32M /dev/zero | tr \"\\0\" a); sleep 1000' >/dev/null 2>&1 &")
            await asyncio.sleep(1.0)
            start = time.perf_counter()
            info = await sb.pause()
            pauses.append(time.perf_counter() - start)
            start = time.perf_counter()
            await sb.resume()
            resumes.append(time.perf_counter() - start)
            reclaimed.append(info["reclaimed_bytes"] / 2**20)
            before.append(info["memory_before"] / 2**20)
        finally:
            await sb.close()
    line("pause (freeze + reclaim)", pauses)
    line("resume", resumes)
    print(
        f"memory per sandbox before pause: median {statistics.median(before):6.1f} MB; "
        f"reclaimed by pause: median {statistics.median(reclaimed):6.1f} MB"
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=500)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--pauses", type=int, default=10)
    args = parser.parse_args()
    async with shoal.AsyncClient() as client:
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        line("fsync of 256 bytes on the log's disk", fsync_latency(os.environ["SHOAL_HOME"]))
        print(f"exec `true` in busybox, one at a time ({args.n} each)")
        off = await sequential(client, False, args.n)
        on = await sequential(client, True, args.n)
        line("  log off (record=False)", off)
        line("  log on  (durable before ack)", on)
        print(
            f"  added by the log: p50 {1000 * (statistics.median(on) - statistics.median(off)):.3f} ms, "
            f"p99 {1000 * (pct(on, 0.99) - pct(off, 0.99)):.3f} ms"
        )
        print(f"exec `true`, {args.width} concurrent, {max(1, args.n // args.width)} rounds")
        c_off, _ = await concurrent(client, False, max(1, args.n // args.width), args.width)
        c_on, _ = await concurrent(client, True, max(1, args.n // args.width), args.width)
        line("  log off", c_off)
        line("  log on", c_on)
        await fast_forward(client, max(args.n, 2000), args.width)
        await pause_resume(client, args.pauses)


if __name__ == "__main__":
    asyncio.run(main())
