"""Screens: the node's side of a sandbox's GUI (the `gui` operation).

A sandbox created with a screen runs one long-lived helper (shoal/guest/gui_helper.py) through its agent:
it starts Xvfb and an xterm and then serves actions over its stdin/stdout, so an action is one pipe round
trip instead of a process start. The helper sends a screenshot as compressed PNG image data (16 KiB where
the pixels are 4 MiB: the pipe, not the encoding, was the cost) and the node wraps it in PNG chunks; no
imaging library on either side. `wait_for_change` polls a digest of the pixels until it differs from the
last screenshot's.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequestError, NodeError, NoScreenError
from shoal.guest.client import AgentClient, ExecProcess

HELPER_PATH = "/.shoal/gui_helper.py"
DEFAULT_SCREEN = (1280, 800)
SCREEN_KINDS = ("container", "vm")  # a vm's screen is QEMU's, driven over QMP (substrates/qemu/screen.py)
SCREEN_IMAGES = ("desktop", "vm-desktop")  # images whose sandboxes get DEFAULT_SCREEN when create names none
ACTIONS = ("screenshot", "click", "move", "drag", "scroll", "type", "key", "cursor", "wait_for_change")
_HELPER_SOURCE = Path(__file__).parents[1] / "guest" / "gui_helper.py"
_U32 = struct.Struct(">I")


def screen_of(image: str, screen: list[int] | None) -> tuple[int, int] | None:
    """The screen a sandbox gets: the requested one, the default for desktop images, or None (also for an
    empty size: `create(screen=False)`, a desktop image whose caller starts its own X server, as e2b-desktop
    does on display :0)."""
    if screen is not None and len(screen) == 0:
        return None
    if screen is None:
        return DEFAULT_SCREEN if image in SCREEN_IMAGES else None
    if len(screen) != 2 or not all(isinstance(v, int) and 16 <= v <= 8192 for v in screen):
        raise InvalidRequestError(f"screen={screen!r}: give (width, height), each 16..8192 pixels")
    return screen[0], screen[1]


def png(width: int, height: int, idat: bytes) -> bytes:
    """A PNG (8-bit RGB) around zlib-compressed scanlines."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return _U32.pack(len(data)) + kind + data + _U32.pack(zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class Screen:
    """One sandbox's display: the helper process and a buffer of its replies."""

    def __init__(self, proc: ExecProcess, width: int, height: int) -> None:
        self.proc = proc
        self.width, self.height = width, height
        self.buffer = bytearray()
        self.lock = asyncio.Lock()
        self.last_digest: str | None = None

    @classmethod
    async def start(cls, agent: AgentClient, width: int, height: int, timeout: float = 120.0) -> Screen:
        """Write the helper into the sandbox, start it, and wait until the display answers."""
        await agent.write_file(HELPER_PATH, _HELPER_SOURCE.read_bytes())
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "DISPLAY": ":0", "LANG": "C.UTF-8"}
        proc = await agent.exec(
            ["python3", HELPER_PATH, str(width), str(height)], env=env, cwd="/", cap_bytes=0, stdin_pipe=True
        )
        screen = cls(proc, width, height)
        try:
            ready, _ = await asyncio.wait_for(screen._reply(), timeout)
        except BaseException:
            await proc.close()
            raise
        if not ready.get("ok"):
            await proc.close()
            raise NodeError(f"the sandbox's display did not start: {ready.get('error')}")
        return screen

    async def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            item = await self.proc.next_output()
            if item is None:
                raise NodeError(f"the sandbox's GUI helper exited ({self.proc.exit})")
            if item[0] == "stdout":
                self.buffer += item[1]
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def _reply(self) -> tuple[dict[str, Any], bytes]:
        header = json.loads(await self._read(_U32.unpack(await self._read(4))[0]))
        blob = await self._read(_U32.unpack(await self._read(4))[0])
        return header, blob

    async def _call(self, action: str, args: dict[str, Any]) -> tuple[Any, bytes]:
        async with self.lock:
            await self.proc.write_stdin(json.dumps({"action": action, "args": args}).encode() + b"\n")
            reply, blob = await self._reply()
        if not reply["ok"]:
            raise InvalidRequestError(f"gui {action}: {reply['error']}")
        return reply["result"], blob

    async def act(self, action: str, args: dict[str, Any]) -> dict[str, Any]:
        if action not in ACTIONS:
            raise InvalidRequestError(f"gui action {action!r}: choose one of {', '.join(ACTIONS)}")
        if action == "screenshot":
            meta, idat = await self._call("screenshot", {})
            self.last_digest = meta["digest"]
            return {"png": png(meta["width"], meta["height"], idat), "width": meta["width"], "height": meta["height"]}
        if action == "wait_for_change":
            return await self._wait_for_change(float(args.get("timeout", 10.0)), float(args.get("interval", 0.05)))
        result, _ = await self._call(action, args)  # bad arguments come back as the helper's TypeError
        return {"result": result}

    async def _wait_for_change(self, timeout: float, interval: float) -> dict[str, Any]:
        """Poll until the screen differs from the last screenshot (or the first poll, if none was taken)."""
        start = time.monotonic()
        while True:
            digest = (await self._call("digest", {}))[0]["digest"]
            if self.last_digest is None:
                self.last_digest = digest
            elif digest != self.last_digest:
                self.last_digest = digest
                return {"changed": True, "waited_s": time.monotonic() - start}
            if time.monotonic() - start >= timeout:
                return {"changed": False, "waited_s": time.monotonic() - start}
            await asyncio.sleep(interval)

    async def start_vnc(self) -> None:
        """Start the display's VNC server (x11vnc on 127.0.0.1:5900) for the live view, if not yet running."""
        await self._call("vnc", {})

    async def close(self) -> None:
        await self.proc.close()


def no_screen(sandbox_id: str, kind: str) -> NoScreenError:
    return NoScreenError(
        f"sandbox {sandbox_id} ({kind}) has no screen: create it with image='desktop' (or screen=(w, h) on an "
        "image with Xvfb and python3-xlib), or a kind='vm' with screen=(w, h)"
    )


def display_lost(sandbox_id: str) -> NodeError:
    return NodeError(
        f"sandbox {sandbox_id}'s display ended with the node that started it (re-adopted sandboxes keep their "
        "files and processes, not their screen): create a new desktop"
    )
