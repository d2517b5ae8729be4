"""GUI sandboxes: a real Xvfb in a `desktop` container, driven through `sb.gui` alone (issue 15).

The desktop image is built by `make images`; the display (Xvfb + an xterm at the top left) starts with the
sandbox. Waits are on conditions with generous deadlines: the test machine is a loaded 2-core box.
"""

from __future__ import annotations

import struct
import time
import zlib

import pytest
from conftest import until

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


def test_type_into_a_terminal_through_the_gui_alone(client: shoal.Client) -> None:
    with client.create("container", image="desktop", screen=(1024, 640), pool=False, ttl_s=600) as sb:
        first = sb.gui.screenshot()
        assert first.size == (1024, 640) and _png_size(first.png) == (1024, 640)
        assert len(_png_pixels(first.png)) == 640 * (1 + 1024 * 3)
        # the xterm (white) maps at the top left of the black root shortly after the display starts
        until(lambda: _pixel(sb.gui.screenshot(), 100, 100) != (0, 0, 0), what="the xterm to draw")
        # focus follows the pointer (no window manager): point into the terminal, then type
        sb.gui.click(100, 100)
        assert sb.gui.cursor() == (100, 100)
        before = sb.gui.screenshot()
        sb.gui.type("echo hi > /tmp/gui-ok")
        sb.gui.key("Return")
        until(lambda: sb.exec("test -f /tmp/gui-ok").exit_code == 0, what="/tmp/gui-ok")
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
    # screen=False: the desktop image's programs without shoal's display (e2b-desktop starts its own Xvfb :0)
    with client.create("container", image="desktop", screen=False, pool=False, ttl_s=120) as sb:
        assert "Xvfb" not in sb.exec("ps -eo args").stdout
        assert sb.exec("command -v Xvfb scrot startxfce4 x11vnc websockify").exit_code == 0
        with pytest.raises(shoal.NoScreenError):
            sb.gui.screenshot()


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
        until(lambda: vm.exec("test -f /tmp/gui-ok").exit_code == 0, timeout=120, what="/tmp/gui-ok")
        assert vm.files.read_text("/tmp/gui-ok") == "hi\n"
        assert "echo hi > /tmp/gui-ok" in vm.exec("cat /dev/vcs1").stdout  # the console shows what was typed
        after = vm.gui.screenshot()
        assert after.size == (1024, 768) and _png_pixels(after.png) != _png_pixels(before.png)
        with pytest.raises(shoal.InvalidRequestError, match="unknown key"):
            vm.gui.key("NoSuchKeyName")
        assert "gui" in [step["op"] for step in vm.log()]


