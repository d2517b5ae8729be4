"""Pause/resume (files, processes and shells intact), TTL and idle timeouts in both modes, keepalive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import NodeProcess

import shoal


def _wait_state(client: shoal.Client, sandbox_id: str, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get(sandbox_id).info.state == state:
            return
        time.sleep(0.1)
    raise AssertionError(f"{sandbox_id} did not become {state}")


def _frozen(node: NodeProcess, sandbox_id: str) -> bool:
    path = f"/sys/fs/cgroup/freezer/{node.cgroup_parent}/{sandbox_id}/freezer.state"
    if os.path.exists(path):
        return open(path).read().strip() == "FROZEN"
    return "frozen 1" in open(f"/sys/fs/cgroup/{node.cgroup_parent}/{sandbox_id}/cgroup.events").read()


def test_pause_resume_cycles_lose_nothing(client: shoal.Client, node: NodeProcess) -> None:
    with client.create(image="debian", pool=False) as sb:
        pid = sb.exec("sleep 1000 >/dev/null 2>&1 & echo $!").stdout.strip()
        sh = sb.shell()
        sh.run("cd /tmp && export COUNT=0")
        for cycle in range(10):
            sb.files.write(f"/data/f{cycle}", f"cycle {cycle}\n" * 1000)
            info = sb.pause()
            assert info["state"] == "paused" and sb.refresh().state == "paused"
            assert _frozen(node, sb.id)
            assert info["memory_after"] <= info["memory_before"]
            sb.resume()
            assert not _frozen(node, sb.id)
            assert sh.run("COUNT=$((COUNT+1)); echo $COUNT $PWD").stdout.split() == [str(cycle + 1), "/tmp"]
        for cycle in range(10):
            assert sb.files.read_text(f"/data/f{cycle}") == f"cycle {cycle}\n" * 1000
        assert sb.exec(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"


def test_any_request_resumes_a_paused_sandbox(client: shoal.Client, node: NodeProcess) -> None:
    with client.create(image="busybox", pool=False) as sb:
        sb.files.write("/f", "kept")
        for request in (
            lambda: sb.exec("cat /f").stdout,
            lambda: sb.files.read_text("/f"),
            lambda: sb.shell().run("cat /f").stdout,
        ):
            sb.pause()
            assert request() == "kept"
            assert sb.refresh().state == "ready" and not _frozen(node, sb.id)


def test_pause_all_and_resume_all_by_labels(client: shoal.Client, node: NodeProcess) -> None:
    fleet = [client.create(image="busybox", pool=False, labels={"trainer": "t9"}) for _ in range(3)]
    other = client.create(image="busybox", pool=False, labels={"trainer": "other"})
    try:
        paused = client.pause_all(labels={"trainer": "t9"})
        assert sorted(p["id"] for p in paused) == sorted(s.id for s in fleet)
        assert {s.refresh().state for s in fleet} == {"paused"} and other.refresh().state == "ready"
        assert client.resume_all(labels={"trainer": "t9"}) == 3
        assert {s.refresh().state for s in fleet} == {"ready"}
        client.pause_all(labels={"trainer": "t9"})
        cli = [sys.executable, "-m", "shoal.cli", "--home", str(node.home)]
        out = subprocess.run([*cli, "resume", "--label", "trainer=t9"], capture_output=True, text=True)
        assert out.stdout.strip() == "resumed 3 sandboxes", out.stderr
        out = subprocess.run([*cli, "pause", other.id], capture_output=True, text=True)
        assert out.stdout.strip() == "paused 1 sandboxes" and other.refresh().state == "paused", out.stderr
    finally:
        for s in [*fleet, other]:
            s.close()  # closing a paused sandbox works and frees everything


def test_ttl_kill_and_ttl_pause(client: shoal.Client) -> None:
    killed = client.create(image="busybox", pool=False, ttl_s=1.0)
    paused = client.create(image="busybox", pool=False, ttl_s=1.0, on_timeout="pause")
    try:
        time.sleep(2.0)
        with pytest.raises(shoal.SandboxClosedError, match="ttl"):
            killed.exec("true")
        assert paused.refresh().state == "paused"
        assert paused.exec("echo back").stdout == "back\n"  # resumed; the ttl runs again
        _wait_state(client, paused.id, "paused")
    finally:
        paused.close()


def test_idle_timeout_kill_pause_and_keepalive(client: shoal.Client) -> None:
    idle_kill = client.create(image="busybox", pool=False, idle_timeout_s=1.0)
    idle_pause = client.create(image="busybox", pool=False, idle_timeout_s=1.0, on_timeout="pause")
    try:
        assert idle_kill.exec("sleep 1.6; echo busy").stdout == "busy\n"  # a running command is not idle
        for _ in range(4):
            time.sleep(0.5)
            idle_kill.keepalive()
        assert idle_kill.refresh().state == "ready"
        time.sleep(1.8)
        with pytest.raises(shoal.SandboxClosedError, match="idle"):
            idle_kill.refresh()
        _wait_state(client, idle_pause.id, "paused")
        assert idle_pause.exec("echo hi").stdout == "hi\n"
        assert idle_pause.refresh().state == "ready"
    finally:
        idle_pause.close()


def _reaped_at(client: shoal.Client, sandbox_id: str, timeout: float = 60.0) -> tuple[float, str]:
    """Poll until the sandbox is reaped: (the time the closed answer came back, its reason)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.get(sandbox_id)
        except shoal.SandboxClosedError as exc:
            return time.time(), str(exc)
        time.sleep(0.05)
    raise AssertionError(f"{sandbox_id} was not reaped within {timeout} s")


