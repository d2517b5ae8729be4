"""OCI layer tarballs ↔ overlayfs directories, whiteouts included.

An OCI layer marks a deletion with an empty file `.wh.<name>` and an opaque directory (hide everything
below from lower layers) with `<dir>/.wh..wh..opq`. Overlayfs marks them with a 0/0 character device
named `<name>` and the xattr `trusted.overlay.opaque=y`. `unpack` turns the first into the second (so a
layer directory is an overlay lower as is); `pack` does the reverse for a sandbox's upper directory.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO

from shoal.errors import ImageError

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
_CHUNK = 1 << 20

try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # zstd layers are then refused with a remedy

    class _ZstdError(Exception):  # type: ignore[no-redef]
        pass


class HashingReader:
    """A read-only stream that hashes what passes through it (and counts the bytes)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class GunzipReader:
    """Streaming gzip decoder with a read(n) interface (tarfile's own `r|gz` hides the plain bytes)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            chunk = self.raw.read(_CHUNK)
            if not chunk:
                if not self._z.eof:
                    raise ImageError("corrupt layer archive: the gzip stream is truncated; fetch the image again")
                break
            self._buf += self._z.decompress(chunk)
            while self._z.eof and self._z.unused_data:  # concatenated gzip members
                rest = self._z.unused_data
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._buf += self._z.decompress(rest)
        if n < 0:
            data, self._buf = self._buf, b""
        else:
            data, self._buf = self._buf[:n], self._buf[n:]
        return data


def plain_stream(raw: IO[bytes], media_type: str) -> IO[bytes]:
    """The uncompressed tar stream of a layer blob of `media_type` (gzip is also sniffed)."""
    if "zstd" in media_type:
        try:
            import zstandard
        except ImportError:
            raise ImageError(f"layer media type {media_type} needs `pip install zstandard`") from None
        return zstandard.ZstdDecompressor().stream_reader(raw, read_size=_CHUNK)  # type: ignore[return-value]
    return GunzipReader(raw) if "gzip" in media_type else raw  # type: ignore[return-value]


def unpack(stream: IO[bytes], dest: Path, *, apply: bool = False) -> None:
    """Extract an OCI layer tar stream into `dest`. Rejects entries that escape `dest`.

    By default `dest` gets the layer in overlay form (whiteouts kept as markers); with `apply` the layer is
    applied over what `dest` already holds (whiteouts delete, opaque markers empty the directory), which
    flattens a stack of layers into one tree.
    """
    dest.mkdir(parents=True, exist_ok=True)
    safe_dirs: set[str] = {""}
    created: set[str] | None = set() if apply else None
    try:
        with tarfile.open(fileobj=stream, mode="r|", errorlevel=2, bufsize=_CHUNK) as archive:  # type: ignore[call-overload]
            dir_times: list[tuple[Path, int]] = []
            for member in archive:
                _extract(archive, member, dest, safe_dirs, created)
                if member.isdir():
                    dir_times.append((dest / _clean(member.name), int(member.mtime)))
        for path, mtime in reversed(dir_times):  # children changed them: set directory times last
            os.utime(path, (mtime, mtime), follow_symlinks=False)
    except (tarfile.TarError, EOFError, zlib.error, _ZstdError) as exc:
        raise ImageError(f"corrupt layer archive: {exc}; fetch or export the image again") from exc


def _clean(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ImageError(f"layer entry {name!r} escapes the layer root; the archive is malicious or corrupt")
    return "/".join(parts)


def _parent_ok(dest: Path, rel: str, safe_dirs: set[str]) -> None:
    """Make the parents of `rel` (as plain directories): never follow a symlink out of the layer."""
    parent = rel.rpartition("/")[0]
    if parent in safe_dirs:
        return
    path = ""
    for part in parent.split("/"):
        path = f"{path}/{part}" if path else part
        if path in safe_dirs:
            continue
        full = dest / path
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            os.mkdir(full, 0o755)
            st = os.lstat(full)
        if not stat.S_ISDIR(st.st_mode):
            raise ImageError(f"layer entry {rel!r} lies below {path!r}, which is not a directory in this layer")
        safe_dirs.add(path)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _extract(
    archive: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, safe_dirs: set[str], created: set[str] | None
) -> None:
    rel = _clean(member.name)
    if not rel:  # the root itself: take its metadata
        _apply_meta(dest, member)
        return
    _parent_ok(dest, rel, safe_dirs)
    base = rel.rpartition("/")[2]
    head = rel.rpartition("/")[0]
    parent = dest / head if head else dest
    if base == OPAQUE_MARKER:
        if created is None:
            os.setxattr(parent, OPAQUE_XATTR, b"y")
        else:  # hide what lower layers put here, keep what this layer did
            for child in os.listdir(parent):
                if (f"{head}/{child}" if head else child) not in created:
                    _remove(parent / child)
        return
    if base.startswith(WHITEOUT_PREFIX):
        hidden = base[len(WHITEOUT_PREFIX) :]
        if hidden in ("", ".", ".."):  # `.wh..` would delete the parent, `.wh...` the layer root's parent
            raise ImageError(f"layer entry {member.name!r} is a whiteout of no valid name; the archive is malicious")
        target = parent / hidden
        _remove(target)
        if created is None:
            os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
        return
    if created is not None:
        created.add(rel)
    path = dest / rel
    if member.isdir():
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        path.mkdir(exist_ok=True)
        safe_dirs.add(rel)
    else:
        _remove(path)
        if member.isreg():
            source = archive.extractfile(member)
            assert source is not None
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                while chunk := source.read(_CHUNK):
                    out.write(chunk)
        elif member.issym():
            os.symlink(member.linkname, path)
        elif member.islnk():
            _hard_link(dest, rel, member.linkname, path)
            return  # shares the target's inode and metadata
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            os.mkfifo(path, 0o600)
        else:
            raise ImageError(f"layer entry {rel!r} has an unsupported type {member.type!r}")
    _apply_meta(path, member)


def _hard_link(dest: Path, rel: str, linkname: str, path: Path) -> None:
    """Link `path` to `linkname`, an earlier entry of this layer, walking its directories without following
    symlinks: `d -> /etc` then a hard link to `d/shadow` would otherwise link a host file into the image."""
    target = _clean(linkname)
    head, _, name = target.rpartition("/")
    if not name:
        raise ImageError(f"hard link {rel!r} names the layer root; the archive is malicious or corrupt")
    dirfd = os.open(dest, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in head.split("/") if head else ():
            try:
                inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            except OSError:  # ELOOP (a symlink), ENOTDIR, ENOENT: not a directory of this layer
                raise ImageError(
                    f"hard link {rel!r} names {linkname!r}, which is not below plain directories of this layer; "
                    "the archive is malicious or corrupt"
                ) from None
            os.close(dirfd)
            dirfd = inner
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            raise ImageError(f"hard link {rel!r} names {linkname!r}, which is not earlier in the layer") from None
        if stat.S_ISDIR(st.st_mode):
            raise ImageError(f"hard link {rel!r} names {linkname!r}, a directory; the archive is corrupt")
        os.link(name, path, src_dir_fd=dirfd, follow_symlinks=False)
    finally:
        os.close(dirfd)


def _apply_meta(path: Path, member: tarfile.TarInfo) -> None:
    os.chown(path, member.uid, member.gid, follow_symlinks=False)
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            try:
                os.setxattr(
                    path, key[len("SCHILY.xattr.") :], value.encode("utf-8", "surrogateescape"), follow_symlinks=False
                )
            except OSError:
                pass  # an xattr this filesystem refuses (e.g. security.* without the LSM): not fatal
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)  # after chown, which clears setuid/setgid
    os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


# ---------------------------------------------------------------------------- directory → OCI tar


def _walk(root: Path, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below `root` as (relative path, lstat): parents before children, names sorted."""
    with os.scandir(root / rel if rel else root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        child = f"{rel}/{entry.name}" if rel else entry.name
        st = entry.stat(follow_symlinks=False)
        yield child, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(root, child)


def pack(root: Path, out: BinaryIO, *, overlay: bool = True) -> None:
    """Write `root` as a deterministic OCI layer tar to `out`.

    With `overlay` the directory is read in overlay form (an upper dir or a layer dir): 0/0 character
    devices become `.wh.` files and opaque directories get a `.wh..wh..opq` entry.
    """
    links: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for rel, st in _walk(root):
            path = root / rel
            mode = st.st_mode
            if overlay and stat.S_ISCHR(mode) and st.st_rdev == 0:
                head, _, name = rel.rpartition("/")
                info = tarfile.TarInfo(f"{head}/{WHITEOUT_PREFIX}{name}" if head else WHITEOUT_PREFIX + name)
                info.mtime = int(st.st_mtime)
                archive.addfile(info)
                continue
            info = tarfile.TarInfo(rel)
            info.mode = stat.S_IMODE(mode)
            info.uid, info.gid = st.st_uid, st.st_gid
            info.uname = info.gname = ""
            info.mtime = int(st.st_mtime)
            for name in _xattrs(path):
                if overlay and name.startswith("trusted.overlay."):
                    continue
                value = os.getxattr(path, name, follow_symlinks=False)
                info.pax_headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
            key = (st.st_dev, st.st_ino)
            if stat.S_ISREG(mode) and st.st_nlink > 1 and key in links:
                info.type = tarfile.LNKTYPE
                info.linkname = links[key]
                archive.addfile(info)
                continue
            if stat.S_ISREG(mode):
                links.setdefault(key, rel)
                info.size = st.st_size
                with open(path, "rb") as source:
                    archive.addfile(info, source)
                continue
            if stat.S_ISDIR(mode):
                info.type = tarfile.DIRTYPE
            elif stat.S_ISLNK(mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                info.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
                info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            elif stat.S_ISFIFO(mode):
                info.type = tarfile.FIFOTYPE
            else:
                continue  # sockets are not part of a layer
            archive.addfile(info)
            if overlay and stat.S_ISDIR(mode) and _is_opaque(path):
                marker = tarfile.TarInfo(f"{rel}/{OPAQUE_MARKER}")
                marker.mtime = int(st.st_mtime)
                archive.addfile(marker)


def _xattrs(path: Path) -> list[str]:
    try:
        return sorted(os.listxattr(path, follow_symlinks=False))
    except OSError:
        return []


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False
