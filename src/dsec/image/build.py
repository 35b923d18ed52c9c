"""The image builder's pure logic: build steps, the config they leave, step cache keys and
the Dockerfile -> steps compiler.

A build is a base (a stack of layers) and a list of steps. ``Run`` and ``Copy`` steps each
make one layer (a pack_diff snapshot of a build sandbox's upper dir); ``Env``,
``Workdir``, ``User``, ``Label``, ``Cmd`` and ``Entrypoint`` only change the config the
later steps run under and the image carries. The I/O (sandboxes, snapshots, hashing local
files) is in :mod:`dsec.client.build`; everything here is pure and unit-tested.

**Step cache key**: sha256 over the parent (the layer digests the step runs on), the step
(command text or argv; for a copy its destination and the digest of the copied content),
the config in effect (env, workdir, user) and the network policy the step runs with.
Same key -> the recorded layer is reused and nothing runs. The key travels as the build
sandbox's label :data:`BUILD_STEP_LABEL`, which the edge writes into the snapshot layer's
manifest (so the cache index *is* the layer store: durable as soon as the snapshot
answers, gone with the layer when it is pruned, which makes a miss, never an error).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from dsec.errors import InvalidArgument

__all__ = ["BUILD_STEP_LABEL", "BuildConfig", "Cmd", "Copy", "DockerfileBuild", "Entrypoint",
           "Env", "Label", "Run", "Step", "User", "Workdir", "apply_config",
           "compile_dockerfile", "step_key"]

BUILD_STEP_LABEL = "build.dsec.io/step"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Run:
    """A command run in a build sandbox: a shell string (``sh -c``) or an argv."""

    command: str | tuple[str, ...]

    def describe(self) -> str:
        c = self.command
        return f"RUN {c}" if isinstance(c, str) else f"RUN {json.dumps(list(c))}"


@dataclass(frozen=True, slots=True)
class Copy:
    """Local ``src`` (file or directory, on the machine running the build) to ``dest``
    in the image (a directory's contents go into ``dest``, as Docker's COPY does)."""

    src: str
    dest: str

    def describe(self) -> str:
        return f"COPY {self.src} {self.dest}"


@dataclass(frozen=True, slots=True)
class Env:
    items: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        return "ENV " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.items)


@dataclass(frozen=True, slots=True)
class Workdir:
    path: str

    def describe(self) -> str:
        return f"WORKDIR {self.path}"


@dataclass(frozen=True, slots=True)
class User:
    name: str

    def describe(self) -> str:
        return f"USER {self.name}"


@dataclass(frozen=True, slots=True)
class Label:
    items: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        return "LABEL " + " ".join(f"{k}={shlex.quote(v)}" for k, v in self.items)


@dataclass(frozen=True, slots=True)
class Cmd:
    argv: tuple[str, ...]

    def describe(self) -> str:
        return f"CMD {json.dumps(list(self.argv))}"


@dataclass(frozen=True, slots=True)
class Entrypoint:
    argv: tuple[str, ...]

    def describe(self) -> str:
        return f"ENTRYPOINT {json.dumps(list(self.argv))}"


Step = Run | Copy | Env | Workdir | User | Label | Cmd | Entrypoint
LAYER_STEPS = (Run, Copy)


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """The config a step runs under and an image carries (OCI config's Env, WorkingDir,
    User, Labels, Cmd, Entrypoint)."""

    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/"
    user: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def _merge(old: tuple[tuple[str, str], ...],
           new: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    d = dict(old)
    d.update(new)
    return tuple(sorted(d.items()))


def _resolve_dir(cwd: str, path: str) -> str:
    if not path:
        raise InvalidArgument("WORKDIR needs a path", field="workdir")
    joined = path if path.startswith("/") else cwd.rstrip("/") + "/" + path
    parts: list[str] = []
    for p in joined.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if parts:
                parts.pop()
            continue
        parts.append(p)
    return "/" + "/".join(parts)


def apply_config(cfg: BuildConfig, step: Step) -> BuildConfig:
    """The config after ``step`` (unchanged for layer steps)."""
    if isinstance(step, Env):
        for k, _ in step.items:
            if not _ENV_NAME.match(k):
                raise InvalidArgument(f"environment variable name {k!r} is invalid "
                                      "([A-Za-z_][A-Za-z0-9_]*)", field="env")
        return replace(cfg, env=_merge(cfg.env, step.items))
    if isinstance(step, Workdir):
        return replace(cfg, workdir=_resolve_dir(cfg.workdir, step.path))
    if isinstance(step, User):
        if not step.name or any(c.isspace() for c in step.name):
            raise InvalidArgument(f"USER {step.name!r}: give a user name or uid", field="user")
        return replace(cfg, user=step.name)
    if isinstance(step, Label):
        return replace(cfg, labels=_merge(cfg.labels, step.items))
    if isinstance(step, Cmd):
        return replace(cfg, cmd=step.argv)
    if isinstance(step, Entrypoint):
        return replace(cfg, entrypoint=step.argv)
    return cfg


def step_key(parent: Sequence[str], step: Run | Copy, cfg: BuildConfig, *,
             network: str, content_digest: str | None = None) -> str:
    """The cache key of a layer step (64 hex). ``parent``: the digests of the stack the
    step runs on, highest first; ``content_digest``: a copy's content (its
    :func:`dsec.client.build.tree_digest`); ``network``: the policy, canonical JSON."""
    if isinstance(step, Copy) and content_digest is None:
        raise InvalidArgument("a copy step's cache key needs its content digest")
    doc = {
        "v": 1,
        "parent": list(parent),
        "step": ("run", step.command if isinstance(step.command, str)
                 else list(step.command)) if isinstance(step, Run)
                else ("copy", step.dest, content_digest),
        # what the command sees: env, cwd and user (labels/cmd do not change a layer)
        "env": [list(kv) for kv in cfg.env],
        "workdir": cfg.workdir,
        "user": cfg.user,
        "network": network,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


# ---------------------------------------------------------------------------- Dockerfile
@dataclass(frozen=True, slots=True)
class DockerfileBuild:
    """A Dockerfile compiled: its FROM and the builder steps (with the line each came
    from, 1-based, for errors)."""

    base: str
    steps: tuple[Step, ...]
    lines: tuple[int, ...] = field(default=())


SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ARG", "LABEL", "CMD",
             "ENTRYPOINT")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _substitute(text: str, values: Mapping[str, str]) -> str:
    """Docker's ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` in instruction arguments
    (ARG and ENV values in effect; unknown names become empty, as in Docker)."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        v = values.get(name)
        if v is None or (v == "" and m.group(2) is not None):
            return m.group(2) or ""
        return v
    return _VAR.sub(one, text)


