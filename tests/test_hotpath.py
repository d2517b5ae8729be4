"""Hot-path pieces (issue 12): group commit of the trajectory log, removal of a sandbox's state directory, a
mount table that does not grow with live sandboxes."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import types
from pathlib import Path

import pytest
from conftest import NodeProcess, no_leftovers, runtime_unavailable, sandbox_pid, sandbox_roots

import shoal
from shoal import linux, protocol, settings
from shoal.config import shm_state_dir
from shoal.node import trajectory
from shoal.node.trajectory import Recorder, TrajectoryLog


async def test_concurrent_steps_share_one_fsync_and_are_all_in_the_log(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    try:
        await log.append("warm", 0, "exec", "k", {}, {}, None, 0.0)
        before = log.commits
        # 16 sandboxes' intents and results at once: every row is written before any fsync starts, so one
        # fsync covers the whole burst (an intent needs none)
        await asyncio.gather(*(log.begin(f"s{i}", 0, "exec", "k", {}, 0.0) for i in range(16)))
        assert log.commits == before
        await asyncio.gather(*(log.append(f"s{i}", 0, "exec", "k", {}, {"exit": i}, None, 0.0) for i in range(16)))
        assert log.commits == before + 1
        assert [log.get(f"s{i}", 0).result for i in range(16)] == [{"exit": i} for i in range(16)]
    finally:
        log.close()
    # what was acknowledged is in the file, read by another connection after the log closed
    db = sqlite3.connect(tmp_path / "trajectory.db")
    assert db.execute("SELECT COUNT(*) FROM steps WHERE error_type IS NULL").fetchone()[0] == 17
    db.close()


async def test_prune_forgets_ended_sandboxes_in_small_transactions(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    try:
        for i in range(40):  # more than one transaction's worth
            await log.open_sandbox(f"s{i}", None, "busybox", {})
            await log.append(f"s{i}", 0, "exec", "k", {}, {}, None, 0.0)
            if i % 2:
                await log.close_sandbox(f"s{i}", "closed", "test")
        await log.prune(closed_before=float("inf"))
        assert [log.sandbox(f"s{i}") is not None for i in range(40)] == [i % 2 == 0 for i in range(40)]
        assert log.next_seq("s1") == 0 and log.next_seq("s0") == 1
    finally:
        log.close()


def test_remove_directory_known_entries_and_what_a_sandbox_wrote(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    for sub in ("upper/.shoal", "work/work", "rootfs"):
        (plain / sub).mkdir(parents=True)
    (plain / "upper/.shoal/agent").touch()
    (plain / "record.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept").write_text("x")
    os.symlink(elsewhere, plain / "link")  # removed as a link, never followed
    linux.remove_directory(
        str(plain), ("upper/.shoal", "upper", "work/work", "work", "rootfs"), ("upper/.shoal/agent",)
    )
    assert not plain.exists()
    assert (elsewhere / "kept").exists()

    wrote = tmp_path / "wrote"
    (wrote / "upper/home/user/deep/er").mkdir(parents=True)
    (wrote / "upper/home/user/deep/er/file").write_bytes(b"x" * 100)
    (wrote / "config.json").write_text("{}")
    linux.remove_directory(str(wrote), ("upper",))
    assert not wrote.exists()
    linux.remove_directory(str(tmp_path / "missing"))  # nothing there: nothing to do


def test_remove_directory_stays_on_its_file_system(tmp_path: Path) -> None:
    """A mount left inside (an unmount that failed) is not emptied through."""
    outer, inner = tmp_path / "outer", tmp_path / "outer" / "rootfs"
    inner.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(inner)], check=True)
    try:
        (inner / "kept").write_text("x")
        (outer / "upper" / "x").mkdir(parents=True)
        linux.remove_directory(str(outer), ("upper",))
        assert (inner / "kept").exists()
    finally:
        subprocess.run(["umount", str(inner)], check=True)
    linux.remove_directory(str(outer), ("rootfs",))
    assert not outer.exists()


def test_live_sandboxes_do_not_grow_the_nodes_mount_table(client: shoal.Client, node: NodeProcess) -> None:
    """A crun sandbox's overlay is mounted only in a namespace of its own (substrates/container/mountns.py):
    the node's table (which every create's runtime copies) and the host's keep the same mounts under the
    node's home however many sandboxes live; each agent's root is its overlay, which goes with the sandbox."""

    def mounts_under_home(pid: int | str) -> list[str]:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        return sorted(target for line in lines if (target := line.split()[4]).startswith(f"{node.home}/"))

    first = client.create(image="busybox", pool=False, ttl_s=600)  # the image's layers stay mounted from here
    more = []
    try:
        node_before, host_before = mounts_under_home(node.pid), mounts_under_home("self")
        more = [client.create(image="busybox", pool=False, ttl_s=600) for _ in range(4)]
        assert mounts_under_home(node.pid) == node_before
        assert mounts_under_home("self") == host_before
        roots = sandbox_roots(node.home, node.cgroup_parent)
        assert len(roots) >= 5  # (other tests' sandboxes of this session's node may live too)
        for sb in [first, *more]:
            assert sandbox_pid(node.home, sb.id) in [int(p) for p in roots]
            sb.files.write("/mine", sb.id.encode())
            assert sb.exec("cat /mine").stdout == sb.id  # each its own upper
    finally:
        for sb in [first, *more]:
            sb.close()
    assert not no_leftovers(node.home, node.cgroup_parent)


@pytest.mark.skipif(settings.TEST_USERNS.is_set(), reason="userns sandboxes keep a mount point of their own")
@pytest.mark.parametrize("runtime", ["crun", "runc", "shoal"])
def test_a_sandbox_directory_holds_only_what_the_sandbox_wrote(
    client: shoal.Client, node: NodeProcess, runtime: str
) -> None:  # noqa: E501
    """Issue 12: every directory or file made on the home's ext4 per create is removed again per close. A
    sandbox's overlay is mounted on the node's one mount point (in its own namespace), the agent's mount point
    comes from a node layer, and crun's and runc's bundle files sit beside the runtime's state (tmpfs where
    there is one): the state directory holds its record, the overlay's upper (only what the sandbox wrote)
    and work directories, nothing else (the shoal launcher's sandboxes too: their log and socket are in the
    bundle directory); the agent still runs
    from /.shoal/agent, which the sandbox cannot replace, and everything goes with the sandbox."""
    if reason := runtime_unavailable(runtime):
        pytest.skip(reason)
    with client.create(image="busybox", pool=False, ttl_s=600, runtime=runtime) as sb:
        directory = node.home / "sandboxes" / sb.id
        if (directory / "disk").is_dir():
            pytest.skip("this node gives sandboxes a disk of their own (SHOAL_DEFAULT_DISK_MB): the upper is on it")
        sb.files.write("/mine", b"x")
        mounted = sb.exec("test -f /.shoal/agent && ls /.shoal && grep -c ' /.shoal/agent ' /proc/self/mountinfo")
        assert mounted.stdout.split() == ["agent", "1"]
        assert sb.exec("rm -f /.shoal/agent || echo refused").stdout.strip() == "refused"
        names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
        assert names == ["record.json", "upper", "upper/mine", "work", "work/work"]
        bundles = [root / "bundles" / sb.id for root in (shm_state_dir(node.home), node.home / "runtime")]
        found = [b for b in bundles if b.is_dir()]
        # the shoal launcher reads no bundle and answers the pid: only the agent's socket and log are there
        own = ["agent.sock", "runtime.log"]
        if runtime != "shoal":
            own = ["agent.sock", "config.json", "pid", "runtime.log"]
        assert len(found) == 1 and sorted(p.name for p in found[0].iterdir()) == own
    assert not any(b.exists() for b in bundles)
    assert not no_leftovers(node.home, node.cgroup_parent)


async def test_walsync_fdatasyncs_through_linux_aio_and_completes_on_its_eventfd(tmp_path: Path) -> None:
    from shoal.node.walsync import WalSync

    path = tmp_path / "wal"
    path.write_bytes(b"x" * 4096)
    sync = WalSync.open(str(path))
    if sync is None:
        pytest.skip("this kernel cannot fdatasync through Linux AIO (io_setup or IOCB_CMD_FDSYNC refused)")
    loop = asyncio.get_running_loop()
    try:
        for _ in range(3):
            done = loop.create_future()
            loop.add_reader(sync.eventfd, lambda d=done: d.done() or d.set_result(sync.reap()))
            try:
                sync.submit()
                assert await asyncio.wait_for(done, 60) == 0
            finally:
                loop.remove_reader(sync.eventfd)
    finally:
        sync.close()


async def test_durable_steps_through_aio_and_through_the_syncer_thread(tmp_path: Path) -> None:
    for thread in (False, True):
        log = TrajectoryLog(tmp_path / f"trajectory-{thread}.db", reserve_bytes=0)
        if thread:
            log._aio_tried = True  # as where Linux AIO cannot fsync: the syncer thread does it
        try:
            for seq in range(3):  # one at a time: an fsync each
                await log.begin("a", seq, "exec", "k", {}, 0.0)
                await log.append("a", seq, "exec", "k", {}, {"n": seq}, None, 0.0)
            assert log.commits == 3
            await asyncio.gather(*(log.append(f"b{i}", 0, "exec", "k", {}, {}, None, 0.0) for i in range(16)))
            assert log.commits == 4  # the burst: one fsync
            assert [log.get("a", seq).result for seq in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
            assert thread or log._aio is not None or not _aio_available(tmp_path)
        finally:
            log.close()
        db = sqlite3.connect(tmp_path / f"trajectory-{thread}.db")
        assert db.execute("SELECT COUNT(*) FROM steps WHERE error_type IS NULL").fetchone()[0] == 19
        db.close()


def _aio_available(tmp_path: Path) -> bool:
    from shoal.node.walsync import WalSync

    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    sync = WalSync.open(str(probe))
    if sync is not None:
        sync.close()
    return sync is not None


async def test_an_append_answers_only_after_the_fsync_that_covers_it(tmp_path: Path, monkeypatch) -> None:
    """Durable before the answer: with the fsync's completion held back, the append does not return (a log
    that answered at the write, or at the fsync's submission, fails here), through AIO and the thread."""
    import threading

    for thread in (False, True):
        log = TrajectoryLog(tmp_path / f"trajectory-{thread}.db", reserve_bytes=0)
        if thread:
            log._aio_tried = True  # as where Linux AIO cannot fsync: the syncer thread does it
        try:
            await log.append("a", 0, "exec", "k", {}, {}, None, 0.0)
            gate = threading.Event()
            if log._aio is not None:  # hold the kernel's completion: the eventfd is not watched
                asyncio.get_running_loop().remove_reader(log._aio.eventfd)
            else:
                real = os.fdatasync
                monkeypatch.setattr(os, "fdatasync", lambda fd, g=gate, r=real: g.wait(60) and r(fd))
            commits = log.commits
            step = asyncio.ensure_future(log.append("a", 1, "exec", "k", {}, {"n": 1}, None, 0.0))
            await asyncio.sleep(0.3)  # time enough for a log that does not wait to have answered
            assert not step.done() and log.commits == commits
            if log._aio is not None:
                asyncio.get_running_loop().add_reader(log._aio.eventfd, log._aio_done)
            gate.set()
            await asyncio.wait_for(step, 60)
            assert log.commits == commits + 1 and log.get("a", 1).result == {"n": 1}
            monkeypatch.undo()
        finally:
            log.close()


