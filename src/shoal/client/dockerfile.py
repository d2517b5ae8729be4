"""A Dockerfile subset → `ImageBuilder`: FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD, ENTRYPOINT, LABEL.

Single stage only. ARG values are substituted (`$NAME`, `${NAME}`) in later instructions; EXPOSE, VOLUME,
STOPSIGNAL and HEALTHCHECK are accepted and ignored (they do not apply to sandboxes). Anything else is an
error naming the line.
"""

from __future__ import annotations

import json
import re
import shlex
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequestError

IGNORED = {"EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER", "SHELL", "ONBUILD"}
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _lines(text: str) -> list[tuple[int, str]]:
    out, buffer, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        out.append((start, buffer + line))
        buffer = ""
    if buffer:
        out.append((start, buffer))
    return out


def _json_or_shell(value: str) -> str | list[str]:
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed):
            return parsed
    return value


def _pairs(value: str, number: int, keyword: str) -> dict[str, str]:
    words = shlex.split(value)
    if words and "=" not in words[0]:  # legacy `ENV KEY value with spaces`
        key, _, rest = value.partition(" ")
        return {key: rest.strip()}
    pairs = {}
    for word in words:
        key, eq, item = word.partition("=")
        if not eq:
            raise InvalidRequestError(f"line {number}: {keyword} expects KEY=value, got {word!r}")
        pairs[key] = item
    return pairs


def parse(text: str, context: Path, from_: Callable[[str], Any]) -> Any:
    """Parse a Dockerfile into the builder `from_(base)` starts (ImageBuilder.from_, which imports this module);
    COPY/ADD sources are read from `context` now."""
    builder: Any = None
    args: dict[str, str] = {}
    for number, line in _lines(text):
        keyword, _, value = line.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword == "ARG":
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip().strip('"')
            continue
        value = _VAR.sub(lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)
        if keyword == "FROM":
            if builder is not None:
                raise InvalidRequestError(f"line {number}: multi-stage builds (a second FROM) are not supported")
            builder = from_(value.split()[0])
            continue
        if builder is None:
            raise InvalidRequestError(f"line {number}: {keyword} before FROM")
        if keyword == "RUN":
            builder = builder.run(_json_or_shell(value))
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(value)
            flags = [w for w in words if w.startswith("--")]
            if any(not f.startswith("--chown=") for f in flags):
                raise InvalidRequestError(f"line {number}: {keyword} flags {flags} are not supported")
            owner = flags[-1].partition("=")[2] if flags else None
            paths = [w for w in words if not w.startswith("--")]
            if len(paths) < 2:
                raise InvalidRequestError(f"line {number}: {keyword} needs a source and a destination")
            *sources, dest = paths
            for source in sources:
                local = (context / source).resolve()
                if not local.is_relative_to(context.resolve()):
                    raise InvalidRequestError(f"line {number}: {source!r} lies outside the build context {context}")
                if len(sources) > 1 and not dest.endswith("/"):
                    dest += "/"
                target = dest if not (local.is_file() and dest.endswith("/")) else dest + local.name
                if keyword == "ADD" and local.is_file() and tarfile.is_tarfile(local):
                    builder = builder.add(local, target)
                else:
                    builder = builder.copy(local, target, owner=owner)
        elif keyword == "ENV":
            builder = builder.env(_pairs(value, number, keyword))
        elif keyword == "LABEL":
            builder = builder.label(_pairs(value, number, keyword))
        elif keyword == "WORKDIR":
            builder = builder.workdir(value)
        elif keyword == "USER":
            builder = builder.user(value)
        elif keyword == "CMD":
            builder = builder.cmd(_json_or_shell(value))
        elif keyword == "ENTRYPOINT":
            builder = builder.entrypoint(_json_or_shell(value))
        elif keyword in IGNORED:
            continue
        else:
            raise InvalidRequestError(f"line {number}: Dockerfile instruction {keyword} is not supported")
    if builder is None:
        raise InvalidRequestError("the Dockerfile has no FROM")
    return builder
