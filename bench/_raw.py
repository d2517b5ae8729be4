"""Raw-tool loops for the side-by-side benchmarks; run as its own process (it enters a mount namespace).

python bench/_raw.py crun N | crun-exec N | bwrap N     → prints JSON {"seconds": [...], "wall": s}
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoal import cgroups, linux  # noqa: E402
from shoal.images import ImageStore  # noqa: E402
from shoal.images.erofs import mount_image  # noqa: E402
from shoal.substrates.container.oci import bundle_config  # noqa: E402

PARENT = f"shoal-bench-raw-{os.getpid()}"  # per run: benches of other sessions may run at once
WORK = Path("/tmp") / PARENT
ROOT = WORK / "crun-root"
DEVNULL = subprocess.DEVNULL


def enter_runtime_namespace() -> None:
    """What the node does on a hybrid host, so crun runs here exactly as it does under shoal."""
    if cgroups.layout() == "hybrid":
        linux.unshare(linux.CLONE_NEWNS)
        linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
        linux.umount("/sys/fs/cgroup/unified")


def layer() -> str:
    """The busybox layer as a directory: its `fs/` tree, or its EROFS image mounted in this process's
    private mount namespace (gone when the process exits)."""
    image = ImageStore(Path(os.environ.get("SHOAL_IMAGES", "/var/lib/shoal/store"))).get("busybox")
    layer_dir = image.layers[0]
    if (layer_dir / "fs").is_dir():
        return str(layer_dir / "fs")
    target = WORK / "lower"
    if not linux.is_mountpoint(str(target)):
        target.mkdir(parents=True, exist_ok=True)
        mount_image(layer_dir / "fs.erofs", target)
    return str(target)


def bundle(i: int, lower: str) -> Path:
    directory = WORK / f"b{i}"
    for sub in ("rootfs", "upper", "work"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={directory / 'upper'},workdir={directory / 'work'}"
    linux.mount("overlay", str(directory / "rootfs"), "overlay", 0, options)
    config = bundle_config(
        hostname="sandbox", agent_binary="/bin/true", cgroup_path=f"/{PARENT}/c{i}", cpu=None,
        memory_mb=None, pids=1024,
    )  # fmt: skip
    config["mounts"] = [m for m in config["mounts"] if m["destination"] != "/.shoal/agent"]
    config["process"]["args"] = ["/bin/sleep", "1000000"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def unbundle(directory: Path) -> None:
    linux.umount(str(directory / "rootfs"))
    shutil.rmtree(directory)


def crun(*args: str) -> None:
    subprocess.run(["crun", "--root", str(ROOT), *args], stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL, check=True)


def crun_cycle(n: int) -> dict:
    """Same work as shoal's create → exec `true` → close: overlay, crun run -d, crun exec, crun delete."""
    lower, seconds = layer(), []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        directory = bundle(i, lower)
        crun("run", "-d", "--bundle", str(directory), f"raw{i}")
        crun("exec", f"raw{i}", "/bin/true")
        crun("delete", "-f", f"raw{i}")
        unbundle(directory)
        seconds.append(time.perf_counter() - t)
    return {"seconds": seconds, "wall": time.perf_counter() - start}


def cpu_ms() -> float:
    """CPU of this process, the children it reaped and the containers' cgroups so far (as bench_hotpath's
    shoal figure counts shoal's): the raw tools' own cost, not the shared machine's."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return (total + (cgroups.cpu_seconds(f"/{PARENT}") or 0.0)) * 1e3


def crun_create(n: int) -> dict:
    """Just `crun run -d` of a prepared bundle (the runtime's own floor for a cold create); its CPU per run
    (crun and the container's start) and per whole cycle (overlay, run, delete, unmount)."""
    lower, seconds = layer(), []
    run_cpu = 0.0
    start, cpu0 = time.perf_counter(), cpu_ms()
    for i in range(n):
        directory = bundle(i, lower)
        t, c = time.perf_counter(), cpu_ms()
        crun("run", "-d", "--bundle", str(directory), f"raw{i}")
        seconds.append(time.perf_counter() - t)
        run_cpu += cpu_ms() - c
        crun("delete", "-f", f"raw{i}")
        unbundle(directory)
    cycle = (cpu_ms() - cpu0) / n
    return {"seconds": seconds, "wall": time.perf_counter() - start, "cpu_ms": run_cpu / n, "cycle_cpu_ms": cycle}


def crun_exec(n: int) -> dict:
    lower = layer()
    directory = bundle(0, lower)
    crun("run", "-d", "--bundle", str(directory), "rawexec")
    seconds = []
    start = time.perf_counter()
    try:
        for _ in range(n):
            t = time.perf_counter()
            crun("exec", "rawexec", "/bin/true")
            seconds.append(time.perf_counter() - t)
    finally:
        crun("delete", "-f", "rawexec")
        unbundle(directory)
    return {"seconds": seconds, "wall": time.perf_counter() - start}


def bwrap_cycle(n: int) -> dict:
    """bubblewrap running `true` in fresh namespaces over the same (read-only) layer."""
    lower, seconds = layer(), []
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", lower, "/", "--proc", "/proc",
            "--dev", "/dev", "--tmpfs", "/tmp", "/bin/true"]  # fmt: skip
    start, cpu0 = time.perf_counter(), cpu_ms()
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL, check=True)
        seconds.append(time.perf_counter() - t)
    return {"seconds": seconds, "wall": time.perf_counter() - start, "cpu_ms": (cpu_ms() - cpu0) / n}


if __name__ == "__main__":
    mode, count = sys.argv[1], int(sys.argv[2])
    enter_runtime_namespace()
    WORK.mkdir(parents=True, exist_ok=True)
    run = {"crun": crun_cycle, "crun-create": crun_create, "crun-exec": crun_exec, "bwrap": bwrap_cycle}[mode]
    try:
        result = run(count)
    finally:
        cgroups.remove(f"/{PARENT}")  # crun removes each container's cgroup, not the parent it made
        if linux.is_mountpoint(str(WORK / "lower")):
            linux.umount(str(WORK / "lower"))
        shutil.rmtree(WORK, ignore_errors=True)
    print(json.dumps(result))
