"""`shoal node`: one node agent process per machine. It owns every sandbox here and outlives clients."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from shoal import cgroups, linux
from shoal.config import NodeSettings, Paths
from shoal.errors import NodeError
from shoal.settings import CGROUP_FAVOR_DYNMODS, LOG_LEVEL, READY_FD, USERNS
from shoal.substrates.container.choice import Choice
from shoal.substrates.container.choice import choose as choose_runtime

log = logging.getLogger("shoal.node")


def prepare_mount_namespace(paths: Paths) -> int | None:
    """Give the node a mount namespace where the OCI runtime sees a cgroup layout it supports.

    On a hybrid host (cgroup v1 controllers plus an empty cgroup2 at /sys/fs/cgroup/unified) crun refuses
    to run. The node moves into its own mount namespace and unmounts the cgroup2 there only; the
    sandboxes directory is made a shared mount first so the mounts the node makes there (disk_mb's disks,
    gVisor's overlays; crun's and runc's overlays live in each sandbox's own namespace) still appear on
    the host (where tools, tests and a restarted node can see and clean them).
    """
    if cgroups.layout() != "hybrid":
        return None
    sandboxes = str(paths.sandboxes)
    paths.sandboxes.mkdir(parents=True, exist_ok=True)
    if not linux.is_mountpoint(sandboxes):
        linux.mount(sandboxes, sandboxes, None, linux.MS_BIND)
    linux.mount("none", sandboxes, None, linux.MS_SHARED)
    host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount("none", "/sys/fs/cgroup/unified", None, linux.MS_PRIVATE)
    linux.umount("/sys/fs/cgroup/unified")
    return host_ns


def release_mount_namespace(paths: Paths, host_ns: int | None) -> None:
    """On a clean shutdown, remove the shared bind mount of the sandboxes directory from the host."""
    if host_ns is None:
        return
    import subprocess

    subprocess.run(
        ["nsenter", f"--mount=/proc/self/fd/{host_ns}", "umount", "-l", str(paths.sandboxes)],
        pass_fds=[host_ns],
        capture_output=True,
    )
    os.close(host_ns)


def acquire_lock(paths: Paths) -> int:
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NodeError(f"another shoal node already serves {paths.home} (lock {paths.lock})") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


KEEP_SIGNAL = signal.SIGUSR1  # `shoal node stop --keep`: stop, leaving re-adoptable sandboxes running


# The network front (TCP with project tokens, HTTP metrics) lives above the node (shoal.cluster.front); the
# entry point (node/__main__.py) passes it in, so node code never imports the cluster layer.
NetworkFront = Callable[[Any, Paths, asyncio.Event], Awaitable[list[Callable[[], Awaitable[None]]]]]


async def serve(
    paths: Paths,
    settings: NodeSettings,
    ready_fd: int | None = None,
    network: NetworkFront | None = None,
    runtime: Choice | None = None,
) -> bool:
    """Serve until SIGTERM/SIGINT (close every sandbox) or KEEP_SIGNAL (keep the re-adoptable ones);
    returns whether sandboxes were kept."""
    from shoal.node.server import NodeServer
    from shoal.node.service import NodeService

    service = NodeService(paths, settings, runtime)
    await service.start()
    server_impl = NodeServer(service)
    if paths.socket.exists() or paths.socket.is_symlink():
        paths.socket.unlink()
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(server_impl.unix_connection, path=str(paths.socket), backlog=4096)
    os.chmod(paths.socket, 0o600)
    log.info("node %s serving on %s (pid %d)", settings.node_id, paths.socket, os.getpid())
    stop = asyncio.Event()
    closers = [] if network is None else await network(server_impl, paths, stop)  # SHOAL_TCP / SHOAL_HTTP
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    keep = False

    def keep_then_stop() -> None:
        nonlocal keep
        keep = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(KEEP_SIGNAL, keep_then_stop)
    try:
        await stop.wait()
    finally:
        for closer in closers:
            await closer()
        server.close()
        if keep:
            kept = await service.stop_keeping()
            log.info("node stopped; %d sandboxes keep running for the next node to re-adopt", len(kept))
        else:
            log.info("node shutting down: closing %d sandboxes", len(service.sandboxes))
            await service.stop()
        if paths.socket.exists():
            paths.socket.unlink()
    return keep


def main(argv: list[str] | None = None, network: NetworkFront | None = None) -> int:
    """Run the node in the foreground until SIGTERM/SIGINT; `network` serves TCP/HTTP if the environment asks."""
    if os.geteuid() != 0:
        print("shoal node must run as root (it mounts filesystems and manages cgroups)", file=sys.stderr)
        return 2
    paths = Paths.from_env()
    settings = NodeSettings.from_env(paths.home)
    try:  # before anything is made: a SHOAL_RUNTIME this host cannot honour stops the node here, saying why
        runtime = choose_runtime(settings.runtime, USERNS.get())
    except ValueError as exc:
        print(f"shoal node: {exc}", file=sys.stderr)
        return 2
    paths.home.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=LOG_LEVEL.get(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    lock_fd = acquire_lock(paths)
    if CGROUP_FAVOR_DYNMODS.get():  # in the host's namespace: a hybrid host's cgroup2 is unmounted below
        log.info("%s", cgroups.favor_dynamic_modifications())
    host_ns = prepare_mount_namespace(paths)  # before any thread exists: unshare requires it
    ready_fd = READY_FD.get()
    os.environ.pop(READY_FD.name, None)  # not inherited by what the node starts
    try:
        # kept sandboxes still use the shared mount
        if not asyncio.run(serve(paths, settings, ready_fd, network, runtime)):
            release_mount_namespace(paths, host_ns)
    finally:
        os.close(lock_fd)
    return 0


def stop_node(paths: Paths, keep: bool = False, timeout: float = 120.0) -> str:
    """Stop the node serving `paths` (the one whose pid is in its lock) and wait until it has exited.

    Without `keep` every sandbox is closed (a clean shutdown leaves nothing); with it, re-adoptable
    sandboxes keep running and the next node on this home adopts them. Returns what happened."""
    import time

    pid = running_pid(paths)
    if pid is None:
        return f"no shoal node is running for {paths.home}"
    os.kill(pid, KEEP_SIGNAL if keep else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running_pid(paths) is not None:
        if time.monotonic() > deadline:
            raise NodeError(f"the node (pid {pid}) did not stop within {timeout:.0f} s; see its log {paths.log}")
        time.sleep(0.1)
    return f"stopped the shoal node for {paths.home} (pid {pid}); " + (
        "re-adoptable sandboxes keep running until a node starts again" if keep else "its sandboxes were closed"
    )


def running_pid(paths: Paths) -> int | None:
    """The pid of the node holding `paths`' lock, or None if none holds it."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = paths.lock.read_text().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
