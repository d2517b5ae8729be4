"""Builders of the images shoal ships: `busybox` (tiny, instant), `debian` (minbase via mmdebstrap) and
`debian-dev` (debian plus the C and C++ toolchains, for `run_code`) and `desktop` (debian plus an X server
and the tools a GUI agent drives it with; see node/gui.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from shoal import settings
from shoal.errors import ImageError
from shoal.images.store import ImageConfig, ImageStore

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEBIAN_SUITE = settings.DEBIAN_SUITE.get()
DEBIAN_PACKAGES = ["bash", "coreutils", "python3", "ca-certificates", "procps"]
DEBIAN_DEV_PACKAGES = [*DEBIAN_PACKAGES, "gcc", "g++", "libc6-dev"]
# Small on purpose (no browser, no office): Xvfb, a terminal, xdotool/xwd for hand-driving, python3-xlib for
# the in-sandbox GUI helper (XTest input, GetImage screenshots) the node talks to, and x11vnc for the live view.
# The rest is what the unmodified e2b-desktop SDK runs through commands (docs/E2B.md): `startxfce4` (a minimal
# Xfce: session, window manager, desktop; no panel, no file manager), `scrot`, `xrandr`, `netstat`, `xdg-open`,
# `gtk-launch`, and noVNC's `novnc_proxy` under /opt/noVNC with websockify. Recommends are never installed.
# Its recipe is recorded: a store holding an older desktop rebuilds it.
DESKTOP_PACKAGES = [
    *DEBIAN_PACKAGES,
    "xvfb",
    "xfonts-base",
    "xterm",
    "xdotool",
    "x11-utils",
    "x11-apps",
    "python3-xlib",
    "x11vnc",  # the live view (shoal/view.py): VNC of the display on 127.0.0.1:5900, relayed by the node
    # e2b-desktop (2.7.2) runs these by name:
    "xfce4-session",  # startxfce4, xfce4-session
    "xfwm4",
    "xfdesktop4",
    "dbus-x11",  # dbus-launch: startxfce4's xinitrc starts the session bus with it
    "scrot",  # screenshot()
    "x11-xserver-utils",  # xrandr: get_screen_size()
    "net-tools",  # netstat: stream.start() waits for noVNC's port with it
    "websockify",  # noVNC's proxy (stream.start())
    "xdg-utils",  # xdg-open: open()
    "libgtk-3-bin",  # gtk-launch: launch()
]
# noVNC's web client and novnc_proxy, unpacked from Debian's `novnc` package without installing it: the package
# depends on nodejs (≈90 MB, for developer scripts the proxy never runs); e2b-desktop starts
# /opt/noVNC/utils/novnc_proxy, which runs the installed websockify.
_NOVNC_HOOK = (
    'chroot "$1" sh -ec "cd /tmp && apt-get download -q novnc && dpkg-deb -x novnc_*.deb / && rm -f novnc_*.deb'
    ' && ln -s /usr/share/novnc /opt/noVNC"'
)

_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
_SKELETON_DIRS = ["proc", "sys", "dev", "tmp", "etc", "root", "work", "run", "var/tmp", ".shoal"]
_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def build_busybox(rootfs: Path) -> ImageConfig:
    """A root filesystem of the host's static busybox and its applet links (≈2 MB, milliseconds)."""
    source = shutil.which("busybox")
    if source is None:
        raise ImageError("busybox is not installed: `apt-get install busybox-static`")
    probe = subprocess.run(["file", "-L", source], capture_output=True, text=True)
    if probe.returncode == 0 and "dynamically linked" in probe.stdout:
        raise ImageError(f"{source} is dynamically linked: `apt-get install busybox-static`")
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy2(source, rootfs / "bin" / "busybox")
    applets = subprocess.run([source, "--list"], capture_output=True, text=True, check=True).stdout
    for applet in applets.split():
        if applet != "busybox":
            (rootfs / "bin" / applet).symlink_to("busybox")
    for sub in _SKELETON_DIRS:
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    (rootfs / "etc" / "passwd").write_text(_PASSWD)
    (rootfs / "etc" / "group").write_text(_GROUP)
    return ImageConfig(env={"PATH": DEFAULT_PATH, "HOME": "/root"}, shell=["/bin/sh"])


def build_debian(rootfs: Path, packages: list[str] = DEBIAN_PACKAGES, hooks: tuple[str, ...] = ()) -> ImageConfig:
    """Debian minbase with bash, coreutils and python3, from the host's apt sources; `hooks` are mmdebstrap
    customize hooks (shell commands run with the new root as $1)."""
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed: `apt-get install mmdebstrap`")
    sources = _host_apt_sources()
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        "--quiet",
        f"--include={','.join(packages)}",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        *(f"--customize-hook={hook}" for hook in hooks),
        DEBIAN_SUITE,
        str(rootfs),
        *sources,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageError(
            f"mmdebstrap failed (exit {result.returncode}); check network access to Debian's "
            f"package mirror and the host's apt sources.\n{result.stderr[-2000:]}"
        )
    for sub in ["work", ".shoal"]:
        (rootfs / sub).mkdir(exist_ok=True)
    hosts = rootfs / "etc" / "hosts"
    if not hosts.exists():  # mmdebstrap writes none: without it `localhost` does not resolve (noVNC's proxy)
        hosts.write_text(_HOSTS)
    return ImageConfig(env={"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}, shell=["/bin/bash"])


def build_debian_dev(rootfs: Path) -> ImageConfig:
    """`debian` plus gcc, g++ and libc headers: what `run_code` needs for c and c++."""
    return build_debian(rootfs, DEBIAN_DEV_PACKAGES)


def build_desktop(rootfs: Path) -> ImageConfig:
    """`debian` plus Xvfb, xterm, xdotool, x11-utils/x11-apps and python3-xlib: a screen for GUI agents; and
    a minimal Xfce, scrot and noVNC for e2b-desktop."""
    config = build_debian(rootfs, DESKTOP_PACKAGES, hooks=(_NOVNC_HOOK,))
    config.env["DISPLAY"] = ":0"
    return config


def _host_apt_sources() -> list[str]:
    """The host's apt source files (mmdebstrap reads .list and .sources files given as mirrors)."""
    found = sorted(str(p) for p in Path("/etc/apt/sources.list.d").glob("*.sources"))
    found += sorted(str(p) for p in Path("/etc/apt/sources.list.d").glob("*.list"))
    main = Path("/etc/apt/sources.list")
    if main.exists() and any(line.startswith("deb") for line in main.read_text().splitlines()):
        found.insert(0, str(main))
    return found


def register_builtins(store: ImageStore) -> ImageStore:
    store.register_builtin("busybox", build_busybox)
    store.register_builtin("debian", build_debian)
    store.register_builtin("debian-dev", build_debian_dev)
    store.register_builtin(
        "desktop", build_desktop, recipe=" ".join([DEBIAN_SUITE, *DESKTOP_PACKAGES, _NOVNC_HOOK, _HOSTS])
    )
    return store


def main(argv: list[str] | None = None) -> int:
    """`python -m shoal.images.builtin NAME...`: build builtin images straight into the store, no node."""
    import sys

    from shoal.config import Paths

    names = (argv if argv is not None else sys.argv[1:]) or ["busybox", "debian"]
    store = register_builtins(ImageStore(Paths.from_env().images))
    for name in names:
        image = store.ensure(name)
        print(f"image {name}: {', '.join(str(p) for p in image.layers)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
