"""Which runtime runs a container whose create names none: SHOAL_RUNTIME, "auto" by default.

Why (issue 12): runtime="shoal" (the node's pre-forked launcher, launcher.py) creates in about half the time
of crun at about 60 % of the node's CPU, with the same isolation (tests/test_hardening.py runs every escape
attempt under both), so users should get it without asking. It cannot run everywhere (no user namespace,
cgroup v1/hybrid hosts only, libseccomp needed): "auto" asks this host once, when the node starts, and falls
back to crun, saying why. The node stores the concrete runtime in each sandbox's record, so a sandbox is
always closed and re-adopted by the runtime that made it, whatever the default is later.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from shoal.errors import InvalidRequestError
from shoal.substrates.container import launcher
from shoal.substrates.container.runtime import RUNTIMES

AUTO = "auto"
CHOICES = (AUTO, launcher.NAME, *RUNTIMES)


@dataclass(frozen=True)
class Choice:
    """The node's default runtime, the SHOAL_RUNTIME value it came from, and why."""

    runtime: str
    setting: str
    reason: str

    def describe(self) -> str:
        if self.setting == AUTO:
            return f"auto → {self.runtime}: {self.reason}"
        return f"{self.runtime} (SHOAL_RUNTIME={self.setting}): {self.reason}"


def choose(setting: str | None, userns_base: int | None) -> Choice:
    """The default runtime for `setting` (SHOAL_RUNTIME) on this host; ValueError for a value this host cannot
    honour (unknown, not installed, or "shoal" where the launcher cannot run), naming the remedy."""
    value = (setting or AUTO).strip().lower()
    if value not in CHOICES:
        raise ValueError(f"SHOAL_RUNTIME={setting!r}: choose one of {', '.join(CHOICES)}")
    if value in RUNTIMES:
        if shutil.which(value) is None:
            raise ValueError(f"SHOAL_RUNTIME={value}: {value} is not installed here; install it or unset SHOAL_RUNTIME")
        return Choice(value, value, "named by SHOAL_RUNTIME")
    why_not = _launcher_unusable(userns_base)
    if value == launcher.NAME:
        if why_not:
            raise ValueError(f"SHOAL_RUNTIME=shoal: {why_not}; unset SHOAL_RUNTIME (auto) or name crun")
        return Choice(launcher.NAME, value, "named by SHOAL_RUNTIME")
    if why_not:
        return Choice("crun", AUTO, f"the launcher cannot run here: {why_not}")
    why = "this host runs the node's pre-forked launcher (cgroup v1 limits, no SHOAL_USERNS, libseccomp)"
    return Choice(launcher.NAME, AUTO, why)


def _launcher_unusable(userns_base: int | None) -> str | None:
    """Why the launcher cannot make sandboxes on this host, or None (its binary is built here if stale)."""
    try:
        launcher.check_host(userns_base)
    except InvalidRequestError as exc:
        return str(exc)
    try:
        launcher.binary_path()
    except (RuntimeError, OSError) as exc:  # gcc or a static libc missing: the build's own error says which
        return f"its binary could not be built: {exc}"
    return None
