"""A GUI RL environment on a desktop container: "set the value to N and press Save".

    python examples/gui_form_env.py [TARGET]

The task is a small X11 form (FORM_APP below: python3-xlib, which image `desktop` has; it opens at the
bottom right, clear of the desktop's xterm, as there is no window manager) with a value, a red "-" button,
a green "+" button and a blue "Save" button; the app keeps its state in /tmp/form.json in the sandbox (the
value, the value saved, the clicks it has handled). The agent sees only screenshots and acts only through
`sb.gui` (clicks); the reward is read from the sandbox's state (1.0 when the saved value is the target),
once the app has handled the click. The scripted policy finds the buttons by their colours in the
screenshot, clicks "+" or "-" until its count says the value is there, then Save: a stand-in for a
model's screenshot -> action loop.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from dataclasses import dataclass

import shoal

FORM_APP = r"""
import json, os
from Xlib import X, display
d = display.Display(); screen = d.screen(); cmap = screen.default_colormap
win = screen.root.create_window(560, 480, 420, 160, 0, screen.root_depth, X.InputOutput, X.CopyFromParent,
                                background_pixel=screen.white_pixel, event_mask=X.ExposureMask | X.ButtonPressMask)
def gc(rgb):
    return win.create_gc(foreground=cmap.alloc_color(*[c * 257 for c in rgb]).pixel)
buttons = {"minus": ((20, 80, 100, 60), gc((220, 40, 40))), "plus": ((150, 80, 100, 60), gc((40, 180, 40))),
           "save": ((280, 80, 120, 60), gc((40, 60, 220)))}
ink = gc((0, 0, 0)); value = 0; saved = None; clicks = 0
def record():  # every click is acknowledged in the state file, so the reward never races the app
    with open("/tmp/form.tmp", "w") as f:
        json.dump({"value": value, "saved": saved, "clicks": clicks}, f)
    os.replace("/tmp/form.tmp", "/tmp/form.json")
def draw():
    win.clear_area(0, 0, 420, 70)
    win.draw_text(ink, 20, 40, f"value: {value}".encode())
    for (x, y, w, h), g in buttons.values():
        win.fill_rectangle(g, x, y, w, h)
win.map(); d.sync()
while True:
    e = d.next_event()
    if e.type == X.Expose:
        draw()
    elif e.type == X.ButtonPress:
        clicks += 1
        for name, ((x, y, w, h), _) in buttons.items():
            if x <= e.event_x < x + w and y <= e.event_y < y + h:
                if name == "save":
                    saved = value
                else:
                    value += 1 if name == "plus" else -1
                draw(); d.sync()
        record()
"""
COLOURS = {"minus": (220, 40, 40), "plus": (40, 180, 40), "save": (40, 60, 220)}


def pixels(shot: shoal.Screenshot) -> bytes:
    """RGB rows of a container's screenshot (the node writes filter-0 scanlines, so no unfiltering)."""
    pos, idat = 8, b""
    while pos < len(shot.png):
        (length,) = struct.unpack(">I", shot.png[pos : pos + 4])
        if shot.png[pos + 4 : pos + 8] == b"IDAT":
            idat += shot.png[pos + 8 : pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + shot.width * 3
    return b"".join(raw[row * stride + 1 : (row + 1) * stride] for row in range(shot.height))


def find_buttons(shot: shoal.Screenshot) -> dict[str, tuple[int, int]]:
    """The centre of each button, found by its colour (a scan every 4 pixels is enough for 60-pixel buttons)."""
    rgb, width = pixels(shot), shot.width
    found: dict[str, list[tuple[int, int]]] = {name: [] for name in COLOURS}
    for y in range(0, shot.height, 4):
        for x in range(0, width, 4):
            at = (y * width + x) * 3
            colour = tuple(rgb[at : at + 3])
            for name, want in COLOURS.items():
                if colour == want:
                    found[name].append((x, y))
    return {name: (sum(p[0] for p in pts) // len(pts), sum(p[1] for p in pts) // len(pts))
            for name, pts in found.items() if pts}  # fmt: skip


@dataclass
class FormEnv:
    """One episode per reset: a fresh desktop sandbox with the form open; actions are clicks."""

    client: shoal.Client
    target: int
    sandbox: shoal.Sandbox | None = None
    clicks: int = 0

    def reset(self, timeout: float = 120.0) -> shoal.Screenshot:
        self.close()
        self.clicks = 0
        self.sandbox = self.client.create("container", image="desktop", screen=(1024, 768), pool=False, ttl_s=600)
        self.sandbox.files.write("/opt/form.py", FORM_APP.encode())
        self.sandbox.exec("nohup python3 /opt/form.py >/tmp/form.log 2>&1 &")  # the task, not the agent's action
        deadline = time.monotonic() + timeout
        while True:  # the form is up once its three buttons are on the screen
            shot = self.sandbox.gui.screenshot()
            if len(find_buttons(shot)) == len(COLOURS):
                return shot
            if time.monotonic() > deadline:
                raise TimeoutError(f"the form did not appear in {timeout:g} s")
            time.sleep(0.2)

    def step(self, x: int, y: int) -> tuple[shoal.Screenshot, float, bool]:
        """Click at (x, y); the new screen, the reward (read from the sandbox) and whether it is done."""
        assert self.sandbox is not None
        self.sandbox.gui.click(x, y)
        self.clicks += 1
        reward = 1.0 if self.state()["saved"] == self.target else 0.0
        return self.sandbox.gui.screenshot(), reward, reward > 0

    def state(self, timeout: float = 60.0) -> dict:
        """The form's state once it has handled every click sent so far."""
        assert self.sandbox is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = json.loads(self.sandbox.files.read_text("/tmp/form.json"))
                if state["clicks"] >= self.clicks:
                    return state
            except (FileNotFoundError, ValueError):  # no click handled yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the form did not handle click {self.clicks} in {timeout:g} s")
            time.sleep(0.05)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


def scripted_episode(env: FormEnv) -> tuple[float, int]:
    """Screenshot -> action -> reward until done; (the final reward, the number of clicks)."""
    shot = env.reset()
    value, clicks, reward = 0, 0, 0.0
    while True:
        buttons = find_buttons(shot)
        if value == env.target:
            _, reward, _ = env.step(*buttons["save"])
            return reward, clicks + 1
        name = "plus" if value < env.target else "minus"
        shot, reward, _ = env.step(*buttons[name])
        value += 1 if name == "plus" else -1
        clicks += 1


if __name__ == "__main__":
    target = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with shoal.Client() as client:
        env = FormEnv(client, target)
        try:
            started = time.monotonic()
            reward, clicks = scripted_episode(env)
            print(f"target {target}: reward {reward} after {clicks} clicks in {time.monotonic() - started:.1f} s")
        finally:
            env.close()
