"""The asynchronous SDK: the one implementation; `shoal.Client` wraps it for blocking code."""

from __future__ import annotations

import asyncio
import getpass
import os
import socket
import stat as stat_module
import warnings
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from shoal import ops, protocol, settings, tls
from shoal.client import functions, localfs, ports, procs, tartree
from shoal.client.adb import AsyncAdb, adb_program
from shoal.client.gui import AsyncGui
from shoal.client.image import ImageBuilder, placed
from shoal.client.procs import AsyncProcess
from shoal.client.results import ExecResult, FileEntry, SandboxInfo
from shoal.client.transport import Connection
from shoal.config import Paths, settings_env
from shoal.errors import (
    DivergenceError,
    InvalidRequestError,
    NodeError,
    NodeSettingsWarning,
    SandboxLostError,
    ShoalError,
    UnsafeEntryWarning,
)
from shoal.errors import from_wire as wire_error
from shoal.protocol import UNSET, OutputChunk, SandboxSpec, Unset
from shoal.steps import describe, divergence_message, is_bulk, step_key
from shoal.tasks import TaskOwner

DEFAULT_TIMEOUT = 60.0
FF_PAGE = 512  # log entries fetched per round trip while fast-forwarding
_SPEC_FIELDS = set(SandboxSpec.__struct_fields__)


