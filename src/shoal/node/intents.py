"""The trajectory log's journal: what makes a step durable. One pwrite() into a pre-zeroed file per record, and one
fdatasync of that file (node/walsync.py) covers every record written before it, across sandboxes.

Records: a running step's intent (it is about to run), a step's result, a sandbox opened or closed. SQLite
(node/trajectory.py) gets the results in batches, off the step's path and without an fsync of its own: a node
that starts replays the journal into SQLite (in the order written: an intent never overrides a result already
there, a result replaces its intent), fsyncs SQLite's WAL and only then starts the journal over. Why: a SQLite
commit per result cost a logged exec 15 of its 33.6 syscalls (a 4 KiB WAL frame, six fcntl locks, ≈35 µs of
the loop) and its own fdatasync of a WAL that also takes the checkpoints (issue 12); a journal record is one
pwrite of ~200 bytes, and a batch of a hundred rows costs SQLite about what one row did.

Layout. A 16-byte header (MAGIC, then the epoch: a u64 that every start-over increments) and records from
byte 16: a u32 length, a u32 CRC-32 of the body seeded with the epoch, the body (msgpack of a tuple; a step
in the `steps` table's column order, 10 fields, its intent with `finished_at` None; a sandbox opened, 6 fields;
closed, 5). The file is JOURNAL_BYTES of zeros written once (not fallocated: unwritten extents would make
every fdatasync commit their conversion to the file system's journal, the cost bench/bench_walfloor.py
measured for a growing WAL), so an fdatasync commits no size or extent change (on ext4 without a journal it
still writes the inode's block when a write moved the mtime, i.e. in a new clock tick: bench/bench_logpath.py).
Recovery reads records until a zero length or a CRC that fails: a torn record, or the stale records of an
earlier epoch past the tail, end it.

Starting over (`rotate`, once the tail passes ROTATE_BYTES) happens in place: a new epoch in the header, then
the running steps' intents from byte 16. The caller first puts every result into SQLite and fsyncs the WAL, so
whichever header a crash leaves on disk, nothing acknowledged depends on the records it can no longer read.
Files from before this layout (length-prefixed msgpack intents) are still read, then replaced.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path

import msgspec

MAGIC = b"SHOALJ1\0"
JOURNAL_BYTES = 8 << 20  # the pre-zeroed size (on a disk without the room, the file grows as records come)
ROTATE_BYTES = 4 << 20  # the tail past which the caller starts the journal over
_HEADER = struct.Struct("<8sQ")
_RECORD = struct.Struct("<II")
_LEGACY = struct.Struct("<I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class IntentJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.running: dict[tuple[str, int], tuple] = {}  # (sandbox_id, seq) -> its intent, until its result is in
        self.offset = _HEADER.size  # where the next record goes
        self.epoch = 0
        self._fd = -1

    def recover(self) -> list[tuple]:
        """The records a node that stopped left, in the order written (read before `open` starts over)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        if not data.startswith(MAGIC):
            return _recover_legacy(data)
        _, epoch = _HEADER.unpack_from(data)
        return _records(data, _HEADER.size, _RECORD, epoch & 0xFFFFFFFF)

    def open(self) -> None:
        """Start the journal over (after `recover`'s records are durable elsewhere): a new epoch, an empty tail,
        JOURNAL_BYTES of written zeros (made once, synced once)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            head = os.pread(fd, _HEADER.size, 0)
            epoch = _HEADER.unpack(head)[1] if head.startswith(MAGIC) and len(head) == _HEADER.size else 0
            if epoch == 0 or os.fstat(fd).st_size < JOURNAL_BYTES:
                os.ftruncate(fd, 0)
                zeros = bytes(1 << 20)
                try:
                    for at in range(0, JOURNAL_BYTES, len(zeros)):
                        if os.pwrite(fd, zeros[: JOURNAL_BYTES - at], at) != min(len(zeros), JOURNAL_BYTES - at):
                            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError as exc:  # a small disk: records then grow the file (each fsync commits its size)
                    if exc.errno != errno.ENOSPC:
                        raise
                    os.ftruncate(fd, 0)
            self.epoch = epoch + 1
            os.pwrite(fd, _HEADER.pack(MAGIC, self.epoch), 0)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.offset = _HEADER.size

    def add(self, row: tuple) -> None:
        """Keep a running step's intent (its row, `finished_at` None); OSError if the disk refused it."""
        self.write(row)
        self.running[(row[0], row[1])] = row

    def write(self, record: tuple) -> None:
        """Append one record (not synced: the caller's fdatasync of `fd` covers it); OSError if the disk refused."""
        frame = self._frame(record)
        self._pwrite(frame, self.offset)
        self.offset += len(frame)

    @property
    def fd(self) -> int:
        return self._fd

    def rotate(self) -> None:
        """Start over in place with only the running steps' intents. The caller has made every other record
        durable in SQLite first (results written, WAL fsynced)."""
        self.epoch += 1
        self.offset = _HEADER.size
        frames = b"".join(self._frame(row) for row in self.running.values())
        self._pwrite(_HEADER.pack(MAGIC, self.epoch) + frames, 0)
        self.offset += len(frames)

    def _frame(self, record: tuple) -> bytes:
        body = _encode(record)
        return _RECORD.pack(len(body), zlib.crc32(body, self.epoch & 0xFFFFFFFF)) + body

    def _pwrite(self, data: bytes, at: int) -> None:
        written = os.pwrite(self._fd, data, at)
        if written != len(data):  # past the zeroed size on a full disk: the torn record fails its CRC
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _recover_legacy(data: bytes) -> list[tuple]:
    """Intents in the layout before this one: length-prefixed msgpack, appended."""
    return _records(data, 0, _LEGACY, None)


def _records(data: bytes, at: int, prefix: struct.Struct, seed: int | None) -> list[tuple]:
    """The records from `at` to the tail. Each is `prefix` (the body's length, then, unless `seed` is None as
    in the legacy layout, its CRC-32 seeded with `seed`) and a msgpack body. The tail: a zero length, a torn
    record (a write cut short by a crash or a full disk), a CRC that fails (an earlier epoch's records), or a
    body that does not decode."""
    rows = []
    while at + prefix.size <= len(data):
        size, *crc = prefix.unpack_from(data, at)
        body = data[at + prefix.size : at + prefix.size + size]
        if size == 0 or len(body) < size or (seed is not None and zlib.crc32(body, seed) != crc[0]):
            break
        try:
            rows.append(tuple(_decode(body)))
        except msgspec.DecodeError:
            break
        at += prefix.size + size
    return rows
