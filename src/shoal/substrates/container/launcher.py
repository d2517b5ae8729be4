"""runtime="shoal": containers made by shoal's own pre-forked launcher (launcher.c) instead of an OCI runtime.

Why (issue 12): a create through crun costs an exec and dynamic link of the runtime, a config.json parse and
a re-derivation of the same namespaces, mounts, limits, capabilities and seccomp filter each time (~9 CPU-ms
of a `crun run -d` here, most of a create). The launcher is started once per node and told once what every
sandbox gets (oci.py's capabilities, masked and read-only paths, devices, seccomp.py's compiled filter);
a create is then one message over a socketpair carrying the agent's listening socket, and the launcher
does only the kernel's part: clone into new pid/net/ipc/uts/mount namespaces, the cgroup (limits written
and joined before the child runs a step of its own), then in the child a cgroup namespace, the overlay
mounted in the sandbox's own mount namespace, /proc, /dev, /sys, masks, pivot_root, hostname, rlimits,
capabilities, no_new_privs, seccomp, exec of the agent. The same isolation as the crun bundle
(tests/test_hardening.py runs every escape attempt under it).

What does not depend on the request is done ahead, while the launcher waits (launcher.c, "the spare"): the
next sandbox's init is cloned into its pid/net/ipc/uts namespaces, makes its /sys, /proc, /dev (devices,
devpts, shm, mqueue) and the agent's bind as detached mounts (moved into its root after pivot_root), brings
its loopback up, drops the capability bounding set and waits in a cgroup made for the next sandbox
(`<parent>/.spare-<launcher pid>-<n>`, with the last create's limits); a create renames that cgroup to the
sandbox's and writes the limits that differ (else it places the init in the sandbox's new cgroup before it
runs a step of its own), and the init takes its mount namespace then (the host's mounts as they are at that
create). At thousands of live sandboxes the kernel's per-create work grows with their number (a sysfs
superblock lookup, pivot_root's walk of every task, the cpu bandwidth check, a memory cgroup's removal
walking every superblock's LRU lists): the launcher reaps by pid, writes the cfs period only if it differs
from the kernel's default, binds one empty directory of the node's read-only onto a sandbox's masked
directories (no superblock of their own), gives a sandbox a clone of one sysfs of a network namespace with
only its loopback (the launcher's template; a sandbox given a network policy, or re-adopted by a restarted
node, gets a sysfs of its own: own_sysfs), lets sandboxes share their parent's cpuset, and keeps a destroyed
sandbox's cgroup (emptied, renamed to a spare's, at most SHOAL_KEPT_CGROUPS) for a later spare, which resets
it (memory peak, fail count and CPU usage zeroed, what is still charged reclaimed above 16 MiB, limits
written) instead of making one, or for a create that finds no spare ready (creates that come together: the
launcher resets it the same way): no memory cgroup is taken offline per close. One where the OOM killer fired
is removed (that count cannot be reset).

The launcher is the init's parent and reaps it; it exits when the node's end of the socket closes (or on
SIGTERM), removing its spare and the spare's and the kept cgroups (the node removes those of a launcher that
was killed), and the sandboxes it made keep running (a restarted node re-adopts them from record.json and their cgroup).
Limits: cgroup v1 and hybrid hosts only (v2 needs a device-control BPF program), no user namespace.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import os
import resource
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from shoal import cgroups, settings, spawn
from shoal.cbuild import static_binary
from shoal.errors import InvalidRequestError, SandboxLostError
from shoal.substrates.container import oci
from shoal.substrates.container.seccomp import seccomp_bpf_base64
from shoal.tasks import TaskOwner

log = logging.getLogger("shoal.node")
_DIR = Path(__file__).resolve().parent
_SOURCE = _DIR / "launcher.c"
_BINARY = _DIR / "shoal-launcher"

NAME = "shoal"
CREATE_TIMEOUT_S = 60.0

# Capability numbers (linux/capability.h) of the names oci.CAPABILITIES keeps
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
               "CAP_NET_RAW": 13, "CAP_SYS_CHROOT": 18, "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29,
               "CAP_SETFCAP": 31}  # fmt: skip

# The devices a sandbox may use (after `devices.deny a`): what crun allows by default for an OCI bundle
# whose resources deny all; /dev holds null, zero, full, random, urandom, tty and a private devpts.
DEVICES_ALLOWED = ["c *:* m", "b *:* m", "c 1:3 rwm", "c 1:8 rwm", "c 1:7 rwm", "c 5:0 rwm", "c 1:5 rwm",
                   "c 1:9 rwm", "c 5:1 rwm", "c 136:* rwm", "c 5:2 rwm"]  # fmt: skip


def binary_path() -> str:
    """The static shoal-launcher binary, (re)built with gcc if stale (`make setup` builds it)."""
    return static_binary(_BINARY, (_SOURCE,))


def check_host(userns_base: int | None) -> None:
    """Refuse, with the reason and the remedy, what the launcher does not do."""
    if userns_base is not None:
        raise InvalidRequestError(
            "runtime 'shoal' makes no user namespace, and SHOAL_USERNS is set on this node: use runtime='crun' "
            "(which maps sandbox root to an unprivileged host uid) or unset SHOAL_USERNS"
        )
    if cgroups.layout() == "v2":
        raise InvalidRequestError(
            "runtime 'shoal' writes cgroup v1 limits (devices deny-all needs a BPF program under cgroup v2, "
            "which it does not load): this host has cgroup v2 only; use runtime='crun'"
        )
    if seccomp_bpf_base64() is None:
        raise InvalidRequestError("runtime 'shoal' loads a precompiled seccomp filter: install libseccomp2")


def hierarchies() -> list[str]:
    """The v1 hierarchies a sandbox's cgroup is made in (each once, where several controllers share one)."""
    found: dict[str, str] = {}
    for name in (*cgroups.V1_CONTROLLERS, "systemd"):
        path = cgroups.ROOT / name
        if path.is_dir():
            found.setdefault(os.path.realpath(path), str(path))
    return list(found.values())


