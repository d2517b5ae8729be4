"""The unmodified, pinned `e2b-desktop` SDK against shoal's `desktop` template (docs/E2B.md), with E2B's API
served inside a real node, and one check through a gateway.

e2b-desktop drives everything with commands: its create starts `Xvfb` and `startxfce4` and waits for
xfce4-session, xfwm4 and xfdesktop; `screenshot` is `scrot`, input is `xdotool`, `get_screen_size` is `xrandr`,
`stream.start` runs x11vnc and noVNC's `novnc_proxy` and waits for its port with `netstat`. So these tests
check the real programs in the `desktop` image (built by `make images`) as much as the E2B layer.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import no_leftovers, until
from e2b_desktop import Sandbox

from shoal.cluster.local import LocalCluster

PROJECTS = {"alice": {}}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, dict[str, str]]]:
    """One node serving E2B's API in its own process (SHOAL_E2B), and a gateway in front of it doing the same."""
    workdir = tmp_path_factory.mktemp("e2b-desktop")
    saved = os.environ.get("SHOAL_E2B")
    os.environ["SHOAL_E2B"] = "127.0.0.1:0"
    try:
        lc = LocalCluster(workdir / "cluster", nodes=1, projects=PROJECTS, prefix="ed")
    finally:
        os.environ.pop("SHOAL_E2B") if saved is None else os.environ.update(SHOAL_E2B=saved)
    try:
        gateway = lc.add_gateway("--e2b", "127.0.0.1:0")
        urls = {
            "node": "http://" + (lc.nodes[0].home / "node.e2b").read_text().strip(),
            "gateway": "http://" + Path(str(gateway.addr_file) + ".e2b").read_text().strip(),
        }
        yield lc, urls
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def _use(hosted: tuple[LocalCluster, dict[str, str]], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lc, urls = hosted
    monkeypatch.setenv("E2B_API_URL", urls[where])
    monkeypatch.setenv("E2B_SANDBOX_URL", urls[where])
    monkeypatch.setenv("E2B_API_KEY", lc.project_tokens["alice"])


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _windows(desk: Sandbox, cls: str) -> list[str]:
    result = desk.commands.run(f"xdotool search --onlyvisible --class {cls} || true")
    return result.stdout.split()


def _check_stream(desk: Sandbox) -> None:
    """`stream.start()` runs x11vnc and noVNC in the sandbox; `get_url()` is reached through shoal's port relay:
    the noVNC page answers 200, and its websocket carries the VNC server's RFB greeting."""
    import aiohttp
    import httpx

    desk.stream.start()
    url = desk.stream.get_url()
    assert url.startswith("https://6080-" + desk.sandbox_id + ".") and "/vnc.html?" in url
    # the SDK writes https:// (E2B's proxy has TLS); this node's and gateway's HTTP are plain (no SHOAL_TLS_CERT)
    page = httpx.get("http://" + url.removeprefix("https://"), timeout=60)
    assert page.status_code == 200 and "noVNC" in page.text
    socket_url = "http://" + url.removeprefix("https://").partition("/vnc.html")[0] + "/websockify"

    async def greeting() -> bytes:
        timeout = aiohttp.ClientWSTimeout(ws_close=60)
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(socket_url, protocols=("binary",), timeout=timeout) as ws,
        ):
            message = await asyncio.wait_for(ws.receive(), 60)
            assert message.type == aiohttp.WSMsgType.BINARY, message
            return message.data

    assert asyncio.run(greeting()).startswith(b"RFB 003.")
    desk.stream.stop()


def test_desktop_sdk_against_a_node(hosted, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    _use(hosted, "node", monkeypatch)
    desk = Sandbox.create(resolution=(800, 600), timeout=900)
    try:
        assert desk.get_screen_size() == (800, 600)
        first = bytes(desk.screenshot())
        assert _png_size(first) == (800, 600)
        assert not desk.commands.run("ls /tmp").stdout.count("screenshot-")  # the SDK removes its file

        desk.move_mouse(123, 145)
        assert desk.get_cursor_position() == (123, 145)
        desk.drag((20, 30), (300, 200))
        assert desk.get_cursor_position() == (300, 200)

        # an xterm, typed into through the SDK alone; the file it makes is checked with commands.run
        desk.commands.run("xterm -title e2bterm -geometry 80x20+40+40", background=True)
        window = until(lambda: _windows(desk, "xterm"), timeout=120)[0]
        assert desk.get_window_title(window) == "e2bterm"
        shell = desk.commands.run(f"xdotool getwindowgeometry --shell {window}").stdout
        geometry = dict(line.split("=", 1) for line in shell.split())
        cx, cy = int(geometry["X"]) + int(geometry["WIDTH"]) // 2, int(geometry["Y"]) + int(geometry["HEIGHT"]) // 2
        desk.left_click(cx, cy)
        assert desk.get_cursor_position() == (cx, cy)
        until(lambda: desk.get_current_window_id() == window, timeout=30)
        before = bytes(desk.screenshot())
        desk.write("echo typed-by-e2b > /tmp/e2b-desktop-ok", chunk_size=20, delay_in_ms=10)
        desk.press("enter")
        until(lambda: desk.files.exists("/tmp/e2b-desktop-ok"), timeout=60)
        assert desk.commands.run("cat /tmp/e2b-desktop-ok").stdout == "typed-by-e2b\n"
        assert bytes(desk.screenshot()) != before  # the typed line and its output are on the screen
        desk.press(["ctrl", "l"])  # a chord: xdotool key Control_L+l clears the terminal
        desk.double_click(cx, cy)
        desk.right_click(cx, cy)
        desk.middle_click(cx, cy)
        desk.scroll("up", 2)
        desk.mouse_press("left")
        desk.mouse_release("left")
        desk.wait(50)

        _check_stream(desk)
    finally:
        desk.kill()
    assert not desk.is_running()


def test_desktop_sdk_through_a_gateway(hosted, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    _use(hosted, "gateway", monkeypatch)
    desk = Sandbox.create(resolution=(640, 480), timeout=900)
    try:
        assert _png_size(bytes(desk.screenshot())) == (640, 480)
        desk.move_mouse(10, 20)
        assert desk.get_cursor_position() == (10, 20)
        _check_stream(desk)
    finally:
        desk.kill()
