"""A throwaway OCI registry on loopback and OCI images written by hand: for the tests
and the ``image`` benchmark suite (never for serving anything).

:class:`LocalRegistry` runs Debian's ``docker-registry`` (the CNCF distribution registry)
as our own child process (its systemd unit is not used): a config file and filesystem
storage in a given directory, a free loopback port, optional htpasswd basic auth (the
bcrypt line made with the C library's crypt(3), which libxcrypt gives ``$2b$``).
:func:`write_image` writes an OCI image layout (gzip tar layers, config with
``rootfs.diff_ids``, manifest, optionally a two-platform index) from Python; skopeo then
pushes it (:func:`push`).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

__all__ = ["Entry", "LocalRegistry", "push", "tar_dir", "write_image"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bcrypt_line(user: str, password: str) -> str:
    """An htpasswd line (bcrypt, which the registry requires)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # 3.11: deprecated but present; libxcrypt does bcrypt
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        raise RuntimeError("this C library's crypt(3) cannot make bcrypt hashes")
    return f"{user}:{hashed}\n"


@dataclass
class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1:<free port>, data under ``workdir``."""

    workdir: str
    auth: tuple[str, str] | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Self:
        os.makedirs(self.workdir, exist_ok=True)
        auth = ""
        if self.auth is not None:
            pw = os.path.join(self.workdir, "htpasswd")
            with open(pw, "w") as f:
                f.write(bcrypt_line(*self.auth))
            auth = f"auth:\n  htpasswd:\n    realm: dsec-test\n    path: {pw}\n"
        for _ in range(5):
            self.port = _free_port()
            cfg = os.path.join(self.workdir, "config.yml")
            with open(cfg, "w") as f:
                f.write("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
                        f"storage:\n  filesystem:\n    rootdirectory: {self.workdir}/data\n"
                        "  delete:\n    enabled: true\n"
                        f"http:\n  addr: 127.0.0.1:{self.port}\n" + auth)
            self.proc = subprocess.Popen(
                ["docker-registry", "serve", cfg], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.workdir, "registry.log"), "ab"))  # noqa: SIM115
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                    return self
                except urllib.error.HTTPError:
                    return self        # 401: up, and asking for auth
                except OSError:
                    time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"docker-registry did not start; see {self.workdir}/registry.log")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None

    def blob_path(self, digest: str) -> str:
        """Where the registry keeps a blob on disk (tests corrupt it)."""
        hx = digest.removeprefix("sha256:")
        return os.path.join(self.workdir, "data", "docker", "registry", "v2", "blobs",
                            "sha256", hx[:2], hx, "data")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------- OCI by hand
@dataclass(frozen=True)
class Entry:
    """A tar member: ``file`` (data), ``dir``, ``symlink`` (target in data),
    ``whiteout`` (hides ``path`` below) or ``opaque`` (directory ``path`` replaced)."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644


def _add(tf: tarfile.TarFile, e: Entry) -> None:
    path = e.path.strip("/")
    if e.kind == "whiteout":
        d, _, base = path.rpartition("/")
        path, kind, data = (f"{d}/.wh.{base}" if d else f".wh.{base}"), "file", b""
    elif e.kind == "opaque":
        path, kind, data = f"{path}/.wh..wh..opq", "file", b""
    else:
        kind, data = e.kind, e.data
    ti = tarfile.TarInfo(path)
    ti.mtime = 1_700_000_000
    ti.mode = e.mode
    if kind == "dir":
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(ti)
    elif kind == "symlink":
        ti.type, ti.linkname = tarfile.SYMTYPE, data.decode()
        tf.addfile(ti)
    else:
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))


