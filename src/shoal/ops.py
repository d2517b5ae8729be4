"""The operation table: every operation of the wire protocol, declared once.

Each entry says what an operation takes and returns, where it runs, who may call it, and how it behaves on
the wire. The node server's dispatch, the node's TCP access rules, the gateway's routing, the client's
retry rule, the HTTP API and its OpenAPI document are all derived from this table, and the wire name is the
client method name (`client.attach(...)` sends `attach`). Adding an operation is one entry here plus its
implementation (a `NodeService` method of the same name and parameters, or a gateway method for
gateway-only operations); tests/test_ops.py checks both sides agree and calls every entry through every
transport.

This module sits beside `protocol` at the bottom of the layers: it imports nothing from node or cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shoal.errors import InvalidRequestError
from shoal.protocol import ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxSpec

# ---------------------------------------------------------------- how an operation is routed (by a gateway)

SANDBOX = "sandbox"  # to the node that holds the sandbox named by an argument (IDs are <node>-<hex>)
TARGET = "target"  # by sandbox ID or trajectory name: to the node that holds it (asked of every node)
PLACED = "placed"  # create: admission, placement, the trajectory's home node
ANYWHERE = "anywhere"  # stateless: any node that runs the kind (or the sandbox's node when one is named)
FANOUT = "fanout"  # to every healthy node, answers merged (see `merge`)
ONE = "one"  # to one healthy node that has the named image
LOCAL = "local"  # answered by whoever receives it (the node itself, or the gateway)
GATEWAY = "gateway"  # only a gateway answers it (a node says so)
ROUTES = (SANDBOX, TARGET, PLACED, ANYWHERE, FANOUT, ONE, LOCAL, GATEWAY)

# ---------------------------------------------------------------- who may call it (over the network)

PROJECT = "project"  # a project token (scoped to the project's sandboxes) or the cluster token
CLUSTER = "cluster"  # the cluster (admin) token only: node-wide effects (images, pools)

# ---------------------------------------------------------------- how fan-out answers merge

CONCAT = "concat"  # lists joined
SUM = "sum"  # counts added
UNION = "union"  # sorted union of name lists
BY_NODE = "by_node"  # {node_id: answer}; a failing node fails the request
STATUS = "status"  # one status shaped like a node's (protocol.combine_status)
IMAGES = "images"  # image_ls answers by image name, each naming the nodes that hold it
INSPECT = "inspect"  # one node's record, naming every node that holds the image

SEQ = int | None  # a logged step's place in the trajectory log (None: append)


@dataclass(frozen=True)
class Op:
    name: str  # the wire name and the client method name
    request: type[msgspec.Struct]  # the arguments, as a struct (unknown arguments are refused)
    returns: Any  # what the result converts to
    route: str
    access: str = PROJECT
    doc: str = ""
    step: bool = False  # a logged step: recorded in the trajectory log, fast-forwarded on re-issue
    streams: bool = False  # sends events before its result
    retry: bool = False  # safe to send again on a new connection (idempotent): the client may retry it
    merge: str | None = None  # FANOUT: how the answers combine
    scoped: bool = False  # takes `labels`: a project's call is restricted to the project's sandboxes
    sandbox_arg: str = "sandbox_id"  # SANDBOX / ANYWHERE: which argument names the sandbox ("req.sandbox_id"...)
    by_target: bool = False  # its `target` argument is a sandbox ID or a trajectory name (resolved per project)

    def sandbox_of(self, args: dict[str, Any]) -> str | None:
        """The sandbox (or, for TARGET, the sandbox ID or trajectory name) a request addresses, or None."""
        if self.by_target:
            target = args.get("target")
            return target if isinstance(target, str) else None
        if self.route not in (SANDBOX, ANYWHERE):
            return None
        head, _, field = self.sandbox_arg.partition(".")
        value = args.get(head)
        if field:
            value = value.get(field) if isinstance(value, dict) else None
        if not isinstance(value, str):
            return None
        return value.partition("/")[0] if head == "shell_id" else value  # a shell ID is <sandbox>/<n>

    def convert(self, args: dict[str, Any]) -> msgspec.Struct:
        """The arguments checked and typed; an InvalidRequestError names what is wrong."""
        try:
            return msgspec.convert(args, self.request, strict=False)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"invalid arguments to {self.name}: {exc}") from None

    def kwargs(self, args: dict[str, Any]) -> dict[str, Any]:
        request = self.convert(args)
        return {name: getattr(request, name) for name in request.__struct_fields__}


OPS: dict[str, Op] = {}


def _op(name: str, route: str, params: dict[str, Any], returns: Any, doc: str, **flags: Any) -> None:
    """Declare one operation. `params` maps each argument to its type, or to (type, default)."""
    fields = [(k, *v) if isinstance(v, tuple) else (k, v) for k, v in params.items()]
    title = "".join(part.capitalize() for part in name.split("_")) + "Args"
    request = msgspec.defstruct(title, fields, kw_only=True, forbid_unknown_fields=True, module=__name__)
    request.__doc__ = doc
    if name in OPS:
        raise RuntimeError(f"operation {name!r} is declared twice")
    OPS[name] = Op(name=name, request=request, returns=returns, route=route, doc=doc, **flags)


LABELS = {"labels": (dict[str, str] | None, None)}
OPT_STR = (str | None, None)
JSON = dict[str, Any]

# fmt: off
# ---------------------------------------------------------------- session and cluster
_op("auth", LOCAL, {"token": OPT_STR}, JSON,
    "Authenticate a TCP connection (its first request); answers who the token is.", retry=True)
_op("hello", LOCAL, {}, JSON, "Who answers: node ID (or gateway name) and the sandbox kinds it runs.", retry=True)
_op("status", FANOUT, {}, JSON, "Load, pools, limits and per-project usage.", retry=True, merge=STATUS)
_op("cluster_status", GATEWAY, {}, JSON, "The gateway's view of the cluster: nodes, health, queue.", retry=True)
_op("metrics", GATEWAY, {}, str, "The gateway's Prometheus metrics as text.", retry=True)
_op("cluster_nodes", GATEWAY, {"nodes": (dict[str, str] | None, None), "gone": (dict[str, str] | None, None)},
    list[str], "Replace the gateway's membership {node_id: host:port} (the Ray controller pushes it).",
    access=CLUSTER)
_op("settings_env", FANOUT, {}, dict[str, str],
    "Digests of the SHOAL_* settings a node started with (a client compares its own).", access=CLUSTER,
    retry=True, merge=BY_NODE)
_op("trajectory_find", FANOUT, {"target": str}, list[JSON],
    "Which sandbox (live or ended) on this node is `target` (a sandbox ID or trajectory name), if any.",
    retry=True, merge=CONCAT, by_target=True)

# ---------------------------------------------------------------- sandboxes
_op("create", PLACED, {"spec": SandboxSpec}, SandboxInfo,
    "Create a sandbox; with spec.trajectory naming a live trajectory, that sandbox is returned instead.")
_op("get", SANDBOX, {"sandbox_id": str}, SandboxInfo, "Describe a sandbox.", retry=True)
_op("attach", TARGET, {"target": str}, SandboxInfo,
    "A live sandbox by ID or trajectory name; the client re-issues its steps from seq 0.", retry=True, by_target=True)
_op("list", FANOUT, LABELS, list[SandboxInfo], "Live sandboxes (with these labels).",
    retry=True, merge=CONCAT, scoped=True)
_op("kill", SANDBOX, {"sandbox_id": str, "reason": (str, "closed by the client")}, bool,
    "Destroy a sandbox and everything it owns; closing twice is fine (false: it was closed already).", retry=True)
_op("close_all", FANOUT, LABELS, int, "Close every sandbox (with these labels); how many.", merge=SUM, scoped=True)
_op("keepalive", SANDBOX, {"sandbox_id": str, "ttl_s": (float | None, None)}, SandboxInfo,
    "Push the TTL deadline out by ttl_s from now.", retry=True)
_op("processes", SANDBOX, {"sandbox_id": str}, list[JSON],
    "Processes in a sandbox but its agent's, each with the exec that started it (exec_id).", retry=True)
_op("usage", SANDBOX, {"sandbox_id": str}, JSON,
    "What a sandbox uses now, from its cgroup: memory charged, CPU seconds, tasks (a paused one is not resumed).",
    retry=True)
_op("kill_processes", SANDBOX, {"sandbox_id": str, "exec_id": (int | None, None)}, dict[str, int],
    "SIGKILL what one exec left running (exec_id), or every process but the agent's; works at the pids limit.",
    retry=True)
_op("pause", SANDBOX, {"sandbox_id": str}, JSON, "Freeze a sandbox and reclaim its memory.")
_op("resume", SANDBOX, {"sandbox_id": str}, SandboxInfo, "Resume a paused sandbox.")
_op("pause_all", FANOUT, LABELS, list[JSON], "Pause every running sandbox (with these labels).",
    merge=CONCAT, scoped=True)
_op("resume_all", FANOUT, LABELS, int, "Resume every paused sandbox (with these labels); how many.",
    merge=SUM, scoped=True)
_op("expose", SANDBOX, {"sandbox_id": str, "port": int}, JSON,
    "A URL (through the node's or gateway's HTTP) reaching a port inside the sandbox, network policy untouched.",
    retry=True)
_op("set_network", SANDBOX, {"sandbox_id": str, "network": str | list[str] | dict[str, bool]}, JSON,
    "Change a sandbox's network policy now.")

# ---------------------------------------------------------------- steps (logged in the trajectory log)
_op("exec", SANDBOX, {"req": ExecRequest}, ExecResult, "Run a command; streams its output when req.stream.",
    step=True, streams=True, sandbox_arg="req.sandbox_id")
_op("file_write", SANDBOX, {"sandbox_id": str, "path": str, "data": bytes, "mode": (int, 0o644),
                            "append": (bool, False), "seq": (SEQ, None)}, int, "Write a file.", step=True)
_op("file_read", SANDBOX, {"sandbox_id": str, "path": str, "max_bytes": (int, 256 << 20), "seq": (SEQ, None),
                           "stream": (bool, False), "operator": (bool, False)},
    bytes | JSON, "Read a file; with stream, a file over 64 KiB comes as events (chunks) and the result is its "
    "{bulk: digest, size}. operator: an operator's read (the console's download), not logged.", step=True,
    retry=True, streams=True)
_op("file_untar", SANDBOX, {"sandbox_id": str, "path": str, "data": bytes, "seq": (SEQ, None)}, int,
    "Unpack a tar stream into a directory (links in it never followed); the entries made.", step=True)
_op("file_list", SANDBOX, {"sandbox_id": str, "path": str, "recursive": (bool, False), "seq": (SEQ, None),
                           "operator": (bool, False)},
    list[FileEntry], "List a directory (operator: an operator's look, not logged).", step=True, retry=True)
_op("file_stat", SANDBOX, {"sandbox_id": str, "path": str, "seq": (SEQ, None)}, FileEntry | None,
    "Describe a path (None if it does not exist).", step=True, retry=True)
_op("file_mkdir", SANDBOX, {"sandbox_id": str, "path": str, "seq": (SEQ, None)}, None,
    "Make a directory and its parents.", step=True)
_op("file_remove", SANDBOX, {"sandbox_id": str, "path": str, "recursive": (bool, False), "seq": (SEQ, None)},
    None, "Remove a file (or a tree).", step=True)
_op("shell_open", SANDBOX, {"sandbox_id": str, "seq": (SEQ, None)}, str, "Open a persistent shell; its ID.",
    step=True)
_op("shell_run", SANDBOX, {"shell_id": str, "cmd": str, "timeout": (float | None, None),
                           "idle_timeout": (float | None, None), "seq": (SEQ, None)}, ExecResult,
    "Run a command in a persistent shell.", step=True, sandbox_arg="shell_id")
_op("shell_close", SANDBOX, {"shell_id": str}, None, "Close a persistent shell.", sandbox_arg="shell_id")
_op("sandbox_snapshot", SANDBOX, {"sandbox_id": str, "name": str, "seq": (SEQ, None)}, JSON,
    "Commit a container's writes as image `name`.", step=True)
_op("gui", SANDBOX, {"sandbox_id": str, "action": str, "args": (JSON | None, None), "seq": (SEQ, None),
                     "operator": (bool, False)}, JSON,
    "A GUI action on a sandbox's screen (screenshot, click, move, drag, scroll, type, key, cursor, "
    "wait_for_change); NoScreenError without one. operator: an operator's act (the console's), not logged.",
    step=True)

# ---------------------------------------------------------------- background processes and terminals (node/procs.py)
_op("proc_start", SANDBOX, {"sandbox_id": str, "cmd": str | list[str], "env": (dict[str, str] | None, None),
                            "cwd": OPT_STR, "user": OPT_STR, "stdin": (bytes | None, None),
                            "merge_stderr": (bool, False), "pty": (dict[str, int] | None, None),
                            "output_cap_bytes": (int | None, None), "open_stdin": (bool, True),
                            "seq": (SEQ, None), "operator": (bool, False), "stream": (bool, False),
                            "timeout": (float | None, None)}, JSON,
    "Start a command in the background (on a terminal of pty {cols, rows}; stdin a pipe unless open_stdin is "
    "false); it outlives this call and the client, dies with the sandbox, keeps the last output_cap_bytes of "
    "each stream; its {id, pid, pty}. operator: an operator's act (the console's terminal), not logged. "
    "stream: its {id, pid, pty} as the first event, then it is followed as proc_read follow+stream does (its "
    "output as events until it ends or the timeout passes) and the answer is proc_read's.",
    step=True, streams=True)
_op("proc_read", SANDBOX, {"sandbox_id": str, "id": int, "stdout_offset": (int, 0), "stderr_offset": (int, 0),
                           "follow": (bool, False), "timeout": (float | None, None),
                           "max_bytes": (int, 16 << 20), "stream": (bool, False)}, JSON,
    "A background process's output from the offsets: what there is now, or (follow) until it ends or the "
    "timeout passes (with stream, as events); the offsets to read on from and whether it runs (exit_code, "
    "signal).",
    streams=True, retry=True)
_op("proc_input", SANDBOX, {"sandbox_id": str, "id": int, "data": (bytes, b""), "eof": (bool, False),
                            "seq": (SEQ, None), "operator": (bool, False)}, JSON,
    "Write to a background process's stdin (its terminal's input); eof closes it (a terminal gets ^D); operator: "
    "not logged.",
    step=True)
_op("proc_signal", SANDBOX, {"sandbox_id": str, "id": int, "signal": (int, 15), "seq": (SEQ, None),
                             "operator": (bool, False)}, JSON,
    "Send a signal to a background process's group and every process it started; operator: not logged.",
    step=True)
_op("proc_resize", SANDBOX, {"sandbox_id": str, "id": int, "cols": int, "rows": int}, JSON,
    "Resize a background process's terminal (it gets SIGWINCH).")
_op("proc_list", SANDBOX, {"sandbox_id": str}, list[JSON],
    "The background processes a sandbox keeps (running, or ended and not yet let go), with their offsets.",
    retry=True)

# ---------------------------------------------------------------- trajectories
_op("log_steps", TARGET, {"target": str, "since": (int, 0), "limit": (int, 1000), "max_bytes": (int, 16 << 20)},
    JSON, "A page of the trajectory log of a sandbox (ID or trajectory name, live or ended).", retry=True,
    by_target=True)
_op("replay", TARGET, {"target": str, "image": OPT_STR, "keep": (bool, False)}, JSON,
    "Re-run a recorded trajectory in a fresh sandbox and report each step whose outcome differs.", by_target=True)

# ---------------------------------------------------------------- VMs
_op("vm_snapshot", SANDBOX, {"sandbox_id": str}, str, "Capture a VM's memory and disk; a snapshot ID.")
_op("vm_snapshot_delete", FANOUT, {"snapshot_id": str}, None, "Remove a VM snapshot.", merge=BY_NODE)
_op("fork", SANDBOX, {"sandbox_id": str, "count": (int, 1)}, list[Any],
    "Running copies of a VM: each a SandboxInfo or an error.")

# ---------------------------------------------------------------- function calls
_op("fn_call", ANYWHERE, {"spec": SandboxSpec, "call": JSON, "timeout": (float | None, None),
                          "sandbox_id": OPT_STR}, JSON, "Run a pickled function in a fresh worker.")
_op("fn_map", ANYWHERE, {"spec": SandboxSpec, "call": JSON, "items": list[Any], "timeout": (float | None, None),
                         "isolation": (str, "item")},
    list[JSON], "Run a function once per item in one round trip (isolation 'item': a fresh worker child each; "
    "'batch': the items in one child, sharing it); outcomes in order.")
_op("fn_run_code", ANYWHERE, {"spec": SandboxSpec, "code": str, "language": (str, "python"),
                              "stdin": (bytes | None, None), "files": (dict[str, bytes] | None, None),
                              "compile_timeout": (float | None, 30.0), "run_timeout": (float | None, 10.0),
                              "output_files": (list[str] | None, None)}, JSON,
    "Compile and run a program in a fresh worker.")

# ---------------------------------------------------------------- pools and images
_op("pool_set", FANOUT, {"spec": SandboxSpec, "size": int, "wait": (bool, False)}, JSON,
    "Keep `size` warm sandboxes of this shape on every node.", access=CLUSTER, merge=BY_NODE)
_op("image_list", FANOUT, {}, list[str], "Names of the usable images.", retry=True, merge=UNION)
_op("image_ls", FANOUT, {}, list[JSON], "Images in the store with layers, size, age.", retry=True, merge=IMAGES)
_op("image_inspect", FANOUT, {"name": str}, JSON, "One image's manifest and layers.", retry=True, merge=INSPECT)
_op("image_build", FANOUT, {"name": str, "force": (bool, False), "base": OPT_STR,
                            "steps": (list[JSON] | None, None), "no_cache": (bool, False),
                            "network": (str | list[str] | dict[str, bool] | None, None)}, JSON,
    "Build an image (a builtin by name, or base + steps); streams each step.", access=CLUSTER, streams=True,
    merge=BY_NODE)
_op("image_rm", FANOUT, {"name": str}, JSON, "Forget an image.", access=CLUSTER, merge=BY_NODE)
_op("image_prune", FANOUT, {}, JSON, "Remove unreferenced layers and blobs.", access=CLUSTER, merge=BY_NODE)
_op("image_tag", FANOUT, {"source": str, "target": str}, None, "Name an image again.", access=CLUSTER,
    merge=BY_NODE)
_op("image_squash", FANOUT, {"name": str, "target": str}, JSON, "Flatten an image into one layer.",
    access=CLUSTER, merge=BY_NODE)
_op("image_import", FANOUT, {"path": str, "name": OPT_STR}, list[str],
    "Import an OCI layout or docker-save archive from a path on each node's machine.", access=CLUSTER,
    merge=BY_NODE)
_op("image_import_disk", FANOUT, {"path": str, "name": str, "kernel": OPT_STR, "initrd": OPT_STR, "append": OPT_STR,
                                 "ready_port": (int | None, None), "disk_bus": (str, "virtio"),
                                 "nic": (str, "virtio")}, JSON,
    "Register a VM disk image (Android-x86, AOSP...) at a path on each node's machine as an image an agentless "
    "vm boots.", access=CLUSTER, merge=BY_NODE)
_op("image_export", ONE, {"name": str, "path": str}, str,
    "Write an image as an OCI layout at a path on the node's machine; its digest.", access=CLUSTER)
_op("image_pull", FANOUT, {"reference": str, "name": OPT_STR, "auth": OPT_STR, "platform": OPT_STR}, JSON,
    "Pull an image from a registry.", access=CLUSTER, streams=True, merge=BY_NODE)
_op("image_push", ONE, {"name": str, "reference": str, "auth": OPT_STR}, JSON, "Push an image to a registry.",
    access=CLUSTER, streams=True)
# fmt: on

NODE_OPS = [name for name, op in OPS.items() if op.route != GATEWAY and name != "auth"]  # NodeService methods
RETRYABLE = frozenset(name for name, op in OPS.items() if op.retry)


def get(name: str) -> Op:
    """The operation `name`, or an InvalidRequestError listing the known ones."""
    op = OPS.get(name)
    if op is None:
        raise InvalidRequestError(f"unknown operation {name!r}; operations: {', '.join(sorted(OPS))}")
    return op


def openapi(title: str = "shoal gateway", extra_paths: dict[str, Any] | None = None) -> dict[str, Any]:
    """An OpenAPI 3.1 document for `POST /v1/ops/<name>` of every operation a gateway serves, generated
    from the table (request and response schemas from the request structs and return types)."""
    names = [n for n in OPS if n not in ("auth",)]
    types = [OPS[n].request for n in names] + [_response_type(OPS[n]) for n in names]
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    paths: dict[str, Any] = dict(extra_paths or {})
    for name, request, response in zip(names, schemas, schemas[len(names) :], strict=False):
        op = OPS[name]
        notes = [f"route: {op.route}", f"access: {op.access}"]
        notes += [flag for flag in ("step", "streams", "retry") if getattr(op, flag)]
        paths[f"/v1/ops/{name}"] = {
            "post": {
                "operationId": name,
                "summary": op.doc,
                "description": "; ".join(notes) + (" (streamed events only on the binary protocol)"
                                                   if op.streams else ""),
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {"description": "the result", "content": {"application/json": {"schema": response}}},
                    "default": {"description": "an error", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Error"}}}},
                },
            }
        }  # fmt: skip
    components["Error"] = {
        "type": "object",
        "required": ["error", "message"],
        "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": "1",
            "description": "Every operation of the shoal protocol as POST /v1/ops/<name> with its arguments as a "
            "JSON object (bytes as base64). Errors: 400 invalid request, 401 bad token, 403 quota, 404 not "
            "found, 409 divergence, 410 sandbox lost, 503 no capacity.",
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": components},
        "paths": paths,
    }


def _response_type(op: Op) -> Any:
    return type(None) if op.returns is None else op.returns
