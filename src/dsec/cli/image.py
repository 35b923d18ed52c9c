"""``dsec image``: build, import, tag, list and remove layers of the node's layer store.

This works on the store directly, as the host user owning it (who can read every layer
anyway), so it is the cluster's superuser: a bare ``--name`` is cluster-wide and
``teama/tools`` is project ``teama``'s. Layers built here record ``host:<user>`` as their
owner. Tenants build through the API (``POST /v1/images``), where the namespace rules
apply (docs/images.md, "Names and tenancy")."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from dsec.cli.edge import blob_store_option
from dsec.cli.sandbox import conn_options
from dsec.errors import DsecError
from dsec.image.erofs import ProgressFn
from dsec.image.manifest import LAYER_KINDS, LayerManifest

if TYPE_CHECKING:
    from dsec.image.store import LayerStore

DEFAULT_ROOT = "/var/lib/dsec/images"
_PHASES = {"pack": "packing EROFS", "hash": "hashing"}


def default_root() -> str:
    """``$DSEC_IMAGE_ROOT``; else the layer store of the running ``dsec up`` (its state
    dir's ``layers/``, where its edges start sandboxes from), else the system store."""
    env = os.environ.get("DSEC_IMAGE_ROOT")
    if env:
        return env
    from dsec.statedir import read_local

    local = read_local()
    if local is not None and isinstance(local.get("state_dir"), str):
        return os.path.join(local["state_dir"], "layers")
    return DEFAULT_ROOT


def _store(root: str | None) -> LayerStore:
    from dsec.image.store import LayerStore

    return LayerStore(root or default_root())


@contextmanager
def _progress(console: Console, quiet: bool) -> Iterator[ProgressFn | None]:
    if quiet:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield report


def _say_skipped(m: LayerManifest) -> None:
    """The special files the one rule left out (tree.special_skip), as every door says."""
    if m.skipped:
        click.echo("skipped " + ", ".join(f"{n} {kind}" for kind, n in m.skipped.items())
                   + " (device nodes other than whiteouts and sockets never enter a layer)")


def _fail(exc: DsecError) -> None:
    raise click.ClickException(str(exc)) from exc


def _host_owner() -> str:
    import pwd
    try:
        return "host:" + pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"host:{os.geteuid()}"


def _split_name(name: str, tag: str) -> tuple[str | None, str, str]:
    """``[project/]name`` + tag -> (namespace, bare name, tag), validated."""
    from dsec.image.manifest import parse_ref

    try:
        p = parse_ref(f"{name}:{tag}")
    except DsecError as exc:
        raise click.BadParameter(exc.message, param_hint="--name") from exc
    if p.name is None:
        raise click.BadParameter(f"{name!r} is a digest, not a name", param_hint="--name")
    return p.namespace, p.name, p.tag


@click.group()
@click.option("--root", envvar="DSEC_IMAGE_ROOT", default=None,
              help="Layer store directory (default $DSEC_IMAGE_ROOT, else the running "
                   f"`dsec up` cluster's store, else {DEFAULT_ROOT}).")
@click.pass_context
def image(ctx: click.Context, root: str | None) -> None:
    """Build and manage read-only image layers (EROFS)."""
    ctx.obj = root


@image.command()
@click.argument("path")
@click.option("--kind", type=click.Choice([k for k in LAYER_KINDS if k != "snapshot"]),
              default=None, help="Role of the layer in a sandbox root (required without -f).")
@click.option("--name", default=None,
              help="[project/]name: 'python' is cluster-wide, 'teama/repo' project teama's "
                   "(required without -f).")
@click.option("--tag", default="latest", show_default=True)
@click.option("--lz4", "compression", flag_value="lz4", default=None,
              help="Compress with lz4 (smaller file, a little CPU per read).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("-f", "--file", "dockerfile", default=None, metavar="DOCKERFILE",
              help="Build from a Dockerfile, PATH being its context: each RUN/COPY runs in "
                   "a build sandbox of the running cluster (--url/--api-key) and becomes "
                   "one layer; unchanged steps come from the step cache.")
@click.option("-t", "image_name", default=None, metavar="NAME[:TAG]",
              help="With -f: name the built image ([project/]name[:tag]; bare: in the "
                   "build's project), so `create(image=NAME)` runs it with its config.")
@click.option("--squash", is_flag=True,
              help="With -t: flatten the base into the named image too (one standalone "
                   "layer; default: the steps as one layer over the base's shared layers).")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE")
@click.option("--network", default="none", show_default=True,
              help="Network of the build sandboxes (none, or a mode the cluster allows).")
@click.option("--project", default=None, help="Project the build sandboxes run in.")
@click.option("--url", envvar="DSEC_URL", default=None, help="apiserver URL (with -f).")
@click.option("--api-key", envvar="DSEC_API_KEY", default=None, help="API key (with -f).")
@click.pass_obj
def build(root: str | None, path: str, kind: str | None, name: str | None, tag: str,
          compression: str | None, labels: tuple[str, ...], quiet: bool,
          dockerfile: str | None, image_name: str | None, build_args: tuple[str, ...],
          network: str, project: str | None, url: str | None,
          api_key: str | None, squash: bool) -> None:
    """Build a layer from a directory PATH or a tar file ('-' reads a tar from stdin);
    with -f, build an image from a Dockerfile with PATH as its context."""
    if dockerfile is not None:
        if kind is not None or name is not None:
            raise click.UsageError("-f builds from a Dockerfile: drop --kind/--name (the "
                                   "result is started with `--snapshot <top>`)")
        if squash and image_name is None:
            raise click.UsageError("--squash flattens the image -t names: give -t NAME")
        _build_dockerfile(dockerfile, path, build_args, network, project, url, api_key,
                          quiet, image_name, squash)
        return
    if image_name is not None or squash:
        raise click.UsageError("-t/--squash name a Dockerfile build (-f); a layer is named "
                               "--name")
    if kind is None or name is None:
        raise click.UsageError("--kind and --name are required (or -f DOCKERFILE)")
    console = Console(stderr=True)
    lab = dict(item.split("=", 1) for item in labels if "=" in item)
    namespace, bare, tag = _split_name(name, tag)
    store = _store(root)
    owner = _host_owner()

    def add(src: str | IO[bytes], progress: ProgressFn | None) -> LayerManifest:
        if isinstance(src, str):
            return store.add_tree(src, kind=kind, name=bare,  # type: ignore[arg-type]
                                  tag=tag, labels=lab, compression=compression,  # type: ignore[arg-type]
                                  namespace=namespace, owner=owner, progress=progress)
        return store.add_tar(src, kind=kind, name=bare,  # type: ignore[arg-type]
                             tag=tag, labels=lab, compression=compression,  # type: ignore[arg-type]
                             namespace=namespace, owner=owner, progress=progress)
    try:
        with _progress(console, quiet) as progress:
            if path != "-" and os.path.isdir(path):
                m = add(path, progress)
            elif path == "-":
                m = add(sys.stdin.buffer, progress)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    m = add(f, progress)
            else:
                raise click.BadParameter(f"{path!r} is neither a directory nor a tar file",
                                         param_hint="PATH")
    except DsecError as exc:
        _fail(exc)
    click.echo(f"{m.ref} {m.digest} {m.size_bytes} bytes")
    _say_skipped(m)


@image.command("import")
@click.argument("path")
@click.option("--name", required=True)
@click.option("--tag", default="latest", show_default=True)
@click.option("--ref", default=None, help="Image inside a multi-image layout/tarball.")
@click.option("--lz4", "compression", flag_value="lz4", default=None)
@click.pass_obj
def import_(root: str | None, path: str, name: str, tag: str, ref: str | None,
            compression: str | None) -> None:
    """Import an OCI layout (dir or tar) or a `docker save` tarball as one base layer."""
    from dsec.image.oci import import_oci

    namespace, bare, tag = _split_name(name, tag)
    try:
        layers = import_oci(_store(root), path, name=bare, tag=tag, ref=ref,
                            compression=compression,  # type: ignore[arg-type]
                            namespace=namespace, owner=_host_owner())
    except DsecError as exc:
        _fail(exc)
    m = layers[0]
    click.echo(f"{m.ref} {m.digest} {m.size_bytes} bytes")
    _say_skipped(m)


@image.command("pull")
@click.argument("ref")
@click.option("--name", default=None,
              help="[project/]name[:tag] to store it under (default: the registry ref's "
                   "own name, e.g. 127.0.0.1-5000_team_python:3.12, cluster-wide).")
@click.option("--insecure", is_flag=True, help="Plain HTTP (local "
              "registries).")
@click.option("--platform", default=None, metavar="OS/ARCH[/VARIANT]",
              help="Which image of a multi-platform index (default: this host's).")
@click.option("--creds", envvar="DSEC_REGISTRY_CREDS", default=None, metavar="USER:PASS",
              help="Registry credentials (or $DSEC_REGISTRY_CREDS; default: the docker-style "
                   "auth files of the user running it, or --authfile).")
@click.option("--authfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A docker-style auth.json / ~/.docker/config.json.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.pass_obj
def pull(root: str | None, ref: str, name: str | None, insecure: bool, platform: str | None,
         creds: str | None, authfile: str | None, quiet: bool) -> None:
    """Pull REF (host[:port]/repo[:tag|@sha256:...]) from an OCI registry: one layer per
    OCI layer (layers already here are shared), the image's config kept as its
    defaults (`dsec image inspect`)."""
    from dsec.image.pull import PullOptions, pull_image
    from dsec.image.registry import parse_platform

    console = Console(stderr=True)
    try:
        namespace, bare, tag = (None, None, None)
        if name is not None:
            from dsec.image.manifest import parse_ref
            p = parse_ref(name)
            if p.name is None:
                raise click.BadParameter("--name must be a name, not a digest")
            namespace, bare = p.namespace, p.name
            tag = p.tag if ":" in name.rsplit("/", 1)[-1] else None
        opts = PullOptions(platform=parse_platform(platform) if platform else None,
                           insecure=insecure, creds=creds, authfile=authfile,
                           # the CLI is the host user: its own registry logins apply
                           ambient_auth=True)
        with _progress(console, quiet) as progress:
            res = pull_image(_store(root), ref, namespace=namespace, owner=_host_owner(),
                             name=bare, tag=tag, options=opts, progress=progress)
    except DsecError as exc:
        _fail(exc)
    m = res.image
    reused = len(res.layers) - len(res.made)
    click.echo(f"{res.key} {m.digest} {len(res.layers)} layers ({len(res.made)} new, "
               f"{reused} shared), {res.fetched_bytes} bytes fetched")


@image.command("push")
@click.argument("ref")
@blob_store_option
@click.option("--chunk-size", type=click.IntRange(4096), default=262144, show_default=True,
              metavar="BYTES", help="Chunk size of the layers' chunk tables (lazy reads "
                                    "fetch and verify this much at a time).")
@click.option("--verify", is_flag=True,
              help="Read back layers the store already has and check every chunk, instead "
                   "of trusting a complete manifest + chunk table + size.")
@click.option("--json", "as_json", is_flag=True, help="The result as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_obj
def push(root: str | None, ref: str, blob_store: str | None, chunk_size: int, verify: bool,
         as_json: bool, quiet: bool) -> None:
    """Push REF (its layer and every layer below it) to a blob store: each layer file,
    its chunk table and its manifest, lowest layer first. Layers the store already has
    whole are skipped; a push killed midway leaves nothing a node would use."""
    import json

    from dsec.image.blob import open_blobstore
    from dsec.image.blob.push import push_image

    if blob_store is None:
        raise click.UsageError("give --blob-store URL (or set $DSEC_BLOB_STORE)")
    console = Console(stderr=True)
    try:
        blob = open_blobstore(blob_store)
        with _progress(console, quiet or as_json) as progress:
            res = push_image(blob, _store(root), ref, chunk_size=chunk_size, verify=verify,
                             progress=progress)
    except DsecError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps({
            "ref": res.ref, "digest": res.digest, "store": res.store,
            "bytes_uploaded": res.bytes_uploaded, "seconds": round(res.seconds, 3),
            "layers": [{"digest": p.digest, "size_bytes": p.size_bytes,
                        "chunk_size": p.chunk_size, "uploaded": p.uploaded}
                       for p in res.layers]}, sort_keys=True))
        return
    new = sum(p.uploaded for p in res.layers)
    click.echo(f"{ref} {res.digest} -> {res.store}: {len(res.layers)} layers ({new} "
               f"uploaded, {len(res.layers) - new} already there), {res.bytes_uploaded} "
               f"bytes in {res.seconds:.2f} s")


@image.command("pin")
@click.argument("ref")
@click.option("--node", required=True, help="The edge node to keep it cached on.")
@conn_options
def pin(ref: str, node: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Keep REF (every layer of it) fully cached on NODE: its lazily loaded layers are
    fetched whole there and never evicted. Push it to the blob store first. An
    operator's (superuser); stored in the cluster's state store."""
    from dsec.cli.sandbox import client, emit_json

    with client(url, api_key) as c:
        view = c.images.pin(ref, node=node)
    if as_json:
        emit_json(view)
        return
    click.echo(f"{ref} ({view.image}) pinned on {view.node}: {len(view.layers)} layer(s) "
               "kept fully cached")


@image.command("unpin")
@click.argument("image_ref")
@click.option("--node", required=True, help="The edge node it is pinned on.")
@conn_options
def unpin(image_ref: str, node: str, url: str | None, api_key: str | None,
          as_json: bool) -> None:
    """Stop keeping IMAGE (its digest, or the ref it was pinned as) fully cached on NODE."""
    from dsec.cli.sandbox import client, emit_json

    with client(url, api_key) as c:
        digest = image_ref
        if not image_ref.startswith("sha256:") or len(image_ref) != 71:
            hits = [p.image for p in c.images.pins(node) if p.ref == image_ref]
            if not hits:
                raise click.ClickException(f"{image_ref!r} is not pinned on {node} "
                                           "(dsec image pins --node NODE)")
            digest = hits[0]
        c.images.unpin(digest, node=node)
    if as_json:
        emit_json({"node": node, "image": digest, "unpinned": True})
        return
    click.echo(f"{digest} unpinned on {node}")


@image.command("pins")
@click.option("--node", required=True, help="The edge node.")
@conn_options
def pins(node: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """List the images pinned on NODE."""
    from dsec.cli.sandbox import client, emit_json

    with client(url, api_key) as c:
        items = c.images.pins(node)
    if as_json:
        emit_json(items)
        return
    for p in items:
        click.echo(f"{p.image} {p.ref} {len(p.layers)} layer(s) by {p.by}")


@image.command("inspect")
@click.argument("ref")
@click.pass_obj
def inspect(root: str | None, ref: str) -> None:
    """Show a layer's manifest and, for an image, the sandbox defaults its config sets
    (env, working dir, user, entrypoint/cmd, labels) and the layers it stands on."""
    import json

    import msgspec

    from dsec.image.registry import defaults_from_labels

    try:
        store = _store(root)
        m = store.get(ref)
        d = defaults_from_labels(m.labels)
        out = msgspec.to_builtins(m)
        out["defaults"] = {"env": d.env, "cwd": d.cwd, "user": d.user,
                           "entrypoint": list(d.entrypoint), "cmd": list(d.cmd),
                           "labels": d.labels}
        out["layers"] = [m.digest, *m.stack] if m.kind != "snapshot" else [m.digest]
    except DsecError as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2, sort_keys=True))


@image.command("tag")
@click.argument("source")
@click.argument("target")
@click.pass_obj
def tag_(root: str | None, source: str, target: str) -> None:
    """Point the name TARGET ([project/]name[:tag]) at the layer SOURCE names. Refused
    when that layer was built outside TARGET's project (or its ancestors): a tag never
    moves to a tree built by someone without the right on its namespace."""
    from dsec.image.manifest import parse_ref

    try:
        t = parse_ref(target)
        if t.name is None:
            raise click.BadParameter("TARGET must be a name, not a digest",
                                     param_hint="TARGET")
        m = _store(root).tag(source, t.name, t.tag, namespace=t.namespace)
    except DsecError as exc:
        _fail(exc)
    click.echo(f"{t.key} -> {m.digest}")


@image.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON manifest per line.")
@click.pass_obj
def ls(root: str | None, as_json: bool) -> None:
    """List the layers in the store."""
    import msgspec

    store = _store(root)
    refs_by_digest: dict[str, list[str]] = {}
    for ref, digest in store.refs().items():
        refs_by_digest.setdefault(digest, []).append(ref)
    layers = store.manifests()
    if as_json:
        for m in layers:
            click.echo(msgspec.json.encode(m).decode())
        return
    from dsec.image.manifest import layer_namespace

    table = Table("REFS", "DIGEST", "KIND", "NAMESPACE", "OWNER", "SIZE", "CREATED", "PARENT")
    from rich.text import Text

    from dsec.logs import escape_text

    for m in layers:
        ns = layer_namespace(m)
        # refs, namespaces and owners are tenant-chosen: escaped, plain Text (no markup)
        table.add_row(*(Text(escape_text(c)) for c in (
                      ", ".join(sorted(refs_by_digest.get(m.digest, []))) or "-",
                      m.digest[:19], m.kind,
                      "(cluster-wide)" if ns is None else ns or "(none)", m.owner or "-",
                      f"{m.size_bytes / 2**20:.1f} MiB",
                      datetime.datetime.fromtimestamp(m.created).strftime("%Y-%m-%d %H:%M"),
                      (m.parent or "")[:19])))
    Console().print(table)


@image.command("rm")
@click.argument("refs", nargs=-1, required=True)
@click.pass_obj
def rm(root: str | None, refs: tuple[str, ...]) -> None:
    """Remove layers (refused while mounted or while a snapshot builds on them)."""
    store = _store(root)
    for ref in refs:
        try:
            m = store.remove(ref)
        except DsecError as exc:
            _fail(exc)
        click.echo(f"removed {m.digest}")


@image.command("prune")
@click.option("--dry-run", is_flag=True, help="Say what would go; remove nothing.")
@click.option("--budget", type=int, default=None, metavar="BYTES",
              help="Remove only the least recently used unreferenced layers until the "
                   "store holds at most BYTES.")
@click.option("--json", "as_json", is_flag=True, help="The result as one JSON object.")
@click.pass_obj
def prune(root: str | None, dry_run: bool, budget: int | None, as_json: bool) -> None:
    """Remove the layers nothing references: no name, not a snapshot or under one, not
    mounted on this node, not held by a running build. Never a layer in use."""
    import msgspec

    store = _store(root)
    try:
        res = store.prune(dry_run=dry_run, budget_bytes=budget)
    except DsecError as exc:
        _fail(exc)
    if as_json:
        click.echo(msgspec.json.encode(res).decode())
        return
    verb = "would remove" if dry_run else "removed"
    for m in res.removed:
        click.echo(f"{verb} {m.digest} {m.kind} {m.size_bytes} bytes")
    click.echo(f"{verb} {len(res.removed)} layers, {res.freed_bytes} bytes; kept "
               f"{res.kept_layers} layers, {res.kept_bytes} bytes"
               + (f"; swept {res.orphans} orphaned files" if res.orphans else ""))


@image.group("bootstrap")
def bootstrap() -> None:
    """Build a real Linux base layer from a distribution's packages."""


@bootstrap.command("debian")
@click.option("--suite", default="bookworm", show_default=True)
@click.option("--include", default="", metavar="PKG,PKG",
              help="Extra packages, comma-separated (e.g. python3,python3-pip,git).")
@click.option("--variant", default="apt", show_default=True,
              help="mmdebstrap variant: essential, apt, minbase, required, standard, ...")
@click.option("--mirror", default=None,
              help="Debian mirror URL (default http://deb.debian.org/debian).")
@click.option("--trusted", is_flag=True,
              help="The mirror is unsigned (a local repo made by `dsec image debian-repo`).")
@click.option("--name", default=None,
              help="[project/]name (default debian-<suite>-<variant>-<key of the package "
                   "set>: the name dsec.Image.debian(...) looks for).")
@click.option("--tag", default="latest", show_default=True)
@click.option("--lz4", "compression", flag_value="lz4", default=None)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.pass_obj
def bootstrap_debian_(root: str | None, suite: str, include: str, variant: str,
                      mirror: str | None, trusted: bool, name: str | None, tag: str,
                      compression: str | None, quiet: bool) -> None:
    """Bootstrap Debian SUITE with mmdebstrap into one base layer."""
    from dsec.image.bootstrap import DEFAULT_MIRROR, BootstrapPlan, bootstrap_debian

    console = Console(stderr=True)
    try:
        plan = BootstrapPlan.parse(suite=suite, include=include, variant=variant,
                                   mirror=mirror or DEFAULT_MIRROR, trusted=trusted)
    except DsecError as exc:
        _fail(exc)
    namespace, bare, tag = _split_name(name or plan.image_name(), tag)
    try:
        with _progress(console, quiet) as progress:
            if not quiet:
                console.print(f"mmdebstrap {suite} ({variant}"
                              + (f" + {', '.join(plan.include)}" if plan.include else "")
                              + f") from {plan.mirror} ...")
            res = bootstrap_debian(_store(root), plan, name=bare, tag=tag,
                                   namespace=namespace, owner=_host_owner(),
                                   compression=compression, progress=progress)
    except DsecError as exc:
        _fail(exc)
    m = res.layer
    if not quiet:
        console.print(f"bootstrap {res.seconds_bootstrap:.1f} s, layer "
                      f"{res.seconds_layer:.1f} s; {len(res.special_files_dropped)} device "
                      "nodes under /dev left out (each sandbox gets its own /dev)")
    click.echo(f"{m.ref} {m.digest} {m.size_bytes} bytes")


@image.command("debian-repo")
@click.option("--suite", default="bookworm", show_default=True)
@click.option("--include", default="", metavar="PKG,PKG")
@click.option("--variant", default="apt", show_default=True)
@click.option("--mirror", default=None, help="Where to download from (default Debian's).")
@click.option("--cache", "cache_root", default=None,
              help="Cache directory (default /var/cache/dsec/debian).")
def debian_repo(suite: str, include: str, variant: str, mirror: str | None,
                cache_root: str | None) -> None:
    """Download (once) every package a bootstrap of SUITE + --include needs into a local,
    unsigned apt repository and print its directory (serve it and pass its URL to
    `dsec image bootstrap debian --mirror URL --trusted`: how the tests stay offline)."""
    from dsec.image.bootstrap import DEFAULT_MIRROR, DEFAULT_REPO_CACHE, BootstrapPlan, fetch_repo

    try:
        plan = BootstrapPlan.parse(suite=suite, include=include, variant=variant,
                                   mirror=mirror or DEFAULT_MIRROR)
        click.echo(fetch_repo(plan, cache_root or DEFAULT_REPO_CACHE))
    except DsecError as exc:
        _fail(exc)


def _build_dockerfile(dockerfile: str, context: str, build_args: tuple[str, ...],
                      network: str, project: str | None, url: str | None,
                      api_key: str | None, quiet: bool,
                      image_name: str | None = None, squash: bool = False) -> None:
    """`dsec image build -f`: compile the Dockerfile into builder steps (the SDK's
    :class:`dsec.Image`, one implementation) and build through the API."""
    import json

    import msgspec

    from dsec.cli.sandbox import client
    from dsec.client.build import Image

    args: dict[str, str] = {}
    for item in build_args:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--build-arg")
        args[k] = v
    if not os.path.isdir(context):
        raise click.BadParameter(f"{context!r} is not a directory", param_hint="PATH")
    try:
        img = Image.from_dockerfile(dockerfile, context=context, build_args=args)
    except (DsecError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        with client(url, api_key) as c:
            built = img.build(c, network=network, project=project,  # type: ignore[arg-type]
                              name=image_name, squash=squash)
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc
    if not quiet:
        Console(stderr=True).print(
            f"{len(img.steps)} steps: {built.ran} ran, {built.cached} cached, "
            f"{built.seconds:.2f} s")
    click.echo(json.dumps({"snapshot": built.top, "image": built.base,
                           "config": msgspec.to_builtins(built.config),
                           **({"name": built.name} if built.name else {})}))
