"""The gateway: a stateless front for many nodes, speaking the node protocol (TCP + token) to clients.

- Routing: a sandbox ID is `<node_id>-<hex>`, so any gateway sends any request to the owning node with no
  shared state; a node that is gone or not answering makes its sandboxes' requests fail with
  SandboxLostError naming the node and the reason, while every other sandbox carries on.
- Placement of creates: admission queue (bounded, fair, deadlines) → filter → power-of-k on load → the node
  may refuse (CapacityError) → retry on another node.
- Membership: a static list (`--node id=host:port`) or pushed by the Ray controller (`cluster_nodes`);
  each node is polled for its load, kinds, images and per-project usage (cluster-wide quotas).

Run: `python -m shoal.cluster.gateway --listen 0.0.0.0:7470 --tokens tokens.json --node n1=host:7400 ...`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from shoal import ops, protocol, settings, tls
from shoal.client.transport import Connection
from shoal.cluster import placement
from shoal.cluster.admission import AdmissionQueue
from shoal.cluster.auth import CLUSTER_ROLE, Identity, Tokens, Usage, cost
from shoal.cluster.metrics import Counter, CounterFn, Gauge, Histogram, Registry
from shoal.cluster.placement import NodeView
from shoal.config import write_address
from shoal.errors import (
    AuthenticationError,
    CapacityError,
    InvalidRequestError,
    NodeError,
    SandboxLostError,
    SandboxNotFoundError,
    ShoalError,
    UnsupportedKindError,
    from_wire,
    to_wire,
)
from shoal.netguard import ConnectionGuard, serve_tcp
from shoal.protocol import Request, Response, combine_status, merge_image_lists
from shoal.tasks import TaskOwner

log = logging.getLogger("shoal.gateway")

NOT_CONTACTED = placement.NOT_CONTACTED


def node_of(sandbox_id: str, known: Any = ()) -> str:
    """The node a sandbox ID names: `<node>-<hex>`, or `<node>-fn-<hex>` for a function sandbox."""
    node, _, suffix = sandbox_id.rpartition("-")
    if not node or not suffix:
        raise InvalidRequestError(f"{sandbox_id!r} is not a sandbox ID: IDs look like <node>-<hex>")
    if node not in known and node.endswith("-fn") and node.removesuffix("-fn") in known:
        return node.removesuffix("-fn")
    return node


class Gateway:
    def __init__(
        self,
        tokens: Tokens,
        *,
        name: str = "gw",
        poll_interval: float = 0.5,
        k: int = 2,
        max_inflight_per_node: int = 32,
        admission_timeout: float = 600.0,
        max_waiting: int = 200_000,
    ) -> None:
        self.tokens = tokens
        self.tls_ca: str | None = None  # set by main(): speak TLS to the nodes, verified against this CA
        self.node_tls: Any = None
        self.cluster_token = next((t for t, p in tokens.config.get("tokens", {}).items() if p == CLUSTER_ROLE), None)
        if self.cluster_token is None:
            raise AuthenticationError("the gateway's token file has no @cluster token: it needs one to talk to nodes")
        self.name = name
        self.http_url: str | None = None  # the gateway's HTTP (sb.expose URLs go through it); set by its server
        self.poll_interval = poll_interval
        self.k = k
        self.max_inflight = max_inflight_per_node
        self.nodes: dict[str, NodeView] = {}
        self.gone: dict[str, str] = {}
        self.conns: dict[str, Connection] = {}  # clients' requests to each node, multiplexed
        self.poll_conns: dict[str, Connection] = {}  # each poller's own: a slow poll never fails a request
        self.tasks = TaskOwner(f"gateway {name}")  # every background task of the gateway ends with it
        self._pollers: dict[str, asyncio.Task] = {}
        self._closing = False
        self._changed = asyncio.Event()
        self.rng = random.Random()
        self.admission = AdmissionQueue(
            lambda: placement.free_slots(self.nodes.values(), self.max_inflight),
            max_waiting=max_waiting,
            timeout=admission_timeout,
        )
        self.reserving: dict[str, Usage] = collections.defaultdict(Usage)  # creates of a project in flight
        self.started_at = time.time()
        self.connections = 0
        self.metrics = self._metrics()

    # ------------------------------------------------------------------ membership and the cluster view

    def set_nodes(self, nodes: dict[str, str], gone: dict[str, str] | None = None) -> None:
        """Replace the membership: {node_id: "host:port"}; `gone` names nodes that left, with why."""
        for node_id, reason in (gone or {}).items():
            self.gone[node_id] = reason
        for node_id in list(self.nodes):
            if node_id not in nodes:
                self._forget(node_id, self.gone.get(node_id, "it left the cluster"))
        for node_id, address in nodes.items():
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():  # one bad entry must not stop the rest of the membership
                log.warning("node %s pushed with an unusable address %r: left out", node_id, address)
                continue
            view = self.nodes.get(node_id)
            if view is not None and (view.host, view.port) == (host, int(port)):
                continue
            if view is not None:
                self._forget(node_id, "it moved to a new address")
            self.gone.pop(node_id, None)
            self.nodes[node_id] = NodeView(node_id=node_id, host=host, port=int(port), since=time.time())
            poller = self.tasks.spawn(self._poll(node_id), f"poll {node_id}")
            if poller is not None:
                self._pollers[node_id] = poller

    async def discover(self, name: str, port: int, interval: float = 5.0) -> None:
        """Keep the membership equal to the nodes behind a DNS name (e.g. a Kubernetes headless Service):
        each address is asked who it is (its node ID) over the protocol; an address that leaves DNS is gone."""
        loop = asyncio.get_running_loop()
        known: dict[str, str] = {}  # host:port -> node id
        while True:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                addresses = {f"{info[4][0]}:{port}" for info in infos}
            except OSError as exc:
                log.warning("discovery: cannot resolve %s: %s", name, exc)
                addresses = set(known)
            for address in sorted(addresses - set(known)):
                host = address.rpartition(":")[0]
                try:
                    conn = await asyncio.wait_for(self._open(host, port), 5)
                    known[address] = conn.identity["node_id"]
                    await conn.close()
                except Exception as exc:  # not up yet: ask again next round
                    log.info("discovery: %s does not answer yet: %s", address, exc)
            departed = {known.pop(a): f"its address {a} left {name}" for a in set(known) - addresses}
            self.set_nodes({node_id: address for address, node_id in known.items()}, departed)
            await asyncio.sleep(interval)

    def _forget(self, node_id: str, reason: str) -> None:
        self.nodes.pop(node_id, None)
        self.gone[node_id] = reason
        task = self._pollers.pop(node_id, None)
        if task is not None:
            task.cancel()
        for conns in (self.conns, self.poll_conns):
            conn = conns.pop(node_id, None)
            if conn is not None:
                self.tasks.spawn(conn.close(), f"close the connection to {node_id}")

    def _mark(self, view: NodeView, healthy: bool, reason: str = "") -> None:
        if view.healthy != healthy:
            view.since = time.time()
            log.log(logging.INFO if healthy else logging.WARNING, "node %s %s %s", view.node_id,
                    "is up" if healthy else "is down:", reason)  # fmt: skip
        view.healthy = healthy
        view.reason = reason

    async def _conn(self, view: NodeView, conns: dict[str, Connection] | None = None) -> Connection:
        """The open connection to a node in `conns` (the requests' by default), opened if there is none."""
        conns = self.conns if conns is None else conns
        conn = conns.get(view.node_id)
        if conn is None or conn.closed:
            conn = await asyncio.wait_for(self._open(view.host, view.port), 5)
            if conn.identity.get("node_id") != view.node_id:
                await conn.close()
                raise NodeError(f"{view.host}:{view.port} is node {conn.identity.get('node_id')}, not {view.node_id}")
            conns[view.node_id] = conn
        return conn

    async def _open(self, host: str, port: int) -> Connection:
        """A connection to a node as the cluster: over TLS if the gateway has a CA for its nodes (--tls-ca)."""
        return await Connection.open_tcp(host, port, self.cluster_token, tls_context=self.node_tls, tls_ca=self.tls_ca)

    async def _poll(self, node_id: str) -> None:
        """Keep a node's view current, on a connection of the poller's own.

        A poll that times out marks the node down (no new placements) but leaves the requests' connection
        alone: a node busy with thousands of creates answers late, and its in-flight requests are still
        good. A poll that fails otherwise (refused, reset, a node that is someone else) closes both: the
        requests would fail on that connection anyway, and the next request opens a fresh one."""
        images_every = 20
        tick = 0
        while node_id in self.nodes and not self._closing:
            view = self.nodes[node_id]
            try:
                conn = await self._conn(view, self.poll_conns)
                status = await asyncio.wait_for(conn.call("status"), 5)
                # a sandbox made (node clock) before the node took its usage snapshot is in the snapshot (as
                # owned, or as reserved while its create was in flight); the later ones are counted from here
                view.usage_as_of = float(status.get("usage_as_of", 0.0))
                view.placed = [p for p in view.placed if p[0] > view.usage_as_of]
                if tick % images_every == 0 or not view.healthy:
                    view.images = frozenset(await asyncio.wait_for(conn.call("image_list"), 5))
                view.status = status
                view.kinds = frozenset(status.get("kinds", ["container"]))
                view.max_sandboxes = int(status.get("max_sandboxes", 0))
                view.polled = int(status["sandboxes"]) + int(status.get("creating", 0))
                view.delta = 0
                view.full = False
                view.projects = status.get("projects", {})
                self._mark(view, True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._mark(view, False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
                slow = isinstance(exc, TimeoutError)
                for conns in (self.poll_conns,) if slow else (self.poll_conns, self.conns):
                    conn = conns.pop(node_id, None)
                    if conn is not None:
                        await conn.close()
            tick += 1
            self.admission.pump()
            await asyncio.sleep(self.poll_interval)

    def healthy(self) -> list[NodeView]:
        return [v for v in self.nodes.values() if v.healthy]

    # ------------------------------------------------------------------ serving clients

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, guard: ConnectionGuard | None = None
    ) -> None:
        self.connections += 1
        state: dict[str, Any] = {"identity": None, "guard": guard}
        if guard is not None:
            guard.is_authenticated = lambda: state["identity"] is not None

        def send(message: Response) -> None:
            if not writer.is_closing():
                writer.write(protocol.encode(message))

        async def drain() -> None:
            if writer.transport.get_write_buffer_size() > 1 << 20:
                await writer.drain()

        try:
            await protocol.dispatch_requests(
                reader, lambda request: self._serve(request, send, state), after_each=drain, guard=guard
            )
        finally:
            self.connections -= 1
            writer.close()

    async def _serve(self, request: Request, send: Callable[[Response], None], state: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            if request.op == "auth":
                guard = state.get("guard")
                if guard is not None and not guard.tls:
                    tls.refuse_plaintext(guard.peer, f"gateway {self.name}")
                ident = self.tokens.authenticate(request.args.get("token"))
                state["identity"] = ident
                result: Any = {
                    "gateway": self.name,
                    "node_id": None,
                    "project": ident.project,
                    "cluster": ident.cluster,
                }
            else:
                ident = state["identity"]
                if ident is None:
                    raise AuthenticationError(
                        "not authenticated: the first request must be auth with a token "
                        "(shoal.Client('shoal://host:port', token=...))"
                    )
                on_event = lambda event: send(Response(id=request.id, event=event))  # noqa: E731
                result = await self.dispatch(ident, request.op, dict(request.args), on_event)
            response = Response(id=request.id, result=result)
        except (Exception, asyncio.CancelledError) as exc:  # every failure is this request's error response
            response = protocol.error_response(request, exc)
        if request.op == "auth":  # every other request is observed by dispatch, whichever front called it
            self._observe(request.op, time.monotonic() - started, response.error.type if response.error else None)
        send(response)

    async def dispatch(self, ident: Identity, name: str, args: dict[str, Any], on_event: Callable[[Any], None]) -> Any:
        """Serve one request for `ident` (a project, or the cluster acting for `_project` or for everyone),
        routed as its entry in the operation table (shoal/ops.py) says. The TCP front and the HTTP API both come
        through here, so the request metrics count both."""
        started = time.monotonic()
        error: str | None = None
        try:
            return await self._dispatch(ident, name, args, on_event)
        except (Exception, asyncio.CancelledError) as exc:
            error = to_wire(exc)[0]
            raise
        finally:
            self._observe(name, time.monotonic() - started, error)

    async def _dispatch(self, ident: Identity, name: str, args: dict[str, Any], on_event: Callable[[Any], None]) -> Any:
        project = args.pop("_project", None) if ident.cluster else ident.project
        op = ops.get(name)
        if op.access == ops.CLUSTER and not ident.cluster:
            raise AuthenticationError(f"operation {name!r} needs a cluster (admin) token, not project {project!r}'s")
        if op.route in (ops.LOCAL, ops.GATEWAY):
            return self._local(op, args, ident)
        if op.name == "expose":  # the node's answer, with the URL through this gateway's HTTP
            if self.http_url is None:
                raise InvalidRequestError(
                    f"gateway {self.name} serves no HTTP, so it relays no ports: start it with --http"
                )
            result = await self._routed(op, args, project, on_event)
            return dict(result, url=self.http_url + result["path"])
        if op.route == ops.SANDBOX or (op.route == ops.ANYWHERE and op.sandbox_of(args)):
            return await self._routed(op, args, project, on_event)
        if op.route == ops.ANYWHERE:
            return await self._anywhere(op.name, args, project, on_event)
        if op.route == ops.TARGET:
            return await self._targeted(op, args, project, on_event)
        if op.route == ops.PLACED:
            if project is None:
                raise InvalidRequestError("create through a gateway needs a project (use a project token)")
            return await self.create(project, args)
        if op.route == ops.ONE:
            return await self._one(op, args, project, on_event)
        return await self._fanout(op, args, project, on_event)

    def _local(self, op: ops.Op, args: dict[str, Any], ident: Identity) -> Any:
        if op.name == "auth":
            return {"gateway": self.name, "node_id": None, "project": ident.project, "cluster": ident.cluster}
        if op.name == "hello":
            return {"gateway": self.name, "nodes": sorted(self.nodes), "kinds": sorted(self._kinds())}
        if op.name == "cluster_status":
            view = self.cluster_status()
            if not ident.cluster:  # a project sees its own queue, not which other projects wait
                view["queue_by_project"] = {p: d for p, d in view["queue_by_project"].items() if p == ident.project}
            return view
        if op.name == "metrics":
            return self.metrics.render()
        if op.name == "cluster_nodes":
            self.set_nodes(args.get("nodes") or {}, args.get("gone") or {})
            return sorted(self.nodes)
        raise InvalidRequestError(f"operation {op.name!r} has no local implementation in the gateway")

    async def open_port(self, target: Any, project: str | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to a port inside a sandbox (an sb.expose URL's request, shoal/portrelay.py): a connection
        of its own to the sandbox's node, as the cluster, turned into that stream by the node's `port_connect`
        (which checks the key, or that the sandbox is `project`'s)."""
        node_id = node_of(target.sandbox_id, self.nodes.keys() | self.gone.keys())
        view = self.nodes.get(node_id)
        if view is None or not view.healthy:
            raise self._lost(target.sandbox_id, node_id)
        if self.node_tls is None:
            tls.refuse_plaintext(view.host, f"gateway {self.name} to node {node_id}")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                view.host,
                view.port,
                limit=1 << 20,
                ssl=self.node_tls,
                server_hostname=view.host if self.node_tls else None,
            ),
            10,
        )
        try:
            await _ask(reader, writer, 1, "auth", {"token": self.cluster_token})
            args: dict[str, Any] = {"sandbox_id": target.sandbox_id, "port": target.port, "key": target.key}
            if project is not None:
                args["_project"] = project
            await _ask(reader, writer, 2, "port_connect", args)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    def _kinds(self) -> set[str]:
        return set().union(*(v.kinds for v in self.nodes.values())) if self.nodes else set()

    def _lost(self, sandbox_id: str, node_id: str) -> ShoalError:
        if node_id in self.gone:
            return SandboxLostError(
                f"sandbox {sandbox_id} is lost: its node {node_id} left the cluster ({self.gone[node_id]})"
            )
        view = self.nodes.get(node_id)
        if view is None:
            known = ", ".join(sorted(self.nodes)) or "none"
            return SandboxNotFoundError(
                f"sandbox {sandbox_id} names node {node_id!r}, which this cluster does not have (nodes: {known}); "
                "check the ID, or the node left and took its sandboxes with it"
            )
        ago = time.time() - view.since
        return SandboxLostError(
            f"sandbox {sandbox_id} is lost: its node {node_id} stopped answering {ago:.1f} s ago ({view.reason})"
        )

    async def _routed(self, op: ops.Op, args: dict[str, Any], project: str | None, on_event: Callable) -> Any:
        sandbox_id = op.sandbox_of(args)
        if not sandbox_id:
            raise InvalidRequestError(f"{op.name} needs a sandbox ID ({op.sandbox_arg})")
        return await self._on_node(
            op.name, node_of(sandbox_id, self.nodes.keys() | self.gone.keys()), sandbox_id, args, project, on_event
        )

    async def _on_node(
        self, op: str, node_id: str, sandbox_id: str, args: dict[str, Any], project: str | None, on_event: Callable
    ) -> Any:
        """Send a request about `sandbox_id` to its node; a node that is gone makes it SandboxLostError."""
        view = self.nodes.get(node_id)
        if op == "kill" and view is None and node_id in self.gone:
            return False  # its node left the cluster: the sandbox is gone already, and closing twice is fine
        if view is None or not view.healthy:
            raise self._lost(sandbox_id, node_id)
        try:
            conn = await self._conn(view)
        except (OSError, NodeError, TimeoutError) as exc:
            self._mark(view, False, f"{type(exc).__name__}: {exc}")
            raise self._lost(sandbox_id, node_id) from exc
        if project is not None:
            args["_project"] = project
        try:
            result = await conn.call(op, args, on_event=on_event)
        except NodeError as exc:  # the connection to the node broke during the request
            self._mark(view, False, str(exc))
            raise self._lost(sandbox_id, node_id) from exc
        if op == "kill":
            view.delta -= 1
            self.admission.pump()
        return result

    async def _anywhere(self, op: str, args: dict[str, Any], project: str | None, on_event: Callable) -> Any:
        kind = (args.get("spec") or {}).get("kind", "function")
        if project is not None:
            args["_project"] = project
        tried: set[str] = set()
        while True:
            options = [v for v in self.healthy() if kind in v.kinds and v.node_id not in tried]
            view = placement.power_of_k(options, self.k, self.rng)
            if view is None:
                raise CapacityError(f"no healthy node runs kind {kind!r} ({self._down()}); start or fix nodes")
            try:
                return await (await self._conn(view)).call(op, args, on_event=on_event)
            except (NodeError, OSError, TimeoutError) as exc:  # the node went away: another one
                self._mark(view, False, f"{type(exc).__name__}: {exc}")
                tried.add(view.node_id)

    async def _fanout(
        self,
        op: ops.Op,
        args: dict[str, Any],
        project: str | None,
        on_event: Callable | None = None,
        views: list[NodeView] | None = None,
    ) -> Any:
        """Send to every healthy node (or `views`) and merge the answers as the table says (`op.merge`)."""
        views = self.healthy() if views is None else views
        if project is not None:
            args["_project"] = project

        async def one(view: NodeView) -> Any:
            return await (await self._conn(view)).call(op.name, args, on_event=on_event)

        results = await asyncio.gather(*(one(v) for v in views), return_exceptions=True)
        answers = {v.node_id: r for v, r in zip(views, results, strict=True)}
        failed = {n: r for n, r in answers.items() if isinstance(r, BaseException)}
        ok = {n: r for n, r in answers.items() if not isinstance(r, BaseException)}
        if op.merge == ops.STATUS:  # shaped like a node's (protocol.combine_status), plus the gateway's name
            return {**combine_status(ok, {n: str(e) for n, e in failed.items()}), "gateway": self.name}
        if op.merge == ops.CONCAT:  # what the reachable nodes hold (a lost node's sandboxes are lost)
            return [item for r in ok.values() for item in r]
        if op.merge == ops.SUM:
            if failed:
                self.admission.pump()
            return sum(ok.values())
        if op.merge == ops.UNION:
            return sorted(set().union(*ok.values())) if ok else []
        if op.merge == ops.IMAGES:  # one entry per image, as a node lists it, naming the nodes that hold it
            return merge_image_lists(ok.values())
        if op.merge == ops.INSPECT and ok:  # one record, as a node answers, naming the nodes that hold it
            record = dict(next(iter(ok.values())))
            record["nodes"] = sorted(n for r in ok.values() for n in r.get("nodes", []))
            return record
        if failed:
            first = next(iter(failed.values()))
            raise first if isinstance(first, Exception) else ShoalError(str(first))
        return ok

    async def _one(self, op: ops.Op, args: dict[str, Any], project: str | None, on_event: Callable) -> Any:
        """An image operation that one node does for the cluster: a healthy node that has the image."""
        name = args.get("name")
        views = sorted(self.healthy(), key=lambda v: (name not in v.images, v.node_id))
        if not views:
            raise CapacityError(f"no healthy node in the cluster ({self._down()}); start or fix nodes")
        if project is not None:
            args["_project"] = project
        return await (await self._conn(views[0])).call(op.name, args, on_event=on_event)

    # ------------------------------------------------------------------ trajectories

    async def find(self, target: str, project: str | None) -> list[dict[str, Any]]:
        """Every node's answer to "where is `target` (sandbox ID or trajectory name) of `project`": the
        source of truth for a name, whatever the node set was when it was made. Live entries first. Every
        member is asked, also one this gateway saw fail a poll: under load a view can be wrong for a moment,
        and a holder left out would make its name look new."""
        rows = await self._fanout(
            ops.OPS["trajectory_find"], {"target": target}, project, views=list(self.nodes.values())
        )
        return sorted(rows, key=lambda row: row["status"] != "live")

    def home(self, name: str, project: str, kind: str) -> NodeView | None:
        """The node where trajectory `name` of `project` is made: rendezvous hashing over the member nodes
        that run `kind` (healthy or not: gateways agree on membership more than on health), so every gateway
        picks the same node, and that node serialises concurrent creates of the name (two trainers racing
        through two gateways get one sandbox). Only if the home cannot be reached is the name placed
        elsewhere."""
        options = [v for v in self.nodes.values() if kind in v.kinds]
        if not options:
            return None

        def score(view: NodeView) -> bytes:
            return hashlib.sha256(f"{project}\0{name}\0{view.node_id}".encode()).digest()

        return max(options, key=score)

    async def _targeted(self, op: ops.Op, args: dict[str, Any], project: str | None, on_event: Callable) -> Any:
        """attach / log_steps / replay: by sandbox ID or trajectory name, on the node that holds it."""
        target = args.get("target")
        if not isinstance(target, str) or not target:
            raise InvalidRequestError(f"{op.name} needs a target: a sandbox ID or a trajectory name")
        try:
            node_id = node_of(target, self.nodes.keys())
        except InvalidRequestError:  # not shaped like an ID: a name
            node_id = ""
        if node_id in self.nodes and self.nodes[node_id].healthy:  # looks like a sandbox ID: ask its node
            try:
                return await self._on_node(op.name, node_id, target, args, project, on_event)
            except SandboxNotFoundError:  # a trajectory name that only looks like an ID
                pass
        found = await self.find(target, project)
        if not found:
            raise SandboxNotFoundError(
                f"no sandbox or trajectory {target!r} in this cluster"
                + (f" for project {project!r}" if project else "")
                + f" (asked nodes {', '.join(sorted(v.node_id for v in self.healthy())) or 'none'})"
            )
        row = found[0]
        args["target"] = row["sandbox_id"]  # the exact sandbox: a name may have run on several nodes
        return await self._on_node(op.name, row["node_id"], row["sandbox_id"], args, project, on_event)

    # ------------------------------------------------------------------ creates

    def _project_usage(self, project: str) -> Usage:
        """As of each node's last poll, plus what this gateway placed since and has in flight."""
        total = Usage(**vars(self.reserving[project]))
        for view in self.nodes.values():
            used = view.projects.get(project)
            if used:
                total.sandboxes += used["sandboxes"]
                total.cpu += used["cpu"]
                total.memory_mb += used["memory_mb"]
            for _, who, cpu, mem in view.placed:
                if who == project:
                    total.add(cpu, mem)
        return total

    async def create(self, project: str, args: dict[str, Any]) -> Any:
        spec = dict(args.get("spec") or {})
        kind, image = spec.get("kind", "container"), spec.get("image", "debian")
        for _ in range(100):  # a gateway that just started: give the first polls up to 5 s
            if self.healthy() or all(v.reason != NOT_CONTACTED for v in self.nodes.values()):
                break
            await asyncio.sleep(0.05)
        if not self.healthy():  # nothing to wait for: say so now rather than at the deadline
            raise CapacityError(f"no healthy node in the cluster ({self._down()}); start or fix nodes")
        if kind not in self._kinds():
            raise UnsupportedKindError(
                f"kind {kind!r}: no node in this cluster runs it (kinds: {sorted(self._kinds())})"
            )
        pinned = None
        name = spec.get("trajectory")
        if name and kind != "function":
            found = await self.find(name, project)
            if found:  # the name exists: its node attaches (live) or says how it ended, as a node alone would
                row = found[0]
                return await self._on_node("create", row["node_id"], row["sandbox_id"], args, project, lambda e: None)
            pinned = self.home(name, project, kind)
        cpu, mem = cost(spec)
        self.tokens.check(project, self._project_usage(project), cpu, mem)
        reserved = self.reserving[project]
        reserved.add(cpu, mem)  # held from here: concurrent creates of this project see it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission.timeout
        front = False
        tried: set[str] = set()
        started = time.monotonic()
        try:
            while True:
                if not self.healthy():  # nothing to wait for: say so now rather than at the deadline
                    raise CapacityError(f"no healthy node in the cluster ({self._down()}); start or fix nodes")
                await self.admission.acquire(project, deadline, front=front)
                front = True
                try:
                    if pinned is not None and pinned.node_id not in tried:  # tried even if it looked down
                        view: NodeView | None = pinned  # a new trajectory: its home node (see `home`)
                    else:
                        view = placement.choose(
                            list(self.nodes.values()), kind, image, tried, self.max_inflight, self.k, self.rng
                        )
                    if view is None:
                        tried.clear()
                        await asyncio.sleep(0.02)  # the view was stale; let the pollers and answers catch up
                        continue
                    info = await self._create_on(view, project, spec, tried)
                    if info is not None:
                        made_at = float(info.get("created_at", time.time()))
                        if made_at > view.usage_as_of:  # else the last poll counted it already (reserved)
                            view.placed.append((made_at, project, cpu, mem))
                        self.created.inc(view.node_id)
                        self.create_latency.observe(time.monotonic() - started)
                        return info
                finally:
                    self.admission.release()
        finally:
            reserved.add(cpu, mem, -1)

    def _down(self) -> str:
        down = [f"{v.node_id}: {v.reason}" for v in self.nodes.values() if not v.healthy]
        return "; ".join(down) or "no nodes joined"

    async def _create_on(self, view: NodeView, project: str, spec: dict[str, Any], tried: set[str]) -> Any:
        view.inflight += 1
        try:
            conn = await self._conn(view)

            def orphan(info: Any) -> None:  # our caller went away after the node made it: release it
                self.tasks.spawn(self._kill_quietly(conn, info["id"], project), f"release orphan {info['id']}")

            info = await conn.call("create", {"spec": spec, "_project": project}, on_orphan=orphan)
        except CapacityError:
            view.full = True
            tried.add(view.node_id)
            self.rejections.inc(view.node_id)
            return None
        except (NodeError, OSError, TimeoutError) as exc:
            self._mark(view, False, f"{type(exc).__name__}: {exc}")
            tried.add(view.node_id)
            return None
        finally:
            view.inflight -= 1
        view.delta += 1
        return info

    async def _kill_quietly(self, conn: Connection, sandbox_id: str, project: str) -> None:
        try:
            await conn.call("kill", {"sandbox_id": sandbox_id, "_project": project})
        except Exception:  # noqa: S110 - best effort
            pass

    # ------------------------------------------------------------------ observability

    def cluster_status(self) -> dict[str, Any]:
        nodes = {}
        for v in self.nodes.values():
            nodes[v.node_id] = {
                "address": f"{v.host}:{v.port}",
                "healthy": v.healthy,
                "reason": v.reason,
                "sandboxes": v.used,
                "max_sandboxes": v.max_sandboxes,
                "inflight": v.inflight,
                "load": round(v.load(), 4),
                "pool_hits": v.status.get("pool_hits", 0),
                "pool_misses": v.status.get("pool_misses", 0),
                "states": v.status.get("states", {}),
            }
        return {
            "gateway": self.name,
            "uptime_s": time.time() - self.started_at,
            "nodes": nodes,
            "gone": dict(self.gone),
            "queue_depth": self.admission.depth(),
            "queue_by_project": self.admission.depth_by_project(),
            "admitted": self.admission.admitted,
            "creating": self.admission.inflight,
            "created": sum(self.created.values.values()),
            "rejections": sum(self.rejections.values.values()),
            "connections": self.connections,
        }

    def _metrics(self) -> Registry:
        reg = Registry()
        self.latency = reg.add(
            Histogram("shoal_gateway_request_seconds", "Time to serve a request, by operation", ["op"])
        )
        self.create_latency = reg.add(
            Histogram("shoal_gateway_create_seconds", "Create latency seen by clients, queueing included")
        )
        self.errors = reg.add(
            Counter("shoal_gateway_errors_total", "Failed requests by operation and error", ["op", "type"])
        )
        self.created = reg.add(Counter("shoal_gateway_creates_total", "Sandboxes placed, by node", ["node"]))
        self.rejections = reg.add(
            Counter("shoal_gateway_rejections_total", "Creates a node refused for capacity (then retried)", ["node"])
        )
        reg.add(
            Gauge(
                "shoal_gateway_queue_depth",
                "Creates waiting for admission",
                collect=lambda: {(): self.admission.depth()},
            )
        )
        reg.add(
            CounterFn(
                "shoal_gateway_admission_timeouts_total",
                "Creates that waited past their deadline",
                collect=lambda: {(): self.admission.timeouts},
            )  # fmt: skip
        )
        reg.add(Gauge("shoal_gateway_nodes", "Nodes by health", ["healthy"], collect=self._node_health))
        reg.add(
            Gauge(
                "shoal_gateway_node_sandboxes",
                "Sandboxes per node as the gateway sees them",
                ["node"],
                collect=lambda: {(v.node_id,): v.used for v in self.nodes.values()},
            )  # fmt: skip
        )
        return reg

    def _node_health(self) -> dict[tuple[str, ...], float]:
        up = sum(1 for v in self.nodes.values() if v.healthy)
        return {("true",): up, ("false",): len(self.nodes) - up}

    def _observe(self, op: str, seconds: float, error: str | None) -> None:
        self.latency.observe(seconds, op)
        if error is not None:
            self.errors.inc(op, error)

    async def close(self) -> None:
        """Stop every background task (pollers, discovery, releases of orphans), then the node connections."""
        # Python 3.11's wait_for returns the result, swallowing the cancel, when both arrive together: a
        # poller cancelled just as its status came back would poll on forever and close() never return
        # (a gateway that ignored SIGTERM, seen in test_a_cancel_storm_then_shutdown_leaves_nothing).
        self._closing = True
        await self.tasks.close()
        self._pollers.clear()
        for conns in (self.conns, self.poll_conns):
            for conn in list(conns.values()):
                await conn.close()
            conns.clear()


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: int, op: str, args: dict) -> Any:
    """One request on a connection of its own (no multiplexing: port_connect takes the connection over)."""
    writer.write(protocol.encode(Request(id=rid, op=op, args=args)))
    body = await protocol.read_frame(reader)
    if body is None:
        raise NodeError(f"the node closed the connection during {op}")
    response = protocol.decode_response(body)
    if response.error is not None:
        raise from_wire(response.error.type, response.error.message)
    return response.result


async def serve(
    gateway: Gateway,
    where: str,
    http: str | None,
    addr_file: str | None,
    stop: asyncio.Event,
    e2b: str | None = None,
) -> None:
    from shoal.config import parse_hostport

    host, port = parse_hostport(where)
    server = await serve_tcp(gateway.handle, host, port, name=f"gateway {gateway.name}", ssl=tls.server_context())
    bound = server.sockets[0].getsockname()
    closers = []
    if http:
        from shoal.cluster.http import serve_gateway_http

        closers.append(await serve_gateway_http(gateway, http, addr_file and addr_file + ".http"))
    if e2b:  # E2B's API in this process, a client of this gateway (docs/E2B.md)
        from shoal.e2b.server import default_target, own_address, start

        target = default_target(own_address(bound[0], bound[1]))
        closers.append(await start(target, e2b, addr_file and addr_file + ".e2b"))
    if addr_file:
        write_address(addr_file, bound[0], bound[1])
    log.info("gateway %s on %s:%d", gateway.name, bound[0], bound[1])
    try:
        await stop.wait()
    finally:
        server.close()
        await asyncio.gather(*(closer() for closer in closers))  # each waits its in-flight requests' grace
        await gateway.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.cluster.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default=settings.GATEWAY.get())
    parser.add_argument("--http", default=settings.GATEWAY_HTTP.get(), help="host:port for /metrics")
    parser.add_argument("--e2b", default=settings.GATEWAY_E2B.get(), help="host:port for E2B's API (docs/E2B.md)")
    parser.add_argument("--tokens", default=settings.TOKENS.raw(), required=not settings.TOKENS.is_set())
    parser.add_argument("--node", action="append", default=[], help="node_id=host:port (repeatable)")
    parser.add_argument("--discover", help="name:port: the nodes are every address this DNS name resolves to")
    parser.add_argument("--name", default=settings.GATEWAY_NAME.get())
    parser.add_argument("--addr-file", help="write the bound host:port here once serving")
    parser.add_argument("--admission-timeout", type=float, default=settings.ADMISSION_TIMEOUT.get())
    parser.add_argument("--max-waiting", type=int, default=settings.MAX_WAITING.get())
    parser.add_argument("--k", type=int, default=2, help="power-of-k-choices sample size")
    parser.add_argument("--discover-interval", type=float, default=5.0)
    parser.add_argument("--tls-ca", default=settings.TLS_CA.raw(), help="CA file: speak TLS to the nodes")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between polls of each node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=settings.LOG_LEVEL.get(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    nodes = dict(item.split("=", 1) for item in args.node)

    async def run() -> None:
        gateway = Gateway(
            Tokens.load(args.tokens), name=args.name, k=args.k, admission_timeout=args.admission_timeout,
            poll_interval=args.poll_interval,
            max_waiting=args.max_waiting,
        )  # fmt: skip
        if args.tls_ca:
            gateway.tls_ca, gateway.node_tls = args.tls_ca, tls.client_context(args.tls_ca)
        gateway.set_nodes(nodes)
        if args.discover:
            name, _, port = args.discover.rpartition(":")
            gateway.tasks.spawn(gateway.discover(name, int(port), args.discover_interval), "discovery")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        parent = settings.PARENT_PID.get()
        if parent:

            async def watch() -> None:
                while os.getppid() == int(parent):
                    await asyncio.sleep(0.5)
                stop.set()

            gateway.tasks.spawn(watch(), "watch the supervisor")
        await serve(gateway, args.listen, args.http, args.addr_file, stop, args.e2b)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
