"""The `function` kind end to end: warm workers in real containers, a fresh forked child per call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import IMAGES, NodeProcess, no_leftovers, runtime_unavailable, sandbox_roots

import shoal
from shoal import FunctionError
from shoal.protocol import HeadTail, cut_marker
from shoal.substrates.function import worker

DEV_IMAGE = IMAGES / "images" / "debian-dev.json"
needs_dev = pytest.mark.skipif(
    not DEV_IMAGE.exists(), reason="image debian-dev not built (make images); it takes minutes to build"
)


pytestmark = pytest.mark.usefixtures("function_workers_retired")


@pytest.fixture
def fn(client: shoal.Client):  # noqa: ANN201
    with client.create("function", image="debian") as sandbox:
        yield sandbox


# ---------------------------------------------------------------- the sandbox-shaped handle


def test_what_a_function_sandbox_cannot_do_says_so_and_names_the_alternative(client: shoal.Client) -> None:
    """Operations that need a long-lived process or a step log raise an InvalidRequestError (UnsupportedKindError
    for most) naming the kind and what to use instead, rather than 'no sandbox'; trajectory= is refused at
    create, not silently ignored."""
    with pytest.raises(
        shoal.InvalidRequestError, match="trajectory='t1': function sandboxes keep no step log.*container"
    ):
        client.create("function", image="debian", trajectory="t1")
    with client.create("function", image="debian") as sandbox:
        cannot = {
            "pause": sandbox.pause,
            "resume": sandbox.resume,
            "snapshot": lambda: sandbox.snapshot("fn-image"),
            "fork": lambda: sandbox.fork(2),
            "set_network": lambda: sandbox.set_network("pypi"),
            "attach": lambda: client.attach(sandbox.id),
            "log": lambda: client.log(sandbox.id),
        }
        for call in cannot.values():  # on failure, pytest's traceback shows which (its key in `cannot`)
            with pytest.raises(
                shoal.UnsupportedKindError, match=f"{sandbox.id} is a function sandbox.*kind='container'"
            ):
                call()
        with pytest.raises(shoal.InvalidRequestError, match="function sandboxes keep no state.*use a container"):
            sandbox.shell()
        assert sandbox.exec("echo still here").stdout == "still here\n"  # the refusals changed nothing
        sandbox.keepalive(60)


def test_exec_like_a_container(fn: shoal.Sandbox) -> None:
    r = fn.exec("echo hi && echo oops >&2 && exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "oops\n")
    assert fn.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b"]).stdout == "['a b']\n"
    assert fn.exec("cat", stdin="piped").stdout == "piped"
    assert fn.exec("echo $A", env={"A": "1"}).stdout == "1\n"
    assert fn.exec("pwd; id -un").stdout == "/work\nnobody\n"
    assert fn.exec(["/no/such/binary"]).exit_code == 127
    assert fn.info.kind == "function"
    assert fn.id in [i.id for i in fn._client.list()]


def test_calls_get_what_python3_and_exec_give_and_none_of_the_workers_start(fn: shoal.Sandbox) -> None:
    """A Python call keeps SIGPIPE and SIGXFSZ ignored, as python3 does (a broken pipe raises BrokenPipeError);
    a command the worker execs gets them at their defaults (ignoring survives exec); neither sees LD_BIND_NOW,
    which the node sets only for the worker's own start-up."""
    ignored = "import signal\n[signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGPIPE, signal.SIGXFSZ)]"
    assert fn.call(ignored) == [True, True]
    assert fn.call("import os, sys\nr, w = os.pipe()\nos.close(r)\ntry:\n    os.write(w, b'x')\nexcept "
                   "BrokenPipeError:\n    sys.exit(0)\nsys.exit(3)") is None  # fmt: skip
    mask = int(fn.exec("grep SigIgn /proc/self/status").stdout.split()[1], 16)
    assert mask & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)) == 0, hex(mask)
    assert fn.call("import os\n'LD_BIND_NOW' in os.environ") is False
    assert "LD_BIND_NOW" not in fn.exec("env").stdout


def test_a_calls_code_compiles_as_under_python3(fn: shoal.Sandbox) -> None:
    """Not with the worker module's own `from __future__ import annotations`: annotations are the objects."""
    assert fn.call("def f(x: int): pass\nf.__annotations__['x'] is int") is True
    assert fn.call("x: int = 1\nclass C:\n    y: int = 2\nC.__annotations__['y'] is int") is True
    assert fn.call("def f(x: int):\n    return f.__annotations__['x'] is int\n", 1, entry="f") is True


def test_nothing_persists_between_calls(fn: shoal.Sandbox) -> None:
    wrote = fn.exec("for d in /work /tmp /var/tmp /dev/shm; do echo x > $d/mark && echo ok; done; (sleep 300 &)")
    assert wrote.stdout == "ok\n" * 4
    after = fn.exec("ls -A /work /tmp /var/tmp /dev/shm; pgrep -c -x sleep || true")
    assert "mark" not in after.stdout
    assert after.stdout.strip().endswith("0"), after.stdout  # the background sleep was killed with its call
    cannot = fn.exec("touch /etc/x /root/x /usr/x /run/lock/x 2>&1; echo $?")
    assert "Permission denied" in cannot.stdout


