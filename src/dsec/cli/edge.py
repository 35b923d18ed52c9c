"""``dsec edge``: run one edge node and serve it over Aether until SIGINT/SIGTERM.

Run by hand (one per machine) or by ``dsec up``, which starts one ``dsec edge`` process
per node and supervises it (:mod:`dsec.cluster.edge_process`): ``--ready-fd`` tells the
supervisor when the node serves, ``--supervisor-pid`` makes the edge stop (gracefully,
keeping its sandboxes for the next start) when its supervisor dies, even by kill -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

_PR_SET_PDEATHSIG = 1


def _default_node_id() -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")
    return name[:63].strip("-") or "edge"


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"label {v!r} must look like key=value", param_hint="--label")
        out[k] = val
    return out


def _extra_opts(values: tuple[str, ...], backends: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for v in values:
        target, sep, val = v.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not key or name not in backends:
            raise click.BadParameter(
                f"{v!r} must look like BACKEND.KEY=VALUE for a backend given with --backend",
                param_hint="--backend-opt")
        out.setdefault(name, {})[key] = val
    return out


def _backend_opts(name: str, profile: str, pool_size: int, state_dir: str | None,
                  layer_store: str | None, owned: list[Any], *,
                  lazy: dict[str, Any] | None = None,
                  shared: dict[str, Any] | None = None) -> dict[str, Any]:
    """``make_backend`` options; what must be closed at exit is appended to ``owned``.
    ``lazy``: ``blob_url``, ``cache_bytes``, ``node`` of the node's lazy layers.
    ``shared``: what the node's backends share, filled on first use (the images object:
    pass the same dict for every backend of one node)."""
    if name == "simulated":
        from dsec.edge.backends.simulated import NodeLatencyProfile

        if profile == "zero":
            prof = NodeLatencyProfile.zero()
        else:
            kind = profile.removeprefix("paper").lstrip("-") or "container"
            prof = NodeLatencyProfile.paper(kind)  # type: ignore[arg-type]
        return {"profile": prof}
    if name == "fncall":
        # Work dirs next to the journal: a restarted edge adopts its fncall sandboxes
        # and reconciles the rest (a temp dir per process could do neither).
        root = {"root": os.path.join(state_dir, "fncall")} if state_dir else {}
        return {"pool_size": pool_size, **root}
    from dsec.edge.backends import LAYERED

    if name in LAYERED:
        opts: dict[str, Any] = {}
        if state_dir is not None:
            opts["root_dir"] = os.path.join(state_dir, name)
        if layer_store is not None:
            shared = {} if shared is None else shared
            if "images" not in shared:
                shared["images"] = _node_images(layer_store, state_dir, owned, lazy)
            opts["images"] = shared["images"]
        elif lazy is not None:
            from dsec.errors import InvalidArgument

            raise InvalidArgument("--blob-store needs --layer-store: a node records the "
                                  "manifests of the layers it reads lazily in its store")
        return opts
    return {}


def pool_split(n: int, total: int | None, state_dir: str | None) -> int | None:
    """Each pooled backend's disk pool size on a node running ``n`` of them (container
    and gvisor each keep a preallocated btrfs pool in their own root): ``total`` (the
    node's ``--disk-pool``, else $DSEC_DISK_POOL_BYTES, else the default share of the
    state dir's free space, measured once here) split evenly. Each backend sizing its
    own pool took the default share of what was free *then*, so the second found the
    disk already reserved by the first and the edge did not start. None: each backend's
    own rule (one pooled backend; or no state dir; or the free space no longer allows a
    new pool, as on a restart whose pools exist already: their size is kept)."""
    from dsec.edge.backends.container.disk import MIN_POOL_BYTES, POOL_SIZE_ENV, pool_size_for
    from dsec.errors import DsecError

    if n < 2:
        return total
    if total is None and os.environ.get(POOL_SIZE_ENV, "").isdigit():
        total = int(os.environ[POOL_SIZE_ENV])
    if total is None:
        if state_dir is None:
            return None
        vfs = os.statvfs(state_dir)
        try:
            total = pool_size_for(vfs.f_bavail * vfs.f_frsize)
        except DsecError:
            return None
    return max(MIN_POOL_BYTES, total // n)


def _node_images(layer_store: str, state_dir: str | None, owned: list[Any],
                 lazy: dict[str, Any] | None) -> Any:
    """The node's images object (StoreImages over the layer store, one MountCache, the
    lazy layers if any): made once per node and handed to every layered backend."""
    from dsec.edge.backends.container.images import StoreImages
    from dsec.image import LayerStore, MountCache

    lazy_layers = _lazy_layers(lazy, state_dir, layer_store)
    # layers mounted once for all this node's sandboxes
    mounts = MountCache(lazy=lazy_layers)
    owned.append(mounts)
    if lazy_layers is not None:
        lazy_layers.on_restart(mounts.rebind_lazy)
        owned.append(lazy_layers)   # after the mounts: EROFS holds its files open
    return StoreImages(LayerStore(layer_store), mounts, lazy_layers)


def _lazy_layers(lazy: dict[str, Any] | None, state_dir: str | None,
                 layer_store: str) -> Any:
    """[lazy] The node's lazy layers (issue 17: layers read 256 KiB at a time from the
    blob store through a FUSE daemon), or None without ``--blob-store``."""
    if lazy is None:
        return None
    from dsec.edge.lazy.layers import LazyConfig, LazyLayers

    return LazyLayers(LazyConfig(
        blob_url=lazy["blob_url"], cache_bytes=lazy.get("cache_bytes"),
        node=lazy.get("node", "node"),
        cache_dir=os.path.join(state_dir or layer_store, "lazy-chunks")))


def _check_pool(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--net-pool refused at parse time (dsec up and dsec edge alike), before anything
    starts: the range's rules are addressing.Pool's."""
    from dsec.errors import InvalidArgument
    from dsec.net.addressing import Pool

    try:
        Pool(value)
    except InvalidArgument as exc:
        raise click.BadParameter(exc.message) from exc
    return value


