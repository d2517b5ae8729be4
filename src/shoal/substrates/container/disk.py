"""Disk limits: a sandbox with `disk_mb` keeps its overlay upper on its own size-limited ext4.

Per sandbox: `disk.img` (a sparse copy of a pre-formatted template of that size), attached to a loop
device with autoclear and mounted on `disk/`, which holds `upper/` and `work/`. A full disk or an
exhausted inode table then fails only that sandbox's writes (ENOSPC) and costs the host nothing beyond
the blocks actually written. Templates are formatted once per size (mkfs.ext4 ≈60-80 ms) and copied
sparsely per create (a few ms); sandboxes without `disk_mb` keep the plain upper directory (no cost).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import subprocess
import threading
from pathlib import Path

from shoal import linux
from shoal.errors import InvalidRequestError, SandboxLostError

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
BYTES_PER_INODE = 8192
_template_lock = threading.Lock()


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


def template(templates: Path, disk_mb: int) -> Path:
    """The formatted, sparse ext4 image of `disk_mb` MB, made once per size."""
    path = templates / f"ext4-{disk_mb}m.img"
    if path.exists():
        return path
    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        raise InvalidRequestError("disk_mb needs mkfs.ext4 on the node: apt-get install e2fsprogs")
    with _template_lock:
        if path.exists():
            return path
        templates.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as handle:
            handle.truncate(disk_mb << 20)
        argv = [mkfs, "-q", "-F", "-O", "^has_journal", "-m", "0", "-i", str(BYTES_PER_INODE),
                "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0", str(tmp)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SandboxLostError(f"mkfs.ext4 for a {disk_mb} MB sandbox disk failed: {proc.stderr.strip()}")
        os.replace(tmp, path)
    return path


def sparse_copy(source: Path, target: Path) -> None:
    """Copy only the data extents of `source` (a fresh filesystem image is mostly holes)."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only holes remain
                    break
                raise
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            copied = start
            while copied < end:
                copied += os.copy_file_range(src.fileno(), dst.fileno(), end - copied, copied, copied)
            offset = end


def attach_loop(image: Path) -> tuple[str, int]:
    """Attach `image` to a free loop device that detaches itself once unmounted and closed (autoclear).

    Returns the device and an open fd on it: close that only after mounting (autoclear acts on last close).
    """
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):  # another process may take the free device first
                number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    config = _LoopConfig(fd=backing, block_size=0)
                    config.info.lo_flags = LO_FLAGS_AUTOCLEAR
                    name = str(image).encode()[:63]
                    ctypes.memmove(config.info.lo_file_name, name, len(name))
                    fcntl.ioctl(loop, LOOP_CONFIGURE, bytes(config))
                    return device, loop
                except OSError as exc:
                    os.close(loop)
                    if exc.errno != errno.EBUSY:
                        raise
        finally:
            os.close(control)
    finally:
        os.close(backing)
    raise SandboxLostError("no free loop device after 64 tries; too many sandboxes with disk_mb at once")


def mount_disk(directory: Path, templates: Path, disk_mb: int, tag: str) -> Path:
    """Make and mount the sandbox's own disk; return the directory holding upper/ and work/.

    The image is named `disk-<tag>.img` (the node's tag) so its loop device says which node owns it.
    """
    image = directory / f"disk-{tag}.img"
    mountpoint = directory / "disk"
    mountpoint.mkdir()
    sparse_copy(template(templates, disk_mb), image)
    device, loop = attach_loop(image)
    try:
        linux.mount(device, str(mountpoint), "ext4", linux.MS_NODEV | linux.MS_NOSUID)
    finally:
        os.close(loop)  # unmounted (or never mounted) and closed: the device detaches
    return mountpoint


def unmount_disk(directory: Path) -> None:
    """Unmount the sandbox's disk if it has one (its loop device then detaches by itself)."""
    mountpoint = directory / "disk"
    if not mountpoint.is_dir():
        return
    try:
        linux.umount(str(mountpoint))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):
            raise SandboxLostError(f"could not unmount {mountpoint}: {exc}") from exc
