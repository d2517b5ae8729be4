"""The blocking SDK: thin wrappers that run the async implementation on a private event loop thread."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from shoal.client.aio import (
    DEFAULT_TIMEOUT,
    AsyncClient,
    AsyncFiles,
    AsyncSandbox,
    AsyncShell,
    ExecStream,
    ReplayReport,
)
from shoal.client.functions import RunCodeResult
from shoal.client.gui import Gui
from shoal.client.image import ImageBuilder
from shoal.client.procs import AsyncProcess
from shoal.client.results import ExecResult, FileEntry, SandboxInfo
from shoal.protocol import UNSET, OutputChunk, Unset

T = TypeVar("T")


class _Loop:
    """An event loop on a daemon thread; `run(coro)` blocks the caller until the coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="shoal-client", daemon=True)
        self.thread.start()
        # a script that ends without close(): its loop's tasks are cancelled at exit instead of being collected pending
        # (which printed "Task was destroyed but it is pending!"); the node keeps its sandboxes either way
        weakref.finalize(self, _shut_down, self.loop, self.thread)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed() or not thread.is_alive():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=2)
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=2)


class Client:
    """Blocking client. `with shoal.Client() as client:` connects to (and if need be starts) the node."""

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
    ) -> None:
        self._loop = _Loop()
        self._async = AsyncClient(
            address, home=home, autostart=autostart, token=token, ray_address=ray_address, project=project,
            owner=owner, tls_ca=tls_ca,
        )  # fmt: skip
        try:
            self._loop.run(self._async.connect())
        except BaseException:
            self._loop.stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (sandboxes live on until closed, killed or expired)."""
        self._run(self._async.close())
        self._loop.stop()

    def create(
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
    ) -> Sandbox:
        # the docstring is AsyncClient.create's (carried below), with the same signature
        options = {k: v for k, v in locals().items() if k not in ("self", "kind", "image")}
        return Sandbox(self, self._run(self._async.create(kind, image, **options)))

    def create_many(
        self, count: int, kind: str = "container", image: str = "debian", **options: Any
    ) -> list[Sandbox | Exception]:
        made = self._run(self._async.create_many(count, kind, image, **options))
        return [Sandbox(self, s) if isinstance(s, AsyncSandbox) else s for s in made]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self, self._run(self._async.get(sandbox_id)))

    def call(self, fn: Callable[..., Any] | str, *args: Any, **options: Any) -> Any:
        return self._run(self._async.call(fn, *args, **options))

    def map(self, fn: Callable[..., Any] | str, items: Iterable[Any], **options: Any) -> Iterator[Any]:
        return _iterate(self, self._async.map(fn, items, **options))

    def run_code(self, code: str, language: str = "python", **options: Any) -> RunCodeResult:
        return self._run(self._async.run_code(code, language, **options))

    def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return self._run(self._async.list(labels))

    def attach(self, target: str, *, seq: int | None = 0) -> Sandbox:
        return Sandbox(self, self._run(self._async.attach(target, seq=seq)))

    def pause_all(self, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return self._run(self._async.pause_all(labels))

    def resume_all(self, labels: dict[str, str] | None = None) -> int:
        return self._run(self._async.resume_all(labels))

    def log(self, target: str, *, since: int = 0) -> dict[str, Any]:
        return self._run(self._async.log(target, since=since))

    def replay(self, target: str, *, image: str | None = None, keep: bool = False) -> ReplayReport:
        return self._run(self._async.replay(target, image=image, keep=keep))

    def kill(self, sandbox_id: str) -> bool:
        return self._run(self._async.kill(sandbox_id))

    def close_all(self, labels: dict[str, str] | None = None) -> int:
        return self._run(self._async.close_all(labels))

    def set_pool(self, kind: str = "container", image: str = "debian", size: int = 1, **options: Any) -> dict:
        return self._run(self._async.set_pool(kind, image, size, **options))

    def status(self) -> dict[str, Any]:
        return self._run(self._async.status())

    def hello(self) -> dict[str, Any]:
        return self._run(self._async.hello())

    def cluster_status(self) -> dict[str, Any]:
        return self._run(self._async.cluster_status())

    def metrics(self) -> str:
        return self._run(self._async.metrics())

    def trajectory_find(self, target: str) -> list[dict[str, Any]]:
        return self._run(self._async.trajectory_find(target))

    def kinds(self) -> list[str]:
        return self._run(self._async.kinds())

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._run(self._async.delete_snapshot(snapshot_id))

    def build_image(self, name: str, image: ImageBuilder | None = None, **options: Any) -> dict[str, Any]:
        return self._run(self._async.build_image(name, image, **options))

    def images(self) -> list[str]:
        return self._run(self._async.images())

    def image_list(self) -> list[dict[str, Any]]:
        return self._run(self._async.image_list())

    def image_inspect(self, name: str) -> dict[str, Any]:
        return self._run(self._async.image_inspect(name))

    def image_rm(self, name: str) -> dict[str, Any]:
        return self._run(self._async.image_rm(name))

    def image_prune(self) -> dict[str, Any]:
        return self._run(self._async.image_prune())

    def image_squash(self, name: str, target: str) -> dict[str, Any]:
        return self._run(self._async.image_squash(name, target))

    def image_tag(self, source: str, target: str) -> None:
        self._run(self._async.image_tag(source, target))

    def image_import_disk(self, path: str | os.PathLike[str], name: str, **options: Any) -> dict[str, Any]:
        """See AsyncClient.image_import_disk: a VM disk image an agentless vm boots (kernel=, initrd=, append=,
        ready_port=, disk_bus=, nic=)."""
        return self._run(self._async.image_import_disk(path, name, **options))

    def image_import(self, path: str | os.PathLike[str], name: str | None = None) -> list[str]:
        return self._run(self._async.image_import(path, name))

    def image_pull(self, reference: str, name: str | None = None, **options: Any) -> dict[str, Any]:
        return self._run(self._async.image_pull(reference, name, **options))

    def image_push(self, name: str, reference: str, **options: Any) -> dict[str, Any]:
        return self._run(self._async.image_push(name, reference, **options))

    def image_export(self, name: str, path: str | os.PathLike[str]) -> str:
        return self._run(self._async.image_export(name, path))


class PortForward:
    """A local TCP port carried to a port inside a sandbox (see AsyncSandbox.forward)."""

    def __init__(self, client: Client, inner: Any) -> None:
        self._client = client
        self._inner = inner
        self.address: str = inner.address

    def close(self) -> None:
        self._client._run(self._inner.close())

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Adb:
    """adb connected to an agentless vm's adbd (see AsyncSandbox.adb): `.serial`, `.run(*args)`, `.close()`."""

    def __init__(self, client: Client, inner: Any) -> None:
        self._client = client
        self._inner = inner
        self.serial: str = inner.serial

    def connect(self, timeout: float = 60) -> Adb:
        self._client._run(self._inner.connect(timeout))
        return self

    def run(self, *args: str, timeout: float | None = 120) -> Any:
        """`adb -s <serial> ARGS...`: a subprocess.CompletedProcess (text)."""
        return self._client._run(self._inner.run(*args, timeout=timeout))

    def close(self) -> None:
        self._client._run(self._inner.close())

    def __enter__(self) -> Adb:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    """Blocking handle on one sandbox; `with client.create(...) as sb:` closes it at the end."""

    def __init__(self, client: Client, inner: AsyncSandbox) -> None:
        self._client = client
        self._inner = inner
        self.id = inner.id
        self.files = Files(client, inner.files)
        self.gui = Gui(client._run, inner.gui)

    @property
    def info(self) -> SandboxInfo:
        """The sandbox's record as last fetched (`refresh()` fetches it again)."""
        return self._inner.info

    @property
    def seq(self) -> int | None:
        """The next step's number in the sandbox's trajectory log (None: steps append at the end)."""
        return self._inner.seq

    @seq.setter
    def seq(self, value: int | None) -> None:
        self._inner.seq = value

    @property
    def fast_forwarded(self) -> int:
        """Steps this handle answered from the trajectory log instead of running them."""
        return self._inner.fast_forwarded

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.kind}:{self.info.image}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT, **options: Any) -> Any:
        """See AsyncSandbox.exec: an ExecResult, or with background=True a `Process` at once."""
        result = self._client._run(self._inner.exec(cmd, timeout=timeout, **options))
        return Process(self._client, result) if isinstance(result, AsyncProcess) else result

    def pty(self, cols: int = 80, rows: int = 24, **options: Any) -> Process:
        """See AsyncSandbox.pty: a program on a terminal of cols x rows."""
        return Process(self._client, self._client._run(self._inner.pty(cols, rows, **options)))

    def process(self, id: int) -> Process:
        """See AsyncSandbox.process: a handle on background process `id`, from any client."""
        return Process(self._client, self._client._run(self._inner.process(id)))

    def exec_stream(
        self, cmd: str | Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT, **options: Any
    ) -> SyncExecStream:
        return SyncExecStream(self._client, self._inner.exec_stream(cmd, timeout=timeout, **options))

    def shell(self) -> Shell:
        return Shell(self._client, self._client._run(self._inner.shell()))

    def call(self, fn: Callable[..., Any] | str, *args: Any, **options: Any) -> Any:
        return self._client._run(self._inner.call(fn, *args, **options))

    def refresh(self) -> SandboxInfo:
        return self._client._run(self._inner.refresh())

    def keepalive(self, ttl_s: float | None = None) -> None:
        self._client._run(self._inner.keepalive(ttl_s))

    def snapshot(self, name: str | None = None) -> Any:
        return self._client._run(self._inner.snapshot(name))

    def set_network(self, network: str | list[str] | dict[str, bool]) -> dict[str, Any]:
        """See `AsyncSandbox.set_network`."""
        return self._client._run(self._inner.set_network(network))

    def processes(self, *, background: bool = False) -> list[dict[str, Any]]:
        return self._client._run(self._inner.processes(background=background))

    def kill_processes(self, exec_id: int | None = None) -> dict[str, int]:
        return self._client._run(self._inner.kill_processes(exec_id))

    def usage(self) -> dict[str, Any]:
        """See `AsyncSandbox.usage`."""
        return self._client._run(self._inner.usage())

    def expose(self, port: int) -> str:
        """See AsyncSandbox.expose: a URL reaching `port` inside the sandbox through the node or gateway."""
        return self._client._run(self._inner.expose(port))

    def view(self) -> str:
        """See AsyncSandbox.view: a URL of the live view (noVNC) of the sandbox's screen."""
        return self._client._run(self._inner.view())

    def forward(self, port: int, local_port: int = 0) -> PortForward:
        """See AsyncSandbox.forward: 127.0.0.1:<local port> (`.address`) carries raw TCP to `port` inside the
        sandbox, served on the client's loop thread until `.close()` (or the `with` block's end)."""
        return PortForward(self._client, self._client._run(self._inner.forward(port, local_port)))

    def adb(self, port: int = 5555, *, connect: bool = True, program: str = "adb") -> Adb:
        """See AsyncSandbox.adb: adb connected through forward(5555) to an agentless vm's adbd."""
        return Adb(self._client, self._client._run(self._inner.adb(port, connect=connect, program=program)))

    def pause(self) -> dict[str, Any]:
        return self._client._run(self._inner.pause())

    def resume(self) -> None:
        self._client._run(self._inner.resume())

    def log(self, *, since: int = 0) -> list[dict[str, Any]]:
        return self._client._run(self._inner.log(since=since))

    def fork(self, count: int = 1) -> list[Sandbox | Exception]:
        results = self._client._run(self._inner.fork(count))
        return [r if isinstance(r, Exception) else Sandbox(self._client, r) for r in results]

    def close(self) -> None:
        self._client._run(self._inner.close())