def _init_fields(agent_binary: str, empty: Path) -> list[tuple[str, str]]:
    bpf = seccomp_bpf_base64()
    assert bpf is not None  # check_host refused otherwise
    caps = 0
    for name in oci.CAPABILITIES:
        caps |= 1 << CAP_NUMBERS[name]
    capmax = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    fields = [
        ("agent", agent_binary),
        ("empty", str(empty)),
        ("nofile", str(min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))),
        ("caps", f"{caps:x}"),
        ("capmax", str(capmax)),
        ("kept", str(max(0, settings.KEPT_CGROUPS.get()))),
        ("bpf", base64.b64decode(bpf).hex()),
    ]
    fields += [("mask", p) for p in oci.MASKED_PATHS] + [("ro", p) for p in oci.READONLY_PATHS]
    fields += [("cg", h) for h in hierarchies()] + [("dev", d) for d in DEVICES_ALLOWED]
    return fields


def _message(op: str, fields: list[tuple[str, str]]) -> bytes:
    parts = [f"op={op}"] + [f"{k}={v}" for k, v in fields]
    for part in parts:
        if "\0" in part:
            raise InvalidRequestError(f"a launcher request field holds a NUL byte: {part!r}")
    return "\0".join(parts).encode()


def remove_spare_cgroups(cgroup_parent: str, launcher_pid: int | None = None) -> None:
    """Remove the cgroups where a launcher's spare waited or that it kept for one (launcher.c, spare_cgroup and
    keep_cgroup: `.spare-<launcher pid>-<n>`): those of `launcher_pid`
    (it exited), or of every launcher that no longer runs. A launcher removes its own when it leaves; one that
    was killed cannot, and its spare, which exits when the launcher's socket closes, may still be in it
    (cgroups.remove kills what is left)."""
    names: set[str] = set()
    for hierarchy in hierarchies():
        parent = Path(hierarchy) / cgroup_parent
        for path in parent.glob(f".spare-{launcher_pid if launcher_pid is not None else '*'}-*"):
            pid = path.name.split("-")[1]
            if launcher_pid is not None or not pid.isdigit() or not Path(f"/proc/{pid}").exists():
                names.add(path.name)
    for name in names:
        cgroups.remove(f"/{cgroup_parent}/{name}")


