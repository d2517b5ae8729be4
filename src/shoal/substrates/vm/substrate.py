"""The `vm` kind: a complete Debian system (systemd as PID 1, the agent as a unit) on a qcow2 overlay."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from shoal.errors import ImageError
from shoal.guest import agent_binary_path
from shoal.images import Image
from shoal.substrates.qemu.disk import base_disk
from shoal.substrates.qemu.substrate import QemuSubstrate
from shoal.substrates.vm.rootfs import AGENT_PATH, ensure_vm_rootfs


def _has_systemd(image: Image) -> bool:
    return any((layer / "usr/lib/systemd/systemd").exists() or (layer / "lib/systemd/systemd").exists()
               for layer in image.layers)  # fmt: skip


class VmSubstrate(QemuSubstrate):
    kind = "vm"
    machine_type = "q35"
    boot_mode = "vm"

    async def base_disk(self, image: Image) -> Path:
        """Images with systemd boot as they are; image "debian" boots shoal's systemd build of Debian."""
        if not _has_systemd(image):
            if image.name != "debian":
                raise ImageError(
                    f"image {image.name!r} has no systemd, which a vm boots as PID 1; use image='debian' "
                    "(shoal builds a systemd Debian for vms), an image with systemd, or kind='microvm'"
                )
            root = await asyncio.to_thread(ensure_vm_rootfs, self.cache)
            image = dataclasses.replace(image, name="vm-debian", layers=(root,), layer_ids=())
        agent = {AGENT_PATH: agent_binary_path()}
        return await asyncio.to_thread(base_disk, image, self.cache, agent)
