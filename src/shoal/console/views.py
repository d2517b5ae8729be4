"""What the console's JSON answers hold, as plain functions over operation results (no I/O here).

The sandbox list is filtered, sorted and cut into a page on the server: a browser gets one page of rows
however many sandboxes the node or cluster holds (`page` costs one pass over the `list` answer).
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import InvalidRequestError
from shoal.steps import jsonable

PAGE_MAX = 500  # most rows one page may ask for
OUTPUT_SHOWN = 4000  # characters of a step's stdout/stderr shown in a step table (the export has them whole)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
SORTS = ("newest", "oldest", "remaining")


def duration(text: str | None, name: str) -> float | None:
    """'90', '90s', '10m', '2h', '1d' → seconds; '' or None → None."""
    if text is None or not text.strip():
        return None
    match = _DURATION.match(text)
    if match is None:
        raise InvalidRequestError(f"{name}={text!r}: give a duration such as 90, 90s, 10m, 2h or 1d")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class Filters:
    labels: dict[str, str] = field(default_factory=dict)  # sent to the `list` operation (filtered on the node)
    kind: str = ""
    state: str = ""
    owner: str = ""  # matches the owner (user@host) or the project
    min_age: float | None = None
    max_age: float | None = None
    min_remaining: float | None = None
    max_remaining: float | None = None
    search: str = ""  # part of the ID, image or trajectory
    sort: str = "newest"
    offset: int = 0
    limit: int = 50

    @classmethod
    def from_query(cls, query: Any) -> Filters:
        """From a request's query (a multidict: `label` may repeat, as k=v)."""
        labels = {}
        for item in query.getall("label", []):
            for part in filter(None, (p.strip() for p in item.split(","))):
                key, eq, value = part.partition("=")
                if not eq or not key:
                    raise InvalidRequestError(f"label={part!r}: give key=value")
                labels[key] = value
        sort = query.get("sort") or "newest"
        if sort not in SORTS:
            raise InvalidRequestError(f"sort={sort!r}: one of {', '.join(SORTS)}")
        try:
            offset = max(0, int(query.get("offset") or 0))
            limit = min(PAGE_MAX, max(1, int(query.get("limit") or 50)))
        except ValueError as exc:
            raise InvalidRequestError(f"offset and limit are whole numbers: {exc}") from None
        return cls(
            labels=labels,
            kind=query.get("kind", "").strip(),
            state=query.get("state", "").strip(),
            owner=query.get("owner", "").strip(),
            min_age=duration(query.get("min_age"), "min_age"),
            max_age=duration(query.get("max_age"), "max_age"),
            min_remaining=duration(query.get("min_remaining"), "min_remaining"),
            max_remaining=duration(query.get("max_remaining"), "max_remaining"),
            search=query.get("q", "").strip(),
            sort=sort,
            offset=offset,
            limit=limit,
        )


def remaining(info: dict[str, Any], now: float) -> float | None:
    """Seconds until the TTL or the idle timeout ends the sandbox (whichever comes first); None: never."""
    ends = []
    if info.get("expires_at"):
        ends.append(info["expires_at"] - now)
    if info.get("idle_timeout_s") and info.get("state") != "paused":
        ends.append(info["idle_timeout_s"] - (now - (info.get("last_active_at") or now)))
    return max(0.0, min(ends)) if ends else None


def _matches(info: dict[str, Any], f: Filters, now: float) -> bool:
    if f.kind and info["kind"] != f.kind:
        return False
    if f.state and info["state"] != f.state:
        return False
    if f.owner and f.owner not in (info.get("owner") or "", info["labels"].get("shoal.project", "")):
        return False
    if f.search and not any(f.search in (info.get(k) or "") for k in ("id", "image", "trajectory")):
        return False
    age = now - info["created_at"]
    if (f.min_age is not None and age < f.min_age) or (f.max_age is not None and age > f.max_age):
        return False
    if f.min_remaining is not None or f.max_remaining is not None:
        left = remaining(info, now)
        left = math.inf if left is None else left
        if (f.min_remaining is not None and left < f.min_remaining) or (
            f.max_remaining is not None and left > f.max_remaining
        ):
            return False
    return True


def row(info: dict[str, Any], now: float) -> dict[str, Any]:
    return {
        "id": info["id"],
        "kind": info["kind"],
        "image": info["image"],
        "state": info["state"],
        "owner": info.get("owner"),
        "project": info["labels"].get("shoal.project"),
        "labels": {k: v for k, v in info["labels"].items() if k != "shoal.project"},
        "trajectory": info.get("trajectory"),
        "steps": info.get("steps", 0),
        "age_s": round(now - info["created_at"], 1),
        "remaining_s": None if (left := remaining(info, now)) is None else round(left, 1),
    }


