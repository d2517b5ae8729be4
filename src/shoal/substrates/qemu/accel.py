"""Which accelerator QEMU can really use here: KVM if a guest actually boots under it, else TCG.

Opening /dev/kvm is not enough: under nested `kvm_pvm` the device exists but stock guest kernels hang.
So the probe boots shoal's own kernel and initramfs in probe mode and waits for its greeting on the
serial console. The verdict is cached per host boot (SHOAL_VM_ACCEL=kvm|tcg overrides it).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shoal import settings
from shoal.substrates.qemu.kernel import cache_dir, ensure_boot_files
from shoal.substrates.qemu.machine import QEMU

log = logging.getLogger("shoal.vm")
PROBE_TIMEOUT_S = settings.KVM_PROBE_TIMEOUT.get()


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" or "tcg"
    reason: str


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def detect(cache: Path | None = None, refresh: bool = False) -> Accel:
    """KVM when a probe guest boots under it within PROBE_TIMEOUT_S, otherwise TCG, with the reason."""
    forced = settings.VM_ACCEL.get()
    if forced in ("kvm", "tcg"):
        return Accel(forced, f"forced by SHOAL_VM_ACCEL={forced}")
    cache = cache or cache_dir()
    record = cache / "accel.json"
    if not refresh:
        try:
            data = json.loads(record.read_text())
            if data.get("boot_id") == _boot_id():
                return Accel(data["name"], data["reason"])
        except (OSError, ValueError, KeyError):
            pass
    accel = _probe(cache)
    if accel.name == "tcg":
        log.warning("VMs run under TCG (software emulation, slow boots): %s", accel.reason)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".accel-")
    with os.fdopen(fd, "w") as handle:
        json.dump({"name": accel.name, "reason": accel.reason, "boot_id": _boot_id()}, handle)
    os.replace(tmp, record)
    return accel


def _probe(cache: Path) -> Accel:
    if not os.path.exists("/dev/kvm"):
        return Accel("tcg", "/dev/kvm does not exist (no hardware virtualization, or the kvm module is not loaded)")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return Accel("tcg", "/dev/kvm is not accessible to this user (add it to the kvm group)")
    files = ensure_boot_files(cache)
    modules = ""
    try:
        modules = " ".join(line.split()[0] for line in Path("/proc/modules").read_text().splitlines() if "kvm" in line)
    except OSError:
        pass
    argv = [
        QEMU, "-machine", "q35", "-accel", "kvm", "-cpu", "host", "-m", "128", "-nodefaults", "-no-user-config",
        "-display", "none", "-no-reboot", "-serial", "stdio", "-kernel", str(files.kernel),
        "-initrd", str(files.initramfs), "-append", "console=ttyS0 quiet panic=-1 shoal.mode=probe",
    ]  # fmt: skip
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Accel(
            "tcg",
            f"/dev/kvm exists (modules: {modules or 'unknown'}) but a guest did not boot under it within "
            f"{PROBE_TIMEOUT_S:g} s (e.g. nested kvm_pvm, where stock guest kernels hang)",
        )
    if b"shoal-probe-ok" in proc.stdout:
        return Accel("kvm", f"a guest booted under KVM in {time.monotonic() - start:.2f} s")
    tail = " ".join((proc.stdout + proc.stderr)[-300:].decode(errors="replace").split())
    origin = " /dev/kvm comes from kvm_pvm (nested, no VMX/SVM)." if "kvm_pvm" in modules else ""
    return Accel("tcg", f"QEMU could not boot a guest under KVM (exit {proc.returncode}).{origin} QEMU said: {tail}")


if __name__ == "__main__":
    result = detect(refresh=True)
    print(f"{result.name}: {result.reason}")
