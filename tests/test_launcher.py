"""runtime="shoal": shoal's own pre-forked launcher (substrates/container/launcher.c) instead of an OCI runtime.

The escape attempts run under it in tests/test_hardening.py; here: it gives a sandbox what crun gives (limits,
mounts, devices, capabilities, seccomp), pause/resume, no leftovers after a close, a create that fails
halfway or is cancelled, a killed launcher, and a SIGKILLed node whose successor re-adopts its sandboxes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import NodeProcess, leftovers, no_leftovers, runtime_unavailable, sandbox_pid, sandbox_roots, until

import shoal
from shoal import cgroups
from shoal.errors import InvalidRequestError, SandboxLostError
from shoal.guest import agent_binary_path
from shoal.images import Image
from shoal.images.store import ImageConfig
from shoal.protocol import SandboxSpec
from shoal.substrates.container import launcher
from shoal.substrates.container.substrate import ContainerSubstrate

pytestmark = pytest.mark.skipif(bool(runtime_unavailable("shoal")), reason=runtime_unavailable("shoal") or "")

# What a sandbox sees of its own isolation: mounts (point and per-mount flags), /dev, capabilities, seccomp,
# no_new_privs, hostname, open-file limit, its cgroup namespace's view, its network interfaces (loopback up).
SELF_VIEW = (
    "for i in /sys/class/net/*; do echo $i $(cat $i/operstate $i/flags); done; "
    "awk '{print $5, $6}' /proc/self/mountinfo | sed 's/,relatime//; s/,nosuid,nodev,noexec//' | sort; "
    "ls -l /dev /dev/pts | awk '{print $1, $5, $6, $NF}'; "
    "grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status; hostname; ulimit -n; cat /proc/self/cgroup"
)
LIMITS = [
    ("memory", "memory.limit_in_bytes"),
    ("memory", "memory.memsw.limit_in_bytes"),
    ("pids", "pids.max"),
    ("cpu", "cpu.shares"),
    ("cpu", "cpu.cfs_quota_us"),
    ("cpu", "cpu.cfs_period_us"),
    ("devices", "devices.list"),
    ("cpuset", "cpuset.cpus"),
    ("cpuset", "cpuset.mems"),
]


def _limits(node: NodeProcess, sandbox_id: str) -> dict[str, str]:
    rel = f"{node.cgroup_parent}/{sandbox_id}"
    found = {}
    for hierarchy, name in LIMITS:
        path = cgroups.ROOT / hierarchy / rel / name
        found[name] = path.read_text() if path.exists() else "(none)"
    found["hierarchies"] = " ".join(sorted(p.name for p in cgroups.ROOT.iterdir() if (p / rel).is_dir()))
    return found


def _agent_cgroup(node: NodeProcess, sandbox_id: str) -> str:
    pid = sandbox_pid(node.home, sandbox_id)
    return "".join(sorted(Path(f"/proc/{pid}/cgroup").read_text().splitlines(keepends=True)))


def test_a_shoal_sandbox_gets_what_crun_gives(node: NodeProcess, client: shoal.Client) -> None:
    shape = {"memory_mb": 128, "pids": 50, "cpu": 0.5, "tmpfs": ["/scratch/deep"], "pool": False, "ttl_s": 300}
    with (
        client.create(image="debian", runtime="crun", **shape) as crun,
        client.create(image="debian", runtime="shoal", **shape) as own,
    ):
        assert "shoal" in (node.home / "sandboxes" / own.id / "record.json").read_text()
        assert own.exec(SELF_VIEW).stdout == crun.exec(SELF_VIEW).stdout
        # one difference (issue 12): the launcher's sandbox joins its parent's cpuset, which has the cpus and
        # mems crun copies into a cpuset per container (launcher.c, in_parent_cpuset)
        own_limits, crun_limits = _limits(node, own.id), _limits(node, crun.id)
        parent_cpuset = cgroups.ROOT / "cpuset" / node.cgroup_parent
        assert own_limits == crun_limits | {
            "cpuset.cpus": "(none)", "cpuset.mems": "(none)",
            "hierarchies": crun_limits["hierarchies"].replace(" cpuset ", " "),
        }  # fmt: skip
        assert [(parent_cpuset / n).read_text() for n in ("cpuset.cpus", "cpuset.mems")] == [
            crun_limits["cpuset.cpus"], crun_limits["cpuset.mems"],
        ]  # fmt: skip
        own_cgroup = _agent_cgroup(node, own.id).replace(own.id, "X")
        own_cgroup = own_cgroup.replace(f":cpuset:/{node.cgroup_parent}\n", f":cpuset:/{node.cgroup_parent}/X\n")
        assert own_cgroup == _agent_cgroup(node, crun.id).replace(crun.id, "X")
        # the overlay is mounted in the sandbox's own mount namespace only, as with crun
        assert leftovers(node.home, node.cgroup_parent)["mounts"] == []
        pid = str(sandbox_pid(node.home, own.id))
        assert pid in sandbox_roots(node.home, node.cgroup_parent)
        own.files.write("/note", "written")
        assert own.exec("cat /note").stdout == "written"


def test_the_launcher_makes_the_next_sandbox_init_ahead_and_it_ends_with_the_launcher(tmp_path: Path) -> None:
    """Issue 12: the launcher clones the next sandbox's init into fresh pid/net/ipc/uts namespaces while it
    waits (the spare), so a create does not wait for them. The spare is one process that serves one sandbox:
    the next create's init is that very process, in the sandbox's cgroup, with a mount namespace made at the
    create and namespaces of its own (none shared with the host, the launcher or another sandbox); another
    spare is made for the next; spares end with the launcher (killed or stopped with the node)."""
    node = NodeProcess(tmp_path / "home", f"shoal-test-launcher-spare-{os.getpid()}").start()
    spares: list[int] = []
    try:
        with node.client() as client:
            client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300).close()  # starts the launcher
            launcher_pid = _launchers(node.pid)[0]
            until(lambda: len(_launchers(launcher_pid)) == 1)
            spare = _launchers(launcher_pid)[0]
            kinds = ("pid_for_children", "net", "ipc", "uts")
            assert all(_ns(spare, k) != _ns(launcher_pid, k) for k in kinds)
            assert _ns(spare, "mnt") == _ns(launcher_pid, "mnt")  # made at the create, from the mounts then
            # it waits in a cgroup made for the next sandbox (renamed to the sandbox's by the create)
            until(lambda: f"/{node.cgroup_parent}/.spare-{launcher_pid}-" in Path(f"/proc/{spare}/cgroup").read_text())
            # and holds its sandbox's /sys, /proc and /dev (devpts, shm, mqueue) made while it waited: detached
            # mounts, moved into its root at the create
            until(lambda: {"sysfs", "proc", "tmpfs", "devpts", "mqueue"} <= _held_filesystems(spare))
            # the image's layer was unmounted with the first sandbox and is mounted again after the spare was
            # made: the spare's mount namespace, made at the create, has it
            with (
                client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as first,
                client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as second,
            ):
                assert sandbox_pid(node.home, first.id) == spare
                assert first.exec("head -c 13 /proc/1/cmdline; echo; hostname").stdout == "/.shoal/agent\nsandbox\n"
                # its /sys was made while it waited (a clone of the launcher's template: a sysfs of a network
                # namespace with only lo, as its own), with crun's flags
                sysfs = "grep ' /sys ro' /proc/self/mountinfo | cut -d' ' -f5-; ls /sys/class/net"
                assert first.exec(sysfs).stdout == "/sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs rw\nlo\n"
                # its masked directories are one read-only bind of the node's empty directory: no superblock
                # of their own (each superblock makes every memory cgroup removal dearer)
                masked = first.exec(
                    "for d in /proc/acpi /sys/firmware /sys/kernel/debug; do ls -A $d; touch $d/x 2>/dev/null && echo "
                    "written; done; awk '$5 ~ /^(\\/proc\\/acpi|\\/sys\\/firmware|\\/sys\\/kernel\\/debug)$/ "
                    "{print $3, $6}' /proc/self/mountinfo | sort -u"
                ).stdout.splitlines()
                empty = os.stat(node.home / "runtime" / "masked").st_dev
                assert masked == [f"{os.major(empty)}:{os.minor(empty)} ro,relatime"], masked
                one, two = sandbox_pid(node.home, first.id), sandbox_pid(node.home, second.id)
                for kind in ("net", "ipc", "uts", "mnt", "pid", "cgroup"):
                    assert len({_ns(one, kind), _ns(two, kind), _ns(launcher_pid, kind)}) == 3
                assert f"/{node.cgroup_parent}/{first.id}" in Path(f"/proc/{one}/cgroup").read_text()
            until(lambda: len(_launchers(launcher_pid)) == 1)
            spares = _launchers(launcher_pid)
            os.kill(spares[0], signal.SIGKILL)  # a spare killed while it waits: another is made, creates go on
            until(lambda: len(_launchers(launcher_pid)) == 1 and _launchers(launcher_pid) != spares)
            with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as after:
                assert after.exec("echo ok").stdout == "ok\n"
            survivor = client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300)
            until(lambda: len(_launchers(launcher_pid)) == 1)
            spares = _launchers(launcher_pid)
            os.kill(launcher_pid, signal.SIGKILL)  # its spare sees its socket close and exits
            until(lambda: not Path(f"/proc/{spares[0]}").exists())
            with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as again:
                assert again.exec("echo again").stdout == "again\n"
            # a sandbox of the killed launcher's: its /sys cloned that launcher's template, whose lo went with it;
            # the next launcher gives it a sysfs of its own namespace (launcher.py, _restarted)
            until(lambda: survivor.exec("ls /sys/class/net").stdout == "lo\n")
            survivor.close()
            launcher_pid = _launchers(node.pid)[0]
            until(lambda: len(_launchers(launcher_pid)) == 1)
            spares = _launchers(launcher_pid)
            assert not no_leftovers(node.home, node.cgroup_parent)
    finally:
        node.stop()
    until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in spares))
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_sandboxes_share_one_read_only_sysfs_of_a_namespace_with_only_lo(
    node: NodeProcess, client: shoal.Client, tmp_path: Path
) -> None:
    """Issue 12: a sandbox's /sys is a clone of one sysfs the launcher mounted in a network namespace of its own
    with only its loopback (launcher.c, template_sysfs): no sysfs superblock per sandbox, whose mount walked
    every other one. It shows what the sandbox's own would (lo, up), read-only, masked, not the host's."""
    view = (
        "awk '$5 == \"/sys\" {print $3, $6}' /proc/self/mountinfo; ls /sys/class/net; cat /sys/class/net/lo/operstate; "
        "ls -A /sys/firmware; for f in /sys/class/net/lo/mtu /sys/kernel/mm/transparent_hugepage/enabled /sys/x; "
        "do echo 1 2>/dev/null >$f && echo wrote $f; done; mount -o remount,rw /sys 2>/dev/null && echo remounted; "
        "grep -c ' /sys' /proc/self/mountinfo"
    )
    host_sys_mounts = Path("/proc/self/mountinfo").read_text().count(" /sys ")
    with (
        client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as one,
        client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as two,
    ):
        seen = one.exec(view).stdout
        assert seen == two.exec(view).stdout  # one superblock: the same device number
        device, options, *rest = seen.split()
        host = os.stat("/sys").st_dev
        assert device != f"{os.major(host)}:{os.minor(host)}"  # not the host's sysfs
        assert options == "ro,nosuid,nodev,noexec,relatime"
        # only lo (up: "unknown"), /sys/firmware masked, nothing written, no remount; /sys and its masks (the
        # same mounts as crun's: test_a_shoal_sandbox_gets_what_crun_gives)
        assert rest[:2] == ["lo", "unknown"] and int(rest[2]) > 1, seen
        # a network policy's veth shows only in a sysfs of the sandbox's own namespace: it gets one first
        # (launcher.c, own_sysfs; here from a launcher of the test's), with the same flags, masks and view
        asyncio.run(_own_sysfs(tmp_path, sandbox_pid(node.home, one.id)))
        mine = one.exec(view).stdout.split()
        assert mine[0] not in (device, f"{os.major(host)}:{os.minor(host)}") and mine[1:] == [options, *rest], mine
        assert two.exec(view).stdout == seen  # the other keeps the clone
        with pytest.raises(SandboxLostError, match="own sysfs"):  # never the host's namespaces
            asyncio.run(_own_sysfs(tmp_path, os.getpid()))
    assert Path("/proc/self/mountinfo").read_text().count(" /sys ") == host_sys_mounts


async def _own_sysfs(tmp_path: Path, pid: int) -> None:
    own = launcher.Launcher(str(agent_binary_path()), tmp_path / "launcher.log", f"shoal-test-sysfs-{os.getpid()}")
    try:
        await own.own_sysfs(pid)
    finally:
        await own.close()


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _held_filesystems(pid: int) -> set[str]:
    """The filesystem types of what `pid` holds open (`stat -f`: a detached mount is in no mount table)."""
    fds = [str(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    return set(subprocess.run(["stat", "-f", "-c", "%T", *fds], capture_output=True, text=True).stdout.split())


def test_each_sandbox_gets_its_own_limits_whatever_the_spare_was_made_with(
    node: NodeProcess, client: shoal.Client
) -> None:
    """The spare waits in a cgroup with the last create's limits; a create of another shape takes it and
    writes what differs (memory raised and lowered, pids unset, the cpu quota changed): the limits are those a
    crun sandbox of the same shape gets."""
    shapes = [
        {"memory_mb": 64, "pids": 50, "cpu": 0.5},
        {"memory_mb": 256, "cpu": 1.5},
        {"memory_mb": 96, "pids": 70, "cpu": 0.25},
        {"memory_mb": 64, "pids": 50, "cpu": 0.5},
    ]
    for shape in shapes:
        with client.create(image="busybox", runtime="crun", pool=False, ttl_s=300, **shape) as crun:
            want = _limits(node, crun.id)
        time.sleep(0.2)  # the launcher makes its spare while it is idle
        with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300, **shape) as own:
            got = _limits(node, own.id)
            assert own.exec("echo ok").stdout == "ok\n"
        assert got == want | {"cpuset.cpus": "(none)", "cpuset.mems": "(none)",
                              "hierarchies": want["hierarchies"].replace(" cpuset ", " ")}, shape  # fmt: skip
    assert not no_leftovers(node.home, node.cgroup_parent)


def test_a_closed_sandboxs_cgroup_serves_a_later_one_from_zero(tmp_path: Path) -> None:
    """Issue 12: a destroyed sandbox's cgroup is kept (renamed to a spare's) and reset for a later sandbox
    instead of removed, which would walk every superblock's LRU lists under the cgroup mutex. The later
    sandbox starts from zero: little of the memory its predecessor charged (a 40 MiB file) left, memory peak,
    fail count and CPU usage zeroed, its own limits; the cgroup of one where the OOM killer fired is not kept (that
    count cannot be reset, and the node reads it as the sandbox's). Kept cgroups go with the launcher."""
    node = NodeProcess(tmp_path / "home", f"shoal-test-launcher-kept-{os.getpid()}").start()
    memory = cgroups.ROOT / "memory" / node.cgroup_parent

    try:
        with node.client() as client:
            inos, burnt = set(), 0.0
            for _ in range(2):
                with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300, memory_mb=256) as sb:
                    sb.exec("dd if=/dev/zero of=/fill bs=1M count=40 2>/dev/null; sync; "
                            "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")  # fmt: skip
                    assert int((memory / sb.id / "memory.max_usage_in_bytes").read_text()) > 40 << 20
                    burnt = max(burnt, sb.usage()["cpu_s"])
                    inos.add((memory / sb.id).stat().st_ino)
                _spare_waits(node)
            with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300, memory_mb=64, pids=40) as sb:
                assert (memory / sb.id).stat().st_ino in inos  # a kept one, renamed
                used = sb.usage()
                assert used["memory_bytes"] < 16 << 20 and used["cpu_s"] < burnt / 4, (used, burnt)
                assert int((memory / sb.id / "memory.max_usage_in_bytes").read_text()) < 16 << 20
                assert (memory / sb.id / "memory.failcnt").read_text() == "0\n"
                assert int((memory / sb.id / "memory.limit_in_bytes").read_text()) == 64 << 20
                assert (cgroups.ROOT / "pids" / node.cgroup_parent / sb.id / "pids.max").read_text() == "40\n"
                assert "written" not in sb.exec("head -c 1 /fill 2>/dev/null && echo written").stdout
                # the OOM killer fires in it: its cgroup is not kept
                sb.exec("head -c 100m /dev/zero > /dev/shm/fill; true")
                assert cgroups.oom_kills(f"/{node.cgroup_parent}/{sb.id}") > 0
                oomed = (memory / sb.id).stat().st_ino
            _spare_waits(node)
            with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as sb:
                _spare_waits(node)
                with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as other:
                    for each in (sb, other):
                        assert (memory / each.id).stat().st_ino != oomed
                        assert cgroups.oom_kills(f"/{node.cgroup_parent}/{each.id}") == 0
            assert not no_leftovers(node.home, node.cgroup_parent)
            assert any(memory.glob(".spare-*"))
    finally:
        node.stop()
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_creates_that_find_no_spare_ready_take_kept_cgroups_from_zero(tmp_path: Path) -> None:
    """Issue 12: the launcher makes its spare only while no create is in flight, so of creates that come
    together all but the first clone their child on the spot. Those take kept cgroups too, reset from zero with
    their own limits, instead of making new ones (which left the kept ones untaken: 16 concurrent
    create+exec+close cycles made and removed a cgroup in every hierarchy each). After 6 closes, 6 creates at
    once make at most one new cgroup: the one of the spare that waited before anything was kept."""
    node = NodeProcess(tmp_path / "home", f"shoal-test-launcher-spot-{os.getpid()}").start()
    memory = cgroups.ROOT / "memory" / node.cgroup_parent
    pids = cgroups.ROOT / "pids" / node.cgroup_parent
    burn = "dd if=/dev/zero of=/fill bs=1M count=8 2>/dev/null; i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"

    async def burst(client: shoal.AsyncClient, **limits: int) -> list:
        create = functools.partial(client.create, image="busybox", runtime="shoal", pool=False, ttl_s=300)
        return list(await asyncio.gather(*(create(**limits) for _ in range(6))))

    async def run() -> None:
        async with node.async_client() as client:
            first = await burst(client, memory_mb=256)
            await asyncio.gather(*(sb.exec(["sh", "-c", burn]) for sb in first))
            burnt = min([(await sb.usage())["cpu_s"] for sb in first])
            inos = {(memory / sb.id).stat().st_ino for sb in first}
            await asyncio.gather(*(sb.close() for sb in first))
            second = await burst(client, memory_mb=64, pids=40)
            try:
                new = [sb.id for sb in second if (memory / sb.id).stat().st_ino not in inos]
                assert len(new) <= 1, (new, [sb.id for sb in second])
                for sb in second:
                    used = await sb.usage()
                    assert used["cpu_s"] < burnt / 4, (used, burnt)
                    assert int((memory / sb.id / "memory.max_usage_in_bytes").read_text()) < 16 << 20
                    assert (memory / sb.id / "memory.failcnt").read_text() == "0\n"
                    assert int((memory / sb.id / "memory.limit_in_bytes").read_text()) == 64 << 20
                    assert (pids / sb.id / "pids.max").read_text() == "40\n"
                    assert (await sb.exec(["true"])).exit_code == 0
            finally:
                await asyncio.gather(*(sb.close() for sb in second))

    try:
        asyncio.run(run())
        assert not no_leftovers(node.home, node.cgroup_parent)
    finally:
        node.stop()
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_kept_cgroups_off_removes_every_closed_sandboxs_cgroup(tmp_path: Path) -> None:
    """SHOAL_KEPT_CGROUPS=0 (for operators who want no cgroup to serve two sandboxes): each sandbox gets a new
    cgroup and none is left under a spare's name but the waiting spare's own."""
    node = NodeProcess(tmp_path / "home", f"shoal-test-launcher-nokeep-{os.getpid()}", SHOAL_KEPT_CGROUPS="0").start()
    memory = cgroups.ROOT / "memory" / node.cgroup_parent
    try:
        with node.client() as client:
            inos = []
            for _ in range(3):
                with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as sb:
                    inos.append((memory / sb.id).stat().st_ino)
                _spare_waits(node)
            assert len(set(inos)) == 3, inos
            assert len(list(memory.glob(".spare-*"))) <= 1  # the waiting spare's own
    finally:
        node.stop()
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_the_cgroup_a_killed_launchers_spare_left_is_removed(tmp_path: Path) -> None:
    """A launcher removes its spare's cgroup as it leaves; one killed together with its node cannot. The next
    launcher removes such cgroups when it starts, and the node when it stops."""
    parent = f"shoal-test-launcher-stale-{os.getpid()}"
    node = NodeProcess(tmp_path / "home", parent).start()
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()  # a dead pid

    def stale() -> list[Path]:
        return [Path(h) / parent / f".spare-{gone}-1" for h in launcher.hierarchies()]

    def leave_stale() -> None:
        for directory in stale():
            directory.mkdir(parents=True, exist_ok=True)

    try:
        leave_stale()
        with node.client() as client:
            client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300).close()  # starts a launcher
            assert not any(d.exists() for d in stale())
        leave_stale()
    finally:
        node.stop()
    assert not no_leftovers(node.home, parent, node_stopped=True)


