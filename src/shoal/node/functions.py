"""The `function` kind in the node: logical sandboxes whose every exec runs in a fresh, isolated worker child.

A function sandbox owns no container. Its handle's `exec` leases a warm worker (`pool.py`) of its image,
runs the command in a freshly forked child of the worker's resident interpreter (own cgroup and limits,
unprivileged, no network but the container's private loopback) and discards everything the call wrote.
Its `files` are staged inputs kept by the node and written into every call's scratch space; what a call
writes is gone afterwards (collect outputs with `run_code(output_files=...)`). `call` and `run_code` are
the same machinery without a handle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from shoal import resources, settings
from shoal.errors import InvalidRequestError, SandboxLostError, SandboxNotFoundError
from shoal.protocol import ExecRequest, ExecResult, FileEntry, OutputChunk, SandboxInfo, SandboxSpec
from shoal.substrates.function import limits as call_limits
from shoal.substrates.function.languages import LANGUAGES, run_code_steps, status_of
from shoal.substrates.function.limits import CallLimits
from shoal.substrates.function.pool import (
    CALL_GID,
    CALL_UID,
    IDLE_S,
    SOCKET,
    WORKER_DIR,
    Worker,
    WorkerKey,
    WorkerPool,
    b64,
    hand_over,
    no_python_error,
    worker_source,
)
from shoal.substrates.function.worker import WRITABLE, inside

if TYPE_CHECKING:
    from shoal.config import NodeSettings
    from shoal.images import Image, ImageStore
    from shoal.node.sandbox import Sandbox


class FunctionHost(Protocol):
    """What the function kind needs of the node: container sandboxes for its workers, images, settings, and
    the closed-sandbox record (shoal.node.service.NodeService is one)."""

    settings: NodeSettings
    images: ImageStore

    async def make_sandbox(self, spec: SandboxSpec, image: Image | None = None) -> Sandbox: ...

    async def destroy_sandbox(self, sandbox: Sandbox) -> None: ...

    async def image_named(self, name: str) -> Image: ...

    def remember_closed(self, sandbox_id: str, reason: str) -> None: ...


log = logging.getLogger("shoal.functions")

WORKDIR = "/work"
MAX_WORKERS = settings.FN_MAX_WORKERS.get() or max(4, 4 * (os.cpu_count() or 1))
# Few on purpose: a fork copies the worker's page tables, so every MB imported costs every call (measured
# here: ~0.15 ms per MB of anonymous memory). Calls import anything else themselves.
PREIMPORT = ("json", "math", "re", "collections", "itertools", "functools", "typing", "string", "heapq")
PREIMPORT += tuple(filter(None, settings.FN_PREIMPORT.get().split(",")))
PICKLED = (*PREIMPORT, "cloudpickle")  # workers for cloudpickled functions also hold cloudpickle
MAX_STAGED_BYTES = 64 << 20
SETUP_GRACE_S = 30.0
KILL_GRACE_S = 0.25  # per step: past its timeouts by this much, the node kills a call the worker has not
NO_TIMEOUT_S = 7 * 86400.0
ISOLATION = ("item", "batch")  # map: a fresh child per item, or one child per batch (see FunctionService.map)
MAX_BATCH = 1024  # items of one `map` round trip (the client sends far fewer: results stream back per batch)


@dataclass
class FnSandbox:
    """A function sandbox: a spec plus staged input files; no process of its own."""

    id: str
    spec: SandboxSpec
    created_at: float
    expires_at: float | None
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    @property
    def workdir(self) -> str:
        return self.spec.workdir or WORKDIR

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            kind="function",
            image=self.spec.image,
            state="ready",
            labels=dict(self.spec.labels),
            created_at=self.created_at,
            expires_at=self.expires_at,
            owner=self.spec.owner,
            workdir=self.workdir,
        )

    def staged(self) -> dict[str, dict[str, Any]]:
        entries: dict[str, dict[str, Any]] = {d: {"dir": True} for d in sorted(self.dirs)}
        entries.update({p: {"data": b64(data), "mode": mode} for p, (data, mode) in self.files.items()})
        return entries


class FunctionService:
    def __init__(self, node: FunctionHost) -> None:
        self.node = node
        self.sandboxes: dict[str, FnSandbox] = {}
        self.pools: dict[WorkerKey, WorkerPool] = {}
        self.calls = 0
        self._janitor: asyncio.Task | None = None
        self._stopping: set[asyncio.Task] = set()
        self._configs: dict[str, Any] = {}

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._janitor = asyncio.create_task(self._tend_forever())

    async def stop(self) -> None:
        if self._janitor:
            self._janitor.cancel()
        workers = []
        for pool in self.pools.values():
            pool.warm = 0
            for task in pool.tasks:
                task.cancel()
            await asyncio.gather(*pool.tasks, return_exceptions=True)
            workers += [*pool.idle, *pool.busy]
            pool.idle.clear()
            pool.busy.clear()
        await asyncio.gather(*(self._stop_worker(w) for w in workers), return_exceptions=True)
        await asyncio.gather(*self._stopping, return_exceptions=True)

    async def _tend_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for sandbox in [s for s in self.sandboxes.values() if s.expires_at and s.expires_at <= now]:
                self.kill(sandbox.id, "its ttl expired")
            for pool in self.pools.values():
                for worker in pool.retire_idle(time.monotonic(), IDLE_S):
                    self._background_stop(worker)

    def _background_stop(self, worker: Worker) -> None:
        task = asyncio.ensure_future(self._stop_worker(worker))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    # ---------------------------------------------------------------- workers

    def _pool(self, spec: SandboxSpec, pickled: bool = False) -> WorkerPool:
        modules = (*(PICKLED if pickled else PREIMPORT), *(m for m in spec.preimport if m not in PICKLED))
        key = WorkerKey(image=spec.image, runtime=spec.runtime, modules=modules)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = WorkerPool(key, self._start_worker, self._stop_worker, self._may_grow)
        return pool

    def _may_grow(self) -> bool:
        """Within the node-wide budget; at the budget, an idle worker of another pool makes room."""
        if sum(p.size for p in self.pools.values()) < MAX_WORKERS:
            return True
        for pool in sorted(self.pools.values(), key=lambda p: len(p.idle), reverse=True):
            victim = pool.evict_one()
            if victim is not None:
                self._background_stop(victim)
                return True
        return False

    async def _start_worker(self, key: WorkerKey) -> Worker:
        # every core: a worker serves many calls at once, each under its own call cgroup's cpu limit (the
        # node's default cap for sandboxes that name no cpu= would make them share one core)
        cores = float(os.cpu_count() or 1)
        # the directories calls write are in memory (/dev/shm is already): each run_code writes its source
        # file there and the worker removes it after, and on the host's disk (ext4 without a journal here)
        # creating an inode got slower with every file removed in the seconds before it (~0.2 ms a call)
        scratch = [root for root in WRITABLE if root != "/dev/shm"]
        spec = SandboxSpec(
            kind="container", image=key.image, runtime=key.runtime, pids=None, pool=False, cpu=cores, tmpfs=scratch
        )
        sandbox = await self.node.make_sandbox(spec)
        self._configs[key.image] = sandbox.image.config  # as the image is now (it may have been rebuilt)
        try:
            return await self._boot(key, sandbox)
        except BaseException:
            await asyncio.shield(self.node.destroy_sandbox(sandbox))
            raise

    async def _boot(self, key: WorkerKey, sandbox: Any) -> Worker:
        agent = sandbox.agent
        await agent.mkdir(WORKER_DIR, mode=0o700)
        await agent.write_file(f"{WORKER_DIR}/worker.py", worker_source(), mode=0o600)
        for relative, data in _cloudpickle_files():
            await agent.write_file(f"{WORKER_DIR}/lib/{relative}", data, mode=0o600)
        dirs = await asyncio.to_thread(call_limits.call_dirs, sandbox.instance.cgroup_path)
        # LD_BIND_NOW: the dynamic linker resolves every symbol of python3 and its libraries at start-up. Bound
        # lazily, each libc function only calls' children use (setsid, setgroups, setuid, chdir, close_range,
        # _exit, ...) was looked up again in every child, whose GOT write is a copy-on-write fault: ~14 page
        # faults per call here. The worker drops the variable once started, so calls do not inherit it.
        env = {**sandbox.env, "SHOAL_FN_PATH": f"{WORKER_DIR}/lib", "LD_BIND_NOW": "1"}
        argv = ["python3", "-c", BOOT, f"{WORKER_DIR}/worker.py", SOCKET, str(CALL_UID), str(CALL_GID), *key.modules]
        process = await agent.exec(argv, env=env, cwd="/", cap_bytes=1 << 16)
        ready = await asyncio.wait_for(_ready_line(process, key.image), 60)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            # through a descriptor of its directory: the full path may exceed AF_UNIX's 108 bytes
            root = sandbox.instance.rootfs or Path(sandbox.instance.directory) / "rootfs"
            where = Path(root) / SOCKET.lstrip("/")
            dirfd = os.open(where.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                await loop.sock_connect(sock, f"/proc/self/fd/{dirfd}/{where.name}")
            finally:
                os.close(dirfd)
            procs, pids = call_limits.open_procs(dirs), call_limits.open_pids(dirs)
            try:
                hand_over(sock, procs, pids)
            finally:
                for fd in (*procs, *pids):
                    os.close(fd)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            await process.close()
            raise
        worker = Worker(key, sandbox, dirs, reader, writer, process, ready["python"])
        if ready.get("failed_imports"):
            log.warning("function worker %s could not pre-import: %s", sandbox.id, ready["failed_imports"])
        worker.watcher = asyncio.ensure_future(_watch(worker))
        return worker

    async def _stop_worker(self, worker: Worker) -> None:
        worker.broken = True
        worker.close()
        try:
            worker.writer.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            await worker.process.close()
        except Exception:  # noqa: BLE001
            pass
        await asyncio.shield(self.node.destroy_sandbox(worker.sandbox))

    async def set_warm(self, spec: SandboxSpec, size: int, wait: bool = False) -> dict[str, Any]:
        """Keep `size` workers of this image warm; 0 stops its idle workers now (demand starts them again)."""
        self._check_spec(spec)
        await self.node.image_named(spec.image)
        pool = self._pool(spec)
        pool.warm = max(0, size)
        if pool.warm == 0:  # like a container pool of size 0: idle workers of the image (any modules) go now
            pools = [each for key, each in self.pools.items() if key.image == spec.image]
            while True:
                for each in pools:
                    each.warm = 0
                    while each.idle:
                        self._background_stop(each.idle.pop())
                if not wait or not any(each.starting for each in pools):
                    break
                await asyncio.sleep(0.05)  # workers still starting join the idle set, then go too
            if wait:
                await asyncio.gather(*self._stopping, return_exceptions=True)
        pool.grow()
        if wait:
            async with asyncio.timeout(120):
                while len(pool.idle) + len(pool.busy) < pool.warm:
                    if pool.last_error is not None and pool.starting == 0:
                        raise pool.last_error
                    await asyncio.sleep(0.02)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "sandboxes": len(self.sandboxes),
            "max_workers": MAX_WORKERS,
            "pools": {_pool_name(k): p.stats() for k, p in self.pools.items()},
        }

    # ---------------------------------------------------------------- one request through one worker

    async def _run(
        self, spec: SandboxSpec, request: dict[str, Any], budget_s: float, pickled_by: str | None = None
    ) -> dict[str, Any]:
        """Lease a worker (one holding cloudpickle if `pickled_by`, the client's Python), run, release."""
        check_python = pickled_by
        pool = self._pool(spec, pickled=pickled_by is not None)
        worker = await pool.lease()
        try:
            if check_python and check_python != "unknown" and worker.python != check_python:
                raise InvalidRequestError(
                    f"a Python function pickled by Python {check_python} cannot run under the image's Python "
                    f"{worker.python}: pass its source as a string instead, or use an image with Python {check_python}"
                )
            limits = CallLimits(memory_mb=_memory_mb(spec), pids=spec.pids or 1024, cpu=spec.cpu)
            self.calls += 1
            timeouts = [step.get("timeout") for step in request["steps"]]
            kill_after = sum(timeouts) + KILL_GRACE_S * len(timeouts) if all(timeouts) else None
            reply = await worker.run(request, limits, budget_s, kill_after)
        finally:
            pool.release(worker)
        if reply.get("error"):
            raise InvalidRequestError(f"the function call could not run: {reply['error']}")
        ooms = reply["oom_kills"] or int(reply["oom_killed"])
        for step in reversed(reply["steps"]):  # the OOM kills hit the last steps killed other than by a timeout
            if ooms and step["signal"] == 9 and not step["timed_out"]:
                step["oom_killed"] = True
                ooms -= 1
        return reply

    def _request(
        self, spec: SandboxSpec, steps: list[dict[str, Any]], files: dict[str, dict[str, Any]], **extra: Any
    ) -> dict[str, Any]:
        env = {"HOME": spec.workdir or WORKDIR, **self._image_env(spec), **spec.env}
        return {"cwd": spec.workdir or WORKDIR, "env": env, "files": files, "steps": steps, **extra}

    def _config(self, image: str) -> Any:
        """The image's config, cached (reading the store costs file reads); refreshed when a worker starts."""
        config = self._configs.get(image)
        if config is None:
            try:
                config = self._configs[image] = self.node.images.get(image).config
            except Exception:  # noqa: BLE001 - not built yet: the worker start builds it
                return None
        return config

    def _image_env(self, spec: SandboxSpec) -> dict[str, str]:
        config = self._config(spec.image)
        env = dict(config.env) if config else {}
        env.pop("HOME", None)
        return env

    @staticmethod
    def _budget(*timeouts: float | None) -> float:
        if any(t is None for t in timeouts):
            return NO_TIMEOUT_S
        return sum(t for t in timeouts if t) + SETUP_GRACE_S

    def _check_spec(self, spec: SandboxSpec) -> None:
        if spec.user not in (None, "nobody", str(CALL_UID)):
            raise InvalidRequestError(
                f"user={spec.user!r}: function calls always run as the unprivileged user 'nobody' so that "
                "nothing they do outlives them; use a container for other users"
            )
        if spec.workdir and not inside(spec.workdir):
            raise InvalidRequestError(
                f"workdir {spec.workdir!r}: a function sandbox works under {', '.join(WRITABLE)} (the places a "
                "call may write and that are wiped after it)"
            )
        for module in spec.preimport:
            if not all(part.isidentifier() for part in module.split(".")):
                raise InvalidRequestError(f"preimport: {module!r} is not a module name")
        if spec.runtime not in ("shoal", "crun", "runc"):
            raise InvalidRequestError(
                f"runtime {spec.runtime!r}: function workers run on shoal, crun or runc (the node hands each worker "
                "its call cgroup and reaches it through the host view of its root filesystem)"
            )

    # ---------------------------------------------------------------- the sandbox-shaped API

    def owns(self, sandbox_id: str) -> bool:
        return sandbox_id in self.sandboxes

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self._check_spec(spec)
        await self.node.image_named(spec.image)
        now = time.time()
        sandbox = FnSandbox(
            id=f"{self.node.settings.node_id}-fn-{secrets.token_hex(6)}",
            spec=spec,
            created_at=now,
            expires_at=now + spec.ttl_s if spec.ttl_s else None,
        )
        for path, data in spec.files.items():
            self._stage(sandbox, path, data, 0o644)
        pool = self._pool(spec)
        if pool.size == 0:  # start one worker now so the first exec finds it warm
            pool.warm = max(pool.warm, 1)
            pool.grow()
        self.sandboxes[sandbox.id] = sandbox
        return sandbox.info()

    def get(self, sandbox_id: str) -> FnSandbox:
        return self.sandboxes[sandbox_id]

    def list(self, labels: dict[str, str] | None) -> list[SandboxInfo]:
        return [
            s.info()
            for s in self.sandboxes.values()
            if not labels or all(s.spec.labels.get(k) == v for k, v in labels.items())
        ]

    def kill(self, sandbox_id: str, reason: str = "closed by the client") -> bool:
        if self.sandboxes.pop(sandbox_id, None) is None:
            return False
        self.node.remember_closed(sandbox_id, reason)
        return True

    def keepalive(self, sandbox_id: str, ttl_s: float | None) -> SandboxInfo:
        sandbox = self.sandboxes[sandbox_id]
        ttl = ttl_s or sandbox.spec.ttl_s
        if ttl:
            sandbox.expires_at = time.time() + ttl
        return sandbox.info()

    async def exec(self, req: ExecRequest, emit: Any = None) -> ExecResult:
        sandbox = self.sandboxes[req.sandbox_id]
        if req.user not in (None, "nobody", str(CALL_UID)):
            raise InvalidRequestError(f"user={req.user!r}: function calls run as 'nobody'; use a container")
        argv = list(req.cmd) if isinstance(req.cmd, list) else [*self._shell(sandbox.spec), "-c", req.cmd]
        if not argv:
            raise InvalidRequestError("empty command")
        cap = req.output_cap_bytes or sandbox.spec.output_cap_bytes or self.node.settings.output_cap_bytes
        step = {
            "argv": argv,
            "stdin": b64(req.stdin) if req.stdin else None,
            "timeout": req.timeout,
            "idle_timeout": req.idle_timeout,
            "cap": cap,
            "merge_stderr": req.merge_stderr,
        }
        request = self._request(sandbox.spec, [step], sandbox.staged())
        request["env"].update(req.env)
        if req.cwd:
            request["cwd"] = req.cwd if req.cwd.startswith("/") else str(PurePosixPath(sandbox.workdir) / req.cwd)
            if not inside(request["cwd"]):
                raise InvalidRequestError(f"cwd {req.cwd!r}: function calls work under {', '.join(WRITABLE)}")
        reply = await self._run(sandbox.spec, request, self._budget(req.timeout))
        result = _exec_result(reply["steps"][0])
        if emit is not None and req.stream:
            for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
                if data:
                    await emit(OutputChunk(stream=stream, data=data))
        return result

    def _shell(self, spec: SandboxSpec) -> list[str]:
        config = self._config(spec.image)
        return list(config.shell or ["/bin/sh"]) if config else ["/bin/sh"]

    # ---------------------------------------------------------------- staged files

    def _path(self, sandbox: FnSandbox, path: str) -> str:
        full = os.path.normpath(path if path.startswith("/") else os.path.join(sandbox.workdir, path))
        if not inside(full):
            raise InvalidRequestError(
                f"{path}: a function sandbox's files live under {', '.join(WRITABLE)}, the places its calls "
                "may write (and that are wiped after each call); use a container for files elsewhere"
            )
        return full

    def _stage(self, sandbox: FnSandbox, path: str, data: bytes, mode: int, append: bool = False) -> int:
        full = self._path(sandbox, path)
        if full in sandbox.dirs:
            raise IsADirectoryError(f"{path} is a directory")
        if append and full in sandbox.files:
            data = sandbox.files[full][0] + data
        total = sum(len(d) for p, (d, _) in sandbox.files.items() if p != full) + len(data)
        if total > MAX_STAGED_BYTES:
            raise InvalidRequestError(
                f"a function sandbox stages at most {MAX_STAGED_BYTES >> 20} MB of input files; "
                "use a container for larger inputs"
            )
        sandbox.files[full] = (bytes(data), mode & 0o7777)
        return len(data)

    def file_write(self, sandbox_id: str, path: str, data: bytes, mode: int, append: bool) -> int:
        return self._stage(self.sandboxes[sandbox_id], path, data, mode, append)

    def file_read(self, sandbox_id: str, path: str, max_bytes: int) -> bytes:
        sandbox = self.sandboxes[sandbox_id]
        full = self._path(sandbox, path)
        if full not in sandbox.files:
            raise FileNotFoundError(
                f"{path}: no such input file in function sandbox {sandbox_id} (what calls write is discarded "
                "after each call; collect it with run_code(output_files=...))"
            )
        data = sandbox.files[full][0]
        if len(data) > max_bytes:
            raise InvalidRequestError(f"{path} has {len(data)} bytes, more than max_bytes={max_bytes}")
        return data

    def _is_dir(self, sandbox: FnSandbox, full: str) -> bool:
        prefix = full.rstrip("/") + "/"
        return (
            full in sandbox.dirs
            or full in WRITABLE
            or full == sandbox.workdir
            or any(p.startswith(prefix) for p in [*sandbox.files, *sandbox.dirs])
        )

    def file_stat(self, sandbox_id: str, path: str) -> FileEntry | None:
        sandbox = self.sandboxes[sandbox_id]
        full = self._path(sandbox, path)
        now = time.time()
        if full in sandbox.files:
            data, mode = sandbox.files[full]
            return FileEntry(name=PurePosixPath(full).name, kind="file", size=len(data), mode=mode, mtime=now)
        if self._is_dir(sandbox, full):
            return FileEntry(name=PurePosixPath(full).name, kind="dir", size=0, mode=0o755, mtime=now)
        return None

    def file_list(self, sandbox_id: str, path: str, recursive: bool) -> list[FileEntry]:
        sandbox = self.sandboxes[sandbox_id]
        full = self._path(sandbox, path)
        if full in sandbox.files:
            raise NotADirectoryError(f"{path} is a file")
        if not self._is_dir(sandbox, full):
            raise FileNotFoundError(f"{path}: no such directory among the staged inputs")
        prefix = full.rstrip("/") + "/"
        names: dict[str, FileEntry] = {}
        now = time.time()
        for candidate in [*sandbox.files, *sandbox.dirs]:
            if not candidate.startswith(prefix):
                continue
            parts = candidate[len(prefix) :].split("/")
            for depth in range(1, len(parts) + 1 if recursive else 2):
                name = "/".join(parts[:depth])
                whole = prefix + name
                if whole in sandbox.files:
                    data, mode = sandbox.files[whole]
                    names[name] = FileEntry(name=name, kind="file", size=len(data), mode=mode, mtime=now)
                else:
                    names[name] = FileEntry(name=name, kind="dir", size=0, mode=0o755, mtime=now)
        return [names[n] for n in sorted(names)]

    def file_mkdir(self, sandbox_id: str, path: str) -> None:
        sandbox = self.sandboxes[sandbox_id]
        full = self._path(sandbox, path)
        if full in sandbox.files:
            raise FileExistsError(f"{path} is a file")
        sandbox.dirs.add(full)

    def file_remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        sandbox = self.sandboxes[sandbox_id]
        full = self._path(sandbox, path)
        if sandbox.files.pop(full, None) is not None:
            return
        prefix = full.rstrip("/") + "/"
        inner = [p for p in [*sandbox.files, *sandbox.dirs] if p.startswith(prefix)]
        if inner and not recursive:
            raise OSError(39, f"{path}: directory not empty (pass recursive=True)")
        if not inner and full not in sandbox.dirs:
            raise FileNotFoundError(f"{path}: no such staged input")
        for p in inner:
            sandbox.files.pop(p, None)
            sandbox.dirs.discard(p)
        sandbox.dirs.discard(full)

    # ---------------------------------------------------------------- call and run_code

    def _spec_for(self, spec: SandboxSpec, sandbox_id: str | None) -> tuple[SandboxSpec, dict[str, dict[str, Any]]]:
        if sandbox_id is None:
            self._check_spec(spec)
            return spec, {}
        if sandbox_id not in self.sandboxes:
            raise SandboxNotFoundError(f"no function sandbox {sandbox_id}")
        sandbox = self.sandboxes[sandbox_id]
        return sandbox.spec, sandbox.staged()

    async def call(
        self, spec: SandboxSpec, call: dict[str, Any], timeout: float | None, sandbox_id: str | None
    ) -> dict[str, Any]:
        spec, files = self._spec_for(spec, sandbox_id)
        python: dict[str, Any] = {}
        if call.get("pickle") is not None:
            python["pickle"] = b64(call["pickle"])
            python["args"] = b64(call.get("args") or b"")
        elif isinstance(call.get("source"), str):
            python.update(source=call["source"], entry=call.get("entry"))
            python.update(args=call.get("args") or [], kwargs=call.get("kwargs") or {})
        else:
            raise InvalidRequestError("a call needs a pickled function or Python source")
        cap = spec.output_cap_bytes or self.node.settings.output_cap_bytes
        step = {"python": python, "timeout": timeout, "cap": cap}
        reply = await self._run(
            spec,
            self._request(spec, [step], files),
            self._budget(timeout),
            pickled_by=str(call.get("python") or "unknown") if "pickle" in python else None,
        )
        return _call_outcome(reply["steps"][0], timeout, _memory_mb(spec))

    async def map(
        self,
        spec: SandboxSpec,
        call: dict[str, Any],
        items: list[Any],
        timeout: float | None,
        isolation: str = "item",
    ) -> list[dict[str, Any]]:
        """`call` once per item in one worker round trip; outcomes in order, a failure in place.

        isolation "item": each item a fresh forked child as `call` runs it, the worker wiping files,
        processes and IPC between items. "batch": the items run one after another in ONE child (the function
        loaded once), sharing its globals, files and processes; an item that ends the child (crash, timeout,
        OOM kill) fails alone and the rest run in a fresh child. Batches are isolated from each other."""
        if isolation not in ISOLATION:
            raise InvalidRequestError(f"isolation={isolation!r}: choose one of {', '.join(map(repr, ISOLATION))}")
        self._check_spec(spec)
        if not items:
            return []
        if len(items) > MAX_BATCH:
            raise InvalidRequestError(f"a map batch holds at most {MAX_BATCH} items; send more batches")
        python: dict[str, Any] = {}
        if call.get("pickle") is not None:
            python["pickle"] = b64(call["pickle"])
            steps_args = [{"args": b64(item or b"")} for item in items]
        elif isinstance(call.get("source"), str):
            python.update(source=call["source"], entry=call.get("entry"), kwargs=call.get("kwargs") or {})
            steps_args = [{"args": item if isinstance(item, list) else [item]} for item in items]
        else:
            raise InvalidRequestError("a map needs a pickled function or Python source")
        cap = spec.output_cap_bytes or self.node.settings.output_cap_bytes
        steps = [{"python": each, "timeout": timeout, "cap": cap} for each in steps_args]
        shared = {"shared_child": True} if isolation == "batch" else {"isolate": True}
        request = self._request(spec, steps, {}, python=python, **shared)
        reply = await self._run(
            spec,
            request,
            self._budget(*([timeout] * len(items))),
            pickled_by=str(call.get("python") or "unknown") if "pickle" in python else None,
        )
        memory = _memory_mb(spec)
        outcomes = [_call_outcome(step, timeout, memory) for step in reply["steps"]]
        if reply.get("aborted") or len(outcomes) < len(items):  # pragma: no cover - the caller went away
            raise SandboxLostError("the function worker stopped the batch before its end")
        return outcomes

    async def run_code(
        self,
        spec: SandboxSpec,
        language: str,
        code: str,
        stdin: bytes | None,
        files: dict[str, bytes],
        compile_timeout: float | None,
        run_timeout: float | None,
        output_files: list[str],
    ) -> dict[str, Any]:
        spec, staged = self._spec_for(spec, None)
        if language not in LANGUAGES:
            raise InvalidRequestError(f"language {language!r} is not supported; choose one of {sorted(LANGUAGES)}")
        sandbox = FnSandbox(id="run_code", spec=spec, created_at=0, expires_at=None)
        for path, data in files.items():
            self._stage(sandbox, path, data, 0o644)
        for path in output_files:
            self._path(sandbox, path)
        cap = spec.output_cap_bytes or self.node.settings.output_cap_bytes
        steps, source_file = run_code_steps(language, stdin, compile_timeout, run_timeout, cap)
        self._stage(sandbox, source_file, code.encode(), 0o644)
        request = self._request(spec, steps, sandbox.staged(), collect=list(output_files))
        reply = await self._run(spec, request, self._budget(compile_timeout, run_timeout))
        results = [_exec_result(s) for s in reply["steps"]]
        compiled = results[0] if len(steps) == 2 else None
        ran = results[-1] if len(results) == len(steps) else None
        out = {path: (None if data is None else _unb64(data)) for path, data in reply["files"].items()}
        return {
            "status": status_of(compiled, ran),
            "compile": None if compiled is None else compiled,
            "run": ran,
            "files": out,
        }


# ---------------------------------------------------------------- helpers


# How a worker starts: worker.py imported as a module, not run as python3's script. Run as the script
# (__main__) it held 8.4 MB of anonymous memory after start-up, imported 6.0 MB (python3.11 on Debian 12,
# the same modules, after gc.collect and malloc_trim), and every call's fork copies, and its child's exit
# tears down, the page tables of all of it (~0.09 ms per MB here). The path is the first argument (taken off
# before main() reads the rest), so the process still names worker.py.
BOOT = "import sys; path = sys.argv.pop(1); sys.path[0] = path.rpartition('/')[0]; import worker; worker.main()"


def _pool_name(key: WorkerKey) -> str:
    """image:runtime, then :pickled for workers holding cloudpickle, then :+modules for extra pre-imports."""
    extra = [m for m in key.modules if m not in PICKLED]
    return (
        f"{key.image}:{key.runtime}"
        + (":pickled" if "cloudpickle" in key.modules else "")
        + (f":+{','.join(extra)}" if extra else "")
    )


def _unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


def _exec_result(step: dict[str, Any]) -> ExecResult:
    return ExecResult(
        exit_code=step["exit_code"],
        stdout=_unb64(step["stdout"]),
        stderr=_unb64(step["stderr"]),
        duration_s=step["duration_s"],
        timed_out=step["timed_out"],
        truncated=step["truncated"],
        signal=step["signal"],
        oom_killed=bool(step.get("oom_killed")),
        stdout_omitted=int(step.get("stdout_omitted", 0)),
        stderr_omitted=int(step.get("stderr_omitted", 0)),
    )


def _call_outcome(step: dict[str, Any], timeout: float | None, memory_mb: int) -> dict[str, Any]:
    """A Python call's outcome as inert data: the value stays JSON text until the client parses it."""
    result = _exec_result(step)
    outcome: dict[str, Any] = {
        "ok": False,
        "value": None,
        "error": None,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "duration_s": result.duration_s,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "truncated": result.truncated,
    }
    parsed: Any = None
    if step.get("result"):
        try:
            parsed = json.loads(step["result"])
        except ValueError:
            parsed = None
    if result.timed_out:
        error = ("TimeoutError", f"the call ran longer than its timeout of {timeout}s and was killed")
    elif result.oom_killed:
        error = ("MemoryError", f"the call exceeded its memory limit of {memory_mb} MB and was killed; raise memory_mb")
    elif step.get("result_too_large"):
        error = ("ResultTooLarge", "the call's result exceeded 64 MB; return less, or write files")
    elif isinstance(parsed, dict) and parsed.get("ok") is True and isinstance(parsed.get("value"), str):
        outcome.update(ok=True, value=parsed["value"])
        return outcome
    elif isinstance(parsed, dict) and parsed.get("ok") is False:
        outcome["error"] = {
            "type": str(parsed.get("type", "Exception")),
            "message": str(parsed.get("message", "")),
            "traceback": str(parsed.get("traceback", "")),
        }
        return outcome
    elif result.signal:
        error = ("WorkerCrashed", f"the interpreter running the call died of signal {result.signal}")
    elif step.get("result"):
        error = ("MalformedResult", "the call wrote something other than a result to the result channel")
    else:
        error = ("WorkerCrashed", f"the interpreter exited with code {result.exit_code} before returning")
    outcome["error"] = {"type": error[0], "message": error[1], "traceback": ""}
    return outcome


async def _ready_line(process: Any, image: str) -> dict[str, Any]:
    """Read the worker's first stdout line (its readiness report); explain a worker that died instead."""
    out, err = bytearray(), bytearray()
    while b"\n" not in out:
        item = await process.next_output()
        if item is None:
            text = (bytes(err) or bytes(out)).decode(errors="replace")
            if "python3" in text and ("not found" in text or "No such file" in text):
                raise no_python_error(image)
            exit_info = process.exit
            if exit_info is not None and exit_info.exit_code == 127:
                raise no_python_error(image)
            raise SandboxLostError(f"the function worker in image {image!r} failed to start: {text[-2000:]}")
        (out if item[0] == "stdout" else err).extend(item[1])
    return json.loads(bytes(out).split(b"\n", 1)[0])


async def _watch(worker: Worker) -> None:
    """Drain the worker process's own output; when it exits, mark the worker broken (the pool replaces it)."""
    try:
        while True:
            item = await worker.process.next_output()
            if item is None:
                break
            if item[0] == "stderr":
                log.warning("function worker %s: %s", worker.sandbox.id, item[1][-2000:].decode(errors="replace"))
    except Exception:  # noqa: BLE001
        pass
    worker.broken = True


def _cloudpickle_files() -> list[tuple[str, bytes]]:
    """cloudpickle's pure-Python sources, shipped into each worker so pickled functions load there."""
    try:
        import cloudpickle
    except ImportError:
        return []
    root = Path(cloudpickle.__file__).parent
    return [(f"cloudpickle/{p.name}", p.read_bytes()) for p in sorted(root.glob("*.py"))]


def _memory_mb(spec: SandboxSpec) -> int:
    """A call's memory cap: its own, or SHOAL_FN_MEMORY_MB (shoal.resources holds every kind's default)."""
    return resources.memory_mb("function", spec.memory_mb) or settings.FN_MEMORY_MB.get()
