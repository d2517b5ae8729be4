"""A VM's screen driven from the host through QMP: nothing in the guest takes part.

A `vm` created with a screen gets QEMU's standard VGA (Bochs VBE) and a USB tablet; the guest kernel is
booted with `vga=<VESA mode>` so its framebuffer console comes up at the requested size (the modes are
the ones QEMU's VGA BIOS lists, see VESA_MODES). Screenshots are QMP `screendump` in QEMU's own PNG
format; input is QMP `input-send-event` (absolute pointer moves scaled to 0..32767, buttons, wheel, and
keys as QEMU key codes through the emulated PS/2 keyboard). So the same `sb.gui` API works for any guest
OS, at the price that `cursor()` is where shoal last put the pointer (QEMU does not report the guest's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequestError

# (width, height) -> VESA mode (32 bits per pixel) of QEMU's Bochs VGA BIOS (SeaVGABIOS bochsvga_modes);
# the kernel takes it as vga=0x200+mode. Other sizes have no mode to boot into.
VESA_MODES = {
    (640, 480): 0x142, (800, 600): 0x143, (1024, 768): 0x144, (1280, 1024): 0x145, (1600, 1200): 0x147,
    (1152, 864): 0x14C, (1280, 768): 0x177, (1280, 800): 0x17A, (1280, 960): 0x17D, (1440, 900): 0x180,
    (1400, 1050): 0x183, (1680, 1050): 0x186, (1920, 1200): 0x189, (1280, 720): 0x18F, (1920, 1080): 0x192,
    (1600, 900): 0x195,
}  # fmt: skip
DEFAULT_VM_SCREEN = (1280, 800)
VNC_SOCKET = "vnc.sock"  # QEMU's VNC server of the screen, in the VM's directory (the live view)

# Between the characters of `type`: QEMU's PS/2 keyboard queues 16 bytes of scancodes and drops what comes on
# top, so a burst of keys faster than the guest's vCPU drains them (a loaded host, TCG) loses characters.
TYPE_INTERVAL_S = 0.03
BUTTONS = {"left": "left", "middle": "middle", "right": "right"}
# xdotool / X keysym names (lower-cased) -> QEMU QKeyCode.
KEYS = {
    "return": "ret", "enter": "ret", "kp_enter": "kp_enter", "escape": "esc", "esc": "esc", "tab": "tab",
    "backspace": "backspace", "delete": "delete", "insert": "insert", "space": "spc", "home": "home",
    "end": "end", "prior": "pgup", "pageup": "pgup", "next": "pgdn", "pagedown": "pgdn", "up": "up",
    "down": "down", "left": "left", "right": "right", "ctrl": "ctrl", "control": "ctrl", "control_l": "ctrl",
    "control_r": "ctrl_r", "shift": "shift", "shift_l": "shift", "shift_r": "shift_r", "alt": "alt",
    "alt_l": "alt", "alt_r": "alt_r", "super": "meta_l", "super_l": "meta_l", "meta": "meta_l",
    "caps_lock": "caps_lock", "menu": "menu", "print": "print", "minus": "minus", "equal": "equal",
    "plus": "equal", "comma": "comma", "period": "dot", "slash": "slash", "backslash": "backslash",
    "semicolon": "semicolon", "apostrophe": "apostrophe", "grave": "grave_accent",
    "bracketleft": "bracket_left", "bracketright": "bracket_right",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
}  # fmt: skip
# Characters on a US keyboard: (QKeyCode, with shift).
_PLAIN = "`1234567890-=qwertyuiop[]\\asdfghjkl;'zxcvbnm,./"
_SHIFTED = '~!@#$%^&*()_+QWERTYUIOP{}|ASDFGHJKL:"ZXCVBNM<>?'
_CODES = ["grave_accent", *"1234567890", "minus", "equal", *"qwertyuiop", "bracket_left", "bracket_right",
          "backslash", *"asdfghjkl", "semicolon", "apostrophe", *"zxcvbnm", "comma", "dot", "slash"]  # fmt: skip
CHARS: dict[str, tuple[str, bool]] = {c: (code, False) for c, code in zip(_PLAIN, _CODES, strict=True)}
CHARS |= {c: (code, True) for c, code in zip(_SHIFTED, _CODES, strict=True)}
CHARS |= {" ": ("spc", False), "\n": ("ret", False), "\t": ("tab", False)}

Qmp = Callable[..., Awaitable[Any]]


def vga_mode(width: int, height: int) -> int:
    """The kernel's vga= value for a screen of this size; InvalidRequestError names the sizes there are."""
    mode = VESA_MODES.get((width, height))
    if mode is None:
        sizes = ", ".join(f"{w}x{h}" for w, h in sorted(VESA_MODES))
        raise InvalidRequestError(f"screen={width}x{height}: a vm's screen is a VGA mode, one of {sizes}")
    return 0x200 + mode


