"""The `function` kind: stateless calls served by warm container workers, a fresh forked child per call."""

from shoal.substrates.function.service import FunctionService

__all__ = ["FunctionService"]
