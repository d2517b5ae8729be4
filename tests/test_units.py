"""The pure parts, without root or a node: OCI bundle generation, the QEMU command line, network rules and
their nftables rendering, and validation of user input. `make test-fast` runs these (marker `fast`)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import msgspec
import pytest

from shoal.errors import InvalidRequestError
from shoal.node import network
from shoal.protocol import SandboxSpec
from shoal.substrates.container import oci
from shoal.substrates.container.seccomp import DENIED_SYSCALLS, gvisor_profile, seccomp_profile
from shoal.substrates.qemu.machine import Machine, MachineConfig

pytestmark = pytest.mark.fast


# ---------------------------------------------------------------- OCI bundle


def _bundle(**kw: object) -> dict:
    args = dict(hostname="sb", agent_binary="/opt/agent", cgroup_path="/shoal/sb", cpu=None, memory_mb=None, pids=64)
    return oci.bundle_config(**{**args, **kw})  # type: ignore[arg-type]


def test_bundle_runs_the_agent_as_pid1_on_fd3_with_limits() -> None:
    config = _bundle(cpu=1.5, memory_mb=256)
    assert config["process"]["args"] == [oci.AGENT_PATH, "--fd", "3"]
    resources = config["linux"]["resources"]
    assert resources["memory"] == {"limit": 256 << 20, "swap": 256 << 20}  # no swap beyond the limit
    assert resources["pids"] == {"limit": 64}
    assert resources["cpu"] == {"shares": 1536, "quota": 150_000, "period": oci.CPU_PERIOD_US}
    assert resources["devices"] == [{"allow": False, "access": "rwm"}]
    agent = next(m for m in config["mounts"] if m["destination"] == oci.AGENT_PATH)
    assert agent["source"] == "/opt/agent" and "ro" in agent["options"]
    assert config["process"]["noNewPrivileges"] is True
    assert config["linux"]["cgroupsPath"] == "/shoal/sb"


def test_bundle_without_limits_has_no_caps_but_a_default_weight() -> None:
    resources = _bundle(pids=None)["linux"]["resources"]
    assert "memory" not in resources and "pids" not in resources
    assert resources["cpu"] == {"shares": 1024}


def test_bundle_namespaces_and_user_namespace() -> None:
    plain = _bundle()["linux"]
    assert {n["type"] for n in plain["namespaces"]} == {"pid", "network", "ipc", "uts", "mount", "cgroup"}
    assert "uidMappings" not in plain
    shifted = _bundle(userns_base=100000)["linux"]
    assert {"type": "user"} in shifted["namespaces"]
    assert shifted["uidMappings"][0]["containerID"] == 0 and shifted["uidMappings"][0]["hostID"] == 100000


def test_bundle_for_runtimes_that_cannot_pass_a_socket() -> None:
    config = _bundle(agent_dir="/run/x", resolv_conf="/etc/shoal-resolv")
    assert config["process"]["args"] == [oci.AGENT_PATH, "--listen", f"{oci.AGENT_RUN_DIR}/agent.sock"]
    destinations = {m["destination"]: m for m in config["mounts"]}
    assert destinations[oci.AGENT_RUN_DIR]["source"] == "/run/x"
    assert destinations["/etc/resolv.conf"]["options"] == ["bind", "ro"]
    # the agent seals that directory itself (then drops CAP_SYS_ADMIN); gVisor needs PID 1 guarded
    assert "CAP_SYS_ADMIN" in config["process"]["capabilities"]["bounding"]
    assert "CAP_SYS_ADMIN" not in _bundle()["process"]["capabilities"]["bounding"]
    assert config["linux"]["seccomp"] == gvisor_profile()


def test_gvisor_profile_guards_pid_1_only() -> None:
    (rule,) = gvisor_profile()["syscalls"]
    assert {"kill", "tkill", "tgkill", "pidfd_open"} <= set(rule["names"]) and rule["action"] == "SCMP_ACT_ERRNO"
    assert rule["args"] == [{"index": 0, "value": 0xFFFFFFFF, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}]


def test_cpu_shares_are_bounded() -> None:
    assert oci.cpu_shares(None) == 1024 and oci.cpu_shares(0.0001) == 2 and oci.cpu_shares(10_000) == 262144


def test_seccomp_refuses_dangerous_calls_and_namespace_clones() -> None:
    profile = seccomp_profile()
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = {name for rule in profile["syscalls"] if "args" not in rule for name in rule["names"]}
    assert {"keyctl", "bpf", "kexec_load"} <= denied and set(DENIED_SYSCALLS) <= denied | {"clone3"}
    clone_rules = [r for r in profile["syscalls"] if r["names"] == ["clone"]]
    assert clone_rules and all(r["args"][0]["op"] == "SCMP_CMP_MASKED_EQ" for r in clone_rules)
    clone3 = next(r for r in profile["syscalls"] if r["names"] == ["clone3"])
    assert clone3["action"] == "SCMP_ACT_ERRNO"  # ENOSYS: libc falls back to clone, which the rules see


# ---------------------------------------------------------------- QEMU command line


def _machine(tmp_path: Path, **kw: object) -> Machine:
    config = dict(machine="q35", accel="tcg", cpus=2, memory_mb=256, kernel="/k", initramfs="/i", cmdline="quiet")
    return Machine(tmp_path, MachineConfig(**{**config, **kw}), tmp_path / "disk.qcow2")  # type: ignore[arg-type]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_qemu_argv_q35_under_tcg(tmp_path: Path) -> None:
    argv = _machine(tmp_path).argv()
    assert _option(argv, "-machine") == ["q35"] and _option(argv, "-accel") == ["tcg"]
    assert _option(argv, "-cpu") == ["max"] and _option(argv, "-smp") == ["2"] and _option(argv, "-m") == ["256"]
    devices = _option(argv, "-device")
    assert "virtio-blk-pci,drive=disk0,id=blk0" in devices and "virtio-serial-pci,id=vser0" in devices
    assert any("name=shoal.agent" in d for d in devices)  # the agent's virtio-serial port
    assert f"unix:{tmp_path / 'qmp.sock'},server=on,wait=off" in _option(argv, "-qmp")
    assert "-incoming" not in argv and "-nodefaults" in argv and "-no-reboot" in argv
    assert f"file={tmp_path / 'disk.qcow2'},if=none,id=disk0,format=qcow2,cache=unsafe,discard=unmap" in argv


def test_qemu_argv_microvm_under_kvm_restoring_shared_memory(tmp_path: Path) -> None:
    machine = _machine(tmp_path, machine="microvm", accel="kvm", memory_file="/t/memory", memory_shared=True)
    argv = machine.argv(incoming=tmp_path / "state")
    assert _option(argv, "-machine")[0].startswith("microvm,") and "memory-backend=mem" in _option(argv, "-machine")[0]
    assert _option(argv, "-cpu") == ["host"]
    assert "virtio-blk-device,drive=disk0,id=blk0" in _option(argv, "-device")  # no PCI on microvm
    assert "memory-backend-file,id=mem,size=256M,mem-path=/t/memory,share=on" in _option(argv, "-object")
    assert _option(argv, "-incoming") == ["defer"]  # migrate-incoming follows over QMP


def test_qemu_copies_map_template_memory_privately(tmp_path: Path) -> None:
    argv = _machine(tmp_path, memory_file="/t/memory", memory_shared=False).argv()
    assert any(o.endswith("share=off") for o in _option(argv, "-object"))


def test_machine_config_round_trips_through_json(tmp_path: Path) -> None:
    config = _machine(tmp_path, extra_args=["-S"]).config
    assert MachineConfig.from_json(msgspec.json.decode(msgspec.json.encode(config.to_json()))) == config


# ---------------------------------------------------------------- network rules


def test_rules_render_to_nftables() -> None:
    net = ipaddress.IPv4Network("1.2.3.4/32")
    assert network.Rule(net).nft() == "ip daddr 1.2.3.4/32 accept"
    assert network.Rule(net, "tcp", 443).nft() == "ip daddr 1.2.3.4/32 tcp dport 443 accept"
    assert network.Rule(net, None, 53).nft() == "ip daddr 1.2.3.4/32 meta l4proto { tcp, udp } th dport 53 accept"
    assert network.Rule(net, "udp").nft() == "ip daddr 1.2.3.4/32 meta l4proto udp accept"


def test_chain_allows_named_private_ranges_before_the_block_and_public_after() -> None:
    private = network.Rule(ipaddress.IPv4Network("10.1.0.0/16"), "tcp", 80)
    public = network.Rule(ipaddress.IPv4Network("0.0.0.0/0"))
    body = network.Policy(rules=[public, private]).chain_body()
    blocked = next(i for i, line in enumerate(body) if line.startswith("ip daddr {") and "tcp reset" in line)
    assert body.index(private.nft()) < blocked < body.index(public.nft())
    assert body[-1] == "drop" and network.Policy().none and network.Policy(rules=[public]).any_host


async def test_resolve_presets_addresses_and_configured_hosts() -> None:
    config = network.NetworkConfig(
        presets={"mirror": ["tcp://mirror.internal:443"]},
        hosts={"mirror.internal": ["10.9.8.7"]},
        pool=ipaddress.IPv4Network("10.200.0.0/18"),
        prefix="sh00",
    )
    policy = await network.resolve(["mirror", "udp://8.8.8.8:53", "*", "mirror"], config)
    assert sorted(r.nft() for r in policy.rules) == [  # the preset named twice counts once
        "ip daddr 0.0.0.0/0 accept",
        "ip daddr 10.9.8.7/32 tcp dport 443 accept",
        "ip daddr 8.8.8.8/32 udp dport 53 accept",
    ]
    assert policy.names == {"mirror.internal": ["10.9.8.7"]} and policy.any_host


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sctp://1.2.3.4:80", "protocol 'sctp' is not one of"),
        ("1.2.3.4:99999", "must be a number in 1..65535"),
        ("1.2.3.999", "is not a valid IPv4 address or CIDR"),
        (":80", "names no destination"),
        ("bad host!", "neither a preset"),
        (42, "give 'none', a preset name"),
    ],
)
async def test_bad_network_rules_say_what_is_wrong(spec: object, message: str) -> None:
    config = network.NetworkConfig(presets={}, hosts={}, pool=ipaddress.IPv4Network("10.0.0.0/18"), prefix="sh")
    with pytest.raises(InvalidRequestError, match=message):
        await network.resolve(spec, config)  # type: ignore[arg-type]


def test_normalise_accepts_every_documented_form() -> None:
    assert network.normalise("none") == [] and network.normalise(None) == [] and network.normalise([]) == []
    assert network.normalise("pypi") == ["pypi"]
    assert network.normalise({"pypi": True, "npm": False}) == ["pypi"]
    assert network.normalise(["none", "tcp://a:1"]) == ["tcp://a:1"]


def test_default_pool_is_a_stable_private_18() -> None:
    pool = ipaddress.IPv4Network(network.default_pool("sh1a2b"))
    assert pool.prefixlen == 18 and pool.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    assert network.default_pool("sh1a2b") == str(pool)


# ---------------------------------------------------------------- spec validation on the wire


def test_spec_fields_are_typed_on_the_wire() -> None:
    spec = msgspec.convert({"kind": "microvm", "memory_mb": 512, "network": ["pypi"]}, SandboxSpec)
    assert spec.memory_mb == 512 and spec.pids == 1024 and spec.on_timeout == "kill"
    with pytest.raises(msgspec.ValidationError, match="memory_mb"):
        msgspec.convert({"memory_mb": "lots"}, SandboxSpec)
    with pytest.raises(msgspec.ValidationError, match="network"):
        msgspec.convert({"network": 5}, SandboxSpec)


def test_pool_key_ignores_late_bound_fields() -> None:
    a = SandboxSpec(image="debian", env={"A": "1"}, labels={"x": "y"}, ttl_s=5)
    b = SandboxSpec(image="debian", workdir="/tmp", trajectory="t")
    assert a.pool_key() == b.pool_key() != SandboxSpec(image="debian", memory_mb=64).pool_key()


# ---------------------------------------------------------------- substrate contract


def test_every_kind_declares_capabilities_and_one_create() -> None:
    import inspect

    from shoal.substrates.base import Substrate
    from shoal.substrates.container import ContainerSubstrate
    from shoal.substrates.microvm import MicrovmSubstrate
    from shoal.substrates.vm import VmSubstrate

    base = inspect.signature(Substrate.create).parameters
    for cls in (ContainerSubstrate, MicrovmSubstrate, VmSubstrate):
        assert list(inspect.signature(cls.create).parameters) == list(base), cls  # restore is a parameter
        assert cls.capabilities.pause, cls
    assert ContainerSubstrate.capabilities.names() == ["pause", "image_commit", "disk_cap", "readopt"]
    for vm in (MicrovmSubstrate, VmSubstrate):
        assert vm.capabilities.names() == ["pause", "memory_snapshots", "disk_cap", "readopt", "guest_nic"]


async def test_a_container_refuses_a_memory_snapshot_before_touching_anything(tmp_path: Path) -> None:
    from shoal.substrates.container import ContainerSubstrate

    substrate = object.__new__(ContainerSubstrate)  # no agent binary needed: the check comes first
    substrate.sandboxes_dir = tmp_path / "sandboxes"
    with pytest.raises(InvalidRequestError, match="container sandboxes have no memory snapshots.*microvm/vm"):
        await substrate.create("x-1", SandboxSpec(), None, snapshot="snap-000000000000")  # type: ignore[arg-type]
    assert not (tmp_path / "sandboxes").exists()


# ---------------------------------------------------------------- user arguments → resources


def test_one_place_decides_memory_per_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal import resources

    monkeypatch.setenv("SHOAL_FN_MEMORY_MB", "333")
    assert resources.memory_mb("container", None, node_default=4096) == 4096
    assert resources.memory_mb("container", None, node_default=0) is None  # the node's default turned off
    assert resources.memory_mb("microvm", None) == 256 and resources.memory_mb("vm", None) == 512
    assert resources.memory_mb("function", None) == 333
    assert all(resources.memory_mb(kind, 99, 4096) == 99 for kind in ("container", "microvm", "vm", "function"))
    assert resources.quota_cost({}) == (1.0, 512) and resources.quota_cost({"cpu": 2, "memory_mb": 64}) == (2.0, 64)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cpu": 0}, "cpu=0 is impossible here: this node has 2 cores"),
        ({"cpu": 3}, "cpu=3 is impossible here"),
        ({"memory_mb": 4}, "memory_mb=4: a container needs at least 8 MB"),
        ({"kind": "microvm", "memory_mb": 32}, "memory_mb=32: a microvm needs at least 64 MB"),
        ({"memory_mb": 10_000}, "exceeds this node's 8000 MB"),
        ({"pids": 3}, "pids=3: a sandbox needs at least 4"),
        ({"disk_mb": 1}, "disk_mb=1 is below the minimum of 4 MB"),
        ({"kind": "function", "tmpfs": ["/work"]}, "tmpfs: only containers mount .*not function sandboxes"),
        ({"kind": "microvm", "tmpfs": ["/work"]}, "tmpfs: only containers mount .*not microvm sandboxes"),
        ({"tmpfs": ["work"]}, "tmpfs: 'work' is not an absolute, normalised directory path"),
        ({"tmpfs": ["/work/../etc"]}, "tmpfs: '/work/../etc' is not an absolute, normalised"),
        ({"tmpfs": ["/"]}, "tmpfs: '/' is not an absolute, normalised directory path below /"),
        ({"tmpfs": ["/dev/shm"]}, "tmpfs: '/dev/shm' is under /proc, /sys, /dev, /.shoal"),
        ({"tmpfs": ["/.shoal/x"]}, "tmpfs: '/.shoal/x' is under"),
        ({"tmpfs": [f"/t{i}" for i in range(9)]}, "tmpfs: at most 8 paths, not 9"),
    ],
)
def test_resource_arguments_are_checked_with_the_bound_named(fields: dict, message: str) -> None:
    from shoal import resources

    with pytest.raises(InvalidRequestError, match=message):
        resources.check(SandboxSpec(**fields), cores=2, total_mb=8000)
    resources.check(SandboxSpec(cpu=2, memory_mb=8000, pids=4, disk_mb=4), cores=2, total_mb=8000)
    resources.check(SandboxSpec(tmpfs=["/work", "/tmp", "/var/tmp"]), cores=2, total_mb=8000)


def test_bundle_mounts_an_empty_tmpfs_at_each_scratch_path() -> None:
    assert not [m for m in _bundle()["mounts"] if m["destination"] in ("/work", "/tmp")]
    mounts = {m["destination"]: m for m in _bundle(tmpfs=("/work", "/tmp"))["mounts"]}
    for path in ("/work", "/tmp"):
        assert mounts[path]["type"] == "tmpfs" and {"nosuid", "nodev"} <= set(mounts[path]["options"])
    assert SandboxSpec(tmpfs=["/work"]).pool_key() != SandboxSpec().pool_key()  # pools do not mix them


def test_oom_kill_count_reads_the_oom_kill_line_of_either_cgroup_version() -> None:
    from shoal.cgroups import oom_kill_count

    assert oom_kill_count(b"oom_kill_disable 0\nunder_oom 0\noom_kill 7\n") == 7  # v1 memory.oom_control
    assert oom_kill_count(b"low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 5\n") == 2  # v2 memory.events
    assert oom_kill_count(b"oom_kill 11") == 11
    assert oom_kill_count(b"oom_kill_disable 0\nunder_oom 0\n") == 0
    assert oom_kill_count(b"") == 0


async def test_a_pool_member_made_across_a_resize_to_zero_and_back_is_kept_not_orphaned() -> None:
    """A refill in flight while the pool is set to 0 and then to N again: its sandbox joins the new pool
    (it was appended to the dropped deque, where no claim or drain ever found it: a leaked sandbox)."""
    import asyncio

    from shoal.node.pools import WarmPools

    release, made, destroyed = asyncio.Event(), [], []

    async def make(spec: SandboxSpec) -> object:
        await release.wait()
        made.append(object())
        return made[-1]

    async def destroy(sandbox: object) -> None:
        destroyed.append(sandbox)

    pools, spec = WarmPools(make, destroy, refill_concurrency=1), SandboxSpec(image="busybox")
    await pools.configure(spec, 1)
    await asyncio.sleep(0.01)  # the refill waits in make()
    await pools.configure(spec, 0)
    await pools.configure(spec, 1)
    release.set()
    await pools.wait_full(spec, timeout=10)
    assert pools.take(spec) is made[0] and destroyed == []
    await pools.drain()


async def test_reaper_heap_wakes_for_due_deadlines_only_and_compacts() -> None:
    """The reaper's deadline heap (node/lifecycle.py): only due sandboxes are looked at, a deadline moved later
    is re-armed rather than acted on, and closed sandboxes' far entries do not pile up."""
    import time
    import types

    from shoal.node.lifecycle import Lifecycle
    from shoal.node.sandbox import State

    killed: list[str] = []

    class Host:
        sandboxes: dict = {}

        async def kill(self, sandbox_id: str, reason: str = "") -> None:
            killed.append(sandbox_id)
            self.sandboxes.pop(sandbox_id, None)

    def fake(i: str, expires_at: float | None) -> types.SimpleNamespace:
        spec = types.SimpleNamespace(idle_timeout_s=None, ttl_s=60.0, on_timeout="kill")
        return types.SimpleNamespace(id=i, spec=spec, expires_at=expires_at, state=State.READY, busy=0, inflight={},
                                     last_active=time.time())  # fmt: skip

    host = Host()
    reaper = Lifecycle(host)  # type: ignore[arg-type]
    now = time.time()
    far = {f"far-{n}": fake(f"far-{n}", now + 3600) for n in range(3000)}
    host.sandboxes.update(far, due=fake("due", now - 1), moved=fake("moved", now - 1))
    for sandbox in host.sandboxes.values():
        reaper.arm(sandbox)
    host.sandboxes["moved"].expires_at = now + 3600  # moved later after it was armed: not reaped
    await reaper.reap_due()
    assert killed == ["due"] and "moved" in host.sandboxes and reaper.deadline("moved") == now + 3600
    for name in far:
        host.sandboxes.pop(name)
        reaper.forget(name)
    assert reaper.heap_size <= 2 + 1024  # compacted: the 3,000 closed sandboxes' entries do not stay


