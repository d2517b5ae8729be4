"""Disks: one shared read-only base per image (ext4 built from its layers), one thin qcow2 overlay per VM."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from shoal import linux
from shoal.errors import ImageError
from shoal.images import Image

MIN_DISK_MB = 2048
# No blocks reserved for root (-m 0): a VM's disk_mb is the free space the agent leaves on this file system
# (agent.c set_disk_cap), and it should mean the same for root and other users. Part of the disk's name.
MKFS_FORMAT = "ext4 -m 0"


def file_part(name: str) -> str:
    """An image name as one safe file name component (names may hold '/', '..', ':'); the callers add a
    digest, so names that map to the same text never share a file."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name).lstrip(".")[:80] or "_"


def base_disk(image: Image, cache: Path, extra: dict[str, str] | None = None) -> Path:
    """The image's layers as an ext4 file system in a raw file, built once and shared by every VM.

    `extra` maps guest paths to host files copied in (e.g. the agent and its systemd unit for `vm`).
    """
    # Content-addressed layers are keyed by id (their mount paths differ per node), others by path.
    digest = hashlib.sha256("\0".join(image.layer_ids or tuple(str(p) for p in image.layers)).encode())
    digest.update(MKFS_FORMAT.encode())
    for guest_path, host_path in sorted((extra or {}).items()):
        digest.update(guest_path.encode() + hashlib.sha256(Path(host_path).read_bytes()).digest())
    target = cache / "disks" / f"{file_part(image.name)}-{digest.hexdigest()[:16]}.raw"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if shutil.which("mkfs.ext4") is None:
        raise ImageError("mkfs.ext4 is missing: `apt-get install e2fsprogs`")
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            source = Path(tmp, "root")
            source.mkdir()
            mounted = len(image.layers) > 1
            try:
                if mounted:
                    lowers = ":".join(str(p) for p in reversed(image.layers))
                    linux.mount("overlay", str(source), "overlay", linux.MS_RDONLY, f"lowerdir={lowers}")
                    tree = Path(tmp, "tree")
                    _copy_tree(source, tree)
                    source_dir = tree
                else:
                    source_dir = image.layers[0]
                if extra:
                    tree = Path(tmp, "tree")
                    if source_dir != tree:
                        _copy_tree(source_dir, tree)
                    for guest_path, host_path in extra.items():
                        dest = tree / guest_path.lstrip("/")
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(host_path, dest)
                    source_dir = tree
                used_mb = _du_mb(source_dir)
                size_mb = max(MIN_DISK_MB, used_mb * 2 + 512)
                raw = Path(tmp, "disk.raw")
                proc = subprocess.run(
                    ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "shoal", "-E", "root_owner=0:0", "-d", str(source_dir),
                     str(raw), f"{size_mb}M"],
                    capture_output=True, text=True,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise ImageError(f"building the disk of image {image.name!r} failed: {proc.stderr.strip()}")
                os.chmod(raw, 0o444)
                os.replace(raw, target)
            finally:
                if mounted:
                    linux.umount(str(source))
    return target


def _copy_tree(source: Path, target: Path) -> None:
    """`cp -a`: keeps device nodes, hard links, owners and modes (a Python copy would read /dev/zero)."""
    proc = subprocess.run(["cp", "-a", "--reflink=auto", f"{source}/.", str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"copying {source} failed: {proc.stderr.strip()[-500:]}")


def _du_mb(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total >> 20


def overlay(path: Path, backing: Path) -> None:
    """A thin qcow2 whose reads fall through to `backing` (raw or qcow2) and whose writes stay private."""
    fmt = "raw" if backing.suffix == ".raw" else "qcow2"
    proc = subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", fmt, str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ImageError(f"qemu-img create {path} failed: {proc.stderr.strip()} (is qemu-utils installed?)")