def test_what_calls_write_is_in_memory_and_counts_as_memory(client: shoal.Client) -> None:
    """The directories calls may write are tmpfs mounts of the worker's container (creating and removing a
    file there is cheap, unlike the overlay's upper on the host's disk), so what a call writes counts against
    its memory limit: past it the call dies as a memory bomb would, and the next call finds nothing."""
    mounts = "[(l.split()[4], l.split(' - ')[1].split()[0]) for l in open('/proc/self/mountinfo')]"
    kinds = dict(client.call(mounts))
    assert [kinds.get(root) for root in worker.WRITABLE] == ["tmpfs"] * len(worker.WRITABLE), kinds
    fill = "f = open('/work/big', 'wb')\nfor _ in range(200): f.write(bytes(1 << 20))\nf.flush()"
    with pytest.raises(FunctionError) as filled:
        client.call(fill, memory_mb=64, timeout=60)
    assert filled.value.oom_killed and filled.value.type == "MemoryError", filled.value
    assert client.call("import os\n[os.listdir(d) for d in ('/work', '/tmp', '/var/tmp')]") == [[], [], []]


MAKE_ENTRIES = """
import os, socket
os.mkdir('/tmp/d'); open('/tmp/d/f', 'w').write('x')
os.symlink('/etc/passwd', '/var/tmp/link')
open('/dev/shm/a', 'w').write('a'); os.link('/dev/shm/a', '/dev/shm/hard'); os.unlink('/dev/shm/a')
open('/tmp/d/g', 'w').write('g'); os.rename('/tmp/d/g', '/tmp/moved')
os.mkfifo('/var/tmp/fifo')
socket.socket(socket.AF_UNIX).bind('/dev/shm/sock')
sorted(os.listdir('/tmp') + os.listdir('/var/tmp') + os.listdir('/dev/shm'))
"""


def test_every_kind_of_entry_a_call_makes_is_gone_for_the_next(client: shoal.Client) -> None:
    """The worker skips listing a tmpfs root whose size says it is empty (tmpfs counts each entry in its
    directory's size): whatever way an entry appears there (mkdir, symlink, hard link, rename, fifo, socket,
    a file in a directory made by the call), the next call finds every root empty."""
    made = client.call(MAKE_ENTRIES)
    assert made == sorted(["d", "moved", "link", "fifo", "hard", "sock"]), made
    for _ in range(3):  # and again: the roots' empty size is learnt after the first clean-up
        assert client.call("import os\n[os.listdir(d) for d in ('/work', '/tmp', '/var/tmp', '/dev/shm')]") == [
            [],
            [],
            [],
            [],
        ]
        assert client.call(MAKE_ENTRIES) == made


# a call changes what it may of /work, which the calls' user owns: mode (none at all, set-group-id), a user
# attribute, a default ACL (POSIX ACL xattr: version 2; user, group and other entries, rwx), its inode flags
# (chattr +d +A: FS_IOC_SETFLAGS, nodump and noatime), its times
WORK_FLAGS = """
import fcntl, os, struct
def flags(set_to=None):
    fd = os.open('/work', os.O_RDONLY | os.O_DIRECTORY)
    try:
        if set_to is not None:
            fcntl.ioctl(fd, 0x40086602, struct.pack('i', set_to))
        return struct.unpack('i', fcntl.ioctl(fd, 0x80086601, bytes(4)))[0]
    except OSError:  # a file system without them: the rest is still checked
        return None
    finally:
        os.close(fd)
"""
CHANGE_WORK = (
    WORK_FLAGS
    + """
acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, 7, 0xFFFFFFFF) for tag in (0x01, 0x04, 0x20))
for name, value in (('user.shoal', b'left'), ('system.posix_acl_default', acl)):
    try:
        os.setxattr('/work', name, value)
    except OSError:  # as above
        pass
now = flags(0x40 | 0x80)
os.utime('/work', (12345, 67890))
os.chmod('/work', 0o2000)
st = os.stat('/work')
[oct(st.st_mode & 0o7777), sorted(os.listxattr('/work')), st.st_mtime, now]
"""
)
WORK_AS_IS = WORK_FLAGS + (
    "st = os.stat('/work')\n"
    "[oct(st.st_mode & 0o7777), st.st_uid, os.getcwd(), os.listxattr('/work'), st.st_mtime == 67890, flags()]"
)


def test_what_a_call_sets_on_work_is_gone_for_the_next(client: shoal.Client) -> None:
    """/work belongs to the calls' user, so a call may chmod it, set its set-group-id bit, a default ACL (which
    what later calls create there would inherit), user attributes, inode flags or its times. None of it outlives
    the call: a chmod 0 of /work made every later call on that worker fail to start ('could not set up the
    call', exit 125)."""
    before = client.call(WORK_AS_IS)
    assert before[0] == "0o755" and before[2] == "/work" and before[3:5] == [[], False], before
    assert before[5] in (0, None), before
    for _ in range(3):
        mode, names, mtime, flags = client.call(CHANGE_WORK)
        assert (mode, mtime) == ("0o2000", 67890), (mode, mtime)  # the call did change them
        assert set(names) <= {"user.shoal", "system.posix_acl_default"}, names
        assert flags in (0x40 | 0x80, None), flags
        for _ in range(2):
            assert client.call(WORK_AS_IS) == before


