"""The VM agent channel's host half (qemu/bridge.py) against a scripted guest on its chardev socket.

A real guest cannot be made to hit these races on purpose (they depend on when a restored vCPU runs); the
VM tests (test_vm.py, test_microvm*.py) cover the real path. Here the guest's side is played byte for byte
as agent.c's serial mux speaks it, including what a guest restored from a snapshot legally sends.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from shoal.substrates.qemu.bridge import AgentBridge

pytestmark = pytest.mark.fast

_HDR = struct.Struct(">IBI")
_RESET = _HDR.pack(0, ord("R"), 16) + b"SHOAL-MUX-RESET1"


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
    channel, op, length = _HDR.unpack(await reader.readexactly(_HDR.size))
    return channel, chr(op), await reader.readexactly(length)


def test_a_restored_guests_late_frames_do_not_close_new_channels(tmp_path: Path) -> None:
    """A guest restored from a template sends the end of the template's own last channels ('E', 'C', and a
    late 'D') after the host's 'R' and 'O' are on their way: the bridge's first channel must not be one of
    them. Every bridge used to number its channels from 1, so the restored copy's first request shared the
    template's boot hello's channel and was closed under it (CI: "closed the connection unexpectedly")."""

    async def main() -> None:
        serial_path, listen_path = tmp_path / "serial.sock", tmp_path / "agent.sock"
        opened: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def guest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert await reader.readexactly(len(_RESET)) == _RESET
            channel, op, _ = await _read_frame(reader)
            assert op == "O"
            opened.set_result(channel)
            channel, op, request = await _read_frame(reader)
            assert op == "D"
            for stale in range(1, 65):  # what the template's bridge had open, reported late
                writer.write(_HDR.pack(stale, ord("D"), 4) + b"late")
                writer.write(_HDR.pack(stale, ord("E"), 0) + _HDR.pack(stale, ord("C"), 0))
            await writer.drain()
            await asyncio.sleep(0.05)  # the bridge handles the late frames before the answer
            writer.write(_HDR.pack(channel, ord("D"), len(request)) + request.upper())
            writer.write(_HDR.pack(channel, ord("E"), 0))
            await writer.drain()
            await reader.read()  # until the bridge hangs up

        server = await asyncio.start_unix_server(guest, path=str(serial_path))
        bridge = AgentBridge(listen_path)
        await bridge.start()
        try:
            await bridge.attach(serial_path)
            reader, writer = await asyncio.open_unix_connection(str(listen_path))
            writer.write(b"hello")
            await writer.drain()
            channel = await asyncio.wait_for(opened, 5)
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer == b"HELLO", f"channel {channel}: the answer was lost to a late frame ({answer!r})"
            writer.close()
        finally:
            await bridge.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
