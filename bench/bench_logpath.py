"""Where a logged exec's time goes between the agent's exit frame and the node's answer (issue 12's "trajectory
log added per exec"), read from kernel tracepoints while a node of the tree on PYTHONPATH runs an exec loop.

    PYTHONPATH=<tree>/src python bench/bench_logpath.py [--seconds 4] [--name logpath]

Needs root and perf (`perf record -a` of syscall, workqueue and block tracepoints; nothing is sampled, so the
node runs at full speed). Per logged exec `true`, p50 / p90 in ms:
  - exit frame read -> the journal's fdatasync submitted (io_submit): the node's own work on the loop;
  - submitted -> the kernel's AIO worker starts it (a kworker bound to the node's CPU: it waits for that CPU);
  - the fdatasync in that worker, by what it wrote: the record's block then the cache flush (WS+FF), or also the
    journal's inode block in between (WS+WSM+FF). The latter happens on ext4 without a journal (this project's
    machines) whenever the file's mtime moved since the last sync: a write in a new clock tick (4 ms at HZ=250)
    dirties the inode, and fdatasync writes the inode's block with the data it covers;
  - the worker done -> the node's loop awake; awake -> the answer sent;
Alternate two trees by running it twice, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode, pct  # noqa: E402

import shoal  # noqa: E402

EVENTS = ["syscalls:sys_exit_recvfrom", "syscalls:sys_enter_io_submit", "syscalls:sys_exit_epoll_wait",
          "syscalls:sys_enter_sendto", "workqueue:workqueue_execute_start", "workqueue:workqueue_execute_end",
          "block:block_rq_issue", "block:block_rq_complete"]  # fmt: skip
LINE = re.compile(r"\s*(.+?)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+(\S+):\s*(.*)")


async def run(seconds: float, name: str) -> tuple[list[tuple], int, int]:
    node = BenchNode(name)
    try:
        async with shoal.AsyncClient() as client:
            sb = await client.create(image="busybox", pool=False, ttl_s=600)
            for _ in range(50):  # warm: a kept agent connection, the log's AIO context
                await sb.exec(["true"])
            pid = (await client.status())["pid"]
            done = asyncio.Event()
            count = 0

            async def loop() -> None:
                nonlocal count
                while not done.is_set():
                    await sb.exec(["true"])
                    count += 1

            task = asyncio.ensure_future(loop())
            with tempfile.NamedTemporaryFile(suffix=".perf") as out:
                argv = ["perf", "record", "-q", "-a", "-o", out.name]
                for event in EVENTS:
                    argv += ["-e", event]
                perf = await asyncio.create_subprocess_exec(*argv, "--", "sleep", str(seconds))
                await perf.wait()
                done.set()
                await task
                script = subprocess.run(["perf", "script", "-i", out.name], capture_output=True, text=True)
            await sb.close()
    finally:
        node.stop()
    events = []
    for line in script.stdout.splitlines():
        m = LINE.match(line)
        if m:
            comm, tid, t, event, rest = m.groups()
            events.append((float(t) * 1e3, comm, tid, event, rest))
    events.sort(key=lambda e: e[0])
    return events, pid, count


def breakdown(events: list[tuple], pid: int) -> tuple[dict[str, list[float]], Counter, dict[str, list[float]]]:
    node, rows, kinds = str(pid), defaultdict(list), Counter()
    by_pattern: dict[str, list[float]] = defaultdict(list)

    def find(start: int, match) -> int | None:
        for i in range(start, len(events)):
            if match(events[i]):
                return i
        return None

    exit_frame = None
    for i, (t, _comm, tid, event, _rest) in enumerate(events):
        if tid == node and event == "syscalls:sys_exit_recvfrom":
            exit_frame = t  # the last read before a submit: the exec's exit frame
        if not (tid == node and event == "syscalls:sys_enter_io_submit") or exit_frame is None:
            continue
        start = find(i, lambda e: e[3] == "workqueue:workqueue_execute_start" and "aio_fsync_work" in e[4])
        if start is None:
            break
        worker = events[start][2]
        end = find(start, lambda e, w=worker: e[3] == "workqueue:workqueue_execute_end" and e[2] == w)
        if end is None:
            break
        wrote = [e[4].split()[1] for e in events[start:end] if e[3] == "block:block_rq_issue"
                 and (e[2] == worker or " FF " in e[4])]  # fmt: skip
        awake = find(end, lambda e: e[2] == node and e[3] == "syscalls:sys_exit_epoll_wait")
        sent = awake is not None and find(awake, lambda e: e[2] == node and e[3] == "syscalls:sys_enter_sendto")
        if not sent:
            break
        pattern = "+".join(dict.fromkeys(wrote)) or "nothing"
        kinds[pattern] += 1
        rows["exit frame -> fdatasync submitted"].append(t - exit_frame)
        rows["submitted -> kworker starts it"].append(events[start][0] - t)
        rows["fdatasync in the kworker"].append(events[end][0] - events[start][0])
        by_pattern[pattern].append(events[end][0] - events[start][0])
        rows["kworker done -> node awake"].append(events[awake][0] - events[end][0])
        rows["node awake -> answer sent"].append(events[sent][0] - events[awake][0])
        rows["exit frame -> answer sent"].append(events[sent][0] - exit_frame)
        exit_frame = None
    return rows, kinds, by_pattern


def show(label: str, values: list[float]) -> None:
    print(f"  {label:<44} p50 {statistics.median(values):6.3f}  p90 {pct(values, 0.9):6.3f} ms  (n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--name", default="logpath", help="the bench node's home: /tmp/shoal-bench-NAME")
    args = parser.parse_args()
    events, pid, count = asyncio.run(run(args.seconds, args.name))
    rows, kinds, parts = breakdown(events, pid)
    print(f"logged exec `true` loop, {count} execs, {len(rows['exit frame -> answer sent'])} fdatasyncs traced; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    if not rows:
        print("  no fdatasync through Linux AIO seen (the log's syncer thread does them here?)")
        return
    for label, values in rows.items():
        show(label, values)
    print("  what each fdatasync wrote: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    for pattern, values in sorted(parts.items()):
        if len(values) >= 5:  # a sync that met another flush or a read on its way: too few to quote
            show(f"fdatasync that wrote {pattern}", values)


if __name__ == "__main__":
    main()