def test_pause_resume_and_close_leave_nothing(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "home", f"shoal-test-launcher-{os.getpid()}").start()
    try:
        with node.client() as client:
            sb = client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300)
            sb.exec("sleep 1000 >/dev/null 2>&1 &")
            sb.pause()
            assert client.get(sb.id).info.state == "paused"
            freezer = cgroups.ROOT / "freezer" / node.cgroup_parent / sb.id / "freezer.state"
            assert freezer.read_text().strip() == "FROZEN"
            sb.resume()
            assert freezer.read_text().strip() == "THAWED"
            assert "sleep 1000" in sb.exec("ps").stdout
            sb.close()
            for _ in range(3):  # one after another: the launcher serves every create
                with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as again:
                    assert again.exec("echo $((6*7))").stdout == "42\n"
            assert not no_leftovers(node.home, node.cgroup_parent)
            launchers = _launchers(node.pid)
            assert len(launchers) == 1
            os.kill(launchers[0], signal.SIGKILL)  # a lost launcher: the next create starts another
            until(lambda: not _launchers(node.pid))
            with client.create(image="busybox", runtime="shoal", pool=False, ttl_s=300) as after:
                assert after.exec("echo again").stdout == "again\n"
            assert not no_leftovers(node.home, node.cgroup_parent)
            second = _launchers(node.pid)
            assert len(second) == 1 and second != launchers
            # many requests at once: more than a unix packet socket queues (net.unix.max_dgram_qlen, 10), so
            # senders wait for room, each in turn (all at once, they lost their wake-ups and hung)
            made = client.create_many(40, image="busybox", runtime="shoal", pool=False, ttl_s=300, concurrency=16)
            assert all(isinstance(m, shoal.Sandbox) for m in made), made
            closing = threading.Thread(target=lambda: closed.append(client.close_all()))
            closed: list[int] = []
            closing.start()
            closing.join(300)
            assert closed == [40]
    finally:
        node.stop()
    until(lambda: not Path(f"/proc/{second[0]}").exists())  # it ended with the node, and was reaped
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_sigkilled_node_leaves_shoal_sandboxes_running_and_its_successor_adopts_them(tmp_path: Path) -> None:
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-launcher-recover-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            kept = [client.create(image="busybox", runtime="shoal", pool=False, ttl_s=600) for _ in range(2)]
            for i, sb in enumerate(kept):
                sb.files.write("/kept", f"file {i}")
                sb.exec("sleep 1000 >/dev/null 2>&1 &")
            kept[1].pause()
            victim = client.create(image="busybox", runtime="shoal", pool=False, ttl_s=600)
            victim_pid = sandbox_pid(doomed.home, victim.id)
            launcher_pid = _launchers(doomed.pid)[0]
        doomed.stop(signal.SIGKILL)
        until(lambda: not Path(f"/proc/{launcher_pid}").exists())  # its socket closed: it exited
        found = leftovers(doomed.home, doomed.cgroup_parent)
        assert len(found["agents"]) == 3 and found["mounts"] == []  # still running, reparented, no zombie
        os.kill(victim_pid, signal.SIGKILL)  # this one dies while no node watches: its successor removes it
        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            assert sorted(client.status()["adopted"]) == sorted(s.id for s in kept)
            assert victim.id in client.status()["lost"]
            for i, sb in enumerate(kept):
                again = client.get(sb.id)
                assert again.files.read_text("/kept") == f"file {i}"  # the paused one: resumed transparently
                assert "sleep 1000" in again.exec("ps").stdout
                # the template its /sys cloned (launcher.c) ended with its launcher: it got a sysfs of its own
                assert again.exec("ls /sys/class/net").stdout == "lo\n"
            assert client.close_all() == 2
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
    finally:
        if restarted is None:
            doomed.stop(signal.SIGKILL)
            restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        restarted.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


