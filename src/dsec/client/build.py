"""``dsec.Image``: build images declaratively, in the shape Modal users know.

```python
from dsec import Client, Image

image = (Image.from_image("debian-bookworm")          # or Image.debian("bookworm")
         .apt_install("git")                          # apt-get update && apt-get install -y
         .pip_install("requests==2.32.3")
         .copy("./myproject", "/src")
         .env({"PYTHONUNBUFFERED": "1"})
         .workdir("/src")
         .run("python3 -m compileall -q ."))
with Client(url, key) as c:
    built = image.build(c, network="none")            # or await image.build_async(ac)
    with c.sandboxes.create(**built.create_args()) as sb:
        sb.exec("python3 -m pytest -q", **built.exec_args())
```

**Where the build runs: in the SDK, through the catalogue.** Each ``run``-like step is a
real build sandbox created from the stack so far (``create(image=...)`` for the first
layer step, ``create(snapshot=<previous step's layer>)`` after), the command ``exec``'d
in it, its upper dir captured with ``snapshot`` (pack_diff: one new layer on top) and the
sandbox destroyed (always: also when the step fails or the build is interrupted). A
``copy`` step writes the local files into a build sandbox the same way. So a build is
ordinary operations, each checked by the control plane as any other (quotas, the
snapshot storage quota, network policy and ceilings, placement on the node holding the
parent layer), through whichever door the client uses (REST or the Aether gateway), and
needed no new edge logic. A server-side build operation would save a round trip per
step (~ms) but duplicate create/exec/snapshot's checks on the server and stream local
files to it anyway.

**Step cache** (:func:`dsec.image.build.step_key`): the key of a layer step goes into
its build sandbox's spec (the dedicated ``build_step`` field: labels in dsec.io domains
are refused at every door); the edge records it in the snapshot layer's manifest beside
the stack the sandbox really ran on, and ``snapshots.list()`` shows both (``build_step``,
``stack``). A rebuild lists the target project's snapshots once (``project=None``: the
key's default project; never another project's) and skips every step whose key is there
AND whose entry the edge recorded on exactly the step's parent (the snapshot its build
sandbox started from, ``parent``, on the build's image ``stack``): nothing runs. A member of
the target project can still make an entry by hand (create with ``build_step=`` and run
something else): the cache trusts the project's members as its images do. The cache is the layer
store: durable once the snapshot answers, shared by every client of the project, and a
pruned layer is simply a miss. A step that changed nothing (``true``) makes no layer,
so it is not cached and runs again next time (cheap by definition).

A built image is the top layer of its chain (a snapshot id) plus its config (env,
workdir, user, labels, cmd): ``create(**built.create_args())`` starts sandboxes from it
with its env, and ``exec(..., **built.exec_args())`` runs as its user in its workdir.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import secrets
import stat
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from dsec.errors import BuildStepFailed, DsecError, InvalidArgument
from dsec.image.bootstrap import DEFAULT_MIRROR, BootstrapPlan
from dsec.image.build import (
    BUILD_STEP_LABEL,
    BuildConfig,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Label,
    Run,
    Step,
    User,
    Workdir,
    apply_config,
    compile_dockerfile,
    step_key,
)
from dsec.wire.api import ImagePromoteRequest, SnapshotView
from dsec.wire.netpolicy import NetMode
from dsec.wire.spec import ExecResult, NetworkPolicy

if TYPE_CHECKING:
    from dsec.client.core import AsyncClient, AsyncSandbox
    from dsec.client.sync import Client

__all__ = ["BUILD_STEP_LABEL", "BuildStepFailed", "BuiltImage", "Image", "tree_digest"]

_TAIL = 2000
COPY_TAR = "/.dsec-copy.tar"
# The builder's own random token to find its build sandbox after an interrupted create:
# a caller label (dsec.wire.spec.CALLER_DSEC_LABELS), trusted by nobody but this build.
BUILD_RUN_LABEL = "dsec.io/build-run"


@dataclass(frozen=True, slots=True)
class _FromRegistry:
    ref: str
    insecure: bool
    platform: str | None = None
    creds: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class _Base:
    image: str | None = None
    workspace: str | None = None
    toolkits: tuple[str, ...] = ()
    debian: BootstrapPlan | None = None
    registry: _FromRegistry | None = None


@dataclass(frozen=True, slots=True)
class BuiltImage:
    """The result of a build: the stack (``base`` digest + ``workspace``/``toolkits`` as
    resolved, and ``top``: the snapshot holding the steps' layers, None without layer
    steps) and the config. ``ran``/``cached``: how many layer steps ran / were reused."""

    base: str
    workspace: str | None
    toolkits: tuple[str, ...]
    top: str | None
    config: BuildConfig
    ran: int = 0
    cached: int = 0
    seconds: float = 0.0
    step_seconds: tuple[float, ...] = field(default=())     # wall time of each step run
    command_seconds: tuple[float, ...] = field(default=())  # its command's own run time
    # the name it was given (``build(name=...)``): ``create(image=name)`` starts it with
    # its config, as a pulled image
    name: str | None = None

    def create_args(self) -> dict[str, Any]:
        """Keywords for ``sandboxes.create``: where to start from, and the image's env
        (a named image carries its config itself)."""
        if self.name is not None:
            return {"image": self.name}
        where: dict[str, Any] = ({"snapshot": self.top} if self.top is not None else
                                 {"image": self.base, "workspace": self.workspace,
                                  "toolkits": list(self.toolkits)})
        return {**where, "env": self.config.env_dict}

    def exec_args(self) -> dict[str, Any]:
        """Keywords for ``exec``: the image's workdir and user."""
        return {"cwd": self.config.workdir, "user": self.config.user}


