"""Before/after of the function kind on a shared, noisy machine: `bench_function.py` run on two source trees,
alternated round by round (before, after, before, after, ...), so both meet the same load.

    python bench/bench_function_ab.py BEFORE_SRC [AFTER_SRC] [--rounds 3] [--ways 'shoal call,shoal map,run_code']
                                      [--calls 1000] [--map-items 5000] [--snippets 500]

BEFORE_SRC / AFTER_SRC are `src` directories of two checkouts (e.g. `git worktree add /tmp/before main`, then
/tmp/before/src; AFTER_SRC defaults to this tree's). Each run is a fresh `bench_function.py --rounds 1` (its
own private node) with PYTHONPATH set to the tree, so the node and the worker source it ships into the
sandboxes are that tree's. Prints every run's rows, then per tree and way the median over rounds of ops/s,
p50/p99 ms and CPU-ms per op (node, sandboxes, client) with the range of the sandboxes' figure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROW = re.compile(r"^(?P<way>\S.*?)\s{2,}(?P<rate>\d+)\s+(?P<p50>[\d.-]+)\s+(?P<p99>[\d.-]+)\s+(?P<machine>[\d.]+)\s+"
                 r"(?P<node>[\d.-]+)\s+(?P<calls>[\d.-]+)\s+(?P<client>[\d.-]+)")  # fmt: skip


def run(src: str, args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], float]:
    argv = [sys.executable, str(HERE / "bench_function.py"), "--rounds", "1", "--ways", args.ways]
    argv += ["--calls", str(args.calls), "--map-items", str(args.map_items), "--snippets", str(args.snippets)]
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    rows: dict[str, dict[str, float]] = {}
    load = float(re.search(r"load ([\d.]+)", out).group(1)) if "load" in out else 0.0
    for line in out.splitlines():
        match = ROW.match(line)
        if match and not line.startswith(("way", "python3 -c", "raw fork")):
            rows[match["way"].strip()] = {k: float(v) for k, v in match.groupdict().items() if k != "way" and v != "-"}
    return rows, load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default=str(HERE.parent / "src"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default="shoal call,shoal map,batch iso,run_code")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--map-items", type=int, default=5000)
    parser.add_argument("--snippets", type=int, default=500)
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    results: dict[str, dict[str, list[dict[str, float]]]] = {name: {} for name in trees}
    loads = []
    for round_ in range(args.rounds):
        for name, src in trees.items():
            rows, load = run(src, args)
            loads.append(load)
            for way, row in rows.items():
                results[name].setdefault(way, []).append(row)
                line = (f"round {round_ + 1} {name:<6} load {load:5.1f}  {way:<28} {row['rate']:6.0f}/s  p50 "
                        f"{row.get('p50', 0):6.2f}  p99 {row.get('p99', 0):7.2f}  node {row.get('node', 0):.2f}  "
                        f"sandboxes {row.get('calls', 0):.2f}  client {row.get('client', 0):.2f}")  # fmt: skip
                print(line, flush=True)
    print(f"\nmedians over {args.rounds} alternated rounds, load {min(loads):.1f}-{max(loads):.1f} (CPU ms per op)")
    print(f"{'tree':<7}{'way':<28}{'ops/s':>7}{'p50':>8}{'p99':>8}{'node':>7}{'sandboxes (range)':>22}{'client':>8}")
    for name in trees:
        for way, rows in results[name].items():

            def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                values = [r[key] for r in rows if key in r]
                return statistics.median(values) if values else float("nan")

            boxes = [r["calls"] for r in rows if "calls" in r]
            spread = f"{med('calls'):.2f} ({min(boxes):.2f}-{max(boxes):.2f})" if boxes else "-"
            print(f"{name:<7}{way:<28}{med('rate'):>7.0f}{med('p50'):>8.2f}{med('p99'):>8.2f}{med('node'):>7.2f}"
                  f"{spread:>22}{med('client'):>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
