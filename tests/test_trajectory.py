"""The trajectory log: durable steps, fast-forward after a client dies, divergence, replay, `shoal log`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import NodeProcess, no_leftovers

import shoal

TRAINER = textwrap.dedent(
    """
    import sys, shoal
    home, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with shoal.Client(home=home) as client:
        sb = client.create(image="busybox", pool=False, trajectory=name, labels={"t": "ff"})
        for i in range(steps):
            result = sb.exec(f"echo step-{i} >> /work.log; sleep 0.2; wc -l < /work.log")
            print(i, result.stdout.strip(), flush=True)
        print("fast-forwarded", sb.fast_forwarded)
    """
)


def test_fast_forward_after_the_client_is_killed_mid_trajectory(node: NodeProcess, client: shoal.Client) -> None:
    name = f"run7/ep{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    first = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(node.home), name, "10"], stdout=subprocess.PIPE, text=True, env=env
    )
    assert first.stdout is not None
    seen = [first.stdout.readline() for _ in range(4)]  # steps 0..3 acknowledged
    time.sleep(0.1)  # step 4 is now running
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert [line.split()[0] for line in seen] == ["0", "1", "2", "3"]
    second = subprocess.run(
        [sys.executable, "-c", TRAINER, str(node.home), name, "10"], capture_output=True, text=True, env=env, timeout=60
    )
    assert second.returncode == 0, second.stderr
    lines = [line.split() for line in second.stdout.splitlines()]
    assert lines[-1][0] == "fast-forwarded" and int(lines[-1][1]) >= 4
    assert [int(n) for _, n in lines[:-1]] == list(range(1, 11))  # step i saw i+1 lines: no step ran twice
    sb = client.attach(name, seq=None)
    try:
        log = sb.files.read_text("/work.log").split()
        assert log == [f"step-{i}" for i in range(10)]
    finally:
        sb.close()


def test_divergence_names_both_steps(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False) as sb:
        sb.exec("echo one >> /f")
        sb.files.write("/g", "data")
        again = client.attach(sb.id)
        assert again.exec("echo one >> /f").stdout == ""  # fast-forwarded
        with pytest.raises(shoal.DivergenceError) as caught:
            again.files.write("/g", "other data")
        message = str(caught.value)
        assert "file_write '/g' (4 bytes)" in message and "file_write '/g' (10 bytes)" in message
        assert "step 1" in message
        streamed = client.attach(sb.id)  # exec_stream is fast-forwarded by the node, not the handle
        stream = streamed.exec_stream("echo one >> /f")
        assert list(stream) == [] and stream.result is not None and stream.result.exit_code == 0
        with pytest.raises(shoal.DivergenceError, match=r"the log has file_write '/g' \(4 bytes\)"):
            list(streamed.exec_stream("echo two"))
        assert client.status()["trajectory"]["fast_forwarded"] >= 1
        assert sb.files.read_text("/f") == "one\n"  # appended once
        with pytest.raises(shoal.InvalidRequestError, match="skips ahead"):
            later = client.attach(sb.id, seq=sb.seq + 3)
            later.exec("true")


def test_fast_forward_returns_logged_errors_and_files(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False) as sb:
        with pytest.raises(FileNotFoundError):
            sb.files.read("/missing")
        listing = sb.files.list("/etc")
        sb.exec("echo later > /missing")
        again = client.attach(sb.id)
        with pytest.raises(FileNotFoundError):  # logged error, though the file exists now
            again.files.read("/missing")
        assert [e.name for e in again.files.list("/etc")] == [e.name for e in listing]
        assert again.exec("echo later > /missing").exit_code == 0
        assert again.files.read_text("/missing") == "later\n"  # past the log: runs for real


async def test_concurrent_steps_share_commits(aclient: shoal.AsyncClient) -> None:
    sb = await aclient.create(image="busybox", pool=False)
    try:
        before = await aclient.status()
        results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(64)))
        assert [r.stdout.strip() for r in results] == [str(i) for i in range(64)]
        after = await aclient.status()
        appended = after["trajectory"]["appended"] - before["trajectory"]["appended"]
        commits = after["trajectory"]["commits"] - before["trajectory"]["commits"]
        assert appended >= 64 and commits < appended  # group commit: several steps per fsync
        steps = await sb.log()
        assert [s["seq"] for s in steps] == list(range(64))
        again = await aclient.attach(sb.id)
        replayed = await asyncio.gather(*(again.exec(f"echo {i}") for i in range(64)))
        assert [r.stdout for r in replayed] == [r.stdout for r in results]
    finally:
        await sb.close()


async def test_a_step_reissued_while_it_runs_answers_its_logged_result(aclient: shoal.AsyncClient) -> None:
    """Two handles send step 0 at once: it runs once; the other waits for it (its answer goes out from the
    journal's fsync, its task already ended: the re-issue waits for that fsync too) and answers the same result."""
    sb = await aclient.create(image="busybox", pool=False)
    try:
        again = await aclient.attach(sb.id)
        command = "echo once >> /f; cat /proc/sys/kernel/random/uuid"
        first, second = await asyncio.gather(sb.exec(command), again.exec(command))
        assert first.stdout == second.stdout and len(first.stdout.strip()) == 36
        assert (await sb.files.read_text("/f")) == "once\n"
    finally:
        await sb.close()


async def test_cancelled_step_is_logged_as_interrupted(aclient: shoal.AsyncClient) -> None:
    sb = await aclient.create(image="busybox", pool=False)
    try:
        task = asyncio.ensure_future(sb.exec("echo started >> /f; sleep 30; echo finished >> /f"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        steps = await sb.log()
        assert steps[0]["error"] and "cancelled by its client" in steps[0]["error"]
        assert (await sb.files.read_text("/f")) == "started\n"
        again = await aclient.attach(sb.id)
        with pytest.raises(shoal.ShoalError, match="cancelled by its client"):
            await again.exec("echo started >> /f; sleep 30; echo finished >> /f")
    finally:
        await sb.close()


def test_replay_reports_the_steps_that_differ(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False, files={"/in.txt": "abc\n"}) as sb:
        sb.exec("wc -c < /in.txt")
        sb.exec("cat /proc/sys/kernel/random/uuid")
        sb.files.write("/out", "x")
        sb.exec("cat /out")
        with sb.shell() as sh:
            sh.run("cd /etc")
            sh.run("pwd")
        report = client.replay(sb.id)
    assert report.steps == 7 and report.source == sb.id
    assert [(d["seq"], d["field"]) for d in report.differences] == [(1, "stdout")]
    assert report.differences[0]["step"] == "exec 'cat /proc/sys/kernel/random/uuid'"
    with pytest.raises(shoal.SandboxClosedError):
        client.get(report.sandbox_id)  # closed after the replay unless keep=True
    other = client.replay(sb.id, image="debian")  # the same steps in another image: still runs
    assert {d["seq"] for d in other.differences} == {1}


def test_log_cli_show_and_export(client: shoal.Client, node: NodeProcess, tmp_path: Path) -> None:
    with client.create(image="busybox", pool=False, trajectory=f"cli-{os.getpid()}") as sb:
        sb.exec("echo hello")
        sb.files.write("/bin.dat", bytes([0, 255, 1]))
    env = dict(os.environ, SHOAL_HOME=str(node.home))
    shown = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "log", "show", sb.id], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0, shown.stderr
    assert "exec 'echo hello'" in shown.stdout and "hello" in shown.stdout and "closed" in shown.stdout
    out = tmp_path / "log.jsonl"
    exported = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "log", "export", f"cli-{os.getpid()}", "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert exported.returncode == 0, exported.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["op"] == "exec" and rows[0]["result"]["stdout"] == "hello\n"
    assert rows[1]["args"]["data"] == {"base64": "AP8B"}
    missing = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "log", "show", "no-such"], capture_output=True, text=True, env=env
    )
    assert missing.returncode == 1 and "no trajectory log" in missing.stderr