class Image:
    """An image recipe: a base and steps. Immutable: every method returns a new Image,
    so recipes can share a prefix (and its cached layers)."""

    def __init__(self, base: _Base, steps: tuple[Step, ...] = ()) -> None:
        self._base = base
        self.steps = steps

    # ------------------------------------------------------------------ bases
    @classmethod
    def from_image(cls, ref: str) -> Image:
        """Start from a base layer in the cluster's store (``[project/]name[:tag]`` or a
        digest): e.g. one made by ``dsec image bootstrap debian`` or imported."""
        return cls(_Base(image=ref))

    @classmethod
    def from_registry(cls, ref: str, *, insecure: bool | None = None,
                      platform: str | None = None, creds: str | None = None) -> Image:
        """Start from an image in an OCI registry (``host[:port]/repo[:tag|@sha256:...]``,
        Modal's ``Image.from_registry``). The build pulls it first, into the build's
        project (``images.pull``: the caller's write right there and the apiserver's
        allowed registries hold, on every hop), and runs the steps on its layers under
        its config (Env, WorkingDir, User, Cmd/Entrypoint, Labels: later steps add to
        it). Step cache keys stand on the pulled layers' digests, so a tag that moved to
        another image makes a miss. ``insecure`` (plain HTTP) defaults to a loopback
        registry's; ``platform`` picks from an index; ``creds`` is ``user:password``."""
        from dsec.image.registry import is_loopback_host, parse_registry_ref

        r = parse_registry_ref(ref)
        return cls(_Base(registry=_FromRegistry(
            ref=ref, insecure=is_loopback_host(r.host) if insecure is None else insecure,
            platform=platform, creds=creds)))

    @classmethod
    def from_layers(cls, image: str, *, workspace: str | None = None,
                    toolkits: Sequence[str] = ()) -> Image:
        """Start from a composed stack (a base, a workspace and toolkits)."""
        return cls(_Base(image=image, workspace=workspace, toolkits=tuple(toolkits)))

    @classmethod
    def debian(cls, suite: str = "bookworm", *, include: Sequence[str] = (),
               mirror: str = DEFAULT_MIRROR, variant: str = "apt") -> Image:
        """A Debian base bootstrapped with mmdebstrap (``dsec image bootstrap debian``).
        The build uses the store's image :meth:`debian_name` names (make it once with
        ``dsec image bootstrap debian --suite S --include ... --name <that>``); if there
        is none, the build bootstraps it here (needs mmdebstrap and root on this
        machine) and uploads it under that name."""
        plan = BootstrapPlan.parse(suite=suite, include=include, mirror=mirror,
                                   variant=variant)
        return cls(_Base(debian=plan))

    @staticmethod
    def debian_name(suite: str = "bookworm", *, include: Sequence[str] = (),
                    variant: str = "apt") -> str:
        """The store name :meth:`debian` looks for: ``debian-<suite>-<variant>-<key>``,
        keyed by the package set."""
        return BootstrapPlan.parse(suite=suite, include=include, variant=variant).image_name()

    @classmethod
    def from_dockerfile(cls, path: str | os.PathLike[str], *, context: str | None = None,
                        build_args: Mapping[str, str] | None = None) -> Image:
        """Compile a Dockerfile into builder steps (``dsec.image.build.compile_dockerfile``);
        COPY sources are resolved against ``context`` (default: the Dockerfile's dir)."""
        p = os.fspath(path)
        with open(p) as f:
            df = compile_dockerfile(f.read(), build_args)
        ctx = os.path.abspath(context if context is not None else os.path.dirname(p) or ".")
        steps: list[Step] = []
        for s, line in zip(df.steps, df.lines, strict=True):
            if isinstance(s, Copy):
                src = _in_context(ctx, s.src, line)
                s = Copy(src, s.dest)
            steps.append(s)
        from dsec.image.registry import is_registry_ref
        if is_registry_ref(df.base):      # FROM host[:port]/repo[:tag]: pulled first
            return cls(Image.from_registry(df.base)._base, tuple(steps))
        return cls(_Base(image=df.base), tuple(steps))

    # ------------------------------------------------------------------ steps
    def _with(self, *steps: Step) -> Image:
        return Image(self._base, self.steps + steps)

    def run(self, *commands: str | Sequence[str]) -> Image:
        """Each command (a shell string, or an argv list) is one step and one layer."""
        return self._with(*(Run(c if isinstance(c, str) else tuple(c)) for c in commands))

    def apt_install(self, *packages: str) -> Image:
        """``apt-get update && apt-get install -y --no-install-recommends`` as one step
        (needs a network policy that reaches the image's mirror)."""
        pk = _names(packages, "apt_install")
        return self.run("export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && "
                        f"apt-get install -y -qq --no-install-recommends {' '.join(pk)} && "
                        "rm -rf /var/lib/apt/lists/*")

    def pip_install(self, *packages: str, index_url: str | None = None) -> Image:
        """``python3 -m pip install`` as one step."""
        pk = _names(packages, "pip_install")
        idx = f" --index-url {index_url}" if index_url else ""
        return self.run(f"python3 -m pip install -q --no-cache-dir --break-system-packages"
                        f"{idx} {' '.join(_quote(p) for p in pk)}")

    def copy(self, local_path: str | os.PathLike[str], dest: str) -> Image:
        """Copy a local file or directory (its contents) to ``dest`` in the image."""
        src = os.path.abspath(os.fspath(local_path))
        if not os.path.lexists(src):
            raise InvalidArgument(f"copy: {src!r} does not exist", field="local_path")
        if not dest.startswith("/"):
            raise InvalidArgument(f"copy: destination {dest!r} must be absolute",
                                  field="dest")
        return self._with(Copy(src, dest))

    def env(self, values: Mapping[str, str]) -> Image:
        return self._with(Env(tuple(sorted((str(k), str(v)) for k, v in values.items()))))

    def workdir(self, path: str) -> Image:
        return self._with(Workdir(path))

    def user(self, name: str) -> Image:
        return self._with(User(name))

    def label(self, values: Mapping[str, str]) -> Image:
        return self._with(Label(tuple(sorted(values.items()))))

    def cmd(self, argv: Sequence[str]) -> Image:
        return self._with(Cmd(tuple(argv)))

    def entrypoint(self, argv: Sequence[str]) -> Image:
        return self._with(Entrypoint(tuple(argv)))

    def __repr__(self) -> str:
        b = self._base
        head = (f"Image.debian({b.debian.suite!r})" if b.debian is not None
                else f"Image.from_registry({b.registry.ref!r})" if b.registry is not None
                else f"Image.from_image({b.image!r})")
        return head + "".join(f"\n  {s.describe()}" for s in self.steps)

    # ------------------------------------------------------------------ build
    def build(self, client: Client, *, network: NetworkPolicy | NetMode = "none",
              project: str | None = None, timeout: float = 600.0,
              memory: int | str = "1GiB", cpu: float = 1,
              name: str | None = None, squash: bool = False) -> BuiltImage:
        """Build (sync client); see :meth:`build_async`."""
        return client._run(self.build_async(client._a, network=network, project=project,
                                            timeout=timeout, memory=memory, cpu=cpu,
                                            name=name, squash=squash))

    async def build_async(self, client: AsyncClient, *,
                          network: NetworkPolicy | NetMode = "none",
                          project: str | None = None, timeout: float = 600.0,
                          memory: int | str = "1GiB", cpu: float = 1,
                          name: str | None = None, squash: bool = False) -> BuiltImage:
        """Run the steps not in the cache, each in a build sandbox with ``network``
        (default none: no egress; e.g. a policy allowing only a package mirror for
        ``apt_install``), ``timeout`` seconds per command. A failing step raises
        :class:`BuildStepFailed` naming it; its build sandbox is destroyed whatever
        happens. ``name`` (``[project/]name[:tag]``, bare: in the build's project): name
        the result (``images.promote``), so ``create(image=name)`` runs it with its
        env, workdir, user, entrypoint, cmd and labels, as a pulled image. The named
        image is the steps as one layer over the base's layers (shared with every image
        on that base); ``squash=True`` flattens the base in too: one standalone layer."""
        t0 = time.monotonic()
        # The target project's own layers only (project=None: the key's default project,
        # where the build sandboxes go): a key holding roles on several projects sees
        # theirs too, and another project's admin must not plant entries for us.
        target = project if project is not None else \
            ((await client.info()).project or "default")
        base = await self._resolve_base(client, project, target)
        net = _net_key(network)
        cache = {s.view.build_step: s.view
                 for s in await client.snapshots.list(project=target)
                 if s.view.build_step and s.project == target}
        cfg = base.config
        top: str | None = None
        parent: tuple[str, ...] = base.digests
        ran = cached = 0
        step_seconds: list[float] = []
        command_seconds: list[float] = []
        for i, step in enumerate(self.steps, 1):
            if not isinstance(step, Run | Copy):
                cfg = apply_config(cfg, step)
                continue
            digest = (await asyncio.to_thread(tree_digest, step.src)
                      if isinstance(step, Copy) else None)
            key = step_key(parent, step, cfg, network=net, content_digest=digest)
            hit = cache.get(key)
            # an entry is used only if the edge recorded it on exactly this step's
            # parent: the snapshot the build sandbox started from (the previous step's
            # layer, None for the first) on the image stack the build started from
            # (the recorded stack goes on below the image's top layer with that layer's
            # own stack - a pulled image's lower layers -, which its digest fixes: one
            # manifest per digest in the store)
            if hit is not None and hit.parent == top \
                    and tuple(hit.stack[:len(base.digests)]) == base.digests:
                top, parent, cached = hit.id, (hit.id,), cached + 1
                continue
            ts = time.monotonic()
            view, cmd_s = await self._run_step(client, base, top, step, i, cfg, key,
                                               network, project, timeout, memory, cpu)
            step_seconds.append(time.monotonic() - ts)
            command_seconds.append(cmd_s)
            ran += 1
            if view.id != top:
                cache[key] = view
            top, parent = view.id, (view.id,)
        named: str | None = None
        if name is not None:
            named = await _promote(client, base, top, cfg, name, target, squash)
        return BuiltImage(base=base.image, workspace=base.workspace, toolkits=base.toolkits,
                          top=top, config=cfg, ran=ran, cached=cached,
                          seconds=time.monotonic() - t0, step_seconds=tuple(step_seconds),
                          command_seconds=tuple(command_seconds), name=named)

    async def _run_step(self, client: AsyncClient, base: _Resolved, top: str | None,
                        step: Run | Copy, index: int, cfg: BuildConfig, key: str,
                        network: NetworkPolicy | NetMode, project: str | None,
                        timeout: float, memory: int | str, cpu: float
                        ) -> tuple[SnapshotView, float]:
        """Run one layer step; its layer and its command's own run time."""
        where: dict[str, Any] = ({"snapshot": top} if top is not None else
                                 {"image": base.image, "workspace": base.workspace,
                                  "toolkits": list(base.toolkits)})
        # A label unique to this step run: if the create is interrupted after the server
        # made the sandbox but before we learn its id, we find it by this label and
        # destroy it (else it would live until its TTL).
        run_id = secrets.token_hex(8)
        labels = {"dsec.io/build": "step", BUILD_RUN_LABEL: run_id}
        try:
            sb = await client.sandboxes.create(
                **where, labels=labels, network=network, project=project, memory=memory,
                cpu=cpu, ttl=timeout + 300, build_step=key)
        except BaseException:
            await asyncio.shield(_kill_labelled(client, project, run_id))
            raise
        try:
            what = f"step {index}/{len(self.steps)} ({step.describe()[:200]})"
            if cfg.workdir != "/":
                # as root from /, as Docker makes a WORKDIR: the image's own default
                # cwd (a FROM image's WorkingDir) may not exist yet, nor be its user's
                await _check(sb.exec(["mkdir", "-p", cfg.workdir], timeout=60, cwd="/",
                                     user="root"),
                             what + ": mkdir -p " + cfg.workdir)
            if isinstance(step, Run):
                res = await sb.exec(list(step.command) if isinstance(step.command, tuple)
                                    else step.command, timeout=timeout, env=cfg.env_dict,
                                    cwd=cfg.workdir, user=cfg.user)
                await _check(res, what)
            else:
                res = await self._copy_into(sb, step, cfg, what)
            snap = await sb.snapshot()
            return snap.view, res.duration_s
        finally:
            await asyncio.shield(sb.kill())

    async def _copy_into(self, sb: AsyncSandbox, step: Copy, cfg: BuildConfig,
                         what: str) -> ExecResult:
        dest = step.dest if step.dest.startswith("/") else \
            cfg.workdir.rstrip("/") + "/" + step.dest
        data = await asyncio.to_thread(_pack_for_copy, step.src, dest)
        await sb.files.write(COPY_TAR, data, mode=0o600)
        parent = dest if os.path.isdir(step.src) or dest.endswith("/") else \
            os.path.dirname(dest.rstrip("/")) or "/"
        res = await sb.exec(["sh", "-c", 'mkdir -p "$1" && tar -xf "$2" -C / && rm -f "$2"',
                             "copy", parent, COPY_TAR], timeout=600)
        await _check(res, what)
        return res

    async def _resolve_base(self, client: AsyncClient, project: str | None,
                            target: str) -> _Resolved:
        b = self._base
        image = b.image
        if b.debian is not None:
            image = await _ensure_debian(client, b.debian, project)
        if b.registry is not None:
            # pulled into the build's project every build: a moved tag is seen (the
            # pull fetches nothing when the image's layers are here already)
            image = (await client.images.pull(
                b.registry.ref, project=target, platform=b.registry.platform,
                insecure=b.registry.insecure, creds=b.registry.creds)).digest
        assert image is not None
        main = await client.images.get(image)
        ws = (await client.images.get(b.workspace)).digest if b.workspace else None
        tks = tuple([(await client.images.get(t)).digest for t in b.toolkits])
        digests = (*reversed(tks), *([ws] if ws else []), main.digest)
        return _Resolved(image=main.digest, workspace=ws, toolkits=tks, digests=digests,
                         config=base_config(main.labels))


