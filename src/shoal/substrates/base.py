"""The interface every substrate implements: the written contract between the node and a kind.

The node knows a kind only through this: `create` (a cold create, or a restore when `snapshot` is given),
`destroy`, `destroy_orphan`, and what `capabilities` says the kind can do beyond that. The node asks the
capabilities, never the class, so a new kind is one subclass and an entry in the node's table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from shoal.guest import AgentClient
from shoal.images import Image
from shoal.protocol import SandboxSpec


@dataclass(frozen=True)
class Capabilities:
    """What a kind can do beyond create and destroy. Each flag gates the node's operations of that name."""

    pause: bool = False  # pause/resume (and on_timeout="pause")
    memory_snapshots: bool = False  # snapshot memory + disk; create(snapshot=id) restores it; fork copies it
    image_commit: bool = False  # sb.snapshot(name): commit the sandbox's writes as an image layer
    disk_cap: bool = False  # disk_mb is enforced
    readopt: bool = False  # a restarted node re-adopts its live sandboxes (else they are reported lost)
    # The network policy's veth goes into the netns of `Instance.pid` and is bridged to a guest's NIC there
    # (VMs: the guest configures its own address, `guest_network_argv`); else the veth itself is eth0.
    guest_nic: bool = False

    def names(self) -> list[str]:
        return [name for name, on in self.__dict__.items() if on]


@dataclass
class Instance:
    """A running sandbox as its substrate made it: enough to reach its agent and to tear it down."""

    id: str
    kind: str
    directory: Path
    agent_socket: Path
    cgroup_path: str
    # Container-only facts, typed (they were an untyped `extra` dict): the OCI runtime that runs it, the
    # agent's host pid once known (None under gVisor), and the writable upper directory of its overlay.
    # A VM's pid is its QEMU's (whose network namespace holds the guest NIC's bridge).
    runtime: str = ""
    pid: int | None = None
    upper: str | None = None
    # Where the node reaches the sandbox's root directory: /proc/<agent pid>/root when its rootfs is mounted
    # only in the sandbox's own mount namespace (crun, runc), the bundle's rootfs/ under gVisor.
    rootfs: str | None = None
    # What the substrate wrote to record.json at the create, if it wrote it: the node merges its own view into
    # it (recovery.write_record) without reading the file back.
    record: dict[str, Any] | None = None


class Substrate(ABC):
    """Makes and destroys sandboxes of one kind. Policy (timeouts, pools, limits) lives in the node."""

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()

    @abstractmethod
    async def create(self, sandbox_id: str, spec: SandboxSpec, image: Image, snapshot: str | None = None) -> Instance:
        """Start a sandbox whose agent answers on `Instance.agent_socket`; clean up fully on failure.
        With `snapshot` (only if `capabilities.memory_snapshots`), restore that snapshot instead of booting."""

    @abstractmethod
    async def destroy(self, instance: Instance) -> None:
        """Stop the sandbox and remove everything it owned. Idempotent."""

    @abstractmethod
    async def destroy_orphan(self, directory: Path) -> None:
        """Remove what a sandbox left behind when only its state directory is known (after a crash)."""

    async def pause(self, instance: Instance) -> None:
        raise NotImplementedError(f"{self.kind} sandboxes cannot be paused yet")

    async def resume(self, instance: Instance) -> None:
        raise NotImplementedError(f"{self.kind} sandboxes cannot be resumed yet")

    # memory_snapshots
    async def snapshot(self, instance: Instance, image_name: str) -> str:
        raise NotImplementedError(f"{self.kind} sandboxes have no memory snapshots")

    def snapshot_meta(self, snap_id: str) -> dict[str, Any]:
        raise NotImplementedError(f"{self.kind} sandboxes have no memory snapshots")

    def delete_snapshot(self, snap_id: str) -> None:
        """Remove snapshot `snap_id` if this kind holds it (no-op otherwise)."""
        return None

    def delete_all_snapshots(self) -> None:
        """Remove every snapshot this kind holds (node shutdown)."""
        return None

    def reconcile(self) -> None:
        """After a restart: remove whatever this kind left behind outside sandbox directories."""
        return None

    async def readopt(self, instance: Instance) -> bool | None:
        """A restarted node takes `instance` over (only if `capabilities.readopt`): reconnect to what still runs,
        set `instance.pid`, and return whether it is paused; raise SandboxLostError (with why) if it cannot
        be. None: the kind keeps nothing in the node process, so the node checks the agent's pid and cgroup."""
        return None

    async def network_joining(self, instance: Instance) -> None:
        """Before a network policy's veth goes into the network namespace of `instance.pid` (no-op by default)."""
        return None

    def guest_network_argv(self, address: str, gateway: str) -> list[str] | None:
        """(`capabilities.guest_nic`) A command the guest runs to give its NIC `address`/30 via `gateway`."""
        return None

    def own_image(self, name: str) -> Image | None:
        """An image this kind builds itself rather than the image store (the vm's "vm-desktop": a systemd root
        with a display session, meaningless as a container); None for names the store resolves."""
        return None

    def screen(self, instance: Instance) -> Any:
        """A screen this kind drives from the host (a VM's, over QMP): an object with `act(action, args)` and
        `close()` like node/gui.Screen; None when the sandbox has none (containers run an in-sandbox helper)."""
        return None

    def agent(self, instance: Instance) -> Any:
        """What the node talks to for the sandbox's data plane: its guest agent's client, or (an agentless
        VM, substrates/qemu/agentless.py) a stand-in that refuses what needs an agent with NoAgentError."""
        return AgentClient(str(instance.agent_socket))

    def agentless(self, instance: Instance) -> bool:
        """Does the sandbox run without shoal's agent (so exec, files and network policies are refused)?"""
        return False

    def loss_detail(self, instance: Instance) -> str:
        """What to add when a sandbox's agent stopped answering (e.g. a VM's console tail); empty if nothing."""
        return ""
