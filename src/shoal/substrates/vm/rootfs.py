"""The root file system of `vm` guests: Debian with systemd, built by shoal from Debian packages.

Built once per host into the VM cache (`rootfs/vm-debian-<hash>/`) with mmdebstrap; the guest agent runs
as a systemd unit started early in boot (sysinit), on the virtio-serial port udev names shoal.agent.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from shoal.errors import ImageError
from shoal.images.builtin import DEBIAN_PACKAGES, DEBIAN_SUITE, _host_apt_sources

VM_PACKAGES = [*DEBIAN_PACKAGES, "systemd-sysv", "udev", "iproute2"]
AGENT_PATH = "/usr/local/sbin/shoal-agent"
AGENT_UNIT = f"""[Unit]
Description=shoal guest agent
DefaultDependencies=no
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
# Units a sandbox does not need: they only slow a software-emulated boot down.
MASKED = [
    "systemd-timesyncd.service", "getty@tty1.service", "serial-getty@ttyS0.service", "apt-daily.timer",
    "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer",
    "systemd-tmpfiles-clean.timer", "man-db.timer", "systemd-networkd-wait-online.service",
]  # fmt: skip


def ensure_vm_rootfs(cache: Path) -> Path:
    """The systemd Debian tree for `vm` sandboxes of image "debian" (≈30-60 s on first use, then cached)."""
    key = hashlib.sha256(" ".join([DEBIAN_SUITE, *VM_PACKAGES, AGENT_UNIT, *MASKED]).encode()).hexdigest()[:12]
    target = cache / "rootfs" / f"vm-debian-{key}"
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
                "mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(VM_PACKAGES)}",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*", DEBIAN_SUITE, str(root), *_host_apt_sources(),
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ImageError(f"building the vm root file system failed: {proc.stderr[-1500:]}")
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
            root.rename(target)
    return target
