"""The `container` substrate: an OCI bundle over an overlay of shared read-only image layers."""

from shoal.substrates.container.substrate import ContainerSubstrate

__all__ = ["ContainerSubstrate"]
