"""Network policy per sandbox: a veth into the sandbox's network namespace, nftables rules on the host.

VMs (microvm, vm) get the same: their NIC's tap is on a bridge in a network namespace QEMU owns, the veth's
inner end joins that bridge, and the guest gives its NIC the sandbox's address (qemu/machine.py).

`network="none"` (the default) costs nothing: the runtime's fresh namespace has only loopback. A sandbox
given an allowlist (at create, at claim from a pool, or later with `set_network`) gets a veth pair: `eth0`
inside with a /30 from the node's pool, the host end named `<prefix><slot>`. Everything of one node lives in
one nftables table `inet shoal_<prefix>` (the prefix is derived from SHOAL_HOME, so two nodes on a host
never touch each other's rules, links or addresses):

    forward   packets from a sandbox jump to its own chain (a verdict map keyed by interface), which
              accepts the allowed destinations and rejects the rest (TCP reset, ICMP admin-prohibited);
              every packet is checked, so a revoked destination is cut even on an open connection
    input     a sandbox reaches the host only for DNS (redirected to the node's resolver)
    both      a packet from a sandbox's link whose source is not that sandbox's address is dropped (a VM's
              root, or a container given CAP_NET_ADMIN, could set any address on its NIC: the resolver
              answers by source address, and replies must not reach another sandbox)
    nat       DNS to the gateway is redirected to the resolver; traffic leaving the host is masqueraded

Private, shared, link-local (cloud metadata), loopback and multicast ranges are refused unless a rule
names a destination inside them. Names in rules are resolved by the node when the policy is set; the
node's resolver answers only those names (NXDOMAIN otherwise). Presets ("pypi", "npm", "debian" ...) and
static host entries come from the node's configuration (SHOAL_NETWORK_CONFIG, a JSON file).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal import settings, spawn
from shoal.config import node_tag
from shoal.errors import InvalidRequestError, ShoalError

log = logging.getLogger("shoal.network")

NetworkSpec = str | list[str] | dict[str, bool] | None

BLOCKED_RANGES = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
]  # fmt: skip
DEFAULT_PRESETS: dict[str, list[str]] = {
    "pypi": ["tcp://pypi.org:443", "tcp://files.pythonhosted.org:443"],
    "npm": ["tcp://registry.npmjs.org:443"],
    "debian": ["tcp://deb.debian.org:80", "tcp://deb.debian.org:443", "tcp://security.debian.org:80"],
    "internet": ["0.0.0.0/0"],
}
PROTOCOLS = ("tcp", "udp")
HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.?)+")


class NetworkError(ShoalError):
    """The host could not set up or change a sandbox's network."""


@dataclass(frozen=True)
class Rule:
    """One allowed destination: a network, optionally one protocol and one port."""

    net: ipaddress.IPv4Network
    proto: str | None = None
    port: int | None = None

    def nft(self) -> str:
        match = f"ip daddr {self.net}"
        if self.port is not None:
            match += (
                f" {self.proto} dport {self.port}"
                if self.proto
                else f" meta l4proto {{ tcp, udp }} th dport {self.port}"
            )
        elif self.proto:
            match += f" meta l4proto {self.proto}"
        return f"{match} accept"

    @property
    def explicit_private(self) -> bool:
        """Does it name a destination inside a blocked range (and so is allowed before the block)?"""
        return any(self.net.subnet_of(ipaddress.IPv4Network(r)) for r in BLOCKED_RANGES)


@dataclass
class Policy:
    """A resolved policy: rules, and the names (with their addresses) DNS may answer."""

    rules: list[Rule] = field(default_factory=list)
    names: dict[str, list[str]] = field(default_factory=dict)
    source: Any = "none"

    @property
    def none(self) -> bool:
        return not self.rules

    @property
    def any_host(self) -> bool:
        """Does a rule allow every public address ("*", "internet")? Then any name may be resolved."""
        return any(rule.net.prefixlen == 0 for rule in self.rules)

    def chain_body(self) -> list[str]:
        explicit = [r.nft() for r in self.rules if r.explicit_private]
        public = [r.nft() for r in self.rules if not r.explicit_private]
        blocked = ", ".join(BLOCKED_RANGES)
        return [
            *explicit,
            f"ip daddr {{ {blocked} }} meta l4proto tcp reject with tcp reset",
            f"ip daddr {{ {blocked} }} reject with icmp type admin-prohibited",
            *public,
            "meta l4proto tcp reject with tcp reset",
            "meta nfproto ipv4 reject with icmp type admin-prohibited",
            "drop",
        ]


