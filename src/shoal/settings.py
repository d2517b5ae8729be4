"""Every SHOAL_* environment variable, declared once: name, type, default, who reads it, and what it does.

Why one table: 40-odd variables were read with `os.environ.get` in 25 files, each with its own default and
parsing, and only some were documented. Code reads a setting through its declaration here
(`settings.FN_MEMORY_MB.get()`), so a bad value fails the same way everywhere (naming the variable and what
it expects), and `python -m shoal.settings > docs/SETTINGS.md` writes the reference table. tests/test_settings.py
fails if that file is stale or if a SHOAL_ name appears in the sources without a declaration here.

A default of None means "unset": the reader computes the fallback (e.g. SHOAL_IMAGES from SHOAL_HOME); the
`fallback` text says what it is, for the docs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Who reads a setting (the docs group by it).
NODE, SANDBOX_KINDS, IMAGES, NETWORK, CLUSTER, CLIENT, INTERNAL, TESTS = (
    "node",
    "sandbox kinds",
    "images",
    "network front (TCP, HTTP)",
    "gateway",
    "client",
    "internal (set by shoal for its own processes)",
    "tests and benchmarks",
)
SCOPES = (NODE, SANDBOX_KINDS, IMAGES, NETWORK, CLUSTER, CLIENT, INTERNAL, TESTS)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1 or 0")


_PARSERS: dict[type, Callable[[str], Any]] = {str: str, int: int, float: float, bool: _bool, Path: Path}
_TYPE_NAMES = {str: "text", int: "integer", float: "number", bool: "0 or 1", Path: "path"}


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    type: type
    default: T | None
    scope: str
    doc: str
    fallback: str = ""  # for a None default: what the reader uses instead (documentation only)
    secret: bool = False

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's text, or None if it is unset (an empty value counts as unset)."""
        value = (os.environ if env is None else env).get(self.name)
        return value if value else None

    def get(self, env: Mapping[str, str] | None = None) -> T | None:
        """The typed value from `env` (default: os.environ), or the default if unset."""
        text = self.raw(env)
        if text is None:
            return self.default
        try:
            return _PARSERS[self.type](text)
        except ValueError as exc:
            raise ValueError(
                f"{self.name}={text!r} is not a valid {_TYPE_NAMES[self.type]} ({exc}); "
                f"unset it for the default ({self.default_text()}) — see docs/SETTINGS.md"
            ) from None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.raw(env) is not None

    def default_text(self) -> str:
        if self.default is None:
            return self.fallback or "unset"
        if self.type is bool:
            return "1" if self.default else "0"
        if self.default == "":
            return "empty"
        return str(self.default)


REGISTRY: dict[str, Setting[Any]] = {}


def _declare(name: str, type_: type, default: Any, scope: str, doc: str, **kw: Any) -> Setting[Any]:
    assert name.startswith("SHOAL_") and name not in REGISTRY, name
    setting = Setting(name, type_, default, scope, doc, **kw)
    REGISTRY[name] = setting
    return setting