def test_a_moved_deadline_reaps_at_the_new_one(client: shoal.Client) -> None:
    """The reaper sleeps until the next deadline: one moved earlier (keepalive with a shorter ttl_s) wakes it
    sooner, one moved later is not reaped at the old one. (Reaped means closed before the poll that saw it
    answered; the node and this test read the same clock, so a closed answer before the new deadline would
    prove a reap at the old one, whatever the load.)"""
    later = client.create(image="busybox", pool=False, ttl_s=3.0)
    earlier = client.create(image="busybox", pool=False, ttl_s=3600.0)
    try:
        later.keepalive(ttl_s=6.0)
        earlier.keepalive(ttl_s=1.0)
        moved_out, moved_in = later.info.expires_at, earlier.info.expires_at
        assert moved_out is not None and moved_in is not None
        seen, reason = _reaped_at(client, later.id)
        assert seen >= moved_out and "ttl" in reason, (seen, moved_out, reason)
        seen, reason = _reaped_at(client, earlier.id)
        assert seen >= moved_in and "ttl" in reason, (seen, moved_in, reason)
    finally:
        for sb in (later, earlier):
            with contextlib.suppress(shoal.SandboxClosedError):
                sb.close()


def test_bad_lifetimes_are_refused(client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequestError, match="on_timeout='stop'"):
        client.create(image="busybox", pool=False, on_timeout="stop")
    with pytest.raises(shoal.InvalidRequestError, match="idle_timeout_s=0"):
        client.create(image="busybox", pool=False, idle_timeout_s=0)


def test_owner_is_stamped(node: NodeProcess, client: shoal.Client) -> None:
    with shoal.Client(home=str(node.home), owner="trainer-7") as named, named.create(image="busybox") as sb:
        assert sb.info.owner == "trainer-7"
    with client.create(image="busybox") as sb:
        assert sb.info.owner and "@" in sb.info.owner  # user@host by default


