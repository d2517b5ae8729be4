"""The image store: content-addressed layers, the blobs they came from, and named images over them.

Layout under the store root (SHOAL_IMAGES; may be shared by several nodes):
    blobs/sha256/<hex>        blobs by digest: layer archives as fetched (gzip or plain tar), configs
    layers/<hex>/             one layer, keyed by its diff_id (sha256 of the uncompressed tar):
        layer.json            {"diff_id", "blob", "media_type", "size", "format"}; written last
        fs.erofs | fs/        the layer in overlay form: an EROFS image, or a plain directory
    images/<quoted name>.json {"name", "layers": [diff_id, ... top], "config": {...}, "oci_config": {...}}
    cache/<hex>               build cache: step key → diff_id
    partial/<digest>[.lock]   interrupted registry downloads, resumed by the next pull
    tmp/<pid>-<random>/       staging; a layer appears under layers/ only by one atomic rename
    .gc.lock                  shared by imports/pulls/builds in progress, exclusive for a full prune
A layer is never written after it is committed, so every sandbox on the machine mounts the same one.
A node holds a shared flock on `layers/<hex>/layer.json` while any sandbox uses the layer; GC skips
layers it cannot lock exclusively, so no node removes what another node's sandboxes have mounted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from shoal.errors import ImageError, ImageNotFoundError
from shoal.images import erofs, tarfs

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about how to run in it (the OCI config subset shoal honours)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "0:0"
    cmd: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh"])
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        """From an OCI/Docker image config's `config` object."""
        env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
        return cls(
            env=env,
            workdir=config.get("WorkingDir") or "/",
            user=config.get("User") or "0:0",
            cmd=list(config.get("Cmd") or []),
            entrypoint=list(config.get("Entrypoint") or []),
            labels=dict(config.get("Labels") or {}),
        )

    def to_oci(self) -> dict[str, Any]:
        out: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in self.env.items()], "WorkingDir": self.workdir}
        if self.user:
            out["User"] = self.user
        if self.cmd:
            out["Cmd"] = self.cmd
        if self.entrypoint:
            out["Entrypoint"] = self.entrypoint
        if self.labels:
            out["Labels"] = self.labels
        return out


@dataclass(frozen=True)
class Image:
    """A resolved image: its name, layers (bottom first) and config.

    `layers` are the store's layer directories; a node turns them into overlay lowers with
    `LayerMounts` (EROFS mounts or `fs/` directories) before handing the image to a substrate, which
    receives `layers` as ready-to-stack directories.
    """

    name: str
    layers: tuple[Path, ...]
    config: ImageConfig
    layer_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerInfo:
    diff_id: str
    blob: str
    media_type: str
    size: int
    format: str


Builder = Callable[[Path], ImageConfig]


RECIPE_LABEL = "org.shoal.builtin.recipe"  # the digest of the recipe a builtin image was built from


def _digest(recipe: str) -> str:
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _hex(digest: str) -> str:
    algo, _, value = digest.partition(":")
    if algo != "sha256" or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ImageError(f"bad digest {digest!r}: expected sha256:<64 lowercase hex digits>")
    return value


def _record_name(name: str) -> str:
    if not name or name.startswith(".") or len(name) > 200:
        raise ImageNotFoundError(f"invalid image name {name!r}")
    return urllib.parse.quote(name, safe="") + ".json"


