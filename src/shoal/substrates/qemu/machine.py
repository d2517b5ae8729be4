"""One QEMU process: its command line, its QMP control socket, save (migrate to a file) and restore.

A machine's files live in its sandbox directory: `qmp.sock` (control), `serial.sock` (the agent's
virtio-serial chardev), `console.log` (the guest's serial console), `qemu.log`, `qemu.pid`, and
`machine.json` (its config, so a restarted node can take over the running process: `Machine.adopt`).

Network: every machine has one virtio-net NIC (templates too: a restored machine needs the same devices),
backed by a tap in a network namespace of QEMU's own, where the tap is enslaved to a bridge `br0`. With
no network policy that namespace has nothing else, so the NIC reaches nothing; a policy adds a veth into
it exactly as for a container (node/network.py enslaves its end to `br0`), so containers and VMs share the
same addresses, nftables rules and resolver. The namespace lives and dies with QEMU: nothing to clean up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal import settings
from shoal.errors import SandboxLostError
from shoal.substrates.qemu import screen as screen_mod

QEMU = settings.QEMU.get()
GUEST_MAC = "52:54:00:5a:00:01"  # every guest's NIC: each is alone on its own bridge
# Run in QEMU's new network namespace (`unshare --net`) before it execs QEMU: the tap its NIC uses, on a bridge.
NETNS_SETUP = "\n".join([
    "link add br0 type bridge", "tuntap add dev tap0 mode tap", "link set tap0 master br0", "link set tap0 up",
    "link set br0 up", "",
])  # fmt: skip


class QmpError(SandboxLostError):
    """QEMU refused a control command or went away."""


@dataclass
class MachineConfig:
    """What fixes a machine's device model: a restored machine must be started with the same values."""

    machine: str  # "q35" or "microvm"
    accel: str  # "kvm" or "tcg"
    cpus: int
    memory_mb: int
    kernel: str
    initramfs: str
    cmdline: str
    extra_args: list[str] = field(default_factory=list)
    # Guest RAM in a file: a template boots with it shared (the RAM *is* the file, so its snapshot holds
    # only device state) and its copies map it privately (copy-on-write from the shared page cache).
    memory_file: str = ""
    memory_shared: bool = False
    screen: list[int] | None = None  # [width, height]: a VGA display and a USB tablet (qemu/screen.py)
    nic: bool = True  # a virtio-net NIC on a tap in QEMU's own network namespace (see the module doc)
    # Agentless VMs (a user's disk image: agentless.py): "user" is QEMU's own user-mode network (DHCP for
    # the guest, restrict=on: no route out), still inside QEMU's network namespace, so the ports it forwards
    # from 127.0.0.1 exist only there; the disk bus and NIC model a guest without virtio drivers may need.
    net: str = "tap"  # "tap" or "user"
    disk_bus: str = "virtio"  # "virtio" or "sata"
    nic_model: str = "virtio"  # "virtio" or "e1000"
    agentless: bool = False  # no shoal agent in the guest: ready when QEMU runs (agentless.py)
    ready_port: int | None = None  # agentless: ready once a TCP connection to this guest port is established

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineConfig:
        return cls(**data)


