"""Queries on the trajectory log: which sandbox a target (an ID or a trajectory name) names, pages of its
steps, and where a trajectory lives (the gateway asks every node that).

Apart from NodeService so that reading logs needs only the log, the live sandbox table and the node's ID;
the service delegates its log_steps / trajectory_find / replay operations here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.errors import SandboxNotFoundError, UnsupportedKindError
from shoal.node.sandbox import Sandbox
from shoal.node.table import FUNCTION_OPS
from shoal.node.trajectory import TrajectoryLog


class TrajectoryQueries:
    def __init__(
        self,
        log: TrajectoryLog,
        sandboxes: Mapping[str, Sandbox],
        node_id: str,
        is_function: Callable[[str], bool],
    ) -> None:
        self.log = log
        self.sandboxes = sandboxes  # the node's live table (read only here)
        self.node_id = node_id
        self.is_function = is_function

    def owner(self, target: str) -> str:
        """A sandbox ID (live or ended) or a trajectory name, resolved to the sandbox ID whose log it is."""
        if target in self.sandboxes or self.log.sandbox(target) is not None:
            return target
        if self.is_function(target):
            raise UnsupportedKindError(FUNCTION_OPS.format(sandbox_id=target))
        row = self.log.by_trajectory(target)
        if row is None:
            raise SandboxNotFoundError(f"no trajectory log for {target!r} on node {self.node_id}")
        return row["id"]

    def find(self, target: str) -> list[dict[str, Any]]:
        """Where `target` (a sandbox ID or a trajectory name) lives on this node: [] if nowhere, else one
        entry {"sandbox_id", "trajectory", "status" (live|closed|lost), "project"} (the gateway asks every
        node, so a name resolves to the node that holds it whatever the node set was when it was made)."""
        live = self.sandboxes.get(target)
        if live is None:
            live = next((sb for sb in self.sandboxes.values() if sb.spec.trajectory == target), None)
        if live is not None:
            row: dict[str, Any] | None = {"id": live.id, "trajectory": live.spec.trajectory, "status": "live",
                                          "spec": {"labels": live.spec.labels}}  # fmt: skip
        else:
            row = self.log.sandbox(target) or self.log.by_trajectory(target)
        if row is None:
            return []
        labels = (row.get("spec") or {}).get("labels") or {}
        return [{"sandbox_id": row["id"], "trajectory": row["trajectory"], "status": row["status"],
                 "project": labels.get("shoal.project", ""), "node_id": self.node_id}]  # fmt: skip

    def page(self, target: str, since: int = 0, limit: int = 1000, max_bytes: int = 16 << 20) -> dict[str, Any]:
        """The record of `target`'s sandbox and up to `limit` steps from `since` in order (fewer if they hold
        more than `max_bytes`; always at least one)."""
        sandbox_id = self.owner(target)
        steps: list[dict[str, Any]] = []
        size = 0
        for step in self.log.steps(sandbox_id, since):
            size += step.size
            if len(steps) >= limit or (steps and size > max_bytes):
                break
            steps.append({**step.to_dict(), "summary": step.describe()})
        return {"sandbox": self.log.sandbox(sandbox_id), "steps": steps}
