"""microvm benchmark: shoal side by side with raw QEMU (same kernel, initramfs, disk, device model), one run.

    python bench/bench_vm.py [--image busybox] [--cold 3] [--restores 10] [--fork 4] [--execs 50]

(a) cold boot to ready: shoal create with templates off (boot until the agent answers) vs raw QEMU booting
    the same kernel + initramfs to its first userspace output; (b) restore to ready: shoal create from the
    template (restore + fresh identity + agent hello) vs raw `qemu -incoming` of the same memory file until
    the guest runs; (c) fork of N running copies vs N raw restores in parallel; (d) exec round trip;
    (e) host memory (RSS) per idle VM. The accelerator in use (KVM or TCG) is printed first: under TCG
    every figure is software emulation; KVM figures need a host with hardware virtualization.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import BenchNode, summary  # noqa: E402

import shoal  # noqa: E402
from shoal.guest import AgentClient  # noqa: E402
from shoal.substrates.qemu.accel import detect  # noqa: E402
from shoal.substrates.qemu.machine import Machine, MachineConfig  # noqa: E402


def pss_mb(pid: int, field: str = "Pss") -> float:
    """Proportional set size (pages shared by n processes count 1/n to each), or another smaps field."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def qemu_pid(home: Path, sandbox_id: str) -> int:
    return int((home / "sandboxes" / sandbox_id / "qemu.pid").read_text())


def raw_argv(config: MachineConfig, work: Path, disk: Path, incoming: Path | None) -> list[str]:
    """The identical QEMU command line shoal uses (so the comparison is like for like), QMP on stdio."""
    argv = Machine(work, config, disk).argv(incoming)
    i = argv.index("-qmp")
    return [*argv[:i], "-qmp", "stdio", *argv[i + 2 :]]


def raw_cold_boot(config: MachineConfig, disk: Path) -> float:
    """Raw QEMU, the same boot: spawn → the guest opens its virtio-serial port (QMP VSERPORT_CHANGE), which
    is the moment shoal's agent starts listening; shoal additionally waits for the agent's first answer."""
    with tempfile.TemporaryDirectory(prefix="shoal-rawvm-") as tmp:
        work = Path(tmp)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(disk), "-F", "raw", f"{tmp}/d.qcow2"])
        plain = MachineConfig(**{**config.to_json(), "memory_file": "", "memory_shared": False})
        argv = raw_argv(plain, work, work / "d.qcow2", None)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdin and proc.stdout
        proc.stdin.write(b'{"execute":"qmp_capabilities"}\n')
        proc.stdin.flush()
        for line in proc.stdout:
            event = json.loads(line)
            if event.get("event") == "VSERPORT_CHANGE" and event["data"].get("open"):
                break
        elapsed = time.monotonic() - start
        proc.kill()
        proc.wait()
        return elapsed


def raw_restore(config: MachineConfig, template: Path, keep: bool = False) -> tuple[float, subprocess.Popen, Path]:
    """Raw QEMU: spawn with -incoming of the template's memory file → guest running (QMP query-status)."""
    work = Path(tempfile.mkdtemp(prefix="shoal-rawvm-"))
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(template / "disk.qcow2"), "-F", "qcow2",
                    str(work / "d.qcow2")])  # fmt: skip
    argv = raw_argv(config, work, work / "d.qcow2", template / "memory")
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin and proc.stdout
    proc.stdout.readline()
    proc.stdin.write(b'{"execute":"qmp_capabilities"}\n')
    proc.stdin.flush()
    proc.stdout.readline()
    if config.memory_file:  # the same technique shoal uses: RAM mapped from the template's file
        proc.stdin.write(b'{"execute":"migrate-set-capabilities","arguments":{"capabilities":'
                         b'[{"capability":"x-ignore-shared","state":true}]}}\n')  # fmt: skip
        proc.stdin.flush()
        proc.stdout.readline()
    uri = json.dumps(f"exec:cat {template / 'memory'}").encode()
    proc.stdin.write(b'{"execute":"migrate-incoming","arguments":{"uri":' + uri + b"}}\n")
    proc.stdin.flush()
    proc.stdout.readline()
    while True:
        proc.stdin.write(b'{"execute":"query-status"}\n')
        proc.stdin.flush()
        reply = json.loads(proc.stdout.readline())
        status = reply.get("return", {}).get("status")
        if status in ("running", "paused", "postmigrate"):
            if status != "running":
                proc.stdin.write(b'{"execute":"cont"}\n')
                proc.stdin.flush()
                proc.stdout.readline()
            break
        time.sleep(0.002)
    elapsed = time.monotonic() - start
    if not keep:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", str(work)])
    return elapsed, proc, work


