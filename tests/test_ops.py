"""The operation table (shoal/ops.py) against real nodes and gateways.

Every operation of the table is called through each way in: a node's Unix socket, a node's TCP port with a
project token, a gateway with a project token, and a gateway with the cluster token (for admin operations).
None may answer "unknown operation"; each either works or raises the precise typed error the table implies
(an admin operation with a project token: AuthenticationError; a gateway operation on a node: "served by a
gateway"). Then trajectories across nodes and gateways: a trainer killed mid-episode comes back through
another gateway with the same trajectory name and gets its sandbox and its logged results back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import no_leftovers

import shoal
from shoal import ops
from shoal.client.functions import _payload
from shoal.cluster.auth import CLUSTER_ROLE, Tokens
from shoal.cluster.gateway import Gateway
from shoal.cluster.local import LocalCluster
from shoal.node.service import NodeService
from shoal.protocol import SandboxSpec
from shoal.tasks import TaskOwner

TRANSPORTS = ("unix", "node-tcp", "gateway", "gateway-admin")
PROJECT = "p1"


def _wait_healthy(address: str, token: str, count: int, timeout: float = 30.0) -> None:
    with shoal.Client(f"shoal://{address}", token=token) as c:
        deadline = time.monotonic() + timeout
        while True:
            status = c.call("cluster_status", {})
            if sum(n["healthy"] for n in status["nodes"].values()) >= count:
                return
            assert time.monotonic() < deadline, f"nodes did not come up: {status}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("ops"), nodes=2, projects={PROJECT: {}, "p2": {}}, prefix="to")
    try:
        lc.add_gateway()
        lc.add_gateway()
        for gw in lc.gateways:
            _wait_healthy(gw.address, lc.cluster_token, 2)
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def _connect(lc: LocalCluster, transport: str) -> shoal.Client:
    node = lc.nodes[0]
    if transport == "unix":
        return shoal.Client(home=str(node.home), autostart=False)
    if transport == "node-tcp":
        return shoal.Client(f"shoal://{node.address}", token=lc.project_tokens[PROJECT])
    token = lc.cluster_token if transport == "gateway-admin" else lc.project_tokens[PROJECT]
    return shoal.Client(f"shoal://{lc.gateways[0].address}", token=token)


@pytest.fixture(scope="module")
def ways(cluster: LocalCluster) -> Iterator[dict[str, tuple[shoal.Client, str | None]]]:
    """Per transport: a client and a sandbox of its own (the admin transport has none: it runs admin ops)."""
    out: dict[str, tuple[shoal.Client, str | None]] = {}
    try:
        for transport in TRANSPORTS:
            client = _connect(cluster, transport)
            sandbox = None
            if transport != "gateway-admin":
                sandbox = client.create(image="busybox", pool=False, ttl_s=900, labels={"ops": transport}).id
            out[transport] = (client, sandbox)
        yield out
    finally:
        for client, sandbox in out.values():
            if sandbox is not None:
                client.kill(sandbox)
        if "unix" in out:  # every image the operations made was removed again
            assert [n for n in out["unix"][0].images() if "ops-" in n] == []
        for client, _ in out.values():
            client.close()


# ---------------------------------------------------------------- arguments for each operation

NOWHERE = {"ops-test": "matches-nothing"}


def _fresh(client: shoal.Client) -> str:
    return client.create(image="busybox", pool=False, ttl_s=300).id


def _tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    return buffer.getvalue()


def _written(client: shoal.Client, sb: str) -> str:
    client.call("file_write", {"sandbox_id": sb, "path": "/tmp/ops-read.txt", "data": b"read me"})
    return "/tmp/ops-read.txt"


def _made(client: shoal.Client, sb: str) -> str:
    client.call("file_mkdir", {"sandbox_id": sb, "path": "/tmp/ops-gone/a"})
    return "/tmp/ops-gone"


def _shell(client: shoal.Client, sb: str) -> str:
    return client.call("shell_open", {"sandbox_id": sb})


def _proc(client: shoal.Client, sb: str, cmd: str, pty: dict[str, int] | None = None) -> int:
    return client.call("proc_start", {"sandbox_id": sb, "cmd": cmd, "pty": pty})["id"]


Args = Callable[[shoal.Client, str, dict[str, Any]], dict[str, Any]]
ARGS: dict[str, Args] = {
    "auth": lambda c, sb, x: {"token": x["token"]},
    "hello": lambda c, sb, x: {},
    "status": lambda c, sb, x: {},
    "cluster_status": lambda c, sb, x: {},
    "metrics": lambda c, sb, x: {},
    "settings_env": lambda c, sb, x: {},
    "cluster_nodes": lambda c, sb, x: {"nodes": x["nodes"]},
    "trajectory_find": lambda c, sb, x: {"target": sb},
    "create": lambda c, sb, x: {"spec": {"image": "busybox", "pool": False, "ttl_s": 120}},
    "get": lambda c, sb, x: {"sandbox_id": sb},
    "attach": lambda c, sb, x: {"target": sb},
    "list": lambda c, sb, x: {"labels": {"ops": x["transport"]}},
    "kill": lambda c, sb, x: {"sandbox_id": _fresh(c)},
    "close_all": lambda c, sb, x: {"labels": NOWHERE},
    "keepalive": lambda c, sb, x: {"sandbox_id": sb, "ttl_s": 900},
    "processes": lambda c, sb, x: {"sandbox_id": sb},
    "usage": lambda c, sb, x: {"sandbox_id": sb},
    "kill_processes": lambda c, sb, x: {"sandbox_id": sb, "exec_id": 999999},  # no such exec: kills nothing
    "pause": lambda c, sb, x: {"sandbox_id": sb},
    "resume": lambda c, sb, x: {"sandbox_id": sb},
    "pause_all": lambda c, sb, x: {"labels": NOWHERE},
    "resume_all": lambda c, sb, x: {"labels": NOWHERE},
    "expose": lambda c, sb, x: {"sandbox_id": sb, "port": 8000},
    "set_network": lambda c, sb, x: {"sandbox_id": sb, "network": "none"},
    "exec": lambda c, sb, x: {"req": {"sandbox_id": sb, "cmd": "echo ops"}},
    "proc_start": lambda c, sb, x: {"sandbox_id": sb, "cmd": "echo ops"},
    "proc_read": lambda c, sb, x: {"sandbox_id": sb, "id": _proc(c, sb, "echo ops"), "follow": True, "timeout": 60},
    "proc_input": lambda c, sb, x: {"sandbox_id": sb, "id": _proc(c, sb, "cat"), "data": b"ops", "eof": True},
    "proc_signal": lambda c, sb, x: {"sandbox_id": sb, "id": _proc(c, sb, "sleep 300"), "signal": 9},
    "proc_resize": lambda c, sb, x: {
        "sandbox_id": sb,
        "id": _proc(c, sb, "sleep 300", {"cols": 80, "rows": 24}),
        "cols": 100,
        "rows": 30,
    },
    "proc_list": lambda c, sb, x: {"sandbox_id": sb},
    "file_write": lambda c, sb, x: {"sandbox_id": sb, "path": "/tmp/ops.txt", "data": b"ops"},
    "file_untar": lambda c, sb, x: {"sandbox_id": sb, "path": "/tmp/ops-untar", "data": _tar()},
    "file_read": lambda c, sb, x: {"sandbox_id": sb, "path": _written(c, sb)},
    "file_list": lambda c, sb, x: {"sandbox_id": sb, "path": "/etc"},
    "file_stat": lambda c, sb, x: {"sandbox_id": sb, "path": "/etc"},
    "file_mkdir": lambda c, sb, x: {"sandbox_id": sb, "path": "/tmp/ops-dir"},
    "file_remove": lambda c, sb, x: {"sandbox_id": sb, "path": _made(c, sb), "recursive": True},
    "shell_open": lambda c, sb, x: {"sandbox_id": sb},
    "shell_run": lambda c, sb, x: {"shell_id": _shell(c, sb), "cmd": "echo ops"},
    "shell_close": lambda c, sb, x: {"shell_id": _shell(c, sb)},
    "sandbox_snapshot": lambda c, sb, x: {"sandbox_id": sb, "name": f"ops-snap-{x['transport']}"},
    "gui": lambda c, sb, x: {"sandbox_id": sb, "action": "screenshot"},
    "log_steps": lambda c, sb, x: {"target": sb},
    "replay": lambda c, sb, x: {"target": sb},
    "vm_snapshot": lambda c, sb, x: {"sandbox_id": sb},
    "vm_snapshot_delete": lambda c, sb, x: {"snapshot_id": "snap-000000000000"},
    "fork": lambda c, sb, x: {"sandbox_id": sb},
    "fn_call": lambda c, sb, x: {
        "spec": {"kind": "function", "image": "debian"},
        "call": _payload("6*7", (), None, None),
    },
    "fn_map": lambda c, sb, x: {
        "spec": {"kind": "function", "image": "debian"},
        "call": {"source": "def f(x):\n    return x * 7", "entry": "f"},
        "items": [[1], [6]],
    },
    "fn_run_code": lambda c, sb, x: {"spec": {"kind": "function", "image": "debian"}, "code": "print(6*7)"},
    "pool_set": lambda c, sb, x: {"spec": {"image": "busybox"}, "size": 0},
    "image_list": lambda c, sb, x: {},
    "image_ls": lambda c, sb, x: {},
    "image_inspect": lambda c, sb, x: {"name": "busybox"},
    "image_build": lambda c, sb, x: {"name": "busybox"},
    "image_rm": lambda c, sb, x: {"name": "ops-no-such-image"},
    "image_prune": lambda c, sb, x: {},
    "image_tag": lambda c, sb, x: {"source": "busybox", "target": f"ops-tag-{x['transport']}"},
    "image_squash": lambda c, sb, x: {"name": "busybox", "target": f"ops-squash-{x['transport']}"},
    "image_import": lambda c, sb, x: {"path": str(x["tmp"] / "no-such-layout")},
    "image_import_disk": lambda c, sb, x: {"path": str(x["tmp"] / "no-such-disk"), "name": "ops-disk"},
    "image_export": lambda c, sb, x: {"name": "busybox", "path": str(x["tmp"] / f"busybox-{x['transport']}.tar")},
    "image_pull": lambda c, sb, x: {"reference": "127.0.0.1:1/ops/none:latest"},
    "image_push": lambda c, sb, x: {"name": "busybox", "reference": "127.0.0.1:1/ops/busybox:latest"},
}
# what an operation raises whatever the transport (the arguments above ask for it on purpose)
RAISES: dict[str, type[Exception]] = {
    "vm_snapshot": shoal.InvalidRequestError,  # a container has no memory snapshot
    "fork": shoal.InvalidRequestError,
    "gui": shoal.NoScreenError,  # the sandbox here has no screen (tests/test_gui.py drives a desktop)
    "image_rm": shoal.NotFoundError,
    "image_import": shoal.ShoalError,
    "image_import_disk": shoal.InvalidRequestError,  # the path names no file (tests/test_agentless.py imports one)
    "image_pull": shoal.ImageError,  # nothing listens on port 1
    "image_push": shoal.ImageError,
}
CLEANUP = {"image_tag": "target", "image_squash": "target", "sandbox_snapshot": "name"}


def _expected(op: ops.Op, transport: str) -> type[Exception] | None:
    if op.route == ops.GATEWAY and transport in ("unix", "node-tcp"):
        return shoal.InvalidRequestError  # "served by a gateway, not by a node"
    if op.access == ops.CLUSTER and transport in ("node-tcp", "gateway"):
        return shoal.AuthenticationError
    if op.name == "vm_snapshot_delete" and transport in ("node-tcp", "gateway"):
        return shoal.NotFoundError  # not a snapshot of the project's (on the Unix socket: nothing to delete)
    return RAISES.get(op.name)


@pytest.mark.fast
def test_every_operation_has_arguments_here() -> None:
    assert set(ARGS) == set(ops.OPS)


CASES = [
    (name, transport)
    for name, op in ops.OPS.items()
    for transport in TRANSPORTS
    # the cluster token is for admin and gateway operations; the others go through "gateway" with a project's
    if transport != "gateway-admin" or op.access == ops.CLUSTER or op.route == ops.GATEWAY
]


@pytest.mark.parametrize(("name", "transport"), CASES)
def test_every_operation_through_every_way_in(
    cluster: LocalCluster, ways: dict, tmp_path_factory: pytest.TempPathFactory, name: str, transport: str
) -> None:
    op = ops.OPS[name]
    client, sandbox = ways[transport]
    if sandbox is None:
        sandbox = ways["unix"][1]
    context = {
        "transport": transport,
        "tmp": tmp_path_factory.getbasetemp(),
        "nodes": cluster.node_map(),
        "token": cluster.cluster_token if transport == "gateway-admin" else cluster.project_tokens[PROJECT],
    }
    args = ARGS[name](client, sandbox, context)
    expected = _expected(op, transport)
    try:
        result = client.call(name, args)
    except shoal.ShoalError as exc:
        assert "unknown operation" not in str(exc)
        assert expected is not None and isinstance(exc, expected), f"{name} via {transport}: {exc!r}"
        if expected is shoal.InvalidRequestError and op.route == ops.GATEWAY:
            assert "served by a gateway" in str(exc)
        return
    finally:
        if name in CLEANUP:
            made = args[CLEANUP[name]]  # a project's images live in its namespace on the node (cluster/tenancy.py)
            made = made if transport in ("unix", "gateway-admin") else f"@{PROJECT}/{made}"
            with contextlib.suppress(shoal.NotFoundError):
                ways["unix"][0].call("image_rm", {"name": made})
    assert expected is None, f"{name} via {transport} should have raised {expected.__name__}, returned {result!r}"
    if name == "create":
        client.kill(result["id"])
    if name == "replay":
        assert result["source"] == sandbox and result["sandbox_id"] != sandbox
    if name == "exec":
        assert result["stdout"] == b"ops\n"
    if name == "usage":
        assert result["memory_bytes"] > 0 and result["pids"] >= 1 and result["cpu_s"] >= 0, result
    if name == "file_read":
        assert result == b"read me"
    if name == "proc_read":
        assert (result["stdout"], result["running"], result["exit_code"]) == (b"ops\n", False, 0), result
    if name == "proc_resize":  # the terminal's process stays for the sandbox's end; this one is not wanted
        client.call("proc_signal", {"sandbox_id": sandbox, "id": args["id"], "signal": 9})
    if name == "fn_call":
        assert result["ok"] and json.loads(result["value"]) == 42, result
    if name == "fn_map":
        assert [json.loads(each["value"]) for each in result] == [7, 42], result
    if name == "fn_run_code":
        assert result["status"] == "ok" and result["run"]["stdout"] == b"42\n", result
    if name == "trajectory_find":
        assert [row["sandbox_id"] for row in result] == [sandbox]


@pytest.mark.fast
def test_every_operation_is_in_the_developers_guide() -> None:
    guide = (Path(__file__).parents[1] / "docs" / "DEVELOPING.md").read_text()
    assert [name for name in ops.OPS if f"| `{name}` |" not in guide] == []


@pytest.mark.fast
def test_the_node_implements_the_table() -> None:
    """Each node operation is a NodeService method with exactly the table's parameters and defaults."""
    for name in ops.NODE_OPS:
        op = ops.OPS[name]
        params = inspect.signature(getattr(NodeService, name)).parameters
        declared = {k: v.default for k, v in params.items() if k not in ("self", "emit")}
        fields = op.request.__struct_fields__
        defaults = dict(zip(fields[len(fields) - len(op.request.__struct_defaults__) :],
                            op.request.__struct_defaults__, strict=True))  # fmt: skip
        table = {k: defaults.get(k, inspect.Parameter.empty) for k in fields}
        assert declared == table, name
        assert ("emit" in params) == op.streams, name


