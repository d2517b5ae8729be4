"""`shoal demo`: a few hundred sandboxes created concurrently, used, measured and cleaned up."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import shoal


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _bar(done: int, total: int, started: float) -> None:
    width = 40
    filled = width * done // total
    rate = done / max(1e-9, time.monotonic() - started)
    sys.stdout.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {rate:6.1f}/s")
    sys.stdout.flush()


async def _demo(count: int, image: str, concurrency: int, home: str | None) -> int:
    async with shoal.AsyncClient(home=home) as client:
        print(f"shoal demo: {count} '{image}' containers, {concurrency} created at a time")
        warm = await client.create(image=image, pool=False)  # builds the image on first use
        await warm.close()
        await client.close_all(labels={"demo": "shoal"})
        mem_before = meminfo_used_mb()
        create_s: list[float] = []
        exec_s: list[float] = []
        gate = asyncio.Semaphore(concurrency)
        done = 0
        started = time.monotonic()

        async def one(i: int) -> shoal.AsyncSandbox:
            nonlocal done
            async with gate:
                t0 = time.monotonic()
                sb = await client.create(image=image, labels={"demo": "shoal"}, env={"N": str(i)}, pool=False)
                create_s.append(time.monotonic() - t0)
                done += 1
                if done == count or done % max(1, count // 40) == 0:
                    _bar(done, count, started)
                return sb

        print("creating:")
        made = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
        create_wall = time.monotonic() - started
        sandboxes = [s for s in made if isinstance(s, shoal.AsyncSandbox)]
        failures = [s for s in made if not isinstance(s, shoal.AsyncSandbox)]
        print(f"\n  {len(sandboxes)} ready in {create_wall:.2f} s ({len(sandboxes) / create_wall:.0f}/s)")
        for failure in failures[:3]:
            print(f"  failed: {failure!r}")
        mem_used = meminfo_used_mb()

        async def work(sb: shoal.AsyncSandbox) -> bool:
            async with gate:
                t0 = time.monotonic()
                r = await sb.exec("echo sandbox $N: $(uname -n) $(cat /proc/self/cgroup | wc -l) cgroups", timeout=30)
                exec_s.append(time.monotonic() - t0)
                return r.exit_code == 0 and r.stdout.startswith("sandbox ")

        t0 = time.monotonic()
        ok = sum(await asyncio.gather(*(work(sb) for sb in sandboxes)))
        exec_wall = time.monotonic() - t0
        status = await client.status()
        charged = [u["memory_bytes"] for u in await asyncio.gather(*(sb.usage() for sb in sandboxes))]
        charged = [b / 2**20 for b in charged if b is not None]  # None where this host's cgroups do not show it
        t0 = time.monotonic()
        closed = await client.close_all(labels={"demo": "shoal"})
        close_wall = time.monotonic() - t0
        print("\nfigures (this machine, one run):")
        print(f"  create  p50 {statistics.median(create_s) * 1e3:7.1f} ms   p99 {_pct(create_s, 0.99) * 1e3:7.1f} ms"
              f"   (concurrency {concurrency})")  # fmt: skip
        print(f"  exec    p50 {statistics.median(exec_s) * 1e3:7.1f} ms   p99 {_pct(exec_s, 0.99) * 1e3:7.1f} ms"
              f"   {ok}/{len(sandboxes)} ok, {len(sandboxes) / exec_wall:.0f} execs/s")  # fmt: skip
        each = f"p50 {statistics.median(charged):.2f} MiB each" if charged else "not shown by this host's cgroups"
        print(f"  live    {status['sandboxes']} sandboxes; memory charged to their cgroups {each}; host memory in use"
              f" {mem_used - mem_before:+.0f} MiB (host-wide: other work moves it too)")  # fmt: skip
        print(f"  cleanup {closed} closed in {close_wall:.2f} s")
        return 0 if ok == len(sandboxes) == count else 1


def meminfo_used_mb() -> float:
    """Host memory in use (MemTotal - MemAvailable), in MiB."""
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, value = line.split(":")
            fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def run_demo(count: int = 300, image: str = "debian", concurrency: int = 32, home: str | None = None) -> int:
    return asyncio.run(_demo(count, image, concurrency, home))
