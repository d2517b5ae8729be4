"""One suite for every kind: the same SDK calls behave the same on container, microvm and vm."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterator

import pytest

import shoal
from shoal import protocol

KINDS = ["container", "microvm", "vm"]
IMAGE = "debian"


@pytest.fixture(scope="module", params=KINDS)
def kind_sb(request: pytest.FixtureRequest, client: shoal.Client) -> Iterator[shoal.Sandbox]:
    if request.param not in client.kinds():
        pytest.skip(f"kind {request.param} is not available on this node (QEMU missing)")
    with client.create(request.param, image=IMAGE, pool=False, memory_mb=512, cpu=1) as sandbox:
        yield sandbox


def test_exec(kind_sb: shoal.Sandbox) -> None:
    r = kind_sb.exec("echo hi && echo oops >&2 && exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "oops\n")
    assert kind_sb.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"]).stdout == "['a b', 'c']\n"
    assert kind_sb.exec("cat", stdin="piped").stdout == "piped"
    assert kind_sb.exec("echo $A-$B", env={"A": "1", "B": "2"}).stdout == "1-2\n"
    assert kind_sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert kind_sb.exec(["/no/such/binary"]).exit_code == 127


def test_streaming(kind_sb: shoal.Sandbox) -> None:
    chunks, stamps = [], []
    for chunk in kind_sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.3; done"):
        chunks.append(chunk.data)
        stamps.append(time.monotonic())
    assert b"".join(chunks) == b"1\n2\n3\n"
    assert len(chunks) >= 2 and stamps[-1] - stamps[0] > 0.3  # output arrived as printed, not at the end


def test_timeouts_and_cap(kind_sb: shoal.Sandbox) -> None:
    # Generous limits: a software-emulated guest on a busy host may take seconds to start a shell.
    r = kind_sb.exec("echo started; sleep 60", timeout=5)
    assert r.timed_out and r.stdout == "started\n" and r.duration_s < 20
    idle = kind_sb.exec("echo a; sleep 60", idle_timeout=5, timeout=40)
    assert idle.timed_out and idle.stdout == "a\n" and idle.duration_s < 30
    big = kind_sb.exec("head -c 3000000 /dev/zero | tr '\\0' x", output_cap_bytes=100_000)
    # The cap keeps head and tail (100,000 bytes in all) and marks the cut in between.
    marker = protocol.cut_marker(3_000_000 - 100_000).decode()
    assert big.truncated and big.exit_code == 0 and big.stdout_omitted == 3_000_000 - 100_000
    assert big.stdout == "x" * 50_000 + marker + "x" * 50_000


def test_files(kind_sb: shoal.Sandbox) -> None:
    payload = os.urandom(300_000)
    kind_sb.files.write("/tmp/kinds/blob.bin", payload)
    assert kind_sb.files.read("/tmp/kinds/blob.bin") == payload
    assert (
        kind_sb.exec("sha256sum /tmp/kinds/blob.bin | cut -c1-16").stdout.strip()
        == __import__("hashlib").sha256(payload).hexdigest()[:16]
    )
    names = [e.name for e in kind_sb.files.list("/tmp/kinds")]
    assert names == ["blob.bin"]
    assert kind_sb.files.stat("/tmp/kinds/blob.bin").size == len(payload)
    kind_sb.files.remove("/tmp/kinds", recursive=True)
    assert not kind_sb.files.exists("/tmp/kinds")
    with pytest.raises(FileNotFoundError):
        kind_sb.files.read("/no/such/file")


def test_shell_keeps_state(kind_sb: shoal.Sandbox) -> None:
    with kind_sb.shell() as sh:
        sh.run("cd /tmp && export X=42")
        assert sh.run("echo $X $(pwd)").stdout == "42 /tmp\n"


def test_limits_and_isolation(kind_sb: shoal.Sandbox) -> None:
    assert kind_sb.exec("nproc").stdout.strip() == "1" or kind_sb.info.kind == "container"
    if kind_sb.info.kind != "container":
        mem_kb = int(kind_sb.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
        assert 400_000 < mem_kb <= 512 * 1024  # the guest sees the memory it was given, not the host's
        assert kind_sb.exec("uname -r").stdout.strip() != platform.release()  # its own kernel
        # its NIC (on a tap in QEMU's own netns, node/network.py) has no address and no route: it reaches nothing
        assert kind_sb.exec("cat /proc/net/route").stdout.splitlines()[1:] == []
        assert "eth0" not in kind_sb.exec("cat /proc/net/if_inet6 2>/dev/null; true").stdout
    secret = f"/tmp/host-secret-{os.getpid()}"
    with open(secret, "w") as handle:
        handle.write("host only")
    try:
        assert "host only" not in kind_sb.exec(f"cat {secret}").stdout
    finally:
        os.unlink(secret)