@dataclass(frozen=True, slots=True)
class _Resolved:
    image: str
    workspace: str | None
    toolkits: tuple[str, ...]
    digests: tuple[str, ...]
    config: BuildConfig = field(default_factory=BuildConfig)


def base_config(labels: Mapping[str, str]) -> BuildConfig:
    """The config a build starts from: its base image's (the ``oci.*`` labels a pull or
    a named build stores), as Docker's FROM inherits ENV, WORKDIR, USER, CMD... Pure."""
    from dsec.image.registry import defaults_from_labels

    d = defaults_from_labels(labels)
    return BuildConfig(env=tuple(sorted(d.env.items())), workdir=d.cwd or "/", user=d.user,
                       labels=tuple(sorted(d.labels.items())), cmd=d.cmd,
                       entrypoint=d.entrypoint)


async def _promote(client: AsyncClient, base: _Resolved, top: str | None, cfg: BuildConfig,
                   name: str, project: str, squash: bool = False) -> str:
    """Name the build ``name`` (a bare name goes in ``project``); the ref to create from."""
    if base.workspace is not None or base.toolkits:
        raise InvalidArgument("a build on a workspace or toolkits cannot be named: name "
                              "builds on a plain image", field="name")
    target = name if "/" in name else f"{project}/{name}"
    if top is None:       # no layer step: the base itself, under the new name and config
        raise InvalidArgument("a build without a layer step (RUN/COPY) has nothing to "
                              "name: tag its base instead (images.tag)", field="name")
    await client.images.promote(ImagePromoteRequest(
        top=top, base=base.image, target=target, env=cfg.env_dict,
        workdir=cfg.workdir if cfg.workdir != "/" else None, user=cfg.user,
        entrypoint=list(cfg.entrypoint), cmd=list(cfg.cmd), labels=dict(cfg.labels),
        squash=squash))
    return target


