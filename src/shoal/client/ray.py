"""The SDK's side of a shoal cluster on Ray: find the controller and ask it for gateways and a token.

`shoal.Client(ray_address=...)` uses `connect_info`; the cluster's own code (shoal.cluster.ray) builds on the
same lookups. Ray is imported by this module only, so the SDK without Ray never loads it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from shoal.errors import NodeError

NAMESPACE = "shoal"
CONTROLLER = "shoal-controller"


def ensure_ray(address: str | None) -> bool:
    """Connect to Ray if not yet connected; True if this call connected (so the caller may disconnect)."""
    if ray.is_initialized():
        return False
    ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    return True


def controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise NodeError("no shoal cluster on this Ray cluster: start one with `shoal cluster up`") from None


def ask_controller(method: str, *args: Any, patience: float = 120.0) -> Any:
    """Call the controller, waiting out a restart (Ray restarts it; calls meanwhile are refused)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return ray.get(getattr(controller(), method).remote(*args))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def connect_info(address: str | None, project: str | None = None) -> dict[str, Any]:
    """Where the gateways are and a token for `project` (what `shoal.Client(ray_address=...)` uses)."""
    connected = ensure_ray(address)
    try:
        return ask_controller("connect_info", project)
    finally:
        if connected:
            ray.shutdown()
