"""The image store: named images, each an ordered list of read-only layer directories plus a config.

Layout under the images directory:
    layers/<layer-id>/          one unpacked layer, never written after it is committed
    images/<name>.json          {"name", "layers": [bottom ... top], "config": {...}}
Sandboxes stack an image's layers as overlayfs lowers with a private upper, so creating a sandbox
never copies or unpacks anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.errors import ImageError, ImageNotFoundError


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about how to run in it (the OCI config subset shoal honours)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "0:0"
    cmd: list[str] = field(default_factory=list)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh"])
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Image:
    """A resolved image: its name, layer directories (bottom first) and config."""

    name: str
    layers: tuple[Path, ...]
    config: ImageConfig


Builder = Callable[[Path], ImageConfig]


class ImageStore:
    """Named images over a content directory of layers. Safe for concurrent builders (file locks)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers_dir = root / "layers"
        self.images_dir = root / "images"
        self._builtins: dict[str, Builder] = {}

    def register_builtin(self, name: str, builder: Builder) -> None:
        """Make `name` buildable on first use by `builder(layer_dir) -> ImageConfig`."""
        self._builtins[name] = builder

    def names(self) -> list[str]:
        """Images present in the store, plus builtins that can be built on demand."""
        present = {p.stem for p in self.images_dir.glob("*.json")} if self.images_dir.exists() else set()
        return sorted(present | set(self._builtins))

    def get(self, name: str) -> Image:
        """Resolve a present image; raise ImageNotFoundError (naming the remedy) if it is not built."""
        record = self.images_dir / f"{_safe(name)}.json"
        try:
            data = json.loads(record.read_text())
        except FileNotFoundError:
            hint = (
                f"build it with `shoal image build {name}`"
                if name in self._builtins
                else f"known images: {', '.join(self.names()) or 'none'}"
            )
            raise ImageNotFoundError(f"image {name!r} is not in {self.root}: {hint}") from None
        layers = tuple(self.layers_dir / layer for layer in data["layers"])
        for layer in layers:
            if not layer.is_dir():
                raise ImageError(f"image {name!r} names layer {layer.name} which is missing; rebuild it")
        return Image(name=name, layers=layers, config=ImageConfig(**data.get("config", {})))

    def ensure(self, name: str) -> Image:
        """Resolve `name`, building it first if it is a builtin that is not present yet."""
        try:
            return self.get(name)
        except ImageNotFoundError:
            if name not in self._builtins:
                raise
        self.build(name)
        return self.get(name)

    def build(self, name: str, *, force: bool = False) -> Image:
        """Build a builtin image into one layer (under a lock; concurrent callers wait)."""
        if name not in self._builtins:
            raise ImageNotFoundError(f"no builder for image {name!r}; builtins: {sorted(self._builtins)}")
        with self._lock(name):
            if not force:
                try:
                    return self.get(name)
                except ImageError:
                    pass
            layer_id = f"{_safe(name)}-{os.urandom(6).hex()}"
            staging = self.layers_dir / f".tmp-{layer_id}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            try:
                config = self._builtins[name](staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            staging.rename(self.layers_dir / layer_id)
            self.commit(name, [layer_id], config)
            return self.get(name)

    def commit(self, name: str, layers: list[str], config: ImageConfig) -> None:
        """Register (or replace) image `name` as `layers` (bottom first) with `config`, atomically."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        record = self.images_dir / f"{_safe(name)}.json"
        tmp = record.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"name": name, "layers": layers, "config": asdict(config)}))
        os.replace(tmp, record)

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".build-{_safe(name)}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _safe(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ImageNotFoundError(f"invalid image name {name!r}")
    return name
