"""`shoal doctor`: what this host can do for each substrate, and the remedy for every gap."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shoal import cgroups


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    remedy: str = ""


def _filesystems() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines()}


def _kvm_boots() -> tuple[bool, str]:
    """Does KVM actually run a guest? Opening /dev/kvm is not enough (nested PVM hosts hang at boot)."""
    if not os.path.exists("/dev/kvm"):
        return False, "/dev/kvm is absent"
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        return False, "/dev/kvm present; qemu-system-x86 not installed, so no boot probe"
    modules = Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""
    if "kvm_pvm" in modules:
        return False, "/dev/kvm comes from kvm_pvm (nested, no VMX/SVM): stock guest kernels hang; TCG fallback"
    # A guest that runs one HLT-free instruction stream and powers off: qemu's own firmware boot probe.
    try:
        proc = subprocess.run(
            [qemu, "-accel", "kvm", "-machine", "microvm", "-nodefaults", "-no-user-config", "-display", "none",
             "-m", "16", "-bios", "/dev/null", "-S", "-qmp", "stdio"],
            input=b'{"execute":"qmp_capabilities"}\n{"execute":"query-kvm"}\n{"execute":"quit"}\n',
            capture_output=True,
            timeout=10,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, "qemu with -accel kvm did not answer in 10 s"
    if b'"enabled": true' in proc.stdout:
        return True, "qemu starts with KVM acceleration"
    return False, f"qemu could not use KVM: {proc.stderr.decode(errors='replace')[-200:]}"


def run_checks() -> list[Check]:
    checks = [
        Check("root", os.geteuid() == 0, f"euid {os.geteuid()}", "run the node as root"),
    ]
    for name, package in [("crun", "crun"), ("runc", "runc"), ("runsc", "gVisor runsc")]:
        path = shutil.which(name)
        checks.append(Check(f"runtime {name}", path is not None, path or "not found", f"install {package}"))
    fs = _filesystems()
    checks.append(Check("overlayfs", "overlay" in fs, "in /proc/filesystems" if "overlay" in fs else "missing",
                        "modprobe overlay"))  # fmt: skip
    checks.append(Check("erofs", "erofs" in fs, "in /proc/filesystems" if "erofs" in fs else "missing",
                        "modprobe erofs (layers then fall back to directories)"))  # fmt: skip
    layout = cgroups.layout()
    detail = {"v2": "cgroup v2 (unified)", "v1": "cgroup v1", "hybrid": "hybrid v1 + empty v2: the node hides "
              "the v2 mount from crun in its own mount namespace"}[layout]  # fmt: skip
    checks.append(Check("cgroups", True, detail))
    for tool, package in [("mmdebstrap", "mmdebstrap"), ("busybox", "busybox-static"), ("gcc", "gcc"),
                          ("mkfs.erofs", "erofs-utils"), ("qemu-system-x86_64", "qemu-system-x86")]:  # fmt: skip
        path = shutil.which(tool)
        checks.append(Check(tool, path is not None, path or "not found", f"apt-get install {package}"))
    ok, detail = _kvm_boots()
    checks.append(Check("kvm", ok, detail, "microvm/vm fall back to TCG (slow); use a host with VMX/SVM"))
    return checks


def report() -> tuple[str, bool]:
    lines = []
    essential = {"root", "runtime crun", "overlayfs", "busybox", "gcc"}
    healthy = True
    for check in run_checks():
        mark = "ok  " if check.ok else "FAIL" if check.name in essential else "warn"
        healthy &= check.ok or check.name not in essential
        line = f"[{mark}] {check.name:<20} {check.detail}"
        if not check.ok and check.remedy:
            line += f"\n       remedy: {check.remedy}"
        lines.append(line)
    return "\n".join(lines), healthy
