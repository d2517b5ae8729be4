"""The `vm` kind: a complete Debian system (systemd as PID 1, the agent as a unit) on a qcow2 overlay."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from shoal.errors import ImageError
from shoal.guest import agent_binary_path
from shoal.images import Image, ImageConfig
from shoal.substrates.qemu.disk import base_disk
from shoal.substrates.qemu.screen import DEFAULT_VM_SCREEN
from shoal.substrates.qemu.substrate import QemuSubstrate
from shoal.substrates.vm.rootfs import AGENT_PATH, ensure_desktop_rootfs, ensure_vm_rootfs

DESKTOP_IMAGE = "vm-desktop"
_DESKTOP_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DISPLAY": ":0",  # the desktop's X server: exec'd X tools (xdotool, xwininfo) reach it
}


def _has_systemd(image: Image) -> bool:
    return any((layer / "usr/lib/systemd/systemd").exists() or (layer / "lib/systemd/systemd").exists()
               for layer in image.layers)  # fmt: skip


class VmSubstrate(QemuSubstrate):
    kind = "vm"
    machine_type = "q35"
    boot_mode = "vm"
    default_screens = {DESKTOP_IMAGE: DEFAULT_VM_SCREEN}  # a desktop without a screen would be no use
    # A desktop's agent answers later than the plain vm's (udev's coldplug of USB and input devices comes first):
    # minutes under TCG on a loaded host. Its template boots once per node; creates restore it.
    slow_boots = {DESKTOP_IMAGE: 600.0}

    def own_image(self, name: str) -> Image | None:
        """Image "vm-desktop" is built by shoal into the VM cache (vm/rootfs.py), not kept in the image store."""
        if name != DESKTOP_IMAGE:
            return None
        return Image(DESKTOP_IMAGE, (), ImageConfig(env=dict(_DESKTOP_ENV), shell=["/bin/bash"]), ())

    async def base_disk(self, image: Image) -> Path:
        """Images with systemd boot as they are; image "debian" boots shoal's systemd build of Debian and
        "vm-desktop" the same with an X desktop."""
        if image.name == DESKTOP_IMAGE and not image.layers:
            root = await asyncio.to_thread(ensure_desktop_rootfs, self.cache)
            image = dataclasses.replace(image, layers=(root,))
        elif not _has_systemd(image):
            if image.name != "debian":
                raise ImageError(
                    f"image {image.name!r} has no systemd, which a vm boots as PID 1; use image='debian' "
                    "(shoal builds a systemd Debian for vms), 'vm-desktop', an image with systemd, or "
                    "kind='microvm'"
                )
            root = await asyncio.to_thread(ensure_vm_rootfs, self.cache)
            image = dataclasses.replace(image, name="vm-debian", layers=(root,), layer_ids=())
        agent = {AGENT_PATH: agent_binary_path()}
        return await asyncio.to_thread(base_disk, image, self.cache, agent)