@dataclass(frozen=True)
class NetworkConfig:
    """The node's network settings: presets, static hosts (for internal mirrors), the address pool."""

    presets: dict[str, list[str]]
    hosts: dict[str, list[str]]
    pool: ipaddress.IPv4Network
    prefix: str

    @classmethod
    def load(cls, home: Path) -> NetworkConfig:
        data: dict[str, Any] = {}
        path = settings.NETWORK_CONFIG.get()
        if path:
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise InvalidRequestError(f"SHOAL_NETWORK_CONFIG={path}: cannot read it as JSON ({exc})") from exc
        prefix = node_tag(home)
        pool = data.get("pool") or settings.NET_POOL.get() or default_pool(prefix)
        hosts = {k: [v] if isinstance(v, str) else list(v) for k, v in data.get("hosts", {}).items()}
        return cls(
            presets={**DEFAULT_PRESETS, **data.get("presets", {})},
            hosts=hosts,
            pool=ipaddress.IPv4Network(pool),
            prefix=prefix,
        )


def default_pool(tag: str) -> str:
    """One of the 1024 /18s of 10.0.0.0/8 (4095 sandboxes each), picked by the node's tag; slots whose
    gateway address is already on this host (another node drew the same pool) are skipped."""
    index = int(hashlib.sha1(tag.encode()).hexdigest()[:8], 16) % 1024
    return str(ipaddress.IPv4Network(f"10.{index >> 2}.{(index & 3) << 6}.0/18"))


