"""The in-sandbox GUI helper: starts the X display and serves GUI actions over stdin/stdout.

The node writes this file into a sandbox with a screen and runs it once, as one long-lived process (so an
action costs a pipe round trip, not a process start): it starts Xvfb on :0 at the requested size and an
xterm, then answers one JSON request per stdin line with a frame on stdout: u32 length + JSON header, u32
length + blob (a screenshot's PNG image data: RGB scanlines, zlib-compressed here so 16 KiB rather than
4 MiB of pixels cross the pipe; the node wraps it in PNG chunks).
Input goes through the XTest extension (python3-xlib), as xdotool does. It runs under the sandbox's python3,
so it imports nothing from shoal.
"""

import ctypes
import json
import os
import struct
import subprocess
import sys
import time
import zlib

from Xlib import XK, X, display
from Xlib.error import DisplayError
from Xlib.ext import xtest

BUTTONS = {"left": 1, "middle": 2, "right": 3}
ALIASES = {
    "ctrl": "Control_L", "control": "Control_L", "shift": "Shift_L", "alt": "Alt_L", "super": "Super_L",
    "meta": "Meta_L", "enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape",
    "tab": "Tab", "backspace": "BackSpace", "delete": "Delete", "space": "space", "up": "Up", "down": "Down",
    "left": "Left", "right": "Right", "home": "Home", "end": "End", "pageup": "Prior", "pagedown": "Next",
}  # fmt: skip
CHARS = {"\n": "Return", "\t": "Tab", " ": "space"}


def start(width: int, height: int) -> display.Display:
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if not os.path.exists("/tmp/.X11-unix/X0"):
        subprocess.Popen(["Xvfb", ":0", "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp", "-ac"], **quiet)
    deadline = time.monotonic() + 60
    while True:
        try:
            d = display.Display(":0")
            break
        except (DisplayError, OSError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    env = {**os.environ, "DISPLAY": ":0"}
    subprocess.Popen(["xterm", "-geometry", "100x30+0+0"], env=env, cwd="/root", **quiet)
    return d


class _XImage(ctypes.Structure):
    """The head of libX11's XImage (the fields read here; the rest follows in the real struct)."""

    _fields_ = [
        (name, ctypes.c_void_p if name == "data" else ctypes.c_int)
        for name in ["width", "height", "xoffset", "format", "data", "byte_order", "bitmap_unit",
                     "bitmap_bit_order", "bitmap_pad", "depth", "bytes_per_line", "bits_per_pixel"]
    ]  # fmt: skip


class Grabber:
    """Screenshots through libX11 (ctypes) on a connection of their own: its XGetImage reads the 4 MiB reply
    straight into one buffer, where python-xlib's receive loop re-concatenates its buffer per socket read
    (as slow as the rest of a screenshot together)."""

    def __init__(self, width: int, height: int) -> None:
        x11 = ctypes.CDLL("libX11.so.6")
        x11.XOpenDisplay.restype = ctypes.c_void_p
        x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
        x11.XDefaultRootWindow.restype = ctypes.c_ulong
        x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        x11.XGetImage.restype = ctypes.POINTER(_XImage)
        x11.XGetImage.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_uint,
                                  ctypes.c_uint, ctypes.c_ulong, ctypes.c_int]  # fmt: skip
        x11.XDestroyImage.argtypes = [ctypes.POINTER(_XImage)]
        self.x11 = x11
        self.dpy = x11.XOpenDisplay(b":0")
        if not self.dpy:
            raise OSError("libX11 cannot open display :0")
        self.root = x11.XDefaultRootWindow(self.dpy)
        self.width, self.height = width, height

    def pixels(self) -> bytes:
        image = self.x11.XGetImage(self.dpy, self.root, 0, 0, self.width, self.height, 0xFFFFFFFF, X.ZPixmap)
        if not image:
            raise OSError("XGetImage of the root window failed")
        try:
            head = image.contents
            if head.bits_per_pixel != 32 or head.bytes_per_line != self.width * 4:
                raise ValueError(f"screen of {head.bits_per_pixel} bits per pixel, not 32")
            return ctypes.string_at(head.data, self.width * self.height * 4)
        finally:
            self.x11.XDestroyImage(image)


