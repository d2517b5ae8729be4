"""A fluent image builder: `shoal.Image.from_("debian").apt_install("git").run("...").copy("./src", "/work")`.

The builder only records steps; `client.build_image(name, builder)` sends them to the node, which runs each
RUN in a sandbox and commits its writes as one layer (COPY becomes a layer straight from the files sent),
cached by the step and everything before it. Config steps (env, workdir, user, cmd, entrypoint, label)
change the image's config and the cache keys of later steps, but add no layer.
"""

from __future__ import annotations

import io
import os
import shlex
import tarfile
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequestError


class ImageBuilder:
    """Steps over a base image. Every method returns a new builder, so partial builders can be shared."""

    def __init__(self, base: str = "scratch", steps: tuple[dict[str, Any], ...] = ()) -> None:
        self.base = base
        self.steps = steps

    @classmethod
    def from_(cls, base: str) -> ImageBuilder:
        return cls(base)

    @classmethod
    def from_dockerfile(
        cls, path: str | os.PathLike[str], context: str | os.PathLike[str] | None = None
    ) -> ImageBuilder:
        from shoal.client.dockerfile import parse

        file = Path(path)
        return parse(file.read_text(), Path(context) if context is not None else file.parent, cls.from_)

    def _with(self, step: dict[str, Any]) -> ImageBuilder:
        return ImageBuilder(self.base, (*self.steps, step))

    def run(self, *commands: str | list[str], timeout: float | None = None) -> ImageBuilder:
        """Run each command (a shell string or an argv list) in its own step."""
        builder = self
        for command in commands:
            step: dict[str, Any] = {"op": "run", "cmd": command}
            if timeout is not None:
                step["timeout"] = timeout
            builder = builder._with(step)
        return builder

    def apt_install(self, *packages: str) -> ImageBuilder:
        names = " ".join(shlex.quote(p) for p in packages)
        return self.run(
            "export DEBIAN_FRONTEND=noninteractive && apt-get update -qq && "
            f"apt-get install -y -qq --no-install-recommends {names} && rm -rf /var/lib/apt/lists/*"
        )

    def pip_install(self, *packages: str) -> ImageBuilder:
        names = " ".join(shlex.quote(p) for p in packages)
        return self.run(f"PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir {names}")

    def copy(
        self, source: str | os.PathLike[str], dest: str, *, mode: int | None = None, owner: str | None = None
    ) -> ImageBuilder:
        """Copy a local file or directory to `dest` in the image (read now, when the step is added).

        Files are owned by root unless `owner` gives a numeric `uid[:gid]`."""
        return self._with({"op": "copy", "dest": dest, "tar": _tar_of(Path(source), dest, mode, _owner(owner))})

    def add(self, source: str | os.PathLike[str], dest: str) -> ImageBuilder:
        """Like `copy`, but a local tar archive is unpacked at `dest`."""
        path = Path(source)
        if path.is_file() and tarfile.is_tarfile(path):
            return self._with({"op": "copy", "dest": dest, "tar": _retarget(path, dest)})
        return self.copy(path, dest)

    def copy_from(self, stage: ImageBuilder | str, source: str, dest: str, *, owner: str | None = None) -> ImageBuilder:
        """Copy `source` out of another image (a builder: built first, as a multi-stage build's stage) to
        `dest`. Resolved by `client.build_image`, which builds the stage, reads `source` from a sandbox of
        it, and sends the files as a COPY layer (a directory's contents go below `dest`, as in Docker)."""
        stage = stage if isinstance(stage, ImageBuilder) else ImageBuilder(stage)
        _clean_dest(dest)
        return self._with({"op": "copy_from", "stage": stage, "src": source, "dest": dest, "owner": _owner(owner)})

    def env(self, values: dict[str, str] | None = None, *, expand: bool = False, **more: str) -> ImageBuilder:
        """Set environment variables. With `expand`, the node replaces `$NAME` references in the values
        with the image's environment so far (what `ENV PATH $PATH:/x` needs: the base image's PATH)."""
        return self._with({"op": "env", "value": {**(values or {}), **more}, **({"expand": True} if expand else {})})

    def label(self, values: dict[str, str] | None = None, **more: str) -> ImageBuilder:
        return self._with({"op": "label", "value": {**(values or {}), **more}})

    def workdir(self, path: str, *, expand: bool = False) -> ImageBuilder:
        return self._with({"op": "workdir", "value": path, **({"expand": True} if expand else {})})

    def user(self, user: str, *, expand: bool = False) -> ImageBuilder:
        return self._with({"op": "user", "value": user, **({"expand": True} if expand else {})})

    def cmd(self, command: str | list[str]) -> ImageBuilder:
        return self._with({"op": "cmd", "value": command})

    def entrypoint(self, command: str | list[str]) -> ImageBuilder:
        return self._with({"op": "entrypoint", "value": command})

    def __repr__(self) -> str:
        return f"<ImageBuilder from {self.base!r}, {len(self.steps)} steps>"


def _clean_dest(dest: str) -> str:
    if not dest.startswith("/"):
        raise InvalidRequestError(f"copy destination {dest!r} must be an absolute path in the image")
    return dest.strip("/")


def _owner(owner: str | None) -> tuple[int, int]:
    if owner is None:
        return 0, 0
    uid, _, gid = owner.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise InvalidRequestError(f"owner {owner!r}: give a numeric uid[:gid] (names need the image's passwd)")
    return int(uid), int(gid or uid)


def _tar_of(source: Path, dest: str, mode: int | None, owner: tuple[int, int] = (0, 0)) -> bytes:
    """A layer tar of `source` placed at `dest` (a directory's contents go below `dest`), owned by `owner`."""
    if not source.exists():
        raise InvalidRequestError(f"copy source {source} does not exist")
    base = _clean_dest(dest)
    buffer = io.BytesIO()

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid = owner
        info.uname = info.gname = ""
        if mode is not None and info.isreg():
            info.mode = mode
        return info

    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                archive.add(str(path), arcname=f"{base}/{path.relative_to(source).as_posix()}", recursive=False,
                            filter=owned_by_root)  # fmt: skip
        else:
            target = base if not dest.endswith("/") else f"{base}/{source.name}"
            archive.add(str(source), arcname=target, filter=owned_by_root)
    return buffer.getvalue()


def _retarget(archive_path: Path, dest: str) -> bytes:
    base = _clean_dest(dest)
    buffer = io.BytesIO()
    with tarfile.open(archive_path) as source, tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out:
        for member in source:
            name = member.name.removeprefix("./").strip("/")
            member.name = f"{base}/{name}" if name else base
            if member.islnk():
                member.linkname = f"{base}/{member.linkname.removeprefix('./')}"
            out.addfile(member, source.extractfile(member) if member.isreg() else None)
    return buffer.getvalue()


def placed(archive: bytes, dest: str, *, directory: bool, owner: tuple[int, int]) -> bytes:
    """Re-root a tar read out of a stage (members relative to the copied directory, or one file) at `dest`,
    owned by `owner`: the layer a `COPY --from` adds."""
    base = _clean_dest(dest)
    buffer = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(archive)) as source,
        tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out,
    ):
        for member in source:
            name = member.name.removeprefix("./").strip("/")
            if directory:
                member.name = f"{base}/{name}" if name else base
            else:
                member.name = f"{base}/{name}" if dest.endswith("/") else base
            if member.islnk():
                member.linkname = f"{base}/{member.linkname.removeprefix('./')}" if directory else member.name
            member.uid, member.gid = owner
            member.uname = member.gname = ""
            out.addfile(member, source.extractfile(member) if member.isreg() else None)
    return buffer.getvalue()
