"""The admission queue on its own: fairness between projects, the bound, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import pytest

import shoal
from shoal.cluster.admission import AdmissionQueue
from shoal.cluster.placement import NodeView, choose

pytestmark = pytest.mark.fast  # no root, no node: the queue, placement and a gateway object on their own


class Slots:
    def __init__(self, free: int) -> None:
        self.free = free


async def test_projects_are_served_in_turn() -> None:
    slots = Slots(0)
    queue = AdmissionQueue(lambda: slots.free, timeout=30)
    order: list[str] = []
    loop = asyncio.get_running_loop()

    async def create(project: str) -> None:
        await queue.acquire(project, loop.time() + 30)
        order.append(project)

    tasks = [asyncio.create_task(create("big")) for _ in range(6)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(create("small")) for _ in range(2)]
    await asyncio.sleep(0)
    assert queue.depth() == 8 and order == []
    slots.free = 8  # room appears: grants alternate between the projects while both wait
    queue.pump()
    await asyncio.gather(*tasks)
    assert order[:4] == ["big", "small", "big", "small"] and order[4:] == ["big"] * 4
    assert queue.inflight == 8


async def test_bounded_and_deadline() -> None:
    queue = AdmissionQueue(lambda: 0, max_waiting=2, timeout=0.2)
    loop = asyncio.get_running_loop()
    waiting = [asyncio.create_task(queue.acquire("p", loop.time() + 0.2)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(shoal.CapacityError, match="admission queue is full"):
        await queue.acquire("p", loop.time() + 0.2)
    for task in waiting:
        with pytest.raises(shoal.CapacityError, match="admission deadline"):
            await task
    assert queue.depth() == 0 and queue.timeouts == 2


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    slots = Slots(0)
    queue = AdmissionQueue(lambda: slots.free)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(queue.acquire("p", loop.time() + 30))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    slots.free = 1
    queue.pump()
    assert queue.depth() == 0 and queue.inflight == 0


def test_choose_prefers_free_and_local_nodes() -> None:
    nodes = [
        NodeView(node_id=f"n{i}", host="h", port=i, healthy=True, kinds=frozenset({"container"}),
                 images=frozenset({"debian"} if i == 3 else set()), max_sandboxes=10, polled=i)
        for i in range(20)
    ]  # fmt: skip
    nodes[5].healthy = False
    picks = {choose(nodes, "container", "debian", set(), 32, k=20).node_id for _ in range(50)}
    assert picks == {"n3"}  # sampling all: the one node holding the image wins over lighter ones
    picks = {choose(nodes, "container", "ubuntu", set(), 32, k=2).node_id for _ in range(200)}
    assert "n5" not in picks and len(picks) > 3  # never the unhealthy one; spread across the rest
    assert choose(nodes, "vm", "debian", set(), 32) is None
    full = [NodeView(node_id="x", host="h", port=1, healthy=True, kinds=frozenset({"container"}), max_sandboxes=1,
                     polled=1)]  # fmt: skip
    assert choose(full, "container", "debian", set(), 32) is None


async def test_gateway_without_healthy_nodes_says_so() -> None:
    from shoal.cluster.auth import Tokens
    from shoal.cluster.gateway import Gateway

    gateway = Gateway(Tokens({"tokens": {"secret": "@cluster", "p": "proj"}}))
    gateway.set_nodes({"n1": "127.0.0.1:9"})  # nothing listens there: the poller marks it down
    for _ in range(100):
        if gateway.nodes["n1"].reason != "not contacted yet":
            break
        await asyncio.sleep(0.02)
    try:
        with pytest.raises(shoal.CapacityError, match=r"no healthy node in the cluster \(n1: ConnectionRefusedError"):
            await gateway.create("proj", {"spec": {"image": "busybox"}})
        with pytest.raises(shoal.SandboxLostError, match="n1 stopped answering"):
            await gateway.dispatch(gateway.tokens.authenticate("p"), "get", {"sandbox_id": "n1-0123456789ab"}, print)
        gateway._pollers["n1"].cancel()  # from here the view is ours: a healthy container node
        gateway.nodes["n1"].healthy, gateway.nodes["n1"].kinds = True, frozenset({"container"})
        with pytest.raises(shoal.UnsupportedKindError, match="'teapot': no node in this cluster runs it"):
            await gateway.create("proj", {"spec": {"kind": "teapot"}})
    finally:
        await gateway.close()
