"""shoal.cbuild: the guest agent is linked with musl where musl-gcc is there (a static glibc start costs ~1
CPU-ms of CPUID exits under virtualization, issue 12), and what musl cannot build is built with glibc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from shoal.cbuild import static_binary
from shoal.guest import agent_binary_path

MUSL = shutil.which("musl-gcc") is not None
needs_musl = pytest.mark.skipif(not MUSL, reason="musl-gcc missing (make setup installs musl-tools)")


@needs_musl
def test_the_agent_is_linked_with_musl() -> None:
    agent = Path(agent_binary_path()).read_bytes()
    assert b"glibc" not in agent  # glibc's static start-up carries its own messages ("Fatal glibc error: ...")
    version = subprocess.run([agent_binary_path(), "--version"], capture_output=True, text=True, timeout=10)
    assert "shoal-agent" in version.stdout + version.stderr


def _built_with_musl_asked(tmp_path: Path, source: str) -> tuple[str, bytes]:
    """Build `source` as cbuild builds the agent (musl asked for); its output when run, and the binary."""
    (tmp_path / "prog.c").write_text(source)
    binary = static_binary(tmp_path / "prog", (tmp_path / "prog.c",), musl=True)
    return subprocess.run([binary], capture_output=True, text=True).stdout, Path(binary).read_bytes()


@needs_musl
def test_musl_builds_with_the_kernels_headers(tmp_path: Path) -> None:
    out, binary = _built_with_musl_asked(
        tmp_path,
        "#include <linux/falloc.h>\n#include <stdio.h>\n"
        'int main(void) { printf("%d\\n", FALLOC_FL_PUNCH_HOLE); return 0; }\n',
    )
    assert out == "2\n"
    assert b"glibc" not in binary


def test_what_musl_cannot_build_is_built_with_glibc(tmp_path: Path) -> None:
    out, _ = _built_with_musl_asked(
        tmp_path,
        "#include <gnu/libc-version.h>\n#include <stdio.h>\n"
        "int main(void) { puts(gnu_get_libc_version()); return 0; }\n",
    )
    assert out.strip().split(".")[0] == "2", out  # glibc's version
