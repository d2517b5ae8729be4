"""Nothing leaks: mounts, cgroups, processes and directories are gone after every way a sandbox ends."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest
from conftest import NodeProcess, leftovers, no_leftovers, sandbox_pid, sandbox_roots

import shoal
from shoal.config import default_memory_mb, shm_state_dir


def test_many_cycles_leave_nothing(client: shoal.Client, node: NodeProcess) -> None:
    for _ in range(30):
        with client.create(image="busybox", pool=False) as sb:
            sb.exec("echo x > /tmp/f; sleep 100 & true")
            sh = sb.shell()
            sh.run("cd /tmp")
    batch = client.create_many(10, image="busybox", pool=False)
    for s in batch:
        assert isinstance(s, shoal.Sandbox)
        s.close()
    assert not no_leftovers(node.home, node.cgroup_parent)


async def test_cancelled_creates_leave_nothing(node: NodeProcess) -> None:
    async with node.async_client() as client:
        for delay in (0.0, 0.005, 0.01, 0.02, 0.04, 0.08):
            task = asyncio.ensure_future(client.create(image="busybox", pool=False, labels={"t": "cancel"}))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                made = await task
            except asyncio.CancelledError:
                continue
            await made.close()  # it finished before the cancel arrived
        await asyncio.sleep(0.5)
        assert await client.list(labels={"t": "cancel"}) == []
    assert not no_leftovers(node.home, node.cgroup_parent)


async def test_failed_batch_leaves_nothing(tmp_path) -> None:  # noqa: ANN001
    small = NodeProcess(tmp_path / "home", f"shoal-test-cap-{os.getpid()}", SHOAL_MAX_SANDBOXES="3").start()
    try:
        async with small.async_client() as client:
            made = await client.create_many(6, image="busybox", pool=False, concurrency=6)
            ok = [s for s in made if isinstance(s, shoal.AsyncSandbox)]
            failed = [s for s in made if isinstance(s, Exception)]
            assert len(ok) == 3 and len(failed) == 3
            assert all(isinstance(e, shoal.CapacityError) for e in failed)
            await client.close_all()
        assert not no_leftovers(small.home, small.cgroup_parent)
    finally:
        small.stop()
    assert not no_leftovers(small.home, small.cgroup_parent, node_stopped=True)


def test_killed_node_is_reconciled_on_restart(tmp_path) -> None:  # noqa: ANN001
    """Running sandboxes are re-adopted; those that died meanwhile are removed and reported lost."""
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-kill-{os.getpid()}").start()
    with doomed.client() as client:
        sandboxes = [client.create(image="busybox", pool=False) for _ in range(5)]
        for sb in sandboxes:
            sb.exec("sleep 1000 &")
        client.set_pool(image="busybox", size=1, wait=True)  # warm members are not adoptable: removed
    doomed.stop(signal.SIGKILL)
    found = leftovers(doomed.home, doomed.cgroup_parent)
    assert len(found["agents"]) == 6  # still running after the crash, each on its overlay, which is mounted
    assert len(sandbox_roots(doomed.home, doomed.cgroup_parent)) == 6  # in its own namespace only
    assert found["mounts"] == []
    dead = sandboxes[:2]
    for sb in dead:  # these die while no node watches them
        os.kill(sandbox_pid(doomed.home, sb.id), signal.SIGKILL)
    restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
    try:
        with restarted.client() as client:
            assert sorted(client.status()["adopted"]) == sorted(s.id for s in sandboxes[2:])
            assert {s.id for s in dead} <= set(client.status()["lost"])
            assert len(sandbox_roots(restarted.home, restarted.cgroup_parent)) == 3
            client.close_all()
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
    finally:
        restarted.stop()
    assert not no_leftovers(restarted.home, restarted.cgroup_parent, node_stopped=True)


def test_pools_from_settings_and_ttl_expiry_leave_nothing(tmp_path) -> None:  # noqa: ANN001
    pooled = NodeProcess(tmp_path / "home", f"shoal-test-pools-{os.getpid()}", SHOAL_POOLS="busybox=2").start()
    try:
        with pooled.client() as client:
            deadline = time.monotonic() + 30
            runtime = client.status()["runtime"]["default"]  # the node's (SHOAL_RUNTIME): the pool's key names it
            key = f"container:busybox:{runtime}:cpu=:mem={default_memory_mb()}:pids=1024"  # the node's default cap
            while client.status()["pools"].get(key, {}).get("ready") != 2:
                assert time.monotonic() < deadline, client.status()
                time.sleep(0.05)
            sb = client.create(image="busybox", ttl_s=0.3)
            assert client.status()["pool_hits"] == 1
            time.sleep(1.2)
            assert client.list() == []
            assert sb.id not in [d.name for d in (pooled.home / "sandboxes").iterdir()]
    finally:
        pooled.stop()
    assert not no_leftovers(pooled.home, pooled.cgroup_parent, node_stopped=True)


def test_client_reconnects_to_a_restarted_node(tmp_path) -> None:  # noqa: ANN001
    first = NodeProcess(tmp_path / "home", f"shoal-test-restart-{os.getpid()}").start()
    with first.client() as client:
        old_pid = first.pid
        assert client.status()["pid"] == old_pid
        first.stop()
        try:
            new_pid = client.status()["pid"]  # reconnects, starting a node again as Client() does
            assert new_pid != old_pid and new_pid == first.pid
        finally:
            first.stop()
    assert not no_leftovers(first.home, first.cgroup_parent, node_stopped=True)


def test_full_disk_is_a_clear_capacity_error(tmp_path) -> None:  # noqa: ANN001
    import subprocess

    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(home)], check=True)
    try:
        small = NodeProcess(home, f"shoal-test-disk-{os.getpid()}").start()
        try:
            with small.client() as client:
                # record=False: the trajectory log shares this full disk (a logged step would raise CapacityError)
                sb = client.create(image="busybox", pool=False, record=False)
                sb.exec("dd if=/dev/zero of=/fill bs=1M count=8 2>/dev/null; true")
                with pytest.raises(shoal.CapacityError, match="no space left"):
                    client.create(image="busybox", pool=False)
                sb.close()
                client.create(image="busybox", pool=False).close()  # space is back
        finally:
            small.stop()
        assert not no_leftovers(small.home, small.cgroup_parent, node_stopped=True)
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


@pytest.mark.parametrize("node_state", ["running", "killed"])
def test_the_session_sweeper_clears_a_killed_runs_leftovers(tmp_path_factory, node_state: str) -> None:  # noqa: ANN001
    """A run killed before its fixtures ran leaves its node (or, if that was killed too, its sandboxes) behind
    under a cgroup parent named after its pid: conftest's sweeper finds the parent by the dead pid and clears
    it; the parents of live runs (this one's included) are never candidates."""
    import subprocess

    from conftest import RUN_MARKS, dead_run_parents, sweep_dead_run

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer exists: the "killed run"
    parent = f"shoal-test-sweep-{gone.pid}"
    node = NodeProcess(tmp_path_factory.mktemp("sweep") / "home", parent).start()  # short: socket paths fit
    with node.client() as client:
        for _ in range(2):
            sb = client.create(image="busybox", pool=False, ttl_s=600)
            sb.exec("sleep 1000 >/dev/null 2>&1 &")
        client.create(image="busybox", pool=False, ttl_s=600).pause()
    if node_state == "killed":
        node.stop(signal.SIGKILL)
    assert parent not in dead_run_parents()  # not a test run's (no mark): a real node's, never swept
    # marked as a test run marks itself, only now: a concurrent run's session sweeper (another pytest on
    # this machine) would otherwise take this "killed run" while it is being set up
    (RUN_MARKS / str(gone.pid)).touch()
    assert parent in dead_run_parents()
    assert f"shoal-test-{os.getpid()}" not in dead_run_parents()  # this run is alive
    sweep_dead_run(parent)
    (RUN_MARKS / str(gone.pid)).unlink(missing_ok=True)  # a concurrent run's session sweeper may have taken it
    assert parent not in dead_run_parents()
    found = no_leftovers(node.home, parent, node_stopped=True)
    if node_state == "killed":  # no node cleaned the sandboxes' directories (nor the runtime's state files,
        found.pop("dirs", None)  # on tmpfs); nothing else may stay
        found.pop("runtime_state", None)
        shutil.rmtree(shm_state_dir(node.home), ignore_errors=True)
    assert not found, found
