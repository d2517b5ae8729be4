"""Tests for the guest agent, run directly on the host (no container)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from shoal.guest import AgentClient, AgentError, ExecProcess, ExitInfo, agent_binary_path
from shoal.guest.client import (
    EXEC_BG_FOLLOW,
    EXEC_HOLD_PID,
    Attached,
    BackgroundStatus,
    _exec_payload,
    _frame,
    control_frames,
)
from shoal.protocol import cut_marker

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    sock_path: str
    client: AgentClient


def ignore_reserved_signal(signum: int) -> None:
    """SIG_IGN for a signal libc reserves for itself (32, 33), by the raw rt_sigaction system call (x86_64 and
    aarch64 alike: the kernel's struct starts with the handler; SIG_IGN is 1)."""
    libc = ctypes.CDLL(None, use_errno=True)
    act = (ctypes.c_ulong * 4)(1, 0, 0, 0)
    nr = {"x86_64": 13, "aarch64": 134}[platform.machine()]
    if libc.syscall(nr, signum, ctypes.byref(act), None, 8) != 0:
        raise OSError(ctypes.get_errno(), f"rt_sigaction({signum})")


@pytest.fixture
def agent(request: pytest.FixtureRequest) -> Iterator[Agent]:
    """An agent and its client; parametrized (indirect) with a number of ms, the client asks the agent to hold
    exec pid frames (EXEC_HOLD_PID, as a container's does) and the agent holds them that long at most."""
    hold_ms = getattr(request, "param", None)
    env = None if hold_ms is None else {**os.environ, "SHOAL_AGENT_PID_HOLD_MS": str(hold_ms)}
    binary = agent_binary_path()
    tmp = tempfile.mkdtemp(prefix="shoal-agent-")
    sock_path = os.path.join(tmp, "agent.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(sock_path)
    sock.listen(128)
    fd = sock.fileno()

    def to_fd3() -> None:
        os.dup2(fd, 3)
        # Whatever starts an agent may leave signals ignored or blocked (both survive execve; CI runners do):
        # the agent must not pass that on to its commands.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGRTMIN, signal.SIG_IGN)
        ignore_reserved_signal(32)  # what the CI runner leaves ignored; libc's own calls refuse it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    # The agent's default listening fd is 3.  Its own session lets teardown kill
    # the agent together with any handler processes still running.
    proc = subprocess.Popen([binary], pass_fds=[3], preexec_fn=to_fd3, start_new_session=True, env=env)
    sock.close()
    try:
        yield Agent(proc, sock_path, AgentClient(sock_path, hold_pid=hold_ms is not None))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="shoal-agent-files-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def run(client: AgentClient, argv: list[str], **kw: object) -> tuple[bytes, bytes, ExitInfo]:
    kw.setdefault("env", ENV)
    proc = await client.exec(argv, **kw)  # type: ignore[arg-type]
    try:
        return await proc.collect()
    finally:
        await proc.close()


def procs_with_arg(arg: str) -> list[int]:
    """Pids of live processes whose argv contains ``arg``."""
    found = []
    needle = arg.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            pass
    return found


def zombie_children(pid: int) -> list[int]:
    zombies = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == pid:
            zombies.append(int(name))
    return zombies


async def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


def unique_sleep_arg() -> str:
    return f"1000.{uuid.uuid4().int % 10**9:09d}"


# --------------------------------------------------------------------------- basics


async def test_hello(agent: Agent) -> None:
    pid, version = await agent.client.hello()
    assert pid == agent.proc.pid
    assert version == "shoal-agent 1"


async def test_connection_error_names_socket(workdir: str) -> None:
    path = os.path.join(workdir, "missing.sock")
    with pytest.raises(ConnectionError, match="missing.sock"):
        await AgentClient(path).hello()


async def test_exec_exit_code_and_streams(agent: Agent) -> None:
    out, err, info = await run(agent.client, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert out == b"out\n"
    assert err == b"err\n"
    assert info == ExitInfo(exit_code=3, signal=0, stdout_dropped=0, stderr_dropped=0)


async def test_exec_reports_pid(agent: Agent) -> None:
    proc = await agent.client.exec(["sh", "-c", "echo $$"], env=ENV)
    out, _, info = await proc.collect()
    assert int(out) == proc.pid
    assert info.exit_code == 0


async def test_commands_start_with_default_signal_dispositions(agent: Agent) -> None:
    """The agent ignores SIGPIPE and catches SIGCHLD (and, outside a PID namespace, SIGTERM and SIGINT); a
    command, started by a child sharing its handler's memory, inherits none of that: nothing ignored, caught
    or blocked, on a new connection and on a kept one alike."""

    def masks(out: bytes) -> dict[str, int]:
        fields = dict(line.split(":\t", 1) for line in out.decode().splitlines() if ":\t" in line)
        return {k: int(fields[k], 16) for k in ("SigBlk", "SigIgn", "SigCgt")}

    out, _, info = await run(agent.client, ["cat", "/proc/self/status"])
    assert info.exit_code == 0 and masks(out) == {"SigBlk": 0, "SigIgn": 0, "SigCgt": 0}
    for _ in range(3):  # the kept connection's handler starts these
        done = await exec_done(agent.client, ["cat", "/proc/self/status"])
        assert masks(bytes(done.stdout)) == {"SigBlk": 0, "SigIgn": 0, "SigCgt": 0}  # type: ignore[attr-defined]
    for _ in range(2):  # background processes too (the second on the spare connection), on a terminal too
        _, _, follower = await agent.client.background_follow(["cat", "/proc/self/status"], env=ENV)
        assert follower is not None
        assert masks((await _drain(follower))[0]) == {"SigBlk": 0, "SigIgn": 0, "SigCgt": 0}
    _, _, follower = await agent.client.background_follow(["cat", "/proc/self/status"], env=ENV, size=(24, 80))
    assert follower is not None
    assert masks((await _drain(follower))[0].replace(b"\r\n", b"\n")) == {"SigBlk": 0, "SigIgn": 0, "SigCgt": 0}


async def test_exec_killed_by_signal(agent: Agent) -> None:
    _, _, info = await run(agent.client, ["sh", "-c", "kill -TERM $$"])
    assert (info.exit_code, info.signal) == (128 + signal.SIGTERM, signal.SIGTERM)


async def test_merge_stderr(agent: Agent) -> None:
    argv = ["sh", "-c", "echo a; echo b >&2; echo c"]
    out, err, info = await run(agent.client, argv, merge_stderr=True)
    assert out == b"a\nb\nc\n"
    assert err == b""
    assert info.exit_code == 0


async def test_env_and_cwd(agent: Agent, workdir: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "FOO": "bar baz", "EMPTY": ""}
    out, _, info = await run(agent.client, ["sh", "-c", 'echo "$FOO"; pwd; env'], env=env, cwd=workdir)
    lines = out.decode().splitlines()
    assert lines[0] == "bar baz"
    assert lines[1] == workdir
    names = {line.split("=", 1)[0] for line in lines[2:]}
    # Only the given variables (plus what sh itself adds) are visible.
    assert {"FOO", "EMPTY", "PATH"} <= names
    assert not names & {"PYTEST_CURRENT_TEST", "HOME", "VIRTUAL_ENV"}
    assert info.exit_code == 0


async def test_path_lookup_uses_given_env(agent: Agent, workdir: str) -> None:
    script = os.path.join(workdir, "shoal-test-cmd")
    with open(script, "w") as f:
        f.write('#!/bin/sh\necho custom "$@"\n')
    os.chmod(script, 0o755)
    out, _, info = await run(agent.client, ["shoal-test-cmd", "x"], env={"PATH": workdir})
    assert (out, info.exit_code) == (b"custom x\n", 0)
    # A script without a #! line is run by /bin/sh, like execvp does.
    with open(script, "w") as f:
        f.write("echo plain\n")
    out, _, info = await run(agent.client, ["shoal-test-cmd"], env={"PATH": workdir})
    assert (out, info.exit_code) == (b"plain\n", 0)
    # Not found through the default PATH when the env has none.
    _, err, info = await run(agent.client, ["shoal-test-cmd"], env={})
    assert info.exit_code == 127
    assert b"shoal-test-cmd" in err


async def test_exec_missing_binary(agent: Agent) -> None:
    out, err, info = await run(agent.client, ["no-such-command-xyz", "arg"])
    assert info.exit_code == 127
    assert out == b""
    assert err == b"shoal: exec no-such-command-xyz: No such file or directory\n"


async def test_exec_not_executable_and_bad_cwd(agent: Agent, workdir: str) -> None:
    path = os.path.join(workdir, "noexec")
    with open(path, "w") as f:
        f.write("echo hi\n")
    os.chmod(path, 0o644)
    _, err, info = await run(agent.client, [path])
    assert info.exit_code == 126
    assert b"Permission denied" in err
    missing = os.path.join(workdir, "nope")
    _, err, info = await run(agent.client, ["true"], cwd=missing)
    assert info.exit_code == 127
    assert err == f"shoal: chdir {missing}: No such file or directory\n".encode()


async def test_exec_as_other_user(agent: Agent) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root")
    out, _, info = await run(agent.client, ["sh", "-c", "id -u; id -g; id -G"], uid=4321, gid=8765)
    assert out.split() == [b"4321", b"8765", b"8765"]
    assert info.exit_code == 0


async def test_stdin_pipe_round_trip(agent: Agent) -> None:
    data = os.urandom(3 << 20)
    proc = await agent.client.exec(["cat"], env=ENV, stdin_pipe=True, cap_bytes=0)
    try:
        await proc.write_stdin(b"hello ")
        await proc.write_stdin(data)
        await proc.close_stdin()
        out, err, info = await proc.collect()
    finally:
        await proc.close()
    assert out == b"hello " + data
    assert err == b""
    assert info.exit_code == 0


async def test_stdin_is_dev_null_without_pipe(agent: Agent) -> None:
    out, _, info = await run(agent.client, ["sh", "-c", "cat; echo end"])
    assert (out, info.exit_code) == (b"end\n", 0)


async def test_output_cap(agent: Agent) -> None:
    total = 5_000_000
    cap = 1 << 20
    argv = ["sh", "-c", f"yes | head -c {total}; yes e | head -c {total} >&2"]
    out, err, info = await run(agent.client, argv, cap_bytes=cap)
    marker = cut_marker(total - cap)  # the head and the tail are kept, the middle is cut
    assert out == b"y\n" * (cap // 4) + marker + b"y\n" * (cap // 4)
    assert err == b"e\n" * (cap // 4) + marker + b"e\n" * (cap // 4)
    assert info.stdout_dropped == total - cap
    assert info.stderr_dropped == total - cap
    assert info.exit_code == 0


# --------------------------------------------------------------------------- process trees


async def _start_tree(agent: Agent) -> tuple[ExecProcess, str]:
    arg = unique_sleep_arg()
    proc = await agent.client.exec(["sh", "-c", f"setsid sleep {arg} & sleep {arg}"], env=ENV)
    assert await wait_for(lambda: len(procs_with_arg(arg)) == 2), "sleeps did not start"
    return proc, arg


async def test_kill_tree(agent: Agent) -> None:
    proc, arg = await _start_tree(agent)
    try:
        await proc.kill()
        _, _, info = await asyncio.wait_for(proc.collect(), 5)
        assert info.signal == signal.SIGKILL
        assert info.exit_code == 128 + signal.SIGKILL
        assert await wait_for(lambda: not procs_with_arg(arg), 2)
        await proc.kill()  # harmless after exit
    finally:
        for pid in procs_with_arg(arg):
            os.kill(pid, signal.SIGKILL)


async def test_kill_tree_with_sigterm(agent: Agent) -> None:
    proc, arg = await _start_tree(agent)
    try:
        await proc.kill(signal.SIGTERM)
        _, _, info = await asyncio.wait_for(proc.collect(), 5)
        assert info.signal == signal.SIGTERM
        assert await wait_for(lambda: not procs_with_arg(arg), 2)
    finally:
        for pid in procs_with_arg(arg):
            os.kill(pid, signal.SIGKILL)


async def test_closing_connection_kills_tree(agent: Agent) -> None:
    proc, arg = await _start_tree(agent)
    try:
        await proc.close()
        assert await wait_for(lambda: not procs_with_arg(arg), 3)
    finally:
        for pid in procs_with_arg(arg):
            os.kill(pid, signal.SIGKILL)


async def test_background_job_survives_and_does_not_block(agent: Agent) -> None:
    arg = f"30.{uuid.uuid4().int % 10**9:09d}"
    try:
        start = time.monotonic()
        out, _, info = await run(agent.client, ["sh", "-c", f"sleep {arg} & echo done"])
        elapsed = time.monotonic() - start
        assert out == b"done\n"
        assert info.exit_code == 0
        assert elapsed < 10.0  # not held until the 30 s job ends (a loaded host can take seconds)
        await asyncio.sleep(0.1)
        assert len(procs_with_arg(arg)) == 1, "background job should survive"
    finally:
        for pid in procs_with_arg(arg):
            os.kill(pid, signal.SIGKILL)
    assert await wait_for(lambda: not zombie_children(agent.proc.pid), 2)


async def test_zombies_are_reaped(agent: Agent) -> None:
    # Background children outlive their handler and get reparented to the agent.
    procs = [run(agent.client, ["sh", "-c", "sleep 0.2 & sleep 0.1 & true"]) for _ in range(20)] + [
        run(agent.client, ["true"]) for _ in range(30)
    ]
    results = await asyncio.gather(*procs)
    assert all(info.exit_code == 0 for _, _, info in results)
    await asyncio.sleep(0.4)
    assert await wait_for(lambda: not zombie_children(agent.proc.pid), 2)


# --------------------------------------------------------------------------- files


async def test_write_read_round_trip(agent: Agent, workdir: str) -> None:
    c = agent.client
    binary = bytes(range(256)) * 7 + b"\0\n\r"
    path = os.path.join(workdir, "bin.dat")
    assert await c.write_file(path, binary) == len(binary)
    assert await c.read_file(path) == binary
    with open(path, "rb") as f:
        assert f.read() == binary

    big = os.urandom(5 << 20)
    big_path = os.path.join(workdir, "big.dat")
    assert await c.write_file(big_path, big) == len(big)
    assert await c.read_file(big_path) == big

    empty = os.path.join(workdir, "empty")
    assert await c.write_file(empty, b"") == 0
    assert await c.read_file(empty) == b""

    # Overwrite is atomic and leaves no temp files behind.
    assert await c.write_file(path, b"new") == 3
    assert await c.read_file(path) == b"new"
    assert sorted(os.listdir(workdir)) == ["big.dat", "bin.dat", "empty"]


async def test_write_mkdirs_mode_owner_append(agent: Agent, workdir: str) -> None:
    c = agent.client
    path = os.path.join(workdir, "a", "b", "c.txt")
    with pytest.raises(FileNotFoundError):
        await c.write_file(path, b"x", mkdirs=False)
    await c.write_file(path, b"one\n", mode=0o600, uid=1234, gid=5678)
    st = os.stat(path)
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o600, 1234, 5678)
    parent = os.stat(os.path.dirname(path))
    assert (parent.st_mode & 0o7777, parent.st_uid, parent.st_gid) == (0o755, 1234, 5678)

    assert await c.write_file(path, b"two\n", append=True) == 4
    assert await c.read_file(path) == b"one\ntwo\n"
    assert os.stat(path).st_mode & 0o7777 == 0o600  # appending keeps metadata

    new = os.path.join(workdir, "appended")
    await c.write_file(new, b"z", append=True, mode=0o640)
    assert os.stat(new).st_mode & 0o7777 == 0o640

    await c.write_file(os.path.join(workdir, "exe"), b"#!/bin/sh\n", mode=0o755)
    assert os.stat(os.path.join(workdir, "exe")).st_mode & 0o7777 == 0o755


async def test_read_errors(agent: Agent, workdir: str) -> None:
    c = agent.client
    missing = os.path.join(workdir, "missing")
    with pytest.raises(FileNotFoundError, match="missing"):
        await c.read_file(missing)
    path = os.path.join(workdir, "f")
    await c.write_file(path, b"x" * 1000)
    with pytest.raises(AgentError) as exc_info:
        await c.read_file(path, max_bytes=999)
    assert exc_info.value.errno == errno.EFBIG
    assert "1000" in str(exc_info.value) and "999" in str(exc_info.value)
    assert await c.read_file(path, max_bytes=1000) == b"x" * 1000
    with pytest.raises(IsADirectoryError):
        await c.read_file(workdir)


async def test_list_dir(agent: Agent, workdir: str) -> None:
    c = agent.client
    outside = tempfile.mkdtemp(prefix="shoal-agent-outside-")
    try:
        with open(os.path.join(outside, "hidden.txt"), "w") as f:
            f.write("nope")
        root = os.path.join(workdir, "root")
        await c.write_file(os.path.join(root, "a.txt"), b"aaa")
        await c.write_file(os.path.join(root, "sub", "b.txt"), b"b")
        await c.mkdir(os.path.join(root, "sub", "deeper"))
        os.symlink(outside, os.path.join(root, "link"))

        flat = await c.list_dir(root)
        assert [e.name for e in flat] == ["a.txt", "link", "sub"]
        kinds = {e.name: e.kind for e in flat}
        assert kinds == {"a.txt": "file", "link": "symlink", "sub": "dir"}
        by_name = {e.name: e for e in flat}
        assert by_name["a.txt"].size == 3
        assert by_name["link"].target == outside
        assert abs(by_name["a.txt"].mtime - os.stat(os.path.join(root, "a.txt")).st_mtime) < 1e-3

        rec = await c.list_dir(root, recursive=True)
        names = [e.name for e in rec]
        assert names == ["a.txt", "link", "sub", "sub/b.txt", "sub/deeper"]
        assert not any("hidden" in n for n in names)

        with pytest.raises(FileNotFoundError):
            await c.list_dir(os.path.join(workdir, "nope"))
        with pytest.raises(NotADirectoryError):
            await c.list_dir(os.path.join(root, "a.txt"))
    finally:
        shutil.rmtree(outside)


async def test_stat(agent: Agent, workdir: str) -> None:
    c = agent.client
    path = os.path.join(workdir, "s.txt")
    await c.write_file(path, b"12345", mode=0o640)
    entry = await c.stat(path)
    assert entry is not None
    assert (entry.kind, entry.size, entry.mode, entry.target) == ("file", 5, 0o640, "")
    assert entry.uid == os.getuid()
    os.symlink("s.txt", os.path.join(workdir, "ln"))
    link = await c.stat(os.path.join(workdir, "ln"))
    assert link is not None and (link.kind, link.target) == ("symlink", "s.txt")
    d = await c.stat(workdir)
    assert d is not None and d.kind == "dir"
    assert await c.stat(os.path.join(workdir, "missing")) is None
    assert await c.stat(os.path.join(path, "below-a-file")) is None


async def test_mkdir(agent: Agent, workdir: str) -> None:
    c = agent.client
    path = os.path.join(workdir, "x", "y", "z")
    await c.mkdir(path, mode=0o700, uid=1111, gid=2222)
    st = os.stat(path)
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o700, 1111, 2222)
    await c.mkdir(path)  # existing is fine with parents
    with pytest.raises(FileExistsError):
        await c.mkdir(path, parents=False)
    with pytest.raises(FileNotFoundError):
        await c.mkdir(os.path.join(workdir, "p", "q"), parents=False)
    await c.mkdir(os.path.join(workdir, "single"), parents=False, mode=0o750)
    assert os.stat(os.path.join(workdir, "single")).st_mode & 0o7777 == 0o750
    await c.write_file(os.path.join(workdir, "file"), b"")
    with pytest.raises(NotADirectoryError):
        await c.mkdir(os.path.join(workdir, "file", "sub"))


async def test_remove(agent: Agent, workdir: str) -> None:
    c = agent.client
    outside = tempfile.mkdtemp(prefix="shoal-agent-outside-")
    try:
        keep = os.path.join(outside, "keep.txt")
        with open(keep, "w") as f:
            f.write("keep")
        tree = os.path.join(workdir, "tree")
        for rel in ("a", "d1/b", "d1/d2/c", "d1/d2/d3/d"):
            await c.write_file(os.path.join(tree, rel), b"data")
        os.symlink(outside, os.path.join(tree, "d1", "link"))
        os.symlink("/nonexistent", os.path.join(tree, "dangling"))

        with pytest.raises(AgentError) as exc_info:
            await c.remove(tree)
        assert exc_info.value.errno == errno.ENOTEMPTY
        await c.remove(tree, recursive=True)
        assert not os.path.lexists(tree)
        assert os.path.exists(keep), "recursive remove followed a symlink"

        f = os.path.join(workdir, "f")
        await c.write_file(f, b"x")
        await c.remove(f)
        assert not os.path.exists(f)
        await c.mkdir(os.path.join(workdir, "empty"))
        await c.remove(os.path.join(workdir, "empty"))
        with pytest.raises(FileNotFoundError):
            await c.remove(f)
    finally:
        shutil.rmtree(outside)


async def test_concurrent_operations(agent: Agent, workdir: str) -> None:
    c = agent.client
    blobs = {os.path.join(workdir, f"f{i}"): os.urandom(100_000 + i) for i in range(20)}
    await asyncio.gather(*(c.write_file(p, d) for p, d in blobs.items()))
    got = await asyncio.gather(*(c.read_file(p) for p in blobs))
    assert got == list(blobs.values())
    outs = await asyncio.gather(*(run(c, ["echo", str(i)]) for i in range(20)))
    assert [o for o, _, _ in outs] == [f"{i}\n".encode() for i in range(20)]


async def test_port_relay(agent: Agent) -> None:
    """'F' relays raw bytes to a port on the agent's loopback, both ways, with half-close, many at once."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the relay passes on the client's half-close
        writer.write(data[::-1])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:

        async def one(payload: bytes) -> bytes:
            reader, writer = await agent.client.open_port(port)
            writer.write(payload)
            writer.write_eof()
            got = await reader.read()
            writer.close()
            return got

        blobs = [os.urandom(n) for n in (1, 70_000, 3 << 20)] + [b"x%d" % i for i in range(20)]
        assert await asyncio.gather(*(one(b) for b in blobs)) == [b[::-1] for b in blobs]
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        await agent.client.open_port(port)  # nothing listens there any more
    with pytest.raises(ValueError):
        await agent.client.open_port(70000)


# --------------------------------------------------------------------------- background processes (procs.c)


async def _drain(attached: Attached) -> tuple[bytes, bytes]:
    out, err = bytearray(), bytearray()
    while (item := await attached.next()) is not None:
        (out if item[0] == "stdout" else err).extend(item[1])
    return bytes(out), bytes(err)


async def _read(agent: Agent, id: int, offsets: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes, BackgroundStatus]:
    out, err = await _drain(await agent.client.attach(id, Attached.READ, offsets))
    status = await agent.client.control(id, b"")
    return out, err, status


async def test_background_outlives_its_connection_and_takes_stdin(agent: Agent) -> None:
    script = 'echo ready; while read line; do echo "got $line"; echo "err $line" >&2; done; echo bye; exit 7'
    pid, id = await agent.client.background(["sh", "-c", script], env=ENV)
    assert pid > 0 and id > 0 and id != pid
    assert os.path.exists(f"/proc/{pid}")  # the starting connection is closed: the process still runs
    attached = await agent.client.attach(id, Attached.READ)
    assert attached.pid == pid and not attached.pty

    async def output(offsets: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes]:
        return await _drain(await agent.client.attach(id, Attached.READ, offsets))

    await attached.close()
    status = await agent.client.control(id, control_frames(stdin=b"one\ntwo\n"))
    assert status.running
    deadline = time.monotonic() + 10
    while (await output())[0] != b"ready\ngot one\ngot two\n" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out, err = await output()
    assert out == b"ready\ngot one\ngot two\n" and err == b"err one\nerr two\n"
    assert await output((len(b"ready\n"), len(b"err one\n"))) == (b"got one\ngot two\n", b"err two\n")
    # a follower sees the rest live, then the exit status; a late reader still gets it (the keeper lingers)
    follower = await agent.client.attach(id, Attached.FOLLOW, (len(out), len(err)))
    await follower.send(control_frames(stdin=b"three\n", eof=True))
    assert await _drain(follower) == (b"got three\nbye\n", b"err three\n")
    assert follower.status is not None and not follower.status.running and follower.status.exit_code == 7
    assert follower.offsets == [follower.status.stdout_offset, follower.status.stderr_offset]
    late = await agent.client.control(id, b"")
    assert (late.running, late.exit_code, late.stdout_offset) == (
        False,
        7,
        len(b"ready\ngot one\ngot two\ngot three\nbye\n"),
    )
    listed = {e.id: e for e in await agent.client.background_list()}
    assert listed[id].pid == pid and not listed[id].running and listed[id].exit_code == 7


async def test_background_signal_kills_its_tree_and_list(agent: Agent) -> None:
    arg = unique_sleep_arg()
    pid, id = await agent.client.background(["sh", "-c", f"sleep {arg} & sleep {arg}; echo never"], env=ENV)
    try:
        assert await wait_for(lambda: len(procs_with_arg(arg)) == 2, 10)
        (entry,) = [e for e in await agent.client.background_list() if e.id == id]
        assert entry.running and entry.pid == pid and not entry.pty
        await agent.client.control(id, control_frames(signal=signal.SIGTERM))
        follower = await agent.client.attach(id, Attached.FOLLOW)
        assert await _drain(follower) == (b"", b"")
        assert follower.status is not None and follower.status.signal == signal.SIGTERM
        assert follower.status.exit_code == 128 + signal.SIGTERM
        assert await wait_for(lambda: not procs_with_arg(arg), 10)  # the whole tree, not just its leader
    finally:
        for p in procs_with_arg(arg):
            os.kill(p, signal.SIGKILL)


async def test_background_ring_keeps_the_newest_output(agent: Agent) -> None:
    _, id = await agent.client.background(
        ["sh", "-c", "head -c 20000 /dev/zero | tr '\\0' a; printf END"], env=ENV, ring_bytes=4096
    )
    follower = await agent.client.attach(id, Attached.FOLLOW)
    await _drain(follower)
    out, _ = await _drain(await agent.client.attach(id, Attached.READ))
    marker = cut_marker(20003 - 4096)  # the ring holds the last 4096 bytes; what came before is counted
    assert out.startswith(marker) and out[len(marker) :] == b"a" * (4096 - 3) + b"END"


async def test_background_terminal_size_and_resize(agent: Agent) -> None:
    script = "stty size; trap 'stty size' WINCH; echo ready; while :; do sleep 0.05; done"
    pid, id = await agent.client.background(["sh", "-c", script], env=ENV, size=(24, 80))
    try:
        follower = await agent.client.attach(id, Attached.FOLLOW)
        assert follower.pty
        seen = bytearray()
        while b"ready" not in seen:
            item = await asyncio.wait_for(follower.next(), 10)
            assert item is not None
            seen.extend(item[1])
        assert b"24 80\r\n" in seen  # a terminal: newlines come back as CR LF
        await follower.send(control_frames(size=(40, 132)))
        while b"40 132" not in seen:
            item = await asyncio.wait_for(follower.next(), 10)
            assert item is not None
            seen.extend(item[1])
        out = await agent.client.control(id, control_frames(stdin=b"x"))
        assert out.running
        await agent.client.control(id, control_frames(signal=signal.SIGKILL))
        assert await _drain(follower) is not None
        assert follower.status is not None and follower.status.signal == signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_background_followed_on_its_starting_connection(agent: Agent) -> None:
    """'B' with the follow flag: the starter's connection stays, a follower from offset 0 (output, then the
    status), and the process is a background one like any other (listed, attached, read again)."""
    pid, id, follower = await agent.client.background_follow(
        ["sh", "-c", "echo out; echo err >&2; read x; echo $x; exit 4"], env=ENV
    )
    assert follower is not None and (follower.pid, follower.id, follower.pty) == (pid, id, False)
    assert id in [e.id for e in await agent.client.background_list()]
    await agent.client.control(id, control_frames(stdin=b"in\n", eof=True))
    assert await _drain(follower) == (b"out\nin\n", b"err\n")
    assert follower.status is not None and not follower.status.running and follower.status.exit_code == 4
    out, err, status = await _read(agent, id)
    assert (out, err, status.exit_code) == (b"out\nin\n", b"err\n", 4)
    # the follower may go away first: the process goes on, on its own
    arg = unique_sleep_arg()
    pid, id, follower = await agent.client.background_follow(["sleep", arg], env=ENV)
    assert follower is not None
    await follower.close()
    try:
        assert (await agent.client.control(id, b"")).running
    finally:
        await agent.client.control(id, control_frames(signal=signal.SIGKILL))


def test_a_followed_start_answers_both_pid_frames_in_one_send(agent: Agent) -> None:
    """'B' with the follow flag: the command's child sends the follower's 'P' (pid, keeper, pty) together with
    the start's own, so the node reads both at once instead of waiting for the keeper to send the second
    once the command has exec'd (one wakeup of the node per start, and the start not held up by the exec)."""
    for size, pty in ((0, 0), (24 << 16 | 80, 1)):
        arg = unique_sleep_arg()
        payload = _exec_payload(
            ["sleep", arg], ENV, "/", os.getuid(), os.getgid(), 1 << 20, True, False, EXEC_BG_FOLLOW
        )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        try:
            sock.connect(agent.sock_path)
            sock.sendall(_frame(b"B", payload + struct.pack(">I", size)))
            data = sock.recv(4096)  # one send of 27 bytes is one read on a unix socket
            assert len(data) == 27, data
            start, follower = struct.unpack(">IcII", data[:13]), struct.unpack(">IcII?", data[13:])
            assert start[:2] == (9, b"P") and follower[:2] == (10, b"P")
            assert start[2:] == follower[2:4] and follower[4] == bool(pty)
            keeper = start[3]
            # listed as running from then on (the child records itself in its keeper's slot before the 'P'),
            # not only once the command has exec'd: a client told the process started may look for it at once
            lister = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lister.settimeout(30)
            with lister:
                lister.connect(agent.sock_path)
                lister.sendall(_frame(b"J"))
                reply = b""
                while len(reply) < 9 or len(reply) < 4 + struct.unpack(">I", reply[:4])[0]:
                    chunk = lister.recv(65536)
                    assert chunk, reply
                    reply += chunk
            assert reply[4:5] == b"A"
            entries = [
                struct.unpack_from(">II?", reply, 9 + 34 * i) for i in range(struct.unpack_from(">I", reply, 5)[0])
            ]
            assert (keeper, start[2], True) in entries
        finally:
            sock.close()
        asyncio.run(agent.client.control(keeper, control_frames(signal=signal.SIGKILL)))


def children(pid: int) -> set[int]:
    """The live (not zombie) child processes of `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


async def test_background_start_is_served_by_a_handler_forked_ahead(agent: Agent) -> None:
    """Once it started a background process the client holds a spare connection, whose handler the agent
    forked while nothing waited on it: the next start goes there (that handler becomes its keeper, the ID).
    A spare whose handler was killed in the sandbox is passed over; close() lets the spare's handler go."""
    await agent.client.hello()  # the agent is up, its reserve forked (before its first accept)
    base = children(agent.proc.pid)  # the reserve (and the hello's handler, if it has not exited yet)
    _, first, follower = await agent.client.background_follow(["true"], env=ENV)
    assert follower is not None
    await _drain(follower)
    assert await wait_for(lambda: len(children(agent.proc.pid) - base - {first}) == 1)
    (spare,) = children(agent.proc.pid) - base - {first}
    _, second = await agent.client.background(["true"], env=ENV)
    assert second == spare
    assert await wait_for(lambda: len(children(agent.proc.pid) - base - {first, second}) == 1)
    (spare,) = children(agent.proc.pid) - base - {first, second}
    os.kill(spare, signal.SIGKILL)
    assert await wait_for(lambda: spare not in children(agent.proc.pid))
    _, third, follower = await agent.client.background_follow(["sh", "-c", "echo $PPID"], env=ENV)
    assert follower is not None
    assert await _drain(follower) == (f"{third}\n".encode(), b"")
    assert third not in (first, second, spare)
    assert await wait_for(lambda: len(children(agent.proc.pid) - base - {first, second, third}) == 1)
    (spare,) = children(agent.proc.pid) - base - {first, second, third}
    agent.client.close()
    assert await wait_for(lambda: spare not in children(agent.proc.pid))


async def test_a_spare_that_answers_an_error_is_passed_over(agent: Agent) -> None:
    """A spare connection the agent passed to its reserve (dialled at the sandbox's pids limit) answers the
    start with an error, though a new connection now could start it: the start goes to a new connection."""
    ours, reserve = socket.socketpair()
    ours.setblocking(False)
    reserve.setblocking(False)
    agent.client._spare = ours
    loop = asyncio.get_running_loop()

    async def answer_an_error() -> bytes:
        request = await loop.sock_recv(reserve, 1 << 16)
        message = struct.pack(">I", errno.EAGAIN) + b"fork: resource temporarily unavailable"
        await loop.sock_sendall(reserve, struct.pack(">IB", len(message) + 1, ord("Z")) + message)
        return request

    answered = asyncio.create_task(answer_an_error())
    try:
        _, id, follower = await agent.client.background_follow(["sh", "-c", "echo started"], env=ENV)
        assert (await answered)[4:5] == b"B"  # the start went to the spare first
        assert follower is not None and await _drain(follower) == (b"started\n", b"")
    finally:
        reserve.close()
        ours.close()


async def test_requests_the_reserve_serves_let_the_spare_go(agent: Agent) -> None:
    """Hello, the process list and kills close the spare first: at the pids limit a spare goes to the agent's
    reserve, which would wait on it (5 s) before serving them, and the node's liveness check is a hello."""
    await agent.client.hello()  # the agent is up, its reserve forked (before its first accept)
    base = children(agent.proc.pid)
    for request in (agent.client.hello, agent.client.processes, agent.client.kill_processes):
        _, id = await agent.client.background(["true"], env=ENV)
        assert agent.client._spare is not None
        base |= {id}
        assert await wait_for(lambda b=base: len(children(agent.proc.pid) - b) == 1)
        (spare,) = children(agent.proc.pid) - base
        await request()
        assert agent.client._spare is None
        assert await wait_for(lambda s=spare: s not in children(agent.proc.pid))


async def test_attach_to_unknown_background_process(agent: Agent) -> None:
    with pytest.raises(AgentError) as info:
        await agent.client.attach(agent.proc.pid, Attached.READ)
    assert info.value.errno == errno.ESRCH


# --------------------------------------------------------------------------- ExecRun (the node's exec step)


async def finish(run: object, limit: float | None = None) -> None:
    while run.exit is None and run.error is None:  # type: ignore[attr-defined]
        await run.wait(limit)  # type: ignore[attr-defined]


async def test_exec_run_collects_streams_cut_marks_and_exit(agent: Agent) -> None:
    run = await agent.client.exec_run(
        ["sh", "-c", "echo out; echo err >&2; head -c 5000 /dev/zero | tr '\\0' x; exit 3"], env=ENV, cap_bytes=1000
    )
    try:
        assert run.pid > 0 and run.handler_pid not in (None, run.pid)
        await finish(run)
    finally:
        run.close()
    assert run.exit is not None and (run.exit.exit_code, run.exit.signal) == (3, 0)
    assert bytes(run.stderr) == b"err\n"
    omitted = 4 + 5000 - 1000
    assert bytes(run.stdout) == b"out\n" + b"x" * 496 + cut_marker(omitted) + b"x" * 500
    assert run.exit.stdout_dropped == omitted and run.chunks is None


async def test_exec_run_streams_chunks_in_order_and_feeds_stdin(agent: Agent) -> None:
    run = await agent.client.exec_run(["sh", "-c", "cat; echo done >&2"], env=ENV, stdin_pipe=True, stream=True)
    seen: list[tuple[str, bytes]] = []
    try:
        await run.send(control_frames(stdin=b"abc", eof=True))
        while run.exit is None:
            await run.wait(None)
            seen += run.chunks or []
            run.chunks = []
    finally:
        run.close()
    assert b"".join(d for s, d in seen if s == "stdout") == bytes(run.stdout) == b"abc"
    assert b"".join(d for s, d in seen if s == "stderr") == bytes(run.stderr) == b"done\n"
    await run.send(control_frames(stdin=b"late"))  # after the exit: dropped, not an error


async def test_exec_run_wait_returns_at_its_limit_and_kill_ends_the_tree(agent: Agent) -> None:
    arg = unique_sleep_arg()
    run = await agent.client.exec_run(["sh", "-c", f"sleep {arg} & sleep {arg}"], env=ENV)
    try:
        t = time.monotonic()
        await run.wait(time.monotonic() + 0.2)
        assert run.exit is None and time.monotonic() - t >= 0.19
        await run.kill(signal.SIGKILL)
        await finish(run, time.monotonic() + 30)
    finally:
        run.close()
    assert run.exit is not None and run.exit.signal == signal.SIGKILL
    assert await wait_for(lambda: not procs_with_arg(arg))


async def test_exec_run_reports_a_killed_handler_and_closes_the_command(agent: Agent) -> None:
    arg = unique_sleep_arg()
    run = await agent.client.exec_run(["sleep", arg], env=ENV)
    try:
        assert run.handler_pid is not None
        os.kill(run.handler_pid, signal.SIGKILL)
        await finish(run, time.monotonic() + 30)
        assert run.exit is None and isinstance(run.error, ConnectionError)
    finally:
        run.close()
    for pid in procs_with_arg(arg):  # the command outlives its killed handler (its own session)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_exec_run_errors_before_the_start(agent: Agent, workdir: str) -> None:
    with pytest.raises(ConnectionError, match="missing.sock"):
        await AgentClient(os.path.join(workdir, "missing.sock")).exec_run(["true"], env=ENV)
    from shoal.guest.client import ExecRun

    malformed = struct.pack(">IB", 4, ord("E")) + b"\0\0\0"  # an exec request cut short: the agent's 'Z'
    with pytest.raises(AgentError, match="malformed") as refused:
        await ExecRun.start(agent.sock_path, malformed, stream=False)
    assert refused.value.errno == errno.EINVAL
    # not waiting for the start (the node's exec without stdin): the refusal comes as the run's error, unstarted
    run = await ExecRun.start(agent.sock_path, malformed, stream=False, on_start=lambda r: 1 / 0, wait_start=False)
    try:
        await finish(run, time.monotonic() + 30)
    finally:
        run.close()
    assert isinstance(run.error, AgentError) and run.error.errno == errno.EINVAL
    assert not run.started and run.exec_id is None and run.exit is None


async def test_exec_run_names_the_exec_at_its_start_without_waking_the_waiter(agent: Agent) -> None:
    """Without wait_start, exec_run returns before the pid; on_start runs (from the loop's callback) when the
    pid comes, and a waiter is not woken by it: only by the exit (or its limit)."""
    arg = unique_sleep_arg()
    named: list[int] = []
    run = await agent.client.exec_run(
        ["sleep", arg], env=ENV, on_start=lambda r: named.append(r.handler_pid) or 7, wait_start=False
    )
    try:
        assert not run.started and run.pid == 0
        t = time.monotonic()
        await run.wait(t + 1.0)  # not woken by the start: returns at its limit
        assert time.monotonic() - t >= 0.99 and run.exit is None and run.error is None
        deadline = time.monotonic() + 30
        while not run.started and time.monotonic() < deadline:
            await run.wait(time.monotonic() + 0.1)
        assert run.pid > 0 and named == [run.handler_pid] and run.exec_id == 7
        await run.kill(signal.SIGKILL)
        await finish(run, time.monotonic() + 30)
    finally:
        run.close()
    assert run.exit is not None and run.exit.signal == signal.SIGKILL


async def exec_done(client: AgentClient, argv: list[str], stdin: bytes | None = None) -> object:
    """An exec as the node runs it: waiting for its start only when it has stdin to feed."""
    run = await client.exec_run(argv, env=ENV, stdin_pipe=stdin is not None, wait_start=stdin is not None)
    try:
        if stdin is not None:
            await run.send(control_frames(stdin=stdin, eof=True))
        await finish(run, time.monotonic() + 30)
    finally:
        run.close()
    return run


async def runs_once_on_a_new_handler(client: AgentClient, dead_handler: int) -> None:
    """An exec after its kept handler died runs exactly once (a redial does not start it twice), elsewhere."""
    counter = os.path.join(tempfile.mkdtemp(prefix="shoal-agent-count-"), "n")
    try:
        ran = await exec_done(client, ["sh", "-c", f"echo x >> {counter}"])
        assert ran.exit.exit_code == 0 and ran.handler_pid != dead_handler  # type: ignore[attr-defined]
        with open(counter) as f:
            assert f.read() == "x\n"
    finally:
        shutil.rmtree(os.path.dirname(counter), ignore_errors=True)


def handlers(agent_pid: int) -> set[int]:
    """The agent's handler processes (its children other than the reserve)."""
    out = subprocess.run(["ps", "--ppid", str(agent_pid), "-o", "pid=,comm="], capture_output=True, text=True)
    return {int(line.split()[0]) for line in out.stdout.splitlines() if "reserve" not in line}


@pytest.mark.parametrize("agent", [None, 1], ids=["pid-sent", "pid-held"], indirect=True)
async def test_exec_run_keeps_its_connection_while_execs_leave_nothing(agent: Agent) -> None:
    """Successive execs reuse one connection and its handler (one fork per exec: the command's); an exec that
    leaves a process running ends that (its handler stays as the keeper, naming the exec) and the next one
    gets a new handler; stdin frames sent after an exit do not reach the next exec."""
    client = agent.client
    first = await exec_done(client, ["true"])
    again = [await exec_done(client, ["sh", "-c", "echo $$"]) for _ in range(3)]
    assert {r.handler_pid for r in again} == {first.handler_pid}  # type: ignore[attr-defined]
    assert [bytes(r.stdout) for r in again] == [b"%d\n" % r.pid for r in again]  # type: ignore[attr-defined]
    fed = await exec_done(client, ["cat"], stdin=b"abc")
    assert bytes(fed.stdout) == b"abc" and fed.handler_pid == first.handler_pid  # type: ignore[attr-defined]
    arg = unique_sleep_arg()
    left = await exec_done(client, ["sh", "-c", f"sleep {arg} >/dev/null 2>&1 &"])
    assert left.handler_pid == first.handler_pid  # type: ignore[attr-defined]
    assert await wait_for(lambda: procs_with_arg(arg), timeout=30)  # the shell's child may not have exec'd yet
    after = await exec_done(client, ["true"])
    assert after.handler_pid != left.handler_pid  # type: ignore[attr-defined]
    assert {p.exec_id for p in await client.processes() if p.command == f"sleep {arg}"} == {left.handler_pid}  # type: ignore[attr-defined]
    assert await client.kill_processes(left.handler_pid) == (1, 0)  # type: ignore[attr-defined]
    assert await wait_for(lambda: left.handler_pid not in handlers(agent.proc.pid), timeout=30)  # type: ignore[attr-defined]
    # the kept one waits for the next exec (the one-request handlers of the list and the kill are gone soon)
    assert await wait_for(lambda: handlers(agent.proc.pid) == {after.handler_pid}, timeout=30)  # type: ignore[attr-defined]
    client.close()  # the node's destroy: kept connections closed, their handlers gone
    assert await wait_for(lambda: not handlers(agent.proc.pid), timeout=30)
    assert bytes((await exec_done(client, ["echo", "still"])).stdout) == b"still\n"  # type: ignore[attr-defined]
    assert await wait_for(lambda: not handlers(agent.proc.pid), timeout=30)  # a closed client keeps no more


@pytest.mark.parametrize("agent", [None, 1], ids=["pid-sent", "pid-held"], indirect=True)
async def test_exec_run_redials_a_kept_connection_whose_handler_died(agent: Agent) -> None:
    """A kept connection's handler killed while idle (`kill -9 -1` in a sandbox) is detected and the exec goes
    on a new connection, started exactly once; a cancelled exec on a kept connection kills its tree."""
    client = agent.client
    idle = await exec_done(client, ["true"])
    os.kill(idle.handler_pid, signal.SIGKILL)  # type: ignore[attr-defined]
    assert await wait_for(lambda: idle.handler_pid not in handlers(agent.proc.pid), timeout=30)  # type: ignore[attr-defined]
    await runs_once_on_a_new_handler(client, idle.handler_pid)  # type: ignore[attr-defined]
    arg = unique_sleep_arg()
    task = asyncio.ensure_future(exec_done(client, ["sh", "-c", f"sleep {arg} & sleep {arg}"]))
    assert await wait_for(lambda: len(procs_with_arg(arg)) == 2, timeout=30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await wait_for(lambda: not procs_with_arg(arg), timeout=30)
    assert await wait_for(lambda: not handlers(agent.proc.pid), timeout=30)


@pytest.mark.parametrize("agent", [None, 1], ids=["pid-sent", "pid-held"], indirect=True)
async def test_an_idle_kept_connection_is_watched_by_the_loop(agent: Agent) -> None:
    """A kept connection stays in the loop's selector while idle (no epoll_ctl and no probe per exec): a
    handler that dies then is noticed by the loop and its connection closed with no exec asked; one that dies
    just before an exec, before the loop could notice, costs that exec a redial, and it runs exactly once."""
    client = agent.client
    idle = await exec_done(client, ["true"])
    assert len(client._kept) == 1
    os.kill(idle.handler_pid, signal.SIGKILL)  # type: ignore[attr-defined]
    assert await wait_for(lambda: not client._kept, timeout=30)  # closed by the watch, nothing asked
    again = await exec_done(client, ["true"])
    assert again.handler_pid != idle.handler_pid  # type: ignore[attr-defined]
    os.kill(again.handler_pid, signal.SIGKILL)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while again.handler_pid in handlers(agent.proc.pid) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)  # blocking: the loop does not run, so the dead connection is still kept
    assert len(client._kept) == 1
    await runs_once_on_a_new_handler(client, again.handler_pid)  # type: ignore[attr-defined]
    client.close()
    assert not client._kept


# --------------------------------------------------------------------------- a held pid frame (EXEC_HOLD_PID)


@pytest.mark.parametrize("agent", [60000], indirect=True)
def test_a_held_pid_frame_goes_out_with_the_exit_frame(agent: Agent) -> None:
    """A command that ends within the hold: its pid frame and its exit frame reach the node in one read (one
    wake-up of the node per exec, not two). Held 60 s here, so this does not depend on the machine's speed."""
    payload = _exec_payload(["true"], ENV, "/", os.getuid(), os.getgid(), 1 << 20, False, False, EXEC_HOLD_PID)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    with sock:
        sock.connect(agent.sock_path)
        sock.sendall(_frame(b"E", payload))
        data = sock.recv(4096)  # one send of 9 + 30 bytes: one read on a unix socket
        assert len(data) == 13 + 30, data
        pid, handler = struct.unpack_from(">II", data, 5)
        assert data[:5] == struct.pack(">IB", 9, ord("P")) and pid > 0 and handler not in (0, pid)
        assert data[13:18] == struct.pack(">IB", 26, ord("X")) and struct.unpack_from(">II", data, 18) == (0, 0)


@pytest.mark.parametrize("agent", [60000], indirect=True)
async def test_a_held_pid_frame_never_holds_back_output(agent: Agent) -> None:
    """The first output goes out at once, the pid frame with it (held 60 s here: both come long before), and an
    exec that waits for its start (it has stdin to feed) is not held at all."""
    arg = unique_sleep_arg()
    run = await agent.client.exec_run(["sh", "-c", f"echo a; exec sleep {arg}"], env=ENV, stream=True, wait_start=False)
    try:
        t = time.monotonic()
        while not run.chunks and run.exit is None and time.monotonic() - t < 30:
            await run.wait(t + 30)
        assert run.chunks == [("stdout", b"a\n")] and time.monotonic() - t < 30
        assert run.started  # the pid came with the output: the shell's, which execs `sleep` after the echo
        assert await wait_for(lambda: run.pid in procs_with_arg(arg), timeout=30)
    finally:
        run.close()
    assert await wait_for(lambda: not procs_with_arg(arg), timeout=30)  # closed: the agent kills the tree

    t = time.monotonic()
    fed = await exec_done(agent.client, ["cat"], stdin=b"abc")  # waits for the start: not held
    assert bytes(fed.stdout) == b"abc" and time.monotonic() - t < 30  # type: ignore[attr-defined]


@pytest.mark.parametrize("agent", [3000], indirect=True)
async def test_a_silent_commands_held_pid_goes_out_when_the_hold_ends(agent: Agent) -> None:
    """A command that stays silent gets its pid sent when the hold ends (3 s here), not at its exit."""
    arg = unique_sleep_arg()
    started: list[float] = []
    run = await agent.client.exec_run(
        ["sleep", arg], env=ENV, on_start=lambda r: started.append(time.monotonic()), wait_start=False
    )
    try:
        t = time.monotonic()
        while not started and time.monotonic() - t < 30:
            await run.wait(time.monotonic() + 0.1)
        assert run.exit is None and run.error is None and len(started) == 1
        assert started[0] - t >= 2.0 and run.pid in procs_with_arg(arg)  # t: after the request left, so a loaded
        # machine can put it late in the hold; sent at once would be ~0, at the exit never (sleep runs on)
    finally:
        run.close()
    assert await wait_for(lambda: not procs_with_arg(arg), timeout=30)


@pytest.mark.parametrize("agent", [60000], indirect=True)
async def test_a_command_that_kills_its_handler_before_its_held_pid_runs_once(agent: Agent) -> None:
    """Its pid held, a command can run and kill its handler before the node knows it started: the exec is
    reported as a broken connection of a started command (the node's "killed from inside"), never sent again
    on a new connection as a kept connection's exec whose handler died before it started is."""
    client = agent.client
    await exec_done(client, ["true"])  # a kept connection
    assert len(client._kept) == 1
    counter = os.path.join(tempfile.mkdtemp(prefix="shoal-agent-count-"), "n")
    try:
        run = await exec_done(client, ["sh", "-c", f"echo x >> {counter}; kill -9 $PPID; sleep 1"])
        assert run.started and run.pid == 0 and run.exit is None  # type: ignore[attr-defined]
        assert isinstance(run.error, ConnectionError)  # type: ignore[attr-defined]
        with open(counter) as f:
            assert f.read() == "x\n"
    finally:
        shutil.rmtree(os.path.dirname(counter), ignore_errors=True)


@pytest.mark.parametrize("agent", [60000], indirect=True)
async def test_a_kept_handler_killed_with_the_request_unread_has_it_sent_again(agent: Agent) -> None:
    """A reset (the handler's end closed with our request unread) proves the command did not start, pid held
    or not: the exec goes on a new connection and runs once."""
    client = agent.client
    idle = await exec_done(client, ["true"])
    handler = idle.handler_pid  # type: ignore[attr-defined]
    os.kill(handler, signal.SIGSTOP)  # it cannot read what comes
    counter = os.path.join(tempfile.mkdtemp(prefix="shoal-agent-count-"), "n")
    try:
        run = await client.exec_run(["sh", "-c", f"echo x >> {counter}"], env=ENV, wait_start=False)
        try:
            os.kill(handler, signal.SIGKILL)
            await finish(run, time.monotonic() + 30)
        finally:
            run.close()
        assert run.exit is not None and run.exit.exit_code == 0 and run.handler_pid != handler
        with open(counter) as f:
            assert f.read() == "x\n"
    finally:
        shutil.rmtree(os.path.dirname(counter), ignore_errors=True)
