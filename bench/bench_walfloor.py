"""The floor under the trajectory log's added latency per step (issue 12's "log added per exec <= 0.3 ms"),
measured piece by piece in one process, rounds alternated so a load change hits every row alike.

    python bench/bench_walfloor.py [--n 300] [--rounds 4] [--dir DIR]   (DIR: on the log's disk; default
                                                                        $SHOAL_HOME or /var/lib/shoal)
Rows (p50/p99 latency, CPU-ms of this process per op; the kernel's AIO worker is not in that CPU):
  - raw fdatasync after a 4 KiB overwrite, on the loop's thread: the disk's own cost;
  - the same after appending a 4120-byte frame to a growing file: what a WAL that never starts over pays
    (a new size and new blocks for the ext4 journal to commit);
  - a 4 KiB pwrite into the preallocated, pre-zeroed file opened O_DSYNC, and opened O_DIRECT|O_DSYNC (an
    aligned buffer): the write is durable when it returns, with no metadata to commit (no size or extent
    change), back to back and one every 3 ms: is a log laid out that way cheaper on this disk than
    write + fdatasync? (issue 12. This VM's virtio disk, load 3.9, p50: O_DSYNC 0.14 ms back to back, 0.31 ms
    3 ms apart; O_DIRECT|O_DSYNC 0.12 / 0.30; overwrite + AIO fdatasync 0.16 / 0.42. At load 5 every variant
    cost 1.1-4.7 ms 3 ms apart: the spacing and the load set a flush's cost far more than the layout does);
  - the same overwrite with the fdatasync through Linux AIO, completing on an eventfd an asyncio loop
    watches (node/walsync.py), back to back and one every 3 ms: the latter is the floor of a durable step
    that does not block the node's loop, as steps come (on this VM a flush costs more the longer since the
    last: 0.14 ms back to back, 0.35 ms 3 ms apart, 0.49 ms 10 ms apart, load 13);
  - TrajectoryLog.begin (a step's intent: one write() to node/intents.py, no sync) and .append (commit, fdatasync,
    wake-up): what a logged step pays in the log itself;
  - Recorder.step logged minus unlogged around a step that does nothing: the log's whole share of a step,
    without node, client or agent.
The node-level figure (exec `true` logged minus record=False) is bench_hotpath.py's "trajectory log added".
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct  # noqa: E402

from shoal.node.trajectory import Recorder, TrajectoryLog  # noqa: E402
from shoal.node.walsync import WalSync  # noqa: E402
from shoal.protocol import ExecResult  # noqa: E402

FRAME = 4120  # a SQLite WAL frame of a 4 KiB page: 24-byte header + page
GAP = 0.003  # an exec loop's steps come this far apart: an fdatasync then costs more than back to back
ARGS = {"cmd": ["true"], "env": {}, "cwd": None, "user": None, "stdin": None, "timeout": None,
        "idle_timeout": None, "output_cap_bytes": None, "merge_stderr": False}  # fmt: skip


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Rows:
    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}

    def add(self, name: str, seconds: list[float], cpu_s: float) -> None:
        self.seconds.setdefault(name, []).extend(seconds)
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu_s

    def p50(self, name: str) -> float:
        return statistics.median(self.seconds[name]) * 1e3

    def show(self, name: str, label: str) -> None:
        s = self.seconds[name]
        print(f"  {label:<58} p50 {self.p50(name):6.3f} ms  p99 {pct(s, 0.99) * 1e3:7.3f} ms  "
              f"{self.cpu[name] * 1e3 / len(s):.3f} CPU-ms")  # fmt: skip


class Raw:
    """A preallocated file to overwrite and a growing one to append to, each with its AIO syncer."""

    def __init__(self, directory: Path) -> None:
        self.over = os.open(directory / "overwrite", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.write(self.over, b"\0" * (4 << 20))
        os.fsync(self.over)
        self.grow = os.open(directory / "grow", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.grown = 0
        self.turn = 0
        self.aio = WalSync.open(str(directory / "overwrite"))
        self.done: asyncio.Future | None = None
        self.dsync = os.open(directory / "overwrite", os.O_RDWR | os.O_DSYNC | os.O_CLOEXEC)
        try:
            self.direct: int | None = os.open(
                directory / "overwrite", os.O_RDWR | os.O_DIRECT | os.O_DSYNC | os.O_CLOEXEC
            )
        except OSError:  # a file system without O_DIRECT (tmpfs)
            self.direct = None
        self.aligned = mmap.mmap(-1, 4096)  # O_DIRECT wants a buffer aligned to the logical block size
        self.aligned.write(b"z" * 4096)

    def overwrite(self) -> None:
        self.turn = (self.turn + 1) % 1000
        os.pwrite(self.over, b"x" * 4096, self.turn * 4096)

    def sync_round(self, rows: Rows, n: int) -> None:
        seconds, c = [], cpu()
        for _ in range(n):
            t = time.perf_counter()
            self.overwrite()
            os.fdatasync(self.over)
            seconds.append(time.perf_counter() - t)
        rows.add("overwrite", seconds, cpu() - c)
        seconds, c = [], cpu()
        for _ in range(n):
            t = time.perf_counter()
            os.pwrite(self.grow, b"y" * FRAME, self.grown)
            self.grown += FRAME
            os.fdatasync(self.grow)
            seconds.append(time.perf_counter() - t)
        rows.add("grow", seconds, cpu() - c)
        for gap in (0.0, GAP):
            self.durable_writes(rows, n if not gap else n // 3, gap)

    def durable_writes(self, rows: Rows, n: int, gap: float) -> None:
        """4 KiB overwrites that are durable when pwrite returns (O_DSYNC; O_DIRECT|O_DSYNC), `gap` apart."""
        for name, fd, data in (("dsync", self.dsync, b"d" * 4096), ("direct", self.direct, self.aligned)):
            if fd is None:
                continue
            seconds, c = [], 0.0
            for _ in range(n):
                if gap:
                    time.sleep(gap)
                c0, t = cpu(), time.perf_counter()
                self.turn = (self.turn + 1) % 1000
                os.pwrite(fd, data, self.turn * 4096)
                seconds.append(time.perf_counter() - t)
                c += cpu() - c0
            rows.add(f"{name}-{gap}", seconds, c)

    async def aio_round(self, rows: Rows, n: int, gap: float = 0.0) -> None:
        if self.aio is None:
            return
        loop = asyncio.get_running_loop()
        seconds, c = [], 0.0
        for _ in range(n):
            if gap:
                await asyncio.sleep(gap)
            c0, t = cpu(), time.perf_counter()
            self.overwrite()
            self.done = loop.create_future()
            self.aio.submit()
            await self.done
            seconds.append(time.perf_counter() - t)
            c += cpu() - c0
        rows.add(f"aio-{gap}", seconds, c)

    def reaped(self) -> None:
        assert self.aio is not None
        if self.aio.reap() is not None and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def close(self) -> None:
        if self.aio is not None:
            self.aio.close()
        os.close(self.over)
        os.close(self.grow)
        os.close(self.dsync)
        if self.direct is not None:
            os.close(self.direct)
        self.aligned.close()


class FakeSandbox:
    """What Recorder.step reads of a sandbox."""

    def __init__(self, record: bool) -> None:
        self.id = f"bench-{'logged' if record else 'bare'}"
        self.spec = types.SimpleNamespace(record=record)
        self.next_seq = 0
        self.inflight: dict = {}
        self.last_active = 0.0


async def log_round(log: TrajectoryLog, rows: Rows, n: int, first: int) -> None:
    result = {"exit_code": 0, "stdout": b"", "stderr": b"", "duration_s": 0.001}
    begins, appends, c = [], [], cpu()
    for seq in range(first, first + n):
        t = time.perf_counter()
        await log.begin("bench-log", seq, "exec", "k" * 24, ARGS, time.time())
        t1 = time.perf_counter()
        await log.append("bench-log", seq, "exec", "k" * 24, ARGS, result, None, time.time())
        appends.append(time.perf_counter() - t1)
        begins.append(t1 - t)
    rows.add("step", [b + a for b, a in zip(begins, appends, strict=True)], cpu() - c)
    rows.add("begin", begins, 0.0)
    rows.add("append", appends, 0.0)


async def recorder_round(recorder: Recorder, sandboxes: dict[bool, FakeSandbox], rows: Rows, n: int) -> None:
    async def run() -> ExecResult:
        return ExecResult(exit_code=0, stdout=b"", stderr=b"", duration_s=0.001, exec_id=1)

    for record in (True, False):
        seconds, c = [], cpu()
        for _ in range(n):
            t = time.perf_counter()
            await recorder.step(sandboxes[record], "exec", ARGS, None, run)
            seconds.append(time.perf_counter() - t)
        rows.add(f"recorder-{record}", seconds, cpu() - c)


async def main(args: argparse.Namespace) -> None:
    base = Path(args.dir or os.environ.get("SHOAL_HOME") or "/var/lib/shoal")
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-walfloor-", dir=base))
    raw = Raw(directory)
    log = TrajectoryLog(directory / "trajectory.db", reserve_bytes=0)
    recorder = Recorder(log)
    sandboxes = {True: FakeSandbox(True), False: FakeSandbox(False)}
    rows = Rows()
    loop = asyncio.get_running_loop()
    try:
        if raw.aio is not None:
            loop.add_reader(raw.aio.eventfd, raw.reaped)
        await log_round(log, Rows(), 1200, 0)  # past a checkpoint: the WAL's blocks exist, as on a node in use
        await recorder_round(recorder, sandboxes, Rows(), 20)
        for r in range(args.rounds):
            raw.sync_round(rows, args.n)
            await raw.aio_round(rows, args.n)
            await raw.aio_round(rows, args.n // 3, GAP)
            await log_round(log, rows, args.n, 1200 + r * args.n)
            await recorder_round(recorder, sandboxes, rows, args.n)
    finally:
        if raw.aio is not None:
            loop.remove_reader(raw.aio.eventfd)
        raw.close()
        log.close()
        shutil.rmtree(directory)
    print(f"trajectory log floor, {args.rounds} rounds of n={args.n}, alternated; load average "
          f"{os.getloadavg()[0]:.1f}; files in {base}")  # fmt: skip
    rows.show("overwrite", "raw: 4 KiB overwrite + fdatasync (the disk)")
    rows.show("grow", "raw: 4120 B append to a growing file + fdatasync")
    for name, label in (("dsync", "O_DSYNC"), ("direct", "O_DIRECT|O_DSYNC")):
        if f"{name}-0.0" in rows.seconds:
            rows.show(f"{name}-0.0", f"raw: 4 KiB pwrite, file opened {label} (durable at return)")
            rows.show(f"{name}-{GAP}", f"  same, one every {GAP * 1e3:.0f} ms")
    if "aio-0.0" in rows.seconds:
        rows.show("aio-0.0", "raw: overwrite + AIO fdatasync + eventfd wake-up")
        rows.show(f"aio-{GAP}", f"  same, one every {GAP * 1e3:.0f} ms, as an exec loop's steps come")
    rows.show("begin", "log.begin: the intent (node/intents.py), no sync")
    rows.show("append", "log.append: WAL commit + fdatasync + wake-ups")
    rows.show("step", "log.begin + log.append (CPU-ms: both)")
    rows.show("recorder-True", "Recorder.step logged, a step that does nothing")
    rows.show("recorder-False", "Recorder.step record=False")
    added = rows.p50("recorder-True") - rows.p50("recorder-False")
    floor = rows.p50("aio-0.0") if "aio-0.0" in rows.seconds else rows.p50("overwrite")
    print(
        f"  log's share of a step p50 {added:.3f} ms, {added - floor:.3f} ms above the floor measured the same way "
        f"(back to back: {floor:.3f} ms); an exec loop's steps, {GAP * 1e3:.0f} ms apart, meet the other floor"
    )
    print("  (node-level: bench_hotpath_ab.py BEFORE_SRC --only exec,bare)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", help="a directory on the log's disk (default $SHOAL_HOME or /var/lib/shoal)")
    asyncio.run(main(parser.parse_args()))