def page(infos: list[dict[str, Any]], f: Filters, now: float) -> dict[str, Any]:
    """One page of the sandboxes that pass the filters, and how many passed."""
    chosen = [info for info in infos if _matches(info, f, now)]
    if f.sort == "remaining":
        chosen.sort(key=lambda i: (math.inf if (left := remaining(i, now)) is None else left, i["id"]))
    else:
        chosen.sort(key=lambda i: (i["created_at"], i["id"]), reverse=f.sort == "newest")
    rows = [row(info, now) for info in chosen[f.offset : f.offset + f.limit]]
    return {"total": len(chosen), "offset": f.offset, "limit": f.limit, "items": rows}


def _node(node_id: str, healthy: bool, reason: Any, sandboxes: int, most: int, load: Any) -> dict[str, Any]:
    return {"id": node_id, "healthy": healthy, "reason": reason, "sandboxes": sandboxes, "max_sandboxes": most,
            "load": load}  # fmt: skip


def nodes(status: dict[str, Any], cluster: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each node's health and load: from a gateway's cluster view, else from a node's status (itself)."""
    out = []
    if cluster is not None:
        for node_id, n in sorted(cluster["nodes"].items()):
            out.append(_node(node_id, n["healthy"], n.get("reason"), n["sandboxes"], n["max_sandboxes"], n["load"]))
        for node_id, reason in sorted(cluster.get("gone", {}).items()):
            out.append(_node(node_id, False, f"gone: {reason}", 0, 0, None))
    else:
        for node_id, n in sorted(status.get("nodes", {}).items()):
            used, most = n.get("sandboxes", 0), n.get("max_sandboxes") or 0
            out.append(_node(node_id, True, None, used, most, round(used / most, 4) if most else None))
    for node_id, reason in sorted((status.get("unreachable") or {}).items()):
        if not any(n["id"] == node_id for n in out):
            out.append(_node(node_id, False, reason, 0, 0, None))
    return out


def by_kind_state(infos: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for info in infos:
        counts[info["kind"]][info["state"]] += 1
    return {kind: dict(states) for kind, states in sorted(counts.items())}


def shown(value: Any) -> Any:
    """A logged or replayed value as a table shows it: text cut to OUTPUT_SHOWN, anything else as JSON."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return _text(value if isinstance(value, bytes | bytearray | str) else jsonable(value))


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode(errors="replace")
    text = str(value)
    return text if len(text) <= OUTPUT_SHOWN else text[:OUTPUT_SHOWN] + f"… ({len(text) - OUTPUT_SHOWN} more)"


def step_row(step: dict[str, Any]) -> dict[str, Any]:
    """A step of the trajectory log as a table row: what ran, its outputs or error, how long it took."""
    result = step.get("result")
    out: dict[str, Any] = {
        "seq": step["seq"],
        "op": step["op"],
        "summary": step.get("summary") or step["op"],
        "started_at": step.get("started_at"),
        "duration_ms": None
        if not step.get("finished_at")
        else round((step["finished_at"] - step["started_at"]) * 1000, 2),
        "error": f"{step['error_type']}: {step.get('error') or ''}" if step.get("error_type") else None,
        "exit_code": None,
        "stdout": "",
        "stderr": "",
        "result": None,
    }
    if isinstance(result, dict) and "exit_code" in result:
        out.update(exit_code=result["exit_code"], stdout=_text(result.get("stdout", b"")))
        out["stderr"] = _text(result.get("stderr", b""))
    elif isinstance(result, dict) and "png" in result:
        out["result"] = f"screenshot {result.get('width')}x{result.get('height')}"
    elif result is not None:
        out["result"] = _text(jsonable(result))
    return out


def spec_shown(spec: dict[str, Any] | None) -> dict[str, Any]:
    """A stored spec without file contents (names and sizes only) and without the project's label."""
    if not spec:
        return {}
    shown = {k: v for k, v in spec.items() if k not in ("files", "env")}
    if spec.get("files"):
        shown["files"] = {name: f"{len(data)} bytes" for name, data in spec["files"].items()}
    if spec.get("env"):
        shown["env"] = sorted(spec["env"])  # names only: values may be secrets
    return jsonable(shown)
