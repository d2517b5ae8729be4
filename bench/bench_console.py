"""The web console's server side: what a page of the sandbox list, a sandbox page and the overview cost with
N live sandboxes, through a node's and a gateway's HTTP, beside the same `list` through the SDK.

    PYTHONPATH=src python bench/bench_console.py --sandboxes 200 --rounds 50

Prints p50/p99 wall time per request and the serving processes' CPU-ms per request (node + gateway, from
/proc). The paging query over a 3,000-entry `list` answer without any sandboxes: tests/test_console.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import requests

import shoal
from shoal.cluster.local import LocalCluster

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def measure(name: str, call, rounds: int, pids: list[int]) -> None:  # noqa: ANN001
    call()  # warm
    times = []
    cpu = sum(cpu_ms(p) for p in pids)
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    cpu = (sum(cpu_ms(p) for p in pids) - cpu) / rounds
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    print(f"{name:<48} p50 {statistics.median(times):7.1f} ms  p99 {p99:7.1f} ms  serving CPU {cpu:6.1f} ms/req")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-console-") as workdir:
        lc = LocalCluster(Path(workdir), nodes=1, projects={"bench": {}}, prefix="bc")
        try:
            gateway = lc.add_gateway()
            node = lc.nodes[0]
            pids = [node.pid, gateway.proc.pid]
            with shoal.Client(f"shoal://{gateway.address}", token=lc.project_tokens["bench"]) as client:
                made = client.create_many(args.sandboxes, "container", image="busybox", ttl_s=1800)
                ok = [m for m in made if isinstance(m, shoal.Sandbox)]
                if len(ok) < len(made):
                    print("failed creates:", {repr(m) for m in made if not isinstance(m, shoal.Sandbox)})
                print(f"{len(ok)} sandboxes live (busybox); one run, a shared machine: compare within the run")
                one, n = ok[0].id, args.rounds
                measure("SDK client.list() through the gateway", client.list, args.rounds, pids)
                for where, http in (("node", node.http), ("gateway", gateway.http)):
                    session = requests.Session()
                    base = f"http://{http}/console/api/"
                    session.post(base + "login", json={"token": lc.cluster_token}, timeout=60).raise_for_status()

                    def get(path: str, s: requests.Session = session, b: str = base) -> None:
                        s.get(b + path, timeout=60).raise_for_status()

                    last = f"sandboxes?limit=50&offset={len(ok) - 10}"
                    measure(f"console list page, 50 rows ({where})", lambda g=get: g("sandboxes?limit=50"), n, pids)
                    measure(f"console list page, last page ({where})", lambda g=get, p=last: g(p), n, pids)
                    measure(f"console sandbox page ({where})", lambda g=get: g(f"sandboxes/{one}"), n, pids)
                    measure(f"console overview ({where})", lambda g=get: g("overview"), n, pids)
                client.close_all()
        finally:
            lc.stop()


if __name__ == "__main__":
    main()
