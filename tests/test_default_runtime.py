"""The node's default runtime (SHOAL_RUNTIME, "auto"): a container or function sandbox that names no runtime
gets shoal's launcher where the host runs it, else crun, chosen once at node start and reported with its reason;
an explicit runtime= keeps working; records, warm pools and function worker pools hold the concrete runtime,
so a sandbox is closed and re-adopted by the runtime that made it whatever the default is later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NodeProcess, default_runtime, no_leftovers, runtime_unavailable

import shoal

pytestmark = pytest.mark.usefixtures("function_workers_retired")  # its call starts a warm worker


def _record(node: NodeProcess, sandbox_id: str) -> dict:
    return json.loads((node.home / "sandboxes" / sandbox_id / "record.json").read_text())


def test_a_sandbox_that_names_no_runtime_gets_the_nodes_and_its_record_keeps_it(
    client: shoal.Client, node: NodeProcess
) -> None:
    expected = default_runtime()
    chosen = client.status()["runtime"]
    assert chosen["default"] == expected and chosen["reason"], chosen
    with (
        client.create(image="busybox", pool=False, ttl_s=300) as default,
        client.create(image="busybox", pool=False, ttl_s=300, runtime="crun") as crun,
    ):
        assert _record(node, default.id)["runtime"] == expected
        assert _record(node, default.id)["node"]["spec"]["runtime"] == expected  # concrete, not "the default"
        assert _record(node, crun.id)["runtime"] == "crun"
        assert default.exec("echo hi").stdout == crun.exec("echo hi").stdout == "hi\n"
    assert client.call("6 * 7") == 42  # the function kind's workers run on the default too
    assert f"debian:{expected}" in client.status()["functions"]["pools"]


def test_warm_pools_key_on_the_resolved_runtime(client: shoal.Client) -> None:
    """A pool set without a runtime holds sandboxes of the node's default: a create naming another runtime
    is never handed one of them, and one naming none is."""
    expected = default_runtime()
    other = "runc" if expected == "crun" else "crun"
    client.set_pool("container", "busybox", size=1, wait=True)
    try:
        assert any(f":busybox:{expected}:" in key for key in client.status()["pools"]), client.status()["pools"]
        hits = client.status()["pool_hits"]
        if runtime_unavailable(other) is None:
            with client.create(image="busybox", runtime=other, ttl_s=300) as cold:
                assert cold.exec("true").exit_code == 0
            assert client.status()["pool_hits"] == hits
        with client.create(image="busybox", ttl_s=300) as warm:
            assert warm.exec("true").exit_code == 0
        assert client.status()["pool_hits"] == hits + 1
    finally:
        client.set_pool("container", "busybox", size=0)


def test_setting_picks_the_runtime_and_a_bad_one_stops_the_node(tmp_path: Path) -> None:
    named = NodeProcess(tmp_path / "home", f"shoal-test-runtime-{os.getpid()}", SHOAL_RUNTIME="crun").start()
    try:
        with named.client() as client:
            assert client.status()["runtime"] == {
                "default": "crun", "setting": "crun", "reason": "named by SHOAL_RUNTIME",
            }  # fmt: skip
            with client.create(image="busybox", pool=False, ttl_s=300) as sb:
                assert _record(named, sb.id)["runtime"] == "crun"
    finally:
        named.stop()
    assert not no_leftovers(named.home, named.cgroup_parent, node_stopped=True)
    env = dict(os.environ, SHOAL_HOME=str(tmp_path / "bad"), SHOAL_CGROUP_PARENT=f"shoal-test-bad-{os.getpid()}",
               SHOAL_RUNTIME="docker")  # fmt: skip
    bad = subprocess.run([sys.executable, "-m", "shoal.node"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "SHOAL_RUNTIME='docker': choose one of auto, shoal, crun" in bad.stderr, bad
    assert not (tmp_path / "bad").exists()  # stopped before it made anything


def test_a_default_change_leaves_each_sandbox_on_the_runtime_that_made_it(tmp_path: Path) -> None:
    """Made under the launcher (auto), the node SIGKILLed and restarted with SHOAL_RUNTIME=crun: the adopted
    sandbox is still run, paused, resumed and closed as a launcher's, new ones are crun's, nothing is left."""
    if reason := runtime_unavailable("shoal"):
        pytest.skip(reason)
    parent = f"shoal-test-runtime-change-{os.getpid()}"
    first = NodeProcess(tmp_path / "home", parent).start()
    restarted = None
    try:
        with first.client() as client:
            assert client.status()["runtime"]["default"] == "shoal"
            kept = client.create(image="busybox", pool=False, ttl_s=600)
            kept.files.write("/kept", "made under shoal")
        first.stop(signal.SIGKILL)
        restarted = NodeProcess(first.home, parent, SHOAL_RUNTIME="crun").start()
        with restarted.client() as client:
            assert client.status()["adopted"] == [kept.id]
            assert client.status()["runtime"]["default"] == "crun"
            again = client.get(kept.id)
            assert _record(restarted, kept.id)["runtime"] == "shoal"
            again.pause()
            assert again.files.read_text("/kept") == "made under shoal"  # resumed transparently
            with client.create(image="busybox", pool=False, ttl_s=300) as new:
                assert _record(restarted, new.id)["runtime"] == "crun"
            assert client.close_all() == 1
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
    finally:
        if restarted is None:
            first.stop(signal.SIGKILL)
            restarted = NodeProcess(first.home, parent).start()
        restarted.stop()
    assert not no_leftovers(first.home, parent, node_stopped=True)
