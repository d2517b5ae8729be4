"""Disk limits: `disk_mb` puts a sandbox's writes on its own size-limited filesystem."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import NodeProcess, leftovers, no_leftovers

import shoal

FILL_INODES = """
import os
n = 0
try:
    while True:
        open(f"/tmp/f{n}", "w").close()
        n += 1
except OSError as e:
    print(n, e.strerror)
"""


def test_disk_fill_is_contained(client: shoal.Client, node: NodeProcess) -> None:
    with (
        client.create(image="busybox", disk_mb=32, pool=False) as sb,
        client.create(image="busybox", pool=False) as other,
    ):
        r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=100; sync; ls -l /fill")
        assert "No space left on device" in r.stderr
        size = int(r.stdout.split()[4])
        assert 20 << 20 < size <= 32 << 20
        assert sb.exec("head -c 1048576 /dev/zero > /tmp/x").exit_code != 0  # full: further writes fail ...
        assert sb.exec("echo still answers").stdout == "still answers\n"  # ... the sandbox does not
        assert other.exec("dd if=/dev/zero of=/f bs=1M count=40 2>&1 && echo ok").stdout.endswith("ok\n")
        (image,) = (node.home / "sandboxes" / sb.id).glob("disk-*.img")
        assert image.stat().st_blocks * 512 <= 33 << 20  # what the host spent on it: at most the limit
        assert sb.exec("rm /fill && echo again > /tmp/x && cat /tmp/x").stdout == "again\n"


def test_inode_exhaustion_is_contained(client: shoal.Client) -> None:
    with (
        client.create(image="debian", disk_mb=16, pool=False) as sb,
        client.create(image="debian", pool=False) as other,
    ):
        r = sb.exec(["python3", "-c", FILL_INODES], timeout=120)
        count, _, reason = r.stdout.strip().partition(" ")
        assert reason == "No space left on device" and 1000 < int(count) < 4096, r.stdout
        assert sb.exec("echo alive").stdout == "alive\n"
        assert other.exec("touch /tmp/a /tmp/b && echo ok").stdout == "ok\n"


def test_disk_limit_applies_to_files_api(client: shoal.Client) -> None:
    with client.create(image="busybox", disk_mb=8, pool=False) as sb:
        with pytest.raises(shoal.ShoalError, match="No space|space"):
            sb.files.write("/big.bin", b"x" * (16 << 20))
        sb.files.write("/small.txt", "fits")
        assert sb.files.read_text("/small.txt") == "fits"


def test_default_has_no_disk_of_its_own(client: shoal.Client, node: NodeProcess) -> None:
    with client.create(image="busybox", pool=False) as sb:
        directory = node.home / "sandboxes" / sb.id
        assert (directory / "upper").is_dir() and not (directory / "disk").exists()


def test_tmpfs_scratch_is_in_memory_and_counts_against_memory(client: shoal.Client, node: NodeProcess) -> None:
    """`tmpfs=[...]`: empty in-memory file systems in the container, nothing of them in the upper on the
    host's disk; writing past `memory_mb` there ends the writer as allocating would (an OOM kill)."""
    with client.create(image="busybox", tmpfs=["/scratch", "/var/cache/x"], memory_mb=64, pool=False) as sb:
        mounts = sb.exec("grep -E ' /(scratch|var/cache/x) ' /proc/mounts").stdout
        assert [line.split()[2] for line in mounts.splitlines()] == ["tmpfs", "tmpfs"], mounts
        assert sb.exec("echo hi > /scratch/a && cat /scratch/a").stdout == "hi\n"
        assert not (node.home / "sandboxes" / sb.id / "upper" / "scratch" / "a").exists()
        filled = sb.exec("head -c 200000000 /dev/zero > /scratch/big")
        assert filled.exit_code != 0 and filled.oom_killed, filled
    with pytest.raises(shoal.InvalidRequestError, match="tmpfs: '/proc/x' is under"):
        client.create(image="busybox", tmpfs=["/proc/x"])


def test_bad_disk_mb(client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequestError, match="disk_mb"):
        client.create(image="busybox", disk_mb=1)


