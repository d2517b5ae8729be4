"""The `shoal` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import shoal
from shoal.config import Paths
from shoal.protocol import SandboxInfo
from shoal.steps import jsonable


def _client(args: argparse.Namespace) -> shoal.Client:
    if getattr(args, "ray_address", None):
        return shoal.Client(ray_address=args.ray_address, token=args.token)
    return shoal.Client(args.address, home=args.home, token=args.token, tls_ca=args.tls_ca)


def cmd_cluster(args: argparse.Namespace) -> int:
    from shoal.cluster import ray as shoal_ray

    if args.action == "up":
        tokens = json.loads(Path(args.tokens).read_text()) if args.tokens else None
        env = {"SHOAL_MAX_SANDBOXES": str(args.max_sandboxes)} if args.max_sandboxes else {}
        if args.images:
            env["SHOAL_IMAGES"] = args.images
        info = shoal_ray.cluster_up(
            args.ray_address, home=args.cluster_home, gateways=args.gateways, gateway_port=args.port,
            tokens=tokens, node_env=env, resource=args.resource, wait_nodes=args.wait_nodes, tls_dir=args.tls,
        )  # fmt: skip
        scheme = "shoals://" if args.tls else "shoal://"
        addresses = ",".join(f"{scheme}{h}:{p}" for h, p in info["gateways"])
        print(f"shoal cluster up: {len(info['status']['nodes'])} nodes, gateways {addresses}")
        ca = f", tls_ca={str(Path(args.tls) / 'ca.crt')!r}" if args.tls else ""
        print(f"connect: shoal.Client({addresses!r}, token=...{ca}) or shoal.Client(ray_address={args.ray_address!r})")
        print(f"default project token: {info['token']}")
    elif args.action == "down":
        print(json.dumps(shoal_ray.cluster_down(args.ray_address)))
    else:
        print(json.dumps(shoal_ray.cluster_status(args.ray_address), indent=2, default=str))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from shoal.cluster.top import run

    with _client(args) as client:
        return run(client, args.interval, args.once)


def console_url(http: str | None, home: str | None) -> str:
    """The web console's URL: at `http` (host:port of a node's or gateway's HTTP), else at the local node's
    (the address it published in $SHOAL_HOME/node.http)."""
    from shoal import settings

    if not http:
        published = (Path(home) if home else settings.HOME.get()) / "node.http"
        try:
            http = published.read_text().strip()
        except OSError:
            raise shoal.InvalidRequestError(
                f"no console here: the node publishes none ({published} is missing). Start the node with "
                "SHOAL_HTTP=host:port, SHOAL_TCP and SHOAL_TOKENS (the console takes the same tokens), or give "
                "--http host:port of a gateway's HTTP port"
            ) from None
    host, _, port = http.rpartition(":")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    scheme = "https" if settings.TLS_CERT.raw() else "http"
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}/console/"


def cmd_console(args: argparse.Namespace) -> int:
    url = console_url(args.http, args.home)
    print(url)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """The live view (noVNC) of a sandbox's screen: a URL with its key, through the node or the gateway."""
    with _client(args) as client:
        url = client.get(args.id).view()
    print(url)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("shoal run: give a command after --", file=sys.stderr)
        return 2
    with _client(args) as client, client.create(args.kind, image=args.image, runtime=args.runtime) as sb:
        result = sb.exec(" ".join(command) if len(command) == 1 else command, timeout=args.timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.timed_out:
            print(f"shoal: timed out after {args.timeout} s", file=sys.stderr)
        return result.exit_code


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        now = time.time()
        print("ID\tKIND\tIMAGE\tSTATE\tOWNER\tENDS IN\tLABELS")
        for info in client.list():
            labels = ",".join(f"{k}={v}" for k, v in info.labels.items())
            owner = info.owner or "-"
            print(f"{info.id}\t{info.kind}\t{info.image}\t{info.state}\t{owner}\t{_ends_in(info, now)}\t{labels}")
    return 0


def _ends_in(info: SandboxInfo, now: float) -> str:
    """What ends the sandbox first and when: `ttl 23h59m`, `idle 29m` (if nothing runs), or `never`."""
    from shoal.doctor import duration

    ends = []
    if info.expires_at is not None:
        ends.append((info.expires_at - now, "ttl"))
    if info.idle_timeout_s and info.state == "ready":
        ends.append((info.last_active_at + info.idle_timeout_s - now, "idle"))
    if not ends:
        return "never"
    left, why = min(ends)
    return f"{why} {duration(max(0.0, left))}"


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.all:
            print(f"closed {client.close_all()} sandboxes")
        for sandbox_id in args.ids:
            client.kill(sandbox_id)
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    labels = dict(item.partition("=")[::2] for item in args.label)
    with _client(args) as client:
        if args.cmd == "pause":
            done = [p["id"] for p in client.pause_all(labels)] if labels else []
            for sandbox_id in args.ids:
                client.get(sandbox_id).pause()
                done.append(sandbox_id)
            print(f"paused {len(done)} sandboxes")
        else:
            count = client.resume_all(labels) if labels else 0
            for sandbox_id in args.ids:
                client.get(sandbox_id).resume()
            print(f"resumed {count + len(args.ids)} sandboxes")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from shoal.cluster.front import serve_network
    from shoal.node.daemon import main, stop_node

    if args.home:
        os.environ["SHOAL_HOME"] = args.home
    if args.action == "stop":
        print(stop_node(Paths.from_env(), keep=args.keep, timeout=args.timeout))
        return 0
    return main(network=serve_network)


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.status(), indent=2))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from shoal.doctor import report

    text, healthy = report()
    print(text)
    return 0 if healthy else 1


