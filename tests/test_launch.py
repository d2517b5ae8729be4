"""A container start's fixed costs (issue 12): the runtime run from one sealed copy, cgroup joins without an
RCU wait, the seccomp filter compiled once. Their speed is measured in bench/ (bench_hotpath_ab.py --only
create,conc); these check that each keeps what it must: the runtime's copy can never be written, the host's
cgroup mount keeps its options, the precompiled filter answers every syscall as the program crun makes of
the profile does."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import fcntl
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal import cgroups, spawn
from shoal.substrates.container.runtime import SEALS, OciRuntime, sealed_copy
from shoal.substrates.container.seccomp import (
    CLONE_NAMESPACE_FLAGS,
    DENIED_SYSCALLS,
    PTRACE_ATTACH,
    PTRACE_SEIZE,
    compile_bpf,
    seccomp_bpf_base64,
    seccomp_profile,
)


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


# The architectures the profile names (AUDIT_ARCH_*), and the arguments its rules look at: every namespace
# flag of clone, alone and together, and ptrace's requests, each beside values that differ in one bit
_AUDIT_ARCHES = (0xC000003E, 0x40000003, 0x4000003E)
_ARGUMENTS = sorted(
    {0, 1, 0x11, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, sum(CLONE_NAMESPACE_FLAGS.values())}
    | {v ^ bit for v in (*CLONE_NAMESPACE_FLAGS.values(), PTRACE_ATTACH, PTRACE_SEIZE) for bit in (0, 1, 1 << 32)}
)


def _run_bpf(program: bytes, nr: int, arch: int, arg: int) -> tuple[int, bool]:
    """What classic BPF seccomp `program` answers for syscall `nr` of `arch` with every argument `arg`, and
    whether it looked at an argument: the instructions libseccomp emits (loads of seccomp_data words, AND,
    JEQ/JGT/JGE/JSET, RET); any other fails the test."""
    words = struct.pack("<iI", nr, arch) + b"\0" * 8 + struct.pack("<Q", arg) * 6  # nr, arch, ip, args[6]
    acc, pc, looked = 0, 0, False
    while True:
        code, jt, jf, k = struct.unpack_from("<HBBI", program, pc * 8)
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc, looked = struct.unpack_from("<I", words, k)[0], looked or k >= 16
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ, JGT, JGE, JSET with K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k, looked
        else:
            raise AssertionError(f"instruction {code:#x} at {pc - 1}: not one libseccomp emits")


def _assert_same_answers(ours: bytes, reference: bytes) -> int:
    """Both filters answer alike for every syscall number of every architecture (x32's have bit 30 set), with
    every argument value of _ARGUMENTS where either looks at an argument; how many answers refuse."""
    refused = 0
    for arch in _AUDIT_ARCHES:
        for nr in [*range(-1, 1100), *range(0x40000000, 0x40000400)]:
            (answer, looked), (expected, looked_there) = _run_bpf(ours, nr, arch, 0), _run_bpf(reference, nr, arch, 0)
            assert answer == expected, (hex(arch), nr)
            for arg in _ARGUMENTS if looked or looked_there else ():
                answer, expected = _run_bpf(ours, nr, arch, arg)[0], _run_bpf(reference, nr, arch, arg)[0]
                assert answer == expected, (hex(arch), nr, hex(arg))
                refused += answer != 0x7FFF0000
            refused += answer != 0x7FFF0000
    return refused


def test_the_filter_decides_as_a_linear_one_and_is_a_tree() -> None:
    """No host needed: the precompiled filter (syscall numbers in a binary tree, a cheaper load) answers as
    libseccomp's linear list of the same profile (crun's layout) for every syscall of every architecture."""
    tree = base64.b64decode(seccomp_bpf_base64() or "")
    linear = compile_bpf(seccomp_profile(), optimize=False)
    assert tree != linear
    assert _assert_same_answers(tree, linear) > 3 * len(DENIED_SYSCALLS)  # refuses on every architecture
    assert _run_bpf(tree, 165, 0xC000003E, 0) == (0x00050001, False)  # mount: EPERM
    assert _run_bpf(tree, 56, 0xC000003E, CLONE_NAMESPACE_FLAGS["CLONE_NEWUSER"]) == (0x00050001, True)
    assert _run_bpf(tree, 56, 0xC000003E, 0x11) == (0x7FFF0000, True)  # clone without namespaces: allowed


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
        crun_filter, ours = _seccomp_filter(pid), base64.b64decode(bpf)
        assert crun_filter == compile_bpf(seccomp_profile(), optimize=False)  # crun's linear list
        _assert_same_answers(ours, crun_filter)  # and ours, a tree, answers every syscall as crun's does
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        assert proc.wait(timeout=120) == 0