class Launcher:
    """The node's one shoal-launcher process: started on first use, restarted if it ever dies."""

    def __init__(self, agent_binary: str, log_path: Path, cgroup_parent: str = "shoal") -> None:
        self.agent_binary = agent_binary
        self.log_path = log_path
        self.cgroup_parent = cgroup_parent
        self._sock: socket.socket | None = None
        self._pid: int | None = None
        self._reaper: asyncio.Task | None = None
        self._waiters: dict[str, asyncio.Future[tuple[str, str]]] = {}
        self._ids = itertools.count(1)
        self._starting = asyncio.Lock()
        self._write_wait = asyncio.Lock()
        self._tasks = TaskOwner("shoal-launcher")
        # the sandboxes this node's launchers made and it has not destroyed: init pid -> cgroup (see _restarted)
        self._made: dict[int, str] = {}

    async def create(self, fields: list[tuple[str, str]], listen_fd: int, on_pid: Callable[[int], None]) -> int:
        """Make one sandbox (`fields`: launcher.c's create keys); the pid of its agent (its init).

        Not abandoned when the caller is cancelled: the sandbox is being made, so this waits for the
        launcher's answer (within the timeout) and hands the pid to `on_pid`, for the caller's cleanup to
        kill it, before the cancellation goes on."""
        await self._ensure_started()
        answer = await self._send("create", fields, listen_fd)
        try:
            status, rest = await asyncio.wait_for(asyncio.shield(answer), CREATE_TIMEOUT_S)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                status, rest = await asyncio.wait_for(answer, CREATE_TIMEOUT_S)
                if status == "ok":
                    on_pid(int(rest))
            raise
        except TimeoutError:
            raise SandboxLostError(f"the shoal launcher did not answer within {CREATE_TIMEOUT_S:.0f} s") from None
        if status != "ok":
            raise SandboxLostError(f"the shoal launcher could not start the sandbox: {rest}")
        pid = int(rest)
        self._made[pid] = "/" + dict(fields).get("cgroup", "")
        on_pid(pid)
        return pid

    async def destroy(self, pid: int) -> bool:
        """SIGKILL sandbox init `pid`, reaped and its cgroup removed (or kept, emptied, under a spare's name) by
        the launcher when this returns True.

        False: the running launcher did not make it (a sandbox re-adopted from an earlier node, or one whose
        init is gone already), or no launcher runs: the caller kills it and removes its cgroup itself."""
        self._made.pop(pid, None)
        if self._sock is None:
            return False
        try:
            answer = await self._send("destroy", [("pid", str(pid))])
            status, rest = await asyncio.wait_for(asyncio.shield(answer), CREATE_TIMEOUT_S)
        except (SandboxLostError, TimeoutError):
            return False
        if status == "err":  # killed and reaped, but a cgroup directory stayed: the caller's cleanup retries
            log.warning("the shoal launcher could not remove a cgroup: %s", rest)
        return status in ("ok", "err")

    async def own_sysfs(self, pid: int) -> None:
        """Give sandbox init `pid` a sysfs of its own network namespace in place of its /sys (a clone of the
        launcher's template, which shows the template's loopback: launcher.c, own_sysfs), with the same masks;
        before a network policy moves a veth into its namespace, and when a restarted node re-adopts it."""
        await self._ensure_started()
        answer = await self._send("sysfs", [("pid", str(pid))])
        try:
            status, rest = await asyncio.wait_for(asyncio.shield(answer), CREATE_TIMEOUT_S)
        except TimeoutError:
            raise SandboxLostError(f"the shoal launcher did not answer within {CREATE_TIMEOUT_S:.0f} s") from None
        if status != "ok":
            raise SandboxLostError(f"the shoal launcher could not give sandbox init {pid} its own sysfs: {rest}")

    async def _ensure_started(self) -> None:
        if self._sock is not None:
            return
        async with self._starting:
            if self._sock is not None:
                return
            binary = await asyncio.to_thread(binary_path)
            await asyncio.to_thread(remove_spare_cgroups, self.cgroup_parent)  # of a launcher that was killed
            node_end, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                pid = spawn.start([binary], log_path=str(self.log_path), pass_fd=launcher_end.fileno())
            except BaseException:
                node_end.close()
                raise
            finally:
                launcher_end.close()
            node_end.setblocking(False)
            self._sock, self._pid = node_end, pid
            asyncio.get_running_loop().add_reader(node_end.fileno(), self._readable)
            self._reaper = self._tasks.spawn(self._reap(pid, node_end), name="reap the launcher")
            empty = self.log_path.parent / "masked"  # an empty directory, bound read-only onto masked ones
            empty.mkdir(mode=0o555, exist_ok=True)
            answer = await self._send("init", _init_fields(self.agent_binary, empty))
            status, rest = await asyncio.wait_for(answer, CREATE_TIMEOUT_S)
            if status != "ok":
                self._lost(f"it refused its settings: {rest}")
                raise SandboxLostError(f"the shoal launcher refused its settings: {rest}")
            made, self._made = self._made, {}
            if made:
                self._tasks.spawn(self._restarted(made), name="own sysfs for an earlier launcher's sandboxes")

    async def _restarted(self, made: dict[int, str]) -> None:
        """A launcher that died left sandboxes running (`made`: init pid -> cgroup): each whose init still runs
        in its cgroup (not a reused pid) gets a sysfs of its own, as a re-adopted one does (readopt): their /sys
        cloned that launcher's template, whose loopback ended with it (launcher.c, template_sysfs)."""
        for pid, cgroup in made.items():
            await self.repair_sysfs(pid, cgroup)

    async def repair_sysfs(self, pid: int, cgroup: str) -> None:
        """own_sysfs for a sandbox whose /sys cloned the template of a launcher that ended (a node's re-adopted
        sandboxes, an earlier launcher's): only if its init `pid` still runs in `cgroup` (not a reused pid), and
        a failure is logged, not raised: its /sys/class/net then shows no device, the rest of it works."""
        if pid not in await asyncio.to_thread(cgroups.procs, cgroup):
            return
        try:
            await self.own_sysfs(pid)
        except Exception as exc:  # its /sys/class/net shows no device; the rest of it works
            log.warning("sandbox init %d keeps the sysfs of a launcher that ended: %s", pid, exc)

    async def _send(self, op: str, fields: list[tuple[str, str]], fd: int | None = None) -> asyncio.Future:
        """Send one request; the future of its answer, (status, rest). Dropped from the waiters once answered
        or when the launcher is lost (which fails it)."""
        sock = self._sock
        if sock is None:
            raise SandboxLostError("the shoal launcher is not running")
        ident = "init" if op == "init" else str(next(self._ids))
        payload = _message(op, [("id", ident), *fields])  # destroy, sysfs: exactly id=, pid= (launcher.c reads so)
        answer: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        self._waiters[ident] = answer
        try:
            while True:
                try:
                    if fd is None:
                        sock.send(payload)
                    else:
                        socket.send_fds(sock, [payload], [fd])
                    return answer
                except BlockingIOError:  # its queue is full: wait until it reads (one waiter registered at a
                    async with self._write_wait:  # time: the loop keeps one writer callback per fd)
                        await _writable(sock)
        except BaseException as exc:
            self._waiters.pop(ident, None)
            if isinstance(exc, OSError):
                self._lost(f"writing to it failed ({exc})")
                raise SandboxLostError(f"the shoal launcher is gone ({exc})") from None
            raise

    def _readable(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(16384)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(f"reading from it failed ({exc})")
                return
            if not data:
                self._lost("it exited")
                return
            ident, _, rest = data.decode(errors="replace").partition(" ")
            status, _, rest = rest.partition(" ")
            answer = self._waiters.pop(ident, None)
            if answer is not None and not answer.done():
                answer.set_result((status, rest))

    def _lost(self, why: str) -> None:
        """The launcher is gone: fail whatever waits for it; the next create starts a new one."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        waiters, self._waiters = self._waiters, {}
        for answer in waiters.values():
            if not answer.done():
                answer.set_exception(SandboxLostError(f"the shoal launcher is gone: {why}"))

    async def _reap(self, pid: int, sock: socket.socket) -> None:
        try:
            await spawn.wait(pid)
        finally:
            if self._sock is sock:
                self._lost("it exited")
            await asyncio.to_thread(remove_spare_cgroups, self.cgroup_parent, pid)  # if it could not

    async def close(self) -> None:
        """Stop the launcher (its sandboxes keep running: each is its own process tree and cgroup)."""
        self._lost("the node closed it")
        pid, self._pid = self._pid, None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # it leaves on the closed socket anyway; this is for a stuck one
        if self._reaper is not None:  # it removes its spare's cgroup as it leaves: let it, then make sure
            await asyncio.wait({self._reaper}, timeout=5.0)
        await self._tasks.close()


async def _writable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


class ShoalRuntime:
    """The runtime object the container substrate drives for runtime="shoal" (as OciRuntime for crun)."""

    name = NAME
    passes_fds = True
    own_mount_ns = True

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    async def delete(self, container_id: str, log: Path | str = "/dev/null") -> bool:
        """Nothing to delete: no state outside the sandbox's directory and cgroup (the caller removes both,
        killing what the cgroup still holds)."""
        return False

    async def kill_directly(self, container_id: str, pid: int, cgroup_path: str) -> bool:
        """SIGKILL the sandbox's init (the kernel kills the rest of its PID namespace) and wait for it.

        The launcher that made it (its parent) does it when it can: it reaps the init at once and removes the
        cgroup then, where a kill from here would find the cgroup busy with a zombie until the launcher got
        to reap it (tens of ms on a loaded machine). A sandbox of an earlier launcher's is killed from here."""
        if await self.launcher.destroy(pid):
            return True
        return await spawn.kill_cgroup_init(pid, cgroup_path)

    async def pause(self, container_id: str, cgroup_path: str) -> None:
        await asyncio.to_thread(cgroups.freeze, cgroup_path, True)

    async def resume(self, container_id: str, cgroup_path: str) -> None:
        await asyncio.to_thread(cgroups.freeze, cgroup_path, False)

    def known_ids(self) -> list[str]:
        return []
