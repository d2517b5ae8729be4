"""The host half of the VM agent channel: many agent connections muxed over one virtio-serial stream.

The node listens on `sandboxes/<id>/agent.sock` exactly as for containers; each accepted connection
becomes a channel on QEMU's chardev socket (frames: u32 channel, u8 op, u32 length, payload; ops 'O'
open, 'D' data, 'E' end of the sender's data, 'C' close, and 'R' reset, the first frame of every chardev
connection, after which the guest drops older channels). 'E' is a half-close, so a port relay over a VM
keeps TCP's half-close (a client that shuts its sending side still gets the answer); the guest closes a
channel ('C') once both directions have ended, and a connection whose node side has gone (a write to it
failed) is closed in the guest at its next data frame, as a container's handler would get EPIPE.
The guest agent (`shoal-agent --serial`) serves each channel with its usual per-connection handler, so
`AgentClient` works unchanged. The chardev side can be swapped (restore, resume) with `attach()`;
connections open at that moment are closed, as the guest drops them too.
Channel numbers start at a random point in every bridge (`_channel_numbers`), because a guest restored
from a snapshot can send frames of the channels it had open when it was saved before it reads the new
connection's 'R'.
The guest is untrusted: frame lengths are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path

_HDR = struct.Struct(">IBI")
_CHUNK = 1 << 16
_RESET = _HDR.pack(0, ord("R"), 16) + b"SHOAL-MUX-RESET1"
_MAX_FRAME = 1 << 20  # the agent sends at most 64 KiB per frame
_CHANNELS = (1 << 32) - 1  # channel numbers 1 .. 2**32-1 (u32; 0 is the reset's)


def _channel_numbers() -> Iterator[int]:
    """This bridge's channel numbers: consecutive from a random start, wrapping past 2**32-1 to 1.

    A VM restored from a snapshot (a template, a fork, a pause) runs on from the moment it was saved: its
    agent may report the end of a channel that was open then (the template's boot hello) before it reads
    this connection's 'R' and drops such channels. Those frames arrive here after 'R' was sent, when this
    bridge may already have opened channels of its own. With every bridge counting from 1, the restored
    copy's first request (its identity) had the template's last channel number and was closed by that
    channel's late 'C' ("closed the connection unexpectedly", seen in CI). From a random start, a late frame
    names a channel this bridge has never opened, and is dropped.
    """
    start = secrets.randbelow(_CHANNELS)
    return (1 + (start + k) % _CHANNELS for k in itertools.count())


class AgentBridge:
    """Listens on `listen_path`; forwards each connection as a channel over the chardev at `serial_path`."""

    def __init__(self, listen_path: Path) -> None:
        self.listen_path = listen_path
        self._server: asyncio.AbstractServer | None = None
        self._serial_writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._channels: dict[int, asyncio.StreamWriter] = {}
        self._ids = _channel_numbers()
        self._connected = asyncio.Event()
        self._dead = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.listen_path), backlog=256)

    async def attach(self, serial_path: Path, timeout: float = 10.0) -> None:
        """Connect to QEMU's chardev socket (waiting for QEMU to create it), replacing any earlier one."""
        await self.detach()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(serial_path), limit=1 << 20)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.01)
        writer.write(_RESET)  # the guest drops channels of earlier connections and resynchronises here
        self._serial_writer = writer
        self._dead = False
        self._reader_task = asyncio.create_task(self._pump_serial(reader))
        self._connected.set()

    async def detach(self) -> None:
        """Drop the chardev connection and every open channel."""
        self._connected.clear()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task
            self._reader_task = None
        if self._serial_writer is not None:
            self._serial_writer.close()
            self._serial_writer = None
        for writer in self._channels.values():
            writer.close()
        self._channels.clear()

    async def close(self) -> None:
        await self.detach()
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.listen_path.unlink()

    def _send(self, channel: int, op: bytes, data: bytes = b"") -> None:
        if self._serial_writer is not None:
            self._serial_writer.write(_HDR.pack(channel, op[0], len(data)) + data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        channel = next(self._ids)
        try:
            if self._dead:  # QEMU is gone: fail fast so the node marks the sandbox lost
                return
            if not self._connected.is_set():
                await asyncio.wait_for(self._connected.wait(), 30)
            serial = self._serial_writer
            self._channels[channel] = writer
            self._send(channel, b"O")
            while True:
                data = await reader.read(_CHUNK)
                if self._serial_writer is not serial:  # the VM was restored or paused under us
                    break
                if not data:  # the node's side ended its data: the guest's side may still answer
                    self._send(channel, b"E")
                    await writer.wait_closed()  # the guest's 'C' (or a detach) closes it
                    break
                self._send(channel, b"D", data)
                await serial.drain()
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._tasks.discard(task)
            if self._channels.pop(channel, None) is not None or not writer.is_closing():
                writer.close()

    async def _pump_serial(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(_HDR.size)
                channel, op, length = _HDR.unpack(header)
                if length > _MAX_FRAME:  # the guest is not trusted: a bogus length must not make us buffer GBs
                    raise ConnectionError(f"guest sent a {length}-byte mux frame (max {_MAX_FRAME})")
                data = await reader.readexactly(length) if length else b""
                writer = self._channels.get(channel)
                if writer is None:
                    continue
                if op == ord("D"):
                    if writer.transport.is_closing():  # the node's side is gone: so is the guest's
                        self._channels.pop(channel, None)
                        self._send(channel, b"C")
                        writer.close()
                    else:
                        writer.write(data)
                elif op == ord("E"):
                    if writer.can_write_eof() and not writer.transport.is_closing():
                        writer.write_eof()
                elif op == ord("C"):
                    self._channels.pop(channel, None)
                    writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            self._dead = True
            for writer in self._channels.values():
                writer.close()
            self._channels.clear()
