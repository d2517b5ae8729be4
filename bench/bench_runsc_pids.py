"""Host pids a sandbox's processes use: runsc (gVisor, ptrace platform) beside crun, for N sleeping processes.

Why it matters: the sandbox's `pids` limit is enforced on its host cgroup. Under crun each process in the
sandbox is one host pid; under gVisor's ptrace platform each guest address space is backed by a host stub
process with a stub thread per sentry thread that ever ran it, so the host count grows faster than the
guest's and is not given back when the processes exit (the stubs are pooled). When the host pids.max refuses
one, the sentry cannot run the task and the sandbox dies (docs/SECURITY.md, "Limits found").

    host pids, N sleeping   the sandbox's host pids.current with N `sleep` processes started by one exec
    after kill_processes    the same once the sandbox lists nothing but its agent again

Run as root:  PYTHONPATH=src python bench/bench_runsc_pids.py [--n 10 25 50 100]
It starts its own node (SHOAL_HOME=/tmp/shoal-bench-runsc-pids unless set) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import shoal
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 25, 50, 100])
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
    finally:
        if os.environ.get("SHOAL_BENCH_KEEP_NODE") != "1":
            os.kill(int(paths.lock.read_text()), 15)


if __name__ == "__main__":
    main()