class ImageStore:
    """Named images over content-addressed layers. Safe for concurrent writers (renames and file locks)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs_dir = root / "blobs" / "sha256"
        self.layers_dir = root / "layers"
        self.images_dir = root / "images"
        self.cache_dir = root / "cache"
        self.tmp_dir = root / "tmp"
        self._builtins: dict[str, Builder] = {}
        self._recipes: dict[str, str] = {}
        self._resolved: dict[str, tuple[tuple[int, int, int], Image]] = {}  # get(): name -> (record stamp, image)

    # ---------------------------------------------------------------- names

    def register_builtin(self, name: str, builder: Builder, recipe: str = "") -> None:
        """Make `name` buildable on first use by `builder(rootfs_dir) -> ImageConfig`. With a `recipe` (what
        the builder makes, e.g. its package list), an image built from another recipe is stale: `ensure` and
        `build` make it again (a host that built it before the recipe changed gets the new one)."""
        self._builtins[name] = builder
        if recipe:
            self._recipes[name] = recipe

    def _stale(self, name: str, image: Image) -> bool:
        recipe = self._recipes.get(name)
        return recipe is not None and image.config.labels.get(RECIPE_LABEL) != _digest(recipe)

    def names(self) -> list[str]:
        """Images present in the store, plus builtins that can be built on demand."""
        return sorted(set(self.present()) | set(self._builtins))

    def present(self) -> list[str]:
        if not self.images_dir.is_dir():
            return []
        return sorted(urllib.parse.unquote(p.name[:-5]) for p in self.images_dir.glob("*.json"))

    def has(self, name: str) -> bool:
        """Is image `name` present (registered, not merely buildable)?"""
        try:  # os.path on a str: asked on every function call, where pathlib's objects cost more than the stat
            return os.path.exists(f"{self.images_dir}/{_record_name(name)}")
        except ImageNotFoundError:  # not a valid name
            return False

    def record(self, name: str) -> dict[str, Any]:
        try:
            return json.loads((self.images_dir / _record_name(name)).read_text())
        except FileNotFoundError:
            hint = (
                f"build it with `shoal image build {name}`"
                if name in self._builtins
                else f"pull, import or build it first; images here: {_some(self.present())}"
            )
            raise ImageNotFoundError(f"image {name!r} is not in {self.root}: {hint}") from None

    def get(self, name: str) -> Image:
        """Resolve a present image; ImageNotFoundError (naming the remedy) if it is not there.

        Every create resolves its image (issue 12: reading and parsing the record and a stat per layer were
        ~5 % of the node's CPU per create): an unchanged record (same inode, mtime and size; a commit or
        import replaces it by rename, a removal unlinks it) answers the image resolved from it before. Layers
        an image record names are never pruned while the record exists."""
        try:
            st = os.stat(self.images_dir / _record_name(name))
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        cached = self._resolved.get(name)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        image = self._get(name)
        if stamp is not None:
            self._resolved[name] = (stamp, image)
        return image

    def _get(self, name: str) -> Image:
        data = self.record(name)
        ids = tuple(data["layers"])
        for diff_id in ids:
            if not self.has_layer(diff_id):
                raise ImageError(f"image {name!r} names layer {diff_id[:19]} which is missing; pull or rebuild it")
        return Image(
            name=name,
            layers=tuple(self.layer_dir(d) for d in ids),
            config=ImageConfig.from_dict(data.get("config", {})),
            layer_ids=ids,
        )

    def ensure(self, name: str) -> Image:
        """Resolve `name`, building it first if it is a builtin that is not present yet."""
        try:
            image = self.get(name)
            if not self._stale(name, image):
                return image
        except ImageNotFoundError:
            if name not in self._builtins:
                raise
        return self.build(name)

    def build(self, name: str, *, force: bool = False) -> Image:
        """Build a builtin image into one layer (under a lock; concurrent callers wait)."""
        if name not in self._builtins:
            raise ImageNotFoundError(f"no builder for image {name!r}; builtins: {sorted(self._builtins)}")
        with self._lock(f"build-{name}"), self.writing():
            if not force:
                try:
                    image = self.get(name)
                    if not self._stale(name, image):
                        return image
                except ImageError:
                    pass
            with self.staging() as staging:
                rootfs = staging / "rootfs"
                rootfs.mkdir()
                config = self._builtins[name](rootfs)
                if name in self._recipes:
                    config.labels[RECIPE_LABEL] = _digest(self._recipes[name])
                diff_id = self.add_layer_dir(rootfs, disposable=True)
            self.commit(name, [diff_id], config)
            return self.get(name)

    def commit(
        self, name: str, layers: list[str], config: ImageConfig, oci_config: dict[str, Any] | None = None
    ) -> None:
        """Register (or replace) image `name` as `layers` (diff_ids, bottom first), atomically."""
        for diff_id in layers:
            if not self.has_layer(diff_id):
                raise ImageError(f"cannot commit image {name!r}: layer {diff_id[:19]} is not in the store")
        self.images_dir.mkdir(parents=True, exist_ok=True)
        record = self.images_dir / _record_name(name)
        data = {"name": name, "layers": layers, "config": asdict(config), "created": time.time()}
        if oci_config is not None:
            data["oci_config"] = oci_config
        tmp = record.with_name(f".{record.name}.{os.getpid()}.{os.urandom(4).hex()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, record)

    def tag(self, source: str, target: str) -> None:
        data = self.record(source)
        self.commit(target, data["layers"], ImageConfig.from_dict(data["config"]), data.get("oci_config"))

    # ---------------------------------------------------------------- layers

    def layer_dir(self, diff_id: str) -> Path:
        return self.layers_dir / _hex(diff_id)

    def has_layer(self, diff_id: str) -> bool:
        return (self.layer_dir(diff_id) / "layer.json").exists()

    def layer_info(self, diff_id: str) -> LayerInfo:
        try:
            return LayerInfo(**json.loads((self.layer_dir(diff_id) / "layer.json").read_text()))
        except FileNotFoundError:
            raise ImageError(f"layer {diff_id[:19]} is not in the store; pull or rebuild the image") from None

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """A private scratch directory on the store's filesystem, removed afterwards whatever happens."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        path = self.tmp_dir / f"{os.getpid()}-{os.urandom(6).hex()}"
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def add_blob(self, source: IO[bytes], expect: str | None = None) -> tuple[str, int]:
        """Copy a stream into the blob store, verifying `expect` if given; returns (digest, size)."""
        with self.staging() as staging:
            tmp = staging / "blob"
            reader = tarfs.HashingReader(source)
            with _disk_errors("writing a blob"), open(tmp, "wb") as out:
                while chunk := reader.read(_CHUNK):
                    out.write(chunk)
            digest = reader.digest
            if expect is not None and digest != expect:
                raise ImageError(
                    f"digest mismatch: expected {expect}, the content hashes to {digest}; the source is corrupt"
                )
            return self.adopt_blob(tmp, digest), reader.size

    def adopt_blob(self, path: Path, digest: str) -> str:
        """Move a verified file into the blob store under `digest`."""
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        os.replace(path, self.blobs_dir / _hex(digest))
        return digest

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / _hex(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def add_layer_blob(self, digest: str, media_type: str, expect_diff_id: str | None = None) -> str:
        """Unpack a blob already in the store into a committed layer; returns its diff_id."""
        if expect_diff_id is not None and self.has_layer(expect_diff_id):
            return expect_diff_id
        with self.staging() as staging, open(self.blob_path(digest), "rb") as raw:
            plain = tarfs.HashingReader(tarfs.plain_stream(raw, media_type))
            with _disk_errors("unpacking a layer"):
                tarfs.unpack(plain, staging / "fs")  # type: ignore[arg-type]
                plain.drain()
            diff_id = plain.digest
            if expect_diff_id is not None and diff_id != expect_diff_id:
                raise ImageError(
                    f"layer {digest[:19]} unpacks to {diff_id[:19]}, but the image config says {expect_diff_id[:19]}; "
                    "the image is corrupt"
                )
            size = self.blob_path(digest).stat().st_size
            return self._commit_layer(staging, LayerInfo(diff_id, digest, media_type, size, ""))

    def add_layer_tar(self, source: IO[bytes], media_type: str = LAYER_TAR, expect: str | None = None) -> str:
        """Store a layer archive stream (verifying its digest) and unpack it; returns the diff_id."""
        digest, _ = self.add_blob(source, expect)
        return self.add_layer_blob(digest, media_type)

    def add_layer_dir(self, source: Path, *, disposable: bool = False) -> str:
        """Commit a directory in overlay form as a layer: packed to a tar blob, then moved or unpacked."""
        with self.staging() as staging:
            tar_path = staging / "layer.tar"
            with _disk_errors("packing a layer"), open(tar_path, "wb") as out:
                hashing = _HashingWriter(out)
                tarfs.pack(source, hashing)  # type: ignore[arg-type]
            digest = hashing.digest
            size = tar_path.stat().st_size
            if self.has_layer(digest):
                return digest
            self.adopt_blob(tar_path, digest)
            if disposable:
                os.rename(source, staging / "fs")
            else:
                with open(self.blob_path(digest), "rb") as raw, _disk_errors("unpacking a layer"):
                    tarfs.unpack(raw, staging / "fs")
            return self._commit_layer(staging, LayerInfo(digest, digest, LAYER_TAR, size, ""))

    def add_layer_image(self, staging: Path) -> str:
        """Commit `staging/fs.erofs` (made by `erofs.mkfs` from an overlay upper dir) as a layer; its tar
        blob is packed from the mounted image, so the two always hold the same content."""
        mountpoint = staging / "mnt"
        mountpoint.mkdir()
        erofs.mount_image(staging / "fs.erofs", mountpoint)
        try:
            with _disk_errors("packing a layer"), open(staging / "layer.tar", "wb") as out:
                hashing = _HashingWriter(out)
                tarfs.pack(mountpoint, hashing)  # type: ignore[arg-type]
        finally:
            erofs.unmount_quietly(mountpoint)
        digest = hashing.digest
        if self.has_layer(digest):
            return digest
        size = (staging / "layer.tar").stat().st_size
        self.adopt_blob(staging / "layer.tar", digest)
        return self._commit_layer(staging, LayerInfo(digest, digest, LAYER_TAR, size, ""))

    def _commit_layer(self, staging: Path, info: LayerInfo) -> str:
        final = self.layer_dir(info.diff_id)
        if (final / "layer.json").exists():
            return info.diff_id
        if (staging / "fs").exists() and erofs.supported():
            erofs.mkfs(staging / "fs", staging / "fs.erofs")
            shutil.rmtree(staging / "fs")
        fmt = "erofs" if (staging / "fs.erofs").exists() else "dir"
        layer = staging / "layer"
        layer.mkdir()
        for part in ("fs", "fs.erofs"):
            if (staging / part).exists():
                os.rename(staging / part, layer / part)
        (layer / "layer.json").write_text(json.dumps(asdict(LayerInfo(**{**asdict(info), "format": fmt}))))
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(layer, final)
        except OSError:  # another writer committed the same layer first: theirs is identical
            if not (final / "layer.json").exists():
                raise
        return info.diff_id

    def squash(self, name: str, target: str) -> Image:
        """Register `target` as image `name` flattened into one layer (same files, same config)."""
        data = self.record(name)
        with self.writing(), self.staging() as staging:
            tree = staging / "tree"
            for diff_id in data["layers"]:
                info = self.layer_info(diff_id)
                if not self.has_blob(info.blob):
                    raise ImageError(f"layer {diff_id[:19]} has no stored archive; pull the image again to squash it")
                with open(self.blob_path(info.blob), "rb") as raw, _disk_errors("squashing layers"):
                    tarfs.unpack(tarfs.plain_stream(raw, info.media_type), tree, apply=True)
            diff_id = self.add_layer_dir(tree, disposable=True)
            self.commit(target, [diff_id], ImageConfig.from_dict(data["config"]), data.get("oci_config"))
        return self.get(target)

    # ---------------------------------------------------------------- build cache

    def cache_get(self, key: str) -> str | None:
        try:
            diff_id = (self.cache_dir / hashlib.sha256(key.encode()).hexdigest()).read_text().strip()
        except FileNotFoundError:
            return None
        return diff_id if self.has_layer(diff_id) else None

    def cache_put(self, key: str, diff_id: str) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / hashlib.sha256(key.encode()).hexdigest()
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(diff_id)
        os.replace(tmp, path)

    # ---------------------------------------------------------------- inspection and garbage collection

    def inspect(self, name: str) -> dict[str, Any]:
        data = self.record(name)
        layers = [asdict(self.layer_info(d)) for d in data["layers"]]
        return {"name": name, "layers": layers, "config": data["config"], "created": data.get("created")}

    def remove(self, name: str) -> dict[str, Any]:
        """Forget image `name`, then remove its layers that nothing else uses."""
        data = self.record(name)
        (self.images_dir / _record_name(name)).unlink(missing_ok=True)
        return self.prune(only=set(data["layers"]))

    def prune(self, only: set[str] | None = None) -> dict[str, Any]:
        """Remove layers no image references and no sandbox (of any node) has mounted, and their blobs.

        A full prune first waits for imports, pulls and builds in progress (they hold `writing()`), whose
        new layers no image references yet.
        """
        if only is None:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / ".gc.lock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                return self._prune(None)
        return self._prune(only)

    def _prune(self, only: set[str] | None) -> dict[str, Any]:
        referenced: set[str] = set()
        for name in self.present():
            try:
                data = self.record(name)
            except ImageError:
                continue
            referenced.update(data["layers"])
        removed, kept_in_use, freed = [], [], 0
        candidates = [f"sha256:{p.name}" for p in self.layers_dir.iterdir()] if self.layers_dir.is_dir() else []
        for diff_id in candidates:
            if diff_id in referenced or (only is not None and diff_id not in only):
                continue
            directory = self.layer_dir(diff_id)
            try:
                fd = os.open(directory / "layer.json", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    kept_in_use.append(diff_id)
                    continue
                info = self.layer_info(diff_id)
                freed += _du(directory)
                trash = self.tmp_dir / f"{os.getpid()}-gc-{os.urandom(4).hex()}"
                self.tmp_dir.mkdir(parents=True, exist_ok=True)
                os.rename(directory, trash)
            finally:
                os.close(fd)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(diff_id)
            if self.has_blob(info.blob):
                freed += self.blob_path(info.blob).stat().st_size
                self.blob_path(info.blob).unlink(missing_ok=True)
        freed += self._remove_stale_staging()
        if only is None:
            freed += self._remove_partial_downloads()
        if only is None and self.cache_dir.is_dir():  # build cache entries whose layer is gone
            for entry in self.cache_dir.iterdir():
                try:
                    if not self.has_layer(entry.read_text().strip()):
                        entry.unlink()
                except (OSError, ImageError):
                    entry.unlink(missing_ok=True)
        return {"removed_layers": removed, "in_use": kept_in_use, "freed_bytes": freed}

    def _remove_partial_downloads(self) -> int:
        """Interrupted downloads nobody is resuming right now (their lock is free)."""
        freed = 0
        partial_dir = self.root / "partial"
        for lock_path in partial_dir.glob("*.lock") if partial_dir.is_dir() else []:
            with open(lock_path, "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                data = lock_path.with_suffix("")
                if data.exists():
                    freed += data.stat().st_size
                    data.unlink()
                lock_path.unlink()
        return freed

    def _remove_stale_staging(self) -> int:
        freed = 0
        if not self.tmp_dir.is_dir():
            return 0
        for entry in self.tmp_dir.iterdir():
            pid = entry.name.partition("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                freed += _du(entry)
                shutil.rmtree(entry, ignore_errors=True)
        return freed

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold while adding layers that no image references yet: a full `prune` waits for it to end."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".gc.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            yield

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{urllib.parse.quote(name, safe='')}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


class _HashingWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.out.write(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


@contextmanager
def _disk_errors(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in (28, 122):  # ENOSPC, EDQUOT
            raise ImageError(
                f"disk full while {what}: free space under the image store (try `shoal image prune`)"
            ) from exc
        raise


def _some(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more (`shoal image ls`)" if len(names) > limit else ""
    )


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
