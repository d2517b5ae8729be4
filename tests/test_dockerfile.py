"""Dockerfile parsing as the ecosystem writes it (SWE-bench templates, BuildKit features): the steps it plans.

No node: the builds themselves are in test_images_node.py. Reference normalisation is here too because it
is pure parsing; pulling through it is in test_registry.py.
"""

from __future__ import annotations

import importlib.metadata
import io
import platform
import runpy
import string
import tarfile
import warnings
from pathlib import Path

import pytest

import shoal
from shoal import shellvars
from shoal.errors import ImageError
from shoal.images.registry import Reference

pytestmark = pytest.mark.fast


def _plan(tmp_path: Path, text: str) -> shoal.Image:
    (tmp_path / "Dockerfile").write_text(text)
    return shoal.Image.from_dockerfile(tmp_path / "Dockerfile")


def _files(step: dict) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(step["tar"])) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive if m.isreg()}  # type: ignore[union-attr]


def test_expansion_follows_docker() -> None:
    values = {"A": "1", "EMPTY": ""}
    assert shellvars.expand("$A/${A}/${B:-d}/${EMPTY:-e}/${EMPTY-e}/${A:+x}/${B:+x}/$B.", values) == "1/1/d/e//x//."
    assert shellvars.expand(r"\$A $A", values) == "$A 1"
    assert shellvars.expand("$A:$PATH", values, keep_unknown=True) == "1:$PATH"
    assert shellvars.references("${X:-y} $Y \\$Z") == {"X", "Y"}


def test_swebench_style_header_args_env_and_platform(tmp_path: Path) -> None:
    machine = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine()]
    image = _plan(
        tmp_path,
        "ARG BASE=ubuntu:22.04\n"
        f"FROM --platform=linux/{machine} ${{BASE}}\n"
        "ARG DEBIAN_FRONTEND=noninteractive\nARG RUNNER\n"
        "ENV TZ=Etc/UTC LANG=${LANG:-C.UTF-8}\n"
        "ENV NVM_DIR /usr/local/nvm\n"
        "ENV PATH $NVM_DIR/bin:$PATH\n"
        "ENV PATH=/opt/x:$PATH X=$NVM_DIR\n"
        "WORKDIR $NVM_DIR/work\n"
        "USER ${RUNNER:-1000}\n"
        "USER ${NOBODY:-1000}\n"
        "WORKDIR $HOME\n"
        "RUN echo $DEBIAN_FRONTEND $TZ\n",
    )
    assert image.base == "ubuntu:22.04"
    env, more, path, again, workdir, user, nobody, home, run = image.steps
    # LANG may be the base image's: its default is chosen by the node, which knows the image's environment
    assert env == {"op": "env", "value": {"TZ": "Etc/UTC", "LANG": "${LANG:-C.UTF-8}"}, "expand": True}
    assert more["value"] == {"NVM_DIR": "/usr/local/nvm"}
    # $PATH is the base image's: the node finishes the expansion against the image's environment
    assert path == {"op": "env", "value": {"PATH": "/usr/local/nvm/bin:$PATH"}, "expand": True}
    # the node's PATH (already finished) is used, not this file's unfinished text: no doubled prefix
    assert again == {"op": "env", "value": {"PATH": "/opt/x:$PATH", "X": "/usr/local/nvm"}, "expand": True}
    assert workdir == {"op": "workdir", "value": "/usr/local/nvm/work"}
    assert user == {"op": "user", "value": "1000"}  # RUNNER is an (empty) ARG: the file knows it
    assert nobody == {"op": "user", "value": "${NOBODY:-1000}", "expand": True}
    assert home == {"op": "workdir", "value": "$HOME", "expand": True}
    assert run["cmd"] == "echo noninteractive $TZ"  # ARGs substituted; ENV is the shell's at run time


def test_from_platform_for_another_architecture_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="--platform=linux/s390x is ignored"):
        image = _plan(tmp_path, "FROM --platform=linux/s390x debian AS base\nRUN true\n")
    assert image.base == "debian"


def test_heredocs_shell_and_copy(tmp_path: Path) -> None:
    image = _plan(
        tmp_path,
        "FROM debian\n"
        "RUN <<EOF\n"
        "set -e\n"
        "echo one\n"
        "EOF\n"
        "RUN cat <<'END' > /etc/motd && echo $((1<<2))\n"
        "hello $USER\n"
        "END\n"
        "COPY <<EOF /etc/app.conf\n"
        "key=value\n"
        "EOF\n"
        'SHELL ["/bin/bash", "-o", "pipefail", "-c"]\n'
        "RUN echo hi | cat\n"
        'RUN ["echo", "exec form"]\n'
        "CMD bash -l\n",
    )
    script, cat, copy, piped, exec_form, cmd = image.steps
    assert script["cmd"] == "set -e\necho one\n"
    assert cat["cmd"] == "cat <<'END' > /etc/motd && echo $((1<<2))\nhello $USER\nEND"
    assert copy["dest"] == "/etc/app.conf" and _files(copy) == {"etc/app.conf": b"key=value\n"}
    assert piped["cmd"] == ["/bin/bash", "-o", "pipefail", "-c", "echo hi | cat"]
    assert exec_form["cmd"] == ["echo", "exec form"]
    assert cmd["value"] == ["/bin/bash", "-o", "pipefail", "-c", "bash -l"]


