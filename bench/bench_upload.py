"""Uploading a source tree into a sandbox: one tar stream (`files.upload`) against one request per file.

    PYTHONPATH=src .venv/bin/python bench/bench_upload.py [--files 1794] [--rounds 5]

Ways, interleaved per round (load from other users hits all alike); wall time per upload, p50/p99 over
rounds, and the client process's CPU-ms per upload:
- shoal upload (tar)   `sb.files.upload(dir, dest)`: the tree as tar stream(s), unpacked by the agent
- shoal per-file       `sb.files.write` for every file (what upload did before), 16 at a time
- raw tar | exec       `tar -c` on the host piped into `tar -x` in the sandbox via exec stdin (the floor
                       for "one stream" through the same node, using the image's own tar)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import resource
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from _common import BenchNode, pct

import shoal


def make_tree(root: Path, files: int) -> None:
    for i in range(files):
        path = root / f"pkg{i % 23}" / f"mod{i % 7}" / f"file{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# file {i}\n" + "x = 1\n" * (i % 40))


def cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1e3


async def per_file(sb: shoal.AsyncSandbox, root: Path, dest: str) -> None:
    paths = [p for p in sorted(root.rglob("*")) if p.is_file()]
    for start in range(0, len(paths), 16):
        batch = paths[start : start + 16]
        await asyncio.gather(*(sb.files.write(f"{dest}/{p.relative_to(root)}", p.read_bytes()) for p in batch))


async def raw_tar(sb: shoal.AsyncSandbox, root: Path, dest: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(root, arcname=".")
    result = await sb.exec(f"mkdir -p {dest} && tar -x -C {dest}", stdin=buffer.getvalue(), timeout=120)
    assert result.exit_code == 0, result.stderr


async def main(files: int, rounds: int) -> None:
    node = BenchNode("upload")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "tree"
            make_tree(root, files)
            async with shoal.AsyncClient() as client:
                sb = await client.create(image="debian", pool=False, ttl_s=1800)
                try:
                    ways = {
                        "shoal upload (tar)": lambda d: sb.files.upload(str(root), d),
                        "shoal per-file": lambda d: per_file(sb, root, d),
                        "raw tar | exec tar -x": lambda d: raw_tar(sb, root, d),
                    }
                    times: dict[str, list[float]] = {w: [] for w in ways}
                    cpu: dict[str, list[float]] = {w: [] for w in ways}
                    for r in range(rounds):
                        for i, (name, way) in enumerate(ways.items()):
                            dest = f"/work/r{r}w{i}"
                            c0, t0 = cpu_ms(), time.perf_counter()
                            await way(dest)
                            times[name].append(time.perf_counter() - t0)
                            cpu[name].append(cpu_ms() - c0)
                            await sb.exec(f"rm -rf {dest}")
                    print(f"upload of {files} files ({rounds} rounds, os.cpu_count()={os.cpu_count()}):")
                    for name in ways:
                        p50, p99 = statistics.median(times[name]), pct(times[name], 0.99)
                        print(f"  {name:<24} p50 {p50 * 1e3:8.1f} ms  p99 {p99 * 1e3:8.1f} ms  "
                              f"client CPU {statistics.median(cpu[name]):7.1f} ms")  # fmt: skip
                finally:
                    await sb.close()
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=1794)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.files, args.rounds))
