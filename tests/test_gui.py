"""GUI sandboxes: a real Xvfb in a `desktop` container, driven through `sb.gui` alone (issue 15).

The desktop image is built by `make images`; the display (Xvfb + an xterm at the top left) starts with the
sandbox. Waits are on conditions with generous deadlines: the test machine is a loaded 2-core box.
"""

from __future__ import annotations

import struct
import time
import zlib

import pytest

import shoal


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _png_pixels(data: bytes) -> bytes:
    """The decompressed scanlines (each a filter byte + RGB): enough to tell two screens apart."""
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(kind + chunk) == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        if kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return zlib.decompress(idat)


def _pixel(shot: shoal.Screenshot, x: int, y: int) -> tuple[int, int, int]:
    at = y * (1 + shot.width * 3) + 1 + x * 3  # filter 0 (what the node writes): bytes are the pixels
    rgb = _png_pixels(shot.png)[at : at + 3]
    return rgb[0], rgb[1], rgb[2]


def _wait(condition, timeout: float = 60.0, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_type_into_a_terminal_through_the_gui_alone(client: shoal.Client) -> None:
    with client.create("container", image="desktop", screen=(1024, 640), pool=False, ttl_s=600) as sb:
        first = sb.gui.screenshot()
        assert first.size == (1024, 640) and _png_size(first.png) == (1024, 640)
        assert len(_png_pixels(first.png)) == 640 * (1 + 1024 * 3)
        # the xterm (white) maps at the top left of the black root shortly after the display starts
        _wait(lambda: _pixel(sb.gui.screenshot(), 100, 100) != (0, 0, 0), what="the xterm to draw")
        # focus follows the pointer (no window manager): point into the terminal, then type
        sb.gui.click(100, 100)
        assert sb.gui.cursor() == (100, 100)
        before = sb.gui.screenshot()
        sb.gui.type("echo hi > /tmp/gui-ok")
        sb.gui.key("Return")
        _wait(lambda: sb.exec("test -f /tmp/gui-ok").exit_code == 0, what="/tmp/gui-ok")
        assert sb.files.read_text("/tmp/gui-ok") == "hi\n"
        after = sb.gui.screenshot()
        assert after.size == (1024, 640) and _png_pixels(after.png) != _png_pixels(before.png)
        ops = [step["op"] for step in sb.log()]
        assert ops.count("gui") >= 6 and "exec" in ops  # each action is a step of the trajectory


def test_desktop_defaults_and_keys(client: shoal.Client) -> None:
    with client.create("container", image="desktop", pool=False, ttl_s=600) as sb:
        assert sb.gui.screenshot().size == (1280, 800)
        sb.gui.move(300, 200)
        assert sb.gui.cursor() == (300, 200)
        sb.gui.drag(10, 10, 50, 60)
        assert sb.gui.cursor() == (50, 60)
        sb.gui.scroll(dy=2)
        sb.gui.key("ctrl+c")
        sb.gui.click(5, 5, button="right", double=True)
        with pytest.raises(shoal.InvalidRequestError, match="unknown key"):
            sb.gui.key("NoSuchKeyName")


def test_a_sandbox_without_a_screen_says_so(client: shoal.Client) -> None:
    with (
        client.create("container", image="busybox", pool=False, ttl_s=120) as sb,
        pytest.raises(shoal.NoScreenError, match="has no screen"),
    ):
        sb.gui.screenshot()
    with pytest.raises(shoal.InvalidRequestError, match="screen"):
        client.create("container", image="desktop", screen=(1, 2), pool=False, ttl_s=60)


async def test_async_gui_and_a_paused_desktop(aclient: shoal.AsyncClient) -> None:
    sb = await aclient.create("container", image="desktop", screen=(640, 480), pool=False, ttl_s=600)
    try:
        shot = await sb.gui.screenshot()
        assert shot.size == (640, 480) and _png_size(shot.png) == (640, 480)
        await sb.gui.move(20, 30)
        await sb.pause()
        assert await sb.gui.cursor() == (20, 30)  # any request resumes a paused sandbox
        assert (await sb.gui.screenshot()).size == (640, 480)
    finally:
        await sb.close()


def test_a_vm_screen_through_qmp_alone(client: shoal.Client) -> None:
    """A `vm` with a screen: QEMU's VGA and input, driven from the host over QMP (nothing in the guest takes
    part); shoal's Debian shows a root shell on tty1, so typing a command there runs it."""
    if "vm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    with pytest.raises(shoal.InvalidRequestError, match="VGA mode"):
        client.create("vm", image="debian", screen=(1000, 700), pool=False, ttl_s=60)
    with client.create("vm", image="debian", screen=(1024, 768), pool=False, ttl_s=900) as vm:
        first = vm.gui.screenshot()
        assert first.size == (1024, 768) and _png_size(first.png) == (1024, 768)
        assert len(_png_pixels(first.png)) == 768 * (1 + 1024 * 4) or len(_png_pixels(first.png)) == 768 * (
            1 + 1024 * 3
        )
        vm.gui.move(500, 400)
        assert vm.gui.cursor() == (500, 400)
        vm.gui.click(10, 10)
        before = vm.gui.screenshot()
        vm.gui.type("echo hi > /tmp/gui-ok")
        vm.gui.key("Return")
        _wait(lambda: vm.exec("test -f /tmp/gui-ok").exit_code == 0, timeout=120, what="/tmp/gui-ok")
        assert vm.files.read_text("/tmp/gui-ok") == "hi\n"
        assert "echo hi > /tmp/gui-ok" in vm.exec("cat /dev/vcs1").stdout  # the console shows what was typed
        after = vm.gui.screenshot()
        assert after.size == (1024, 768) and _png_pixels(after.png) != _png_pixels(before.png)
        with pytest.raises(shoal.InvalidRequestError, match="unknown key"):
            vm.gui.key("NoSuchKeyName")
        assert "gui" in [step["op"] for step in vm.log()]
