"""Fixtures: a real node (its own state directory and cgroup parent) serving real sandboxes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from shoal import settings
from shoal.client.launch import spawn_background
from shoal.config import Paths, node_tag, shm_state_dir

IMAGES = settings.IMAGES_DIR.get() or Path("/var/lib/shoal/store")
# A cold boot of the systemd `vm` under TCG takes ~40 s on a quiet 2-core machine and minutes on a loaded one;
# the node's default (120 s) is for users: tests wait for the boot rather than fail on the machine's load.
os.environ.setdefault(settings.VM_BOOT_TIMEOUT.name, "400")
# A node keeps an unused image layer mounted for SHOAL_LAYER_LINGER_S (10 s) after its last sandbox closed.
# The leak checks run right after a test's closes and count layer mounts: with the linger they would have to
# wait it out after every test, and they would no longer tell a layer reference that leaked from one that
# lingers. Test nodes release at once; test_images_node's linger tests start nodes with it on.
os.environ.setdefault(settings.LAYER_LINGER_S.name, "0")

# Unix socket paths (agent, QMP, serial, node) live in node homes under tmp_path and may not exceed 108 bytes.
# pytest's default base, /tmp/pytest-of-<user>/pytest-<N>/<test name, 30 chars>0/, leaves only a few bytes
# of margin and loses them as N grows on a long-lived machine, which fails tests with "AF_UNIX path too
# long" on one machine and not on another. A run without --basetemp gets a short base of its own instead.
SHORT_TEMP_ROOT = Path("/tmp/shoal-t")
KEEP_TEMP_RUNS = 3


# Each test run marks its pid here while it runs: the sweeper below takes a cgroup parent named after a dead
# pid for a killed test run's only if that pid has a mark, so a real node whose parent happens to end in a
# number (SHOAL_CGROUP_PARENT=shoal-team-42, a Ray node's shoal-<id>) is never touched by a test run.
RUN_MARKS = Path("/run/shoal-test-runs")


def pytest_configure(config: pytest.Config) -> None:
    RUN_MARKS.mkdir(mode=0o700, parents=True, exist_ok=True)
    (RUN_MARKS / str(os.getpid())).touch()
    if config.option.basetemp is None:
        SHORT_TEMP_ROOT.mkdir(mode=0o700, exist_ok=True)
        _prune_old_runs(SHORT_TEMP_ROOT)
        config.option.basetemp = str(SHORT_TEMP_ROOT / str(os.getpid()))


def pytest_unconfigure(config: pytest.Config) -> None:
    (RUN_MARKS / str(os.getpid())).unlink(missing_ok=True)  # ended: its fixtures cleaned up what it made


def _prune_old_runs(root: Path) -> None:
    """Keep the newest finished runs' temp dirs (as pytest does); never one of a live run or with a mount."""
    mounted = Path("/proc/self/mountinfo").read_text()
    finished = [d for d in root.iterdir() if d.is_dir() and not (d.name.isdigit() and Path(f"/proc/{d.name}").exists())]
    finished.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for old in finished[KEEP_TEMP_RUNS:]:
        if f" {old}/" not in mounted and f" {old} " not in mounted:
            subprocess.run(["rm", "-rf", "--one-file-system", str(old)], check=False)


def runtime_unavailable(name: str) -> str | None:
    """Why sandboxes of container runtime `name` cannot run on this host (a skip reason), or None.

    crun, runc, runsc: their binary is missing. shoal (shoal's own launcher, launcher.py): it writes cgroup v1
    limits only and makes no user namespace, so a cgroup-v2-only host or a SHOAL_TEST_USERNS run has none."""
    if name != "shoal":
        return None if shutil.which(name) else f"runtime {name} is not installed on this host"
    from shoal import cgroups

    if cgroups.layout() == "v2":
        return "runtime shoal writes cgroup v1 limits: this host has cgroup v2 only"
    if settings.TEST_USERNS.is_set():
        return "runtime shoal makes no user namespace: this run maps every sandbox into one (SHOAL_TEST_USERNS)"
    return None


