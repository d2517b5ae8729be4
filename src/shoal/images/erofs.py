"""EROFS layers: convert a layer directory to an EROFS image file, and mount those files for sandboxes.

Linux ≥ 6.12 mounts an EROFS image straight from a regular file (no loop device). Each layer is mounted
read-only once per node, under `$SHOAL_HOME/layers/<id>`, and shared by every sandbox stacking it; the
mount goes when the last sandbox using it does. A shared flock on the layer's record tells garbage
collection (possibly in another node sharing the store) that the layer is in use.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from shoal import linux, settings
from shoal.errors import ImageError

_SUPPORTED: bool | None = None


def supported() -> bool:
    """EROFS in the kernel and mkfs.erofs on the PATH (SHOAL_EROFS=0 forces plain directories)."""
    global _SUPPORTED
    if not settings.EROFS.get():
        return False
    if _SUPPORTED is None:
        try:
            kernel = "erofs" in Path("/proc/filesystems").read_text()
        except OSError:
            kernel = False
        _SUPPORTED = kernel and shutil.which("mkfs.erofs") is not None
    return _SUPPORTED


def mkfs(source: Path, image: Path) -> None:
    """Write directory `source` (in overlay form: whiteouts, opaque xattrs) as an EROFS image."""
    result = subprocess.run(
        ["mkfs.erofs", "--quiet", "--preserve-mtime", "-x1", str(image), str(source)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        image.unlink(missing_ok=True)
        full = "No space left" in result.stderr
        remedy = "free disk space under the image store" if full else "check the layer's contents"
        raise ImageError(f"mkfs.erofs failed (exit {result.returncode}): {result.stderr.strip()[-500:]}; {remedy}")


@dataclass
class _Held:
    path: Path
    refs: int
    lock_fd: int
    mounted: bool


class LayerMounts:
    """Reference-counted read-only mounts of layers, one per layer per node."""

    def __init__(self, mount_root: Path) -> None:
        self.mount_root = mount_root
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def acquire(self, layer_id: str, layer_dir: Path) -> Path:
        """The directory to use as an overlay lower for this layer (mounting it on first use)."""
        with self._lock:
            held = self._held.get(layer_id)
            if held is None:
                held = self._open(layer_id, layer_dir)
                self._held[layer_id] = held
            held.refs += 1
            return held.path

    def acquire_mounted(self, layer_ids: tuple[str, ...]) -> list[Path] | None:
        """Take another reference on layers that are all mounted already (no I/O: fit for the event loop);
        None, taking nothing, if one of them is not."""
        with self._lock:
            held = [self._held.get(layer_id) for layer_id in layer_ids]
            if any(h is None for h in held):
                return None
            for h in held:
                h.refs += 1  # type: ignore[union-attr]
            return [h.path for h in held]  # type: ignore[union-attr]

    def release_if_shared(self, layer_ids: tuple[str, ...] | list[str]) -> bool:
        """Drop a reference on each layer if none of them is its last (no unmount: fit for the event loop);
        False, dropping nothing, otherwise."""
        with self._lock:
            held = [self._held.get(layer_id) for layer_id in layer_ids]
            if any(h is None or h.refs <= 1 for h in held):
                return False
            for h in held:
                h.refs -= 1  # type: ignore[union-attr]
            return True

    def release(self, layer_id: str) -> None:
        with self._lock:
            held = self._held.get(layer_id)
            if held is None:
                return
            held.refs -= 1
            if held.refs <= 0:
                del self._held[layer_id]
                self._close(held)

    def release_all(self) -> None:
        with self._lock:
            for held in self._held.values():
                self._close(held)
            self._held.clear()

    def in_use(self) -> dict[str, int]:
        with self._lock:
            return {k: v.refs for k, v in self._held.items()}

    def _open(self, layer_id: str, layer_dir: Path) -> _Held:
        try:
            lock_fd = os.open(layer_dir / "layer.json", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ImageError(
                f"layer {layer_id[:19]} is missing from the store (removed?); pull or rebuild the image"
            ) from None
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # waits while a garbage collector holds it exclusively
        try:
            if os.fstat(lock_fd).st_ino != os.stat(layer_dir / "layer.json").st_ino:
                raise FileNotFoundError
            image = layer_dir / "fs.erofs"
            if not image.exists():
                return _Held(path=layer_dir / "fs", refs=0, lock_fd=lock_fd, mounted=False)
            target = self.mount_root / layer_id.partition(":")[2][:24]  # short: overlay options fit one page
            target.mkdir(parents=True, exist_ok=True)
            if not linux.is_mountpoint(str(target)):
                mount_image(image, target)
            return _Held(path=target, refs=0, lock_fd=lock_fd, mounted=True)
        except FileNotFoundError:
            os.close(lock_fd)
            raise ImageError(
                f"layer {layer_id[:19]} was removed while being mounted; pull or rebuild the image"
            ) from None
        except BaseException:
            os.close(lock_fd)
            raise

    @staticmethod
    def _close(held: _Held) -> None:
        try:
            if held.mounted:
                unmount_quietly(held.path)
                held.path.rmdir()
        finally:
            os.close(held.lock_fd)


def mount_image(image: Path, target: Path) -> None:
    """Mount an EROFS image read-only: from the file itself, or through an auto-clearing loop device where
    the file's filesystem cannot back a mount (tmpfs, for one)."""
    try:
        linux.mount(str(image), str(target), "erofs", linux.MS_RDONLY | linux.MS_NODEV, None)
        return
    except OSError as exc:
        if exc.errno != errno.ENOTBLK:
            raise ImageError(f"cannot mount layer image {image}: {exc}") from exc
    result = subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro,nodev,loop", str(image), str(target)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ImageError(f"cannot mount layer image {image} (file or loop device): {result.stderr.strip()}")


def unmount_quietly(path: Path) -> None:
    try:
        linux.umount(str(path))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):
            raise


def unmount_stale(mount_root: Path) -> list[str]:
    """Unmount every layer mount under `mount_root` (left by a node that crashed); returns them."""
    prefix = str(mount_root) + "/"
    stale = [target for target in linux.mountpoints() if target.startswith(prefix)]
    for target in stale:
        unmount_quietly(Path(target))
    if mount_root.is_dir():
        for child in mount_root.iterdir():
            try:
                child.rmdir()
            except OSError:
                pass
    return stale
