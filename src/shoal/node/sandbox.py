"""The node's record of one sandbox and its state machine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shoal.guest import AgentClient
from shoal.images import Image
from shoal.protocol import SandboxInfo, SandboxSpec
from shoal.substrates import Instance


class State(StrEnum):
    CREATING = "creating"
    READY = "ready"
    PAUSED = "paused"
    CLOSED = "closed"
    LOST = "lost"


@dataclass
class Sandbox:
    id: str
    spec: SandboxSpec
    image: Image
    instance: Instance
    agent: AgentClient
    state: State = State.READY
    created_at: float = field(default_factory=time.time)
    expires_at: float | None = None
    uid: int = 0
    gid: int = 0
    lost_reason: str = ""
    resolv_written: bool = False
    next_seq: int = 0  # the next step's place in the trajectory log
    inflight: dict[int, asyncio.Future] = field(default_factory=dict)  # steps running now, by seq
    last_active: float = field(default_factory=time.time)  # for idle_timeout_s
    busy: int = 0  # requests in progress (an idle timer does not run while a command does)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises pause, resume and snapshot
    screen: Any = None  # node.gui.Screen: its display's helper, when it has a screen
    execs: dict[int, str] = field(default_factory=dict)  # recent execs' commands by exec ID (processes())
    record_base: dict[str, Any] | None = None  # the substrate's part of record.json (recovery.write_record)

    def remember_exec(self, exec_id: int | None, command: str) -> None:
        if exec_id is not None:
            self.execs.pop(exec_id, None)
            self.execs[exec_id] = command[:200]
            while len(self.execs) > 512:
                del self.execs[next(iter(self.execs))]

    @property
    def env(self) -> dict[str, str]:
        return {**self.image.config.env, **self.spec.env}

    @property
    def workdir(self) -> str:
        return self.spec.workdir or self.image.config.workdir or "/"

    @property
    def shell(self) -> list[str]:
        return list(self.image.config.shell or ["/bin/sh"])

    def bind(self, spec: SandboxSpec, now: float) -> None:
        """Late binding at claim time: the fields a warm sandbox did not know when it was made."""
        self.spec = spec
        self.created_at = now
        self.expires_at = now + spec.ttl_s if spec.ttl_s else None
        self.last_active = now

    def matches(self, labels: dict[str, str] | None) -> bool:
        return not labels or all(self.spec.labels.get(k) == v for k, v in labels.items())

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            kind=self.spec.kind,
            image=self.spec.image,
            state=self.state.value,
            labels=dict(self.spec.labels),
            created_at=self.created_at,
            expires_at=self.expires_at,
            owner=self.spec.owner,
            workdir=self.workdir,
            trajectory=self.spec.trajectory,
            steps=self.next_seq,
            last_active_at=self.last_active,
            idle_timeout_s=self.spec.idle_timeout_s or None,  # internal sandboxes (builds) leave it UNSET
            on_timeout=self.spec.on_timeout,
            network=self.spec.network,
        )
