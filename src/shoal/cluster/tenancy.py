"""Projects on one node: what each owns, and the one place a project's request is resolved against it.

A request that comes with a project (a TCP connection authenticated by a project token, or a gateway naming
`_project`) is served by `Tenancy.call`, which is the only place ownership is decided:

- sandboxes of every kind (containers, VMs, function sandboxes) belong to the project in their label
  `shoal.project`; one of another project (or of none: made over the node's Unix socket) is "not found";
- VM snapshots belong to the project whose sandbox they were taken from; restoring or deleting another
  project's snapshot is "not found";
- trajectory names and image names live in a per-project namespace: the node keeps them as
  `@<project>/<name>` (in its log and its image store) and shows them to the project without the prefix.
  Two projects naming a trajectory "x" get two sandboxes. A project reads its own images first, then the
  node's shared ones (builtins, images an operator imported or built); it writes only into its namespace,
  so its `sb.snapshot("busybox")` makes its own "busybox" (shadowing the shared one for it alone) and never
  replaces what other projects create from;
- `status` shows only the project's own figures (no paths, no other projects).

Callers on the Unix socket are local and trusted and are served without any of this.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from shoal import ops
from shoal.cluster.auth import PROJECT_LABEL, Tokens, Usage, cost
from shoal.errors import (
    AuthenticationError,
    ImageNotFoundError,
    InvalidRequestError,
    NotFoundError,
    SandboxNotFoundError,
    ShoalError,
)
from shoal.protocol import SandboxInfo, combine_status
from shoal.substrates.qemu.substrate import check_snapshot_id

if TYPE_CHECKING:
    from shoal.node.service import NodeService

Invoke = Callable[[dict[str, Any]], Awaitable[Any]]

SCOPE = "@"  # names starting with it are namespaced: `@<project>/<name>`; projects cannot name them directly
REMEMBERED_IDS = 100_000  # sandbox IDs of closed sandboxes whose project is remembered (like `closed`)


def scoped(project: str, name: str) -> str:
    """The node's name for `name` in `project`'s namespace."""
    return f"{SCOPE}{project}/{name}"


class Tenancy:
    """Per-node ownership and accounting of projects (quotas, and the gateway's cluster-wide view)."""

    def __init__(self, service: NodeService, tokens: Tokens) -> None:
        self.service = service
        self.tokens = tokens
        self.reserved: dict[str, Usage] = collections.defaultdict(Usage)  # creates in flight
        self.made: collections.OrderedDict[str, str] = collections.OrderedDict()  # sandbox id -> project
        self.snapshots: dict[str, str] = {}  # VM snapshot id -> project (snapshots die with the node process)

    # ---------------------------------------------------------------- accounting

    def _live(self) -> list[tuple[str, Any]]:
        """(project, spec) of every live sandbox, function sandboxes included."""
        specs = [s.spec for s in self.service.sandboxes.values()]
        specs += [s.spec for s in self.service.functions.sandboxes.values()]
        return [(spec.labels.get(PROJECT_LABEL, ""), spec) for spec in specs]

    def usage(self, project: str) -> Usage:
        total = Usage(**vars(self.reserved[project]))
        for owner, spec in self._live():
            if owner == project:
                total.add(*cost({"cpu": spec.cpu, "memory_mb": spec.memory_mb}))
        return total

    def all_usage(self) -> dict[str, dict[str, Any]]:
        projects = {owner for owner, _ in self._live() if owner} | {p for p, u in self.reserved.items() if u.sandboxes}
        return {p: self.usage(p).as_dict() for p in sorted(projects)}

    def owner(self, sandbox_id: str) -> str | None:
        """The project of a sandbox (live or ended); '' if it has none; None if this node never held it."""
        sandbox = self.service.sandboxes.get(sandbox_id) or self.service.functions.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return sandbox.spec.labels.get(PROJECT_LABEL, "")
        if sandbox_id in self.made:
            return self.made[sandbox_id]
        row = self.service.trajectory.sandbox(sandbox_id)
        if row is not None:
            return (row["spec"].get("labels") or {}).get(PROJECT_LABEL, "")
        return None

    def _remember(self, sandbox_id: str, project: str) -> None:
        self.made[sandbox_id] = project
        while len(self.made) > REMEMBERED_IDS:
            self.made.popitem(last=False)

    # ---------------------------------------------------------------- the one place requests are resolved

    async def call(self, project: str, op: str, args: dict[str, Any], invoke: Invoke, enforce: bool) -> Any:
        """Serve `op` for `project`: refuse what is not its own, put its names in its namespace, take the
        namespace off the answer (and off the message of an error). `enforce`: hold it to its quotas here
        (a gateway enforces them itself)."""
        try:
            return await self._call(project, op, args, invoke, enforce)
        except ShoalError as exc:
            prefix = scoped(project, "")
            if prefix not in str(exc):
                raise
            raise type(exc)(str(exc).replace(prefix, "")) from None

    async def _call(self, project: str, op: str, args: dict[str, Any], invoke: Invoke, enforce: bool) -> Any:
        spec = ops.get(op)
        if spec.access != ops.PROJECT:
            raise AuthenticationError(f"operation {op!r} needs a cluster (admin) token, not project {project!r}'s")
        sandbox_id = spec.sandbox_of(args)
        if spec.by_target and sandbox_id is not None:
            args["target"] = sandbox_id = self._target(project, sandbox_id)
        elif sandbox_id is not None and self.owner(sandbox_id) not in (None, project):
            node = self.service.settings.node_id
            raise SandboxNotFoundError(f"no sandbox {sandbox_id} on node {node} in project {project!r}")
        if spec.scoped:
            args["labels"] = {**(args.get("labels") or {}), PROJECT_LABEL: project}
        elif op == "status":
            return self._status(project)
        elif op == "create":
            return await self._create(project, args, invoke, enforce)
        elif op in ("fn_call", "fn_map", "fn_run_code") and args.get("spec") is not None:
            args["spec"] = self._spec(project, dict(args["spec"]))
        elif op == "vm_snapshot_delete":
            self._own_snapshot(project, args.get("snapshot_id"))
        elif op == "sandbox_snapshot":
            args["name"] = self._image_to_write(project, args.get("name"))
        elif op == "image_inspect":
            args["name"] = self._image_to_read(project, args.get("name"))
        elif op == "fork" and enforce:
            self._check_quota(project, self.service.sandboxes.get(str(sandbox_id)), int(args.get("count") or 1))
        result = await invoke(args)
        if op == "vm_snapshot":
            self.snapshots[result] = project
        elif op == "vm_snapshot_delete":
            self.snapshots.pop(args["snapshot_id"], None)
        elif op == "image_list":
            return self._visible_images(project, result)
        elif op == "trajectory_find":
            return [dict(row, trajectory=self._unscope(project, row["trajectory"])) for row in result]
        elif op == "log_steps" and result.get("sandbox"):
            return dict(
                result,
                sandbox=dict(result["sandbox"], trajectory=self._unscope(project, result["sandbox"]["trajectory"])),
            )
        elif op == "image_ls":
            mine = [r for r in result if not r["name"].startswith(SCOPE) or r["name"].startswith(scoped(project, ""))]
            return [dict(r, name=self._unscope(project, r["name"])) for r in mine]
        return self._shown(project, result)

    def _target(self, project: str, target: str) -> str:
        """attach / log_steps / replay / trajectory_find name a sandbox ID or a trajectory name: an ID of the
        project's is kept, another project's is "not found", anything else is a name in its namespace."""
        owner = self.owner(target)
        if owner == project:
            return target
        if owner is not None:
            node = self.service.settings.node_id
            raise SandboxNotFoundError(f"no sandbox or trajectory {target!r} on node {node} in project {project!r}")
        return scoped(project, target)

    async def _create(self, project: str, args: dict[str, Any], invoke: Invoke, enforce: bool) -> Any:
        spec = self._spec(project, dict(args.get("spec") or {}))
        if spec.get("snapshot") is not None:
            self._own_snapshot(project, spec["snapshot"])
        args["spec"] = spec
        cpu, mem = cost(spec)
        if enforce:
            self.tokens.check(project, self.usage(project), cpu, mem)
        reserved = self.reserved[project]
        reserved.add(cpu, mem)
        try:
            info = await invoke(args)
        finally:
            reserved.add(cpu, mem, -1)
        self._remember(info.id, project)
        return self._shown(project, info)

    def _spec(self, project: str, spec: dict[str, Any]) -> dict[str, Any]:
        """A create/call spec with the project's label and its names in its namespace."""
        spec["labels"] = {**(spec.get("labels") or {}), PROJECT_LABEL: project}
        if spec.get("trajectory") is not None:
            spec["trajectory"] = scoped(project, str(spec["trajectory"]))
        if spec.get("snapshot") is None:  # a restore runs the snapshot's image
            spec["image"] = self._image_to_read(project, spec.get("image", "debian"))
        spec["layers"] = [self._image_to_read(project, name) for name in spec.get("layers") or []]
        return spec

    def _check_quota(self, project: str, sandbox: Any, count: int) -> None:
        if sandbox is None or not 1 <= count <= 256:
            return  # the node's own error follows
        usage = self.usage(project)
        cpu, mem = cost({"cpu": sandbox.spec.cpu, "memory_mb": sandbox.spec.memory_mb})
        for _ in range(count):
            self.tokens.check(project, usage, cpu, mem)
            usage.add(cpu, mem)

    def _own_snapshot(self, project: str, snapshot_id: Any) -> None:
        if self.snapshots.get(check_snapshot_id(snapshot_id)) != project:
            raise NotFoundError(
                f"no snapshot {snapshot_id!r} of project {project!r} on node {self.service.settings.node_id} "
                "(snapshot ids are what sb.snapshot() returned for one of your VMs; snapshots live on their node)"
            )

    # ---------------------------------------------------------------- images

    def _shared_images(self) -> list[str]:
        """Images every project may read (and none may write): builtins and those made without a project."""
        return [n for n in self.service.images.names() if not n.startswith(SCOPE)]

    def _image_to_read(self, project: str, name: Any) -> str:
        """The project's own image `name` if it has one, else the shared one; never another project's."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"image name {name!r}: give the name of an image")
        mine = scoped(project, name)
        if self.service.images.has(mine):
            return mine
        if name.startswith(SCOPE):
            raise InvalidRequestError(
                f"image name {name!r}: names starting with {SCOPE!r} are reserved for the node's per-project "
                "namespaces; use the plain name"
            )
        if self.service.images.has(name):  # present and shared: one stat, not a listing of the store per call
            return name
        if name not in self._shared_images():
            raise ImageNotFoundError(
                f"image {name!r} is not on node {self.service.settings.node_id}; images project {project!r} can "
                f"use here: {', '.join(self._visible_images(project, self.service.images.names()))}"
            )
        return name

    def _image_to_write(self, project: str, name: Any) -> Any:
        """Where a project's image commit goes: always its own namespace. A name it shares with a shared image
        (`sb.snapshot("busybox")`) makes the project's own image, which shadows the shared one for it alone."""
        return scoped(project, name) if isinstance(name, str) and name else name

    def _visible_images(self, project: str, names: list[str]) -> list[str]:
        own = [self._unscope(project, n) for n in names if n.startswith(scoped(project, ""))]
        return sorted({*(n for n in names if not n.startswith(SCOPE)), *own})

    # ---------------------------------------------------------------- answers

    @staticmethod
    def _unscope(project: str, name: Any) -> Any:
        prefix = scoped(project, "")
        return name[len(prefix) :] if isinstance(name, str) and name.startswith(prefix) else name

    def _shown(self, project: str, result: Any) -> Any:
        """An answer as the project sees it: its names without the namespace."""
        if isinstance(result, SandboxInfo):
            return msgspec.structs.replace(
                result,
                image=self._unscope(project, result.image),
                trajectory=self._unscope(project, result.trajectory),
            )
        if isinstance(result, list):
            return [self._shown(project, item) for item in result]
        if isinstance(result, dict) and isinstance(result.get("name"), str):  # sandbox_snapshot's report
            return dict(result, name=self._unscope(project, result["name"]))
        return result

    def _status(self, project: str) -> dict[str, Any]:
        mine = [spec for owner, spec in self._live() if owner == project]
        states = collections.Counter(
            s.state.value for s in self.service.sandboxes.values() if s.spec.labels.get(PROJECT_LABEL) == project
        )
        settings = self.service.settings
        own = {
            "node_id": settings.node_id,
            "kinds": self.service.kinds(),
            "max_sandboxes": settings.max_sandboxes,
            "sandboxes": len(mine),
            "states": dict(states),
            "projects": {project: self.usage(project).as_dict()},
        }
        return {**combine_status({settings.node_id: own}, {}), **own}  # the node's shape (NodeService.status)