def _chromium(workdir: str):  # noqa: ANN202
    """Debian's headless chromium through selenium, with a fresh profile (Makefile APT_PACKAGES, [dev])."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage"]
    flags += ["--disable-background-networking", f"--user-data-dir={workdir}/profile", "--window-size=1200,900"]
    for flag in flags:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


_LIT_PIXELS = """const c = document.querySelector('#screen canvas');
if (!c || c.width < 2) return null;
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let lit = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 150) lit++;
return [c.width, c.height, lit];"""


def test_live_view_of_a_vm_in_a_real_browser(client: shoal.Client, tmp_path) -> None:  # noqa: ANN001
    """`sb.view()`: noVNC (Debian's novnc) served by the node, its websocket bridged to QEMU's VNC server;
    headless chromium shows the VM's console: the canvas has the screen's size and the typed text lit."""
    if "vm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    from selenium.webdriver.support.ui import WebDriverWait

    with client.create("vm", image="debian", screen=(1024, 768), pool=False, ttl_s=900) as vm:
        vm.gui.type("echo the view shows this line\n")
        url = vm.view()
        assert "/view/" + vm.id + "/5900." in url
        driver = _chromium(str(tmp_path))
        try:
            driver.get(url)
            seen = WebDriverWait(driver, 120, 0.5).until(
                lambda d: (r := d.execute_script(_LIT_PIXELS)) and r[2] > 200 and r, "the VM's screen in the canvas"
            )
            assert seen[:2] == [1024, 768]
            assert driver.execute_script("return document.body.dataset.state") == "connected"
        finally:
            driver.quit()
        bad = url.replace("/5900.", "/5900.0000")
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad + "websockify", timeout=30)
        assert refused.value.code in (400, 401)


def test_the_example_gui_rl_environment(client: shoal.Client) -> None:
    """examples/gui_form_env.py: screenshot -> click -> reward read from the sandbox, on a desktop container."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    try:
        import gui_form_env
    finally:
        sys.path.pop(0)
    env = gui_form_env.FormEnv(client, target=3)
    try:
        reward, clicks = gui_form_env.scripted_episode(env)
        assert (reward, clicks) == (1.0, 4)
        shot = env.reset()  # a new episode: saving at once leaves the value at 0, not the target
        _, reward, done = env.step(*gui_form_env.find_buttons(shot)["save"])
        assert (reward, done) == (0.0, False)
        assert env.state() == {"value": 0, "saved": 0, "clicks": 1}
    finally:
        env.close()


@pytest.fixture(scope="module")
def view_cluster(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One node and a gateway, each with its HTTP port (LocalCluster), for the live view through both."""
    from conftest import no_leftovers

    from shoal.cluster.local import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("view"), nodes=1, max_sandboxes=4, projects={"bob": {}}, prefix="tv")
    try:
        lc.add_gateway()
        with shoal.Client(f"shoal://{lc.gateways[0].address}", token=lc.cluster_token) as c:
            deadline = time.monotonic() + 60
            while sum(n["healthy"] for n in c._run(c._async.call("cluster_status"))["nodes"].values()) < 1:
                assert time.monotonic() < deadline, "the node did not come up"
                time.sleep(0.1)
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_live_view_of_a_desktop_through_gateway_and_node(view_cluster, tmp_path) -> None:  # noqa: ANN001
    """A desktop container's view: x11vnc (started at the first view) relayed through the gateway's HTTP and
    the node's; chromium shows the xterm (white on the black root) in a canvas of the screen's size."""
    from selenium.webdriver.support.ui import WebDriverWait

    gw, node = view_cluster.gateways[0], view_cluster.nodes[0]
    bob = view_cluster.project_tokens["bob"]
    with shoal.Client(f"shoal://{gw.address}", token=bob) as c:
        sb = c.create("container", image="desktop", screen=(800, 600), pool=False, ttl_s=600)
        try:
            until(lambda: _pixel(sb.gui.screenshot(), 100, 100) != (0, 0, 0), what="the xterm to draw")
            with shoal.Client(f"shoal://{node.address}", token=bob) as direct:
                urls = [sb.view(), direct.get(sb.id).view()]
            assert urls[0].startswith(f"http://{gw.http}/view/{sb.id}/5900.")
            assert urls[1].startswith(f"http://{node.http}/view/{sb.id}/5900.")
            driver = _chromium(str(tmp_path))
            try:
                for url in urls:
                    driver.get(url)
                    seen = WebDriverWait(driver, 120, 0.5).until(
                        lambda d: (r := d.execute_script(_LIT_PIXELS)) and r[2] > 10000 and r, "the desktop's canvas"
                    )
                    assert seen[:2] == [800, 600]
            finally:
                driver.quit()
        finally:
            sb.close()


def test_fork_of_a_vm_with_a_screen(client: shoal.Client) -> None:
    """Copies of a VM with a screen show the same screen at first and differ after different input."""
    if "vm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    with client.create("vm", image="debian", screen=(1024, 768), pool=False, ttl_s=900) as vm:
        vm.gui.type("echo parent\n")
        console = lambda: vm.exec("cat /dev/vcs1").stdout.split("echo parent", 1)[-1].rstrip()  # noqa: E731
        until(lambda: "parent" in console() and console().endswith("#"), what="the echo and the next prompt")
        kids = vm.fork(count=2)
        try:
            assert all(isinstance(k, shoal.Sandbox) for k in kids), kids
            assert [k.gui.screenshot().size for k in kids] == [(1024, 768), (1024, 768)]  # type: ignore[union-attr]
            same = lambda: len({_png_pixels(k.gui.screenshot().png) for k in kids}) == 1  # type: ignore[union-attr]  # noqa: E731
            until(same, what="the copies to show the same screen")
            kids[0].gui.type("echo first copy\n")  # type: ignore[union-attr]
            kids[1].gui.type("echo second\n")  # type: ignore[union-attr]
            for kid, text in zip(kids, ["first copy", "second"], strict=True):
                until(lambda k=kid, t=text: f"echo {t}" in k.exec("cat /dev/vcs1").stdout, what=text)
            shots = [k.gui.screenshot() for k in kids]  # type: ignore[union-attr]
            assert _png_pixels(shots[0].png) != _png_pixels(shots[1].png)
        finally:
            for k in kids:
                if isinstance(k, shoal.Sandbox):
                    k.close()


def _vm_desktop(client: shoal.Client) -> shoal.Sandbox:
    """A `vm-desktop` (systemd Debian + Xorg on QEMU's VGA, an xterm at the top left, no window manager):
    its root tree is built by `make images`, its first create boots and saves the template (minutes under TCG)."""
    if "vm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    return client.create("vm", image="vm-desktop", screen=(1024, 768), pool=False, ttl_s=1800)


def _x_pointer(vm: shoal.Sandbox) -> tuple[int, int]:
    """Where the guest's X server has its pointer (xdotool in the guest: a check, not a GUI action)."""
    out = dict(line.split("=", 1) for line in vm.exec("xdotool getmouselocation --shell").stdout.split())
    return int(out["X"]), int(out["Y"])


def _near(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return abs(a[0] - b[0]) <= 1 and abs(a[1] - b[1]) <= 1  # the tablet's 0..32767 scaling rounds


def test_a_vm_desktop_through_the_gui_alone(client: shoal.Client) -> None:
    """Xorg in a VM driven from the host over QMP: the USB tablet moves X's pointer, a click focuses the xterm
    and typing there runs the command (the file is checked with exec)."""
    with _vm_desktop(client) as vm:
        first = vm.gui.screenshot()
        assert first.size == (1024, 768) and _png_size(first.png) == (1024, 768)
        vm.gui.move(300, 200)  # the tablet's absolute position is where X puts its pointer
        until(lambda: _near(_x_pointer(vm), (300, 200)), timeout=120, what="X's pointer at 300,200")
        vm.gui.click(100, 100)  # into the xterm: focus follows the pointer
        before = vm.gui.screenshot()
        vm.gui.type("echo hi > /tmp/gui-ok")
        vm.gui.key("Return")
        until(lambda: vm.exec("test -f /tmp/gui-ok").exit_code == 0, timeout=120, what="/tmp/gui-ok")
        assert vm.files.read_text("/tmp/gui-ok") == "hi\n"
        after = vm.gui.screenshot()
        assert after.size == (1024, 768) and _png_pixels(after.png) != _png_pixels(before.png)
        assert "gui" in [step["op"] for step in vm.log()]
        # An agent's next step comes seconds later: the idle tablet must not be suspended, or the click's pointer
        # move reaches X after the keys typed right behind it and they go to the root window (lost).
        vm.gui.move(700, 600)  # off the xterm: the click below must bring the focus back
        time.sleep(4)  # the guest's USB autosuspend delay is 2 s
        vm.gui.click(100, 100)
        vm.gui.type("echo again > /tmp/gui-again\n")
        until(lambda: vm.exec("test -f /tmp/gui-again").exit_code == 0, timeout=60, what="/tmp/gui-again")


def test_fork_of_a_vm_desktop(client: shoal.Client) -> None:
    """Copies of a vm-desktop show the same screen at first and differ after different input (issue 15)."""
    with _vm_desktop(client) as vm:
        vm.gui.click(100, 100)
        vm.gui.type("echo parent > /tmp/parent\n")
        until(lambda: vm.exec("test -f /tmp/parent").exit_code == 0, timeout=120, what="/tmp/parent")
        kids = vm.fork(count=2)
        try:
            assert all(isinstance(k, shoal.Sandbox) for k in kids), kids
            assert [k.gui.screenshot().size for k in kids] == [(1024, 768), (1024, 768)]  # type: ignore[union-attr]
            same = lambda: len({_png_pixels(k.gui.screenshot().png) for k in kids}) == 1  # type: ignore[union-attr]  # noqa: E731
            until(same, timeout=120, what="the copies to show the same screen")
            for kid, text in zip(kids, ["first copy", "second"], strict=True):
                kid.gui.type(f"echo {text} > /tmp/kid\n")  # type: ignore[union-attr]
            for kid, text in zip(kids, ["first copy", "second"], strict=True):
                read = lambda k=kid: k.exec("cat /tmp/kid 2>/dev/null").stdout  # noqa: E731
                until(lambda r=read, t=text: r() == t + "\n", timeout=120, what=text)
            shots = [k.gui.screenshot() for k in kids]  # type: ignore[union-attr]
            assert _png_pixels(shots[0].png) != _png_pixels(shots[1].png)
        finally:
            for k in kids:
                if isinstance(k, shoal.Sandbox):
                    k.close()
