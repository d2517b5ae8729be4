"""fdatasync of the trajectory log's WAL without a thread: Linux AIO (IOCB_CMD_FDSYNC) completing on an eventfd
that the node's event loop watches.

Why: every logged step waits for an fsync that covers it, and handing that fsync to a thread and back cost
the node more CPU than the rest of a logged step (a queue put, a thread wake-up, the GIL taken and given
back, a call_soon_threadsafe through the loop's self-pipe: bench_hotpath_ab measured 0.8 node CPU-ms per
logged exec for the fsync path, of which the fdatasync call itself is 0.1-0.3). Here a sync is one
io_submit; the kernel runs it and signals the eventfd; the loop's reader reaps it.

Linux 4.18 or later (Debian 12 ships 6.1). Where io_setup or an AIO fsync fails (an old kernel, aio-max-nr
exhausted, a seccomp filter, a file system that refuses), `WalSync.open` returns None and the log keeps
its syncer thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_SYSCALLS = {  # io_setup, io_destroy, io_getevents, io_submit
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),
}
IOCB_CMD_FDSYNC = 3
IOCB_FLAG_RESFD = 1


class _Iocb(ctypes.Structure):
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),  # little-endian order of the kernel's PADDED(aio_key, aio_rw_flags)
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class WalSync:
    """One fdatasync at a time of one file: `submit` starts it, `reap` (once `eventfd` is readable) ends it."""

    def __init__(self, fd: int, ctx: ctypes.c_ulong, numbers: tuple[int, int, int, int]) -> None:
        self.fd = fd
        self._ctx = ctx
        _, self._destroy, self._getevents, self._submit = numbers
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._iocb = _Iocb(
            aio_lio_opcode=IOCB_CMD_FDSYNC, aio_fildes=fd, aio_flags=IOCB_FLAG_RESFD, aio_resfd=self.eventfd
        )
        self._iocbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(self._iocb))
        self._events = (_Event * 1)()
        self._zero = _Timespec()

    @classmethod
    def open(cls, path: str) -> WalSync | None:
        """A syncer of `path`, or None where Linux AIO cannot fsync it (the caller then uses a thread)."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or not hasattr(os, "eventfd"):
            return None
        ctx = ctypes.c_ulong(0)
        if _syscall(numbers[0], 4, ctypes.byref(ctx)) != 0:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _syscall(numbers[1], ctx)
            return None
        sync = cls(fd, ctx, numbers)
        try:  # the kernel may refuse an fsync through AIO on this file system: find out now, not per step
            sync.submit()
            if not sync.wait():
                raise OSError("the first fdatasync through AIO failed")
        except OSError:
            sync.close()
            return None
        return sync

    def submit(self) -> None:
        """Start an fdatasync of the file; OSError if the kernel refused it."""
        if _syscall(self._submit, self._ctx, 1, self._iocbs) != 1:
            err = ctypes.get_errno()
            raise OSError(err, f"io_submit (fdatasync): {os.strerror(err)}")

    def reap(self) -> int | None:
        """After `eventfd` became readable: None if nothing completed, else the fdatasync's result (0, or a
        negative errno)."""
        try:
            os.eventfd_read(self.eventfd)
        except BlockingIOError:
            return None
        got = _syscall(self._getevents, self._ctx, 1, 1, self._events, ctypes.byref(self._zero))
        return int(self._events[0].res) if got == 1 else None

    def wait(self) -> bool:
        """Block until the submitted fdatasync completed (`open` only); True if it succeeded."""
        got = _syscall(self._getevents, self._ctx, 1, 1, self._events, None)
        if got == 1:
            os.eventfd_read(self.eventfd)
        return got == 1 and self._events[0].res == 0

    def close(self) -> None:
        _syscall(self._destroy, self._ctx)  # waits for a submitted sync to finish
        os.close(self.eventfd)
        os.close(self.fd)