async def main(args: argparse.Namespace) -> None:
    accel = detect()
    print(f"shoal microvm benchmark — image {args.image}; accelerator: {accel.name.upper()} ({accel.reason})\n")
    cold_node = BenchNode("vm-cold")
    os.environ["SHOAL_VM_TEMPLATES"] = "0"
    try:
        async with shoal.AsyncClient() as client:
            cold = []
            for _ in range(args.cold):
                start = time.monotonic()
                sb = await client.create("microvm", image=args.image, pool=False)
                cold.append(time.monotonic() - start)
                await sb.close()
    finally:
        cold_node.stop()
    os.environ.pop("SHOAL_VM_TEMPLATES")
    node = BenchNode("vm")
    try:
        async with shoal.AsyncClient() as client:
            first = await client.create("microvm", image=args.image, pool=False)  # boots and snapshots the template
            template = next((node.home / "vm-templates").glob(f"microvm-{args.image}-*"))
            meta = json.loads((template / "meta.json").read_text())
            config = MachineConfig.from_json(meta["config"])
            info = subprocess.run(
                ["qemu-img", "info", "--output=json", "-U", str(template / "disk.qcow2")],
                capture_output=True,
                text=True,
            )
            base = Path(json.loads(info.stdout)["backing-filename"])

            print("(a) cold boot to ready")
            print(summary("shoal create, templates off (agent answers)", cold))
            raw_cold = [raw_cold_boot(config, base) for _ in range(args.cold)]
            print(summary("raw QEMU, same boot → guest opens agent port", raw_cold))

            print("\n(b) restore to ready")
            restores = []
            for _ in range(args.restores):
                start = time.monotonic()
                sb = await client.create("microvm", image=args.image, pool=False)
                restores.append(time.monotonic() - start)
                await sb.close()
            print(summary("shoal create (template restore + identity)", restores))
            raw_rest = [raw_restore(config, template)[0] for _ in range(args.restores)]
            print(summary("raw QEMU -incoming of the same memory file", raw_rest))
            print(f"  → shoal / raw restore (p50): {statistics.median(restores) / statistics.median(raw_rest):.2f}x;"
                  f" cold / restore (p50): {statistics.median(cold) / statistics.median(restores):.1f}x")  # fmt: skip

            print(f"\n(c) fork of {args.fork} running copies")
            start = time.monotonic()
            kids = await first.fork(args.fork)
            fork_s = time.monotonic() - start
            print(f"  shoal sb.fork({args.fork}) (snapshot + {args.fork} restores): {fork_s * 1e3:8.1f} ms")
            start = time.monotonic()
            raw_par = await asyncio.gather(
                *(asyncio.to_thread(raw_restore, config, template) for _ in range(args.fork))
            )
            raw_fork_s = time.monotonic() - start
            print(f"  raw: {args.fork} parallel QEMU -incoming (no snapshot step):   {raw_fork_s * 1e3:8.1f} ms"
                  f"  (each p50 {statistics.median(r[0] for r in raw_par) * 1e3:.0f} ms)")  # fmt: skip
            for kid in kids:
                if not isinstance(kid, Exception):
                    await kid.close()

            print("\n(d) exec round trip")
            agent = AgentClient(str(node.home / "sandboxes" / first.id / "agent.sock"))
            sdk, direct, hello = [], [], []
            for _ in range(args.execs):  # interleaved, so drift on a shared host hits all three alike
                start = time.monotonic()
                await first.exec(["true"])
                sdk.append(time.monotonic() - start)
                start = time.monotonic()
                proc = await agent.exec(["true"], env={}, cwd="/", uid=0, gid=0, cap_bytes=1 << 20)
                while await proc.next_output() is not None:
                    pass
                await proc.close()
                direct.append(time.monotonic() - start)
                start = time.monotonic()
                await agent.hello()
                hello.append(time.monotonic() - start)
            print(summary("shoal sb.exec(['true']) through the node", sdk))
            print(summary("agent exec `true` on agent.sock (node bypassed)", direct))
            print(summary("agent hello: one virtio-serial mux round trip", hello))

            print(f"\n(e) host memory per idle VM (PSS of its QEMU process, {args.fork} idle copies each)")
            copies = [await client.create("microvm", image=args.image, pool=False) for _ in range(args.fork)]
            raws = [raw_restore(config, template, keep=True) for _ in range(args.fork)]
            time.sleep(3)  # both sets alive together, settled: page sharing is counted the same way for each
            shoal_pss = statistics.mean(pss_mb(qemu_pid(node.home, c.id)) for c in copies)
            shoal_rss = statistics.mean(pss_mb(qemu_pid(node.home, c.id), "Rss") for c in copies)
            raw_pss = statistics.mean(pss_mb(proc.pid) for _, proc, _ in raws)
            for _, proc, work in raws:
                proc.kill()
                proc.wait()
                subprocess.run(["rm", "-rf", str(work)])
            for c in copies:
                await c.close()
            print(f"  shoal microvm ({config.memory_mb} MiB guest, RAM mapped from template): PSS {shoal_pss:.0f} MiB"
                  f" (RSS {shoal_rss:.0f} MiB); raw QEMU restored the same way: PSS {raw_pss:.0f} MiB")  # fmt: skip
            await first.close()
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", default="busybox")
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--restores", type=int, default=10)
    parser.add_argument("--fork", type=int, default=4)
    parser.add_argument("--execs", type=int, default=50)
    asyncio.run(main(parser.parse_args()))
