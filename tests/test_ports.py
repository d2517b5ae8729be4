"""sb.expose(port): a server inside a sandbox with network="none" reached through the node's HTTP (and, in
test_cluster.py, a gateway's), on every container runtime and a microVM; HTTP and websockets; keys."""

from __future__ import annotations

import asyncio
import shutil
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

import shoal

# A websocket echo server from the standard library (the image has python3, no websocket package, and no
# network to fetch one): RFC 6455 handshake, then text frames echoed back, unmasked.
WS_ECHO = r"""
import base64, hashlib, socket, struct, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + GUID.encode()).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    f = conn.makefile("rb")
    while True:
        b1, b2 = f.read(2)
        n = b2 & 127
        if n == 126: n = struct.unpack(">H", f.read(2))[0]
        elif n == 127: n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
        if b1 & 15 == 8:
            conn.sendall(b"\x88\x00"); conn.close(); return
        data = b"echo:" + data
        size = bytes([len(data)]) if len(data) < 126 else b"\x7e" + struct.pack(">H", len(data))
        conn.sendall(bytes([0x80 | (b1 & 15)]) + size + data)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8765)); s.listen(16)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


# A raw TCP server (no HTTP): reads until the client's half-close, answers the bytes reversed.
TCP_REVERSE = r"""
import socket, threading
def serve(c):
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    c.sendall(data[::-1]); c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9009)); s.listen(16)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def reverse_through(address: str, payload: bytes) -> bytes:
    import socket

    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        return got


def check_raw_tcp(sb: shoal.Sandbox) -> None:
    """sb.forward: a local port whose connections are raw TCP to a port in the sandbox (half-close kept)."""
    sb.files.write("/srv/rev.py", TCP_REVERSE.encode())
    sb.exec("nohup python3 /srv/rev.py >/dev/null 2>&1 &")
    with sb.forward(9009) as fwd:
        deadline = time.monotonic() + 60
        while (got := reverse_through(fwd.address, b"ping")) != b"gnip":  # empty until the server listens
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        blob = bytes(range(256)) * 4096
        assert reverse_through(fwd.address, blob) == blob[::-1]


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_serving(url: str, deadline_s: float = 120) -> bytes:
    """The body of `url` once the server in the sandbox answers (a 502 until it listens)."""
    deadline = time.monotonic() + deadline_s
    while True:
        status, body = get(url)
        if status == 200:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never answered 200 (last: {status} {body[:300]!r})")
        time.sleep(0.2)


def start_servers(sb: shoal.Sandbox, ws: bool = True) -> None:
    sb.files.write("/srv/hello.txt", b"hello from the sandbox\n")
    sb.exec("cd /srv && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
    if ws:
        sb.files.write("/srv/ws.py", WS_ECHO.encode())
        sb.exec("nohup python3 /srv/ws.py >/dev/null 2>&1 &")


async def ws_echo(url: str, messages: list[str]) -> list[str]:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_close=30)) as ws,
    ):
        got = []
        for message in messages:
            await ws.send_str(message)
            got.append((await ws.receive(timeout=30)).data)
        return got


def check_exposed(sb: shoal.Sandbox, ws: bool = True) -> str:
    """The checks every runtime and kind must pass; returns the URL of port 8000."""
    start_servers(sb, ws)
    url = sb.expose(8000)
    assert f"/ports/{sb.id}/8000." in url
    assert wait_serving(url + "hello.txt") == b"hello from the sandbox\n"
    assert b"hello.txt" in wait_serving(url)  # the directory listing, at the prefix's root
    if ws:
        ws_url = sb.expose(8765).replace("http://", "ws://")
        deadline = time.monotonic() + 60
        while True:
            try:
                got = asyncio.run(ws_echo(ws_url, ["one", "two" * 100]))
                break
            except aiohttp.WSServerHandshakeError:  # not listening yet: the relay answers 502
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert got == ["echo:one", "echo:" + "two" * 100]
    return url


def test_expose_http_and_websocket_with_network_none(client: shoal.Client) -> None:
    with client.create(image="debian", network="none", pool=False, ttl_s=600) as sb:
        url = check_exposed(sb)
        base, _, rest = url.partition("/ports/")
        sandbox_id, port_key = rest.strip("/").split("/")
        # the key is per port: port 8000's key does not open port 8765, a wrong key nothing
        status, body = get(f"{base}/ports/{sandbox_id}/8765.{port_key.partition('.')[2]}/")
        assert status == 401 and b"key" in body
        assert get(f"{base}/ports/{sandbox_id}/8000.{'0' * 24}/")[0] == 401
        assert get(f"{base}/ports/{sandbox_id}/8000/")[0] == 401  # no key, no token
        # a port nothing listens on: the relay says so
        status, body = get(sb.expose(9))
        assert status == 502 and b"nothing listens" in body
        # the sandbox's own network policy stayed shut
        r = sb.exec("python3 -c \"import socket; socket.create_connection(('10.0.0.1', 80), timeout=3)\"")
        assert r.exit_code != 0
        check_raw_tcp(sb)
    status, body = get(url)  # closed with the sandbox
    assert status == 404, (status, body)


