"""Agentless VMs: a user's disk image (Android-x86, AOSP x86_64, any OS) booted by QEMU with no shoal agent.

`shoal image import-disk PATH --name android` (node/images.py) stores the disk, converted to a standalone
qcow2 (no backing file, no external data file: a disk must not name host files), as one layer of an image
whose labels say how to boot it (LABELS): from the disk's own boot loader (SeaBIOS), or, for images that
come as kernel + ramdisk + disk (AOSP's), directly with `-kernel`. `create("vm", image="android")` then
boots it on a private qcow2 overlay with a screen (VGA + USB tablet: the same `sb.gui` over QMP as every
VM) and QEMU's user-mode network: the guest gets an address by DHCP (what Android-x86 expects), and
`restrict=on` gives it no route out. QEMU runs in a network namespace of its own, so a port it forwards
from 127.0.0.1 (`hostfwd_add`, one per guest port asked for) exists only there: the node opens its
sockets in that namespace (`open_guest_port`), and `sb.expose(port)` / `sb.forward(port)` / `sb.adb()`
reach the guest through the same relay as for any sandbox, with nothing listening on the host.

Ready means QEMU runs the guest, and, when the image names a ready port, that a TCP connection to that
guest port is established (slirp's own connection table says so: `info usernet`), whatever protocol
speaks there (adbd speaks only after the host did).

The node talks to such a sandbox through `NoAgent` instead of an agent client: its hello says whether QEMU
runs, its `open_port` is the forward above, and everything else (exec, files, shells, processes) raises
NoAgentError naming what works instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import ImageError, InvalidRequestError, NoAgentError
from shoal.images import Image

PREFIX = "org.shoal.vm."
DISK, KERNEL, INITRD, APPEND, READY_PORT, DISK_BUS, NIC = (
    f"{PREFIX}{n}" for n in ("disk", "kernel", "initrd", "append", "ready-port", "disk-bus", "nic")
)
DISK_FILE, KERNEL_FILE, INITRD_FILE = "disk.qcow2", "kernel", "initrd"
DISK_BUSES = ("virtio", "sata")
NIC_MODELS = ("virtio", "e1000")
WORKS = (
    "sb.gui (screenshot, click, type, key...), sb.view(), sb.expose(port) / sb.forward(port) / sb.adb() to "
    "the guest's TCP ports over its private network, lifetimes (ttl_s, idle_timeout_s, keepalive), "
    "pause/resume, snapshot/fork"
)
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class DiskBoot:
    """How to boot an agentless image, read from its labels (paths inside its one layer)."""

    disk: Path
    kernel: Path | None
    initrd: Path | None
    append: str
    ready_port: int | None
    disk_bus: str
    nic_model: str


def is_agentless(image: Image) -> bool:
    return DISK in image.config.labels


def disk_boot(image: Image) -> DiskBoot:
    """The boot plan of an agentless image whose layers are ready (acquired). The files it names must be in
    its own top layer: labels come from whoever made the image, so they never name a host path."""
    labels = image.config.labels
    if not image.layers:
        raise ImageError(f"image {image.name!r} says it is a disk image ({DISK}) but has no layer holding a disk")
    layer = Path(image.layers[-1])

    def member(label: str) -> Path | None:
        name = labels.get(label)
        if not name:
            return None
        if "/" in name or name in (".", ".."):
            raise ImageError(f"image {image.name!r}: label {label}={name!r} must name a file of its layer")
        path = layer / name
        if not path.is_file():
            raise ImageError(f"image {image.name!r}: {name!r} ({label}) is not in its layer")
        return path

    disk = member(DISK)
    assert disk is not None
    kernel, initrd = member(KERNEL), member(INITRD)
    if initrd is not None and kernel is None:
        raise ImageError(f"image {image.name!r} names an initrd but no kernel ({KERNEL})")
    port_text = labels.get(READY_PORT) or ""
    if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ImageError(f"image {image.name!r}: {READY_PORT}={port_text!r} is not a port number")
    bus, nic = labels.get(DISK_BUS) or "virtio", labels.get(NIC) or "virtio"
    if bus not in DISK_BUSES or nic not in NIC_MODELS:
        raise ImageError(f"image {image.name!r}: disk bus {bus!r} / NIC {nic!r}: choose {DISK_BUSES} / {NIC_MODELS}")
    return DiskBoot(disk, kernel, initrd, labels.get(APPEND) or "", int(port_text) if port_text else None, bus, nic)


def check_disk(path: Path) -> None:
    """Refuse a disk QEMU would make read a host file: a qcow2 with a backing file or an external data file
    (an image's layer can come from anyone). `import_disk` writes disks that pass."""
    proc = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"qemu-img info {path.name} failed: {proc.stderr.strip()[-300:]} (is qemu-utils installed?)")
    info = json.loads(proc.stdout)
    data_file = ((info.get("format-specific") or {}).get("data") or {}).get("data-file")
    if info.get("format") != "qcow2" or info.get("backing-filename") or data_file:
        raise ImageError(
            f"the disk of this image is not a standalone qcow2 (format {info.get('format')!r}, backing file "
            f"{info.get('backing-filename')!r}, data file {data_file!r}); import it with `shoal image import-disk`"
        )