def _iterate(client: Client, source: AsyncIterator[T]) -> Iterator[T]:
    """Drive an async iterator on the client's loop thread, yielding its items here as they come."""
    items: queue.Queue[Any] = queue.Queue(maxsize=1024)
    done = object()

    async def pump() -> None:
        try:
            async for item in source:
                try:
                    items.put_nowait(item)
                except queue.Full:  # the consumer is behind: wait without blocking the loop
                    await asyncio.to_thread(items.put, item)
        except BaseException as exc:  # hand the failure to the iterating thread
            items.put(_Failure(exc))
        finally:
            items.put(done)

    future = asyncio.run_coroutine_threadsafe(pump(), client._loop.loop)
    try:
        while (item := items.get()) is not done:
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        future.cancel()


class Process:
    """Blocking handle on a background process or terminal (see shoal.client.procs.AsyncProcess)."""

    def __init__(self, client: Client, inner: AsyncProcess) -> None:
        self._client = client
        self._inner = inner
        self.id = inner.id

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncProcess", "Process", 1)

    def __getattr__(self, name: str) -> Any:  # pid, pty, command, running, exit_code, exit_signal, offsets
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("stdout_offset", "stderr_offset"):
            setattr(self._inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def read(self, **offsets: int) -> tuple[bytes, bytes]:
        return self._client._run(self._inner.read(**offsets))

    def stream(self, *, timeout: float | None = None) -> Iterator[OutputChunk]:
        return _iterate(self._client, self._inner.stream(timeout=timeout))

    def wait(self, timeout: float | None = None) -> ExecResult:
        return self._client._run(self._inner.wait(timeout))

    def send_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        self._client._run(self._inner.send_stdin(data, eof=eof))

    def close_stdin(self) -> None:
        self._client._run(self._inner.close_stdin())

    def signal(self, signal: int = 15) -> None:
        self._client._run(self._inner.signal(signal))

    def kill(self) -> None:
        self._client._run(self._inner.kill())

    def resize(self, cols: int, rows: int) -> None:
        self._client._run(self._inner.resize(cols, rows))

    def refresh(self) -> Process:
        self._client._run(self._inner.refresh())
        return self


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class SyncExecStream:
    """Iterate to get OutputChunk(stream, data) as printed; `.result` holds the ExecResult after."""

    def __init__(self, client: Client, inner: ExecStream) -> None:
        self._client = client
        self._inner = inner

    @property
    def result(self) -> ExecResult | None:
        """The command's ExecResult once iteration has finished; None before."""
        return self._inner.result

    def __iter__(self) -> Iterator[OutputChunk]:
        """Start the command and yield its output as printed; breaking out early cancels it."""
        items: queue.Queue[Any] = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for chunk in self._inner:
                    items.put(chunk)
            except BaseException as exc:  # hand the failure to the iterating thread
                items.put(exc)
            finally:
                items.put(done)

        future = asyncio.run_coroutine_threadsafe(pump(), self._client._loop.loop)
        try:
            while (item := items.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()


class Shell:
    """Blocking handle on a persistent shell: `run` calls share working directory and environment."""

    def __init__(self, client: Client, inner: AsyncShell) -> None:
        self._client = client
        self._inner = inner
        self.id = inner.id

    def run(
        self, cmd: str, *, timeout: float | None = DEFAULT_TIMEOUT, idle_timeout: float | None = None
    ) -> ExecResult:
        return self._client._run(self._inner.run(cmd, timeout=timeout, idle_timeout=idle_timeout))

    def close(self) -> None:
        self._client._run(self._inner.close())

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Files:
    """Blocking file operations inside one sandbox (`sandbox.files`)."""

    def __init__(self, client: Client, inner: AsyncFiles) -> None:
        self._client = client
        self._inner = inner

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644, append: bool = False) -> int:
        return self._client._run(self._inner.write(path, data, mode=mode, append=append))

    def write_from(self, local: str | os.PathLike[str], path: str, *, mode: int | None = None) -> int:
        return self._client._run(self._inner.write_from(local, path, mode=mode))

    def read(self, path: str, *, max_bytes: int = 256 << 20) -> bytes:
        return self._client._run(self._inner.read(path, max_bytes=max_bytes))

    def read_text(self, path: str) -> str:
        return self._client._run(self._inner.read_text(path))

    def list(self, path: str = ".", *, recursive: bool = False) -> list[FileEntry]:
        return self._client._run(self._inner.list(path, recursive=recursive))

    def stat(self, path: str) -> FileEntry | None:
        return self._client._run(self._inner.stat(path))

    def exists(self, path: str) -> bool:
        return self._client._run(self._inner.exists(path))

    def mkdir(self, path: str) -> None:
        self._client._run(self._inner.mkdir(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._client._run(self._inner.remove(path, recursive=recursive))

    def upload(self, local_dir: str, remote_dir: str) -> int:
        return self._client._run(self._inner.upload(local_dir, remote_dir))

    def write_tar(self, remote_dir: str, data: bytes) -> int:
        return self._client._run(self._inner.write_tar(remote_dir, data))

    def download(self, remote_dir: str, local_dir: str) -> int:
        return self._client._run(self._inner.download(remote_dir, local_dir))


def _carry_docstrings() -> None:
    """Give each blocking method the docstring of the async method it wraps (they take the same arguments
    and return the same thing, only without `await`), so help() and IDEs show the same text for both."""
    pairs = [(Client, AsyncClient), (Sandbox, AsyncSandbox), (Files, AsyncFiles), (Shell, AsyncShell)]
    for blocking, wrapped in pairs:
        for name, method in vars(blocking).items():
            if name.startswith("_") or not callable(method) or method.__doc__:
                continue
            source = getattr(wrapped, name, None)
            if source is not None and source.__doc__:
                method.__doc__ = source.__doc__


_carry_docstrings()