def _spec(kind: str, image: str, options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - _SPEC_FIELDS
    if unknown:
        raise TypeError(f"create() got unexpected arguments {sorted(unknown)}; known: {sorted(_SPEC_FIELDS)}")
    files = options.get("files")
    if files:
        options = dict(options, files={k: v.encode() if isinstance(v, str) else v for k, v in files.items()})
    return protocol.to_builtins(SandboxSpec(kind=kind, image=image, **options))


async def _warn_if_settings_differ(conn: Connection, address: str) -> None:
    """Warn (NodeSettingsWarning) if this process sets SHOAL_* variables the running node has other values
    for (or none): the node keeps the settings it started with, so they would be silently ignored."""
    try:
        theirs = await conn.call("settings_env")
    except ShoalError:  # an older node: it cannot say
        return
    differ = sorted(k for k, v in settings_env(os.environ).items() if theirs.get(k) != v)
    if differ:
        warnings.warn(
            f"the shoal node at {address} was started with other values of {', '.join(differ)} than this "
            "process has, and keeps its own; to apply yours, stop it (`shoal node stop`; add --keep to keep its "
            "sandboxes) and connect again",
            NodeSettingsWarning,
            stacklevel=4,
        )


class AsyncClient:
    """Connects to a node or a cluster; the SDK surface is the same for all three.

    - no address: the local node over its Unix socket (started on demand);
    - `"shoal://host:port"` (or several, comma-separated: tried in turn, also to fail over) with `token=`
      (default $SHOAL_TOKEN): a node or a gateway over TCP; `"shoals://host:port"` the same over TLS, the
      server verified against `tls_ca=` (default $SHOAL_TLS_CA, else the system CAs). A token is not sent
      over plain TCP to a host off loopback unless SHOAL_PLAINTEXT_TOKENS=1 (docs/SECURITY.md);
    - `ray_address="auto"`: a shoal cluster deployed on that Ray cluster (`shoal cluster up`).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        home: str | None = None,
        autostart: bool = True,
        token: str | None = None,
        ray_address: str | None = None,
        project: str | None = None,
        owner: str | None = None,
        tls_ca: str | None = None,
        connector: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        # stamped on every sandbox this client creates (`list` shows it; the reaper's logs name it)
        self.owner = owner or settings.OWNER.get() or f"{getpass.getuser()}@{socket.gethostname()}"
        self.paths = Paths.from_env() if home is None else Paths(Path(home), Paths.from_env().images)
        self.address = address or str(self.paths.socket)
        self.autostart = autostart and address is None and ray_address is None
        self.token = token or settings.TOKEN.get()
        self.ray_address = ray_address
        self.project = project
        self.tls_ca = tls_ca
        self._tls = bool(address and address.startswith(tls.SCHEME_TLS))
        self._ssl: Any = None
        self._endpoints = _endpoints(address) if address and address.startswith(("shoal://", "shoals://")) else []
        self._next = 0
        self._conn: Connection | None = None
        # opens the connection instead of `address`: a process that hosts the node (or gateway) hands its own
        # in-process one to the services it runs for callers (the E2B API inside a node, cluster/inproc.py)
        self._connector = connector
        self._connecting = asyncio.Lock()
        self._tasks = TaskOwner("shoal client")  # releases of sandboxes whose create was cancelled

    async def connect(self) -> AsyncClient:
        """Open the connection (starting the local node first if need be and `autostart` allows)."""
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                self._conn = await self._open()
        return self

    async def _open(self) -> Connection:
        if self._connector is not None:
            return await self._connector()
        if self.ray_address is not None:
            if self._endpoints:
                try:
                    return await self._open_tcp()
                except NodeError:  # the gateways moved (restarted elsewhere): ask Ray again
                    pass
            from shoal.client.ray import connect_info

            info = await asyncio.to_thread(connect_info, self.ray_address, self.project)
            self._endpoints = [tuple(e) for e in info["gateways"]]
            self.token = self.token or info["token"]
            if info.get("tls_ca"):  # a cluster up with --tls: its CA comes with the answer
                self._tls, self._ssl = (
                    True,
                    tls.client_context(self.tls_ca, cadata=None if self.tls_ca else info["tls_ca"]),
                )
            scheme = tls.SCHEME_TLS if self._tls else tls.SCHEME_PLAIN
            self.address = ",".join(f"{scheme}{h}:{p}" for h, p in self._endpoints)
        if self._endpoints:
            return await self._open_tcp()
        try:
            conn = await Connection.open_unix(self.address)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if not self.autostart:
                raise NodeError(f"no shoal node answers at {self.address}: start one with `shoal node`") from exc
        else:
            await _warn_if_settings_differ(conn, self.address)
            return conn
        if os.geteuid() != 0:
            raise NodeError("no shoal node is running and starting one needs root: run as root or `sudo shoal node`")
        from shoal.client.launch import spawn_background

        await asyncio.to_thread(spawn_background, self.paths)
        return await Connection.open_unix(self.address)

    async def _open_tcp(self) -> Connection:
        failures = []
        for _ in range(len(self._endpoints)):
            host, port = self._endpoints[self._next % len(self._endpoints)]
            try:
                return await Connection.open_tcp(
                    host, port, self.token, tls_context=self._tls_context(), tls_ca=self.tls_ca,
                    plaintext_ok=self.ray_address is not None,  # Ray's network: see docs/SECURITY.md
                )  # fmt: skip
            except ShoalError:  # refused by the server (bad token): do not try elsewhere
                raise
            except OSError as exc:
                failures.append(f"{host}:{port}: {exc.strerror or exc}")
                self._next += 1
        raise NodeError(f"no shoal node or gateway answers at {self.address} ({'; '.join(failures)})")

    def _tls_context(self) -> Any:
        if self._tls and self._ssl is None:
            self._ssl = tls.client_context(self.tls_ca)  # once: reconnects reuse it (and its session cache)
        return self._ssl

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection. Sandboxes live on in the node until closed, killed or expired (those whose
        create was cancelled are released first, given up to 5 s)."""
        await self._tasks.wait(5.0)
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def call(self, fn: Callable[..., Any] | str, *args: Any, **options: Any) -> Any:
        """Run a function (or Python source) in a fresh isolated worker; see `shoal.client.functions.call`.

        For compatibility `call("op", {...})` (an operation name and its arguments) is the raw `rpc`.
        """
        if _is_rpc(fn, args, options):
            return await self.rpc(fn, *args, **options)  # type: ignore[arg-type]
        return await functions.call(self, fn, *args, **options)

    def map(self, fn: Callable[..., Any] | str, items: Any, **options: Any) -> AsyncIterator[Any]:
        """`async for value in client.map(fn, items, concurrency=32)`: results in order, errors in place."""
        return functions.map_calls(self, fn, items, **options)

    async def run_code(self, code: str, language: str = "python", **options: Any) -> functions.RunCodeResult:
        """Compile and run a python, bash, c or c++ program in a fresh worker; see `functions.run_code`."""
        return await functions.run_code(self, code, language, **options)

    async def rpc(self, op: str, args: dict[str, Any] | None = None, **kw: Any) -> Any:
        """One request to the node: operation `op` with `args`. A connection the node dropped (it restarted)
        is reopened first; calls in flight when it dropped fail with NodeError rather than being sent twice."""
        if self._conn is not None and self._conn.broken:
            await self._conn.close()
            self._conn = None
        if self._conn is None:
            await self.connect()
        assert self._conn is not None
        conn = self._conn
        try:
            return await conn.call(op, args, **kw)
        except NodeError:
            # the connection broke under the request; over TCP, a request that is safe to repeat is sent
            # again on a new connection (to the next gateway); others raise, as they may have run
            if not (self._endpoints and conn.closed and op in ops.RETRYABLE):
                raise
            self._next += 1
        await self.connect()
        return await self._conn.call(op, args, **kw)

    # ---------------------------------------------------------------- sandboxes

    async def create(
        self,
        kind: str = "container",
        image: str = "debian",
        *,
        layers: Sequence[str] | None = None,
        runtime: str | None = None,
        cpu: float | None = None,
        memory_mb: int | None = None,
        pids: int | None = 1024,
        disk_mb: int | None = None,
        tmpfs: Sequence[str] | None = None,
        ttl_s: float | None | Unset = UNSET,
        idle_timeout_s: float | None | Unset = UNSET,
        on_timeout: str = "kill",
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        labels: dict[str, str] | None = None,
        files: dict[str, bytes | str] | None = None,
        network: str | list[str] | dict[str, bool] = "none",
        output_cap_bytes: int | None = None,
        pool: bool = True,
        trajectory: str | None = None,
        record: bool = True,
        snapshot: str | None = None,
        preimport: Sequence[str] | None = None,
        owner: str | None = None,
        screen: tuple[int, int] | None | Literal[False] = None,
    ) -> AsyncSandbox:
        """Create a sandbox (from a warm pool when one matches) and return a handle on it.

        Args:
            kind: "container" (default), "microvm", "vm" (QEMU on the node) or "function".
            image: the image to run (`images()` lists them; builtin ones are built on first use).
            layers: images whose layers stack on top of `image`, bottom first.
            runtime: the runtime of a container: "shoal" (the node's own pre-forked launcher: crun's
                isolation, half the create time; cgroup v1 hosts, no userns), "crun", "runc" or "runsc"
                (gVisor); None: the node's default (SHOAL_RUNTIME, "auto": shoal where the host supports
                it, else crun; `client.status()["runtime"]` says which and why).
            cpu: cores it may use (a cgroup quota); None: no limit.
            memory_mb: memory limit in MiB; None: the node's default for the kind.
            pids: most processes at once (a fork bomb stops here).
            disk_mb: most MiB it may write; None: no cap.
            tmpfs: container: absolute paths to mount an empty in-memory file system on (scratch space;
                what is written there counts against `memory_mb`).
            ttl_s: it is closed (or paused, see `on_timeout`) this many seconds after creation;
                `keepalive` pushes the deadline out. Left out: the node's default (SHOAL_DEFAULT_TTL_S, 24 h),
                so an abandoned sandbox ends; None: no limit.
            idle_timeout_s: it is closed (or paused) after this long without a request. Left out: the node's
                default (SHOAL_DEFAULT_IDLE_S, 30 min); None: no limit.
            on_timeout: "kill" or "pause" when `ttl_s` or `idle_timeout_s` runs out.
            env: environment of every command it runs.
            workdir: working directory of its commands (default "/").
            user: user its commands run as (name or uid[:gid]); default root inside the sandbox.
            labels: your key/values, for `list(labels=...)` and `close_all(labels=...)`.
            files: {path: contents} written before `create` returns.
            network: "none" (default), a preset ("pypi"), rules ("tcp://host:443", "10.0.0.0/8:80"), a list of
                them, or {"pypi": True}; `set_network` changes it later.
            output_cap_bytes: most bytes of stdout/stderr an exec keeps (the rest is cut, `truncated` set).
            pool: False: never take a warm sandbox from a pool.
            trajectory: a name for this episode. If a live sandbox of your project already runs it (on any
                node of the cluster), that sandbox is returned and this handle re-issues steps from 0: steps
                already logged return their logged results without running (fast-forward), a different step
                raises DivergenceError. A restarted trainer gets its sandbox back this way.
            record: False: do not log steps in the trajectory log (no fast-forward, no replay).
            snapshot: microvm/vm: restore this snapshot (memory and disk) instead of booting.
            preimport: function kind: modules its warm workers import before forking calls.
            owner: who made it, shown by `list`; default this client's owner (user@host).
            screen: (width, height) of an X display started with it, driven through `sb.gui`; image
                "desktop" has one of 1280x800 by default; False: none, the image's programs only (a caller that
                starts its own X server, as e2b-desktop does).
        """
        options: dict[str, Any] = {
            "layers": list(layers or []), "runtime": runtime, "cpu": cpu, "memory_mb": memory_mb, "pids": pids,
            "disk_mb": disk_mb, "tmpfs": list(tmpfs or []), "ttl_s": ttl_s, "idle_timeout_s": idle_timeout_s,
            "on_timeout": on_timeout,
            "env": env or {}, "workdir": workdir, "user": user, "labels": labels or {}, "files": files or {},
            "network": network, "output_cap_bytes": output_cap_bytes, "pool": pool, "trajectory": trajectory,
            "record": record, "snapshot": snapshot, "preimport": list(preimport or []),
            "owner": owner or self.owner, "screen": _screen(screen),
        }  # fmt: skip
        spec = _spec(kind, image, options)

        def release(info: Any) -> None:  # the caller was cancelled after the node made it
            self._tasks.spawn(self._kill_quietly(info["id"]), f"release orphan {info['id']}")

        info = await self.call("create", {"spec": spec}, on_orphan=release)
        return AsyncSandbox(self, protocol.convert(info, SandboxInfo), seq=0)

    async def create_many(
        self, count: int, kind: str = "container", image: str = "debian", *, concurrency: int = 64, **options: Any
    ) -> list[AsyncSandbox | Exception]:
        """Create `count` sandboxes; each slot holds a sandbox or the exception that stopped it."""
        gate = asyncio.Semaphore(concurrency)

        async def one() -> AsyncSandbox:
            async with gate:
                return await self.create(kind, image, **options)

        results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        for item in results:
            if isinstance(item, BaseException) and not isinstance(item, Exception):
                raise item
        return list(results)  # type: ignore[arg-type]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle whose steps are appended to the sandbox's log (no fast-forward: see `attach`)."""
        info = await self.call("get", {"sandbox_id": sandbox_id})
        return AsyncSandbox(self, protocol.convert(info, SandboxInfo))

    async def attach(self, target: str, *, seq: int | None = 0) -> AsyncSandbox:
        """A handle on a live sandbox (by ID or trajectory name) that re-issues steps from `seq`.

        Steps already in the sandbox's trajectory log return their logged results without running; the
        first step past the log runs for real; a step that differs from the logged one raises
        DivergenceError. `seq=None` appends every step at the end of the log instead.
        """
        info = await self.call("attach", {"target": target})
        return AsyncSandbox(self, protocol.convert(info, SandboxInfo), seq=seq)

    async def pause_all(self, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Pause every running sandbox (with these labels): e.g. a preempted trainer's fleet."""
        return await self.call("pause_all", {"labels": labels})

    async def resume_all(self, labels: dict[str, str] | None = None) -> int:
        """Resume every paused sandbox (with these labels); returns how many."""
        return await self.call("resume_all", {"labels": labels})

    async def log(self, target: str, *, since: int = 0, page: int = 256) -> dict[str, Any]:
        """The trajectory log of a sandbox (ID or trajectory name, live or ended): {"sandbox", "steps"}.
        Fetched `page` steps per request, so a long log never makes one huge frame."""
        first = await self.call("log_steps", {"target": target, "since": since, "limit": page})
        steps = first["steps"]
        while steps:
            more = await self.call("log_steps", {"target": target, "since": steps[-1]["seq"] + 1, "limit": page})
            if not more["steps"]:
                break
            steps += more["steps"]
        return {"sandbox": first["sandbox"], "steps": steps}

    async def replay(self, target: str, *, image: str | None = None, keep: bool = False) -> ReplayReport:
        """Re-run a recorded trajectory in a fresh sandbox (of `image`, default the recorded one) and
        report each step whose outcome differs. `keep=True` leaves the new sandbox running."""
        raw = await self.call("replay", {"target": target, "image": image, "keep": keep})
        return ReplayReport(**raw)

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """The live sandboxes (of this project), optionally only those carrying all of `labels`."""
        return [protocol.convert(i, SandboxInfo) for i in await self.call("list", {"labels": labels})]

    async def kill(self, sandbox_id: str) -> bool:
        """Destroy a sandbox by ID at once (its processes are killed; its log is kept); False if it was closed
        already (killed, expired, or its node left the cluster)."""
        return bool(await self.call("kill", {"sandbox_id": sandbox_id}))

    async def _kill_quietly(self, sandbox_id: str) -> None:
        try:
            await self.kill(sandbox_id)
        except Exception:  # noqa: S110 - best effort release of an orphan
            pass

    async def close_all(self, labels: dict[str, str] | None = None) -> int:
        """Close every sandbox (with these labels); returns how many were closed."""
        return await self.call("close_all", {"labels": labels})

    async def set_pool(
        self, kind: str = "container", image: str = "debian", size: int = 1, *, wait: bool = False, **options: Any
    ) -> dict[str, Any]:
        """Keep `size` warm sandboxes of this shape ready; `create` with the same shape claims them."""
        return await self.call("pool_set", {"spec": _spec(kind, image, options), "size": size, "wait": wait})

    async def status(self) -> dict[str, Any]:
        """The node's figures (through a gateway: summed over the nodes, each under `nodes`)."""
        return await self.call("status")

    async def hello(self) -> dict[str, Any]:
        """Who answers: a node ({"node_id", "pid", "kinds"}) or a gateway ({"gateway", "nodes", "kinds"})."""
        return await self.call("hello", {})

    async def cluster_status(self) -> dict[str, Any]:
        """(gateway) Its view of the cluster: each node's health, load and sandboxes, the admission queue."""
        return await self.call("cluster_status", {})

    async def metrics(self) -> str:
        """(gateway) Its Prometheus metrics, as text."""
        return await self.call("metrics", {})

    async def trajectory_find(self, target: str) -> list[dict[str, Any]]:
        """Where a sandbox ID or trajectory name of yours lives: [] if nowhere, else one entry per node that
        holds it ({"sandbox_id", "trajectory", "status": live|closed|lost, "node_id"}), live ones first."""
        return await self.call("trajectory_find", {"target": target})

    async def kinds(self) -> list[str]:
        """The sandbox kinds this node can make (microvm/vm need QEMU on the node's host)."""
        return (await self.call("hello"))["kinds"]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a VM snapshot (sandboxes restored from it keep running)."""
        await self.call("vm_snapshot_delete", {"snapshot_id": snapshot_id})

    async def build_image(
        self,
        name: str,
        image: ImageBuilder | None = None,
        *,
        force: bool = False,
        no_cache: bool = False,
        network: str | list[str] | dict[str, bool] | None = None,
        on_step: Callable[[dict[str, Any]], Any] | None = None,
    ) -> dict[str, Any]:
        """Build `image` (an `ImageBuilder`) as `name`, or without one the builtin image `name`.

        RUN steps reach the network as `network` says (a policy as for `create`); by default the node's
        build policy, the public internet as in Docker's build ("none" builds offline).
        `on_step({"step", "op", "cached", "layer"})` is called as each step completes."""
        if image is None:
            return await self.call("image_build", {"name": name, "force": force})
        steps = [
            await self._materialise(name, step, network) if step["op"] == "copy_from" else step for step in image.steps
        ]
        args = {"name": name, "base": image.base, "steps": steps, "no_cache": no_cache or force}
        if network is not None:
            args["network"] = network
        return await self.call("image_build", args, on_event=on_step)

    async def _materialise(self, name: str, step: dict[str, Any], network: Any) -> dict[str, Any]:
        """A `copy_from` step as the COPY layer it means: build the stage (a temporary image, removed after),
        tar `src` in a sandbox of it, and re-root the files at `dest`."""
        stage: ImageBuilder = step["stage"]
        built = stage.base
        if stage.steps:
            built = f"{name}.stage-{os.getpid()}-{id(step)}"
            await self.build_image(built, stage, network=network)
        try:
            async with await self.create("container", image=built, pool=False, ttl_s=600, user="0") as sandbox:
                source = "/" + str(step["src"]).strip("/")
                entry = await sandbox.files.stat(source)
                if entry is None:
                    raise InvalidRequestError(f"COPY --from: {source} does not exist in the stage ({built})")
                directory = entry.kind == "dir"
                where, what = (source, ".") if directory else source.rsplit("/", 1)
                tar = "/tmp/.shoal-copy-from.tar"
                result = await sandbox.exec(["tar", "-C", where or "/", "-cf", tar, what])
                if result.exit_code != 0:
                    raise InvalidRequestError(f"COPY --from: tar of {source} in the stage failed: {result.stderr}")
                data = await sandbox.files.read(tar)
        finally:
            if built != stage.base:
                await self.image_rm(built)
        tar_bytes = placed(data, step["dest"], directory=directory, owner=tuple(step["owner"]))
        return {"op": "copy", "dest": step["dest"], "tar": tar_bytes}

    async def images(self) -> list[str]:
        """Names of the images the node can use (present, or builtin and built on first use)."""
        return await self.call("image_list")

    async def image_list(self) -> list[dict[str, Any]]:
        """Images in the store with their layer count, size and creation time."""
        return await self.call("image_ls")

    async def image_inspect(self, name: str) -> dict[str, Any]:
        """An image's record: layers, config, size, and the nodes that hold it."""
        return await self.call("image_inspect", {"name": name})

    async def image_rm(self, name: str) -> dict[str, Any]:
        """Forget an image; its layers go unless another image or a live sandbox uses them."""
        return await self.call("image_rm", {"name": name})

    async def image_prune(self) -> dict[str, Any]:
        """Remove layers and blobs no image references and no sandbox has mounted."""
        return await self.call("image_prune")

    async def image_squash(self, name: str, target: str) -> dict[str, Any]:
        """Flatten an image into one layer (deleted files gone for good), registered as `target`."""
        return await self.call("image_squash", {"name": name, "target": target})

    async def image_tag(self, source: str, target: str) -> None:
        """Register image `source` under a second name `target` (no layers copied)."""
        await self.call("image_tag", {"source": source, "target": target})

    async def image_import(self, path: str | os.PathLike[str], name: str | None = None) -> list[str]:
        """Import an OCI image layout (directory or tar) or a `docker save` archive on the node's machine."""
        return await self.call("image_import", {"path": os.path.abspath(path), "name": name})

    async def image_import_disk(
        self,
        path: str | os.PathLike[str],
        name: str,
        *,
        kernel: str | os.PathLike[str] | None = None,
        initrd: str | os.PathLike[str] | None = None,
        append: str | None = None,
        ready_port: int | None = None,
        disk_bus: str = "virtio",
        nic: str = "virtio",
    ) -> dict[str, Any]:
        """Register a VM disk image on the node's machine (Android-x86, AOSP x86_64, any OS; raw, qcow2, vmdk...)
        as image `name`, which create("vm", image=name) boots without shoal's agent: from the disk's own boot
        loader, or with `kernel` (+ `initrd`, `append`). `ready_port`: a create waits until that guest port
        takes a connection (5555 for adbd). `disk_bus="sata"` / `nic="e1000"` for guests without virtio."""

        def absolute(value: Any) -> str | None:
            return os.path.abspath(value) if value is not None else None

        args = {"path": os.path.abspath(path), "name": name, "kernel": absolute(kernel), "initrd": absolute(initrd),
                "append": append, "ready_port": ready_port, "disk_bus": disk_bus, "nic": nic}  # fmt: skip
        return await self.call("image_import_disk", args)

    async def image_pull(
        self,
        reference: str,
        name: str | None = None,
        *,
        auth: str | None = None,
        platform: str | None = None,
        on_progress: Callable[[dict[str, Any]], Any] | None = None,
    ) -> dict[str, Any]:
        """Pull HOST[:PORT]/REPO[:TAG|@DIGEST] (auth: 'user:password'; platform: 'linux/amd64')."""
        args = {"reference": reference, "name": name, "auth": auth, "platform": platform}
        return await self.call("image_pull", args, on_event=on_progress)

    async def image_push(
        self,
        name: str,
        reference: str,
        *,
        auth: str | None = None,
        on_progress: Callable[[dict[str, Any]], Any] | None = None,
    ) -> dict[str, Any]:
        """Push a stored image to HOST[:PORT]/REPO[:TAG]; blobs the registry already has are skipped."""
        return await self.call("image_push", {"name": name, "reference": reference, "auth": auth}, on_event=on_progress)

    async def image_export(self, name: str, path: str | os.PathLike[str]) -> str:
        """Write an image as an OCI layout (a directory, or a tar if `path` ends in .tar); returns its digest."""
        return await self.call("image_export", {"name": name, "path": os.path.abspath(path)})


def _is_rpc(fn: Any, args: tuple, options: dict[str, Any]) -> bool:
    """A bare operation name with at most one dict is an RPC (as Python source it could only raise NameError)."""
    return (
        isinstance(fn, str)
        and fn.isidentifier()
        and len(args) <= 1
        and all(a is None or isinstance(a, dict) for a in args)
        and set(options) <= {"on_event", "on_orphan"}
    )


def _screen(screen: tuple[int, int] | None | Literal[False]) -> list[int] | None:
    """The wire form of `create(screen=...)`: [w, h], None (the image's default) or [] (no display)."""
    if screen is False:
        return []
    return list(screen) if screen else None


def reachable_url(url: str, client: AsyncClient) -> str:
    """A URL whose host is a wildcard bind (0.0.0.0, ::) names the host the client reached instead."""
    scheme, _, rest = url.partition("://")
    hostport, slash, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return url
    where = client._endpoints[0][0] if client._endpoints else "127.0.0.1"
    where = f"[{where}]" if ":" in where else where
    return f"{scheme}://{where}:{port}{slash}{path}"


def _endpoints(address: str) -> list[tuple[str, int]]:
    out = []
    for part in address.split(","):
        rest = part.strip().removeprefix("shoals://").removeprefix("shoal://")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{part!r} is not an address like shoal://host:port or shoals://host:port")
        out.append((host, int(port)))
    return out


@dataclass(frozen=True)
class ReplayReport:
    """What `replay` found: `differences` holds one entry per differing field of a step."""

    source: str
    sandbox_id: str
    image: str
    steps: int
    differences: list[dict[str, Any]]
    skipped: list[dict[str, Any]] = field(default_factory=list)  # steps not re-run (snapshots)

    @property
    def identical(self) -> bool:
        """True if the replay matched the log in every step."""
        return not self.differences


class ExecStream:
    """`async for chunk in sandbox.exec_stream(...)` yields OutputChunk(stream, data); `.result` after.

    The command starts (and takes its place in the sandbox's step order) when iteration starts, not when
    the stream is made: a stream that is never read costs nothing, and steps issued between making and
    reading it run first. Stopping the iteration early cancels the command on the node.
    """

    def __init__(self, sandbox: AsyncSandbox, args: dict[str, Any]) -> None:
        self._sandbox = sandbox
        self._args = args
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.result: ExecResult | None = None

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        if "seq" not in self._args:
            self._args.update(self._sandbox._next_seq())
        task = asyncio.ensure_future(
            self._sandbox.client.call("exec", {"req": self._args}, on_event=self._queue.put_nowait)
        )
        task.add_done_callback(lambda _t: self._queue.put_nowait(None))
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    break
                yield protocol.convert(item, OutputChunk)
            self.result = ExecResult.from_wire(task.result())
        finally:
            if not task.done():
                task.cancel()


class AsyncSandbox:
    """A handle on one sandbox. Cheap: it holds the ID and a client; every call goes to the node.

    A handle that counts steps (`seq` not None: from `create` or `attach`) fast-forwards itself: re-issued
    steps already in the sandbox's trajectory log are answered from pages of the log fetched from the node
    (`FF_PAGE` steps per round trip), checked against the logged step exactly as the node would.
    """

    def __init__(self, client: AsyncClient, info: SandboxInfo, *, seq: int | None = None) -> None:
        self.client = client
        self.info = info
        self.id = info.id
        self.files = AsyncFiles(self)
        self.gui = AsyncGui(self)
        self.seq = seq  # the next step's sequence number in the trajectory log; None: append at the end
        self.fast_forwarded = 0  # steps this handle answered from the log
        self._log_end = info.steps if seq is not None else 0  # steps below this may be in the log
        self._ahead: dict[int, dict[str, Any]] = {}  # fetched log entries not yet re-issued
        self._fetching = asyncio.Lock()

    def _next_seq(self) -> dict[str, int]:
        """Claim the next sequence number (when this handle counts steps) for a request's arguments."""
        if self.seq is None:
            return {}
        self.seq += 1
        return {"seq": self.seq - 1}

    async def _step(self, op: str, args: dict[str, Any], **call_options: Any) -> Any:
        """Issue one step: from the fetched log if it is there (fast-forward), else on the node."""
        if "seq" not in args:
            args.update(self._next_seq())
        seq = args.get("seq")
        if seq is not None and seq < self._log_end:
            if seq not in self._ahead:
                async with self._fetching:  # FIFO: steps reach the node in the order they were issued
                    if seq not in self._ahead:
                        await self._fetch(seq)
            logged = self._ahead.pop(seq, None)
            # unfinished, or a read whose bytes the log kept only as a digest: the node decides
            if logged is not None and logged["finished_at"] is not None and not is_bulk(logged["result"]):
                return self._fast_forward(op, args, logged)
        try:
            return await self.client.call(op, {"req": args} if op == "exec" else args, **call_options)
        except (NodeError, SandboxLostError):
            # the node (or the way to it) went away: the retry reuses the number, so a step that never
            # arrived runs, and one that did start raises (its outcome is unknown) instead of running again
            if seq is not None and self.seq == seq + 1:
                self.seq = seq
            raise

    async def _fetch(self, since: int) -> None:
        page = (await self.client.call("log_steps", {"target": self.id, "since": since, "limit": FF_PAGE}))["steps"]
        self._ahead.update((step["seq"], step) for step in page)
        if len(page) < FF_PAGE:  # the log ends here (or the page was cut by size): later steps go to the node
            self._log_end = min(self._log_end, since + len(page))

    def _fast_forward(self, op: str, args: dict[str, Any], logged: dict[str, Any]) -> Any:
        if logged["op"] != op or logged["key"] != step_key(op, args):
            raise DivergenceError(divergence_message(self.id, logged["seq"], logged["summary"], describe(op, args)))
        self.fast_forwarded += 1
        if logged["error_type"] is not None:
            raise wire_error(logged["error_type"], logged["error"])
        return logged["result"]

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.kind}:{self.info.image}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self.close())

    def _exec_args(self, cmd: str | Sequence[str], options: dict[str, Any]) -> dict[str, Any]:
        args: dict[str, Any] = {"sandbox_id": self.id, "cmd": cmd if isinstance(cmd, str) else list(cmd)}
        stdin = options.pop("stdin", None)
        if stdin is not None:
            args["stdin"] = stdin.encode() if isinstance(stdin, str) else stdin
        args.update({k: v for k, v in options.items() if v is not None})
        return args

    @overload
    async def exec(
        self, cmd: str | Sequence[str], *, background: Literal[True], **options: Any
    ) -> AsyncProcess: ...  # pragma: no cover

    @overload
    async def exec(self, cmd: str | Sequence[str], **options: Any) -> ExecResult: ...  # pragma: no cover

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        idle_timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | str | None = None,
        output_cap_bytes: int | None = None,
        merge_stderr: bool = False,
        on_stdout: Callable[[bytes], Any] | None = None,
        on_stderr: Callable[[bytes], Any] | None = None,
        background: bool = False,
    ) -> Any:
        """Run a command (a shell string, or an argv list run without a shell) and wait for it.

        On `timeout` (wall clock) or `idle_timeout` (no output for that long) the whole process tree is
        killed and the result has `timed_out` set with the output printed so far.

        With `background=True` it does not wait: it returns an `AsyncProcess` (client/procs.py) at once, a
        process that outlives this call and this client (no timeouts: kill it, or it ends with the sandbox);
        `stdin` is its first input, `output_cap_bytes` how much of each stream the sandbox keeps for readers.
        """
        if background:
            if idle_timeout is not None or on_stdout or on_stderr:
                raise InvalidRequestError("a background process takes no idle_timeout or callbacks: read its "
                                          "output with proc.stream() or proc.read()")  # fmt: skip
            options = dict(env=env, cwd=cwd, user=user, stdin=stdin, output_cap_bytes=output_cap_bytes)
            return await procs.start(self, self._exec_args(cmd, dict(options, merge_stderr=merge_stderr or None)))
        args = self._exec_args(
            cmd,
            dict(
                timeout=timeout,
                idle_timeout=idle_timeout,
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                output_cap_bytes=output_cap_bytes,
                merge_stderr=merge_stderr or None,
            ),
        )
        on_event = None
        if on_stdout or on_stderr:
            args["stream"] = True

            def on_event(event: Any) -> None:
                callback = on_stdout if event["stream"] == "stdout" else on_stderr
                if callback is not None:
                    callback(event["data"])

        return ExecResult.from_wire(await self._step("exec", args, on_event=on_event))

    def exec_stream(
        self, cmd: str | Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT, **options: Any
    ) -> ExecStream:
        """Run a command and stream its output as it is printed."""
        args = self._exec_args(cmd, dict(options, timeout=timeout))
        args["stream"] = True
        return ExecStream(self, args)

    async def shell(self) -> AsyncShell:
        """A persistent shell: working directory and environment carry over between `run` calls."""
        return AsyncShell(self, await self._step("shell_open", {"sandbox_id": self.id}))

    async def call(self, fn: Callable[..., Any] | str, *args: Any, **options: Any) -> Any:
        """(function sandboxes) Run `fn` in a fresh worker with this sandbox's image, limits, env and files."""
        return await functions.call(self.client, fn, *args, sandbox_id=self.id, **options)

    async def refresh(self) -> SandboxInfo:
        """Fetch this sandbox's record from the node again (state, expiry, steps) and return it."""
        self.info = protocol.convert(await self.client.call("get", {"sandbox_id": self.id}), SandboxInfo)
        return self.info

    async def keepalive(self, ttl_s: float | None = None) -> None:
        """Push the TTL deadline out by `ttl_s` (default: the sandbox's own TTL) from now."""
        self.info = protocol.convert(
            await self.client.call("keepalive", {"sandbox_id": self.id, "ttl_s": ttl_s}), SandboxInfo
        )

    async def processes(self, *, background: bool = False) -> list[dict[str, Any]]:
        """Processes running in the sandbox other than its agent's, each a dict: pid, ppid, state, command,
        exec_id (the exec that started it, as in `ExecResult.exec_id`, or the background process's ID; None
        once that is unknown) and exec_command. Forking, double-forking and setsid do not take a process
        away from its exec.

        With `background=True`: the background processes and terminals the sandbox keeps (running, or ended
        a short while ago), each a dict: id (for `process(id)`), pid, pty, running, exit_code, signal,
        stdout_offset and stderr_offset (how much each stream has printed), command."""
        if background:
            return await self.client.call("proc_list", {"sandbox_id": self.id})
        return await self.client.call("processes", {"sandbox_id": self.id})

    async def usage(self) -> dict[str, Any]:
        """What the sandbox uses now, from its cgroup: {"memory_bytes", "cpu_s", "pids", "state"} (None for
        what this host's cgroups do not show). Asking does not resume a paused sandbox."""
        return await self.client.call("usage", {"sandbox_id": self.id})

    async def process(self, id: int) -> AsyncProcess:
        """A handle on background process `id` (from `processes(background=True)`, or `proc.id` in another
        client, even one that has died): reads start at offset 0 (set `stdout_offset`/`stderr_offset` to
        go on from elsewhere)."""
        return await procs.AsyncProcess(self, {"id": id, "pid": 0}).refresh()

    async def pty(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        cmd: str | Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> AsyncProcess:
        """A program on a terminal of `cols` x `rows` (default: a login shell), as a background process:
        type with `send_stdin`, read the screen's bytes with `stream()`/`read()`, `resize(cols, rows)`.
        TERM is xterm-256color unless `env` says otherwise."""
        args = self._exec_args(cmd or procs.DEFAULT_PTY_CMD, dict(env=env, cwd=cwd, user=user))
        args["pty"] = {"cols": cols, "rows": rows}
        return await procs.start(self, args)

    async def kill_processes(self, exec_id: int | None = None) -> dict[str, int]:
        """SIGKILL the processes one exec left running (`exec_id`), or every process but the agent's (None):
        e.g. a `nohup server &` no longer wanted, or a fork bomb. Works at the sandbox's pids limit.
        Returns {"killed": n, "left": n} (left is 0 unless something outran a thousand rounds of kills)."""
        return await self.client.call("kill_processes", {"sandbox_id": self.id, "exec_id": exec_id})

    async def expose(self, port: int) -> str:
        """A URL that reaches `port` inside the sandbox (HTTP and websockets) through the node's HTTP, or the
        gateway's when the client talks to one, without opening the sandbox's network policy: a server on
        127.0.0.1 or 0.0.0.0 in a sandbox with network="none" is reachable. The URL carries a key for this
        port of this sandbox, derived from a secret of the node; anyone holding it gets in, until the sandbox
        closes. Without the key, a request needs `Authorization: Bearer <token>` of the sandbox's project at
        `<base>/ports/<id>/<port>/`. Each request opens one connection to the port (`Connection: close`).
        A new relayed connection counts as activity for `idle_timeout_s`; a long silent one (an idle
        websocket) does not: keep such a sandbox alive with `keepalive()` or a TTL instead."""
        result = await self.client.call("expose", {"sandbox_id": self.id, "port": port})
        return reachable_url(result["url"], self.client)

    async def view(self) -> str:
        """A URL of the live view of this sandbox's screen (noVNC in a browser, served by the node or the
        gateway, shoal/view.py); it opens with the key of `expose(5900)`, the screen's VNC stream."""
        return (await self.expose(5900)).replace("/ports/", "/view/", 1)

    async def open_tcp(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw TCP stream (any protocol) to `port` inside the sandbox, through the same relay as `expose`."""
        return await ports.open_tcp(await self.expose(port), self.client._tls_context())

    async def forward(self, port: int, local_port: int = 0) -> ports.PortForward:
        """Listen on 127.0.0.1:`local_port` (0: any free one; see `.address`) and carry every connection to
        `port` inside the sandbox as raw TCP; `await fwd.close()` stops it."""
        return await ports.PortForward(await self.expose(port), self.client._tls_context()).start(port=local_port)

    async def adb(self, port: int = 5555, *, connect: bool = True, program: str = "adb") -> AsyncAdb:
        """Android's adb (on this machine) connected to the adbd of an agentless vm (an Android image) through
        `forward(port)`: `(await sb.adb()).run("shell", "ls")`; `await adb.close()` disconnects. See client/adb.py."""
        adb_program(program)  # refused before a forward is opened
        adb = AsyncAdb(await self.forward(port), program)
        if connect:
            try:
                await adb.connect()
            except BaseException:
                await adb.forward.close()
                raise
        return adb

    async def pause(self) -> dict[str, Any]:
        """Pause: a container is frozen and its memory reclaimed; a VM is saved to disk and its QEMU stopped.
        Files, processes and shells survive; any request resumes it."""
        return await self.client.call("pause", {"sandbox_id": self.id})

    async def resume(self) -> None:
        """Resume a paused sandbox (its processes continue where they stopped)."""
        self.info = protocol.convert(await self.client.call("resume", {"sandbox_id": self.id}), SandboxInfo)

    async def log(self, *, since: int = 0) -> list[dict[str, Any]]:
        """The steps of this sandbox's trajectory log, in order."""
        return (await self.client.log(self.id, since=since))["steps"]

    async def snapshot(self, name: str | None = None) -> Any:
        """container: commit its writes (deletions too) as image `name` (its image plus one new layer).

        microvm/vm: capture memory and disk of the running VM and return a snapshot id, which
        `client.create(kind, snapshot=id)` restores as a new running VM (`name` is not used)."""
        if self.info.kind in ("microvm", "vm"):
            return await self.client.call("vm_snapshot", {"sandbox_id": self.id})
        if name is None:
            raise TypeError(f"snapshot() of a {self.info.kind} commits an image: give it a name")
        return await self._step("sandbox_snapshot", {"sandbox_id": self.id, "name": name})

    async def set_network(self, network: str | list[str] | dict[str, bool]) -> dict[str, Any]:
        """Change the network policy now: "none", a preset ("pypi"), rules ("tcp://host:443",
        "10.0.0.0/8:80", "udp://1.2.3.4:53"), a list of them, or {"pypi": True, "npm": False}.

        Names are resolved by the node now; open connections to destinations no longer allowed are cut.
        Returns what was applied (rules, resolved names, the sandbox's address).
        """
        return await self.client.call("set_network", {"sandbox_id": self.id, "network": network})

    async def fork(self, count: int = 1) -> list[AsyncSandbox | Exception]:
        """microvm/vm: `count` running copies of this VM; each slot is a sandbox or the exception that stopped it."""
        results = await self.client.call("fork", {"sandbox_id": self.id, "count": count})
        out: list[AsyncSandbox | Exception] = []
        for item in results:
            if "id" in item:
                out.append(AsyncSandbox(self.client, protocol.convert(item, SandboxInfo)))
            else:
                out.append(wire_error(item["type"], item["message"]))
        return out

    async def close(self) -> None:
        """Destroy the sandbox and everything it owns. Closing twice is fine."""
        await self.client.call("kill", {"sandbox_id": self.id})


class AsyncShell:
    def __init__(self, sandbox: AsyncSandbox, shell_id: str) -> None:
        self.sandbox = sandbox
        self.id = shell_id

    async def run(
        self, cmd: str, *, timeout: float | None = DEFAULT_TIMEOUT, idle_timeout: float | None = None
    ) -> ExecResult:
        """Run `cmd` in this shell. A timeout kills the shell (later runs raise); open a new one."""
        args = {"shell_id": self.id, "cmd": cmd, "timeout": timeout, "idle_timeout": idle_timeout}
        raw = await self.sandbox._step("shell_run", args)
        return ExecResult.from_wire(raw)

    async def close(self) -> None:
        """End the shell session (its processes are killed)."""
        await self.sandbox.client.call("shell_close", {"shell_id": self.id})

    async def __aenter__(self) -> AsyncShell:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


WRITE_CHUNK = 8 << 20  # bytes per file_write request when a large file is written


class AsyncFiles:
    """Files inside the sandbox, read and written through its agent (as the sandbox's user)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def _call(self, op: str, **args: Any) -> Any:
        return await self._sandbox._step(op, {"sandbox_id": self._sandbox.id, **args})

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644, append: bool = False) -> int:
        """Write `data` (str is UTF-8 encoded) to `path`, making parent directories; returns bytes written.

        Up to WRITE_CHUNK (8 MiB) the file is replaced atomically; more goes as that first chunk and then
        appends of WRITE_CHUNK each (one step each), so neither the node nor the agent holds a large file
        whole; a reader in the sandbox may see it grow meanwhile."""
        payload = data.encode() if isinstance(data, str) else data
        if len(payload) <= WRITE_CHUNK:
            return await self._call("file_write", path=path, data=payload, mode=mode, append=append)
        written = 0
        for offset in range(0, len(payload), WRITE_CHUNK):
            chunk = bytes(payload[offset : offset + WRITE_CHUNK])
            args = {"path": path, "data": chunk, "mode": mode, "append": append or offset > 0}
            written += await self._call("file_write", **args)
        return written

    async def write_from(self, local: str | os.PathLike[str], path: str, *, mode: int | None = None) -> int:
        """Copy the local file `local` to `path`, read and sent WRITE_CHUNK at a time (never held whole)."""
        source = Path(local)
        mode = stat_module.S_IMODE(source.stat().st_mode) if mode is None else mode

        async def chunks() -> AsyncIterator[bytes]:
            with source.open("rb") as handle:
                while chunk := await asyncio.to_thread(handle.read, WRITE_CHUNK):
                    yield chunk

        return await self.write_stream(path, chunks(), mode=mode)

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes], *, mode: int = 0o644) -> int:
        """Write what `chunks` yields to `path`, sent WRITE_CHUNK at a time as it arrives, so an upload relayed
        from a socket (the E2B layer's) is never held whole: the first piece replaces the file, the rest
        append (one step each); an empty stream makes an empty file. Returns the bytes written."""
        written = 0
        started = False
        pending = bytearray()
        async for chunk in chunks:
            pending += chunk
            while len(pending) >= WRITE_CHUNK:
                piece = bytes(pending[:WRITE_CHUNK])
                del pending[:WRITE_CHUNK]
                written += await self._call("file_write", path=path, data=piece, mode=mode, append=started)
                started = True
        if pending or not started:
            written += await self._call("file_write", path=path, data=bytes(pending), mode=mode, append=started)
        return written

    async def read(self, path: str, *, max_bytes: int = 256 << 20) -> bytes:
        """The bytes of file `path`; raises if it is larger than `max_bytes`. A file over 64 KiB comes in
        chunks (the node never holds it whole) and is logged as its digest (see docs/DEVELOPING.md)."""
        chunks: list[bytes] = []
        args = {"sandbox_id": self._sandbox.id, "path": path, "max_bytes": max_bytes, "stream": True}
        result = await self._sandbox._step("file_read", args, on_event=chunks.append)
        if not is_bulk(result):
            return result
        data = b"".join(chunks)
        if len(data) != result["size"]:
            raise NodeError(f"read {path}: {len(data)} of {result['size']} bytes arrived")
        return data

    async def read_text(self, path: str) -> str:
        """The contents of file `path` decoded as UTF-8."""
        return (await self.read(path)).decode()

    async def list(self, path: str = ".", *, recursive: bool = False) -> list[FileEntry]:
        """The entries of directory `path` (recursive: names relative to it; symlinks not followed)."""
        raw = await self._call("file_list", path=path, recursive=recursive)
        return [protocol.convert(e, FileEntry) for e in raw]

    async def stat(self, path: str) -> FileEntry | None:
        """The entry for `path` (not following a final symlink), or None if it does not exist."""
        raw = await self._call("file_stat", path=path)
        return None if raw is None else protocol.convert(raw, FileEntry)

    async def exists(self, path: str) -> bool:
        """Whether `path` exists (a dangling symlink counts)."""
        return await self.stat(path) is not None

    async def mkdir(self, path: str) -> None:
        """Create directory `path` and any missing parents."""
        await self._call("file_mkdir", path=path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink or (with `recursive`, non-empty) directory."""
        await self._call("file_remove", path=path, recursive=recursive)

    async def upload(self, local_dir: str | os.PathLike[str], remote_dir: str) -> int:
        """Copy a local directory (or file) into the sandbox; returns the number of files written.

        A directory goes as tar streams (one request per 64 MiB of files, see `write_tar`): directories,
        regular files and symlinks (recreated as links), written as the sandbox's user."""
        root = Path(local_dir)
        if root.is_file():
            await self.write_from(root, remote_dir)
            return 1
        if not root.is_dir():
            raise FileNotFoundError(f"no local file or directory {root}")
        files = 0
        big: list[str] = []  # files larger than a batch: sent by themselves, in chunks (write_from)
        made = tartree.batches(root, big=big)
        while (batch := await asyncio.to_thread(next, made, None)) is not None:
            data, count = batch
            await self.write_tar(remote_dir, data)
            files += count
        for name in big:
            await self.write_from(root / name, f"{remote_dir.rstrip('/')}/{name}")
        return files + len(big)

    async def write_tar(self, remote_dir: str, data: bytes) -> int:
        """Unpack a tar stream (ustar or GNU format: files, directories, symlinks) into `remote_dir` (made
        if missing) in one request, as the sandbox's user; returns the entries made. Members with an
        absolute name or a '..' component are refused, and links already in the sandbox are not followed
        (an entry a link stands in the way of replaces the link)."""
        return await self._call("file_untar", path=remote_dir, data=data)

    async def download(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> int:
        """Copy a directory (or file) out of the sandbox; returns the number of files written.

        What the sandbox reports is not trusted: nothing below `local_dir` is followed (links already there
        are replaced, not written through), and a symlink is recreated only if it stays inside `local_dir`;
        others are skipped with a warning that names them (see `shoal.client.localfs`).
        """
        root = Path(local_dir)
        entry = await self.stat(remote_dir)
        if entry is None:
            raise FileNotFoundError(f"no file or directory {remote_dir} in sandbox {self._sandbox.id}")
        if entry.kind == "file":
            data = await self.read(remote_dir)
            await asyncio.to_thread(localfs.write_file, root, data, entry.mode or 0o644)
            return 1
        count = 0
        with localfs.TreeWriter(root) as tree:
            for item in await self.list(remote_dir, recursive=True):
                if item.kind == "dir":
                    tree.mkdir(item.name)
                elif item.kind == "file":
                    data = await self.read(f"{remote_dir.rstrip('/')}/{item.name}")
                    count += await asyncio.to_thread(tree.write_file, item.name, data, item.mode)
                elif item.kind == "symlink":
                    tree.symlink(item.name, item.target)
        if tree.skipped:
            more = len(tree.skipped) - 10
            shown = ", ".join(tree.skipped[:10]) + (f" and {more} more" if more > 0 else "")
            warnings.warn(
                f"download of {remote_dir} from sandbox {self._sandbox.id} into {root} skipped "
                f"{len(tree.skipped)} entries that could lead outside it: {shown}",
                UnsafeEntryWarning,
                stacklevel=2,
            )
        return count
