"""Images through a real node: composition, snapshots, builds (builder and Dockerfile), GC with live sandboxes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DEBIAN_RELEASE, FETCH, NodeProcess, layer_mounts, no_leftovers, outside_network
from ocitools import Entry, layer_tar, write_oci_layout

import shoal
from shoal.images import erofs

_MADE: list[str] = []


def _unique(prefix: str) -> str:
    name = f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    _MADE.extend([name, name + "-b"])
    return name


@pytest.fixture(autouse=True, scope="module")
def _remove_test_images(client: shoal.Client) -> Iterator[None]:
    """The test store is shared by sessions: remove what these tests registered."""
    yield
    for name in set(_MADE) & set(client.images()):
        client.image_rm(name)


def test_composition_stacks_images_without_repacking(client: shoal.Client, tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "main.py").write_text("print('hi')\n")
    workspace, toolkit = _unique("ws"), _unique("tk")
    client.build_image(workspace, shoal.Image.from_("scratch").copy(tmp_path / "repo", "/work/repo").env(REPO="1"))
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho tool-ran\n")
    tool.chmod(0o755)
    client.build_image(toolkit, shoal.Image.from_("scratch").copy(tool, "/opt/tk/tool").env(TK="2"))
    with client.create("container", image="busybox", layers=[workspace, toolkit], pool=False) as sb:
        assert sb.exec("cat /work/repo/main.py").stdout == "print('hi')\n"
        assert sb.exec("/opt/tk/tool").stdout == "tool-ran\n"
        assert sb.exec("echo $REPO$TK").stdout == "12\n"
        assert sb.exec("ls /bin/busybox").exit_code == 0
    with pytest.raises(shoal.ImageNotFoundError):
        client.create("container", image="busybox", layers=["no-such-layer-image"], pool=False)


def test_snapshot_keeps_writes_and_deletions_and_costs_only_the_writes(client: shoal.Client, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for name in "ab":
        (tmp_path / "data" / name).write_text(name)
    base = _unique("snapbase")
    client.build_image(base, shoal.Image.from_("busybox").copy(tmp_path / "data", "/data"))
    snap = _unique("snap")
    with client.create("container", image=base, pool=False) as sb:
        sb.exec("echo written > /root/new && rm /etc/group && rm -rf /data && mkdir /data && echo c > /data/c")
        result = sb.snapshot(snap)
        assert sb.exec("cat /root/new").stdout == "written\n"  # still running after the snapshot
    image_size = sum(layer["size"] for layer in client.image_inspect(base)["layers"])
    assert result["size"] < image_size / 10, (result["size"], image_size)
    with client.create("container", image=snap, pool=False) as sb:
        assert sb.exec("cat /root/new").stdout == "written\n"
        assert sb.exec("test -e /etc/group").exit_code == 1
        assert sb.exec("ls /data").stdout.split() == ["c"]  # the old directory is hidden (opaque)
        assert sb.exec("cat /etc/passwd").exit_code == 0
    assert len(client.image_inspect(snap)["layers"]) == len(client.image_inspect(base)["layers"]) + 1


def test_builds_are_cached_by_step_and_parent(client: shoal.Client) -> None:
    name = _unique("built")
    marker = _unique("m")
    recipe = (
        shoal.Image.from_("busybox")
        .run(f"echo {marker} > /built && cat /proc/sys/kernel/random/uuid > /stamp")
        .env(GREETING="hello")
        .workdir("/app")
        .run("echo $GREETING > greeting")
    )
    seen: list[dict] = []
    first = client.build_image(name, recipe, on_step=seen.append)
    assert [s["cached"] for s in first["steps"]] == [False, True, True, False]
    assert seen == first["steps"]  # streamed as they completed
    again = client.build_image(name, recipe)
    assert all(s["cached"] for s in again["steps"]) and again["layers"] == first["layers"]
    changed = client.build_image(name + "-b", recipe.run("echo more > /more"))
    assert [s["cached"] for s in changed["steps"]] == [True, True, True, True, False]
    with client.create("container", image=name, pool=False) as sb:
        assert sb.info.workdir == "/app"
        assert sb.exec("cat /built; cat greeting; echo $GREETING").stdout == f"{marker}\nhello\nhello\n"
        stamp = sb.exec("cat /stamp").stdout
    with client.create("container", image=name + "-b", pool=False) as sb:
        assert sb.exec("cat /stamp").stdout == stamp  # the shared step was not run again
        assert sb.exec("cat /more").stdout == "more\n"


def test_dockerfile_subset(client: shoal.Client, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.sh").write_text("echo app\n")
    (tmp_path / "Dockerfile").write_text(
        "# a comment\n"
        "FROM busybox\n"
        "ARG WHO=world\n"
        'ENV GREETING="hello" \\\n    TARGET=$WHO\n'
        "LABEL team=rl\n"
        "WORKDIR /srv\n"
        "COPY src/ /srv/src/\n"
        "COPY --chown=1234:1234 src/app.sh /home/runner/\n"
        'RUN ["/bin/sh", "-c", "echo $GREETING $TARGET > out.txt"]\n'
        "RUN echo runner:x:1234:1234::/tmp:/bin/sh >> /etc/passwd\n"
        "USER runner\n"
        "RUN id -u > /tmp/uid\n"
        'CMD ["sh", "src/app.sh"]\n'
        "EXPOSE 8080\n"
    )
    name = _unique("df")
    report = client.build_image(name, shoal.Image.from_dockerfile(tmp_path / "Dockerfile"))
    assert sum(1 for s in report["steps"] if not s["cached"]) == 5  # two COPYs + three RUNs
    info = client.image_inspect(name)
    assert info["config"]["cmd"] == ["sh", "src/app.sh"] and info["config"]["labels"] == {"team": "rl"}
    assert info["config"]["user"] == "runner"
    with client.create("container", image=name, pool=False) as sb:
        assert sb.exec("cat out.txt; sh src/app.sh; cat /tmp/uid").stdout == "hello world\napp\n1234\n"
        assert sb.exec("stat -c %u:%g /home/runner/app.sh").stdout == "1234:1234\n"
    bad = tmp_path / "Bad"
    bad.write_text("FROM busybox\nCOPY --from=busybox /nowhere /x\n")
    with pytest.raises(shoal.InvalidRequestError, match="/nowhere does not exist in the stage"):
        client.build_image(_unique("df"), shoal.Image.from_dockerfile(bad))


def test_multi_stage_copy_from(client: shoal.Client, tmp_path: Path) -> None:
    """COPY --from a stage by name and by index, FROM an earlier stage; the stage images are not kept."""
    (tmp_path / "Dockerfile").write_text(
        "FROM busybox AS build\n"
        "WORKDIR /src\n"
        "RUN mkdir -p out/sub && echo built > out/a && echo deep > out/sub/b && ln -s a out/link\n"
        "FROM build AS more\n"
        "RUN echo more > /src/out/c\n"
        "FROM busybox\n"
        "COPY --from=build /src/out /app/\n"
        "COPY --from=1 /src/out/c /app/c2\n"
        "COPY --from=0 --chown=1234:1234 /src/out/a /single/\n"
    )
    before = set(client.images())
    name = _unique("ms")
    client.build_image(name, shoal.Image.from_dockerfile(tmp_path / "Dockerfile"))
    assert set(client.images()) - before == {name}
    with client.create("container", image=name, pool=False) as sb:
        out = sb.exec("cat /app/a /app/sub/b /app/link /app/c2 /single/a; ls /app; stat -c %u /single/a").stdout
        assert out == "built\ndeep\nbuilt\nmore\nbuilt\na\nc2\nlink\nsub\n1234\n"


def test_dockerfile_as_the_ecosystem_writes_it(client: shoal.Client, tmp_path: Path) -> None:
    """ARG before FROM, `ENV PATH $X:$PATH` over the base image's PATH, heredocs, SHELL, expanded WORKDIR."""
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE=busybox\n"
        "FROM ${BASE}\n"
        "ENV TOOLS /opt/tools\n"
        "ENV PATH $TOOLS/bin:$PATH\n"
        "ENV PATH=/opt/more:$PATH\n"
        "ENV LANG=${LANG:-C.UTF-8} PAGER=${PAGER:-less}\n"
        "WORKDIR $TOOLS\n"
        "RUN <<EOF\n"
        "mkdir -p bin\n"
        "printf '#!/bin/sh\\necho tool\\n' > bin/tool\n"
        "chmod +x bin/tool\n"
        "EOF\n"
        "COPY <<EOF /etc/app.conf\n"
        "key=$TOOLS\n"
        "EOF\n"
        'SHELL ["/bin/sh", "-e", "-c"]\n'
        "RUN cat <<'END' > notes.txt; false; echo not reached > notes.txt\n"
        "never\n"
        "END\n",
    )
    with pytest.raises(shoal.ImageError, match="exited 1"):  # SHELL's -e stops at `false`
        client.build_image(_unique("eco"), shoal.Image.from_dockerfile(tmp_path / "Dockerfile"))
    text = (tmp_path / "Dockerfile").read_text().replace("; false; echo not reached > notes.txt", "")
    (tmp_path / "Dockerfile").write_text(text.replace("never", "kept $HOME"))
    name = _unique("eco")
    client.build_image(name, shoal.Image.from_dockerfile(tmp_path / "Dockerfile"))
    env = client.image_inspect(name)["config"]["env"]
    assert (
        env["PATH"].startswith("/opt/more:/opt/tools/bin:/")
        and env["PATH"].count("/opt/tools") == 1
        and env["LANG"] == "C.UTF-8"
    )
    assert env["PAGER"] == "less"
    with client.create("container", image=name, pool=False) as sb:
        assert sb.exec("pwd; tool; cat /etc/app.conf notes.txt").stdout == (
            "/opt/tools\ntool\nkey=$TOOLS\nkept $HOME\n"
        )


