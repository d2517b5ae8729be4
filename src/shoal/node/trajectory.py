"""The trajectory log: every step run in a sandbox, in order, durable before its result is returned.

One SQLite database per node (`$SHOAL_HOME/trajectory.db`) in WAL mode, and in front of it a journal
(`trajectory.db.intents`, node/intents.py) that makes a step durable: a logged step's intent (it is about to
run) and its result are each one pwrite() of a record there, and one fdatasync of the journal covers every
record written before it started (group commit across sandboxes); a step's result is answered only after the
fsync that covers it, so it survives a SIGKILL of the node and a power cut. The fsync is submitted to the
kernel with Linux AIO and completes on an eventfd the loop watches (node/walsync.py: no thread hand-off per
step); where AIO cannot fsync, a syncer thread does it. Results reach SQLite in batches (one transaction every
SHOAL_LOG_BATCH_MS, `synchronous=NORMAL`, no fsync: the journal is what is durable); until then reads find
them in memory. A node that starts replays the journal into SQLite, fsyncs the WAL, and starts the journal
over; so does a running node when the journal fills (flushing and fsyncing first). Why: a SQLite commit per
result was 15 of a logged exec's 33.6 syscalls (issue 12). Sandboxes opened and closed are journal records
too (a close waits for its fsync; an open rides on the next one). Checkpoints, which sync the database
file, run on the syncer thread. Reads (fast-forward, `shoal log`) use a separate connection on the event
loop: point lookups by primary key take microseconds.

A step's `key` (shoal/steps.py) is a digest of the arguments that define it; a re-issued step with the
same sequence number and key returns the logged result, a different key is a divergence.

Bulk payloads (over steps.BULK_BYTES, 64 KiB: the data of a file write, an exec's stdin, the bytes a file
read returned) are logged as their digest and size, not their bytes. A re-issued write is still checked
against the log (the key digests the data); a re-issued read of a logged step reads the file again and
returns it only if it still has the logged digest and size, else raises PayloadNotKeptError (the log cannot
give back bytes it did not keep). Digests of large payloads are computed off the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shoal import settings
from shoal.errors import (
    CapacityError,
    DivergenceError,
    InvalidRequestError,
    PayloadNotKeptError,
    ShoalError,
    from_wire,
    to_wire,
)
from shoal.node import intents as intents_module
from shoal.node.intents import IntentJournal
from shoal.node.walsync import WalSync
from shoal.steps import (
    BULK_ARGS,
    BULK_BYTES,
    bulk,
    describe,
    digest,
    divergence_message,
    is_bulk,
    loggable_args,
    step_key,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, trajectory TEXT, image TEXT, spec BLOB, created_at REAL,
    closed_at REAL, status TEXT NOT NULL DEFAULT 'live', reason TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_by_trajectory ON sandboxes (trajectory);
CREATE TABLE IF NOT EXISTS steps (
    sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, op TEXT NOT NULL, key TEXT NOT NULL, args BLOB,
    result BLOB, error_type TEXT, error TEXT, started_at REAL, finished_at REAL,
    PRIMARY KEY (sandbox_id, seq)
) WITHOUT ROWID;
"""

log = logging.getLogger("shoal.trajectory")
JOURNAL_LIMIT = 8 << 20
CHECKPOINT_WRITES = 500  # after this many writes the syncer copies the WAL into the database (≈1000 pages)
CHECKPOINT_PASSES = 4  # PASSIVE checkpoints in a row at most, catching up with the writes made while one ran
BATCH_ROWS = 512  # journaled results that make a batch at once, without waiting for SHOAL_LOG_BATCH_MS
BUSY_WAIT = 0.0005  # a write the checkpoint's lock refused is retried after this (seconds), for up to 10 s
# A sandbox opened and closed: the same statements when logged and when a journal record of them is replayed
_OPEN_SANDBOX = "INSERT OR REPLACE INTO sandboxes (id, trajectory, image, spec, created_at) VALUES (?,?,?,?,?)"
_CLOSE_SANDBOX = "UPDATE sandboxes SET closed_at=?, status=?, reason=? WHERE id=? AND status='live'"

# Tasks running a logged step now (Recorder.step), with how many: a client that goes away must not stop them.
_logging: dict[asyncio.Task, int] = {}


