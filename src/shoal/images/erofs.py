"""EROFS layers: convert a layer directory to an EROFS image file, and mount those files for sandboxes.

Linux ≥ 6.12 mounts an EROFS image straight from a regular file (no loop device). Each layer is mounted
read-only once per node, under `$SHOAL_HOME/layers/<id>`, and shared by every sandbox stacking it; the
mount goes a short while (the linger, SHOAL_LAYER_LINGER_S) after the last sandbox using it does. A shared
flock on the layer's record tells garbage collection (possibly in another node sharing the store) that the
layer is in use; a lingering layer holds it too, so such a collection keeps it until the linger ends.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import threading
import time
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
    idle_until: float = 0.0  # refs 0: kept (mounted, flock held) until this time.monotonic()


class LayerMounts:
    """Reference-counted read-only mounts of layers, one per layer per node.

    A layer whose last reference goes is kept for `linger_s` more seconds, owned by this object (it is in
    `_held` with no references): a create of the same image within that time takes it as it is. Why (issue
    12): mounting an EROFS layer costs ≈1 ms of a create and unmounting it ≈1.5 ms of a close, paid at every
    create and close while sandboxes of an image come and go one at a time. Bounded by time: `close_idle`
    (called by the node when the earliest linger ends) closes what lingered its time, `release_all` (the
    node's shutdown) and `close_idle(everything=True)` (before a prune) close them at once; a node killed
    outright loses its mount namespace with them, and its successor's `unmount_stale` clears the rest."""

    def __init__(self, mount_root: Path, linger_s: float = 0.0) -> None:
        self.mount_root = mount_root
        self.linger_s = linger_s
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
        """Drop a reference on each layer if none of them must be unmounted now (another reference stays, or
        the last lingers): no I/O, fit for the event loop; False, dropping nothing, otherwise."""
        with self._lock:
            held = [self._held.get(layer_id) for layer_id in layer_ids]
            if any(h is None or (h.refs <= 1 and self.linger_s <= 0) for h in held):
                return False
            for h in held:
                self._drop(h)  # type: ignore[arg-type]
            return True

    def release(self, layer_id: str) -> None:
        with self._lock:
            held = self._held.get(layer_id)
            if held is None:
                return
            self._drop(held)
            if held.refs <= 0 and self.linger_s <= 0:
                del self._held[layer_id]
                self._close(held)

    def _drop(self, held: _Held) -> None:
        held.refs -= 1
        if held.refs <= 0:
            held.idle_until = time.monotonic() + self.linger_s

    def close_idle(self, everything: bool = False) -> float | None:
        """Close the layers that lingered their time (`everything`: every lingering one); when the next
        linger ends (time.monotonic()), or None if none lingers."""
        with self._lock:
            now, next_end = time.monotonic(), None
            for layer_id, held in list(self._held.items()):
                if held.refs > 0:
                    continue
                if everything or held.idle_until <= now:
                    del self._held[layer_id]
                    self._close(held)
                else:
                    next_end = held.idle_until if next_end is None else min(next_end, held.idle_until)
            return next_end

    def release_all(self) -> None:
        with self._lock:
            for held in self._held.values():
                self._close(held)
            self._held.clear()

    def in_use(self) -> dict[str, int]:
        """Layers some sandbox uses, with their references (lingering ones left out)."""
        with self._lock:
            return {k: v.refs for k, v in self._held.items() if v.refs > 0}

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
