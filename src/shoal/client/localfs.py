"""Writing a sandbox's files onto the client host without letting the sandbox choose where they land.

The sandbox controls the names, kinds and symlink targets a download reports. `TreeWriter` creates every
entry below one root through directory descriptors opened with O_NOFOLLOW, so nothing on the way is ever
followed: a symlink (or file) where a directory must be is replaced by the directory, a file lands by
`rename` (which replaces a link instead of writing through it), so a second download into the same place
cannot write through links the first one (or anything else) left there. A symlink is recreated only if
it cannot lead out of the root: relative, with `..` only as leading components and no more of them than
its depth (links below then only descend, so chains of them stay inside too), and not resolving outside
now. Other links, and names that are not plain relative paths, are skipped and listed in `skipped`.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeWriter:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the caller's own path
        self.skipped: list[str] = []

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def __enter__(self) -> TreeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- entries

    def mkdir(self, name: str) -> None:
        parts = self._parts(name)
        if parts:
            os.close(self._walk(parts))

    def write_file(self, name: str, data: bytes, mode: int) -> bool:
        parts = self._parts(name)
        if not parts:
            return False
        parent = self._walk(parts[:-1])
        try:
            write_at(parent, parts[-1], data, mode)
        finally:
            os.close(parent)
        return True

    def symlink(self, name: str, target: str) -> bool:
        parts = self._parts(name)
        if not parts:
            return False
        if not _stays_inside(target, depth=len(parts) - 1) or not self._resolves_inside(parts, target):
            self.skipped.append(f"{name} -> {target}")
            return False
        parent = self._walk(parts[:-1])
        try:
            base = parts[-1]
            try:
                st = os.stat(base, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(base, dir_fd=parent) == target:
                return True
            if st is not None and stat.S_ISDIR(st.st_mode):
                self.skipped.append(f"{name} -> {target} (a directory is in its place here)")
                return False
            if st is not None:
                os.unlink(base, dir_fd=parent)
            os.symlink(target, base, dir_fd=parent)
        finally:
            os.close(parent)
        return True

    # ---------------------------------------------------------------- paths

    def _parts(self, name: str) -> list[str]:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or ".." in parts or "\0" in name:
            self.skipped.append(f"{name} (not a plain relative path)")
            return []
        return parts

    def _walk(self, parts: list[str]) -> int:
        """A descriptor of root/parts as real directories (made, or put in place of links and files)."""
        fd = os.dup(self.root_fd)
        try:
            for part in parts:
                try:
                    inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        raise
                    if exc.errno != errno.ENOENT:  # a symlink or a file: replaced, never followed
                        os.unlink(part, dir_fd=fd)
                    os.mkdir(part, 0o755, dir_fd=fd)
                    inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _resolves_inside(self, parts: list[str], target: str) -> bool:
        """Also true of the links already here (a link made by an older download may lead out)."""
        root = os.path.realpath(self.root)
        where = os.path.realpath(os.path.join(root, *parts[:-1], target))
        return where == root or where.startswith(root + os.sep)


def _stays_inside(target: str, depth: int) -> bool:
    if not target or target.startswith("/"):
        return False
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    return ups <= depth and ".." not in parts[ups:]


def write_at(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """Write a new file next to `name` and rename it over `name`: a link there is replaced, not followed."""
    tmp = f".{name[:200]}.shoal-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode & 0o777)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write `path` (its parents are the caller's choice; its last component is replaced, never followed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_at(parent, path.name, data, mode)
    finally:
        os.close(parent)
