"""The node's side of images: composing layer stacks, mounting them, snapshots, builds and store operations.

`NodeService` delegates here. Disk work (unpacking, mkfs.erofs, hashing) runs in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shoal import shellvars
from shoal.errors import ImageError, InvalidRequestError, UnsupportedKindError
from shoal.images import Image, ImageConfig, ImageStore, erofs, layout, registry
from shoal.images.erofs import LayerMounts, unmount_stale
from shoal.protocol import SandboxSpec
from shoal.substrates.qemu import agentless

Emit = Callable[[Any], Awaitable[None]]

if TYPE_CHECKING:
    from shoal.node.sandbox import Sandbox
    from shoal.protocol import ExecResult
    from shoal.substrates import Substrate


class BuildHost(Protocol):
    """What image snapshots and builds need of the node (shoal.node.service.NodeService is one)."""

    substrates: dict[str, Substrate]

    async def spawn_sandbox(self, spec: SandboxSpec, image: Image) -> Sandbox: ...

    async def exec_in(self, sandbox: Sandbox, argv: list[str], timeout: float | None) -> ExecResult: ...

    async def kill(self, sandbox_id: str, reason: str = ...) -> bool: ...


log = logging.getLogger("shoal.images")

CONFIG_STEPS = ("env", "workdir", "user", "cmd", "entrypoint", "label", "shell")
BUILD_STEP_TIMEOUT_S = 3600.0
MAX_LOWERDIR_CHARS = 3500  # mount(2) options fit one page, shared with upperdir= and workdir=


class NodeImages:
    def __init__(self, store: ImageStore, mount_root: Path, linger_s: float = 0.0) -> None:
        self.store = store
        self.mounts = LayerMounts(mount_root, linger_s)
        self.mount_root = mount_root
        self._pulls: dict[tuple[str, str | None], tuple[asyncio.Future, list[Emit]]] = {}
        self._expiry: asyncio.TimerHandle | None = None  # when the earliest lingering layer's time ends
        self._expiring: asyncio.Task | None = None

    def reconcile(self) -> list[str]:
        return unmount_stale(self.mount_root)

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """`store.writing()` without blocking the loop while a prune holds the store."""
        hold = self.store.writing()
        entering = asyncio.ensure_future(asyncio.to_thread(hold.__enter__))
        try:
            await asyncio.shield(entering)
        except asyncio.CancelledError:  # the thread takes the lock anyway: give it back when it has
            entering.add_done_callback(
                lambda t: None if t.cancelled() or t.exception() else hold.__exit__(None, None, None)
            )
            raise
        try:
            yield
        finally:
            hold.__exit__(None, None, None)

    # ---------------------------------------------------------------- composition and mounts

    async def resolve(self, name: str, extra: list[str] | tuple[str, ...] = ()) -> Image:
        """Image `name` with the layers of the images in `extra` stacked on top (each layer once)."""
        base = await self._ensure(name)
        ids = list(base.layer_ids)
        env, labels = dict(base.config.env), dict(base.config.labels)
        for other_name in extra:
            other = await self._ensure(other_name)
            ids += [d for d in other.layer_ids if d not in ids]
            env.update(other.config.env)
            labels.update(other.config.labels)
        if not extra:
            return base
        config = dataclasses.replace(base.config, env=env, labels=labels)
        label = "+".join([name, *extra])
        return Image(label, tuple(self.store.layer_dir(d) for d in ids), config, tuple(ids))

    async def _ensure(self, name: str) -> Image:
        try:
            return self.store.get(name)
        except ImageError:
            return await asyncio.to_thread(self.store.ensure, name)

    async def acquire(self, image: Image) -> Image:
        """The same image with `layers` as mounted overlay lowers; pair with `release`.

        Mounting runs in a thread that a cancellation cannot stop, so a cancelled caller hands what the
        thread acquired straight back."""
        ids = image.layer_ids
        paths = self.mounts.acquire_mounted(ids)  # the common case, an image in use: no thread, no mount
        if paths is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._acquire_all, ids, image.layers))
            try:
                paths = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else self._release_all(ids))
                raise
        if sum(len(str(p)) + 1 for p in paths) > MAX_LOWERDIR_CHARS:
            await self.release(ids)
            raise ImageError(
                f"image {image.name!r} stacks {len(ids)} layers, more than one overlay mount takes here; "
                "flatten it with `client.image_squash(name, new_name)` (`shoal image squash NAME NEW`)"
            )
        return dataclasses.replace(image, layers=tuple(paths))

    def _acquire_all(self, ids: tuple[str, ...], directories: tuple[Path, ...]) -> list[Path]:
        paths: list[Path] = []
        try:
            for diff_id, directory in zip(ids, directories, strict=True):
                paths.append(self.mounts.acquire(diff_id, directory))
        except BaseException:
            self._release_all(ids[: len(paths)])
            raise
        return paths

    def _release_all(self, ids: tuple[str, ...] | list[str]) -> None:
        for diff_id in ids:
            self.mounts.release(diff_id)

    async def release(self, layer_ids: list[str] | tuple[str, ...]) -> None:
        if not self.mounts.release_if_shared(layer_ids):  # a last reference unmounts: off the loop
            await asyncio.to_thread(self._release_all, layer_ids)
        if self.mounts.linger_s > 0 and self._expiry is None and self._expiring is None:
            self._expire_at(time.monotonic() + self.mounts.linger_s)

    def _expire_at(self, when: float) -> None:
        """Close the layers that lingered their time (LayerMounts.close_idle) at `when`, and again at the next
        end while some linger: one timer for all of them."""
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_at(loop.time() + max(0.0, when - time.monotonic()) + 0.01, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._expiring = asyncio.ensure_future(asyncio.to_thread(self.mounts.close_idle))
        self._expiring.add_done_callback(self._expired)

    def _expired(self, task: asyncio.Task) -> None:
        self._expiring = None
        if task.cancelled():
            return
        if task.exception() is not None:  # the layer stays held: tried again at the next release
            log.warning("could not unmount a lingering layer: %s", task.exception())
            return
        next_end = task.result()
        if next_end is not None and self._expiry is None:
            self._expire_at(next_end)

    async def close(self) -> None:
        """Unmount every layer, lingering or not (the node's shutdown: its sandboxes are closed)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._expiring is not None:
            with contextlib.suppress(Exception):
                await self._expiring
        await asyncio.to_thread(self.mounts.release_all)

    # ---------------------------------------------------------------- snapshots

    async def snapshot(self, service: BuildHost, sandbox: Sandbox, name: str) -> dict[str, Any]:
        """Commit the sandbox's writes (deletions included) as one layer over its image; register `name`."""
        async with self._writing():
            diff_id = await self.snapshot_layer(service, sandbox)
            layers = [*sandbox.image.layer_ids, diff_id]
            await asyncio.to_thread(self.store.commit, name, layers, sandbox.image.config)
        return {"name": name, "layer": diff_id, "layers": layers, "size": self.store.layer_info(diff_id).size}

    async def snapshot_layer(self, service: BuildHost, sandbox: Sandbox) -> str:
        """The sandbox's upper directory as a committed layer. The sandbox is frozen while it is read:
        with EROFS only for mkfs.erofs (the tar blob is then packed from the new image), else for the tar."""
        if sandbox.spec.kind != "container":
            raise UnsupportedKindError(f"snapshots of {sandbox.spec.kind} sandboxes are not supported yet")
        substrate = service.substrates[sandbox.spec.kind]
        upper = Path(sandbox.instance.upper or sandbox.instance.directory / "upper")
        frozen = sandbox.state.value == "paused"
        with self.store.staging() as staging:
            if not frozen:
                await substrate.pause(sandbox.instance)  # a consistent view of the upper directory
            try:
                if erofs.supported():
                    await asyncio.to_thread(erofs.mkfs, upper, staging / "fs.erofs")
                else:
                    return await asyncio.to_thread(self.store.add_layer_dir, upper)
            finally:
                if not frozen:
                    await substrate.resume(sandbox.instance)
            return await asyncio.to_thread(self.store.add_layer_image, staging)

    # ---------------------------------------------------------------- builds

    async def build(
        self,
        service: BuildHost,
        name: str,
        base: str,
        steps: list[dict[str, Any]],
        no_cache: bool = False,
        network: Any = None,
        emit: Emit | None = None,
    ) -> dict[str, Any]:
        """Run build steps over `base`; each RUN or COPY becomes one layer, cached by (parent chain, step).
        RUN steps run with the network policy `network` (not part of the cache key, as in Docker)."""
        async with self._writing():
            return await self._build(service, name, base, steps, no_cache, network, emit)

    async def _build(
        self,
        service: BuildHost,
        name: str,
        base: str,
        steps: list[dict[str, Any]],
        no_cache: bool,
        network: Any,
        emit: Emit | None,
    ) -> dict[str, Any]:
        image = await self._ensure(base) if base != "scratch" else Image("scratch", (), ImageConfig(), ())
        layers = list(image.layer_ids)
        config = image.config
        key = "base:" + ",".join(layers)
        report = []
        for number, step in enumerate(steps, 1):
            op = step.get("op")
            if op in CONFIG_STEPS:
                config = _apply_config(config, step)
                key = _key(key, step)
                await _report(report, {"step": number, "op": op, "cached": True}, emit)
                continue
            if op == "copy":
                data = step.get("tar")
                if not isinstance(data, bytes):
                    raise InvalidRequestError(f"step {number}: copy needs the files as a tar in `tar`")
                key = _key(key, {"op": "copy", "sha256": hashlib.sha256(data).hexdigest()})
            elif op == "run":
                if not step.get("cmd"):
                    raise InvalidRequestError(f"step {number}: run needs a command")
                key = _key(key, {"op": "run", "cmd": step["cmd"], "config": dataclasses.asdict(config)})
            else:
                raise InvalidRequestError(f"step {number}: unknown build step {op!r}")
            cached = None if no_cache else self.store.cache_get(key)
            if cached is not None:
                layers.append(cached)
                await _report(report, {"step": number, "op": op, "cached": True, "layer": cached}, emit)
                continue
            if op == "copy":
                diff_id = await asyncio.to_thread(self.store.add_layer_tar, io.BytesIO(step["tar"]))
            else:
                diff_id = await self._run_step(service, layers, config, step, number, network)
            self.store.cache_put(key, diff_id)
            layers.append(diff_id)
            await _report(report, {"step": number, "op": op, "cached": False, "layer": diff_id}, emit)
        await asyncio.to_thread(self.store.commit, name, layers, config)
        return {"name": name, "layers": layers, "steps": report}

    async def _run_step(
        self,
        service: BuildHost,
        layers: list[str],
        config: ImageConfig,
        step: dict[str, Any],
        number: int,
        network: Any = None,
    ) -> str:
        if not layers:
            raise ImageError(f"step {number}: RUN needs a base image with a shell (FROM scratch has none)")
        image = Image("build", tuple(self.store.layer_dir(d) for d in layers), config, tuple(layers))
        spec = SandboxSpec(
            image="build", pool=False, workdir=config.workdir, labels={"shoal.build": "1"}, network=network or "none"
        )
        if config.user and config.user not in ("0", "0:0", "root"):
            spec.user = config.user
        sandbox = await service.spawn_sandbox(spec, image)
        try:
            cmd = step["cmd"]
            argv = list(cmd) if isinstance(cmd, list) else [*config.shell, "-c", cmd]
            result = await service.exec_in(sandbox, argv, timeout=step.get("timeout") or BUILD_STEP_TIMEOUT_S)
            if result.exit_code != 0 or result.timed_out:
                tail = (result.stdout + result.stderr)[-2000:].decode(errors="replace")
                why = "timed out" if result.timed_out else f"exited {result.exit_code}"
                raise ImageError(f"build step {number} (RUN {cmd!r}) {why}:\n{tail}")
            if sandbox.resolv_written:  # the node's resolver address is the build's, not the image's
                upper = Path(sandbox.instance.upper or sandbox.instance.directory / "upper")
                await asyncio.to_thread(_forget_upper_file, upper, "etc", "resolv.conf")
            return await self.snapshot_layer(service, sandbox)
        finally:
            await service.kill(sandbox.id, reason="build step done")

    # ---------------------------------------------------------------- store operations

    async def list(self) -> list[dict[str, Any]]:
        out = []
        for name in self.store.present():
            try:
                data = self.store.record(name)
            except ImageError:
                continue
            size = 0
            for diff_id in data["layers"]:
                try:
                    size += self.store.layer_info(diff_id).size
                except ImageError:
                    pass
            out.append({"name": name, "layers": len(data["layers"]), "size": size, "created": data.get("created")})
        return out

    async def inspect(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.inspect, name)

    async def remove(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.remove, name)

    async def squash(self, name: str, target: str) -> dict[str, Any]:
        image = await asyncio.to_thread(self.store.squash, name, target)
        return {"name": target, "layers": list(image.layer_ids)}

    async def prune(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            self.mounts.close_idle(everything=True)  # a lingering layer's flock would keep it from removal
            return self.store.prune()

        return await asyncio.to_thread(run)

    async def import_archive(self, path: str, name: str | None = None) -> list[str]:
        return await asyncio.to_thread(layout.import_archive, self.store, Path(path), name)

    async def import_disk(
        self,
        path: str,
        name: str,
        kernel: str | None,
        initrd: str | None,
        append: str | None,
        ready_port: int | None,
        disk_bus: str,
        nic: str,
    ) -> dict[str, Any]:
        """Register a VM disk image (converted to a standalone qcow2, with its kernel and initrd if it boots
        that way) as image `name`, one layer whose labels say how an agentless vm boots it."""
        labels = agentless.labels(bool(kernel), bool(initrd), append, ready_port, disk_bus, nic)
        store = self.store

        def work() -> dict[str, Any]:
            with store.writing(), store.staging() as staging:
                files = staging / "disk"
                agentless.import_disk(Path(path), files, kernel and Path(kernel), initrd and Path(initrd))
                diff_id = store.add_layer_dir(files, disposable=True)
            store.commit(name, [diff_id], ImageConfig(labels=labels))
            return {"name": name, "layers": [diff_id], "labels": labels}

        return await asyncio.to_thread(work)

    async def pull(
        self, reference: str, name: str | None, auth: str | None, platform: str | None, emit: Emit | None
    ) -> dict[str, Any]:
        """Pull from a registry; concurrent pulls of the same reference share one download."""
        key = (reference, name)
        if key not in self._pulls:
            listeners: list[Emit] = []
            wanted = tuple(platform.split("/", 1)) if platform else None
            progress = _progress_relay(asyncio.get_running_loop(), listeners)
            task = asyncio.ensure_future(
                asyncio.to_thread(
                    registry.pull, self.store, reference, name, auth=auth, platform=wanted, progress=progress
                )
            )
            self._pulls[key] = (task, listeners)
            task.add_done_callback(lambda _t: self._pulls.pop(key, None))
        task, listeners = self._pulls[key]
        if emit is not None:
            listeners.append(emit)
        try:
            return await asyncio.shield(task)
        finally:
            if emit is not None and emit in listeners:
                listeners.remove(emit)

    async def push(self, name: str, reference: str, auth: str | None, emit: Emit | None) -> dict[str, Any]:
        progress = _progress_relay(asyncio.get_running_loop(), [emit] if emit else [])
        return await asyncio.to_thread(registry.push, self.store, name, reference, auth=auth, progress=progress)

    async def export_archive(self, name: str, path: str) -> str:
        return await asyncio.to_thread(layout.export_archive, self.store, name, Path(path))


def _progress_relay(loop: asyncio.AbstractEventLoop, listeners: list[Emit]) -> registry.Progress:
    """A thread-side progress callback that forwards (at most ~10/s per blob) to async listeners."""
    last: dict[str, float] = {}

    def progress(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last.get(what, 0.0) < 0.1:
            return
        last[what] = now
        event = {"blob": what, "done": done, "total": total}
        for emit in list(listeners):
            loop.call_soon_threadsafe(lambda e=emit: asyncio.ensure_future(e(event)))

    return progress


async def _report(report: list[dict[str, Any]], entry: dict[str, Any], emit: Emit | None) -> None:
    report.append(entry)
    if emit is not None:
        await emit(entry)


def _key(parent: str, step: dict[str, Any]) -> str:
    return hashlib.sha256((parent + "\n" + json.dumps(step, sort_keys=True, default=str)).encode()).hexdigest()


def _apply_config(config: ImageConfig, step: dict[str, Any]) -> ImageConfig:
    op, value = step["op"], step.get("value")
    if step.get("expand"):  # references the SDK could not resolve: the image's environment so far
        if op == "env":
            value = {k: shellvars.expand(str(v), config.env) for k, v in dict(value).items()}
        elif op in ("workdir", "user"):
            value = shellvars.expand(str(value), config.env)
    if op == "env":
        return dataclasses.replace(config, env={**config.env, **dict(value)})
    if op == "label":
        return dataclasses.replace(config, labels={**config.labels, **dict(value)})
    if op == "workdir":
        path = str(value)
        if not path.startswith("/"):
            path = str(Path(config.workdir) / path)
        return dataclasses.replace(config, workdir=path)
    if op == "user":
        return dataclasses.replace(config, user=str(value))
    if op in ("cmd", "entrypoint", "shell"):
        return dataclasses.replace(config, **{op: list(value) if isinstance(value, list) else ["/bin/sh", "-c", value]})
    raise InvalidRequestError(f"unknown config step {op!r}")


def _forget_upper_file(upper: Path, directory: str, name: str) -> None:
    """Remove `directory/name` from an overlay upper directory (the lower layers' file shows again),
    never following a link the sandbox planted there."""
    try:
        top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        inner = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
    except OSError:
        return
    finally:
        os.close(top)
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=inner, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=inner)
    except OSError:
        pass
    finally:
        os.close(inner)
