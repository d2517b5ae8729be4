"""Substrates: narrow back ends that start and stop sandboxes. What a sandbox offers (exec, files,
shells) is the same guest agent protocol for every substrate; only how the agent is started differs."""

from shoal.substrates.base import Instance, Substrate

__all__ = ["Instance", "Substrate"]
