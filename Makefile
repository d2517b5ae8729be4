# shoal: two commands on a fresh Debian machine (as root):  make demo   and   make test
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# chromium + chromium-driver: tests/test_console.py drives the web console in Debian's headless chromium (selenium)
# novnc: the live view of a screen (shoal/view.py serves /usr/share/novnc; tests/test_gui.py loads it in chromium)
# adb: Android's debug bridge client; tests/test_agentless.py carries it into an agentless vm (sb.adb())
# musl-tools: the guest agent is linked with musl (shoal/cbuild.py: glibc's start costs ~1 CPU-ms of CPUID exits)
APT_PACKAGES := crun runc bubblewrap mmdebstrap busybox-static erofs-utils iproute2 nftables e2fsprogs \
	qemu-system-x86 qemu-utils gcc libc6-dev musl-tools make psmisc procps file util-linux \
	skopeo umoci docker-registry openssl chromium chromium-driver novnc adb
PYTHON ?= python3

.PHONY: setup demo test test-fast bench bench-vm lint settings-doc clean-state apt runsc venv agent images vm-images

setup: apt venv agent images

apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@$(MAKE) --no-print-directory runsc

# gVisor: bookworm's runsc (0.0~20221219) has only the ptrace and KVM platforms, where every guest process costs
# host stub processes (docs/SECURITY.md); bookworm-backports carries 0.0~20240729, which has systrap. On bookworm
# the backports suite is added the Debian way (a sources entry on the same mirror) unless apt already has it;
# other releases take their own runsc (trixie's is newer than the backport).
RUNSC_MIN := 0.0~20240729
runsc:
	@have=$$(dpkg-query -W -f='$${Version}' runsc 2>/dev/null); \
	if [ -n "$$have" ] && dpkg --compare-versions "$$have" ge '$(RUNSC_MIN)'; then exit 0; fi; \
	. /etc/os-release; \
	if [ "$$VERSION_CODENAME" != bookworm ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc >/dev/null; exit $$?; \
	fi; \
	if ! grep -Eqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/*; then \
		echo "adding Debian's bookworm-backports suite (for runsc $(RUNSC_MIN))"; \
		printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
			'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' \
			> /etc/apt/sources.list.d/shoal-bookworm-backports.sources; \
	fi; \
	echo "installing runsc from bookworm-backports"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports runsc >/dev/null

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,cluster]'
	$(PY) -m pip install -q --no-deps 'verl==0.9.1'  # its interface modules only (docs/RL.md); deps in [dev]
	$(PY) -m pip install -q --no-deps 'swebench==4.1.0'  # its Dockerfile templates only (tests/test_dockerfile.py)
	touch $@

venv: $(VENV)/.installed

agent: venv
	@$(PY) -c "from shoal.guest import agent_binary_path; print('agent:', agent_binary_path())"
	@$(PY) -c "from shoal.substrates.container.launcher import binary_path; print('launcher:', binary_path())"

# desktop (Xvfb + xterm + xdotool + python3-xlib for tests/test_gui.py; Xfce, scrot, noVNC for
# tests/test_e2b_desktop.py): about 5 minutes on a loaded 2-core machine
images: venv vm-images
	@$(PY) -m shoal.images.builtin busybox debian debian-dev desktop

# microvm/vm: Debian's kernel (apt-get download, unpacked into SHOAL_VM_CACHE), the initramfs, the systemd
# Debian root for `vm`, the same with Xorg and an xterm for image `vm-desktop` (≈3.5 min on a loaded 2-core
# machine), and the accelerator probe (KVM if a guest really boots under it, else TCG).
vm-images: venv agent
	@$(PY) -m shoal.substrates.qemu.kernel
	@$(PY) -c "from shoal.substrates.qemu.kernel import cache_dir; from shoal.substrates.vm.rootfs import ensure_vm_rootfs; print('vm rootfs:', ensure_vm_rootfs(cache_dir()))"
	@$(PY) -c "from shoal.substrates.qemu.kernel import cache_dir; from shoal.substrates.vm.rootfs import ensure_desktop_rootfs; print('vm-desktop rootfs:', ensure_desktop_rootfs(cache_dir()))"
	@$(PY) -m shoal.substrates.qemu.accel

demo: setup
	$(VENV)/bin/shoal demo

test: setup
	$(VENV)/bin/pytest -q

# The fast tier: no root, no node, no images (pytest marker `fast`): op table, OCI bundle, QEMU command line,
# network rules, validation, settings, layers. Under 30 s: only the files that hold fast tests are collected.
test-fast: venv
	$(VENV)/bin/pytest -q -m fast -p no:cacheprovider $$(grep -l 'mark.fast' tests/test_*.py)

bench: setup
	$(PY) bench/bench_container.py
	$(PY) bench/bench_hotpath.py
	$(PY) bench/bench_images.py
	$(PY) bench/bench_security.py --userns 100000
	$(PY) bench/bench_function.py
	$(PY) bench/bench_humaneval.py
	$(PY) bench/bench_cluster.py
	$(PY) bench/bench_vm.py

bench-vm: setup
	$(PY) bench/bench_vm.py

# docs/SETTINGS.md from src/shoal/settings.py (tests/test_settings.py fails when it is stale)
settings-doc: venv
	PYTHONPATH=src $(PY) -W ignore::RuntimeWarning -m shoal.settings > docs/SETTINGS.md

# Style and layers: ruff, then the import contracts in pyproject.toml ([tool.importlinter]).
lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	PYTHONPATH=src $(VENV)/bin/lint-imports