async def _kill_labelled(client: AsyncClient, project: str | None, run_id: str) -> None:
    with contextlib.suppress(DsecError):
        for sb in await client.sandboxes.list(project=project,
                                              labels={BUILD_RUN_LABEL: run_id}):
            await sb.kill()


async def _check(res_or_coro: Any, what: str) -> None:
    res = await res_or_coro if asyncio.iscoroutine(res_or_coro) else res_or_coro
    if res.exit_code != 0 or res.timed_out:
        out = (res.stdout + res.stderr)[-_TAIL:].decode(errors="replace")
        why = "timed out" if res.timed_out else f"exited with code {res.exit_code}"
        raise BuildStepFailed(f"image build {what} {why}; output tail:\n{out}")


async def _ensure_debian(client: AsyncClient, plan: BootstrapPlan,
                         project: str | None) -> str:
    from dsec.errors import ImageNotFound

    name = Image.debian_name(plan.suite, include=plan.include, variant=plan.variant)
    refs = [f"{project}/{name}", name] if project else [name]
    for ref in refs:
        try:
            await client.images.get(ref)
            return ref
        except ImageNotFound:
            continue
    # Not there: bootstrap here and upload (the one special-files rule: bootstrap_tree
    # leaves /dev's device nodes out, so the upload is accepted).
    import tempfile

    from dsec.image.bootstrap import bootstrap_tree
    from dsec.rmtree import remove_tree

    tmp = tempfile.mkdtemp(prefix="dsec-debian-")
    try:
        root = os.path.join(tmp, "root")
        await asyncio.to_thread(bootstrap_tree, plan, root)
        view = await client.images.build(root, name=refs[0], kind="base")
    finally:   # never through a mount point (what a killed mmdebstrap might leave)
        await asyncio.to_thread(remove_tree, tmp, detach=True)
    return view.refs[0] if view.refs else view.digest