@pytest.mark.fast
def test_create_is_typed_like_the_spec() -> None:
    """`create` names every SandboxSpec field as a typed keyword (no **options), in both clients."""
    for create in (shoal.AsyncClient.create, shoal.Client.create):
        params = inspect.signature(create).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
        assert set(params) - {"self"} == set(SandboxSpec.__struct_fields__)
    assert list(inspect.signature(shoal.Client.create).parameters) == list(
        inspect.signature(shoal.AsyncClient.create).parameters
    )
    doc = shoal.AsyncClient.create.__doc__ or ""
    assert all(f"{name}:" in doc for name in SandboxSpec.__struct_fields__)


def test_http_generic_route_and_generated_openapi(cluster: LocalCluster, ways: dict) -> None:
    gw = cluster.gateways[1]
    sandbox = ways["gateway"][1]

    def post(path: str, body: object) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://{gw.http}{path}", data=json.dumps(body).encode(), method="POST")
        req.add_header("Authorization", f"Bearer {cluster.project_tokens[PROJECT]}")
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, result = post("/v1/ops/exec", {"req": {"sandbox_id": sandbox, "cmd": "cat", "stdin": "aGk="}})
    assert status == 200 and base64.b64decode(result["stdout"]) == b"hi", result
    assert post("/v1/ops/get", {"sandbox_id": sandbox})[1]["id"] == sandbox
    assert post("/v1/ops/log_steps", {"target": sandbox})[0] == 200
    status, error = post("/v1/ops/nonsense", {})
    assert status == 400 and "unknown operation" in error["message"]
    assert post("/v1/ops/get", {"sandbox_id": sandbox, "bogus": 1})[0] == 400
    assert post("/v1/ops/image_prune", {})[0] == 401  # admin only
    assert post("/v1/ops/get", {"sandbox_id": "to1-000000000000"})[0] == 404
    with urllib.request.urlopen(f"http://{gw.http}/openapi.json") as r:
        document = json.loads(r.read())
    assert {f"/v1/ops/{name}" for name in ops.OPS if name != "auth"} <= set(document["paths"])
    assert "/v1/sandboxes/{id}/exec" in document["paths"]
    schema = document["components"]["schemas"]["FileReadArgs"]
    assert schema["required"] == ["sandbox_id", "path"]