def import_disk(source: Path, target: Path, kernel: Path | None = None, initrd: Path | None = None) -> None:
    """Write `source` (any format qemu-img reads: raw, qcow2, vmdk, vdi...) into directory `target` as a
    standalone qcow2, beside copies of `kernel` and `initrd`."""
    for path, what in ((source, "disk"), (kernel, "kernel"), (initrd, "initrd")):
        if path is not None and not path.is_file():
            raise InvalidRequestError(f"{what} {str(path)!r} is not a file on the node's machine")
    if initrd is not None and kernel is None:
        raise InvalidRequestError("an initrd is booted with a kernel: give kernel= too")
    if shutil.which("qemu-img") is None:
        raise ImageError("qemu-img is missing: `apt-get install qemu-utils`")
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["qemu-img", "convert", "-O", "qcow2", str(source), str(target / DISK_FILE)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise ImageError(f"converting {source} to qcow2 failed: {proc.stderr.strip()[-400:]}")
    for path, name in ((kernel, KERNEL_FILE), (initrd, INITRD_FILE)):
        if path is not None:
            shutil.copyfile(path, target / name)


def labels(
    kernel: bool, initrd: bool, append: str | None, ready_port: int | None, disk_bus: str, nic_model: str
) -> dict[str, str]:
    """The labels of an imported disk image (what `disk_boot` reads back)."""
    if disk_bus not in DISK_BUSES or nic_model not in NIC_MODELS:
        raise InvalidRequestError(f"disk_bus={disk_bus!r}, nic={nic_model!r}: choose {DISK_BUSES} / {NIC_MODELS}")
    if ready_port is not None and not 0 < ready_port < 65536:
        raise InvalidRequestError(f"ready_port={ready_port} is not a port number (1-65535)")
    if append and not kernel:
        raise InvalidRequestError("append= is the kernel command line of a kernel= boot; a disk boots its own")
    out = {DISK: DISK_FILE, DISK_BUS: disk_bus, NIC: nic_model}
    if kernel:
        out[KERNEL] = KERNEL_FILE
        out[APPEND] = append or ""
    if initrd:
        out[INITRD] = INITRD_FILE
    if ready_port:
        out[READY_PORT] = str(ready_port)
    return out


def refuse_agent_fields(spec: Any, image_name: str) -> None:
    """Create arguments that only the agent could apply are refused before booting, not ignored."""
    asked = [
        name
        for name, value in (
            ("env", spec.env), ("files", spec.files), ("user", spec.user),
            ("workdir", spec.workdir not in (None, "", "/") and spec.workdir),
            ("network", spec.network not in (None, "none", [], {}) and spec.network),
            ("disk_mb", spec.disk_mb),
        )
        if value
    ]  # fmt: skip
    if asked:
        raise NoAgentError(
            f"image {image_name!r} is a disk image booted without shoal's guest agent, so {', '.join(asked)}= "
            f"cannot be applied in it (its network is a private one with no route out). What works: {WORKS}"
        )


# ---------------------------------------------------------------- the guest's ports, from QEMU's namespace


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def socket_in_netns(pid: int) -> socket.socket:
    """A TCP socket created in the network namespace of process `pid` (QEMU's). setns changes only the
    calling thread, so this runs in a thread of its own that ends right after."""
    result: list[Any] = []

    def make() -> None:
        libc = _libc()
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into the network namespace of QEMU (pid {pid})")
                try:
                    result.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC))
                finally:
                    if libc.setns(own, CLONE_NEWNET) != 0:  # cannot happen; the thread ends anyway
                        raise OSError(ctypes.get_errno(), "setns back")
            finally:
                os.close(target)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result.append(exc)
        finally:
            os.close(own)

    thread = threading.Thread(target=make, name="shoal-netns", daemon=True)
    thread.start()
    thread.join()
    if isinstance(result[-1], BaseException):
        for item in result[:-1]:
            item.close()
        raise result[-1]
    return result[0]


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Hmp = Callable[[str], Awaitable[str]]


