"""`vm`: a complete Debian system (systemd as PID 1) with the shoal agent as a systemd service."""

from shoal.substrates.vm.substrate import VmSubstrate

__all__ = ["VmSubstrate"]