class Gui:
    def __init__(self, d: display.Display) -> None:
        self.d = d
        self.root = d.screen().root
        geometry = self.root.get_geometry()
        self.width, self.height = geometry.width, geometry.height
        self.spare: int | None = None
        self.last_shot: tuple[str, dict, bytes] | None = None  # (digest, meta, image data) of the last screenshot
        try:
            self.grabber: Grabber | None = Grabber(self.width, self.height)
        except OSError:  # no libX11 in this image: python-xlib's GetImage (slower, same pixels)
            self.grabber = None

    def _pixels(self) -> bytes:
        if self.grabber is not None:
            return self.grabber.pixels()
        image = self.root.get_image(0, 0, self.width, self.height, X.ZPixmap, 0xFFFFFFFF)
        if len(image.data) != self.width * self.height * 4:
            raise ValueError(f"screen of depth {image.depth} is not 32 bits per pixel")
        return image.data

    @staticmethod
    def _digest(pixels: bytes) -> str:
        """What wait_for_change compares: CRC-32 and Adler-32 of the pixels (64 bits, a few ms for 4 MiB,
        where a cryptographic hash took as long as the PNG encoding; nothing here needs collision resistance)."""
        return f"{zlib.crc32(pixels):08x}{zlib.adler32(pixels):08x}"

    def digest(self) -> tuple[dict, bytes]:
        """A digest of the pixels (what wait_for_change compares), without encoding them."""
        return {"digest": self._digest(self._pixels())}, b""

    def screenshot(self) -> tuple[dict, bytes]:
        """PNG image data: scanlines of filter 0 + RGB, zlib level 1 (slice copies run at C speed). A screen
        whose pixels have not changed since the last screenshot is not encoded again: an agent polling a still
        screen pays for the grab and the digest only."""
        bgrx = self._pixels()
        digest = self._digest(bgrx)
        if self.last_shot is not None and self.last_shot[0] == digest:
            return self.last_shot[1], self.last_shot[2]
        width, height = self.width, self.height
        rgb = bytearray(width * height * 3)
        rgb[0::3] = bgrx[2::4]
        rgb[1::3] = bgrx[1::4]
        rgb[2::3] = bgrx[0::4]
        stride = width * 3
        rows = bytearray(height * (stride + 1))
        for row in range(height):
            start = row * (stride + 1) + 1
            rows[start : start + stride] = rgb[row * stride : (row + 1) * stride]
        meta = {"width": width, "height": height, "digest": digest}
        self.last_shot = (digest, meta, zlib.compress(rows, 1))
        return meta, self.last_shot[2]

    def move(self, x: int, y: int) -> None:
        xtest.fake_input(self.d, X.MotionNotify, x=int(x), y=int(y))
        self.d.sync()

    def _button(self, button: int, count: int = 1) -> None:
        for _ in range(count):
            xtest.fake_input(self.d, X.ButtonPress, button)
            xtest.fake_input(self.d, X.ButtonRelease, button)
        self.d.sync()

    def click(self, x: int, y: int, button: str = "left", double: bool = False) -> None:
        if button not in BUTTONS:
            raise ValueError(f"button {button!r}: choose one of {', '.join(BUTTONS)}")
        self.move(x, y)
        self._button(BUTTONS[button], 2 if double else 1)

    def drag(self, x1: int, y1: int, x2: int, y2: int, button: str = "left") -> None:
        self.move(x1, y1)
        xtest.fake_input(self.d, X.ButtonPress, BUTTONS[button])
        steps = 8
        for i in range(1, steps + 1):
            xtest.fake_input(self.d, X.MotionNotify, x=x1 + (x2 - x1) * i // steps, y=y1 + (y2 - y1) * i // steps)
        xtest.fake_input(self.d, X.ButtonRelease, BUTTONS[button])
        self.d.sync()

    def scroll(self, dx: int = 0, dy: int = 0) -> None:
        self._button(5 if dy > 0 else 4, abs(int(dy)))
        self._button(7 if dx > 0 else 6, abs(int(dx)))

    def _keycode(self, keysym: int) -> tuple[int, bool]:
        """A keycode for `keysym` and whether it needs shift; an unmapped keysym borrows a spare keycode."""
        for code, index in self.d.keysym_to_keycodes(keysym):
            if index in (0, 1):
                return code, index == 1
        if self.spare is None:
            first = self.d.display.info.min_keycode
            mapping = self.d.get_keyboard_mapping(first, self.d.display.info.max_keycode - first + 1)
            empty = [first + i for i, syms in enumerate(mapping) if not any(syms)]
            if not empty:
                raise ValueError(f"no keycode for keysym {keysym:#x} and no spare keycode to map it to")
            self.spare = empty[-1]
        self.d.change_keyboard_mapping(self.spare, [(keysym, keysym)])
        self.d.sync()
        return self.spare, False

    def _keysym(self, name: str) -> int:
        keysym = XK.string_to_keysym(ALIASES.get(name.lower(), name))
        if not keysym and len(name) == 1:
            keysym = ord(name) if ord(name) < 0x100 else 0x01000000 | ord(name)
        if not keysym:
            raise ValueError(f"unknown key {name!r} (use X keysym names: Return, ctrl, alt, F1, a...)")
        return keysym

    def _press(self, codes: list[int]) -> None:
        for code in codes:
            xtest.fake_input(self.d, X.KeyPress, code)
        for code in reversed(codes):
            xtest.fake_input(self.d, X.KeyRelease, code)
        self.d.sync()

    def key(self, keys: str) -> None:
        codes = []
        for name in keys.split("+") if keys != "+" else ["plus"]:
            code, shift = self._keycode(self._keysym(name))
            if shift:
                codes.append(self.d.keysym_to_keycode(XK.string_to_keysym("Shift_L")))
            codes.append(code)
        self._press(codes)

    def type(self, text: str) -> None:
        shift = self.d.keysym_to_keycode(XK.string_to_keysym("Shift_L"))
        for char in text:
            keysym = XK.string_to_keysym(CHARS[char]) if char in CHARS else self._keysym(char)
            code, shifted = self._keycode(keysym)
            self._press([shift, code] if shifted else [code])

    def vnc(self) -> dict:
        """Start x11vnc on 127.0.0.1:5900 (once, at the first live view) and wait until it listens."""
        import socket

        if getattr(self, "vnc_proc", None) is None or self.vnc_proc.poll() is not None:
            quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            argv = ["x11vnc", "-display", ":0", "-rfbport", "5900", "-localhost", "-forever", "-shared", "-nopw"]
            self.vnc_proc = subprocess.Popen([*argv, "-quiet"], **quiet)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", 5900), timeout=1).close()
                return {"port": 5900}
            except OSError:
                if self.vnc_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"x11vnc did not listen on 127.0.0.1:5900 (exit {self.vnc_proc.poll()})"
                    ) from None
                time.sleep(0.1)

    def cursor(self) -> dict:
        pointer = self.root.query_pointer()
        return {"x": pointer.root_x, "y": pointer.root_y}


def main() -> None:
    width, height = int(sys.argv[1]), int(sys.argv[2])
    out = sys.stdout.buffer
    try:
        gui = Gui(start(width, height))
        ready: dict = {"ok": True, "width": gui.width, "height": gui.height}
    except Exception as exc:  # reported to the node, which raises it at create
        ready = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    header = json.dumps(ready).encode()
    out.write(struct.pack(">I", len(header)) + header + struct.pack(">I", 0))
    out.flush()
    if not ready["ok"]:
        return
    for line in sys.stdin.buffer:
        request = json.loads(line)
        blob = b""
        try:
            action, args = request["action"], request.get("args") or {}
            if action in ("screenshot", "digest"):
                result, blob = getattr(gui, action)()
            else:
                result = getattr(gui, action)(**args)
            reply = {"ok": True, "result": result}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        header = json.dumps(reply).encode()
        out.write(struct.pack(">I", len(header)) + header + struct.pack(">I", len(blob)) + blob)
        out.flush()


if __name__ == "__main__":
    main()