def _kv_pairs(value: str, instr: str, line: int) -> tuple[tuple[str, str], ...]:
    """``K=V K2="v 2"`` (or the legacy ``K V`` form) -> pairs."""
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise InvalidArgument(f"Dockerfile line {line}: {instr} {value!r}: {exc}") from exc
    if words and "=" not in words[0]:
        if len(words) < 2:
            raise InvalidArgument(f"Dockerfile line {line}: {instr} needs KEY=VALUE")
        return ((words[0], value.split(None, 1)[1].strip()),)
    out = []
    for w in words:
        if "=" not in w:
            raise InvalidArgument(f"Dockerfile line {line}: {instr} {w!r} is not KEY=VALUE")
        k, v = w.split("=", 1)
        out.append((k, v))
    return tuple(out)


def _json_or_shell(value: str) -> str | tuple[str, ...]:
    v = value.strip()
    if v.startswith("["):
        try:
            argv = json.loads(v)
        except ValueError:
            return v                       # Docker runs a malformed JSON form as shell
        if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
            return tuple(argv)
    return v


def compile_dockerfile(text: str, build_args: Mapping[str, str] | None = None
                       ) -> DockerfileBuild:
    """Parse ``text`` (with dockerfile-parse: continuation lines, comments, parser
    directives) and compile it to builder steps. One stage only; ``ADD`` only of local
    files (no URLs, no archive auto-extraction); other instructions are refused naming
    their line."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    args: dict[str, str] = {}
    given = dict(build_args or {})
    env: dict[str, str] = {}
    base: str | None = None
    steps: list[Step] = []
    lines: list[int] = []
    for ins in parser.structure:
        name = str(ins["instruction"]).upper()
        value = str(ins["value"])
        line = int(ins["startline"]) + 1
        if name == "COMMENT":
            continue
        if name not in SUPPORTED:
            raise InvalidArgument(f"Dockerfile line {line}: {name} is not supported by dsec "
                                  f"image build (supported: {', '.join(SUPPORTED)})")
        values = {**args, **env}
        if name == "ARG":
            k, _, default = value.partition("=")
            k = k.strip()
            if not _ENV_NAME.match(k):
                raise InvalidArgument(f"Dockerfile line {line}: ARG {k!r} is not a name")
            args[k] = given[k] if k in given else _substitute(default.strip().strip('"'),
                                                               values)
            continue
        if name == "FROM":
            if base is not None:
                raise InvalidArgument(f"Dockerfile line {line}: a second FROM (multi-stage "
                                      "builds) is not supported")
            words = _substitute(value, values).split()
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise InvalidArgument(f"Dockerfile line {line}: FROM {value!r}: use FROM "
                                      "<image>")
            base = words[0]
            continue
        if base is None:
            raise InvalidArgument(f"Dockerfile line {line}: {name} before FROM")
        step: Step
        if name == "RUN":
            cmd = _json_or_shell(value)
            if isinstance(cmd, str) and cmd.startswith("--"):
                raise InvalidArgument(f"Dockerfile line {line}: RUN flags ({cmd.split()[0]}) "
                                      "are not supported")
            # ARG values are in the command's environment, as in Docker; ENV ones are in
            # the config anyway.
            if args:
                arg_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(args.items()))
                cmd = (f"export {arg_env}; {cmd}" if isinstance(cmd, str)
                       else ("env", *[f"{k}={v}" for k, v in sorted(args.items())], *cmd))
            step = Run(cmd)
        elif name in ("COPY", "ADD"):
            try:
                words = shlex.split(_substitute(value, values))
            except ValueError as exc:
                raise InvalidArgument(f"Dockerfile line {line}: {name} {value!r}: {exc}"
                                      ) from exc
            flags = [w for w in words if w.startswith("--")]
            if flags:
                raise InvalidArgument(f"Dockerfile line {line}: {name} {flags[0]} is not "
                                      "supported (files are copied as root; RUN chown after)")
            if len(words) != 2:
                raise InvalidArgument(f"Dockerfile line {line}: {name} takes one source and "
                                      "one destination here (<src> <dest>)")
            src, dest = words
            if name == "ADD" and re.match(r"^[a-z][a-z0-9+.-]*://", src):
                raise InvalidArgument(f"Dockerfile line {line}: ADD {src}: remote URLs are "
                                      "not supported (fetch it in a RUN step, or COPY a "
                                      "local file)")
            if name == "ADD" and re.search(r"\.(tar|tgz|tar\.\w+)$", src):
                raise InvalidArgument(f"Dockerfile line {line}: ADD {src}: archives are not "
                                      "unpacked by ADD here; COPY it and RUN tar -x")
            step = Copy(src, dest)
        elif name == "ENV":
            pairs = tuple((k, _substitute(v, values))
                          for k, v in _kv_pairs(value, name, line))
            env.update(pairs)
            step = Env(pairs)
        elif name == "LABEL":
            step = Label(tuple((k, _substitute(v, values))
                               for k, v in _kv_pairs(value, name, line)))
        elif name == "WORKDIR":
            step = Workdir(_substitute(value.strip(), values))
        elif name == "USER":
            step = User(_substitute(value.strip(), values))
        else:  # CMD / ENTRYPOINT
            form = _json_or_shell(value)
            argv = form if isinstance(form, tuple) else ("/bin/sh", "-c", form)
            step = Cmd(argv) if name == "CMD" else Entrypoint(argv)
        steps.append(step)
        lines.append(line)
    if base is None:
        raise InvalidArgument("the Dockerfile has no FROM")
    unused = sorted(set(given) - set(args))
    if unused:
        raise InvalidArgument(f"--build-arg {', '.join(unused)} not declared by any ARG in "
                              "the Dockerfile")
    return DockerfileBuild(base=base, steps=tuple(steps), lines=tuple(lines))
