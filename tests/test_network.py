"""Network policy against real servers on test hosts: network namespaces this module makes and removes.

Each test host is a namespace with a veth to the host, an address in 192.168.x.0/30 and a TCP echo
server on ports 8080 and 9090. The node under test gets a config mapping names to those hosts (as a site
maps its mirrors), so names, presets and DNS are exercised without the internet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DEBIAN_RELEASE, FETCH, NodeProcess, no_leftovers, outside_network, runtime_unavailable, sandbox_pid

import shoal

ECHO_SERVER = """
import socketserver, sys
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer.daemon_threads = True
class UdpEcho(socketserver.BaseRequestHandler):
    def handle(self):
        data, sock = self.request
        sock.sendto(data, self.client_address)
servers = [socketserver.ThreadingTCPServer(("0.0.0.0", p), Echo) for p in (8080, 9090)]
servers.append(socketserver.UDPServer(("0.0.0.0", 8080), UdpEcho))
import threading
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
servers[0].serve_forever()
"""

PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=3)
        s.sendall(b"ping\\n")
        print(target, "open" if s.recv(16) == b"ping\\n" else "mute")
        s.close()
    except OSError as e:
        print(target, "closed", type(e).__name__)
"""


class EchoHost:
    """A network namespace with an echo server, reachable from the host at `address`."""

    def __init__(self, name: str, subnet: int) -> None:
        self.name = name
        self.link = f"{name}h"
        self.gateway = f"192.168.{subnet}.1"
        self.address = f"192.168.{subnet}.2"
        self.server: subprocess.Popen | None = None

    def start(self) -> EchoHost:
        for cmd in (
            f"ip netns add {self.name}",
            f"ip link add {self.link} type veth peer name eth0 netns {self.name}",
            f"ip addr add {self.gateway}/30 dev {self.link}",
            f"ip link set {self.link} up",
            f"ip -n {self.name} addr add {self.address}/30 dev eth0",
            f"ip -n {self.name} link set eth0 up",
            f"ip -n {self.name} link set lo up",
            f"ip -n {self.name} route add default via {self.gateway}",
        ):
            subprocess.run(cmd.split(), check=True)
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE
        )
        assert self.server.stdout is not None and self.server.stdout.readline() == b"ready\n"
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        subprocess.run(["ip", "link", "delete", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[EchoHost, EchoHost]]:
    tag = os.getpid() % 100000
    base = 160 + os.getpid() % 40 * 2
    made = []
    try:
        for i in range(2):
            made.append(EchoHost(f"shtst{tag}{'ab'[i]}", base + i).start())
        yield made[0], made[1]
    finally:
        for host in made:
            host.stop()


@pytest.fixture(scope="module")
def netnode(tmp_path_factory: pytest.TempPathFactory, hosts: tuple[EchoHost, EchoHost]) -> Iterator[NodeProcess]:
    a, b = hosts
    config = tmp_path_factory.mktemp("netcfg") / "network.json"
    config.write_text(
        json.dumps(
            {
                "hosts": {"mirror-a.test": a.address, "mirror-b.test": b.address},
                "presets": {"mirror": ["tcp://mirror-a.test:8080"], "other": ["tcp://mirror-b.test:8080"]},
            }
        )
    )
    home = tmp_path_factory.mktemp("net-home")
    proc = NodeProcess(home, f"shoal-test-net-{os.getpid()}", SHOAL_NETWORK_CONFIG=str(config)).start()
    yield proc
    proc.stop()
    assert not no_leftovers(proc.home, proc.cgroup_parent, node_stopped=True)


@pytest.fixture(scope="module")
def nclient(netnode: NodeProcess) -> Iterator[shoal.Client]:
    with netnode.client() as c:
        yield c


def reach(sb: shoal.Sandbox, *targets: str) -> dict[str, str]:
    out = sb.exec(["python3", "-c", PROBE, *targets], timeout=30).stdout
    return {line.split()[0]: line.split()[1] for line in out.splitlines()}


def test_default_is_loopback_only(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, _ = hosts
    with nclient.create(image="debian", pool=False) as sb:
        assert reach(sb, f"{a.address}:8080") == {f"{a.address}:8080": "closed"}
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]


@pytest.mark.parametrize("runtime", ["crun", "shoal"])
def test_allowlist_by_address_and_port(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost], runtime: str) -> None:
    if reason := runtime_unavailable(runtime):
        pytest.skip(reason)
    a, b = hosts
    with nclient.create(image="debian", pool=False, network=[f"tcp://{a.address}:8080"], runtime=runtime) as sb:
        got = reach(sb, f"{a.address}:8080", f"{a.address}:9090", f"{b.address}:8080", f"{a.gateway}:22")
        assert got == {
            f"{a.address}:8080": "open",
            f"{a.address}:9090": "closed",  # same host, other port
            f"{b.address}:8080": "closed",  # other host
            f"{a.gateway}:22": "closed",  # the host itself
        }