def _address_in_use(address: str) -> bool:
    """Is `address` already assigned on this host (binding to it succeeds only if it is local)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def normalise(spec: NetworkSpec) -> list[str]:
    """The rule strings of a policy as users may write it: "none", a preset or rule, a list, or a dict."""
    if spec is None or spec == "none" or spec == []:
        return []
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, dict):
        return [name for name, on in spec.items() if on]
    if isinstance(spec, list) and all(isinstance(x, str) for x in spec):
        return [x for x in spec if x != "none"]
    raise InvalidRequestError(
        f"network={spec!r}: give 'none', a preset name, a rule like 'tcp://host:443' or '10.0.0.0/8:80', "
        "a list of those, or a dict like {'pypi': True}"
    )


def _parse_rule(text: str) -> tuple[str, str | None, int | None]:
    """'[tcp|udp://]host-or-cidr[:port]' → (host, proto, port)."""
    proto = None
    rest = text.strip()
    if "://" in rest:
        proto, _, rest = rest.partition("://")
        if proto not in PROTOCOLS:
            raise InvalidRequestError(f"network rule {text!r}: protocol {proto!r} is not one of {PROTOCOLS}")
    host, port = rest, None
    if rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidRequestError(f"network rule {text!r}: port {port_text!r} must be a number in 1..65535")
        port = int(port_text)
    if not host:
        raise InvalidRequestError(f"network rule {text!r} names no destination")
    if host == "*":
        host = "0.0.0.0/0"
    return host, proto, port


def _kernel_has_ipv6() -> bool:
    """IPv6 is off in sandboxes: their links are made with `addrgenmode none` (no address, not even
    link-local, so no route to anything over IPv6) where the kernel has IPv6 at all."""
    return Path("/proc/net/if_inet6").exists()


def _host_links_get_ipv6() -> bool:
    """Would a new link on the host get an IPv6 link-local address (so the host end needs `addrgenmode none`)?"""
    try:
        return Path("/proc/sys/net/ipv6/conf/default/disable_ipv6").read_text().strip() == "0"
    except OSError:
        return False


def _is_ipv6(text: str) -> bool:
    host = text.strip()
    if host.startswith("["):  # [2001:db8::1]:443
        host = host[1:].partition("]")[0]
    try:
        ipaddress.IPv6Network(host, strict=False)
    except ValueError:
        return False
    return True


async def resolve(spec: NetworkSpec, config: NetworkConfig) -> Policy:
    """Turn a policy into rules, resolving presets and names now (the node's view of DNS, at set time)."""
    policy = Policy(source=spec if spec is not None else "none")
    pending = list(normalise(spec))
    seen_presets: set[str] = set()
    loop = asyncio.get_running_loop()
    while pending:
        text = pending.pop(0)
        if text in config.presets:
            if text not in seen_presets:
                seen_presets.add(text)
                pending.extend(config.presets[text])
            continue
        host, proto, port = _parse_rule(text)
        if _is_ipv6(host):
            raise InvalidRequestError(
                f"network rule {text!r}: IPv6 destinations are not supported; sandboxes speak IPv4 only (their "
                "links have no IPv6 address or route, docs/SECURITY.md): name an IPv4 address or a host name"
            )
        try:
            nets = [ipaddress.IPv4Network(host, strict=False)]
        except ValueError:
            if "/" in host or host.replace(".", "").isdigit():
                raise InvalidRequestError(
                    f"network rule {text!r}: {host!r} is not a valid IPv4 address or CIDR"
                ) from None
            if not HOSTNAME.fullmatch(host):
                raise InvalidRequestError(
                    f"network rule {text!r}: {host!r} is neither a preset ({', '.join(sorted(config.presets))}), "
                    "an IPv4 address/CIDR, nor a host name"
                ) from None
            addresses = config.hosts.get(host)
            if addresses is None:
                try:
                    infos = await loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
                except OSError as exc:
                    raise InvalidRequestError(
                        f"network rule {text!r}: the node cannot resolve {host!r} ({exc}); check the name, or map "
                        "it in the node's network config ('hosts' in SHOAL_NETWORK_CONFIG)"
                    ) from None
                addresses = sorted({info[4][0] for info in infos})
            policy.names[host.lower().rstrip(".")] = addresses
            nets = [ipaddress.IPv4Network(a) for a in addresses]
        for net in nets:
            rule = Rule(net, proto, port)
            if rule not in policy.rules:
                policy.rules.append(rule)
    return policy


@dataclass
class Attachment:
    """A sandbox's plumbing: its slot in the pool, host interface and addresses."""

    sandbox_id: str
    slot: int
    ifname: str
    address: str
    gateway: str
    policy: Policy = field(default_factory=Policy)
    bridged: bool = False  # a VM: the veth's inner end is on the bridge of its guest's NIC, not eth0 itself

    @property
    def chain(self) -> str:
        return f"sb{self.slot}"


class NetworkManager:
    """The node's side of sandbox networking: one nftables table, a resolver, a pool of /30 slots."""

    def __init__(self, home: Path, config: NetworkConfig | None = None) -> None:
        self.home = home
        self.config = config or NetworkConfig.load(home)
        self.table = f"shoal_{self.config.prefix}"
        self.attachments: dict[str, Attachment] = {}
        self._by_address: dict[str, Attachment] = {}
        self._sandbox_locks: dict[str, asyncio.Lock] = {}
        self._releasing: set[asyncio.Task] = set()
        self._used_slots: set[int] = set()
        self._ready = False
        self._setup_lock = asyncio.Lock()
        self._resolver: DnsResolver | None = None
        self._lock = asyncio.Lock()

    @property
    def slots(self) -> int:
        return self.config.pool.num_addresses // 4 - 1

    # ------------------------------------------------------------------ host setup and cleanup

    async def _ensure_ready(self) -> None:
        async with self._setup_lock:
            if self._ready:
                return
            if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "1":
                log.info("enabling IPv4 forwarding (net.ipv4.ip_forward=1) for sandbox networking")
                Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: DnsResolver(self), local_addr=("0.0.0.0", 0), family=socket.AF_INET
            )
            self._resolver = protocol
            port = transport.get_extra_info("sockname")[1]
            p, pool = self.config.prefix, self.config.pool
            await nft(
                f"""
table inet {self.table} {{
  map egress {{ type ifname : verdict; }}
  set sources {{ type ifname . ipv4_addr; }}
  chain forward {{
    type filter hook forward priority filter - 5; policy accept;
    iifname "{p}*" iifname . ip saddr != @sources drop
    iifname vmap @egress
    iifname "{p}*" drop
    oifname "{p}*" ct state established,related accept
    oifname "{p}*" drop
  }}
  chain input {{
    type filter hook input priority filter - 5; policy accept;
    iifname "{p}*" iifname . ip saddr != @sources drop
    iifname "{p}*" meta l4proto udp th dport {port} accept
    iifname "{p}*" ct state established,related accept
    iifname "{p}*" meta l4proto tcp reject with tcp reset
    iifname "{p}*" reject
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{p}*" udp dport 53 redirect to :{port}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != "{p}*" masquerade
  }}
}}
"""
            )
            self._ready = True

    async def cleanup_all(self) -> None:
        """Remove this node's table, resolver and any host links it left (startup after a crash, shutdown)."""
        await asyncio.gather(*self._releasing, return_exceptions=True)
        for name in host_links(self.config.prefix):  # links first: none is left without its rules
            await run(["ip", "link", "delete", name], check=False)
        await nft(f"delete table inet {self.table}", check=False)
        if self._resolver is not None:
            self._resolver.close()
            self._resolver = None
        self.attachments.clear()
        self._by_address.clear()
        self._used_slots.clear()
        self._ready = False

    # ------------------------------------------------------------------ per sandbox

    async def apply(
        self,
        sandbox_id: str,
        pid: int,
        directory: Path,
        policy: Policy,
        *,
        reattach: bool = False,
        bridged: bool = False,
    ) -> Attachment | None:
        """Give the sandbox (agent `pid`) this policy, plumbing its veth on first use. Atomic per call;
        concurrent calls for one sandbox apply in turn. `reattach`: a sandbox re-adopted after a node restart
        gets the slot recorded in its network.json again (so its address and resolver stay the same).
        `bridged`: a VM (`pid` is its QEMU's): the veth's inner end joins the bridge `br0` its guest's NIC is
        on in that namespace, and the guest gives itself the attachment's address (the node asks it to)."""  # fmt: skip
        lock = self._sandbox_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            return await self._apply(sandbox_id, pid, directory, policy, reattach, bridged)

    async def _apply(
        self, sandbox_id: str, pid: int, directory: Path, policy: Policy, reattach: bool = False,
        bridged: bool = False,
    ) -> Attachment | None:  # fmt: skip
        attachment = self.attachments.get(sandbox_id)
        new = attachment is None
        if attachment is None:
            if policy.none:
                return None
            slot = recorded_slot(directory) if reattach else None
            attachment = await self._attach(sandbox_id, pid, directory, slot, bridged)
        body = "\n".join(f"    {line}" for line in policy.chain_body())
        script = f"table inet {self.table} {{\n  chain {attachment.chain} {{\n{body}\n  }}\n}}"
        if new:  # the chain, its rules, the jump to it and its one source address appear in one transaction
            script += f'\nadd element inet {self.table} egress {{ "{attachment.ifname}" : jump {attachment.chain} }}'
            script += f'\nadd element inet {self.table} sources {{ "{attachment.ifname}" . {attachment.address} }}'
        else:
            script = f"flush chain inet {self.table} {attachment.chain}\n{script}"
        try:
            await nft(script)
        except BaseException:
            if new:
                await asyncio.shield(self.detach(sandbox_id))
            raise
        attachment.policy = policy
        return attachment

    async def _attach(
        self, sandbox_id: str, pid: int, directory: Path, wanted: int | None = None, bridged: bool = False
    ) -> Attachment:
        await self._ensure_ready()
        async with self._lock:
            candidates = range(1, self.slots + 1) if wanted is None else [wanted]
            slot = next((s for s in candidates if s not in self._used_slots and not _address_in_use(
                str(self.config.pool.network_address + 4 * s + 1))), None)  # fmt: skip
            if slot is None and wanted is not None:
                raise NetworkError(f"its recorded address slot {wanted} is taken; it cannot keep its address")
            if slot is None:
                raise NetworkError(f"the node's address pool {self.config.pool} is exhausted; set a larger 'pool'")
            self._used_slots.add(slot)
        base = self.config.pool.network_address + 4 * slot
        gateway, address = str(base + 1), str(base + 2)
        attachment = Attachment(sandbox_id, slot, f"{self.config.prefix}{slot:x}", address, gateway, bridged=bridged)
        (directory / "network.json").write_text(json.dumps({"slot": slot, "ifname": attachment.ifname}))
        try:  # until its chain exists the forward hook drops everything from the new link (fail closed)
            await self._plug(attachment, pid)
        except BaseException:
            await asyncio.shield(self._release(attachment))
            raise
        self.attachments[sandbox_id] = attachment
        self._by_address[address] = attachment
        return attachment

    async def _plug(self, attachment: Attachment, pid: int) -> None:
        """Make the veth pair: the host end with the gateway address, the other in the netns of `pid`."""
        # A guest keeps its ARP cache across a new veth (resume, node restart): the host end's MAC must stay.
        slot = attachment.slot
        mac = f" address 02:5e:00:00:{slot >> 8:02x}:{slot & 255:02x}" if attachment.bridged else ""
        await run(["ip", "-batch", "-"], stdin=(
            f"link add {attachment.ifname}{mac} type veth peer name eth0 netns {pid}\n"
            + (f"link set {attachment.ifname} addrgenmode none\n" if _host_links_get_ipv6() else "")
            + f"addr add {attachment.gateway}/30 dev {attachment.ifname}\n"
            f"link set {attachment.ifname} up\n"
        ).encode())  # fmt: skip
        ipv6_off = "link set eth0 addrgenmode none\n" if _kernel_has_ipv6() else ""
        inside = (
            f"{ipv6_off}link set eth0 master br0\nlink set eth0 up\n"
            if attachment.bridged
            else f"{ipv6_off}addr add {attachment.address}/30 dev eth0\nlink set eth0 up\n"
            f"route add default via {attachment.gateway}\n"
        )
        await run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"], stdin=inside.encode())

    async def replug(self, sandbox_id: str, pid: int) -> None:
        """A VM resumed in a new QEMU (a new network namespace; the old veth died with the old one): plug its
        veth again. Its rules are keyed by the host link's name, which stays, so they hold throughout."""
        lock = self._sandbox_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            attachment = self.attachments.get(sandbox_id)
            if attachment is None:
                return
            if Path(f"/sys/class/net/{attachment.ifname}").exists():
                await run(["ip", "link", "delete", attachment.ifname], check=False)
            await self._plug(attachment, pid)

    async def detach(self, sandbox_id: str) -> None:
        """Forget the sandbox's plumbing. Its rules are deleted in the background (an nftables commit that
        deletes waits for an RCU grace period, ≈15 ms); its slot is reused only once they are gone."""
        self._sandbox_locks.pop(sandbox_id, None)
        attachment = self.attachments.pop(sandbox_id, None)
        if attachment is not None:
            self._by_address.pop(attachment.address, None)
            task = asyncio.create_task(self._release(attachment))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _release(self, attachment: Attachment) -> None:
        element = f'delete element inet {self.table} egress {{ "{attachment.ifname}" }}'
        source = f'delete element inet {self.table} sources {{ "{attachment.ifname}" . {attachment.address} }}'
        chain = f"delete chain inet {self.table} {attachment.chain}"
        try:
            if self._ready and await nft(f"{element}\n{source}\n{chain}", check=False) != 0:  # half made: in turn
                for part in (element, source, chain):
                    await nft(part, check=False)
            if Path(f"/sys/class/net/{attachment.ifname}").exists():
                await run(["ip", "link", "delete", attachment.ifname], check=False)
        except Exception as exc:  # a background task: say so, cleanup_all removes the whole table later
            log.warning("could not remove the network rules of %s: %s", attachment.sandbox_id, exc)
        finally:
            self._used_slots.discard(attachment.slot)

    def answer(self, client_ip: str, name: str) -> list[str] | None:
        """Addresses the resolver gives `client_ip` for `name`, or None if its policy does not allow it."""
        attachment = self._by_address.get(client_ip)
        return None if attachment is None else attachment.policy.names.get(name.lower().rstrip("."))

    def resolves_any(self, client_ip: str) -> bool:
        """May `client_ip` resolve names outside its policy's list (its policy allows every address)?"""
        attachment = self._by_address.get(client_ip)
        return attachment is not None and attachment.policy.any_host


