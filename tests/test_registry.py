"""Registry pull and push against a real registry server on loopback (Debian's docker-registry)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess
from ocitools import Entry, layer_tar, sha, write_oci_layout

from shoal.errors import ImageError, ImageNotFoundError
from shoal.images import ImageStore, layout, registry

REGISTRY = shutil.which("docker-registry")
pytestmark = pytest.mark.skipif(
    REGISTRY is None, reason="docker-registry is not installed (apt-get install docker-registry)"
)


class Registry:
    """A registry server on 127.0.0.1 with its own storage; stop() and start() keep the content."""

    def __init__(self, root: Path, extra_config: str = "") -> None:
        self.root = root
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n" + extra_config
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> Registry:
        log = open(self.root / "registry.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([REGISTRY, "serve", str(self.root / "config.yml")], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).close()
                return self
            except urllib.error.HTTPError:
                return self  # answering (401 with auth on)
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"registry did not start: {(self.root / 'registry.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def blob_file(self, digest: str) -> Path:
        hexd = digest[7:]
        return self.root / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    server = Registry(tmp_path / "registry").start()
    yield server
    server.stop()


LAYERS = [
    layer_tar([Entry("etc", "dir", mode=0o755), Entry("etc/a", data=b"a" * 1000), Entry("etc/gone", data=b"x")]),
    layer_tar([Entry("etc", "dir", mode=0o755), Entry("etc/gone", "whiteout"), Entry("etc/b", data=b"b")]),
    layer_tar([Entry("big", data=os.urandom(32 << 20))]),  # more than loopback socket buffers hold
]


@pytest.fixture
def source(tmp_path: Path) -> ImageStore:
    store = ImageStore(tmp_path / "src-store")
    write_oci_layout(tmp_path / "oci", LAYERS)
    layout.import_archive(store, tmp_path / "oci", "app")
    return store


def test_push_pull_round_trip_skips_what_is_there(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    ref = f"{reg.host}/team/app:v1"
    pushed = registry.push(source, "app", ref)
    assert pushed["uploaded"] == 3 and pushed["skipped"] == 0
    assert registry.push(source, "app", f"{reg.host}/team/app:v2")["skipped"] == 3
    target = ImageStore(tmp_path / "dst")
    pulled = registry.pull(target, ref)
    assert pulled["name"] == ref and pulled["fetched"] == 3 and pulled["digest"] == pushed["digest"]
    assert list(target.get(ref).layer_ids) == [sha(t) for t in LAYERS]
    assert registry.pull(target, f"{reg.host}/team/app:v2", "local")["skipped"] == 3
    by_digest = registry.pull(target, f"{reg.host}/team/app@{pushed['digest']}", "pinned")
    assert by_digest["layers"] == pulled["layers"]
    with pytest.raises(ImageNotFoundError, match="not in the registry"):
        registry.pull(target, f"{reg.host}/team/app:nope")
    with pytest.raises(ImageError, match="names no registry"):
        registry.pull(target, "team/app:v1")


def test_short_names_resolve_on_the_default_registry_like_docker(
    reg: Registry, source: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python:3.11` is `library/python:3.11` and `user/repo` is `user/repo` on SHOAL_DEFAULT_REGISTRY
    (pointed at the loopback server here); a `host:port/` reference keeps its own host."""
    monkeypatch.setenv("SHOAL_DEFAULT_REGISTRY", reg.host)
    pushed = registry.push(source, "app", f"{reg.host}/library/python:3.11")
    target = ImageStore(tmp_path / "dst")
    pulled = registry.pull(target, "python:3.11")
    assert pulled["digest"] == pushed["digest"] and pulled["name"] == "python:3.11"
    assert list(target.get("python:3.11").layer_ids) == [sha(t) for t in LAYERS]
    registry.push(source, "app", "team/app")  # short names push to the default registry too
    assert registry.pull(target, f"{reg.host}/team/app:latest", "full")["digest"] == pushed["digest"]
    monkeypatch.setenv("SHOAL_DEFAULT_REGISTRY", "127.0.0.1:1")  # nothing listens: an explicit host is kept
    assert registry.pull(target, f"{reg.host}/team/app", "explicit")["skipped"] == 3


