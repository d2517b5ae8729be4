"""Node recovery: a SIGKILLed node's successor re-adopts what still runs and cleans up what it cannot."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import NodeProcess, leftovers, no_leftovers, sandbox_pid, sandbox_roots, until
from test_network import EchoHost, reach

import shoal


def _dead(pid: int) -> bool:
    """`pid` is gone or a zombie (its cmdline reads empty)."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def test_sigkilled_node_under_load_is_recovered(tmp_path: Path) -> None:
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-recover-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            plain = [client.create(image="busybox", pool=False, labels={"k": "plain"}) for _ in range(3)]
            for i, sb in enumerate(plain):
                sb.files.write("/kept", f"file {i}")
                sb.exec("sleep 1000 >/dev/null 2>&1 &")
            paused = client.create(image="busybox", pool=False, labels={"k": "paused"})
            paused.files.write("/kept", "paused file")
            paused.pause()
            traj = client.create(image="busybox", pool=False, trajectory="recover/1")
            traj.exec("echo a >> /steps")
            victim = client.create(image="busybox", pool=False, labels={"k": "victim"})
            victim_pid = sandbox_pid(doomed.home, victim.id)
            stop = threading.Event()

            def load(sb: shoal.Sandbox) -> None:  # steps in flight when the node dies
                while not stop.is_set():
                    try:
                        sb.exec("echo x >> /load; sleep 0.05")
                    except shoal.ShoalError:
                        return

            threads = [threading.Thread(target=load, args=(sb,)) for sb in plain]
            for t in threads:
                t.start()
            time.sleep(0.5)
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.stop(signal.SIGKILL)
            stop.set()
            for t in threads:
                t.join()
        os.kill(victim_pid, signal.SIGKILL)  # this sandbox dies while no node watches it
        until(lambda: _dead(victim_pid), 10, "the victim to die")  # a loaded host runs it a while after the signal
        found = leftovers(doomed.home, doomed.cgroup_parent)
        assert len(found["agents"]) == 5 and found["mounts"] == []  # overlays: in each sandbox's namespace only
        assert len(sandbox_roots(doomed.home, doomed.cgroup_parent)) == 5

        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            status = client.status()
            assert sorted(status["adopted"]) == sorted([*(s.id for s in plain), paused.id, traj.id])
            assert list(status["lost"]) == [victim.id]
            for _ in range(2):  # every request for it says so
                with pytest.raises(shoal.SandboxLostError, match="could not re-adopt"):
                    client.get(victim.id)
            for i, sb in enumerate(plain):
                again = client.get(sb.id)
                assert again.files.read_text("/kept") == f"file {i}"
                assert "sleep 1000" in again.exec("ps").stdout
            assert client.get(paused.id).info.state == "paused"
            assert client.get(paused.id).files.read_text("/kept") == "paused file"  # transparent resume
            resumed = client.create(image="busybox", pool=False, trajectory="recover/1")
            assert resumed.id == traj.id and resumed.info.steps == 1
            resumed.exec("echo a >> /steps")  # fast-forwarded from the log kept across the restart
            resumed.exec("echo b >> /steps")
            assert resumed.files.read_text("/steps") == "a\nb\n"
            assert client.close_all() == 5
        found = no_leftovers(restarted.home, restarted.cgroup_parent)
        assert not found, found
    finally:  # also after a failed assertion: a node on this home closes whatever is left
        if restarted is None:
            doomed.stop(signal.SIGKILL)
            restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        restarted.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


def test_step_in_flight_at_node_death_is_not_run_twice(tmp_path: Path) -> None:
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-inflight-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            sb = client.create(image="busybox", pool=False, trajectory="inflight")
            sb.exec("echo 0 >> /f")
            killer = threading.Timer(0.5, os.kill, (doomed.pid, signal.SIGKILL))
            killer.start()
            with pytest.raises(shoal.NodeError):
                sb.exec("echo 1 >> /f; sleep 30")  # the node dies while this runs
            doomed.stop(signal.SIGKILL)
            restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
            # the same handle, reconnected: its retry of the step cannot know whether it ran
            with pytest.raises(shoal.ShoalError, match="running when the node stopped"):
                sb.exec("echo 1 >> /f; sleep 30")
            assert sb.exec("cat /f").stdout == "0\n1\n"  # the next step runs; nothing ran twice
        with restarted.client() as client:  # a new client re-issuing the whole trajectory
            again = client.create(image="busybox", pool=False, trajectory="inflight")
            assert again.exec("echo 0 >> /f").exit_code == 0
            with pytest.raises(shoal.ShoalError, match="running when the node stopped"):
                again.exec("echo 1 >> /f; sleep 30")
            assert again.exec("cat /f").stdout == "0\n1\n"  # logged result of that same step
            again.close()
    finally:
        (restarted or doomed).stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


