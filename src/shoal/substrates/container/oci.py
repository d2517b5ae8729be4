"""The OCI runtime spec (config.json) for one sandbox: the same bundle serves crun, runc and runsc."""

from __future__ import annotations

import resource
from typing import Any

from shoal.substrates.container import userns
from shoal.substrates.container.seccomp import gvisor_profile, seccomp_bpf_base64, seccomp_profile

# The capabilities a sandbox keeps: enough for package managers and servers, nothing that reaches the
# host (no SYS_ADMIN, NET_ADMIN, SYS_PTRACE, SYS_MODULE, MKNOD, NET_RAW ...).
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
]

MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kallsyms",
    "/proc/kcore",
    "/proc/keys",
    "/proc/kmsg",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/vmallocinfo",
    "/sys/firmware",
    "/sys/kernel/debug",
    "/sys/kernel/mm/page_idle",
    "/sys/kernel/security",
    "/sys/devices/virtual/powercap",
]

READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

AGENT_PATH = "/.shoal/agent"
AGENT_RUN_DIR = "/.shoal/run"
CPU_PERIOD_US = 100_000


def cpu_shares(cpu: float | None) -> int:
    """A sandbox's CPU weight among its siblings: 1024 (one ordinary process's) per core it asked for.

    Under contention, `cpu=2` gets twice the time of a sandbox without `cpu`; the quota (a cap) is apart.
    crun and runc map shares to cgroup v2's cpu.weight themselves.
    """
    return max(2, min(262144, round(1024 * cpu))) if cpu else 1024


def bundle_config(
    *,
    hostname: str,
    agent_binary: str,
    cgroup_path: str,
    cpu: float | None,
    memory_mb: int | None,
    pids: int | None,
    resolv_conf: str | None = None,
    agent_dir: str | None = None,
    userns_base: int | None = None,
    tmpfs: tuple[str, ...] = (),
    rootfs: str = "rootfs",
) -> dict[str, Any]:
    """config.json for a sandbox whose PID 1 is the shoal agent (with an empty tmpfs at each `tmpfs` path).

    The agent listens on inherited fd 3; or, with `agent_dir` (for runtimes that cannot pass a socket,
    i.e. gVisor), on a socket it creates in that host directory, mounted at /.shoal/run. It then covers
    that directory with an empty read-only tmpfs and drops CAP_SYS_ADMIN, which it holds only for that
    (so nothing in the sandbox can write into the node's state directory, past disk_mb, or plant links).
    """
    caps = list(CAPABILITIES) + (["CAP_SYS_ADMIN"] if agent_dir else [])
    nofile = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if memory_mb is not None:
        limit = memory_mb << 20
        resources["memory"] = {"limit": limit, "swap": limit}
    if pids is not None:
        resources["pids"] = {"limit": pids}
    resources["cpu"] = {"shares": cpu_shares(cpu)}
    if cpu is not None:
        resources["cpu"].update(quota=int(cpu * CPU_PERIOD_US), period=CPU_PERIOD_US)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {
            "destination": AGENT_PATH,
            "type": "bind",
            "source": agent_binary,
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
    ]
    for path in tmpfs:  # sandbox root owns them; no size of their own: what is written counts as memory
        scratch = {"destination": path, "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}
        mounts.append(scratch)
    args = [AGENT_PATH, "--fd", "3"]
    if agent_dir:
        mounts.append({"destination": AGENT_RUN_DIR, "type": "bind", "source": agent_dir, "options": ["bind", "rw"]})
        args = [AGENT_PATH, "--listen", f"{AGENT_RUN_DIR}/agent.sock"]
    if resolv_conf:
        mounts.append(
            {"destination": "/etc/resolv.conf", "type": "bind", "source": resolv_conf, "options": ["bind", "ro"]}
        )
    namespaces = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")]
    linux: dict[str, Any] = {}
    if userns_base is not None:  # root here is host uid `userns_base`, unprivileged outside
        namespaces.append({"type": "user"})
        linux.update(userns.mappings(userns_base))
    annotations = {}
    bpf = None if agent_dir else seccomp_bpf_base64()
    if bpf:  # crun loads this instead of compiling "seccomp" (runc ignores it and applies the profile)
        annotations["run.oci.seccomp_bpf_data"] = bpf
    return {
        "ociVersion": "1.0.2",
        "annotations": annotations,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "cgroupsPath": cgroup_path,
            "resources": resources,
            "namespaces": namespaces,
            **linux,
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": gvisor_profile() if agent_dir else seccomp_profile(),
        },
    }