def recorded_slot(directory: Path) -> int:
    """The slot a sandbox's network.json recorded (written before its link is made)."""
    try:
        return int(json.loads((directory / "network.json").read_text())["slot"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NetworkError(f"its network record {directory / 'network.json'} is unreadable ({exc})") from None


def host_links(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(prefix))
    except OSError:
        return []


async def nft(script: str, check: bool = True) -> int:
    return await run(["nft", "-f", "-"], stdin=script.encode(), check=check)


async def run(argv: list[str], stdin: bytes = b"", check: bool = True) -> int:
    """Run a host tool with `stdin`; on failure (if `check`) raise NetworkError with its stderr."""
    in_r, in_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_DUP2, err_w, 2)]  # fmt: skip
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
    finally:
        os.close(in_r)
        os.close(err_w)
    try:
        with contextlib.suppress(BrokenPipeError):
            os.write(in_w, stdin)  # small scripts: they fit in the pipe buffer
        os.close(in_w)
        in_w = -1
        status = await spawn.wait(pid, timeout=30)
        os.set_blocking(err_r, False)
        try:
            error = os.read(err_r, 4096).decode(errors="replace").strip()
        except BlockingIOError:
            error = ""
    finally:
        if in_w >= 0:
            os.close(in_w)
        os.close(err_r)
    if status != 0 and check:
        raise NetworkError(f"{' '.join(argv[:3])} failed (exit {status}): {error}")
    return status