def _sqlite_rows(home: Path, sandbox_id: str, count: int, what: str = "COUNT(*)") -> object:
    """`what` over the sandbox's steps in SQLite, once it holds `count` of them (waits up to 10 s for the batch)."""
    deadline = time.monotonic() + 10
    while True:
        db = sqlite3.connect(f"file:{home / 'trajectory.db'}?mode=ro", uri=True)
        try:
            (have, value) = db.execute(
                f"SELECT COUNT(*), {what} FROM steps WHERE sandbox_id=?", (sandbox_id,)
            ).fetchone()
        finally:
            db.close()
        if have >= count or time.monotonic() > deadline:
            assert have == count, f"SQLite holds {have} of the sandbox's {count} steps after 10 s"
            return value
        time.sleep(0.02)


@pytest.mark.parametrize("batch_ms", ["0", "600000"])
def test_step_is_durable_when_the_node_dies_right_after_the_ack(tmp_path: Path, batch_ms: str) -> None:
    """SIGKILLed right after the ack, with the result already in SQLite (batch_ms 0) or only in the journal
    (a batch that never comes before the kill): the restarted node has the steps and fast-forwards them. A node
    that did not replay the journal into SQLite runs a step a second time here. Both steps are answered from
    the journal's fsync completion (server.ANSWERED_AT_FSYNC): an exec and a file write."""
    doomed = NodeProcess(tmp_path / "home", f"shoal-test-durable-{os.getpid()}", SHOAL_LOG_BATCH_MS=batch_ms).start()
    with doomed.client() as client:
        sb = client.create(image="busybox", pool=False, trajectory="durable")
        acked = sb.exec("echo once >> /f; cat /proc/sys/kernel/random/uuid")
        assert sb.files.write("/f", "written once\n", append=True) == 13
        if batch_ms == "0":
            _sqlite_rows(doomed.home, sb.id, 2)  # the batch's turn of the loop
        os.kill(doomed.pid, signal.SIGKILL)  # no chance to flush anything after the ack
    doomed.stop(signal.SIGKILL)
    db = sqlite3.connect(f"file:{tmp_path / 'home' / 'trajectory.db'}?mode=ro", uri=True)
    in_sqlite = db.execute("SELECT COUNT(*) FROM steps WHERE sandbox_id=?", (sb.id,)).fetchone()
    db.close()
    assert in_sqlite == ((2,) if batch_ms == "0" else (0,))  # killed between the journal and the batch
    restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
    try:
        with restarted.client() as client:
            again = client.create(image="busybox", pool=False, trajectory="durable")
            assert again.id == sb.id  # re-adopted
            replayed = again.exec("echo once >> /f; cat /proc/sys/kernel/random/uuid")
            assert replayed.stdout == acked.stdout  # the logged result, not a second run
            assert again.files.write("/f", "written once\n", append=True) == 13
            assert again.files.read_text("/f") == "once\nwritten once\n"
            again.close()
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
    finally:
        restarted.stop()
    assert not no_leftovers(restarted.home, restarted.cgroup_parent, node_stopped=True)