def test_sysv_ipc_does_not_persist(client: shoal.Client) -> None:
    make = (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "shm = libc.shmget(0x5A5A, 4096, 0o1666)\nsem = libc.semget(0x5A5B, 1, 0o1666)\n"
        "msg = libc.msgget(0x5A5C, 0o1666)\n[shm >= 0, sem >= 0, msg >= 0]"
    )
    assert client.call(make) == [True, True, True]
    assert client.call("[len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'sem', 'msg')]") == [0, 0, 0]
    # more objects than one read of the kernel's table returns (a page of rows): every one is removed
    many = (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "[sum(libc.shmget(0, 4096, 0o1600) >= 0 for _ in range(100)),"
        " sum(libc.semget(0, 1, 0o1600) >= 0 for _ in range(100)),"
        " sum(libc.msgget(0, 0o1600) >= 0 for _ in range(100))]"
    )
    assert client.call(many) == [100, 100, 100]
    assert client.call("[len(open(f'/proc/sysvipc/{k}').readlines()) - 1 for k in ('shm', 'sem', 'msg')]") == [0, 0, 0]


def test_preimported_modules(client: shoal.Client) -> None:
    probe = "import sys\n'decimal' in sys.modules"
    assert client.call(probe) is False
    assert client.call(probe, preimport=["decimal"]) is True  # forked from a worker that imported it
    with pytest.raises(shoal.InvalidRequestError, match="module name"):
        client.call("1", preimport=["os; rm -rf /"])


def test_globals_do_not_persist(client: shoal.Client) -> None:
    def bump() -> int:
        import json

        json.shoal_counter = getattr(json, "shoal_counter", 0) + 1  # a module pre-imported by the worker
        return json.shoal_counter

    assert [client.call(bump) for _ in range(3)] == [1, 1, 1]


def test_staged_files_are_inputs(fn: shoal.Sandbox) -> None:
    fn.files.write("data.txt", "input")
    fn.files.write("/work/bin/run.sh", "#!/bin/sh\necho ran $(cat /work/data.txt)\n", mode=0o755)
    assert fn.exec("bin/run.sh").stdout == "ran input\n"
    assert fn.exec("cat data.txt; echo more >> data.txt; cat data.txt").stdout == "inputinputmore\n"
    assert fn.files.read_text("data.txt") == "input"  # what a call writes is discarded
    assert {e.name for e in fn.files.list("/work")} == {"data.txt", "bin"}
    assert fn.files.exists("/work/bin/run.sh") and not fn.files.exists("/work/nope")
    fn.files.remove("data.txt")
    assert fn.exec("ls /work").stdout == "bin\n"
    with pytest.raises(shoal.InvalidRequestError, match="/work"):
        fn.files.write("/etc/passwd", "x")


