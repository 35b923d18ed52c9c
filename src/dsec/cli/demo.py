"""``dsec demo``: what ``make demo`` runs - dsec's main job, as a user would drive it.

Starts ``dsec up`` (a single-node cluster: apiserver, placement, watcher, one edge with
the container backend, SQLite state) in a child process, then through the SDK: builds a
base image and a toolkit layer, creates 50 sandboxes at once, runs a small real task in
each (write an input file, run the toolkit's script on it, read the answer back), pauses
half and resumes them, snapshots one and starts 5 new sandboxes from the snapshot, prints
a table of what happened with timings, and tears everything down, checking that no mount,
cgroup or process is left behind.

With real containers it also shows egress policy (docs/networking.md): the demo builds a
small test internet in network namespaces of its own (:mod:`dsec.net.testinternet`, plus
a package mirror ``mirror.test``, :mod:`dsec.net.testmirror`; documentation addresses
only, nothing leaves the machine) and gives the edge a router into it. Sandbox A, whose
policy allows ``mirror.test:80``, downloads a package from the mirror with busybox wget,
unpacks it and runs it; sandbox B, whose policy allows another name only, is refused -
its DNS lookup by dsec's resolver, its direct connection by the router (counted, and
reported as a ``network_denied`` event) - and the mirror's log shows B's requests never
arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from dsec.rmtree import remove_tree

T = TypeVar("T")

TASK_SCRIPT = """#!/bin/sh
# The demo's task: sum the numbers in $1 and record who computed it.
set -e
total=0
for n in $(cat "$1"); do total=$((total + n)); done
echo "sum=$total host=$(hostname)" > /workspace/answer.txt
cat /workspace/answer.txt
"""


@dataclass
class Step:
    name: str
    count: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    result: str = ""

    def row(self) -> tuple[str, ...]:
        p50 = f"{statistics.median(self.latencies_s) * 1000:.1f}" if self.latencies_s else "-"
        p99 = f"{_pct(self.latencies_s, 0.99) * 1000:.1f}" if self.latencies_s else "-"
        return (self.name, str(self.count), f"{self.wall_s * 1000:.0f}", p50, p99, self.result)


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _timed(fn: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = await fn()
    return out, time.perf_counter() - t0


async def _each(items: Sequence[Any], fn: Callable[[Any], Awaitable[T]]
                ) -> tuple[list[T], list[float], float]:
    """Run ``fn`` on every item concurrently; results, per-item latencies, wall time."""
    t0 = time.perf_counter()
    pairs = await asyncio.gather(*(_timed(functools.partial(fn, it)) for it in items))
    return [p[0] for p in pairs], [p[1] for p in pairs], time.perf_counter() - t0


def _host_leftovers(state_dir: str, sandbox_ids: set[str]) -> dict[str, int]:
    """Mounts below the cluster's state dir, loop devices backed by files in it and
    cgroups of the demo's sandboxes still on the host after teardown."""
    real = os.path.realpath(state_dir)
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if line.split()[4].startswith(real + "/"))
    loops = 0
    for dev in glob.glob("/sys/block/loop*/loop/backing_file"):
        with contextlib.suppress(OSError), open(dev) as f:
            loops += f.read().strip().startswith(real + "/")
    cgroups = 0
    for ctrl in ("memory", "pids", "cpu", "freezer", "unified"):
        for _, dirs, _ in os.walk(os.path.join("/sys/fs/cgroup", ctrl)):
            cgroups += sum(1 for d in dirs if d in sandbox_ids)
    # A cgroup cannot be removed while a process is in it, so no cgroup = no process.
    return {"mounts": mounts, "loop devices": loops, "cgroups": cgroups}


# (busybox 1.35's ``wget -T`` segfaults, on the host too: ``timeout`` bounds the probes)
INSTALL = ("set -e; wget -q -O /tmp/{pkg} http://{name}:{port}{path}; mkdir -p /opt; "
           "tar -xzf /tmp/{pkg} -C /opt; /opt/hello/bin/hello")
PROBE = ("timeout 1 wget -q -O /tmp/p http://{name}:{port}{path} 2>&1; "
         "echo \"by name: rc=$?\"; "
         "timeout 1 wget -q -O /tmp/p http://{ip}:{port}{path} 2>&1; "
         "echo \"by address: rc=$?\"")


