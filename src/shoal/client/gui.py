"""`sb.gui`: the screen of a sandbox created with one (image='desktop' or screen=(w, h)).

Every action is the `gui` operation, a logged step of the sandbox's trajectory like exec (a screenshot's
PNG is kept in the log, so a trajectory holds what the agent saw). Key names are X keysym names as
xdotool takes them ("Return", "ctrl+c", "alt+F4"); coordinates are screen pixels from the top left.
A sandbox without a screen raises NoScreenError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Stepper(Protocol):
    """What AsyncGui needs of its sandbox handle (AsyncSandbox): its ID and a way to issue a step."""

    id: str

    async def _step(self, op: str, args: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Screenshot:
    """A PNG of the whole screen and its size."""

    png: bytes
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


class AsyncGui:
    """GUI actions on one sandbox's screen (async)."""

    def __init__(self, sandbox: Stepper) -> None:
        self._sandbox = sandbox

    async def _act(self, action: str, **args: Any) -> Any:
        return await self._sandbox._step("gui", {"sandbox_id": self._sandbox.id, "action": action, "args": args})

    async def screenshot(self) -> Screenshot:
        """The whole screen as PNG (8-bit RGB)."""
        shot = await self._act("screenshot")
        return Screenshot(png=shot["png"], width=shot["width"], height=shot["height"])

    async def click(self, x: int, y: int, button: str = "left", double: bool = False) -> None:
        """Move the pointer to (x, y) and click `button` ("left", "middle", "right"), twice if `double`."""
        await self._act("click", x=x, y=y, button=button, double=double)

    async def move(self, x: int, y: int) -> None:
        await self._act("move", x=x, y=y)

    async def drag(self, x1: int, y1: int, x2: int, y2: int, button: str = "left") -> None:
        """Press `button` at (x1, y1), move to (x2, y2), release."""
        await self._act("drag", x1=x1, y1=y1, x2=x2, y2=y2, button=button)

    async def scroll(self, dx: int = 0, dy: int = 0) -> None:
        """Scroll wheel clicks: dy > 0 down, dx > 0 right."""
        await self._act("scroll", dx=dx, dy=dy)

    async def type(self, text: str) -> None:
        """Type `text` key by key (newline presses Return)."""
        await self._act("type", text=text)

    async def key(self, keys: str) -> None:
        """Press a key or a chord: "Return", "ctrl+c", "alt+F4", "shift+Tab"."""
        await self._act("key", keys=keys)

    async def cursor(self) -> tuple[int, int]:
        """Where the pointer is."""
        where = (await self._act("cursor"))["result"]
        return where["x"], where["y"]

    async def wait_for_change(self, timeout: float = 10.0) -> bool:
        """Wait until the screen differs from the last screenshot; False if it did not within `timeout`."""
        return bool((await self._act("wait_for_change", timeout=timeout))["changed"])


class Gui:
    """GUI actions on one sandbox's screen (blocking); see AsyncGui."""

    def __init__(self, run: Any, inner: AsyncGui) -> None:
        self._run = run
        self._inner = inner

    def screenshot(self) -> Screenshot:
        return self._run(self._inner.screenshot())

    def click(self, x: int, y: int, button: str = "left", double: bool = False) -> None:
        self._run(self._inner.click(x, y, button, double))

    def move(self, x: int, y: int) -> None:
        self._run(self._inner.move(x, y))

    def drag(self, x1: int, y1: int, x2: int, y2: int, button: str = "left") -> None:
        self._run(self._inner.drag(x1, y1, x2, y2, button))

    def scroll(self, dx: int = 0, dy: int = 0) -> None:
        self._run(self._inner.scroll(dx, dy))

    def type(self, text: str) -> None:
        self._run(self._inner.type(text))

    def key(self, keys: str) -> None:
        self._run(self._inner.key(keys))

    def cursor(self) -> tuple[int, int]:
        return self._run(self._inner.cursor())

    def wait_for_change(self, timeout: float = 10.0) -> bool:
        return self._run(self._inner.wait_for_change(timeout))