async def test_a_write_waits_for_the_checkpoints_lock_without_blocking_the_loop(tmp_path: Path) -> None:
    """The checkpoint that lets the WAL start over holds SQLite's write lock for a moment: a step's result is
    answered meanwhile (durable in the journal; its batch into SQLite is retried after the lock), and a
    sandbox's close waits on the loop (retried), not asleep in SQLite with the whole node stopped."""
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    holder = sqlite3.connect(tmp_path / "trajectory.db", isolation_level=None)
    try:
        await log.open_sandbox("a", None, "busybox", {})
        await log.append("a", 0, "exec", "k", {}, {}, None, 0.0)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, as the RESTART checkpoint takes it
        await asyncio.wait_for(log.append("a", 1, "exec", "k", {}, {"n": 1}, None, 0.0), 60)
        close = asyncio.ensure_future(log.close_sandbox("a", "closed", "test"))
        ticks = 0
        for _ in range(20):  # the loop keeps running meanwhile
            await asyncio.sleep(0.005)
            ticks += 1
        assert ticks == 20 and not close.done()
        assert log.get("a", 1).result == {"n": 1}  # from the journaled results, not yet in SQLite
        assert holder.execute("SELECT COUNT(*) FROM steps WHERE seq=1").fetchone() == (0,)
        holder.execute("COMMIT")
        await asyncio.wait_for(close, 60)
        for _ in range(200):  # the batch, retried once the lock is free
            if holder.execute("SELECT COUNT(*) FROM steps WHERE seq=1").fetchone() == (1,):
                break
            await asyncio.sleep(0.01)
        assert holder.execute("SELECT COUNT(*) FROM steps WHERE seq=1").fetchone() == (1,)
    finally:
        holder.close()
        log.close()