# ---------------------------------------------------------------- node
HOME: Setting[Path] = _declare(
    "SHOAL_HOME", Path, Path("/var/lib/shoal"), NODE,
    "The node's private state directory (node.sock, sandboxes, trajectory.db); clients find the node's socket here. "
    "Put it on a file system with a journal (ext4 with one, XFS): on ext4 without one, each logged step's fdatasync "
    "also writes the log's inode block, a third disk request (docs/PERFORMANCE.md, the log's added time).",
)  # fmt: skip
IMAGES_DIR: Setting[Path] = _declare(
    "SHOAL_IMAGES", Path, None, NODE,
    "The image store; several nodes on a host may share one.", fallback="$SHOAL_HOME/store",
)  # fmt: skip
NODE_ID: Setting[str] = _declare("SHOAL_NODE_ID", str, "local", NODE, "The node's name (prefixes its sandbox IDs).")
OUTPUT_CAP: Setting[int] = _declare(
    "SHOAL_OUTPUT_CAP", int, 1 << 20, NODE, "Bytes of stdout and of stderr kept per exec (the rest is dropped)."
)
POOLS: Setting[str] = _declare(
    "SHOAL_POOLS", str, "", NODE, "Warm pools at start: `[kind:]image=n,...` (e.g. `debian=8,function:debian=4`)."
)
MAX_SANDBOXES: Setting[int] = _declare("SHOAL_MAX_SANDBOXES", int, 20000, NODE, "Live sandboxes a node holds at most.")
CGROUP_PARENT: Setting[str] = _declare(
    "SHOAL_CGROUP_PARENT", str, None, NODE,
    "The cgroup under which the node makes its sandboxes' cgroups (two nodes must not share one).",
    fallback="`shoal` for the default home, else `shoal-<hash of SHOAL_HOME>`",
)  # fmt: skip
LOG_RETENTION_S: Setting[float] = _declare(
    "SHOAL_LOG_RETENTION_S", float, 7 * 86400.0, NODE, "Seconds the trajectory log of a closed sandbox is kept."
)
BUILD_NETWORK: Setting[str] = _declare(
    "SHOAL_BUILD_NETWORK", str, "*", NODE,
    "Network policy of image build steps (RUN): `*` the public internet (as Docker's build), `none` offline.",
)  # fmt: skip
SANDBOXES_CPU_WEIGHT: Setting[float] = _declare(
    "SHOAL_SANDBOXES_CPU_WEIGHT", float, 0.0, NODE,
    "CPU weight of all sandboxes together, in busy host processes; 0: one per CPU of the host.",
)  # fmt: skip
LOG_BATCH_MS: Setting[float] = _declare(
    "SHOAL_LOG_BATCH_MS", float, 50.0, NODE,
    "Milliseconds a logged step's result waits in the durable journal before joining a batch written to "
    "the trajectory log's SQLite database (reads see it meanwhile).",
)  # fmt: skip
LOG_RESERVE_MB: Setting[float] = _declare(
    "SHOAL_LOG_RESERVE_MB", float, 64.0, NODE,
    "Disk (MB) the trajectory log keeps in reserve, released when a commit finds the disk full.",
)  # fmt: skip
DEFAULT_MEMORY_MB: Setting[int] = _declare(
    "SHOAL_DEFAULT_MEMORY_MB", int, None, NODE,
    "Memory cap (MB) of containers that name no `memory_mb`; 0: no cap.",
    fallback="4096, or half the host's memory if less",
)  # fmt: skip
DEFAULT_TTL_S: Setting[float] = _declare(
    "SHOAL_DEFAULT_TTL_S", float, 24 * 3600.0, NODE,
    "TTL (s) of sandboxes whose create leaves `ttl_s` unset (abandoned ones end); 0: none. `ttl_s=None` opts out.",
)  # fmt: skip
DEFAULT_IDLE_S: Setting[float] = _declare(
    "SHOAL_DEFAULT_IDLE_S", float, 30 * 60.0, NODE,
    "Idle timeout (s) of sandboxes whose create leaves `idle_timeout_s` unset; 0: none. An explicit None opts out.",
)  # fmt: skip
DEFAULT_CPU: Setting[float] = _declare(
    "SHOAL_DEFAULT_CPU", float, 1.0, NODE,
    "CPU cap (cores, a CFS quota) of containers that name no `cpu`, so one runaway cannot load the host; 0: none.",
)  # fmt: skip
LOG_LEVEL: Setting[str] = _declare("SHOAL_LOG_LEVEL", str, "INFO", NODE, "Log level of nodes and gateways.")