def test_killed_node_leaves_no_disks(tmp_path: Path) -> None:
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-diskkill-{os.getpid()}").start()
    with doomed.client() as client:
        for _ in range(2):
            client.create(image="busybox", disk_mb=16, pool=False).exec("echo x > /x")
    doomed.stop(signal.SIGKILL)
    assert leftovers(doomed.home, doomed.cgroup_parent)["loops"]  # the SIGKILL really left disks
    doomed.start()
    try:
        with doomed.client() as client:  # the restarted node re-adopts them (issue 5); closing frees the disks
            assert len(client.status()["adopted"]) == 2
            assert [s.exec("cat /x").stdout for s in map(client.get, client.status()["adopted"])] == ["x\n"] * 2
            assert client.close_all() == 2
        assert not no_leftovers(doomed.home, doomed.cgroup_parent)
    finally:
        doomed.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


def test_node_default_disk_limit(tmp_path: Path) -> None:
    capped = NodeProcess(tmp_path / "home", f"shoal-test-diskdefault-{os.getpid()}", SHOAL_DEFAULT_DISK_MB="24").start()
    try:
        with capped.client() as client:
            with client.create(image="busybox", pool=False) as sb:
                size_kb = int(sb.exec("df -k / | tail -1").stdout.split()[1])
                assert 16_000 < size_kb <= 24 * 1024
            with client.create(image="busybox", pool=False, disk_mb=48) as sb:  # the sandbox's own wins
                assert int(sb.exec("df -k / | tail -1").stdout.split()[1]) > 32 * 1024
    finally:
        capped.stop()
    assert not no_leftovers(capped.home, capped.cgroup_parent, node_stopped=True)


def test_snapshot_of_a_disk_limited_sandbox_keeps_its_writes(client: shoal.Client) -> None:
    name = f"disksnap-{os.getpid()}-{time.monotonic_ns()}"
    with client.create(image="busybox", disk_mb=16, pool=False) as sb:
        sb.exec("echo on-its-own-disk > /root/kept")
        sb.snapshot(name)
    try:
        with client.create(image=name, pool=False) as restored:
            assert restored.exec("cat /root/kept").stdout == "on-its-own-disk\n"
    finally:
        client.image_rm(name)


def test_vm_disk_cap_holds_in_the_guest_and_on_the_host(client: shoal.Client, node: NodeProcess) -> None:
    """disk_mb on a microvm is the free space the agent leaves on the guest's root: writing past it fails
    with ENOSPC in the guest, the sandbox answers on, and the host's qcow2 stays near the cap, also when the
    guest deletes and writes again (the root is remounted with discard, QEMU punches what it frees)."""
    if "microvm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    cap = 64
    with client.create("microvm", image="debian", disk_mb=cap, pool=False, ttl_s=900) as sb:
        disk = node.home / "sandboxes" / sb.id / "disk.qcow2"
        available_kb = int(sb.exec(["df", "-k", "/"]).stdout.split("\n")[1].split()[3])
        assert (cap - 8) << 10 < available_kb <= cap << 10, available_kb
        r = sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=200; sync; ls -l /root/fill", timeout=600)
        assert "No space left on device" in r.stderr, r.stderr
        size = int(r.stdout.split()[4])
        assert (cap - 16) << 20 < size <= cap << 20, size
        with pytest.raises(shoal.ShoalError, match="No space"):
            sb.files.write("/root/more.bin", b"x" * (4 << 20))
        assert sb.exec("echo still answers").stdout == "still answers\n"
        host = [disk.stat().st_blocks * 512]
        for _ in range(3):  # what the guest deletes is free again, in the guest and (discarded) on the host
            again = "rm /root/fill && sync && dd if=/dev/zero of=/root/fill bs=1M count=48 2>/dev/null && sync"
            assert sb.exec(again + " && echo ok", timeout=600).stdout == "ok\n"
            host.append(disk.stat().st_blocks * 512)
        print(f"microvm disk_mb={cap}: host qcow2 allocated {[h >> 20 for h in host]} MiB")
        assert max(host) <= (cap + 32) << 20, host
