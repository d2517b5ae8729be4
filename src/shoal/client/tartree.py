"""A local directory tree as tar streams for `files.upload`: one request per batch instead of one per file.

Members are directories, regular files and symlinks (as links; the agent never follows them), in sorted
order with fixed owner and time, so the same tree gives the same bytes (a re-run's steps match the
trajectory log). Other kinds (sockets, devices, fifos) are left out.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

BATCH_BYTES = 64 << 20  # a new tar (request) once a batch holds this much file data


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = 0
    return info


def batches(root: Path, batch_bytes: int = BATCH_BYTES, big: list[str] | None = None) -> Iterator[tuple[bytes, int]]:
    """(tar bytes, regular files in it) for the tree under `root`, each tar at most about `batch_bytes`.
    With `big`, a regular file larger than `batch_bytes` is left out and its relative name appended there
    (the caller sends it by itself, in chunks: no request and no buffer holds it whole)."""
    buffer = io.BytesIO()
    archive = tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT)  # noqa: SIM115 - spans batches
    files = size = 0
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(directory)
        for name in sorted(dirnames + filenames):
            path = base / name
            relative = path.relative_to(root).as_posix()
            st = path.lstat()
            info = _info(relative, st)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                archive.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                if big is not None and st.st_size > batch_bytes:
                    big.append(relative)
                    continue
                if size and size + st.st_size > batch_bytes:
                    archive.close()
                    yield buffer.getvalue(), files
                    buffer = io.BytesIO()
                    archive = tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT)  # noqa: SIM115 - spans batches
                    files = size = 0
                with open(path, "rb") as content:
                    info.size = os.fstat(content.fileno()).st_size
                    archive.addfile(info, content)
                files += 1
                size += info.size
    archive.close()
    yield buffer.getvalue(), files