async def _mirror_case(console: Console, client: Any, image: str, ids: set[str],
                       mirror: Any) -> list[Step]:
    """Sandbox A (allowed mirror.test:80) installs a package from the mirror; sandbox B
    (allowed another name only) is refused, by name and by address."""
    from dsec.net.testmirror import (
        HELLO_OUTPUT,
        MIRROR_IP,
        MIRROR_NAME,
        MIRROR_PORT,
        PACKAGE,
        PACKAGE_PATH,
    )
    from dsec.wire.netpolicy import NetworkPolicy

    base = {"image": image, "backend": "container", "memory": "64MiB", "ttl": 600}
    t0 = time.perf_counter()
    a, b = await asyncio.gather(
        client.sandboxes.create(**base, network=NetworkPolicy(
            mode="policy", allow=(f"{MIRROR_NAME}:{MIRROR_PORT}/tcp",))),
        client.sandboxes.create(**base, network=NetworkPolicy(
            mode="policy", allow=("allowed.test:80/tcp",))))
    ids.update((a.id, b.id))
    t_made = time.perf_counter() - t0
    (ra, dt_a), (rb, dt_b) = await asyncio.gather(
        _timed(lambda: a.exec(INSTALL.format(pkg=PACKAGE, name=MIRROR_NAME, port=MIRROR_PORT,
                                             path=PACKAGE_PATH), timeout=30)),
        _timed(lambda: b.exec(PROBE.format(name=MIRROR_NAME, ip=MIRROR_IP, port=MIRROR_PORT,
                                           path=PACKAGE_PATH), timeout=30)))
    out_a = ra.stdout.decode(errors="replace").strip()
    installed = ra.exit_code == 0 and out_a.startswith(HELLO_OUTPUT)
    steps = [Step(f"sandbox A (allow {MIRROR_NAME}:{MIRROR_PORT}) installs {PACKAGE} from "
                  "the mirror", 1, t_made + dt_a,
                  result=f"{int(installed)}/1 installed and ran: {out_a!r}")]
    t0 = time.perf_counter()
    out_b = rb.stdout.decode(errors="replace")
    events: list[Any] = []
    for _ in range(40):  # the edge reads the denied counters every second
        events = [e for e in await b.events() if e.reason == "network_denied"]
        if events:
            break
        await asyncio.sleep(0.05)
    view = await b.network.get()
    # the mirror sees every sandbox as the router's uplink address (NAT): A's one request
    # is all it may have seen
    seen = mirror.seen()
    refused = ("by name: rc=0" not in out_b and "by address: rc=0" not in out_b
               and len(seen) == 1 and view.denied_packets > 0 and bool(events))
    steps.append(Step("sandbox B (allow allowed.test:80 only) tries the mirror", 1,
                      dt_b + time.perf_counter() - t0,
                      result=f"{int(refused)}/1 refused: the name by dsec's resolver, the "
                             f"address by the router ({view.denied_packets} packet(s) "
                             f"denied, {len(events)} network_denied event); the mirror "
                             f"served {len(seen)} request(s), A's"))
    console.print(f"[bold]sandbox A[/] {a.id} (allow {MIRROR_NAME}:{MIRROR_PORT}): {out_a}")
    console.print(f"[bold]sandbox B[/] {b.id} (allow allowed.test:80): "
                  + "; ".join(line.strip() for line in out_b.splitlines() if line.strip()))
    for e in events[:1]:
        console.print(f"  event {e.reason}: {e.detail}")
    console.print(f"  mirror.test's log: {len(seen)} request(s): "
                  + ", ".join(f"{c} GET {p}" for c, p in seen))
    await asyncio.gather(a.kill(), b.kill())
    return steps


