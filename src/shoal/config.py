"""Where shoal keeps its state, and the node's settings, from the environment."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from shoal import resources, settings


@dataclass(frozen=True)
class Paths:
    """The directories one node uses. `home` is private to the node; `images` may be shared."""

    home: Path
    images: Path

    @classmethod
    def from_env(cls) -> Paths:
        home = settings.HOME.get()
        images = settings.IMAGES_DIR.get() or home / "store"
        return cls(home=home, images=images)

    @property
    def socket(self) -> Path:
        return self.home / "node.sock"

    @property
    def lock(self) -> Path:
        return self.home / "node.lock"

    @property
    def log(self) -> Path:
        return self.home / "node.log"

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def runtime_root(self) -> Path:
        """The runtimes' directory in the home (shoal's launcher keeps its log there)."""
        return self.home / "runtime"

    @property
    def runtime_state(self) -> Path:
        """State directory handed to the OCI runtimes (`--root`, one subdirectory each), so we list only our
        own: on tmpfs where the host has one at /dev/shm (see runtime_state_root), else `runtime_root`."""
        return runtime_state_root(self.home)


SHM = Path("/dev/shm")


def runtime_state_root(home: Path, shm: Path = SHM) -> Path:
    """The OCI runtime's state root of the node at `home`: `/dev/shm/shoal-<hash of home>` when that is a
    tmpfs, else `home/runtime`.

    Why (issue 12): crun writes a few small files per container there and the node removes them at every
    close; on the home's ext4 each of those creates and unlinks is a journalled inode and block change
    (~0.1 ms of CPU each, ~0.3 ms per close in the node alone), on tmpfs a few microseconds. The state only
    describes running containers, which a reboot ends together with tmpfs, the default home of crun and
    runc's own state (/run/crun, /run/runc) for that reason. /dev/shm is writable by everyone: the directory
    is made 0700 and used only if it is a real directory owned by this user with no access for others (a
    planted symlink or someone else's directory makes the node fall back to its home). The full hash of the
    home's path (not node_tag's four hex digits) keeps two nodes from ever sharing a root: reconcile deletes
    the containers of its root that it does not own.
    """
    fallback = home / "runtime"
    if not _is_tmpfs(shm):
        return fallback
    directory = shm_state_dir(home, shm)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return fallback
    try:
        info = os.lstat(directory)
    except OSError:
        return fallback
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return fallback
    return directory


def shm_state_dir(home: Path, shm: Path = SHM) -> Path:
    """Where runtime_state_root puts the runtime's state of the node at `home` on tmpfs (nothing made)."""
    return shm / f"shoal-{hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:20]}"


def _is_tmpfs(path: Path) -> bool:
    """Is `path` the mount point of a tmpfs in this mount namespace?"""
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                if left.split()[4] == str(path) and right.split()[0] == "tmpfs":
                    return True
    except OSError:
        pass
    return False


def node_tag(home: Path) -> str:
    """A short name unique to one node's home on this host: prefixes its links, nftables table, disks."""
    return "sh" + hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:4]


DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_IDLE_S = 30 * 60.0
DEFAULT_CPU = 1.0