def default_runtime() -> str:
    """The runtime a test node gives containers that name none (SHOAL_RUNTIME, "auto": shoal where this host
    runs it, else crun): what the node's status()["runtime"]["default"] must say."""
    chosen = (settings.RUNTIME.get() or "auto").lower()
    if chosen != "auto":
        return chosen
    return "crun" if runtime_unavailable("shoal") else "shoal"


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
            # a running node's launcher keeps its next sandbox's init waiting in a cgroup of its own
            # (launcher.c, spare_cgroup), removed as the launcher leaves: none once the node stopped
            cgroup_dirs += [str(p) for p in parent.iterdir() if p.is_dir() and (node_stopped or not _is_spare(p))]
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
    # the OCI runtimes' state of each container (on tmpfs, config.runtime_state_root); a stopped node's root too
    shm = shm_state_dir(home)
    runtime_state = [
        str(p) for r in (shm, home / "runtime") for n in ("crun", "runc", "bundles") for p in r.glob(f"{n}/*")
    ]
    if node_stopped and shm.exists():
        runtime_state.append(str(shm))
    return {"mounts": mounts, "cgroups": cgroup_dirs, "agents": agents, "agent_helpers": helpers, "qemu": vms,
            "dirs": dirs, "links": links, "runtime_state": runtime_state,
            "nft": nft, "loops": loops, "vm_files": vm_files, "layers": layer_mounts(home)}  # fmt: skip


def until(condition, timeout: float = 60.0, what: str = "condition"):  # noqa: ANN001, ANN201
    """Poll `condition()` until it returns something truthy, and return that; fail naming `what` after `timeout` s.

    The tests' one polling helper. The pause between polls grows from 10 ms to 250 ms: a quick condition is seen
    quickly, and a slow one (a screen, a guest under TCG) is not polled hard enough to slow what it waits for."""
    deadline, pause = time.monotonic() + timeout, 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)


def sandbox_pid(home: Path, sandbox_id: str) -> int:
    """The host pid of a container sandbox's agent (its init), as the node recorded it in record.json."""
    record = json.loads((home / "sandboxes" / sandbox_id / "record.json").read_text())
    return int(record["node"]["instance"]["pid"])


def sandbox_roots(home: Path, cgroup_parent: str) -> list[str]:
    """Agents of the node at `home` whose root is their sandbox's overlay (upper under home/sandboxes).

    crun and runc sandboxes mount their overlay only in a mount namespace of their own (mountns.py): the
    host's table (`leftovers()["mounts"]`) never shows it; it lives exactly as long as the sandbox's processes."""
    upper = f"upperdir={home}/sandboxes/"
    found = []
    for pid in leftovers(home, cgroup_parent)["agents"]:
        try:
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields, _, fs = line.partition(" - ")
            if fields.split()[4] == "/" and fs.startswith("overlay ") and upper in fs:
                found.append(pid)
                break
    return found


def _is_spare(cgroup_dir: Path) -> bool:
    """The cgroup of a running launcher's spare (`.spare-<launcher pid>-<n>`)."""
    name = cgroup_dir.name
    return name.startswith(".spare-") and Path(f"/proc/{name.split('-')[1]}").exists()


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


# ---------------------------------------------------------------- leftovers of killed runs

# Cgroup parents that tests (and LocalCluster) name after the pytest process: shoal-test-<pid>,
# shoal-test-userns-<pid>, shoal-<node id>-<pid>... A parent whose <pid> no longer exists but is marked in
# RUN_MARKS belongs to a test run that was killed before its fixtures could clean up. A live run's pid
# exists, so its parents never match; a parent of anything but a test run has no mark.
_RUN_PARENT = re.compile(r"^shoal-[A-Za-z0-9._-]+-([0-9]+)$")
_PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())  # a larger number is no pid: never swept


def dead_run_parents() -> list[str]:
    """Cgroup parents of test runs whose process is gone (in any hierarchy, v1 or v2)."""
    from shoal import cgroups

    root = cgroups.ROOT
    hierarchies = [root] if cgroups.layout() == "v2" else [h for h in root.iterdir() if h.is_dir()]
    found = set()
    for hierarchy in hierarchies:
        try:
            entries = list(hierarchy.glob("shoal-*"))
        except OSError:
            continue
        for entry in entries:
            match = _RUN_PARENT.match(entry.name)
            pid = match[1] if match else ""
            killed = pid and int(pid) <= _PID_MAX and (RUN_MARKS / pid).exists() and not Path(f"/proc/{pid}").exists()
            if killed and entry.is_dir():
                found.add(entry.name)
    return sorted(found)