# ---------------------------------------------------------------- trajectories across nodes and gateways

TRAINER = """
import os, sys, shoal
address, token, name, out = sys.argv[1:5]
client = shoal.Client(address, token=token)
sandbox = client.create(image="busybox", pool=False, ttl_s=600, trajectory=name)
with open(out, "w") as f:
    f.write(sandbox.id + "\\n")
    for i in range(3):
        f.write(sandbox.exec(f"echo step{i} $RANDOM$RANDOM").stdout)
        f.flush()
os.kill(os.getpid(), 9)  # preempted mid-episode: no close, no goodbye
"""


def test_a_killed_trainer_comes_back_through_another_gateway(cluster: LocalCluster, tmp_path: Path) -> None:
    name = f"run7/ep{os.getpid()}"
    out = tmp_path / "trainer.out"
    gw1, gw2 = (f"shoal://{g.address}" for g in cluster.gateways)
    token = cluster.project_tokens[PROJECT]
    trainer = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRAINER), gw1, token, name, str(out)], capture_output=True, timeout=120
    )
    assert trainer.returncode == -9, trainer.stderr.decode()[-2000:]
    sandbox_id, *first_run = out.read_text().splitlines()
    assert len(first_run) == 3

    with shoal.Client(gw2, token=token) as client:
        sandbox = client.create(image="busybox", pool=False, ttl_s=600, trajectory=name)
        assert sandbox.id == sandbox_id  # the same sandbox, found by name through the other gateway
        again = [sandbox.exec(f"echo step{i} $RANDOM$RANDOM").stdout.strip() for i in range(3)]
        assert again == first_run  # logged results, not run again ($RANDOM would differ)
        assert sandbox.fast_forwarded == 3
        assert sandbox.exec("echo past the log").stdout == "past the log\n"  # the first new step runs

        back = client.attach(name)  # by name, through the gateway; replays from step 0
        assert back.id == sandbox_id
        assert back.exec("echo step0 $RANDOM$RANDOM").stdout.strip() == first_run[0]
        with pytest.raises(shoal.DivergenceError):
            back.exec("echo something else")

        where = client.trajectory_find(name)
        assert [(w["sandbox_id"], w["status"], w["trajectory"]) for w in where] == [(sandbox_id, "live", name)]
        log = client.log(name)
        assert [s["seq"] for s in log["steps"]] == [0, 1, 2, 3] and log["sandbox"]["id"] == sandbox_id
        report = client.replay(name)
        assert report.source == sandbox_id and report.steps == 4
        assert {d["seq"] for d in report.differences} == {0, 1, 2}  # $RANDOM differs; the echo does not
        assert report.differences and all(d["field"] == "stdout" for d in report.differences)

        export = tmp_path / "log.jsonl"
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "--address",
                gw1,
                "--token",
                token,
                "log",
                "export",
                name,
                "-o",
                str(export),
            ],
            capture_output=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr.decode()
        assert [json.loads(line)["seq"] for line in export.read_text().splitlines()] == [0, 1, 2, 3]

        # another project does not see the name, through the gateway or on the node itself
        with shoal.Client(gw2, token=cluster.project_tokens["p2"]) as other, pytest.raises(shoal.NotFoundError):
            other.attach(name)
        holder = next(n for n in cluster.nodes if sandbox_id.startswith(n.node_id + "-"))
        p2 = cluster.project_tokens["p2"]
        with shoal.Client(f"shoal://{holder.address}", token=p2) as direct, pytest.raises(shoal.NotFoundError):
            direct.log(name)
        with shoal.Client(f"shoal://{holder.address}", token=token) as direct:  # the project itself: yes
            assert direct.attach(name).id == sandbox_id
        sandbox.close()
        with pytest.raises(shoal.SandboxClosedError) as ended:  # an ended trajectory is not made again silently
            client.create(image="busybox", pool=False, trajectory=name)
        assert f"trajectory {name!r}" in str(ended.value) and "@" not in str(ended.value)  # the user's name


