"""sb.expose: request latency and throughput through the port relay, beside a direct connection, in one run.

The same small HTTP server (stdlib asyncio) runs on the host (direct: the baseline any relay is measured
against) and inside a sandbox with network="none" (reached only through the relay: client -> node's relay
listener -> agent 'F' over its Unix socket, or the VM's serial mux -> 127.0.0.1:port). Each request opens a
new connection on both paths (the relay answers `Connection: close`). Also: the node's CPU-ms per relayed
request (its /proc stat before and after).

    python bench/bench_ports.py [--requests 300] [--mb 64] [--runtime runsc] [--kind microvm] [--gateway]

--gateway: a local cluster (one node, one gateway, tokens) instead of the local node; the URL then goes
through the gateway's HTTP, which opens a connection of its own to the node per request (port_connect).
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import BenchNode, summary  # noqa: E402

import shoal  # noqa: E402

SERVER = r"""
import asyncio, sys
BIG = b"x" * (int(sys.argv[2]) << 20)
async def serve(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    body = BIG if head.split(b" ")[1].endswith(b"/big") else b"ok"
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    writer.write(body)
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""


def node_cpu_s(home: Path) -> float:
    pid = int((home / "node.lock").read_text())
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str) -> bytes:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", parts.path or "/")
        answer = conn.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {body[:200]!r}")
        return body
    finally:
        conn.close()


def measure(label: str, url: str, requests: int, mb: int, cpu: Callable[[], float] = lambda: 0.0) -> None:
    for _ in range(10):  # warm up
        get(url + "small")
    seconds = []
    start, cpu_before = time.perf_counter(), cpu()
    for _ in range(requests):
        t = time.perf_counter()
        get(url + "small")
        seconds.append(time.perf_counter() - t)
    print(summary(f"{label}: GET (new connection each)", seconds, time.perf_counter() - start))
    if spent := cpu() - cpu_before:
        print(f"  {label + ': node CPU per request':<44} {spent * 1e3 / requests:8.2f} ms")
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        size = len(get(url + "big"))
        rates.append(size / (time.perf_counter() - t) / 1e6)
    print(f"  {label + f': {mb} MiB response':<44} {statistics.median(rates):8.1f} MB/s (median of 3)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--kind", default="container")
    parser.add_argument("--gateway", action="store_true")
    args = parser.parse_args()
    node = BenchNode("ports")
    cluster = None
    home = node.home
    if args.gateway:
        import tempfile

        from shoal.cluster.local import LocalCluster

        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="bench-ports-")), nodes=1, prefix="bp")
        gateway = cluster.add_gateway()
        home = cluster.nodes[0].home
    host_server = subprocess.Popen([sys.executable, "-c", SERVER, "18777", str(args.mb)])
    try:
        address = f"shoal://{gateway.address}" if cluster else None
        token = cluster.project_tokens["default"] if cluster else None
        with shoal.Client(address, token=token) as client:
            extra = {"runtime": args.runtime} if args.runtime else {}
            with client.create(args.kind, image="debian", network="none", pool=False, ttl_s=900, **extra) as sb:
                sb.files.write("/srv/server.py", SERVER.encode())
                sb.exec(f"nohup python3 /srv/server.py 8777 {args.mb} >/dev/null 2>&1 &")
                url = sb.expose(8777)
                deadline = time.monotonic() + 120
                while True:
                    try:
                        get(url + "small")
                        get("http://127.0.0.1:18777/small")
                        break
                    except (RuntimeError, OSError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
                what = f"{args.kind}{' ' + args.runtime if args.runtime else ''}{', via a gateway' if cluster else ''}"
                print(f"sb.expose relay vs a direct connection ({what}, {args.requests} requests, same server)")
                measure("direct (host server)", "http://127.0.0.1:18777/", args.requests, args.mb)
                measure("relay (sandbox, network=none)", url, args.requests, args.mb, lambda: node_cpu_s(home))
    finally:
        host_server.kill()
        host_server.wait()
        if cluster is not None:
            cluster.stop()
        node.stop()


if __name__ == "__main__":
    main()