async def forward_port(hmp: Hmp, port: int, forwarded: set[int]) -> None:
    """Have QEMU forward 127.0.0.1:`port` of its namespace to the guest's `port` (once per QEMU process; a
    second hostfwd_add of the same port only prints an error, so a re-adopted QEMU is fine too)."""
    if port not in forwarded:
        await hmp(f"hostfwd_add net0 tcp:127.0.0.1:{port}-:{port}")
        forwarded.add(port)


async def open_guest_port(pid: int, hmp: Hmp, port: int, forwarded: set[int]) -> Stream:
    """A byte stream to TCP `port` of the guest (through QEMU's user-mode network, inside its namespace)."""
    await forward_port(hmp, port, forwarded)
    sock = await asyncio.to_thread(socket_in_netns, pid)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=1 << 20)


_USERNET_LINE = re.compile(r"TCP\[(\w+)\]\s+\S+\s+\S+\s+\d+\s+(\S+)\s+(\d+)")


async def guest_port_open(pid: int, hmp: Hmp, port: int, forwarded: set[int], wait_s: float = 3.0) -> bool:
    """Does a TCP server in the guest accept on `port` now? A connection through the forward is accepted by
    QEMU at once; whether the guest answered shows in slirp's table (ESTABLISHED) or as a closed stream."""
    try:
        reader, writer = await open_guest_port(pid, hmp, port, forwarded)
    except OSError:
        return False
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        read = asyncio.ensure_future(reader.read(1))
        try:
            while loop.time() < deadline:
                done, _ = await asyncio.wait({read}, timeout=0.2)
                if done:
                    return bool(read.result())  # bytes: a server spoke; b"": the guest refused
                table = await hmp("info usernet")
                for state, _address, guest_port in _USERNET_LINE.findall(table):
                    if int(guest_port) == port and state == "ESTABLISHED":
                        return True
            return False
        finally:
            read.cancel()
    except (OSError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


class NoAgent:
    """What the node holds as the "agent" of an agentless VM: a hello that says whether QEMU runs, the
    guest's TCP ports through QEMU's forward, and NoAgentError for everything that needs an agent."""

    def __init__(self, sandbox_id: str, running: Callable[[], bool], open_port: Callable[[int], Awaitable[Stream]]):
        self._sandbox_id = sandbox_id
        self._running = running
        self._open_port = open_port

    async def hello(self) -> dict[str, Any]:
        if not self._running():
            raise ConnectionError(f"the QEMU of agentless vm {self._sandbox_id} is not running")
        return {"agentless": True}

    async def open_port(self, port: int) -> Stream:
        return await self._open_port(port)

    def close(self) -> None:
        """Nothing to let go: no agent connections are kept (the node calls this on every destroy)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise NoAgentError(
                f"sandbox {self._sandbox_id} is an agentless vm (a disk image booted without shoal's guest "
                f"agent): {name} needs the agent, which its guest does not run. What works: {WORKS}"
            )

        return refused
