"""The node's operations, transport-free: what the server exposes, one method per operation."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import os
import posixpath
import secrets
import shutil
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from shoal import cgroups, resources
from shoal.config import NodeSettings, Paths, settings_env
from shoal.errors import (
    CapacityError,
    InvalidRequestError,
    NoAgentError,
    NodeError,
    ProcessNotFoundError,
    SandboxClosedError,
    SandboxLostError,
    SandboxNotFoundError,
    ShellLostError,
    ShoalError,
    UnsupportedKindError,
)
from shoal.guest import AgentClient, AgentError
from shoal.guest.client import control_frames
from shoal.images import Image, ImageStore
from shoal.images.builtin import register_builtins
from shoal.node import gui, network, procs, recovery
from shoal.node.functions import FunctionService
from shoal.node.images import NodeImages
from shoal.node.lifecycle import ON_TIMEOUT, Lifecycle
from shoal.node.logs import TrajectoryQueries
from shoal.node.pools import WarmPools
from shoal.node.ports import NodePorts
from shoal.node.sandbox import Sandbox, State
from shoal.node.shell import ShellSession
from shoal.node.table import NODE_RESTARTED, SandboxTable
from shoal.node.trajectory import Recorder, TrajectoryLog
from shoal.protocol import (
    KINDS,
    ErrorInfo,
    ExecRequest,
    ExecResult,
    FileEntry,
    OutputChunk,
    SandboxInfo,
    SandboxSpec,
    combine_status,
    merge_image_lists,
)
from shoal.settings import QEMU
from shoal.steps import BULK_BYTES
from shoal.substrates import Substrate
from shoal.substrates.container import ContainerSubstrate
from shoal.substrates.container.choice import Choice
from shoal.substrates.container.choice import choose as choose_runtime
from shoal.view import VNC_PORT

log = logging.getLogger("shoal.node")
# this node process's mark in the shell IDs it makes: a shell ID with another mark was opened by an earlier
# node process on this home, so it was lost in a restart (ShellLostError), not closed
SHELL_EPOCH = secrets.token_hex(3)

Emit = Callable[[Any], Awaitable[None]]
MIN_MEMORY_MB = 8
MIN_DISK_MB = 4
KILL_GRACE_S = 2.0


class NodeService:
    def __init__(self, paths: Paths, settings: NodeSettings, runtime: Choice | None = None) -> None:
        self.paths = paths
        self.settings = settings
        self._started_env = dict(os.environ)  # what configured this node (clients compare theirs: settings_env)
        self.images = register_builtins(ImageStore(paths.images))
        self.node_images = NodeImages(self.images, paths.home / "layers", settings.layer_linger_s)
        container = ContainerSubstrate(
            paths.sandboxes,
            paths.runtime_root,
            settings.cgroup_parent,
            default_cpu=settings.default_cpu,
            state_root=paths.runtime_state,
        )
        self.substrates: dict[str, Substrate] = {"container": container}
        # the runtime of containers (and function workers) whose create names none: decided once, here, so
        # that every create of this node process gets the same one (SHOAL_RUNTIME; status() says which, why)
        self.runtime_choice = runtime or choose_runtime(settings.runtime, container.userns_base)
        log.info("containers that name no runtime run on %s", self.runtime_choice.describe())
        if shutil.which(QEMU.get()) and shutil.which("qemu-img"):
            from shoal.substrates.microvm import MicrovmSubstrate
            from shoal.substrates.vm import VmSubstrate

            for cls in (MicrovmSubstrate, VmSubstrate):
                self.substrates[cls.kind] = cls(paths.home, paths.sandboxes)
        self.trajectory = TrajectoryLog(paths.home / "trajectory.db")
        self.functions = FunctionService(self)
        self.table = SandboxTable(settings.node_id, self.trajectory, self.functions.owns)
        self.sandboxes = self.table.live
        self.closed = self.table.closed
        self.shells: dict[str, ShellSession] = {}
        self.pools = WarmPools(self.make_sandbox, self.destroy_sandbox)
        self.network = network.NetworkManager(paths.home)
        self.started_at = time.time()
        self._creating = 0  # sandboxes being made (capacity counts them)
        self._binding = 0  # creates between their making and their registration (shutdown waits for them)
        self._stopping = False
        self._destroying: set[asyncio.Future] = set()
        self._reaper: asyncio.Task | None = None
        self.logs = TrajectoryQueries(self.trajectory, self.sandboxes, settings.node_id, self.functions.owns)
        self.recorder = Recorder(self.trajectory)
        self.lifecycle = Lifecycle(self)
        self.adopted: list[str] = []
        self.lost: dict[str, str] = {}  # sandboxes found at start that could not be adopted, and why
        self._naming: dict[str, asyncio.Future[SandboxInfo]] = {}  # trajectory names being created
        self.ports = NodePorts(paths.home)  # sb.expose: keys, the URL base, the loopback relay

    # ---------------------------------------------------------------- lifecycle of the node

    async def start(self) -> None:
        _shield_node_from_oom_killer()
        self.paths.sandboxes.mkdir(parents=True, exist_ok=True)
        weight = self.settings.sandboxes_cpu_weight or os.cpu_count() or 1
        cgroups.set_parent_cpu_weight(f"/{self.settings.cgroup_parent}", weight)
        await asyncio.to_thread(self.node_images.reconcile)  # before adoption re-acquires layers
        await self.reconcile()  # re-adopts what still runs; the rest is remembered as lost
        await self.network.cleanup_all()  # the earlier node's links and rules; adopted networked ones get new
        await self._reattach_networks()
        self._reaper = asyncio.create_task(self.lifecycle.reap_forever())
        await self.functions.start()
        for shape, size in self.settings.pool_sizes.items():  # SHOAL_POOLS="busybox=4,container:debian=2"
            kind, _, image = shape.partition(":")  # image names may hold colons (HOST:PORT/REPO:TAG)
            if kind not in KINDS:
                kind, image = "container", shape
            await self.pool_set(SandboxSpec(kind=kind, image=image), size)

    async def stop(self) -> None:
        """Close every sandbox this node owns (a clean shutdown leaves nothing behind)."""
        self._stopping = True  # connections outlive the listener: refuse creates that arrive from now on
        if self._reaper:
            self._reaper.cancel()
        await self.ports.close()
        await self.functions.stop()
        await self.pools.drain()
        await self._settle()
        await asyncio.gather(*(self.kill(i, reason="node shut down") for i in list(self.sandboxes)))
        await self._settle()
        self.trajectory.close()
        await self.node_images.close()
        await self.network.cleanup_all()
        for substrate in self._snapshotting_substrates():
            substrate.delete_all_snapshots()
        await self._close_launcher()
        for parent in cgroups.sandbox_dirs(f"/{self.settings.cgroup_parent}"):
            with contextlib.suppress(OSError):  # still holds a sandbox's cgroup: keep it
                parent.rmdir()
        root = self.paths.runtime_state  # on tmpfs, outside the home: gone with the node when empty
        for directory in [*(root / name for name in ("crun", "runc", "runsc", "bundles")), root]:
            with contextlib.suppress(OSError):  # holds a container's state (a runtime that failed to delete)
                directory.rmdir()

    async def stop_keeping(self) -> list[str]:
        """Stop but leave running the sandboxes a restarted node re-adopts (containers without a network
        policy), as a crash would; the rest (warm pools, functions, VMs, networked ones) are closed.
        Until a node starts again on this home nothing reaps the kept ones (TTL, idle)."""
        self._stopping = True
        if self._reaper:
            self._reaper.cancel()
        await self.functions.stop()
        await self.pools.drain()
        await self._settle()
        kept = [
            i
            for i, s in self.sandboxes.items()
            if s.spec.kind == "container"
            and not network.normalise(s.spec.network)
            and s.state.value in ("ready", "paused")
        ]
        others = [i for i in self.sandboxes if i not in kept]
        await asyncio.gather(*(self.kill(i, reason="node stopped (only re-adoptable sandboxes kept)") for i in others))
        await self._settle()
        self.trajectory.close()
        await self.network.cleanup_all()
        for substrate in self._snapshotting_substrates():
            substrate.delete_all_snapshots()
        await self._close_launcher()
        return kept

    async def _close_launcher(self) -> None:
        container = self.substrates["container"]
        assert isinstance(container, ContainerSubstrate)
        await container.close()

    async def _reattach_networks(self) -> None:
        """Plumb re-adopted networked sandboxes again on their recorded slots (recovery.py); one that cannot be
        is closed and reported lost, so no sandbox runs with a policy other than its own."""
        for sandbox_id in list(self.adopted):
            sandbox = self.sandboxes.get(sandbox_id)
            if sandbox is None or not network.normalise(sandbox.spec.network) or sandbox.instance.pid is None:
                continue
            try:
                policy = await self._resolve_policy(sandbox.spec.network)
                await self.network.apply(
                    sandbox.id, sandbox.instance.pid, sandbox.instance.directory, policy, reattach=True,
                    bridged=self.substrates[sandbox.spec.kind].capabilities.guest_nic,
                )  # fmt: skip
                sandbox.resolv_written = True  # same slot: the resolver address in its resolv.conf holds
            except Exception as exc:
                reason = f"lost: {NODE_RESTARTED}, and its network could not be re-attached: {exc}"
                log.warning("sandbox %s %s", sandbox_id, reason)
                self.adopted.remove(sandbox_id)
                self.lost[sandbox_id] = reason
                await self.kill(sandbox_id, reason=reason)

    async def _settle(self, timeout: float = 60.0) -> None:
        """Wait for creates and destroys in flight (a destroy outlives its cancelled request), so the
        process does not exit halfway through one and leave its mounts, cgroups or files behind."""
        deadline = time.monotonic() + timeout
        while (self._creating or self._binding or self._destroying) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def reconcile(self) -> list[str]:
        """Re-adopt the sandboxes an earlier node process left running (see recovery.py); remove the rest
        (mounts, cgroups, runtime state, files) and remember those as lost."""
        removed = []
        container = self.substrates["container"]
        for directory in sorted(self.paths.sandboxes.iterdir()) if self.paths.sandboxes.exists() else []:
            if directory.is_dir() and directory.name not in self.sandboxes:
                try:
                    substrate = self._substrate_of(directory)
                    if not substrate.capabilities.readopt:
                        raise recovery.NotAdoptable(f"{substrate.kind} sandboxes are not re-adopted yet")
                    sandbox = await recovery.adopt(directory, self.node_images, substrate)
                except recovery.NotAdoptable as exc:
                    reason = f"lost: {NODE_RESTARTED}, and could not re-adopt it: {exc}"
                else:
                    sandbox.next_seq = self.trajectory.next_seq(sandbox.id)
                    self.sandboxes[sandbox.id] = sandbox
                    self.lifecycle.arm(sandbox)  # its recorded ttl (an idle timer restarts with this node)
                    self.adopted.append(sandbox.id)
                    continue
                await self._substrate_of(directory).destroy_orphan(directory)
                removed.append(directory.name)
                self.lost[directory.name] = reason
                self.remember_closed(directory.name, reason)
                await self.trajectory.close_sandbox(directory.name, "lost", reason)
        assert isinstance(container, ContainerSubstrate)
        for name in ("crun", "runc", "runsc"):
            state_root = self.paths.runtime_state / name
            if state_root.is_dir() and shutil.which(name):
                for cid in (p.name for p in state_root.iterdir()):
                    if cid not in self.sandboxes:
                        await container.runtime(name).delete(cid)
        for directory in cgroups.sandbox_dirs(f"/{self.settings.cgroup_parent}"):
            for child in directory.iterdir():
                if child.is_dir() and child.name not in self.sandboxes:
                    await asyncio.to_thread(cgroups.remove, f"/{self.settings.cgroup_parent}/{child.name}")
        if self.adopted:
            log.info("re-adopted %d sandboxes of an earlier node: %s", len(self.adopted), self.adopted)
        for substrate in self._snapshotting_substrates():
            await asyncio.to_thread(substrate.reconcile)
        if removed:
            log.info("removed %d sandboxes of an earlier node that could not be adopted: %s", len(removed), removed)
        return removed

    def _substrate_of(self, directory: Path) -> Substrate:
        """The substrate that made a sandbox directory, from its record (containers if unreadable)."""
        try:
            kind = json.loads((directory / "record.json").read_text()).get("kind", "container")
        except (OSError, ValueError):
            kind = "container"
        return self.substrates.get(kind) or self.substrates["container"]

    def _snapshotting_substrates(self) -> list[Substrate]:
        return [s for s in self.substrates.values() if s.capabilities.memory_snapshots]

    # ---------------------------------------------------------------- sandboxes

    async def hello(self) -> dict[str, Any]:
        return {"node_id": self.settings.node_id, "pid": os.getpid(), "kinds": self.kinds()}

    async def settings_env(self) -> dict[str, str]:
        """Digests of the SHOAL_* settings this node started with (local socket only; see config.settings_env)."""
        return settings_env(self._started_env)

    def kinds(self) -> list[str]:
        return sorted([*self.substrates, "function"])

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        spec = self._with_runtime(self._with_default_lifetime(spec))
        self._validate(spec)
        spec = self._with_default_caps(spec)
        if spec.kind == "function":
            if spec.trajectory is not None:
                raise InvalidRequestError(
                    f"trajectory={spec.trajectory!r}: function sandboxes keep no step log (each call runs in a fresh "
                    "child and leaves nothing behind, so there is nothing to fast-forward or replay); use "
                    "kind='container' (or microvm/vm) for a trajectory"
                )
            return await self.functions.create(spec)
        if spec.trajectory:
            # Asked before the log: while a create is in flight its log row already says live but the sandbox
            # is not in the table yet, which _find_trajectory would call an ended trajectory.
            if spec.trajectory in self._naming:  # the same trajectory is being created: share it
                return await asyncio.shield(self._naming[spec.trajectory])
            existing = self._find_trajectory(spec.trajectory)
            if existing is not None:  # a restarted trainer re-creating its sandbox: attach to it
                return existing.info()
            self._naming[spec.trajectory] = made = asyncio.get_running_loop().create_future()
            try:
                info = await self._create(spec)
            except BaseException as exc:
                made.set_exception(exc)
                made.exception()  # retrieved: no "never retrieved" warning when nobody shared it
                raise
            finally:
                self._naming.pop(spec.trajectory, None)
            made.set_result(info)
            return info
        return await self._create(spec)

    async def _create(self, spec: SandboxSpec) -> SandboxInfo:
        if self._stopping:
            raise NodeError(f"node {self.settings.node_id} is shutting down; create the sandbox on another node")
        self._binding += 1
        try:
            return await self._create_bound(spec)
        finally:
            self._binding -= 1

    async def _create_bound(self, spec: SandboxSpec) -> SandboxInfo:
        now = time.time()
        sandbox = self.pools.take(spec) if spec.pool and not spec.snapshot else None
        if sandbox is None:
            if len(self.sandboxes) + self._creating >= self.settings.max_sandboxes:
                raise CapacityError(
                    f"node {self.settings.node_id} holds {len(self.sandboxes)} sandboxes, its limit "
                    f"(SHOAL_MAX_SANDBOXES={self.settings.max_sandboxes}); close some or add nodes"
                )
            sandbox = await self._make_checked(spec)
        try:
            await self._bind(sandbox, spec, now)
            self.persist(sandbox)
            await self.trajectory.open_sandbox(sandbox.id, spec.trajectory, sandbox.image.name, _stored_spec(spec))
        except BaseException:
            await asyncio.shield(self.destroy_sandbox(sandbox))
            await asyncio.shield(
                self.trajectory.close_sandbox(sandbox.id, "closed", "its create failed or was cancelled")
            )
            raise
        self.sandboxes[sandbox.id] = sandbox  # no await since the log row: a cancel cannot orphan it
        self.lifecycle.arm(sandbox)
        return sandbox.info()

    def persist(self, sandbox: Sandbox) -> None:
        """Write what a restarted node needs to re-adopt this sandbox (recovery.py)."""
        recovery.write_record(sandbox)

    def _find_trajectory(self, name: str) -> Sandbox | None:
        """The live sandbox running trajectory `name`; a precise error if it ended; None if never seen."""
        for sandbox in self.sandboxes.values():
            if sandbox.spec.trajectory == name:
                return sandbox
        row = self.trajectory.by_trajectory(name)
        if row is None:
            return None
        error = SandboxLostError if row["status"] == "lost" else SandboxClosedError
        raise error(
            f"trajectory {name!r} ran in sandbox {row['id']}, which is {row['status']} ({row['reason']}); "
            f"replay its log in a fresh sandbox with client.replay({row['id']!r}), or use a new trajectory name"
        )

    async def attach(self, target: str) -> SandboxInfo:
        """A sandbox by ID or by trajectory name (the client then re-issues steps from seq 0)."""
        if target in self.sandboxes:
            return self._get(target).info()
        if target in self._naming:  # its create is in flight: the sandbox it makes
            return await asyncio.shield(self._naming[target])
        sandbox = self._find_trajectory(target)
        if sandbox is None:
            self._get(target)  # raises the precise error
        assert sandbox is not None
        return sandbox.info()

    def _with_default_caps(self, spec: SandboxSpec) -> SandboxSpec:
        """A container that names no memory_mb / disk_mb gets the node's defaults (SHOAL_DEFAULT_MEMORY_MB,
        SHOAL_DEFAULT_DISK_MB; 0 turns a default off), so one tenant cannot exhaust the host's memory or the
        disk that holds the trajectory log. pids defaults to 1024 in the spec itself."""
        if spec.kind != "container":
            return spec
        changes: dict[str, int] = {}
        memory_mb = resources.memory_mb(spec.kind, spec.memory_mb, self.settings.default_memory_mb)
        if memory_mb != spec.memory_mb:
            changes["memory_mb"] = memory_mb
        if spec.disk_mb is None and self.settings.default_disk_mb > 0:
            changes["disk_mb"] = self.settings.default_disk_mb
        return msgspec.structs.replace(spec, **changes) if changes else spec

    def _with_runtime(self, spec: SandboxSpec) -> SandboxSpec:
        """A container or function sandbox that names no runtime gets the node's (SHOAL_RUNTIME, chosen at
        start). Resolved before anything keys on it: warm pools, function worker pools and the record all hold
        the concrete runtime, so a sandbox is closed and re-adopted by the runtime that made it."""
        if spec.runtime is None and spec.kind in ("container", "function"):
            return msgspec.structs.replace(spec, runtime=self.runtime_choice.runtime)
        return spec

    def _with_default_lifetime(self, spec: SandboxSpec) -> SandboxSpec:
        """A create that leaves ttl_s / idle_timeout_s unset gets the node's defaults (explicit None: no limit)."""
        changes: dict[str, Any] = {}
        if spec.ttl_s is msgspec.UNSET:
            changes["ttl_s"] = self.settings.default_ttl_s
        if spec.idle_timeout_s is msgspec.UNSET:
            changes["idle_timeout_s"] = self.settings.default_idle_timeout_s
        return msgspec.structs.replace(spec, **changes) if changes else spec

    def _validate(self, spec: SandboxSpec) -> None:
        """Refuse impossible specs (lifetimes may still be UNSET: pools and calls take them from each create)."""
        if spec.kind not in self.substrates and spec.kind != "function":
            known = "unknown kind" if spec.kind not in KINDS else "not available on this node yet"
            raise UnsupportedKindError(f"kind {spec.kind!r}: {known}; kinds available here: {', '.join(self.kinds())}")
        resources.check(spec)
        if (
            spec.disk_mb is not None
            and spec.kind in self.substrates
            and not self.substrates[spec.kind].capabilities.disk_cap
        ):
            raise UnsupportedKindError(  # refused, not ignored: a cap that does not hold is worse than none
                f"disk_mb={spec.disk_mb}: {spec.kind} sandboxes have no disk cap yet; leave disk_mb unset or use "
                f"kind={' or '.join(repr(k) for k in self._kinds_with('disk_cap'))}"
            )
        if isinstance(spec.ttl_s, (int, float)) and spec.ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s={spec.ttl_s} must be positive (or None for no limit)")
        network.normalise(spec.network)
        if isinstance(spec.idle_timeout_s, (int, float)) and spec.idle_timeout_s <= 0:
            raise InvalidRequestError(f"idle_timeout_s={spec.idle_timeout_s} must be positive (or None)")
        if spec.on_timeout not in ON_TIMEOUT:
            raise InvalidRequestError(f"on_timeout={spec.on_timeout!r}: choose one of {', '.join(ON_TIMEOUT)}")
        if gui.screen_of(spec.image, spec.screen) is not None and spec.kind not in gui.SCREEN_KINDS:
            raise InvalidRequestError(
                f"screen: GUI sandboxes are containers (image='desktop') or vms (screen=(w, h)), not {spec.kind}"
            )
        if spec.snapshot is not None:
            substrate = self.substrates[spec.kind]
            if not substrate.capabilities.memory_snapshots:
                raise InvalidRequestError(
                    f"snapshot= restores memory snapshots; {spec.kind} sandboxes have none "
                    f"(kinds with them: {', '.join(self._kinds_with('memory_snapshots'))})"
                )
            meta = substrate.snapshot_meta(spec.snapshot)
            if meta["kind"] != spec.kind:
                raise InvalidRequestError(f"snapshot {spec.snapshot} is of a {meta['kind']}, not a {spec.kind}")
        for path in [spec.workdir or "/", *spec.files]:
            if not path.startswith("/"):
                raise InvalidRequestError(f"path {path!r} must be absolute")

    async def _make_checked(self, spec: SandboxSpec) -> Sandbox:
        """`_make`, with a full disk reported as the capacity problem it is."""
        try:
            return await self.make_sandbox(spec)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.paths.sandboxes).free >> 20
                raise CapacityError(
                    f"node {self.settings.node_id}: no space left under {self.paths.sandboxes} ({free} MiB free); "
                    "free disk space or close sandboxes"
                ) from exc
            raise

    async def make_sandbox(self, spec: SandboxSpec, image: Image | None = None) -> Sandbox:
        """Cold-create a sandbox with no late-bound fields applied."""
        spec = self._with_runtime(spec)  # build steps come here directly
        substrate = self.substrates[spec.kind]
        if spec.snapshot is not None:
            spec = msgspec.structs.replace(spec, image=substrate.snapshot_meta(spec.snapshot)["image"])
            image = None
        if image is None:
            image = await self.resolve_image(spec)
        sandbox_id = f"{self.settings.node_id}-{secrets.token_hex(6)}"
        # The making runs as its own task, counted in `_creating` until it has truly finished, cleanup included.
        # Cancelled, it is cancelled exactly once: a second cancel (the request's connection going away after
        # its cancel request, the node shutting down) would break the substrate's shielded cleanup loose, and
        # shutdown's settle would stop waiting while that cleanup still ran (issue 19, the cancel storm).
        self._creating += 1
        task = asyncio.ensure_future(self._make_instance(sandbox_id, substrate, spec, image))
        abandoned = False

        def made(task: asyncio.Future) -> None:  # uncount it once it truly ended; destroy it if nobody took it
            self._creating -= 1
            if abandoned:
                self._destroy_made(spec, task)

        task.add_done_callback(made)
        try:
            instance, image, agent, screen = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():  # it ended in the instant its requester gave up (its callback may have run)
                self._destroy_made(spec, task)
            else:
                abandoned = True
                task.cancel()
            raise
        return Sandbox(id=sandbox_id, spec=spec, image=image, instance=instance, agent=agent, screen=screen)

    async def _make_instance(
        self, sandbox_id: str, substrate: Substrate, spec: SandboxSpec, image: Image
    ) -> tuple[Any, Image, AgentClient, Any]:
        image = await self.node_images.acquire(image)
        try:
            instance = await substrate.create(sandbox_id, spec, image, snapshot=spec.snapshot)
            agent = substrate.agent(instance)  # an agentless VM's stand-in (substrates/qemu/agentless.py)
            screen = None
            try:
                async with asyncio.timeout(10):  # not wait_for: no task of its own per create
                    await agent.hello()
                if spec.kind != "container":
                    screen = substrate.screen(instance)  # a VM's screen is QEMU's (QMP), if it has one
                elif (size := gui.screen_of(spec.image, spec.screen)) is not None:
                    screen = await gui.Screen.start(agent, *size)
            except BaseException:
                await asyncio.shield(substrate.destroy(instance))
                raise
        except BaseException:
            await asyncio.shield(self.node_images.release(image.layer_ids))
            raise
        return instance, image, agent, screen

    def _destroy_made(self, spec: SandboxSpec, task: asyncio.Future) -> None:
        """Destroy what an abandoned making task made (if it made anything)."""
        if not task.cancelled() and task.exception() is None:
            instance, image, agent, screen = task.result()
            orphan = Sandbox(id=instance.id, spec=spec, image=image, instance=instance, agent=agent, screen=screen)
            self._start_destroy(orphan)

    async def resolve_image(self, spec: SandboxSpec) -> Image:
        """The image a create of `spec` runs: one its kind builds itself (vm-desktop), else the store's."""
        substrate = self.substrates.get(spec.kind)
        own = substrate.own_image(spec.image) if substrate is not None and not spec.layers else None
        return own or await self.node_images.resolve(spec.image, spec.layers)

    async def image_named(self, name: str) -> Image:
        """Image `name` from the store (built first if it is a builtin); its layers are not mounted."""
        return await self.node_images.resolve(name)

    async def _bind(self, sandbox: Sandbox, spec: SandboxSpec, now: float) -> None:
        sandbox.bind(spec, now)
        if spec.user:
            sandbox.uid, sandbox.gid = await self._resolve_user(sandbox, spec.user)
        if spec.workdir and spec.workdir != "/":
            await sandbox.agent.mkdir(spec.workdir, uid=sandbox.uid, gid=sandbox.gid, parents=True)
        for path, data in spec.files.items():
            await sandbox.agent.write_file(path, data, uid=sandbox.uid, gid=sandbox.gid)
        if network.normalise(spec.network):
            await self._apply_network(sandbox, spec.network)

    async def _resolve_policy(self, spec: network.NetworkSpec) -> network.Policy:
        return await network.resolve(spec, self.network.config)

    async def _apply_network(self, sandbox: Sandbox, spec: network.NetworkSpec) -> dict[str, Any]:
        policy = await self._resolve_policy(spec)
        pid = sandbox.instance.pid
        if pid is None:
            raise InvalidRequestError(
                f"network policies need the sandbox's agent pid on the host, which {sandbox.spec.kind} sandboxes on "
                f"runtime {sandbox.spec.runtime!r} do not have yet: use network='none' or runtime 'crun'/'runc'"
            )
        substrate = self.substrates[sandbox.spec.kind]
        bridged = substrate.capabilities.guest_nic
        await substrate.network_joining(sandbox.instance)
        attachment = await self.network.apply(sandbox.id, pid, sandbox.instance.directory, policy, bridged=bridged)
        if attachment is not None and not sandbox.resolv_written:
            argv = substrate.guest_network_argv(attachment.address, attachment.gateway) if bridged else None
            if argv is not None:  # a VM's guest gives its own NIC the address (the veth only reaches its bridge)
                env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
                async with await sandbox.agent.exec(argv, env=env, merge_stderr=True) as process:
                    output, _, status = await asyncio.wait_for(process.collect(), 60)
                if status.exit_code != 0:
                    raise network.NetworkError(
                        f"the guest of {sandbox.id} could not configure its network interface "
                        f"(exit {status.exit_code}): {output.decode(errors='replace').strip()[-400:]}"
                    )
            await sandbox.agent.write_file("/etc/resolv.conf", f"nameserver {attachment.gateway}\n".encode())
            sandbox.resolv_written = True
        return {
            "network": policy.source,
            "rules": [r.nft().removesuffix(" accept") for r in policy.rules],
            "names": policy.names,
            "address": attachment.address if attachment else None,
        }

    async def resumed(self, sandbox: Sandbox) -> None:
        """After a resume: a VM resumed in a new QEMU, whose new network namespace needs its veth again."""
        if self.substrates[sandbox.spec.kind].capabilities.guest_nic and sandbox.instance.pid is not None:
            await self.network.replug(sandbox.id, sandbox.instance.pid)

    async def set_network(self, sandbox_id: str, network: str | list[str] | dict[str, bool]) -> dict[str, Any]:
        """Change a running sandbox's network policy; open connections to revoked destinations are cut."""
        sandbox = self._get(sandbox_id)
        if self.substrates[sandbox.spec.kind].agentless(sandbox.instance):
            raise NoAgentError(
                f"sandbox {sandbox_id} is an agentless vm: its guest has a private network with no route out, "
                "and a network policy needs shoal's agent in the guest to configure it"
            )
        summary = await self._apply_network(sandbox, network)
        sandbox.spec.network = network
        return summary

    async def _resolve_user(self, sandbox: Sandbox, user: str) -> tuple[int, int]:
        name, _, group = user.partition(":")
        if name.isdigit() and (not group or group.isdigit()):
            return int(name), int(group or name)
        try:
            passwd = (await sandbox.agent.read_file("/etc/passwd")).decode()
        except FileNotFoundError:
            passwd = ""
        for line in passwd.splitlines():
            fields = line.split(":")
            if len(fields) >= 4 and fields[0] == name:
                return int(fields[2]), int(group) if group.isdigit() else int(fields[3])
        raise InvalidRequestError(f"user {name!r} does not exist in image {sandbox.spec.image!r}")

    def destroy_sandbox(self, sandbox: Sandbox) -> Awaitable[None]:
        """Destroy `sandbox`; registered at once (not when first awaited), and a cancelled caller leaves it running."""
        return asyncio.shield(self._start_destroy(sandbox))

    def _start_destroy(self, sandbox: Sandbox) -> asyncio.Future:
        """Start destroying `sandbox` in a task the node's settle waits for (it outlives a cancelled caller)."""
        task = asyncio.ensure_future(self._destroy_now(sandbox))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
        return task

    async def _destroy_now(self, sandbox: Sandbox) -> None:
        sandbox.agent.close()  # the exec connections the agent client keeps
        sandbox.close_files()
        try:
            if sandbox.screen is not None:
                await sandbox.screen.close()
            await self.substrates[sandbox.spec.kind].destroy(sandbox.instance)
        finally:
            await self.network.detach(sandbox.id)
            await self.node_images.release(sandbox.image.layer_ids)

    async def spawn_sandbox(self, spec: SandboxSpec, image: Image) -> Sandbox:
        """A sandbox of an unnamed layer stack (build steps), registered so node shutdown closes it."""
        sandbox = await self.make_sandbox(spec, image)
        try:
            await self._bind(sandbox, spec, time.time())
        except BaseException:
            await asyncio.shield(self.destroy_sandbox(sandbox))
            raise
        self.sandboxes[sandbox.id] = sandbox
        self.lifecycle.arm(sandbox)
        return sandbox

    async def exec_in(self, sandbox: Sandbox, argv: list[str], timeout: float | None) -> ExecResult:
        return await self.exec(ExecRequest(sandbox_id=sandbox.id, cmd=argv, timeout=timeout))

    def _get(self, sandbox_id: str) -> Sandbox:
        return self.table.get(sandbox_id)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        if self.functions.owns(sandbox_id):
            return self.functions.get(sandbox_id).info()
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            self._get(sandbox_id)  # raises the precise error
        assert sandbox is not None
        return sandbox.info()

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return [s.info() for s in self.sandboxes.values() if s.matches(labels)] + self.functions.list(labels)

    async def kill(self, sandbox_id: str, reason: str = "closed by the client") -> bool:
        """True if this closed it, False if it was closed already (E2B's kill answers 404 for that)."""
        if self.functions.owns(sandbox_id):
            return self.functions.kill(sandbox_id, reason)
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            if sandbox_id in self.closed:
                return False
            raise SandboxNotFoundError(f"no sandbox {sandbox_id} on node {self.settings.node_id}")
        self.remember_closed(sandbox_id, reason)
        was_paused = sandbox.state is State.PAUSED
        sandbox.state = State.CLOSED
        self.lifecycle.forget(sandbox_id)
        # Out of the table from here: the rest runs as a task the node's settle waits for, so a cancelled
        # caller (the reaper at shutdown, a client gone mid-close) cannot leave it half closed and unseen.
        task = asyncio.ensure_future(self._close_popped(sandbox, was_paused, reason))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
        await asyncio.shield(task)
        return True

    async def _close_popped(self, sandbox: Sandbox, was_paused: bool, reason: str) -> None:
        if was_paused:  # a frozen cgroup cannot be killed on cgroup v1: thaw it first
            try:
                await self.substrates[sandbox.spec.kind].resume(sandbox.instance)
            except Exception as exc:
                log.warning("could not thaw %s before closing it: %s", sandbox.id, exc)
        for shell in [s for s in self.shells.values() if s.sandbox_id == sandbox.id]:
            self.shells.pop(shell.id, None)
            try:
                await shell.close()
            except Exception as exc:  # the destroy below ends it anyway
                log.warning("could not close shell %s of %s: %s", shell.id, sandbox.id, exc)
        await self._destroy_now(sandbox)
        await self.trajectory.close_sandbox(sandbox.id, "closed", reason)

    @property
    def creating(self) -> int:
        """Sandboxes being made right now (a metric; capacity checks count them too)."""
        return self._creating

    def remember_closed(self, sandbox_id: str, reason: str) -> None:
        self.table.remember_closed(sandbox_id, reason)

    async def close_all(self, labels: dict[str, str] | None = None) -> int:
        doomed = [s.id for s in self.sandboxes.values() if s.matches(labels)]
        doomed += [s.id for s in self.functions.list(labels)]
        await asyncio.gather(*(self.kill(i) for i in doomed))
        return len(doomed)

    async def keepalive(self, sandbox_id: str, ttl_s: float | None = None) -> SandboxInfo:
        """Reset the idle timer and push the TTL deadline out by `ttl_s` (default: the sandbox's ttl_s)."""
        if self.functions.owns(sandbox_id):
            return self.functions.keepalive(sandbox_id, ttl_s)
        sandbox = self._get(sandbox_id)
        ttl = ttl_s or sandbox.spec.ttl_s
        if ttl:
            sandbox.expires_at = time.time() + ttl
        sandbox.last_active = time.time()
        self.persist(sandbox)
        self.lifecycle.arm(sandbox)  # a shorter ttl_s moves its deadline earlier
        return sandbox.info()

    # ---------------------------------------------------------------- pause / resume

    async def _agent_alive(self, sandbox: Sandbox) -> bool:
        """Does the sandbox's agent (PID 1) still live? A dropped connection alone does not say.

        Where the node knows the agent's host pid, the process table answers (a busy host cannot make
        that look like death); otherwise the agent must answer a hello.
        """
        pid = sandbox.instance.pid
        if pid and not self.substrates[sandbox.spec.kind].capabilities.guest_nic:  # a VM's pid is its QEMU's
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                mine = f"{sandbox.instance.cgroup_path}\n" in Path(f"/proc/{pid}/cgroup").read_text()
            except (OSError, IndexError):
                return False
            return mine and state not in ("Z", "X")
        try:
            await asyncio.wait_for(sandbox.agent.hello(), 5)
        except AgentError:  # it answered, with an error (e.g. it cannot fork at the pids limit)
            return True
        except Exception:
            return False
        return True

    async def pause(self, sandbox_id: str) -> dict[str, Any]:
        """Freeze the sandbox and reclaim its memory; any later request resumes it."""
        return await asyncio.shield(self.lifecycle.pause(self._get(sandbox_id)))  # never left half-frozen

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sandbox = self._get(sandbox_id)
        await asyncio.shield(self.lifecycle.resume(sandbox))
        return sandbox.info()

    async def pause_all(self, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        chosen = [s for s in self.sandboxes.values() if s.matches(labels) and s.state is State.READY]
        return list(await asyncio.shield(asyncio.gather(*(self.lifecycle.pause(s) for s in chosen))))

    async def resume_all(self, labels: dict[str, str] | None = None) -> int:
        chosen = [s for s in self.sandboxes.values() if s.matches(labels) and s.state is State.PAUSED]
        await asyncio.shield(asyncio.gather(*(self.lifecycle.resume(s) for s in chosen)))
        return len(chosen)

    async def _lost(self, sandbox: Sandbox, exc: BaseException) -> ShoalError:
        """The agent stopped answering: mark the sandbox lost, free its resources, say why."""
        if sandbox.state is State.PAUSED:  # a pause cut this request's connection; the sandbox is fine
            return ShoalError(
                f"sandbox {sandbox.id} was paused during this request: its processes keep their state and run "
                "on after resume, but this request's connection is gone"
            )
        if sandbox.state is State.CLOSED:  # it was closed under a running request: that is why
            return SandboxClosedError(f"sandbox {sandbox.id} was closed ({self.closed.get(sandbox.id, 'closed')})")
        reason = f"its agent stopped answering ({exc.__class__.__name__}: {exc})"
        if cgroups.oom_kills(sandbox.instance.cgroup_path):
            reason += "; the kernel's OOM killer fired in it: raise memory_mb"
        detail = self.substrates[sandbox.spec.kind].loss_detail(sandbox.instance)
        if detail:
            reason += f"; {detail}"
        sandbox.state = State.LOST
        sandbox.lost_reason = reason
        self.lifecycle.forget(sandbox.id)
        self.sandboxes.pop(sandbox.id, None)
        self.remember_closed(sandbox.id, f"lost: {reason}")
        await asyncio.shield(self.destroy_sandbox(sandbox))
        await self.trajectory.close_sandbox(sandbox.id, "lost", f"lost: {reason}")
        return SandboxLostError(f"sandbox {sandbox.id} is lost: {reason}")

    # ---------------------------------------------------------------- exec

    async def _step(
        self, sandbox: Sandbox, op: str, args: dict[str, Any], seq: int | None, run: Any, operator: bool = False
    ) -> Any:
        """Run one data-plane request as a step of the sandbox's trajectory (trajectory.Recorder). An operator's
        act (`operator`: the console's terminal) runs unlogged: a person looking in is not the agent's
        trajectory, and a logged keystroke would shift the sequence numbers a trainer counts (DivergenceError)."""

        async def awake_then_run() -> Any:
            await self.lifecycle.awake(sandbox)
            return await run()

        sandbox.busy += 1
        try:
            if operator:
                if seq is not None:
                    raise InvalidRequestError("an operator's act is not logged, so it takes no seq")
                return await awake_then_run()
            if seq is not None and seq in sandbox.inflight:  # the logged original may be frozen
                await self.lifecycle.awake(sandbox)
            return await self.recorder.step(sandbox, op, args, seq, awake_then_run)
        finally:
            sandbox.busy -= 1
            sandbox.last_active = time.time()

    async def exec(self, req: ExecRequest, emit: Emit | None = None) -> ExecResult:
        if self.functions.owns(req.sandbox_id):
            return await self.functions.exec(req, emit)
        sandbox = self._get(req.sandbox_id)
        args = {k: v for k, v in msgspec.structs.asdict(req).items() if k not in ("sandbox_id", "seq", "stream")}

        async def quiet_emit(event: Any) -> None:  # a step outlives a client that went away
            try:
                await emit(event)  # type: ignore[misc]
            except Exception:  # noqa: S110
                pass

        run = functools.partial(self._exec, sandbox, req, quiet_emit if emit is not None else None)
        return await self._step(sandbox, "exec", args, req.seq, run)

    async def _exec(self, sandbox: Sandbox, req: ExecRequest, emit: Emit | None) -> ExecResult:
        argv = list(req.cmd) if isinstance(req.cmd, list) else [*sandbox.shell, "-c", req.cmd]
        if not argv:
            raise InvalidRequestError("empty command")
        uid, gid = (await self._resolve_user(sandbox, req.user)) if req.user else (sandbox.uid, sandbox.gid)
        cap = req.output_cap_bytes or sandbox.spec.output_cap_bytes or self.settings.output_cap_bytes
        ooms = sandbox.oom_kills() if sandbox.spec.memory_mb else 0
        command = req.cmd if isinstance(req.cmd, str) else " ".join(req.cmd)
        start = time.monotonic()
        try:
            # Without stdin to feed, the step is not woken at the command's start, only at its end (a loop pass
            # fewer per exec, issue 12): the exec is named (processes(), kill_processes) from the loop's callback.
            run = await sandbox.agent.exec_run(
                argv,
                env={**sandbox.env, **req.env},
                cwd=req.cwd or sandbox.workdir,
                uid=uid,
                gid=gid,
                cap_bytes=cap,
                stdin_pipe=req.stdin is not None,
                merge_stderr=req.merge_stderr,
                stream=emit is not None and req.stream,
                on_start=lambda run: sandbox.exec_started(run.handler_pid, command),
                wait_start=req.stdin is not None,
            )
        except OSError as exc:  # ConnectionError is one
            await self._start_failed(sandbox, exc)
        timed_out = killed_inside = False
        try:
            if req.stdin is not None:
                await run.send(control_frames(stdin=req.stdin, eof=True))
            deadline = start + req.timeout if req.timeout else None
            kill_deadline: float | None = None
            while True:
                if run.chunks:  # streamed, in order (only with emit and req.stream)
                    chunks, run.chunks = run.chunks, []
                    for stream, data in chunks:
                        await emit(OutputChunk(stream=stream, data=data))  # type: ignore[misc]
                    continue
                if run.exit is not None:
                    break
                if run.error is not None:
                    if not run.started:  # it did not start: below, once the connection is closed
                        break
                    raise run.error
                if kill_deadline is not None:
                    limit: float | None = kill_deadline
                else:
                    limits = [t for t in (deadline, req.idle_timeout and run.last_output + req.idle_timeout) if t]
                    limit = min(limits) if limits else None
                if limit is not None and time.monotonic() >= limit:
                    if kill_deadline is not None:  # killed, yet no exit frame within the grace period
                        break
                    timed_out = True
                    await run.kill(9)
                    kill_deadline = time.monotonic() + KILL_GRACE_S
                    continue
                await run.wait(limit)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if not await self._agent_alive(sandbox):
                raise await self._lost(sandbox, exc) from exc
            # The agent lives but the process serving this command was killed from inside the sandbox
            # (`kill -9 -1` as root there): report the command as killed, keep the sandbox.
            run.stderr.extend(b"\n[shoal] the command's handler was killed from inside the sandbox\n")
            killed_inside = True
        finally:
            run.close()
        if isinstance(run.error, OSError) and not run.started:
            await self._start_failed(sandbox, run.error)
        exit_info = None if killed_inside else run.exit
        oom = bool(sandbox.spec.memory_mb) and sandbox.oom_kills() > ooms
        return ExecResult(
            exit_code=exit_info.exit_code if exit_info else 137,
            stdout=bytes(run.stdout),
            stderr=bytes(run.stderr),
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
            truncated=bool(exit_info and (exit_info.stdout_dropped or exit_info.stderr_dropped)),
            signal=exit_info.signal if exit_info else 9,
            oom_killed=oom,
            stdout_omitted=exit_info.stdout_dropped if exit_info else 0,
            stderr_omitted=exit_info.stderr_dropped if exit_info else 0,
            exec_id=run.exec_id,
        )

    async def _start_failed(self, sandbox: Sandbox, exc: OSError) -> NoReturn:
        """Raise what an exec that the sandbox did not start (`exc`: how its request failed) answers."""
        if exc.errno == errno.EAGAIN:
            raise CapacityError(
                f"sandbox {sandbox.id} could not start the command: {exc.strerror or exc}; its pids limit is "
                f"{sandbox.spec.pids}"
            ) from None
        if isinstance(exc, AgentError):
            raise exc
        if not isinstance(exc, (ConnectionError, FileNotFoundError)) or not await self._agent_alive(sandbox):
            raise await self._lost(sandbox, exc) from exc
        current = cgroups.pids_current(sandbox.instance.cgroup_path)
        if sandbox.spec.pids and current is not None and current >= sandbox.spec.pids - 2:
            raise CapacityError(  # the agent's handler could not fork either: say why
                f"sandbox {sandbox.id} could not start the command: it holds {current} tasks and its pids "
                f"limit is {sandbox.spec.pids}; wait for processes to exit or kill them"
            ) from None
        raise CapacityError(f"sandbox {sandbox.id} dropped the command before it started: {exc}") from None

    # ---------------------------------------------------------------- files

    async def _agent_call(self, sandbox_id: str, op: str, *args: Any, **kwargs: Any) -> Any:
        sandbox = await self._awake(self._get(sandbox_id))
        try:
            return await getattr(sandbox.agent, op)(*args, **kwargs)
        except AgentError:
            raise
        except FileNotFoundError:
            raise
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise await self._lost(sandbox, exc) from exc

    # ---------------------------------------------------------------- ports (node/ports.py, shoal/portrelay.py)

    async def expose(self, sandbox_id: str, port: int) -> dict[str, Any]:
        """A URL reaching `port` inside the sandbox through this node's HTTP, with the key that opens it."""
        if not 0 < port < 65536:
            raise InvalidRequestError(f"port {port} is not a port number (1-65535)")
        if self.functions.owns(sandbox_id):
            raise InvalidRequestError(f"{sandbox_id} is a function sandbox: it runs no servers; expose a container")
        self._get(sandbox_id)
        key = self.ports.key(sandbox_id, port)
        path = f"/ports/{sandbox_id}/{port}.{key}/"
        base = await self.ports.url_base(self.open_port_target)
        return {"url": base + path, "path": path, "port": port, "key": key,
                "sandbox_key": self.ports.key(sandbox_id, None)}  # fmt: skip

    async def open_port_target(self, target: Any) -> Any:
        return await self.open_port(target.sandbox_id, target.port)

    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to 127.0.0.1:port inside the sandbox (the agent's relay; the caller authorised it)."""
        if self.functions.owns(sandbox_id):
            raise InvalidRequestError(f"{sandbox_id} is a function sandbox: it serves no ports")
        sandbox = await self._awake(self._get(sandbox_id))
        sandbox.last_active = time.time()  # traffic to its ports keeps a sandbox from its idle timeout
        if port == VNC_PORT and hasattr(sandbox.screen, "open_vnc"):
            return await sandbox.screen.open_vnc()  # a VM's screen: QEMU's own VNC server (shoal/view.py)
        if port == VNC_PORT and hasattr(sandbox.screen, "start_vnc"):
            await sandbox.screen.start_vnc()  # a desktop's x11vnc starts at its first view (no cost before)
        try:
            return await sandbox.agent.open_port(port)
        except ConnectionRefusedError as exc:
            raise ConnectionRefusedError(
                exc.errno, f"nothing listens on 127.0.0.1:{port} in sandbox {sandbox_id} ({exc.strerror})"
            ) from None
        except AgentError:
            raise
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise await self._lost(sandbox, exc) from exc

    # ---------------------------------------------------------------- processes that outlive their exec

    async def usage(self, sandbox_id: str) -> dict[str, Any]:
        """What a sandbox uses now, read from its cgroup (the agent is not asked, so a paused sandbox stays
        paused): memory charged in bytes, CPU seconds, tasks (None for what this host's cgroups do not show)."""
        sandbox = self._get(sandbox_id)
        return {**cgroups.usage(sandbox.instance.cgroup_path), "state": sandbox.state.value}

    async def processes(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's processes but its agent's, each with the exec that started it (guest/agent.c: an
        exec's handler stays the subreaper of what its command left running, so forks and setsid stay its)."""
        sandbox = self._get(sandbox_id)
        entries = await self._agent_call(sandbox_id, "processes")
        return [
            {
                "pid": e.pid,
                "ppid": e.ppid,
                "state": e.state,
                "command": e.command,
                "exec_id": exec_id,
                "exec_command": sandbox.execs.get(exec_id) if exec_id else None,
            }
            for e in entries
            for exec_id in (sandbox.exec_id_of(e.exec_id),)
        ]

    # ---------------------------------------------------------------- background processes (node/procs.py)

    async def _proc(self, sandbox: Sandbox, id: int | None, call: Awaitable[Any]) -> Any:
        """An agent call about a background process, its failures as typed errors."""
        try:
            return await call
        except AgentError as exc:
            raise procs.agent_error(exc, sandbox.id, id) from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if not await self._agent_alive(sandbox):
                raise await self._lost(sandbox, exc) from exc
            raise ProcessNotFoundError(  # its keeper was killed from inside the sandbox (`kill -9 -1`)
                f"background process {id} of sandbox {sandbox.id} went away while answering: {exc}"
            ) from None

    async def proc_start(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        merge_stderr: bool = False,
        pty: dict[str, int] | None = None,
        output_cap_bytes: int | None = None,
        open_stdin: bool = True,
        seq: int | None = None,
        operator: bool = False,
        stream: bool = False,
        timeout: float | None = None,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        """With `stream`: the start's answer goes out as the first event and the process is then followed in
        the same request (what the E2B layer's Start is: one request, not a start and a read)."""
        sandbox = self._get(sandbox_id)
        size = procs.terminal_size(pty)
        follow: list[Any] | None = [] if stream and emit is not None else None  # the start's own connection
        args = {"cmd": cmd, "env": env or {}, "cwd": cwd, "user": user, "stdin": stdin, "merge_stderr": merge_stderr,
                "pty": pty, "output_cap_bytes": output_cap_bytes}  # fmt: skip

        async def run() -> dict[str, Any]:
            argv = list(cmd) if isinstance(cmd, list) else [*sandbox.shell, "-c", cmd]
            if not argv:
                raise InvalidRequestError("empty command")
            uid, gid = (await self._resolve_user(sandbox, user)) if user else (sandbox.uid, sandbox.gid)
            cap = output_cap_bytes or sandbox.spec.output_cap_bytes or self.settings.output_cap_bytes
            started = await self._proc(sandbox, None, procs.start(
                sandbox.agent, argv, env={**sandbox.env, **(env or {})}, cwd=cwd or sandbox.workdir, uid=uid,
                gid=gid, ring_bytes=min(cap, 1 << 30), merge_stderr=merge_stderr, size=size, stdin=stdin,
                open_stdin=open_stdin, follow=follow,
            ))  # fmt: skip
            command = cmd if isinstance(cmd, str) else " ".join(cmd)
            sandbox.background_started(started["id"], command)
            return {**started, "command": command[:200]}

        try:
            started = await self._step(sandbox, "proc_start", args, seq, run, operator)
            if follow is None:
                return started
            await emit(started)  # type: ignore[misc]
            attached = follow.pop() if follow else None
        finally:
            for unused in follow or ():
                await unused.close()
        if attached is None:  # a step fast-forwarded from the log, or an agent without the follow flag
            return await self.proc_read(sandbox_id, started["id"], follow=True, timeout=timeout, stream=True, emit=emit)
        read = procs.read_attached(attached, started["id"], follow=True, timeout=timeout,
                                   max_bytes=procs.READ_MAX_BYTES, emit=emit)  # fmt: skip
        sandbox.busy += 1  # as proc_read's follower: a command being followed keeps the sandbox busy
        try:
            return await self._proc(sandbox, started["id"], read)
        finally:
            sandbox.busy -= 1
            sandbox.last_active = time.time()

    async def proc_read(
        self,
        sandbox_id: str,
        id: int,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        follow: bool = False,
        timeout: float | None = None,
        max_bytes: int = procs.READ_MAX_BYTES,
        stream: bool = False,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        sandbox = await self._awake(self._get(sandbox_id))
        read = procs.read(sandbox.agent, id, (stdout_offset, stderr_offset), follow=follow, timeout=timeout,
                          max_bytes=max(1, min(max_bytes, procs.READ_MAX_BYTES)),
                          emit=emit if stream else None)  # fmt: skip
        sandbox.busy += follow  # a follower waiting on a quiet process does not make the sandbox idle
        try:
            return await self._proc(sandbox, id, read)
        finally:
            sandbox.busy -= follow
            sandbox.last_active = time.time()

    async def _proc_control(
        self, op: str, sandbox_id: str, id: int, args: dict, frames: bytes, seq: int | None, operator: bool = False
    ) -> Any:
        sandbox = self._get(sandbox_id)

        async def run() -> dict[str, Any]:
            return await self._proc(sandbox, id, procs.control(sandbox.agent, id, frames))

        if seq is None and op == "proc_resize":  # not a step: what a terminal shows is not the trajectory's
            await self._awake(sandbox)
            return await run()
        return await self._step(sandbox, op, {"id": id, **args}, seq, run, operator)

    async def proc_input(
        self,
        sandbox_id: str,
        id: int,
        data: bytes = b"",
        eof: bool = False,
        seq: int | None = None,
        operator: bool = False,
    ) -> dict[str, Any]:
        frames = procs.control_frames(stdin=data, eof=eof)
        args = {"data": data, "eof": eof}
        return await self._proc_control("proc_input", sandbox_id, id, args, frames, seq, operator)

    async def proc_signal(
        self, sandbox_id: str, id: int, signal: int = 15, seq: int | None = None, operator: bool = False
    ) -> dict[str, Any]:
        if not 0 < signal < 65:
            raise InvalidRequestError(f"signal {signal} is not a signal number (1-64)")
        frames = procs.control_frames(signal=signal)
        return await self._proc_control("proc_signal", sandbox_id, id, {"signal": signal}, frames, seq, operator)

    async def proc_resize(self, sandbox_id: str, id: int, cols: int, rows: int) -> dict[str, Any]:
        size = procs.terminal_size({"cols": cols, "rows": rows})
        return await self._proc_control("proc_resize", sandbox_id, id, {}, procs.control_frames(size=size), None)

    async def proc_list(self, sandbox_id: str) -> list[dict[str, Any]]:
        sandbox = await self._awake(self._get(sandbox_id))
        return await self._proc(sandbox, None, procs.listing(sandbox.agent, sandbox.execs))

    async def kill_processes(self, sandbox_id: str, exec_id: int | None = None) -> dict[str, int]:
        """SIGKILL every process of exec `exec_id` (of every exec if None); the agent stays. Needs no fork in
        the sandbox, so it also works when a fork bomb holds every pid (the agent's reserve serves it)."""
        if exec_id is not None:
            if not 0 < exec_id < 1 << 64:
                raise InvalidRequestError(f"exec_id {exec_id} names no exec: take it from ExecResult.exec_id")
            handler = self._get(sandbox_id).agent_exec_id(exec_id)
            if handler is None:  # that exec ended leaving nothing; its handler runs a later exec now
                return {"killed": 0, "left": 0}
            exec_id = handler
        killed, left = await self._agent_call(sandbox_id, "kill_processes", exec_id)
        return {"killed": killed, "left": left}

    async def _file_step(
        self, op: str, sandbox_id: str, seq: int | None, args: dict[str, Any], run: Any, operator: bool = False
    ) -> Any:
        return await self._step(self._get(sandbox_id), op, args, seq, run, operator)

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False, seq: int | None = None
    ) -> int:
        if self.functions.owns(sandbox_id):
            return self.functions.file_write(sandbox_id, path, data, mode, append)
        sandbox = self._get(sandbox_id)
        run = functools.partial(
            self._agent_call,
            sandbox_id,
            "write_file",
            _abs(path, sandbox),
            data,
            mode=mode,
            uid=sandbox.uid,
            gid=sandbox.gid,
            append=append,
        )
        args = {"path": path, "data": data, "mode": mode, "append": append}
        return await self._file_step("file_write", sandbox_id, seq, args, run)

    async def file_untar(self, sandbox_id: str, path: str, data: bytes, seq: int | None = None) -> int:
        """Unpack a tar stream (a whole directory tree in one request) into directory `path`, as the sandbox's
        user; absolute and '..' members are refused and links in the tree are never followed. Returns the
        entries made."""
        if self.functions.owns(sandbox_id):
            return untar_files(data, path, functools.partial(self.functions.file_write, sandbox_id, append=False))
        sandbox = self._get(sandbox_id)
        target = _abs(path, sandbox)
        run = functools.partial(self._agent_call, sandbox_id, "untar", target, data, uid=sandbox.uid, gid=sandbox.gid)
        return await self._file_step("file_untar", sandbox_id, seq, {"path": path, "data": data}, run)

    async def file_read(
        self,
        sandbox_id: str,
        path: str,
        max_bytes: int = 256 << 20,
        seq: int | None = None,
        stream: bool = False,
        operator: bool = False,
        emit: Emit | None = None,
    ) -> bytes | dict[str, Any]:
        """The file's bytes; with `stream` a file over steps.BULK_BYTES comes as events (chunks, never held
        whole by the node) and the result is its {"bulk": digest, "size": n}."""
        if self.functions.owns(sandbox_id):
            return self.functions.file_read(sandbox_id, path, max_bytes)
        target = _abs(path, self._get(sandbox_id))
        if stream and emit is not None:
            run = functools.partial(self._read_streamed, sandbox_id, target, max_bytes, emit)
        else:
            run = functools.partial(self._agent_call, sandbox_id, "read_file", target, max_bytes)
        args = {"path": path, "max_bytes": max_bytes}
        return await self._file_step("file_read", sandbox_id, seq, args, run, operator)

    async def _read_streamed(self, sandbox_id: str, target: str, max_bytes: int, emit: Emit) -> bytes | dict:
        sandbox = await self._awake(self._get(sandbox_id))
        head: list[bytes] = []
        held = 0
        hasher = hashlib.blake2b(digest_size=16)
        size = 0
        streaming = False

        async def quiet_emit(data: bytes) -> None:  # a step outlives a client that went away
            try:
                await emit(data)
            except Exception:  # noqa: S110
                pass

        try:
            async for chunk in sandbox.agent.read_file_chunks(target, max_bytes):
                hasher.update(chunk)
                size += len(chunk)
                if streaming:
                    await quiet_emit(chunk)
                    continue
                head.append(chunk)
                held += len(chunk)
                if held > BULK_BYTES:
                    streaming = True
                    for part in head:
                        await quiet_emit(part)
                    head = []
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise await self._lost(sandbox, exc) from exc
        if not streaming:
            return b"".join(head)
        return {"bulk": "blake2b:" + hasher.hexdigest(), "size": size}

    async def file_list(
        self, sandbox_id: str, path: str, recursive: bool = False, seq: int | None = None, operator: bool = False
    ) -> list[FileEntry]:
        if self.functions.owns(sandbox_id):
            return self.functions.file_list(sandbox_id, path, recursive)

        async def run() -> list[FileEntry]:
            entries = await self._agent_call(sandbox_id, "list_dir", _abs(path, self._get(sandbox_id)), recursive)
            return [_entry(e) for e in entries]

        args = {"path": path, "recursive": recursive}
        return await self._file_step("file_list", sandbox_id, seq, args, run, operator)

    async def file_stat(self, sandbox_id: str, path: str, seq: int | None = None) -> FileEntry | None:
        if self.functions.owns(sandbox_id):
            return self.functions.file_stat(sandbox_id, path)

        async def run() -> FileEntry | None:
            entry = await self._agent_call(sandbox_id, "stat", _abs(path, self._get(sandbox_id)))
            return None if entry is None else _entry(entry)

        return await self._file_step("file_stat", sandbox_id, seq, {"path": path}, run)

    async def file_mkdir(self, sandbox_id: str, path: str, seq: int | None = None) -> None:
        if self.functions.owns(sandbox_id):
            return self.functions.file_mkdir(sandbox_id, path)
        sandbox = self._get(sandbox_id)
        run = functools.partial(
            self._agent_call, sandbox_id, "mkdir", _abs(path, sandbox), uid=sandbox.uid, gid=sandbox.gid, parents=True
        )
        await self._file_step("file_mkdir", sandbox_id, seq, {"path": path}, run)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False, seq: int | None = None) -> None:
        if self.functions.owns(sandbox_id):
            return self.functions.file_remove(sandbox_id, path, recursive)
        run = functools.partial(
            self._agent_call, sandbox_id, "remove", _abs(path, self._get(sandbox_id)), recursive=recursive
        )
        await self._file_step("file_remove", sandbox_id, seq, {"path": path, "recursive": recursive}, run)

    # ---------------------------------------------------------------- shells

    async def shell_open(self, sandbox_id: str, seq: int | None = None) -> str:
        if self.functions.owns(sandbox_id):
            raise InvalidRequestError("function sandboxes keep no state between calls, so no shells: use a container")
        sandbox = self._get(sandbox_id)
        return await self._step(sandbox, "shell_open", {}, seq, functools.partial(self._shell_open, sandbox))

    async def _shell_open(self, sandbox: Sandbox) -> str:
        sandbox_id = sandbox.id
        argv = [
            "/bin/sh",
            "-c",
            "if command -v bash >/dev/null 2>&1; then exec bash --noprofile --norc; else exec sh; fi",
        ]
        proc = await self._agent_call(
            sandbox_id,
            "exec",
            argv,
            env=sandbox.env,
            cwd=sandbox.workdir,
            uid=sandbox.uid,
            gid=sandbox.gid,
            cap_bytes=0,
            stdin_pipe=True,
        )
        shell_id = f"{sandbox_id}/sh-{SHELL_EPOCH}-{secrets.token_hex(4)}"
        cap = sandbox.spec.output_cap_bytes or self.settings.output_cap_bytes
        self.shells[shell_id] = ShellSession(shell_id, sandbox_id, proc, cap)
        return shell_id

    async def shell_run(
        self,
        shell_id: str,
        cmd: str,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        seq: int | None = None,
    ) -> ExecResult:
        sandbox_id = shell_id.partition("/sh-")[0]
        shell = self.shells.get(shell_id)
        if sandbox_id not in self.sandboxes and shell is None:
            raise SandboxNotFoundError(f"no shell {shell_id} (closed, or its sandbox was closed)")
        sandbox = self._get(sandbox_id)

        async def run() -> ExecResult:
            if shell is None and not shell_id.startswith(f"{sandbox_id}/sh-{SHELL_EPOCH}-"):
                raise ShellLostError(
                    f"shell {shell_id} was lost: the node restarted since it was opened (a shell's process belongs "
                    f"to the node that opened it; the sandbox {sandbox_id} lives on): open a new one, sandbox.shell()"
                )
            if shell is None:
                raise SandboxNotFoundError(f"no shell {shell_id}: it was closed")
            return await shell.run(cmd, timeout, idle_timeout)

        args = {"shell_id": shell_id, "cmd": cmd, "timeout": timeout, "idle_timeout": idle_timeout}
        return await self._step(sandbox, "shell_run", args, seq, run)

    async def shell_close(self, shell_id: str) -> None:
        shell = self.shells.pop(shell_id, None)
        if shell is not None:
            await shell.close()

    # ---------------------------------------------------------------- pause, resume, snapshots, fork

    async def _awake(self, sandbox: Sandbox) -> Sandbox:
        """Any request to a paused sandbox resumes it first."""
        await self.lifecycle.awake(sandbox)
        return sandbox

    def _snapshotter(self, sandbox: Sandbox) -> Substrate:
        substrate = self.substrates[sandbox.spec.kind]
        if not substrate.capabilities.memory_snapshots:
            raise InvalidRequestError(
                f"{sandbox.spec.kind} sandboxes have no memory snapshots; use "
                f"{' or '.join(self._kinds_with('memory_snapshots'))}"
                + (
                    " (sb.snapshot(name) commits a container's files as an image)"
                    if substrate.capabilities.image_commit
                    else ""
                )
            )
        return substrate

    def _kinds_with(self, capability: str) -> list[str]:
        return [kind for kind, s in self.substrates.items() if getattr(s.capabilities, capability)] or ["none here"]

    async def vm_snapshot(self, sandbox_id: str) -> str:
        """Capture memory and disk of a running VM; `create(kind, snapshot=id)` restores it."""
        sandbox = await self._awake(self._get(sandbox_id))
        substrate = self._snapshotter(sandbox)
        async with sandbox.lock:
            return await substrate.snapshot(sandbox.instance, sandbox.spec.image)

    async def vm_snapshot_delete(self, snapshot_id: str) -> None:
        for substrate in self._snapshotting_substrates():
            substrate.delete_snapshot(snapshot_id)

    async def fork(self, sandbox_id: str, count: int = 1) -> list[Any]:
        """`count` running copies of a VM (memory and disk); each slot is a SandboxInfo or an ErrorInfo."""
        if not 1 <= count <= 256:
            raise InvalidRequestError(f"count={count}: fork makes between 1 and 256 copies")
        sandbox = self._get(sandbox_id)
        snapshot_id = await self.vm_snapshot(sandbox_id)
        try:
            spec = msgspec.structs.replace(sandbox.spec, snapshot=snapshot_id, pool=False)
            results = await asyncio.gather(*(self.create(spec) for _ in range(count)), return_exceptions=True)
        finally:
            await self.vm_snapshot_delete(snapshot_id)
        out: list[Any] = []
        for item in results:
            if isinstance(item, BaseException) and not isinstance(item, Exception):
                raise item
            out.append(ErrorInfo(type=type(item).__name__, message=str(item)) if isinstance(item, Exception) else item)
        return out

    # ---------------------------------------------------------------- pools, images, status

    async def pool_set(self, spec: SandboxSpec, size: int, wait: bool = False) -> dict[str, Any]:
        spec = self._with_runtime(spec)
        self._validate(spec)
        spec = self._with_default_caps(spec)  # the same pool key a create without caps will look up
        if spec.kind == "function":
            return await self.functions.set_warm(spec, size, wait)
        await self.resolve_image(spec)
        await self.pools.configure(spec, size)
        if wait:
            await self.pools.wait_full(spec)
        return self.pools.stats()

    # ---------------------------------------------------------------- function calls (substrates/function)

    async def fn_call(
        self, spec: SandboxSpec, call: dict[str, Any], timeout: float | None = None, sandbox_id: str | None = None
    ) -> dict[str, Any]:
        spec = self._with_runtime(spec)
        self._validate(spec)
        return await self.functions.call(spec, call, timeout, sandbox_id)

    async def fn_map(
        self,
        spec: SandboxSpec,
        call: dict[str, Any],
        items: list[Any],
        timeout: float | None = None,
        isolation: str = "item",
    ) -> list[dict[str, Any]]:
        spec = self._with_runtime(spec)
        self._validate(spec)
        return await self.functions.map(spec, call, items, timeout, isolation)

    async def fn_run_code(
        self,
        spec: SandboxSpec,
        code: str,
        language: str = "python",
        stdin: bytes | None = None,
        files: dict[str, bytes] | None = None,
        compile_timeout: float | None = 30.0,
        run_timeout: float | None = 10.0,
        output_files: list[str] | None = None,
    ) -> dict[str, Any]:
        spec = self._with_runtime(spec)
        self._validate(spec)
        return await self.functions.run_code(
            spec, language, code, stdin, files or {}, compile_timeout, run_timeout, output_files or []
        )

    async def image_build(
        self,
        name: str,
        force: bool = False,
        base: str | None = None,
        steps: list[dict[str, Any]] | None = None,
        no_cache: bool = False,
        network: Any = None,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        """Build a builtin image (no `steps`), or `steps` over image `base` (see shoal.client.image);
        streams one event per step as it completes. RUN steps get `network` (default: the node's
        `build_network`, the public internet as in Docker's build)."""
        if steps is None:
            image = await asyncio.to_thread(self.images.build, name, force=force)
            return {"name": image.name, "layers": list(image.layer_ids)}
        policy = self.settings.build_network if network is None else network
        await self._resolve_policy(policy)  # a bad policy fails before any step runs
        return await self.node_images.build(
            self, name, base or "scratch", steps, no_cache=no_cache, network=policy, emit=emit
        )

    async def image_list(self) -> list[str]:
        return sorted(self.images.names())

    async def image_ls(self) -> list[dict[str, Any]]:
        """The store's images; shaped as a gateway answers (`nodes`: where each is present)."""
        return merge_image_lists([[{**e, "nodes": [self.settings.node_id]} for e in await self.node_images.list()]])

    async def image_inspect(self, name: str) -> dict[str, Any]:
        return {**await self.node_images.inspect(name), "nodes": [self.settings.node_id]}

    async def image_rm(self, name: str) -> dict[str, Any]:
        return await self.node_images.remove(name)

    async def image_prune(self) -> dict[str, Any]:
        return await self.node_images.prune()

    async def image_squash(self, name: str, target: str) -> dict[str, Any]:
        """Flatten image `name` into one layer, registered as `target`."""
        return await self.node_images.squash(name, target)

    async def image_tag(self, source: str, target: str) -> None:
        await asyncio.to_thread(self.images.tag, source, target)

    async def image_import_disk(
        self,
        path: str,
        name: str,
        kernel: str | None = None,
        initrd: str | None = None,
        append: str | None = None,
        ready_port: int | None = None,
        disk_bus: str = "virtio",
        nic: str = "virtio",
    ) -> dict[str, Any]:
        return await self.node_images.import_disk(path, name, kernel, initrd, append, ready_port, disk_bus, nic)

    async def image_import(self, path: str, name: str | None = None) -> list[str]:
        return await self.node_images.import_archive(path, name)

    async def image_export(self, name: str, path: str) -> str:
        return await self.node_images.export_archive(name, path)

    async def image_pull(
        self,
        reference: str,
        name: str | None = None,
        auth: str | None = None,
        platform: str | None = None,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        """Pull HOST[:PORT]/REPO[:TAG|@DIGEST] into the store; streams progress events."""
        return await self.node_images.pull(reference, name, auth, platform, emit)

    async def image_push(
        self, name: str, reference: str, auth: str | None = None, emit: Emit | None = None
    ) -> dict[str, Any]:
        return await self.node_images.push(name, reference, auth, emit)

    async def gui(
        self,
        sandbox_id: str,
        action: str,
        args: dict[str, Any] | None = None,
        seq: int | None = None,
        operator: bool = False,
    ) -> dict[str, Any]:
        """One GUI action on the sandbox's screen (node/gui.py); a logged step like exec."""
        if self.functions.owns(sandbox_id):
            raise gui.no_screen(sandbox_id, "function")
        sandbox = self._get(sandbox_id)
        if sandbox.screen is None and gui.screen_of(sandbox.spec.image, sandbox.spec.screen) is not None:
            raise gui.display_lost(sandbox_id)
        if sandbox.screen is None:
            raise gui.no_screen(sandbox_id, sandbox.spec.kind)
        run = functools.partial(sandbox.screen.act, action, dict(args or {}))
        return await self._step(sandbox, "gui", {"action": action, "args": args}, seq, run, operator)

    async def sandbox_snapshot(self, sandbox_id: str, name: str, seq: int | None = None) -> dict[str, Any]:
        """Commit the sandbox's writes as a new image `name` (its image plus one layer); a logged step."""
        sandbox = self._get(sandbox_id)
        if not self.substrates[sandbox.spec.kind].capabilities.image_commit:
            raise InvalidRequestError(
                f"image commits are for containers; a {sandbox.spec.kind} snapshot (memory + disk) is made with "
                "sb.snapshot() and restored with create(kind, snapshot=id)"
            )
        run = functools.partial(self.node_images.snapshot, self, sandbox, name)
        return await self._step(sandbox, "sandbox_snapshot", {"name": name}, seq, run)

    async def status(self) -> dict[str, Any]:
        """This node's figures, shaped as a gateway's status (a cluster of one: see protocol.combine_status)."""
        own = self._own_status()
        return {**combine_status({self.settings.node_id: own}, {}), **own}

    def _own_status(self) -> dict[str, Any]:
        states = collections.Counter(s.state.value for s in self.sandboxes.values())
        return {
            "node_id": self.settings.node_id,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "sandboxes": len(self.sandboxes),
            "max_sandboxes": self.settings.max_sandboxes,
            "kinds": self.kinds(),
            "states": dict(states),
            "creating": self._creating,
            "pools": self.pools.stats(),
            "pool_hits": self.pools.hits,
            "pool_misses": self.pools.misses,
            "shells": len(self.shells),
            "functions": self.functions.stats(),
            "home": str(self.paths.home),
            "adopted": list(self.adopted),
            "lost": dict(self.lost),
            # the runtime of containers that name none, the SHOAL_RUNTIME it came from, and why
            "runtime": {
                "default": self.runtime_choice.runtime,
                "setting": self.runtime_choice.setting,
                "reason": self.runtime_choice.reason,
            },
            "trajectory": {
                "appended": self.trajectory.appended,
                "commits": self.trajectory.commits,
                "fast_forwarded": self.recorder.fast_forwarded,
                "reserve_released": self.trajectory.reserve_released,  # times a full disk took the reserve
            },
        }

    # ---------------------------------------------------------------- trajectory log (node/logs.py)

    async def trajectory_find(self, target: str) -> list[dict[str, Any]]:
        """Where `target` (a sandbox ID or a trajectory name) lives on this node (see TrajectoryQueries.find)."""
        return self.logs.find(target)

    async def log_steps(
        self, target: str, since: int = 0, limit: int = 1000, max_bytes: int = 16 << 20
    ) -> dict[str, Any]:
        """A page of the trajectory log of a sandbox (by ID or trajectory name)."""
        return self.logs.page(target, since, limit, max_bytes)

    async def replay(self, target: str, image: str | None = None, keep: bool = False) -> dict[str, Any]:
        """Re-run a recorded trajectory in a fresh sandbox; report each step whose outcome differs."""
        from shoal.node.replay import replay

        return await replay(self, self.logs.owner(target), image, keep)


def _stored_spec(spec: SandboxSpec) -> dict[str, Any]:
    """The spec as the log keeps it (file contents are kept: a replay writes them again)."""
    return msgspec.structs.asdict(spec)


def _abs(path: str, sandbox: Sandbox) -> str:
    return path if path.startswith("/") else str(Path(sandbox.workdir) / path)


def _entry(entry: Any) -> FileEntry:
    return FileEntry(
        name=entry.name, kind=entry.kind, size=entry.size, mode=entry.mode, mtime=entry.mtime, target=entry.target
    )


def _shield_node_from_oom_killer() -> None:
    """A sandbox without memory_mb can exhaust the host: the kernel must then kill its processes, not the node."""
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("-1000")
    except OSError as exc:  # no CAP_SYS_RESOURCE (e.g. in a container): commands still run at +1000
        log.info("the node's oom_score_adj stays at its default (%s); sandbox commands run at +1000", exc.strerror)


def untar_files(data: bytes, target: str, write: Any) -> int:
    """A function sandbox's share of an upload: its regular files, staged with `write(path, data, mode)`
    (function sandboxes hold input files, not a filesystem); unsafe names are refused as the agent does."""
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            for member in archive:
                parts = [p for p in member.name.split("/") if p not in ("", ".")]
                if member.name.startswith("/") or ".." in parts:
                    raise PermissionError(f"untar: member {member.name} leads out of the target; refused")
                if member.isfile() and parts:
                    content = archive.extractfile(member)
                    write(posixpath.join(target, *parts), content.read() if content else b"", member.mode & 0o777)
                    count += 1
    except tarfile.TarError as exc:
        raise InvalidRequestError(f"untar: not a tar stream ({exc})") from None
    return count