def test_layers_download_side_by_side(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    """The first blob's download waits (in its progress callback) until another blob's has started: a
    pull that fetched one blob at a time would wait the whole deadline and fail here."""
    registry.push(source, "app", f"{reg.host}/par/app:v1")
    seen: set[str] = set()
    together = threading.Event()
    met: list[bool] = []
    lock = threading.Lock()

    def progress(digest: str, done: int, total: int) -> None:
        with lock:
            seen.add(digest)
            first = len(seen) == 1
            if len(seen) >= 2:
                together.set()
        if first:
            met.append(together.wait(timeout=60))

    pulled = registry.pull(ImageStore(tmp_path / "dst"), f"{reg.host}/par/app:v1", progress=progress)
    assert met == [True] and pulled["fetched"] == 3 and len(seen) == 3


def test_index_platform_selection(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    pushed = registry.push(source, "app", f"{reg.host}/multi/app:amd")
    client = registry.RegistryClient(registry.Reference.parse(f"{reg.host}/multi/app:all"), push=True)
    _, digest, raw = client.manifest("amd")
    index = {
        "schemaVersion": 2,
        "mediaType": layout.INDEX,
        "manifests": [
            {
                "mediaType": layout.MANIFEST,
                "digest": digest,
                "size": len(raw),
                "platform": {"os": "linux", "architecture": arch},
            }
            for arch in ("arm64", layout.host_platform()[1])
        ],
    }
    body = json.dumps(index).encode()
    client.request("PUT", "manifests/all", headers={"Content-Type": layout.INDEX}, body=body, ok=(201,)).close()
    target = ImageStore(tmp_path / "dst")
    assert registry.pull(target, f"{reg.host}/multi/app:all")["digest"] == pushed["digest"]
    with pytest.raises(ImageError, match="no linux/s390x variant"):
        registry.pull(target, f"{reg.host}/multi/app:all", platform=("linux", "s390x"))


def test_corrupt_blob_in_the_registry_is_refused(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    registry.push(source, "app", f"{reg.host}/bad/app:v1")
    blob = source.layer_info(sha(LAYERS[0])).blob
    data = bytearray(reg.blob_file(blob).read_bytes())
    data[10] ^= 0xFF
    reg.blob_file(blob).write_bytes(bytes(data))
    target = ImageStore(tmp_path / "dst")
    with pytest.raises(ImageError, match="digest mismatch"):
        registry.pull(target, f"{reg.host}/bad/app:v1")
    assert target.present() == [] and not target.has_layer(sha(LAYERS[0]))


def test_registry_going_away_mid_pull_then_resume(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    ref = f"{reg.host}/flaky/app:v1"
    registry.push(source, "app", ref)
    big_blob = source.layer_info(sha(LAYERS[2])).blob
    target = ImageStore(tmp_path / "dst")
    seen: list[int] = []

    def kill_midway(blob: str, done: int, total: int) -> None:
        if blob == big_blob and 0 < done < total and not seen:
            seen.append(done)
            reg.stop()

    with pytest.raises(ImageError, match="pull again to resume"):
        registry.pull(target, ref, progress=kill_midway)
    assert target.present() == [] and not target.has_layer(sha(LAYERS[2]))
    partial = target.root / "partial" / big_blob.replace(":", "-")
    kept = partial.stat().st_size
    assert 0 < kept < len(LAYERS[2])
    reg.start()
    starts: list[int] = []
    result = registry.pull(target, ref, progress=lambda b, d, t: starts.append(d) if b == big_blob else None)
    assert starts and min(starts) > kept  # resumed from the kept bytes, not from zero
    assert result["layers"][-1] == sha(LAYERS[2]) and not partial.exists()


def test_prune_drops_abandoned_partial_downloads(reg: Registry, source: ImageStore, tmp_path: Path) -> None:
    ref = f"{reg.host}/abandoned/app:v1"
    registry.push(source, "app", ref)
    target = ImageStore(tmp_path / "dst")
    with pytest.raises(ImageError, match="pull again to resume"):
        registry.pull(target, ref, progress=lambda b, d, t: reg.stop() if 0 < d < t else None)
    assert any((target.root / "partial").iterdir())
    assert target.prune()["freed_bytes"] > 0
    assert list((target.root / "partial").iterdir()) == []


def test_pull_through_the_node_streams_progress_and_shares_concurrent_pulls(
    reg: Registry,
    source: ImageStore,
    node: NodeProcess,
) -> None:
    ref = f"{reg.host}/node/app:{os.getpid()}-{time.monotonic_ns()}"
    registry.push(source, "app", ref)

    async def both() -> list[dict]:
        events: list[dict] = []
        async with node.async_client() as c:
            return await asyncio.gather(
                c.image_pull(ref, on_progress=events.append), c.image_pull(ref, on_progress=events.append)
            ), events

    (first, second), events = asyncio.run(both())
    assert first == second and first["fetched"] >= 1  # one download served both callers (the big layer is new)
    assert events and events[-1]["done"] == events[-1]["total"]
    with node.client() as c:
        with c.create("container", image="busybox", layers=[ref], pool=False) as sb:
            assert sb.exec("cat /etc/b; test -e /etc/gone").stdout == "b"
            assert sb.exec("test -e /etc/gone").exit_code == 1
        again = f"{reg.host}/node/again:v1"
        try:
            pushed = c.image_push(ref, again)
            assert pushed["uploaded"] + pushed["skipped"] == 3
            assert c.image_pull(again)["layers"] == first["layers"]
        finally:
            for name in {ref, again} & set(c.images()):
                c.image_rm(name)


class TokenServer:
    """A bearer-token service for the registry: checks Basic credentials, signs RS256 JWTs (openssl)."""

    def __init__(self, root: Path, user: str, password: str) -> None:
        import http.server
        import threading

        root.mkdir(parents=True, exist_ok=True)
        self.key, self.cert = root / "key.pem", root / "cert.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key), "-out",
             str(self.cert), "-days", "1", "-subj", "/CN=shoal-test-token"],
            check=True, capture_output=True,
        )  # fmt: skip
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], capture_output=True)
        self.x5c = base64.b64encode(der.stdout).decode()
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.issued = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                if self.headers.get("Authorization") != server.expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": server.token(query.get("scope", [""])[0])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def token(self, scope: str) -> str:
        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": "shoal-test-issuer",
            "sub": "tester",
            "aud": "shoal-test",
            "iat": now - 10,
            "nbf": now - 10,
            "exp": now + 300,
            "jti": os.urandom(8).hex(),
            "access": [{"type": kind, "name": name, "actions": actions.split(",")}] if scope else [],
        }
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(), capture_output=True
        ).stdout
        self.issued += 1
        return f"{signing_input}.{b64(signature)}"

    def stop(self) -> None:
        self.httpd.shutdown()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to sign test tokens")
