"""The resident worker of a `function` sandbox: runs INSIDE a container, under the image's python3.

Standard library only (the image has nothing else). Started by the node through the container's agent:

    python3 worker.py SOCKET_PATH UID GID MODULE...

It imports MODULE..., listens on SOCKET_PATH (in a root-only directory, so calls cannot reach it) and prints
``ready <python version>`` once. The node connects once and sends a hello frame carrying, as SCM_RIGHTS, open
``cgroup.procs`` files of the per-call cgroup. Then requests, one at a time; frames are a 4-byte big-endian
length and UTF-8 JSON, bytes travel as base64.

A request is one call (a command, Python, or run_code's compile and run) or a batch of calls (`map`:
the function once in "python", each step only its arguments, "isolate" set): between the calls of a batch
the worker cleans up exactly as after a request, so each sees only its own inputs.

Per request the worker writes the input files, then runs each step in a freshly forked child that joins
the call cgroup, drops to UID:GID (no capabilities), and either execs a command or runs Python in the
already-warm interpreter; afterwards it kills every process but itself and the agent, collects the
requested output files and wipes every directory a call could write (`WRITABLE`). Results go back as
JSON; a Python value must be JSON data, so nothing the call makes can run code in the node or client.
"""

from __future__ import annotations

import _signal
import _socket
import ast
import binascii
import errno
import fcntl
import gc
import json
import os
import resource
import select
import struct
import sys
import time
import traceback

WRITABLE = ("/work", "/tmp", "/var/tmp", "/dev/shm")
TMPFS: frozenset[str] = frozenset()  # which of them are tmpfs mount points (main() fills it in)
CLOSE_TO_CALLS = ("/run/lock", "/dev/mqueue", "/var/lock")
RESULT_FD = 3
GO_ON_FD = 4  # a batch's shared child: reads a byte here after each item's result (the worker cut its output)
MAX_RESULT = 64 << 20
MAX_FILE = 256 << 20
_LEN = struct.Struct(">I")
# the ones Python ignores (ignoring survives exec), reset through the C module in a child that execs a command
# (the `signal.signal` wrapper converts to and from enums, which cost the child ~30 page faults). A child
# that runs Python keeps them ignored, as python3 itself does (a broken pipe is BrokenPipeError, not death)
DEFAULT_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ)
SIGKILL = _signal.SIGKILL
# The worker imports little beyond what calls use (not shutil, socket, signal, base64): each call forks it,
# and fork and exit cost CPU per resident page (~0.09 ms per MB here, both sides), so the ~0.9 MB those
# modules held cost every call ~0.1 ms. `ast` stays: a cell whose last line is no expression needs it, and
# importing it in that call's child would cost the child more than its pages cost every call.


class HeadTail:
    """shoal.protocol.HeadTail, repeated here because the worker runs under the image's python without
    shoal: the first `cap - cap // 2` bytes of an output and its last `cap // 2`, the cut marked."""

    def __init__(self, cap: int) -> None:
        self.head_cap, self.tail_cap = cap - cap // 2, cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.omitted = 0

    def feed(self, data: bytes) -> None:
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            over = len(self.tail) - self.tail_cap
            if over > 0:
                self.omitted += over
                del self.tail[:over]

    def value(self) -> bytes:
        if not self.omitted:
            return bytes(self.head + self.tail)
        marker = f"\n[... shoal: {self.omitted} bytes omitted by the output cap ...]\n".encode()
        return bytes(self.head + marker + self.tail)


def b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unb64(text: str | None) -> bytes:
    return binascii.a2b_base64(text) if text else b""


# ------------------------------------------------------------------ framing


