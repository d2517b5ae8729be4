"""A container start's fixed costs (issue 12): the runtime run from one sealed copy, cgroup joins without an
RCU wait, the seccomp filter compiled once. Their speed is measured in bench/ (bench_hotpath_ab.py --only
create,conc); these check that each keeps what it must: the runtime's copy can never be written, the host's
cgroup mount keeps its options, the precompiled filter is the very program crun makes of the profile."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal import cgroups, spawn
from shoal.substrates.container.runtime import SEALS, OciRuntime, sealed_copy
from shoal.substrates.container.seccomp import seccomp_bpf_base64


def test_the_runtimes_sealed_copy_runs_and_cannot_be_written(tmp_path: Path) -> None:
    binary = shutil.which("crun")
    assert binary, "make setup installs crun"
    path = sealed_copy(binary)
    fd = int(path.rsplit("/", 1)[1])
    # exactly the seals crun (and runc) check on /proc/self/exe before they skip copying themselves
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
    assert os.fstat(fd).st_size == os.stat(binary).st_size
    writable = os.open(path, os.O_RDWR)
    try:
        for change in (lambda: os.pwrite(writable, b"x", 0), lambda: os.ftruncate(writable, 1)):
            with pytest.raises(PermissionError):
                change()
    finally:
        os.close(writable)
    log = tmp_path / "version.log"
    assert asyncio.run(spawn.run([path, "--version"], log_path=str(log))) == 0
    assert "crun version" in log.read_text()
    assert sealed_copy(binary) == path  # one copy per node process, not one per create
    assert OciRuntime.find("crun", tmp_path).binary == path


def test_runsc_is_never_run_from_a_copy(tmp_path: Path) -> None:
    if shutil.which("runsc") is None:
        pytest.skip("gVisor (runsc) is not installed here")
    assert OciRuntime.find("runsc", tmp_path).binary == shutil.which("runsc")


def _cgroup2_options() -> tuple[str, list[str], set[str]] | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            fields = left.split()
            return fields[4], fields[5].split(","), set(right.split()[2].split(","))
    return None


def test_favordynmods_is_set_then_cleared_and_every_other_cgroup2_option_kept() -> None:
    before = _cgroup2_options()
    if before is None:
        pytest.skip("this host mounts no cgroup2 (pure cgroup v1): nothing to tune")
    was_on = "favordynmods" in before[2]
    try:
        said = cgroups.favor_dynamic_modifications(True)
        after = _cgroup2_options()
        assert after is not None and after[0] == before[0]
        assert after[1] == before[1], said  # nosuid, nodev, noexec, relatime... as they were
        assert after[2] - {"favordynmods"} == before[2] - {"favordynmods"}, said  # nsdelegate etc. kept
        if "favordynmods" not in after[2]:  # kernels before 6.0, or a host whose cgroup core this one cannot tune
            assert "remounted" not in said, said
            pytest.skip(f"this kernel ({platform.release()}) or host does not take favordynmods: {said}")
        assert "already" in cgroups.favor_dynamic_modifications(True)  # a second node leaves it alone
        assert _cgroup2_options() == after
        said = cgroups.favor_dynamic_modifications(False)
        cleared = _cgroup2_options()
        assert cleared is not None and "favordynmods" not in cleared[2], said
        assert cleared[1] == before[1] and cleared[2] - {"favordynmods"} == before[2] - {"favordynmods"}
    finally:  # the host as the test found it
        cgroups.favor_dynamic_modifications(was_on)
    assert _cgroup2_options() == before


def test_favordynmods_without_cgroup2_changes_nothing(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 0:21 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n")
    assert "no cgroup2" in cgroups.favor_dynamic_modifications(True, str(mountinfo))


# Runs crun on a bundle whose filter crun compiles itself from the profile (no annotation): prints the
# container's pid, waits for a line on stdin, deletes it. Its own process: a hybrid host needs the
# cgroup2 unmounted in crun's mount namespace, as the node does.
CRUN_FROM_PROFILE = r"""
import json, os, subprocess, sys
from shoal import cgroups, linux
from shoal.substrates.container.oci import bundle_config
bundle, parent = sys.argv[1], sys.argv[2]
if cgroups.layout() == "hybrid":
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.umount("/sys/fs/cgroup/unified")
config = bundle_config(hostname="t", agent_binary="/bin/true", cgroup_path=f"/{parent}/c", cpu=None,
                       memory_mb=None, pids=64)
config["annotations"] = {}
config["mounts"] = [m for m in config["mounts"] if m["destination"] != "/.shoal/agent"]
config["process"]["args"] = ["/busybox", "sleep", "600"]
open(f"{bundle}/config.json", "w").write(json.dumps(config))
crun = ["crun", "--root", f"{bundle}/state"]
subprocess.run([*crun, "run", "-d", "--pid-file", f"{bundle}/pid", "--bundle", bundle, "t"], check=True)
try:
    print(open(f"{bundle}/pid").read().strip(), flush=True)
    sys.stdin.readline()
finally:
    subprocess.run([*crun, "delete", "-f", "t"])
    cgroups.remove(f"/{parent}")
"""


def _seccomp_filter(pid: int) -> bytes:
    """The (only) seccomp filter of `pid`, as the kernel holds it (PTRACE_SECCOMP_GET_FILTER)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    assert libc.ptrace(16, pid, None, None) == 0, os.strerror(ctypes.get_errno())  # PTRACE_ATTACH
    try:
        os.waitpid(pid, 0x40000000)  # __WALL: the tracee stopped
        buffer = ctypes.create_string_buffer(8 * 4096)
        count = libc.ptrace(0x420C, pid, None, buffer)  # PTRACE_SECCOMP_GET_FILTER, the newest filter
        assert count > 0, os.strerror(ctypes.get_errno())
        return buffer.raw[: count * 8]
    finally:
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH


def test_the_precompiled_filter_is_the_one_crun_compiles_from_the_profile(tmp_path: Path) -> None:
    bpf = seccomp_bpf_base64()
    assert bpf, "libseccomp (crun's own dependency) compiles the profile"
    (tmp_path / "rootfs").mkdir()
    shutil.copy("/bin/busybox", tmp_path / "rootfs" / "busybox")  # busybox-static, from make setup
    parent = f"shoal-test-launch-{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=str(Path(cgroups.__file__).parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-c", CRUN_FROM_PROFILE, str(tmp_path), parent],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 60  # `run -d` returns before the container has loaded its filter
        while "Seccomp:\t2" not in Path(f"/proc/{pid}/status").read_text():
            assert time.monotonic() < deadline, "the container never loaded a seccomp filter"
            time.sleep(0.01)
        while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != b"/busybox":
            assert time.monotonic() < deadline, "the container never started"
            time.sleep(0.01)
        assert _seccomp_filter(pid) == base64.b64decode(bpf)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        assert proc.wait(timeout=120) == 0
