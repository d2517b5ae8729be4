"""Thin wrappers over the Linux system calls shoal needs that Python's os module lacks."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import subprocess

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {fstype or ''} {source} on {target}",
    )


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mountpoints() -> dict[str, str]:
    """Mount points of this process's mount namespace → filesystem type."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            target = left.split()[4].replace("\\040", " ")
            found[target] = right.split()[0]
    return found


def is_mountpoint(path: str) -> bool:
    return os.path.realpath(path) in mountpoints()


def remove_directory(path: str, known_dirs: tuple[str, ...] = (), known_files: tuple[str, ...] = ()) -> None:
    """Delete `path` without walking it in Python: the known entries with a syscall each, the top level's
    files by one listing; whatever else is there (a sandbox that wrote files) goes to `rm -rf` (a C walk in
    its own process, staying on this file system), so the node's own CPU per close does not grow with what
    the sandbox wrote."""
    for name in known_files:
        with contextlib.suppress(OSError):
            os.unlink(f"{path}/{name}")
    for name in known_dirs:
        with contextlib.suppress(OSError):
            os.rmdir(f"{path}/{name}")
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
        os.rmdir(path)
        return
    except FileNotFoundError:
        return
    except OSError:  # not empty: directories the sandbox made
        pass
    subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)  # fmt: skip
