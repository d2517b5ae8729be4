"""The network API, the gateway (routing, placement, admission) and quotas, on real nodes over real TCP.

Nodes and gateways are separate processes (shoal.cluster.local); the Ray deployment is tested in
test_ray_cluster.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import resource
import signal
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import no_leftovers

import shoal
from shoal.cluster.local import LocalCluster, LocalGateway

PROJECTS = {"alice": {"sandboxes": 3}, "bob": {}, "carol": {"cpu": 2, "memory_mb": 1024}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=2, max_sandboxes=4, projects=PROJECTS, prefix="tc")
    try:
        lc.add_gateway()
        lc.add_gateway()
        _wait_healthy(lc.gateways[0].address, lc.cluster_token, 2)
        _wait_healthy(lc.gateways[1].address, lc.cluster_token, 2)
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def _wait_healthy(address: str, token: str, count: int, timeout: float = 20.0) -> dict:
    with shoal.Client(f"shoal://{address}", token=token) as c:
        deadline = time.monotonic() + timeout
        while True:
            status = c._run(c._async.call("cluster_status"))
            if sum(n["healthy"] for n in status["nodes"].values()) >= count:
                return status
            assert time.monotonic() < deadline, f"nodes did not come up: {status}"
            time.sleep(0.1)


def _client(lc: LocalCluster, project: str, gateway: int = 0) -> shoal.Client:
    return shoal.Client(f"shoal://{lc.gateways[gateway].address}", token=lc.project_tokens[project])


@pytest.fixture
def bob(cluster: LocalCluster) -> Iterator[shoal.Client]:
    with _client(cluster, "bob") as c:
        yield c
        c.close_all()


def test_tokens_are_checked(cluster: LocalCluster) -> None:
    gw = cluster.gateways[0].address
    with pytest.raises(shoal.AuthenticationError, match="no token given"):
        shoal.Client(f"shoal://{gw}")
    with pytest.raises(shoal.AuthenticationError, match="unknown token"):
        shoal.Client(f"shoal://{gw}", token="not-a-token")
    node = cluster.nodes[0].address  # the node's own TCP port needs a token too
    with pytest.raises(shoal.AuthenticationError, match="unknown token"):
        shoal.Client(f"shoal://{node}", token="nope")


def test_direct_node_over_tcp_streams_and_isolates_projects(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    address = f"shoal://{node.address}"
    with (
        shoal.Client(address, token=cluster.project_tokens["bob"]) as c,
        c.create(image="busybox", pool=False) as sb,
        shoal.Client(address, token=cluster.project_tokens["alice"]) as other,
    ):
        chunks = [ch.data for ch in sb.exec_stream("echo a; sleep 0.2; echo b")]
        assert b"".join(chunks) == b"a\nb\n" and len(chunks) == 2
        assert sb.info.labels["shoal.project"] == "bob"
        assert other.list() == []
        with pytest.raises(shoal.SandboxNotFoundError, match="alice"):
            other.get(sb.id).exec("true")
        with pytest.raises(shoal.AuthenticationError, match="admin"):
            other.set_pool("container", "busybox", 1)


def test_placement_spreads_and_routes_by_id_through_any_gateway(cluster: LocalCluster, bob: shoal.Client) -> None:
    made = bob.create_many(4, image="busybox", pool=False)
    assert all(isinstance(s, shoal.Sandbox) for s in made), made
    per_node = {n.node_id: sum(s.id.startswith(n.node_id + "-") for s in made) for n in cluster.nodes}
    assert all(1 <= count <= 3 for count in per_node.values()), per_node  # 4 would fit on one node
    with _client(cluster, "bob", gateway=1) as other:  # the second gateway has never seen these IDs
        for sb in made:
            assert other.get(sb.id).exec("echo $HOSTNAME").exit_code == 0
        stream = other.get(made[1].id).exec_stream("echo one; sleep 0.3; echo two >&2")
        chunks = [(c.stream, c.data) for c in stream]  # output streams through the gateway as printed
        assert chunks == [("stdout", b"one\n"), ("stderr", b"two\n")] and stream.result.exit_code == 0
        assert other.kill(made[0].id) is True  # through the gateway: the kill says whether it closed it
        assert other.kill(made[0].id) is False  # closed already (twice is fine: E2B's kill answers 404)
    with pytest.raises(shoal.SandboxClosedError):
        made[0].exec("true")
    with pytest.raises(shoal.SandboxNotFoundError, match="nowhere.*does not have"):
        bob.get("nowhere-0123456789ab")
    with pytest.raises(shoal.InvalidRequestError, match="not a sandbox ID"):
        bob.get("plainname")


def test_function_calls_through_the_gateway(cluster: LocalCluster, bob: shoal.Client) -> None:
    """Stateless calls go to any node that runs the function kind; no sandbox is left."""
    assert [bob.call("6 * 7") for _ in range(4)] == [42] * 4
    assert bob.list() == []


def test_quota_exceeded_is_refused_cluster_wide(cluster: LocalCluster) -> None:
    with _client(cluster, "alice") as alice:
        try:
            made = [alice.create(image="busybox", pool=False) for _ in range(3)]
            assert {s.id.rsplit("-", 1)[0] for s in made} == {"tc1", "tc2"}  # spread, yet counted together
            with pytest.raises(shoal.QuotaExceededError, match="alice.*sandboxes quota: 3 in use"):
                alice.create(image="busybox", pool=False)
            made[0].close()
            time.sleep(1)  # the gateway learns of the freed quota at its next poll of the node
            alice.create(image="busybox", pool=False).close()
        finally:
            alice.close_all()
    with _client(cluster, "carol") as carol:
        try:
            carol.create(image="busybox", pool=False, cpu=1, memory_mb=512)
            with pytest.raises(shoal.QuotaExceededError, match="memory_mb quota"):
                carol.create(image="busybox", pool=False, cpu=0.5, memory_mb=600)
        finally:
            carol.close_all()


def test_admission_queues_a_burst_larger_than_the_cluster(cluster: LocalCluster, bob: shoal.Client) -> None:
    """14 creates against 8 slots: the surplus waits until TTLs free slots, then succeeds."""
    start = time.time()
    made = bob.create_many(14, image="busybox", pool=False, ttl_s=2)
    errors = [s for s in made if isinstance(s, Exception)]
    assert not errors, errors
    late = [s for s in made if s.info.created_at - start > 1.5]
    assert len(late) >= 6, "the surplus must have been created only after capacity freed"
    with shoal.Client(f"shoal://{cluster.gateways[0].address}", token=cluster.cluster_token) as admin:
        status = admin._run(admin._async.call("cluster_status"))
    assert status["queue_depth"] == 0


def test_admission_deadline_and_node_rejection_retry(cluster: LocalCluster, bob: shoal.Client) -> None:
    # a gateway with a stale view (polls every 60 s) and a short admission deadline
    gw = LocalGateway("slow", cluster.tokens_file, cluster.node_map(), cluster.workdir, "--poll-interval", "60",
                      "--admission-timeout", "1.5")  # fmt: skip
    try:
        _wait_healthy(gw.address, cluster.cluster_token, 2)
        first = cluster.nodes[0]
        with shoal.Client(f"shoal://{first.address}", token=cluster.project_tokens["bob"]) as direct:
            filled = [direct.create(image="busybox", pool=False) for _ in range(4)]  # behind the gateway's back
        with shoal.Client(f"shoal://{gw.address}", token=cluster.project_tokens["bob"]) as c:
            placed = [c.create(image="busybox", pool=False) for _ in range(4)]
            assert all(s.id.startswith("tc2-") for s in placed)  # tc1 refused; the gateway retried on tc2
            status = c._run(c._async.call("cluster_status"))
            assert status["rejections"] >= 1
            t = time.monotonic()
            with pytest.raises(shoal.CapacityError, match="admission deadline"):
                c.create(image="busybox", pool=False)
            assert 1.4 < time.monotonic() - t < 60  # its 1.5 s deadline, not the default 600 s (a loaded host is slow)
        assert len(filled) == 4
    finally:
        gw.stop()


def test_gateway_discovers_nodes_by_dns_name(cluster: LocalCluster) -> None:
    port = cluster.nodes[0].address.rpartition(":")[2]
    gw = LocalGateway("dns", cluster.tokens_file, {}, cluster.workdir, "--discover", f"localhost:{port}",
                      "--discover-interval", "0.2")  # fmt: skip
    try:
        status = _wait_healthy(gw.address, cluster.cluster_token, 1)
        assert list(status["nodes"]) == ["tc1"]  # learnt its ID by asking it
    finally:
        gw.stop()


def test_a_gateway_stops_promptly_with_a_request_in_flight(cluster: LocalCluster) -> None:
    # A client that never finishes its request body held a SIGTERMed gateway for aiohttp's 60 s shutdown
    # timeout; in-flight requests now get a few seconds (stop() fails if the gateway outlives 30 s).
    gw = LocalGateway("halfsent", cluster.tokens_file, cluster.node_map(), cluster.workdir)
    host, _, port = gw.http.rpartition(":")
    with socket.create_connection((host, int(port))) as peer:
        peer.sendall(
            f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cluster.cluster_token}\r\n"
            "Content-Length: 100\r\n\r\n{".encode()
        )
        time.sleep(0.5)  # let it reach the handler (not needed for the check: the stop below must be bounded)
        gw.stop()
    assert gw.proc.returncode is not None


def test_killing_a_gateway_loses_nothing(cluster: LocalCluster) -> None:
    spare = LocalGateway("spare", cluster.tokens_file, cluster.node_map(), cluster.workdir)
    try:
        _wait_healthy(spare.address, cluster.cluster_token, 2)
        address = f"shoal://{spare.address},{cluster.gateways[1].address}"
        with shoal.Client(address, token=cluster.project_tokens["bob"]) as c:
            sb = c.create(image="busybox", pool=False)
            sb.exec("echo kept > /tmp/state")
            spare.stop(signal.SIGKILL)
            assert sb.files.read_text("/tmp/state") == "kept\n"  # reconnected through the other gateway
            sb.close()
    finally:
        spare.stop()


def test_http_api_and_metrics(cluster: LocalCluster) -> None:
    gw = cluster.gateways[0]
    token = cluster.project_tokens["bob"]

    def call(method: str, path: str, body: object = None, token: str | None = token) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{gw.http}{path}", data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, info = call("POST", "/v1/sandboxes", {"image": "busybox", "pool": False})
    assert status == 200, info
    status, result = call("POST", f"/v1/sandboxes/{info['id']}/exec", {"cmd": "echo hello; exit 3"})
    assert (status, result["stdout"], result["exit_code"]) == (200, "hello\n", 3)
    assert call("GET", "/v1/sandboxes/nowhere-000000000000")[0] == 404
    assert call("GET", "/v1/sandboxes", token=None)[0] == 401
    assert call("DELETE", f"/v1/sandboxes/{info['id']}")[0] == 200
    assert call("GET", "/openapi.json")[1]["openapi"].startswith("3.")
    text = urllib.request.urlopen(f"http://{gw.http}/metrics").read().decode()
    assert 'shoal_gateway_request_seconds_count{op="create"}' in text
    assert "shoal_gateway_queue_depth 0" in text
    node_text = urllib.request.urlopen(f"http://{cluster.nodes[0].http}/metrics").read().decode()
    assert "shoal_node_request_seconds_bucket" in node_text and "shoal_node_capacity 4" in node_text


def test_a_killed_node_loses_only_its_sandboxes(tmp_path: Path) -> None:
    lc = LocalCluster(tmp_path, nodes=2, prefix="tk")
    try:
        gw = lc.add_gateway()
        _wait_healthy(gw.address, lc.cluster_token, 2)
        with _client(lc, "default") as c:
            made = c.create_many(4, image="busybox", pool=False)
            victims = [s for s in made if s.id.startswith("tk2-")]
            survivors = [s for s in made if s.id.startswith("tk1-")]
            assert victims and survivors, [s.id for s in made]
            lc.nodes[1].stop(signal.SIGKILL)
            for sb in victims:
                with pytest.raises(shoal.SandboxLostError, match="node tk2 stopped answering"):
                    sb.exec("true")
            for sb in survivors:
                assert sb.exec("echo ok").stdout == "ok\n"
            assert all(s.id.startswith("tk1-") for s in c.create_many(2, image="busybox", pool=False))
            lc.nodes[1].start()  # restarted: it re-adopts the sandboxes that outlived it (issue 5)
            with shoal.Client(f"shoal://{gw.address}", token=lc.cluster_token) as admin:
                admin._run(admin._async.call("cluster_nodes", {"nodes": lc.node_map()}))
            _wait_healthy(gw.address, lc.cluster_token, 2)
            assert victims[0].exec("echo back").stdout == "back\n"
            c.close_all()
        assert not no_leftovers(lc.nodes[1].home, lc.nodes[1].cgroup_parent)
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_a_slow_health_poll_does_not_fail_requests_in_flight(tmp_path: Path) -> None:
    """A node too busy to answer its health poll in time is marked down (no new placements), but the
    requests already on it finish: the poll has a connection of its own, so closing it after a timeout
    does not fail the client's calls (it did: a close_all of 3,000 sandboxes through a gateway failed)."""
    lc = LocalCluster(tmp_path, nodes=1, prefix="ts")
    try:
        gw = lc.add_gateway()
        _wait_healthy(gw.address, lc.cluster_token, 1)
        with _client(lc, "default") as c, shoal.Client(f"shoal://{gw.address}", token=lc.cluster_token) as admin:
            sb = c.create(image="busybox", ttl_s=300)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(sb.exec, "sleep 1; echo done")
                time.sleep(0.5)  # the exec is on the node
                os.kill(lc.nodes[0].pid, signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 30
                    while admin._run(admin._async.call("cluster_status"))["nodes"]["ts1"]["healthy"]:
                        assert time.monotonic() < deadline, "the gateway never saw the stopped node's poll time out"
                        time.sleep(0.2)
                finally:
                    os.kill(lc.nodes[0].pid, signal.SIGCONT)
                assert running.result(timeout=60).stdout == "done\n"
            _wait_healthy(gw.address, lc.cluster_token, 1)
            assert sb.exec("echo again").stdout == "again\n"
            sb.close()
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_shoal_top_shows_the_cluster(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.cli import main

    address = f"shoal://{cluster.gateways[0].address}"
    assert main(["--address", address, "--token", cluster.project_tokens["bob"], "top", "--once"]) == 0
    screen = capsys.readouterr().out
    assert "nodes 2/2 up" in screen and "tc1" in screen and "tc2" in screen and "queued 0" in screen
    node = cluster.nodes[0]  # a node on its own (no gateway) shows as a cluster of one
    assert (
        main(["--address", f"shoal://{node.address}", "--token", cluster.project_tokens["bob"], "top", "--once"]) == 0
    )
    assert "nodes 1/1 up" in capsys.readouterr().out


def test_node_and_gateway_answer_in_the_same_shapes(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.cli import main

    token = cluster.project_tokens["bob"]
    gateway, node = f"shoal://{cluster.gateways[0].address}", f"shoal://{cluster.nodes[0].address}"
    with shoal.Client(gateway, token=token) as via_gateway, shoal.Client(node, token=token) as direct:
        g_status, n_status = via_gateway.status(), direct.status()
        shared = set(n_status) - {"node_id", "pid", "uptime_s", "home"}
        assert shared <= set(g_status), shared - set(g_status)
        assert {k: type(n_status[k]) for k in shared} == {k: type(g_status[k]) for k in shared}
        assert set(g_status["nodes"]) == {"tc1", "tc2"} and set(n_status["nodes"]) == {cluster.nodes[0].node_id}
        assert g_status["sandboxes"] == sum(n["sandboxes"] for n in g_status["nodes"].values())
        for answers in (via_gateway.images(), direct.images()):
            assert isinstance(answers, list) and "busybox" in answers and answers == sorted(answers)
        g_images, n_images = via_gateway.image_list(), direct.image_list()
        assert (
            {frozenset(e) for e in g_images}
            == {frozenset(e) for e in n_images}
            == {frozenset({"name", "layers", "size", "created", "nodes"})}
        )
        busybox = next(e for e in g_images if e["name"] == "busybox")
        assert busybox["nodes"] == ["tc1", "tc2"] and busybox["layers"] >= 1
        g_record, n_record = via_gateway.image_inspect("busybox"), direct.image_inspect("busybox")
        assert set(g_record) == set(n_record) and g_record["nodes"] == ["tc1", "tc2"]
    for address in (gateway, node):
        assert main(["--address", address, "--token", token, "image", "ls"]) == 0
        assert "busybox" in capsys.readouterr().out


def test_cli_image_build_through_the_gateway(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every node builds; the CLI prints each node's report (it printed a node's, and crashed on a gateway's)."""
    from shoal.cli import main

    gateway = f"shoal://{cluster.gateways[0].address}"
    name = f"gwbuild-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    (tmp_path / "f.txt").write_text("F\n")
    (tmp_path / "Dockerfile").write_text("FROM busybox\nCOPY f.txt /f.txt\n")
    try:
        argv = ["--address", gateway, "--token", cluster.cluster_token, "image", "build", name, "-f"]
        assert main([*argv, str(tmp_path / "Dockerfile")]) == 0
        out = capsys.readouterr().out
        assert f"{name}: 2 layers on node tc1" in out and f"{name}: 2 layers on node tc2" in out
    finally:  # the nodes here share one store: remove through one of them
        with shoal.Client(f"shoal://{cluster.nodes[0].address}", token=cluster.cluster_token) as node:
            if name in node.images():
                node.image_rm(name)


async def test_cancelling_through_the_gateway_leaks_nothing(cluster: LocalCluster) -> None:
    import asyncio

    address = f"shoal://{cluster.gateways[0].address}"
    async with shoal.AsyncClient(address, token=cluster.project_tokens["bob"]) as c:
        sb = await c.create(image="busybox", pool=False)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sb.exec("sleep 60"), 0.5)  # cancel travels client → gateway → node
            deadline = time.monotonic() + 5
            while "sleep 60" in (await sb.exec("ps -o args")).stdout:
                assert time.monotonic() < deadline, "the cancelled command still runs"
                await asyncio.sleep(0.1)
            creates = [asyncio.ensure_future(c.create(image="busybox", pool=False)) for _ in range(6)]
            await asyncio.sleep(0.05)
            for task in creates:
                task.cancel()  # some are cancelled before the node answers: the gateway releases those
            for made in await asyncio.gather(*creates, return_exceptions=True):
                if isinstance(made, shoal.AsyncSandbox):  # finished before the cancel: ours to close
                    await made.close()
            deadline = time.monotonic() + 10
            while len(await c.list()) != 1:
                assert time.monotonic() < deadline, [i.id for i in await c.list()]
                await asyncio.sleep(0.1)
        finally:
            await c.close_all()


async def test_a_cancel_storm_then_shutdown_leaves_nothing(tmp_path: Path) -> None:
    """Creates cancelled at random points (client → gateway → node), then everything stops: a destroy that
    outlived its cancelled request must finish before the node exits."""
    import asyncio
    import random

    lc = LocalCluster(tmp_path, nodes=1, prefix="ts")
    try:
        gw = lc.add_gateway()
        _wait_healthy(gw.address, lc.cluster_token, 1)
        async with shoal.AsyncClient(f"shoal://{gw.address}", token=lc.project_tokens["default"]) as c:
            for _ in range(20):
                tasks = [asyncio.ensure_future(c.create(image="busybox", pool=False)) for _ in range(6)]
                await asyncio.sleep(random.uniform(0.0, 0.15))
                for task in tasks:
                    task.cancel()
                for made in await asyncio.gather(*tasks, return_exceptions=True):
                    if isinstance(made, shoal.AsyncSandbox):
                        await made.close()
    finally:
        lc.stop()
    node = lc.nodes[0]
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


# ---------------------------------------------------------------- unauthenticated peers (issue 18, item 6)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _raw(address: str, source: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(20)
    sock.connect((host, int(port)))
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the server has closed `sock` (EOF or reset), False if it is still open after `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _works(address: str, token: str, timeout: float = 60.0) -> None:
    """A real client connects, authenticates and gets an answer within `timeout` (generous: loaded machine)."""

    async def go() -> None:
        async with shoal.AsyncClient(f"shoal://{address}", token=token) as c:
            await c.rpc("status")

    asyncio.run(asyncio.wait_for(go(), timeout))


@pytest.fixture
def guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("SHOAL_AUTH_TIMEOUT_S", "3")  # the node's and gateway's pre-auth deadline
    monkeypatch.setenv("SHOAL_PEER_INFLIGHT_MB", "64")  # request bytes in flight per address
    lc = LocalCluster(tmp_path, nodes=1, prefix="tg")
    try:
        lc.add_gateway()
        _wait_healthy(lc.gateways[0].address, lc.cluster_token, 1)
        yield lc
    finally:
        lc.stop()
    assert not no_leftovers(lc.nodes[0].home, lc.nodes[0].cgroup_parent, node_stopped=True)


def test_unauthenticated_peers_cannot_make_node_or_gateway_buffer_or_hold(guarded: LocalCluster) -> None:
    targets = [
        (guarded.nodes[0].address, guarded.nodes[0].pid),
        (guarded.gateways[0].address, guarded.gateways[0].proc.pid),
    ]
    token = guarded.project_tokens["default"]
    for address, pid in targets:
        before = _rss_mb(pid)
        # a 256 MiB length prefix before auth: refused at once, not buffered
        huge = [_raw(address, "127.0.0.2") for _ in range(4)]
        for sock in huge:
            try:
                sock.sendall(struct.pack(">I", (256 << 20) - 1) + b"\0" * (4 << 20))
            except (ConnectionResetError, BrokenPipeError):
                pass
        assert all(_closed_by_peer(s, 20) for s in huge), f"{address} kept a connection sending a 256 MiB frame"
        for sock in huge:
            sock.close()
        # many connections that never authenticate: over the per-peer cap they are closed at once, the rest
        # at the auth deadline, and a real client from another address is served meanwhile
        held = [_raw(address, "127.0.0.3") for _ in range(200)]
        _works(address, token)
        closed_now = sum(_closed_by_peer(s, 0.5) for s in held)
        assert closed_now >= 100, f"only {closed_now} of 200 unauthenticated connections were refused"
        deadline = time.monotonic() + 60
        assert all(_closed_by_peer(s, max(0.1, deadline - time.monotonic())) for s in held), "not timed out"
        for sock in held:
            sock.close()
        assert _rss_mb(pid) - before < 64, f"{address}: RSS grew {_rss_mb(pid) - before:.0f} MiB"
        _works(address, token)


def _authenticated(address: str, source: str, token: str) -> socket.socket:
    from shoal import protocol

    sock = _raw(address, source)
    sock.sendall(protocol.encode(protocol.Request(id=1, op="auth", args={"token": token})))
    length = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))[0]
    answer = protocol.decode_response(sock.recv(length, socket.MSG_WAITALL))
    assert answer.error is None, answer.error
    return sock


def test_a_token_holder_cannot_make_node_or_gateway_buffer_frames_without_bound(guarded: LocalCluster) -> None:
    """Partial 40 MiB frames on 8 authenticated connections from one address: only what the address's
    budget (SHOAL_PEER_INFLIGHT_MB=64 here) allows is read; the rest waits in TCP (RSS grew by all of it
    before), other addresses are served meanwhile, and the budget comes back when the connections close."""
    from shoal import protocol

    token = guarded.project_tokens["default"]
    targets = [
        (guarded.nodes[0].address, guarded.nodes[0].pid),
        (guarded.gateways[0].address, guarded.gateways[0].proc.pid),
    ]
    for address, pid in targets:
        before = _rss_mb(pid)
        socks = [_authenticated(address, "127.0.0.4", token) for _ in range(8)]
        chunk = b"\0" * (1 << 20)
        for sock in socks:
            sock.settimeout(0.5)
            try:
                sock.sendall(struct.pack(">I", 40 << 20))
                for _ in range(39):  # all of the frame but its last MiB: it stays buffered, unanswered
                    sock.sendall(chunk)
            except TimeoutError:  # this connection's frame waits for budget: TCP pushes back
                pass
        time.sleep(1.0)
        grew = _rss_mb(pid) - before
        _works(address, token)  # another address is served meanwhile
        assert grew < 140, f"{address}: RSS grew {grew:.0f} MiB for 8 partial 40 MiB frames (budget 64 MiB)"
        for sock in socks:
            sock.close()
        sock = _authenticated(address, "127.0.0.4", token)  # the address's budget was given back
        sock.settimeout(30)
        sock.sendall(protocol.encode(protocol.Request(id=2, op="status", args={})))
        length = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))[0]
        assert protocol.decode_response(sock.recv(length, socket.MSG_WAITALL)).error is None
        sock.close()


def test_out_of_file_descriptors_backs_off_logs_once_and_recovers(guarded: LocalCluster) -> None:
    gw = guarded.gateways[0]
    resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE, (128, 128))
    log = guarded.workdir / f"{gw.name}.log"
    socks = []
    try:
        for i in range(300):  # from many addresses (under the per-peer caps): the fd limit is what runs out
            socks.append(_raw(gw.address, f"127.0.{1 + i // 8}.{10 + i % 8}"))
        time.sleep(1.0)
        # without closing anything here: the gateway drops the unauthenticated ones at the auth deadline,
        # accepts again, and a real client gets through
        _works(gw.address, guarded.project_tokens["default"], timeout=90)
    finally:
        for sock in socks:
            sock.close()
    text = log.read_text(errors="replace")
    assert "out of file descriptors" in text, "the gateway never ran out of fds: the test did not test anything"
    assert text.count("out of file descriptors") <= 3, "EMFILE logged more than once per episode"
    assert text.count("Too many open files") <= 3
    assert len(text) < 200_000


def test_http_checks_the_token_before_reading_a_body(guarded: LocalCluster) -> None:
    host, port = guarded.gateways[0].http.rsplit(":", 1)
    token = guarded.project_tokens["default"]

    def head_only(auth: str) -> bytes:
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(
                f"PUT /v1/sandboxes/tg1-000000000000/files?path=/a HTTP/1.1\r\nHost: x\r\n{auth}"
                f"Content-Length: {200 << 20}\r\n\r\n".encode()
            )
            return sock.recv(4096)

    assert head_only("").startswith(b"HTTP/1.1 401"), "the gateway waited for the body before checking the token"
    assert head_only(f"Authorization: Bearer {token}\r\n").startswith(b"HTTP/1.1 413")
    # a connection that never sends a request is closed at the deadline
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        assert _closed_by_peer(sock, 60)


# ---------------------------------------------------------------- projects are isolated (issue 18, items 1-3)


def _rpc(c: shoal.Client, op: str, args: dict | None = None) -> object:
    return c._run(c._async.rpc(op, args or {}))


def _node_client(lc: LocalCluster, project: str, node: int = 0) -> shoal.Client:
    return shoal.Client(f"shoal://{lc.nodes[node].address}", token=lc.project_tokens[project])


def test_snapshot_is_an_id_never_a_path(cluster: LocalCluster, tmp_path: Path) -> None:
    """`snapshot=` naming a directory of the caller's choosing must not make the node start QEMU with the
    machine config (QEMU arguments) found there: it is refused as not a snapshot id, on the node's TCP port,
    through the gateway and through the gateway's HTTP API."""
    marker = tmp_path / "host-file-made-by-qemu"
    planted = tmp_path / "planted"
    planted.mkdir()
    config = {
        "machine": "q35", "accel": "tcg", "cpus": 1, "memory_mb": 64, "kernel": "/nonexistent",
        "initramfs": "/nonexistent", "cmdline": "", "extra_args": ["-chardev", f"file,id=pwn,path={marker}"],
    }  # fmt: skip
    (planted / "meta.json").write_text(json.dumps({"config": config, "kind": "microvm", "image": "busybox"}))
    (planted / "memory").write_bytes(b"")
    with _node_client(cluster, "bob") as direct, _client(cluster, "bob") as via_gateway:
        if "microvm" not in direct.kinds():
            pytest.skip("QEMU is not installed on this node")
        for c in (direct, via_gateway):
            for bad in (str(planted), f"../../../..{planted}", "snap-../../x", "snap-0123456789abc"):
                with pytest.raises(shoal.InvalidRequestError, match="not a snapshot id"):
                    c.create("microvm", snapshot=bad, pool=False)
        gw = cluster.gateways[0]
        req = urllib.request.Request(
            f"http://{gw.http}/v1/sandboxes",
            data=json.dumps({"kind": "microvm", "snapshot": str(planted), "pool": False}).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {cluster.project_tokens['bob']}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req)
        assert refused.value.code == 400 and "not a snapshot id" in refused.value.read().decode()
        assert direct.list() == []
    assert not marker.exists()


def test_function_sandboxes_belong_to_their_project(cluster: LocalCluster) -> None:
    """Another project's function sandbox is "not found" for every operation by ID, and function sandboxes
    count against the sandbox quota (alice may hold 3)."""
    with _node_client(cluster, "bob") as bob, _node_client(cluster, "alice") as alice:
        fn = bob.create("function", image="debian")
        try:
            fn.files.write("/tmp/secret", b"bob's")
            fid = fn.id
            attempts = {
                "get": {"sandbox_id": fid},
                "exec": {"req": {"sandbox_id": fid, "cmd": "cat /tmp/secret"}},
                "file_read": {"sandbox_id": fid, "path": "/tmp/secret"},
                "file_write": {"sandbox_id": fid, "path": "/tmp/secret", "data": b"alice's"},
                "file_list": {"sandbox_id": fid, "path": "/tmp"},
                "keepalive": {"sandbox_id": fid},
                "fn_call": {"spec": {"kind": "function"}, "call": {"source": "1"}, "sandbox_id": fid},
                "kill": {"sandbox_id": fid},
            }
            for op, args in attempts.items():
                with pytest.raises(shoal.SandboxNotFoundError, match="alice"):
                    _rpc(alice, op, args)
            assert fn.files.read("/tmp/secret") == b"bob's" and fn.exec("cat /tmp/secret").stdout == "bob's"
            assert alice.list() == []
        finally:
            fn.close()
        made = [alice.create("function", image="debian") for _ in range(3)]
        try:
            with pytest.raises(shoal.QuotaExceededError, match="sandboxes quota"):
                alice.create("function", image="debian")
        finally:
            for sb in made:
                sb.close()
    with _client(cluster, "alice") as alice:  # the gateway counts them too (from the nodes' figures)
        made = alice.create_many(3, "function", image="debian")
        try:
            assert all(isinstance(s, shoal.Sandbox) for s in made), made
            with pytest.raises(shoal.QuotaExceededError, match="sandboxes quota"):
                alice.create("function", image="debian")
        finally:
            for sb in made:
                if isinstance(sb, shoal.Sandbox):
                    sb.close()


def test_trajectory_names_are_per_project(cluster: LocalCluster) -> None:
    """Two projects naming a trajectory alike get two sandboxes; one cannot attach to (hijack) or squat the
    other's name."""
    with _node_client(cluster, "bob") as bob, _node_client(cluster, "alice") as alice:
        theirs = bob.create(image="busybox", pool=False, trajectory="run/ep1")
        squat = alice.create(image="busybox", pool=False, trajectory="run/ep2")  # before bob uses the name
        try:
            theirs.exec("echo bob > /tmp/who")
            mine = alice.create(image="busybox", pool=False, trajectory="run/ep1")
            try:
                assert mine.id != theirs.id and mine.info.trajectory == "run/ep1"
                assert mine.exec("cat /tmp/who 2>&1").exit_code != 0  # not bob's sandbox
                assert bob.create(image="busybox", pool=False, trajectory="run/ep1").id == theirs.id
            finally:
                mine.close()
            later = bob.create(image="busybox", pool=False, trajectory="run/ep2")
            try:
                assert later.id != squat.id and later.info.trajectory == "run/ep2"
                assert [s.id for s in alice.list()] == [squat.id]
            finally:
                later.close()
        finally:
            theirs.close()
            squat.close()


def test_status_of_a_project_shows_only_its_own(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    with (
        _node_client(cluster, "bob") as bob,
        _node_client(cluster, "alice") as alice,
        _client(cluster, "bob") as gw,
        bob.create(image="busybox", pool=False),
    ):
        for status in (alice.status(), *gw.status()["nodes"].values()):
            assert str(node.home) not in json.dumps(status) and "home" not in status
            assert set(status["projects"]) <= {"alice", "bob"} and len(status["projects"]) == 1
        assert alice.status()["sandboxes"] == 0 and set(alice.status()["projects"]) == {"alice"}
        assert bob.status()["sandboxes"] == 1


def test_vm_snapshots_belong_to_their_project(cluster: LocalCluster) -> None:
    """Another project can neither restore (read) nor delete a VM snapshot."""
    with _node_client(cluster, "bob") as bob, _node_client(cluster, "alice") as alice:
        if "microvm" not in bob.kinds():
            pytest.skip("QEMU is not installed on this node")
        with bob.create("microvm", image="busybox", pool=False) as vm:
            vm.files.write("/root/secret", b"bob's secret")
            snap = vm.snapshot()
        try:
            with pytest.raises(shoal.NotFoundError, match="no snapshot"):
                alice.create("microvm", snapshot=snap, pool=False)
            with pytest.raises(shoal.NotFoundError, match="no snapshot"):
                alice.delete_snapshot(snap)
            assert alice.list() == []
            with bob.create("microvm", snapshot=snap, pool=False) as copy:  # still there, still bob's
                assert copy.files.read("/root/secret") == b"bob's secret"
        finally:
            bob.delete_snapshot(snap)


def test_images_are_per_project_and_shared_ones_read_only(tmp_path: Path) -> None:
    """A project's `sb.snapshot(name)` lands in its own namespace: it cannot replace a shared image (builtins,
    operator images) that other projects create from, read another project's image, or see its name.
    A cluster with a store of its own: a regression must not poison the store other tests share."""
    lc = LocalCluster(tmp_path, nodes=1, images=str(tmp_path / "store"), projects={"alice": {}, "bob": {}}, prefix="ti")
    name = "env1"
    try:
        lc.add_gateway()
        _wait_healthy(lc.gateways[0].address, lc.cluster_token, 1)
        with _node_client(lc, "bob") as bob, _node_client(lc, "alice") as alice:
            with bob.create(image="busybox", pool=False) as sb:
                sb.exec("echo 'exit 0 # planted reward' > /reward.sh")
                assert sb.snapshot("busybox")["name"] == "busybox"  # bob's own busybox, not the shared one
                assert sb.snapshot(name)["name"] == name
            with _client(lc, "alice") as via_gateway:  # the shared busybox is untouched, on every path
                for c in (alice, via_gateway):
                    with c.create(image="busybox", pool=False) as clean:
                        assert clean.exec("test -e /reward.sh").exit_code == 1 and clean.info.image == "busybox"
            with bob.create(image="busybox", pool=False) as shadow, bob.create(image=name, pool=False) as again:
                assert shadow.exec("cat /reward.sh").exit_code == 0 and shadow.info.image == "busybox"
                assert again.exec("cat /reward.sh").exit_code == 0 and again.info.image == name
            assert name in bob.images() and name in {i["name"] for i in bob.image_list()}
            assert bob.image_inspect(name)["name"] == name
            assert name not in alice.images() and not any(n.startswith("@") for n in alice.images())
            assert not any(i["name"].startswith("@") or i["name"] == name for i in alice.image_list())
            with pytest.raises(shoal.ImageNotFoundError, match=name):
                alice.create(image=name, pool=False)
            with pytest.raises(shoal.InvalidRequestError, match="reserved"):
                alice.create(image=f"@bob/{name}", pool=False)
            with pytest.raises(shoal.InvalidRequestError, match="reserved"):
                alice.image_inspect(f"@bob/{name}")
            with alice.create(image="busybox", pool=False) as sb:  # the same name: alice's own image
                sb.exec("echo alice > /who")
                sb.snapshot(name)
            with alice.create(image=name, pool=False) as mine, bob.create(image=name, pool=False) as theirs:
                assert mine.exec("cat /who; test -e /reward.sh").stdout == "alice\n"
                assert theirs.exec("cat /who 2>&1; cat /reward.sh").stdout.endswith("planted reward\n")
    finally:
        lc.stop()
    node = lc.nodes[0]
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)