class Answer:
    """The answer of a request that goes out once the journal's fsync covers its logged step, sent from that
    fsync's completion rather than by the request's task woken for it: the task ends once the step's result is
    journaled, the answer waits here (issue 12: a loop pass and a task wake-up fewer per logged exec). The
    node's server makes one per request it can answer that way and sets it in ANSWER; the first step the
    request logs in its own task defers to it (`owed`), any later one waits for its own fsync as before (which
    covers the first one's too), and so does a step logged by a task that only inherited the request's context."""

    __slots__ = ("open", "pending", "error", "send", "task")

    def __init__(self) -> None:
        self.task = asyncio.current_task()  # the request's: only a step it runs itself defers to this answer
        self.open = True  # a step's result may still defer to this answer
        self.pending = 0  # fsyncs it waits for
        self.error: Exception | None = None
        self.send: Callable[[Exception | None], None] | None = None

    def settled(self, error: Exception | None) -> None:
        """The log: the fsync covering the step is done (`error`: it failed)."""
        self.pending -= 1
        if error is not None and self.error is None:
            self.error = error
        if not self.pending and self.send is not None:
            send, self.send = self.send, None
            send(self.error)

    def owed(self, send: Callable[[Exception | None], None]) -> bool:
        """The server, with its response ready: True if `send(error)` sends it (once the fsync is done, or now
        with the fsync's error), False if the server sends it itself (nothing was deferred)."""
        self.open = False
        if self.pending:
            self.send = send
            return True
        if self.error is not None:
            send(self.error)
            return True
        return False


ANSWER: contextvars.ContextVar[Answer | None] = contextvars.ContextVar("shoal_trajectory_answer", default=None)


def abandon(task: asyncio.Task) -> None:
    """A request whose client went away (its connection closed): cancel it, unless it runs a logged step,
    which finishes and is logged (its result then has nobody to go to). A request that has not started its
    step yet is cancelled before it does."""
    if task not in _logging:
        task.cancel()


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