def tar_entries(entries: Sequence[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            _add(tf, e)
    return buf.getvalue()


def tar_dir(root: str) -> bytes:
    """A directory as an uncompressed tar (paths relative to it, sorted, fixed mtimes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for n in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, n)
                ti = tf.gettarinfo(full, os.path.relpath(full, root))
                ti.mtime = 1_700_000_000
                if ti.isfile():
                    with open(full, "rb") as f:
                        tf.addfile(ti, f)
                else:
                    tf.addfile(ti)
    return buf.getvalue()


def _put(layout: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    d = os.path.join(layout, "blobs", "sha256")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, digest[7:]), "wb") as f:
        f.write(data)
    return digest


@dataclass
class Built:
    """What :func:`write_image` wrote: the manifest (per platform) and layer digests."""

    manifest: str
    layers: list[str] = field(default_factory=list)        # blob digests, bottom first
    diff_ids: list[str] = field(default_factory=list)


def _image(layout: str, layers: Sequence[bytes], config: Mapping[str, Any],
           arch: str, bad_diff_id: bool = False) -> tuple[dict[str, Any], Built]:
    blobs, diffs = [], []
    descs = []
    for raw in layers:
        gz = gzip.compress(raw, mtime=0)
        digest = _put(layout, gz)
        blobs.append(digest)
        diffs.append("sha256:" + hashlib.sha256(raw).hexdigest())
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      "digest": digest, "size": len(gz)})
    if bad_diff_id and diffs:
        diffs[-1] = "sha256:" + "0" * 64
    cfg = {"architecture": arch, "os": "linux", "config": dict(config),
           "rootfs": {"type": "layers", "diff_ids": diffs}}
    cfg_bytes = json.dumps(cfg).encode()
    cfg_digest = _put(layout, cfg_bytes)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": cfg_digest, "size": len(cfg_bytes)},
                "layers": descs}
    mb = json.dumps(manifest).encode()
    md = _put(layout, mb)
    return ({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md,
             "size": len(mb), "platform": {"architecture": arch, "os": "linux"}},
            Built(md, blobs, diffs))


def write_image(layout: str, tag: str, layers: Sequence[bytes] | Mapping[str, Sequence[bytes]],
                config: Mapping[str, Any] | None = None, *, arch: str = "amd64",
                bad_diff_id: bool = False) -> dict[str, Built]:
    """Add image ``tag`` to the OCI layout ``layout`` (created when missing). ``layers``
    are uncompressed tars bottom first, or a mapping arch -> layers for an image index.
    Returns the per-arch :class:`Built`."""
    os.makedirs(layout, exist_ok=True)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion":"1.0.0"}')
    idx_path = os.path.join(layout, "index.json")
    try:
        with open(idx_path) as f:
            index = json.load(f)
    except FileNotFoundError:
        index = {"schemaVersion": 2, "manifests": []}
    per = layers if isinstance(layers, Mapping) else {arch: layers}
    out: dict[str, Built] = {}
    descs = []
    for a, ls in per.items():
        d, built = _image(layout, ls, config or {}, a, bad_diff_id)
        descs.append(d)
        out[a] = built
    if isinstance(layers, Mapping):
        ib = json.dumps({"schemaVersion": 2,
                         "mediaType": "application/vnd.oci.image.index.v1+json",
                         "manifests": descs}).encode()
        top = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": _put(layout, ib),
               "size": len(ib)}
    else:
        top = {k: v for k, v in descs[0].items() if k != "platform"}
    top["annotations"] = {"org.opencontainers.image.ref.name": tag}
    index["manifests"] = [m for m in index["manifests"]
                          if (m.get("annotations") or {}).get(
                              "org.opencontainers.image.ref.name") != tag] + [top]
    with open(idx_path, "w") as f:
        json.dump(index, f)
    return out


def push(layout: str, tag: str, dest: str, *, creds: str | None = None) -> None:
    """``skopeo copy --all oci:<layout>:<tag> docker://<dest>`` over plain HTTP."""
    args = ["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false"]
    if creds:
        args += ["--dest-creds", creds]
    subprocess.run([*args, f"oci:{layout}:{tag}", f"docker://{dest}"], check=True,
                   capture_output=True)


@contextlib.contextmanager
def registry(workdir: str, auth: tuple[str, str] | None = None) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(workdir, auth=auth).start()
    try:
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(os.path.join(workdir, "data"), ignore_errors=True)
