"""Pull and push over the OCI distribution API (blocking; the node runs it in threads).

References name their registry: `HOST[:PORT]/REPOSITORY[:TAG|@DIGEST]`. Plain HTTP is used for loopback
hosts and for hosts listed in SHOAL_INSECURE_REGISTRIES (comma-separated); HTTPS otherwise. Credentials
come from the call or SHOAL_REGISTRY_AUTH=`user:password`; bearer-token challenges are answered by
fetching a token from the realm the registry names. Blobs are verified by digest; an interrupted
download keeps its bytes under `partial/` and the next pull resumes it with a Range request.
"""

from __future__ import annotations

import base64
import concurrent.futures
import fcntl
import hashlib
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shoal import settings
from shoal.errors import ImageError, ImageNotFoundError
from shoal.images import layout
from shoal.images.store import LAYER_GZIP, ImageConfig, ImageStore

ACCEPT = ", ".join([layout.INDEX, layout.MANIFEST, layout.DOCKER_INDEX, layout.DOCKER_MANIFEST])
Progress = Callable[[str, int, int], None]  # (what, done bytes, total bytes)
_CHUNK = 1 << 20
_RETRIES = 3
_PARALLEL = 4  # layer downloads at once (Docker's default is 3; registries allow more)


@dataclass(frozen=True)
class Reference:
    host: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> Reference:
        first, _, rest = text.partition("/")
        if not rest or not ("." in first or ":" in first or first == "localhost"):
            # Docker's rule: a first part without a dot, a port or `localhost` is not a host, so the name
            # lives on the default registry, and a one-part name in its `library/` namespace.
            default = settings.DEFAULT_REGISTRY.get()
            if not default:
                raise ImageError(
                    f"reference {text!r} names no registry: write it as HOST[:PORT]/REPOSITORY[:TAG], "
                    "or set SHOAL_DEFAULT_REGISTRY to the registry that short names mean"
                )
            first, rest = default.rstrip("/"), (text if rest else f"library/{text}")
        digest = None
        if "@" in rest:
            rest, _, digest = rest.partition("@")
        tag = None
        if ":" in rest.rpartition("/")[2]:
            rest, _, tag = rest.rpartition(":")
        if not re.fullmatch(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*", rest):
            raise ImageError(f"reference {text!r}: {rest!r} is not a valid repository name (lowercase, digits, ._-/)")
        return cls(first, rest, tag if tag or digest else "latest", digest)

    @property
    def ref(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.host}/{self.repository}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


def stored_credentials(host: str) -> str | None:
    """`user:password` for `host` from a Docker-format credentials file (what `docker login` writes), or None.
    Credential helpers (`credsStore`) are not run: only inline `auths` entries are read."""
    path = settings.REGISTRY_CREDENTIALS.get()
    if path is None:
        folder = os.environ.get("DOCKER_CONFIG")
        path = Path(folder) / "config.json" if folder else Path.home() / ".docker" / "config.json"
    try:
        auths = json.loads(path.read_text()).get("auths") or {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        raise ImageError(f"registry credentials file {path} is unreadable ({exc}); fix it or unset it") from exc
    for key, entry in auths.items():
        if key.split("://", 1)[-1].split("/", 1)[0] != host or not isinstance(entry, dict):
            continue
        if entry.get("auth"):
            try:
                return base64.b64decode(entry["auth"]).decode()
            except (ValueError, UnicodeDecodeError) as exc:
                raise ImageError(f"{path}: the `auth` of {key} is not base64 of user:password") from exc
        if entry.get("username") and entry.get("password"):
            return f"{entry['username']}:{entry['password']}"
    return None


class RegistryClient:
    """One registry, one repository; keeps the bearer token it was given."""

    def __init__(self, ref: Reference, auth: str | None = None, *, push: bool = False, timeout: float = 30.0) -> None:
        self.ref = ref
        insecure = {h.strip() for h in settings.INSECURE_REGISTRIES.get().split(",") if h.strip()}
        hostname = ref.host.rpartition(":")[0] if ":" in ref.host else ref.host
        plain = hostname in ("localhost", "127.0.0.1", "::1", "[::1]") or ref.host in insecure
        self.base = f"{'http' if plain else 'https'}://{ref.host}"
        self.auth = auth or settings.REGISTRY_AUTH.get() or stored_credentials(ref.host)
        self.scope = f"repository:{ref.repository}:{'pull,push' if push else 'pull'}"
        self.timeout = timeout
        self._authorization: str | None = None

    # ---------------------------------------------------------------- HTTP with auth

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | IO[bytes] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> http.client.HTTPResponse:
        url = path if path.startswith("http") else f"{self.base}/v2/{self.ref.repository}/{path}"
        for attempt in range(2):
            request = urllib.request.Request(url, method=method, headers=dict(headers or {}), data=body)  # type: ignore[arg-type]
            if self._authorization:
                request.add_header("Authorization", self._authorization)
            try:
                response = urllib.request.urlopen(request, timeout=self.timeout)  # noqa: S310 - the user's registry
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and attempt == 0 and self._answer(exc.headers.get("WWW-Authenticate", "")):
                    if hasattr(body, "seek"):
                        body.seek(0)  # type: ignore[union-attr]
                    continue
                if exc.code in ok:
                    return exc  # type: ignore[return-value]
                raise self._error(exc, method, url) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise ImageError(f"registry {self.ref.host} is unreachable ({reason}); check the address") from exc
            if response.status not in ok:
                raise ImageError(f"{method} {url}: unexpected HTTP {response.status}")
            return response
        raise ImageError(f"registry {self.ref.host} refused the credentials for {self.scope}")

    def _error(self, exc: urllib.error.HTTPError, method: str, url: str) -> ImageError:
        detail = exc.read(2000).decode(errors="replace")
        if exc.code == 404:
            return ImageNotFoundError(f"{self.ref} is not in the registry ({method} {url}: 404 {detail.strip()})")
        if exc.code in (401, 403):
            return ImageError(
                f"registry {self.ref.host} denied {self.scope} (HTTP {exc.code}): give credentials "
                "(auth='user:password' or SHOAL_REGISTRY_AUTH)"
            )
        return ImageError(f"{method} {url}: HTTP {exc.code} {detail.strip()}")

    def _answer(self, challenge: str) -> bool:
        """Meet a 401 challenge: Basic with our credentials, or Bearer with a token from its realm."""
        scheme, _, params = challenge.partition(" ")
        basic = "Basic " + base64.b64encode(self.auth.encode()).decode() if self.auth else None
        if scheme.lower() == "basic":
            self._authorization = basic
            return basic is not None
        if scheme.lower() != "bearer":
            return False
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        realm = fields.pop("realm", None)
        if not realm:
            return False
        query = {"service": fields.get("service", ""), "scope": fields.get("scope") or self.scope}
        request = urllib.request.Request(f"{realm}?{urllib.parse.urlencode(query)}")
        if basic:
            request.add_header("Authorization", basic)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                data = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ImageError(f"could not get a token for {self.ref.host} from {realm}: {exc}") from exc
        token = data.get("token") or data.get("access_token")
        if not token:
            raise ImageError(f"the token service {realm} answered without a token")
        self._authorization = f"Bearer {token}"
        return True

    # ---------------------------------------------------------------- reads

    def manifest(self, ref: str) -> tuple[dict[str, Any], str, bytes]:
        """(manifest or index, its digest, raw bytes), verified when the reference is a digest."""
        with self.request("GET", f"manifests/{ref}", headers={"Accept": ACCEPT}) as response:
            raw = response.read()
            header = response.headers.get("Docker-Content-Digest")
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        expect = ref if ref.startswith("sha256:") else header
        if expect and expect != digest:
            raise ImageError(f"manifest {ref} of {self.ref}: digest mismatch (expected {expect}, got {digest})")
        return json.loads(raw), digest, raw

    def blob_bytes(self, digest: str) -> bytes:
        with self.request("GET", f"blobs/{digest}") as response:
            raw = response.read()
        actual = "sha256:" + hashlib.sha256(raw).hexdigest()
        if actual != digest:
            raise ImageError(f"blob {digest} of {self.ref}: digest mismatch (content hashes to {actual})")
        return raw

    def fetch_blob(self, store: ImageStore, digest: str, size: int | None, progress: Progress | None) -> None:
        """Download a blob into the store, resuming an earlier partial download; verify its digest."""
        partial_dir = store.root / "partial"
        partial_dir.mkdir(parents=True, exist_ok=True)
        partial = partial_dir / digest.replace(":", "-")
        with open(partial.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one downloader per blob across nodes sharing the store
            if store.has_blob(digest):
                return
            actual = ""
            for attempt in range(_RETRIES):
                try:
                    actual = self._download(partial, digest, size, progress)
                    break
                except (OSError, http.client.HTTPException, ImageError) as exc:
                    if isinstance(exc, ImageError) and "mismatch" in str(exc):
                        partial.unlink(missing_ok=True)
                        raise
                    if attempt == _RETRIES - 1:
                        kept = partial.stat().st_size if partial.exists() else 0
                        raise ImageError(
                            f"download of {digest[:19]} from {self.ref.host} failed ({exc}); "
                            f"{kept} bytes are kept: pull again to resume"
                        ) from exc
                    time.sleep(0.2 * (attempt + 1))
            if actual != digest:
                partial.unlink(missing_ok=True)
                raise ImageError(f"blob {digest} of {self.ref}: digest mismatch after download; pull again")
            store.adopt_blob(partial, digest)

    def _download(self, partial: Path, digest: str, size: int | None, progress: Progress | None) -> str:
        """Fetch the rest of a blob into `partial`; returns the digest of the whole file."""
        sha = hashlib.sha256()
        have = 0
        if partial.exists():
            with open(partial, "rb") as kept:
                while chunk := kept.read(_CHUNK):
                    sha.update(chunk)
                    have += len(chunk)
        if size is not None and have == size:
            return "sha256:" + sha.hexdigest()
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self.request("GET", f"blobs/{digest}", headers=headers, ok=(200, 206)) as response:
            if response.status == 200 and have:
                have, sha = 0, hashlib.sha256()  # the registry ignored the range: start over
            with open(partial, "r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    sha.update(chunk)
                    have += len(chunk)
                    if progress:
                        progress(digest, have, size or 0)
        if size is not None and have != size:
            raise ImageError(f"blob {digest[:19]}: connection closed after {have} of {size} bytes")
        return "sha256:" + sha.hexdigest()

    # ---------------------------------------------------------------- writes

    def has_blob(self, digest: str) -> bool:
        try:
            with self.request("HEAD", f"blobs/{digest}", ok=(200, 404)) as response:
                return response.status == 200
        except ImageNotFoundError:
            return False

    def upload_blob(self, digest: str, source: Path | bytes, progress: Progress | None = None) -> None:
        with self.request("POST", "blobs/uploads/", ok=(202,), body=b"") as response:
            location = response.headers["Location"]
        if not location.startswith("http"):
            location = self.base + location
        sep = "&" if "?" in location else "?"
        url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
        if isinstance(source, bytes):
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(source))}
            self.request("PUT", url, headers=headers, body=source, ok=(201,)).close()
        else:
            size = source.stat().st_size
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            with open(source, "rb") as handle:
                self.request("PUT", url, headers=headers, body=handle, ok=(201,)).close()
            if progress:
                progress(digest, size, size)


def pull(
    store: ImageStore,
    reference: str,
    name: str | None = None,
    *,
    auth: str | None = None,
    platform: tuple[str, str] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Pull `reference` into the store as `name` (default: the reference); returns a summary."""
    ref = Reference.parse(reference)
    with store.writing():
        try:
            return _pull(store, ref, reference, name, auth, platform, progress)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ImageError(
                f"{reference}: unsupported or malformed manifest (missing or bad field {exc}); "
                "only OCI and Docker schema 2 images can be pulled"
            ) from exc


def _pull(
    store: ImageStore,
    ref: Reference,
    reference: str,
    name: str | None,
    auth: str | None,
    platform: tuple[str, str] | None,
    progress: Progress | None,
) -> dict[str, Any]:
    client = RegistryClient(ref, auth)
    manifest, digest, _ = client.manifest(ref.ref)
    if manifest.get("mediaType") in layout.INDEX_TYPES or "manifests" in manifest:
        chosen = layout.pick_platform(manifest, platform)
        manifest, digest, _ = client.manifest(chosen["digest"])
    config = json.loads(client.blob_bytes(manifest["config"]["digest"]))
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    layers = manifest.get("layers") or []
    if len(diff_ids) != len(layers):
        raise ImageError(f"{ref}: the manifest has {len(layers)} layers, its config {len(diff_ids)} diff_ids")
    fetched, skipped = 0, 0
    unique = dict(zip(diff_ids, layers, strict=True))  # a layer listed twice is fetched and unpacked once
    wanted = [(layer, d) for d, layer in unique.items() if not store.has_layer(d)]
    skipped = len(layers) - len(wanted)
    # Downloads run side by side (each blob has its own lock and partial file); layers are unpacked in
    # order as their blobs arrive, overlapping the downloads still running. A failure waits for the others,
    # whose finished blobs and partial files stay for the next pull.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_PARALLEL, thread_name_prefix="pull") as pool:
        downloads = {
            layer["digest"]: pool.submit(client.fetch_blob, store, layer["digest"], layer.get("size"), progress)
            for layer, _ in wanted
            if not store.has_blob(layer["digest"])
        }
        for layer, diff_id in wanted:
            if layer["digest"] in downloads:
                downloads[layer["digest"]].result()
                fetched += 1
            store.add_layer_blob(layer["digest"], layer.get("mediaType", LAYER_GZIP), expect_diff_id=diff_id)
    local = name or reference
    store.commit(local, list(diff_ids), ImageConfig.from_oci(config.get("config") or {}), oci_config=config)
    return {"name": local, "digest": digest, "layers": list(diff_ids), "fetched": fetched, "skipped": skipped}


def push(
    store: ImageStore, name: str, reference: str, *, auth: str | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Push stored image `name` to `reference`; blobs the registry has already are skipped."""
    ref = Reference.parse(reference)
    if ref.digest:
        raise ImageError(f"push to a tag, not a digest: {reference}")
    client = RegistryClient(ref, auth, push=True)
    config = layout.image_config_json(store, name)
    manifest = layout.manifest_json(store, name, config)
    uploaded, skipped = 0, 0
    for descriptor in json.loads(manifest)["layers"]:
        if client.has_blob(descriptor["digest"]):
            skipped += 1
            continue
        if not store.has_blob(descriptor["digest"]):
            raise ImageError(f"layer blob {descriptor['digest'][:19]} of {name!r} is not stored; pull or rebuild it")
        client.upload_blob(descriptor["digest"], store.blob_path(descriptor["digest"]), progress)
        uploaded += 1
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    if not client.has_blob(config_digest):
        client.upload_blob(config_digest, config)
    headers = {"Content-Type": layout.MANIFEST}
    client.request("PUT", f"manifests/{ref.ref}", headers=headers, body=manifest, ok=(201,)).close()
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    return {"reference": str(ref), "digest": digest, "uploaded": uploaded, "skipped": skipped}