def test_uploaded_tree_is_staged(fn: shoal.Sandbox, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.txt").write_text("A\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\ncat pkg/a.txt\n")
    (tmp_path / "run.sh").chmod(0o755)
    assert fn.files.upload(str(tmp_path), "/work") == 2  # one tar request, staged file by file
    assert fn.exec("./run.sh").stdout == "A\n"


def test_create_options(client: shoal.Client) -> None:
    with client.create(
        "function", image="debian", env={"A": "1"}, workdir="/work/p", files={"/work/p/f": "F\n"}, labels={"t": "fo"}
    ) as sb:
        assert sb.exec("echo $A; pwd; cat f").stdout == "1\n/work/p\nF\n"
        assert [i.id for i in client.list(labels={"t": "fo"})] == [sb.id]
        assert sb.call("open('f').read()") == "F\n"
    with pytest.raises(shoal.SandboxClosedError):
        sb.exec("true")


def test_bad_options_name_the_remedy(client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequestError, match="nobody"):
        client.create("function", user="root")
    with pytest.raises(shoal.InvalidRequestError, match="workdir"):
        client.create("function", workdir="/srv")
    with pytest.raises(shoal.ImageError, match="python3"):
        client.call("1", image="busybox")
    with client.create("function") as sb, pytest.raises(shoal.InvalidRequestError, match="container"):
        sb.shell()


# ---------------------------------------------------------------- call and map


def test_call_functions_and_source(client: shoal.Client) -> None:
    base = 10

    def add(a: int, b: int = 0) -> dict:
        return {"sum": a + b + base}

    assert client.call(add, 1, kwargs={"b": 2}) == {"sum": 13}
    assert client.call("def f(x):\n    return [x, x]\n", "y", entry="f") == ["y", "y"]
    assert client.call("import math\nmath.factorial(5)") == 120
    assert client.call("x = 1") is None


def test_call_errors_are_per_call(client: shoal.Client) -> None:
    with pytest.raises(FunctionError) as info:
        client.call("print('before'); 1/0")
    assert info.value.type == "ZeroDivisionError" and "before" in info.value.stdout
    assert "ZeroDivisionError" in info.value.remote_traceback
    with pytest.raises(FunctionError, match="SyntaxError"):
        client.call("def (:")
    with pytest.raises(FunctionError, match="not JSON"):
        client.call("object()")
    with pytest.raises(FunctionError, match="SystemExit"):
        client.call("import sys; sys.exit(3)")
    with pytest.raises(FunctionError) as crash:
        client.call("import ctypes; ctypes.string_at(0)")
    assert crash.value.type == "WorkerCrashed" and "signal 11" in crash.value.message
    assert client.call("'still fine'") == "still fine"


def test_timeouts_and_limits(client: shoal.Client) -> None:
    started = time.monotonic()
    with pytest.raises(FunctionError) as loop:
        client.call("while True: pass", timeout=1)
    assert loop.value.timed_out and loop.value.type == "TimeoutError"
    assert time.monotonic() - started < 30  # the 1 s timeout ended an endless loop (a loaded host is slow)
    with pytest.raises(FunctionError) as bomb:
        client.call("x = []\nwhile True: x.append(bytearray(1 << 20))", memory_mb=64, timeout=20)
    assert bomb.value.oom_killed and bomb.value.type == "MemoryError", bomb.value
    fork = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    with pytest.raises(FunctionError) as forks:
        client.call(fork, pids=32, timeout=2)
    assert forks.value.timed_out
    with client.create("function", output_cap_bytes=1 << 16) as sb:
        r = sb.exec("yes | head -c 5000000; echo '== 3 passed =='")
        assert r.truncated and r.stdout_omitted == 5000000 + 15 - (1 << 16)
        assert len(r.stdout_bytes) == (1 << 16) + len(cut_marker(r.stdout_omitted))
        assert r.stdout.endswith("y\n== 3 passed ==\n")  # the end survives the cap, as in containers
        assert sb.exec("nproc; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || true").exit_code == 0
    assert client.call("sum(range(10))") == 45  # the pool recovered


def test_bad_call_does_not_disturb_others(client: shoal.Client) -> None:
    results: dict[str, object] = {}

    def bomb() -> None:
        try:
            client.call("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", pids=16, timeout=3)
        except FunctionError as exc:
            results["bomb"] = exc.type

    thread = threading.Thread(target=bomb)
    thread.start()
    time.sleep(0.3)
    results["good"] = [client.call("2 * 21") for _ in range(20)]
    thread.join()
    assert results == {"bomb": "TimeoutError", "good": [42] * 20}


BOMB = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"


def _call_processes(node: NodeProcess) -> list[str]:
    """Processes in the per-call cgroups of this node's function workers (v1 hierarchies or v2)."""
    root = Path("/sys/fs/cgroup")
    found = []
    for procs in [*root.glob(f"{node.cgroup_parent}/*/call/cgroup.procs"),
                  *root.glob(f"*/{node.cgroup_parent}/*/call/cgroup.procs")]:  # fmt: skip
        try:
            found += procs.read_text().split()
        except FileNotFoundError:  # its worker's sandbox was closed since the glob: an empty cgroup is removable
            pass
    return found


@pytest.mark.parametrize("runtime", ["crun", "runc", "shoal"])
def test_fork_bomb_dies_with_its_call(client: shoal.Client, node: NodeProcess, runtime: str) -> None:
    """Issue 18: a fork bomb left ~1,000 processes after its call, its 3 s timeout fired after 17-27 s (the
    worker, starved of CPU by the bomb, killed one process at a time while the bomb refilled the pids), and
    later calls failed. Now the call's processes die with it, near its deadline, and the next call is fine."""
    if reason := runtime_unavailable(runtime):
        pytest.skip(reason)
    assert client.call("1 + 1", runtime=runtime) == 2  # a warm worker, so the timing below is the call's
    started = time.monotonic()
    with pytest.raises(FunctionError) as bomb:
        client.call(BOMB, runtime=runtime, pids=1024, timeout=3)  # the default cap
    elapsed = time.monotonic() - started
    assert bomb.value.type == "TimeoutError" and bomb.value.timed_out, bomb.value
    assert _call_processes(node) == []
    assert elapsed < 3 + 5, f"a 3 s timeout fired after {elapsed:.1f} s"  # typically 1-2 s late on a busy host
    assert client.call("sum(range(10))", runtime=runtime) == 45
    # a command that leaves a running bomb behind: it is gone before the result comes back (a smaller bomb:
    # with ~1,000 runnable processes each wakeup of the command's own shell waits its turn behind them)
    with client.create("function", image="debian", runtime=runtime, pids=128) as sb:
        r = sb.exec(f"python3 -c {shlex.quote(BOMB)} & sleep 1; echo left", timeout=120)
        assert r.stdout == "left\n" and not r.timed_out, r
        assert _call_processes(node) == []
        assert sb.exec("echo fine").stdout == "fine\n"
    assert client.call("sum(range(10))", runtime=runtime) == 45


def test_no_network(client: shoal.Client) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = f"""
import socket
out = []
for host in ("127.0.0.1", "1.1.1.1"):
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect((host, {port} if host == "127.0.0.1" else 53)); out.append("connected")
    except OSError as exc:
        out.append(type(exc).__name__)
out
"""
    try:
        assert "connected" not in client.call(probe)
    finally:
        server.close()


def test_map_in_order_with_errors(client: shoal.Client) -> None:
    def inverse(x: int) -> float:
        return 1 / x

    out = list(client.map(inverse, [1, 2, 0, 4], concurrency=3))
    assert out[0] == 1.0 and out[1] == 0.5 and out[3] == 0.25
    assert isinstance(out[2], FunctionError) and out[2].type == "ZeroDivisionError"
    assert list(client.map("def f(a, b):\n    return a * b", [(2, 3), (4, 5)], entry="f", star=True)) == [6, 20]


async def test_async_map_and_cancellation(aclient: shoal.AsyncClient) -> None:
    squares = [v async for v in aclient.map(lambda x: x * x, range(50), concurrency=8)]
    assert squares == [x * x for x in range(50)]
    task = asyncio.ensure_future(aclient.call("import time; time.sleep(30)", timeout=60))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    results = await asyncio.gather(*(aclient.call("'ok'") for _ in range(10)))
    assert results == ["ok"] * 10
    status = (await aclient.status())["functions"]
    assert all(p["waiting"] == 0 for p in status["pools"].values())


def test_hostile_results_stay_data(client: shoal.Client, tmp_path: Path) -> None:
    """A call can forge its own result channel; whatever it sends is parsed as JSON, never unpickled."""
    marker = tmp_path / "pwned"
    forge = (
        "import json, os, pickle\n"
        "class P:\n"
        f"    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
        "blob = pickle.dumps(P()).decode('latin-1')\n"
        "value = {VALUE}\n"
        "os.write(3, json.dumps({{'ok': True, 'value': value}}).encode())\n"
        "os._exit(0)\n"
    )
    value = client.call(forge.replace("{VALUE}", "json.dumps(blob)").replace("{{", "{").replace("}}", "}"))
    assert isinstance(value, str) and "system" in value  # the pickle arrives as a plain string
    with pytest.raises(FunctionError) as raw:  # a bare pickle where JSON belongs
        client.call(forge.replace("{VALUE}", "blob").replace("{{", "{").replace("}}", "}"))
    assert raw.value.type == "MalformedResult"
    with pytest.raises(FunctionError, match="MalformedResult"):
        client.call("import os; os.write(3, b'\\x80\\x04garbage'); os._exit(0)")
    assert client.call("__import__('pickle').dumps(3).decode('latin-1')") == "\x80\x04K\x03."
    assert not marker.exists()


# ---------------------------------------------------------------- run_code


@needs_dev
def test_run_code_languages(client: shoal.Client) -> None:
    py = client.run_code("import sys; print(sys.stdin.read().upper())", "python", stdin="abc")
    assert py.ok and py.stdout == "ABC\n" and py.compile is None
    sh = client.run_code(
        "echo $((6*7)) > out.txt; cat in.txt", "bash", files={"in.txt": "in"}, output_files=["out.txt"]
    )
    assert sh.ok and sh.stdout == "in" and sh.files == {"out.txt": b"42\n"}
    c = client.run_code(
        '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}', "c", stdin="2 3"
    )
    assert c.ok and c.stdout == "5\n" and c.compile is not None and c.compile.exit_code == 0
    cpp = client.run_code('#include <iostream>\nint main(){std::cout<<"hi"<<std::endl;return 4;}', "c++")
    assert cpp.status == "runtime_error" and cpp.run is not None and cpp.run.exit_code == 4 and cpp.stdout == "hi\n"
    bad = client.run_code("int main(){ return x; }", "c")
    assert bad.status == "compile_error" and "x" in bad.compile.stderr and bad.run is None
    slow = client.run_code("int main(){for(;;);}", "c", run_timeout=1)
    assert slow.status == "timeout"
    with pytest.raises(shoal.InvalidRequestError, match="cobol"):
        client.run_code("x", "cobol")


@needs_dev
def test_run_code_python_behaves_as_python3_main_py(client: shoal.Client) -> None:
    """Python programs run in a fork of the warm worker, not a fresh python3: the same observable behaviour."""
    main = "import sys, helper\nprint(__name__, sys.argv, helper.X, input())\nraise SystemExit(int(sys.stdin.read()))"
    r = client.run_code(main, "python", files={"helper.py": "X = 7"}, stdin="a\n3")
    assert r.run.exit_code == 3 and r.stdout == "__main__ ['main.py'] 7 a\n", r
    crash = client.run_code("def f():\n    1 / 0\nf()", "python")
    assert crash.status == "runtime_error" and crash.run.exit_code == 1, crash
    stderr = crash.run.stderr
    assert stderr.startswith("Traceback") and "ZeroDivisionError" in stderr, stderr
    assert "runpy" not in stderr and 'main.py", line 3' in stderr, stderr
    said = client.run_code("import sys; print('out'); sys.exit('bye')", "python")
    assert said.run.exit_code == 1 and said.stdout == "out\n" and said.run.stderr == "bye\n", said
    assert client.run_code("import os; print(os.getcwd())", "python").stdout == "/work\n"
    bad = client.run_code("print(1", "python").run.stderr
    assert "SyntaxError" in bad and "runpy" not in bad, bad
    # the program is the __main__ module (dataclasses and pickle look it up in sys.modules)
    main_module = "import sys\nfrom dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n"
    main_module += "print(P(1), sys.modules['__main__'].P is P, __file__)"
    assert client.run_code(main_module, "python").stdout == "P(x=1) True /work/main.py\n"


def test_killed_node_leaves_no_workers() -> None:
    # not under /tmp/pytest-of-*: every pytest session's teardown (conftest) lazily unmounts sandboxes
    # directories there, also those of other sessions' running nodes
    home = Path(tempfile.mkdtemp(prefix="shoal-fnkill-"))
    doomed = NodeProcess(home, f"shoal-test-fnkill-{os.getpid()}").start()
    with doomed.client() as client:
        client.set_pool("function", "debian", size=2, wait=True)
        assert client.call("'warm'") == "warm"
    doomed.stop(signal.SIGKILL)
    assert len(sandbox_roots(doomed.home, doomed.cgroup_parent)) == 2  # the workers outlived the node
    restarted = NodeProcess(doomed.home, doomed.cgroup_parent).start()
    try:
        assert not no_leftovers(restarted.home, restarted.cgroup_parent)
        with restarted.client() as client:
            assert client.call("'again'") == "again"
    finally:
        restarted.stop()
    assert not no_leftovers(restarted.home, restarted.cgroup_parent, node_stopped=True)
    shutil.rmtree(home, ignore_errors=True)


async def test_pool_grows_with_demand(aclient: shoal.AsyncClient) -> None:
    await aclient.set_pool("function", "debian", size=0, wait=True)
    spans = await asyncio.gather(
        *(aclient.call("import time; t0 = time.time(); time.sleep(1.5); (t0, time.time())") for _ in range(4))
    )
    spans = sorted(tuple(span) for span in spans)
    # not 4 x 1.5 s one after another: workers were added, so calls overlapped (told from the calls' own
    # clocks, not from a wall-clock bound a loaded host can exceed)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False)), spans
    status = await aclient.status()
    pools = status["functions"]["pools"]
    assert pools[f"debian:{status['runtime']['default']}"]["idle"] >= 2, pools  # the node's default runtime


def test_ttl_closes_function_sandboxes(client: shoal.Client) -> None:
    sb = client.create("function", ttl_s=0.5)
    assert sb.exec("true").exit_code == 0
    time.sleep(1.5)
    with pytest.raises(shoal.SandboxClosedError, match="ttl"):
        sb.exec("true")


def test_pool_replaces_a_dead_worker(client: shoal.Client, node: NodeProcess) -> None:
    def workers() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if (
                    b"/run/shoal-fn/worker.py" in (proc / "cmdline").read_bytes()
                    and node.cgroup_parent in (proc / "cgroup").read_text()
                ):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found

    client.set_pool("function", "debian", size=1, wait=True)
    result: dict[str, BaseException] = {}

    def slow() -> None:
        try:
            client.call("import time; time.sleep(20)", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            result["error"] = exc

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(1.0)
    for pid in workers():
        with contextlib.suppress(ProcessLookupError):  # a call's child may exit between listing and kill
            os.kill(pid, signal.SIGKILL)
    thread.join(timeout=15)
    assert isinstance(result.get("error"), shoal.SandboxLostError), result
    time.sleep(0.5)  # the node notices the idle workers' deaths too
    assert [client.call("'recovered'") for _ in range(5)] == ["recovered"] * 5


def test_cpu_limit_throttles_the_call(client: shoal.Client, node: NodeProcess) -> None:
    def throttled() -> int:
        total = 0
        for stat in Path("/sys/fs/cgroup").glob(f"cpu*/{node.cgroup_parent}/*/call/cpu.stat"):
            total += int(dict(line.split() for line in stat.read_text().splitlines()).get("nr_throttled", 0))
        return total

    if not list(Path("/sys/fs/cgroup").glob("cpu*")) or not (Path("/sys/fs/cgroup") / "cpu").is_dir():
        pytest.skip("no cgroup v1 cpu hierarchy on this host (v2 reports cpu.max throttling differently)")
    before = throttled()
    busy = "import time\nt = time.time()\nwhile time.time() - t < 1: pass\ntime.process_time()"
    used = client.call(busy, cpu=0.2)
    assert used < 0.6 and throttled() > before


def test_giant_output_and_result_are_capped(client: shoal.Client) -> None:
    with pytest.raises(FunctionError) as big:
        client.call("print('y' * (20 << 20)); 'x' * (65 << 20)", output_cap_bytes=1 << 16, timeout=30)
    omitted = (20 << 20) + 1 - (1 << 16)  # head and tail kept, the middle cut and marked
    assert big.value.type == "ResultTooLarge" and len(big.value.stdout) == (1 << 16) + len(cut_marker(omitted))
    streamed: list[bytes] = []
    with client.create("function") as sb:
        result = sb.exec("echo streamed", on_stdout=streamed.append)
    assert result.stdout == "streamed\n" and b"".join(streamed) == b"streamed\n"


@needs_dev
def test_worker_budget_is_shared_between_images() -> None:
    home = Path(tempfile.mkdtemp(prefix="shoal-fnbudget-"))
    small = NodeProcess(home, f"shoal-test-fnbudget-{os.getpid()}", SHOAL_FN_MAX_WORKERS="1").start()
    try:
        with small.client() as client:
            start = time.monotonic()
            threads = [threading.Thread(target=client.call, args=("import time; time.sleep(1)",)) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert time.monotonic() - start >= 2.0  # one worker: the calls took turns
            assert client.call("'debian'") == "debian"
            assert client.call("'dev'", image="debian-dev") == "dev"  # the idle debian worker made room
            pools = client.status()["functions"]["pools"]
            assert sum(p["idle"] + p["busy"] + p["starting"] for p in pools.values()) <= 1, pools
    finally:
        small.stop()
    assert not no_leftovers(small.home, small.cgroup_parent, node_stopped=True)
    shutil.rmtree(home, ignore_errors=True)


def test_abandoned_map_stops_its_calls(client: shoal.Client) -> None:
    taken = []
    for value in client.map("import time\ndef f(x):\n    time.sleep(0.2)\n    return x", range(100), entry="f"):
        taken.append(value)
        if len(taken) == 3:
            break
    assert taken == [0, 1, 2]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pools = client.status()["functions"]["pools"]
        if all(p["busy"] == 0 and p["waiting"] == 0 for p in pools.values()):
            break
        time.sleep(0.1)
    assert all(p["busy"] == 0 and p["waiting"] == 0 for p in pools.values()), pools


# what each item of a batched map does: look for what an earlier item of its batch left, then leave some
LEFTOVERS = """
import os, subprocess
def f(x):
    seen = sorted(n for d in ('/work', '/tmp', '/dev/shm') for n in os.listdir(d))
    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()
              and os.stat('/proc/' + p).st_uid == os.getuid()]
    for d in ('/work', '/tmp', '/dev/shm'):
        open(f'{d}/mark-{x}', 'w').write('x')
    subprocess.Popen(['sleep', '300'], start_new_session=True)
    if x % 5 == 3:
        raise ValueError(f'item {x} fails')
    return [x, seen, others]
"""


def test_batched_map_items_are_isolated_in_order_with_errors_in_place(client: shoal.Client) -> None:
    """A batch runs its items one after another in one worker, each in a fresh child: none sees the files
    or processes an earlier item left; values come back in order, a failing item's error in its place and
    the rest of its batch still runs."""
    out = list(client.map(LEFTOVERS, range(24), entry="f", batch=8, concurrency=2))
    assert len(out) == 24
    for x, value in enumerate(out):
        if x % 5 == 3:
            assert isinstance(value, FunctionError) and value.type == "ValueError" and f"item {x}" in value.message
        else:
            assert value == [x, [], []], value
    squares = list(client.map(lambda x: x * x, range(100), batch=16, concurrency=3))
    assert squares == [x * x for x in range(100)]
    star = client.map("def f(a, b):\n    return a - b", [(5, 3), (2, 7)] * 5, entry="f", star=True, batch=4)
    assert list(star) == [2, -5] * 5
    with pytest.raises(ValueError, match="batch"):
        list(client.map(lambda x: x, range(3), batch=0))


SHARING = """
import os, sys
def f(x):
    if x == 3:
        os._exit(7)  # ends the shared child: item 3 fails alone, 4 and 5 run in a fresh one
    if x == 6:
        import time
        time.sleep(60)  # past its own timeout: the same
    print('out', x)
    print('err', x, file=sys.stderr)
    open(f'/work/mark-{x}', 'w').write('x')
    seen = globals().setdefault('seen', [])
    seen.append(x)
    return [list(seen), sorted(os.listdir('/work'))]
"""


def test_map_with_batch_isolation_shares_one_child_per_batch(client: shoal.Client) -> None:
    """isolation="batch": a batch's items run in one child (what one leaves, the next sees), each with its
    own value or error in place, its own output and its own timeout; an item that ends the child fails alone
    and the rest of the batch start afresh; the next batch shares nothing; the default stays per item."""
    out = list(client.map(SHARING, range(10), entry="f", batch=8, isolation="batch", timeout=10))
    marks = [f"mark-{x}" for x in range(10)]
    assert out[:3] == [[[0], marks[:1]], [[0, 1], marks[:2]], [[0, 1, 2], marks[:3]]]
    assert isinstance(out[3], FunctionError) and out[3].type == "WorkerCrashed" and "code 7" in out[3].message
    assert out[4:6] == [[[4], marks[4:5]], [[4, 5], marks[4:6]]]
    assert isinstance(out[6], FunctionError) and out[6].type == "TimeoutError" and out[6].timed_out
    assert out[7] == [[7], marks[7:8]]
    assert out[8:] == [[[8], marks[8:9]], [[8, 9], marks[8:10]]]  # a new batch: nothing of the first
    isolated = list(client.map(SHARING, [0, 1, 2], entry="f", batch=3))
    assert isolated == [[[x], [f"mark-{x}"]] for x in range(3)]
    spec = {"kind": "function", "image": "debian"}
    raw = client.call("fn_map", {"spec": spec, "call": {"source": SHARING, "entry": "f"}, "items": [[0], [1]],
                                "isolation": "batch"})  # fmt: skip
    assert [(r["stdout"], r["stderr"]) for r in raw] == [(b"out 0\n", b"err 0\n"), (b"out 1\n", b"err 1\n")]
    assert list(client.map(lambda x: x * x, range(50), isolation="batch", batch=16)) == [x * x for x in range(50)]
    with pytest.raises(shoal.InvalidRequestError, match="isolation='none'"):
        client.call("fn_map", {"spec": spec, "call": {"source": SHARING, "entry": "f"}, "items": [[0]],
                              "isolation": "none"})  # fmt: skip
    with pytest.raises(ValueError, match="isolation"):
        list(client.map(lambda x: x, range(3), isolation="process"))  # type: ignore[arg-type]


def test_call_children_are_ordinary_processes(client: shoal.Client) -> None:
    """In calls and batched map items (cloudpickle workers load threading and logging, which register
    at-fork handlers): threads, fork, subprocesses work, and no two calls share random state."""

    def _threads_forks_and_randomness(x: int) -> list:
        """Runs in a call's child (nested, so cloudpickled by value). The worker may fork calls without
        CPython's at-fork handlers: the child must still start threads, fork, run programs and draw its
        own random numbers."""
        import os
        import random
        import subprocess
        import threading

        seen = []
        worker = threading.Thread(target=seen.append, args=(threading.get_ident(),))
        worker.start()
        worker.join()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"forked")
            os._exit(7)
        os.close(write)
        forked = os.read(read, 16).decode()
        _, status = os.waitpid(pid, 0)
        echoed = subprocess.run(["echo", str(x)], capture_output=True, text=True, check=True).stdout.strip()
        return [x, len(seen), forked, os.waitstatus_to_exitcode(status), echoed, os.getpid(), random.random(),
                os.urandom(8).hex()]  # fmt: skip

    rows = list(client.map(_threads_forks_and_randomness, range(12), batch=6, concurrency=2))
    rows.append(client.call(_threads_forks_and_randomness, 12))
    for x, row in enumerate(rows):
        assert row[:5] == [x, 1, "forked", 7, str(x)], row
    assert all(row[5] > 1 for row in rows)  # a process of its own (workers are containers: pids repeat)
    assert len({row[6] for row in rows}) == len(rows)  # random is not the worker's state replayed
    assert len({row[7] for row in rows}) == len(rows)


def test_batch_limits_are_per_item(client: shoal.Client) -> None:
    """Each item of a batch gets its own timeout and memory limit; one item's timeout or OOM kill is that
    item's error and the items after it in the batch run normally."""
    source = (
        "import time\ndef f(x):\n    if x == 1:\n        time.sleep(300)\n"
        "    if x == 3:\n        b = bytearray(400 << 20)\n        return len(b)\n    return x"
    )
    out = list(client.map(source, range(5), entry="f", batch=5, timeout=2, memory_mb=128))
    assert out[0] == 0 and out[2] == 2 and out[4] == 4, out
    assert isinstance(out[1], FunctionError) and out[1].type == "TimeoutError", out[1]
    assert isinstance(out[3], FunctionError) and out[3].type == "MemoryError", out[3]


def test_abandoned_batched_map_leaves_no_busy_workers_or_processes(client: shoal.Client, node: NodeProcess) -> None:
    """Leaving a batched map early cancels its batches in flight: the workers stop the running item, skip
    the rest of the batch and are free again, with no process of any item left in a call cgroup."""
    source = "import subprocess, time\ndef f(x):\n    subprocess.Popen(['sleep', '300'])\n"
    source += "    time.sleep(0.3)\n    return x"
    taken = []
    for value in client.map(source, range(200), entry="f", batch=20, concurrency=2):
        taken.append(value)
        if len(taken) == 2:
            break
    assert taken == [0, 1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pools = client.status()["functions"]["pools"]
        if all(p["busy"] == 0 and p["waiting"] == 0 for p in pools.values()) and not _call_processes(node):
            break
        time.sleep(0.1)
    assert all(p["busy"] == 0 and p["waiting"] == 0 for p in pools.values()), pools
    assert _call_processes(node) == []
    assert client.call("6 * 7") == 42  # the workers that were aborted serve calls again


def test_the_workers_output_cap_matches_the_nodes() -> None:
    """The worker (under the image's python, without shoal) keeps and marks output as the node does."""
    for cap, pieces in ((10, [b"abc", b"defghijklmnop", b"q"]), (7, [b"x" * 100]), (64, [b"short"])):
        ours, theirs = HeadTail(cap), worker.HeadTail(cap)
        for piece in pieces:
            ours.feed(piece)
            theirs.feed(piece)
        assert (ours.value(), ours.omitted) == (theirs.value(), theirs.omitted)