# ---------------------------------------------------------------- sandbox kinds
USERNS: Setting[int] = _declare(
    "SHOAL_USERNS", int, None, SANDBOX_KINDS,
    "Run containers in a user namespace: root inside is this host uid (e.g. 100000). Off when unset.",
)  # fmt: skip
DEFAULT_DISK_MB: Setting[int] = _declare(
    "SHOAL_DEFAULT_DISK_MB", int, None, SANDBOX_KINDS,
    "Disk cap (MB) of containers that name no `disk_mb`.", fallback="no cap",
)  # fmt: skip
RUNTIME: Setting[str] = _declare(
    "SHOAL_RUNTIME", str, "auto", SANDBOX_KINDS,
    "Runtime of containers (and function workers) whose create names none: `auto` (shoal's pre-forked launcher "
    "where this host supports it, else crun; decided once at node start, `shoal doctor` and the node's status say "
    "which and why), `shoal`, `crun`, `runc` or `runsc`. A create's `runtime=` overrides it.",
)  # fmt: skip
KEPT_CGROUPS: Setting[int] = _declare(
    "SHOAL_KEPT_CGROUPS", int, 16, SANDBOX_KINDS,
    "Closed sandboxes' cgroups the `shoal` launcher keeps, emptied and reset, for its next sandboxes instead of "
    "removing them (a removal makes the kernel walk every live sandbox's superblocks). A reused cgroup starts with "
    "usage, peak, fail counts and CPU time zeroed, but memory.stat's cumulative event counts continue from the "
    "sandbox before; one where the OOM killer fired is never reused. 0: every closed sandbox's cgroup is removed "
    "(at most 64).",
)  # fmt: skip
SEALED_RUNTIME: Setting[bool] = _declare(
    "SHOAL_SEALED_RUNTIME", bool, True, SANDBOX_KINDS,
    "Run crun/runc from one sealed in-memory copy per node (they skip re-executing themselves per create); 0: off.",
)  # fmt: skip
CGROUP_FAVOR_DYNMODS: Setting[bool] = _declare(
    "SHOAL_CGROUP_FAVOR_DYNMODS", bool, False, SANDBOX_KINDS,
    "1: remount the host's cgroup2 with `favordynmods` at node start (a cgroup join then never waits for an RCU "
    "grace period, up to ~14 ms of a create on an otherwise idle host; a host-wide change, so opt-in).",
)  # fmt: skip
RUNSC_PLATFORM: Setting[str] = _declare(
    "SHOAL_RUNSC_PLATFORM", str, None, SANDBOX_KINDS,
    "gVisor's platform (`systrap`, `ptrace` or `kvm`; KVM only when named: it needs VMX/SVM a guest can use).",
    fallback="systrap if the installed runsc has it, else ptrace",
)  # fmt: skip
FN_MEMORY_MB: Setting[int] = _declare(
    "SHOAL_FN_MEMORY_MB", int, 1024, SANDBOX_KINDS, "Memory limit (MB) of one function call without `memory_mb`."
)
FN_MAX_WORKERS: Setting[int] = _declare(
    "SHOAL_FN_MAX_WORKERS", int, None, SANDBOX_KINDS,
    "Function workers per image at most.", fallback="max(4, 4 × CPUs)",
)  # fmt: skip
FN_PREIMPORT: Setting[str] = _declare(
    "SHOAL_FN_PREIMPORT", str, "", SANDBOX_KINDS, "Modules every function worker imports once (`numpy,pandas`)."
)
FN_IDLE_S: Setting[float] = _declare(
    "SHOAL_FN_IDLE_S", float, 60.0, SANDBOX_KINDS, "Seconds an idle function worker above a pool's warm size lives."
)
FN_PATH: Setting[str] = _declare(
    "SHOAL_FN_PATH", str, "", SANDBOX_KINDS,
    "Extra `:`-separated directories where a function worker looks for interpreters (read inside the sandbox).",
)  # fmt: skip
QEMU: Setting[str] = _declare("SHOAL_QEMU", str, "qemu-system-x86_64", SANDBOX_KINDS, "The QEMU binary for VM kinds.")
VM_TEMPLATES: Setting[bool] = _declare(
    "SHOAL_VM_TEMPLATES", bool, True, SANDBOX_KINDS,
    "Start VMs from a snapshotted template (0: cold-boot every VM).",
)  # fmt: skip
VM_SHARED_MEMORY: Setting[bool] = _declare(
    "SHOAL_VM_SHARED_MEMORY", bool, True, SANDBOX_KINDS,
    "Restore VM memory copy-on-write from the template file (0: a private copy per VM).",
)  # fmt: skip
VM_BOOT_TIMEOUT: Setting[float] = _declare(
    "SHOAL_VM_BOOT_TIMEOUT", float, 120.0, SANDBOX_KINDS, "Seconds a VM's agent may take to answer after a cold boot."
)
MICROVM_MACHINE: Setting[str] = _declare(
    "SHOAL_MICROVM_MACHINE", str, None, SANDBOX_KINDS,
    "QEMU machine type of `microvm` sandboxes.", fallback="`microvm` under KVM, `q35` under TCG",
)  # fmt: skip
VM_MACHINE: Setting[str] = _declare(
    "SHOAL_VM_MACHINE", str, None, SANDBOX_KINDS, "QEMU machine type of `vm` sandboxes.", fallback="`q35`"
)
VM_ACCEL: Setting[str] = _declare(
    "SHOAL_VM_ACCEL", str, None, SANDBOX_KINDS,
    "Force the VM accelerator: `kvm` or `tcg`.", fallback="KVM if a probe guest boots under it, else TCG",
)  # fmt: skip
KVM_PROBE_TIMEOUT: Setting[float] = _declare(
    "SHOAL_KVM_PROBE_TIMEOUT", float, 20.0, SANDBOX_KINDS, "Seconds the KVM boot probe may take."
)
VM_CACHE: Setting[Path] = _declare(
    "SHOAL_VM_CACHE", Path, Path("/var/lib/shoal/vm"), SANDBOX_KINDS,
    "Host-wide VM build products: kernel, initramfs, base disks, the `vm` root.",
)  # fmt: skip
NETWORK_CONFIG: Setting[Path] = _declare(
    "SHOAL_NETWORK_CONFIG", Path, None, SANDBOX_KINDS,
    "JSON file with network presets, host aliases and the address pool (docs/SECURITY.md).", fallback="built-in",
)  # fmt: skip
NET_POOL: Setting[str] = _declare(
    "SHOAL_NET_POOL", str, None, SANDBOX_KINDS,
    "IPv4 network the sandboxes' links are numbered from.", fallback="a /16 in 10.0.0.0/8 picked from SHOAL_HOME",
)  # fmt: skip