def test_copy_flags_and_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("echo\n")
    image = _plan(tmp_path, "FROM debian\nARG D=/opt\nCOPY --chmod=755 --link run.sh $D/\n")
    with tarfile.open(fileobj=io.BytesIO(image.steps[0]["tar"])) as archive:
        (member,) = archive.getmembers()
    assert member.name == "opt/run.sh" and member.mode == 0o755
    staged = _plan(
        tmp_path, "FROM debian AS build\nRUN make\nFROM build\nRUN test\nFROM alpine\nCOPY --from=build /o /p\n"
    )
    (copy,) = staged.steps
    assert copy["op"] == "copy_from" and copy["stage"].steps[0]["cmd"] == "make" and copy["dest"] == "/p"
    assert _plan(tmp_path, "FROM debian AS build\nRUN make\nFROM build\nRUN test\n").steps[1]["cmd"] == "test"
    with pytest.raises(shoal.InvalidRequestError, match="heredoc <<EOF is never closed"):
        _plan(tmp_path, "FROM debian\nRUN <<EOF\necho\n")
    with pytest.raises(shoal.InvalidRequestError, match="SHELL takes a JSON list"):
        _plan(tmp_path, "FROM debian\nSHELL /bin/bash -c\n")
    with pytest.raises(shoal.InvalidRequestError, match="FROM flag --squash"):
        _plan(tmp_path, "FROM --squash debian\n")


def test_references_normalise_like_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOAL_DEFAULT_REGISTRY", raising=False)
    with pytest.raises(ImageError, match="set SHOAL_DEFAULT_REGISTRY"):
        Reference.parse("python:3.11")
    monkeypatch.setenv("SHOAL_DEFAULT_REGISTRY", "registry.test:5000")
    assert str(Reference.parse("python:3.11")) == "registry.test:5000/library/python:3.11"
    assert str(Reference.parse("python")) == "registry.test:5000/library/python:latest"
    assert str(Reference.parse("user/repo")) == "registry.test:5000/user/repo:latest"
    assert str(Reference.parse("user/repo@sha256:" + "a" * 64)).endswith("/user/repo@sha256:" + "a" * 64)
    assert str(Reference.parse("localhost:5000/repo:1")) == "localhost:5000/repo:1"
    assert str(Reference.parse("10.0.0.1:5000/a/b")) == "10.0.0.1:5000/a/b:latest"
    with pytest.raises(ImageError, match="not a valid repository name"):
        Reference.parse("Python:3.11")


class _Sample(string.Formatter):
    """Fills a SWE-bench template's fields ({platform}, {python_version}, ...) with plausible values."""

    def get_value(self, key, args, kwargs):  # type: ignore[no-untyped-def]
        return {"platform": "linux/x86_64", "conda_arch": "x86_64", "ubuntu_version": "22.04"}.get(key, "9.9")


def test_every_swebench_dockerfile_template_parses_and_plans(tmp_path: Path) -> None:
    """The pinned `swebench` package's templates (Makefile installs it without its dependencies: only these
    files are used, read without importing swebench). Their bases cannot be fetched here: parse and plan only."""
    folder = Path(str(importlib.metadata.distribution("swebench").locate_file("swebench/harness/dockerfiles")))
    (tmp_path / "setup_env.sh").write_text("true\n")
    (tmp_path / "setup_repo.sh").write_text("true\n")
    planned = {}
    for module in sorted(p for p in folder.glob("*.py") if p.name != "__init__.py"):  # it imports swebench
        for name, template in runpy.run_path(str(module)).items():
            if name.startswith("_DOCKERFILE") and isinstance(template, str):
                (tmp_path / "Dockerfile").write_text(_Sample().format(template))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # --platform=linux/x86_64 on another host architecture
                    planned[name] = shoal.Image.from_dockerfile(tmp_path / "Dockerfile")
    assert len(planned) >= 15 and planned["_DOCKERFILE_BASE_PY"].base == "ubuntu:22.04"
    env_js = [s for s in planned["_DOCKERFILE_ENV_JS"].steps if s["op"] == "env"]
    # NVM_DIR comes from the base image: the node resolves it and the base's PATH
    assert {"op": "env", "value": {"PATH": "$NVM_DIR/versions/node/v9.9/bin:$PATH"}, "expand": True} in env_js
    for name, image in planned.items():
        assert image.steps, name
        assert {s["op"] for s in image.steps} <= {"run", "copy", "env", "workdir", "user", "cmd", "label"}, name
