"""Processes that outlive their exec: listed with the exec that started them, killed per exec or all at once,
also when a fork bomb holds every pid of the sandbox (guest/agent.c: keepers, the reserve).

Every sandbox here has a ttl_s and is closed in a `with`, so no bomb outlives its test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import runtime_unavailable, until

import shoal

LEFTOVERS = "sleep 101 >/dev/null 2>&1 & setsid sh -c 'sleep 102 >/dev/null 2>&1 &'; (sh -c 'sleep 103 &' &); echo ok"
# bash retries a fork that fails, so this bomb holds every pid of a pids=64 sandbox until it is killed
BOMB = "bash -c 'bomb() { bomb | bomb & }; bomb' >/dev/null 2>&1; echo started"
# Where pids does not cap the bomb, a tree bounded by its depth (2^(d+1) processes that stay): runsc (pids
# counts gVisor's own host threads, and a bomb that reaches it takes the sandbox down, so it is reported
# lost, rather than failing its forks). In a microvm the agent puts commands in a guest cgroup with the limit.
TREE = "tree() { if [ $1 -gt 0 ]; then tree $(($1-1)) & tree $(($1-1)) & wait; else sleep 300; fi; }; "
TREE += "tree DEPTH >/dev/null 2>&1 & echo started"


def _until_empty(sb: shoal.Sandbox, timeout: float = 60.0) -> float:
    """Seconds until the sandbox lists no process but its agent's (fails after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not sb.processes():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"processes still there after {timeout} s: {sb.processes()[:5]}")


@pytest.fixture(scope="module")
def neighbour(client: shoal.Client) -> Iterator[shoal.Sandbox]:
    with client.create(image="busybox", pool=False, ttl_s=900) as sandbox:
        yield sandbox


