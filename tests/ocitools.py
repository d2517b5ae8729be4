"""Test helpers: write real OCI layer tars, OCI image layouts and `docker save` archives from a description."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Entry:
    """One tar entry: kind is file, dir, symlink, hardlink, whiteout (of `name`), opaque (dir `name`), fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    target: str = ""
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, str] = field(default_factory=dict)


def layer_tar(entries: list[Entry]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for e in entries:
            head, _, base = e.name.rpartition("/")
            prefix = f"{head}/" if head else ""
            if e.kind == "whiteout":
                info = tarfile.TarInfo(f"{prefix}.wh.{base}")
            elif e.kind == "opaque":
                info = tarfile.TarInfo(f"{e.name}/.wh..wh..opq")
            else:
                info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            for key, value in e.xattrs.items():
                info.pax_headers[f"SCHILY.xattr.{key}"] = value
            payload = None
            if e.kind == "file":
                info.size = len(e.data)
                payload = io.BytesIO(e.data)
            elif e.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.target
            elif e.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            archive.addfile(info, payload)
    return buffer.getvalue()


def config_for(layers: list[bytes], env: list[str] | None = None, workdir: str = "/") -> dict:
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env or ["PATH=/bin"], "WorkingDir": workdir, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [sha(tar) for tar in layers]},
    }


def write_oci_layout(
    root: Path, layers: list[bytes], *, ref: str = "latest", compress: bool = True, config: dict | None = None
) -> dict:
    """An OCI image layout at `root` (a directory); returns {'manifest': digest, 'layers': blob digests}."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = sha(data)
        (blobs / digest[7:]).write_bytes(data)
        return digest

    descriptors = []
    for tar in layers:
        blob = gzip.compress(tar, mtime=0) if compress else tar
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
        descriptors.append({"mediaType": media, "digest": put(blob), "size": len(blob)})
    config_bytes = json.dumps(config or config_for(layers)).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": put(config_bytes),
            "size": len(config_bytes),
        },
        "layers": descriptors,
    }
    manifest_bytes = json.dumps(manifest).encode()
    manifest_digest = put(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {"org.opencontainers.image.ref.name": ref},
            }
        ],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return {"manifest": manifest_digest, "layers": [d["digest"] for d in descriptors]}


def tar_directory(source: Path, target: Path) -> Path:
    with tarfile.open(target, "w") as archive:
        for path in sorted(source.rglob("*")):
            archive.add(str(path), arcname=path.relative_to(source).as_posix(), recursive=False)
    return target


def write_docker_archive(target: Path, layers: list[bytes], tag: str) -> Path:
    """A `docker save` archive (legacy layout: <id>/layer.tar, <config>.json, manifest.json)."""
    config_bytes = json.dumps(config_for(layers)).encode()
    with tarfile.open(target, "w") as archive:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))

        names = []
        for tar in layers:
            name = f"{sha(tar)[7:]}/layer.tar"
            add(name, tar)
            names.append(name)
        config_name = f"{sha(config_bytes)[7:]}.json"
        add(config_name, config_bytes)
        add("manifest.json", json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}]).encode())
    return target