def device_args(machine: str, directory: Path | None = None) -> list[str]:
    """QEMU devices of a screen: standard VGA, a USB tablet (absolute pointer) on an xHCI controller, and a
    VNC server on a unix socket in `directory` (no TCP port: the node relays it to the live view)."""
    if machine != "q35":
        raise InvalidRequestError("screen= needs a PCI machine (kind='vm'); a microvm has no display device")
    devices = [
        "-device",
        "VGA,id=vga0",
        "-device",
        "qemu-xhci,id=xhci0",
        "-device",
        "usb-tablet,bus=xhci0.0,id=tablet0",
    ]
    return devices + (["-vnc", f"unix:{directory / VNC_SOCKET}"] if directory is not None else [])


def _png_size(data: bytes) -> tuple[int, int]:
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise InvalidRequestError("QEMU's screendump did not write a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


class QmpScreen:
    """The `gui` actions of one VM, over its QMP socket (`qmp` runs one command on the current machine)."""

    def __init__(self, qmp: Qmp, directory: Path, width: int, height: int, follow_size: bool = False) -> None:
        self._qmp = qmp
        self.follow_size = follow_size  # a guest that picks its own mode (a disk image): its last screenshot's size
        self.directory = directory
        self.width, self.height = width, height
        self.pointer = (0, 0)
        self.last_digest: str | None = None
        self.lock = asyncio.Lock()

    async def _screendump(self) -> bytes:
        path = self.directory / f".screen-{secrets.token_hex(4)}.png"
        try:
            await self._qmp("screendump", filename=str(path), format="png")
            return await asyncio.to_thread(path.read_bytes)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def screenshot(self) -> dict[str, Any]:
        data = await self._screendump()
        width, height = _png_size(data)
        if self.follow_size:
            self.width, self.height = width, height
        self.last_digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        return {"png": data, "width": width, "height": height}

    async def _events(self, events: list[dict[str, Any]]) -> None:
        await self._qmp("input-send-event", events=events)

    def _abs(self, x: int, y: int) -> list[dict[str, Any]]:
        """Absolute pointer events for (x, y) on the screen of the size the VM was made with."""
        width, height = self.width, self.height
        if not (0 <= x < width and 0 <= y < height):
            raise InvalidRequestError(f"({x}, {y}) is off the {width}x{height} screen")
        self.pointer = (x, y)
        scale = [(x * 0x7FFF) // max(1, width - 1), (y * 0x7FFF) // max(1, height - 1)]
        return [{"type": "abs", "data": {"axis": axis, "value": v}} for axis, v in zip(("x", "y"), scale, strict=True)]

    async def move(self, x: int, y: int) -> None:
        await self._events(self._abs(int(x), int(y)))

    async def _button(self, button: str, down: bool) -> None:
        await self._events([{"type": "btn", "data": {"down": down, "button": button}}])

    async def click(self, x: int, y: int, button: str = "left", double: bool = False) -> None:
        if button not in BUTTONS:
            raise InvalidRequestError(f"button {button!r}: choose one of {', '.join(BUTTONS)}")
        await self.move(x, y)
        for _ in range(2 if double else 1):
            await self._button(BUTTONS[button], True)
            await self._button(BUTTONS[button], False)

    async def drag(self, x1: int, y1: int, x2: int, y2: int, button: str = "left") -> None:
        if button not in BUTTONS:
            raise InvalidRequestError(f"button {button!r}: choose one of {', '.join(BUTTONS)}")
        await self.move(x1, y1)
        await self._button(BUTTONS[button], True)
        steps = 8
        for i in range(1, steps + 1):
            await self.move(x1 + (x2 - x1) * i // steps, y1 + (y2 - y1) * i // steps)
        await self._button(BUTTONS[button], False)

    async def scroll(self, dx: int = 0, dy: int = 0) -> None:
        for name, count in (("wheel-down" if dy > 0 else "wheel-up", abs(int(dy))),
                            ("wheel-right" if dx > 0 else "wheel-left", abs(int(dx)))):  # fmt: skip
            for _ in range(count):
                await self._button(name, True)
                await self._button(name, False)

    @staticmethod
    def _qcode(name: str) -> tuple[str, bool]:
        lowered = name.lower()
        if lowered in KEYS:
            return KEYS[lowered], False
        if len(name) == 1 and name in CHARS:
            return CHARS[name]
        raise InvalidRequestError(f"unknown key {name!r} (use X keysym names: Return, ctrl, alt, F1, a...)")

    async def _press(self, codes: list[str]) -> None:
        keys = [{"type": "qcode", "data": code} for code in codes]
        down = [{"type": "key", "data": {"down": True, "key": k}} for k in keys]
        up = [{"type": "key", "data": {"down": False, "key": k}} for k in reversed(keys)]
        await self._events(down)
        await self._events(up)

    async def key(self, keys: str) -> None:
        codes: list[str] = []
        for name in keys.split("+") if keys != "+" else ["plus"]:
            code, shift = self._qcode(name)
            codes += ["shift", code] if shift else [code]
        await self._press(codes)

    async def type(self, text: str) -> None:
        for char in text:
            if char not in CHARS:
                raise InvalidRequestError(f"cannot type {char!r} on a VM's US keyboard (ASCII only)")
        for index, char in enumerate(text):
            if index:
                await asyncio.sleep(TYPE_INTERVAL_S)
            code, shift = CHARS[char]
            await self._press(["shift", code] if shift else [code])

    async def cursor(self) -> dict[str, int]:
        return {"x": self.pointer[0], "y": self.pointer[1]}

    async def wait_for_change(self, timeout: float = 10.0, interval: float = 0.1) -> dict[str, Any]:
        start = time.monotonic()
        while True:
            digest = hashlib.blake2b(await self._screendump(), digest_size=16).hexdigest()
            if self.last_digest is None:
                self.last_digest = digest
            elif digest != self.last_digest:
                self.last_digest = digest
                return {"changed": True, "waited_s": time.monotonic() - start}
            if time.monotonic() - start >= timeout:
                return {"changed": False, "waited_s": time.monotonic() - start}
            await asyncio.sleep(interval)

    async def act(self, action: str, args: dict[str, Any]) -> dict[str, Any]:
        """One action, with the same results as a container's screen (node/gui.py)."""
        async with self.lock:
            if action == "screenshot":
                return await self.screenshot()
            if action == "wait_for_change":
                return await self.wait_for_change(float(args.get("timeout", 10.0)), float(args.get("interval", 0.1)))
            method = getattr(self, action, None) if action in _ACTIONS else None
            if method is None:
                raise InvalidRequestError(f"gui action {action!r}: choose one of {', '.join(_ACTIONS)}")
            try:
                result = await method(**args)
            except TypeError as exc:
                raise InvalidRequestError(f"gui {action}: {exc}") from None
            return {"result": result}

    async def open_vnc(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to QEMU's VNC server of this screen (the live view, shoal/view.py)."""
        return await asyncio.open_unix_connection(str(self.directory / VNC_SOCKET))

    async def close(self) -> None:
        """Nothing to stop: the screen ends with its QEMU."""


_ACTIONS = ("screenshot", "click", "move", "drag", "scroll", "type", "key", "cursor", "wait_for_change")
