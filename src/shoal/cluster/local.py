"""A cluster of nodes and gateways as plain processes on one machine (tests, benchmarks, trying things out).

Each node gets its own SHOAL_HOME, node ID and cgroup parent; everything started is stopped by `stop()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shoal import settings
from shoal.cluster.auth import CLUSTER_ROLE, new_token
from shoal.config import Paths
from shoal.errors import NodeError
from shoal.tls import issue, make_ca


def remove_cgroup_parent(name: str) -> None:
    """Remove a stopped node's (empty) cgroup parent from every hierarchy; a busy one is left alone."""
    root = Path("/sys/fs/cgroup")
    for directory in [root / name, *(h / name for h in root.iterdir() if h.is_dir())]:
        try:
            directory.rmdir()
        except OSError:
            pass


class LocalNode:
    def __init__(self, node_id: str, home: Path, cgroup_parent: str, env: dict[str, str]) -> None:
        self.node_id = node_id
        self.home = home
        self.cgroup_parent = cgroup_parent
        self.env = env

    def start(self) -> LocalNode:
        from shoal.client.launch import spawn_background

        saved = dict(os.environ)
        os.environ.update(self.env, SHOAL_NODE_ID=self.node_id, SHOAL_CGROUP_PARENT=self.cgroup_parent)
        try:
            (self.home / "node.addr").unlink(missing_ok=True)
            spawn_background(Paths(self.home, Path(self.env.get("SHOAL_IMAGES", str(self.home / "images")))))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return self

    @property
    def address(self) -> str:
        return (self.home / "node.addr").read_text().strip()

    @property
    def http(self) -> str:
        return (self.home / "node.http").read_text().strip()

    @property
    def pid(self) -> int:
        return int((self.home / "node.lock").read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        try:
            pid = self.pid
            os.kill(pid, sig)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                break
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        else:
            raise NodeError(f"node {self.node_id} (pid {pid}) did not stop within {timeout} s")
        if sig == signal.SIGTERM:
            remove_cgroup_parent(self.cgroup_parent)


class LocalGateway:
    def __init__(
        self, name: str, tokens_file: Path, nodes: dict[str, str], workdir: Path, *args: str,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.addr_file = workdir / f"{name}.addr"
        self.addr_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "shoal.cluster.gateway", "--listen", "127.0.0.1:0", "--name", name]
        argv += ["--http", "127.0.0.1:0"]
        argv += ["--tokens", str(tokens_file), "--addr-file", str(self.addr_file), *args]
        for node_id, address in nodes.items():
            argv += ["--node", f"{node_id}={address}"]
        self.log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + 30
        while not self.addr_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise NodeError(f"gateway {name} did not start; see {workdir / (name + '.log')}")
            time.sleep(0.02)
        self.address = self.addr_file.read_text().strip()
        self.http = Path(str(self.addr_file) + ".http").read_text().strip()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.log.close()


class LocalCluster:
    """`nodes` nodes serving TCP, and gateways in front of them, with a token file made for the run."""

    def __init__(
        self,
        workdir: Path,
        nodes: int = 2,
        *,
        images: str | None = None,
        max_sandboxes: int = 20000,
        projects: dict[str, dict] | None = None,
        prefix: str = "lc",
        tls: bool = False,
    ) -> None:
        self.workdir = workdir
        # tls: a CA made for the run (workdir/tls/ca.crt, `self.ca`), a certificate per node and gateway;
        # every port then speaks only TLS and clients use shoals:// addresses with this CA
        self.ca: Path | None = make_ca(workdir / "tls") if tls else None
        workdir.mkdir(parents=True, exist_ok=True)
        self.cluster_token = new_token()
        self.tokens = {new_token(): name for name in (projects or {"default": {}})}
        self.project_tokens = {name: token for token, name in self.tokens.items()}
        self.tokens_file = workdir / "tokens.json"
        config = {"projects": projects or {}, "tokens": {**self.tokens, self.cluster_token: CLUSTER_ROLE}}
        self.tokens_file.write_text(json.dumps(config))
        self.tokens_file.chmod(0o600)
        env = {"SHOAL_TCP": "127.0.0.1:0", "SHOAL_TOKENS": str(self.tokens_file), "SHOAL_HTTP": "127.0.0.1:0"}
        env["SHOAL_MAX_SANDBOXES"] = str(max_sandboxes)
        env["SHOAL_IMAGES"] = images or settings.IMAGES_DIR.raw() or "/var/lib/shoal/store"
        self.env = env
        self.nodes: list[LocalNode] = []
        self.gateways: list[LocalGateway] = []
        self.prefix = prefix
        try:
            for i in range(nodes):
                self.add_node(f"{prefix}{i + 1}")
        except BaseException:
            self.stop()
            raise

    def _tls_env(self, name: str) -> dict[str, str]:
        if self.ca is None:
            return {}
        cert, key = issue(self.ca.parent, name, ["127.0.0.1"])
        return {"SHOAL_TLS_CERT": str(cert), "SHOAL_TLS_KEY": str(key), "SHOAL_TLS_CA": str(self.ca)}

    @property
    def scheme(self) -> str:
        return "shoals://" if self.ca else "shoal://"

    def add_node(self, node_id: str) -> LocalNode:
        env = {**self.env, **self._tls_env(node_id)}
        node = LocalNode(node_id, self.workdir / node_id, f"shoal-{node_id}-{os.getpid()}", env)
        node.home.mkdir(exist_ok=True)
        self.nodes.append(node)
        return node.start()

    def node_map(self) -> dict[str, str]:
        return {n.node_id: n.address for n in self.nodes}

    def add_gateway(self, *args: str) -> LocalGateway:
        name = f"gw{len(self.gateways) + 1}"
        env = self._tls_env(name)
        gateway = LocalGateway(name, self.tokens_file, self.node_map(), self.workdir, *args, env=env)
        self.gateways.append(gateway)
        return gateway

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for node in self.nodes:
            node.stop()
