"""microvm/vm specifics: template fast path, snapshot/restore, fork, identity, pause/resume, faults.

Under TCG (no usable KVM, as on the CI host) a cold boot takes seconds (microvm) to a minute (vm); the
session's node keeps its templates, so each is booted once per session and everything else restores.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import NodeProcess, no_leftovers

import shoal


def _qemu_pids(home: Path) -> dict[str, int]:
    """sandbox id → pid of its QEMU, for the node at `home`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"qemu-system" in argv[0] and f"{home}/".encode() in b" ".join(argv):
                name = argv[argv.index(b"-name") + 1].decode().removeprefix("shoal-")
                found[name] = int(proc.name)
    return found


@pytest.fixture(scope="module")
def micro(client: shoal.Client) -> shoal.Sandbox:
    if "microvm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    with client.create("microvm", image="debian", pool=False) as sandbox:
        yield sandbox


def test_creates_restore_the_template(micro: shoal.Sandbox, client: shoal.Client, node: NodeProcess) -> None:
    templates = list((node.home / "vm-templates").glob("microvm-debian-1c-256m-*"))
    assert len(templates) == 1 and {p.name for p in templates[0].iterdir()} == {
        "memory",
        "disk.qcow2",
        "meta.json",
        "ram",
    }
    with client.create("microvm", image="debian", pool=False) as other:
        argv = Path(f"/proc/{_qemu_pids(node.home)[other.id]}/cmdline").read_bytes()
        assert b"-incoming" in argv and f"mem-path={templates[0] / 'ram'},share=off".encode() in argv
        assert other.exec("echo restored").stdout == "restored\n"
    assert list((node.home / "vm-templates").glob("microvm-debian-1c-256m-*")) == templates  # not booted again


def test_copies_get_fresh_identity(micro: shoal.Sandbox) -> None:
    probe = "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1; date +%s"
    kids = micro.fork(count=3)
    try:
        assert all(isinstance(k, shoal.Sandbox) for k in kids), kids
        seen = [k.exec(probe).stdout.split("\n") for k in [micro, *kids]]  # type: ignore[union-attr]
        for column in range(3):  # hostname, machine id, random bytes: all distinct
            values = [s[column] for s in seen]
            assert len(set(values)) == len(values), values
        for s in seen:
            assert abs(int(s[3]) - time.time()) < 30  # the wall clock was set on restore
    finally:
        for k in kids:
            if isinstance(k, shoal.Sandbox):
                k.close()


def test_snapshot_captures_memory_and_disk(micro: shoal.Sandbox, client: shoal.Client, node: NodeProcess) -> None:
    micro.files.write("/root/state.txt", "on disk")
    micro.exec("nohup sleep 4321 >/dev/null 2>&1 &")
    snap = micro.snapshot()
    micro.files.write("/root/state.txt", "changed after the snapshot")
    copy = client.create("microvm", snapshot=snap, pool=False)
    try:
        assert copy.info.image == "debian"
        assert copy.files.read_text("/root/state.txt") == "on disk"
        assert "sleep 4321" in copy.exec("ps -eo args").stdout  # a process running at snapshot time lives on
        client.delete_snapshot(snap)  # the copy keeps working without it
        assert not (node.home / "vm-snapshots" / snap).exists()
        assert copy.exec("cat /root/state.txt").stdout == "on disk"
    finally:
        copy.close()
    assert micro.files.read_text("/root/state.txt") == "changed after the snapshot"
    with pytest.raises(shoal.NotFoundError, match="no snapshot"):
        client.create("microvm", snapshot=snap, pool=False)


