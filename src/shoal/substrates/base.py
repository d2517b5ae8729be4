"""The interface every substrate implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from shoal.images import Image
from shoal.protocol import SandboxSpec


@dataclass
class Instance:
    """A running sandbox as its substrate made it: enough to reach its agent and to tear it down."""

    id: str
    kind: str
    directory: Path
    agent_socket: Path
    cgroup_path: str
    extra: dict[str, Any] = field(default_factory=dict)


class Substrate(ABC):
    """Makes and destroys sandboxes of one kind. Policy (timeouts, pools, limits) lives in the node."""

    kind: ClassVar[str]

    @abstractmethod
    async def create(self, sandbox_id: str, spec: SandboxSpec, image: Image) -> Instance:
        """Start a sandbox whose agent answers on `Instance.agent_socket`; clean up fully on failure."""

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