async def test_creates_that_fail_halfway_or_are_cancelled_leave_nothing(tmp_path: Path) -> None:
    """Driven through the container substrate itself: a layer that does not exist makes the launcher's child
    fail at the overlay (after the cgroup, pid file and namespaces were made); cancels land at every stage."""
    home = tmp_path / "home"
    (home / "sandboxes").mkdir(parents=True)
    parent = f"shoal-test-launcher-cancel-{os.getpid()}"
    substrate = ContainerSubstrate(home / "sandboxes", home / "runtime", cgroup_parent=parent)
    empty = tmp_path / "layer"  # the agent is static and bind-mounted: an empty root filesystem runs it
    empty.mkdir()
    spec = SandboxSpec(image="empty", runtime="shoal", memory_mb=64, pids=32)
    good = Image(name="empty", layers=(empty,), config=ImageConfig())
    broken = Image(name="broken", layers=(tmp_path / "missing",), config=ImageConfig())
    try:
        with pytest.raises(SandboxLostError, match="overlay"):
            await substrate.create("fail-1", spec, broken)
        made = await substrate.create("ok-1", spec, good)
        assert made.pid and f"/{parent}/ok-1" in Path(f"/proc/{made.pid}/cgroup").read_text()
        await substrate.destroy(made)
        for i in range(12):  # cancelled after 0, 1, 2 ... ms: before the request, in the launcher, after
            task = asyncio.ensure_future(substrate.create(f"cancel-{i}", spec, good))
            await asyncio.sleep(i / 1000)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                continue
            await substrate.destroy(task.result())  # it finished before the cancel
        found = {k: v for k, v in leftovers(home, parent).items() if v}
        assert not found, found
        until(lambda: _zombies(_launchers(os.getpid())) == [])  # each init reaped by the launcher
    finally:
        await substrate.close()
        for directory in cgroups.sandbox_dirs(f"/{parent}"):
            directory.rmdir()


