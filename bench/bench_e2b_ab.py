"""Before/after of the E2B API served inside a node, on a shared, noisy machine: two nodes (one per source
tree), each serving E2B's API in its own process (SHOAL_E2B), the same loops alternated round by round so both
meet the same load.

    PYTHONPATH=src python bench/bench_e2b_ab.py BEFORE_SRC [AFTER_SRC] [--rounds 4] [--n 50]

BEFORE_SRC / AFTER_SRC are `src` directories of two checkouts (`git archive <commit> src | tar -x -C /tmp/b`;
AFTER_SRC defaults to this tree's). Per node, per round: the E2B SDK's `commands.run("true")` through the API
in that node, and shoal's native streamed exec of the same argv (what the layer's cost is measured against),
`n` times each, and the same through that tree's own `shoal e2b serve` (a client of that node), the six
rows taking turns op by op.
Prints p50/p99 and CPU-ms per op (utime+stime from /proc: of the node process, and of the serve process for
the serve rows) per variant, and the layer's cost (E2B row minus native row) per variant with the 2 ms target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_seconds, pct  # noqa: E402

import shoal  # noqa: E402
from shoal.cluster.local import LocalCluster  # noqa: E402
from shoal.e2b.local import LocalE2B  # noqa: E402

SDK_ARGV = ["/bin/bash", "-l", "-c", "true"]  # what e2b's commands.run("true") asks envd to start
TARGET_MS = 2.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--n", type=int, default=50)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-e2b-ab-"))
    saved = os.environ.get("PYTHONPATH")
    clusters: dict[str, LocalCluster] = {}
    serves: dict[str, LocalE2B] = {}
    try:
        os.environ["SHOAL_E2B"] = "127.0.0.1:0"
        for name, src in (("before", args.before), ("after", args.after)):
            os.environ["PYTHONPATH"] = src  # the node process runs this tree
            clusters[name] = LocalCluster(workdir / name, nodes=1, prefix=f"ab{name[0]}")
        os.environ.pop("SHOAL_E2B", None)
        for name, src in (("before", args.before), ("after", args.after)):
            os.environ["PYTHONPATH"] = src  # and so does its `shoal e2b serve`
            serves[name] = LocalE2B(f"shoal://{clusters[name].nodes[0].address}", workdir, f"e2b-{name}")
    finally:
        os.environ.pop("SHOAL_E2B", None)
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
    from e2b import Sandbox

    try:
        rows: dict[str, object] = {}
        pids: dict[str, int] = {}
        handles = []
        for name, lc in clusters.items():
            token = lc.project_tokens["default"]
            url = "http://" + (lc.nodes[0].home / "node.e2b").read_text().strip()
            sbx = Sandbox.create(template="base", timeout=900, api_url=url, sandbox_url=url, api_key=token)
            served = serves[name].url
            sbx_serve = Sandbox.create(template="base", timeout=900, api_url=served, sandbox_url=served, api_key=token)
            client = shoal.Client(f"shoal://{lc.nodes[0].address}", token=token)
            native = client.create(image="debian", ttl_s=900)
            handles.append((sbx, client, native))
            handles.append((sbx_serve, None, None))
            rows[f"{name:<6} e2b commands.run('true')"] = sbx.commands.run
            rows[f"{name:<6} e2b via shoal e2b serve"] = sbx_serve.commands.run
            rows[f"{name:<6} native exec(bash -l -c true, streamed)"] = lambda n=native: n.exec(
                SDK_ARGV, on_stdout=print
            )
            pids[f"{name:<6} e2b commands.run('true')"] = lc.nodes[0].pid
            pids[f"{name:<6} e2b via shoal e2b serve"] = serves[name].proc.pid  # the serve process's CPU
            pids[f"{name:<6} native exec(bash -l -c true, streamed)"] = lc.nodes[0].pid
        times: dict[str, list[float]] = {k: [] for k in rows}
        cpu: dict[str, list[float]] = {k: [] for k in rows}
        for key, fn in rows.items():
            fn("true") if "e2b" in key else fn()  # warm up
        for r in range(args.rounds):
            used = dict.fromkeys(rows, 0.0)
            for _ in range(args.n):  # op by op, row after row: a burst of load falls on every row alike
                for key, fn in rows.items():
                    c0 = cpu_seconds(pids[key])
                    t = time.perf_counter()
                    fn("true") if "e2b" in key else fn()
                    times[key].append(time.perf_counter() - t)
                    used[key] += cpu_seconds(pids[key]) - c0
            for key in rows:
                cpu[key].append(used[key] / args.n * 1e3)
            layer = []  # this round's layer cost per variant: the quiet rounds of a noisy run show here
            for name in clusters:
                e2b, native = (
                    times[f"{name:<6} e2b commands.run('true')"],
                    times[f"{name:<6} native exec(bash -l -c true, streamed)"],
                )
                extra = statistics.median(e2b[-args.n :]) - statistics.median(native[-args.n :])
                served = statistics.median(times[f"{name:<6} e2b via shoal e2b serve"][-args.n :])
                layer.append(
                    f"{name} {extra * 1e3:+.2f} (serve {(served - statistics.median(native[-args.n :])) * 1e3:+.2f}) ms"
                )
            print(
                f"round {r + 1}/{args.rounds}: load {os.getloadavg()[0]:.1f}; layer p50 {', '.join(layer)}", flush=True
            )
        p50 = {}
        for key in rows:
            p50[key] = statistics.median(times[key]) * 1e3
            per_round = " ".join(f"{c:.2f}" for c in cpu[key])
            print(
                f"  {key:<46} p50 {p50[key]:7.2f} ms  p99 {pct(times[key], 0.99) * 1e3:7.2f} ms"
                f"  {'serve' if 'serve' in key else 'node'} CPU-ms/op {statistics.mean(cpu[key]):5.2f}"
                f" (rounds: {per_round})"
            )
        for name in clusters:
            e2b, native = f"{name:<6} e2b commands.run('true')", f"{name:<6} native exec(bash -l -c true, streamed)"
            extra = p50[e2b] - p50[native]
            extra_cpu = statistics.mean(cpu[e2b]) - statistics.mean(cpu[native])
            verdict = "met" if extra <= TARGET_MS else "not met"
            print(
                f"  -> {name}: the layer in the node adds {extra:+.2f} ms p50 ({verdict}), {extra_cpu:+.2f} node CPU-ms"
            )
            served = p50[f"{name:<6} e2b via shoal e2b serve"] - p50[native]
            verdict = "met" if served <= TARGET_MS else "not met"
            print(f"  -> {name}: through `shoal e2b serve` it adds {served:+.2f} ms p50 ({verdict})")
        for sbx, client, native in handles:
            sbx.kill()
            if native is not None:
                native.close()
                client.close()
    finally:
        for server in serves.values():
            server.stop()
        for lc in clusters.values():
            lc.stop()


if __name__ == "__main__":
    main()