def test_a_failing_step_names_the_step_and_leaves_nothing(client: shoal.Client, node: NodeProcess) -> None:
    name = _unique("fails")
    with pytest.raises(shoal.ImageError, match=r"(?s)step 2 .*exited 3.*oops"):
        client.build_image(name, shoal.Image.from_("busybox").run("true", "echo oops >&2; exit 3"))
    assert name not in client.images()
    assert not [s for s in client.list() if s.labels.get("shoal.build")]


def test_build_steps_reach_the_network_like_dockers(client: shoal.Client) -> None:
    if (why := outside_network()) is not None:
        pytest.skip(why)
    name = _unique("netbuild")
    fetch = f"python3 -c '{FETCH}' {DEBIAN_RELEASE} > /release && getent hosts deb.debian.org > /resolved"
    client.build_image(name, shoal.Image.from_("debian").run(fetch), no_cache=True)
    with client.create(image=name, pool=False) as built, client.create(image="debian", pool=False) as base:
        assert "Codename: bookworm" in built.files.read_text("/release")
        assert "deb.debian.org" in built.files.read_text("/resolved")
        resolv = "cat /etc/resolv.conf 2>&1; true"  # the build's resolver address is not baked into the image
        assert built.exec(resolv).stdout == base.exec(resolv).stdout
    with pytest.raises(shoal.ImageError, match="step 1"):  # offline on request
        client.build_image(name + "-b", shoal.Image.from_("debian").run(fetch), no_cache=True, network="none")
    with pytest.raises(shoal.InvalidRequestError, match="network"):
        client.build_image(name + "-b", shoal.Image.from_("debian").run("true"), network="ftp://nowhere")


