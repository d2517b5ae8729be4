"""The console's backends (shoal/console/backend.py): how a node and a gateway answer it.

Both call operations the way their TCP fronts do, so ownership is decided in one place: a node runs a
project's request through its `ProjectSession` (cluster/tenancy.py), a gateway through `Gateway.dispatch`.
Figures for the overview's charts come from the metrics each already keeps (cluster/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from shoal import tls
from shoal.cluster.metrics import Histogram, Registry
from shoal.console.backend import Viewer
from shoal.errors import AuthenticationError

CHARTED_OPS = ("create", "exec", "shell_run", "file_write", "file_read")  # latencies the overview draws


def _builtins(result: Any) -> Any:
    return msgspec.to_builtins(result, builtin_types=(bytes,))


def _latencies(histogram: Histogram | None, ops: tuple[str, ...] = CHARTED_OPS) -> dict[str, Any]:
    if histogram is None:
        return {}
    out = {}
    for op in ops:
        row = histogram.series.get((op,))
        if row:
            out[op] = {"p50": histogram.quantile(0.5, op), "p99": histogram.quantile(0.99, op), "count": sum(row[:-1])}
    return out


def _find(registry: Registry, name: str) -> Any:
    return next((m for m in registry.metrics if m.name == name), None)


class NodeConsole:
    """A node's console: tokens are the node's (SHOAL_TOKENS), requests go through its project sessions."""

    def __init__(self, server: Any, registry: Registry, session: Callable[[Any], Any] | None) -> None:
        self.server = server
        self.registry = registry
        self.session = session
        self.where = f"node {server.service.settings.node_id}"

    def _projects(self) -> Any:
        projects = getattr(self.server, "projects", None)
        if projects is None or self.session is None:
            raise AuthenticationError(
                "this node takes no tokens, so it serves no console: start it with SHOAL_TCP and SHOAL_TOKENS "
                "(or open the console of a gateway in front of it)"
            )
        return projects

    def authenticate(self, token: str | None) -> Viewer:
        return Viewer.of(self._projects().tokens.authenticate(token))

    def check_transport(self, peer: str, secure: bool) -> None:
        if not secure:
            tls.refuse_plaintext(peer, f"node {self.server.service.settings.node_id} console")

    async def call(
        self, viewer: Viewer, op: str, args: dict[str, Any], on_event: Callable[[Any], None] | None = None
    ) -> Any:
        bound = self.server.ops.get(op)
        if bound is None:  # a gateway's operation (cluster_status...): the node says so, as over TCP
            from shoal.errors import InvalidRequestError

            raise InvalidRequestError(f"operation {op!r} is served by a gateway, not by a node")
        session = self.session(self._projects())
        session.identity = viewer.identity

        async def invoke(checked: dict[str, Any]) -> Any:
            kwargs = bound.arguments(checked)
            if bound.streams:

                async def emit(event: Any) -> None:
                    if on_event is not None:
                        on_event(_builtins(event))

                kwargs["emit"] = emit
            return await bound.method(**kwargs)

        return _builtins(await session.call(op, args, invoke))

    def figures(self) -> dict[str, Any]:
        latency = _find(self.registry, "shoal_node_request_seconds")
        row = latency.series.get(("create",)) if latency is not None else None
        return {"latency": _latencies(latency), "creates_total": sum(row[:-1]) if row else 0, "queue_depth": 0}


class GatewayConsole:
    """A gateway's console: its tokens, its dispatch (routing, fan-out, admission), its metrics."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self.where = f"gateway {gateway.name}"

    def authenticate(self, token: str | None) -> Viewer:
        return Viewer.of(self.gateway.tokens.authenticate(token))

    def check_transport(self, peer: str, secure: bool) -> None:
        if not secure:
            tls.refuse_plaintext(peer, f"gateway {self.gateway.name} console")

    async def call(
        self, viewer: Viewer, op: str, args: dict[str, Any], on_event: Callable[[Any], None] | None = None
    ) -> Any:
        def forward(event: Any) -> None:
            if on_event is not None:
                on_event(_builtins(event))

        return _builtins(await self.gateway.dispatch(viewer.identity, op, args, forward))

    def figures(self) -> dict[str, Any]:
        gw = self.gateway
        latency = _latencies(gw.latency)
        if gw.create_latency.series.get(()):
            row = gw.create_latency.series[()]
            latency["create"] = {"p50": gw.create_latency.quantile(0.5), "p99": gw.create_latency.quantile(0.99),
                                 "count": sum(row[:-1])}  # fmt: skip
        return {
            "latency": latency,
            "creates_total": sum(gw.created.values.values()),
            "queue_depth": gw.admission.depth(),
        }
