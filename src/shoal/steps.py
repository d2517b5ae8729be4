"""What identifies a step of a trajectory: shared by the node (which logs steps) and the client (which can
fast-forward through a fetched page of the log without a round trip per step).

A step's key is a digest of the arguments that define it (command, env, cwd, user, stdin, file path and
data...). Timeouts, output caps and streaming flags are not part of it, nor are arguments left at their
empty default, so the client (which sends only what was set) and the node (which sees every field) agree.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import msgspec

# Payloads above this many bytes (a file's data written or read, an exec's stdin) are logged as their
# digest and size, not their bytes: the log stays small and its group commits fast (issue 18).
BULK_BYTES = 64 << 10

VOLATILE = frozenset({"timeout", "idle_timeout", "stream", "output_cap_bytes", "seq", "sandbox_id", "max_bytes"})
_encode = msgspec.msgpack.Encoder().encode
_EMPTY = (None, {}, [], False)  # values left out of a key (compared with ==: 0 and 0.0 too, not "")


def step_key(op: str, args: dict[str, Any]) -> str:
    identity = {k: v for k, v in sorted(args.items()) if k not in VOLATILE and v not in _EMPTY}
    return hashlib.blake2b(_encode([op, identity]), digest_size=12).hexdigest()


def digest(data: bytes) -> str:
    return "blake2b:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def bulk(data: bytes, known_digest: str | None = None) -> dict[str, Any]:
    """What the log keeps of a payload over BULK_BYTES (see `is_bulk`)."""
    return {"bulk": known_digest or digest(data), "size": len(data)}


def is_bulk(value: Any) -> bool:
    """A payload the log kept only as {"bulk": digest, "size": bytes}."""
    return isinstance(value, dict) and len(value) == 2 and "bulk" in value and "size" in value


BULK_ARGS = {"file_write": "data", "file_untar": "data", "exec": "stdin", "shell_run": "stdin", "proc_start": "stdin",
             "proc_input": "data"}  # fmt: skip


def loggable_args(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """`args` as the log keeps them: a bulk payload argument replaced by its digest and size."""
    name = BULK_ARGS.get(op)
    value = args.get(name) if name else None
    if isinstance(value, bytes | bytearray | memoryview) and len(value) > BULK_BYTES:
        return {**args, name: bulk(bytes(value))}
    return args


def describe(op: str, args: dict[str, Any]) -> str:
    """A short human form of a step for errors and `shoal log show`."""
    if op in ("exec", "shell_run", "proc_start"):
        text = f"{op} {args.get('cmd')!r}"
        extras = {k: args[k] for k in ("env", "cwd", "user", "stdin") if args.get(k)}
        return text + (f" {extras}" if extras else "")
    if op == "file_write":
        data = args.get("data") or b""
        size = data["size"] if is_bulk(data) else len(data)
        return f"file_write {args.get('path')!r} ({size} bytes{', append' if args.get('append') else ''})"
    if op == "file_untar":
        data = args.get("data") or b""
        return f"file_untar {args.get('path')!r} ({data['size'] if is_bulk(data) else len(data)} bytes of tar)"
    if op == "proc_input":
        data = args.get("data") or b""
        size = data["size"] if is_bulk(data) else len(data)
        return f"proc_input {args.get('id')} ({size} bytes{', eof' if args.get('eof') else ''})"
    if op == "proc_signal":
        return f"proc_signal {args.get('id')} signal {args.get('signal')}"
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


def jsonable(value: Any) -> Any:
    """A logged value as JSON can carry it: bytes as text when they are UTF-8, else {"base64": ...}, containers
    converted recursively (what `shoal log export` and the console's JSONL export write)."""
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
