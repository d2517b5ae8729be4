"""Guest kernel and initramfs: Debian's stock kernel plus a tiny initramfs that loads the virtio modules.

Everything is cached under the VM cache directory (SHOAL_VM_CACHE, default /var/lib/shoal/vm), built
once per host and shared by every node, written to a temporary name and renamed into place.

    kernel-<version>/vmlinuz          the Debian kernel (from `apt-get download linux-image-amd64`)
    kernel-<version>/modules/*.ko     the modules the initramfs loads (uncompressed in Debian 12)
    initramfs-<hash>.cpio             busybox + modules + the agent + /init, keyed by their content
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shoal import settings
from shoal.errors import ImageError
from shoal.guest import agent_binary_path

# Loaded in this order (dependencies are resolved from each module's own `depends=` list).
MODULES = [
    "virtio_pci", "virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "virtio_net", "crc32c_generic", "ext4",
]  # fmt: skip
# Not in the initramfs: a guest root with a display session (vm-desktop) loads these itself (ensure_modules):
# the xHCI controller and HID drivers of QEMU's USB tablet, and evdev, through which Xorg reads the tablet and
# the PS/2 keyboard. The display needs none: the VGA's VESA mode is the kernel's built-in vesafb (/dev/fb0).
SCREEN_MODULES = ["xhci_pci", "usbhid", "hid_generic", "evdev"]

INIT_SCRIPT = r"""#!/bin/busybox sh
# shoal initramfs: load virtio modules, mount the VM's disk, hand over to the agent (microvm) or init (vm).
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mode=microvm; root=/dev/vda
for arg in $(cat /proc/cmdline); do
  case "$arg" in shoal.mode=*) mode=${arg#shoal.mode=};; shoal.root=*) root=${arg#shoal.root=};; esac
done
[ "$mode" = probe ] && { echo shoal-probe-ok; poweroff -f; }
for m in $(cat /modules.order); do insmod /modules/$m.ko 2>/dev/null; done
i=0; while [ ! -b "$root" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
mount -t ext4 -o rw,noatime "$root" /newroot || { echo "shoal-init: cannot mount $root"; sleep 5; poweroff -f; }
if [ "$mode" = vm ]; then
  mount --move /dev /newroot/dev; umount /proc /sys
  exec switch_root /newroot /sbin/init
fi
port=""
for d in /sys/class/virtio-ports/*; do [ "$(cat $d/name 2>/dev/null)" = shoal.agent ] && port=/dev/${d##*/}; done
[ -n "$port" ] || { echo "shoal-init: no virtio-serial port named shoal.agent"; poweroff -f; }
mkdir -p /newroot/.shoal /newroot/dev /newroot/proc /newroot/sys /newroot/tmp
mount -t tmpfs -o size=8m,mode=0755 shoal /newroot/.shoal && cp /agent /newroot/.shoal/agent
cp /bin/busybox /newroot/.shoal/busybox  # the node configures the guest's network with its `ip` (network.py)
mount --move /dev /newroot/dev; mount --move /proc /newroot/proc; mount --move /sys /newroot/sys
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts; mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
exec switch_root /newroot /.shoal/agent --serial "$port"
"""


@dataclass(frozen=True)
class BootFiles:
    kernel: Path
    initramfs: Path
    version: str


def cache_dir() -> Path:
    return settings.VM_CACHE.get()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_kernel(cache: Path | None = None) -> tuple[Path, Path, str]:
    """Return (vmlinuz, modules dir, version), downloading Debian's kernel package on first use."""
    cache = cache or cache_dir()
    with _locked(cache / ".kernel.lock"):
        found = sorted(cache.glob("kernel-*/vmlinuz"))
        if found:
            kdir = found[-1].parent
            order = (kdir / "modules" / "order").read_text().split()
            if set(MODULES) <= set(order):
                return kdir / "vmlinuz", kdir / "modules", kdir.name.removeprefix("kernel-")
            # a cache made before a module was added to MODULES: fetch the package again, add what is missing
            # (files are added, never replaced, and the order is renamed into place: running nodes read it)
            version = kdir.name.removeprefix("kernel-")
            wanted = _add_modules(kdir, version, MODULES)
            (kdir / "modules" / ".order.tmp").write_text("\n".join(wanted) + "\n")
            os.replace(kdir / "modules" / ".order.tmp", kdir / "modules" / "order")
            return kdir / "vmlinuz", kdir / "modules", version
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise ImageError("no guest kernel cached and apt-get/dpkg-deb are missing: run `make vm-kernel` on Debian")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            meta = _apt(["apt-cache", "depends", "linux-image-amd64"], tmp)
            match = re.search(r"Depends: (linux-image-[0-9][^\s]*)", meta)
            if not match:
                raise ImageError(f"cannot resolve linux-image-amd64 to a kernel package: {meta[:300]}")
            _apt(["apt-get", "download", "-q", match.group(1)], tmp)
            deb = next(Path(tmp).glob("linux-image-*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], check=True)
            vmlinuz = next(Path(tmp, "x/boot").glob("vmlinuz-*"))
            version = vmlinuz.name.removeprefix("vmlinuz-")
            kdir = Path(tmp, "kernel")
            (kdir / "modules").mkdir(parents=True)
            shutil.copy2(vmlinuz, kdir / "vmlinuz")
            shutil.copy2(Path(tmp, "x/boot", f"config-{version}"), kdir / "config")
            index = _module_index(Path(tmp, "x/lib/modules", version, "kernel"))
            for name in _with_dependencies([*MODULES, *SCREEN_MODULES], index):  # one download serves both
                shutil.copy2(index[name], kdir / "modules" / f"{name}.ko")
            (kdir / "modules" / "order").write_text("\n".join(_with_dependencies(MODULES, index)) + "\n")
            final = cache / f"kernel-{version}"
            os.replace(kdir, final)
        return final / "vmlinuz", final / "modules", version


def _add_modules(kdir: Path, version: str, names: list[str]) -> list[str]:
    """Copy `names` and their dependencies from Debian's kernel package into `kdir/modules` (fetched again:
    the cache keeps only the modules asked for so far); returns them in load order."""
    with tempfile.TemporaryDirectory(dir=kdir.parent) as tmp:
        _apt(["apt-get", "download", "-q", f"linux-image-{version}"], tmp)
        deb = next(Path(tmp).glob("linux-image-*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], check=True)
        index = _module_index(Path(tmp, "x/lib/modules", version, "kernel"))
        wanted = _with_dependencies(names, index)
        for name in wanted:
            if not (kdir / "modules" / f"{name}.ko").exists():
                shutil.copy2(index[name], kdir / "modules" / f".{name}.ko.tmp")
                os.replace(kdir / "modules" / f".{name}.ko.tmp", kdir / "modules" / f"{name}.ko")
        return wanted


def ensure_modules(names: list[str], cache: Path | None = None) -> tuple[str, list[Path]]:
    """(kernel version, the .ko files of `names` and their dependencies in load order) for a guest root that
    loads them itself (vm-desktop: display and USB input). The initramfs's own list (`order`) is untouched."""
    cache = cache or cache_dir()
    _, modules, version = ensure_kernel(cache)
    with _locked(cache / ".kernel.lock"):
        have = {p.name[:-3]: p for p in modules.glob("*.ko")}
        try:
            wanted = _with_dependencies(names, have)
        except ImageError:  # one of them (or a dependency) is not cached yet
            wanted = _add_modules(modules.parent, version, names)
        return version, [modules / f"{name}.ko" for name in wanted]


def _apt(argv: list[str], cwd: str) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"{' '.join(argv)} failed (need Debian apt sources): {proc.stderr.strip()[-400:]}")
    return proc.stdout


def _module_index(root: Path) -> dict[str, Path]:
    return {p.name[:-3].replace("-", "_"): p for p in root.rglob("*.ko")}


def _depends(path: Path) -> list[str]:
    match = re.search(rb"\0depends=([^\0]*)\0", path.read_bytes())
    return [d.replace("-", "_") for d in match.group(1).decode().split(",") if d] if match else []


def _with_dependencies(names: list[str], index: dict[str, Path]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name not in index:
            raise ImageError(f"kernel module {name} not found in Debian's kernel package")
        for dep in _depends(index[name]):
            visit(dep)
        order.append(name)

    for name in names:
        visit(name)
    return order


def ensure_boot_files(cache: Path | None = None) -> BootFiles:
    """The kernel and an initramfs holding the current agent binary (rebuilt when any input changes)."""
    cache = cache or cache_dir()
    vmlinuz, modules, version = ensure_kernel(cache)
    agent = Path(agent_binary_path())
    busybox = shutil.which("busybox")
    if busybox is None:
        raise ImageError("busybox is not installed: `apt-get install busybox-static`")
    order = (modules / "order").read_text().split()
    digest = hashlib.sha256()
    for part in [INIT_SCRIPT.encode(), agent.read_bytes(), Path(busybox).read_bytes(), version.encode()]:
        digest.update(hashlib.sha256(part).digest())
    target = cache / f"initramfs-{digest.hexdigest()[:16]}.cpio"
    if not target.exists():
        entries: list[tuple[str, int, bytes]] = []
        for d in ["bin", "dev", "proc", "sys", "newroot", "modules"]:
            entries.append((d, stat.S_IFDIR | 0o755, b""))
        entries.append(("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes()))
        for applet in ["sh", "mount", "umount", "insmod", "sleep", "cat", "mkdir", "cp", "switch_root", "poweroff"]:
            entries.append((f"bin/{applet}", stat.S_IFLNK | 0o777, b"busybox"))
        entries.append(("init", stat.S_IFREG | 0o755, INIT_SCRIPT.encode()))
        entries.append(("agent", stat.S_IFREG | 0o755, agent.read_bytes()))
        entries.append(("modules.order", stat.S_IFREG | 0o644, ("\n".join(order) + "\n").encode()))
        for name in order:
            entries.append((f"modules/{name}.ko", stat.S_IFREG | 0o644, (modules / f"{name}.ko").read_bytes()))
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".initramfs-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(cpio_archive(entries))
        os.replace(tmp, target)
    return BootFiles(kernel=vmlinuz, initramfs=target, version=version)


def cpio_archive(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc-format cpio archive (what the kernel unpacks as an initramfs)."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + encoded
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


if __name__ == "__main__":
    files = ensure_boot_files()
    print(f"kernel {files.version}: {files.kernel}\ninitramfs: {files.initramfs}")
