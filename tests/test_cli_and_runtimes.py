"""The CLI, the async client, and the runtimes other than crun."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NodeProcess, default_runtime, no_leftovers

import shoal
from shoal import settings


def shoal_cli(node: NodeProcess, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SHOAL_HOME=str(node.home), SHOAL_IMAGES=str(node.paths.images))
    return subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, env=env)


def test_cli_run_ls_rm(node: NodeProcess, client: shoal.Client) -> None:
    run = shoal_cli(node, "run", "--image", "busybox", "--", "echo from-cli; exit 4")
    assert run.returncode == 4 and run.stdout == "from-cli\n"
    sb = client.create(image="busybox", labels={"cli": "yes"}, pool=False)
    listing = shoal_cli(node, "ls")
    assert sb.id in listing.stdout and "cli=yes" in listing.stdout
    assert shoal_cli(node, "rm", sb.id).returncode == 0
    with pytest.raises(shoal.SandboxClosedError):
        sb.exec("true")
    bad = shoal_cli(node, "run", "--image", "nope", "--", "true")
    assert bad.returncode == 1 and "ImageNotFoundError" in bad.stderr


def test_demo_uses_its_sandboxes_reports_their_memory_and_closes_them(node: NodeProcess, client: shoal.Client) -> None:
    """`make demo` is the quick start's main job: every sandbox it makes answers, the figures it prints are
    measured (memory from the sandboxes' own cgroups), and it leaves none behind."""
    run = shoal_cli(node, "demo", "--count", "24", "--concurrency", "8", "--image", "busybox")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "24 ready in" in run.stdout and "24/24 ok" in run.stdout and "cleanup 24 closed" in run.stdout, run.stdout
    charged = run.stdout.split("memory charged to their cgroups p50 ")[1].split(" MiB")[0]
    assert 0 < float(charged) < 64, run.stdout  # an idle busybox sandbox: its shell and agent, well under 64 MiB
    assert client.list(labels={"demo": "shoal"}) == []


def test_doctor_names_what_it_checks() -> None:
    env = dict(os.environ)
    if settings.TEST_USERNS.is_set():  # as the test nodes run
        env[settings.USERNS.name] = settings.TEST_USERNS.raw() or ""
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "doctor"], capture_output=True, text=True, env=env)
    for name in ("runtime crun", "overlayfs", "cgroups", "kvm", "default runtime"):
        assert name in out.stdout
    # which runtime a container that names none gets here, and why (the node decides the same at start)
    chosen, setting = default_runtime(), (settings.RUNTIME.get() or "auto").lower()
    assert (f"auto → {chosen}: " if setting == "auto" else f"{chosen} (SHOAL_RUNTIME=") in out.stdout, out.stdout
    assert out.returncode == 0, out.stdout


def test_node_stop_closes_or_keeps_sandboxes_and_other_settings_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from shoal import cgroups

    node = NodeProcess(tmp_path / "home", f"shoal-test-stop-{os.getpid()}", SHOAL_OUTPUT_CAP="4096").start()

    def stop(*args: str) -> str:
        env = dict(os.environ, SHOAL_HOME=str(node.home))
        done = subprocess.run([sys.executable, "-m", "shoal.cli", "node", "stop", *args], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        monkeypatch.setenv("SHOAL_OUTPUT_CAP", "8192")  # the node runs with 4096: the client is told
        with pytest.warns(shoal.NodeSettingsWarning, match="SHOAL_OUTPUT_CAP.*shoal node stop"):
            client = shoal.Client(home=str(node.home))
        client.close()
        monkeypatch.setenv("SHOAL_OUTPUT_CAP", "4096")
        with warnings.catch_warnings():
            warnings.simplefilter("error", shoal.NodeSettingsWarning)  # same settings: no warning
            client = shoal.Client(home=str(node.home), autostart=False)
        with client:
            kept = client.create(image="busybox", pool=False, ttl_s=600)
            kept.exec("echo before > /mark")
        assert "keep running" in stop("--keep")
        assert cgroups.procs(f"/{node.cgroup_parent}/{kept.id}"), "the kept sandbox must still run"
        node.start()
        with shoal.Client(home=str(node.home), autostart=False) as client:
            assert kept.id in client.status()["adopted"]
            assert client.get(kept.id).exec("cat /mark").stdout == "before\n"
        assert "sandboxes were closed" in stop()
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)
        assert "no shoal node is running" in stop()
    finally:
        node.stop()