# ---------------------------------------------------------------- the node's small state files (issue 12)


def _record_sandbox(directory: Path, labels: dict[str, str]) -> object:
    from shoal.images.store import Image, ImageConfig
    from shoal.node.sandbox import Sandbox
    from shoal.substrates import Instance

    instance = Instance(id="n-1", kind="container", directory=directory, agent_socket=directory / "agent.sock",
                        cgroup_path="/shoal/n-1", runtime="crun", pid=123)  # fmt: skip
    spec = SandboxSpec(kind="container", image="busybox", labels=labels)
    image = Image(name="busybox", layers=(), config=ImageConfig())
    return Sandbox(id="n-1", spec=spec, image=image, instance=instance, agent=None)  # type: ignore[arg-type]


def test_a_small_record_is_rewritten_in_place_and_a_large_one_by_rename(tmp_path: Path) -> None:
    """write_record rewrites record.json with one write into the file the substrate made (no new inode
    and rename per create on the home's ext4), padded with spaces when it shrinks; one that outgrows a page
    (which one write could not keep whole if the node died) is written to a new file and renamed."""
    import json

    from shoal.node.recovery import RECORD_IN_PLACE_MAX, write_record

    record = tmp_path / "record.json"
    record.write_text(json.dumps({"id": "n-1", "kind": "container", "runtime": "crun", "cgroup": "/shoal/n-1"}))
    inode = record.stat().st_ino
    sandbox = _record_sandbox(tmp_path, {"run": "r" * 300})
    write_record(sandbox)  # type: ignore[arg-type]
    grown = record.stat().st_size
    assert record.stat().st_ino == inode
    written = json.loads(record.read_text())
    assert written["runtime"] == "crun" and written["node"]["spec"]["labels"] == {"run": "r" * 300}
    assert written["node"]["instance"]["pid"] == 123
    sandbox.spec.labels = {}  # type: ignore[attr-defined]
    write_record(sandbox)  # type: ignore[arg-type]
    assert record.stat().st_ino == inode and record.stat().st_size == grown  # shorter: padded, not truncated
    assert json.loads(record.read_text())["node"]["spec"].get("labels", {}) == {}
    sandbox.spec.labels = {"big": "x" * RECORD_IN_PLACE_MAX}  # type: ignore[attr-defined]
    write_record(sandbox)  # type: ignore[arg-type]
    assert record.stat().st_ino != inode and not (tmp_path / "record.json.tmp").exists()
    assert json.loads(record.read_text())["node"]["spec"]["labels"]["big"] == "x" * RECORD_IN_PLACE_MAX