async def test_the_wal_starts_over_instead_of_growing(tmp_path: Path) -> None:
    """After a checkpoint the WAL is written over in place: an fdatasync then flushes data only, with no new
    size or blocks for the file system's journal to commit (twice the cost, bench/bench_walfloor.py)."""
    from shoal.node.trajectory import CHECKPOINT_WRITES

    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    wal = tmp_path / "trajectory.db-wal"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120

    async def writer(name: str) -> None:  # steps keep landing while the checkpoint copies
        seq = 0
        while log.checkpoints < 1 and loop.time() < deadline:
            await log.append(name, seq, "exec", "k", {"cmd": ["true"]}, {"exit_code": 0}, None, 0.0)
            seq += 1

    try:
        await asyncio.gather(*(writer(f"w{i}") for i in range(4)))
        assert log.checkpoints >= 1
        grown = wal.stat().st_size
        for seq in range(CHECKPOINT_WRITES * 3):  # three times the rows: a WAL never started over triples
            await log.append("b", seq, "exec", "k", {"cmd": ["true"]}, {"exit_code": 0}, None, 0.0)
        # checkpoints go on as results reach SQLite in batches: the WAL is written over from its start (how
        # far it gets between two depends on the batches; its fsyncs are rare now, at the journal's start-over)
        assert log.checkpoints >= 3 and wal.stat().st_size <= 8 * grown
        assert log.next_seq("b") == CHECKPOINT_WRITES * 3
    finally:
        log.close()


