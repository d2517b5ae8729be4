"""Console logins: a token is exchanged once for a random session ID held in an HttpOnly cookie.

The browser then never keeps the token itself (no script can read the cookie), and links (downloads,
screenshots) and the terminal's websocket are authenticated like every other request. Sessions live in
the serving process only and end after SESSION_S or at a logout; SameSite=Strict keeps other sites' pages
from riding on them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from shoal.console.backend import Viewer
from shoal.errors import AuthenticationError

COOKIE = "shoal_console"
SESSION_S = 12 * 3600
MAX_SESSIONS = 10_000


class Sessions:
    def __init__(self) -> None:
        self._by_id: dict[str, tuple[Viewer, float]] = {}

    def open(self, viewer: Viewer) -> str:
        self._expire()
        while len(self._by_id) >= MAX_SESSIONS:
            self._by_id.pop(next(iter(self._by_id)))
        sid = secrets.token_urlsafe(32)
        self._by_id[sid] = (viewer, time.monotonic() + SESSION_S)
        return sid

    def viewer(self, sid: Any) -> Viewer:
        entry = self._by_id.get(sid) if isinstance(sid, str) else None
        if entry is None or entry[1] < time.monotonic():
            self._by_id.pop(sid, None) if isinstance(sid, str) else None
            raise AuthenticationError("not logged in to the console (or the session ended): log in with a token")
        return entry[0]

    def close(self, sid: Any) -> None:
        if isinstance(sid, str):
            self._by_id.pop(sid, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, (_, ends) in self._by_id.items() if ends < now]:
            del self._by_id[sid]