def _shm_is_tmpfs() -> bool:
    from shoal.config import SHM, _is_tmpfs

    return _is_tmpfs(SHM)


@pytest.mark.skipif(not _shm_is_tmpfs(), reason="this host has no tmpfs at /dev/shm: the home keeps the state")
def test_the_runtime_state_root_is_a_private_tmpfs_directory(tmp_path: Path) -> None:
    """crun's per-container state files go to tmpfs (/dev/shm/shoal-<hash>), made 0700; a directory there
    that is a planted symlink or open to others is not used (the home's runtime/ is)."""
    import os

    from shoal.config import SHM, runtime_state_root, shm_state_dir

    home = tmp_path / "home"
    root = runtime_state_root(home)
    try:
        assert root == shm_state_dir(home) and root.parent == SHM
        info = root.lstat()
        assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.geteuid()
        assert runtime_state_root(home) == root  # the same again, already there
        assert shm_state_dir(tmp_path / "other") != root
        root.chmod(0o755)
        assert runtime_state_root(home) == home / "runtime"
        root.rmdir()
        root.symlink_to(tmp_path)
        assert runtime_state_root(home) == home / "runtime"
    finally:
        if root.is_symlink():
            root.unlink()
        elif root.exists():
            root.rmdir()
    assert runtime_state_root(home, shm=tmp_path) == home / "runtime"  # not a tmpfs mount point


