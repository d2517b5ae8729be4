"""TLS for the network ports (node TCP and HTTP, gateway TCP and HTTP) and the clients that call them.

Why: a token is a bearer secret; sent over plain TCP anyone on the path can replay it. Servers take a
certificate and key from files (SHOAL_TLS_CERT, SHOAL_TLS_KEY); clients (the Python client, a gateway
calling its nodes, the Ray controller) verify the server against a CA file (SHOAL_TLS_CA or `tls_ca=`).
`shoal tls init DIR` makes a private CA and certificates with the `openssl` command (no Python dependency
is needed for that; `cryptography` is not part of shoal's install).

Plaintext policy: a server refuses a token that arrives over plain TCP from a peer that is not on the
loopback interface, and a client refuses to send one to such a host, unless SHOAL_PLAINTEXT_TOKENS=1 says
the network is trusted (e.g. inside a Ray cluster's private network). Loopback stays allowed: a token that
never leaves the machine cannot be sniffed on the wire.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import subprocess
from pathlib import Path

from shoal import settings
from shoal.errors import AuthenticationError, InvalidRequestError, TLSError

SCHEME_TLS = "shoals://"
SCHEME_PLAIN = "shoal://"


_LOOPBACK = frozenset(("localhost", "127.0.0.1", "::1"))


def is_loopback(host: str) -> bool:
    """Is `host` (an address or name) on the loopback interface? Names are resolved; unresolvable is not."""
    host = host.strip("[]")
    if host in _LOOPBACK:  # the common peers, without parsing an address per request
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def plaintext_allowed() -> bool:
    return bool(settings.PLAINTEXT_TOKENS.get())


def refuse_plaintext(peer: str, where: str) -> None:
    """Raise AuthenticationError if a token may not travel in clear between here and `peer`."""
    if is_loopback(peer) or plaintext_allowed():
        return
    raise AuthenticationError(
        f"tokens are refused over plain TCP to or from {peer} ({where}): use TLS (a shoals:// address with the "
        "cluster's CA, servers started with SHOAL_TLS_CERT and SHOAL_TLS_KEY; `shoal tls init` makes them), "
        "or set SHOAL_PLAINTEXT_TOKENS=1 if this network is trusted"
    )


def server_context(cert: str | os.PathLike[str] | None = None, key: str | os.PathLike[str] | None = None):
    """The server side from files (default SHOAL_TLS_CERT / SHOAL_TLS_KEY); None when neither is set."""
    cert = cert or settings.TLS_CERT.raw()
    key = key or settings.TLS_KEY.raw()
    if not cert and not key:
        return None
    if not cert or not key:
        raise InvalidRequestError("TLS needs both a certificate and a key: set SHOAL_TLS_CERT and SHOAL_TLS_KEY")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequestError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from exc
    return ctx


def client_context(ca: str | os.PathLike[str] | None = None, cadata: str | None = None) -> ssl.SSLContext:
    """The client side: verify the server against `ca` (default SHOAL_TLS_CA, else the system's CAs), or
    against the PEM `cadata` (a cluster on Ray hands its CA to clients that way, see cluster/ray.py).
    Make it once per client: loading the system's CAs costs tens of ms (bench/bench_tls.py)."""
    ca = None if cadata else (ca or settings.TLS_CA.raw())
    try:  # a CA given: only it is trusted
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None, cadata=cadata)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequestError(f"cannot load the TLS CA {ca or 'given'}: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def explain(exc: BaseException, address: str, ca: str | os.PathLike[str] | None) -> TLSError:
    """A TLS failure as the user can act on it (which CA, what to pass)."""
    ca = ca or settings.TLS_CA.raw()
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TLSError(
            f"the TLS certificate of {address} is not trusted ({exc.verify_message}) by "
            f"{'the CA file ' + str(ca) if ca else 'the system CAs'}: pass the cluster's CA "
            "(shoal.Client(..., tls_ca='ca.crt') or SHOAL_TLS_CA), and check the certificate names this host"
        )
    return TLSError(
        f"TLS with {address} failed ({exc}): is it serving TLS? (a shoals:// address needs a server started "
        "with SHOAL_TLS_CERT and SHOAL_TLS_KEY; use shoal:// for a plain one)"
    )


# ---------------------------------------------------------------- making a CA and certificates (openssl CLI)


def _openssl(*args: str, cwd: Path) -> None:
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise TLSError("making certificates needs the openssl command: apt-get install openssl") from None
    if proc.returncode != 0:
        raise TLSError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")


def make_ca(directory: str | os.PathLike[str], name: str = "shoal cluster CA", days: int = 3650) -> Path:
    """Make ca.key and ca.crt in `directory` (kept if present); returns the CA certificate's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "ca.crt").exists():
        old = os.umask(0o077)
        try:
            _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "ca.key", cwd=d)
        finally:
            os.umask(old)
        _openssl("req", "-x509", "-new", "-key", "ca.key", "-out", "ca.crt", "-days", str(days), "-subj",
                 f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    return d / "ca.crt"


def issue(directory: str | os.PathLike[str], name: str, hosts: list[str], days: int = 825) -> tuple[Path, Path]:
    """A certificate for `name` signed by the CA in `directory`, valid for `hosts` (names and addresses,
    plus localhost and the loopback addresses); returns (cert, key) paths `name.crt`, `name.key`."""
    d = Path(directory)
    if not (d / "ca.key").exists():
        raise TLSError(f"no CA in {d}: run `shoal tls init {d}` first")
    sans = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1", "::1"]):
        try:
            sans.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            sans.append(f"DNS:{host}")
    old = os.umask(0o077)
    try:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key", cwd=d)
    finally:
        os.umask(old)
    ext = d / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={','.join(sans)}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    try:
        _openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", str(days), "-extfile", ext.name, cwd=d)  # fmt: skip
    finally:
        ext.unlink(missing_ok=True)
        (d / f"{name}.csr").unlink(missing_ok=True)
    return d / f"{name}.crt", d / f"{name}.key"


def init(directory: str | os.PathLike[str], names: list[str], hosts: list[str]) -> dict[str, str]:
    """`shoal tls init`: a CA (kept if present) and one certificate per name for `hosts`."""
    out = {"ca": str(make_ca(directory))}
    for name in names:
        cert, key = issue(directory, name, hosts or [socket.gethostname()])
        out[name] = f"{cert} {key}"
    return out


def write_material(directory: str | os.PathLike[str], name: str, material: dict[str, str]) -> dict[str, str]:
    """Write PEM `material` ({"cert", "key", "ca"}) as name.crt, name.key, ca.crt in `directory` (owner-only);
    returns the SHOAL_TLS_* settings that make a node or gateway serve with it and trust that CA."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    paths = {"cert": d / f"{name}.crt", "key": d / f"{name}.key", "ca": d / "ca.crt"}
    for what, path in paths.items():
        path.touch(mode=0o600)
        path.write_text(material[what])
    return {"SHOAL_TLS_CERT": str(paths["cert"]), "SHOAL_TLS_KEY": str(paths["key"]), "SHOAL_TLS_CA": str(paths["ca"])}