RACER = """
import sys, shoal
address, token, name = sys.argv[1:4]
with shoal.Client(address, token=token) as client:
    print(client.create(image="busybox", pool=False, ttl_s=300, trajectory=name).id)
"""


def test_two_trainers_racing_through_two_gateways_get_one_sandbox(cluster: LocalCluster) -> None:
    token = cluster.project_tokens[PROJECT]
    ids = set()
    for round_ in range(3):
        name = f"race/{os.getpid()}/{round_}"
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, f"shoal://{g.address}", token, name], stdout=subprocess.PIPE, text=True
            )
            for g in cluster.gateways
        ]
        answers = {r.communicate(timeout=120)[0].strip() for r in racers}
        assert all(r.returncode == 0 for r in racers)
        assert len(answers) == 1, answers
        ids |= answers
    with shoal.Client(f"shoal://{cluster.gateways[0].address}", token=token) as client:
        for sandbox_id in ids:
            client.kill(sandbox_id)


# ---------------------------------------------------------------- background tasks have an owner


@pytest.mark.fast
async def test_a_task_owner_logs_failures_and_leaves_nothing_running(caplog: pytest.LogCaptureFixture) -> None:
    owner = TaskOwner("test owner")

    async def fail() -> None:
        raise RuntimeError("boom")

    forever = owner.spawn(asyncio.Event().wait(), "forever")
    failing = owner.spawn(fail(), "fail")
    await asyncio.wait({failing})
    await asyncio.sleep(0)  # the done callback runs
    assert "test owner: fail" in caplog.text and "boom" in caplog.text
    assert len(owner) == 1
    await owner.close()
    assert forever is not None and forever.cancelled() and len(owner) == 0
    assert owner.spawn(asyncio.sleep(0), "late") is None  # closed: nothing starts


