"""Fixtures: a real node (its own state directory and cgroup parent) serving real sandboxes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from shoal import settings
from shoal.client.launch import spawn_background
from shoal.config import Paths, node_tag

IMAGES = settings.IMAGES_DIR.get() or Path("/var/lib/shoal/store")
# A cold boot of the systemd `vm` under TCG takes ~40 s on a quiet 2-core machine and minutes on a loaded one;
# the node's default (120 s) is for users: tests wait for the boot rather than fail on the machine's load.
os.environ.setdefault(settings.VM_BOOT_TIMEOUT.name, "400")


def leftovers(home: Path, cgroup_parent: str, node_stopped: bool = False) -> dict[str, list[str]]:
    """Everything sandboxes of the node at `home` could leave behind: mounts, cgroups, processes, dirs.

    A running node keeps one mount of its own (the sandboxes directory, shared so that sandbox mounts
    reach the host); once it has stopped cleanly that must be gone too.
    """
    base = str(home / "sandboxes")
    mounts = [
        target
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if (target := line.split()[4]).startswith(base + "/") or (node_stopped and target == base)
    ]
    cgroup_dirs = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        parent = hierarchy / cgroup_parent
        if parent.is_dir():
            cgroup_dirs += [str(p) for p in parent.iterdir() if p.is_dir()]
            if node_stopped:  # a node that stopped cleanly removes its own parent too
                cgroup_dirs.append(str(parent))
    agents, helpers, vms = [], [], []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"/.shoal/agent") and _in_cgroup(proc, cgroup_parent):
                # a sandbox's agent, or one of its helpers (reserve, keepers: forks of it, child of an agent)
                (helpers if _parent_is_agent(proc) else agents).append(proc.name)
            if b"qemu-system" in cmdline.split(b"\0")[0] and f"{home}/".encode() in cmdline:
                vms.append(proc.name)
    dirs = [str(p) for p in (home / "sandboxes").iterdir()] if (home / "sandboxes").is_dir() else []
    prefix = node_tag(home)
    links = [n for n in os.listdir("/sys/class/net") if n.startswith(prefix)]
    table = subprocess.run(["nft", "list", "table", "inet", f"shoal_{prefix}"], capture_output=True, text=True)
    if node_stopped:
        nft = [f"table inet shoal_{prefix}"] if table.returncode == 0 else []
    else:
        nft = re.findall(r"chain (sb\d+)", table.stdout)
    loops = [line for line in _losetup() if line.endswith(f"/disk-{prefix}.img")]
    # VM snapshots live until deleted or the node stops; half-built templates never stay.
    vm_files = [str(p) for p in (home / "vm-templates").glob(".build-*")]
    if node_stopped:
        vm_files += [str(p) for p in (home / "vm-snapshots").glob("*")]
    return {"mounts": mounts, "cgroups": cgroup_dirs, "agents": agents, "agent_helpers": helpers, "qemu": vms,
            "dirs": dirs, "links": links,
            "nft": nft, "loops": loops, "vm_files": vm_files, "layers": layer_mounts(home)}  # fmt: skip


def _parent_is_agent(proc: Path) -> bool:
    try:
        ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
        return Path(f"/proc/{ppid}/cmdline").read_bytes().startswith(b"/.shoal/agent")
    except (OSError, IndexError):
        return False


def _losetup() -> list[str]:
    """Backing files of the loop devices in use."""
    out = subprocess.run(["losetup", "-n", "-O", "BACK-FILE"], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()]


def layer_mounts(home: Path) -> list[str]:
    """Image layer mounts (EROFS) the node at `home` holds, seen from its mount namespace if it runs."""
    mountinfo = Path("/proc/self/mountinfo")
    try:
        pid = int((home / "node.lock").read_text())
        if Path(f"/proc/{pid}/mountinfo").exists():
            mountinfo = Path(f"/proc/{pid}/mountinfo")
    except (OSError, ValueError):
        pass
    base = str(home / "layers") + "/"
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    return [target for line in lines if (target := line.split()[4]).startswith(base)]


def _in_cgroup(proc: Path, parent: str) -> bool:
    try:
        return f"/{parent}/" in (proc / "cgroup").read_text()
    except OSError:
        return False


def no_leftovers(
    home: Path, cgroup_parent: str, timeout: float = 10.0, node_stopped: bool = False
) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        found = {k: v for k, v in leftovers(home, cgroup_parent, node_stopped).items() if v}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


class NodeProcess:
    """A node started for tests, with its own home and cgroup parent."""

    def __init__(self, home: Path, cgroup_parent: str, **env: str) -> None:
        self.home = home
        self.cgroup_parent = cgroup_parent
        self.env = env
        self.paths = Paths(home=home, images=IMAGES)

    def start(self) -> NodeProcess:
        saved = dict(os.environ)
        os.environ.update(SHOAL_CGROUP_PARENT=self.cgroup_parent, SHOAL_IMAGES=str(IMAGES), **self.env)
        try:
            spawn_background(self.paths)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return self

    @property
    def pid(self) -> int:
        return int(self.paths.lock.read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        try:
            pid = self.pid
            os.kill(pid, sig)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return
            time.sleep(0.05)
        raise RuntimeError(f"node {pid} did not stop")

    def client(self) -> shoal.Client:
        return shoal.Client(home=str(self.home))

    def async_client(self) -> shoal.AsyncClient:
        return shoal.AsyncClient(home=str(self.home))


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    home = tmp_path_factory.mktemp("shoal-home")
    extra = {"SHOAL_USERNS": settings.TEST_USERNS.raw()} if settings.TEST_USERNS.is_set() else {}
    proc = NodeProcess(home, f"shoal-test-{os.getpid()}", **extra).start()  # SHOAL_TEST_USERNS=<base>: all in userns
    yield proc
    proc.stop()
    found = no_leftovers(proc.home, proc.cgroup_parent, node_stopped=True)
    assert not found, f"the node left resources behind on shutdown: {found}"


@pytest.fixture(autouse=True, scope="session")
def _no_stale_test_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Nodes killed on purpose keep their shared sandboxes mount: drop those of this session only."""
    yield
    base = str(tmp_path_factory.getbasetemp()) + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4]
        if target.startswith(base) and target.endswith("/sandboxes"):
            os.system(f"umount -l {target}")


@pytest.fixture(scope="session")
def client(node: NodeProcess) -> Iterator[shoal.Client]:
    with node.client() as c:
        yield c


@pytest.fixture
async def aclient(node: NodeProcess):  # noqa: ANN201
    async with node.async_client() as c:
        yield c


@pytest.fixture
def sb(client: shoal.Client) -> Iterator[shoal.Sandbox]:
    with client.create("container", image="debian", pool=False) as sandbox:
        yield sandbox


@pytest.fixture
def tiny(client: shoal.Client) -> Iterator[shoal.Sandbox]:
    with client.create("container", image="busybox", pool=False) as sandbox:
        yield sandbox


# The Debian archive's index: what tests of outside network fetch (PyPI, Debian and npm are reachable here)
DEBIAN_RELEASE = "http://deb.debian.org/debian/dists/bookworm/Release"
FETCH = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=20).read(4096).decode(errors="replace"))
"""


def outside_network() -> str | None:
    """Why this machine cannot reach the Debian archive (None if it can): tests needing it skip saying so."""
    import urllib.request

    try:
        with urllib.request.urlopen(DEBIAN_RELEASE, timeout=20) as answer:
            answer.read(64)
    except OSError as exc:
        return f"this machine cannot fetch {DEBIAN_RELEASE} itself ({exc})"
    return None
