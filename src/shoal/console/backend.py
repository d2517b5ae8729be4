"""What the console needs from whoever serves it (a node's or a gateway's HTTP): tokens and operations.

The console never decides who owns what: `Backend.call` runs an operation of the table (shoal/ops.py) for a
viewer exactly as that viewer's TCP connection would run it (a node through cluster/tenancy.py, a gateway
through its dispatch). Results come back as plain builtins (msgspec.to_builtins, bytes kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a project (sees its own sandboxes) or the cluster (sees all). `identity` is the
    host's own object for the token (cluster.auth.Identity), handed back to it on every call."""

    project: str | None
    cluster: bool
    identity: Any

    @classmethod
    def of(cls, identity: Any) -> Viewer:
        """From an identity with `.project` and `.cluster` (cluster.auth.Identity)."""
        return cls(project=None if identity.cluster else identity.project, cluster=identity.cluster, identity=identity)


class Backend(Protocol):
    where: str  # "node n1" / "gateway gw1": shown in the page header

    def authenticate(self, token: str | None) -> Viewer:
        """The viewer for a token; AuthenticationError if unknown."""

    def check_transport(self, peer: str, secure: bool) -> None:
        """Raise AuthenticationError when a token or session may not travel in clear from `peer`."""

    async def call(
        self, viewer: Viewer, op: str, args: dict[str, Any], on_event: Callable[[Any], None] | None = None
    ) -> Any:
        """Run operation `op` for `viewer`; the result as builtins. The events of a streaming operation
        (`proc_read` with stream: the terminal's output as printed) go to `on_event` as builtins, in order,
        before the result; without it they are dropped."""

    def figures(self) -> dict[str, Any]:
        """Figures from the metrics the host keeps: {"latency": {op: {"p50", "p99", "count"}},
        "creates_total": n, "queue_depth": n}."""
