"""The image store without a node: import (OCI layout, docker save), whiteouts, digests, export, GC, bad input."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ocitools import Entry, layer_tar, sha, tar_directory, write_docker_archive, write_oci_layout

from shoal import linux
from shoal.errors import ImageError, ImageNotFoundError
from shoal.images import ImageStore, erofs, layout, tarfs
from shoal.images.erofs import LayerMounts
from shoal.images.store import ImageConfig

BASE = [
    Entry("etc", "dir", mode=0o755),
    Entry("etc/motd", data=b"base motd\n"),
    Entry("etc/gone", data=b"deleted later\n"),
    Entry("bin", "dir", mode=0o755),
    Entry("bin/tool", data=b"#!/bin/sh\necho tool\n", mode=0o4755),
    Entry("bin/tool-link", "hardlink", target="bin/tool"),
    Entry("bin/sym", "symlink", target="tool"),
    Entry("opt", "dir", mode=0o755),
    Entry("opt/old", data=b"hidden by the opaque dir above\n"),
    Entry("opt/sub", "dir", mode=0o700, uid=1000, gid=1000),
    Entry("tmp", "dir", mode=0o1777),
    Entry("run", "dir"),
    Entry("run/pipe", "fifo", mode=0o600),
    Entry("etc/tagged", data=b"x", xattrs={"user.shoal": "yes"}),
]
MIDDLE = [
    Entry("etc", "dir", mode=0o755),
    Entry("etc/gone", "whiteout"),
    Entry("opt", "dir", mode=0o755),
    Entry("opt", "opaque"),
    Entry("opt/new", data=b"only this\n"),
]
TOP = [Entry("etc", "dir", mode=0o755), Entry("etc/motd", data=b"top motd\n")]


@pytest.fixture(params=["erofs", "dir"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ImageStore]:
    if request.param == "erofs" and not erofs.supported():
        pytest.skip("no EROFS here (kernel module or mkfs.erofs missing)")
    monkeypatch.setenv("SHOAL_EROFS", "1" if request.param == "erofs" else "0")
    yield ImageStore(tmp_path / "store")


def _mounted(store: ImageStore, name: str, where: Path) -> Iterator[Path]:
    """Stack image `name` the way a sandbox does (layer mounts + overlay), yield the merged root."""
    image = store.get(name)
    mounts = LayerMounts(where / "layers")
    lowers = [mounts.acquire(i, d) for i, d in zip(image.layer_ids, image.layers, strict=True)]
    for sub in ("upper", "work", "root"):
        (where / sub).mkdir(parents=True)
    options = (
        f"lowerdir={':'.join(str(p) for p in reversed(lowers))},upperdir={where / 'upper'},workdir={where / 'work'}"
    )
    linux.mount("overlay", str(where / "root"), "overlay", 0, options)
    try:
        yield where / "root"
    finally:
        linux.umount(str(where / "root"))
        for diff_id in image.layer_ids:
            mounts.release(diff_id)


def _our_mounts(prefix: Path) -> list[str]:
    """Mounts below `prefix`, and loop devices backed by files below it (EROFS on tmpfs uses one)."""
    loops = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().startswith(str(prefix)):
                loops.append(backing.parent.parent.name)
        except OSError:
            pass
    return [m for m in linux.mountpoints() if m.startswith(str(prefix))] + loops


def _check_merged(root: Path) -> None:
    assert (root / "etc/motd").read_text() == "top motd\n"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opt")) == ["new"]
    tool = os.lstat(root / "bin/tool")
    assert stat.S_IMODE(tool.st_mode) == 0o4755
    assert os.lstat(root / "bin/tool-link").st_ino == tool.st_ino
    assert os.readlink(root / "bin/sym") == "tool"
    assert stat.S_IMODE(os.lstat(root / "tmp").st_mode) == 0o1777
    assert stat.S_ISFIFO(os.lstat(root / "run/pipe").st_mode)
    assert os.getxattr(root / "etc/tagged", "user.shoal") == b"yes"


def test_import_oci_layout_with_whiteouts_opaque_dirs_and_links(store: ImageStore, tmp_path: Path) -> None:
    layers = [layer_tar(BASE), layer_tar(MIDDLE), layer_tar(TOP)]
    write_oci_layout(tmp_path / "oci", layers, ref="v1")
    assert layout.import_archive(store, tmp_path / "oci", "three") == ["three"]
    image = store.get("three")
    assert list(image.layer_ids) == [sha(t) for t in layers]
    assert image.config.env == {"PATH": "/bin"}
    fmt = {store.layer_info(d).format for d in image.layer_ids}
    assert fmt == ({"erofs"} if os.environ["SHOAL_EROFS"] == "1" else {"dir"})
    for root in _mounted(store, "three", tmp_path / "m"):
        _check_merged(root)
        assert os.lstat(root / "opt").st_uid == 0
    assert _our_mounts(tmp_path) == []


def test_squash_flattens_whiteouts_and_opaque_dirs(store: ImageStore, tmp_path: Path) -> None:
    write_oci_layout(tmp_path / "oci", [layer_tar(BASE), layer_tar(MIDDLE), layer_tar(TOP)], ref="v1")
    layout.import_archive(store, tmp_path / "oci", "three")
    flat = store.squash("three", "flat")
    assert len(flat.layer_ids) == 1 and flat.config == store.get("three").config
    for root in _mounted(store, "flat", tmp_path / "m"):
        _check_merged(root)
        assert not any(stat.S_ISCHR(os.lstat(p).st_mode) for p in root.rglob("*"))  # no markers left
    assert _our_mounts(tmp_path) == []


def test_import_oci_tar_and_docker_archives(store: ImageStore, tmp_path: Path) -> None:
    layers = [layer_tar(BASE), layer_tar(MIDDLE), layer_tar(TOP)]
    write_oci_layout(tmp_path / "oci", layers, ref="latest", compress=False)
    tar_directory(tmp_path / "oci", tmp_path / "oci.tar")
    assert layout.import_archive(store, tmp_path / "oci.tar") == ["latest"]
    write_docker_archive(tmp_path / "saved.tar", layers, "example/app:1")
    assert layout.import_archive(store, tmp_path / "saved.tar") == ["example/app:1"]
    assert store.get("example/app:1").layer_ids == store.get("latest").layer_ids
    assert len(list(store.layers_dir.iterdir())) == 3  # stored once
    for root in _mounted(store, "example/app:1", tmp_path / "m"):
        _check_merged(root)


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (apt-get install skopeo)")
def test_skopeo_made_docker_archive_and_export_round_trip(store: ImageStore, tmp_path: Path) -> None:
    layers = [layer_tar(BASE), layer_tar(MIDDLE)]
    write_oci_layout(tmp_path / "oci", layers, ref="v2")
    archive = tmp_path / "skopeo.tar"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "-q",
            "oci:" + str(tmp_path / "oci") + ":v2",
            f"docker-archive:{archive}:localhost:5000/made/by:skopeo",
        ],
        check=True,
        capture_output=True,
    )
    assert layout.import_archive(store, archive) == ["localhost:5000/made/by:skopeo"]
    assert list(store.get("localhost:5000/made/by:skopeo").layer_ids) == [sha(t) for t in layers]
    # export as an OCI layout; skopeo re-reads it (verifying every digest) and we re-import it elsewhere
    digest = layout.export_archive(store, "localhost:5000/made/by:skopeo", tmp_path / "out")
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{tmp_path / 'out'}:skopeo", f"dir:{tmp_path / 'copied'}"],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "copied" / "manifest.json").exists()
    assert digest.startswith("sha256:")
    layout.export_archive(store, "localhost:5000/made/by:skopeo", tmp_path / "out.tar")
    other = ImageStore(tmp_path / "other")
    assert layout.import_archive(other, tmp_path / "out.tar", "again") == ["again"]
    assert other.get("again").layer_ids == store.get("localhost:5000/made/by:skopeo").layer_ids


def test_zstd_layers(store: ImageStore) -> None:
    import io

    import zstandard

    tar = layer_tar([Entry("z", data=b"zstd" * 1000)])
    blob = zstandard.ZstdCompressor().compress(tar)
    diff_id = store.add_layer_tar(io.BytesIO(blob), "application/vnd.oci.image.layer.v1.tar+zstd", expect=sha(blob))
    assert diff_id == sha(tar)
    with pytest.raises(ImageError, match="corrupt layer archive"):
        store.add_layer_tar(io.BytesIO(blob[: len(blob) // 2]), "application/vnd.oci.image.layer.v1.tar+zstd")


def test_digest_mismatch_is_refused_and_leaves_nothing(store: ImageStore, tmp_path: Path) -> None:
    info = write_oci_layout(tmp_path / "oci", [layer_tar(BASE)], ref="bad")
    blob = tmp_path / "oci" / "blobs" / "sha256" / info["layers"][0][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="digest mismatch"):
        layout.import_archive(store, tmp_path / "oci")
    assert store.present() == []
    assert not any(store.layers_dir.glob("*")) if store.layers_dir.exists() else True
    assert list(store.tmp_dir.iterdir()) == []


def test_diff_id_mismatch_and_corrupt_archives(store: ImageStore, tmp_path: Path) -> None:
    tar = layer_tar(BASE)
    config = {"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"diff_ids": [sha(b"other")]}}
    write_oci_layout(tmp_path / "lying", [tar], config=config)
    with pytest.raises(ImageError, match="the image is corrupt"):
        layout.import_archive(store, tmp_path / "lying", "x")
    truncated = gzip.compress(tar)[:200]
    with pytest.raises(ImageError, match="corrupt layer archive"):
        store.add_layer_tar(__import__("io").BytesIO(truncated), "application/vnd.oci.image.layer.v1.tar+gzip")
    write_oci_layout(tmp_path / "bare", [tar])
    manifest_digest = json.loads((tmp_path / "bare" / "index.json").read_text())["manifests"][0]["digest"]
    blob = tmp_path / "bare" / "blobs" / "sha256" / manifest_digest[7:]
    blob.write_text("{}")  # a manifest without a config: its digest no longer matches either
    with pytest.raises(ImageError, match="digest mismatch"):
        layout.import_archive(store, tmp_path / "bare", "x")
    index = json.loads((tmp_path / "bare" / "index.json").read_text())
    index["manifests"][0]["digest"] = sha(b"{}")
    (tmp_path / "bare" / "blobs" / "sha256" / sha(b"{}")[7:]).write_text("{}")
    (tmp_path / "bare" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match="malformed image metadata"):
        layout.import_archive(store, tmp_path / "bare", "x")
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ImageError, match="not a readable tar|neither"):
        layout.import_archive(store, tmp_path / "junk.tar")
    with pytest.raises(ImageError, match="no archive"):
        layout.import_archive(store, tmp_path / "missing.tar")
    assert store.present() == [] and list(store.tmp_dir.iterdir()) == []


@pytest.mark.parametrize(
    "entries",
    [
        [Entry("../escape", data=b"x")],
        [Entry("link", "symlink", target="/tmp"), Entry("link/owned", data=b"x")],
        [Entry("hard", "hardlink", target="../../etc/passwd")],
    ],
    ids=["dotdot", "through-symlink", "hardlink-out"],
)
def test_layers_cannot_write_outside_their_root(store: ImageStore, entries: list[Entry], tmp_path: Path) -> None:
    with pytest.raises(ImageError):
        store.add_layer_tar(__import__("io").BytesIO(layer_tar(entries)))
    assert not Path("/tmp/owned").exists()
    assert list(store.tmp_dir.iterdir()) == []


def test_hard_link_through_a_symlinked_directory_is_refused(store: ImageStore, tmp_path: Path) -> None:
    """`d -> <host dir>` then a hard link to `d/secret` once linked a host file into the image (issue 18)."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_text("host only\n")
    for entries in (
        [Entry("d", "symlink", target=str(host)), Entry("leak", "hardlink", target="d/secret")],
        [Entry("d", "symlink", target="../../host"), Entry("leak", "hardlink", target="d/secret")],
        [
            Entry("real", "dir"),
            Entry("real/x", data=b"x"),
            Entry("d", "symlink", target="real"),
            Entry("leak", "hardlink", target="d/x"),
        ],
    ):
        with pytest.raises(ImageError, match="plain directories"):
            store.add_layer_tar(__import__("io").BytesIO(layer_tar(entries)))
    assert (host / "secret").stat().st_nlink == 1
    assert list(store.tmp_dir.iterdir()) == []
    # a hard link to a plain file (or to a symlink itself) of the layer still works
    diff_id = store.add_layer_tar(__import__("io").BytesIO(layer_tar([
        Entry("real", "dir"), Entry("real/x", data=b"x"), Entry("s", "symlink", target="real/x"),
        Entry("hx", "hardlink", target="real/x"), Entry("hs", "hardlink", target="s")])))  # fmt: skip
    assert store.has_layer(diff_id)


