"""The unmodified, pinned `e2b` and `e2b-code-interpreter` SDKs against shoal (`shoal e2b serve`), configured
only through the SDK's own environment variables, with the server in front of a real node and in front of a
gateway over two nodes (docs/E2B.md)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import no_leftovers, until
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    TimeoutException,
)

from shoal.cluster.local import LocalCluster
from shoal.e2b.local import LocalE2B

PROJECTS = {"alice": {}, "bob": {}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, dict[str, LocalE2B]]]:
    workdir = tmp_path_factory.mktemp("e2b")
    saved = os.environ.get("SHOAL_E2B")
    os.environ["SHOAL_E2B"] = "127.0.0.1:0"  # the nodes also serve E2B's API in their own process
    try:
        lc = LocalCluster(workdir / "cluster", nodes=2, projects=PROJECTS, prefix="e2")
    finally:
        os.environ.pop("SHOAL_E2B") if saved is None else os.environ.update(SHOAL_E2B=saved)
    servers: dict[str, LocalE2B] = {}
    try:
        gateway = lc.add_gateway("--e2b", "127.0.0.1:0")  # and so does the gateway
        servers["node"] = LocalE2B(f"shoal://{lc.nodes[0].address}", workdir, "e2b-node")
        servers["gateway"] = LocalE2B(f"shoal://{gateway.address}", workdir, "e2b-gateway")
        # `shoal e2b serve --handoff`: its port handed to the node, which answers every request itself
        servers["handoff"] = LocalE2B(None, workdir, "e2b-handoff", handoff=lc.nodes[0].home / "e2b.handoff")
        lc.hosted = {  # type: ignore[attr-defined]
            "in-node": "http://" + (lc.nodes[0].home / "node.e2b").read_text().strip(),
            "in-gateway": "http://" + Path(str(gateway.addr_file) + ".e2b").read_text().strip(),
        }
        yield lc, servers
    finally:
        for server in servers.values():
            server.stop()
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


@pytest.fixture(params=["node", "gateway", "handoff"])
def e2b_env(request: pytest.FixtureRequest, cluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set to the server in front of a node or of a gateway."""
    lc, servers = cluster
    env = servers[request.param].env(lc.project_tokens["alice"])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def sbx(e2b_env: dict[str, str]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(template="base", timeout=300, envs={"FROM_CREATE": "c1"})
    yield sandbox
    try:
        sandbox.kill()
    except NotFoundException:
        pass


def test_commands_foreground_env_cwd_exit(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; echo $FROM_CREATE $PER_CMD; pwd", envs={"PER_CMD": "p2"}, cwd="/tmp")
    assert r.exit_code == 0
    assert r.stdout == "out\nc1 p2\n/tmp\n"
    assert r.stderr == "err\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; exit 3")
    assert info.value.exit_code == 3 and info.value.stdout == "partial\n"


@pytest.mark.parametrize("shape", ["json", "json-gzip", "binary"])
def test_start_in_every_connect_shape(sbx: Sandbox, e2b_env: dict[str, str], shape: str) -> None:
    """The SDK's own Start shape (Connect JSON, uncompressed) is served by e2b/connect.py; the others a Connect
    client may send (gzip-compressed, the binary codec) by connectrpc. connectrpc's own client sees the same
    events either way, and an unknown sandbox ends the stream with UNAVAILABLE (what the SDK maps to
    SandboxNotRunningException)."""
    from connectrpc.code import Code
    from connectrpc.codec import proto_binary_codec, proto_json_codec
    from connectrpc.compression.gzip import GzipCompression
    from connectrpc.errors import ConnectError
    from e2b.envd.process import process_connect, process_pb
    from protobuf import Oneof

    client = process_connect.ProcessClientSync(
        e2b_env["E2B_SANDBOX_URL"],
        codec=proto_binary_codec() if shape == "binary" else proto_json_codec(),
        send_compression=GzipCompression() if shape == "json-gzip" else None,
    )
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": e2b_env["E2B_API_KEY"]}
    config = process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo out; echo err >&2; exit 4"])
    kinds, out, err, end = [], b"", b"", None
    for message in client.start(process_pb.StartRequest(process=config), headers=headers, timeout_ms=60_000):
        event = message.event.event
        kinds.append(event.field)
        if event.field == "data":
            match event.value.output:
                case Oneof(field="stdout", value=chunk):
                    out += chunk
                case Oneof(field="stderr", value=chunk):
                    err += chunk
        elif event.field == "end":
            end = event.value
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert (out, err, end.exit_code, end.status) == (b"out\n", b"err\n", 4, "exit status 4")
    with pytest.raises(ConnectError) as info:
        node, _, key = sbx.sandbox_id.rpartition("-")
        gone = f"{node}-{'0' * len(key)}"  # well formed, but no such sandbox
        list(client.start(process_pb.StartRequest(process=config), headers={**headers, "E2b-Sandbox-Id": gone}))
    assert info.value.code == Code.UNAVAILABLE


@pytest.mark.parametrize("body", [b"\0\0\0\0\x05{nope", b"\x01\0\0\0\x02{}"])
def test_a_start_the_fast_path_does_not_take_gets_connectrpcs_answer(
    sbx: Sandbox, e2b_env: dict[str, str], body: bytes
) -> None:
    """A JSON-shaped Start that e2b/connect.py does not answer (a message that is not JSON, an envelope flagged
    compressed) goes to connectrpc with the bytes read of it already: its error ends the
    stream, as for any Connect server (not an answer to an empty body, or a hang)."""
    url = urllib.parse.urlsplit(e2b_env["E2B_SANDBOX_URL"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        headers = {
            "Content-Type": "application/connect+json",
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "X-Access-Token": e2b_env["E2B_API_KEY"],
        }
        conn.request("POST", "/process.Process/Start", body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    assert response.status == 200 and response.getheader("Content-Type") == "application/connect+json"
    assert len(data) >= 5 and data[0] == 2, data  # the end-of-stream message, with connectrpc's error
    error = json.loads(data[5:])["error"]
    # connectrpc's verdict on these bytes (before: "unary request has zero messages", it was given none)
    assert error["code"] != "unimplemented" and "zero messages" not in error.get("message", ""), error


class _SharedFile:
    """One buffered reader for every response on a socket (http.client reads each response from it, and
    closes it after each)."""

    def __init__(self, file) -> None:
        self.file = file

    def makefile(self, *_args, **_kwargs):
        return self

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def close(self) -> None:
        pass


def _start_pieces(sandbox_id: str, token: str, cmd: str) -> list[bytes]:
    """A Start as the SDK sends it: the head, the one envelope as a chunk, the chunked terminator apart."""
    message = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": False}).encode()
    envelope = b"\0" + len(message).to_bytes(4, "big") + message
    head = (
        "POST /process.Process/Start HTTP/1.1\r\nHost: e2b\r\nContent-Type: application/connect+json\r\n"
        f"Connect-Protocol-Version: 1\r\nE2b-Sandbox-Id: {sandbox_id}\r\nX-Access-Token: {token}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    return [head, b"%x\r\n%b\r\n" % (len(envelope), envelope), b"0\r\n\r\n"]


def _stdout_of_start(data: bytes) -> str:
    out, ended = b"", False
    while data:
        flags, size = data[0], int.from_bytes(data[1:5], "big")
        message, data = json.loads(data[5 : 5 + size]), data[5 + size :]
        if flags == 2:
            assert "error" not in message, message
            ended = True
        elif "data" in message["event"]:
            out += base64.b64decode(message["event"]["data"].get("stdout", ""))
    assert ended
    return out.decode()


def test_a_kept_connection_mixes_starts_answered_by_front_with_aiohttps_requests(
    sbx: Sandbox, e2b_env: dict[str, str]
) -> None:
    """e2b/front.py answers a connection's Starts itself once the connection's key was accepted (by aiohttp,
    which answers its first request), hands every other request to aiohttp byte for byte (a chunked upload
    whose chunk lines arrive split), and answers pipelined requests in order."""
    url = urllib.parse.urlsplit(e2b_env["E2B_SANDBOX_URL"])
    token, sid = e2b_env["E2B_API_KEY"], sbx.sandbox_id
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    reader = _SharedFile(sock.makefile("rb"))

    def answer() -> tuple[http.client.HTTPResponse, bytes]:
        response = http.client.HTTPResponse(reader)  # type: ignore[arg-type]
        response.begin()
        return response, response.read()

    try:
        for cmd, by_aiohttp in (("echo one", True), ("echo two", False)):
            for piece in _start_pieces(sid, token, cmd):
                sock.sendall(piece)
                time.sleep(0.01)
            response, data = answer()
            assert response.status == 200 and _stdout_of_start(data) == cmd[5:] + "\n"
            assert ("aiohttp" in (response.getheader("Server") or "")) is by_aiohttp, response.getheaders()
        payload = os.urandom(3000)
        upload = (
            f"POST /files?path=/tmp/front.bin HTTP/1.1\r\nHost: e2b\r\nE2b-Sandbox-Id: {sid}\r\n"
            f"X-Access-Token: {token}\r\nContent-Type: application/octet-stream\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode() + b"".join(b"%x;ext=1\r\n%b\r\n" % (len(p), p) for p in (payload[:1000], payload[1000:]))
        upload += b"0\r\nX-Trailer: t\r\n\r\n"
        for i in range(0, len(upload), 777):  # chunk-size lines and CRLFs split across sends
            sock.sendall(upload[i : i + 777])
            time.sleep(0.005)
        response, data = answer()
        assert response.status == 200 and json.loads(data)[0]["path"] == "/tmp/front.bin", data
        for piece in _start_pieces(sid, token, "sha256sum < /tmp/front.bin | cut -c1-64"):
            sock.sendall(piece)
        _, data = answer()
        assert _stdout_of_start(data) == hashlib.sha256(payload).hexdigest() + "\n"
        # pipelined: a request aiohttp answers, then two Starts, in one send: three answers, in order
        health = f"GET /health HTTP/1.1\r\nHost: e2b\r\nE2b-Sandbox-Id: {sid}\r\nX-Access-Token: {token}\r\n\r\n"
        sock.sendall(
            health.encode()
            + b"".join(_start_pieces(sid, token, "echo p1"))
            + b"".join(_start_pieces(sid, token, "echo p2"))
        )
        assert answer()[0].status == 204
        assert _stdout_of_start(answer()[1]) == "p1\n"
        assert _stdout_of_start(answer()[1]) == "p2\n"
        for piece in _start_pieces(sid, token, "echo after"):  # the connection still serves
            sock.sendall(piece)
        assert _stdout_of_start(answer()[1]) == "after\n"
    finally:
        sock.close()


def test_a_handed_off_port_is_the_nodes_until_its_serve_stops(cluster, tmp_path: Path) -> None:
    """`shoal e2b serve --handoff` hands its listening socket to the node: the node answers on it (commands
    run with no serve process on their path), and the port closes when that process stops, though the
    node has started processes since (the launcher) that must not have inherited it."""
    lc, _ = cluster
    server = LocalE2B(None, tmp_path, "e2b-handoff-stop", handoff=lc.nodes[0].home / "e2b.handoff")
    url = urllib.parse.urlsplit(server.url)
    try:
        sandbox = Sandbox.create(
            template="base", timeout=120, api_url=server.url, sandbox_url=server.url, api_key=lc.project_tokens["alice"]
        )
        try:
            assert sandbox.commands.run("echo handed").stdout == "handed\n"
        finally:
            sandbox.kill()
    finally:
        server.stop()

    def refused() -> bool:  # the node closes it once it sees the hand-off connection end
        try:
            socket.create_connection((url.hostname, url.port), timeout=10).close()
        except ConnectionRefusedError:
            return True
        return False

    until(refused, timeout=30)


def test_commands_streaming_callbacks(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    r = sbx.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; done", on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "o1\no2\no3\n" == r.stdout
    assert "".join(err) == "e1\ne2\ne3\n" == r.stderr


def test_commands_timeout(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 60", timeout=1)
    assert time.monotonic() - started < 50  # not the sleep's full minute (a generous bound, not a timing claim)
    # the timed-out command was killed, not left running in the sandbox
    count_sleepers = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -cx 60 || true"
    until(lambda: sbx.commands.run(count_sleepers).stdout.strip() == "0")


def test_background_list_connect_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo started; touch /tmp/bg; sleep 120", background=True, timeout=0)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    listed = next(p for p in sbx.commands.list() if p.pid == handle.pid)
    assert listed.cmd == "/bin/bash" and listed.args[-1] == "echo started; touch /tmp/bg; sleep 120"
    # a second client attaches to the running command
    attached = sbx.commands.connect(handle.pid)
    until(lambda: sbx.files.exists("/tmp/bg"))
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        attached.wait()
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.stdout == "started\n"
    until(lambda: handle.pid not in [p.pid for p in sbx.commands.list()])
    assert sbx.commands.kill(handle.pid) is False  # gone


def test_stdin(sbx: Sandbox) -> None:
    handle = sbx.commands.run("while read -r line; do echo got:$line; done; echo eof", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "one\n")
    handle.send_stdin("two\nthree\n")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "got:one\ngot:two\ngot:three\neof\n"
    with pytest.raises(SandboxException):  # a command started without stdin=True has none to write to
        sbx.commands.send_stdin(sbx.commands.run("sleep 30", background=True).pid, "x")


def test_pty_create_input_resize_connect_kill(sbx: Sandbox) -> None:
    """sandbox.pty on shoal's PTYs (docs/PROCESSES.md): a login bash on a terminal that follows resizes."""
    term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    sbx.pty.send_stdin(term.pid, b"stty size; echo term=$TERM\n")
    events, seen = iter(term), b""
    while b"term=xterm-256color" not in seen:
        _, _, chunk = next(events)
        seen += chunk or b""
    assert b"24 80" in seen
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=132))
    sbx.pty.send_stdin(term.pid, b"stty size; exit 0\n")
    for _, _, chunk in events:
        seen += chunk or b""
    assert b"40 132" in seen and term.wait().exit_code == 0
    # another terminal: a second client connects to it, and a kill ends it
    other = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    attached = sbx.pty.connect(other.pid, timeout=0)
    sbx.pty.send_stdin(other.pid, b"echo from-the-other\n")
    seen = b""
    for _, _, chunk in attached:
        seen += chunk or b""
        if b"from-the-other\r\n" in seen.replace(b"echo from-the-other", b""):
            break
    assert sbx.pty.kill(other.pid) is True
    with pytest.raises(CommandExitException):
        other.wait()
    assert sbx.pty.kill(other.pid) is False  # gone


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("/work/dir/a.txt", "hello")
    assert info.path == "/work/dir/a.txt" and info.name == "a.txt"
    assert sbx.files.read("/work/dir/a.txt") == "hello"
    payload = bytes(range(256)) * 64
    sbx.files.write("/work/dir/blob.bin", payload)
    assert bytes(sbx.files.read("/work/dir/blob.bin", format="bytes")) == payload
    assert sbx.files.make_dir("/work/dir/sub") is True
    assert sbx.files.make_dir("/work/dir/sub") is False  # already there
    sbx.files.write("/work/dir/sub/deep.txt", "d")
    names = {e.name: e for e in sbx.files.list("/work/dir")}
    assert set(names) == {"a.txt", "blob.bin", "sub"}
    assert names["blob.bin"].size == len(payload) and names["sub"].type.value == "dir"
    assert {e.path for e in sbx.files.list("/work/dir", depth=2)} >= {"/work/dir/sub/deep.txt"}
    assert sbx.files.get_info("/work/dir/a.txt").size == 5
    moved = sbx.files.rename("/work/dir/a.txt", "/work/dir/b.txt")
    assert moved.path == "/work/dir/b.txt" and not sbx.files.exists("/work/dir/a.txt")
    sbx.files.remove("/work/dir/sub")
    assert not sbx.files.exists("/work/dir/sub")
    with pytest.raises(NotFoundException):
        sbx.files.read("/work/dir/missing.txt")
    # the files are the command's files
    assert sbx.commands.run("cat /work/dir/b.txt").stdout == "hello"
    # larger than the layer's write pieces (8 MiB): streamed into the sandbox in order, not held whole
    big = os.urandom(1 << 20) * 19 + b"tail"
    sbx.files.write("/work/big.bin", big)
    assert sbx.commands.run("sha256sum /work/big.bin").stdout.split()[0] == hashlib.sha256(big).hexdigest()
    written = sbx.files.write_files([{"path": "/work/m/1.txt", "data": "one"}, {"path": "/work/m/2.txt", "data": b"2"}])
    assert sorted(w.path for w in written) == ["/work/m/1.txt", "/work/m/2.txt"]
    assert sbx.commands.run("cat /work/m/1.txt /work/m/2.txt").stdout == "one2"


def test_files_watch(sbx: Sandbox) -> None:
    sbx.files.make_dir("/work/w")
    handle = sbx.files.watch_dir("/work/w")
    try:
        sbx.files.write("/work/w/new.txt", "x")
        events = until(lambda: [e for e in handle.get_new_events() if e.name == "new.txt"])
        assert events[0].type.name == "CREATE"
        sbx.commands.run("rm /work/w/new.txt")
        until(lambda: [e for e in handle.get_new_events() if e.type.name == "REMOVE"])
    finally:
        handle.stop()


def test_lifecycle_timeout_info_list_pause_connect(sbx: Sandbox, e2b_env: dict[str, str]) -> None:
    tag = os.urandom(4).hex()
    other = Sandbox.create(metadata={"suite": "e2b", "tag": tag}, timeout=120)
    try:
        info = other.get_info()
        assert info.metadata == {"suite": "e2b", "tag": tag} and info.template_id == "base"
        other.set_timeout(600)
        assert other.get_info().end_at.timestamp() > time.time() + 500
        found = Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()
        assert [s.sandbox_id for s in found] == [other.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": "nope" + tag})).next_items() == []
        other.commands.run("echo kept > /work/state")
        other.pause()
        assert other.get_info().state.value == "paused"
        # a new process (the creating client gone) connects, which resumes it, and sees its files
        code = (
            "from e2b import Sandbox; import sys; s = Sandbox.connect(sys.argv[1]);"
            "print(s.commands.run('cat /work/state').stdout, end='')"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, other.sandbox_id],
            env={**os.environ, **e2b_env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout == "kept\n"
        assert other.get_info().state.value == "running"
    finally:
        other.kill()
    with pytest.raises(NotFoundException):
        other.get_info()
    assert not other.is_running()
    assert Sandbox.kill(other.sandbox_id) is False  # already gone
    with pytest.raises(SandboxNotRunningException):  # E2B's answer for in-sandbox calls to a gone sandbox
        other.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        other.files.read("/work/state")
    assert other.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_get_metrics_from_usage(sbx: Sandbox) -> None:
    """get_metrics() is one sample now from the sandbox's cgroup (shoal's usage operation)."""
    sbx.commands.run("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    (metric,) = sbx.get_metrics()
    assert metric.cpu_count == 1 and metric.mem_total == 512 << 20
    assert metric.mem_used > 0 and 0 < metric.cpu_used_pct <= 100
    assert abs(metric.timestamp.timestamp() - time.time()) < 600
    assert Sandbox.get_metrics(sbx.sandbox_id, end=datetime.datetime.fromtimestamp(time.time() - 3600)) == []
    sbx.kill()
    with pytest.raises(SandboxException):  # NotFound for a sandbox that is gone
        sbx.get_metrics()


def test_auth_projects_and_templates(sbx: Sandbox, cluster, e2b_env: dict[str, str]) -> None:
    lc, _servers = cluster
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-shoal-token")
    bob = lc.project_tokens["bob"]
    with pytest.raises(NotFoundException):  # alice's sandbox does not exist for bob
        Sandbox.connect(sbx.sandbox_id, api_key=bob)
    assert Sandbox.kill(sbx.sandbox_id, api_key=bob) is False  # E2B's answer for a sandbox it cannot find
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=bob).next_items()]
    assert sbx.is_running()
    with pytest.raises(SandboxException) as info:
        Sandbox.create(template="no-such-template")
    assert "no-such-template" in str(info.value) and "debian" in str(info.value)


def test_each_request_on_a_kept_connection_is_checked_with_its_own_key(sbx: Sandbox, cluster, e2b_env) -> None:
    """The server lets a connection's later requests with the key it accepted go straight on; any other key on
    that connection is still checked: a bad one is refused, another project's finds no sandbox."""
    lc, _servers = cluster
    url = urllib.parse.urlsplit(e2b_env["E2B_SANDBOX_URL"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:

        def health(key: str) -> int:
            conn.request("GET", "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": key})
            response = conn.getresponse()
            response.read()
            return response.status

        alice = e2b_env["E2B_API_KEY"]
        assert [health(alice), health(alice)] == [204, 204]
        assert health("not-a-shoal-token") == 401
        assert health(lc.project_tokens["bob"]) == 502  # E2B's proxy answer: no such sandbox (for bob)
        assert health(alice) == 204
    finally:
        conn.close()


def test_async_sandbox(e2b_env: dict[str, str]) -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create(timeout=120, metadata={"kind": "async"})
        try:
            seen: list[str] = []
            r = await sbx.commands.run("echo $X; cd /tmp && pwd", envs={"X": "y"}, on_stdout=seen.append)
            assert r.stdout == "y\n/tmp\n" == "".join(seen)
            with pytest.raises(TimeoutException):
                await sbx.commands.run("sleep 60", timeout=1)
            handle = await sbx.commands.run("sleep 120", background=True, timeout=0)
            assert await sbx.commands.kill(handle.pid)
            with pytest.raises(CommandExitException):
                await handle.wait()
            typed = await sbx.commands.run("head -c 5", background=True, stdin=True)
            await sbx.commands.send_stdin(typed.pid, b"bytes and more")
            assert (await typed.wait()).stdout == "bytes"
            await sbx.files.write("/work/a.bin", b"\x00\x01bytes")
            assert bytes(await sbx.files.read("/work/a.bin", format="bytes")) == b"\x00\x01bytes"
            assert [e.name for e in await sbx.files.list("/work")] == ["a.bin"]
            await sbx.files.write("rel.txt", "relative")  # relative to the working directory, listed absolute
            assert "/rel.txt" in [e.path for e in await sbx.files.list(".")]
            await sbx.files.make_dir("/work/d")
            events: list = []
            watch = await sbx.files.watch_dir("/work/d", on_event=events.append)
            await sbx.files.write("/work/d/f", "1")
            for _ in range(600):
                if any(e.name == "f" for e in events):
                    break
                await asyncio.sleep(0.05)
            await watch.stop()
            assert any(e.name == "f" and e.type.name == "CREATE" for e in events)
            await sbx.files.remove("/work/a.bin")
            assert not await sbx.files.exists("/work/a.bin")
            await sbx.set_timeout(200)
            await sbx.pause()
            again = await AsyncSandbox.connect(sbx.sandbox_id)
            assert (await again.commands.run("ls /work")).stdout == "d\n"
            listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"kind": "async"})).next_items()
            assert sbx.sandbox_id in [s.sandbox_id for s in listed]
        finally:
            await sbx.kill()
        assert not await AsyncSandbox.list(query=SandboxQuery(metadata={"kind": "async"})).next_items()

    asyncio.run(main())


def test_code_interpreter_run_code(e2b_env: dict[str, str]) -> None:
    from e2b_code_interpreter import Sandbox as CodeSandbox

    with CodeSandbox.create(timeout=120) as sbx:
        assert sbx.run_code("1+1").text == "2"
        sbx.run_code("x = 40")  # a kernel: state persists between calls
        execution = sbx.run_code("print('side'); x + 2")
        assert execution.text == "42" and execution.logs.stdout == ["side\n"]
        failed = sbx.run_code("1/0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        context = sbx.create_code_context(cwd="/tmp")  # a second kernel, with its own state
        assert sbx.run_code("import os; os.getcwd()", context=context).text == "'/tmp'"
        assert sbx.run_code("'x' in dir()", context=context).text == "False"
        sbx.restart_code_context(context)
        sbx.remove_code_context(context)


@pytest.mark.parametrize("where", ["in-node", "in-gateway"])
def test_served_inside_node_and_gateway(where: str, cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHOAL_E2B on a node / `--e2b` on a gateway: the same API from their own process, no extra server."""
    lc, _servers = cluster
    url = lc.hosted[where]
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", lc.project_tokens["alice"])
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-shoal-token")
    sbx = Sandbox.create(metadata={"where": where})
    try:
        assert sbx.commands.run("echo $0 ok", envs={}).stdout.endswith("ok\n")
        sbx.files.write("/work/x", b"\x00bytes")
        assert bytes(sbx.files.read("/work/x", format="bytes")) == b"\x00bytes"
        assert [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"where": where})).next_items()] == [
            sbx.sandbox_id
        ]
    finally:
        sbx.kill()
    assert not sbx.is_running()


def test_get_host_reaches_a_port_in_the_sandbox(sbx: Sandbox, cluster, e2b_env: dict[str, str]) -> None:
    """`get_host(port)` as E2B's docs use it (`f"http://{sbx.get_host(8000)}"`) reaches a server in the sandbox
    through the node's or gateway's relay (no wildcard DNS: the key rides in the URL's user part)."""
    import httpx

    sbx.files.write("/srv/hello.txt", "hello e2b")
    sbx.commands.run("cd /srv && python3 -m http.server 8000 --bind 127.0.0.1", background=True)
    host = sbx.get_host(8000)
    assert host.startswith(f"8000-{sbx.sandbox_id}.")

    def fetch(url: str) -> httpx.Response | None:
        answer = httpx.get(url, timeout=30)
        return answer if answer.status_code != 502 else None  # 502 until the server listens

    answer = until(lambda: fetch(f"http://{host}/hello.txt"), timeout=120)
    assert answer.status_code == 200 and answer.text == "hello e2b"
    key = host.partition("@")[0].rpartition(".")[2]
    relay = host.partition("@")[2]
    wrong = f"http://8000-{sbx.sandbox_id}.{'0' * len(key)}@{relay}/hello.txt"
    assert httpx.get(wrong, timeout=30).status_code == 401
    assert httpx.get(f"http://{relay}/ports/{sbx.sandbox_id}/8000/hello.txt", timeout=30).status_code == 401
    sbx.kill()
    assert httpx.get(f"http://{host}/hello.txt", timeout=30).status_code == 404