def _environ(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _nodes_of(parent: str) -> list[int]:
    """Node processes (python -m shoal.node) started with SHOAL_CGROUP_PARENT=parent."""
    wanted = b"\0SHOAL_CGROUP_PARENT=" + parent.encode() + b"\0"
    nodes = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"shoal.node"] and wanted in b"\0" + _environ(proc.name):
            nodes.append(int(proc.name))
    return nodes


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.1)
    return False


def sweep_dead_run(parent: str) -> list[str]:
    """Remove what the killed run owning cgroup `parent` left: its node (stopped with SIGTERM, so it closes its
    sandboxes and network as usual; SIGKILL if it hangs), then whatever is still there: processes in the
    parent's cgroups, the mounts of its sandboxes (found by sandbox ID, which is the cgroup's name) and the
    node's shared sandboxes mount (holding a directory of such an ID), and the cgroups. Returns what it did,
    for the session's log."""
    from shoal import cgroups

    done = []
    for pid in _nodes_of(parent):
        try:
            os.kill(pid, signal.SIGTERM)
            if not _gone(pid, 60):
                os.kill(pid, signal.SIGKILL)
                _gone(pid, 10)
        except ProcessLookupError:  # another run's sweep got there first
            continue
        done.append(f"stopped node {pid}")
    root = Path("/sys/fs/cgroup")
    ids = {
        p.name for h in [root, *root.iterdir()] if (h / parent).is_dir() for p in (h / parent).iterdir() if p.is_dir()
    }
    for freezer in [root / "freezer" / parent, root / parent]:  # frozen tasks do not die until thawed
        for state in [*freezer.glob("*/freezer.state"), *freezer.glob("*/cgroup.freeze")]:
            try:
                state.write_text("THAWED" if state.name == "freezer.state" else "0")
            except OSError:
                pass
    paths = [f"/{parent}/{sandbox_id}" for sandbox_id in sorted(ids)] + [f"/{parent}"]
    killed: set[int] = set()
    deadline = time.monotonic() + 30
    while (alive := {pid for path in paths for pid in cgroups.procs(path)}) and time.monotonic() < deadline:
        for pid in alive - killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed |= alive
        time.sleep(0.1)
    if killed:
        done.append(f"killed {len(killed)} processes")
    targets = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4]
        for sandbox_id in ids:
            home, marker, rest = target.partition(f"/sandboxes/{sandbox_id}")
            if marker and rest[:1] in ("", "/"):
                targets += [target, home + "/sandboxes"]
        # the node's shared sandboxes mount, found by a sandbox directory in it (crun/runc sandboxes mount
        # their overlays in namespaces of their own, so no mount of theirs points at it)
        if target.endswith("/sandboxes") and any(os.path.isdir(f"{target}/{i}") for i in ids):
            targets.append(target)
    for target in sorted(set(targets), key=len, reverse=True):  # deepest first
        if subprocess.run(["umount", "-l", target], capture_output=True).returncode == 0:
            done.append(f"unmounted {target}")
    for path in paths:
        cgroups.remove(path)
    for directory in cgroups.candidate_dirs(f"/{parent}"):
        if os.path.isdir(directory):
            done.append(f"could not remove {directory}")
    return done


@pytest.fixture(autouse=True, scope="session")
def _sweep_killed_runs() -> None:
    """Before anything starts: what earlier runs that were killed (SIGKILL, a CI timeout) left behind. Only
    parents named after a pid that no longer exists are touched, so concurrent live runs are safe."""
    for parent in dead_run_parents():
        for line in sweep_dead_run(parent):
            print(f"swept {parent}: {line}")
    for mark in RUN_MARKS.iterdir():  # the killed runs swept (or that left nothing)
        if not Path(f"/proc/{mark.name}").exists():
            mark.unlink(missing_ok=True)


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


@pytest.fixture(scope="module")
def function_workers_retired(client: shoal.Client, node: NodeProcess) -> Iterator[None]:
    """For a module whose calls start warm function workers on the session node: they are sandboxes of
    the node, so retire them when the module ends, or a later module's leak checks find them."""
    yield
    for image in ("debian", "debian-dev"):
        client.set_pool("function", image, size=0, wait=True)
    assert not no_leftovers(node.home, node.cgroup_parent)


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