def test_leftovers_are_listed_with_their_exec_and_killed_per_exec(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        first = sb.exec(LEFTOVERS)
        second = sb.exec("sleep 104 >/dev/null 2>&1 & echo ok")
        assert first.stdout == second.stdout == "ok\n" and first.exec_id and second.exec_id != first.exec_id
        assert sb.exec("echo no leftovers").exec_id  # an exec that leaves nothing lists nothing
        # `echo ok` may answer before a backgrounded child has exec'd its sleep (it is listed as the shell
        # it forked from until then): wait for the four sleeps
        want, deadline = {"sleep 101", "sleep 102", "sleep 103", "sleep 104"}, time.monotonic() + 10
        while set(listed := {p["command"]: p for p in sb.processes()}) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(listed) == want, listed
        for name in ("sleep 101", "sleep 102", "sleep 103"):  # setsid and double fork stay the first exec's
            assert listed[name]["exec_id"] == first.exec_id and listed[name]["exec_command"] == LEFTOVERS
        assert listed["sleep 104"]["exec_id"] == second.exec_id
        assert sb.kill_processes(first.exec_id)["killed"] == 3
        assert [p["command"] for p in sb.processes()] == ["sleep 104"]
        assert sb.kill_processes() == {"killed": 1, "left": 0}
        _until_empty(sb)
        assert sb.exec("echo still here").stdout == "still here\n"


def test_execs_on_a_kept_handler_have_ids_of_their_own(client: shoal.Client) -> None:
    """The node's execs reuse one agent handler while they leave nothing (guest/client.py), so the agent names
    them all by that handler; the node gives each its own ID: an ID kept from an exec that left nothing kills
    and lists nothing of a later exec's on the same handler."""
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        done = [sb.exec("true") for _ in range(3)]
        later = sb.exec("sleep 107 >/dev/null 2>&1 & echo ok")
        ids = [r.exec_id for r in (*done, later)]
        assert all(ids) and len(set(ids)) == 4, ids
        for r in done:
            assert sb.kill_processes(r.exec_id) == {"killed": 0, "left": 0}
        listed = sb.processes()
        assert [(p["command"], p["exec_id"]) for p in listed] == [("sleep 107", later.exec_id)], listed
        assert listed[0]["exec_command"] == "sleep 107 >/dev/null 2>&1 & echo ok"
        assert sb.kill_processes(later.exec_id) == {"killed": 1, "left": 0}
        _until_empty(sb)
        with pytest.raises(shoal.InvalidRequestError):
            sb.kill_processes(-1)


def test_a_timeout_kills_what_escaped_with_setsid(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        r = sb.exec("setsid sh -c 'sleep 105 >/dev/null 2>&1 &'; (sleep 106 >/dev/null 2>&1 &); sleep 100", timeout=1)
        assert r.timed_out
        _until_empty(sb)


CASES = [*(("container", r) for r in ("crun", "runc", "runsc", "shoal")), ("microvm", None)]


@pytest.mark.parametrize(("kind", "runtime"), CASES, ids=[r or k for k, r in CASES])
def test_kill_processes_ends_a_fork_bomb_the_exec_left(
    client: shoal.Client, neighbour: shoal.Sandbox, kind: str, runtime: str | None
) -> None:
    if kind not in client.kinds():
        pytest.skip(f"kind {kind} is not available on this node (QEMU missing)")
    if runtime and (reason := runtime_unavailable(runtime)):
        pytest.skip(reason)
    if kind == "microvm":
        options, image, cmd = {"memory_mb": 512, "pids": 64}, "debian", BOMB
    elif runtime == "runsc":
        options, image, cmd = {"runtime": runtime}, "busybox", TREE.replace("DEPTH", "4")
    else:
        options, image, cmd = {"runtime": runtime, "pids": 64}, "debian", BOMB
    with client.create(kind, image=image, pool=False, ttl_s=600, **options) as sb:
        r = sb.exec(cmd, timeout=60)
        assert r.stdout == "started\n" and not r.timed_out  # the exec returned; its bomb runs on
        until(lambda: len(sb.processes()) >= 20, 60, "the bomb to hold 20 processes")
        assert len(sb.processes()) >= 20
        if cmd == BOMB:  # refused past the limit: forks failed, and the bomb holds no more than it allows
            time.sleep(1)
            assert len(sb.processes()) <= 64
            if kind == "microvm":  # the guest's cgroup for commands counted the refusals
                events = sb.files.read("/sys/fs/cgroup/shoal-commands/pids.events").decode()
                assert int(events.split()[1]) > 0, events
        assert neighbour.exec("echo ok", timeout=60).stdout == "ok\n"
        start = time.monotonic()
        outcome = sb.kill_processes()
        assert outcome["left"] == 0 and outcome["killed"] >= 20
        emptied = _until_empty(sb)
        print(f"{kind}/{runtime}: kill_processes {outcome} in {time.monotonic() - start:.3f} s (+{emptied:.3f} s)")
        assert sb.exec("echo answers", timeout=60).stdout == "answers\n"
        assert neighbour.exec("echo ok", timeout=60).stdout == "ok\n"


def test_sandboxes_without_cpu_get_the_default_cap(client: shoal.Client, node) -> None:  # noqa: ANN001
    """A runaway in a sandbox that named no cpu= is held to SHOAL_DEFAULT_CPU (1 core by default); cpu= overrides."""
    import os

    from shoal import cgroups

    def quota(sandbox_id: str) -> int | None:
        rel = f"{node.cgroup_parent}/{sandbox_id}"
        if cgroups.layout() == "v2":
            value = (cgroups.ROOT / rel / "cpu.max").read_text().split()[0]
            return None if value == "max" else int(value)
        value = int((cgroups.ROOT / "cpu" / rel / "cpu.cfs_quota_us").read_text())
        return None if value < 0 else value

    cores = os.cpu_count() or 1
    with client.create(image="busybox", pool=False, ttl_s=300) as plain:
        assert quota(plain.id) == 100_000  # one core of a 100 ms period
    with client.create(image="busybox", pool=False, ttl_s=300, cpu=cores) as big:
        assert quota(big.id) == cores * 100_000


def test_killing_the_agents_helpers_from_inside_loses_nothing(client: shoal.Client) -> None:
    """Root in the sandbox may kill the agent's reserve and an exec's keeper (plain processes to it): a killed
    keeper's processes are still listed (exec unknown) and killed; the reserve is forked again, so a bomb
    started afterwards is still ended."""
    with client.create(image="debian", pool=False, ttl_s=300, pids=64) as sb:
        left = sb.exec("sleep 107 >/dev/null 2>&1 &")
        [sleeper] = sb.processes()
        assert sleeper["ppid"] == left.exec_id  # its keeper: the exec's handler, whose pid names the exec
        sb.exec(f"kill -9 {left.exec_id}")
        assert [(p["command"], p["exec_id"]) for p in sb.processes()] == [("sleep 107", None)]
        sb.exec("sleep 0.5; kill -9 -1")  # all root may signal here, the reserve too (the agent is PID 1)
        assert sb.exec("echo next").stdout == "next\n"  # its connection makes the agent fork a new reserve
        assert sb.exec(BOMB, timeout=60).stdout == "started\n"
        until(lambda: len(sb.processes()) >= 20, 60, "the bomb to hold 20 processes")
        assert sb.kill_processes()["left"] == 0
        _until_empty(sb)
        assert sb.exec("echo answers", timeout=60).stdout == "answers\n"


def test_usage_reads_the_cgroup_and_leaves_a_paused_sandbox_paused(client: shoal.Client) -> None:
    with client.create("container", image="debian", pool=False, ttl_s=300, memory_mb=256) as sb:
        before = sb.usage()
        assert before["state"] == "ready" and before["memory_bytes"] > 0 and before["pids"] >= 1, before
        sb.exec("python3 -c 'import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass'")
        sb.exec("sleep 60 &")
        after = sb.usage()
        assert after["cpu_s"] >= before["cpu_s"] + 0.4, (before, after)  # the 0.5 s of CPU it burned
        assert after["pids"] > before["pids"], (before, after)  # the sleep left running
        sb.pause()
        assert sb.usage()["state"] == "paused"  # asking did not resume it
        assert client.get(sb.id).info.state == "paused"