async def test_concurrent_creates_of_one_trajectory_share_a_sandbox(aclient: shoal.AsyncClient) -> None:
    name = f"race-{os.getpid()}"
    made = await asyncio.gather(*(aclient.create(image="busybox", pool=False, trajectory=name) for _ in range(4)))
    try:
        assert len({sb.id for sb in made}) == 1
        assert [s.id for s in await aclient.list() if s.trajectory == name] == [made[0].id]
    finally:
        await made[0].close()
    with pytest.raises(shoal.SandboxClosedError, match="replay"):
        await aclient.create(image="busybox", pool=False, trajectory=name)


def test_logs_of_closed_sandboxes_are_pruned_after_the_retention(tmp_path: Path) -> None:
    short = NodeProcess(tmp_path / "home", f"shoal-test-retain-{os.getpid()}", SHOAL_LOG_RETENTION_S="1").start()
    try:
        with short.client() as client:
            kept = client.create(image="busybox", pool=False)
            kept.exec("echo kept")
            with client.create(image="busybox", pool=False) as gone:
                gone.exec("echo gone")
            assert len(client.log(gone.id)["steps"]) == 1
            time.sleep(2.5)
            with pytest.raises(shoal.SandboxNotFoundError, match="no trajectory log"):
                client.log(gone.id)
            assert len(client.log(kept.id)["steps"]) == 1  # live: kept however old
            kept.close()
    finally:
        short.stop()
    assert not no_leftovers(short.home, short.cgroup_parent, node_stopped=True)