def test_a_shell_lost_in_a_node_restart_says_so(tmp_path: Path) -> None:
    """A shell's process belongs to the node that opened it; after kill -9 of the node the sandbox is adopted
    but the shell is not: using it is a ShellLostError naming the restart, and a new shell works."""
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-shell-{os.getpid()}").start()
    restarted = None
    try:
        with doomed.client() as client:
            sb = client.create(image="busybox", pool=False, ttl_s=600)
            old = sb.shell()
            assert old.run("cd /tmp && echo $PWD").stdout == "/tmp\n"
            closed = sb.shell()
            closed.close()
            with pytest.raises(shoal.SandboxNotFoundError, match="it was closed") as info:
                closed.run("true")
            assert not isinstance(info.value, shoal.ShellLostError)
        doomed.stop(signal.SIGKILL)
        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            again = client.get(sb.id)
            with pytest.raises(shoal.ShellLostError, match="node restarted since it was opened.*open a new one"):
                client._run(client._async.call("shell_run", {"shell_id": old.id, "cmd": "pwd"}))
            with again.shell() as fresh:
                assert fresh.run("cd /etc && pwd").stdout == "/etc\n"
            again.close()
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
    finally:
        if restarted is None:
            doomed.stop(signal.SIGKILL)
            restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        restarted.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)


def test_sigkilled_node_readopts_networked_containers_and_microvms() -> None:
    """kill -9 of the node with 20 networked containers and 2 networked microvms running: the next node
    adopts all of them (the VMs' QEMUs kept running), every one answers, its policy still holds (the allowed
    echo server is reached, another port and another host are not), and closing them leaves nothing."""
    tag = os.getpid() % 100000
    subnet = 120 + os.getpid() % 20 * 2
    hosts = []
    home = Path(tempfile.mkdtemp(prefix="shoal-netrec-"))  # short: Unix socket paths are limited to 108 bytes
    doomed = NodeProcess(home, f"shoal-test-netrecover-{os.getpid()}")
    restarted = None
    try:
        hosts = [EchoHost(f"shrec{tag}{x}", subnet + i).start() for i, x in enumerate("ab")]
        a, b = hosts
        allowed, other_port, other_host = f"{a.address}:8080", f"{a.address}:9090", f"{b.address}:8080"
        expect = {allowed: "open", other_port: "closed", other_host: "closed"}
        doomed.start()
        with doomed.client() as client:
            vm_kinds = "microvm" in client.kinds()
            policy = [f"tcp://{allowed}"]
            containers = [client.create(image="debian", pool=False, network=policy, ttl_s=1800) for _ in range(20)]
            vms = [client.create("microvm", image="debian", pool=False, network=policy, ttl_s=1800)
                   for _ in range(2 if vm_kinds else 0)]  # fmt: skip
            addresses = {}
            for sb in [*containers, *vms]:
                assert reach(sb, *expect) == expect, sb.id
                addresses[sb.id] = sb.exec("cat /etc/resolv.conf; grep -v '^lo' /proc/net/fib_trie | sort -u").stdout
        doomed.stop(signal.SIGKILL)
        found = leftovers(doomed.home, doomed.cgroup_parent)
        assert len(found["agents"]) == 20 and len(found["qemu"]) == len(vms)  # all still run, unwatched
        restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
        with restarted.client() as client:
            status = client.status()
            assert sorted(status["adopted"]) == sorted(sb.id for sb in [*containers, *vms])
            assert status["lost"] == {}
            for sb in [*containers, *vms]:
                again = client.get(sb.id)
                assert again.exec("echo here").stdout == "here\n"
                assert reach(again, *expect) == expect, sb.id  # the policy still holds
                same = again.exec("cat /etc/resolv.conf; grep -v '^lo' /proc/net/fib_trie | sort -u").stdout
                assert same == addresses[sb.id]  # same address, gateway and resolver
            assert client.close_all() == len(containers) + len(vms)
        found = no_leftovers(restarted.home, restarted.cgroup_parent)
        assert not found, found
        if not vm_kinds:
            pytest.skip("QEMU is not installed: only the containers' half of this test ran")
    finally:  # also after a failed assertion: a node on this home closes whatever is left
        if doomed.paths.lock.exists():
            if restarted is None:
                doomed.stop(signal.SIGKILL)
                restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
            restarted.stop()
        for host in hosts:
            host.stop()
    assert not no_leftovers(doomed.home, doomed.cgroup_parent, node_stopped=True)
    shutil.rmtree(home, ignore_errors=True)