def _names(packages: Sequence[str], what: str) -> list[str]:
    out = []
    for p in packages:
        if not p or p.startswith("-") or any(c.isspace() or c in "'\";&|`$<>" for c in p):
            raise InvalidArgument(f"{what}: {p!r} is not a package spec", field="packages")
        out.append(p)
    if not out:
        raise InvalidArgument(f"{what} needs at least one package", field="packages")
    return out


def _quote(s: str) -> str:
    import shlex
    return shlex.quote(s)


def _net_key(network: NetworkPolicy | NetMode) -> str:
    if isinstance(network, str):
        return network
    return msgspec.json.encode(network).decode()


def _in_context(ctx: str, src: str, line: int) -> str:
    p = os.path.realpath(os.path.join(ctx, src))
    if p != ctx and not p.startswith(ctx.rstrip("/") + "/"):
        raise InvalidArgument(f"Dockerfile line {line}: COPY {src!r} is outside the build "
                              f"context {ctx}")
    if not os.path.lexists(p):
        raise InvalidArgument(f"Dockerfile line {line}: COPY {src!r}: no such file in the "
                              f"build context {ctx}")
    return p


def tree_digest(path: str) -> str:
    """sha256 over a local file or tree's content: relative paths (sorted), types, modes,
    file bytes and symlink targets; not mtimes or owners (a COPY makes root-owned files,
    and a fresh checkout must hit the cache).

    Every entry is one length-framed record (:func:`_framed`: path, type, mode, then the
    sha256 of the file's bytes or the link target), so no file's bytes can spell the
    framing of further entries: before, ``rel\0type\0mode\0<bytes>\0`` let a file named
    ``a`` holding ``X\0b\0<type>\0<mode>\0Y`` hash like the two files a=X, b=Y, and a
    COPY of one tree reused the layer of the other (red team 15, F8)."""
    h = hashlib.sha256(b"dsec.tree_digest.v2\0")

    def one(p: str, rel: str) -> None:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            body = os.fsencode(os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(1 << 20):
                    fh.update(block)
            body = fh.digest()
        else:
            body = b""
        h.update(_framed(os.fsencode(rel), str(stat.S_IFMT(st.st_mode)).encode(),
                         str(stat.S_IMODE(st.st_mode)).encode(), body))

    if os.path.isdir(path) and not os.path.islink(path):
        for dirpath, dirs, files in os.walk(path):
            dirs.sort()
            for n in sorted(dirs + files):
                p = os.path.join(dirpath, n)
                one(p, os.path.relpath(p, path))
    else:
        one(path, os.path.basename(path))
    return h.hexdigest()


def _framed(*fields: bytes) -> bytes:
    """``fields`` as one unambiguous record: a count, then each field's length (8 bytes,
    big-endian) before its bytes. Pure."""
    out = [len(fields).to_bytes(8, "big")]
    for f in fields:
        out += [len(f).to_bytes(8, "big"), f]
    return b"".join(out)


def _pack_for_copy(src: str, dest: str) -> bytes:
    """A tar of ``src`` placed at ``dest`` (a directory's contents into ``dest``; a file
    to ``dest``, or into it when ``dest`` ends in '/'), every entry owned by root, device
    nodes/fifos/sockets left out (they are not content)."""
    buf = io.BytesIO()
    d = dest.rstrip("/") or "/"

    def owner(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not (ti.isreg() or ti.isdir() or ti.issym() or ti.islnk()):
            return None
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if os.path.isdir(src) and not os.path.islink(src):
            for n in sorted(os.listdir(src)):
                tar.add(os.path.join(src, n), arcname=(d + "/" + n).lstrip("/"),
                        filter=owner)
        else:
            target = (d + "/" + os.path.basename(src)) if dest.endswith("/") else d
            tar.add(src, arcname=target.lstrip("/"), filter=owner)
    return buf.getvalue()