def test_upload_fast_forwards_in_the_same_order(client: shoal.Client, tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / "tree" / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / f"d{i % 4}" / f"f{i}").write_bytes(os.urandom(i * 100))
    with client.create(image="busybox", pool=False) as sb:
        assert sb.files.upload(str(tmp_path / "tree"), "/up") == 40
        again = client.attach(sb.id)
        assert again.files.upload(str(tmp_path / "tree"), "/up") == 40  # every step matches its log entry
        assert again.fast_forwarded == sb.seq


def test_snapshot_is_a_logged_step_that_replay_skips(client: shoal.Client) -> None:
    name = f"traj-snap-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with client.create(image="busybox", pool=False) as sb:
            sb.exec("echo one > /f")
            made = sb.snapshot(name)
            again = client.attach(sb.id)
            again.exec("echo one > /f")
            assert again.snapshot(name) == made and again.fast_forwarded == 2  # not committed twice
            steps = sb.log()
            assert [s["summary"] for s in steps] == ["exec 'echo one > /f'", f"snapshot as image {name!r}"]
        report = client.replay(sb.id)
        assert report.differences == [] and [s["seq"] for s in report.skipped] == [1]
    finally:
        client.image_rm(name)


def test_bulk_payloads_are_logged_as_digests_and_fast_forward_stays_exact(
    client: shoal.Client, node: NodeProcess
) -> None:
    """Reads and writes over 64 KiB are logged as digest + size (the log stays small); re-issuing them is
    still checked: a write by its digest, a read by reading the file again and comparing, which raises
    PayloadNotKeptError once the file no longer holds what was read; replay skips the write it cannot redo."""
    big = os.urandom(1 << 20)
    with client.create(image="busybox", pool=False) as sb:
        sb.files.write("/big", big)
        for _ in range(4):
            assert sb.files.read("/big") == big
        sb.files.write("/small", b"tiny")
        assert sb.files.read("/small") == b"tiny"
        steps = sb.log()
        assert steps[0]["args"]["data"] == {"bulk": steps[0]["args"]["data"]["bulk"], "size": 1 << 20}
        assert steps[1]["result"]["size"] == 1 << 20 and steps[5]["args"]["data"] == b"tiny"
        # the journal answered the steps; SQLite gets them in a batch up to SHOAL_LOG_BATCH_MS later
        stored = _sqlite_rows(node.home, sb.id, len(steps), "SUM(LENGTH(args) + LENGTH(result))")
        assert stored < 16 << 10, f"the log holds {stored} bytes for 5 MiB of file traffic"

        again = client.attach(sb.id)  # re-issued from step 0
        assert again.files.write("/big", big) == 1 << 20  # fast-forwarded: the digest matches
        with pytest.raises(shoal.DivergenceError):
            client.attach(sb.id).files.write("/big", big[:-1] + b"!")  # a different payload diverges
        assert again.files.read("/big") == big  # read again, verified against the logged digest
        sb.files.write("/big", os.urandom(1 << 20))  # the file changes after the log's reads
        with pytest.raises(shoal.PayloadNotKeptError, match="digest"):
            again.files.read("/big")
        report = client.replay(sb.id)
    assert [s["seq"] for s in report.skipped] == [0, 7]  # the two big writes: their bytes were not kept
