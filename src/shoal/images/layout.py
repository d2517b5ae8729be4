"""OCI image layouts (a directory or its tar) and `docker save` archives: import into and export from the store.

Every blob read from an archive is verified against its digest before use; a layer's unpacked content
is verified against the config's `rootfs.diff_ids`.
"""

from __future__ import annotations

import io
import json
import os
import platform
import tarfile
from pathlib import Path
from typing import IO, Any

from shoal.errors import ImageError
from shoal.images.store import LAYER_GZIP, LAYER_TAR, ImageConfig, ImageStore

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_INDEX = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
REF_NAME = "org.opencontainers.image.ref.name"
INDEX_TYPES = (INDEX, DOCKER_INDEX)


def host_platform() -> tuple[str, str]:
    machine = platform.machine()
    return "linux", {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class _Source:
    """Files of an archive: a directory or a tar file (read by member)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            if path.is_dir():
                return
            if not path.exists():
                raise ImageError(f"no archive at {path}")
            self.tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by close()
            self.members = {m.name.removeprefix("./"): m for m in self.tar.getmembers() if m.isreg()}
        except (tarfile.TarError, EOFError) as exc:
            raise ImageError(f"{path} is not a readable tar archive ({exc}); export the image again") from exc
        except OSError as exc:  # a name too long, a directory in the way, no permission: the path is bad
            raise ImageError(f"cannot read an archive at {str(path)[:200]} ({exc.strerror}); give its path") from exc

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file() if self.tar is None else name in self.members

    def open(self, name: str) -> IO[bytes]:
        if self.tar is None:
            try:
                return open(self.path / name, "rb")
            except FileNotFoundError:
                raise ImageError(f"archive {self.path} lacks {name}: it is incomplete") from None
        member = self.members.get(name)
        if member is None:
            raise ImageError(f"archive {self.path} lacks {name}: it is incomplete")
        handle = self.tar.extractfile(member)
        assert handle is not None
        return handle

    def read_json(self, name: str, digest: str | None = None) -> tuple[Any, bytes]:
        with self.open(name) as handle:
            raw = handle.read()
        if digest is not None:
            import hashlib

            actual = "sha256:" + hashlib.sha256(raw).hexdigest()
            if actual != digest:
                raise ImageError(f"digest mismatch for {name}: expected {digest}, content hashes to {actual}")
        try:
            return json.loads(raw), raw
        except ValueError as exc:
            raise ImageError(f"{name} in {self.path} is not valid JSON ({exc})") from exc

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _blob_name(digest: str) -> str:
    algo, _, value = digest.partition(":")
    return f"blobs/{algo}/{value}"


def import_archive(store: ImageStore, path: Path, name: str | None = None) -> list[str]:
    """Import every image in an OCI layout or `docker save` archive; returns the names registered.

    `name` renames the image (the archive must then hold exactly one).
    """
    source = _Source(path)
    try:
        if source.exists("index.json") and source.exists("oci-layout"):
            with store.writing():
                return _import_oci(store, source, name)
        if source.exists("manifest.json"):
            with store.writing():
                return _import_docker(store, source, name)
        raise ImageError(f"{path} is neither an OCI image layout (index.json, oci-layout) nor a `docker save` archive")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ImageError(f"{path}: malformed image metadata (missing or bad field {exc}); export it again") from exc
    finally:
        source.close()


def _select(store: ImageStore, source: _Source, descriptor: dict[str, Any]) -> dict[str, Any]:
    """Follow an index to the manifest for this host's platform."""
    media = descriptor.get("mediaType", MANIFEST)
    if media not in INDEX_TYPES:
        return descriptor
    index, _ = source.read_json(_blob_name(descriptor["digest"]), descriptor["digest"])
    return _select(store, source, pick_platform(index))


def pick_platform(index: dict[str, Any], wanted: tuple[str, str] | None = None) -> dict[str, Any]:
    """The manifest descriptor of an index that matches `wanted` (default: this host)."""
    os_name, arch = wanted or host_platform()
    entries = index.get("manifests") or []
    for entry in entries:
        plat = entry.get("platform") or {}
        if plat.get("os") == os_name and plat.get("architecture") == arch:
            return entry
    if len(entries) == 1 and not entries[0].get("platform"):
        return entries[0]
    found = [f"{(e.get('platform') or {}).get('os')}/{(e.get('platform') or {}).get('architecture')}" for e in entries]
    raise ImageError(f"the image has no {os_name}/{arch} variant (it has: {', '.join(found) or 'none'})")


def _import_oci(store: ImageStore, source: _Source, name: str | None) -> list[str]:
    index, _ = source.read_json("index.json")
    entries = index.get("manifests") or []
    if not entries:
        raise ImageError(f"{source.path}: index.json lists no images")
    if name is not None and len(entries) > 1:
        raise ImageError(f"{source.path} holds {len(entries)} images; import it without a name to keep theirs")
    names = []
    for entry in entries:
        annotations = entry.get("annotations") or {}
        ref = name or annotations.get("io.containerd.image.name") or annotations.get(REF_NAME)
        if not ref:
            raise ImageError(f"{source.path}: an image has no {REF_NAME} annotation; give a name to import it as")
        descriptor = _select(store, source, entry)
        manifest, _ = source.read_json(_blob_name(descriptor["digest"]), descriptor["digest"])
        config_desc = manifest["config"]
        config, raw_config = source.read_json(_blob_name(config_desc["digest"]), config_desc["digest"])
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        layers = manifest.get("layers") or []
        if len(diff_ids) != len(layers):
            raise ImageError(
                f"image {ref!r}: manifest has {len(layers)} layers but config lists {len(diff_ids)} diff_ids"
            )
        for layer, diff_id in zip(layers, diff_ids, strict=True):
            if store.has_layer(diff_id):
                continue
            with source.open(_blob_name(layer["digest"])) as handle:
                digest, _ = store.add_blob(handle, expect=layer["digest"])
            store.add_layer_blob(digest, layer.get("mediaType", LAYER_GZIP), expect_diff_id=diff_id)
        store.commit(ref, list(diff_ids), ImageConfig.from_oci(config.get("config") or {}), oci_config=config)
        names.append(ref)
    return names


def _import_docker(store: ImageStore, source: _Source, name: str | None) -> list[str]:
    entries, _ = source.read_json("manifest.json")
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{source.path}: manifest.json lists no images")
    if name is not None and len(entries) > 1:
        raise ImageError(f"{source.path} holds {len(entries)} images; import it without a name to keep theirs")
    names = []
    for entry in entries:
        config_file = entry["Config"]
        stem = config_file.rpartition("/")[2].removesuffix(".json")
        expect = f"sha256:{stem}" if len(stem) == 64 else None
        config, _ = source.read_json(config_file, expect)
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(entry["Layers"]):
            raise ImageError(f"{source.path}: {len(entry['Layers'])} layer files but {len(diff_ids)} diff_ids")
        for layer_file, diff_id in zip(entry["Layers"], diff_ids, strict=True):
            if store.has_layer(diff_id):
                continue
            with source.open(layer_file) as handle:
                magic = handle.read(2)
                handle.seek(0)
                digest, _ = store.add_blob(handle)
            media = LAYER_GZIP if magic == b"\x1f\x8b" else LAYER_TAR
            store.add_layer_blob(digest, media, expect_diff_id=diff_id)
        tags = entry.get("RepoTags") or []
        ref = name or (tags[0] if tags else None)
        if not ref:
            raise ImageError(f"{source.path}: an image has no RepoTags; give a name to import it as")
        store.commit(ref, list(diff_ids), ImageConfig.from_oci(config.get("config") or {}), oci_config=config)
        names.append(ref)
    return names


# ---------------------------------------------------------------------------- export


def image_config_json(store: ImageStore, name: str) -> bytes:
    """The OCI config blob of a stored image (the imported one, updated with shoal's config and layers)."""
    data = store.record(name)
    base = dict(data.get("oci_config") or {})
    os_name, arch = host_platform()
    base.setdefault("architecture", arch)
    base.setdefault("os", os_name)
    base["config"] = {**(base.get("config") or {}), **ImageConfig.from_dict(data["config"]).to_oci()}
    base["rootfs"] = {"type": "layers", "diff_ids": list(data["layers"])}
    return canonical(base)


def manifest_json(store: ImageStore, name: str, config: bytes) -> bytes:
    import hashlib

    layers = []
    for diff_id in store.record(name)["layers"]:
        info = store.layer_info(diff_id)
        layers.append({"mediaType": info.media_type, "digest": info.blob, "size": info.size})
    return canonical(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {
                "mediaType": CONFIG,
                "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                "size": len(config),
            },
            "layers": layers,
        }
    )


