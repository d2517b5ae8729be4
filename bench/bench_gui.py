"""GUI sandbox benchmark: `sb.gui` beside the raw X tools run in the same Xvfb, in one run.

    python bench/bench_gui.py [--quick] [--vm | --vm-desktop]

(a) screenshot: sb.gui.screenshot() (helper GetImage -> host PNG) vs `xwd -root` run inside the sandbox
    (timed in the sandbox, so without any shoal overhead) and vs sb.exec(["xwd", ...]) (a process per shot);
(b) click -> changed pixels: click into the xterm, type a key, poll until the screen differs;
    raw: `xdotool key` timed in the sandbox; (c) input round trip: sb.gui.move vs `xdotool mousemove`;
(d) desktop create: cold (Xvfb + xterm start) and claimed from a warm pool;
(e) memory per idle desktop (its cgroup) and the node's share; (f) with --vm: a `vm` with a screen (QMP), image
debian (framebuffer console) and vm-desktop (Xorg + xterm): screenshot, input, create from the template
(--vm-desktop: only the vm-desktop rows).
CPU-ms per op is the node's CPU time (user+sys) over the row divided by its ops. The machine is shared:
compare rows within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchNode, summary  # noqa: E402
from bench_container import cgroup_memory_mb, rss_mb  # noqa: E402

import shoal  # noqa: E402

IMAGE = "desktop"
RAW_LOOP = r"""
import json, subprocess, sys, time
cmd, n = json.loads(sys.argv[1]), int(sys.argv[2])
out = []
for _ in range(n):
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def node_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


async def raw_in_sandbox(sb: shoal.AsyncSandbox, cmd: list[str], n: int) -> list[float]:
    r = await sb.exec(["python3", "-c", RAW_LOOP, json.dumps(cmd), str(n)], env={"DISPLAY": ":0"}, timeout=600)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


async def timed(n: int, pid: int, op) -> tuple[list[float], float]:  # noqa: ANN001
    seconds, cpu = [], node_cpu_s(pid)
    for _ in range(n):
        t = time.perf_counter()
        await op()
        seconds.append(time.perf_counter() - t)
    return seconds, (node_cpu_s(pid) - cpu) * 1e3 / n


def row(name: str, seconds: list[float], cpu_ms: float | None = None) -> str:
    return summary(name, seconds) + (f"  node CPU {cpu_ms:.1f} ms/op" if cpu_ms is not None else "")


async def changed_shots(sb: shoal.AsyncSandbox, pid: int, n: int) -> tuple[list[float], float]:
    """Screenshots of a screen that changed since the previous one (a key into the xterm, then waiting for the
    change): the helper encodes each, where a still screen's repeat is answered from its last encoding."""
    await sb.gui.click(200, 100)
    seconds, cpu = [], 0.0
    for i in range(n):
        await sb.gui.key("a" if i % 2 == 0 else "BackSpace")
        assert await sb.gui.wait_for_change(timeout=10), "the screen did not change after a key"
        before = node_cpu_s(pid)
        t = time.perf_counter()
        await sb.gui.screenshot()
        seconds.append(time.perf_counter() - t)
        cpu += node_cpu_s(pid) - before
    return seconds, cpu * 1e3 / n


async def click_to_change(sb: shoal.AsyncSandbox, n: int) -> list[float]:
    await sb.gui.click(200, 100)
    seconds = []
    for i in range(n):
        await sb.gui.screenshot()  # the reference wait_for_change compares against
        t = time.perf_counter()
        await sb.gui.key("a" if i % 2 == 0 else "BackSpace")
        changed = await sb.gui.wait_for_change(
            timeout=10,
        )
        seconds.append(time.perf_counter() - t)
        assert changed, "the screen did not change after a key press"
    return seconds


async def vm_rows(client: shoal.AsyncClient, pid: int, n: int, image: str = "debian") -> None:
    """A `vm` with a screen: screenshots and input through QMP (TCG here: no usable KVM). Image "debian" shows
    the framebuffer console, "vm-desktop" Xorg with an xterm."""
    t = time.perf_counter()
    vm = await client.create("vm", image=image, screen=(1280, 800), pool=False, ttl_s=1800)
    print(
        f"\n(f) vm {image} with a screen, 1280x800 (QMP; first create incl. any template boot: "
        f"{time.perf_counter() - t:.1f} s)"
    )
    try:
        shots, cpu = await timed(n, pid, vm.gui.screenshot)
        size = len((await vm.gui.screenshot()).png)
        print(row(f"shoal vm.gui.screenshot() (QMP screendump, PNG {size >> 10} KiB)", shots, cpu))
        if image == "vm-desktop":  # the same with the xterm full of text: a bigger PNG for QEMU to compress
            await vm.gui.click(200, 100)
            await asyncio.sleep(2)  # the first pointer event after a restore takes 0.5-1 s under TCG (docs/GUI.md)
            await vm.gui.screenshot()
            await vm.gui.type("ls -l /usr/bin /usr/lib\n")
            while await vm.gui.wait_for_change(timeout=3):  # until the listing has stopped scrolling
                await vm.gui.screenshot()
            shots, cpu = await timed(n, pid, vm.gui.screenshot)
            size = len((await vm.gui.screenshot()).png)
            print(row(f"  same, xterm full of text (PNG {size >> 10} KiB)", shots, cpu))
        moves, cpu = await timed(n, pid, lambda: vm.gui.move(300, 300))
        print(row("shoal vm.gui.move() (QMP input-send-event)", moves, cpu))
        keys, cpu = await timed(n, pid, lambda: vm.gui.key("a"))
        print(row("shoal vm.gui.key('a') (press + release)", keys, cpu))
        creates = []
        for _ in range(5):
            t = time.perf_counter()
            one = await client.create("vm", image=image, screen=(1280, 800), pool=False, ttl_s=600)
            creates.append(time.perf_counter() - t)
            await one.close()
        print(row(f"vm {image}: create (template restore)", creates))
    finally:
        await vm.close()


