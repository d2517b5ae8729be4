"""Agentless VMs: a user's disk image (Android-x86, AOSP x86_64, any OS) booted by QEMU with no shoal agent.

No Android image can be fetched on these machines, so the guest here is one that is real but small, made
from Debian packages: Debian's kernel (the one shoal boots VMs with) and an initramfs of busybox whose
init takes an address by DHCP from QEMU's user-mode network, serves HTTP on port 8080, records on port 5555
what a client sent (where an Android guest's adbd listens), and opens a shell on the VGA console. It is
imported like an AOSP image (`kernel=`, `initrd=`, a disk) and driven only through what an Android guest
would offer: the screen over QMP and TCP ports through the private network.

The end-to-end Android test runs when SHOAL_ANDROID_IMAGE names an Android-x86 disk image on this machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from agentless_guest import BOOT_CODE, guest_files
from conftest import NodeProcess, no_leftovers, until

import shoal
from shoal import settings


@pytest.fixture(scope="module")
def guest_image(client: shoal.Client, tmp_path_factory: pytest.TempPathFactory) -> str:
    if "vm" not in client.kinds():
        pytest.skip("this node runs no vm kind (QEMU is missing)")
    disk, kernel, initrd = guest_files(tmp_path_factory.mktemp("agentless"))
    name = f"agentless-test-{os.getpid()}"
    answer = client.image_import_disk(
        disk, name, kernel=kernel, initrd=initrd, append="console=ttyS0 panic=-1", ready_port=8080
    )
    assert answer["name"] == name and answer["labels"]["org.shoal.vm.disk"] == "disk.qcow2"
    yield name
    client.image_rm(name)


@pytest.fixture(scope="module")
def boot_sector_image(client: shoal.Client, tmp_path_factory: pytest.TempPathFactory) -> str:
    if "vm" not in client.kinds():
        pytest.skip("this node runs no vm kind (QEMU is missing)")
    disk = tmp_path_factory.mktemp("bootsector") / "disk.raw"
    disk.write_bytes(BOOT_CODE.ljust(510, b"\0") + b"\x55\xaa" + bytes(1 << 20))
    name = f"bootsector-test-{os.getpid()}"
    client.image_import_disk(disk, name, disk_bus="sata", nic="e1000")
    yield name
    client.image_rm(name)


def test_a_disk_that_boots_by_its_own_loader(client: shoal.Client, boot_sector_image: str) -> None:
    """SeaBIOS boots the disk (on SATA, beside an e1000 NIC); the guest picks its screen mode (VGA text,
    720x400) and its keyboard echoes what sb.gui types through QMP."""
    with pytest.raises(shoal.InvalidRequestError, match="picks its own screen size"):
        client.create("vm", image=boot_sector_image, screen=(1024, 768), pool=False, ttl_s=60)
    with client.create("vm", image=boot_sector_image, pool=False, ttl_s=600) as vm:
        shots: list[shoal.Screenshot] = []

        def booted() -> bool:  # the boot sector's line is on the screen once it stops changing
            shots.append(vm.gui.screenshot())
            return len(shots) > 1 and shots[-1].png == shots[-2].png and shots[-1].width == 720

        until(booted, 120, "the boot sector's text screen")
        assert (shots[-1].width, shots[-1].height) == (720, 400)
        vm.gui.click(700, 390)  # scaled to the guest's own screen size
        vm.gui.type("typed")
        until(lambda: vm.gui.screenshot().png != shots[-1].png, 60, "the echoed keys on the screen")
        with pytest.raises(shoal.NoAgentError):
            vm.files.write("/x", b"y")


def _http_get(address: str, path: str = "/") -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(f"GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def _qemu_of(sandbox_id: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"shoal-{sandbox_id}\0".encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_an_agentless_vm_gui_ports_and_refusals(client: shoal.Client, guest_image: str) -> None:
    """Booted from a disk image with no agent: ready when its ready port answers; the screen over QMP; a
    TCP server in the guest reached through the private network; exec and files refused, naming what works."""
    with client.create("vm", image=guest_image, screen=(1024, 768), pool=False, ttl_s=900) as vm:
        with vm.forward(8080) as web:  # ready_port=8080: the create returned once the guest's server answered
            reply = _http_get(web.address)
            assert reply.startswith(b"HTTP/1.") and b"agentless-guest-ok" in reply

        with pytest.raises(shoal.NoAgentError, match="sb.gui") as refused:
            vm.exec("echo hi")
        assert "agentless" in str(refused.value) and "forward" in str(refused.value)
        with pytest.raises(shoal.NoAgentError):
            vm.files.read("/etc/hostname")
        with pytest.raises(shoal.NoAgentError):
            vm.set_network("pypi")

        first = vm.gui.screenshot()
        assert (first.width, first.height) == (1024, 768) and first.png.startswith(b"\x89PNG")
        vm.gui.click(10, 10)
        vm.gui.type("echo typed through qmp")
        vm.gui.key("Return")
        until(lambda: vm.gui.screenshot().png != first.png, 120, "the typed line on the screen")
        assert "gui" in [step["op"] for step in vm.log()]

        vm.pause()  # QEMU saved and stopped; a resume is a new QEMU in a new namespace, with new forwards
        with vm.forward(8080) as web:
            assert b"agentless-guest-ok" in _http_get(web.address)
        pid = _qemu_of(vm.id)
        assert pid, "the vm's QEMU runs"
    until(lambda: not _qemu_of(vm.id), 30, "the vm's QEMU to end after close")


def _adb_connect(serial: str) -> subprocess.Popen:
    return subprocess.Popen(["adb", "connect", serial], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_adb_client_through_the_private_network(client: shoal.Client, guest_image: str) -> None:
    """Debian's adb (no adbd exists in Debian, so the guest's port 5555 only records what it is sent): adb's
    connect handshake travels through sb.forward into the guest's network, proven by the guest's own copy."""
    if shutil.which("adb") is None:
        pytest.skip("adb is not installed (`make setup` installs Debian's adb)")
    with client.create("vm", image=guest_image, pool=False, ttl_s=900) as vm:
        adb = vm.adb(connect=False)
        # No adbd answers, so `adb connect` waits for a reply that never comes (10 s): it runs beside the checks.
        # It tries once: refused if the guest's recorder is not listening yet (its init starts it beside the ready
        # port's server), and after its 10 s the recorder starts over on an empty file. So it is run again until
        # the guest's copy shows a connect.
        connecting = [_adb_connect(adb.serial)]
        try:
            with vm.forward(8080) as web:
                got: list[bytes] = []

                def recorded() -> bool:
                    got.append(_http_get(web.address, "/adb.bin").partition(b"\r\n\r\n")[2])
                    if not got[-1].startswith(b"CNXN") and connecting[-1].poll() is not None:
                        connecting.append(_adb_connect(adb.serial))
                    return got[-1].startswith(b"CNXN")

                until(recorded, 60, "the guest's copy of adb's CNXN packet")
            assert b"host::" in got[-1]  # adb's connect message: "host::features=..."
        finally:
            for process in connecting:
                process.kill()
                process.wait()
            adb.close()
            subprocess.run(["adb", "kill-server"], capture_output=True, timeout=60)


def test_a_killed_node_readopts_an_agentless_vm(guest_image: str) -> None:
    """kill -9 of the node: its agentless vm's QEMU runs on; the next node adopts it, its screen and ports
    answer, a snapshot forks it, and closing everything leaves nothing behind."""
    home = Path(tempfile.mkdtemp(prefix="shoal-agentless-"))  # short: Unix socket paths are limited
    doomed = NodeProcess(home, f"shoal-test-agentless-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            vm = client.create("vm", image=guest_image, pool=False, ttl_s=1800)
        doomed.stop(signal.SIGKILL)
        assert _qemu_of(vm.id), "QEMU outlives its node"
        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            status = client.status()
            assert status["adopted"] == [vm.id] and status["lost"] == {}
            again = client.get(vm.id)
            assert again.gui.screenshot().png.startswith(b"\x89PNG")
            with again.forward(8080) as web:  # the forward a re-adopted QEMU already has is used again
                assert b"agentless-guest-ok" in _http_get(web.address)
            with pytest.raises(shoal.NoAgentError):
                again.exec("true")
            (copy,) = again.fork(count=1)  # memory + disk: the copy's guest runs on where the original was
            with copy.forward(8080) as web:
                assert b"agentless-guest-ok" in _http_get(web.address)
            assert client.close_all() == 2
        found = no_leftovers(restarted.home, restarted.cgroup_parent)
        assert not found, found
    finally:
        if doomed.paths.lock.exists():
            if restarted is None:
                restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
            restarted.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_agent_only_create_arguments_are_refused(client: shoal.Client, guest_image: str) -> None:
    refused = ({"files": {"/a": b"x"}}, {"env": {"A": "1"}}, {"network": "pypi"}, {"user": "nobody"}, {"disk_mb": 64})
    for extra in refused:
        with pytest.raises(shoal.NoAgentError, match="What works"):
            client.create("vm", image=guest_image, pool=False, ttl_s=60, **extra)
    with pytest.raises(shoal.InvalidRequestError, match="kind='vm'"):
        client.create("microvm", image=guest_image, pool=False, ttl_s=60)


def test_android_image_end_to_end(client: shoal.Client) -> None:
    """A real Android-x86 / AOSP x86_64 disk image: boot, adb shell, the screen (docs/GUI.md's steps)."""
    path = settings.ANDROID_IMAGE.get()
    if not path:
        pytest.skip("SHOAL_ANDROID_IMAGE is not set: no Android disk image on this machine (none can be fetched)")
    if shutil.which("adb") is None:
        pytest.skip("adb is not installed (`make setup` installs Debian's adb)")
    name = f"android-test-{os.getpid()}"
    client.image_import_disk(path, name, ready_port=5555)
    try:
        with client.create("vm", image=name, memory_mb=2048, cpu=2, pool=False, ttl_s=3600) as phone:
            with phone.adb() as adb:
                until(lambda: "device" in adb.run("get-state").stdout, 600, "adb get-state: device")
                release = adb.run("shell", "getprop ro.build.version.release").stdout.strip()
                assert release, "getprop answered nothing"
            shot = phone.gui.screenshot()
            assert shot.png.startswith(b"\x89PNG") and shot.width > 0
    finally:
        client.image_rm(name)
        subprocess.run(["adb", "kill-server"], capture_output=True, timeout=60)