async def test_a_running_steps_intent_is_one_write_that_outlives_the_node(tmp_path: Path, monkeypatch) -> None:
    """An intent is a write() to the intent journal, not a SQLite commit; reads see it while the step runs;
    a node that starts after one died turns it into the step's row (a re-issue raises), unless the result
    superseded it or the sandbox's log is gone; a torn tail and the journal's rotation lose nothing else."""
    from shoal.node import intents

    monkeypatch.setattr(intents, "ROTATE_BYTES", 4096)  # rotate within this test
    path = tmp_path / "trajectory.db"
    log = TrajectoryLog(path, reserve_bytes=0)
    try:
        await log.open_sandbox("s", None, "busybox", {})
        for seq in range(60):  # past a rotation or two: finished steps' intents are dropped from the file
            await log.begin("s", seq, "exec", "k", {"cmd": ["true"]}, 0.0)
            await log.append("s", seq, "exec", "k", {"cmd": ["true"]}, {"n": seq}, None, 0.0)
        appended = log.appended
        await log.begin("s", 60, "exec", "k", {"cmd": ["sleep", "30"]}, 0.0)
        await log.begin("gone", 0, "exec", "k", {}, 0.0)  # a sandbox whose log was pruned meanwhile
        assert log.appended == appended  # no SQLite commit for an intent
        assert log.next_seq("s") == 61 and [s.seq for s in log.steps("s", 58)] == [58, 59, 60]
        assert "running when the node stopped" in log.get("s", 60).error
        assert log.intents.offset <= 4096 + 512  # started over
        tail = log.intents.offset
    finally:
        log.close()  # as a node that died: the journal keeps the intents
    with (tmp_path / "trajectory.db.intents").open("r+b") as journal:
        journal.seek(tail)
        journal.write(b"\x40\x00\x00\x00\x93\x11\x00\x00\x93")  # a write cut short
    log = TrajectoryLog(path, reserve_bytes=0)
    try:
        assert "running when the node stopped" in log.get("s", 60).error  # a row of the table now
        assert log.get("gone", 0) is None and not log.intents.running
        assert [log.get("s", seq).result for seq in (0, 59)] == [{"n": 0}, {"n": 59}]
        await log.begin("s", 61, "exec", "k", {}, 0.0)
        await log.append("s", 61, "exec", "k", {}, {"n": 61}, None, 0.0)
    finally:
        log.close()
    log = TrajectoryLog(path, reserve_bytes=0)
    try:
        assert log.get("s", 61).result == {"n": 61} and log.next_seq("s") == 62  # superseded, not resurrected
    finally:
        log.close()