def test_expose_bad_port_and_unknown_sandbox(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        with pytest.raises(shoal.InvalidRequestError):
            sb.expose(0)
        with pytest.raises(shoal.InvalidRequestError):
            sb.expose(70000)
    with pytest.raises(shoal.NotFoundError):
        sb.expose(80)


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_expose_on_other_runtimes(client: shoal.Client, runtime: str) -> None:
    if shutil.which(runtime) is None:
        pytest.skip(f"{runtime} is not installed on this host")
    with client.create(image="debian", runtime=runtime, pool=False, ttl_s=600) as sb:
        url = check_exposed(sb)
    assert get(url)[0] == 404


async def test_expose_async(aclient: shoal.AsyncClient) -> None:
    async with await aclient.create(image="debian", pool=False, ttl_s=300) as sb:
        await sb.files.write("/srv/a.txt", b"async")
        await sb.exec("cd /srv && nohup python3 -m http.server 8001 --bind 127.0.0.1 >/dev/null 2>&1 &")
        url = await sb.expose(8001)
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(url + "a.txt") as answer:
                    if answer.status == 200:
                        assert await answer.read() == b"async"
                        break
                assert time.monotonic() < deadline, answer.status
                await asyncio.sleep(0.2)
        reader, writer = await sb.open_tcp(8001)  # raw bytes: the HTTP here is ours, not the relay's
        writer.write(b"GET /a.txt HTTP/1.0\r\n\r\n")
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"\r\n\r\nasync"), answer


def test_expose_on_a_microvm(client: shoal.Client) -> None:
    """The same relay over the VM's serial mux (no network device in the guest at all)."""
    if "microvm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    with client.create("microvm", image="debian", pool=False, ttl_s=900) as sb:
        url = check_exposed(sb)
        check_raw_tcp(sb)  # a half-close crosses the mux ('E'), the answer comes back
    assert get(url)[0] == 404


def test_expose_on_a_systemd_vm(client: shoal.Client) -> None:
    """The `vm` kind: the agent is a systemd unit in a full Debian guest, reached over the same serial mux;
    the guest has no network device, so only the relay reaches its ports (the template restore path: a
    create restores the booted template, so a slow TCG host pays the boot once per node)."""
    if "vm" not in client.kinds():
        pytest.skip("QEMU is not installed on this node")
    with client.create("vm", image="debian", network="none", pool=False, ttl_s=900) as sb:
        url = check_exposed(sb)
        check_raw_tcp(sb)
    assert get(url)[0] == 404


# ---------------------------------------------------------------- through a node's HTTP and a gateway's


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from conftest import no_leftovers

    from shoal.cluster.local import LocalCluster

    lc = LocalCluster(tmp_path_factory.mktemp("ports"), nodes=2, max_sandboxes=4, projects={"bob": {}, "alice": {}},
                      prefix="tp")  # fmt: skip
    try:
        lc.add_gateway()
        with shoal.Client(f"shoal://{lc.gateways[0].address}", token=lc.cluster_token) as c:
            deadline = time.monotonic() + 60
            while sum(n["healthy"] for n in c._run(c._async.call("cluster_status"))["nodes"].values()) < 2:
                assert time.monotonic() < deadline, "nodes did not come up"
                time.sleep(0.1)
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_expose_through_a_gateway_over_two_nodes(cluster) -> None:  # noqa: ANN001
    gw = cluster.gateways[0]
    bob, alice = cluster.project_tokens["bob"], cluster.project_tokens["alice"]
    with shoal.Client(f"shoal://{gw.address}", token=bob) as c, shoal.Client(f"shoal://{gw.address}", token=alice) as a:
        made = c.create_many(2, image="debian", network="none", pool=False, ttl_s=600)
        try:
            assert all(isinstance(s, shoal.Sandbox) for s in made), made
            urls = []
            for sb in made:
                url = check_exposed(sb, ws=sb is made[0])
                if sb is made[0]:
                    check_raw_tcp(sb)
                assert url.startswith(f"http://{gw.http}/ports/{sb.id}/8000.")
                urls.append(url)
                plain = f"http://{gw.http}/ports/{sb.id}/8000/hello.txt"
                assert get(plain, {"Authorization": f"Bearer {bob}"}) == (200, b"hello from the sandbox\n")
                assert get(plain, {"Authorization": f"Bearer {alice}"})[0] == 404  # another project's sandbox
                assert get(plain)[0] == 401
                assert get(plain, {"Authorization": "Bearer nope"})[0] == 401
                with pytest.raises(shoal.SandboxNotFoundError):
                    a.get(sb.id).expose(8000)  # alice cannot mint a key for bob's sandbox
            # the node's own HTTP relays too, for a client of that node
            node = next(n for n in cluster.nodes if made[0].id.startswith(n.node_id + "-"))
            with shoal.Client(f"shoal://{node.address}", token=bob) as direct:
                url = direct.get(made[0].id).expose(8000)
                assert url.startswith(f"http://{node.http}/ports/")
                assert wait_serving(url + "hello.txt") == b"hello from the sandbox\n"
                plain = f"http://{node.http}/ports/{made[0].id}/8000/hello.txt"
                assert get(plain, {"Authorization": f"Bearer {alice}"})[0] == 404
                assert get(plain)[0] == 401
        finally:
            for sb in made:
                if isinstance(sb, shoal.Sandbox):
                    sb.close()
        for url in urls:  # closed with their sandboxes
            assert get(url)[0] == 404
