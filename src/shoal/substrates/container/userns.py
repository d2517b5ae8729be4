"""Root in the sandbox mapped to an unprivileged host uid (SHOAL_USERNS=<host uid base>, off by default).

crun 1.8.1 runs a container in a new user namespace from `uidMappings`/`gidMappings`; what it cannot do on
its own is make the image's files (owned by host uid 0) belong to the mapped root. Two ways exist:
idmapped mounts of each layer (kernel ≥5.19 for overlayfs lowers; needs mount_setattr, which crun 1.8.1
only applies to bind mounts it makes itself, not to an overlay the node made) or a copy of each layer
shifted by the base uid, made once per layer and shared by every sandbox of the node. shoal does the
latter: the first sandbox of an image pays one copy (≈1-2 s for debian), later creates pay nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

from shoal.errors import SandboxLostError

SIZE = 65536
_lock = threading.Lock()


def shifted_layers(layers: tuple[Path, ...], cache: Path, base: int) -> tuple[Path, ...]:
    """The image's layers with every owner moved up by `base`, copied once per layer."""
    return tuple(_shifted(layer, cache / str(base), base) for layer in layers)


def _shifted(layer: Path, cache: Path, base: int) -> Path:
    target = cache / layer.name
    if target.is_dir():
        return target
    with _lock:
        if target.is_dir():
            return target
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{layer.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        proc = subprocess.run(["cp", "-a", "--reflink=auto", str(layer), str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SandboxLostError(f"could not copy layer {layer} for user namespaces: {proc.stderr.strip()}")
        shift_tree(tmp, base)
        os.rename(tmp, target)
    return target


def shift_tree(root: Path, base: int) -> None:
    """Add `base` to the owner and group of every file under `root`, keeping modes (chown drops setuid)."""
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files, ""]:
            path = os.path.join(directory, name) if name else directory
            st = os.lstat(path)
            if st.st_uid >= SIZE or st.st_gid >= SIZE:
                continue
            os.lchown(path, base + st.st_uid, base + st.st_gid)
            if not os.path.islink(path):
                os.chmod(path, st.st_mode & 0o7777)


def mappings(base: int) -> dict[str, list[dict[str, int]]]:
    mapping = [{"containerID": 0, "hostID": base, "size": SIZE}]
    return {"uidMappings": mapping, "gidMappings": mapping}