async def test_results_only_in_the_journal_are_replayed_after_rotations(tmp_path: Path, monkeypatch) -> None:
    """Acknowledged results that no batch has put into SQLite yet (the batch waits 10 minutes here), across
    journal start-overs: a node started on the files as a SIGKILL would leave them (copied while the log
    runs: the page cache) finds every one; the stale epochs' records past the tail are not replayed."""
    import shutil

    from shoal.node import intents

    monkeypatch.setenv("SHOAL_LOG_BATCH_MS", "600000")
    monkeypatch.setattr(intents, "ROTATE_BYTES", 4096)
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    dead = tmp_path / "dead"
    dead.mkdir()
    try:
        await log.open_sandbox("s", None, "busybox", {})
        for seq in range(40):  # several start-overs: each puts the results before it into SQLite
            await log.begin("s", seq, "exec", "k", {"cmd": ["true"]}, 0.0)
            await log.append("s", seq, "exec", "k", {"cmd": ["true"]}, {"n": seq}, None, 0.0)
        await log.begin("s", 40, "exec", "k", {"cmd": ["sleep", "30"]}, 0.0)
        assert log.intents.epoch > 2 and log._pending  # rotated; the last results in the journal only
        for name in ("trajectory.db", "trajectory.db-wal", "trajectory.db.intents"):
            shutil.copy(tmp_path / name, dead / name)
    finally:
        log.close()
    db = sqlite3.connect(dead / "trajectory.db")
    in_sqlite = db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    db.close()
    assert in_sqlite < 40
    restarted = TrajectoryLog(dead / "trajectory.db", reserve_bytes=0)
    try:
        assert [restarted.get("s", seq).result for seq in range(40)] == [{"n": seq} for seq in range(40)]
        assert "running when the node stopped" in restarted.get("s", 40).error
        assert restarted.next_seq("s") == 41 and not restarted._pending
    finally:
        restarted.close()
    db = sqlite3.connect(dead / "trajectory.db")
    assert db.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 41  # replayed into SQLite, fsynced
    db.close()


def test_a_journal_of_the_layout_before_is_replayed_then_replaced(tmp_path: Path) -> None:
    """A node upgraded while a step ran: the intents file it left (length-prefixed msgpack, no header) is read,
    its intents become rows, and the journal starts over in the pre-zeroed, CRC'd layout."""
    import struct

    import msgspec

    from shoal.node import intents

    path = tmp_path / "trajectory.db"
    log = TrajectoryLog(path, reserve_bytes=0)
    asyncio.run(log.open_sandbox("s", None, "busybox", {}))
    log.close()
    encode = msgspec.msgpack.encode
    row = ("s", 0, "exec", "k", encode({"cmd": ["true"]}), encode(None), "ShoalError", "running when the node stopped",
           0.0, None)  # fmt: skip
    body = encode(list(row))
    (tmp_path / "trajectory.db.intents").write_bytes(struct.pack("<I", len(body)) + body)
    log = TrajectoryLog(path, reserve_bytes=0)
    try:
        assert "running when the node stopped" in log.get("s", 0).error and log.next_seq("s") == 1
        assert (tmp_path / "trajectory.db.intents").read_bytes()[:8] == intents.MAGIC
    finally:
        log.close()


async def test_a_reader_left_open_does_not_hold_up_the_steps(tmp_path: Path) -> None:
    """A read transaction left open on the file (a `sqlite3` shell) keeps the RESTART checkpoint from
    finishing: it gives up (busy_timeout 100 ms) and the steps go on, the WAL growing until the reader ends;
    then the next checkpoint starts it over."""
    from shoal.node.trajectory import CHECKPOINT_WRITES

    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    reader = sqlite3.connect(tmp_path / "trajectory.db", isolation_level=None)
    try:
        await log.append("a", 0, "exec", "k", {}, {}, None, 0.0)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM steps").fetchone()  # holds its snapshot of the WAL
        for seq in range(1, 2 * CHECKPOINT_WRITES + 10):
            await log.append("a", seq, "exec", "k", {}, {}, None, 0.0)
        assert log.checkpoints == 0  # every RESTART gave up
        reader.execute("COMMIT")
        loop = asyncio.get_running_loop()
        deadline, seq = loop.time() + 120, 2 * CHECKPOINT_WRITES + 10
        while log.checkpoints < 1 and loop.time() < deadline:
            await log.append("a", seq, "exec", "k", {}, {}, None, 0.0)
            seq += 1
        assert log.checkpoints >= 1 and log.next_seq("a") == seq
    finally:
        reader.close()
        log.close()