async def _run(console: Console, n: int, cluster: Any, backend: str,
               ids: set[str], mirror: Any = None) -> list[Step]:
    from dsec.client.core import AsyncClient

    steps: list[Step] = []
    container = backend == "container"
    async with AsyncClient(cluster.url, cluster.api_key, gateway=cluster.gateway) as client:
        if container:
            from dsec.edge.backends.container.testimage import build_busybox_root

            with tempfile.TemporaryDirectory(prefix="dsec-demo-") as d:
                base_dir, tool_dir = os.path.join(d, "base"), os.path.join(d, "tools")
                build_busybox_root(base_dir)
                os.makedirs(os.path.join(tool_dir, "opt/demo"))
                script = os.path.join(tool_dir, "opt/demo/task.sh")
                with open(script, "w") as f:  # noqa: ASYNC230 - a tiny local script
                    f.write(TASK_SCRIPT)
                os.chmod(script, 0o755)
                t0 = time.perf_counter()
                base = await client.images.build(base_dir, name="demo-base", kind="base")
                tools = await client.images.build(tool_dir, name="demo-task", kind="toolkit")
                steps.append(Step("build base image + toolkit layer (EROFS)", 2,
                                  time.perf_counter() - t0,
                                  result=f"{base.ref} {base.size_bytes >> 10} KiB, "
                                         f"{tools.ref} {tools.size_bytes >> 10} KiB"))
            spec: dict[str, Any] = {"image": "demo-base", "toolkits": ["demo-task"],
                                    "backend": "container", "memory": "128MiB", "ttl": 600}
        else:
            spec = {"backend": "simulated", "ttl": 600}

        t0 = time.perf_counter()
        sbs = await client.sandboxes.create_many(n, **spec)
        steps.append(Step(f"create {n} sandboxes at once", n, time.perf_counter() - t0,
                          result=f"{len({s.id for s in sbs})} running"))

        async def task(ix_sb: tuple[int, Any]) -> bool:
            i, sb = ix_sb
            numbers = list(range(i, i + 10))
            await sb.files.write("/workspace/input.txt", " ".join(map(str, numbers)) + "\n")
            if container:
                r = await sb.exec("/opt/demo/task.sh /workspace/input.txt", timeout=30)
                answer = await sb.files.read("/workspace/answer.txt")
                return bool(r.exit_code == 0
                            and answer == f"sum={sum(numbers)} host={sb.id}\n".encode())
            await sb.exec(f"write /workspace/answer.txt sum={sum(numbers)}", timeout=30)
            return bool(await sb.files.read("/workspace/answer.txt")
                        == f"sum={sum(numbers)}".encode())

        ok, lat, wall = await _each(list(enumerate(sbs)), task)
        steps.append(Step("task: write input, run script, read answer", n, wall, lat,
                          f"{sum(ok)}/{n} correct answers"))

        half = sbs[: n // 2]
        stats, lat, wall = await _each(half, lambda sb: sb.pause())
        reclaimed = sum(s.reclaimed_bytes for s in stats)
        resident = sum(s.resident_before_bytes for s in stats)
        steps.append(Step(f"pause {len(half)} sandboxes", len(half), wall, lat,
                          f"{reclaimed >> 20} MiB of {resident >> 20} MiB memory given back"))
        _, lat, wall = await _each(half, lambda sb: sb.resume())
        alive, _, _ = await _each(half, lambda sb: sb.exec("cat /workspace/answer.txt"))
        steps.append(Step(f"resume {len(half)} sandboxes", len(half), wall, lat,
                          f"{sum(r.exit_code == 0 for r in alive)}/{len(half)} answer exec"))

        src = sbs[0]
        await src.exec("echo 'built by the agent' > /workspace/notes.txt", timeout=30)
        snap, dt = await _timed(src.snapshot)
        steps.append(Step("snapshot one sandbox (pack_diff)", 1, dt, [dt],
                          f"{snap.id[:19]}... {snap.size} bytes"))
        t0 = time.perf_counter()
        clones = await client.sandboxes.create_many(5, snapshot=snap, ttl=600)
        wall = time.perf_counter() - t0
        seen, _, _ = await _each(
            clones, lambda sb: sb.exec("cat /workspace/notes.txt /workspace/answer.txt"))
        expected = (await src.exec("cat /workspace/notes.txt /workspace/answer.txt")).stdout
        same = sum(r.stdout == expected for r in seen)
        steps.append(Step("start 5 sandboxes from the snapshot", 5, wall,
                          result=f"{same}/5 see the snapshot's files"))

        if mirror is not None:
            steps += await _mirror_case(console, client, "demo-base", ids, mirror)

        everyone = sbs + clones
        ids.update(sb.id for sb in everyone)
        _, lat, wall = await _each(everyone, lambda sb: sb.kill())
        steps.append(Step(f"destroy all {len(everyone)} sandboxes", len(everyone), wall, lat,
                          "done"))
        try:
            await client.snapshots.delete(snap)
        except Exception as exc:  # noqa: BLE001 - reported, teardown goes on
            console.print(f"[yellow]could not delete the snapshot: {exc}[/]")
    return steps


@click.command()
@click.option("-n", "--sandboxes", default=50, show_default=True, type=click.IntRange(2, 2000),
              help="How many sandboxes to create at once.")
@click.option("--backend", type=click.Choice(["auto", "container", "simulated"]), default="auto",
              show_default=True, help="auto = container when running as root.")
def demo(sandboxes: int, backend: str) -> None:
    """Run dsec's main job end to end on an embedded single-node cluster."""
    import uvloop

    from dsec.cluster.local import LocalCluster

    console = Console(width=None if Console().is_terminal else 120)
    if backend == "auto":
        backend = "container" if os.geteuid() == 0 else "simulated"
        if backend == "simulated":
            console.print("[yellow]not root: real containers need root; using the simulated "
                          "backend (run `sudo make demo` for the real thing)[/]")
    state_dir = tempfile.mkdtemp(prefix="dsec-demo-state-")
    console.rule(f"dsec demo: {sandboxes} sandboxes, {backend} backend")
    with contextlib.ExitStack() as stack:
        net: dict[str, Any] = {}
        inet = mirror = None
        if backend == "container":
            from dsec.net import testinternet, testmirror

            # the test internet: namespaces of this process, gone when it closes them
            inet = stack.enter_context(testinternet.internet())
            mirror = stack.enter_context(testmirror.mirror(inet))
            net = {"net_uplink": f"netns:/proc/{os.getpid()}/fd/{inet.fd}",
                   "net_dns_upstream": (testmirror.MIRROR_DNS,)}
        t0 = time.perf_counter()
        with console.status("starting `dsec up` (apiserver, placement, watcher, edge, "
                            "SQLite)..."):
            cluster = LocalCluster(backend=backend, subprocess=True, state_dir=state_dir,
                                   start_timeout_s=60, **net).start()
        started = time.perf_counter() - t0
        console.print(f"cluster up in {started:.2f}s at {cluster.url} "
                      f"(Aether gateway {cluster.gateway})")
        try:
            ids: set[str] = set()
            steps = uvloop.run(_run(console, sandboxes, cluster, backend, ids, mirror))
        finally:
            with console.status("stopping the cluster..."):
                cluster.stop()
        leftovers = _host_leftovers(state_dir, ids) if backend == "container" else {}
        # The kernel frees an autoclear loop device in a workqueue after its last close
        # (Linux >= 5.17), so the disk pool's loop can outlive its umount by a moment on
        # a busy host (seen once at load 5): ask again for up to 5 s before calling it left.
        deadline = time.monotonic() + 5.0
        while any(leftovers.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            leftovers = _host_leftovers(state_dir, ids)
        if inet is not None:
            from dsec.net.testinternet import links_in

            # the edge's router (its netns, its uplink veth) went with the edge
            leftovers["router uplinks"] = sum(n.startswith("dsu") for n in links_in(inet.fd))
    if not any(leftovers.values()):
        remove_tree(state_dir)   # nothing mounted from it: it can go
    table = Table(title="what happened")
    for col, just in (("step", "left"), ("n", "right"), ("wall ms", "right"),
                      ("p50 ms", "right"), ("p99 ms", "right"), ("result", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    table.add_row("start `dsec up`", "1", f"{started * 1000:.0f}", "-", "-", cluster.url)
    for s in steps:
        table.add_row(*s.row())
    console.print(table)
    if leftovers:
        console.print(f"after teardown: {leftovers['mounts']} mounts under the state dir, "
                      f"{leftovers['loop devices']} loop devices backed by it, "
                      f"{leftovers['cgroups']} sandbox cgroups (so no sandbox process), "
                      f"{leftovers.get('router uplinks', 0)} router uplinks left")
    failed = [s for s in steps if s.result.split("/")[0].isdigit()
              and s.result.split("/")[0] != s.result.split("/")[1].split()[0]]
    if failed or any(leftovers.values()):
        raise SystemExit("demo finished with problems (see the table above)")
    console.print("[green]demo finished: every step succeeded and nothing was left behind[/]")