@pytest.mark.parametrize("name", ["..", ".", "sub/..", ""])
def test_whiteouts_of_dot_names_are_refused(store: ImageStore, tmp_path: Path, name: str) -> None:
    """`.wh...` named the parent of the layer's directory: unpacking deleted outside the layer."""
    entries = [Entry("sub", "dir"), Entry("sub/keep", data=b"k"), Entry(name, "whiteout")]
    with pytest.raises(ImageError, match="whiteout"):
        store.add_layer_tar(__import__("io").BytesIO(layer_tar(entries)))
    assert store.tmp_dir.is_dir() and list(store.tmp_dir.iterdir()) == []


def test_pack_of_an_upper_dir_round_trips_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "new").write_text("new")
    os.mknod(upper / "etc" / "deleted", stat.S_IFCHR, os.makedev(0, 0))
    (upper / "data").mkdir()
    os.setxattr(upper / "data", "trusted.overlay.opaque", b"y")
    (upper / "data" / "only").write_text("1")
    for path in [*upper.rglob("*"), upper]:  # times in the past: any time taken from "now" would show
        os.utime(path, (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    with open(tmp_path / "layer.tar", "wb") as out:
        tarfs.pack(upper, out)
    with tarfile.open(tmp_path / "layer.tar") as archive:
        names = archive.getnames()
    assert names == ["data", "data/.wh..wh..opq", "data/only", "etc", "etc/.wh.deleted", "etc/new"]
    with open(tmp_path / "layer.tar", "rb") as source:
        tarfs.unpack(source, tmp_path / "again")
    st = os.lstat(tmp_path / "again" / "etc" / "deleted")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(tmp_path / "again" / "data", "trusted.overlay.opaque") == b"y"
    with open(tmp_path / "again.tar", "wb") as out:
        tarfs.pack(tmp_path / "again", out)
    assert (tmp_path / "again.tar").read_bytes() == (tmp_path / "layer.tar").read_bytes()  # deterministic


def test_gc_keeps_shared_and_mounted_layers(store: ImageStore, tmp_path: Path) -> None:
    base, mid, top = layer_tar(BASE), layer_tar(MIDDLE), layer_tar(TOP)
    write_oci_layout(tmp_path / "a", [base, mid])
    write_oci_layout(tmp_path / "b", [base, top])
    layout.import_archive(store, tmp_path / "a", "a")
    layout.import_archive(store, tmp_path / "b", "b")
    removed = store.remove("a")
    assert removed["removed_layers"] == [sha(mid)]  # base stays: image b uses it
    assert store.has_layer(sha(base)) and store.has_layer(sha(top)) and not store.has_layer(sha(mid))
    mounts = LayerMounts(tmp_path / "mnt")
    mounts.acquire(sha(top), store.layer_dir(sha(top)))  # a live sandbox uses `top`
    try:
        result = store.remove("b")
        assert result["in_use"] == [sha(top)] and result["removed_layers"] == [sha(base)]
        assert store.has_layer(sha(top))
    finally:
        mounts.release(sha(top))
    assert store.prune()["removed_layers"] == [sha(top)]
    assert not any(store.layers_dir.iterdir()) and not any(store.blobs_dir.iterdir())
    assert _our_mounts(tmp_path) == []


def test_unknown_image_and_bad_digest_name_the_remedy(store: ImageStore) -> None:
    with pytest.raises(ImageNotFoundError, match="pull, import or build it first"):
        store.get("nope")
    with pytest.raises(ImageError, match="bad digest"):
        store.has_layer("md5:abc")


def test_full_disk_is_a_clear_error_and_the_store_stays_consistent(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    linux.mount("tmpfs", str(small), "tmpfs", 0, "size=1m")
    try:
        store = ImageStore(small / "store")
        big = layer_tar([Entry("big", data=os.urandom(3 << 20))])
        write_oci_layout(tmp_path / "oci", [big], compress=False)
        with pytest.raises(ImageError, match="disk full"):
            layout.import_archive(store, tmp_path / "oci", "big")
        assert store.present() == []
        assert not store.layers_dir.exists() or not any(store.layers_dir.iterdir())
        assert list(store.tmp_dir.iterdir()) == []
    finally:
        linux.umount(str(small))


def test_oci_layout_with_a_multi_platform_index(store: ImageStore, tmp_path: Path) -> None:
    import json

    root = tmp_path / "oci"
    ours = layer_tar([Entry("arch", data=layout.host_platform()[1].encode())])
    write_oci_layout(root, [ours], ref="multi")
    index = json.loads((root / "index.json").read_text())
    native = index["manifests"][0]
    native["platform"] = {"os": "linux", "architecture": layout.host_platform()[1]}
    foreign = dict(native, digest=sha(b"elsewhere"), platform={"os": "linux", "architecture": "riscv64"})
    inner = json.dumps({"schemaVersion": 2, "mediaType": layout.INDEX, "manifests": [foreign, native]}).encode()
    (root / "blobs" / "sha256" / sha(inner)[7:]).write_bytes(inner)
    outer = {"mediaType": layout.INDEX, "digest": sha(inner), "size": len(inner), "annotations": native["annotations"]}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [outer]}))
    assert layout.import_archive(store, root) == ["multi"]
    assert list(store.get("multi").layer_ids) == [sha(ours)]
    inner_only = json.dumps({"schemaVersion": 2, "mediaType": layout.INDEX, "manifests": [foreign]}).encode()
    (root / "blobs" / "sha256" / sha(inner_only)[7:]).write_bytes(inner_only)
    outer.update(digest=sha(inner_only), size=len(inner_only))
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [outer]}))
    with pytest.raises(ImageError, match="no linux/.* variant .*riscv64"):
        layout.import_archive(store, root, "foreign")


def test_a_builtin_built_from_an_older_recipe_is_built_again(store: ImageStore) -> None:
    """A host that built `desktop` before its package list grew gets the new one from `ensure` (make images)."""
    built: list[str] = []

    def builder(version: str):  # noqa: ANN202
        def build(rootfs: Path) -> ImageConfig:
            (rootfs / "version").write_text(version)
            built.append(version)
            return ImageConfig()

        return build

    store.register_builtin("thing", builder("1"), recipe="pkg-a")
    first = store.ensure("thing")
    assert store.ensure("thing").layer_ids == first.layer_ids and built == ["1"]  # same recipe: kept
    store.register_builtin("thing", builder("2"), recipe="pkg-a pkg-b")
    second = store.ensure("thing")
    assert built == ["1", "2"] and second.layer_ids != first.layer_ids
    assert store.ensure("thing").layer_ids == second.layer_ids and built == ["1", "2"]
