"""Start a container's runtime inside a mount namespace of its own that holds the sandbox's rootfs (issue 12).

Why: with every sandbox's overlay mounted in the node's mount namespace, the node's mount table grew by one
mount per live sandbox, and every container start copies its runtime's table (clone with CLONE_NEWNS) and
then detaches the copied old root (pivot_root, umount): both cost O(mounts), so creates slowed down as
sandboxes accumulated (3,000 took 134 s), and each overlay also propagated to the host's table.

Here one dedicated thread does, per create: unshare(CLONE_NEWNS) (a copy of the node's table, which now
stays small), make that copy private (nothing propagates back to the node or the host), mount the overlay,
posix_spawn the runtime, and setns back into the node's namespace. The runtime's child clones that
namespace for the container; once the runtime has exited, the container's own namespace is the only one
holding the overlay, and the kernel unmounts it when the container's last process is gone, so a close
needs no umount and a crashed node leaves no overlay behind in any table.

A thread may do this: unshare(CLONE_NEWNS) also gives the calling thread its own fs_struct (root, cwd), so
the node's other threads keep the node's namespace; setns back is allowed once that fs_struct is unshared.
The node reaches a running sandbox's files through /proc/<agent pid>/root (Instance.rootfs), not the bundle.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shoal import linux


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    fstype: str
    options: str


class PrivateMounts:
    """Spawns processes each inside a fresh, private copy of the node's mount namespace plus `mounts`."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-mountns")
        self._node_ns: int | None = None  # the launcher thread's namespace before its first unshare: the node's
        self._lock = threading.Lock()

    async def spawn(self, mounts: list[Mount], begin: Callable[[], int]) -> int:
        """Run `begin` (a spawn returning a pid) in a new namespace holding `mounts`; the child's pid."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._spawn, mounts, begin)

    def _spawn(self, mounts: list[Mount], begin: Callable[[], int]) -> int:
        with self._lock:
            if self._node_ns is None:
                self._node_ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            linux.unshare(linux.CLONE_NEWNS)
            try:
                linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
                for m in mounts:
                    linux.mount(m.source, m.target, m.fstype, 0, m.options)
                return begin()
            finally:
                # Back to the node's namespace: the copy lives on only in the child (and, through it, in the
                # container). Should that fail, this thread must never spawn again: a new one replaces it.
                try:
                    linux.setns(self._node_ns, linux.CLONE_NEWNS)
                except OSError:
                    self._executor.shutdown(wait=False)
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-mountns")
                    raise

    def close(self) -> None:
        self._executor.shutdown(wait=False)
        if self._node_ns is not None:
            os.close(self._node_ns)
            self._node_ns = None
