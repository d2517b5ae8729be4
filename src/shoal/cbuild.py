"""Build shoal's small static C programs (the guest agent, the container launcher) with gcc when stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def static_binary(binary: Path, sources: Sequence[Path]) -> str:
    """Path of `binary`, (re)built from `sources` (the first is the translation unit) if older than any.

    Built into a temporary name and renamed: a concurrent reader never sees half a binary."""
    try:
        if binary.stat().st_mtime >= max(src.stat().st_mtime for src in sources):
            return str(binary)
    except FileNotFoundError:
        if not sources[0].exists():
            raise RuntimeError(f"{binary.name} source missing: {sources[0]}") from None
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError(
            f"cannot build {binary}: gcc not found; install gcc and the static libc "
            "(e.g. `apt-get install gcc libc6-dev`) or run `make setup`"
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{binary.name}-", dir=binary.parent)
    os.close(fd)
    try:
        cmd = [gcc, "-O2", "-static", "-Wall", "-Wextra", "-o", tmp, str(sources[0])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building {binary} with gcc failed (need gcc and static libc, e.g. "
                f"`apt-get install gcc libc6-dev`):\n{proc.stderr.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, binary)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(binary)