# ------------------------------------------------------------------ capacity flags
class _Size(click.ParamType[int]):
    """'24GiB', '512MiB' or bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from dsec.client.core import parse_memory
        from dsec.errors import InvalidArgument

        try:
            n = parse_memory(str(value))
        except InvalidArgument:
            self.fail(f"{value!r} is not a size: use bytes or e.g. '512MiB', '24GiB'", param, ctx)
        if n <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return n


SIZE = _Size()


class _Budget(click.ParamType[Any]):
    """A size, or 'off'."""

    name = "budget"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "off" or isinstance(value, int):
            return value
        return SIZE.convert(value, param, ctx)


BUDGET = _Budget()


def image_budget_option(f: Any) -> Any:
    """``--image-store-budget``: recorded in the layer store, so every process using it
    (edges, apiserver, ``dsec image``) prunes to the same budget."""
    return click.option(
        "--image-store-budget", "image_store_budget", type=BUDGET, default=None,
        metavar="SIZE|off",
        help="Keep the layer store under SIZE: when a new layer takes it over, the least "
             "recently used layers nothing references (no name, snapshot, mount or running "
             "build) are removed. Recorded in the store for every process sharing it; "
             "'off' clears it [default: leave as recorded; none on a new store].")(f)


def _check_blob_store(ctx: click.Context, param: click.Parameter,
                      value: str | None) -> str | None:
    """Parse the blob store URL at start (a bad one fails here, not at the first pull);
    nothing is contacted."""
    if value is None:
        return None
    from dsec.errors import DsecError
    from dsec.image.blob import open_blobstore

    try:
        open_blobstore(value)
    except DsecError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    return value


def blob_store_option(fn: F) -> F:
    """``--blob-store URL`` (or ``$DSEC_BLOB_STORE``): where layers live off-node
    (:mod:`dsec.image.blob`), one definition for ``dsec edge``, ``dsec up``,
    ``dsec apiserver`` and ``dsec image push``. An operator's setting: its host is
    trusted as given (loopback and private addresses included); tenants never name a
    blob store URL, only images, which become digest keys under it."""
    return click.option(
        "--blob-store", "blob_store", default=None, envvar="DSEC_BLOB_STORE",
        metavar="URL", callback=_check_blob_store,
        help="Blob store for image layers: file:///dir, s3://bucket/prefix?endpoint_url="
             "...&region=... (credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) or "
             "http(s)://host/prefix (token in $DSEC_BLOB_TOKEN). Pushed images are read "
             "from it by nodes that lack their layers.")(fn)


class _NetPolicy(click.ParamType[Any]):
    """'none', 'open' or '@policy.json' (a NetworkPolicy as JSON) -> NetworkPolicy."""

    name = "policy"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import msgspec

        from dsec.errors import DsecError
        from dsec.wire.netpolicy import NetworkPolicy

        if isinstance(value, NetworkPolicy):
            return value
        text = str(value)
        try:
            if text.startswith("@"):
                with open(text[1:], "rb") as f:
                    return msgspec.json.decode(f.read(), type=NetworkPolicy).validate()
            if text in ("none", "open"):
                return NetworkPolicy(mode=text)  # type: ignore[arg-type]
        except (OSError, msgspec.DecodeError, DsecError) as exc:
            self.fail(f"{text!r}: {exc}", param, ctx)
        self.fail(f"{text!r} is not a policy: use none, open or @FILE.json", param, ctx)


NET_POLICY = _NetPolicy()


def secret_in_argv(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Option callback: warn when a secret came on the command line, where every user of
    the host reads it (``/proc/PID/cmdline``, ``ps``) for the life of the process. The
    environment variable of the option (0600 ``/proc/PID/environ``), a libpq passfile or
    a token file keep it out of sight. A store URL counts when it holds a password."""
    import sys
    from urllib.parse import urlsplit

    if value is None or ctx.get_parameter_source(param.name or "") is not \
            click.core.ParameterSource.COMMANDLINE:
        return value
    secret = True
    if param.name == "store":
        try:
            secret = urlsplit(value).password is not None
        except ValueError:
            secret = False
    if secret:
        env = param.envvar if isinstance(param.envvar, str) else None
        print(f"dsec: warning: {param.opts[0]} carries a secret on the command line, "
              f"readable by every user of this host (ps); pass it in ${env or 'the environment'}"
              + (" or a libpq passfile (PGPASSFILE)" if param.name == "store" else "")
              + " instead", file=sys.stderr)
    return value


def net_default_option(fn: F) -> F:
    """``--net-default``: the egress policy of a create that names none."""
    return click.option(
        "--net-default", type=NET_POLICY, default="none", show_default=True,
        metavar="none|open|@FILE.json",
        help="Egress policy of a sandbox created without one (a project's network "
             "ceiling still binds; see docs/networking.md).")(fn)


def reply_budget_option(fn: F) -> F:
    """``--reply-budget``: ApiConfig.reply_budget_bytes (dsec.control.replybudget)."""
    return click.option(
        "--reply-budget", "reply_budget", type=BUDGET, default=None, metavar="SIZE|off",
        help="Bytes of unread exec/list_dir/read_file/events replies one tenant may hold in "
             "this apiserver; each call reserves its worst case (an exec: twice "
             "min(output_cap_bytes, 4 MiB)), so SIZE / 2 MiB execs of a tenant at the "
             "default cap are in flight at once; 'off': no budget (docs/api.md) "
             "[default: 4G].")(fn)