def test_pause_frees_the_vm_and_any_request_resumes(client: shoal.Client, node: NodeProcess) -> None:
    with client.create("microvm", image="busybox", pool=False) as sb:
        sb.exec("echo 1 > /tmp/counter; sleep 1000 >/dev/null 2>&1 &")
        sb.pause()
        assert client.get(sb.id).info.state == "paused"
        assert sb.id not in _qemu_pids(node.home)  # QEMU is gone, memory is on disk
        assert (node.home / "sandboxes" / sb.id / "paused.mem").stat().st_size > 0
        assert sb.exec("cat /tmp/counter; ps | grep -c 'sleep 1000'").stdout.split()[0] == "1"
        assert client.get(sb.id).info.state == "ready" and sb.id in _qemu_pids(node.home)
        assert not (node.home / "sandboxes" / sb.id / "paused.mem").exists()
        sb.pause()
        sb.resume()
        assert sb.files.read_text("/tmp/counter") == "1\n"
        # A request that a pause cuts off fails plainly; the sandbox is paused, not lost.
        outcome: list[BaseException | shoal.ExecResult] = []

        def long_exec() -> None:
            try:
                outcome.append(sb.exec("sleep 20; echo late >> /tmp/counter", timeout=60))
            except shoal.ShoalError as exc:
                outcome.append(exc)

        worker = threading.Thread(target=long_exec)
        worker.start()
        time.sleep(1.5)
        client.get(sb.id).pause()
        worker.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], shoal.ShoalError), outcome
        assert not isinstance(outcome[0], shoal.SandboxLostError) and "paused during this request" in str(outcome[0])
        assert client.get(sb.id).info.state == "paused"
        assert sb.exec("echo alive").stdout == "alive\n"


def _limits(sb: shoal.Sandbox) -> tuple[str, str, int]:
    """(the cgroup a command runs in, that cgroup's pids.max, MiB free on /) inside a VM guest."""
    cgroup = sb.exec("cat /proc/self/cgroup").stdout.strip()
    pids_max = sb.files.read("/sys/fs/cgroup/shoal-commands/pids.max").decode().strip()
    return cgroup, pids_max, int(sb.exec(["df", "-m", "/"]).stdout.split("\n")[1].split()[3])


def test_vm_kind_runs_systemd(client: shoal.Client) -> None:
    with client.create("vm", image="debian", pool=False, pids=64, disk_mb=48) as vm:
        assert vm.exec("cat /proc/1/comm").stdout == "systemd\n"
        assert vm.exec("systemctl is-active shoal-agent").stdout == "active\n"
        # No start limit: the agent unit retries until udev names its port, however slow coldplug is.
        assert vm.exec("systemctl show -p StartLimitIntervalUSec --value shoal-agent").stdout == "0\n"
        # Its limits hold under systemd too: commands in the agent's cgroup, 48 MiB to write, no more.
        assert _limits(vm)[:2] == ("0::/shoal-commands", "64") and 40 < _limits(vm)[2] <= 48
        full = vm.exec("dd if=/dev/zero of=/root/fill bs=1M count=100", timeout=300)
        assert "No space left on device" in full.stderr, full.stderr
        assert vm.exec("rm /root/fill && echo answers").stdout == "answers\n"
        kids = vm.fork(count=2)
        try:
            assert [k.exec("cat /proc/1/comm").stdout for k in kids] == ["systemd\n", "systemd\n"]  # type: ignore
            assert [_limits(k)[1] for k in kids] == ["64", "64"]  # type: ignore[union-attr]
        finally:
            for k in kids:
                if isinstance(k, shoal.Sandbox):
                    k.close()


def test_bad_input(client: shoal.Client) -> None:
    with pytest.raises(shoal.ImageError, match="no systemd"):
        client.create("vm", image="busybox", pool=False)
    with pytest.raises(shoal.InvalidRequestError, match="at least 64 MB"):
        client.create("microvm", image="busybox", memory_mb=32, pool=False)
    with pytest.raises(shoal.NotFoundError, match="no snapshot"):
        client.create("microvm", snapshot="snap-000000000000", pool=False)
    with pytest.raises(shoal.InvalidRequestError, match="disk_mb=1 is below the minimum"):
        client.create("microvm", image="busybox", disk_mb=1, pool=False)
    with client.create("container", image="busybox", pool=False) as c:
        with pytest.raises(shoal.InvalidRequestError, match="no memory snapshots"):
            c.fork(2)
        with pytest.raises(TypeError, match="give it a name"):
            c.snapshot()
    with (
        client.create("microvm", image="busybox", pool=False) as v,
        pytest.raises(shoal.InvalidRequestError, match="image commits are for containers"),
    ):
        client._run(client._async.call("sandbox_snapshot", {"sandbox_id": v.id, "name": "x"}))
    with pytest.raises(shoal.UnsupportedKindError, match="microvm"):
        client.create("nope", image="busybox")


