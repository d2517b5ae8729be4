"""A container start's fixed costs (issue 12): the runtime run from one sealed copy, cgroup joins without an
RCU wait. Their speed is measured in bench/ (bench_hotpath_ab.py --only create,conc); these check that each
keeps what it must: the runtime's copy can never be written, the host's cgroup mount keeps its options."""

from __future__ import annotations

import asyncio
import fcntl
import os
import platform
import shutil
from pathlib import Path

import pytest

from shoal import cgroups, spawn
from shoal.substrates.container.runtime import SEALS, OciRuntime, sealed_copy


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


def test_favordynmods_is_set_and_every_other_cgroup2_option_kept() -> None:
    before = _cgroup2_options()
    if before is None:
        pytest.skip("this host mounts no cgroup2 (pure cgroup v1): nothing to tune")
    said = cgroups.favor_dynamic_modifications()
    after = _cgroup2_options()
    assert after is not None and after[0] == before[0]
    assert after[1] == before[1], said  # nosuid, nodev, noexec, relatime... as they were
    assert after[2] - {"favordynmods"} == before[2] - {"favordynmods"}, said  # nsdelegate etc. kept
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) >= (6, 0):  # the kernel has the flag since 6.0
        assert "favordynmods" in after[2], said
        assert "already" in cgroups.favor_dynamic_modifications()  # a second node leaves it alone
        assert _cgroup2_options() == after


def test_favordynmods_without_cgroup2_changes_nothing(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 0:21 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n")
    assert "no cgroup2" in cgroups.favor_dynamic_modifications(str(mountinfo))
