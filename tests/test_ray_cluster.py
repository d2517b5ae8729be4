"""shoal deployed on a real multi-node Ray cluster on this machine (a head and two worker Ray nodes, each a
separate raylet with its own shoal node agent and state directory)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import IMAGES, no_leftovers

import shoal

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'shoal[cluster]'")

from ray.cluster_utils import Cluster  # noqa: E402

from shoal.client.ray import connect_info  # noqa: E402
from shoal.cluster import ray as shoal_ray  # noqa: E402
from shoal.cluster.local import remove_cgroup_parent  # noqa: E402


class RayShoal:
    def __init__(self, cluster: Cluster, home: Path, info: dict) -> None:
        self.cluster = cluster
        self.home = home
        self.info = info

    def status(self) -> dict:
        return shoal_ray.cluster_status()

    def wait(self, predicate, timeout: float = 150.0) -> dict:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.status()
            except ray.exceptions.RayError as exc:  # the controller is restarting: ask again
                status = {"error": str(exc)}
            if "error" not in status and predicate(status):
                return status
            assert time.monotonic() < deadline, f"timed out; cluster status: {status}"
            time.sleep(0.5)

    def gateway_view(self) -> dict:
        with shoal.Client(ray_address=self.cluster.address) as c:
            token = ray.get(shoal_ray.controller().cluster_token_for_admin.remote())
            with shoal.Client(c._async.address, token=token) as admin:
                return admin._run(admin._async.call("cluster_status"))

    def wait_gateway(self, predicate, timeout: float = 150.0) -> dict:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while True:
            try:
                view = self.gateway_view()
            except (ray.exceptions.RayError, shoal.NodeError) as exc:  # restarting controller or gateway
                view = {"error": str(exc)}
            if "error" not in view and predicate(view):
                return view
            assert time.monotonic() < deadline, f"timed out; gateway view: {view}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_shoal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayShoal]:
    os.environ["RAY_TMPDIR"] = f"/tmp/rs8-{os.getpid()}"  # our own Ray state, address file included
    # shoal on Ray speaks plain TCP inside Ray's network (docs/SECURITY.md); this process calls the gateways
    # at the Ray node address (not loopback) with shoal:// addresses too, so it takes that network as trusted
    os.environ["SHOAL_PLAINTEXT_TOKENS"] = "1"
    home = tmp_path_factory.mktemp("ray-shoal")
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    except Exception as exc:  # pragma: no cover - only where Ray cannot run at all
        pytest.skip(f"Ray cannot start a cluster here: {exc}")
    homes: list[tuple[str, str]] = []
    try:
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace=shoal_ray.NAMESPACE, log_to_driver=False)
        env = {"SHOAL_IMAGES": str(IMAGES), "SHOAL_MAX_SANDBOXES": "6"}
        tokens = shoal_ray.default_tokens({"default": {}, "small": {"sandboxes": 2}})
        info = shoal_ray.cluster_up(home=str(home), gateways=2, node_env=env, wait_nodes=3, tokens=tokens)
        rs = RayShoal(cluster, home, info)
        rs.wait_gateway(lambda v: sum(n["healthy"] for n in v["nodes"].values()) == 3)
        yield rs
        homes = [(n["home"], n["cgroup_parent"]) for n in rs.status()["nodes"].values()]
        codes = shoal_ray.cluster_down()
        assert all(code == 0 for code in codes.values()), codes
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(os.environ.pop("RAY_TMPDIR"), ignore_errors=True)  # Ray's session logs
        os.environ.pop("SHOAL_PLAINTEXT_TOKENS", None)
    for node_home, cgroup_parent in homes:
        assert not no_leftovers(Path(node_home), cgroup_parent, node_stopped=True)
    assert not _processes(f"/tmp/rs8-{os.getpid()}") and not _processes(str(home))


def _processes(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                if (
                    marker.encode() in (proc / "cmdline").read_bytes()
                    or marker.encode() in (proc / "environ").read_bytes()
                ):
                    found.append(proc.name)
            except OSError:
                continue
    return found


def test_one_node_agent_per_ray_node_and_placement_spreads(ray_shoal: RayShoal) -> None:
    status = ray_shoal.status()
    ray_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {n["ray_node_id"] for n in status["nodes"].values()} == ray_nodes  # one each, on its own node
    assert len({n["home"] for n in status["nodes"].values()}) == 3
    with shoal.Client(ray_address=ray_shoal.cluster.address) as c:
        made = c.create_many(9, image="busybox", pool=False)
        try:
            assert all(isinstance(s, shoal.Sandbox) for s in made), made
            owners = {s.id.rsplit("-", 1)[0] for s in made}
            assert len(owners) == 3, owners
            assert {r.exec("echo ok").stdout for r in made} == {"ok\n"}
        finally:
            c.close_all()


def test_requests_route_through_either_gateway(ray_shoal: RayShoal) -> None:
    gateways, token = ray_shoal.info["gateways"], ray_shoal.info["token"]
    assert len(gateways) == 2
    first, second = (f"shoal://{h}:{p}" for h, p in gateways)
    with shoal.Client(first, token=token) as a, shoal.Client(second, token=token) as b:
        sb = a.create(image="busybox", pool=False)
        assert b.get(sb.id).exec("echo via-b").stdout == "via-b\n"
        b.kill(sb.id)


def test_a_fresh_process_connects_with_ray_address_and_the_cli_reports(ray_shoal: RayShoal) -> None:
    script = (
        "import shoal, ray\n"
        f"with shoal.Client(ray_address={ray_shoal.cluster.address!r}) as c:\n"
        "    with c.create(image='busybox', pool=False) as sb:\n"
        "        print(sb.exec('echo from-ray').stdout, end='')\n"
        "print('ray still connected:', ray.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "from-ray\nray still connected: False\n"
    cli = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "cluster", "status", "--ray-address", ray_shoal.cluster.address],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert len(json.loads(cli.stdout)["nodes"]) >= 3


def test_a_killed_gateway_loses_nothing_and_is_restarted(ray_shoal: RayShoal) -> None:
    token = ray_shoal.info["token"]
    both = ",".join(f"shoal://{h}:{p}" for h, p in ray_shoal.info["gateways"])
    agent = ray.get_actor("shoal-gateway-1", namespace=shoal_ray.NAMESPACE)
    with shoal.Client(both, token=token) as c:
        sb = c.create(image="busybox", pool=False)
        sb.exec("echo kept > /tmp/f")
        ray.get(agent.kill_gateway.remote(signal.SIGKILL))
        assert sb.files.read_text("/tmp/f") == "kept\n"  # through the other gateway
        ray_shoal.wait(lambda s: s["gateways"][0]["restarts"] >= 1)
        with shoal.Client(ray_address=ray_shoal.cluster.address) as fresh:  # finds the restarted one too
            assert fresh.get(sb.id).exec("cat /tmp/f").stdout == "kept\n"
        sb.close()


def test_tokens_quotas_and_admission_on_ray(ray_shoal: RayShoal) -> None:
    (host, port), _ = connect_info(ray_shoal.cluster.address)["gateways"]  # as they are now
    with pytest.raises(shoal.AuthenticationError, match="unknown token"):
        shoal.Client(f"shoal://{host}:{port}", token="shoal_forged")
    with shoal.Client(ray_address=ray_shoal.cluster.address, project="small") as small:
        try:
            small.create(image="busybox", pool=False)
            small.create(image="busybox", pool=False)
            with pytest.raises(shoal.QuotaExceededError, match="'small'.*sandboxes quota"):
                small.create(image="busybox", pool=False)
        finally:
            small.close_all()
    with pytest.raises(shoal.NodeError, match="no token"):
        shoal.Client(ray_address=ray_shoal.cluster.address, project="nobody")
    with shoal.Client(ray_address=ray_shoal.cluster.address) as c:  # 24 creates, 18 slots: the rest queue
        start = time.time()
        made = c.create_many(24, image="busybox", pool=False, ttl_s=2)
        assert all(isinstance(s, shoal.Sandbox) for s in made), made
        assert sum(s.info.created_at - start > 1.5 for s in made) >= 6


def test_killed_node_agent_loses_only_its_sandboxes_and_comes_back(ray_shoal: RayShoal) -> None:
    with shoal.Client(ray_address=ray_shoal.cluster.address) as c:
        made = c.create_many(6, image="busybox", pool=False)
        try:
            victim_id = made[0].id.rsplit("-", 1)[0]
            victims = [s for s in made if s.id.startswith(victim_id + "-")]
            others = [s for s in made if not s.id.startswith(victim_id + "-")]
            agent = ray.get_actor(f"shoal-node-{victim_id}", namespace=shoal_ray.NAMESPACE)
            ray.get(agent.kill_node.remote(signal.SIGKILL))
            for sb in victims:
                with pytest.raises(shoal.SandboxLostError, match=victim_id):
                    sb.exec("true")
            for sb in others:
                assert sb.exec("echo fine").stdout == "fine\n"
            # the agent restarts the node; the controller tells the gateways its new address
            ray_shoal.wait(lambda s: s["nodes"][victim_id]["restarts"] >= 1 and s["nodes"][victim_id]["alive"])
            ray_shoal.wait_gateway(lambda v: v["nodes"][victim_id]["healthy"])
            assert victims[0].exec("echo back").stdout == "back\n"  # re-adopted by the restarted node (issue 5)
        finally:
            c.close_all()


def test_a_restarted_controller_adopts_the_running_nodes(ray_shoal: RayShoal) -> None:
    before = {n: i["pid"] for n, i in ray_shoal.status()["nodes"].items()}
    ray.kill(shoal_ray.controller(), no_restart=False)  # Ray restarts it (max_restarts=-1)
    deadline = time.monotonic() + 150
    while True:
        try:
            after = {n: i["pid"] for n, i in ray_shoal.status()["nodes"].items()}
            if len(after) == len(before):
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "the controller did not come back"
        time.sleep(0.5)
    assert after == before  # the same node processes: adopted, not replaced
    with shoal.Client(ray_address=ray_shoal.cluster.address) as c, c.create(image="busybox", pool=False) as sb:
        assert sb.exec("echo still").stdout == "still\n"


def test_nodes_join_and_leave(ray_shoal: RayShoal) -> None:
    joined = ray_shoal.cluster.add_node(num_cpus=1)
    status = ray_shoal.wait(lambda s: len(s["nodes"]) == 4 and all(n.get("alive") for n in s["nodes"].values()))
    new_id = next(n["node_id"] for n in status["nodes"].values() if n["ray_node_id"] == joined.node_id)
    new_home = Path(status["nodes"][new_id]["home"])
    ray_shoal.wait_gateway(lambda v: v["nodes"].get(new_id, {}).get("healthy"))
    with shoal.Client(ray_address=ray_shoal.cluster.address) as c:
        made = c.create_many(12, image="busybox", pool=False)
        try:
            assert any(s.id.startswith(new_id + "-") for s in made)
            on_new = [s for s in made if s.id.startswith(new_id + "-")]
            ray_shoal.cluster.remove_node(joined)  # the Ray node goes away, and its shoal node with it
            ray_shoal.wait_gateway(lambda v: new_id in v["gone"])
            with pytest.raises(shoal.SandboxLostError, match="left the cluster"):
                on_new[0].exec("true")
            on_new[0].close()  # closing a sandbox whose node left is fine, as closing twice is
            rest = [s for s in made if not s.id.startswith(new_id + "-")]
            assert rest[0].exec("echo alive").stdout == "alive\n"
        finally:
            c.close_all()
    # the node stopped with its supervisor and closed its sandboxes on the way out
    assert not no_leftovers(new_home, f"shoal-{new_id}", timeout=150, node_stopped=True)
    remove_cgroup_parent(f"shoal-{new_id}")  # its agent died with the Ray node: tidy the empty parent here
