"""Containers: overlayfs (shared read-only lowers + private upper) run by an OCI runtime.

Per sandbox, under its state directory:
    record.json   written first, so a crashed node can find and remove everything below
    config.json   the OCI bundle config; rootfs/ is the overlay mount point (crun, runc: mounted in a mount
                  namespace of the sandbox's own, see mountns.py; the node reaches it as /proc/<pid>/root)
    upper/ work/  the sandbox's private writes (under disk/, its own size-limited ext4, with disk_mb)
    agent.sock    the agent's listening socket (host side only; the sandbox sees no such file)
    runtime.log   what the runtime (and the agent) printed
Under crun and runc (no user namespace) config.json, pid, runtime.log and agent.sock are in the bundle
directory beside the runtimes' state instead (on tmpfs: _bundle_dir), and the overlay is mounted on the
node's one mount point (_shared_dirs): the state directory keeps record.json, upper/ and work/. The shoal
launcher's sandboxes keep their runtime.log and agent.sock in that bundle directory too (no config.json,
no pid file: the launcher answers the pid, and record.json keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import socket
from pathlib import Path

from shoal import cgroups, linux, settings
from shoal.config import node_tag
from shoal.errors import InvalidRequestError, SandboxLostError
from shoal.guest import AgentClient, agent_binary_path
from shoal.images import Image
from shoal.protocol import SandboxSpec
from shoal.substrates.base import Capabilities, Instance, Substrate
from shoal.substrates.container import disk, launcher, userns
from shoal.substrates.container.mountns import Mount, PrivateMounts
from shoal.substrates.container.oci import CPU_PERIOD_US, bundle_config, cpu_shares
from shoal.substrates.container.runtime import OciRuntime

log = logging.getLogger("shoal.node")


class ContainerSubstrate(Substrate):
    kind = "container"
    capabilities = Capabilities(pause=True, image_commit=True, disk_cap=True, readopt=True)

    def __init__(
        self,
        sandboxes_dir: Path,
        runtime_root: Path,
        cgroup_parent: str = "shoal",
        default_cpu: float | None = None,
        state_root: Path | None = None,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.runtime_root = runtime_root
        self.state_root = state_root or runtime_root  # the OCI runtimes' --root (config.runtime_state_root)
        self.cgroup_parent = cgroup_parent
        self.agent_binary = str(agent_binary_path())
        self._runtimes: dict[str, OciRuntime | launcher.ShoalRuntime] = {}
        self.userns_base: int | None = settings.USERNS.get()
        self.default_disk_mb: int | None = settings.DEFAULT_DISK_MB.get()  # a cap for sandboxes that name none
        self.default_cpu = default_cpu  # the cap of sandboxes that name no cpu= (NodeSettings.default_cpu)
        self._private_mounts = PrivateMounts()
        self._shared: tuple[Path, Path] | None = None  # made on first use: _shared_dirs
        self._launcher = launcher.Launcher(self.agent_binary, runtime_root / "shoal-launcher.log", cgroup_parent)

    def agent(self, instance: Instance) -> AgentClient:
        """The agent client. Its socket is the agent handler's own (no VM bridge between), where a reset tells
        an exec request its handler never read: the exec step may let the agent hold the pid frame."""
        return AgentClient(str(instance.agent_socket), hold_pid=True)

    def runtime(self, name: str) -> OciRuntime | launcher.ShoalRuntime:
        if name not in self._runtimes:
            if name == launcher.NAME:  # (create checks the host: closing one must work whatever changed)
                self._runtimes[name] = launcher.ShoalRuntime(self._launcher)
            else:
                self._runtimes[name] = OciRuntime.find(name, self.state_root)
        return self._runtimes[name]

    async def close(self) -> None:
        """Stop the node's launcher (the sandboxes it made keep running until closed or re-adopted), and
        remove what spares of launchers that were killed left (an empty cgroup each: see launcher.py)."""
        await self._launcher.close()
        await asyncio.to_thread(launcher.remove_spare_cgroups, self.cgroup_parent)

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: Image, snapshot: str | None = None) -> Instance:
        if snapshot is not None:
            raise InvalidRequestError(
                f"snapshot={snapshot!r}: container sandboxes have no memory snapshots; commit an image with "
                "sb.snapshot(name) and create from it, or use kind microvm/vm"
            )
        runtime = self.runtime(spec.runtime)
        if isinstance(runtime, launcher.ShoalRuntime):
            launcher.check_host(self.userns_base)
        directory = self.sandboxes_dir / sandbox_id
        agent_dir = None if runtime.passes_fds else directory / "agent"
        instance = Instance(
            id=sandbox_id,
            kind=self.kind,
            directory=directory,
            agent_socket=(agent_dir or directory) / "agent.sock",
            cgroup_path=f"/{self.cgroup_parent}/{sandbox_id}",
            runtime=runtime.name,
        )
        directory.mkdir(parents=True)
        listener: socket.socket | None = None
        bundle = directory
        # crun only: runc resolves the rootfs as the mapped user (needs a world-traversable path); gVisor has
        # its own user isolation
        shift = self.userns_base if runtime.name == "crun" else None
        try:
            record = {"id": sandbox_id, "kind": self.kind, "runtime": runtime.name, "cgroup": instance.cgroup_path}
            _write(directory / "record.json", json.dumps(record))
            instance.record = record
            disk_mb = spec.disk_mb or self.default_disk_mb
            # crun and runc mount the overlay in a private namespace of each sandbox's own: one shared mount
            # point serves them all, and a layer of the node's gives the agent's mount point (see _shared_dirs)
            shared = runtime.own_mount_ns and shift is None  # the shoal launcher's too
            if disk_mb or shift is not None:  # formatting, copying, shifting: off the loop
                upper, overlay = await asyncio.to_thread(self._prepare_rootfs, directory, image, disk_mb, shift, shared)
            else:
                upper, overlay = self._prepare_rootfs(directory, image, shared=shared)
            instance.upper = str(upper)
            bundle = directory
            if shared:  # bundle files on tmpfs (_bundle_dir); the record implies it
                bundle = self._bundle_dir(sandbox_id)
                bundle.mkdir(parents=True)
                instance.agent_socket = bundle / "agent.sock"
            if isinstance(runtime, launcher.ShoalRuntime):
                listener = _listen(instance.agent_socket)
                cpu = spec.cpu if spec.cpu is not None else self.default_cpu
                fields = _launch_fields(instance, overlay, bundle / "runtime.log", cpu, spec.memory_mb, spec.pids)
                fields += [("tmpfs", path) for path in spec.tmpfs]
                known = functools.partial(setattr, instance, "pid")  # for the cleanup, even when cancelled
                pid = await self._launcher.create(fields, listener.fileno(), known)
                instance.rootfs = f"/proc/{pid}/root"
                return instance
            starter = None
            if runtime.own_mount_ns:
                starter = functools.partial(self._private_mounts.spawn, [overlay])
            else:
                linux.mount(overlay.source, overlay.target, overlay.fstype, 0, overlay.options)
                instance.rootfs = overlay.target
            cpu = spec.cpu if spec.cpu is not None else self.default_cpu
            agent = str(agent_dir) if agent_dir else None
            rootfs = overlay.target if shared else "rootfs"
            shape = (self.agent_binary, cpu, spec.memory_mb, spec.pids, agent, shift, tuple(spec.tmpfs), rootfs)
            config = _config_text(shape).replace(_CGROUP_TOKEN, instance.cgroup_path)
            if agent_dir:
                agent_dir.mkdir()
            _write(bundle / "config.json", config)
            if agent_dir is None:
                listener = _listen(instance.agent_socket)
            fd = listener.fileno() if listener else None
            await runtime.run_detached(sandbox_id, bundle, fd, bundle / "runtime.log", starter)
            if agent_dir is None:
                instance.pid = pid = int(_read(bundle / "pid"))
                _shield_from_oom_killer(pid)
                if starter is not None:
                    instance.rootfs = f"/proc/{pid}/root"
            else:
                await _wait_for_socket(instance.agent_socket, directory / "runtime.log")
        except BaseException:
            try:
                with contextlib.suppress(OSError, ValueError):  # `run -d` finished: kill its init directly,
                    if instance.pid is None:  # as close does
                        instance.pid = int((bundle / "pid").read_text())
                await asyncio.shield(self.destroy(instance))
            except Exception as exc:  # say why the cleanup failed; the create's own error is what it raises
                log.warning("could not clean up after the failed create of %s: %r", sandbox_id, exc)
            raise
        finally:
            if listener is not None:
                listener.close()
        return instance

    def _prepare_rootfs(
        self, directory: Path, image: Image, disk_mb: int | None = None, shift: int | None = None, shared: bool = False
    ) -> tuple[Path, Mount]:
        """Make the overlay's directories (the upper on the sandbox's own disk with disk_mb); return the upper
        and the overlay mount for rootfs/ (made by the caller: in the node's namespace or a private one), or,
        `shared`, for the node's one mount point with the node's agent mount point layer on top."""
        home = self.sandboxes_dir.parent
        base = disk.mount_disk(directory, home / "disk-templates", disk_mb, node_tag(home)) if disk_mb else directory
        layers = image.layers
        if shared:
            mountpoint, top = self._shared_dirs()
            target, layers = str(mountpoint), (*layers, top)
        else:
            target = str(directory / "rootfs")
            (directory / "rootfs").mkdir()
        for sub in ("upper", "work"):
            (base / sub).mkdir()
        if shift is not None:
            layers = userns.shifted_layers(layers, home / "userns-layers", shift)
            for path in (base / "upper", base / "work", directory / "rootfs"):
                os.chown(path, shift, shift)
        lowers = ":".join(str(layer) for layer in reversed(layers))
        options = f"lowerdir={lowers},upperdir={base / 'upper'},workdir={base / 'work'}"
        return base / "upper", Mount("overlay", target, "overlay", options)

    def _shared_dirs(self) -> tuple[Path, Path]:
        """The node's overlay mount point for crun and runc sandboxes, and its layer holding the agent's mount
        point (`/.shoal/agent`, an empty file), made once.

        Why (issue 12): each sandbox's overlay is mounted only in a mount namespace of its own (mountns.py), so
        one directory serves as every sandbox's mount point; and with the agent's mount point in a lower
        layer, the runtime's bind mount of the agent no longer creates `.shoal/agent` (and copies `.shoal`
        up) in the sandbox's upper. Each was a journalled ext4 directory or file made at every create and
        removed at every close (rmdir frees a directory's block: the node's costliest syscall per close)."""
        if self._shared is None:
            home = self.sandboxes_dir.parent
            mountpoint, top = home / "rootfs", home / "agent-mountpoint"
            mountpoint.mkdir(exist_ok=True)
            (top / ".shoal").mkdir(parents=True, exist_ok=True)
            (top / ".shoal" / "agent").touch(exist_ok=True)
            self._shared = (mountpoint, top)
        return self._shared

    def _bundle_dir(self, sandbox_id: str) -> Path:
        """Where a crun or runc sandbox's bundle files are (config.json, pid, runtime.log, agent.sock): beside
        the runtime's state, on tmpfs where the host has one (config.runtime_state_root). Why (issue 12):
        on the home's ext4 each was a journalled inode made at every create and freed at every close. They
        matter only while the sandbox runs (the node reaches its agent by the socket's path, kept in
        record.json); a reboot ends the sandbox with them. Derived from the sandbox's ID, so the record
        written before anything is made is enough to find and remove it."""
        return self.state_root / "bundles" / sandbox_id

    async def network_joining(self, instance: Instance) -> None:
        """A shoal-launcher sandbox's /sys shows the loopback of the launcher's template namespace (launcher.c,
        template_sysfs): it gets a sysfs of its own network namespace first, where the veth will show."""
        if instance.runtime == launcher.NAME and instance.pid is not None:
            await self._launcher.own_sysfs(instance.pid)

    async def readopt(self, instance: Instance) -> bool | None:
        """None (the node checks the agent's pid and cgroup); a shoal-launcher sandbox whose agent still runs in
        its cgroup gets a sysfs of its own first: the template its /sys cloned ended with the launcher that made
        it, and its loopback with it (launcher.c, own_sysfs)."""
        if instance.runtime == launcher.NAME and instance.pid is not None:
            await self._launcher.repair_sysfs(instance.pid, instance.cgroup_path)
        return None

    async def destroy(self, instance: Instance) -> None:
        runtime = self.runtime(instance.runtime or "crun")
        pid = instance.pid
        if not (pid and await runtime.kill_directly(instance.id, pid, instance.cgroup_path)):
            await runtime.delete(instance.id)
        bundle = str(self._bundle_dir(instance.id))  # crun's, runc's or the launcher's files (none: one syscall)
        await asyncio.to_thread(_remove_leftovers, instance.directory, instance.cgroup_path, bundle)

    async def destroy_orphan(self, directory: Path) -> None:
        try:
            record = json.loads((directory / "record.json").read_text())
        except (OSError, ValueError):
            record = {"id": directory.name, "runtime": "crun", "cgroup": f"/{self.cgroup_parent}/{directory.name}"}
        try:
            await self.runtime(record.get("runtime", "crun")).delete(record["id"])
        except Exception:  # runtime gone from this host: still remove mounts, cgroups and files
            pass
        bundle = str(self._bundle_dir(record["id"]))
        await asyncio.to_thread(_remove_leftovers, directory, record["cgroup"], bundle)

    async def pause(self, instance: Instance) -> None:
        runtime = self.runtime(instance.runtime or "crun")
        if isinstance(runtime, launcher.ShoalRuntime):
            await runtime.pause(instance.id, instance.cgroup_path)
        else:
            await runtime.pause(instance.id)

    async def resume(self, instance: Instance) -> None:
        runtime = self.runtime(instance.runtime or "crun")
        if isinstance(runtime, launcher.ShoalRuntime):
            await runtime.resume(instance.id, instance.cgroup_path)
        else:
            await runtime.resume(instance.id)


async def _wait_for_socket(path: Path, log: Path, timeout: float = 30.0) -> None:
    """The agent creates its socket itself under gVisor: wait until it accepts a connection (it exists a
    moment before the agent listens on it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _reader, writer = await asyncio.open_unix_connection(str(path))
            writer.close()
            return
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        if loop.time() > deadline:
            detail = log.read_text(errors="replace")[-500:] if log.exists() else ""
            raise SandboxLostError(f"the sandbox's agent did not come up within {timeout:.0f} s: {detail}")
        await asyncio.sleep(0.005)


def _listen(path: Path) -> socket.socket:
    """The agent's listening socket, made by the node and handed to the sandbox as its fd 3."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def _launch_fields(
    instance: Instance, overlay: Mount, log: Path, cpu: float | None, memory_mb: int | None, pids: int | None
) -> list[tuple[str, str]]:
    """One create request for the shoal launcher: the same limits bundle_config gives crun. No pid file: the
    launcher answers the pid and record.json keeps it (a node that dies before writing it finds the sandbox
    by its cgroup, whose processes the cleanup kills)."""
    fields = [
        ("rootfs", overlay.target),
        ("overlay", overlay.options),
        ("log", str(log)),
        ("cgroup", instance.cgroup_path.strip("/")),
        ("shares", str(cpu_shares(cpu))),
        ("hostname", "sandbox"),
    ]
    if memory_mb is not None:
        fields.append(("mem", str(memory_mb << 20)))
    if pids is not None:
        fields.append(("pids", str(pids)))
    if cpu is not None:
        fields += [("quota", str(int(cpu * CPU_PERIOD_US))), ("period", str(CPU_PERIOD_US))]
    return fields


def _shield_from_oom_killer(pid: int) -> None:
    """The agent must survive its sandbox's OOM kills (it resets the score for every command it runs)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as handle:
            handle.write("-1000")
    except OSError:
        pass


def _remove_leftovers(directory: Path, cgroup_path: str, bundle: str | None = None) -> None:
    """Kill stragglers, remove the cgroup, unmount the rootfs and delete the bundle (if elsewhere) and then
    the state directory (last: its record.json is what a restarted node finds the rest by)."""
    cgroups.remove(cgroup_path)
    if bundle is not None:
        linux.remove_directory(bundle)
    rootfs = directory / "rootfs"
    try:
        linux.umount(str(rootfs))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more): nothing to do
            raise SandboxLostError(f"could not unmount {rootfs}: {exc}") from exc
    disk.unmount_disk(directory)
    linux.remove_directory(str(directory), KNOWN_DIRS, KNOWN_FILES)


# What a sandbox's state directory holds after a plain create and close (besides files at its top): removed
# with one syscall each, deepest first. `.shoal/agent` is the mount point crun makes in the upper for the agent.
KNOWN_FILES = ("upper/.shoal/agent",)
KNOWN_DIRS = ("upper/.shoal", "upper", "work/work", "work", "rootfs", "disk", "agent")


_CGROUP_TOKEN = "@@shoal-cgroup-path@@"


@functools.lru_cache(maxsize=64)
def _config_text(shape: tuple) -> str:
    """config.json of one sandbox shape, rendered once: a create only puts its cgroup path in."""
    agent_binary, cpu, memory_mb, pids, agent_dir, shift, tmpfs, rootfs = shape
    config = bundle_config(
        hostname="sandbox", agent_binary=agent_binary, cgroup_path=_CGROUP_TOKEN, cpu=cpu, memory_mb=memory_mb,
        pids=pids, agent_dir=agent_dir, userns_base=shift, tmpfs=tmpfs, rootfs=rootfs,
    )  # fmt: skip
    return json.dumps(config)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)
