"""`shoal doctor`: what this host can do for each substrate, and the remedy for every gap."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shoal import cgroups, settings


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    remedy: str = ""


def _filesystems() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines()}


def _vm_accel() -> tuple[bool, str]:
    """KVM or TCG for microvm/vm, decided by booting shoal's guest kernel under KVM (not by opening /dev/kvm)."""
    if shutil.which("qemu-system-x86_64") is None:
        return False, "qemu-system-x86 not installed: no microvm/vm kinds"
    from shoal.errors import ShoalError
    from shoal.substrates.qemu.accel import detect

    try:
        accel = detect(refresh=True)
    except (ShoalError, OSError) as exc:
        return False, f"cannot probe: {exc}"
    if accel.name == "kvm":
        return True, f"microvm/vm use KVM: {accel.reason}"
    return False, f"microvm/vm use TCG (software emulation, boots take seconds): {accel.reason}"


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
    for tool, package in [("qemu-img", "qemu-utils"), ("mkfs.ext4", "e2fsprogs"), ("apt-get", "apt")]:
        path = shutil.which(tool)
        checks.append(Check(tool, path is not None, path or "not found", f"apt-get install {package}"))
    ok, detail = _vm_accel()
    checks.append(Check("vm accel", ok, detail, "snapshots/templates still make creates fast; for KVM use a "
                        "host with VMX/SVM (nested virtualization enabled), or set SHOAL_VM_ACCEL=tcg"))  # fmt: skip
    return checks + [_defaults_check(), _runtime_check()] + isolation_checks()


def _runtime_check() -> Check:
    """The runtime a node started here gives containers that name none (SHOAL_RUNTIME), and why."""
    from shoal.substrates.container.choice import choose

    try:
        choice = choose(settings.RUNTIME.get(), settings.USERNS.get())
    except ValueError as exc:
        return Check("default runtime", False, str(exc), "unset SHOAL_RUNTIME (auto) or name a runtime this host has")
    return Check("default runtime", True, f"{choice.describe()}; create(runtime=...) picks another")


def _defaults_check() -> Check:
    """The node's defaults for sandboxes that name no lifetime (what an abandoned sandbox costs, at most)."""
    from shoal.config import NodeSettings

    try:
        settings = NodeSettings.from_env()
    except ValueError as exc:
        return Check("sandbox defaults", False, str(exc), "fix the SHOAL_DEFAULT_* setting")
    ttl, idle, cpu = settings.default_ttl_s, settings.default_idle_timeout_s, settings.default_cpu
    detail = (
        f"ttl {duration(ttl)} (SHOAL_DEFAULT_TTL_S), idle timeout {duration(idle)} (SHOAL_DEFAULT_IDLE_S); "
        "create(ttl_s=None, idle_timeout_s=None) lives until closed; "
        f"cpu cap {'none' if cpu is None else f'{cpu:g} cores'} (SHOAL_DEFAULT_CPU; cpu= overrides)"
    )
    return Check("sandbox defaults", True, detail)


def duration(seconds: float | None) -> str:
    """`1d2h`, `30m`, `45s`, or `unlimited`."""
    if seconds is None:
        return "unlimited"
    left, parts = int(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts[:2])


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


def isolation_checks() -> list[Check]:
    """The isolation a sandbox effectively gets from each runtime here, and what network/disk limits need."""
    from shoal.substrates.container import oci, seccomp

    checks = []
    userns = settings.USERNS.raw()
    kept = ",".join(c.removeprefix("CAP_") for c in oci.CAPABILITIES)
    filters = f"seccomp refuses {len(seccomp.DENIED_SYSCALLS)} syscalls + clone(namespaces), ptrace attach; "
    profile = (
        f"namespaces pid,net,ipc,uts,mount,cgroup; caps {kept}; no_new_privs; {len(oci.MASKED_PATHS)} masked "
        "paths; /proc/sys and /sys read-only; devices deny-all; "
    )
    for name in ("crun", "runc", "runsc"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        seccomp_ok = "+SECCOMP" in version if name == "crun" else "libseccomp" in version or name == "runsc"
        if name == "crun" and userns:
            root = f"root → host uid {userns} (user namespace)"
        elif name == "crun":
            root = "root → host root (SHOAL_USERNS unset)"
        else:
            root = "root → host root (SHOAL_USERNS maps crun sandboxes only)"
        if name == "runsc":
            from shoal.substrates.container.runtime import runsc_platform

            detail = f"gVisor {version.split()[2] if len(version.split()) > 2 else '?'} on {runsc_platform(path)}: "
            detail += "a user-space kernel serves every syscall (OCI seccomp not applied); " + profile + root
            detail += "; no network policy yet (no host pid)"
        else:
            detail = filters + profile + root
        checks.append(
            Check(f"isolation {name}", seccomp_ok, detail, f"{name} was built without seccomp: install a build with it")
        )
    checks.append(_shoal_launcher_check(filters + profile))
    if not userns:
        max_ns = Path("/proc/sys/user/max_user_namespaces")
        ok = max_ns.exists() and int(max_ns.read_text()) > 0
        checks.append(
            Check(
                "user namespaces",
                False,
                "available but off" if ok else "disabled in this kernel",
                "set SHOAL_USERNS=100000 on the node to map sandbox root to unprivileged host uids"
                if ok
                else "sysctl user.max_user_namespaces=10000",
            )  # fmt: skip
        )
    tools = {"nft": "nftables", "ip": "iproute2", "nsenter": "util-linux"}
    missing = [pkg for tool, pkg in tools.items() if shutil.which(tool) is None]
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"
    checks.append(
        Check(
            "network policy",
            not missing,
            "nftables + veth per sandbox; IPv4 forwarding "
            + ("on" if forward else "off (the node turns it on at the first sandbox given a network policy)"),
            f"apt-get install {' '.join(missing)}",
        )  # fmt: skip
    )
    disk_ok = shutil.which("mkfs.ext4") is not None and os.path.exists("/dev/loop-control")
    checks.append(
        Check(
            "disk limits",
            disk_ok,
            "disk_mb: per-sandbox ext4 on a loop device" if disk_ok else "unavailable",
            "apt-get install e2fsprogs; modprobe loop",
        )  # fmt: skip
    )
    return checks


def _shoal_launcher_check(profile: str) -> Check:
    """runtime="shoal" (the node's own launcher): usable here, and what it enforces (crun's bundle's guarantees)."""
    from shoal.errors import InvalidRequestError
    from shoal.substrates.container import launcher

    try:
        launcher.check_host(settings.USERNS.get())
    except InvalidRequestError as exc:
        return Check("isolation shoal", False, f"not usable here: {exc}", "use runtime='crun'")
    root = "root → host root (no user namespace)"
    return Check("isolation shoal", True, f"pre-forked launcher, crun's guarantees: {profile}{root}")
