"""Node recovery: after the node process dies, a new one re-adopts the sandboxes that still run.

A sandbox outlives its node: the OCI runtime runs it detached and its agent keeps listening on
`sandboxes/<id>/agent.sock`. What the node knew about it is persisted in `record.json` (the substrate's
part, written before anything is made, plus a `node` part written once the sandbox is bound: its spec,
image, user and lifetime). A restarted node adopts a sandbox when that record is complete, its agent
process still lives in its cgroup and (unless frozen) answers; its trajectory log continues where it was.
Everything else is cleaned up and reported as lost.

A VM's QEMU runs in a session of its own and outlives the node too: the restarted node reconnects to its
QMP and agent chardev sockets (QemuSubstrate.readopt) and, if networked, plugs a new veth into the network
namespace QEMU owns, on the bridge its NIC's tap is on (the guest keeps its address).

A networked sandbox keeps its network namespace; the restarted node removes the old node's links and
nftables table (so nothing stale stays open) and plumbs it again on its recorded slot (network.json, written
before the link was made): same address and resolver, the policy re-resolved and applied before the node
serves requests. Connections open across the restart are cut. Between the crash and the restart the old
rules keep holding (they are kernel state).

Not carried over: shell sessions (their processes belong to the old node's agent connections; using one
is a ShellLostError, told apart from a closed shell by the node-process mark in its ID) and warm
pool members (they are cleaned up; the pools refill).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from shoal import cgroups
from shoal.errors import ShoalError
from shoal.node import network
from shoal.node.sandbox import Sandbox, State
from shoal.protocol import SandboxSpec, convert
from shoal.substrates import Instance, Substrate

if TYPE_CHECKING:
    from shoal.node.images import NodeImages

HELLO_TIMEOUT_S = 3.0


class NotAdoptable(Exception):
    """Why a sandbox found after a restart cannot be taken over."""


def write_record(sandbox: Sandbox) -> None:
    """Merge the node's view of `sandbox` into its record.json (atomically: one write in place, or write
    and rename; see RECORD_IN_PLACE_MAX).

    No fsync (it blocked the event loop on every create and claim): the record serves re-adoption after the
    node *process* dies, and the page cache outlives a process. After a machine crash there is nothing to
    re-adopt (the sandboxes died with it), and a torn or empty record is cleaned up as an orphan.

    The substrate's part is read once per sandbox (substrates write it only when they create) and kept on
    the sandbox, so a create, pause or keepalive costs one write, not a read and a parse too."""
    path = sandbox.instance.directory / "record.json"
    base = sandbox.record_base
    if base is None and sandbox.instance.record is not None:  # as its substrate wrote it
        base = sandbox.record_base = dict(sandbox.instance.record)
    if base is None:
        try:
            base = json.loads(path.read_text())
        except (OSError, ValueError):
            base = {"id": sandbox.id, "kind": sandbox.spec.kind, "cgroup": sandbox.instance.cgroup_path}
        base.pop("node", None)
        sandbox.record_base = base
    spec = msgspec.structs.replace(sandbox.spec, files={})  # files were written into the sandbox already
    record = dict(base)
    record["node"] = {
        "spec": spec,
        "image": sandbox.image.name,
        "uid": sandbox.uid,
        "gid": sandbox.gid,
        "state": sandbox.state.value,
        "created_at": sandbox.created_at,
        "expires_at": sandbox.expires_at,
        "agent_socket": str(sandbox.instance.agent_socket),
        "instance": {
            "runtime": sandbox.instance.runtime,
            "pid": sandbox.instance.pid,
            "upper": sandbox.instance.upper,
            "rootfs": sandbox.instance.rootfs,
        },
    }
    data = msgspec.json.encode(record)
    if len(data) <= RECORD_IN_PLACE_MAX:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        else:
            try:
                size = os.fstat(fd).st_size
                if size <= RECORD_IN_PLACE_MAX:
                    os.pwrite(fd, data.ljust(size), 0)  # JSON allows trailing spaces: one write, no truncate
                    return
            finally:
                os.close(fd)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


# A record up to this size is rewritten in place, by one write at offset 0 that a process's death cannot tear
# (a write into one page of the page cache either happens or not: a pending SIGKILL stops it before the copy),
# padded to the old size with spaces. A new file and a rename, the atomic way for any size, cost a journalled
# inode created and one freed on the home's ext4 per create (issue 12: ~0.1 CPU-ms).
RECORD_IN_PLACE_MAX = 4096


def frozen(cgroup_path: str) -> bool:
    rel = cgroup_path.lstrip("/")
    try:
        if cgroups.layout() == "v2":
            return "frozen 1" in (cgroups.ROOT / rel / "cgroup.events").read_text()
        return (cgroups.ROOT / "freezer" / rel / "freezer.state").read_text().strip() == "FROZEN"
    except OSError:
        return False


async def adopt(directory: Path, node_images: NodeImages, substrate: Substrate) -> Sandbox:
    """Rebuild the node's record of a running sandbox from its state directory, or raise NotAdoptable.

    The substrate takes over what of it lived in the dead node's process (a VM's QEMU connections).
    Its image layers are acquired again (the sandbox's overlay still holds the mounts of the dead node's
    namespace; acquiring keeps this node's reference counts right for when it is closed)."""
    try:
        record = json.loads((directory / "record.json").read_text())
    except (OSError, ValueError) as exc:
        raise NotAdoptable(f"its record.json is unreadable ({exc})") from None
    node: dict[str, Any] | None = record.get("node")
    if node is None:
        raise NotAdoptable("the node stopped before the sandbox was ready (or it was a warm-pool member)")
    spec = convert(node["spec"], SandboxSpec)
    cgroup_path = record.get("cgroup", "")
    facts: dict[str, Any] = node.get("instance") or node.get("extra") or {}  # "extra": records of older nodes
    instance = Instance(
        id=record["id"],
        kind=record.get("kind", "container"),
        directory=directory,
        agent_socket=Path(node.get("agent_socket") or directory / "agent.sock"),
        cgroup_path=cgroup_path,
        runtime=facts.get("runtime") or record.get("runtime", "crun"),
        pid=facts.get("pid"),  # the agent's host pid (not known under gVisor, whose agent answers or not)
        upper=facts.get("upper"),
        rootfs=facts.get("rootfs"),
    )
    if spec.runtime is None and instance.kind == "container":  # a record of a node whose default was implied
        spec.runtime = instance.runtime  # (crun was left out of the spec): the runtime that made it, not today's
    try:
        paused = await substrate.readopt(instance)  # a VM: reconnect to its QEMU (which sets the pid)
    except ShoalError as exc:
        raise NotAdoptable(str(exc)) from None
    screen = None if paused is None else substrate.screen(instance)  # a VM's display is QEMU's (QMP)
    if paused is None:  # nothing of it lived in the node process: its agent runs in its cgroup, or not
        if instance.pid is not None and instance.pid not in cgroups.procs(cgroup_path):
            raise NotAdoptable(f"its agent (pid {instance.pid}) no longer runs in cgroup {cgroup_path}")
        paused = frozen(cgroup_path)
    if network.normalise(spec.network) and instance.pid is None:
        raise NotAdoptable("its network policy needs its agent's host pid to re-attach, which is not known")
    agent = substrate.agent(instance)
    state = State.PAUSED if paused else State.READY
    if state is State.READY:
        try:
            await asyncio.wait_for(agent.hello(), HELLO_TIMEOUT_S)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            raise NotAdoptable(f"its agent does not answer on {instance.agent_socket} ({exc!r})") from None
    try:
        own = substrate.own_image(spec.image) if not spec.layers else None
        image = await node_images.acquire(own or await node_images.resolve(spec.image, spec.layers))
    except Exception as exc:
        raise NotAdoptable(f"its image {node['image']!r} cannot be used any more ({exc})") from None
    sandbox = Sandbox(
        id=instance.id, spec=spec, image=image, instance=instance, agent=agent, state=state, screen=screen
    )
    sandbox.created_at = node["created_at"]
    sandbox.expires_at = node["expires_at"]
    sandbox.uid, sandbox.gid = node["uid"], node["gid"]
    return sandbox
