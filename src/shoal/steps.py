"""What identifies a step of a trajectory: shared by the node (which logs steps) and the client (which can
fast-forward through a fetched page of the log without a round trip per step).

A step's key is a digest of the arguments that define it (command, env, cwd, user, stdin, file path and
data...). Timeouts, output caps and streaming flags are not part of it, nor are arguments left at their
empty default, so the client (which sends only what was set) and the node (which sees every field) agree.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

VOLATILE = frozenset({"timeout", "idle_timeout", "stream", "output_cap_bytes", "seq", "sandbox_id", "max_bytes"})
_encode = msgspec.msgpack.Encoder().encode


def step_key(op: str, args: dict[str, Any]) -> str:
    identity = {k: v for k, v in sorted(args.items()) if k not in VOLATILE and v not in (None, {}, [], False)}
    return hashlib.blake2b(_encode([op, identity]), digest_size=12).hexdigest()


def describe(op: str, args: dict[str, Any]) -> str:
    """A short human form of a step for errors and `shoal log show`."""
    if op in ("exec", "shell_run"):
        text = f"{op} {args.get('cmd')!r}"
        extras = {k: args[k] for k in ("env", "cwd", "user", "stdin") if args.get(k)}
        return text + (f" {extras}" if extras else "")
    if op == "file_write":
        data = args.get("data") or b""
        return f"file_write {args.get('path')!r} ({len(data)} bytes{', append' if args.get('append') else ''})"
    if op == "file_untar":
        return f"file_untar {args.get('path')!r} ({len(args.get('data') or b'')} bytes of tar)"
    if op == "sandbox_snapshot":
        return f"snapshot as image {args.get('name')!r}"
    if "path" in args:
        return f"{op} {args['path']!r}"
    return op


def divergence_message(sandbox_id: str, seq: int, logged: str, issued: str) -> str:
    return (
        f"step {seq} of sandbox {sandbox_id} diverges from its trajectory log: the log has {logged}, this "
        f"request is {issued}; re-issue the logged steps in order, or start a new trajectory "
        f"(client.replay({sandbox_id!r}) re-runs the log in a fresh sandbox)"
    )
