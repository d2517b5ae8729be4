"""Agentless vm benchmark (a disk image with no shoal agent, e.g. Android): shoal's paths beside the raw one.

    python bench/bench_agentless.py [--quick]

The guest is tests/agentless_guest.py's (Debian's kernel + a busybox initrd serving HTTP on 8080).
(a) create: cold boot until the guest's ready port (8080) takes a connection (no template: a disk image
    is booted every time); (b) an HTTP GET to the guest's port 8080 through `sb.forward` (client -> node
    relay -> QEMU's forward in its namespace -> guest), beside the raw path: the same GET on a socket opened
    directly in QEMU's network namespace (QEMU's own forward, no shoal in between); (c) screenshot over QMP.
CPU-ms per op is the node's CPU time over the row divided by its ops. The machine is shared: compare rows
within one run, never across runs.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import BenchNode, cpu_seconds, summary  # noqa: E402
from agentless_guest import guest_files  # noqa: E402

import shoal  # noqa: E402
from shoal.substrates.qemu.agentless import socket_in_netns  # noqa: E402

REQUEST = b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n"


def get(sock: socket.socket) -> bytes:
    with sock:
        sock.sendall(REQUEST)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert b"agentless-guest-ok" in data, data[:200]
    return data


def qemu_pid(sandbox_id: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"shoal-{sandbox_id}\0".encode() in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                pass
    raise RuntimeError(f"no QEMU of {sandbox_id}")


def rows(name: str, n: int, node: int, op) -> str:  # noqa: ANN001
    seconds, cpu, start = [], cpu_seconds(node), time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        op()
        seconds.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return f"{summary(name, seconds, wall)}  node CPU {(cpu_seconds(node) - cpu) * 1e3 / n:6.2f} ms/op"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, boots = (30, 2) if args.quick else (200, 3)
    bench_node = BenchNode("agentless")
    try:
        with shoal.Client() as client, tempfile.TemporaryDirectory() as tmp:
            node = client.status()["pid"]
            disk, kernel, initrd = guest_files(Path(tmp))
            client.image_import_disk(disk, "bench-agentless", kernel=kernel, initrd=initrd, ready_port=8080,
                                     append="console=ttyS0 panic=-1")  # fmt: skip
            print(f"agentless vm benchmark ({'quick' if args.quick else 'full'}), accel: TCG unless KVM works")
            created: list[shoal.Sandbox] = []
            print(
                rows(
                    "(a) create: cold boot until port 8080 answers",
                    boots,
                    node,
                    lambda: created.append(
                        client.create("vm", image="bench-agentless", screen=(1024, 768), pool=False, ttl_s=900)
                    ),
                )
            )
            for extra in created[1:]:
                extra.close()
            vm = created[0]
            with vm.forward(8080) as fwd:
                host, port = fwd.address.rsplit(":", 1)
                print(
                    rows(
                        "(b) HTTP GET via sb.forward(8080)",
                        n,
                        node,
                        lambda: get(socket.create_connection((host, int(port)), timeout=60)),
                    )
                )
                pid = qemu_pid(vm.id)

                def raw() -> None:
                    sock = socket_in_netns(pid)
                    sock.settimeout(60)
                    sock.connect(("127.0.0.1", 8080))  # the forward shoal's relay already made
                    get(sock)

                print(rows("    raw: same GET in QEMU's namespace", n, node, raw))
            print(rows("(c) screenshot (QMP screendump -> PNG)", min(n, 50), node, vm.gui.screenshot))
            vm.close()
            client.image_rm("bench-agentless")
    finally:
        bench_node.stop()


if __name__ == "__main__":
    main()
