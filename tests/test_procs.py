"""Background processes and terminals (docs/PROCESSES.md): they outlive the client that started them, are
listed and reattached from another process, take stdin and signals, run full-screen programs on a PTY with
resize, and end with their sandbox. Every sandbox has a ttl_s and is closed in a `with`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import until

import shoal
from shoal.client import procs
from shoal.client.procs import AsyncProcess

START = """
import sys, shoal
with shoal.Client(home=sys.argv[1]) as client:
    sb = client.create(image="busybox", pool=False, ttl_s=600)
    proc = sb.exec("echo started; while read line; do echo \\"got $line\\"; done; echo bye", background=True)
    print(sb.id, proc.id, proc.pid, flush=True)
    sys.stdin.read()  # until killed
"""


def _host_pids_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


def test_a_background_process_outlives_its_client_and_is_reattached(node, client: shoal.Client) -> None:  # noqa: ANN001
    starter = subprocess.Popen(
        [sys.executable, "-c", START, str(node.home)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = starter.stdout.readline()  # type: ignore[union-attr]
        assert line, "the starting client printed nothing"
        sandbox_id, proc_id, pid = line.split()
        os.kill(starter.pid, signal.SIGKILL)  # the client dies without a goodbye
        starter.wait()
        sb = client.get(sandbox_id)
        try:
            listed = {p["id"]: p for p in sb.processes(background=True)}
            assert int(proc_id) in listed and listed[int(proc_id)]["running"], listed
            assert listed[int(proc_id)]["pid"] == int(pid) and "while read line" in listed[int(proc_id)]["command"]
            # its processes in the sandbox name it as the exec that started them
            assert int(proc_id) in {p["exec_id"] for p in sb.processes()}
            proc = sb.process(int(proc_id))
            assert proc.running and proc.pid == int(pid)
            assert until(lambda: proc.read()[0], what="its first output") == b"started\n"
            assert proc.stdout_offset == len(b"started\n")
            proc.send_stdin("hello\n")
            assert until(lambda: proc.read()[0], what="its answer") == b"got hello\n"
            again = sb.process(int(proc_id))  # another handle reads from 0: the sandbox keeps the output
            assert again.read() == (b"started\ngot hello\n", b"")
            proc.send_stdin(b"last\n", eof=True)
            result = proc.wait(timeout=60)
            assert (result.exit_code, result.stdout, result.timed_out) == (0, "got last\nbye\n", False)
            assert not proc.running and proc.exit_code == 0
            steps = [s["op"] for s in sb.log()]
            assert steps.count("proc_start") == 1 and steps.count("proc_input") == 2 and "proc_read" not in steps
        finally:
            sb.close()
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def test_stream_signal_and_the_end_of_the_sandbox(client: shoal.Client) -> None:
    marker = f"procs-{uuid.uuid4().hex[:12]}"
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        proc = sb.exec(f"i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.05; done # {marker}", background=True)
        seen = b""
        for chunk in proc.stream(timeout=60):
            seen += chunk.data
            if seen.count(b"tick") >= 3:
                break
        assert seen.startswith(b"tick 0\ntick 1\n")
        late = proc.read()[0]  # the stream stopped where this handle's offset now stands: nothing is lost
        assert (seen + late).startswith(b"tick 0\ntick 1\ntick 2\n")
        sleeper = sb.exec(f"sleep 600; : {marker}", background=True)
        until(lambda: len(_host_pids_with(marker)) >= 2, what="both (crun: the sandbox's are host processes)")
        proc.signal(signal.SIGTERM)
        result = proc.wait(timeout=60)
        assert result.signal == signal.SIGTERM and result.exit_code == 128 + signal.SIGTERM
        assert sleeper.refresh().running
    until(lambda: not _host_pids_with(marker), what="the sandbox's background processes to end with it")


def test_pty_runs_top_and_stty_sees_resizes(client: shoal.Client) -> None:
    with client.create(image="debian", pool=False, ttl_s=300) as sb:
        term = sb.pty(100, 30, cmd=["sh"])
        assert term.pty
        term.send_stdin("stty size; tty; echo $TERM\n")
        screen = until(lambda: _more(term, b"xterm-256color"), what="the shell on the terminal")
        assert b"30 100" in screen and b"/dev/pts/" in screen
        term.resize(132, 40)
        term.send_stdin("stty size\n")
        assert b"40 132" in until(lambda: _more(term, b"40 132"), what="the new size")
        # batch once, then full-screen for a few rounds (it ends by itself: no key races its terminal setup)
        term.send_stdin("top -b -n 1 | head -3; top -d 0.5 -n 6; echo top-$((6*7))-quit\n")
        until(lambda: _more(term, b"\x1b[", since=b"load average"), what="top drawing the screen")
        term.resize(90, 20)  # top redraws for the new size
        until(lambda: _more(term, b"top-42-quit\r\n"), what="top to end")  # not the echo of the typed line
        term.send_stdin("exit 3\n")
        assert term.wait(timeout=60).exit_code == 3


def test_pty_edits_a_file_with_vi(client: shoal.Client) -> None:
    """busybox's vi: a full-screen editor that reads keys one at a time from the terminal."""
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        term = sb.pty(80, 24, cmd=["vi", "/tmp/note.txt"])
        until(lambda: _more(term, b"/tmp/note.txt"), what="vi's status line")
        term.resize(120, 40)
        term.send_stdin("ihello from vi")
        until(lambda: _more(term, b"hello from vi"), what="the typed text on the screen")
        mark = len(_SCREENS[(sb.id, term.id)])
        term.send_stdin("\x1b")  # alone: vi takes keys right after ESC as part of an escape sequence
        until(lambda: b"\x1b[K- " in (_more(term, b"") or b"")[mark:], what="vi's command mode")
        term.send_stdin(":wq\r")
        assert term.wait(timeout=60).exit_code == 0
        assert sb.files.read("/tmp/note.txt") == b"hello from vi\n"