def test_a_step_whose_client_died_keeps_the_sandbox_busy(client: shoal.Client, node: NodeProcess) -> None:
    sb = client.create(image="busybox", pool=False, idle_timeout_s=1.0, trajectory=f"busy-{os.getpid()}")
    script = (
        "import sys, shoal\n"
        "with shoal.Client(home=sys.argv[1]) as c:\n"
        "    c.attach(sys.argv[2]).exec('sleep 2.5; echo done >> /f', timeout=10)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(node.home), sb.id])
    while not client.log(sb.id)["steps"]:  # until the step runs (its intent is logged)
        sb.keepalive()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the client dies; its step goes on past the idle timeout
    proc.wait()
    time.sleep(1.8)
    assert client.get(sb.id).info.state == "ready"  # not reaped while its step ran
    _wait_state(client, sb.id, "ready")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # then idle: reaped
        try:
            client.get(sb.id)
        except shoal.SandboxClosedError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the idle sandbox was not reaped")
    steps = client.log(sb.id)["steps"]
    assert steps[0]["result"]["stdout"] == b"" and steps[0]["error"] is None  # it ran to the end, logged


def test_a_script_that_never_closes_its_client_exits_quietly(node: NodeProcess) -> None:
    """A blocking client left open at interpreter exit cancels its own tasks (no asyncio warnings on stderr)."""
    script = (
        "import sys, shoal\n"
        "c = shoal.Client(home=sys.argv[1])\n"
        "sb = c.create(image='busybox', pool=False, idle_timeout_s=60)\n"
        "print(sb.exec('echo hi').stdout, end='')\n"
        "sb.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(node.home)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "hi\n", out
    assert out.stderr == "", out.stderr


def _wait_closed(client: shoal.Client, sandbox_id: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.get(sandbox_id)
        except shoal.SandboxClosedError as exc:
            return str(exc)
        time.sleep(0.1)
    raise AssertionError(f"{sandbox_id} was not reaped within {timeout} s")


def test_default_lifetimes_reap_abandoned_sandboxes(tmp_path) -> None:  # noqa: ANN001
    """A create that names no lifetime gets the node's defaults (lowered here through their settings); an
    explicit None lives until closed."""
    from conftest import no_leftovers

    node = NodeProcess(
        tmp_path / "home", f"shoal-test-deflife-{os.getpid()}", SHOAL_DEFAULT_TTL_S="4", SHOAL_DEFAULT_IDLE_S="1.5"
    ).start()
    try:
        with node.client() as client:
            abandoned = client.create(image="busybox", pool=False)
            assert abandoned.info.idle_timeout_s == 1.5 and abandoned.info.expires_at is not None
            # the default TTL alone (idle explicitly off), through the pool and trajectory paths
            busy = client.create(image="busybox", trajectory=f"deflife-{os.getpid()}", idle_timeout_s=None)
            assert busy.info.idle_timeout_s is None and busy.info.expires_at is not None
            forever = client.create(image="busybox", pool=False, ttl_s=None, idle_timeout_s=None)
            assert forever.info.expires_at is None and forever.info.idle_timeout_s is None
            assert "idle" in _wait_closed(client, abandoned.id)
            while True:  # in use all along, yet its default TTL ends it
                try:
                    assert busy.exec("echo hi").stdout == "hi\n"
                except shoal.SandboxClosedError as exc:
                    assert "ttl" in str(exc)
                    break
                time.sleep(0.3)
            assert forever.exec("echo still").stdout == "still\n"
            forever.close()
    finally:
        node.stop()
    assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def test_ls_shows_owner_and_what_ends_each_sandbox(client: shoal.Client, node: NodeProcess) -> None:
    with (
        client.create(image="busybox", pool=False, ttl_s=600) as timed,
        client.create(image="busybox", pool=False, ttl_s=None, idle_timeout_s=None) as forever,
    ):
        listing = subprocess.run(
            [sys.executable, "-m", "shoal.cli", "--home", str(node.home), "ls"],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout  # fmt: skip
        rows = {line.split("\t")[0]: line.split("\t") for line in listing.splitlines()[1:]}
        assert rows[forever.id][4] == forever.info.owner and rows[forever.id][5] == "never"
        assert rows[timed.id][4] == timed.info.owner and rows[timed.id][5].startswith("ttl ")  # 10 min < 30 min idle


async def test_closing_a_connection_fails_its_calls_in_flight(client: shoal.Client, node: NodeProcess) -> None:
    """A call in flight on a connection that gets closed fails at once instead of waiting for ever (a gateway
    closes a node connection whose health poll timed out while other requests were in flight on it)."""
    from shoal.client.transport import Connection
    from shoal.errors import NodeError

    sb = client.create(image="busybox", ttl_s=120)
    try:
        conn = await Connection.open_unix(str(node.paths.socket))
        call = asyncio.ensure_future(conn.call("exec", {"req": {"sandbox_id": sb.id, "cmd": "sleep 60"}}))
        await asyncio.sleep(1)  # the request is on the node
        assert not call.done()
        await conn.close()
        with pytest.raises(NodeError, match="closed with this call in flight"):
            await asyncio.wait_for(call, 10)
    finally:
        sb.close()