@pytest.mark.fast
async def test_a_closed_gateway_leaves_no_task_behind() -> None:
    gateway = Gateway(Tokens({"tokens": {"t": CLUSTER_ROLE}}), poll_interval=0.05)
    gateway.set_nodes({"n1": "127.0.0.1:1", "n2": "127.0.0.1:1"})  # nothing listens: pollers keep trying
    await asyncio.sleep(0.2)
    assert len(gateway.tasks) == 2
    await gateway.close()
    assert len(gateway.tasks) == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("gateway gw:")]


@pytest.mark.fast
def test_one_mapping_from_exceptions_to_wire_errors() -> None:
    """errors.to_wire / from_wire: what the node, the gateway and the HTTP API send, and the client raises."""
    from shoal.errors import ERROR_TYPES, from_wire, to_wire

    for cls in ERROR_TYPES.values():  # every typed error crosses the wire as itself
        kind, message, expected = to_wire(cls("why and what to do"))
        assert expected and type(from_wire(kind, message)) is cls and str(from_wire(kind, message)) == message

    class AgentSaid(FileNotFoundError):
        pass

    assert to_wire(AgentSaid("no /x")) == ("FileNotFoundError", "no /x", True)
    assert to_wire(asyncio.CancelledError())[:2] == ("CancelledError", "cancelled")
    kind, message, expected = to_wire(KeyError("k"))  # a bug: sent as ShoalError naming it, and logged
    assert (kind, message, expected) == ("ShoalError", "KeyError: 'k'", False)
    assert type(from_wire("NoSuchError", "m")) is shoal.ShoalError
