"""Tokens and projects: who may call a node or gateway over the network, and how much they may hold.

The token file (JSON, path in SHOAL_TOKENS) maps tokens to projects and gives each project its quotas:

    {"projects": {"alice": {"sandboxes": 100, "cpu": 50, "memory_mb": 65536}},
     "tokens": {"<secret>": "alice", "<secret of the cluster>": "@cluster"}}

A quota left out is unlimited. The role `@cluster` is for gateways and the Ray controller: such a connection
may act for any project (it names it per request) and sees everything when it names none.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal import resources, settings
from shoal.errors import AuthenticationError, QuotaExceededError

CLUSTER_ROLE = "@cluster"
PROJECT_LABEL = "shoal.project"
# what a sandbox without an explicit limit counts against its project's quota
DEFAULT_CPU = resources.QUOTA_CPU
DEFAULT_MEMORY_MB = resources.QUOTA_MEMORY_MB


@dataclass(frozen=True)
class Quota:
    sandboxes: int | None = None
    cpu: float | None = None
    memory_mb: int | None = None


@dataclass(frozen=True)
class Identity:
    project: str
    cluster: bool = False  # may act for any project


@dataclass
class Usage:
    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0

    def add(self, cpu: float, memory_mb: int, sign: int = 1) -> None:
        self.sandboxes += sign
        self.cpu += sign * cpu
        self.memory_mb += sign * memory_mb

    def as_dict(self) -> dict[str, Any]:
        return {"sandboxes": self.sandboxes, "cpu": round(self.cpu, 3), "memory_mb": self.memory_mb}


cost = resources.quota_cost  # what a create counts against its project's quota


class Tokens:
    """The token table. Tokens are held only as SHA-256 digests."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.projects = {name: Quota(**(q or {})) for name, q in (config.get("projects") or {}).items()}
        self._by_digest: dict[bytes, Identity] = {}
        for token, project in (config.get("tokens") or {}).items():
            ident = Identity(project="", cluster=True) if project == CLUSTER_ROLE else Identity(project=project)
            self._by_digest[hashlib.sha256(token.encode()).digest()] = ident

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokens:
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise AuthenticationError(f"cannot read the token file {path}: {exc}") from exc

    @classmethod
    def from_env(cls) -> Tokens | None:
        path = settings.TOKENS.raw()
        return cls.load(path) if path else None

    def authenticate(self, token: Any) -> Identity:
        if not token or not isinstance(token, str):
            raise AuthenticationError(
                "no token given: this endpoint needs one (shoal.Client('shoal://host:port', token=...) or $SHOAL_TOKEN)"
            )
        ident = self._by_digest.get(hashlib.sha256(token.encode()).digest())
        if ident is None:
            raise AuthenticationError(f"unknown token {token[:4]}…: check the token, or ask for one for your project")
        return ident

    def quota(self, project: str) -> Quota:
        return self.projects.get(project, Quota())

    def check(self, project: str, usage: Usage, cpu: float, memory_mb: int) -> None:
        """Raise QuotaExceededError if one more sandbox of this size takes `project` past a quota."""
        q = self.quota(project)
        for name, used, more, limit in (
            ("sandboxes", usage.sandboxes, 1, q.sandboxes),
            ("cpu", usage.cpu, cpu, q.cpu),
            ("memory_mb", usage.memory_mb, memory_mb, q.memory_mb),
        ):
            if limit is not None and used + more > limit:
                raise QuotaExceededError(
                    f"project {project!r} would exceed its {name} quota: {used:g} in use + {more:g} requested > "
                    f"{limit:g}; close some sandboxes (unset cpu/memory_mb count as {DEFAULT_CPU:g} core / "
                    f"{DEFAULT_MEMORY_MB} MB) or ask for a larger quota"
                )


def new_token() -> str:
    return "shoal_" + secrets.token_urlsafe(24)