# ---------------------------------------------------------------- the node's default runtime (SHOAL_RUNTIME)


def test_default_runtime_falls_back_to_crun_where_the_launcher_cannot_run_and_refuses_bad_settings() -> None:
    from shoal.substrates.container.choice import choose

    under_userns = choose("auto", userns_base=100000)  # the launcher makes no user namespace
    assert under_userns.runtime == "crun" and "SHOAL_USERNS" in under_userns.reason
    assert under_userns.describe().startswith("auto → crun: ")
    assert choose(None, userns_base=100000).runtime == "crun"  # unset is auto
    with pytest.raises(ValueError, match="SHOAL_RUNTIME=shoal: .*SHOAL_USERNS"):  # named, but impossible here
        choose("shoal", userns_base=100000)
    with pytest.raises(ValueError, match="SHOAL_RUNTIME='docker': choose one of auto, shoal, crun, runc, runsc"):
        choose("docker", userns_base=None)


def test_step_keys_are_stable() -> None:
    """A step's key is in every trajectory log written so far: it must not change. Empty values (None, {}, [],
    False, and so 0 too) and volatile arguments (timeouts) leave it as if they were not sent."""
    from shoal.steps import step_key

    sent = {"cmd": ["true"], "env": {}, "cwd": None, "stdin": None, "merge_stderr": False, "timeout": 60.0}
    assert step_key("exec", sent) == step_key("exec", {"cmd": ["true"]}) == "87feaeef62fe71ff4bb4aabd"
    assert step_key("exec", {"cmd": "x", "n": 0, "s": ""}) == "938b1cedfa53095c446d2938"
    write = {"path": "/f", "data": b"x", "mode": 420, "append": True}
    assert step_key("file_write", write) == "191192de430c2689b9ac2619"