def test_gc_never_removes_a_layer_a_live_sandbox_uses(client: shoal.Client, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("still here")
    name = _unique("gc")
    built = client.build_image(name, shoal.Image.from_("busybox").copy(tmp_path / "f", "/f"))
    own_layer = built["layers"][-1]
    with client.create("container", image=name, pool=False) as sb:
        result = client.image_rm(name)
        assert own_layer in result["in_use"] and result["removed_layers"] == []
        assert sb.exec("cat /f").stdout == "still here"
        with pytest.raises(shoal.ImageNotFoundError):
            client.create("container", image=name, pool=False)
    pruned = client.image_prune()
    assert own_layer in pruned["removed_layers"]
    assert "busybox" in client.images()
    with client.create("container", image="busybox", pool=False) as sb:  # shared base layer untouched
        assert sb.exec("true").exit_code == 0


@pytest.mark.skipif(not erofs.supported(), reason="no EROFS on this host: layers are plain directories")
def test_layer_mounts_are_shared_and_released(client: shoal.Client, node: NodeProcess) -> None:
    layers = client.image_inspect("busybox")["layers"]
    sandboxes = [client.create("container", image="busybox", pool=False) for _ in range(3)]
    try:
        mounted = layer_mounts(node.home)
        assert len(mounted) >= len(layers)
        assert len(mounted) == len(set(mounted))  # one mount per layer, shared by all three
    finally:
        for sb in sandboxes:
            sb.close()
    deadline = time.monotonic() + 5
    while layer_mounts(node.home) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert layer_mounts(node.home) == []


def _layer_mount_ids(node: NodeProcess) -> dict[str, str]:
    """The node's layer mounts: target -> mount ID (a new mount of the same target gets a new ID)."""
    lines = Path(f"/proc/{node.pid}/mountinfo").read_text().splitlines()
    base = str(node.home / "layers") + "/"
    return {f[4]: f[0] for line in lines if (f := line.split())[4].startswith(base)}


@pytest.mark.skipif(not erofs.supported(), reason="no EROFS on this host: layers are plain directories")
@pytest.mark.filterwarnings("ignore::shoal.NodeSettingsWarning")  # this node's linger differs from conftest's
def test_an_unused_layer_lingers_for_the_next_create_then_goes(tmp_path: Path) -> None:
    """With SHOAL_LAYER_LINGER_S, the last close keeps its layers mounted (the next create of the image uses
    the same mounts: no mount, no unmount) and they go once the linger ends; a node's shutdown, and a node
    SIGKILLed with layers lingering then restarted, leave none."""
    parent = f"shoal-test-linger-{os.getpid()}"
    node = NodeProcess(tmp_path / "home", parent, SHOAL_LAYER_LINGER_S="3").start()
    try:
        with node.client() as client:
            client.create("container", image="busybox", pool=False, ttl_s=300).close()
            lingering = _layer_mount_ids(node)
            assert len(lingering) >= len(client.image_inspect("busybox")["layers"])
            with client.create("container", image="busybox", pool=False, ttl_s=300) as sb:
                assert sb.exec("true").exit_code == 0
                assert _layer_mount_ids(node) == lingering  # taken as they were
            assert _layer_mount_ids(node) == lingering
            deadline = time.monotonic() + 15
            while layer_mounts(node.home) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert layer_mounts(node.home) == []  # the linger ended
            client.create("container", image="busybox", pool=False, ttl_s=300).close()
            assert layer_mounts(node.home)
        node.stop(signal.SIGKILL)  # lingering: the next node on the home clears them
        node = NodeProcess(node.home, parent, SHOAL_LAYER_LINGER_S="3").start()
        with node.client() as client:
            assert client.status()["pid"] == node.pid
            assert layer_mounts(node.home) == []
            client.create("container", image="busybox", pool=False, ttl_s=300).close()
            assert layer_mounts(node.home)
    finally:
        node.stop()  # lingering: a clean stop unmounts them
    assert not no_leftovers(node.home, parent, node_stopped=True)


def test_import_through_the_client_and_whiteouts_over_a_base(client: shoal.Client, tmp_path: Path) -> None:
    tar = layer_tar([Entry("etc", "dir", mode=0o755), Entry("etc/group", "whiteout"), Entry("etc/added", data=b"+")])
    write_oci_layout(tmp_path / "oci", [tar], ref="patch")
    name = _unique("patch")
    assert client.image_import(tmp_path / "oci", name) == [name]
    with client.create("container", image="busybox", layers=[name], pool=False) as sb:
        assert sb.exec("test -e /etc/group").exit_code == 1
        assert sb.exec("cat /etc/added").stdout == "+"
    out = tmp_path / "exported.tar"
    assert client.image_export(name, out).startswith("sha256:")
    assert out.stat().st_size > 0
    with pytest.raises(shoal.ImageError, match="neither an OCI image layout"):
        client.image_import(tmp_path / "oci" / "blobs")


@pytest.mark.skipif(not erofs.supported(), reason="no EROFS on this host: layers are plain directories")
def test_a_failed_create_releases_its_layer_mounts(client: shoal.Client, node: NodeProcess) -> None:
    with pytest.raises(shoal.ShoalError):
        client.create("container", image="busybox", runtime="no-such-runtime", pool=False)
    assert layer_mounts(node.home) == []
    with pytest.raises(shoal.ImageNotFoundError):
        client.create("container", image="busybox", layers=["busybox", "missing-image"], pool=False)
    assert layer_mounts(node.home) == []


def test_cli_import_ls_inspect_rm(node: NodeProcess, tmp_path: Path) -> None:
    import subprocess
    import sys

    write_oci_layout(tmp_path / "oci", [layer_tar([Entry("hello", data=b"hi")])], ref="cli")
    name = _unique("cli")

    def shoal_cli(*args: str) -> str:
        env = dict(os.environ, SHOAL_IMAGES=str(node.paths.images))
        done = subprocess.run(
            [sys.executable, "-m", "shoal.cli", "--home", str(node.home), "image", *args],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert shoal_cli("import", str(tmp_path / "oci"), "--as", name).split() == [name]
    assert any(line.split()[0] == name for line in shoal_cli("ls").splitlines())
    assert '"media_type"' in shoal_cli("inspect", name)
    assert "removed_layers" in shoal_cli("rm", name)
    assert name not in shoal_cli("ls")


def test_a_second_node_sharing_the_store_cannot_remove_a_layer_in_use(
    client: shoal.Client, node: NodeProcess, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    (tmp_path / "f").write_text("shared")
    name = _unique("shared")
    layer = client.build_image(name, shoal.Image.from_("busybox").copy(tmp_path / "f", "/f"))["layers"][-1]
    other = NodeProcess(tmp_path_factory.mktemp("other-home"), f"shoal-test-other-{os.getpid()}").start()
    try:
        with client.create("container", image=name, pool=False) as sb, other.client() as second:
            result = second.image_rm(name)  # through the other node: it sees the first node's lock
            assert layer in result["in_use"]
            assert sb.exec("cat /f").stdout == "shared"
        with other.client() as second:
            assert layer in second.image_prune()["removed_layers"]
    finally:
        other.stop()


def test_too_many_layers_is_a_clear_error_and_squash_fixes_it(client: shoal.Client, node: NodeProcess) -> None:
    import io

    from shoal.images import ImageStore

    store = ImageStore(node.paths.images)
    base = list(client.image_inspect("busybox")["layers"])
    tall = [store.add_layer_tar(io.BytesIO(layer_tar([Entry(f"l{i}", data=str(i).encode())]))) for i in range(80)]
    name, flat = _unique("tall"), _unique("flat")
    store.commit(name, [layer["diff_id"] for layer in base] + tall, store.get("busybox").config)
    with pytest.raises(shoal.ImageError, match="squash"):
        client.create("container", image=name, pool=False)
    assert layer_mounts(node.home) == []
    assert len(client.image_squash(name, flat)["layers"]) == 1
    with client.create("container", image=flat, pool=False) as sb:
        assert sb.exec("cat /l0 /l79").stdout == "079"
        assert sb.exec("ls /bin/busybox").exit_code == 0