async def main(args: argparse.Namespace) -> None:
    node = BenchNode("gui")
    n = 30 if args.quick else 100
    try:
        async with shoal.AsyncClient() as client:
            pid = (await client.status())["pid"]
            if args.vm_desktop:
                await vm_rows(client, pid, max(10, n // 3), "vm-desktop")
                return
            t = time.perf_counter()
            sb = await client.create(image=IMAGE, pool=False, ttl_s=1800)
            print(f"shoal GUI benchmark — image {IMAGE} 1280x800, {n} iterations per row "
                  f"(first create, image cached: {time.perf_counter() - t:.2f} s)\n")  # fmt: skip
            try:
                await sb.gui.wait_for_change(timeout=10)  # the xterm has drawn
                print("(a) screenshot of 1280x800")
                shots, cpu = await timed(n, pid, sb.gui.screenshot)
                size = len((await sb.gui.screenshot()).png)
                print(row(f"shoal sb.gui.screenshot(), still screen (PNG {size >> 10} KiB)", shots, cpu))
                fresh, cpu = await changed_shots(sb, pid, n)
                print(row("shoal sb.gui.screenshot(), screen changed since", fresh, cpu))
                print(
                    row(
                        "raw xwd -root, timed inside the sandbox",
                        await raw_in_sandbox(sb, ["xwd", "-root", "-silent"], n),
                    )
                )
                execs, cpu = await timed(n, pid, lambda: sb.exec(["xwd", "-root", "-silent"], env={"DISPLAY": ":0"}))
                print(row("shoal sb.exec(['xwd', '-root']) (XWD, no PNG)", execs, cpu))
                print("\n(b) key press -> changed pixels")
                print(row("shoal gui.key + gui.wait_for_change", await click_to_change(sb, max(10, n // 3))))
                print("\n(c) input round trip")
                moves, cpu = await timed(n, pid, lambda: sb.gui.move(300, 300))
                print(row("shoal sb.gui.move()", moves, cpu))
                raw = await raw_in_sandbox(sb, ["xdotool", "mousemove", "300", "300"], n)
                print(row("raw xdotool mousemove, timed inside the sandbox", raw))
            finally:
                await sb.close()
            print("\n(d) desktop create")
            cold = []
            for _ in range(max(5, n // 10)):
                t = time.perf_counter()
                one = await client.create(image=IMAGE, pool=False, ttl_s=600)
                cold.append(time.perf_counter() - t)
                await one.close()
            print(row("cold create (container + Xvfb + xterm ready)", cold))
            warm_n = max(5, n // 10)
            await client.set_pool("container", IMAGE, warm_n, wait=True)
            claims = []
            for _ in range(warm_n):
                t = time.perf_counter()
                await client.create(image=IMAGE, labels={"bench": "gui-claim"}, ttl_s=600)
                claims.append(time.perf_counter() - t)
            await client.set_pool("container", IMAGE, 0)
            await client.close_all(labels={"bench": "gui-claim"})
            print(row("create from a warm pool", claims))
            if args.vm:
                for image in ("debian", "vm-desktop"):
                    await vm_rows(client, pid, max(10, n // 3), image)
            print("\n(e) memory per idle desktop")
            before = rss_mb(pid)
            idle = await client.create_many(5, image=IMAGE, pool=False, labels={"bench": "gui-idle"}, ttl_s=600)
            live = [s for s in idle if isinstance(s, shoal.AsyncSandbox)]
            await asyncio.sleep(3)
            charged = statistics.mean(cgroup_memory_mb(s.id) for s in live)
            share = (rss_mb(pid) - before) / max(1, len(live))
            print(f"  per idle desktop: {charged:.1f} MiB charged to its cgroup + {share:.2f} MiB of node memory "
                  f"({len(live)} live)")  # fmt: skip
            await client.close_all(labels={"bench": "gui-idle"})
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vm", action="store_true", help="also vms with a screen (QMP; boots templates first)")
    parser.add_argument("--vm-desktop", action="store_true", help="only the rows of a vm-desktop (Xorg over QMP)")
    asyncio.run(main(parser.parse_args()))
