"""A Dockerfile → `ImageBuilder`: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, SHELL, CMD, ENTRYPOINT, LABEL.

Multi-stage: `FROM <stage>` continues an earlier stage, `COPY --from=<stage name, index or image>` becomes
an `ImageBuilder.copy_from` step (the client builds that stage when it builds this one). Variables follow Docker:
ARG (also before FROM) and ENV values are expanded (`$NAME`, `${NAME}`, `${NAME:-default}`) in FROM, ENV,
COPY/ADD, WORKDIR, USER and LABEL; ARG values also in RUN. A reference the file does not define (the base
image's `$PATH`) is kept and expanded by the node against the image's environment (shoal.shellvars).
`FROM --platform=os/arch` is accepted; the node pulls or builds for its own platform, so a different
architecture only warns. `RUN <<EOF` and `COPY <<EOF /path` heredocs work as in BuildKit. SHELL changes
how later shell-form RUN, CMD and ENTRYPOINT are run. EXPOSE, VOLUME, STOPSIGNAL and HEALTHCHECK are
accepted and ignored (they do not apply to sandboxes). Anything else is an error naming the line.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import tarfile
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal import shellvars
from shoal.errors import InvalidRequestError

IGNORED = {"EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER", "ONBUILD"}
_HEREDOC = re.compile(r"(?<!<)<<(-?)([\"']?)([A-Za-z_]\w*)\2")  # not `<<<` here-strings nor `1<<2`
_HEREDOC_KEYWORDS = ("RUN", "COPY", "ADD")
_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def _lines(text: str) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """Logical lines: (first line number, text with continuations joined, [(heredoc word, body)])."""
    out: list[tuple[int, str, list[tuple[str, str]]]] = []
    raw_lines = text.splitlines()
    buffer, start, index = "", 0, 0
    while index < len(raw_lines):
        number, line = index + 1, raw_lines[index].strip()
        index += 1
        if (not line or line.startswith("#")) and not buffer:
            continue
        if buffer and line.startswith("#"):
            continue
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical, buffer = buffer + line, ""
        docs: list[tuple[str, str]] = []
        if logical.partition(" ")[0].upper() in _HEREDOC_KEYWORDS:
            for match in _HEREDOC.finditer(logical):
                strip_tabs, word = match.group(1) == "-", match.group(3)
                body: list[str] = []
                while index < len(raw_lines):
                    row = raw_lines[index]
                    index += 1
                    if (row.lstrip("\t") if strip_tabs else row) == word:
                        break
                    body.append(row.lstrip("\t") if strip_tabs else row)
                else:
                    raise InvalidRequestError(f"line {start}: heredoc <<{word} is never closed by a line {word!r}")
                docs.append((match.group(0), "\n".join(body) + "\n"))
        out.append((start, logical, docs))
    if buffer:
        out.append((start, buffer, []))
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


def _pairs(value: str, number: int, keyword: str, known: dict[str, str]) -> tuple[dict[str, str], bool]:
    """KEY=value pairs (or the legacy `KEY value with spaces`), expanded with `known`; and whether
    references to variables the file does not define remain (the node resolves those)."""
    words = shlex.split(value)
    if words and "=" not in words[0]:  # legacy `ENV KEY value with spaces`
        key, _, rest = value.partition(" ")
        raw = {key: rest.strip()}
    else:
        raw = {}
        for word in words:
            key, eq, item = word.partition("=")
            if not eq:
                raise InvalidRequestError(f"line {number}: {keyword} expects KEY=value, got {word!r}")
            raw[key] = item
    pairs = {k: shellvars.expand(v, known, keep_unknown=True) for k, v in raw.items()}
    return pairs, any(shellvars.references(v) for v in pairs.values())


def _check_platform(wanted: str, number: int) -> None:
    os_name, _, arch = wanted.partition("/")
    here = _ARCHES.get(platform.machine().lower(), platform.machine().lower())
    if os_name != "linux" or _ARCHES.get(arch.split("/")[0].lower(), arch) != here:
        warnings.warn(
            f"line {number}: FROM --platform={wanted} is ignored: the node uses its own platform (linux/{here})",
            stacklevel=3,
        )


def parse(text: str, context: Path, from_: Callable[[str], Any]) -> Any:
    """Parse a Dockerfile into the builder `from_(base)` starts (ImageBuilder.from_, which imports this module);
    COPY/ADD sources are read from `context` now."""
    builder: Any = None
    stages: dict[str, Any] = {}  # name (and index) -> the stage's builder, for FROM <stage> and COPY --from
    stage_names: list[str] = []  # the current stage's index and name
    index = -1
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    deferred: set[str] = set()  # ENV names whose value only the node knows (it refers to the base image's env)
    shell: list[str] | None = None
    for number, line, docs in _lines(text):
        keyword, _, value = line.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        known = {k: v for k, v in {**args, **env}.items() if k not in deferred}
        if keyword == "ARG":
            for word in shlex.split(value):
                name, eq, default = word.partition("=")
                if eq:
                    args[name] = shellvars.expand(default, known, keep_unknown=True)
                else:
                    args.setdefault(name, "")
            continue
        if keyword == "FROM":
            if builder is not None:  # a new stage: the previous one is only reachable by name or index
                stages.update(dict.fromkeys(stage_names, builder))
                env, deferred, shell = {}, set(), None
            words = shellvars.expand(value, known).split()
            for flag in [w for w in words if w.startswith("--")]:
                name, _, wanted = flag.partition("=")
                if name != "--platform":
                    raise InvalidRequestError(f"line {number}: FROM flag {name} is not supported")
                _check_platform(wanted, number)
            image = [w for w in words if not w.startswith("--")]
            if not image or (len(image) > 1 and not (len(image) == 3 and image[1].upper() == "AS")):
                raise InvalidRequestError(f"line {number}: FROM expects `[--platform=P] IMAGE [AS NAME]`")
            builder = stages[image[0]] if image[0] in stages else from_(image[0])
            index += 1
            stage_names = [str(index)]
            stage_names += [image[2].lower()] if len(image) == 3 else []
            continue
        if builder is None:
            raise InvalidRequestError(f"line {number}: {keyword} before FROM")
        if keyword == "RUN":
            run_args = {k: v for k, v in args.items() if k not in env and k not in deferred}  # ENV wins
            command: str | list[str] = _json_or_shell(shellvars.expand(value, run_args, keep_unknown=True))
            if docs and isinstance(command, str):
                if _HEREDOC.fullmatch(command.strip()):  # `RUN <<EOF`: the body is the script
                    command = docs[0][1]
                else:  # `RUN cat <<EOF > f`: the shell reads the heredoc itself
                    command += "".join(f"\n{body}{_HEREDOC.match(word).group(3)}" for word, body in docs)  # type: ignore[union-attr]
            if shell is not None and isinstance(command, str):
                command = [*shell, command]
            builder = builder.run(command)
        elif keyword in ("COPY", "ADD"):
            builder = _copy(builder, keyword, shellvars.expand(value, known), docs, number, context, stages, from_)
        elif keyword == "ENV":
            pairs, unresolved = _pairs(value, number, keyword, known)
            for key, item in pairs.items():  # a later `$KEY` must see the node's value, not this text
                if shellvars.references(item):
                    deferred.add(key)
                    env.pop(key, None)
                else:
                    deferred.discard(key)
                    env[key] = item
            builder = builder.env(pairs, expand=unresolved)
        elif keyword == "LABEL":
            builder = builder.label(_pairs(value, number, keyword, known)[0])
        elif keyword in ("WORKDIR", "USER"):
            expanded = shellvars.expand(value, known, keep_unknown=True)
            step = builder.workdir if keyword == "WORKDIR" else builder.user
            builder = step(expanded, expand=bool(shellvars.references(expanded)))
        elif keyword == "SHELL":
            parsed = _json_or_shell(value)
            if not isinstance(parsed, list) or not parsed:
                raise InvalidRequestError(f'line {number}: SHELL takes a JSON list, e.g. ["/bin/bash", "-c"]')
            shell = parsed
        elif keyword in ("CMD", "ENTRYPOINT"):
            command = _json_or_shell(value)
            if shell is not None and isinstance(command, str):
                command = [*shell, command]
            builder = builder.cmd(command) if keyword == "CMD" else builder.entrypoint(command)
        elif keyword in IGNORED:
            continue
        else:
            raise InvalidRequestError(f"line {number}: Dockerfile instruction {keyword} is not supported")
    if builder is None:
        raise InvalidRequestError("the Dockerfile has no FROM")
    return builder


def _copy(
    builder: Any,
    keyword: str,
    value: str,
    docs: list[tuple[str, str]],
    number: int,
    context: Path,
    stages: dict[str, Any],
    from_: Callable[[str], Any],
) -> Any:
    words = shlex.split(value)
    flags = [w for w in words if w.startswith("--")]
    owner, mode, stage = None, None, None
    for flag in flags:
        name, _, arg = flag.partition("=")
        if name == "--chown":
            owner = arg
        elif name == "--chmod" and re.fullmatch(r"[0-7]{3,4}", arg):
            mode = int(arg, 8)
        elif name == "--from" and keyword == "COPY":
            stage = stages.get(arg.lower()) or from_(arg)  # a stage by name or index, else an image
        elif name != "--link":
            raise InvalidRequestError(f"line {number}: {keyword} flag {name} is not supported")
    paths = [w for w in words if not w.startswith("--")]
    if len(paths) < 2:
        raise InvalidRequestError(f"line {number}: {keyword} needs a source and a destination")
    *sources, dest = paths
    if stage is not None:
        if mode is not None:
            raise InvalidRequestError(f"line {number}: COPY --from with --chmod is not supported")
        if len(sources) > 1 and not dest.endswith("/"):
            dest += "/"
        for source in sources:
            builder = builder.copy_from(stage, source, dest, owner=owner)
        return builder
    inline = dict(docs)
    for source in sources:
        if source in inline:  # `COPY <<EOF /path`: the heredoc is the file
            with tempfile.TemporaryDirectory() as scratch:
                file = Path(scratch) / "heredoc"
                file.write_text(inline[source])
                target = dest if not dest.endswith("/") else dest + _HEREDOC.match(source).group(3)  # type: ignore[union-attr]
                builder = builder.copy(file, target, mode=mode if mode is not None else 0o644, owner=owner)
            continue
        local = (context / source).resolve()
        if not local.is_relative_to(context.resolve()):
            raise InvalidRequestError(f"line {number}: {source!r} lies outside the build context {context}")
        if len(sources) > 1 and not dest.endswith("/"):
            dest += "/"
        target = dest if not (local.is_file() and dest.endswith("/")) else dest + local.name
        if keyword == "ADD" and local.is_file() and tarfile.is_tarfile(local):
            builder = builder.add(local, target)
        else:
            builder = builder.copy(local, target, owner=owner, mode=mode)
    return builder