LOOKUPS_IN_FLIGHT = 64  # host lookups for sandboxes allowed every address; more are dropped (clients retry)


class DnsResolver(asyncio.DatagramProtocol):
    """Answers A queries from sandboxes for the names their policy allows; NXDOMAIN for everything else.

    A sandbox whose policy allows every public address ("*", "internet") may resolve any name: those
    queries are looked up with the host's resolver (getaddrinfo), so `network="*"` works with names too.
    """

    def __init__(self, manager: NetworkManager) -> None:
        self.manager = manager
        self.transport: asyncio.DatagramTransport | None = None
        self.lookups: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def close(self) -> None:
        for task in self.lookups:
            task.cancel()
        if self.transport is not None:
            self.transport.close()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            reply = self.reply(data, addr[0])
        except _LookUp as wanted:
            if len(self.lookups) < LOOKUPS_IN_FLIGHT:
                task = asyncio.ensure_future(self._look_up(data, addr, wanted.name))
                self.lookups.add(task)
                task.add_done_callback(self.lookups.discard)
            return
        except (ValueError, IndexError, struct.error):
            return  # malformed query: no answer
        if reply and self.transport is not None:
            self.transport.sendto(reply, addr)

    async def _look_up(self, query: bytes, addr: tuple[str, int], name: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(name, None, family=socket.AF_INET), 10)
            found: list[str] = sorted({info[4][0] for info in infos})
        except (OSError, UnicodeError, TimeoutError):
            found = []
        with contextlib.suppress(ValueError, IndexError, struct.error):
            reply = self.reply(query, addr[0], found)
            if self.transport is not None:
                self.transport.sendto(reply, addr)

    def reply(self, query: bytes, client_ip: str, looked_up: list[str] | None = None) -> bytes:
        ident, flags, qdcount = struct.unpack_from(">HHH", query)
        if flags & 0x8000 or qdcount != 1:
            raise ValueError("not a single-question query")
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            if length > 63:
                raise ValueError("compressed or oversized label in a question")
            labels.append(query[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
            offset += 1 + length
        qtype, qclass = struct.unpack_from(">HH", query, offset + 1)
        question = query[12 : offset + 5]
        name = ".".join(labels)
        addresses = self.manager.answer(client_ip, name)
        if looked_up is not None:
            addresses = looked_up or None
        elif addresses is None and name and self.manager.resolves_any(client_ip):
            raise _LookUp(name)
        rd = flags & 0x0100
        if addresses is None:
            return struct.pack(">HHHHHH", ident, 0x8080 | rd | 3, 1, 0, 0, 0) + question  # NXDOMAIN
        answers = [a for a in addresses if qtype in (1, 255)] if qclass == 1 else []
        header = struct.pack(">HHHHHH", ident, 0x8480 | rd, 1, len(answers), 0, 0)
        body = b"".join(struct.pack(">HHHLH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(a) for a in answers)
        return header + question + body


class _LookUp(Exception):
    """The query needs a lookup on the host (the sandbox may resolve any name)."""

    def __init__(self, name: str) -> None:
        self.name = name
