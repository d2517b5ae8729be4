"""Start a local node process for the SDK (`shoal.Client()` with no node running yet).

The SDK only runs `python -m shoal.node` as a detached process and waits for its ready line; it imports no
node code, so the client stays free of host-side modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shoal.config import Paths
from shoal.errors import NodeError


def spawn_background(paths: Paths, timeout: float = 30.0) -> None:
    """Start a node for `paths` as a detached process and wait until it serves (or say why not)."""
    paths.home.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, SHOAL_READY_FD=str(write_fd), SHOAL_HOME=str(paths.home), SHOAL_IMAGES=str(paths.images))
    if env.get("PYTHONPATH"):  # the node starts in "/": a relative entry (`PYTHONPATH=src`) would name another tree
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p for p in env["PYTHONPATH"].split(os.pathsep))
    with open(paths.log, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.node"],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            env=env,
            pass_fds=[write_fd],
            start_new_session=True,
            cwd="/",
        )
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    try:
        with os.fdopen(read_fd, "rb") as ready:
            line = ready.readline()  # EOF if the node dies before it serves
        if line.strip() == b"ready":
            return
        if proc.poll() is None and time.monotonic() < deadline:
            return
    finally:
        pass
    tail = _tail(paths.log)
    raise NodeError(f"the shoal node did not start (exit {proc.poll()}); its log {paths.log} ends:\n{tail}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
