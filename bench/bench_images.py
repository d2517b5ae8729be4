"""Image benchmarks: (a) create latency vs image size, (b) disk for many sandboxes of one image, (c) snapshot
time vs bytes written, (d) import and pull throughput next to `skopeo copy`; also 1 vs 3 layers, and mounting
a shared layer vs untarring it per sandbox.

Run as root: `PYTHONPATH=src python bench/bench_images.py [--quick]`. It uses its own node (SHOAL_HOME under
/tmp) and its own store (SHOAL_IMAGES, default /var/lib/shoal-bench/store), and removes both at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import shoal
from shoal.images import ImageConfig, ImageStore, layout, registry
from shoal.images.builtin import build_busybox

MB = 1 << 20


def stats(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return f"median {statistics.median(ordered) * 1000:8.1f} ms  p99 {p99 * 1000:8.1f} ms  (n={len(ordered)})"


def fill_layer(store: ImageStore, size: int, tag: str) -> str:
    """A layer of `size` bytes of incompressible files (64 MiB each at most)."""
    with store.staging() as staging:
        root = staging / "fs"
        (root / "data").mkdir(parents=True)
        left, index = size, 0
        while left > 0:
            chunk = min(left, 64 * MB)
            (root / "data" / f"{tag}-{index}.bin").write_bytes(os.urandom(chunk))
            left -= chunk
            index += 1
        return store.add_layer_dir(root, disposable=True)


def base_layer(store: ImageStore) -> str:
    with store.staging() as staging:
        build_busybox(staging / "fs")
        return store.add_layer_dir(staging / "fs", disposable=True)


def du(path: Path) -> int:
    """Bytes of disk used below `path`, not crossing mount points."""
    done = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.stdout else 0


def create_latency(client: shoal.Client, image: str, runs: int, **options: object) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        sb = client.create("container", image=image, pool=False, **options)
        samples.append(time.perf_counter() - start)
        sb.close()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes and few runs (a smoke test)")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    sizes = [10 * MB, 100 * MB, 300 * MB] if args.quick else [10 * MB, 500 * MB, 2048 * MB]
    runs = 10 if args.quick else args.runs
    many, many_size = (20, 100 * MB) if args.quick else (100, 1024 * MB)
    images = Path(os.environ.get("SHOAL_IMAGES", "/var/lib/shoal-bench/store"))
    home = Path(tempfile.mkdtemp(prefix="shoal-bench-img-"))
    os.environ.update(SHOAL_IMAGES=str(images), SHOAL_HOME=str(home), SHOAL_CGROUP_PARENT=f"shoal-bench-{os.getpid()}")
    store = ImageStore(images)
    out: dict[str, object] = {}
    print(f"store {images} (EROFS: {shoal.images.erofs.supported()}), node home {home}")
    base = base_layer(store)
    config = ImageConfig(env={"PATH": "/bin"})
    try:
        with shoal.Client(home=str(home)) as client:
            # (a) create latency against image size
            print("\n(a) create + close latency by image size (mounted EROFS layers, no pool; sizes interleaved)")
            names = []
            for size in sizes:
                name = f"bench-{size // MB}m"
                t0 = time.perf_counter()
                store.commit(name, [base, fill_layer(store, size, name)], config)
                print(f"  prepared {name} in {time.perf_counter() - t0:.1f} s")
                names.append(name)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(runs):
                for name in names:
                    samples[name] += create_latency(client, name, 1)
            for size, name in zip(sizes, names, strict=True):
                out[f"create_{size // MB}MB"] = statistics.median(samples[name])
                print(f"  {size // MB:5d} MB  {stats(samples[name])}")
            small, large = out[f"create_{sizes[0] // MB}MB"], out[f"create_{sizes[-1] // MB}MB"]
            print(f"  largest / smallest median: {large / small:.2f}x (target <= 1.2x)")  # type: ignore[operator]

            # 1 vs 3 layers
            print("\ncreate latency, 1 vs 3 layers")
            extra = [fill_layer(store, MB, f"x{i}") for i in range(2)]
            store.commit("bench-3l", [base, *extra], config)
            store.commit("bench-1l", [base], config)
            for name in ("bench-1l", "bench-3l"):
                print(f"  {name}: {stats(create_latency(client, name, runs))}")

            # mount a shared layer vs untar per sandbox
            print(f"\nper-sandbox root filesystem: shared mount (above) vs untar of the {sizes[1] // MB} MB layer")
            info = store.layer_info(store.get(f"bench-{sizes[1] // MB}m").layer_ids[-1])
            untar = []
            for _ in range(min(runs, 5)):
                target = Path(tempfile.mkdtemp(dir=images.parent))
                t0 = time.perf_counter()
                with tarfile.open(store.blob_path(info.blob)) as archive:
                    archive.extractall(target, filter="tar")
                os.sync()
                untar.append(time.perf_counter() - t0)
                shutil.rmtree(target)
            print(f"  untar  {stats(untar)}")

            # (b) disk for many sandboxes of one image
            print(f"\n(b) disk used by {many} sandboxes of one {many_size // MB} MB image, each writing 1 MB")
            store.commit("bench-many", [base, fill_layer(store, many_size, "many")], config)
            store_before = du(images)
            sandboxes = client.create_many(many, image="bench-many", pool=False, concurrency=8)
            live = [s for s in sandboxes if not isinstance(s, Exception)]
            for sb in live:
                sb.exec("head -c 1048576 /dev/urandom > /root/w")
            per_sandbox = du(home / "sandboxes")  # upper dirs and state; -x: not the mounted root filesystems
            store_growth = du(images) - store_before
            print(f"  store: {du(images) / MB:.0f} MB in all (grew {store_growth / MB:.1f} MB while they ran)")
            print(f"  {len(live)} sandboxes: {per_sandbox / MB:.1f} MB of private state for {len(live)} MB written")
            print(f"  (one untarred copy per sandbox would need {len(live) * many_size / MB / 1024:.1f} GB)")
            out["many_private_MB"] = per_sandbox / MB
            for sb in live:
                sb.close()

            # (c) snapshot time against bytes written
            print("\n(c) snapshot time against bytes written (image: the largest one)")
            for written in (1, 10, 100):
                with client.create("container", image=f"bench-{sizes[-1] // MB}m", pool=False) as sb:
                    sb.exec(f"head -c {written * MB} /dev/urandom > /root/w")
                    t0 = time.perf_counter()
                    sb.snapshot(f"bench-snap-{written}")
                    took = time.perf_counter() - t0
                print(f"  {written:4d} MB written: {took * 1000:8.1f} ms")
                out[f"snapshot_{written}MB"] = took

            # (d) import and pull throughput next to skopeo
            print(f"\n(d) import / pull of the {sizes[1] // MB} MB image next to `skopeo copy` (same run)")
            work = Path(tempfile.mkdtemp(dir=images.parent))
            name = f"bench-{sizes[1] // MB}m"
            layout.export_archive(store, name, work / "oci")
            total = sum(store.layer_info(d).size for d in store.get(name).layer_ids)
            fresh = ImageStore(work / "fresh")
            t0 = time.perf_counter()
            layout.import_archive(fresh, work / "oci", "imported")
            ours = time.perf_counter() - t0
            t0 = time.perf_counter()
            oci_ref = f"oci:{work / 'oci'}:{name}"
            subprocess.run(["skopeo", "copy", "-q", oci_ref, f"dir:{work / 'skopeo-dir'}"], check=True)
            theirs = time.perf_counter() - t0
            print(f"  import (verify + unpack + mkfs.erofs): {total / MB / ours:7.1f} MB/s ({ours:.2f} s)")
            print(f"  skopeo copy oci: -> dir: (verify only):  {total / MB / theirs:7.1f} MB/s ({theirs:.2f} s)")
            server = shutil.which("docker-registry")
            if server:
                pull_bench(store, name, work, server, total)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        lock = home / "node.lock"
        pid = int(lock.read_text() or 0) if lock.exists() else 0
        if pid:
            os.kill(pid, 15)  # our own node: it closes its sandboxes and unmounts its layers
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
        shutil.rmtree(home, ignore_errors=True)
        for hierarchy in Path("/sys/fs/cgroup").iterdir():  # the (empty) cgroup parent our node made
            try:
                (hierarchy / os.environ["SHOAL_CGROUP_PARENT"]).rmdir()
            except OSError:
                pass
        for name in store.present():
            if name.startswith("bench-"):
                store.remove(name)
        store.prune()
    print("\n" + json.dumps(out))
    return 0


def pull_bench(store: ImageStore, name: str, work: Path, server: str, total: int) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (work / "reg").mkdir()
    (work / "reg.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {work / 'reg'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen(
        [server, "serve", str(work / "reg.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(1)
        ref = f"127.0.0.1:{port}/bench/img:v1"
        registry.push(store, name, ref)
        fresh = ImageStore(work / "pulled")
        t0 = time.perf_counter()
        registry.pull(fresh, ref)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(
            ["skopeo", "copy", "-q", "--src-tls-verify=false", f"docker://{ref}", f"dir:{work / 'skopeo-pull'}"],
            check=True,
        )
        theirs = time.perf_counter() - t0
        print(f"  pull (download + verify + unpack + mkfs.erofs): {total / MB / ours:7.1f} MB/s ({ours:.2f} s)")
        print(f"  skopeo copy docker:// -> dir: (download + verify): {total / MB / theirs:7.1f} MB/s ({theirs:.2f} s)")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