# ---------------------------------------------------------------- images
EROFS: Setting[bool] = _declare(
    "SHOAL_EROFS", bool, True, IMAGES, "Mount layers as EROFS images (0: plain directories)."
)
LAYER_LINGER_S: Setting[float] = _declare(
    "SHOAL_LAYER_LINGER_S", float, 10.0, IMAGES,
    "Seconds a node keeps an image layer mounted after the last sandbox using it closed (the next create of "
    "that image skips the mount, the close the unmount); 0: unmounted at once.",
)  # fmt: skip
DEBIAN_SUITE: Setting[str] = _declare(
    "SHOAL_DEBIAN_SUITE", str, "bookworm", IMAGES, "Debian suite of the builtin `debian` images and the `vm` root."
)
INSECURE_REGISTRIES: Setting[str] = _declare(
    "SHOAL_INSECURE_REGISTRIES", str, "", IMAGES, "Comma-separated registry hosts spoken to over plain HTTP."
)
DEFAULT_REGISTRY: Setting[str] = _declare(
    "SHOAL_DEFAULT_REGISTRY", str, None, IMAGES,
    "Registry `host[:port]` that references without a host mean, as in Docker (`python:3.11` is "
    "`library/python:3.11` there, `user/repo` is `user/repo` there).",
    fallback="none: references must name their registry",
)  # fmt: skip
REGISTRY_CREDENTIALS: Setting[Path] = _declare(
    "SHOAL_REGISTRY_CREDENTIALS", Path, None, IMAGES,
    "Docker-format credentials file (`auths` by registry host) the node reads when a pull or push gives none.",
    fallback="$DOCKER_CONFIG/config.json, else ~/.docker/config.json of the node's user",
)  # fmt: skip
REGISTRY_AUTH: Setting[str] = _declare(
    "SHOAL_REGISTRY_AUTH", str, None, IMAGES, "Registry credentials `user:password`.", secret=True
)