def test_private_and_metadata_ranges_blocked_unless_named(
    nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]
) -> None:
    a, b = hosts
    with nclient.create(image="debian", pool=False, network=["0.0.0.0/0", f"{b.address}/32"]) as sb:
        got = reach(sb, f"{a.address}:8080", f"{b.address}:9090", "169.254.169.254:80", "10.0.0.1:80")
        assert got == {
            f"{a.address}:8080": "closed",  # private: "everything" does not include it
            f"{b.address}:9090": "open",  # named explicitly
            "169.254.169.254:80": "closed",
            "10.0.0.1:80": "closed",
        }


@pytest.mark.parametrize("runtime", ["crun", "shoal"])
def test_sandboxes_cannot_reach_each_other(
    nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost], runtime: str
) -> None:
    if reason := runtime_unavailable(runtime):
        pytest.skip(reason)
    a, _ = hosts
    with (
        nclient.create(image="debian", pool=False, network="mirror", runtime=runtime) as one,
        nclient.create(image="debian", pool=False, network="mirror", runtime=runtime) as two,
    ):
        address = one.set_network("mirror")["address"]
        one.exec("python3 -m http.server 8000 >/dev/null 2>&1 &")
        time.sleep(1)
        assert reach(two, f"{address}:8000") == {f"{address}:8000": "closed"}
        assert reach(two, f"{a.address}:8080")[f"{a.address}:8080"] == "open"


