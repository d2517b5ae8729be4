"""The node's record of one sandbox and its state machine."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shoal import cgroups
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
    oom_fd: int | None = None  # its cgroup's OOM-kill counter, opened at its first exec; -1 once closed
    handlers: dict[int, int] = field(default_factory=dict)  # agent handler pid -> the last exec ID it served
    handler_execs: int = 0  # execs so far that ran on a handler an earlier exec had used (exec_started)

    def oom_kills(self) -> int:
        """How many times the OOM killer has fired in its cgroup (read twice per exec: a kept fd)."""
        if self.oom_fd is None:
            self.oom_fd = cgroups.open_oom_counter(self.instance.cgroup_path)
        if self.oom_fd is None or self.oom_fd < 0:  # could not open it, or closed (an exec outlived a destroy)
            return cgroups.oom_kills(self.instance.cgroup_path)
        return cgroups.oom_kills_of(self.oom_fd)

    def close_files(self) -> None:
        """Close what it holds open of its cgroup (its destroy); later reads open nothing."""
        fd, self.oom_fd = self.oom_fd, -1
        if fd is not None and fd >= 0:
            os.close(fd)

    def exec_started(self, handler_pid: int | None, command: str) -> int | None:
        """The exec ID of an exec the agent's handler `handler_pid` now runs. The agent names an exec by its
        handler, and a kept handler serves execs one after another (guest/client.py), so the first exec on a
        handler is named by its pid (as before) and every later one by ``n << 32 | pid``: unique, so an ID
        kept from an exec that ended leaving nothing can never kill or list a later exec's processes
        (`agent_exec_id`)."""
        if handler_pid is None:
            return None
        exec_id = handler_pid
        if handler_pid in self.handlers:
            self.handler_execs += 1
            exec_id = self.handler_execs << 32 | handler_pid
        self.handlers.pop(handler_pid, None)
        self.handlers[handler_pid] = exec_id
        while len(self.handlers) > 4096:
            del self.handlers[next(iter(self.handlers))]
        self.remember_exec(exec_id, command)
        return exec_id

    def background_started(self, process_id: int, command: str) -> None:
        """A background process (its keeper's pid is its ID) holds that pid as its exec ID from now on."""
        self.handlers.pop(process_id, None)
        self.handlers[process_id] = process_id
        self.remember_exec(process_id, command)

    def exec_id_of(self, handler_pid: int | None) -> int | None:
        """The exec ID of the processes the agent lists under handler `handler_pid`."""
        return None if handler_pid is None else self.handlers.get(handler_pid, handler_pid)

    def agent_exec_id(self, exec_id: int) -> int | None:
        """The handler to ask the agent about for exec `exec_id`, or None if that exec ended leaving nothing
        (its handler has served a later exec since: what runs there now is not exec_id's)."""
        handler_pid = exec_id & 0xFFFFFFFF
        current = self.handlers.get(handler_pid)
        return handler_pid if current is None or current == exec_id else None

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
