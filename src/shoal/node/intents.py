"""Steps that are running, as the trajectory log keeps them: one append to a plain file per step, not a SQLite
commit.

A step's intent (it is about to run) must outlive the node process, so that a re-issue after a crash raises
(its outcome is unknown) instead of running it twice; it need not outlive the machine, which takes its
sandboxes with it. A write() into the page cache is all that takes. As a SQLite commit it cost a logged step
a second WAL frame (a 4 KiB page, six fcntl locks, two pwrites: 60-90 µs of the loop's time before the step
could start, issue 12); here it is one write() of ~150 bytes. The step's result row, written to SQLite when
it ends, supersedes it.

The file holds length-prefixed msgpack rows in the `steps` table's column order. A node that starts moves
the rows it finds into the table (those whose step has no row yet, of sandboxes the log still has), then
starts the file over; while it grows past ROTATE_BYTES it is rewritten with only the running steps (a new
file renamed over the old: a crash leaves one or the other, both complete).
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import msgspec

ROTATE_BYTES = 1 << 20
_LENGTH = struct.Struct("<I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class IntentJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.running: dict[tuple[str, int], tuple] = {}  # (sandbox_id, seq) -> its row, until its result is in
        self._fd = -1
        self._size = 0

    def recover(self) -> list[tuple]:
        """The rows a node that stopped left (read before `open` starts the file over)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        rows, at = [], 0
        while at + _LENGTH.size <= len(data):
            (size,) = _LENGTH.unpack_from(data, at)
            body = data[at + _LENGTH.size : at + _LENGTH.size + size]
            if len(body) < size:  # a write cut short (a full disk): nothing after it was written
                break
            try:
                rows.append(tuple(_decode(body)))
            except msgspec.DecodeError:
                break
            at += _LENGTH.size + size
        return rows

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = 0

    def add(self, row: tuple) -> None:
        """Keep `row` (a running step's, in the steps table's column order); OSError if the disk refused it."""
        frame = _frame(row)
        self._write(self._fd, frame)
        self.running[(row[0], row[1])] = row
        self._size += len(frame)
        if self._size > ROTATE_BYTES:
            self._rotate()

    def done(self, sandbox_id: str, seq: int) -> None:
        self.running.pop((sandbox_id, seq), None)

    def _rotate(self) -> None:
        fresh = self.path.with_name(self.path.name + ".new")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            self._write(fd, b"".join(_frame(row) for row in self.running.values()))
            os.replace(fresh, self.path)
        except BaseException:
            os.close(fd)
            fresh.unlink(missing_ok=True)
            raise
        os.close(self._fd)
        self._fd = fd
        self._size = os.fstat(fd).st_size

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        written = os.write(fd, data) if data else 0
        if written != len(data):  # a regular file writes short only when the disk is full: take the piece back
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_END) - written)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _frame(row: tuple) -> bytes:
    body = _encode(row)
    return _LENGTH.pack(len(body)) + body