@dataclass(frozen=True)
class NodeSettings:
    """Tunables of one node; every one can be set from the environment."""

    node_id: str = "local"
    output_cap_bytes: int = 1 << 20
    pool_sizes: dict[str, int] = field(default_factory=dict)  # "[kind:]image" → warm sandboxes kept
    max_sandboxes: int = 20000
    cgroup_parent: str = "shoal"
    log_retention_s: float = 7 * 86400  # trajectory logs of closed sandboxes are kept this long
    # the network policy of image build steps (RUN): like Docker's build, the public internet by default
    # (private ranges stay shut); SHOAL_BUILD_NETWORK=none builds offline, or name presets/rules
    build_network: str = "*"
    # the CPU weight of all sandboxes together, in busy host processes (default: one per CPU of the host)
    sandboxes_cpu_weight: float = 0.0
    # caps for container sandboxes that name none (0: no cap); see docs/SECURITY.md "Default caps"
    default_memory_mb: int = 0
    default_disk_mb: int = 0
    # lifetimes of sandboxes whose create leaves ttl_s / idle_timeout_s unset (None: unlimited), so that a
    # script that dies before close() does not leak its sandboxes forever
    default_ttl_s: float | None = DEFAULT_TTL_S
    default_idle_timeout_s: float | None = DEFAULT_IDLE_S
    # the CPU cap (cores, a CFS quota) of container sandboxes that name no cpu=, so one runaway (a fork
    # bomb, a busy loop per core) cannot load the whole host; None: no cap
    default_cpu: float | None = DEFAULT_CPU
    # the runtime of containers whose create names none: "auto" (shoal's launcher where the host supports it,
    # else crun), or a runtime's name (substrates/container/choice.py decides once, at node start)
    runtime: str = "auto"
    # seconds an image layer stays mounted once no sandbox uses it (images/erofs.py: LayerMounts)
    layer_linger_s: float = 10.0

    @classmethod
    def from_env(cls, home: Path | None = None) -> NodeSettings:
        pools: dict[str, int] = {}
        for item in filter(None, settings.POOLS.get().split(",")):
            key, _, size = item.partition("=")
            pools[key.strip()] = int(size)
        memory_mb = settings.DEFAULT_MEMORY_MB.get()
        return cls(
            node_id=settings.NODE_ID.get(),
            output_cap_bytes=settings.OUTPUT_CAP.get(),
            pool_sizes=pools,
            max_sandboxes=settings.MAX_SANDBOXES.get(),
            cgroup_parent=settings.CGROUP_PARENT.get() or default_cgroup_parent(home),
            log_retention_s=settings.LOG_RETENTION_S.get(),
            build_network=settings.BUILD_NETWORK.get(),
            sandboxes_cpu_weight=settings.SANDBOXES_CPU_WEIGHT.get(),
            default_memory_mb=default_memory_mb() if memory_mb is None else memory_mb,
            default_disk_mb=settings.DEFAULT_DISK_MB.get() or 0,
            default_ttl_s=settings.DEFAULT_TTL_S.get() or None,
            default_idle_timeout_s=settings.DEFAULT_IDLE_S.get() or None,
            default_cpu=settings.DEFAULT_CPU.get() or None,
            runtime=settings.RUNTIME.get(),
            layer_linger_s=max(0.0, settings.LAYER_LINGER_S.get()),
        )


default_memory_mb = resources.container_default_memory_mb  # tests and the node use this name


def default_cgroup_parent(home: Path | None) -> str:
    """`shoal` for the default home; otherwise one derived from the home, so that two nodes on a host never
    share (and so never reconcile away) each other's cgroups."""
    if home is None or home == Path("/var/lib/shoal"):
        return "shoal"
    return f"shoal-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:10]}"


# Read by clients, not by the node (or secret): left out when a client compares its settings with a node's
CLIENT_ENV = frozenset({"SHOAL_TOKEN", "SHOAL_OWNER", "SHOAL_HOME", "SHOAL_READY_FD", "SHOAL_PARENT_PID"})


def settings_env(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Digests of the SHOAL_* variables that configure a node: a node reports those it started with so a
    client can warn when its own differ (the local node keeps the settings of whoever started it).
    Digests, not values: no variable's value (a path, a credential) leaves the node this way."""
    return {
        key: hashlib.sha256(value.encode()).hexdigest()[:16]
        for key, value in env.items()
        if key.startswith("SHOAL_")
        and not key.startswith("SHOAL_TEST_")
        and key not in CLIENT_ENV
        and "TOKEN" not in key
        and "AUTH" not in key
    }


def parse_hostport(text: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """`host:port` as SHOAL_TCP, SHOAL_HTTP and gateway addresses take it; an empty host means `default_host`."""
    host, _, port = text.rpartition(":")
    try:
        return host or default_host, int(port)
    except ValueError:
        raise ValueError(f"{text!r} is not host:port (e.g. 0.0.0.0:7400, or :0 for any free port)") from None


def write_address(path: Path | str, host: str, port: int) -> None:
    """Publish a bound `host:port` in `path` by rename: supervisors (the Ray node agent, tests) poll for the file
    and read it as soon as it exists, so it must never be seen empty or half written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{host}:{port}\n")
    os.replace(tmp, path)
