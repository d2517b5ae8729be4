"""A small real guest for agentless vms (tests/test_agentless.py, bench/bench_agentless.py), made from Debian
packages: no Android image can be fetched here, so this stands in for one (a kernel + initrd + disk, as AOSP's
come), and a 512-byte boot sector stands in for a disk that boots by its own loader (as Android-x86's does)."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

from shoal.substrates.qemu.kernel import cpio_archive, ensure_kernel

GUEST_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m.ko 2>/dev/null; done
mkdir -p /www /tmp
echo agentless-guest-ok > /www/index.html
ip link set lo up
dev=""; for d in /sys/class/net/*; do [ "${d##*/}" = lo ] || dev=${d##*/}; done
ip link set "$dev" up
udhcpc -i "$dev" -s /dhcp.sh -q -t 100 -T 1 -A 1
(while true; do nc -l -p 5555 > /www/adb.bin; done) &
httpd -p 8080 -h /www
setsid sh -c 'exec sh </dev/tty1 >/dev/tty1 2>&1' &
while true; do sleep 3600; done
"""
DHCP_SCRIPT = r"""#!/bin/busybox sh
case "$1" in bound|renew) ifconfig "$interface" "$ip" netmask "${subnet:-255.255.255.0}";; esac
"""


def guest_files(directory: Path) -> tuple[Path, Path, Path]:
    """(disk, kernel, initrd) of the test guest, written under `directory`."""
    kernel, modules, _version = ensure_kernel()
    order = (modules / "order").read_text().split()
    busybox = shutil.which("busybox")
    assert busybox is not None, "busybox-static is installed by `make setup`"
    entries: list[tuple[str, int, bytes]] = [
        (d, stat.S_IFDIR | 0o755, b"") for d in ["bin", "dev", "proc", "sys", "modules", "tmp"]
    ]
    entries += [
        ("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes()),
        ("init", stat.S_IFREG | 0o755, GUEST_INIT.encode()),
        ("dhcp.sh", stat.S_IFREG | 0o755, DHCP_SCRIPT.encode()),
        ("modules.order", stat.S_IFREG | 0o644, ("\n".join(order) + "\n").encode()),
    ]
    entries += [(f"modules/{m}.ko", stat.S_IFREG | 0o644, (modules / f"{m}.ko").read_bytes()) for m in order]
    initrd = directory / "initrd.cpio"
    initrd.write_bytes(cpio_archive(entries))
    disk = directory / "data.raw"
    with open(disk, "wb") as handle:
        handle.truncate(16 << 20)
    return disk, kernel, initrd


# A boot sector (16-bit x86, loaded by SeaBIOS at 0x7c00): prints a line through the VGA BIOS, then echoes
# every key the BIOS keyboard service returns. A disk that boots by its own loader, as Android-x86's does.
#   xor ax,ax; mov ds,ax; mov si,msg
#   print: lodsb; or al,al; jz keys; mov ah,0x0e; int 0x10; jmp print
#   keys: mov ah,0; int 0x16; mov ah,0x0e; int 0x10; jmp keys
#   msg: "shoal boot sector\r\n", 0
BOOT_CODE = bytes.fromhex("31c08ed8be1c7cac08c07406b40ecd10ebf5b400cd16b40ecd10ebf6") + b"shoal boot sector\r\n\0"