def recv_exact(sock: _socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("node closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: _socket.socket) -> dict:
    (length,) = _LEN.unpack(recv_exact(sock, 4))
    return json.loads(recv_exact(sock, length))


# made once: json.dumps with separators builds a JSONEncoder (its Python __init__) for every reply
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def send_frame(sock: _socket.socket, message: dict) -> None:
    body = _ENCODE(message).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


# ------------------------------------------------------------------ the call's filesystem


def inside(path: str) -> bool:
    real = os.path.normpath(path)
    return any(real == root or real.startswith(root + "/") for root in WRITABLE)


def prepare_dirs(uid: int, gid: int) -> None:
    """At start: the writable roots exist; other world-writable places are closed to calls."""
    for root in WRITABLE:
        os.makedirs(root, exist_ok=True)
        os.chmod(root, 0o1777 if root != "/work" else 0o755)
    os.chown("/work", uid, gid)
    for path in CLOSE_TO_CALLS:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o755)
        except OSError:
            pass


def tmpfs_roots() -> frozenset[str]:
    """The writable roots that are tmpfs mount points (the node mounts one on each but /dev/shm, which is one)."""
    found = set()
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            for line in handle:
                fields = line.split()
                fstype = fields[fields.index(b"-") + 1]
                point = fields[4].decode()
                if fstype == b"tmpfs" and point in WRITABLE:
                    found.add(point)
                elif point in found:  # mounted over since: not (only) that tmpfs any more
                    found.discard(point)
    except (OSError, ValueError, IndexError):
        return frozenset()
    return frozenset(found)


def wipe(empty: dict[str, int] | None = None, pristine: dict[str, Root] | None = None) -> None:
    """Remove everything a call wrote (every writable root is emptied, and put back as it was).

    `empty`: for roots that are tmpfs mount points, a directory's size when it has no entries. tmpfs counts
    every entry in its directory's size (BOGO_DIRENT_SIZE each, whatever makes it: create, mkdir, link,
    symlink, rename, whiteout), so a root still at that size holds nothing, and one stat replaces opening,
    listing and closing it; a root at any other size is listed and emptied as before. Filled in here the
    first time a root is seen empty.

    `pristine`: each root as it was before any call (`Root`): what a call changed of it is put back."""
    for root in WRITABLE:
        try:
            status = os.stat(root)
        except FileNotFoundError:
            continue
        listed = False
        if empty is None or empty.get(root) != status.st_size:
            try:
                entries = list(os.scandir(root))
            except FileNotFoundError:
                continue
            listed = True
            if not entries and empty is not None and root in TMPFS:
                empty[root] = status.st_size
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    rmtree(entry.path)
                else:
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
        was = pristine.get(root) if pristine is not None else None
        if was is not None and (  # compared without making objects: this runs after every call
            listed
            or was.fd >= 0
            or status.st_mode != was.mode
            or status.st_uid != was.uid
            or status.st_gid != was.gid
            or status.st_atime_ns != was.atime
            or status.st_mtime_ns != was.mtime
        ):
            was.restore(status, listed)


# what the owner of a directory may set on it without privileges: user attributes and POSIX ACLs
_OWNER_XATTRS = ("user.", "system.posix_acl_")


# ioctl(2) requests for an inode's flags (chattr's): an int, whatever the request's encoded size says
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602


class Root:
    """A writable root as prepare_dirs left it, before any call, and how to put it back.

    /work belongs to the calls' user, so a call may chmod it (to 0: every later call on the worker failed to
    chdir there), set its set-group-id bit, a default ACL (inherited by what later calls create there), user
    attributes, inode flags (chattr +d, +A) or its times: all outlived the call. Of the roots the calls do
    not own (root's, sticky) they can change only the times (to now). Per call: the stat `wipe` makes anyway
    and, for /work, one listxattr and one ioctl on a descriptor kept open; more only to undo a change."""

    __slots__ = ("atime", "fd", "flags", "gid", "mode", "mtime", "path", "uid")

    def __init__(self, path: str, calls_uid: int) -> None:
        status = os.stat(path)
        self.path, self.mode, self.uid, self.gid = path, status.st_mode, status.st_uid, status.st_gid
        self.atime, self.mtime = status.st_atime_ns, status.st_mtime_ns
        self.fd, self.flags = -1, b""  # for a root the calls own: a descriptor of it and its flags
        if status.st_uid == calls_uid:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self.flags = self._flags()

    def _flags(self) -> bytes:
        try:
            return fcntl.ioctl(self.fd, FS_IOC_GETFLAGS, b"\0\0\0\0")
        except OSError:  # a file system without inode flags
            return b""

    def restore(self, status: os.stat_result, listed: bool) -> None:
        """`status`: the root's stat before the clean-up; `listed`: the clean-up listed it (its times changed)."""
        path, changed = self.path, False
        if self.fd >= 0:
            try:
                for name in os.listxattr(self.fd):
                    if name.startswith(_OWNER_XATTRS):
                        os.removexattr(self.fd, name)
                        changed = True
            except OSError:  # no attributes on this file system
                pass
            if self.flags and self._flags() != self.flags:
                fcntl.ioctl(self.fd, FS_IOC_SETFLAGS, self.flags)
        if (status.st_uid, status.st_gid) != (self.uid, self.gid):
            os.chown(path, self.uid, self.gid)
            changed = True
        if changed or status.st_mode != self.mode:
            os.chmod(path, self.mode & 0o7777)
        if listed or status.st_atime_ns != self.atime or status.st_mtime_ns != self.mtime:
            os.utime(path, ns=(self.atime, self.mtime))


def rmtree(path: str) -> None:
    """Remove a directory tree without following symbolic links (shutil.rmtree without importing shutil).
    Every process of the calls is dead when this runs, so nothing swaps a directory for a link meanwhile."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        entries = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


_IPC_RMID = 0
# A read of a /proc/sysvipc table returns at most one page of rows (seq_file), so a page's worth or less is not
# the end; a read shorter than a page by more than the longest row (under 256 bytes) is.
_SHORT_READ = os.sysconf("SC_PAGESIZE") - 512
_SYSV = (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl"))


def open_sysv() -> list[int]:
    """Descriptors of /proc/sysvipc/{shm,sem,msg} (-1 where missing), opened once: a pread at offset 0
    lists the namespace's objects afresh, one syscall per kind and call instead of open, read and close."""
    fds = []
    for kind, _ctl in _SYSV:
        try:
            fds.append(os.open(f"/proc/sysvipc/{kind}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            fds.append(-1)
    return fds


def _read_table(kind: str, fd: int) -> bytes:
    if fd < 0:
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as handle:
                return handle.read()
        except OSError:
            return b""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < _SHORT_READ:  # a seq_file read returns every row that fits its page: a short one is the end
            break
    return b"".join(chunks)


def remove_sysv_ipc(uid: int, gid: int, fds: list[int] | None = None) -> None:
    """SysV shared memory, semaphores and message queues outlive their process: remove what calls made.

    The container's root lacks CAP_IPC_OWNER, so a short-lived child with the calls' uid removes them.
    """
    found = []
    for (kind, ctl), fd in zip(_SYSV, fds or [-1] * len(_SYSV), strict=True):
        table = _read_table(kind, fd)
        if table.count(b"\n") > 1:  # more than the header line
            found += [(kind, ctl, int(row.split()[1])) for row in table.splitlines()[1:] if row.strip()]
    if not found:
        return
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes

            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            libc = ctypes.CDLL(None, use_errno=True)
            for kind, ctl, ident in found:
                if kind == "sem":
                    libc.semctl(ident, 0, _IPC_RMID)
                else:
                    getattr(libc, ctl)(ident, _IPC_RMID, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def write_inputs(files: dict[str, dict], cwd: str, uid: int, gid: int) -> None:
    """Write the call's input files (and directories: entries with "dir") owned by the call's user."""
    if not files and cwd in WRITABLE:  # the roots always exist (wipe empties them, never removes them)
        return
    makedirs(cwd, uid, gid)
    for path, entry in files.items():
        full = os.path.normpath(os.path.join(cwd, path))
        if not inside(full):
            raise PermissionError(f"{path}: a function call can only write under {', '.join(WRITABLE)}")
        if entry.get("dir"):
            makedirs(full, uid, gid)
            continue
        if os.path.dirname(full) != cwd:
            makedirs(os.path.dirname(full), uid, gid)
        mode = entry.get("mode", 0o644)
        try:  # a new file (the usual case) has its mode from open() when the umask (022) takes nothing away
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            chmod = mode != mode & 0o0755
        except FileExistsError:  # named twice (a/../b and b): the last one wins, mode included
            fd = os.open(full, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
            chmod = True
        try:
            os.write(fd, unb64(entry.get("data")))
            os.fchown(fd, uid, gid)
            if chmod:  # after fchown, which clears the set-id bits
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def makedirs(path: str, uid: int, gid: int) -> None:
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory)
        if inside(directory):
            os.chown(directory, uid, gid)


def read_outputs(paths: list[str], cwd: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for path in paths:
        full = os.path.join(cwd, path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            found[path] = None
            continue
        try:
            found[path] = b64(os.read(fd, MAX_FILE)) if os.path.isfile(full) else None
        except OSError:
            found[path] = None
        finally:
            os.close(fd)
    return found


def kill_stragglers(worker: Worker | None = None) -> None:
    """SIGKILL every process in the sandbox but the agent, its relay for this worker and the worker; wait.

    With the call cgroup's pids files, a call that left nothing costs one read; otherwise forks are
    frozen (pids.max 0: a fork bomb cannot refill what is killed), a child with the calls' uid kills
    every process of that uid in one kill(-1) (no scan of /proc, which a bomb starves for seconds), and
    the call's pids limit is written back once all are gone.
    """
    if worker is not None and worker.pids_current >= 0:
        try:
            if os.pread(worker.pids_current, 32, 0).strip() == b"0":
                return
        except OSError:
            pass
    frozen = False
    if worker is not None and worker.pids_max >= 0:
        frozen = _write_fd(worker.pids_max, b"0")
    if worker is not None:
        kill_as(worker.uid, worker.gid)
    spared = {"1", str(os.getpid()), str(os.getppid())}
    deadline = time.monotonic() + 5
    try:
        while True:
            alive = []
            for name in os.listdir("/proc"):
                if name[0].isdigit() and name not in spared:
                    try:
                        with open(f"/proc/{name}/stat", "rb") as handle:
                            state = handle.read().rsplit(b")", 1)[1].split()[0]
                    except (OSError, IndexError):
                        continue
                    if state not in (b"Z", b"X"):
                        alive.append(int(name))
            if not alive or time.monotonic() > deadline:
                reap()  # the killed are zombies of the worker (a subreaper): gone before the next call looks
                return
            for pid in alive:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass
            reap()
            time.sleep(0.0005)
    finally:
        if frozen:
            assert worker is not None
            _write_fd(worker.pids_max, str(worker.pids or "max").encode())


def kill_as(uid: int, gid: int) -> None:
    """kill(-1, SIGKILL) from a child with the calls' uid: every process of that uid at once (not the
    worker, the agent or its relay, which are root's)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            for _ in range(3):  # a process forked while the first kill walked the list gets the next
                os.kill(-1, SIGKILL)
        except BaseException:  # noqa: BLE001 - ESRCH: nothing (more) to kill
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _write_fd(fd: int, data: bytes) -> bool:
    try:
        os.pwrite(fd, data, 0)
        return True
    except OSError:
        return False


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ------------------------------------------------------------------ one step in a fresh child


class Worker:
    def __init__(self, uid: int, gid: int) -> None:
        self.uid = uid
        self.gid = gid
        self.cgroup_fds: list[int] = []
        self.pids_max = -1  # the call cgroup's pids.max, to freeze forks while killing
        self.pids_current = -1  # and its pids.current: is anything left?
        self.pids = 0  # this request's pids limit, written back after a freeze
        self.join: list[int] = []  # which of them this request's children join
        self.devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.sysv = open_sysv()
        self.empty: dict[str, int] = {}  # tmpfs roots' size when empty (see wipe)
        self.pristine: dict[str, Root] = {}  # each writable root as it was before any call (see wipe)
        for root in WRITABLE:
            try:
                self.pristine[root] = Root(root, uid)
            except OSError:
                pass
        self.environ: dict = dict(os.environ)  # what os.environ holds now
        self.fork = os.fork  # main() sets call_fork(...) once the modules are imported

    def adopt_env(self, env: dict) -> None:
        """Make the worker's own environment the call's (once per distinct environment), so its forked
        children inherit it: rebuilding os.environ in every child cost ~0.5 ms and ~90 copy-on-write page
        faults per call here. The worker reads no variable after its start and execs nothing itself."""
        if env != self.environ:
            os.environ.clear()
            os.environ.update(env)
        self.environ = env  # this very dict: the child knows it is adopted by identity, without comparing

    def child(self, step: dict, cwd: str, env: dict, fds: tuple[int, int, int, int], go_on: int = -1) -> None:
        """In the forked child: join the call cgroup, drop privileges, run. Never returns."""
        stdin_r, out_w, err_w, result_w = fds
        gc.disable()  # short-lived: collecting would only copy pages shared with the worker
        try:
            os.setsid()
            for index in self.join:
                os.write(self.cgroup_fds[index], b"0")
            os.dup2(stdin_r, 0)
            os.dup2(out_w, 1)
            os.dup2(out_w if step.get("merge_stderr") else err_w, 2)
            os.dup2(result_w, RESULT_FD)
            if go_on >= 0:
                os.dup2(go_on, GO_ON_FD)
            os.closerange((GO_ON_FD if go_on >= 0 else RESULT_FD) + 1, 65536)
            if "argv" in step:
                for sig in DEFAULT_SIGNALS:
                    _signal.signal(sig, _signal.SIG_DFL)
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)
            os.chdir(cwd)
        except BaseException as exc:  # noqa: BLE001 - report any setup failure on stderr
            os.write(2, f"shoal function worker: could not set up the call: {exc}\n".encode())
            os._exit(125)
        if "argv" in step:
            argv = step["argv"]
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as exc:
                os.write(2, f"{argv[0]}: {exc.strerror}\n".encode())
                os._exit(126 if exc.errno in (errno.EACCES, errno.ENOEXEC) else 127)
        if env is not self.environ:  # the worker adopts each call's environment before forking (adopt_env)
            os.environ.clear()
            os.environ.update(env)
        if "script" in step:
            os._exit(run_script(step["script"], step["script_path"]))
        sys.argv = ["<shoal call>"]
        code = 1
        try:
            code = run_batch(step["python"]) if "batch" in step["python"] else run_python(step["python"])
        finally:
            os._exit(code)  # whatever happened, this child never returns into the worker's loop

    def run_step(
        self, sock: _socket.socket, step: dict, cwd: str, env: dict, done: list | None = None
    ) -> tuple[dict, bool]:
        """Fork, feed stdin, collect output (capped) until the child exits or a timeout; returns (result, aborted).

        A batch (`step["python"]["batch"]`, items sharing this one child) puts each finished item's result in
        `done`, its output the pipes' contents up to its result frame, each item with its own timeout; the
        returned result is then that of the item the child was on when it ended (if it had not finished)."""
        batch = done is not None
        self.adopt_env(env)
        if "script" in step:  # its absolute path, worked out here rather than in every child
            step["script_path"] = os.path.normpath(os.path.join(cwd, step["script"]))
        cap = int(step.get("cap") or 1 << 20)
        stdin_data = unb64(step.get("stdin"))
        stdin_r, stdin_w = os.pipe() if stdin_data else (self.devnull, -1)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        # a batch's child waits after each item until the worker has read that item's output: else the output
        # of the next item could already sit in the pipes when the worker cuts them at the result frame
        go_on_r, go_on_w = os.pipe() if batch else (-1, -1)
        # the loop's state is made before the fork: the worker's writes then fault on pages only it maps (the
        # previous child is gone), not as copies of pages this call's child still shares
        buffers = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
        limits = {out_r: cap, err_r: cap, res_r: MAX_RESULT}
        dropped = {out_r: 0, err_r: 0, res_r: 0}
        outputs = {out_r: HeadTail(cap), err_r: HeadTail(cap)} if cap else {}  # head and tail kept
        frames = bytearray()
        oversize = False
        if batch:  # an item's output is what the pipes hold when its result frame arrives: read them dry then
            os.set_blocking(out_r, False)
            os.set_blocking(err_r, False)
        poller = select.poll()
        for fd in buffers:
            poller.register(fd, select.POLLIN)
        poller.register(sock.fileno(), select.POLLIN)
        if stdin_data:
            os.set_blocking(stdin_w, False)
            poller.register(stdin_w, select.POLLOUT)
        timeout = step.get("timeout")
        idle = step.get("idle_timeout")
        timed_out = aborted = exited = False
        drain_until = 0.0
        status = 0
        open_fds = set(buffers)
        start = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = self.fork()
        if pid == 0:  # the worker's ends of the pipes (all above GO_ON_FD) go with the child's closerange
            self.child(step, cwd, env, (stdin_r, out_w, err_w, res_w), go_on_r)
        for fd in (out_w, err_w, res_w, go_on_r):
            if fd >= 0:
                os.close(fd)
        if stdin_data:
            os.close(stdin_r)
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
        deadline = start + timeout if timeout else None
        last_output = start
        while open_fds or not exited:
            now = time.monotonic()
            limits_at = [t for t in (deadline, idle and last_output + idle) if t]
            wait = max(0.0, min(limits_at) - now) if limits_at and not exited else None
            if exited:
                wait = max(0.0, drain_until - now)
            events = poller.poll(None if wait is None else wait * 1000)
            if not events:
                if exited:
                    break  # stragglers are dead; a pipe still open is held by nobody we wait for
                timed_out = True
                poller.unregister(pidfd)
                status = self.stop(pid, kill=True)
                exited = True
                drain_until = time.monotonic() + 1.0
                continue
            for fd, _event in events:
                if fd == pidfd:
                    if exited:
                        continue
                    poller.unregister(pidfd)
                    status = self.stop(pid, kill=False)
                    exited = True
                    drain_until = time.monotonic() + 1.0
                elif fd == sock.fileno():  # the node gave up on this call: abort it
                    poller.unregister(fd)
                    try:
                        recv_frame(sock)  # {"abort": true}
                    except ConnectionError:
                        pass
                    aborted = True
                    if not exited:
                        poller.unregister(pidfd)
                        status = self.stop(pid, kill=True)
                    exited = True
                    drain_until = time.monotonic() + 1.0
                elif fd == stdin_w:
                    try:
                        sent = os.write(stdin_w, stdin_data[:65536])
                        stdin_data = stdin_data[sent:]
                    except OSError:
                        stdin_data = b""
                    if not stdin_data:
                        poller.unregister(stdin_w)
                        os.close(stdin_w)
                        stdin_w = -1
                else:
                    try:
                        data = os.read(fd, 1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    if fd != res_r:
                        last_output = time.monotonic()
                    elif batch:
                        frames += data
                        if len(frames) >= 4 and _LEN.unpack_from(frames)[0] > MAX_RESULT and not exited:
                            oversize = True  # as a call's result past MAX_RESULT: the item fails, the child goes
                            frames.clear()
                            poller.unregister(pidfd)
                            status = self.stop(pid, kill=True)
                            exited = True
                            drain_until = time.monotonic() + 1.0
                        while len(frames) >= 4 and len(frames) >= 4 + _LEN.unpack_from(frames)[0]:
                            size = _LEN.unpack_from(frames)[0]
                            item = {"result": frames[4 : 4 + size].decode("utf-8", "replace")}
                            del frames[: 4 + size]
                            for pipe in (out_r, err_r):
                                self._drain(pipe, outputs.get(pipe), buffers[pipe], limits[pipe], poller, open_fds)
                            done.append(self._result(item, start, False, 0, outputs, buffers, out_r, err_r))
                            try:
                                os.write(go_on_w, b"g")
                            except OSError:  # it is gone (it ended after its last item, or was killed)
                                pass
                            start = last_output = time.monotonic()  # the next item's time starts now
                            deadline = start + timeout if timeout else None
                            outputs = {out_r: HeadTail(cap), err_r: HeadTail(cap)} if cap else {}
                            buffers[out_r], buffers[err_r] = bytearray(), bytearray()
                        continue
                    if fd in outputs:
                        outputs[fd].feed(data)
                        continue
                    room = limits[fd] - len(buffers[fd])
                    buffers[fd] += data[: max(room, 0)]
                    dropped[fd] += max(0, len(data) - max(room, 0))
        for fd in (*buffers, pidfd, *([go_on_w] if batch else [])):
            os.close(fd)
        if stdin_w >= 0:
            os.close(stdin_w)
        result: dict = {}
        if batch:  # the item the child was on when it ended returned nothing (or too much)
            result.update(result="", result_too_large=oversize)
        elif "python" in step:
            result.update(result="" if dropped[res_r] else buffers[res_r].decode("utf-8", "replace"),
                          result_too_large=bool(dropped[res_r]))  # fmt: skip
        return self._result(result, start, timed_out, status, outputs, buffers, out_r, err_r), aborted

    @staticmethod
    def _result(
        result: dict, start: float, timed_out: bool, status: int, outputs: dict, buffers: dict, out_r: int, err_r: int
    ) -> dict:
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        result.update(
            exit_code=128 + signum if signum else os.WEXITSTATUS(status),
            signal=signum,
            duration_s=time.monotonic() - start,
            timed_out=timed_out,
        )
        if outputs:
            out, err = outputs[out_r], outputs[err_r]
            result.update(stdout=b64(out.value()), stderr=b64(err.value()), truncated=bool(out.omitted or err.omitted),
                          stdout_omitted=out.omitted, stderr_omitted=err.omitted)  # fmt: skip
        else:
            result.update(stdout=b64(bytes(buffers[out_r])), stderr=b64(bytes(buffers[err_r])), truncated=False)
        return result

    @staticmethod
    def _drain(fd: int, output: HeadTail | None, buffer: bytearray, limit: int, poller, open_fds: set) -> None:  # noqa: ANN001
        """Read a (non-blocking) pipe dry into an item's output; at its end, stop polling it."""
        while fd in open_fds:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                open_fds.discard(fd)
                return
            if output is not None:
                output.feed(data)
            else:
                buffer += data[: max(limit - len(buffer), 0)]

    def stop(self, pid: int, kill: bool) -> int:
        """Reap the call's child (killing it first if asked), then everything it left running."""
        if kill:
            os.kill(pid, SIGKILL)
        _, status = os.waitpid(pid, 0)
        kill_stragglers(self)
        return status

    def serve_request(self, sock: _socket.socket, request: dict) -> dict:
        cwd = request.get("cwd") or "/work"
        self.join = [i for i in request.get("join", range(len(self.cgroup_fds))) if 0 <= i < len(self.cgroup_fds)]
        self.pids = int(request.get("pids") or 0)
        env = request.get("env") or {}
        reply: dict = {"steps": [], "files": {}}
        files = request.get("files") or {}
        shared = request.get("python")  # a batch (`map`): the function once, each step only its arguments
        try:
            write_inputs(files, cwd, self.uid, self.gid)
            if request.get("shared_child"):  # map(..., isolation="batch"): the items share one child
                reply["steps"], reply["aborted"] = self.run_shared(sock, request, shared, cwd, env)
                return reply
            for index, step in enumerate(request["steps"]):
                if request.get("isolate") and index:  # each step a call of its own: a clean slate first
                    self.clean()
                    write_inputs(files, cwd, self.uid, self.gid)
                if shared is not None and "python" in step:
                    step["python"] = {**shared, **step["python"]}
                result, aborted = self.run_step(sock, step, cwd, env)
                reply["steps"].append(result)
                if aborted:
                    reply["aborted"] = True
                    break
                if step.get("stop_on_failure") and (result["exit_code"] != 0 or result["timed_out"]):
                    break
            if not reply.get("aborted"):
                reply["files"] = read_outputs(request.get("collect") or [], cwd)
        except Exception as exc:  # noqa: BLE001 - the request failed as a whole; say why
            reply["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.clean()
        return reply

    def run_shared(self, sock: _socket.socket, request: dict, shared: dict, cwd: str, env: dict) -> tuple[list, bool]:
        """The items of a batch in sequence in one forked child (`run_batch`), results in order. An item that
        ends the child (a crash, its timeout, an OOM kill) gets that as its result and the items after it
        run in a fresh child, after the clean-up that follows every request."""
        steps, results = request["steps"], []
        while len(results) < len(steps):
            rest = steps[len(results) :]
            step = {**rest[0], "python": {**shared, "batch": [each["python"].get("args") for each in rest]}}
            done: list = []
            last, aborted = self.run_step(sock, step, cwd, env, done)
            results += done
            if aborted:
                return results, True
            if len(done) < len(rest):  # the child ended on an item: that is its result; the rest start afresh
                results.append(last)
                self.clean()
                write_inputs(request.get("files") or {}, cwd, self.uid, self.gid)
        return results, False

    def clean(self) -> None:
        """Nothing a call started, wrote or made survives it: processes, writable dirs, SysV IPC."""
        kill_stragglers(self)
        wipe(self.empty, self.pristine)
        remove_sysv_ipc(self.uid, self.gid, self.sysv)


# ------------------------------------------------------------------ Python steps (in the child)


def run_python(spec: dict) -> int:
    """Run a function (cloudpickled by the client, or named in source) and write its JSON result to fd 3."""
    try:
        fn, args, kwargs = load_call(spec)
        outcome = call_outcome(fn, args, kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure of user code is a per-call result
        outcome = failure(exc)
    flush_std()
    write_all(RESULT_FD, json.dumps(outcome).encode())
    return 0


def run_batch(spec: dict) -> int:
    """`map(..., isolation="batch")`: the items of a batch one after another in this one child, the function
    unpickled once. After each item its stdout and stderr are flushed, then its result goes to fd 3 as a
    frame (4-byte length, JSON) and it waits for a byte on GO_ON_FD: the worker cuts the item's output
    there, then lets it go on. What an item leaves (globals, files, processes) the next ones see: the
    caller chose that."""
    fn = None
    for index, item in enumerate(spec["batch"]):
        try:
            if index and not os.read(GO_ON_FD, 1):  # the worker has taken the previous item's output
                return 0
        except OSError:  # an item closed it: the rest run in a fresh child
            return 1
        try:
            if fn is None:
                fn, _, kwargs = load_call({**spec, "args": None})
            if spec.get("pickle"):
                import pickle

                args, kwargs = pickle.loads(unb64(item)) if item else ((), {})
            else:
                args = item
            outcome = call_outcome(fn, args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - the item's failure, in its place
            outcome = failure(exc)
        flush_std()
        body = json.dumps(outcome).encode()
        write_all(RESULT_FD, _LEN.pack(len(body)) + body)
    return 0


def load_call(spec: dict) -> tuple:
    """(fn, args, kwargs) of a call: unpickled, or from source (a cell's last value, or `entry`)."""
    if spec.get("pickle"):
        import pickle

        fn = pickle.loads(unb64(spec["pickle"]))
        args, kwargs = pickle.loads(unb64(spec["args"])) if spec.get("args") else ((), {})
        return fn, args, kwargs
    namespace: dict = {"__name__": "__main__"}
    entry = spec.get("entry")
    if entry is None:  # like a notebook cell: the value of a final expression is the result
        return run_cell(spec["source"], namespace), [], {}
    exec(compile(spec["source"], "<source>", "exec", dont_inherit=True), namespace)
    if entry not in namespace or not callable(namespace[entry]):
        raise NameError(f"the source defines no callable {entry!r}")
    return namespace[entry], spec.get("args") or [], spec.get("kwargs") or {}


def call_outcome(fn, args, kwargs) -> dict:  # noqa: ANN001
    """fn(*args, **kwargs) as {"ok": True, "value": JSON text}, or its failure."""
    try:
        value = fn(*args, **kwargs)
        try:
            text = json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            hint = "return dicts, lists, str, numbers, bool or None"
            raise TypeError(f"the result is not JSON data ({exc}); {hint}") from None
        return {"ok": True, "value": text}
    except BaseException as exc:  # noqa: BLE001 - every failure of user code is a per-call result
        return failure(exc)


def failure(exc: BaseException) -> dict:
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            return {"ok": True, "value": "null"}
        return {"ok": False, "type": "SystemExit", "message": f"exit code {code}", "traceback": ""}
    return {
        "ok": False,
        "type": type(exc).__name__,
        "message": str(exc)[:10000],
        "traceback": traceback.format_exc()[-20000:],
    }


def flush_std() -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def run_script(path: str, full: str) -> int:
    """`python3 <path>` without starting an interpreter: run it as __main__ in this forked child of the warm
    worker (its directory first on sys.path, argv [path]); the exit code python3 would give. `full` is
    the absolute path (the worker computed it: every object the child touches costs it a page fault)."""
    import types

    sys.argv = [path]
    sys.path[0] = os.path.dirname(full)
    # fds 0-2 are this call's pipes now. The worker's own streams (flushed before the fork, stdin never
    # read) already wrap those descriptors, text mode, stderr line-buffered with backslashreplace, as
    # python3 makes them: new ones cost ~0.5 ms and ~90 page faults per call here
    if not _wraps(sys.stdin, 0):
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if not _wraps(sys.stdout, 1):
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    if not _wraps(sys.stderr, 2):
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    code = 0
    try:
        # what runpy.run_path does for a plain file, without importing runpy and pkgutil into every child
        # (as python3 since 3.9: __file__ and the code's file name are the absolute path)
        main = types.ModuleType("__main__")
        main.__file__, main.__builtins__ = full, __builtins__
        sys.modules["__main__"] = main
        fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)  # not open(): its io objects cost ~20 page faults
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        exec(compile(b"".join(chunks), full, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as python3 does: the traceback on stderr, exit code 1
        kind, value, tb = sys.exc_info()
        user = tb
        while user is not None and user.tb_frame.f_code.co_filename not in (path, full):
            user = user.tb_next  # the user's frames only, as python3 prints them (not runpy's)
        traceback.print_exception(kind, value, user if user or isinstance(value, SyntaxError) else tb)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken pipe: nothing more to say
            pass
    return code & 0xFF


def _wraps(stream: object, fd: int) -> bool:
    try:
        return stream is not None and stream.fileno() == fd  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False


def run_cell(source: str, namespace: dict):  # noqa: ANN201
    """Execute source; return a callable giving the value of its last statement if that is an expression.

    Fast path: split at the last top-level line and compile both parts from text (an AST round trip costs
    milliseconds on a long program); anything unusual takes the exact `ast` path. Every compile of a call's
    code passes dont_inherit: this module's `from __future__ import annotations` is not the call's (under it
    a call's `f.__annotations__` held strings where python3 gives the objects).
    """
    lines = source.splitlines(keepends=True)
    last = len(lines) - 1
    while last >= 0 and (not lines[last].strip() or lines[last][0].isspace() or lines[last].startswith("#")):
        last -= 1
    if last < 0:
        exec(compile(source, "<source>", "exec", dont_inherit=True), namespace)
        return lambda: None
    try:
        tail = compile("\n" * last + "".join(lines[last:]), "<source>", "eval", dont_inherit=True)
        head = (
            compile("".join(lines[:last]), "<source>", "exec", dont_inherit=True) if last else None
        )  # a one-line cell: none
    except SyntaxError:
        return run_cell_ast(source, namespace)
    if head is not None:
        exec(head, namespace)
    value = eval(tail, namespace)
    return lambda: value


def run_cell_ast(source: str, namespace: dict):  # noqa: ANN201
    tree = compile(source, "<source>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)  # ast.parse, not inheriting
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<source>", "exec", dont_inherit=True), namespace)
    if last is None:
        return lambda: None
    value = eval(compile(ast.Expression(last.value), "<source>", "eval", dont_inherit=True), namespace)
    return lambda: value


# ------------------------------------------------------------------ main loop


def warm_up() -> None:
    """Run the Python path of a call's child here, once, on fixed inputs of the worker's own (compile and run
    a cell and an entry, unpickle and call a function when cloudpickle is loaded, encode the results).

    What a path initialises on its first use (caches, lazily made objects, first-call state of the compiler,
    pickle and json) is then part of the image every call forks, instead of being made again, in pages
    copied on write, by every call's child: ~40 page faults per call here. Nothing of a call is involved:
    the inputs are constants and every object made is garbage before the worker serves its first call."""
    specs: list[dict] = [
        {"source": "1"},
        {"source": "value = [1]\nvalue"},
        {"source": "def entry(a, b=0):\n    return {'a': a, 'b': b}\n", "entry": "entry", "args": [1], "kwargs": {}},
    ]
    cloudpickle = sys.modules.get("cloudpickle")
    try:
        if cloudpickle is not None:
            arguments = b64(cloudpickle.dumps(((1,), {})))
            specs.append({"pickle": b64(cloudpickle.dumps(lambda a: [a, 1.5, "x"])), "args": arguments})
    except Exception:  # noqa: BLE001, S110 - a cloudpickle this Python cannot use fails the calls that need it, not the start
        pass
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for spec in specs:
            try:
                fn, args, kwargs = load_call(spec)
                outcome = call_outcome(fn, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - a warm-up that fails warms less; calls are unaffected
                outcome = {"ok": False, "type": type(exc).__name__}
            write_all(null, json.dumps(outcome).encode())
    finally:
        os.close(null)


def release_free_memory() -> None:
    """Give the C heap's free pages back (malloc_trim): compiling this file and importing modules leave
    ~1.3 MB free but resident here, and every call's fork copies the page table entries of every resident
    page and its exit tears them down again. glibc only (musl has no malloc_trim: nothing to do)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (ImportError, OSError, AttributeError):
        pass


# What the node pre-imports by default (functions.PREIMPORT, PICKLED) and the worker itself: of these only
# threading and logging (imported by cloudpickle) register at-fork handlers, and those only matter to a
# process with other threads, which the worker never has.
DEFAULT_MODULES = frozenset(
    ("json", "math", "re", "collections", "itertools", "functools", "typing", "string", "heapq", "cloudpickle")
)


def call_fork(modules: list[str]):  # noqa: ANN201
    """How the worker forks calls: glibc's fork() straight (through ctypes, GIL held as os.fork holds it)
    where that is known to be equivalent, else os.fork.

    os.fork also runs CPython's after-fork re-initialisation and every handler modules registered with
    os.register_at_fork; with cloudpickle loaded (threading, logging) that costs each call's child ~180
    page faults here (228 against 51 for a bare fork, ~0.55 ms of CPU). All of it exists for processes
    with other threads (locks they might hold, thread states to drop) or state to reseed (random). So the
    bare fork only when: CPython 3.11 (the version this was checked against: later ones re-initialise
    more), only the default modules were pre-imported (a user's module may register handlers that
    matter), `random` is not loaded, and this is the only thread. A call's child is single-threaded like
    the worker, so its own forks, threads and subprocesses behave as usual.
    """
    threads = sys.modules.get("threading")
    if (
        sys.version_info[:2] != (3, 11)
        or not DEFAULT_MODULES.issuperset(modules)
        or "random" in sys.modules
        or (threads is not None and threads.active_count() != 1)
    ):
        return os.fork
    try:
        import ctypes

        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held across the call
        bare = libc.fork
    except (ImportError, OSError, AttributeError):
        return os.fork
    bare.restype, bare.argtypes = ctypes.c_int, []

    def fork() -> int:
        pid = bare()
        if pid < 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        return pid

    return fork


def become_subreaper() -> None:
    """Orphans of calls (a `Popen(..., start_new_session=True)` left running) become the worker's children,
    not the agent's: once killed, their zombies are reaped by the worker before the next call starts, where
    otherwise they lingered in /proc until the agent got round to them (a next call could see them)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (ImportError, OSError, AttributeError):
        pass


def main() -> None:
    try:
        with open("/proc/1/cmdline", "rb") as handle:
            in_sandbox = handle.read().startswith(b"/.shoal/agent")
    except OSError:
        in_sandbox = False
    if not in_sandbox:  # it kills every process it can see between calls: only ever inside a sandbox
        sys.exit("shoal function worker: refusing to run outside a shoal sandbox (PID 1 is not its agent)")
    path, uid, gid, modules = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    os.environ.pop("LD_BIND_NOW", None)  # the node set it for the worker's own start (functions._boot), not calls'
    for extra in os.environ.get("SHOAL_FN_PATH", "").split(":"):
        if extra:
            sys.path.insert(0, extra)
    failed = []
    for name in modules:
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 - a missing module is reported, not fatal
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    warm_up()
    gc.collect()
    gc.freeze()  # children never scan (and so never copy) the pages of what is imported now
    release_free_memory()
    prepare_dirs(uid, gid)
    global TMPFS  # noqa: PLW0603 - set once, before any call
    TMPFS = tmpfs_roots()
    # what every call's child gets, set once here and inherited (each call made in the child cost it
    # page faults): no core dumps, files up to MAX_FILE (the worker's own writes stay far below), umask 022
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE, MAX_FILE))
    os.umask(0o022)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    print(json.dumps({"ready": True, "python": version, "failed_imports": failed}), flush=True)
    fd, _ = listener._accept()
    sock = _socket.socket(fileno=fd)
    listener.close()
    worker = Worker(uid, gid)
    worker.fork = call_fork(modules)
    become_subreaper()
    hello, ancillary, _, _ = sock.recvmsg(2, _socket.CMSG_SPACE(16 * 4))
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
    for fd in fds:
        os.set_inheritable(fd, False)
    procs = hello[1] if len(hello) > 1 else len(fds)  # b"h" + how many are cgroup.procs; then pids.max
    worker.cgroup_fds = fds[:procs]
    if len(fds) == procs + 2:
        worker.pids_max, worker.pids_current = fds[procs], fds[procs + 1]
    while True:
        try:
            request = recv_frame(sock)
        except ConnectionError:
            return
        if request.get("abort"):  # the call it aborted had already finished
            continue
        send_frame(sock, worker.serve_request(sock, request))


if __name__ == "__main__":
    main()