class Machine:
    """A QEMU process started from `config` on `disk`, controlled over QMP."""

    def __init__(self, directory: Path, config: MachineConfig, disk: Path) -> None:
        self.directory = directory
        self.config = config
        self.disk = disk
        self.pid: int | None = None
        self.exited: asyncio.Future[int] | None = None
        self._pidfd: int | None = None
        self._qmp_reader: asyncio.StreamReader | None = None
        self._qmp_writer: asyncio.StreamWriter | None = None
        self._qmp_lock = asyncio.Lock()
        self.forwarded: set[int] = set()  # user-mode network: guest ports QEMU forwards (agentless.py)

    @property
    def qmp_path(self) -> Path:
        return self.directory / "qmp.sock"

    @property
    def serial_path(self) -> Path:
        return self.directory / "serial.sock"

    @property
    def console_path(self) -> Path:
        return self.directory / "console.log"

    def argv(self, incoming: Path | None = None) -> list[str]:
        c = self.config
        virtio = "device" if c.machine == "microvm" else "pci"
        machine = "microvm,pit=on,pic=on,rtc=on,isa-serial=on" if c.machine == "microvm" else "q35"
        memory: list[str] = []
        if c.memory_file:
            machine += ",memory-backend=mem"
            share = "on" if c.memory_shared else "off"
            memory = [
                "-object",
                f"memory-backend-file,id=mem,size={c.memory_mb}M,mem-path={c.memory_file},share={share}",
            ]
        argv = [
            QEMU,
            "-name", f"shoal-{self.directory.name}",
            "-machine", machine,
            "-accel", c.accel,
            "-cpu", "host" if c.accel == "kvm" else "max",
            "-smp", str(c.cpus),
            "-m", str(c.memory_mb), *memory,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            *(["-kernel", c.kernel, "-append", c.cmdline] if c.kernel else []),
            *(["-initrd", c.initramfs] if c.kernel and c.initramfs else []),
            "-chardev", f"file,id=console,path={self.console_path}",
            "-serial", "chardev:console",
            "-drive", f"file={self.disk},if=none,id=disk0,format=qcow2,cache=unsafe,discard=unmap",
            "-device", (f"virtio-blk-{virtio},drive=disk0,id=blk0" if c.disk_bus == "virtio"
                        else "ide-hd,bus=ide.0,drive=disk0,id=blk0") + ("" if c.kernel else ",bootindex=0"),
            "-device", f"virtio-serial-{virtio},id=vser0",
            "-chardev", f"socket,id=agent,path={self.serial_path},server=on,wait=off",
            "-device", "virtserialport,bus=vser0.0,chardev=agent,name=shoal.agent,id=port0",
            "-object", "rng-random,filename=/dev/urandom,id=rng0",
            "-device", f"virtio-rng-{virtio},rng=rng0,id=rng0dev",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-pidfile", str(self.directory / "qemu.pid"),
            *(screen_mod.device_args(c.machine, self.directory) if c.screen else []),
        ]  # fmt: skip
        if c.nic:
            tap = "tap,id=net0,ifname=tap0,script=no,downscript=no"
            netdev = "user,id=net0,restrict=on" if c.net == "user" else tap
            model = "e1000" if c.nic_model == "e1000" else f"virtio-net-{virtio}"
            argv += ["-netdev", netdev, "-device", f"{model},netdev=net0,id=nic0,mac={GUEST_MAC}"]
        argv += c.extra_args
        if incoming is not None:
            argv += ["-incoming", "defer"]
        return argv

    async def start(self, incoming: Path | None = None) -> None:
        """Start QEMU (restoring from `incoming` if given) and connect to its QMP socket."""
        for stale in (self.qmp_path, self.serial_path):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        log = self.directory / "qemu.log"
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        argv = self.argv(incoming)
        if shutil.which(argv[0]) is None:
            raise QmpError(f"{QEMU} not found: `apt-get install qemu-system-x86` (or set SHOAL_QEMU)")
        if self.config.nic:  # same pid: unshare and sh exec, so QEMU is the process that owns the namespace
            setup = NETNS_SETUP if self.config.net != "user" else "link set lo up\n"  # user mode: loopback only
            script = f"printf '{setup}' | ip -batch - && exec \"$@\""
            argv = ["unshare", "--net", "--", "sh", "-c", script, "shoal-netns", *argv]
        (self.directory / "machine.json").write_text(json.dumps(self.config.to_json()))
        self.pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions, setsid=True)
        self._watch()
        await self._connect(incoming)

    async def adopt(self, pid: int) -> None:
        """Take over QEMU process `pid` that an earlier node started (it is not our child: its exit is
        seen through a pidfd and its status is unknown). Its QMP socket accepts the new connection."""
        self.pid = pid
        self._watch()
        await self._connect(None)

    def _watch(self) -> None:
        assert self.pid is not None
        loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
        self._pidfd = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    async def _connect(self, incoming: Path | None) -> None:
        assert self.exited is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            if self.exited.done():
                raise QmpError(f"QEMU exited at start ({self.exited.result()}): {self.log_tail()}")
            try:
                self._qmp_reader, self._qmp_writer = await asyncio.open_unix_connection(str(self.qmp_path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise QmpError(f"QEMU did not open its control socket in 10 s: {self.log_tail()}") from None
                await asyncio.sleep(0.005)
        await self._qmp_reader.readline()  # greeting
        await self.qmp("qmp_capabilities")
        if incoming is not None:
            await self._ignore_shared()
            await self.qmp("migrate-incoming", uri=f"exec:cat {shlex.quote(str(incoming))}")

    async def _ignore_shared(self) -> None:
        """RAM in a shared file is not copied into (or out of) the migration stream: the file holds it."""
        if self.config.memory_file:
            await self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])

    def _on_exit(self) -> None:
        assert self._pidfd is not None and self.pid is not None and self.exited is not None
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -1
        if not self.exited.done():
            self.exited.set_result(code)

    @property
    def running(self) -> bool:
        return self.exited is not None and not self.exited.done()

    async def qmp(self, command: str, **arguments: Any) -> Any:
        """Run one QMP command and return its result (events in between are skipped)."""
        if self._qmp_writer is None or self._qmp_reader is None:
            raise QmpError("QEMU is not running")
        async with self._qmp_lock:
            message: dict[str, Any] = {"execute": command}
            if arguments:
                message["arguments"] = arguments
            try:
                self._qmp_writer.write(json.dumps(message).encode() + b"\n")
                await self._qmp_writer.drain()
                while True:
                    line = await self._qmp_reader.readline()
                    if not line:
                        raise QmpError(f"QEMU closed its control socket during {command}: {self.log_tail()}")
                    reply = json.loads(line)
                    if "return" in reply:
                        return reply["return"]
                    if "error" in reply:
                        raise QmpError(f"QEMU refused {command}: {reply['error'].get('desc')}")
            except (ConnectionError, OSError) as exc:
                raise QmpError(f"QEMU control socket failed during {command}: {exc}") from exc

    async def hmp(self, command_line: str) -> str:
        """A human-monitor command (for what QMP lacks: `hostfwd_add`, `info usernet`); its printed answer."""
        return str(await self.qmp("human-monitor-command", **{"command-line": command_line}))

    async def wait_incoming(self, timeout: float = 60.0) -> None:
        """Wait until a restore (`-incoming`) has loaded the whole state, then run the guest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status = (await self.qmp("query-status"))["status"]
            if status not in ("inmigrate", "prelaunch"):
                break
            migration = await self.qmp("query-migrate")
            if migration.get("status") == "failed":
                raise QmpError(f"restore failed: {migration.get('error-desc', 'unknown')}: {self.log_tail()}")
            if loop.time() > deadline:
                raise QmpError(f"restore did not finish in {timeout:g} s")
            await asyncio.sleep(0.005)
        if status != "running":
            await self.qmp("cont")

    async def save(self, path: Path, timeout: float = 120.0) -> None:
        """Stop the guest and write its memory and device state to `path` (the guest stays stopped)."""
        await self.qmp("stop")
        await self._ignore_shared()
        await self.qmp("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
        await self.qmp("migrate", uri=f"exec:cat > {shlex.quote(str(path))}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self.qmp("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise QmpError(f"snapshot failed: {info.get('error-desc', status)}")
            if loop.time() > deadline:
                await self.qmp("migrate_cancel")
                raise QmpError(f"snapshot did not finish in {timeout:g} s")
            await asyncio.sleep(0.005)

    async def kill(self) -> None:
        """Stop QEMU at once and reap it. Idempotent."""
        if self._qmp_writer is not None:
            self._qmp_writer.close()
            self._qmp_writer = self._qmp_reader = None
        if self.pid is not None and self.exited is not None and not self.exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.exited), 10)
        for path in (self.qmp_path, self.serial_path, self.directory / "qemu.pid", self.directory / "vnc.sock"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    async def detach(self) -> None:
        """Stop watching QEMU and drop the control connection, leaving the process as it is."""
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._qmp_writer is not None:
            self._qmp_writer.close()
            self._qmp_writer = self._qmp_reader = None

    def log_tail(self, limit: int = 1500) -> str:
        parts = []
        for path in (self.directory / "qemu.log", self.console_path):
            with contextlib.suppress(OSError):
                text = path.read_bytes()[-limit:].decode(errors="replace").strip()
                if text:
                    parts.append(f"[{path.name}] {text}")
        return " | ".join(parts) or "(no output)"


def recorded_pid(directory: Path) -> int | None:
    """The pid in `directory/qemu.pid` if that process still runs and is ours (its command line names the dir)."""
    try:
        pid = int((directory / "qemu.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if f"shoal-{directory.name}\0".encode() in cmdline else None


def kill_recorded(directory: Path) -> None:
    """Kill a QEMU recorded in `directory/qemu.pid` if it is still ours."""
    pid = recorded_pid(directory)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
