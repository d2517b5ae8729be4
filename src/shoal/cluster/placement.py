"""Placement: filter the nodes that can take a sandbox, then power-of-k-choices on load.

The gateway keeps a `NodeView` per node, refreshed by polling `status` and adjusted by what it has sent
since. The view only has to be good enough to choose: the node has the final say (it may answer
CapacityError, and the gateway then tries another node).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

NOT_CONTACTED = "not contacted yet"


@dataclass
class NodeView:
    node_id: str
    host: str
    port: int
    healthy: bool = False
    reason: str = NOT_CONTACTED
    since: float = 0.0  # when `healthy` last changed
    kinds: frozenset[str] = frozenset()
    images: frozenset[str] = frozenset()
    max_sandboxes: int = 0
    polled: int = 0  # sandboxes + creating, as last polled
    delta: int = 0  # creates (+) and kills (-) this gateway saw answered since that poll
    inflight: int = 0  # creates sent and not yet answered
    full: bool = False  # the node refused a create for capacity since the last poll
    projects: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-project usage, as polled
    # creates placed since the last poll: (created_at on the node's clock, project, cpu, mem)
    placed: list[tuple[float, str, float, int]] = field(default_factory=list)
    usage_as_of: float = 0.0  # when (node clock) the node took the per-project usage of the last poll
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return max(0, self.polled + self.delta)

    def free(self) -> int:
        """Slots this view believes are free (not counting creates in flight)."""
        if not self.healthy or self.full:
            return 0
        return max(0, self.max_sandboxes - self.used)

    def load(self) -> float:
        return (self.used + self.inflight) / max(1, self.max_sandboxes)


def candidates(
    nodes: Iterable[NodeView], kind: str, image: str, exclude: set[str], max_inflight: int
) -> list[NodeView]:
    """Healthy nodes that run `kind` and have room; those already holding `image` first if any do."""
    fit = [n for n in nodes if fits(n, kind, exclude, max_inflight)]
    local = [n for n in fit if image in n.images]
    return local or fit


def fits(n: NodeView, kind: str, exclude: set[str], max_inflight: int) -> bool:
    return (
        n.healthy
        and kind in n.kinds
        and n.node_id not in exclude
        and n.inflight < max_inflight
        and n.free() > n.inflight
    )


def choose(
    nodes: list[NodeView],
    kind: str,
    image: str,
    exclude: set[str],
    max_inflight: int,
    k: int = 2,
    rng: random.Random | None = None,
) -> NodeView | None:
    """Power-of-k in O(k): draw nodes at random until k fit (a few extra draws allowed), take the least
    loaded, preferring nodes that hold the image; only if the draws find none, scan every node."""
    rng = rng or random  # type: ignore[assignment]
    sample: list[NodeView] = []
    if len(nodes) > 4 * k:
        for _ in range(4 * k):
            n = nodes[rng.randrange(len(nodes))]
            if n not in sample and fits(n, kind, exclude, max_inflight):
                sample.append(n)
                if len(sample) == k:
                    break
    if not sample:
        return power_of_k(candidates(nodes, kind, image, exclude, max_inflight), k, rng)
    return min(sample, key=lambda n: (image not in n.images, n.load()))


def power_of_k(nodes: list[NodeView], k: int = 2, rng: random.Random | None = None) -> NodeView | None:
    """Sample k nodes and take the least loaded: near-best balance at O(k) cost, no herding."""
    if not nodes:
        return None
    sample = nodes if len(nodes) <= k else (rng or random).sample(nodes, k)
    return min(sample, key=lambda n: n.load())


def free_slots(nodes: Iterable[NodeView], max_inflight: int) -> int:
    """How many creates could start now: free slots, at most `max_inflight` per node."""
    return sum(min(n.free(), max_inflight) for n in nodes)