def export_archive(store: ImageStore, name: str, path: Path) -> str:
    """Write image `name` as an OCI image layout: a directory, or a tar if `path` ends in .tar.

    Returns the manifest digest."""
    import hashlib

    config = image_config_json(store, name)
    manifest = manifest_json(store, name, config)
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    tag = name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else name
    index = canonical(
        {
            "schemaVersion": 2,
            "mediaType": INDEX,
            "manifests": [
                {
                    "mediaType": MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {REF_NAME: tag},
                }
            ],
        }
    )
    files: list[tuple[str, bytes | Path]] = [
        ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
        ("index.json", index),
        (_blob_name("sha256:" + hashlib.sha256(config).hexdigest()), config),
        (_blob_name(manifest_digest), manifest),
    ]
    for diff_id in store.record(name)["layers"]:
        info = store.layer_info(diff_id)
        if not store.has_blob(info.blob):
            raise ImageError(
                f"layer {diff_id[:19]} has no stored archive (blob {info.blob[:19]}); pull the image again"
            )
        files.append((_blob_name(info.blob), store.blob_path(info.blob)))
    if path.suffix == ".tar":
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as archive:
            for member, content in files:
                if isinstance(content, Path):
                    archive.add(str(content), arcname=member)
                else:
                    info = tarfile.TarInfo(member)
                    info.size = len(content)
                    archive.addfile(info, io.BytesIO(content))
        os.replace(tmp, path)
    else:
        for member, content in files:
            target = path / member
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                try:
                    os.link(content, target)
                except OSError:
                    import shutil

                    shutil.copyfile(content, target)
            else:
                target.write_bytes(content)
    return manifest_digest