# ---------------------------------------------------------------- network front
TCP: Setting[str] = _declare(
    "SHOAL_TCP",
    str,
    None,
    NETWORK,
    "Serve the node protocol on TCP at `host:port` (needs SHOAL_TOKENS).",
    fallback="off",
)
HTTP: Setting[str] = _declare(
    "SHOAL_HTTP", str, None, NETWORK, "Serve /metrics and /healthz at `host:port`.", fallback="off"
)
E2B: Setting[str] = _declare(
    "SHOAL_E2B",
    str,
    None,
    NETWORK,
    "Serve E2B's API (unmodified e2b SDK programs, docs/E2B.md) at `host:port`, over SHOAL_TCP.",
    fallback="off",
)
TOKENS: Setting[Path] = _declare(
    "SHOAL_TOKENS", Path, None, NETWORK, "JSON token file: tokens → projects and quotas (docs/CLUSTER.md).", secret=True
)
TLS_CERT: Setting[Path] = _declare(
    "SHOAL_TLS_CERT", Path, None, NETWORK,
    "PEM certificate (chain) of this node's or gateway's TCP and HTTP ports; with SHOAL_TLS_KEY they speak "
    "only TLS (`shoal tls init` makes one).", fallback="plain TCP",
)  # fmt: skip
TLS_KEY: Setting[Path] = _declare(
    "SHOAL_TLS_KEY", Path, None, NETWORK, "PEM private key of SHOAL_TLS_CERT.", fallback="plain TCP", secret=True
)
PLAINTEXT_TOKENS: Setting[bool] = _declare(
    "SHOAL_PLAINTEXT_TOKENS", bool, False, NETWORK,
    "Allow tokens over plain TCP to and from peers that are not on loopback (servers refuse them, clients "
    "do not send them, unless this is 1); loopback is always allowed.",
)  # fmt: skip
HTTP_MAX_BODY: Setting[int] = _declare(
    "SHOAL_HTTP_MAX_BODY", int, 64 << 20, NETWORK, "Largest HTTP request body accepted (bytes)."
)
PREAUTH_FRAME: Setting[int] = _declare(
    "SHOAL_PREAUTH_FRAME", int, 16 << 10, NETWORK, "Largest frame (bytes) before a TCP peer has authenticated."
)
AUTH_TIMEOUT_S: Setting[float] = _declare(
    "SHOAL_AUTH_TIMEOUT_S",
    float,
    10.0,
    NETWORK,
    "Seconds a peer has to show an accepted token (TCP, HTTP and E2B ports).",
)
CONN_IDLE_TIMEOUT_S: Setting[float] = _declare(
    "SHOAL_CONN_IDLE_TIMEOUT_S", float, 900.0, NETWORK, "Seconds an authenticated idle connection stays open."
)
MAX_CONN_PER_PEER: Setting[int] = _declare(
    "SHOAL_MAX_CONN_PER_PEER", int, 1024, NETWORK, "Connections from one address at most."
)
PEER_INFLIGHT_MB: Setting[int] = _declare(
    "SHOAL_PEER_INFLIGHT_MB",
    int,
    1024,
    NETWORK,
    "Request bytes one address may have read and not yet answered (MiB): past it, its next frame waits.",
)
MAX_PREAUTH_PER_PEER: Setting[int] = _declare(
    "SHOAL_MAX_PREAUTH_PER_PEER", int, 32, NETWORK, "Unauthenticated connections from one address at most."
)
MAX_PREAUTH: Setting[int] = _declare(
    "SHOAL_MAX_PREAUTH", int, 1024, NETWORK, "Unauthenticated connections in total at most."
)

