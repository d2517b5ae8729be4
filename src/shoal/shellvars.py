"""Dockerfile variable expansion: `$NAME`, `${NAME}`, `${NAME:-default}`, `${NAME:+alt}`, `\\$` for a literal.

Shared by the SDK's Dockerfile parser (which knows the file's ARG and ENV values) and the node's builder
(which knows the base image's environment, e.g. the PATH in `ENV PATH $NVM_DIR/bin:$PATH`). So the parser
expands what it knows and keeps the references it cannot resolve (`keep_unknown`); the node finishes them.
Imports nothing from shoal: both sides of the layer boundary use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_REF = re.compile(r"\\\$|\$(?:\{(\w+)(?:(:?[-+])([^}]*))?\}|(\w+))")


def references(text: str) -> set[str]:
    """The variable names `text` refers to (escaped dollars excluded)."""
    return {m.group(1) or m.group(4) for m in _REF.finditer(text) if m.group(0) != "\\$"}


def expand(text: str, values: Mapping[str, str], *, keep_unknown: bool = False) -> str:
    """`text` with its references replaced from `values`. An unknown name becomes "" as in Docker, or
    stays as written with `keep_unknown` (escapes too, so a second pass sees the same text)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return match.group(0) if keep_unknown else "$"
        name = match.group(1) or match.group(4)
        if name not in values and keep_unknown:
            return match.group(0)
        value, op, word = values.get(name), match.group(2), match.group(3)
        if op in (":-", "-"):
            unset = value is None or (op == ":-" and value == "")
            return expand(word, values, keep_unknown=keep_unknown) if unset else str(value)
        if op in (":+", "+"):
            present = value is not None and (op == "+" or value != "")
            return expand(word, values, keep_unknown=keep_unknown) if present else ""
        return "" if value is None else str(value)

    return _REF.sub(one, text)
