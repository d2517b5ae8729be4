"""Cost of isolation features, measured against a real node: medians and p99 in milliseconds.

    create+first exec   network="none" (default) vs an allowlist vs disk_mb
    set_network         time to apply a policy change to a running sandbox
    neighbour exec      `true` in one sandbox while another runs a fork bomb / CPU hog / output flood

Run as root:  PYTHONPATH=src python bench/bench_security.py [--n 40]
It starts its own node (SHOAL_HOME=/tmp/shoal-bench-security unless set) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import shoal
from shoal.client.launch import spawn_background
from shoal.config import Paths


def stats(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return f"median {statistics.median(ms):7.1f} ms   p99 {p99:7.1f} ms   (n={len(ms)})"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--userns", type=int, metavar="BASE", help="also compare with a node using SHOAL_USERNS")
    args = parser.parse_args()
    home = os.environ.setdefault("SHOAL_HOME", "/tmp/shoal-bench-security")
    os.environ.setdefault("SHOAL_CGROUP_PARENT", "shoal-bench-security")
    os.environ.setdefault("SHOAL_IMAGES", "/var/lib/shoal/store")
    paths = Paths.from_env()
    if not paths.socket.exists():
        spawn_background(paths)
    with shoal.Client(home=home) as client:

        def cycles(n: int, **options: object) -> tuple[list[float], list[float]]:
            made, closed = [], []
            for _ in range(n):
                start = time.perf_counter()
                sb = client.create(image="busybox", pool=False, **options)
                sb.exec("true")
                made.append(time.perf_counter() - start)
                start = time.perf_counter()
                sb.close()
                closed.append(time.perf_counter() - start)
            return made, closed

        for warm in ({}, {"network": "tcp://192.0.2.1:80"}, {"disk_mb": 256}):  # caches, template, nft table
            cycles(1, **warm)
        print("create + first exec | close   (busybox)")
        shapes = {
            "network none": {},
            "network allowlist": {"network": "tcp://192.0.2.1:80"},
            "disk_mb=256": {"disk_mb": 256},
            "allowlist + disk_mb": {"network": "192.0.2.0/24", "disk_mb": 256},
        }
        for label, options in shapes.items():
            made, closed = cycles(args.n, **options)
            print(f"  {label:<20}  create {stats(made)}")
            print(f"  {'':<20}  close  {stats(closed)}")

        with client.create(image="busybox", pool=False) as sb:
            policies = ["tcp://192.0.2.1:80", ["192.0.2.0/24", "udp://198.51.100.7:53"], "none"]
            first = timed(lambda: sb.set_network("tcp://192.0.2.1:80"), 1)
            changes = timed(lambda: sb.set_network(policies[int(time.perf_counter() * 1000) % 3]), args.n)
            print("set_network")
            print(f"  first (plumbs veth)   {stats(first)}")
            print(f"  change                {stats(changes)}")

        with client.create(image="busybox", pool=False) as neighbour:
            print("neighbour `true` exec latency")
            print(f"  idle host                    {stats(timed(lambda: neighbour.exec('true'), args.n))}")
            abuses = {
                "fork bomb (pids=256)": ("bomb() { bomb | bomb & }; bomb; sleep 30", {"pids": 256}),
                "CPU hog (4 spinners)": ("for i in 1 2 3 4; do (while :; do :; done) & done; sleep 30", {}),
                "output flood (yes)": ("yes", {}),
            }
            for name, (cmd, options) in abuses.items():
                with client.create(image="busybox", pool=False, **options) as abuser:
                    thread = threading.Thread(target=lambda a=abuser, c=cmd: a.exec(c, timeout=8), daemon=True)
                    thread.start()
                    time.sleep(1.5)
                    samples = timed(lambda: neighbour.exec("true"), args.n)
                    thread.join()
                print(f"  beside {name:<22}{stats(samples)}")
        if args.userns:
            compare_userns(client, args.userns, args.n)
    if os.environ.get("SHOAL_BENCH_KEEP_NODE") != "1":
        os.kill(int(paths.lock.read_text()), 15)


def compare_userns(plain: shoal.Client, base: int, n: int) -> None:
    """Create cost with root mapped to an unprivileged uid, interleaved with plain creates (same load)."""
    home = "/tmp/shoal-bench-userns"
    saved = dict(os.environ)
    os.environ.update(SHOAL_HOME=home, SHOAL_CGROUP_PARENT="shoal-bench-userns", SHOAL_USERNS=str(base))
    try:
        paths = Paths.from_env()
        if not paths.socket.exists():
            spawn_background(paths)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    with shoal.Client(home=home) as mapped:
        start = time.perf_counter()
        mapped.create(image="debian", pool=False).close()
        first = time.perf_counter() - start  # includes shifting the image's layers once
        samples: dict[str, list[float]] = {"plain": [], "userns": []}
        for _ in range(n):
            for label, client in (("plain", plain), ("userns", mapped)):
                start = time.perf_counter()
                with client.create(image="debian", pool=False) as sb:
                    sb.exec("true")
                    samples[label].append(time.perf_counter() - start)
        print("create + first exec (debian), interleaved")
        print(f"  first userns create (shifts layers once)  {first * 1000:.0f} ms")
        for label, values in samples.items():
            print(f"  {label:<8}{stats(values)}")
    os.kill(int(paths.lock.read_text()), 15)


if __name__ == "__main__":
    main()
