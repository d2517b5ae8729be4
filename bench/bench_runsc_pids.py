"""Host pids a sandbox's processes use: runsc (gVisor) beside crun, for N sleeping processes; and a bomb.

Why it matters: the sandbox's `pids` limit is enforced on its host cgroup. Under crun each process in the
sandbox is one host pid; under gVisor each guest address space is backed by host stubs (ptrace: a stub
process with a stub thread per sentry thread that ever ran it; systrap: about two), so the host count grows
faster than the guest's and is not given back when the processes exit (the stubs are pooled). When the host
pids.max refuses one, the sentry cannot run the task and the sandbox dies (docs/SECURITY.md, "Limits found").
The platform is the node's (SHOAL_RUNSC_PLATFORM, substrates/container/runtime.py).

    host pids, N sleeping   the sandbox's host pids.current with N `sleep` processes started by one exec
    after kill_processes    the same once the sandbox lists nothing but its agent again
    --bomb                  also: a bash fork bomb in a runsc sandbox (pids 1024) while a crun neighbour runs
                            exec `true` in a loop: the neighbour's p50/p99 and when the runsc sandbox is lost

Run as root:  PYTHONPATH=src python bench/bench_runsc_pids.py [--n 10 25 50 100]
It starts its own node (SHOAL_HOME=/tmp/shoal-bench-runsc-pids unless set) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct  # noqa: E402

import shoal  # noqa: E402
from shoal import cgroups
from shoal.client.launch import spawn_background
from shoal.config import Paths


def settle(sb: shoal.Sandbox, want: int, timeout: float = 60.0) -> int:
    """Number of processes listed once it reaches `want` (or the deadline passes)."""
    deadline = time.monotonic() + timeout
    while (n := len(sb.processes())) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def measure(client: shoal.Client, parent: str, runtime: str, counts: list[int]) -> None:
    # pids high enough that the host limit is never what stops it: the figures are what the sandbox uses
    with client.create(image="busybox", pool=False, ttl_s=900, runtime=runtime, pids=16384) as sb:
        cgroup = f"/{parent}/{sb.id}"
        print(f"{runtime}: idle sandbox holds {cgroups.pids_current(cgroup)} host pids")
        for n in counts:
            sb.exec(f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); sleep 600 & done", timeout=120)
            listed = settle(sb, n)
            time.sleep(1)  # let the runtime settle its threads
            held = cgroups.pids_current(cgroup)
            sb.kill_processes()
            settle(sb, 0)
            time.sleep(1)
            after = cgroups.pids_current(cgroup)
            print(f"  {listed:4d} sleeping: host pids {held:6d}   after kill_processes {after:6d}")


BOMB = "bash -c 'bomb() { bomb | bomb & }; bomb' >/dev/null 2>&1; echo started"


def bomb(client: shoal.Client) -> None:
    """The neighbour's exec latency before and during a runsc bomb (until the sandbox is lost, + 3 s)."""
    with (
        client.create(image="busybox", pool=False, ttl_s=300) as neighbour,
        client.create(image="debian", pool=False, ttl_s=300, runtime="runsc", pids=1024) as sb,
    ):

        def timed() -> float:
            start = time.perf_counter()
            neighbour.exec("true")
            return time.perf_counter() - start

        before = [timed() for _ in range(100)]
        during: list[float] = []
        stop = threading.Event()
        thread = threading.Thread(target=lambda: [during.append(timed()) for _ in iter(stop.is_set, True)])
        thread.start()
        sb.exec(BOMB, timeout=60)
        start, lost = time.monotonic(), None
        while lost is None and time.monotonic() - start < 60:
            try:
                sb.processes()
            except shoal.ShoalError:
                lost = time.monotonic() - start
            time.sleep(0.1)
        time.sleep(3)
        stop.set()
        thread.join()
        for name, values in (("before", before), ("during the bomb", during)):
            print(f"  neighbour exec true {name:<16} p50 {pct(values, 0.5) * 1e3:7.1f} ms"
                  f"   p99 {pct(values, 0.99) * 1e3:7.1f} ms  (n={len(values)})")  # fmt: skip
        print(f"  runsc sandbox lost {lost:.1f} s after the bomb started" if lost else "  runsc sandbox not lost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 25, 50, 100])
    parser.add_argument("--bomb", action="store_true", help="also the bomb and its neighbour's latency")
    args = parser.parse_args()
    home = os.environ.setdefault("SHOAL_HOME", "/tmp/shoal-bench-runsc-pids")
    parent = os.environ.setdefault("SHOAL_CGROUP_PARENT", "shoal-bench-runsc-pids")
    os.environ.setdefault("SHOAL_IMAGES", "/var/lib/shoal/store")
    paths = Paths.from_env()
    if not paths.socket.exists():
        spawn_background(paths)
    try:
        with shoal.Client(home=home) as client:
            for runtime in ("crun", "runsc"):
                if shutil.which(runtime) is None:
                    print(f"{runtime}: not installed, skipped")
                    continue
                measure(client, parent, runtime, args.n)
            if args.bomb and shutil.which("runsc"):
                bomb(client)
    finally:
        if os.environ.get("SHOAL_BENCH_KEEP_NODE") != "1":
            os.kill(int(paths.lock.read_text()), 15)


if __name__ == "__main__":
    main()