def test_qemu_crash_marks_lost_and_cleans_up(client: shoal.Client, node: NodeProcess) -> None:
    sb = client.create("microvm", image="busybox", pool=False)
    os.kill(_qemu_pids(node.home)[sb.id], signal.SIGKILL)
    with pytest.raises(shoal.SandboxLostError, match="stopped answering"):
        sb.exec("true")
    assert not (node.home / "sandboxes" / sb.id).exists()


def test_guest_kernel_panic_marks_lost(client: shoal.Client, node: NodeProcess) -> None:
    sb = client.create("microvm", image="busybox", pool=False)
    with pytest.raises(shoal.SandboxLostError, match="console.log"):
        sb.exec("echo c > /proc/sysrq-trigger", timeout=10)  # the kernel dies; panic=-1, -no-reboot end QEMU
    assert sb.id not in _qemu_pids(node.home)


def test_guest_that_never_becomes_ready() -> None:
    home = Path(tempfile.mkdtemp(prefix="shoal-slow-"))  # short: Unix socket paths are limited to 108 bytes
    node = NodeProcess(home, f"shoal-test-slow-{os.getpid()}", SHOAL_VM_BOOT_TIMEOUT="0.5").start()
    try:
        with node.client() as c, pytest.raises(shoal.SandboxLostError, match=r"did not become ready in 0.5 s.*console"):
            c.create("microvm", image="busybox", pool=False)
    finally:
        node.stop()
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)
    shutil.rmtree(home, ignore_errors=True)


def test_crashed_node_readopts_its_vms() -> None:
    """kill -9 of the node: its VMs' QEMUs run on (their own session) and the next node takes them over, a
    running one with the same QEMU process and a paused one paused; one whose QEMU died meanwhile is lost
    with the reason, and the dead node's snapshots are gone."""
    home = Path(tempfile.mkdtemp(prefix="shoal-crash-"))
    node = NodeProcess(home, f"shoal-test-crash-{os.getpid()}").start()
    try:
        with node.client() as c:
            sb = c.create("microvm", image="busybox", pool=False, ttl_s=900)
            sb.files.write("/kept", "running")
            paused = c.create("microvm", image="busybox", pool=False, ttl_s=900)
            paused.files.write("/kept", "paused")
            paused.pause()
            victim = c.create("microvm", image="busybox", pool=False, ttl_s=900)
            snap = sb.snapshot()
            pid = _qemu_pids(home)[sb.id]
            victim_pid = _qemu_pids(home)[victim.id]
        node.stop(signal.SIGKILL)
        assert Path(f"/proc/{pid}").exists()  # QEMU outlives a crashed node...
        os.kill(victim_pid, signal.SIGKILL)  # ...unless it dies while no node watches it
        node.start()
        with node.client() as c:  # ...and the next node takes it over
            status = c.status()
            assert sorted(status["adopted"]) == sorted([sb.id, paused.id])
            assert list(status["lost"]) == [victim.id] and "QEMU process no longer runs" in status["lost"][victim.id]
            again = c.get(sb.id)
            assert again.files.read_text("/kept") == "running" and _qemu_pids(home)[sb.id] == pid
            assert again.exec("echo $((6 * 7))").stdout == "42\n"
            assert c.get(paused.id).info.state == "paused"
            assert c.get(paused.id).files.read_text("/kept") == "paused"  # transparent resume
            with pytest.raises(shoal.NotFoundError):
                c.create("microvm", snapshot=snap, pool=False)
            assert c.close_all() == 2
        assert not no_leftovers(home, node.cgroup_parent)
    finally:
        node.stop()
    assert not no_leftovers(home, node.cgroup_parent, node_stopped=True)
    shutil.rmtree(home, ignore_errors=True)


def test_warm_pool_of_microvms(client: shoal.Client) -> None:
    client.set_pool("microvm", "busybox", size=1, wait=True, cpu=1)
    try:
        hits = client.status()["pool_hits"]
        with client.create("microvm", image="busybox", cpu=1, env={"LATE": "bound"}, labels={"p": "vm"}) as sb:
            assert client.status()["pool_hits"] == hits + 1
            assert sb.exec("echo $LATE").stdout == "bound\n"
    finally:
        client.set_pool("microvm", "busybox", size=0, cpu=1)
