"""The root file systems of `vm` guests: Debian with systemd (image "debian") and the same with an X desktop
(image "vm-desktop"), built by shoal from Debian packages.

Built once per host into the VM cache (`rootfs/vm-debian-<hash>/`) with mmdebstrap; the guest agent runs
as a systemd unit started early in boot (sysinit), on the virtio-serial port udev names shoal.agent.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from shoal.errors import ImageError
from shoal.images.builtin import DEBIAN_PACKAGES, DEBIAN_SUITE, _host_apt_sources
from shoal.substrates.qemu.kernel import SCREEN_MODULES, ensure_modules

VM_PACKAGES = [*DEBIAN_PACKAGES, "systemd-sysv", "udev", "iproute2"]
AGENT_PATH = "/usr/local/sbin/shoal-agent"
# The agent restarts every 0.2 s until udev has named its virtio port; systemd's default start limit (5 starts
# in 10 s) would give up for good while coldplug is slow (TCG on a loaded host, a desktop's USB and input), so
# the unit has none.
AGENT_UNIT = f"""[Unit]
Description=shoal guest agent
DefaultDependencies=no
StartLimitIntervalSec=0
After=systemd-udevd.service
Wants=systemd-udevd.service

[Service]
ExecStart={AGENT_PATH} --serial /dev/virtio-ports/shoal.agent
Restart=always
RestartSec=0.2
OOMScoreAdjust=-1000

[Install]
WantedBy=sysinit.target
"""
# vm-desktop: Xorg (fbdev on the kernel's vesafb at the screen's VESA mode; libinput reads the USB tablet and
# the PS/2 keyboard through evdev), xinit, and the X tools of the `desktop` container image.
DESKTOP_PACKAGES = [
    *VM_PACKAGES, "kmod", "xserver-xorg-core", "xserver-xorg-video-fbdev", "xserver-xorg-input-libinput", "xinit",
    "xfonts-base", "xterm", "xdotool", "x11-utils", "xinput",
]  # fmt: skip
XORG_CONF = """Section "Device"
    Identifier "vga"
    Driver "fbdev"
    Option "fbdev" "/dev/fb0"
EndSection
Section "ServerFlags"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection
"""
# The session: an xterm at the top left as in the `desktop` container image. Ready (the marker the template
# waits for, substrates/qemu/substrate.py) once its window is on the screen and X has both input devices: the
# PS/2 keyboard and the USB tablet reach X through udev and evdev, seconds to minutes after X starts under
# TCG, and a template saved before would give copies whose first keys are lost.
XSESSION = """#!/bin/sh
cd /root
xterm -geometry 100x30+0+0 -e /bin/bash -l &
xdotool search --sync --onlyvisible --class xterm >/dev/null
has() { xinput list --name-only | grep -q "$1"; }
until udevadm settle --timeout=600 && has "AT Translated" && has Tablet; do sleep 0.5; done
touch /run/shoal-desktop-ready
wait
"""
# Autologin without a display manager: root's X session starts on tty1 at boot (getty@tty1 is masked).
DESKTOP_UNIT = """[Unit]
Description=shoal desktop: Xorg on tty1 with an xterm, logged in as root
After=systemd-udev-trigger.service systemd-modules-load.service
Wants=systemd-udev-trigger.service

[Service]
Environment=HOME=/root TERM=xterm LANG=C.UTF-8
WorkingDirectory=/root
ExecStart=/usr/bin/xinit /etc/shoal/xsession -- /usr/lib/xorg/Xorg :0 vt1 -keeptty -nolisten tcp -s 0 -dpms
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""
# Units a sandbox does not need: they only slow a software-emulated boot down.
MASKED = [
    "systemd-timesyncd.service", "getty@tty1.service", "serial-getty@ttyS0.service", "apt-daily.timer",
    "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer",
    "systemd-tmpfiles-clean.timer", "man-db.timer", "systemd-networkd-wait-online.service",
]  # fmt: skip


def ensure_vm_rootfs(cache: Path) -> Path:
    """The systemd Debian tree for `vm` sandboxes of image "debian" (≈30-60 s on first use, then cached)."""
    key = hashlib.sha256(" ".join([DEBIAN_SUITE, *VM_PACKAGES, AGENT_UNIT, *MASKED]).encode()).hexdigest()[:12]
    return _ensure(cache / "rootfs" / f"vm-debian-{key}", VM_PACKAGES, lambda root: None)


def ensure_desktop_rootfs(cache: Path) -> Path:
    """The tree of image "vm-desktop": the vm's Debian plus Xorg on the VGA framebuffer, logged in at boot to
    the same light desktop as the `desktop` container image (an xterm at the top left, no window manager, so
    focus follows the pointer), and the kernel modules of the USB tablet (≈3-5 min on first use, then cached)."""
    version, modules = ensure_modules(SCREEN_MODULES, cache)
    parts = [DEBIAN_SUITE, *DESKTOP_PACKAGES, AGENT_UNIT, *MASKED, DESKTOP_UNIT, XSESSION, XORG_CONF]
    parts.append(version)
    key = hashlib.sha256(" ".join([*parts, *SCREEN_MODULES]).encode()).hexdigest()[:12]

    def customize(root: Path) -> None:
        kernel_dir = root / "lib/modules" / version / "kernel/shoal"
        kernel_dir.mkdir(parents=True)
        for module in modules:
            shutil.copy2(module, kernel_dir / module.name)
        proc = subprocess.run(["chroot", str(root), "/sbin/depmod", version], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageError(f"depmod in the vm-desktop root failed: {proc.stderr.strip()[-500:]}")
        (root / "etc/modules-load.d/shoal-desktop.conf").write_text("\n".join(SCREEN_MODULES) + "\n")
        (root / "etc/X11/xorg.conf.d").mkdir(parents=True, exist_ok=True)
        (root / "etc/X11/xorg.conf.d/10-shoal.conf").write_text(XORG_CONF)
        (root / "etc/shoal").mkdir(exist_ok=True)
        session = root / "etc/shoal/xsession"
        session.write_text(XSESSION)
        session.chmod(0o755)
        (root / "etc/systemd/system/shoal-desktop.service").write_text(DESKTOP_UNIT)
        wants = root / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        (wants / "shoal-desktop.service").symlink_to("/etc/systemd/system/shoal-desktop.service")

    return _ensure(cache / "rootfs" / f"vm-desktop-{key}", DESKTOP_PACKAGES, customize)


def _ensure(target: Path, packages: list[str], customize: Callable[[Path], None]) -> Path:
    if target.exists():
        return target
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed: `apt-get install mmdebstrap` (needed to build vm images)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            root = Path(tmp, "root")
            cmd = [
                "mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(packages)}",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*", DEBIAN_SUITE, str(root), *_host_apt_sources(),
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ImageError(f"building the {target.name} root file system failed: {proc.stderr[-1500:]}")
            unit = root / "etc/systemd/system/shoal-agent.service"
            unit.write_text(AGENT_UNIT)
            wants = root / "etc/systemd/system/sysinit.target.wants"
            wants.mkdir(parents=True, exist_ok=True)
            (wants / "shoal-agent.service").symlink_to("/etc/systemd/system/shoal-agent.service")
            for name in MASKED:
                link = root / "etc/systemd/system" / name
                link.unlink(missing_ok=True)
                link.symlink_to("/dev/null")
            (root / "etc/hostname").write_text("sandbox\n")
            (root / "etc/machine-id").write_text("")
            for sub in ["work", ".shoal"]:
                (root / sub).mkdir(exist_ok=True)
            customize(root)
            root.rename(target)
    return target
