"""QEMU-backed substrates (`microvm`, `vm`): boot, template fast path, snapshot, restore, pause, resume.

Per sandbox, under its state directory:
    record.json   written first, so a crashed node can find and remove everything below
    base.qcow2    hard link to the snapshot disk it was restored from (so deleting that snapshot is safe)
    disk.qcow2    the VM's private writes, a thin overlay on base.qcow2 (or on the image's base disk)
    agent.sock    the node-side bridge socket: the same agent protocol as containers
    serial.sock qmp.sock console.log qemu.log qemu.pid   see machine.py
    paused.mem    memory and device state while paused

A snapshot (`<home>/vm-snapshots/<id>/`) is `memory` + `disk.qcow2` (standalone over the image's base
disk) + `meta.json` (the machine config a restore must reuse). Templates are snapshots taken once per
(kind, image, cpus, memory) right after the agent first answers; creates restore them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal import resources, settings
from shoal.errors import ImageError, InvalidRequestError, NotFoundError, SandboxLostError
from shoal.guest import AgentClient, AgentError
from shoal.images import Image
from shoal.protocol import SandboxSpec
from shoal.substrates.base import Capabilities, Instance, Substrate
from shoal.substrates.qemu import accel as accel_mod
from shoal.substrates.qemu import agentless
from shoal.substrates.qemu import screen as screen_mod
from shoal.substrates.qemu.bridge import AgentBridge
from shoal.substrates.qemu.disk import base_disk, file_part, overlay
from shoal.substrates.qemu.kernel import cache_dir, ensure_boot_files
from shoal.substrates.qemu.machine import Machine, MachineConfig, kill_recorded, recorded_pid

log = logging.getLogger("shoal.vm")

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{12}")


def check_snapshot_id(snap_id: object) -> str:
    """`snap_id` if it has the form sb.snapshot() returns. Never a path: a caller must not be able to make the
    node read a machine config (QEMU arguments) from a place of its choosing."""
    if not isinstance(snap_id, str) or not SNAPSHOT_ID.fullmatch(snap_id):
        raise InvalidRequestError(
            f"{snap_id!r} is not a snapshot id: ids look like snap-<12 hex digits>, as sb.snapshot() returns"
        )
    return snap_id


@dataclass
class Running:
    machine: Machine
    bridge: AgentBridge


class QemuSubstrate(Substrate):
    """Shared machinery; subclasses choose the machine type, kernel command line and base disk."""

    # disk_mb: free space left on the guest's root (the agent's hold, _fresh_identity). Re-adoption: QEMU runs
    # in its own session and outlives the node; the next node reconnects to its QMP and agent chardev sockets.
    capabilities = Capabilities(pause=True, memory_snapshots=True, readopt=True, guest_nic=True, disk_cap=True)
    machine_type = "q35"
    boot_mode = "microvm"
    default_screens: dict[str, tuple[int, int]] = {}  # image name -> the screen it gets when create names none
    slow_boots: dict[str, float] = {}  # image name -> seconds its cold boot may take at least (SHOAL_VM_BOOT_TIMEOUT)

    def __init__(self, home: Path, sandboxes_dir: Path, cache: Path | None = None) -> None:
        self.home = home
        self.sandboxes_dir = sandboxes_dir
        self.cache = cache or cache_dir()
        self.templates_dir = home / "vm-templates"
        self.snapshots_dir = home / "vm-snapshots"
        self.use_templates = settings.VM_TEMPLATES.get()
        self.shared_memory = settings.VM_SHARED_MEMORY.get()
        self.boot_timeout_s = settings.VM_BOOT_TIMEOUT.get()
        self._accel: accel_mod.Accel | None = None
        self._running: dict[str, Running] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------ configuration

    async def accel(self) -> accel_mod.Accel:
        if self._accel is None:
            self._accel = await asyncio.to_thread(accel_mod.detect, self.cache)
        return self._accel

    async def base_disk(self, image: Image) -> Path:
        """The shared read-only disk this kind boots `image` from (built once per host)."""
        return await asyncio.to_thread(base_disk, image, self.cache)

    async def _config(self, spec: SandboxSpec) -> MachineConfig:
        accel = await self.accel()
        boot = await asyncio.to_thread(ensure_boot_files, self.cache)
        cpus = max(1, math.ceil(spec.cpu)) if spec.cpu else 1
        memory = resources.memory_mb(self.kind, spec.memory_mb)
        if memory < 64:
            raise InvalidRequestError(f"memory_mb={memory}: a {self.kind} needs at least 64 MB")
        machine = self.machine_for(accel.name)
        cmdline = f"console=ttyS0 quiet panic=-1 shoal.mode={self.boot_mode} random.trust_cpu=on"
        # no_timer_check: on a loaded host a software-emulated guest can miss the kernel's IO-APIC timer test
        # and panic at boot ("IO-APIC + timer doesn't work!", seen at load 29 on 2 cores); QEMU's timer works.
        cmdline += " no_timer_check"
        if machine == "microvm" and accel.name == "tcg":  # no PIT/HPET reference: skip TSC calibration
            cmdline += " tsc_early_khz=1000000 tsc=reliable"
        screen = list(spec.screen or self.default_screens.get(spec.image, ())) or None
        if screen is not None:
            screen_mod.device_args(machine)  # refuses a machine without PCI
            cmdline += f" vga={screen_mod.vga_mode(*screen):#x}"  # the framebuffer console at that size
            cmdline += " vt.global_cursor_default=0"  # no blinking cursor: a still screen stays the same picture
            # The USB tablet stays awake: QEMU's tablet offers remote wakeup, so the guest suspends it after 2 s
            # idle and the next pointer event waits for a wakeup (hundreds of ms under TCG). Keys typed right
            # after a click then reach X before the pointer has moved into the window that should take them.
            cmdline += " usbcore.autosuspend=-1"
        return MachineConfig(
            machine=machine,
            accel=accel.name,
            cpus=cpus,
            memory_mb=memory,
            kernel=str(boot.kernel),
            initramfs=str(boot.initramfs),
            cmdline=cmdline,
            screen=screen,
        )

    async def _disk_config(self, spec: SandboxSpec, boot: agentless.DiskBoot) -> MachineConfig:
        """An agentless VM's machine: the image's own boot (its disk's loader, or its kernel), a screen, and
        QEMU's user-mode network in QEMU's namespace (agentless.py)."""
        accel = await self.accel()
        memory = resources.memory_mb(self.kind, spec.memory_mb)
        if boot.kernel is None and spec.screen:
            raise InvalidRequestError(
                f"screen={tuple(spec.screen)}: a disk image boots its own loader and picks its own screen size "
                "(Android-x86: video=WxH on its kernel command line); leave screen unset"
            )
        screen = list(spec.screen) if spec.screen else list(screen_mod.DEFAULT_VM_SCREEN)
        cmdline = boot.append
        if boot.kernel is not None and spec.screen and "vga=" not in cmdline:
            cmdline += f" vga={screen_mod.vga_mode(*screen):#x}"
        return MachineConfig(
            machine="q35",  # a screen needs PCI
            accel=accel.name,
            cpus=max(1, math.ceil(spec.cpu)) if spec.cpu else 1,
            memory_mb=memory,
            kernel=str(boot.kernel or ""),
            initramfs=str(boot.initrd or ""),
            cmdline=cmdline.strip(),
            screen=screen,
            net="user",
            disk_bus=boot.disk_bus,
            nic_model=boot.nic_model,
            agentless=True,
            ready_port=boot.ready_port,
        )

    def machine_for(self, accel: str) -> str:
        """The QEMU machine type; SHOAL_<KIND>_MACHINE=q35|microvm overrides."""
        return settings.get(f"SHOAL_{self.kind.upper()}_MACHINE") or self.machine_type

    # ------------------------------------------------------------ create / destroy

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: Image, snapshot: str | None = None) -> Instance:
        disk_image = agentless.is_agentless(image)
        if disk_image:
            if self.kind != "vm":
                raise InvalidRequestError(f"image {image.name!r} is a disk image: create it as kind='vm'")
            agentless.refuse_agent_fields(spec, image.name)
        directory = self.sandboxes_dir / sandbox_id
        instance = Instance(
            id=sandbox_id,
            kind=self.kind,
            directory=directory,
            agent_socket=directory / "agent.sock",
            cgroup_path=f"/shoal-vm/{sandbox_id}",
        )
        directory.mkdir(parents=True)
        (directory / "record.json").write_text(
            json.dumps({"id": sandbox_id, "kind": self.kind, "cgroup": instance.cgroup_path})
        )
        try:
            bridge = AgentBridge(instance.agent_socket)
            await bridge.start()
            self._running[sandbox_id] = Running(machine=None, bridge=bridge)  # type: ignore[arg-type]
            console = False  # a cold boot starts the screen's console after the identity (templates have it)
            if snapshot is not None:
                source = self.snapshot_dir(snapshot)
                if not (source / "meta.json").exists():
                    raise NotFoundError(f"no snapshot {snapshot!r} on this node (deleted, or made by another node)")
                await self._restore(instance, source)
            elif disk_image:  # booted each time (no template: its readiness is the guest's, not an agent's)
                boot = await asyncio.to_thread(agentless.disk_boot, image)
                await asyncio.to_thread(agentless.check_disk, boot.disk)
                config = await self._disk_config(spec, boot)
                await asyncio.to_thread(overlay, directory / "disk.qcow2", boot.disk)
                await self._boot(directory, config, bridge)
            elif self.use_templates:
                template = await self._template(spec, image)
                await self._restore(instance, template, shared=True)
            else:
                config = await self._config(spec)
                disk = await self.base_disk(image)
                await asyncio.to_thread(overlay, directory / "disk.qcow2", disk)
                await self._boot(directory, config, bridge, image.name)
                console = bool(config.screen)
            if not self._running[sandbox_id].machine.config.agentless:  # no agent to give it one, nor limits
                await self._fresh_identity(instance, spec)
            if console:
                await _start_console(AgentClient(str(instance.agent_socket)))
            instance.pid = self._running[sandbox_id].machine.pid
        except BaseException:
            await asyncio.shield(self.destroy(instance))
            raise
        return instance

    async def _boot(self, directory: Path, config: MachineConfig, bridge: AgentBridge, image: str = "") -> Machine:
        """Cold boot on `directory/disk.qcow2` until the agent answers (an agentless VM: until `_guest_ready`);
        the console tail if it never does."""
        timeout = max(self.boot_timeout_s, self.slow_boots.get(image, 0.0))
        machine = Machine(directory, config, directory / "disk.qcow2")
        running = self._running.get(directory.name)
        if running is not None:
            running.machine = machine
        try:
            await machine.start()
            await bridge.attach(machine.serial_path)
            agent = AgentClient(str(bridge.listen_path))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                assert machine.exited is not None
                if machine.exited.done():
                    raise SandboxLostError(f"the {self.kind} guest stopped during boot: {machine.log_tail()}")
                try:
                    if config.agentless:
                        if await self._guest_ready(machine):
                            return machine
                    else:
                        await asyncio.wait_for(agent.hello(), 1.0)
                        return machine
                except (TimeoutError, ConnectionError, OSError):
                    pass
                if loop.time() > deadline:
                    waited = config.agentless and config.ready_port
                    port = f", port {config.ready_port} did not answer" if waited else ""
                    raise SandboxLostError(
                        f"the {self.kind} guest did not become ready in {timeout:g} s{port} "
                        f"(SHOAL_VM_BOOT_TIMEOUT); console tail: {machine.log_tail()}"
                    )
                await asyncio.sleep(0.05)
        except BaseException:
            await machine.kill()
            raise

    async def _guest_ready(self, machine: Machine) -> bool:
        """An agentless guest is ready when QEMU runs it and its ready port (if any) takes a connection."""
        if (await machine.qmp("query-status"))["status"] != "running":
            return False
        port = machine.config.ready_port
        if not port:
            return True
        assert machine.pid is not None
        return await agentless.guest_port_open(machine.pid, machine.hmp, port, machine.forwarded)

    async def _restore(self, instance: Instance, source: Path, shared: bool = False) -> None:
        """Start a copy of snapshot `source`. Templates (`shared`) outlive the node's sandboxes and back
        their overlays directly; a user snapshot's disk is linked or copied so it can be deleted any time."""
        meta = json.loads((source / "meta.json").read_text())
        config = MachineConfig.from_json(meta["config"])
        directory = instance.directory
        backing = source / "disk.qcow2"
        if not shared:
            backing = directory / "base.qcow2"
            await asyncio.to_thread(_link_or_copy, source / "disk.qcow2", backing)
        await asyncio.to_thread(overlay, directory / "disk.qcow2", backing)
        machine = Machine(directory, config, directory / "disk.qcow2")
        running = self._running[instance.id]
        running.machine = machine
        await machine.start(incoming=source / "memory")
        await machine.wait_incoming()
        await running.bridge.attach(machine.serial_path)

    async def _fresh_identity(self, instance: Instance, spec: SandboxSpec) -> None:
        """Every create ends here (boot, template or snapshot): the guest gets its own identity and this
        sandbox's limits (pids on the guest's commands cgroup, disk_mb as free space on its root)."""
        agent = AgentClient(str(instance.agent_socket))
        hostname = "sb-" + instance.id.rsplit("-", 1)[-1]
        identity = agent.identity(
            hostname, uuid.uuid4().hex, secrets.token_bytes(64), time.time_ns(), spec.pids or 0, spec.disk_mb or 0
        )
        try:
            await asyncio.wait_for(identity, 60)
        except AgentError as exc:  # it answered, but could not apply them: a limit that does not hold is refused
            raise SandboxLostError(f"the {self.kind} guest could not take its limits: {exc}") from exc
        except (TimeoutError, ConnectionError, OSError) as exc:
            machine = self._running[instance.id].machine
            raise SandboxLostError(f"the new {self.kind} did not answer: {exc}; {machine.log_tail()}") from exc

    async def _template(self, spec: SandboxSpec, image: Image) -> Path:
        """The snapshot every create of this (kind, image, cpus, memory) restores; booted once."""
        config = await self._config(spec)
        disk = await self.base_disk(image)
        identity = hashlib.sha256(
            json.dumps([config.to_json(), disk.name, self.shared_memory], sort_keys=True).encode()
        ).hexdigest()
        key = f"{self.kind}-{file_part(image.name)}-{config.cpus}c-{config.memory_mb}m-{config.accel}-{identity[:12]}"
        target = self.templates_dir / key
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if (target / "meta.json").exists():
                return target
            self.templates_dir.mkdir(parents=True, exist_ok=True)
            build = self.templates_dir / f".build-{secrets.token_hex(4)}"
            build.mkdir()
            bridge = AgentBridge(build / "agent.sock")
            machine: Machine | None = None
            try:
                await bridge.start()
                await asyncio.to_thread(overlay, build / "disk.qcow2", disk)
                boot_config = config
                if self.shared_memory:
                    boot_config = MachineConfig(**{**config.to_json(), "memory_file": str(build / "ram"),
                                                   "memory_shared": True})  # fmt: skip
                    config = MachineConfig(**{**config.to_json(), "memory_file": str(target / "ram")})
                started = time.monotonic()
                machine = await self._boot(build, boot_config, bridge, image.name)
                booted = time.monotonic() - started
                if config.screen:
                    await _start_console(AgentClient(str(bridge.listen_path)))
                await machine.save(build / "memory")
                await machine.kill()
                meta_data = {"config": config.to_json(), "kind": self.kind, "image": image.name, "boot_s": booted}
                (build / "meta.json").write_text(json.dumps(meta_data))
                for name in list(os.listdir(build)):
                    if name not in ("memory", "disk.qcow2", "meta.json", "ram"):
                        (build / name).unlink(missing_ok=True)
                os.replace(build, target)
                log.info("template %s: booted in %.1f s (%s)", key, booted, config.accel)
            finally:
                await bridge.close()
                if machine is not None:
                    await machine.kill()
                shutil.rmtree(build, ignore_errors=True)
        return target

    async def destroy(self, instance: Instance) -> None:
        running = self._running.pop(instance.id, None)
        if running is not None:
            await running.bridge.close()
            if running.machine is not None:
                await running.machine.kill()
        await asyncio.to_thread(_remove_dir, instance.directory)

    async def destroy_orphan(self, directory: Path) -> None:
        running = self._running.pop(directory.name, None)  # taken over, then found unusable (a network)
        if running is not None:
            await running.bridge.close()
            await running.machine.detach()
        await asyncio.to_thread(_remove_dir, directory)

    # ------------------------------------------------------------ pause / resume / snapshot

    def _machine(self, instance: Instance) -> Running:
        running = self._running.get(instance.id)
        if running is None or running.machine is None:
            raise SandboxLostError(f"{self.kind} {instance.id} has no QEMU process")
        return running

    async def pause(self, instance: Instance) -> None:
        """Save memory and device state to disk and stop QEMU: a paused VM holds no RAM."""
        running = self._machine(instance)
        await running.machine.save(instance.directory / "paused.mem")
        await running.bridge.detach()
        await running.machine.kill()

    async def resume(self, instance: Instance) -> None:
        running = self._machine(instance)
        machine = Machine(instance.directory, running.machine.config, instance.directory / "disk.qcow2")
        running.machine = machine
        await machine.start(incoming=instance.directory / "paused.mem")
        await machine.wait_incoming()
        (instance.directory / "paused.mem").unlink()
        await running.bridge.attach(machine.serial_path)
        instance.pid = machine.pid  # a new QEMU, in a new network namespace (the node plugs its network again)

    async def readopt(self, instance: Instance) -> bool:
        """Take over a VM an earlier node left: its QEMU (found by qemu.pid, checked by its command line) still
        runs, or it was paused (paused.mem, no QEMU). Returns whether it is paused."""
        directory = instance.directory
        try:
            config = MachineConfig.from_json(json.loads((directory / "machine.json").read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise SandboxLostError(f"its machine.json is unreadable ({exc})") from None
        pid = recorded_pid(directory)
        paused = pid is None and (directory / "paused.mem").exists()
        if pid is None and not paused:
            raise SandboxLostError("its QEMU process no longer runs")
        machine = Machine(directory, config, directory / "disk.qcow2")
        with contextlib.suppress(FileNotFoundError):
            instance.agent_socket.unlink()  # the dead node's listening socket
        bridge = AgentBridge(instance.agent_socket)
        self._running[instance.id] = Running(machine=machine, bridge=bridge)
        try:
            await bridge.start()
            if pid is not None:
                await machine.adopt(pid)
                await bridge.attach(machine.serial_path)
        except BaseException as exc:
            self._running.pop(instance.id, None)
            await bridge.close()
            await machine.detach()
            if isinstance(exc, Exception):
                raise SandboxLostError(f"its QEMU (pid {pid}) could not be taken over: {exc}") from None
            raise
        instance.pid = pid
        return paused

    def guest_network_argv(self, address: str, gateway: str) -> list[str]:
        """A shell script for the guest: its one NIC (eth0, or what udev named it) gets `address`/30, a default
        route via `gateway`, no IPv6. A microvm uses the busybox its initramfs put in /.shoal; a vm, its own."""
        script = (
            'PATH="$PATH:/usr/sbin:/sbin"; [ -x /.shoal/busybox ] && ip() { /.shoal/busybox ip "$@"; }\n'
            'dev=""; for d in /sys/class/net/*; do [ "${d##*/}" = lo ] || dev=${d##*/}; done\n'
            '[ -n "$dev" ] || { echo "the guest has no network interface" >&2; exit 1; }\n'
            "echo 1 > /proc/sys/net/ipv6/conf/$dev/disable_ipv6 2>/dev/null\n"
            f"ip addr flush dev $dev && ip addr add {address}/30 dev $dev && ip link set $dev up "
            f"&& ip route replace default via {gateway}\n"
        )
        shell = ["/.shoal/busybox", "sh"] if self.boot_mode == "microvm" else ["/bin/sh"]
        return [*shell, "-c", script]

    async def snapshot(self, instance: Instance, image_name: str) -> str:
        """Capture memory and disk of the running VM as a snapshot other creates can restore."""
        running = self._machine(instance)
        snap_id = f"snap-{secrets.token_hex(6)}"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        build = self.snapshots_dir / f".build-{snap_id}"
        build.mkdir()
        try:
            await running.machine.save(build / "memory")
            try:
                await asyncio.to_thread(_flatten, instance.directory / "disk.qcow2", build / "disk.qcow2")
            finally:
                await running.machine.qmp("cont")
            meta = {"config": running.machine.config.to_json(), "kind": self.kind, "image": image_name}
            (build / "meta.json").write_text(json.dumps(meta))
            os.replace(build, self.snapshots_dir / snap_id)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        return snap_id

    def snapshot_dir(self, snap_id: str) -> Path:
        """Where snapshot `snap_id` lives (the id checked: never a path)."""
        return self.snapshots_dir / check_snapshot_id(snap_id)

    def snapshot_meta(self, snap_id: str) -> dict:
        meta = self.snapshot_dir(snap_id) / "meta.json"
        try:
            return json.loads(meta.read_text())
        except (OSError, ValueError):
            raise NotFoundError(f"no snapshot {snap_id!r} on this node (deleted, or made by another node)") from None

    def delete_snapshot(self, snap_id: str) -> None:
        shutil.rmtree(self.snapshot_dir(snap_id), ignore_errors=True)

    def delete_all_snapshots(self) -> None:
        """Snapshots live as long as the node that made them (sandboxes keep their own copies)."""
        shutil.rmtree(self.snapshots_dir, ignore_errors=True)

    def reconcile(self) -> None:
        """After a node crash: stop template boots it left running and drop them and its snapshots."""
        for build in [*self.templates_dir.glob(".build-*"), *self.snapshots_dir.glob(".build-*")]:
            _remove_dir(build)
        self.delete_all_snapshots()

    def screen(self, instance: Instance) -> screen_mod.QmpScreen | None:
        """The VM's display driven over QMP, if it was made with one (its machine config says)."""
        running = self._machine(instance)
        size = running.machine.config.screen
        if not size:
            return None

        async def qmp(command: str, **arguments: object) -> object:
            return await self._machine(instance).machine.qmp(command, **arguments)  # the machine changes on resume

        follow = running.machine.config.agentless and not running.machine.config.kernel  # the guest picks its size
        return screen_mod.QmpScreen(qmp, instance.directory, size[0], size[1], follow_size=follow)

    def agentless(self, instance: Instance) -> bool:
        running = self._running.get(instance.id)
        return bool(running and running.machine and running.machine.config.agentless)

    def agent(self, instance: Instance) -> Any:
        """The agent client, or for an agentless VM the stand-in whose ports are QEMU's forwards."""
        if not self.agentless(instance):
            return super().agent(instance)

        def running() -> bool:
            current = self._running.get(instance.id)
            return bool(current and current.machine and current.machine.running)

        return agentless.NoAgent(instance.id, running, lambda port: self.open_guest_port(instance, port))

    async def open_guest_port(self, instance: Instance, port: int) -> agentless.Stream:
        """A byte stream to TCP `port` of an agentless guest (QEMU's forward in its namespace; the machine
        changes on resume, so it is looked up each time)."""
        machine = self._machine(instance).machine
        if machine.pid is None or not machine.running:
            raise SandboxLostError(f"{self.kind} {instance.id} has no QEMU process")
        return await agentless.open_guest_port(machine.pid, machine.hmp, port, machine.forwarded)

    def loss_detail(self, instance: Instance) -> str:
        """The console's tail: a guest kernel panic or an agent crash shows there."""
        running = self._running.get(instance.id)
        return running.machine.log_tail() if running and running.machine else ""


# What a VM's screen shows before its template is saved. An image with its own X session (vm-desktop: an
# /etc/shoal/xsession that marks /run/shoal-desktop-ready once its xterm is on the screen) is waited for; a
# template saved earlier would make every copy boot Xorg again. Other guests that have bash (shoal's Debian)
# get a root shell on the first virtual console, waited for until its prompt is on the screen (/dev/vcs1): a
# template saved before the shell opened its terminal would drop the first keys its copies get (a console
# nobody has open discards input). Guests without either show whatever their own init puts on the screen.
_CONSOLE = """if [ -e /etc/shoal/xsession ]; then
  end=$(($(date +%s) + 600)); while [ "$(date +%s)" -lt $end ] && [ ! -e /run/shoal-desktop-ready ]; do sleep 0.2; done
  [ -e /run/shoal-desktop-ready ] && exit 0
  systemctl status --no-pager -n 30 shoal-desktop.service; tail -n 30 /var/log/Xorg.0.log; exit 1
fi
test -x /bin/bash || exit 0
setsid -f /bin/bash -c 'exec /bin/bash -l <>/dev/tty1 >&0 2>&1'
i=0; while [ $i -lt 1200 ] && ! grep -q '[#$] *$' /dev/vcs1 2>/dev/null; do sleep 0.1; i=$((i+1)); done"""


async def _start_console(agent: AgentClient) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "TERM": "linux", "LANG": "C.UTF-8"}
    proc = await agent.exec(["/bin/sh", "-c", _CONSOLE], env=env, cwd="/", merge_stderr=True)
    try:
        out, _, exit_info = await asyncio.wait_for(proc.collect(), 660)
    finally:
        await proc.close()
    if exit_info.exit_code != 0:
        tail = out.decode(errors="replace")[-2000:]
        raise SandboxLostError(f"the VM's desktop did not come up in 600 s: {tail}")


def _flatten(source: Path, target: Path) -> None:
    """Copy a VM's disk chain into one qcow2 over the image's base disk (independent of its sandbox)."""
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--backing-chain", "--output=json", "-U", str(source)],
            capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    bottom, bottom_format = info[-1]["filename"], info[-1]["format"]  # an agentless VM's base disk is a qcow2
    proc = subprocess.run(
        ["qemu-img", "convert", "-U", "-O", "qcow2", "-B", bottom, "-F", bottom_format, str(source), str(target)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ImageError(f"copying the disk of {source.parent.name} failed: {proc.stderr.strip()}")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another mount (the node's sandboxes directory is its own bind mount): copy, sparsely
        subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(source), str(target)], check=True)


def _remove_dir(directory: Path) -> None:
    kill_recorded(directory)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(directory)