@dataclass(frozen=True)
class Step:
    sandbox_id: str
    seq: int
    op: str
    key: str
    args: dict[str, Any]
    result: Any
    error_type: str | None
    error: str | None
    started_at: float
    finished_at: float | None
    size: int = 0  # bytes of its stored arguments and result

    def describe(self) -> str:
        return describe(self.op, self.args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "seq": self.seq,
            "op": self.op,
            "key": self.key,
            "args": self.args,
            "result": self.result,
            "error_type": self.error_type,
            "error": self.error,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


class TrajectoryLog:
    """Append steps durably (written on the loop, group-committed fsyncs on a thread); read them back on the
    caller's thread.

    Disk reserve: a file of `reserve_bytes` (SHOAL_LOG_RESERVE_MB, default 64) is allocated next to the
    database. When a commit fails because the disk is full (a sandbox without a disk cap filled the disk
    the node's home is on), the reserve is deleted and the commit retried, so every other sandbox's steps
    go on being logged (thousands of steps fit: bulk payloads are digests); the reserve is allocated again
    once the disk has room. Without the reserve a full disk fails every sandbox's steps."""

    def __init__(self, path: Path, reserve_bytes: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if reserve_bytes is None:
            reserve_bytes = int(settings.LOG_RESERVE_MB.get() * (1 << 20))
        self.reserve = path.with_name(path.name + ".reserve")
        self.reserve_bytes = reserve_bytes
        self.reserve_released = 0  # times the reserve was given up for a commit
        self._reserve_checked = time.monotonic()
        self._ensure_reserve()
        self._reader = self._connect()
        self._reader.executescript(SCHEMA)
        # Writes run on the caller's thread (the event loop) with synchronous=NORMAL: a WAL append, no fsync,
        # tens of microseconds. The WAL is then fsynced by a syncer thread, one fsync for every write that
        # committed before it started (group commit), and a durable write's caller waits for that fsync.
        # Checkpoints (which write and sync the database file) run on that thread too, never on the loop.
        self._db = self._connect()
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=0")  # never sleep on the loop: _write_soon retries instead
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")  # a restarted WAL is cut back to this
        self._wal = f"{path}-wal"
        self.intents = IntentJournal(path.with_name(path.name + ".intents"))
        self._recover_journal()
        # results journaled (durable) but not yet in SQLite: (sandbox_id, seq) -> row; reads look here first
        self._pending: dict[tuple[str, int], tuple] = {}
        self._batch_delay = settings.LOG_BATCH_MS.get() / 1000
        self._batch_timer: asyncio.TimerHandle | None = None
        self._rows_written = 0  # rows written to SQLite (checkpoints follow them)
        # (upto, loop, fsync): fsync the journal for records up to `upto` (or, not `fsync`, checkpoint SQLite)
        self._sync_queue: queue.SimpleQueue[tuple[int, asyncio.AbstractEventLoop | None, bool] | None] = (
            queue.SimpleQueue()
        )
        self._aio: WalSync | None = None
        self._aio_tried = False
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._aio_inflight = 0  # the write number the submitted fdatasync covers (0: none in flight)
        self._checkpoint_asked = 0
        self._written = 0  # records written to the journal so far
        self._synced = 0  # of them, how many an fsync has covered
        self._sync_requested = 0
        self._flush_scheduled = False
        self._waiters: list[tuple[int, asyncio.Future | Callable]] = []  # (write number, future or callable)
        self._sync_error: BaseException | None = None
        self._syncer = threading.Thread(target=self._sync_forever, name="shoal-trajectory-sync", daemon=True)
        self._syncer.start()
        self.commits = 0  # fsyncs (each covers every write before it)
        self.appended = 0
        self.checkpoints = 0  # checkpoints after which the WAL started over
        self.batches = 0  # transactions that wrote journaled results to SQLite

    def _recover_journal(self) -> None:
        """Replay what a node that stopped left in the journal into SQLite, in the order written: results
        (acknowledged: they may not have reached SQLite) replace their rows; the intents of steps that were
        running become their rows (a re-issue raises), unless a result superseded them; steps of a sandbox
        whose log was pruned since are dropped; sandboxes opened and closed are applied. Then the WAL is
        fsynced (the replayed results must stay durable once the journal starts over) and the journal starts
        over."""
        statements = [_replayed(record) for record in self.intents.recover()]
        statements = [statement for statement in statements if statement is not None]
        if statements:
            self._commit(self._db, statements)
            _fdatasync(self._wal)
        self.intents.open()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=10000")
        return db

    # ---------------------------------------------------------------- writes (durable when awaited)

    async def _submit(self, sql: str, params: tuple, record: tuple, fsync: bool = True) -> None:
        """Write one row to SQLite and `record` to the journal; return once it is written (it survives the
        node process dying) and, with `fsync`, the journal's fsync covers it (it survives the machine dying)."""
        try:
            await self._write_soon([(sql, params)])
            self._journal(record)
            if fsync:
                # no shield (one loop pass fewer): a cancelled caller cancels only its future, while the
                # fsync it asked for still runs and still covers the record
                await self._durable(self._written)
        except (sqlite3.Error, OSError) as exc:
            raise self._error(exc) from exc

    def _journal(self, record: tuple, intent: bool = False) -> None:
        """One record into the journal (not synced: `_durable` waits for the fsync that covers it); starts the
        journal over first if it is full. OSError if the disk refused it even after the reserve was given up."""
        if self.intents.offset > intents_module.ROTATE_BYTES:
            self._rotate()
        write = self.intents.add if intent else self.intents.write
        try:
            write(record)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self._release_reserve():
                raise
            write(record)  # with the reserve's space
        self._written += 1

    def _rotate(self, sync: bool = False) -> None:
        """Start the journal over: every result into SQLite, the WAL fsynced (on the loop: once per
        ROTATE_BYTES of records, thousands of steps), then a new epoch holding only the running intents. If
        the checkpoint holds SQLite's lock, the journal grows past ROTATE_BYTES until the next record.
        `sync`: the new epoch is fsynced at once (after a prune: else a power cut before the next step's
        fsync would replay the old epoch, bringing the pruned sandboxes back until the next prune)."""
        if not self._flush():
            return
        try:
            _fdatasync(self._wal)
            self.intents.rotate()
            if sync:
                os.fdatasync(self.intents.fd)
        except OSError as exc:
            log.warning("could not start the journal %s over (it keeps growing): %s", self.intents.path, exc)

    def _error(self, exc: sqlite3.Error | OSError) -> Exception:
        if "full" in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC:
            return CapacityError(
                f"the trajectory log {self.path} cannot be written: no space left; free disk space "
                "(or create sandboxes with record=False)"
            )
        return ShoalError(f"the trajectory log {self.path} could not be written: {exc}")

    async def _write_soon(self, statements: list[tuple[str, tuple]]) -> None:
        """`_write`, retried while the checkpoint holds the write lock (a millisecond or so every
        CHECKPOINT_WRITES writes: see _checkpoint) instead of sleeping on the loop."""
        for _ in range(int(10 / BUSY_WAIT)):
            try:
                return self._write(statements)
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                    raise
            await asyncio.sleep(BUSY_WAIT)
        self._write(statements)

    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        """Commit `statements` as one transaction to the WAL (no fsync: see _durable)."""
        try:
            self._commit(self._db, statements)
        except sqlite3.OperationalError as exc:
            if "full" not in str(exc) or not self._release_reserve():
                raise
            self._commit(self._db, statements)  # with the reserve's space
        self._rows_written += 1
        self.appended += 1

    def _schedule_flush(self) -> None:
        if self._batch_timer is None:
            self._batch_timer = asyncio.get_running_loop().call_later(self._batch_delay, self._flush_later)
        elif len(self._pending) >= BATCH_ROWS:
            self._batch_timer.cancel()
            self._flush_later()

    def _flush_later(self) -> None:
        self._batch_timer = None
        if not self._flush() and self._pending:  # the checkpoint held the lock, or the disk refused: later
            self._schedule_flush()

    def _flush(self) -> bool:
        """Write the journaled results to SQLite in one transaction (no fsync: the journal holds them durably
        until it starts over, which fsyncs the WAL first). False if they could not be written now (they stay
        in the journal and in memory, where reads find them)."""
        if not self._pending:
            return True
        rows = list(self._pending.values())
        try:
            self._commit_many(rows)
        except sqlite3.OperationalError as exc:
            if "full" in str(exc) and self._release_reserve():
                return self._flush()
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                log.warning("could not write %d steps to %s (kept in its journal): %s", len(rows), self.path, exc)
            return False
        for row in rows:
            if self._pending.get((row[0], row[1])) is row:
                del self._pending[(row[0], row[1])]
        self.batches += 1
        self._rows_written += len(rows)
        if self._rows_written - self._checkpoint_asked >= CHECKPOINT_WRITES:
            self._checkpoint_asked = self._rows_written  # the thread checkpoints (and checks the reserve)
            self._sync_queue.put((0, None, False))
        return True

    def _commit_many(self, rows: list[tuple]) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _durable(self, upto: int, alone: bool = False) -> asyncio.Future:
        """A future done once an fsync of the WAL covers write number `upto`. `alone`: the row is the result
        of the only step that was running (no other row can be on its way in this loop pass)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self._synced >= upto:
            done.set_result(None)
            return done
        self._wait_for(upto, done, alone, loop)
        return done

    def _wait_for(
        self, upto: int, waiter: asyncio.Future | Callable, alone: bool, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Settle `waiter` (a future, or a callable given the error or None) once an fsync covers `upto`."""
        self._waiters.append((upto, waiter))
        if alone and self._aio is not None and self._aio_loop is loop and not self._aio_inflight:
            # no other step runs, so no other row can join this fsync in this loop pass: it starts now, a pass
            # sooner (rows written while it runs share the next one, which its completion submits)
            self._aio_submit()
        elif not self._flush_scheduled:  # after the tasks ready now have written too: one fsync for them all
            self._flush_scheduled = True
            loop.call_soon(self._request_sync, loop)

    def _request_sync(self, loop: asyncio.AbstractEventLoop) -> None:
        self._flush_scheduled = False
        if self._sync_requested >= self._written:
            return
        if not self._aio_tried:
            self._aio_tried = True
            self._aio = WalSync.open(str(self.intents.path))
            if self._aio is not None:
                self._aio_loop = loop
                loop.add_reader(self._aio.eventfd, self._aio_done)
        if self._aio is None:  # the syncer takes everything written by the time it starts
            self._sync_requested = self._written
            self._sync_queue.put((self._written, loop, True))
        elif not self._aio_inflight:  # else the completion submits the next one
            self._aio_submit()

    def _aio_submit(self) -> None:
        assert self._aio is not None
        upto = self._written  # one fdatasync covers every write committed before it starts
        try:
            self._aio.submit()
        except OSError as exc:
            self._settle(upto, exc)
            return
        self._aio_inflight = self._sync_requested = upto

    def _aio_done(self) -> None:
        """The eventfd fired: settle the writers the fdatasync covered, start the next one if rows wait."""
        assert self._aio is not None
        res = self._aio.reap()
        if res is None or not self._aio_inflight:
            return
        upto, self._aio_inflight = self._aio_inflight, 0
        failure = None if res == 0 else OSError(-res, f"fdatasync {self.intents.path}: {os.strerror(-res)}")
        if failure is None:
            self.commits += 1
        self._settle(upto, failure)
        if self._waiters and not self._aio_inflight and self._written > upto:
            self._aio_submit()

    def _sync_forever(self) -> None:
        checkpointer = self._connect()
        # the RESTART checkpoint waits this long at most for readers (a `sqlite3` shell left open on the file)
        # while it holds the write lock the loop's steps wait for; then it gives up until the next one
        checkpointer.execute("PRAGMA busy_timeout=100")
        while True:
            item = self._sync_queue.get()
            if item is None:
                break
            syncs, checkpoint = ([item], False) if item[2] else ([], True)
            while True:  # a burst of requests: one fsync covers them all
                try:
                    more = self._sync_queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._sync_queue.put(None)
                    break
                if more[2]:
                    syncs.append(more)
                else:
                    checkpoint = True
            if checkpoint:  # asked for after CHECKPOINT_WRITES rows reached SQLite; nobody waits for it
                try:
                    self.checkpoints += _checkpoint(checkpointer)
                except Exception as exc:
                    log.warning("checkpoint of %s failed: %s", self.path, exc)
            if self.reserve_bytes > 0 and time.monotonic() - self._reserve_checked > 10:
                self._reserve_checked = time.monotonic()
                self._ensure_reserve()
            if not syncs:
                continue
            upto = max(upto for upto, _, _ in syncs)
            loop = syncs[-1][1]
            failure: BaseException | None = None
            try:
                _fdatasync(self.intents.path)  # the data (and a size that does not change), not the mtime
                self.commits += 1
            except BaseException as exc:  # report to every waiter; the node keeps running
                failure = exc
            try:
                assert loop is not None
                loop.call_soon_threadsafe(self._settle, upto, failure)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
        checkpointer.close()

    def _settle(self, upto: int, failure: BaseException | None) -> None:
        """On the loop: wake the writers an fsync covered (or tell them it failed)."""
        if failure is None:
            self._synced = max(self._synced, upto)
        still = []
        for target, waiter in self._waiters:
            if target > upto:
                still.append((target, waiter))
            elif not isinstance(waiter, asyncio.Future):  # an Answer's: its request answers from here
                try:
                    waiter(None if failure is None else self._error(_fsync_failed(failure)))
                except Exception:
                    log.exception("answering a request after the log's fsync failed")
            elif not waiter.done():
                if failure is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(_fsync_failed(failure))
        self._waiters = still
        if failure is not None and still and self._sync_requested <= upto:  # retry for the rest
            if self._aio is not None:
                asyncio.get_running_loop().call_soon(self._retry_aio)
            else:
                self._sync_requested = max(t for t, _ in still)
                self._sync_queue.put((self._sync_requested, asyncio.get_running_loop(), True))

    def _retry_aio(self) -> None:
        if self._waiters and not self._aio_inflight:
            self._aio_submit()

    async def append(
        self,
        sandbox_id: str,
        seq: int,
        op: str,
        key: str,
        args: dict[str, Any],
        result: Any,
        error: tuple[str, str] | None,
        started_at: float,
    ) -> None:
        running = self.intents.running
        intent = running.get((sandbox_id, seq))
        # the intent's encoded arguments, not a second encoding (they are the same arguments: Recorder.step)
        encoded = intent[4] if intent is not None and intent[3] == key else _encode(args)
        row = (sandbox_id, seq, op, key, encoded, _encode(result), *(error or (None, None)), started_at, time.time())
        try:
            self._journal(row)
            alone = len(running) == 1 and intent is not None
            running.pop((sandbox_id, seq), None)  # superseded (replayed after it, the result replaces it)
            self._pending[(sandbox_id, seq)] = row
            self.appended += 1
            self._schedule_flush()
            answer = ANSWER.get()
            if answer is not None and answer.open and answer.task is asyncio.current_task():  # answered at the fsync
                answer.open = False
                answer.pending += 1
                self._wait_for(self._written, answer.settled, alone, asyncio.get_running_loop())
                return
            await self._durable(self._written, alone)
        except (sqlite3.Error, OSError) as exc:
            raise self._error(exc) from exc

    async def settled(self) -> None:
        """Return once an fsync covers every record written so far: a result read back from the log (a step
        re-issued) is answered only once it is durable, which a result whose own request's answer still waits
        for (Answer) may not be yet."""
        if self._synced < self._written:
            try:
                await self._durable(self._written)
            except (sqlite3.Error, OSError) as exc:
                raise self._error(exc) from exc

    async def begin(
        self, sandbox_id: str, seq: int, op: str, key: str, args: dict[str, Any], started_at: float
    ) -> None:
        """Log that a step is about to run: if the node dies before its result is logged, a re-issue of
        the step raises (its outcome is unknown) rather than running it a second time.

        One write() to the intent journal (node/intents.py), no SQLite commit and no fsync: it must outlive the
        node process, not the machine (a machine that dies takes its sandboxes, and so the need for the
        intent, with it). Reads see it as the step's row until its result replaces it."""
        message = (
            f"step {seq} was running when the node stopped: it may have run, in part or whole; its outcome is unknown"
        )
        row = (sandbox_id, seq, op, key, _encode(args), _encode(None), "ShoalError", message, started_at, None)
        try:
            self._journal(row, intent=True)
        except OSError as exc:
            raise self._error(exc) from exc

    async def open_sandbox(self, sandbox_id: str, trajectory: str | None, image: str, spec: Any) -> None:
        """Log a new sandbox (a create or a warm-pool claim answers after this).

        Written to SQLite's WAL and to the journal without an fsync of its own, like a step's intent: it must
        outlive the node process (a restarted node finds the trajectory and re-adopts the sandbox). A machine
        that dies takes the sandbox with it; what it then loses is only this row if no step of the sandbox was
        logged since, because the journal's fsync for any later record covers every record before it (SQLite's
        WAL is not fsynced per write). Its own fsync cost a claim more than the rest of it (issue 12: 0.2 ms on
        a quiet disk, tens of ms on a busy one)."""
        row = (sandbox_id, trajectory, image, _encode(spec), time.time())
        await self._submit(
            _OPEN_SANDBOX,
            row,
            ("sandbox", *row),
            fsync=False,
        )

    async def close_sandbox(self, sandbox_id: str, status: str, reason: str) -> None:
        closed_at = time.time()
        await self._submit(
            _CLOSE_SANDBOX,
            (closed_at, status, reason, sandbox_id),
            ("closed", sandbox_id, closed_at, status, reason),
        )

    async def prune(self, closed_before: float) -> None:
        """Forget the logs of sandboxes that ended before `closed_before` (live ones are always kept).

        A few sandboxes per transaction, yielding between them: the writes run on the event loop. Then the
        journal starts over, so that a node restarted later does not bring pruned sandboxes back from it."""
        ended = "SELECT id FROM sandboxes WHERE status != 'live' AND closed_at < ? LIMIT 16"
        pruned = False
        self._flush()
        while ids := [row[0] for row in self._db.execute(ended, (closed_before,))]:
            pruned = True
            marks = ",".join("?" * len(ids))
            try:
                await self._write_soon([(f"DELETE FROM steps WHERE sandbox_id IN ({marks})", tuple(ids)),
                                        (f"DELETE FROM sandboxes WHERE id IN ({marks})", tuple(ids))])  # fmt: skip
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            await asyncio.sleep(0)
        if pruned:
            self._rotate(sync=True)

    def _ensure_reserve(self) -> None:
        """(Re)allocate the reserve file if it is missing and the disk has room for it and as much again."""
        if self.reserve_bytes <= 0:
            return
        try:
            if self.reserve.exists() and self.reserve.stat().st_blocks * 512 >= self.reserve_bytes:
                return
            stat = os.statvfs(self.path.parent)
            if stat.f_bavail * stat.f_frsize < 2 * self.reserve_bytes:
                return
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
        except OSError as exc:
            self.reserve.unlink(missing_ok=True)
            log.warning("could not allocate the trajectory log's disk reserve %s: %s", self.reserve, exc)

    def _release_reserve(self) -> bool:
        try:
            self.reserve.unlink()
        except FileNotFoundError:
            return False
        self.reserve_released += 1
        log.error(
            "the disk holding %s is full: released the log's %d MiB reserve so steps go on being logged; "
            "find the sandbox filling it (create sandboxes with disk_mb, or set SHOAL_DEFAULT_DISK_MB)",
            self.path, self.reserve_bytes >> 20,
        )  # fmt: skip
        return True

    def _commit(self, db: sqlite3.Connection, statements: list[tuple[str, tuple]]) -> None:
        if len(statements) == 1:  # autocommit: one statement is its own transaction
            db.execute(*statements[0])
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                db.execute(sql, params)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        self._flush()  # else the next start replays them from the journal
        self._sync_queue.put(None)
        self._syncer.join(timeout=10)
        if self._aio is not None:
            if self._aio_loop is not None and not self._aio_loop.is_closed():
                self._aio_loop.remove_reader(self._aio.eventfd)
            self._aio.close()
            self._aio = None
        self._db.close()
        self._reader.close()
        self.intents.close()

    # ---------------------------------------------------------------- reads

    def get(self, sandbox_id: str, seq: int) -> Step | None:
        row = self._pending.get((sandbox_id, seq))
        if row is None:
            row = self._reader.execute(
                "SELECT * FROM steps WHERE sandbox_id=? AND seq=?", (sandbox_id, seq)
            ).fetchone() or self.intents.running.get((sandbox_id, seq))
        return None if row is None else _step(row)

    def next_seq(self, sandbox_id: str) -> int:
        row = self._reader.execute("SELECT MAX(seq) FROM steps WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        kept = [seq for sid, seq in (*self.intents.running, *self._pending) if sid == sandbox_id]
        last = max([*kept, *([row[0]] if row[0] is not None else [])], default=None)
        return 0 if last is None else last + 1

    def steps(self, sandbox_id: str, since: int = 0) -> Iterator[Step]:
        """The steps of a sandbox from `since` in order: the table's rows, the results not yet in it and the
        running steps' intents."""
        self._flush()  # most often all in the table then (a listing, not a step's path)
        kept = {key: row for key, row in self.intents.running.items() if key[0] == sandbox_id and key[1] >= since}
        kept.update((key, row) for key, row in self._pending.items() if key[0] == sandbox_id and key[1] >= since)
        running = sorted(kept.values(), key=lambda row: row[1])
        cursor = self._reader.execute(
            "SELECT * FROM steps WHERE sandbox_id=? AND seq>=? ORDER BY seq", (sandbox_id, since)
        )
        for row in cursor:
            while running and running[0][1] < row[1]:
                yield _step(running.pop(0))
            if running and running[0][1] == row[1]:
                running.pop(0)  # its result is in the table (written since the list was taken)
            yield _step(row)
        for intent in running:
            yield _step(intent)

    def sandbox(self, sandbox_id: str) -> dict[str, Any] | None:
        row = self._reader.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return None if row is None else _sandbox_row(row)

    def by_trajectory(self, trajectory: str) -> dict[str, Any] | None:
        """The most recent sandbox that ran this trajectory."""
        row = self._reader.execute(
            "SELECT * FROM sandboxes WHERE trajectory=? ORDER BY created_at DESC LIMIT 1", (trajectory,)
        ).fetchone()
        return None if row is None else _sandbox_row(row)


def _replayed(record: tuple) -> tuple[str, tuple] | None:
    """The SQLite statement that applies a journal record (intents.py) at a node's start."""
    if len(record) == 10:  # a step: its result, or the intent of a step that was running
        verb = "INSERT OR IGNORE" if record[9] is None else "INSERT OR REPLACE"
        return (f"{verb} INTO steps SELECT ?,?,?,?,?,?,?,?,?,? WHERE EXISTS (SELECT 1 FROM sandboxes WHERE id=?)",
                (*record, record[0]))  # fmt: skip
    if len(record) == 6 and record[0] == "sandbox":  # as open_sandbox wrote it (a later close record follows it)
        return _OPEN_SANDBOX, record[1:]
    if len(record) == 5 and record[0] == "closed":
        _, sandbox_id, closed_at, status, reason = record
        return _CLOSE_SANDBOX, (closed_at, status, reason, sandbox_id)
    log.warning("skipped a journal record of unknown shape (%d fields)", len(record))
    return None


def _fsync_failed(failure: BaseException) -> sqlite3.OperationalError:
    return sqlite3.OperationalError(f"fsync of the log failed: {failure}")


def _fdatasync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _checkpoint(db: sqlite3.Connection) -> bool:
    """Copy the WAL into the database (synced) and have the next write start it over: True if so.

    Why: SQLite starts the WAL over (overwriting its blocks in place) only at a write that finds every frame
    copied. A PASSIVE checkpoint under a steady stream of steps never leaves it so (rows land while it
    copies), so the WAL grew without end and every step's fdatasync had to commit a new file size and new
    blocks to the ext4 journal as well: 0.39 vs 0.17 ms p50 for an overwrite (bench/bench_walfloor.py).
    PASSIVE passes copy the bulk without holding the writers, until one finds nothing new to copy; a RESTART
    then holds the write lock for a moment (the loop's writes meanwhile wait without blocking it:
    `_write_soon`), copying and syncing only what landed since that pass, usually nothing."""
    previous = None
    for _ in range(CHECKPOINT_PASSES):
        _busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if copied >= frames and frames == previous:
            break
        previous = frames
    busy, _frames, _copied = db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
    return busy == 0


def _step(row: tuple) -> Step:
    sandbox_id, seq, op, key, args, result, error_type, error, started_at, finished_at = row
    size = len(args or b"") + len(result or b"")
    return Step(
        sandbox_id, seq, op, key, _decode(args), _decode(result), error_type, error, started_at, finished_at, size
    )


def _sandbox_row(row: tuple) -> dict[str, Any]:
    sandbox_id, trajectory, image, spec, created_at, closed_at, status, reason = row
    return {
        "id": sandbox_id,
        "trajectory": trajectory,
        "image": image,
        "spec": _decode(spec) if spec else {},
        "created_at": created_at,
        "closed_at": closed_at,
        "status": status,
        "reason": reason,
    }


class Recorder:
    """Runs a sandbox's steps through the log: fast-forward what is logged, log what runs.

    Sequence numbers: a step with `seq=None` is appended at the end. A step whose `seq` is already in
    the log returns the logged result (or raises the logged error) without running, after waiting for
    it if it is still running; a different step at that `seq` raises DivergenceError. A `seq` past the
    end of the log is refused: steps are contiguous.
    """

    def __init__(self, log: TrajectoryLog, intents: bool = True) -> None:
        self.log = log
        self.intents = intents  # log each step before it runs too (see TrajectoryLog.begin)
        self.fast_forwarded = 0

    async def step(self, sandbox: Any, op: str, args: dict[str, Any], seq: int | None, run: Any) -> Any:
        if not sandbox.spec.record:
            return await run()
        big = _payload_size(op, args) > _OFF_LOOP_BYTES
        key = await asyncio.to_thread(step_key, op, args) if big else step_key(op, args)
        if seq is None:
            seq = sandbox.next_seq
        if seq < 0:
            raise InvalidRequestError(f"seq={seq}: sequence numbers start at 0")
        if seq < sandbox.next_seq:
            running = sandbox.inflight.get(seq)
            if running is not None:  # the original request is still running (its client went away)
                await asyncio.wait({running})
            logged = self.log.get(sandbox.id, seq)
            if logged is None:
                raise InvalidRequestError(f"step {seq} of sandbox {sandbox.id} was not logged (logging was off)")
            if logged.key != key:
                raise DivergenceError(divergence_message(sandbox.id, seq, logged.describe(), describe(op, args)))
            self.fast_forwarded += 1
            await self.log.settled()
            if op == "file_read" and logged.error_type is None and is_bulk(logged.result):
                return await _read_again(sandbox.id, seq, args, logged.result, run)
            return _replay_outcome(logged)
        if seq > sandbox.next_seq:
            raise InvalidRequestError(
                f"step {seq} skips ahead: the log of sandbox {sandbox.id} ends before step {sandbox.next_seq}; "
                f"issue step {sandbox.next_seq} next (or omit seq to append)"
            )
        sandbox.next_seq = seq + 1
        # The step runs in the request's own task, not in a task of its own behind a shield (a task, a shield
        # future and three loop passes per step: issue 12). A client that goes away does not stop it: `abandon`
        # leaves a task running a logged step uncancelled. A client that cancels it stops it (logged as such).
        task = asyncio.current_task()
        assert task is not None
        sandbox.inflight[seq] = task
        _logging[task] = _logging.get(task, 0) + 1
        try:
            return await self._run_and_log(sandbox, seq, op, key, args, run)
        finally:
            if _logging[task] == 1:
                del _logging[task]
            else:
                _logging[task] -= 1

    async def _run_and_log(self, sandbox: Any, seq: int, op: str, key: str, args: dict, run: Any) -> Any:
        started = time.time()
        if _payload_size(op, args) > BULK_BYTES:  # the log keeps a digest of the payload, not its bytes
            big = _payload_size(op, args) > _OFF_LOOP_BYTES
            args = await asyncio.to_thread(loggable_args, op, args) if big else loggable_args(op, args)
        try:
            if self.intents:
                await self.log.begin(sandbox.id, seq, op, key, args, started)
            try:
                result = await run()
            except asyncio.CancelledError:
                message = f"step {seq} was cancelled by its client while it ran (it may have run in part)"
                await self.log.append(sandbox.id, seq, op, key, args, None, ("ShoalError", message), started)
                raise
            except Exception as exc:
                await self.log.append(sandbox.id, seq, op, key, args, None, _error(exc), started)
                raise
            logged = result
            if op == "file_read" and isinstance(result, bytes) and len(result) > BULK_BYTES:
                logged = await asyncio.to_thread(bulk, result) if len(result) > _OFF_LOOP_BYTES else bulk(result)
            await self.log.append(sandbox.id, seq, op, key, args, logged, None, started)
            return result
        finally:
            sandbox.inflight.pop(seq, None)
            sandbox.last_active = time.time()


_OFF_LOOP_BYTES = 1 << 20  # hashing more than this goes to a thread (blake2b releases the GIL)


def _payload_size(op: str, args: dict[str, Any]) -> int:
    name = BULK_ARGS.get(op)
    value = args.get(name) if name else None
    return len(value) if isinstance(value, bytes | bytearray | memoryview) else 0


async def _read_again(sandbox_id: str, seq: int, args: dict[str, Any], kept: dict[str, Any], run: Any) -> Any:
    """A logged read whose bytes the log did not keep: read the file again and give it back only if it is
    still exactly what step `seq` read (same digest and size)."""
    try:
        data = await run()
    except (OSError, ValueError) as exc:
        data, problem = None, f"reading it again failed ({exc})"
    if isinstance(data, dict):  # streamed again (node.service._read_streamed): its digest and size
        if data == kept:
            return data
        problem = f"the file now holds {data.get('size')} bytes that differ from the {kept['size']} bytes it read"
    elif data is not None:
        if len(data) == kept["size"]:
            now = await asyncio.to_thread(digest, data) if len(data) > _OFF_LOOP_BYTES else digest(data)
            if now == kept["bulk"]:
                return data
        problem = f"the file now holds {len(data)} bytes that differ from the {kept['size']} bytes it read"
    raise PayloadNotKeptError(
        f"step {seq} of sandbox {sandbox_id} read {args.get('path')!r} ({kept['size']} bytes); the trajectory log "
        f"keeps payloads over {BULK_BYTES} bytes as a digest only, and {problem}; read the file as a new step"
    )


def _error(exc: BaseException) -> tuple[str, str]:
    kind, message, _ = to_wire(exc)
    return kind, message


def _replay_outcome(step: Step) -> Any:
    """The logged result of a step, or its logged error raised again."""
    if step.error_type is None:
        return step.result
    raise from_wire(step.error_type, step.error or "")
