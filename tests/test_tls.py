"""TLS on the network ports: client -> gateway -> nodes over TLS with a CA made for the run (shoal/tls.py),
and what is refused: a plaintext client, a client trusting another CA, tokens over plain TCP off loopback.

Real nodes and gateways (shoal.cluster.local), real sockets, the openssl command for the certificates.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import no_leftovers

import shoal
from shoal import tls
from shoal.cluster.local import LocalCluster


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("tls"), nodes=2, max_sandboxes=4, prefix="tt", tls=True)
    try:
        lc.add_gateway()
        assert lc.ca is not None
        with shoal.Client(f"shoals://{lc.gateways[0].address}", token=lc.cluster_token, tls_ca=str(lc.ca)) as c:
            deadline = time.monotonic() + 30
            while True:  # the gateway reaches both nodes over TLS
                status = c._run(c._async.call("cluster_status"))
                if sum(n["healthy"] for n in status["nodes"].values()) == 2:
                    break
                assert time.monotonic() < deadline, f"nodes did not come up over TLS: {status}"
                time.sleep(0.1)
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_client_gateway_nodes_over_tls(secure: LocalCluster) -> None:
    token = secure.project_tokens["default"]
    with shoal.Client(f"shoals://{secure.gateways[0].address}", token=token, tls_ca=str(secure.ca)) as c:
        boxes = [c.create(image="busybox", pool=False, ttl_s=120) for _ in range(2)]
        try:
            assert {b.id.split("-")[0] for b in boxes} <= {"tt1", "tt2"}
            for b in boxes:
                result = b.exec("echo over-tls")
                assert (result.exit_code, result.stdout) == (0, "over-tls\n")
        finally:
            for b in boxes:
                b.close()
    # a node's own port is TLS too
    with shoal.Client(f"shoals://{secure.nodes[0].address}", token=token, tls_ca=str(secure.ca)) as c:
        assert c._run(c._async.call("status"))["node_id"] == "tt1"


def test_http_ports_speak_tls(secure: LocalCluster) -> None:
    ctx = ssl.create_default_context(cafile=str(secure.ca))
    token = secure.project_tokens["default"]
    req = urllib.request.Request(f"https://{secure.gateways[0].http}/v1/sandboxes")
    req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        assert r.status == 200 and isinstance(json.loads(r.read()), list)
    with urllib.request.urlopen(f"https://{secure.nodes[0].http}/healthz", context=ctx, timeout=30) as r:
        assert json.loads(r.read())["node_id"] == "tt1"
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to a TLS port gets no answer
        urllib.request.urlopen(f"http://{secure.gateways[0].http}/healthz", timeout=30)


def test_a_plaintext_client_is_refused(secure: LocalCluster) -> None:
    token = secure.project_tokens["default"]
    with pytest.raises(shoal.NodeError, match="shoals://"):
        shoal.Client(f"shoal://{secure.gateways[0].address}", token=token)
    with pytest.raises(shoal.NodeError, match="shoals://"):
        shoal.Client(f"shoal://{secure.nodes[0].address}", token=token)


def test_a_client_trusting_another_ca_fails_clearly(secure: LocalCluster, tmp_path: Path) -> None:
    other = tls.make_ca(tmp_path / "other", name="someone else")
    token = secure.project_tokens["default"]
    with pytest.raises(shoal.TLSError, match="not trusted") as info:
        shoal.Client(f"shoals://{secure.gateways[0].address}", token=token, tls_ca=str(other))
    assert str(other) in str(info.value)
    # a TLS client to a plain server: told it is not TLS
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    try:
        host, port = plain.getsockname()

        def answer_plain() -> None:
            conn, _ = plain.accept()
            conn.sendall(b"\x00\x00\x00\x02hi")
            conn.close()

        import threading

        t = threading.Thread(target=answer_plain, daemon=True)
        t.start()
        with pytest.raises(shoal.TLSError, match="serving TLS"):
            shoal.Client(f"shoals://{host}:{port}", token=token, tls_ca=str(secure.ca))
        t.join(10)
    finally:
        plain.close()


def _outward_address() -> str | None:
    """An address of this machine that is not loopback (the source of a route; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if tls.is_loopback(address) else address


def test_tokens_are_refused_over_plain_tcp_off_loopback(tmp_path: Path) -> None:
    # the client does not send it (nothing listens there: the refusal comes before any connection)
    with pytest.raises(shoal.AuthenticationError, match="SHOAL_PLAINTEXT_TOKENS"):
        shoal.Client("shoal://192.0.2.1:7470", token="shoal_secret")
    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no address but loopback: the server-side refusal cannot be reached")
    lc = LocalCluster(tmp_path, nodes=1, prefix="tp")
    try:
        gw = lc.add_gateway("--listen", "0.0.0.0:0")
        port = int(gw.address.rpartition(":")[2])
        token = lc.project_tokens["default"]
        from shoal.client.transport import Connection

        async def as_outsider() -> None:
            await Connection.open_tcp(address, port, token, plaintext_ok=True)  # the server must refuse it

        import asyncio

        with pytest.raises(shoal.AuthenticationError, match="refused over plain TCP"):
            asyncio.run(as_outsider())
        with shoal.Client(f"shoal://127.0.0.1:{port}", token=token) as c:  # loopback stays allowed
            assert c._run(c._async.call("cluster_status"))["nodes"]
    finally:
        lc.stop()


def test_expose_over_tls(secure: LocalCluster) -> None:
    """sb.expose through a TLS gateway answers an https URL; the relay (in front of the HTTP API on the same
    port) reaches the sandbox's port with the key or a token, and raw TCP (sb.forward) goes over TLS too."""
    ctx = ssl.create_default_context(cafile=str(secure.ca))
    token = secure.project_tokens["default"]
    with (
        shoal.Client(f"shoals://{secure.gateways[0].address}", token=token, tls_ca=str(secure.ca)) as c,
        c.create(image="debian", network="none", pool=False, ttl_s=300) as sb,
    ):
        sb.files.write("/srv/t.txt", b"tls relay")
        sb.exec("cd /srv && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
        url = sb.expose(8000)
        assert url.startswith(f"https://{secure.gateways[0].http}/ports/{sb.id}/8000.")

        def fetch(address: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(urllib.request.Request(address, headers=headers or {}), context=ctx,
                                            timeout=30) as r:  # fmt: skip
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        deadline = time.monotonic() + 120
        while (answer := fetch(url + "t.txt"))[0] != 200:
            assert time.monotonic() < deadline, answer
            time.sleep(0.2)
        assert answer == (200, b"tls relay")
        plain = f"https://{secure.gateways[0].http}/ports/{sb.id}/8000/t.txt"
        assert fetch(plain, {"Authorization": f"Bearer {token}"}) == (200, b"tls relay")
        assert fetch(plain)[0] == 401
        with sb.forward(8000) as fwd:
            host, _, port = fwd.address.rpartition(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("GET", "/t.txt")
            assert conn.getresponse().read() == b"tls relay"
            conn.close()


def test_cluster_up_with_tls_on_ray(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shoal cluster up --tls DIR` on a real two-node Ray cluster: a CA made in DIR, every node and gateway
    serving TLS with a certificate the controller issued for its Ray node, the gateway verifying its nodes,
    and `shoal.Client(ray_address=...)` getting the CA with the gateways; plaintext is refused."""
    import os
    import shutil

    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'shoal[cluster]'")
    from conftest import IMAGES
    from ray.cluster_utils import Cluster

    from shoal.cluster import ray as shoal_ray

    monkeypatch.setenv("RAY_TMPDIR", f"/tmp/rt9-{os.getpid()}")
    monkeypatch.delenv("SHOAL_PLAINTEXT_TOKENS", raising=False)  # nothing here may fall back to clear text
    home = tmp_path_factory.mktemp("ray-tls")
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    except Exception as exc:  # pragma: no cover - only where Ray cannot run at all
        pytest.skip(f"Ray cannot start a cluster here: {exc}")
    homes: list[tuple[str, str]] = []
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace=shoal_ray.NAMESPACE, log_to_driver=False)
        env = {"SHOAL_IMAGES": str(IMAGES), "SHOAL_MAX_SANDBOXES": "4"}
        info = shoal_ray.cluster_up(
            home=str(home / "cluster"), gateways=1, node_env=env, wait_nodes=2, tls_dir=str(home / "tls")
        )
        ca = home / "tls" / "ca.crt"
        assert info["tls_ca"] == ca.read_text()
        with shoal.Client(ray_address=cluster.address) as c:  # the CA comes from the controller
            assert c._async.address.startswith("shoals://")
            deadline = time.monotonic() + 150
            while True:  # the gateway reaches both nodes (over TLS, verified against the CA)
                with shoal.Client(c._async.address, token=_admin(shoal_ray), tls_ca=str(ca)) as admin:
                    status = admin._run(admin._async.call("cluster_status"))
                if sum(n["healthy"] for n in status["nodes"].values()) == 2:
                    break
                assert time.monotonic() < deadline, f"nodes did not come up over TLS: {status}"
                time.sleep(0.5)
            made = c.create_many(2, image="busybox", pool=False, ttl_s=300)
            try:
                assert all(isinstance(s, shoal.Sandbox) for s in made), made
                assert {s.exec("echo over tls").stdout for s in made} == {"over tls\n"}
            finally:
                c.close_all()
        host, port = info["gateways"][0]
        nodes = [n["address"] for n in shoal_ray.cluster_status()["nodes"].values()]
        for address in [f"{host}:{port}", *nodes]:
            with shoal.Client(f"shoals://{address}", token=info["token"], tls_ca=str(ca)) as c:
                assert c.list() == []
            monkeypatch.setenv("SHOAL_PLAINTEXT_TOKENS", "1")  # even a client willing to send it in clear
            with pytest.raises(shoal.ShoalError):
                shoal.Client(f"shoal://{address}", token=info["token"])
            monkeypatch.delenv("SHOAL_PLAINTEXT_TOKENS")
        homes = [(n["home"], n["cgroup_parent"]) for n in shoal_ray.cluster_status()["nodes"].values()]
        codes = shoal_ray.cluster_down()
        assert all(code == 0 for code in codes.values()), codes
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(f"/tmp/rt9-{os.getpid()}", ignore_errors=True)
    for node_home, cgroup_parent in homes:
        assert not no_leftovers(Path(node_home), cgroup_parent, node_stopped=True)


def _admin(shoal_ray) -> str:  # noqa: ANN001
    import ray

    return ray.get(shoal_ray.controller().cluster_token_for_admin.remote())


def test_e2b_port_follows_the_tls_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B API keys are shoal tokens: a node's E2B port serves TLS with the node's certificate, and over plain
    HTTP a key from a peer off loopback is refused (it was accepted in clear)."""
    monkeypatch.setenv("SHOAL_E2B", "0.0.0.0:0")

    def e2b_port(lc: LocalCluster) -> int:
        path = lc.nodes[0].home / "node.e2b"
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline, "the node never served E2B"
            time.sleep(0.05)
        return int(path.read_text().strip().rpartition(":")[2])

    def get(url: str, token: str, ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(url, headers={"X-API-KEY": token})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    secure = LocalCluster(tmp_path / "tls", nodes=1, prefix="te", tls=True)
    try:
        port, token = e2b_port(secure), secure.project_tokens["default"]
        ctx = ssl.create_default_context(cafile=str(secure.ca))
        assert get(f"https://127.0.0.1:{port}/sandboxes", token, ctx) == (200, b"[]")
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to the TLS port gets no answer
            get(f"http://127.0.0.1:{port}/sandboxes", token)
    finally:
        secure.stop()
    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no address but loopback: the refusal off loopback cannot be reached")
    plain = LocalCluster(tmp_path / "plain", nodes=1, prefix="tq")
    try:
        port, token = e2b_port(plain), plain.project_tokens["default"]
        status, body = get(f"http://{address}:{port}/sandboxes", token)
        assert status == 401 and b"SHOAL_PLAINTEXT_TOKENS" in body, (status, body)
        assert get(f"http://127.0.0.1:{port}/sandboxes", token) == (200, b"[]")  # loopback stays allowed
    finally:
        plain.stop()