@pytest.mark.fast
def test_blocking_api_is_documented_and_typed() -> None:
    """help() on the blocking API says what each call does, and type checkers see the package's hints."""
    import importlib.resources
    import inspect
    import tomllib
    from pathlib import Path

    from shoal.client import sync

    undocumented = []
    for cls in (sync.Client, sync.Sandbox, sync.Files, sync.Shell, sync.SyncExecStream):
        assert cls.__doc__, cls
        for name, member in vars(cls).items():
            member = member.fget if isinstance(member, property) else member
            if (not name.startswith("_") or name == "__iter__") and callable(member) and not inspect.getdoc(member):
                undocumented.append(f"{cls.__name__}.{name}")
    assert not undocumented, f"blocking methods without a docstring: {undocumented}"
    assert "node" in inspect.getdoc(sync.Client.status) and "output" in inspect.getdoc(sync.Sandbox.exec_stream)
    assert importlib.resources.files("shoal").joinpath("py.typed").is_file()
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["shoal"]  # shipped in the wheel


@pytest.mark.skipif(shutil.which("runc") is None, reason="runc is not installed on this host")
def test_runc_runs_the_same_bundle(client: shoal.Client) -> None:
    with client.create(image="busybox", runtime="runc", memory_mb=64, pool=False) as sb:
        r = sb.exec("echo via-runc; cat /proc/1/cmdline | tr '\\0' ' '")
        assert r.stdout.startswith("via-runc\n/.shoal/agent")
        assert sb.exec("sleep 100", timeout=0.5).timed_out


@pytest.mark.skipif(shutil.which("runsc") is None, reason="gVisor (runsc) is not installed on this host")
def test_runsc_runs_the_same_bundle(client: shoal.Client, tmp_path) -> None:  # noqa: ANN001
    with client.create(image="busybox", runtime="runsc", pool=False) as sb:
        r = sb.exec("uname -r; echo $((6 * 7))")
        assert r.exit_code == 0 and r.stdout.endswith("42\n")
        assert r.stdout.split()[0] != os.uname().release, "gVisor reports its own kernel, not the host's"
        sb.files.write("/tmp/g", "gvisor")
        assert sb.files.read("/tmp/g") == b"gvisor"
        assert sb.exec("sleep 100", timeout=1).timed_out


def test_runsc_absent_is_a_clear_error(client: shoal.Client) -> None:
    if shutil.which("runsc"):
        pytest.skip("runsc is installed here; this test covers hosts without it")
    with pytest.raises(shoal.InvalidRequestError, match="gVisor"):
        client.create(image="busybox", runtime="runsc")


async def test_async_client_surface(aclient: shoal.AsyncClient) -> None:
    async with await aclient.create(image="busybox", env={"X": "y"}, pool=False) as sb:
        results = await asyncio.gather(*(sb.exec(f"echo $X{i}") for i in range(10)))
        assert [r.stdout for r in results] == [f"y{i}\n" for i in range(10)] or all(r.exit_code == 0 for r in results)
        chunks = [c async for c in sb.exec_stream("echo a; echo b >&2")]
        assert {c.stream for c in chunks} == {"stdout", "stderr"}
        await sb.files.write("/tmp/x", "async")
        assert await sb.files.read_text("/tmp/x") == "async"
        async with await sb.shell() as sh:
            await sh.run("cd /etc")
            assert (await sh.run("pwd")).stdout == "/etc\n"
        same = await aclient.get(sb.id)
        assert (await same.exec("echo $X")).stdout == "y\n"