def test_token_auth(tmp_path: Path, source: ImageStore) -> None:
    tokens = TokenServer(tmp_path / "tokens", "tester", "s3cret")
    auth = (
        f"auth:\n  token:\n    realm: http://127.0.0.1:{tokens.port}/token\n    service: shoal-test\n"
        f"    issuer: shoal-test-issuer\n    rootcertbundle: {tokens.cert}\n"
    )
    server = Registry(tmp_path / "registry", auth).start()
    try:
        ref = f"{server.host}/secure/app:v1"
        with pytest.raises(ImageError, match="denied|could not get a token"):
            registry.push(source, "app", ref)
        with pytest.raises(ImageError, match="could not get a token"):
            registry.push(source, "app", ref, auth="tester:wrong")
        assert registry.push(source, "app", ref, auth="tester:s3cret")["uploaded"] == 3
        target = ImageStore(tmp_path / "dst")
        assert registry.pull(target, ref, auth="tester:s3cret")["fetched"] == 3
        assert tokens.issued >= 2
        # what `docker login` writes, read when no credentials are given
        login = tmp_path / "docker-config.json"
        entry = base64.b64encode(b"tester:s3cret").decode()
        login.write_text(json.dumps({"auths": {f"http://{server.host}/v2/": {"auth": entry}}}))
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SHOAL_REGISTRY_CREDENTIALS", str(login))
            assert registry.pull(ImageStore(tmp_path / "dst2"), ref)["fetched"] == 3
            login.write_text("{not json")
            with pytest.raises(ImageError, match="credentials file .* is unreadable"):
                registry.pull(ImageStore(tmp_path / "dst3"), ref)
    finally:
        server.stop()
        tokens.stop()