_SCREENS: dict[tuple[str, int], bytes] = {}


def _more(term: shoal.Process, needle: bytes, since: bytes | None = None) -> bytes | None:
    """Read what the terminal printed since the last call; the whole screen so far if `needle` is in it
    (after `since`, when given)."""
    key = (term.sandbox.id, term.id)  # IDs are pids in the sandbox: another sandbox may reuse one
    seen = _SCREENS.get(key, b"") + term.read()[0]
    _SCREENS[key] = seen
    where = seen.find(since) if since else 0
    return seen if where >= 0 and needle in seen[where:] else None


async def test_async_process_handle(aclient: shoal.AsyncClient) -> None:
    async with await aclient.create(image="busybox", pool=False, ttl_s=300) as sb:
        proc = await sb.exec(["sh", "-c", "read x; echo $x >&2; exit 5"], background=True, stdin=b"to stderr\n")
        assert isinstance(proc, AsyncProcess)
        result = await proc.wait(timeout=60)
        assert (result.exit_code, result.stderr) == (5, "to stderr\n")
        with pytest.raises(shoal.ProcessNotFoundError):
            await sb.process(424242)


async def test_a_process_started_and_followed_in_one_request(aclient: shoal.AsyncClient) -> None:
    """`proc_start` with stream (the E2B layer's commands.run): the process first, then its output as it is
    printed, then how it ended; past the timeout it keeps running, is listed and is read on by its ID."""
    async with await aclient.create(image="busybox", pool=False, ttl_s=300) as sb:
        items = [
            item
            async for item in procs.start_streaming(sb, {"sandbox_id": sb.id, "cmd": "echo out; echo err >&2; exit 3"})
        ]
        proc, chunks = items[0], items[1:]
        assert isinstance(proc, AsyncProcess) and proc.id > 0
        assert {(c.stream, c.data) for c in chunks} == {("stdout", b"out\n"), ("stderr", b"err\n")}
        assert (proc.running, proc.exit_code, proc.stdout_offset, proc.stderr_offset) == (False, 3, 4, 4)

        slow = procs.start_streaming(sb, {"sandbox_id": sb.id, "cmd": "echo first; sleep 300"}, timeout=1.0)
        items = [item async for item in slow]
        proc = items[0]
        assert proc.running
        assert proc.id in [p["id"] for p in await sb.processes(background=True) if p["running"]]
        await proc.kill()
        rest = await proc.wait(timeout=60)  # the output from where the stream stopped
        assert rest.signal == signal.SIGKILL
        assert b"".join(c.data for c in items[1:]) + rest.stdout_bytes == b"first\n"

        # idle: None while it is quiet (a relay's keepalive: the E2B layer's), then the output
        quiet = [c async for c in procs.start_streaming(sb, {"sandbox_id": sb.id, "cmd": "sleep 1; echo x"}, idle=0.2)]
        assert quiet[1] is None and [c.data for c in quiet[1:] if c is not None] == [b"x\n"]

        events = []  # the raw operation (last: the handle numbers its own steps, this one the node does)
        answer = await aclient.call("proc_start", {"sandbox_id": sb.id, "cmd": "echo a", "stream": True},
                                    on_event=events.append)  # fmt: skip
        assert events[0]["id"] == answer["id"] and events[0]["command"] == "echo a"
        assert (answer["running"], answer["exit_code"]) == (False, 0) and b"".join(e["data"] for e in events[1:])


@pytest.mark.parametrize("kind", ["runsc", "microvm"])
def test_background_and_pty_on_other_kinds(client: shoal.Client, kind: str) -> None:
    if kind == "runsc" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed on this host")
    if kind == "microvm" and "microvm" not in client.kinds():
        pytest.skip("kind microvm is not available on this node (QEMU missing)")
    options = {"runtime": "runsc"} if kind == "runsc" else {}
    with client.create("microvm" if kind == "microvm" else "container", image="busybox", pool=False, ttl_s=600,
                       **options) as sb:  # fmt: skip
        proc = sb.exec('while read line; do echo "got $line"; done', background=True)
        proc.send_stdin("one\n")
        assert until(lambda: proc.read()[0], what="the background answer") == b"got one\n"
        assert sb.process(proc.id).read()[0] == b"got one\n"
        term = sb.pty(100, 30, cmd=["sh"])
        term.send_stdin("stty size\n")
        until(lambda: _more(term, b"30 100"), what="the terminal's size")
        term.resize(132, 40)
        term.send_stdin("stty size\n")
        until(lambda: _more(term, b"40 132"), what="the new size")
        proc.kill()
        assert proc.wait(timeout=60).signal == signal.SIGKILL


def test_a_replay_maps_background_processes_to_its_own(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False, ttl_s=300) as sb:
        # the signal ends it whether it comes before or after the stdin is read (a process that had exited
        # already made the outcome a race between the two)
        proc = sb.exec("read x; echo $x > /tmp/x; exec sleep 30", background=True)
        proc.send_stdin("replayed\n")
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=60).signal == signal.SIGTERM
        report = client.replay(sb.id)  # (a step after these would race the replayed process: none here)
        assert report.steps == 3 and report.identical and not report.skipped, report
