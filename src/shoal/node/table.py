"""The node's sandbox table: the live sandboxes by ID, and why recent ones ended.

Looking a sandbox up answers the precise error for each way it can be missing (closed, lost with the node
process, a function sandbox asked for what it cannot do, never here), so every operation says the same.
Apart from NodeService so that parts needing only the table (log queries, the network front) need no more.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from shoal.errors import SandboxClosedError, SandboxLostError, SandboxNotFoundError, UnsupportedKindError
from shoal.node.sandbox import Sandbox, State
from shoal.node.trajectory import TrajectoryLog

NODE_RESTARTED = "its node process died (its sandboxes with it) and was restarted"
CLOSED_KEPT = 100_000  # closed IDs remembered in memory (the trajectory log remembers the rest)
# A function sandbox has no process of its own between calls: what needs one says so, and names what works.
FUNCTION_OPS = (
    "sandbox {sandbox_id} is a function sandbox: it has no long-lived process, so it cannot be paused, "
    "snapshotted, forked, given a shell or a network policy, and keeps no step log (attach, log, replay); "
    "it supports exec, files, keepalive, get and kill. Use kind='container' (or microvm/vm) for the rest"
)


class SandboxTable:
    def __init__(self, node_id: str, log: TrajectoryLog, is_function: Callable[[str], bool]) -> None:
        self.node_id = node_id
        self.log = log
        self.is_function = is_function
        self.live: dict[str, Sandbox] = {}
        self.closed: collections.OrderedDict[str, str] = collections.OrderedDict()

    def remember_closed(self, sandbox_id: str, reason: str) -> None:
        self.closed[sandbox_id] = reason
        while len(self.closed) > CLOSED_KEPT:
            self.closed.popitem(last=False)

    def get(self, sandbox_id: str) -> Sandbox:
        """The live sandbox `sandbox_id`, or the error that says why there is none."""
        sandbox = self.live.get(sandbox_id)
        if sandbox is None:
            reason = self.closed.get(sandbox_id)
            if reason is None and (row := self.log.sandbox(sandbox_id)) is not None and row["reason"]:
                reason = row["reason"]  # closed before this node process started
            if reason is not None and (reason == NODE_RESTARTED or reason.startswith("lost: " + NODE_RESTARTED)):
                raise SandboxLostError(f"sandbox {sandbox_id} is {reason}")
            if reason is not None:
                raise SandboxClosedError(f"sandbox {sandbox_id} is closed ({reason})")
            if self.is_function(sandbox_id):
                raise UnsupportedKindError(FUNCTION_OPS.format(sandbox_id=sandbox_id))
            raise SandboxNotFoundError(f"no sandbox {sandbox_id} on node {self.node_id}")
        if sandbox.state is State.LOST:
            raise SandboxLostError(f"sandbox {sandbox_id} is lost: {sandbox.lost_reason}")
        return sandbox