def net_node_options(fn: F) -> F:
    """The network flags of a node (``dsec edge``; ``dsec up`` passes them to its edges):
    ``--net-max``, ``--net-uplink``, ``--net-link``, ``--net-egress``, ``--net-pool``,
    ``--net-dns-upstream``, ``--net-ipv6``."""
    opts = [
        click.option("--net-max", type=NET_POLICY, default=None, metavar="none|open|@FILE.json",
                     help="The most open egress policy this node serves, whoever asks (default: "
                          "no node ceiling; projects' ceilings still bind through the apiserver)."),
        click.option("--net-uplink", default=None, metavar="host|netns:PATH",
                     help="Give the container backend a network router (sandboxes get policies "
                          "other than 'none'). 'host': its traffic leaves through this host, which "
                          "CHANGES THE HOST: a veth dsu<hash> (169.254.213.1/30), an nft table "
                          "inet dsec_<node> (drops every packet from the sandboxes to an address "
                          "of this host, forwards them out of the egress device only, masqueraded) "
                          "and net.ipv4.conf.{dsu<hash>,<egress>}.forwarding=1; all undone when "
                          "the router goes (a clean exit with no live sandbox; with live ones "
                          "they stay for the next edge, see docs/networking.md). Refused while another forward chain has policy drop "
                          "(Docker, ufw): the error names the rules to add. 'netns:PATH': the "
                          "uplink leads into the network namespace at PATH (a test or demo "
                          "network; nothing on the host changes). Without it, only policy 'none' "
                          "is served."),
        click.option("--net-link", default="169.254.213.0/30", show_default=True,
                     metavar="CIDR",
                     help="The /30 of the router's uplink veth (peer .1, router .2): each "
                          "edge on one host (or into one namespace) needs its own; `dsec up` "
                          "gives its edges 169.254.213.0/30, .4/30, ..."),
        click.option("--net-egress", default=None, metavar="DEV",
                     help="With --net-uplink host: the device the sandboxes' traffic leaves by "
                          "[default: the device of the IPv4 default route]."),
        click.option("--net-pool", default="10.213.0.0/16", show_default=True, metavar="CIDR",
                     callback=_check_pool,
                     help="Addresses of the router's slots (private to its namespace): inside "
                          "10/8, 172.16/12, 192.168/16, 100.64/10 or 198.18/15, apart from "
                          "--net-link."),
        click.option("--net-dns-upstream", "net_dns_upstream", multiple=True, metavar="ADDR[:PORT]",
                     help="DNS server the sandboxes' resolver asks (repeatable), reached from the "
                          "uplink's namespace."),
        click.option("--net-ipv6", type=click.Choice(["auto", "off"]), default="auto",
                     show_default=True,
                     help="IPv6 for sandboxes: 'auto' gives each one a /127 of fd00:d5ec::/48 "
                          "(NAT66 out of the uplink, its policy's IPv6 entries enforced like the "
                          "IPv4 ones) when the uplink has a global IPv6 address (a netns uplink; "
                          "the host uplink carries no IPv6); 'off' drops every IPv6 packet (v6 "
                          "entries are then accepted but inert, and said so)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def capacity_options(what: str) -> Callable[[F], F]:
    """The capacity flags ``dsec edge`` and ``dsec up`` share. ``what`` names what the
    figures describe ("this node", "this machine")."""
    def deco(fn: F) -> F:
        opts = [
            click.option("--cpus", type=click.FloatRange(0.001, 1_000_000), default=None,
                         help=f"Cores {what} has (default: measured: CPU affinity and the "
                              "cgroup CPU quota)."),
            click.option("--memory", type=SIZE, default=None,
                         help=f"Memory {what} has, e.g. 24GiB (default: measured: "
                              "/proc/meminfo or the cgroup memory limit, the lower)."),
            click.option("--disk", type=SIZE, default=None,
                         help="Largest disk one sandbox may be given (default: the size of "
                              "the state dir's filesystem, or of the container backend's "
                              "disk pool if smaller)."),
            click.option("--cpu-overcommit", type=click.FloatRange(0.001, 10_000),
                         default=64.0, show_default=True,
                         help="Admit sandbox CPU up to this many times the cores (a "
                              "sandbox's cpu is a ceiling; agent sandboxes mostly idle)."),
            click.option("--memory-overcommit", type=click.FloatRange(0.001, 10_000),
                         default=4.0, show_default=True,
                         help="Admit sandbox memory limits up to this many times the "
                              "memory."),
            # Exact figures (what `dsec up` passes to the edges it runs).
            click.option("--cpu-milli", type=click.IntRange(1), default=None, hidden=True),
            click.option("--memory-bytes", type=click.IntRange(1), default=None, hidden=True),
            click.option("--disk-bytes", type=click.IntRange(1), default=None, hidden=True),
        ]
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return deco


def resolve_capacity(*, state_dir: str | None, cpus: float | None, memory: int | None,
                     disk: int | None, cpu_milli: int | None, memory_bytes: int | None,
                     disk_bytes: int | None, cpu_overcommit: float, memory_overcommit: float,
                     max_sandboxes: int, share: int = 1) -> Any:
    """The node Capacity the capacity flags describe (measured where not given)."""
    from dsec.edge.admission import HostResources, Overcommit, measure_host, plan_capacity

    measured = measure_host(state_dir)
    sources = dict(measured.sources)
    cpu = cpu_milli or (round(cpus * 1000) if cpus is not None else None)
    mem = memory_bytes or memory
    dsk = disk_bytes or disk
    for name, given in (("cpu", cpu), ("memory", mem), ("disk", dsk)):
        if given is not None:
            sources[name] = "given"
    host = HostResources(cpu_milli=cpu or measured.cpu_milli,
                         memory_bytes=mem or measured.memory_bytes,
                         disk_bytes=dsk or measured.disk_bytes, sources=sources)
    return plan_capacity(host, overcommit=Overcommit(cpu=cpu_overcommit,
                                                     memory=memory_overcommit),
                         max_sandboxes=max_sandboxes, share=share)


def _die_with_supervisor(pid: int) -> None:
    """Ask the kernel for SIGTERM when our parent (the supervisor) dies, then check it
    has not died already (a race the prctl alone cannot close)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise click.ClickException(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != pid:
        click.echo(f"supervisor pid {pid} is gone (parent is {os.getppid()}); not starting",
                   err=True)
        sys.exit(1)


@click.command()
@click.option("--listen", required=True, metavar="ADDR",
              help="Where to serve Aether: unix:PATH or tcp:HOST:PORT.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the sandbox journal (a restarted edge adopts what it "
                   "owned). Without it, records live in memory only.")
@click.option("--journal-sync", type=click.Choice(["fsync", "write", "tick"]), default="fsync",
              show_default=True,
              help="When an answered create/destroy/pause/resume is on disk: fsync before "
                   "the answer (survives kill -9 and power loss), write before it (kill -9 "
                   "only), or tick (up to 50 ms later: a crash loses that tick).")
@click.option("--backend", "backends", multiple=True, default=("simulated",), show_default=True,
              help="Backend to offer (repeatable): simulated, fncall, container, gvisor, vm. "
                   "The isolation tiers are backends: container, gvisor (runsc) and vm "
                   "(QEMU) each get a root dir <state-dir>/<name> and share the node's "
                   "--layer-store (one mount of each layer).")
@click.option("--node-id", default=_default_node_id, show_default="hostname",
              help="This node's id; it is part of every sandbox id it creates.")
@capacity_options("this node")
@click.option("--max-sandboxes", type=int, default=1000, show_default=True)
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Node label for placement (repeatable).")
@click.option("--profile", type=click.Choice(["zero", "paper", "paper-container", "paper-fncall",
                                              "paper-microvm"]),
              default="zero", show_default=True, help="Latency profile of the simulated backend.")
@click.option("--fncall-pool-size", type=int, default=8, show_default=True,
              help="Warm Python workers kept by the fncall backend.")
@click.option("--layer-store", type=click.Path(file_okay=False), default=None,
              help="Layer store the container backend starts sandboxes from (images and "
                   "snapshots; `dsec up` passes <state-dir>/layers), and that layers move "
                   "in and out of between nodes (docs/layers.md).")
@image_budget_option
@click.option("--backend-opt", "backend_opts", multiple=True, metavar="BACKEND.KEY=VALUE",
              help="Option for one backend's make_backend (repeatable), e.g. "
                   "container.images_dir=/var/lib/dsec/images. Values are strings.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="File holding the secret every Aether connection must present first "
                   "(required with a tcp: listener; the apiserver gets the same file).")
@click.option("--insecure", is_flag=True,
              help="Serve tcp: without a token (anyone who connects can run commands in "
                   "sandboxes): only on a private test network.")
@click.option("--disk-default", default="10GiB", show_default=True, metavar="SIZE",
              help="Disk cap of a container sandbox created without one.")
@click.option("--disk-pool", default=None, metavar="SIZE",
              help="Size of the container backend's sandbox disk pool when first made "
                   "[default: 90% of its root dir's free space]; with --backend container "
                   "--backend gvisor, split evenly between their two pools.")
@click.option("--pids-share", "pids_share", type=click.FloatRange(0, 1, min_open=True),
              default=None, metavar="FRACTION",
              help="This edge's fraction of the host's pid budget (kernel.pid_max minus "
                   "the headroom), split between the tiers it runs; `dsec up` gives each "
                   "of N edges on one host 1/N. [default: 1, the whole budget: with "
                   "other edges on the host give each a share, summing to at most 1; "
                   "the edge warns when it finds others running]")
@click.option("--ready-fd", type=int, default=None, hidden=True,
              help="Write 'ready' to this inherited fd once serving (for a supervisor).")
@click.option("--supervisor-pid", type=int, default=None, hidden=True,
              help="Stop (keeping sandboxes) when this parent process dies.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@net_default_option
@net_node_options
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Serve this edge's Prometheus metrics (denied packets per sandbox, "
                   "refused DNS names, live sandboxes) at http://HOST:PORT/metrics "
                   "[default: off]. Sandbox ids are labels and every host user reaches "
                   "a loopback port: give --metrics-token-file (or --metrics-public).")
@click.option("--metrics-token-file", default=None, metavar="FILE",
              type=click.Path(dir_okay=False),
              help="A scrape must send 'Authorization: Bearer <the token in FILE>' "
                   "(mode 0600, made with a random token when missing; Prometheus: "
                   "authorization.credentials_file); others get 401.")
@click.option("--metrics-public", is_flag=True,
              help="Serve --metrics-listen without a token: anyone who reaches the port "
                   "reads the metrics (sandbox ids, operation counts).")
@click.option("--qos-be-only", "qos_be_only", multiple=True, metavar="PROJECT",
              help="[qos] Run this project's (and its subprojects') sandboxes best-effort "
                   "only: a create asking qos 'ls' is refused (repeatable).")
@click.option("--memory-pressure/--no-memory-pressure", "memory_pressure", default=False,
              help="[qos] Pause idle best-effort sandboxes (idle longest first) while PSI "
                   "shows node memory pressure [default: off].")
@click.option("--lazy-cache-bytes", type=SIZE, default=None, metavar="SIZE",
              help="[lazy] Budget of the node's chunk cache for layers read lazily from "
                   "--blob-store (least recently used chunks go; pinned layers stay) "
                   "[default: no limit].")
@click.option("--join", "join_url", default=None, metavar="URL",
              help="[join] Join the cluster whose apiserver REST is at URL (first start: "
                   "with --token; later starts rejoin from the key and certificate kept in "
                   "--state-dir/cluster) and serve Aether over mutual TLS on --listen "
                   "tcp:HOST:PORT. See docs/cluster.md.")
@click.option("--token", "join_token", default=None, envvar="DSEC_JOIN_TOKEN",
              metavar="TOKEN",
              help="[join] Join token from `dsec cluster token create` (or $DSEC_JOIN_TOKEN, "
                   "which other host users cannot read in the process list).")
@click.option("--advertise", default=None, metavar="HOST:PORT",
              help="[join] The address the apiserver replicas dial [default: --listen's; "
                   "a 0.0.0.0 host becomes the address the join came from].")
@blob_store_option
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="text: 'ISO-time LEVEL logger: message' lines; json: "
                                      "one object per line (dsec.logs; issue 19).")
@click.option("--paused-retention", "paused_retention_s", type=float, default=None,
              metavar="SECONDS",
              help="Destroy a sandbox paused this long (from its pause; reason "
                   "'paused_retention') [default: 604800, 7 days]; 0: keep paused "
                   "sandboxes forever.")
def edge(listen: str, state_dir: str | None, journal_sync: str, backends: tuple[str, ...],
         node_id: str, cpus: float | None, memory: int | None, disk: int | None,
         cpu_overcommit: float, memory_overcommit: float, cpu_milli: int | None,
         memory_bytes: int | None, disk_bytes: int | None, max_sandboxes: int,
         labels: tuple[str, ...], profile: str, fncall_pool_size: int,
         layer_store: str | None, image_store_budget: Any, backend_opts: tuple[str, ...],
         token_file: str | None,
         insecure: bool, disk_default: str, disk_pool: str | None, ready_fd: int | None,
         supervisor_pid: int | None, log_level: str, net_default: Any,
         net_max: Any, net_uplink: str | None, net_link: str, net_egress: str | None,
         net_pool: str, net_ipv6: str, net_dns_upstream: tuple[str, ...],
         metrics_listen: str | None, join_url: str | None, join_token: str | None,
         advertise: str | None, blob_store: str | None,
         lazy_cache_bytes: int | None, log_format: str = "text",
         qos_be_only: tuple[str, ...] = (), memory_pressure: bool = False,
         paused_retention_s: float | None = None, pids_share: float | None = None,
         metrics_token_file: str | None = None, metrics_public: bool = False) -> None:
    """Run an edge node: sandboxes on this machine, served over Aether."""
    from dsec.nofile import raise_nofile  # dens: soft RLIMIT_NOFILE to hard (issue 22)
    metrics_token = _metrics_token(metrics_listen, metrics_token_file, metrics_public)
    if pids_share is None:
        _warn_shared_pid_budget(backends)
        pids_share = 1.0
    _warn_host_proc(backends)
    raise_nofile()
    # A stop before the loop serves (SIGTERM from a supervisor, ^C) unwinds like one
    # after: every finally below runs, so nothing the start made stays mounted,
    # attached or pinned (the default action would end the process mid-start).
    _stop_by_exception()
    if image_store_budget is not None:
        if layer_store is None:
            raise click.BadParameter("needs --layer-store", param_hint="--image-store-budget")
        from dsec.image import LayerStore

        LayerStore(layer_store).set_budget(
            None if image_store_budget == "off" else image_store_budget)
    if supervisor_pid is not None:
        _die_with_supervisor(supervisor_pid)
    from dsec.logs import configure
    configure(log_level, log_format)
    ssl_ctx = None
    if join_url is not None or (state_dir is not None and os.path.exists(
            os.path.join(state_dir, "cluster", "node.crt"))):
        # [join] a joined edge: its node id is its certificate's, it serves mutual TLS
        from dsec.cluster.edge_join import prepare_joined_edge
        from dsec.errors import DsecError

        given = click.get_current_context().get_parameter_source("node_id")
        try:
            joined = prepare_joined_edge(
                state_dir, join_url=join_url, token=join_token, node_id=node_id,
                node_id_given=given is not click.core.ParameterSource.DEFAULT,
                listen=listen, advertise=advertise)
            node_id = joined.node_id
            ssl_ctx = joined.credentials.server_context()
        except DsecError as exc:
            raise click.ClickException(str(exc)) from exc

    owned: list[Any] = []
    built: dict[str, Any] = {}
    served: list[bool] = []  # [True] once the node has closed the backends itself
    try:
        _edge_main(owned, built, served, listen, state_dir, journal_sync, backends, node_id,
                   cpus, memory, disk, cpu_overcommit, memory_overcommit, cpu_milli,
                   memory_bytes, disk_bytes, max_sandboxes, labels, profile, fncall_pool_size,
                   layer_store, backend_opts, token_file, insecure, disk_default, disk_pool,
                   ready_fd, net_default, net_max, net_uplink, net_link, net_egress,
                   net_pool, net_ipv6, net_dns_upstream, metrics_listen, ssl_ctx,
                   blob_store=blob_store, lazy_cache_bytes=lazy_cache_bytes,
                   qos_be_only=qos_be_only, memory_pressure=memory_pressure,
                   paused_retention_s=paused_retention_s, pids_share=pids_share,
                   metrics_token=metrics_token)
    finally:
        # a second signal must not cut the release short (kill -9 still ends it)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if not served:
            for b in {id(b): b for b in built.values()}.values():
                _release_backend(b)
        for o in owned:
            o.close()   # the layer mounts, the router; sandboxes kept for adoption hold their own


def _stop_by_exception() -> None:
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _release_backend(b: Any) -> None:
    """Close a backend the node never got to close (a stop or a failure during start):
    its disk pool unmounted and its loop device detached when it holds no sandbox."""
    log = logging.getLogger("dsec.edge")
    try:
        asyncio.run(b.close())
    except Exception:  # what can be released still is, below
        log.exception("backend %s failed to close", getattr(b, "name", b))
        disk = getattr(b, "disk", None)
        if disk is not None:
            with contextlib.suppress(Exception):
                disk.close()


def _edge_main(owned: list[Any], built: dict[str, Any], served: list[bool], listen: str,
               state_dir: str | None, journal_sync: str, backends: tuple[str, ...],
               node_id: str, cpus: float | None, memory: int | None, disk: int | None,
               cpu_overcommit: float, memory_overcommit: float, cpu_milli: int | None,
               memory_bytes: int | None, disk_bytes: int | None, max_sandboxes: int,
               labels: tuple[str, ...], profile: str, fncall_pool_size: int,
               layer_store: str | None, backend_opts: tuple[str, ...],
               token_file: str | None, insecure: bool, disk_default: str,
               disk_pool: str | None, ready_fd: int | None, net_default: Any, net_max: Any,
               net_uplink: str | None, net_link: str, net_egress: str | None,
               net_pool: str, net_ipv6: str, net_dns_upstream: tuple[str, ...],
               metrics_listen: str | None, ssl_ctx: Any = None,
               blob_store: str | None = None, lazy_cache_bytes: int | None = None,
               qos_be_only: tuple[str, ...] = (), memory_pressure: bool = False,
               paused_retention_s: float | None = None, pids_share: float = 1.0,
               metrics_token: bytes | None = None) -> None:
    # blob_store: validated by --blob-store's callback; the node's lazy layers
    # (dsec.edge.lazy, issue 17) read missing layers from it
    from dsec.edge.admission import bound_disk
    from dsec.edge.backends import make_backend
    from dsec.edge.node import NodeConfig
    from dsec.edge.qos import PressurePolicy
    from dsec.errors import DsecError
    from dsec.wire.spec import PAUSED_RETENTION_S

    try:
        if state_dir is not None:
            from dsec.statedir import ensure_private_dir
            # 0700 even when it existed: journals, sandbox records (with their env).
            state_dir = ensure_private_dir(state_dir)
        capacity = resolve_capacity(
            state_dir=state_dir, cpus=cpus, memory=memory, disk=disk, cpu_milli=cpu_milli,
            memory_bytes=memory_bytes, disk_bytes=disk_bytes, cpu_overcommit=cpu_overcommit,
            memory_overcommit=memory_overcommit, max_sandboxes=max_sandboxes)
        extra = _extra_opts(backend_opts, backends)
        from dsec.client.core import parse_memory
        from dsec.edge.backends import DISK_POOLED
        pooled = [n for n in dict.fromkeys(backends) if n in DISK_POOLED]
        disk_opts: dict[str, Any] = {"default_disk_bytes": parse_memory(disk_default),
                                     "disk_pool_bytes": pool_split(
                                         len(pooled), None if disk_pool is None
                                         else parse_memory(disk_pool), state_dir)}
        for name in pooled:
            extra[name] = {**disk_opts, **extra.get(name, {})}
        from dsec.edge.governor import pids_split

        for name, share in pids_split(backends, pids_share).items():
            extra[name] = {"pids_share": share, **extra.get(name, {})}
        resolver_args: dict[str, Any] | None = None
        if net_egress is not None and net_uplink != "host":
            raise click.BadParameter("only with --net-uplink host", param_hint="--net-egress")
        if net_uplink is not None:
            if "container" not in backends:
                raise click.BadParameter("needs --backend container", param_hint="--net-uplink")
            network, resolver_args = _network(node_id, net_uplink, net_pool,
                                              net_dns_upstream, owned, state_dir,
                                              egress=net_egress, link=net_link,
                                              ipv6=net_ipv6)
            extra["container"] = {**extra.get("container", {}), "network": network}
        shared: dict[str, Any] = {}   # one images object for every tier of the node
        for name in dict.fromkeys(backends):
            lazy = None if blob_store is None else {
                "blob_url": blob_store, "cache_bytes": lazy_cache_bytes, "node": node_id}
            built[name] = make_backend(name, **{**_backend_opts(
                name, profile, fncall_pool_size, state_dir, layer_store, owned, lazy=lazy,
                shared=shared), **extra.get(name, {})})
        cfg = NodeConfig(node_id=node_id, capacity=bound_disk(capacity, built.values()),
                         labels=_labels(labels), state_dir=state_dir,
                         journal_sync=journal_sync,  # type: ignore[arg-type]
                         net_default=net_default, net_max=net_max,
                         # issue 16: layers move in and out of it whatever the backend
                         layer_store=layer_store,
                         # issue 22 (dsec.edge.qos)
                         qos_be_only=qos_be_only,
                         memory_pressure=PressurePolicy() if memory_pressure else None,
                         # red team 19, B4: paused sandboxes are kept a bounded time
                         paused_retention_s=(PAUSED_RETENTION_S if paused_retention_s is None
                                             else paused_retention_s or None))
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyError as exc:
        raise click.ClickException(
            f"backend option {exc} is required: pass --backend-opt BACKEND.{exc.args[0]}=..."
            " (the container backend needs --state-dir and --layer-store, or root_dir and "
            "images_dir)") from exc
    try:
        import uvloop

        token = None
        if token_file is not None:
            with open(token_file, "rb") as f:
                token = f.read().strip()
            if len(token) < 16:
                raise click.BadParameter(f"{token_file} holds {len(token)} bytes; use a random "
                                         "secret of at least 16", param_hint="--token-file")
        uvloop.run(_serve(cfg, built, listen, token, insecure, ready_fd, resolver_args,
                          served, metrics_listen, ssl_ctx, metrics_token))
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc


def proc_hides_pids(mountinfo: str) -> bool:
    """Whether the /proc of ``mountinfo`` (its text) hides other users' processes
    (``hidepid=2``/``invisible``, or ``subset=pid`` alone would not: pure)."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        f = left.split()
        if not sep or len(f) < 5 or f[4] != "/proc":
            continue
        opts = right.split()[2].split(",") if len(right.split()) > 2 else []
        return any(o in ("hidepid=2", "hidepid=invisible") for o in opts)
    return False


def _warn_host_proc(backends: tuple[str, ...] | list[str], *,
                    mountinfo_path: str = "/proc/self/mountinfo") -> bool:
    """Warn (hx) when container-tier sandboxes' processes are host processes every host
    user can list with their command lines (/proc/<pid>/cmdline is 0444: an agent's
    ``curl -H 'Authorization: ...'`` is there to read) because /proc is mounted without
    ``hidepid=invisible``. dsec does not remount the host's /proc itself: that changes
    what every user and tool on the host sees (docs/host-security.md). True when it
    warned."""
    if not any(b in ("container", "runc") for b in backends):
        return False
    try:
        with open(mountinfo_path) as f:
            hidden = proc_hides_pids(f.read())
    except OSError:
        return False
    if not hidden:
        logging.getLogger("dsec.edge").warning(
            "/proc is mounted without hidepid=invisible: every host user can read the "
            "command lines of container sandboxes' processes (their env and files stay "
            "closed); mount -o remount,hidepid=invisible,gid=<admins> /proc on a shared "
            "host (docs/host-security.md)")
    return not hidden


def _warn_shared_pid_budget(backends: tuple[str, ...] | list[str], *,
                            names_dir: str | None = None) -> None:
    """Warn (hx) when this edge takes the whole pid budget by default while other dsec
    edges run on the host: each caps its own sandboxes only, so together they may hold
    N times the budget and exhaust the host's pid table. Not an automatic split: an
    edge started earlier keeps the share it took, so only shares given to every edge
    (``--pids-share``, summing to at most 1; ``dsec up`` does it) are safe."""
    if not any(b in ("container", "gvisor", "vm", "fncall") for b in backends):
        return
    from dsec.edge.backends.container.census import NAMES_DIR, other_edges

    others = other_edges(names_dir=names_dir or NAMES_DIR)
    if others:
        logging.getLogger("dsec.edge").warning(
            "other dsec edges run on this host (pids %s, roots %s) and this one takes the "
            "whole pid budget (no --pids-share): together their sandboxes may exhaust the "
            "host's pid table; give every edge --pids-share so the shares sum to at most 1",
            ", ".join(map(str, sorted(others))),
            ", ".join(sorted({r for roots in others.values() for r in roots})))


def _metrics_token(listen: str | None, token_file: str | None,
                   public: bool) -> bytes | None:
    """The scrape token of ``--metrics-listen`` (None with ``--metrics-public``): one of
    the two is required, so an edge never serves its metrics to every host user by
    default (edge/metrics.py)."""
    if listen is None:
        if token_file is not None or public:
            raise click.BadParameter("only with --metrics-listen",
                                     param_hint="--metrics-token-file/--metrics-public")
        return None
    if token_file is not None and public:
        raise click.BadParameter("give one of them", param_hint="--metrics-token-file/"
                                 "--metrics-public")
    if public:
        return None
    if token_file is None:
        raise click.BadParameter(
            "any host user can reach a loopback port and would read every sandbox's "
            "series: give --metrics-token-file FILE (a 0600 file with a random token; "
            "scrapers send 'Authorization: Bearer <token>') or --metrics-public",
            param_hint="--metrics-listen")
    from dsec.edge.metrics import read_token
    from dsec.errors import DsecError
    try:
        return read_token(token_file, create=True)
    except DsecError as exc:
        raise click.BadParameter(str(exc), param_hint="--metrics-token-file") from exc


class _Fd:
    """An fd closed at exit (the uplink namespace)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _network(node_id: str, uplink: str, pool: str, upstreams: tuple[str, ...],
             owned: list[Any], state_dir: str | None = None, *,
             egress: str | None = None,
             link: str = "169.254.213.0/30", ipv6: str = "auto") -> tuple[Any, dict[str, Any]]:
    """The router (with its slots) the container backend puts sandboxes on; closed with
    ``owned`` (the kernel then removes its namespace, links and nft objects).

    With a state dir the router netns is pinned at ``STATE/net/router``: it outlives
    this process (a crash, or a stop with live sandboxes), and the next edge re-opens it
    and reconciles it with its journal before it serves (docs/networking.md). A host
    uplink's table and sysctls stay with it (reconcile puts them back in place)."""
    import ipaddress

    from dsec.net import netns
    from dsec.net.attach import SandboxNetwork
    from dsec.net.router import Router, RouterConfig
    from dsec.net.uplink import HostUplink, NetnsUplink, Uplink, uplink_ifname

    try:
        net = ipaddress.IPv4Network(link)
    except ValueError as exc:
        raise click.BadParameter(f"{link!r}: {exc}", param_hint="--net-link") from exc
    if net.prefixlen != 30:
        raise click.BadParameter(f"{link!r} must be a /30 (peer .1, router .2)",
                                 param_hint="--net-link")
    up: Uplink
    if uplink == "host":
        # The edge's own netns is the host's; the resolver's upstream socket lives there.
        fd = _Fd(netns.current_netns())
        owned.append(fd)
        # The pinned router's path makes the host's names unique per cluster: two
        # `dsec up` on one host both have a node edge-0 (REDTEAM-14b #4).
        owner = (os.path.realpath(os.path.join(state_dir, "net", "router"))
                 if state_dir is not None else "")
        up = HostUplink(fd.fd, node_id, egress=egress, link=str(net), owner=owner)
        _log_ipv6(ipv6, False)  # HostUplink.has_ipv6: the host uplink carries none
        try:
            router = _router(Router, RouterConfig(pool=pool), up, state_dir)
        except OSError as exc:
            raise click.ClickException(f"--net-uplink host: {exc}") from exc
        click.echo(up.changes(), err=True)  # what this edge changed on the host
    elif uplink.startswith("netns:"):
        if egress is not None:
            raise click.BadParameter("only with --net-uplink host", param_hint="--net-egress")
        path = uplink.removeprefix("netns:")
        try:
            fd = _Fd(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            owned.append(fd)
            with netns.entered(fd.fd):  # EINVAL unless PATH is a network namespace
                pass
            nup = NetnsUplink(fd.fd, uplink_ifname(node_id), link=str(net))
            v6 = ipv6 == "auto" and nup.has_ipv6()
            _log_ipv6(ipv6, v6)
            router = _router(Router, RouterConfig(pool=pool, ipv6=v6), nup, state_dir)
        except OSError as exc:
            raise click.BadParameter(f"{path}: {exc.strerror or exc} (PATH must name a "
                                     "network namespace, e.g. /run/netns/NAME)",
                                     param_hint="--net-uplink") from exc
    else:
        raise click.BadParameter(f"{uplink!r}: use host or netns:PATH",
                                 param_hint="--net-uplink")
    owned.insert(0, router)   # closed before the uplink fd
    if router.pin_path is None:
        router.refill()       # else after reconcile (the backend's, before serving)
    ups = []
    for u in upstreams or ("127.0.0.53",):
        host, _, port = u.partition(":")
        ups.append((host, int(port or 53)))
    return SandboxNetwork(router), {"upstreams": ups, "upstream_netns_fd": fd.fd}


def _log_ipv6(flag: str, on: bool) -> None:
    logging.getLogger("dsec.edge").info(
        "net: IPv6 for sandboxes %s (--net-ipv6 %s)", "on" if on else "off", flag)


def _router(router_cls: Any, config: Any, uplink: Any, state_dir: str | None) -> Any:
    """The router, pinned at ``STATE/net/router`` with a state dir (re-opened if an
    earlier edge of this node left it), else held by this process only."""
    if state_dir is None:
        return router_cls.create(config, uplink)
    from dsec.statedir import ensure_private_dir
    pin = os.path.join(ensure_private_dir(os.path.join(state_dir, "net")), "router")
    return router_cls.open(config, uplink, pin)


async def _serve(cfg: Any, backends: dict[str, Any], listen: str, token: bytes | None,
                 insecure: bool, ready_fd: int | None,
                 resolver_args: dict[str, Any] | None = None,
                 served: list[bool] | None = None,
                 metrics_listen: str | None = None, ssl_ctx: Any = None,
                 metrics_token: bytes | None = None) -> None:
    log = logging.getLogger("dsec.edge")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    resolver = None
    if resolver_args is not None:
        from dsec.net.resolver import Resolver

        resolver = Resolver(backends["container"].network, **resolver_args)
        await resolver.start()
    try:
        await _serve_node(cfg, backends, listen, token, insecure, ready_fd, stop,
                          served if served is not None else [], resolver, metrics_listen,
                          ssl_ctx, metrics_token)
    finally:
        if resolver is not None:
            await resolver.close()
    log.info("edge %s stopped", cfg.node_id)


async def _serve_node(cfg: Any, backends: dict[str, Any], listen: str, token: bytes | None,
                      insecure: bool, ready_fd: int | None, stop: asyncio.Event,
                      served: list[bool], resolver: Any = None,
                      metrics_listen: str | None = None, ssl_ctx: Any = None,
                      metrics_token: bytes | None = None) -> None:
    from dsec.edge.node import EdgeNode
    from dsec.edge.service import serve_edge
    from dsec.wire.node import format_bytes, format_cpu

    log = logging.getLogger("dsec.edge")
    node = EdgeNode(cfg, backends)
    await node.start()   # a failure here: edge() releases the backends
    container: Any = backends.get("container")
    lazy = getattr(getattr(container, "images", None), "lazy", None)
    if lazy is not None:
        # [lazy] the FUSE daemon's events (failed fetches, a restart) become sandbox
        # events; they arrive on its watcher thread
        loop = asyncio.get_running_loop()
        lazy.on_event = lambda ev: loop.call_soon_threadsafe(container.lazy_event, ev)
    try:
        server = await serve_edge(node, listen, token=token, insecure=insecure, ssl=ssl_ctx)
        cap = cfg.capacity
        phys = cap.physical
        log.info("edge %s serving %s on %s (%d sandboxes adopted); admits %s and %s "
                 "(machine: %s, %s)", cfg.node_id, ",".join(sorted(backends)), server.address,
                 node.live_count, format_cpu(cap.cpu_milli), format_bytes(cap.memory_bytes),
                 format_cpu(phys.cpu_milli) if phys else "?",
                 format_bytes(phys.memory_bytes) if phys else "?")
        click.echo(f"edge {cfg.node_id} listening on {server.address}", err=True)
        metrics = None
        if metrics_listen is not None:
            from dsec.edge.metrics import EdgeMetrics, serve_metrics

            em = EdgeMetrics(network=getattr(backends.get("container"), "network", None),
                             resolver=resolver, live=lambda: node.live_count, lazy=lazy,
                             node=node)
            metrics = await serve_metrics(metrics_listen, em.render, token=metrics_token)
            addr = metrics.sockets[0].getsockname()
            click.echo(f"edge {cfg.node_id} metrics on http://{addr[0]}:{addr[1]}/metrics",
                       err=True)
        if ready_fd is not None:
            try:
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            except OSError as exc:
                log.warning("could not tell the supervisor we are ready: %s", exc)
        try:
            await stop.wait()
        finally:
            if metrics is not None:
                metrics.close()
            await server.close()
    finally:
        served.append(True)
        await node.close()
