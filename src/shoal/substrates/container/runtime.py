"""The OCI runtimes shoal drives: crun (default), runc and gVisor's runsc, on the same bundle."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shoal import linux, settings, spawn
from shoal.errors import InvalidRequestError, SandboxLostError

RUNTIMES = ("crun", "runc", "runsc")


@functools.cache
def runsc_platform(binary: str) -> str:
    """gVisor's platform for this node: SHOAL_RUNSC_PLATFORM, else systrap when this runsc has it, else ptrace.

    systrap (gVisor since 2023, bookworm-backports' runsc) runs guest code in host stub threads it reuses, so a
    guest process costs a few host pids; ptrace (bookworm's 2022 runsc) costs a stub process per address space
    plus a thread per sentry thread that ever ran it, never given back (docs/SECURITY.md, runsc pids). KVM is
    never chosen by itself: it needs VMX/SVM a guest can really use (under nested PVM here it hangs).
    """
    chosen = settings.RUNSC_PLATFORM.get()
    if chosen:
        return chosen
    try:
        listing = subprocess.run([binary, "flags"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        flags = listing.stdout.decode(errors="replace")  # runsc prints its flags on stderr
    except (OSError, subprocess.TimeoutExpired):
        flags = ""
    return "systrap" if "systrap" in flags else "ptrace"


# The seals crun and runc (1.1) look for on /proc/self/exe to know they already run from a copy nobody can write
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@functools.cache
def sealed_copy(binary: str) -> str:
    """A path that executes a sealed in-memory copy of `binary` (crun, runc), made once per node process.

    Why: on every `run`, crun and runc guard against CVE-2019-5736 (a container overwriting the host's
    runtime through /proc/<pid>/exe) by re-executing themselves from a read-only copy, unless they already
    run from a sealed memfd: a second exec and dynamic link of a binary with a dozen libraries, ~2.5 of the
    ~10 CPU-ms of a `crun run -d` here (bench/bench_hotpath.py). Handing them the sealed memfd they would
    have made themselves keeps the same guarantee (no write, grow or shrink is possible on it) for one
    copy per node instead of one per create. Close-on-exec: the kernel opens the path before it closes
    the fd, and no other child inherits it.
    """
    fd = os.memfd_create(f"shoal:{os.path.basename(binary)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            sent = 0
            while sent < size:
                done = os.sendfile(fd, source.fileno(), sent, size - sent)
                if done == 0:
                    raise OSError(f"{binary} shrank while shoal copied it")
                sent += done
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return f"/proc/self/fd/{fd}"


@dataclass(frozen=True)
class OciRuntime:
    """One runtime binary with its own state root (so `list` sees only shoal's containers)."""

    name: str
    binary: str
    state_root: Path

    @classmethod
    def find(cls, name: str, state_root: Path) -> OciRuntime:
        if name not in RUNTIMES:
            names = ", ".join((*RUNTIMES, "shoal"))  # shoal: launcher.py's, not an OCI runtime
            raise InvalidRequestError(f"unknown runtime {name!r}; choose one of {names}")
        binary = shutil.which(name)
        if binary is None:
            package = {"crun": "crun", "runc": "runc", "runsc": "gVisor (runsc)"}[name]
            raise InvalidRequestError(f"runtime {name!r} is not installed here: install {package}")
        if name in ("crun", "runc") and settings.SEALED_RUNTIME.get():
            try:
                binary = sealed_copy(binary)
            except OSError:  # no memfd or sealing here: the runtime makes its own copy per run, as before
                pass
        return cls(name=name, binary=binary, state_root=state_root / name)

    @property
    def passes_fds(self) -> bool:
        """Can the runtime hand the sandbox an inherited socket? (gVisor cannot: see oci.agent_dir.)"""
        return self.name != "runsc"

    def _base(self) -> list[str]:
        if self.name == "runsc":
            platform = runsc_platform(self.binary)
            # --oci-seccomp: the bundle's profile for runsc is oci.py's gvisor_profile (PID 1 unsignalable)
            return [self.binary, "--root", str(self.state_root), "--platform", platform, "--network", "none",
                    "--host-uds", "create", "--oci-seccomp"]  # fmt: skip
        return [self.binary, "--root", str(self.state_root)]

    @property
    def own_mount_ns(self) -> bool:
        """Is the rootfs mounted in a namespace of the sandbox's own (mountns.py), not in the node's?

        crun and runc run the container's init in a namespace cloned from theirs; gVisor's sandbox and gofer
        are long-lived processes of its own with their own view, so runsc keeps the overlay in the node's."""
        return self.name != "runsc"

    async def run_detached(
        self, container_id: str, bundle: Path, listen_fd: int | None, log: Path, starter: spawn.Starter | None = None
    ) -> None:
        """Create and start the container in the background, handing it `listen_fd` (if any) as fd 3.
        `starter` spawns the runtime where it must run (mountns.PrivateMounts: with the rootfs mounted)."""
        pid_file = str(bundle / "pid")
        if self.name == "runsc":
            argv = [*self._base(), "run", "-detach", "-pid-file", pid_file, "-bundle", str(bundle), container_id]
        else:
            argv = [*self._base(), "run", "-d", "--pid-file", pid_file]
            argv += ["--preserve-fds", "1"] if listen_fd is not None else []
            argv += ["--bundle", str(bundle), container_id]
        # Not killed halfway when the create is cancelled: a runtime killed inside `run -d` can leave a
        # container it no longer knows (started, but its state half written), which `delete` then misses.
        # It finishes (within spawn's timeout) and the caller's cleanup deletes the container it made.
        started = asyncio.ensure_future(spawn.run(argv, log_path=str(log), pass_fd=listen_fd, starter=starter))
        try:
            status = await asyncio.shield(started)
        except asyncio.CancelledError:
            await asyncio.wait({started})
            raise
        if status != 0:
            detail = log.read_text(errors="replace")[-2000:].strip() if log.exists() else ""
            raise SandboxLostError(f"{self.name} could not start the sandbox (exit {status}): {detail}")

    async def delete(self, container_id: str, log: Path | str = "/dev/null") -> bool:
        """Kill and delete the container; True if the runtime knew it."""
        force = "-force" if self.name == "runsc" else "-f"
        return await spawn.run([*self._base(), "delete", force, container_id], log_path=str(log)) == 0

    async def kill_directly(self, container_id: str, pid: int, cgroup_path: str) -> bool:
        """Delete a detached crun/runc container without spawning the runtime (saves a process per close).

        SIGKILL its init — the kernel then kills the rest of its PID namespace — wait for it to exit, and
        drop the runtime's state directory (all these runtimes keep for a detached container). The caller
        removes the cgroup. Returns False (do nothing) unless `pid` is provably the container's init.
        """
        if self.name not in ("crun", "runc") or not await spawn.kill_cgroup_init(pid, cgroup_path):
            return False
        linux.remove_directory(f"{self.state_root}/{container_id}")  # a few files: no walk, no thread
        return True

    async def pause(self, container_id: str) -> None:
        await spawn.run([*self._base(), "pause", container_id])

    async def resume(self, container_id: str) -> None:
        await spawn.run([*self._base(), "resume", container_id])

    def known_ids(self) -> list[str]:
        """Containers in this runtime's state root (each is a directory named by its ID)."""
        if not self.state_root.is_dir():
            return []
        return sorted(p.name for p in self.state_root.iterdir() if p.is_dir())