def _fake_sandbox(name: str) -> types.SimpleNamespace:
    """What Recorder.step reads and writes of a sandbox."""
    return types.SimpleNamespace(id=name, spec=types.SimpleNamespace(record=True), next_seq=0, inflight={},
                                 last_active=0.0)  # fmt: skip


async def test_a_logged_step_runs_in_its_requests_task_and_outlives_an_abandoned_connection(tmp_path: Path) -> None:
    """No task of its own per step (issue 12: a task, a shield and loop passes per exec), yet a request whose
    connection went away (trajectory.abandon) finishes its logged step and logs it, while a request that has
    not started its step is cancelled."""
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    recorder = Recorder(log)
    sandbox = _fake_sandbox("s")
    release = asyncio.Event()

    async def run() -> dict:
        me = asyncio.current_task()
        await release.wait()
        return {"same_task": me is request}

    async def serve() -> dict:
        return await recorder.step(sandbox, "exec", {"cmd": ["true"]}, None, run)

    try:
        request = asyncio.ensure_future(serve())
        idle = asyncio.ensure_future(asyncio.sleep(30))  # a request that is not running a step
        await asyncio.sleep(0.05)
        assert sandbox.inflight == {0: request}
        trajectory.abandon(request)
        trajectory.abandon(idle)
        await asyncio.sleep(0.05)
        assert idle.cancelled() and not request.done()
        release.set()
        assert await request == {"same_task": True}
        assert log.get("s", 0).result == {"same_task": True} and sandbox.inflight == {}
    finally:
        log.close()


async def test_a_lone_steps_fsync_starts_in_the_loop_pass_of_its_write(tmp_path: Path) -> None:
    """The result of the only running step: its fdatasync is submitted at once, not a loop pass later (with
    other steps running it waits that pass, so that their rows share it: the tests above)."""
    log = TrajectoryLog(tmp_path / "trajectory.db", reserve_bytes=0)
    try:
        await log.append("warm", 0, "exec", "k", {}, {}, None, 0.0)
        if log._aio is None:
            pytest.skip("Linux AIO cannot fsync on this file system: the syncer thread takes every fsync")
        await log.begin("a", 0, "exec", "k", {}, 0.0)
        append = asyncio.ensure_future(log.append("a", 0, "exec", "k", {}, {}, None, 0.0))
        await asyncio.sleep(0)  # the append's first step ran (row written) in this pass, before this line
        assert log._aio_inflight == log._written
        await append
    finally:
        log.close()


def _frames(sock: socket.socket) -> list[protocol.Response]:
    """Every response the node sends on `sock` until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:  # closed with bytes of ours unread: as closed
        pass
    responses, at = [], 0
    while at + 4 <= len(data):
        (length,) = protocol.LENGTH.unpack_from(data, at)
        responses.append(protocol.decode_response(data[at + 4 : at + 4 + length]))
        at += 4 + length
    return responses


def test_the_unix_socket_answers_a_half_closed_client_and_drops_a_malformed_one(
    client: shoal.Client, node: NodeProcess
) -> None:
    """The node's Unix socket is read by a protocol callback (node/server.py _UnixConnection), not a reader
    task: requests in one write are served concurrently, a client that half-closes after its requests still
    gets the answer of its logged step (then the node closes), and a frame over the size limit ends the
    connection."""
    with client.create(image="busybox", pool=False, ttl_s=120) as sb:
        requests = [
            protocol.Request(id=1, op="exec", args={"req": {"sandbox_id": sb.id, "cmd": "sleep 0.3; echo one"}}),
            protocol.Request(id=2, op="exec", args={"req": {"sandbox_id": sb.id, "cmd": "echo two", "seq": 1}}),
            protocol.Request(id=3, op="get", args={"sandbox_id": sb.id}),
        ]
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect(str(node.home / "node.sock"))
            sock.sendall(b"".join(protocol.encode(r) for r in requests))
            sock.shutdown(socket.SHUT_WR)
            answers = {r.id: r for r in _frames(sock)}
        assert answers[3].result["id"] == sb.id and answers[3].error is None
        assert answers[1].error is None and answers[1].result["stdout"] == b"one\n"
        assert answers[2].error is None and answers[2].result["stdout"] == b"two\n"
        assert [step["seq"] for step in sb.log()] == [0, 1]
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect(str(node.home / "node.sock"))
            sock.sendall(protocol.LENGTH.pack(protocol.MAX_FRAME + 1) + b"x" * 64)
            assert _frames(sock) == []  # closed, nothing answered
        assert client.get(sb.id).id == sb.id  # the node serves on