async def test_links_an_image_plants_lead_nowhere_on_the_host(tmp_path: Path) -> None:
    """A layer whose /.shoal, /dev, /proc or a tmpfs path is a symlink to a host directory: everything the
    launcher makes or mounts in the sandbox's root is resolved inside that root (it pivots first), so the
    host directory stays empty whether the create then fails or not."""
    home = tmp_path / "home"
    (home / "sandboxes").mkdir(parents=True)
    parent = f"shoal-test-launcher-links-{os.getpid()}"
    substrate = ContainerSubstrate(home / "sandboxes", home / "runtime", cgroup_parent=parent)
    host = tmp_path / "host"
    host.mkdir()
    try:
        for i, name in enumerate([".shoal", "dev", "proc", "sys", "scratch"]):
            layer = tmp_path / f"layer-{i}"
            layer.mkdir()
            (layer / name).symlink_to(host)
            image = Image(name=f"links-{i}", layers=(layer,), config=ImageConfig())
            spec = SandboxSpec(image=image.name, runtime="shoal", tmpfs=["/scratch"] if name == "scratch" else [])
            try:
                made = await substrate.create(f"links-{i}", spec, image)
            except SandboxLostError:
                pass
            else:
                await substrate.destroy(made)
            assert list(host.iterdir()) == [], name
            assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(host) in line]
        found = {k: v for k, v in leftovers(home, parent).items() if v}
        assert not found, found
    finally:
        await substrate.close()
        for directory in cgroups.sandbox_dirs(f"/{parent}"):
            directory.rmdir()


def test_the_runtime_refuses_what_it_does_not_do(client: shoal.Client) -> None:
    with pytest.raises(InvalidRequestError, match="SHOAL_USERNS"):
        launcher.check_host(100000)
    with pytest.raises(shoal.InvalidRequestError, match="shoal"):  # the list of runtimes names it
        client.create(image="busybox", runtime="nope")


def _spare_waits(node: NodeProcess) -> None:
    """Until the node's launcher has made its spare (while idle) and the spare joined its cgroup: a create then
    takes that cgroup."""
    parent = _launchers(node.pid)[0]
    until(lambda: any(".spare-" in Path(f"/proc/{p}/cgroup").read_text() for p in _launchers(parent)))
    time.sleep(0.05)  # its answer, sent once it joined


def _launchers(parent: int) -> list[int]:
    """shoal-launcher processes whose parent is `parent`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if name == "shoal-launcher" and int(rest[1]) == parent:
                found.append(int(proc.name))
    return found


def _zombies(parents: list[int]) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) in parents:
            found.append(int(proc.name))
    return found
