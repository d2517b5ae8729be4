"""`shoal top`: a live terminal view of a cluster, from a gateway's `cluster_status`."""

from __future__ import annotations

import sys
import time
from typing import Any

import shoal


def _bar(fraction: float, width: int = 20) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "·" * (width - filled)


def render(view: dict[str, Any], previous: dict[str, Any] | None, interval: float) -> str:
    """One screen of text for a gateway's cluster_status (pure: easy to test)."""
    nodes = view.get("nodes", {})
    up = sum(1 for n in nodes.values() if n["healthy"])
    total = sum(n["sandboxes"] for n in nodes.values())
    capacity = sum(n["max_sandboxes"] for n in nodes.values() if n["healthy"])
    rate = 0.0
    if previous is not None and interval > 0:
        rate = max(0.0, (view.get("created", 0) - previous.get("created", 0)) / interval)
    lines = [
        f"shoal top — gateway {view.get('gateway', '?')}   {time.strftime('%H:%M:%S')}",
        f"nodes {up}/{len(nodes)} up   sandboxes {total}/{capacity}   creating {view.get('creating', 0)}   "
        f"queued {view.get('queue_depth', 0)}   creates/s {rate:.1f}   rejections {view.get('rejections', 0):g}   "
        f"clients {view.get('connections', 0)}",
        "",
        f"{'NODE':<14} {'ADDRESS':<22} {'STATE':<6} {'SANDBOXES':>11} {'LOAD':<22} {'INFLIGHT':>8} {'POOL HIT':>8}",
    ]
    for node_id, n in sorted(nodes.items()):
        hits, misses = n.get("pool_hits", 0), n.get("pool_misses", 0)
        pool = f"{100 * hits / (hits + misses):.0f}%" if hits + misses else "-"
        state = "up" if n["healthy"] else "DOWN"
        used = f"{n['sandboxes']}/{n['max_sandboxes']}"
        lines.append(
            f"{node_id:<14} {n['address']:<22} {state:<6} {used:>11} {_bar(n['load'])}   {n['inflight']:>8} {pool:>8}"
        )
        if not n["healthy"]:
            lines.append(f"{'':<14} ↳ {n['reason']}")
    for node_id, reason in sorted(view.get("gone", {}).items()):
        lines.append(f"{node_id:<14} {'':<22} {'GONE':<6} {reason}")
    queued = view.get("queue_by_project") or {}
    if queued:
        lines += ["", "queued by project: " + ", ".join(f"{p}={d}" for p, d in sorted(queued.items()))]
    return "\n".join(lines)


def _view(client: shoal.Client) -> dict[str, Any]:
    """A gateway's cluster view; a single node (no gateway) is shown as a cluster of one."""
    try:
        return client._run(client._async.call("cluster_status"))
    except shoal.InvalidRequestError:
        status = client.status()
        node = {
            "address": client._async.address, "healthy": True, "reason": "", "sandboxes": status["sandboxes"],
            "max_sandboxes": status.get("max_sandboxes", 0), "inflight": status.get("creating", 0),
            "load": status["sandboxes"] / max(1, status.get("max_sandboxes", 1)),
            "pool_hits": status.get("pool_hits", 0), "pool_misses": status.get("pool_misses", 0),
        }  # fmt: skip
        return {"gateway": "(none: one node)", "nodes": {status["node_id"]: node}}


def run(client: shoal.Client, interval: float = 1.0, once: bool = False) -> int:
    """Redraw every `interval` seconds until Ctrl-C (or print one screen with `once`)."""
    previous = None
    while True:
        view = _view(client)
        text = render(view, previous, interval)
        if once:
            print(text)
            return 0
        sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        sys.stdout.flush()
        previous = view
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0