def _progress_bar(event: dict) -> None:
    done, total = event["done"], event["total"] or 1
    width = 30
    filled = int(width * min(done, total) / total)
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done >= total else ""
    print(
        f"\r{event['blob'][7:19]} [{bar}] {done / 1e6:7.1f}/{total / 1e6:.1f} MB", end=end, file=sys.stderr, flush=True
    )


def _by_node(result: dict, key: str) -> dict[str, dict]:
    """A node's answer, or a gateway's {node_id: answer} for operations every node does: as (" on node X"
    suffix, answer) pairs, so one printer serves both."""
    if key in result:
        return {"": result}
    return {f" on node {node}": answer for node, answer in sorted(result.items())}


def cmd_image(args: argparse.Namespace) -> int:
    from pathlib import Path

    with _client(args) as client:
        action, name = args.action, args.name
        if action == "build":
            dockerfile = Path(args.file) if args.file else Path(args.context or ".") / "Dockerfile"
            if args.file or args.context:
                recipe = shoal.ImageBuilder.from_dockerfile(dockerfile, args.context or dockerfile.parent)

                def show(step: dict) -> None:
                    print(
                        f"step {step['step']:>2} {step['op']:<10} {'cached' if step['cached'] else 'built'}", flush=True
                    )

                report = client.build_image(name, recipe, no_cache=args.no_cache, network=args.network, on_step=show)
                for node, one in _by_node(report, "layers").items():
                    print(f"{name}: {len(one['layers'])} layers{node}")
            else:
                print(json.dumps(client.build_image(name or "debian", force=args.force)))
        elif action == "ls":
            for item in client.image_list():
                print(f"{item['name']:<50} {item['layers']:>3} layers {item['size'] / 1e6:10.1f} MB")
        elif action == "pull":
            result = client.image_pull(
                name, args.as_name, auth=args.auth, platform=args.platform, on_progress=_progress_bar
            )
            for node, one in _by_node(result, "digest").items():
                print(f"{one['name']}: {one['digest']} ({one['fetched']} fetched, {one['skipped']} present){node}")
        elif action == "push":
            result = client.image_push(name, args.target, auth=args.auth, on_progress=_progress_bar)
            print(
                f"{result['reference']}: {result['digest']} ({result['uploaded']} uploaded, {result['skipped']} there)"
            )
        elif action == "import":
            print("\n".join(client.image_import(name, args.as_name)))
        elif action == "import-disk":
            if not args.as_name:
                raise SystemExit("shoal image import-disk PATH --as NAME: name the image")
            options = {"kernel": args.kernel, "initrd": args.initrd, "append": args.append,
                       "ready_port": args.ready_port, "disk_bus": args.disk_bus, "nic": args.nic}  # fmt: skip
            for node, one in _by_node(client.image_import_disk(name, args.as_name, **options), "name").items():
                print(f"{one['name']}: disk image, boots as an agentless vm{node}")
        elif action == "export":
            print(client.image_export(name, args.target))
        elif action == "inspect":
            print(json.dumps(client.image_inspect(name), indent=2))
        elif action == "rm":
            print(json.dumps(client.image_rm(name)))
        elif action == "prune":
            print(json.dumps(client.image_prune()))
        elif action == "tag":
            client.image_tag(name, args.target)
        elif action == "squash":
            print(json.dumps(client.image_squash(name, args.target)))
    return 0


def _outcome(step: dict) -> str:
    if step["error_type"]:
        return f"{step['error_type']}: {step['error']}"
    result = step["result"]
    if isinstance(result, dict) and "exit_code" in result:
        out = (result["stdout"] + result["stderr"]).decode(errors="replace").strip().replace("\n", "\\n")
        return f"exit {result['exit_code']}" + (f": {out[:100]}" if out else "")
    text = repr(jsonable(result))
    return text if len(text) <= 100 else text[:97] + "..."