def test_names_presets_and_dns(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, b = hosts
    with nclient.create(image="debian", pool=False, network={"mirror": True, "other": False}) as sb:
        assert sb.exec("getent hosts mirror-a.test").stdout.split() == [a.address, "mirror-a.test"]
        for name in ("mirror-b.test", "pypi.org", "example.com"):
            assert sb.exec(f"getent hosts {name}").exit_code == 2, f"DNS answered {name}"
        # DNS to any server is answered by the node's resolver, with the same allowlist
        assert sb.exec("getent hosts mirror-b.test; echo nameserver 8.8.8.8 > /etc/resolv.conf; "
                       "getent hosts mirror-a.test").stdout.split() == [a.address, "mirror-a.test"]  # fmt: skip
        got = reach(sb, "mirror-a.test:8080", f"{b.address}:8080")
        assert got == {"mirror-a.test:8080": "open", f"{b.address}:8080": "closed"}


def test_any_host_policy_resolves_names(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    if (why := outside_network()) is not None:
        pytest.skip(why)
    a, _ = hosts
    with nclient.create(image="debian", pool=False, network="*") as sb:
        assert sb.exec("getent hosts deb.debian.org").exit_code == 0, "network='*' must resolve public names"
        fetched = sb.exec(["python3", "-c", FETCH, DEBIAN_RELEASE], timeout=60)
        assert "Codename: bookworm" in fetched.stdout, fetched.stderr
        assert sb.exec("getent hosts no-such-name.invalid").exit_code == 2  # NXDOMAIN still says so
        assert reach(sb, f"{a.address}:8080") == {f"{a.address}:8080": "closed"}  # private ranges stay shut


UDP_PROBE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
try:
    s.sendto(b"ping", (sys.argv[1], 8080)); print("open" if s.recv(16) == b"ping" else "mute")
except OSError as e:
    print("closed", type(e).__name__)
"""


def test_protocol_in_rules(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, _ = hosts
    with nclient.create(image="debian", pool=False, network=[f"tcp://{a.address}:8080"]) as sb:
        assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "open"
        assert sb.exec(["python3", "-c", UDP_PROBE, a.address]).stdout.split()[0] == "closed"
        sb.set_network([f"udp://{a.address}:8080"])
        assert sb.exec(["python3", "-c", UDP_PROBE, a.address]).stdout == "open\n"
        assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "closed"
        sb.set_network([f"{a.address}:8080"])  # no protocol: both
        assert sb.exec(["python3", "-c", UDP_PROBE, a.address]).stdout == "open\n"
        assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "open"


def test_concurrent_policy_changes_apply_in_turn(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    import concurrent.futures

    a, b = hosts
    with nclient.create(image="debian", pool=False) as sb:
        policies = ["mirror", "other", ["mirror", "other"], "none", "mirror"]
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            list(pool.map(sb.set_network, policies))
        assert sb.exec("ls /sys/class/net").stdout.split() == ["eth0", "lo"]  # one veth, however many calls
        sb.set_network("other")
        assert reach(sb, f"{a.address}:8080", f"{b.address}:8080") == {
            f"{a.address}:8080": "closed",
            f"{b.address}:8080": "open",
        }


def test_set_network_at_runtime(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, b = hosts
    with nclient.create(image="debian", pool=False) as sb:
        assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "closed"
        applied = sb.set_network("mirror")
        assert applied["names"] == {"mirror-a.test": [a.address]} and applied["address"]
        assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "open"
        sb.set_network(["tcp://mirror-b.test:8080"])
        assert reach(sb, f"{a.address}:8080", f"{b.address}:8080") == {
            f"{a.address}:8080": "closed",
            f"{b.address}:8080": "open",
        }
        sb.set_network("none")
        assert reach(sb, f"{b.address}:8080")[f"{b.address}:8080"] == "closed"


OPEN_CONNECTION = """
import os, socket, sys, time
s = socket.create_connection((sys.argv[1], 8080), timeout=5)
s.sendall(b"one\\n"); assert s.recv(16) == b"one\\n"
open("/tmp/stage1", "w").close()
while not os.path.exists("/tmp/go"): time.sleep(0.05)
try:
    s.sendall(b"two\\n"); data = s.recv(16)
    result = "echoed" if data == b"two\\n" else f"eof {data!r}"
except OSError as e:
    result = type(e).__name__
open("/tmp/result", "w").write(result)
"""


def test_revoking_cuts_an_open_connection(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, _ = hosts
    with nclient.create(image="debian", pool=False, network="mirror") as sb:
        sb.files.write("/tmp/probe.py", OPEN_CONNECTION)
        sb.exec(f"python3 /tmp/probe.py {a.address} >/tmp/log 2>&1 &")
        wait_for(sb, "/tmp/stage1")
        sb.set_network(["tcp://mirror-b.test:8080"])
        sb.exec("touch /tmp/go")
        result = wait_for(sb, "/tmp/result")
        assert result in {"ConnectionResetError", "TimeoutError", "BrokenPipeError"}, result


def test_granting_keeps_an_open_connection(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, _ = hosts
    with nclient.create(image="debian", pool=False, network="mirror") as sb:
        sb.files.write("/tmp/probe.py", OPEN_CONNECTION)
        sb.exec(f"python3 /tmp/probe.py {a.address} >/tmp/log 2>&1 &")
        wait_for(sb, "/tmp/stage1")
        sb.set_network(["mirror", "other"])
        sb.exec("touch /tmp/go")
        assert wait_for(sb, "/tmp/result") == "echoed"


def wait_for(sb: shoal.Sandbox, path: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sb.files.exists(path):
            return sb.files.read_text(path)
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear; log: {sb.exec('cat /tmp/log').stdout}")


def test_network_is_late_bound_on_pool_claim(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    a, _ = hosts
    nclient.set_pool("container", "debian", 1, wait=True, pids=333)
    try:
        with nclient.create(image="debian", pids=333, network="mirror") as sb:
            assert reach(sb, f"{a.address}:8080")[f"{a.address}:8080"] == "open"
    finally:
        nclient.set_pool("container", "debian", 0, pids=333)


def test_bad_policies_are_clear_errors(nclient: shoal.Client) -> None:
    cases = {
        "ftp://1.2.3.4:21": "protocol",
        "1.2.3.4:99999": "port",
        "300.1.2.3": "not a valid IPv4",
        "no-such-host.invalid:80": "cannot resolve",
        "bad name!": "neither a preset",
    }
    for rule, message in cases.items():
        with pytest.raises(shoal.InvalidRequestError, match=message):
            nclient.create(image="busybox", pool=False, network=[rule])
    with pytest.raises(shoal.InvalidRequestError, match="network"):
        nclient.create(image="busybox", pool=False, network=[1, 2])  # type: ignore[list-item]
    with nclient.create(image="busybox", pool=False) as sb, pytest.raises(shoal.InvalidRequestError, match="port"):
        sb.set_network("1.2.3.4:0")


PROBE6 = """
import errno, socket, sys
for host in sys.argv[1:]:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect((host, 80))
        print(host, "open")
    except OSError as e:
        print(host, errno.errorcode.get(e.errno, str(e.errno)))
    finally:
        s.close()
"""


def _host_ipv6() -> dict[str, str]:
    """This host's IPv6 addresses by interface (from /proc/net/if_inet6), loopback left out."""
    out = {}
    for line in Path("/proc/net/if_inet6").read_text().splitlines():
        hexaddr, *_, ifname = line.split()
        if ifname != "lo":
            out[":".join(hexaddr[i : i + 4] for i in range(0, 32, 4))] = ifname
    return out


def test_ipv6_is_off_in_sandboxes(nclient: shoal.Client, netnode: NodeProcess) -> None:
    """Sandboxes speak IPv4 only (docs/SECURITY.md): their links get no IPv6 address, the host end neither,
    so nothing over IPv6 leaves a sandbox; IPv6 rules are refused with a clear error."""
    for rule in ("2001:db8::1", "tcp://[2001:db8::1]:443", "fd00::/8"):
        with pytest.raises(shoal.InvalidRequestError, match="IPv6 destinations are not supported"):
            nclient.create(image="busybox", pool=False, network=[rule])
    if not Path("/proc/net/if_inet6").exists():
        pytest.skip("this kernel has no IPv6 (ipv6.disable=1): there is nothing to turn off in sandboxes")
    with nclient.create(image="debian", pool=False, network="0.0.0.0/0") as sb:
        assert "eth0" not in sb.exec("cat /proc/net/if_inet6").stdout
        ifname = json.loads((netnode.home / "sandboxes" / sb.id / "network.json").read_text())["ifname"]
        assert ifname not in _host_ipv6().values()  # no link-local address on the host end either
        targets = ["2001:db8::1", *(a for a, i in _host_ipv6().items() if not a.startswith("fe80"))]
        got = dict(
            line.split() for line in sb.exec(["python3", "-c", PROBE6, *targets], timeout=60).stdout.splitlines()
        )
        assert got == dict.fromkeys(targets, "ENETUNREACH"), got


@pytest.mark.parametrize("runtime", ["crun", "shoal"])
def test_no_plumbing_left_after_close(nclient: shoal.Client, netnode: NodeProcess, runtime: str) -> None:
    if reason := runtime_unavailable(runtime):
        pytest.skip(reason)
    made = [nclient.create(image="busybox", pool=False, network="mirror", runtime=runtime) for _ in range(4)]
    made[0].set_network("none")
    for sb in made:
        sb.close()
    assert not no_leftovers(netnode.home, netnode.cgroup_parent)


def test_killed_node_readopts_networked_sandboxes_with_their_policy(
    tmp_path: Path, hosts: tuple[EchoHost, EchoHost]
) -> None:
    """kill -9 of the node: its networked containers are adopted by the next one with the same address and
    policy (re-plumbed on their recorded slots); one that died meanwhile is lost and leaves no plumbing."""
    a, b = hosts
    allowed, other_port, other_host = f"{a.address}:8080", f"{a.address}:9090", f"{b.address}:8080"
    expect = {allowed: "open", other_port: "closed", other_host: "closed"}
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-netkill-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            kept = [
                client.create(image="debian", pool=False, network=[f"tcp://{allowed}"], ttl_s=900) for _ in range(3)
            ]
            victim = client.create(image="busybox", pool=False, network="0.0.0.0/0", ttl_s=900)
            addresses = {}
            for sb in kept:
                assert reach(sb, allowed, other_port, other_host) == expect
                addresses[sb.id] = sb.exec("cat /etc/resolv.conf; grep -v '^lo' /proc/net/fib_trie | sort -u").stdout
                assert "nameserver" in addresses[sb.id] and "|--" in addresses[sb.id], addresses[sb.id]
            victim_pid = sandbox_pid(doomed.home, victim.id)
        doomed.stop(signal.SIGKILL)
        assert no_leftovers(doomed.home, doomed.cgroup_parent)["links"]  # the SIGKILL really left them
        os.kill(victim_pid, signal.SIGKILL)  # dies while no node watches it
        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            status = client.status()
            assert sorted(status["adopted"]) == sorted(sb.id for sb in kept)
            assert list(status["lost"]) == [victim.id]
            for sb in kept:
                again = client.get(sb.id)
                assert reach(again, allowed, other_port, other_host) == expect  # the policy still holds
                same = again.exec("cat /etc/resolv.conf; grep -v '^lo' /proc/net/fib_trie | sort -u").stdout
                assert same == addresses[sb.id]  # same address, gateway and resolver
            assert client.close_all() == 3
        found = no_leftovers(restarted.home, restarted.cgroup_parent)
        assert not found, found
    finally:  # also after a failed assertion: a node on this home closes whatever is left
        if restarted is None:
            doomed.stop(signal.SIGKILL)
            restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        restarted.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


def test_port_scan_is_refused_quickly(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    """A scan of the host, other hosts and private ranges finds nothing, and fails fast (rejects, not drops)."""
    a, b = hosts
    targets = [f"{a.gateway}:{p}" for p in range(20, 60)] + [f"{b.address}:{p}" for p in (22, 80, 8080, 9090)]
    targets += [f"10.0.0.{i}:80" for i in range(1, 6)] + ["169.254.169.254:80", "172.17.0.1:2375"]
    with nclient.create(image="debian", pool=False, network=f"tcp://{a.address}:8080") as sb:
        start = time.monotonic()
        got = reach(sb, *targets)
        assert set(got.values()) == {"closed"}, {t: v for t, v in got.items() if v != "closed"}
        assert time.monotonic() - start < 10, "refused destinations should fail fast, not time out"


SYNS = """
import socket, sys, time
for _ in range(50):
    s = socket.socket(); s.setblocking(False); s.connect_ex((sys.argv[1], 8080))
time.sleep(1)
"""


def _rx_packets(host: EchoHost) -> int:
    out = subprocess.run(["ip", "-n", host.name, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True)
    return json.loads(out.stdout)[0]["stats64"]["rx"]["packets"]


def _spoofing_is_dropped(vm: shoal.Sandbox, a: EchoHost, b: EchoHost) -> None:
    """The guest's root takes another address (test host b's, so any reply stays on this machine) and sends
    SYNs its policy allows: the node drops them, as they do not come from the sandbox's own address."""
    ip = "/.shoal/busybox ip"
    address = vm.exec(f"{ip} -4 -o addr show dev eth0").stdout.split()[3]
    gateway = vm.exec(f"{ip} route show default").stdout.split()[2]
    spoof = f"{ip} addr flush dev eth0 && {ip} addr add {b.address}/32 dev eth0 && {ip} route add {gateway} dev eth0"
    assert vm.exec(f"{spoof} && {ip} route add default via {gateway}").exit_code == 0
    before = _rx_packets(a)
    vm.exec(["python3", "-c", SYNS, a.address], timeout=60)
    assert _rx_packets(a) - before < 10  # not one SYN per try (50), nor their retransmissions
    back = f"{ip} addr flush dev eth0 && {ip} addr add {address} dev eth0 && {ip} route add default via {gateway}"
    assert vm.exec(back).exit_code == 0


def test_microvm_gets_the_same_policy(nclient: shoal.Client, hosts: tuple[EchoHost, EchoHost]) -> None:
    """A microvm's NIC is bridged to the same veth + nftables plumbing as a container: allowlist, names, "none",
    "internet" and changes at runtime behave alike, and a pause/resume (a new QEMU) keeps the policy."""
    if "microvm" not in nclient.kinds():
        pytest.skip("QEMU is not installed on this node")
    a, b = hosts
    allowed, other_port, other_host = f"{a.address}:8080", f"{a.address}:9090", f"{b.address}:8080"
    with nclient.create("microvm", image="debian", pool=False, network=[f"tcp://{allowed}"], ttl_s=900) as vm:
        expect = {allowed: "open", other_port: "closed", other_host: "closed", f"{a.gateway}:22": "closed"}
        assert reach(vm, *expect) == expect
        _spoofing_is_dropped(vm, a, b)
        assert reach(vm, *expect) == expect
        vm.set_network("other")  # by name, through the node's resolver
        assert vm.exec("getent hosts mirror-b.test").stdout.split()[0] == b.address
        assert reach(vm, "mirror-b.test:8080", allowed) == {"mirror-b.test:8080": "open", allowed: "closed"}
        vm.set_network("internet")  # every public address; private ranges (the test hosts) stay closed
        assert reach(vm, allowed, other_host) == {allowed: "closed", other_host: "closed"}
        vm.set_network([f"tcp://{allowed}"])
        vm.pause()
        assert reach(vm, allowed, other_port) == {allowed: "open", other_port: "closed"}  # resumed: a new QEMU
        vm.set_network("none")
        assert reach(vm, allowed) == {allowed: "closed"}
    with nclient.create("microvm", image="debian", pool=False, ttl_s=900) as vm:
        assert reach(vm, allowed) == {allowed: "closed"}  # no policy: the NIC reaches nothing
        vm.set_network([f"tcp://{allowed}"])
        assert reach(vm, allowed, other_host) == {allowed: "open", other_host: "closed"}
