"""shoal on Ray: one node agent per Ray node, gateways, and a controller that keeps them in step.

- `NodeAgent` (an actor pinned to its Ray node, num_cpus=0) supervises one `python -m shoal.node` process
  with its own SHOAL_HOME, node ID and cgroup parent, serving TCP; it restarts the process if it dies (the
  restarted node cleans up what the dead one left, and reports those sandboxes lost). Sandboxes are never
  actors: a node holds thousands of them.
- `GatewayAgent` supervises one `python -m shoal.cluster.gateway` process.
- `Controller` (a detached named actor) reconciles every second: an agent for every alive Ray node that
  matches the selector, the membership pushed to every gateway, departed nodes reported as gone.

`shoal cluster up` / `down` / `status` drive it; `shoal.Client(ray_address="auto")` asks it for a gateway.

TLS (`shoal cluster up --tls DIR`): a CA is made in DIR on the machine running `cluster up` and handed to the
controller, which issues every node and gateway a certificate for its Ray node's address; each then serves
TLS only (tokens in clear are refused), gateways verify their nodes, and `connect_info` gives clients the
CA, so `shoal.Client(ray_address=...)` speaks TLS with no file to copy. The CA key stays with the controller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal import tls
from shoal.client.ray import CONTROLLER, NAMESPACE, ask_controller, controller, ensure_ray
from shoal.cluster.auth import CLUSTER_ROLE, new_token
from shoal.errors import NodeError
from shoal.settings import IMAGES_DIR

log = logging.getLogger("shoal.ray")


class Supervisor:
    """Run a process; restart it when it dies (until `stop`); its address is read from `addr_file`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], addr_file: Path, log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.addr_file = addr_file
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.stopping = False
        self.address = ""
        self._start()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _start(self, timeout: float = 60.0) -> None:
        self.addr_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                cwd="/",
                start_new_session=True,  # outlives a kill of the worker process group: it stops itself, cleanly
            )
        deadline = time.monotonic() + timeout
        while not self._published():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace").splitlines()[-10:]
                raise NodeError(
                    f"{self.name} did not start (exit {self.proc.poll()}); its log ends:\n" + "\n".join(tail)
                )
            time.sleep(0.05)
        host, _, port = self.addr_file.read_text().strip().rpartition(":")
        if host in ("0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        self.address = f"{host}:{port}"

    def _published(self) -> bool:
        """The process has written its whole `host:port` (also from a version that wrote the file in place)."""
        try:
            host, _, port = self.addr_file.read_text().strip().rpartition(":")
        except FileNotFoundError:
            return False
        return bool(host) and port.isdigit()

    def _watch(self) -> None:
        while not self.stopping:
            assert self.proc is not None
            code = self.proc.wait()
            if self.stopping:
                return
            log.warning("%s exited with %s: restarting it", self.name, code)
            time.sleep(min(5.0, 0.5 * (self.restarts + 1)))
            try:
                self._start()
                self.restarts += 1  # counted once it serves again, at its new address
            except Exception as exc:  # keep trying: the next wait returns at once
                log.error("%s: restart failed: %s", self.name, exc)

    def kill(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 120.0) -> int | None:
        self.stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _run_async(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, even where this thread has a loop (Ray actors)."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=asyncio.run(coro)))
    thread.start()
    thread.join()
    return box.get("result")


def _tls_env(directory: Path, name: str, certificate: dict[str, str] | None) -> dict[str, str]:
    """With a certificate from the controller: its files, and tokens in clear refused (TLS only)."""
    if certificate is None:
        return {}
    return {**tls.write_material(directory, name, certificate), "SHOAL_PLAINTEXT_TOKENS": "0"}


def _env(extra: dict[str, str]) -> dict[str, str]:
    """Nodes and gateways on Ray speak plain TCP inside the Ray cluster's network, which shoal takes as
    trusted (docs/SECURITY.md): tokens between Ray machines are allowed in clear unless the environment says
    SHOAL_PLAINTEXT_TOKENS=0."""
    return {"SHOAL_PLAINTEXT_TOKENS": "1", **os.environ, **extra, "SHOAL_PARENT_PID": str(os.getpid())}


@ray.remote(num_cpus=0, max_concurrency=4)
class NodeAgent:
    """The shoal node of one Ray node."""

    def __init__(
        self, node_id: str, home: str, tokens: dict[str, Any], settings: dict[str, str],
        certificate: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.node_id = node_id
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        tokens_file = self.home / "tokens.json"
        tokens_file.write_text(json.dumps(tokens))
        tokens_file.chmod(0o600)
        env = {
            "SHOAL_HOME": str(self.home),
            "SHOAL_NODE_ID": node_id,
            "SHOAL_CGROUP_PARENT": f"shoal-{node_id}",
            "SHOAL_TCP": settings.get("tcp", "0.0.0.0:0"),
            "SHOAL_HTTP": settings.get("http", "0.0.0.0:0"),
            "SHOAL_TOKENS": str(tokens_file),
            # images are shared by the nodes of a machine (read-only layers), not built once per node
            "SHOAL_IMAGES": IMAGES_DIR.raw() or "/var/lib/shoal/store",
            **{k: v for k, v in settings.items() if k.startswith("SHOAL_")},
            **_tls_env(self.home / "tls", node_id, certificate),
        }
        self.supervisor = Supervisor(
            f"node {node_id}", [sys.executable, "-m", "shoal.node"], _env(env), self.home / "node.addr",
            self.home / "node.log",
        )  # fmt: skip

    def info(self) -> dict[str, Any]:
        proc = self.supervisor.proc
        http = (self.home / "node.http").read_text().strip() if (self.home / "node.http").exists() else ""
        return {
            "node_id": self.node_id,
            "address": self.supervisor.address,
            "http": http.replace("0.0.0.0", ray.util.get_node_ip_address()),
            "pid": proc.pid if proc else None,
            "alive": proc is not None and proc.poll() is None,
            "restarts": self.supervisor.restarts,
            "home": str(self.home),
            "cgroup_parent": f"shoal-{self.node_id}",
            "ray_node_id": ray.get_runtime_context().get_node_id(),
        }

    def kill_node(self, sig: int = signal.SIGKILL) -> None:
        """Kill the node process (for tests and drills); the supervisor restarts it."""
        self.supervisor.kill(sig)

    def stop(self) -> int | None:
        from shoal.cluster.local import remove_cgroup_parent

        code = self.supervisor.stop()
        remove_cgroup_parent(f"shoal-{self.node_id}")
        return code


@ray.remote(num_cpus=0, max_concurrency=4)
class GatewayAgent:
    def __init__(
        self, name: str, workdir: str, tokens: dict[str, Any], listen: str, options: list[str],
        certificate: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        tokens_file = self.workdir / f"{name}.tokens.json"
        tokens_file.write_text(json.dumps(tokens))
        tokens_file.chmod(0o600)
        addr = self.workdir / f"{name}.addr"
        argv = [sys.executable, "-m", "shoal.cluster.gateway", "--listen", listen, "--name", name]
        argv += ["--tokens", str(tokens_file), "--addr-file", str(addr), "--http", "0.0.0.0:0", *options]
        env = _env(_tls_env(self.workdir / f"tls-{name}", name, certificate))
        self.supervisor = Supervisor(f"gateway {name}", argv, env, addr, self.workdir / f"{name}.log")
        self.http_file = Path(str(addr) + ".http")

    def info(self) -> dict[str, Any]:
        http = self.http_file.read_text().strip() if self.http_file.exists() else ""
        proc = self.supervisor.proc
        return {
            "address": self.supervisor.address,
            "http": http.replace("0.0.0.0", ray.util.get_node_ip_address()),
            "pid": proc.pid if proc else None,
            "restarts": self.supervisor.restarts,
        }

    def kill_gateway(self, sig: int = signal.SIGKILL) -> None:
        self.supervisor.kill(sig)

    def stop(self) -> int | None:
        return self.supervisor.stop()


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    """Keeps one node agent per (selected) alive Ray node and tells the gateways who is where."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.home = config.get("home", "/var/lib/shoal/cluster")
        self.selector = config.get("resource")  # only Ray nodes offering this custom resource
        self.tokens: dict[str, Any] = config["tokens"]
        self.cluster_token = next(t for t, p in self.tokens["tokens"].items() if p == CLUSTER_ROLE)
        self.agents: dict[str, Any] = {}  # ray node id -> actor
        self.infos: dict[str, dict[str, Any]] = {}  # ray node id -> last info
        self.gone: dict[str, str] = {}  # shoal node id -> reason
        self.gateways: list[Any] = []
        self.gateway_infos: list[dict[str, Any]] = []
        self.stopping = False
        self.ca: str | None = None  # the CA's PEM when the cluster speaks TLS
        self.client_tls: Any = None
        if config.get("tls"):
            self.ca_dir = Path(self.home) / "tls-ca"
            tls.write_material(self.ca_dir, "ca", {"cert": config["tls"]["ca"], "key": config["tls"]["ca_key"],
                                                   "ca": config["tls"]["ca"]})  # fmt: skip
            self.ca = config["tls"]["ca"]
            self.client_tls = tls.client_context(cadata=self.ca)
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.ready = threading.Event()
        self.failure: str | None = None
        # runs from the constructor, so a controller that Ray restarts (max_restarts) resumes by itself,
        # adopting the agents and gateways that outlived it (they are detached and named)
        threading.Thread(target=self._run, daemon=True).start()

    def start(self, timeout: float = 180.0) -> bool:
        """Wait until the gateways are up and the first reconciliation is done."""
        if not self.ready.wait(timeout):
            raise NodeError(f"the shoal controller did not come up within {timeout} s: {self.errors}")
        if self.failure:
            raise NodeError(f"the shoal controller could not start: {self.failure}")
        return True

    def _run(self) -> None:
        try:
            self._start_gateways()
            self.reconcile()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.ready.set()
        self._loop()

    def _start_gateways(self) -> None:
        count = int(self.config.get("gateways", 1))
        port = int(self.config.get("gateway_port", 0))
        options = [str(o) for o in self.config.get("gateway_options", [])]
        here = ray.get_runtime_context().get_node_id()
        everywhere = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})  # where it may run
        for i in range(count):
            listen = f"0.0.0.0:{port + i if port else 0}"
            agent = _adopt(f"shoal-gateway-{i + 1}") or GatewayAgent.options(
                name=f"shoal-gateway-{i + 1}", namespace=NAMESPACE, lifetime="detached",
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
            ).remote(f"gw{i + 1}", f"{self.home}/gateways", self.tokens, listen, options,
                     self._certificate(f"gw{i + 1}", everywhere))  # fmt: skip
            self.gateways.append(agent)
        self.gateway_infos = ray.get([g.info.remote() for g in self.gateways], timeout=120)

    def _loop(self) -> None:
        while not self.stopping:
            time.sleep(float(self.config.get("interval", 1.0)))
            try:
                self.reconcile()
            except Exception as exc:
                self.errors = [*self.errors[-9:], f"{time.time():.0f}: {exc}"]

    @staticmethod
    def node_id(ray_node_id: str) -> str:
        return "r" + ray_node_id[:10]

    def reconcile(self) -> None:
        with self.lock:
            if self.stopping:
                return
            alive = {
                n["NodeID"]: n
                for n in ray.nodes()
                if n["Alive"] and (not self.selector or self.selector in n.get("Resources", {}))
            }
            for rid in list(self.agents):
                if rid not in alive:
                    self._drop(rid, "its Ray node left or died")
            for rid in alive:
                if rid not in self.agents:
                    node_id = self.node_id(rid)
                    settings = dict(self.config.get("node_env", {}))
                    adopted = _adopt(f"shoal-node-{node_id}")
                    if adopted is not None:
                        self.agents[rid] = adopted
                        continue
                    try:
                        self.agents[rid] = NodeAgent.options(
                            name=f"shoal-node-{node_id}", namespace=NAMESPACE, lifetime="detached",
                            scheduling_strategy=NodeAffinitySchedulingStrategy(rid, soft=False),
                        ).remote(node_id, f"{self.home}/{node_id}", self.tokens, settings,
                                 self._certificate(node_id, [alive[rid]["NodeManagerAddress"]]))  # fmt: skip
                    except ValueError:  # the name of an agent that is being killed: next round
                        continue
                    self.gone.pop(node_id, None)
            refs = {rid: agent.info.remote() for rid, agent in self.agents.items()}
            for rid, ref in refs.items():
                try:
                    self.infos[rid] = ray.get(ref, timeout=90)
                except ray.exceptions.GetTimeoutError:
                    pass  # still starting
                except ray.exceptions.RayError as exc:
                    self._drop(rid, f"its node agent died ({type(exc).__name__})")
            try:
                self.gateway_infos = ray.get([g.info.remote() for g in self.gateways], timeout=10)
            except ray.exceptions.RayError as exc:
                self.errors = [*self.errors[-9:], f"gateway info: {exc}"]
            nodes = {i["node_id"]: i["address"] for i in self.infos.values() if i.get("address")}
            _run_async(self._push(nodes))

    def _certificate(self, name: str, hosts: list[str]) -> dict[str, str] | None:
        """PEM cert, key and CA for `name` valid for `hosts` (None without TLS); issued here, so the CA
        key never leaves the controller."""
        if self.ca is None:
            return None
        cert, key = tls.issue(self.ca_dir, name, hosts)
        material = {"cert": cert.read_text(), "key": key.read_text(), "ca": self.ca}
        key.unlink()
        return material

    def _drop(self, rid: str, reason: str) -> None:
        agent = self.agents.pop(rid, None)
        info = self.infos.pop(rid, None)
        self.gone[self.node_id(rid)] = reason
        if agent is not None:
            try:
                ray.kill(agent)
            except Exception:  # noqa: S110 - already gone
                pass
        del info

    async def _push(self, nodes: dict[str, str]) -> None:
        from shoal.client.transport import Connection

        for info in self.gateway_infos:
            host, _, port = info["address"].rpartition(":")
            try:
                conn = await asyncio.wait_for(
                    Connection.open_tcp(
                        host, int(port), self.cluster_token, plaintext_ok=True, tls_context=self.client_tls
                    ),
                    5,
                )
                try:
                    await asyncio.wait_for(conn.call("cluster_nodes", {"nodes": nodes, "gone": self.gone}), 5)
                finally:
                    await conn.close()
            except Exception as exc:
                self.errors = [*self.errors[-9:], f"push to gateway {info['address']}: {exc}"]

    def connect_info(self, project: str | None = None) -> dict[str, Any]:
        project = project or "default"
        token = next((t for t, p in self.tokens["tokens"].items() if p == project), None)
        if token is None:
            raise NodeError(f"project {project!r} has no token in this cluster; known: {self.projects()}")
        gateways = []
        for info in self.gateway_infos:
            host, _, port = info["address"].rpartition(":")
            gateways.append((host, int(port)))
        return {"gateways": gateways, "token": token, **({"tls_ca": self.ca} if self.ca else {})}

    def projects(self) -> list[str]:
        return sorted({p for p in self.tokens["tokens"].values() if p != CLUSTER_ROLE})

    def status(self) -> dict[str, Any]:
        return {
            "nodes": {i["node_id"]: i for i in self.infos.values()},
            "gone": dict(self.gone),
            "gateways": self.gateway_infos,
            "errors": self.errors,
        }

    def cluster_token_for_admin(self) -> str:
        return self.cluster_token

    def stop(self) -> dict[str, Any]:
        """Stop every gateway and node (each node closes its sandboxes), then the agents themselves."""
        self.stopping = True
        with self.lock:
            codes = {}
            for agent in self.gateways:
                try:
                    ray.get(agent.stop.remote(), timeout=60)
                except ray.exceptions.RayError:
                    pass
                ray.kill(agent)
            results = {rid: agent.stop.remote() for rid, agent in self.agents.items()}
            for rid, ref in results.items():
                try:
                    codes[self.node_id(rid)] = ray.get(ref, timeout=180)
                except ray.exceptions.RayError as exc:
                    codes[self.node_id(rid)] = str(exc)
                ray.kill(self.agents[rid])
            self.agents.clear()
            self.gateways.clear()
            return codes


def _adopt(name: str) -> Any:
    """The named actor if it exists (outlived an earlier controller), else None."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def default_tokens(projects: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A token file for a new cluster: the cluster's own token and one per project (default: `default`)."""
    projects = projects or {"default": {}}
    tokens = {new_token(): name for name in projects}
    tokens[new_token()] = CLUSTER_ROLE
    return {"projects": projects, "tokens": tokens}


def cluster_up(
    address: str | None = None,
    *,
    home: str = "/var/lib/shoal/cluster",
    gateways: int = 1,
    gateway_port: int = 0,
    tokens: dict[str, Any] | None = None,
    node_env: dict[str, str] | None = None,
    resource: str | None = None,
    gateway_options: list[str] | None = None,
    wait_nodes: int = 1,
    timeout: float = 180.0,
    tls_dir: str | None = None,
) -> dict[str, Any]:
    """Start shoal on the Ray cluster at `address`: a node agent on every (selected) Ray node, and gateways.
    With `tls_dir`, every port speaks TLS with certificates of a CA made there (kept if present; clients
    may use its ca.crt, or get the CA from `connect_info`).

    Idempotent: a running controller is reused. Returns `{"gateways": [...], "token": ..., "status": ...}`
    (and `tls_ca`, the CA's PEM, with TLS).
    """
    ensure_ray(address)
    here = ray.get_runtime_context().get_node_id()
    config = {
        "home": home,
        "gateways": gateways,
        "gateway_port": gateway_port,
        "tokens": tokens or default_tokens(),
        "node_env": node_env or {},
        "resource": resource,
        "gateway_options": gateway_options or [],
    }
    if tls_dir is not None:
        ca = tls.make_ca(tls_dir)
        config["tls"] = {"ca": ca.read_text(), "ca_key": (ca.parent / "ca.key").read_text()}
    ctl = Controller.options(
        name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
    ).remote(config)  # fmt: skip
    ray.get(ctl.start.remote(), timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        status = ray.get(ctl.status.remote())
        if len([n for n in status["nodes"].values() if n.get("alive")]) >= wait_nodes:
            break
        if time.monotonic() > deadline:
            raise NodeError(f"only {len(status['nodes'])} of {wait_nodes} shoal nodes came up: {status}")
        time.sleep(0.5)
    info = ray.get(ctl.connect_info.remote())
    return {**info, "status": status}


def cluster_down(address: str | None = None) -> dict[str, Any]:
    """Stop every shoal node (closing its sandboxes) and gateway on this Ray cluster, then the controller."""
    ensure_ray(address)
    ctl = controller()
    codes = ray.get(ctl.stop.remote(), timeout=600)
    ray.kill(ctl)
    return codes


def cluster_status(address: str | None = None) -> dict[str, Any]:
    ensure_ray(address)
    return ask_controller("status")
