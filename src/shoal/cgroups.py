"""The cgroup tree as shoal sees it: v1 (one hierarchy per controller) or v2 (unified).

The OCI runtime creates and limits each sandbox's cgroup from the bundle; the node uses this module to
read what happened (OOM kills), to freeze, and to remove what a crashed runtime left behind.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

from shoal import linux

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "cpuset", "freezer", "devices", "blkio")


@functools.cache
def layout() -> str:
    """'v2' (unified), 'hybrid' (v1 with an empty cgroup2 at unified/), or 'v1'.

    Asked on every exec and close: looked up once (a host does not change its cgroup layout under a running
    process)."""
    if (ROOT / "cgroup.controllers").exists():
        return "v2"
    if (ROOT / "unified" / "cgroup.controllers").exists():
        return "hybrid"
    return "v1"


def candidate_dirs(path: str) -> list[str]:
    """Where cgroup `path` (e.g. '/shoal/<id>') is in each hierarchy, whether it exists or not."""
    rel = path.lstrip("/")
    if layout() == "v2":
        return [f"{ROOT}/{rel}"]
    return [f"{ROOT}/{c}/{rel}" for c in (*V1_CONTROLLERS, "systemd")]


def sandbox_dirs(path: str) -> list[Path]:
    """Every directory of cgroup `path` (e.g. '/shoal/<id>') that exists now."""
    return [Path(p) for p in candidate_dirs(path) if os.path.isdir(p)]


def _oom_file(path: str) -> str:
    rel = path.lstrip("/")
    return f"{ROOT}/{rel}/memory.events" if layout() == "v2" else f"{ROOT}/memory/{rel}/memory.oom_control"


def oom_kills(path: str) -> int:
    """How many times the kernel's OOM killer has killed a process in this cgroup.

    Read twice per exec (before and after): three syscalls and a bytes search, no file object (Python's
    open() in text mode costs more than the kernel's answer)."""
    try:
        fd = os.open(_oom_file(path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        text = os.read(fd, 4096)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return oom_kill_count(text)


def open_oom_counter(path: str) -> int | None:
    """An fd on the file `oom_kills` reads, for `oom_kills_of`: one pread per read, not an open, a read and a
    close (17 vs 2 µs; the node reads it twice per exec). None if it cannot be opened. The caller closes it
    when the cgroup goes (an open fd keeps the removed cgroup's file alive)."""
    try:
        return os.open(_oom_file(path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def oom_kills_of(fd: int) -> int:
    """`oom_kills` through an fd from `open_oom_counter` (a cgroup file reads anew from offset 0)."""
    try:
        return oom_kill_count(os.pread(fd, 4096, 0))
    except OSError:
        return 0


def oom_kill_count(text: bytes) -> int:
    """The `oom_kill N` line of memory.events (v2) or memory.oom_control (v1); 0 if there is none."""
    at = 0 if text.startswith(b"oom_kill ") else text.find(b"\noom_kill ") + 1
    if at == 0 and not text.startswith(b"oom_kill "):
        return 0
    end = text.find(b"\n", at)
    return int(text[at + 9 : end if end >= 0 else len(text)])


def set_parent_cpu_weight(path: str, cpus: float) -> Path | None:
    """Create the sandboxes' parent cgroup `path` in the cpu hierarchy and weigh it like `cpus` busy host
    processes, so sandboxes together compete with the host's processes as that many of them would (made by
    the runtime, the parent would weigh as one process for all sandboxes). Returns the file written."""
    rel = path.strip("/")
    if layout() == "v2":
        directory, name, value = ROOT / rel, "cpu.weight", max(1, min(10000, round(100 * cpus)))
    else:
        directory, name, value = ROOT / "cpu" / rel, "cpu.shares", max(2, min(262144, round(1024 * cpus)))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(str(value))
    except OSError:  # no cpu controller here (v2 without it delegated): the runtime's defaults stand
        return None
    return directory / name


def pids_current(path: str) -> int | None:
    """How many tasks the cgroup holds now (pids controller), or None if it cannot be read."""
    rel = path.lstrip("/")
    base = ROOT / rel if layout() == "v2" else ROOT / "pids" / rel
    try:
        return int((base / "pids.current").read_text())
    except (OSError, ValueError):
        return None


def memory_current(path: str) -> int | None:
    """Bytes charged to the cgroup's memory now (memory.current; v1 memory.usage_in_bytes), or None."""
    rel = path.lstrip("/")
    file = ROOT / rel / "memory.current" if layout() == "v2" else ROOT / "memory" / rel / "memory.usage_in_bytes"
    try:
        return int(file.read_text())
    except (OSError, ValueError):
        return None


def cpu_seconds(path: str) -> float | None:
    """CPU time the cgroup's tasks have used, in seconds (v2 cpu.stat usage_usec; v1 cpuacct.usage), or None."""
    rel = path.lstrip("/")
    try:
        if layout() == "v2":
            for line in (ROOT / rel / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return None
        return int((ROOT / "cpuacct" / rel / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


def usage(path: str) -> dict[str, int | float | None]:
    """What the cgroup uses now: memory charged (bytes), CPU time (s), tasks; None for what cannot be read."""
    return {"memory_bytes": memory_current(path), "cpu_s": cpu_seconds(path), "pids": pids_current(path)}


def procs(path: str) -> list[int]:
    found: set[int] = set()
    for directory in sandbox_dirs(path):
        try:
            found.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return sorted(found)


def remove(path: str) -> None:
    """Kill whatever is left in the cgroup and remove its directories (children first).

    The common case is an empty cgroup with no children (the sandbox's init is dead and the kernel killed
    the rest of its PID namespace): one rmdir per hierarchy, nothing read or listed. Only a directory the
    kernel refuses to remove (tasks still exiting, child cgroups) is looked into."""
    busy = []
    for directory in candidate_dirs(path):
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            pass
        except OSError:
            busy.append(directory)
    if not busy:
        return
    for pid in procs(path):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    for directory in busy:
        _remove_tree(directory)


def _remove_tree(directory: str) -> None:
    """rmdir `directory` after its child cgroups (only directories: a cgroup's files go with it)."""
    try:
        children = [entry.path for entry in os.scandir(directory) if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for child in children:
        _remove_tree(child)
    _rmdir(directory)


def _rmdir(directory: str) -> None:
    for _ in range(50):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # EBUSY while killed tasks exit; anything else: left for the next reconcile
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                return
            time.sleep(0.01)


# Per-mount flags of a mountinfo line that a remount must repeat (mount(2) resets those it is not given)
_MOUNT_FLAGS = {"ro": 0x1, "nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "noatime": 0x400, "nodiratime": 0x800,
                "relatime": 0x200000, "strictatime": 0x1000000}  # fmt: skip
_MS_REMOUNT = 0x20


def favor_dynamic_modifications(on: bool = True, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Set (or clear) cgroup2's `favordynmods` on this host, keeping every other option; what happened.

    Why: moving a process into a cgroup takes the kernel's cgroup_threadgroup_rwsem for writing, which
    without this flag may wait for an RCU grace period (once a grace period has passed since the last
    join: a node starting sandboxes now and then). One `crun run -d` traced here waited 14 ms in its first
    cgroup.procs write; with other containers starting all the time the wait mostly vanishes, and
    alternated runs at load 4-11 showed no steady gain, hence opt-in (SHOAL_CGROUP_FAVOR_DYNMODS=1). The
    flag makes the lock a plain rwsem that fork and exit take for reading. It is one flag of the kernel's
    cgroup core, shared by every hierarchy (v1's too), so remounting the cgroup2 mount is enough on a
    hybrid host. Kernels before 6.0 do not know it: nothing changes then.
    """
    with open(mountinfo) as handle:
        lines = handle.read().splitlines()
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3 or tail[0] != "cgroup2":
            continue
        target, mount_opts, super_opts = fields[4], fields[5].split(","), tail[2].split(",")
        if ("favordynmods" in super_opts) == on:
            return f"cgroup2 at {target} already has favordynmods {'on' if on else 'off'}"
        flags = _MS_REMOUNT
        for opt in mount_opts:
            flags |= _MOUNT_FLAGS.get(opt, 0)
        kept = [o for o in super_opts if o not in ("rw", "ro", "favordynmods")]
        data = ",".join(kept + ["favordynmods"] if on else kept)
        try:
            linux.mount("cgroup2", target.encode().decode("unicode_escape"), "cgroup2", flags, data)
        except OSError as exc:
            return f"cgroup2 at {target} keeps its options ({exc.strerror})"
        if ("favordynmods" in Path(mountinfo).read_text()) != on:  # e.g. in a cgroup namespace: accepted, ignored
            return f"cgroup2 at {target} did not take the change here"
        return f"cgroup2 at {target} remounted with favordynmods {'on' if on else 'off'}"
    return "no cgroup2 mounted here"


def freeze(path: str, frozen: bool, timeout: float = 30.0) -> None:
    """Freeze (or thaw) every task of cgroup `path` and wait until the kernel says it is so.

    For sandboxes no OCI runtime made (runtime="shoal"): `crun pause` writes the same file. A v1 freezer
    passes through FREEZING while tasks stop; it is polled until FROZEN (or THAWED)."""
    rel = path.strip("/")
    if layout() == "v2":
        name, value, done = ROOT / rel / "cgroup.freeze", "1" if frozen else "0", None
    else:
        name, value = ROOT / "freezer" / rel / "freezer.state", "FROZEN" if frozen else "THAWED"
        done = value
    name.write_text(value)
    deadline = time.monotonic() + timeout
    while done is not None and name.read_text().strip() != done:
        if time.monotonic() > deadline:
            raise OSError(errno.EBUSY, f"cgroup {path} did not become {done} within {timeout:.0f} s")
        name.write_text(value)  # v1: a write retries tasks that could not be frozen yet
        time.sleep(0.002)