def cmd_log(args: argparse.Namespace) -> int:
    with _client(args) as client:
        log = client.log(args.target)
    if args.action == "export":
        lines = "".join(json.dumps(jsonable(step)) + "\n" for step in log["steps"])
        if args.output in (None, "-"):
            sys.stdout.write(lines)
        else:
            with open(args.output, "w") as handle:
                handle.write(lines)
        return 0
    record = log["sandbox"] or {}
    state = record.get("status", "?") + (f" ({record['reason']})" if record.get("reason") else "")
    print(f"sandbox {record.get('id')}  trajectory {record.get('trajectory')}  image {record.get('image')}  {state}")
    for step in log["steps"]:
        took = "  (unfinished)"
        if step["finished_at"]:
            took = f"{(step['finished_at'] - step['started_at']) * 1000:8.1f} ms"
        print(f"{step['seq']:>6}  {took}  {step['summary']}  ->  {_outcome(step)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shoal.demo import run_demo

    return run_demo(count=args.count, image=args.image, concurrency=args.concurrency, home=args.home)


def cmd_e2b(args: argparse.Namespace) -> int:
    from shoal.e2b.server import main as serve_e2b

    rest = list(args.rest)
    if args.address and "--target" not in rest:
        rest += ["--target", args.address]
    return serve_e2b(rest)


def cmd_tls(args: argparse.Namespace) -> int:
    from shoal import tls

    made = tls.init(args.dir, args.name or ["node", "gateway"], args.host)
    print(f"CA: {made.pop('ca')} (give it to clients: shoal.Client('shoals://host:port', tls_ca=...) or SHOAL_TLS_CA)")
    for name, files in made.items():
        cert, key = files.split()
        print(f"{name}: SHOAL_TLS_CERT={cert} SHOAL_TLS_KEY={key}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description=shoal.__doc__.splitlines()[0])
    parser.add_argument("--home", help="node state directory (default $SHOAL_HOME or /var/lib/shoal)")
    parser.add_argument("--address", help="shoal[s]://host:port of a gateway or node (default: the local node)")
    parser.add_argument("--tls-ca", help="CA file for a shoals:// address (default $SHOAL_TLS_CA)")
    parser.add_argument("--token", help="token for --address (default $SHOAL_TOKEN)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one command in a fresh sandbox")
    run.add_argument("--kind", default="container")
    run.add_argument("--image", default="debian")
    run.add_argument("--runtime", help="crun, runc, runsc or shoal (default: the node's, SHOAL_RUNTIME)")
    run.add_argument("--timeout", type=float, default=60.0)
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)
    sub.add_parser("ls", help="list sandboxes").set_defaults(func=cmd_ls)
    rm = sub.add_parser("rm", help="close sandboxes")
    rm.add_argument("ids", nargs="*")
    rm.add_argument("--all", action="store_true")
    rm.set_defaults(func=cmd_rm)
    for verb in ("pause", "resume"):
        pause = sub.add_parser(verb, help=f"{verb} sandboxes (by ID, or all with --label k=v)")
        pause.add_argument("ids", nargs="*")
        pause.add_argument("--label", action="append", default=[], help="k=v; repeat to require several")
        pause.set_defaults(func=cmd_pause)
    node = sub.add_parser("node", help="run the node agent in the foreground, or stop the running one")
    node.add_argument("action", nargs="?", choices=["run", "stop"], default="run")
    node.add_argument(
        "--keep", action="store_true", help="stop: leave re-adoptable sandboxes running (default: close all)"
    )
    node.add_argument("--timeout", type=float, default=120.0, help="stop: wait this long for the node to exit")
    node.set_defaults(func=cmd_node)
    sub.add_parser("status", help="the node's figures").set_defaults(func=cmd_status)
    sub.add_parser("doctor", help="what this host can do, and remedies").set_defaults(func=cmd_doctor)
    image = sub.add_parser("image", help="images: ls pull push import export build inspect rm prune tag")
    image.add_argument(
        "action",
        choices=[
            "ls",
            "pull",
            "push",
            "import",
            "import-disk",
            "export",
            "build",
            "inspect",
            "rm",
            "prune",
            "tag",
            "squash",
            "build-base",
        ],
    )
    image.add_argument("name", nargs="?", help="image name, registry reference (pull) or archive path (import)")
    image.add_argument("target", nargs="?", help="push: registry reference; export: path; tag, squash: new name")
    image.add_argument("--as", "--name", dest="as_name", help="pull/import/import-disk: store under this name")
    image.add_argument("--kernel", help="import-disk: boot this kernel (AOSP-style) instead of the disk's loader")
    image.add_argument("--initrd", help="import-disk: the kernel's initrd / ramdisk")
    image.add_argument("--append", help="import-disk: the kernel command line")
    image.add_argument("--ready-port", type=int, help="import-disk: ready once this guest TCP port answers (5555)")
    image.add_argument("--disk-bus", default="virtio", choices=["virtio", "sata"], help="import-disk: disk bus")
    image.add_argument("--nic", default="virtio", choices=["virtio", "e1000"], help="import-disk: NIC model")
    image.add_argument("--auth", help="registry credentials user:password (or SHOAL_REGISTRY_AUTH)")
    image.add_argument("--platform", help="pull: os/arch from an index (default: this host)")
    image.add_argument("-f", "--file", help="build: the Dockerfile")
    image.add_argument("--context", help="build: the directory COPY reads from (default: the Dockerfile's)")
    image.add_argument("--no-cache", action="store_true")
    image.add_argument("--network", help="build: RUN steps' network policy (default: the node's, the internet)")
    image.add_argument("--force", action="store_true")
    image.set_defaults(func=cmd_image)
    log = sub.add_parser("log", help="show or export (JSONL) a sandbox's trajectory log")
    log.add_argument("action", choices=["show", "export"])
    log.add_argument("target", help="sandbox ID or trajectory name")
    log.add_argument("-o", "--output", help="export to this file (default: stdout)")
    log.set_defaults(func=cmd_log)
    demo = sub.add_parser("demo", help="create a few hundred sandboxes concurrently and use them")
    demo.add_argument("--count", type=int, default=300)
    demo.add_argument("--concurrency", type=int, default=32)
    demo.add_argument("--image", default="debian")
    demo.set_defaults(func=cmd_demo)
    cluster = sub.add_parser("cluster", help="shoal on a Ray cluster: up, down, status")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--ray-address", default="auto")
    cluster.add_argument("--cluster-home", default="/var/lib/shoal/cluster", help="state directories on each node")
    cluster.add_argument("--gateways", type=int, default=1)
    cluster.add_argument("--port", type=int, default=7470, help="first gateway port (0: any free port)")
    cluster.add_argument("--tokens", help="token file (JSON; default: make one project 'default')")
    cluster.add_argument("--max-sandboxes", type=int, default=0, help="per node (default: the node's own)")
    cluster.add_argument("--images", help="image store on each machine (default /var/lib/shoal/store)")
    cluster.add_argument("--resource", help="only Ray nodes offering this custom resource run shoal")
    cluster.add_argument("--wait-nodes", type=int, default=1)
    cluster.add_argument(
        "--tls",
        metavar="DIR",
        help="make a CA in DIR (kept if there) and serve every port with TLS from its certificates",
    )
    cluster.set_defaults(func=cmd_cluster)
    e2b = sub.add_parser("e2b", help="serve E2B's API (unmodified e2b SDK programs) backed by shoal; docs/E2B.md")
    e2b.add_argument("action", choices=["serve"])
    e2b.add_argument(
        "rest", nargs=argparse.REMAINDER, help="--listen HOST:PORT --target shoal://... --template N=IMAGE"
    )
    e2b.set_defaults(func=cmd_e2b)
    tls_cmd = sub.add_parser("tls", help="make a CA and certificates for nodes and gateways (docs/SECURITY.md)")
    tls_cmd.add_argument("action", choices=["init"])
    tls_cmd.add_argument("dir", help="directory for ca.crt, ca.key and NAME.crt/NAME.key (the CA is kept if there)")
    tls_cmd.add_argument("--name", action="append", help="a certificate per name (repeatable; default node, gateway)")
    tls_cmd.add_argument("--host", action="append", default=[], help="a name or address it is valid for (repeatable)")
    tls_cmd.set_defaults(func=cmd_tls)
    console = sub.add_parser("console", help="print (or --open) the web console's URL (log in with a token)")
    console.add_argument("--http", help="host:port of a node's or gateway's HTTP (default: the local node's)")
    console.add_argument("--open", action="store_true", help="also open it in a browser")
    console.set_defaults(func=cmd_console)
    view_cmd = sub.add_parser("view", help="print (or --open) the URL of a sandbox's live screen (noVNC)")
    view_cmd.add_argument("id", help="a sandbox with a screen (a desktop container or a vm with screen=)")
    view_cmd.add_argument("--open", action="store_true", help="also open it in a browser")
    view_cmd.set_defaults(func=cmd_view)
    top = sub.add_parser("top", help="live view of a cluster (through a gateway)")
    top.add_argument("--ray-address", help="find the gateway through this Ray cluster")
    top.add_argument("--interval", type=float, default=1.0)
    top.add_argument("--once", action="store_true", help="print one screen and exit")
    top.set_defaults(func=cmd_top)
    args = parser.parse_args(argv)
    if getattr(args, "action", None) == "build-base":
        args.action = "build"
    try:
        return args.func(args)
    except shoal.ShoalError as exc:
        print(f"shoal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
