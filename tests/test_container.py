"""The container substrate end to end: real crun containers through a real node."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

import shoal
from shoal.protocol import cut_marker


def test_exec_basics(sb: shoal.Sandbox) -> None:
    r = sb.exec("echo hi && echo oops >&2 && exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "oops\n")
    assert not r.timed_out and not r.truncated and r.duration_s > 0
    argv = sb.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
    assert argv.stdout == "['a b', 'c']\n"
    assert sb.exec("cat", stdin="piped").stdout == "piped"
    assert sb.exec("echo $A-$B", env={"A": "1", "B": "2"}).stdout == "1-2\n"
    assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    missing = sb.exec(["/no/such/binary"])
    assert missing.exit_code == 127 and "No such file" in missing.stderr


def test_stdin_to_a_command_that_exits_at_once(tiny: shoal.Sandbox) -> None:
    # The node writes stdin after the command may already have exited; that must never cost the exit frame
    # (it did ~1 in 5: the write hit a closed socket and the result said the handler was killed).
    for data in [b"", b"x" * 100] * 25:
        r = tiny.exec(["true"], stdin=data)
        assert (r.exit_code, r.stderr) == (0, ""), r


def test_create_options_are_honoured(client: shoal.Client) -> None:
    with client.create(
        "container", image="debian", env={"A": "1"}, workdir="/work/proj", labels={"run": "opts"}, pool=False
    ) as sb:
        assert sb.exec("echo $A; pwd").stdout == "1\n/work/proj\n"
        assert [i.id for i in client.list(labels={"run": "opts"})] == [sb.id]
        assert client.get(sb.id).info.labels == {"run": "opts"}


def test_host_files_not_readable_or_writable(sb: shoal.Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    r = sb.exec(f"cat {secret}; ls /var/lib/shoal; cat /etc/hostname")
    assert "host secret" not in r.stdout
    assert sb.exec("echo pwned > /etc/passwd && echo written").stdout == "written\n"
    assert "pwned" not in Path("/etc/passwd").read_text()
    assert sb.exec(f"echo x > {tmp_path}/escape.txt").exit_code != 0 or not (tmp_path / "escape.txt").exists()


def test_other_sandboxes_invisible(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False) as a, client.create(image="busybox", pool=False) as b:
        a.exec("sleep 123.5 >/dev/null 2>&1 &")
        assert "123.5" in a.exec("ps").stdout
        assert "123.5" not in b.exec("ps").stdout
        # b's own: its agent, the agent's reserve, this exec's handler, sh, ls, grep
        assert b.exec("ls /proc | grep -c '^[0-9]'").stdout.strip() in {"1", "2", "3", "4", "5", "6"}


def test_no_network_to_host_loopback(sb: shoal.Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    server.settimeout(5)
    accepted: list = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:  # closed or timed out: nobody connected, as it should be
            pass

    threading.Thread(target=accept, daemon=True).start()
    probe = (
        "import socket\ns=socket.socket(); s.settimeout(2)\n"
        f"try:\n  s.connect(('127.0.0.1', {port})); print('connected')\n"
        "except OSError as e: print('refused', e)\n"
        "try:\n  socket.create_connection(('8.8.8.8', 53), timeout=2); print('internet')\n"
        "except OSError as e: print('no route', e)\n"
    )
    out = sb.exec(["python3", "-c", probe]).stdout
    server.close()
    assert "refused" in out and "no route" in out and not accepted
    assert sb.exec("cat /sys/class/net/*/operstate | sort | tr '\\n' ' '").stdout.split() == ["unknown"]


def test_memory_limit_reports_oom(client: shoal.Client) -> None:
    with client.create(image="debian", memory_mb=64, pool=False) as sb:
        r = sb.exec(["python3", "-c", "x = bytearray(300 << 20); print('survived')"])
        assert r.exit_code == 137 and r.oom_killed and "survived" not in r.stdout
        assert sb.exec("echo still here").stdout == "still here\n"
        assert sb.exec("true").oom_killed is False  # the kept counter: the earlier kill is not this exec's


def test_the_oom_counter_the_node_keeps_open_is_closed_with_its_sandbox(client: shoal.Client) -> None:
    """The node reads a sandbox's OOM-kill counter through an fd it keeps (two reads per exec); its close
    closes it (an fd left open would keep the removed cgroup's file alive in the node)."""

    def counters(pid: int, sandbox_id: str) -> list[str]:
        found = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if sandbox_id in target and target.endswith(("memory.events", "memory.oom_control")):
                    found.append(target)
        return found

    pid = client.status()["pid"]
    with client.create(image="busybox", memory_mb=64, pool=False, ttl_s=300) as sb:
        assert sb.exec("true").exit_code == 0
        assert len(counters(pid, sb.id)) == 1
    assert counters(pid, sb.id) == []


def test_pids_limit(client: shoal.Client, node) -> None:  # noqa: ANN001
    from shoal import cgroups

    with client.create(image="busybox", pids=16, pool=False) as sb:
        r = sb.exec("for i in $(seq 40); do sleep 2 & done 2>&1; echo done", timeout=20)
        assert "can't fork" in r.stdout + r.stderr or "Resource temporarily unavailable" in r.stdout + r.stderr
        assert len(cgroups.procs(f"/{node.cgroup_parent}/{sb.id}")) <= 16
        time.sleep(2.5)
        assert sb.exec("echo recovered").stdout == "recovered\n"


def test_cpu_weights_of_the_sandboxes_and_of_each(client: shoal.Client, node) -> None:  # noqa: ANN001
    """Sandboxes together weigh like one busy host process per CPU (not like one process for them all), and
    each weighs 1024 per core it asked for, so `cpu=2` gets twice a default sandbox's time under contention."""
    import os

    from shoal import cgroups

    def weight(path: str) -> int:
        rel = path.strip("/")
        if cgroups.layout() == "v2":
            return int((cgroups.ROOT / rel / "cpu.weight").read_text())
        return int((cgroups.ROOT / "cpu" / rel / "cpu.shares").read_text())

    per_process = 100 if cgroups.layout() == "v2" else 1024
    assert weight(node.cgroup_parent) == per_process * (os.cpu_count() or 1)
    with client.create(image="busybox", pool=False) as plain, client.create(image="busybox", cpu=2, pool=False) as big:
        first, second = weight(f"{node.cgroup_parent}/{plain.id}"), weight(f"{node.cgroup_parent}/{big.id}")
        if cgroups.layout() == "v2":  # the runtime converts shares to a weight (1024 -> 39, 2048 -> 79)
            assert second > 1.9 * first
        else:
            assert (first, second) == (1024, 2048)
        with client.create(image="busybox", cpu=0.5, pool=False) as small:
            assert weight(f"{node.cgroup_parent}/{small.id}") < first


def test_cpu_quota(client: shoal.Client) -> None:
    with client.create(image="debian", cpu=0.25, pool=False) as sb:
        r = sb.exec(
            ["python3", "-c", "import time,os\nt=time.time()\nwhile time.time()-t<1.5: pass\nprint(os.times().user)"]
        )
        assert float(r.stdout) < 0.6, f"used {r.stdout} s of CPU in 1.5 s under a 0.25-core quota"


def test_output_cap(client: shoal.Client) -> None:
    with client.create(image="busybox", pool=False) as sb:
        r = sb.exec("yes | head -c 5000000; echo tail >&2")
        marker = cut_marker(5000000 - (1 << 20))
        assert len(r.stdout_bytes) == (1 << 20) + len(marker) and r.truncated and r.stderr == "tail\n"
        assert r.stdout_omitted == 5000000 - (1 << 20) and r.stderr_omitted == 0
        small = sb.exec("yes | head -c 5000", output_cap_bytes=100)
        assert small.stdout_bytes == b"y\n" * 25 + cut_marker(4900) + b"y\n" * 25 and small.truncated
        flood = sb.exec("yes", timeout=1)
        assert flood.timed_out and flood.stdout_omitted > 0
        assert len(flood.stdout_bytes) == (1 << 20) + len(cut_marker(flood.stdout_omitted))


def test_output_cap_keeps_the_end(client: shoal.Client, tiny: shoal.Sandbox) -> None:
    """A long test run's last line (its summary: the reward) survives the cap; the cut is marked."""
    script = "i=0; while [ $i -lt 3000 ]; do echo line $i; i=$((i+1)); done; echo '== 7 passed, 1 failed =='"
    for r in (
        tiny.exec(script, output_cap_bytes=4096),
        tiny.exec(f"{{ {script}; }} >&2", output_cap_bytes=4096),
        tiny.exec(script, output_cap_bytes=4096, merge_stderr=True),
    ):
        out = r.stdout_bytes or r.stderr_bytes
        omitted = r.stdout_omitted or r.stderr_omitted
        assert r.truncated and omitted > 0 and out.startswith(b"line 0\nline 1\n")
        assert out.endswith(b"== 7 passed, 1 failed ==\n")
        assert out.count(cut_marker(omitted)) == 1 and len(out) == 4096 + len(cut_marker(omitted))
    streamed = b"".join(c.data for c in tiny.exec_stream(script, output_cap_bytes=4096))
    assert streamed.endswith(b"== 7 passed, 1 failed ==\n") and b"bytes omitted by the output cap" in streamed
    with client.create(image="busybox", output_cap_bytes=4096, pool=False) as small, small.shell() as sh:
        capped = sh.run(script)  # shells keep head and tail too (their cap is the sandbox's)
        assert capped.truncated and capped.stdout_omitted > 0 and capped.stdout.startswith("line 0\n")
        assert (
            capped.stdout.endswith("== 7 passed, 1 failed ==\n")
            and cut_marker(capped.stdout_omitted).decode() in capped.stdout
        )
    whole = tiny.exec("echo short", output_cap_bytes=4096)  # under the cap: untouched
    assert whole.stdout == "short\n" and not whole.truncated and whole.stdout_omitted == 0


def test_timeout_kills_tree_and_keeps_output(tiny: shoal.Sandbox) -> None:
    start = time.monotonic()
    r = tiny.exec("echo before; (setsid sleep 301 &); sleep 302", timeout=1)
    assert r.timed_out and r.stdout == "before\n" and time.monotonic() - start < 30  # not the 302 s sleep
    assert "sleep 30" not in tiny.exec("ps").stdout


def test_idle_timeout(tiny: shoal.Sandbox) -> None:
    r = tiny.exec("for i in 1 2 3; do echo $i; sleep 0.1; done; sleep 300", timeout=30, idle_timeout=1)
    assert r.timed_out and r.stdout == "1\n2\n3\n" and r.duration_s < 25  # idle 1 s, not the 30 s timeout


def test_exec_deadlines_of_one_sandbox_share_a_timer(tiny: shoal.Sandbox) -> None:
    """A sandbox's execs share one deadline timer (guest/client._Deadlines), left armed when an exec ends: a
    deadline earlier than the armed one arms it again, and one later than it is kept when the timer fires for
    an exec that already ended."""
    assert not tiny.exec("true", timeout=120).timed_out  # the timer stays armed 120 s ahead
    earlier = tiny.exec("sleep 100", timeout=1)
    assert earlier.timed_out and earlier.duration_s < 60  # its own 1 s, not the 120 s armed before it
    assert not tiny.exec("true", timeout=1).timed_out  # armed 1 s ahead again
    later = tiny.exec("sleep 100", timeout=4)  # the timer fires for the exec above first
    assert later.timed_out and 3.9 <= later.duration_s < 60


def test_background_job_survives_exec(tiny: shoal.Sandbox) -> None:
    start = time.monotonic()
    assert tiny.exec("sleep 303 & echo started").stdout == "started\n"
    assert time.monotonic() - start < 30  # not held by the 303 s job (a loaded host is slow)
    assert "sleep 303" in tiny.exec("ps").stdout


def test_streaming(tiny: shoal.Sandbox) -> None:
    stream = tiny.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2")
    seen = [(c.stream, c.data, time.monotonic()) for c in stream]
    assert b"".join(d for s, d, _ in seen if s == "stdout") == b"1\n2\n3\n"
    assert seen[-1][2] - seen[0][2] > 0.3, "chunks should arrive as printed, not all at the end"
    assert stream.result is not None and stream.result.exit_code == 0
    got: list[bytes] = []
    tiny.exec("echo cb", on_stdout=got.append)
    assert got == [b"cb\n"]


def test_stream_abandoned_or_interleaved_keeps_the_handle(client: shoal.Client, tiny: shoal.Sandbox) -> None:
    never = tiny.exec_stream("echo never > /never")
    del never  # made, never read: it must not block later steps
    assert tiny.exec("echo after").stdout == "after\n"
    later = tiny.exec_stream("echo streamed")
    assert tiny.exec("echo between").stdout == "between\n"  # another step before the stream is read
    assert b"".join(c.data for c in later) == b"streamed\n"
    assert later.result is not None and later.result.exit_code == 0
    partial = tiny.exec_stream("echo first; sleep 60; echo never")
    for chunk in partial:
        assert chunk.data == b"first\n"
        break  # stop reading midway: the command is cancelled, the handle stays usable
    assert tiny.exec("echo next").stdout == "next\n"
    assert not tiny.files.exists("/never")
    replayed = client.attach(tiny.id)  # the log holds the steps in the order they ran
    assert replayed.exec("echo after").stdout == "after\n" and replayed.fast_forwarded == 1


def test_persistent_shell(sb: shoal.Sandbox) -> None:
    with sb.shell() as sh:
        sh.run("cd /tmp && export GREETING=hello")
        r = sh.run("pwd; echo $GREETING")
        assert r.stdout == "/tmp\nhello\n" and r.exit_code == 0
        assert sh.run("false").exit_code == 1
        assert sh.run("printf no-newline").stdout == "no-newline"
        assert sh.run("echo 'quote'\"s\"; echo err >&2").stdout == "quotes\n"
        assert sh.run("cat").stdout == ""  # stdin is not the shell's command stream
        slow = sh.run("sleep 100", timeout=0.5)
        assert slow.timed_out
        with pytest.raises(shoal.InvalidRequestError):
            sh.run("true")


def test_files_round_trip(sb: shoal.Sandbox, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 4096
    sb.files.write("/work/data/blob.bin", blob)
    assert sb.files.read("/work/data/blob.bin") == blob
    sb.files.write("/work/a.txt", "text", mode=0o600)
    assert sb.exec("stat -c %a /work/a.txt").stdout == "600\n"
    names = {e.name: e for e in sb.files.list("/work")}
    assert names["a.txt"].kind == "file" and names["data"].kind == "dir"
    with pytest.raises(FileNotFoundError):
        sb.files.read("/work/missing")
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("print('hi')\n")
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "run.sh").chmod(0o755)
    assert sb.files.upload(str(src), "/work/src") == 2
    assert sb.exec("/work/src/run.sh && python3 /work/src/pkg/mod.py").stdout == "run\nhi\n"
    sb.exec("mkdir -p /work/out/sub && echo result > /work/out/sub/r.txt && ln -s sub/r.txt /work/out/link")
    out = tmp_path / "out"
    assert sb.files.download("/work/out", str(out)) == 1
    assert (out / "sub" / "r.txt").read_text() == "result\n" and (out / "link").is_symlink()
    sb.files.remove("/work/out", recursive=True)
    assert not sb.files.exists("/work/out")
    big = tmp_path / "big.bin"  # over two 8 MiB write pieces, with a short tail; and an empty file
    big.write_bytes(os.urandom(1 << 20) * 17 + b"tail")
    big.chmod(0o640)
    assert sb.files.write_from(str(big), "/work/big.bin") == big.stat().st_size
    assert sb.exec("sha256sum /work/big.bin; stat -c %a /work/big.bin").stdout.split()[::2] == [
        hashlib.sha256(big.read_bytes()).hexdigest(),
        "640",
    ]
    (tmp_path / "empty").write_bytes(b"")
    assert sb.files.write_from(str(tmp_path / "empty"), "/work/empty") == 0
    assert sb.files.read("/work/empty") == b""


def _tar(*members: tuple[str, str, bytes | str]) -> bytes:
    """A tar of (name, kind 'file'|'dir'|'link', data or link target) members, names taken as given."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                archive.addfile(info)
            else:
                payload = data.encode() if isinstance(data, str) else data
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def test_upload_sends_a_tree_as_one_tar_step(sb: shoal.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    for i in range(300):
        path = src / f"d{i % 7}" / f"sub{i % 3}" / f"f{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"file {i}\n")
    (src / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (src / "tool.sh").chmod(0o750)
    (src / "latest").symlink_to("d1/sub1/f1.txt")
    (src / ("long-" + "x" * 150)).mkdir()  # a name past ustar's 100 bytes
    (src / ("long-" + "x" * 150) / "inner.txt").write_text("deep\n")
    steps = len(sb.log())
    assert sb.files.upload(str(src), "/work/tree") == 302
    assert len(sb.log()) == steps + 1, "the whole tree must go in one request"
    assert sb.files.read_text("/work/tree/d3/sub0/f150.txt") == "file 150\n"
    assert sb.exec("/work/tree/tool.sh; stat -c %a /work/tree/tool.sh").stdout == "tool\n750\n"
    assert sb.exec("readlink /work/tree/latest; cat /work/tree/latest").stdout == "d1/sub1/f1.txt\nfile 1\n"
    assert sb.files.read_text(f"/work/tree/long-{'x' * 150}/inner.txt") == "deep\n"
    assert sb.exec("find /work/tree -type f | wc -l").stdout.strip() == "302"


def test_tar_upload_refuses_escapes_and_never_follows_links(client: shoal.Client) -> None:
    with client.create(image="debian", pool=False) as sb:
        for bad in ("/etc/evil", "../evil", "a/../../evil"):
            with pytest.raises(PermissionError, match="refused|absolute"):
                sb.files.write_tar("/work/dst", _tar((bad, "file", "x")))
        sb.exec("mkdir -p /work/dst && ln -s /etc /work/dst/etc && ln -s /etc/passwd /work/dst/passwd")
        before = sb.files.read("/etc/passwd")
        with pytest.raises(NotADirectoryError, match="links are not followed"):  # through a planted link
            sb.files.write_tar("/work/dst", _tar(("etc/passwd", "file", "pwned")))
        with pytest.raises(NotADirectoryError, match="links are not followed"):  # through a link of the tar
            sb.files.write_tar("/work/dst", _tar(("sneaky", "link", "/etc"), ("sneaky/shadow", "file", "pwned")))
        assert sb.files.write_tar("/work/dst", _tar(("passwd", "file", "mine"))) == 1  # replaces the link
        assert sb.files.read("/etc/passwd") == before and sb.files.read_text("/work/dst/passwd") == "mine"
        assert sb.exec("find / -xdev -name evil 2>/dev/null").stdout == ""
        with pytest.raises(shoal.ShoalError, match="not a tar stream"):
            sb.files.write_tar("/work/dst", b"x" * 1024)
    with client.create(image="debian", user="nobody", pool=False) as sb:  # written as the sandbox's user
        assert sb.files.write_tar("/tmp/up", _tar(("a/b.txt", "file", "b"))) == 1  # parents are made too
        assert sb.exec("stat -c %u /tmp/up/a/b.txt /tmp/up/a").stdout.split() == ["65534", "65534"]
        with pytest.raises(PermissionError):
            sb.files.write_tar("/root/up", _tar(("x", "file", "x")))


def test_create_many_concurrently(client: shoal.Client) -> None:
    many = client.create_many(20, "container", image="busybox", labels={"batch": "b1"}, pool=False)
    try:
        assert all(isinstance(s, shoal.Sandbox) for s in many), many
        assert len({s.id for s in many}) == 20  # type: ignore[union-attr]
        assert all(s.exec("echo ok").stdout == "ok\n" for s in many)  # type: ignore[union-attr]
    finally:
        assert client.close_all(labels={"batch": "b1"}) == 20


def test_warm_pool_claim_binds_late(client: shoal.Client) -> None:
    client.set_pool("container", "busybox", 2, wait=True, pids=512)
    before = client.status()["pool_hits"]
    with client.create(
        "container", image="busybox", pids=512, env={"LATE": "bound"}, labels={"p": "1"}, workdir="/work/w",
        files={"/work/w/in.txt": "input"}, ttl_s=60,
    ) as sb:  # fmt: skip
        assert client.status()["pool_hits"] == before + 1
        assert sb.exec("echo $LATE; pwd; cat in.txt").stdout == "bound\n/work/w\ninput"
        assert sb.info.labels == {"p": "1"} and sb.info.expires_at is not None
    client.set_pool("container", "busybox", 0, pids=512)


def test_ttl_expiry_closes_sandbox(client: shoal.Client) -> None:
    sb = client.create(image="busybox", ttl_s=0.5, pool=False)
    time.sleep(1.5)
    with pytest.raises(shoal.SandboxClosedError, match="ttl"):
        sb.exec("true")


def test_bad_input_errors(client: shoal.Client) -> None:
    with pytest.raises(shoal.ImageNotFoundError, match="no-such-image"):
        client.create(image="no-such-image")
    with pytest.raises(shoal.UnsupportedKindError, match="container"):
        client.create("microvm-x", image="busybox")
    with pytest.raises(shoal.InvalidRequestError, match="cores"):
        client.create(image="busybox", cpu=512)
    with pytest.raises(shoal.InvalidRequestError, match="memory_mb"):
        client.create(image="busybox", memory_mb=1)
    with pytest.raises(shoal.InvalidRequestError, match="runtime"):
        client.create(image="busybox", runtime="nope")
    with pytest.raises(TypeError, match="unexpected"):
        client.create(image="busybox", colour="blue")
    sb = client.create(image="busybox", pool=False)
    sb.close()
    sb.close()  # twice is fine
    with pytest.raises(shoal.SandboxClosedError):
        sb.exec("true")
    with pytest.raises(shoal.SandboxNotFoundError):
        client.get("local-000000000000")


def test_no_node_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(shoal.NodeError, match="shoal node"):
        shoal.Client(address=str(tmp_path / "none.sock"))


def test_sandbox_whose_agent_dies_is_lost(client: shoal.Client, node) -> None:  # noqa: ANN001
    import os
    import signal

    from shoal import cgroups

    sb = client.create(image="busybox", pool=False)
    for pid in cgroups.procs(f"/{node.cgroup_parent}/{sb.id}"):
        with contextlib.suppress(ProcessLookupError):  # gone with the agent, killed first (pid 1 of the sandbox)
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(shoal.SandboxLostError, match="agent"):
        sb.exec("true")
    with pytest.raises(shoal.SandboxClosedError, match="lost"):
        sb.exec("true")
    with pytest.raises(shoal.SandboxClosedError, match="lost"):
        client.get(sb.id)