# ---------------------------------------------------------------- gateway
GATEWAY: Setting[str] = _declare("SHOAL_GATEWAY", str, "0.0.0.0:7470", CLUSTER, "Where a gateway listens (`--listen`).")
GATEWAY_HTTP: Setting[str] = _declare(
    "SHOAL_GATEWAY_HTTP", str, None, CLUSTER, "The gateway's HTTP API and /metrics (`--http`).", fallback="off"
)
GATEWAY_E2B: Setting[str] = _declare(
    "SHOAL_GATEWAY_E2B", str, None, CLUSTER, "The gateway's E2B API, docs/E2B.md (`--e2b`).", fallback="off"
)
GATEWAY_NAME: Setting[str] = _declare("SHOAL_GATEWAY_NAME", str, "gw", CLUSTER, "The gateway's name (`--name`).")
ADMISSION_TIMEOUT: Setting[float] = _declare(
    "SHOAL_ADMISSION_TIMEOUT", float, 600.0, CLUSTER, "Seconds a create may wait in the gateway's admission queue."
)
MAX_WAITING: Setting[int] = _declare(
    "SHOAL_MAX_WAITING", int, 200_000, CLUSTER, "Creates waiting in the admission queue at most."
)

# ---------------------------------------------------------------- client
OWNER: Setting[str] = _declare(
    "SHOAL_OWNER", str, None, CLIENT, "Owner recorded on sandboxes a client creates.", fallback="`user@host`"
)
TOKEN: Setting[str] = _declare(
    "SHOAL_TOKEN", str, None, CLIENT, "Token for `shoal://` addresses when `token=` is not given.", secret=True
)
TLS_CA: Setting[Path] = _declare(
    "SHOAL_TLS_CA", Path, None, CLIENT,
    "CA file that `shoals://` clients (and gateways calling their nodes) verify servers against; a gateway "
    "with it set speaks TLS to its nodes.", fallback="the system CAs",
)  # fmt: skip

# ---------------------------------------------------------------- internal
READY_FD: Setting[int] = _declare(
    "SHOAL_READY_FD", int, None, INTERNAL, "File descriptor a starting node writes `ready` to (client/launch.py)."
)
PARENT_PID: Setting[int] = _declare(
    "SHOAL_PARENT_PID", int, None, INTERNAL, "A node or gateway stops when this supervisor process is gone."
)
AGENT_PID_HOLD_MS: Setting[int] = _declare(
    "SHOAL_AGENT_PID_HOLD_MS", int, None, INTERNAL,
    "Read by the guest agent from its own environment (not the node's): how long a held exec pid frame waits "
    "for the command's first output or exit (EXEC_HOLD_PID); tests/test_guest_agent.py lengthens it.",
    fallback="1 ms (agent.c's PID_HOLD_NS)",
)  # fmt: skip

# ---------------------------------------------------------------- tests and benchmarks
TEST_USERNS: Setting[int] = _declare(
    "SHOAL_TEST_USERNS", int, None, TESTS, "Run the test suite's nodes with SHOAL_USERNS set to this."
)
ANDROID_IMAGE: Setting[str] = _declare(
    "SHOAL_ANDROID_IMAGE", str, None, TESTS,
    "tests/test_agentless.py: an Android-x86 / AOSP x86_64 disk image on this machine; its end-to-end test "
    "(boot, adb shell, screen) runs only when set.",
)  # fmt: skip
BENCH_KEEP_NODE: Setting[bool] = _declare(
    "SHOAL_BENCH_KEEP_NODE", bool, False, TESTS, "bench/bench_security.py: keep its node running afterwards."
)


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """A setting by its variable name (for code that loops over names); unknown names are a bug."""
    return REGISTRY[name].get(env)


def markdown() -> str:
    """docs/SETTINGS.md: one table per scope."""
    out = [
        "# Settings",
        "",
        "Every `SHOAL_*` environment variable. Generated from `src/shoal/settings.py` by",
        "`make settings-doc` (tests/test_settings.py fails when this file is stale).",
    ]
    for scope in SCOPES:
        rows = [s for s in REGISTRY.values() if s.scope == scope]
        out += [
            "",
            f"## {scope[0].upper()}{scope[1:]}",
            "",
            "| Variable | Type | Default | What it does |",
            "|---|---|---|---|",
        ]
        for s in sorted(rows, key=lambda s: s.name):
            doc = s.doc + (" Secret: never logged." if s.secret else "")
            default = s.default_text() if s.default is None or s.default == "" else f"`{s.default_text()}`"
            out.append(f"| `{s.name}` | {_TYPE_NAMES[s.type]} | {default} | {doc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
