"""Killing a sandbox's processes never signals a host process (issue 11.5).

A pid number read from cgroup.procs can be reused by a host process before the kill lands,
when the listed task exits in between - likeliest when sandboxes churn through pids (fork
bombs at their task limit allocate and free a pid per failed fork). The test: fork-bombing
sandboxes are destroyed over and over while a host process spawns thousands of
short-lived children; every child must end by its own exit, none by a signal.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

# Keeps IN_FLIGHT children (each its own session and process group) alive, each living
# 0-2 ms, until SIGTERM; then reports how
# they ended. A child killed by anyone is seen as WIFSIGNALED; the spawner itself dying
# shows in its exit status.
SPAWNER = r"""
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }
int main(int argc, char **argv) {
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    double secs = atof(argv[1]);
    int in_flight = atoi(argv[2]), running = 0;
    long spawned = 0, signaled = 0, failed = 0;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    srand(getpid());
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int done = stop || (now.tv_sec - t0.tv_sec) + (now.tv_nsec - t0.tv_nsec) / 1e9 > secs;
        while (!done && running < in_flight) {
            long ns = rand() % 2000000;
            pid_t p = fork();
            if (p == 0) {
                /* a group leader: a stray kill of a process-group number hits it too */
                setsid();
                struct timespec d = {0, ns};
                nanosleep(&d, NULL);
                _exit(0);
            }
            if (p < 0) { failed++; break; }
            running++;
            spawned++;
        }
        if (running == 0) break;
        int st;
        pid_t w = wait(&st);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) break;
        running--;
        if (WIFSIGNALED(st)) {
            signaled++;
            fprintf(stderr, "child %d killed by signal %d\n", w, WTERMSIG(st));
        }
    }
    printf("spawned=%ld signaled=%ld failed=%ld\n", spawned, signaled, failed);
    return 0;
}
"""

# Capped hard (CPU too): the machine is shared, and the point is pid churn, not load.
BOMB = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=128, cpu_milli=250)
ROUNDS = 8
SANDBOXES = 3


@pytest.fixture(scope="module")
def spawner(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler for the host spawner")
    d = tmp_path_factory.mktemp("spawner")
    (d / "spawner.c").write_text(SPAWNER)
    out = str(d / "spawner")
    subprocess.run([cc, "-O2", "-o", out, str(d / "spawner.c")], check=True)
    return out


async def _churn(b: ContainerBackend, rounds: int) -> int:
    """Fork-bombing sandboxes, exec timeouts with escaping processes, destroys."""
    destroyed = 0
    for _ in range(rounds):
        sids = [new_sid() for _ in range(SANDBOXES)]
        await asyncio.gather(*(b.create(s, BOMB) for s in sids))
        for s in sids:  # each process forks two and exits: constant pid churn
            await b.exec(s, ExecRequest(shell="f(){ f|f& }; f", background=True))
        # more load on the kill paths: execs that time out (or, at the task limit, give up)
        await asyncio.gather(*(b.exec(s, ExecRequest(
            shell="setsid sleep 50 & while :; do true & done", timeout_s=0.3)) for s in sids))
        await asyncio.gather(*(b.destroy(SandboxId(s)) for s in sids))
        destroyed += len(sids)
    return destroyed


async def test_destroying_fork_bombs_never_signals_a_host_process(
        backend: ContainerBackend, runc_backend: ContainerBackend, spawner: str) -> None:
    host = await asyncio.create_subprocess_exec(
        spawner, "600", "24", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    destroyed = 0
    try:
        destroyed += await _churn(backend, ROUNDS)
        destroyed += await _churn(runc_backend, 1)
    finally:
        host.terminate()  # stop spawning, reap the last ones, report
        try:
            out, err = await asyncio.wait_for(host.communicate(), 30)
        except TimeoutError:
            host.kill()
            raise
    assert host.returncode == 0, (host.returncode, err.decode()[-2000:])
    counts = dict(kv.split("=") for kv in out.decode().split())
    assert counts["signaled"] == "0", err.decode()[-2000:]
    assert int(counts["spawned"]) >= 1000, counts
    assert destroyed == (ROUNDS + 1) * SANDBOXES
    assert backend.governor.list_sandboxes() == []
    assert runc_backend.governor.list_sandboxes() == []


def test_a_pid_missing_from_the_second_listing_is_not_signalled() -> None:
    """The v1 kill through pidfds: a pid is signalled only if a listing taken after its
    pidfd was opened still names it - a pid that left (and may already be someone
    else's) is spared. Real processes; the listings are the injected boundary."""
    from dsec.edge.governor import kill_verified

    victim = subprocess.Popen(["sleep", "30"])
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        calls: list[int] = []

        def listing() -> set[int]:
            calls.append(1)
            return {victim.pid, bystander.pid} if len(calls) == 1 else {victim.pid}
        assert kill_verified(listing) == 1
        assert victim.wait(5) == -9
        assert bystander.poll() is None  # listed first, gone from the second: untouched
        assert kill_verified(lambda: {99_999_999}) == 0  # no such pid: nothing happens
    finally:
        for p in (victim, bystander):
            p.kill()
            p.wait()


def test_leftover_cleanup_never_signals_a_pid_that_left_the_cgroup(tmp_path: object) -> None:
    """Reconciliation kills what a leftover sandbox's cgroups still list (hierarchies the
    governor does not manage: runc's devices, blkio, ...). It signalled the pid numbers
    it read (rt-kernel review): a listed task that exits lets its number go to a host
    process before the kill lands. Now a pid is signalled only if a second listing,
    taken after its pidfd was opened, still names it. Here ``cgroup.procs`` is a FIFO the
    test answers twice: the bystander (a real process) is listed first and gone from the
    second listing - as a task that exited and whose number was reused would be."""
    import threading

    from dsec.edge.backends.container.census import kill_tasks as _kill_tasks

    d = os.path.join(str(tmp_path), "leftover-cg")
    os.mkdir(d)
    procs = os.path.join(d, "cgroup.procs")
    os.mkfifo(procs)
    bystander = subprocess.Popen(["sleep", "30"])
    answers = [f"{bystander.pid}\n", ""]

    def serve() -> None:
        import errno
        import time

        for k, text in enumerate(answers):
            while k:  # the previous listing's reader must be gone (else this open would
                try:  # succeed at once and answer the wrong listing; the second answer
                      # is empty, so a probe that meets the next reader answers it right)
                    os.close(os.open(procs, os.O_WRONLY | os.O_NONBLOCK))
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no reader
                        break
                    raise
                time.sleep(0.001)
            fd = os.open(procs, os.O_WRONLY)  # waits for the next listing
            os.write(fd, text.encode())
            os.close(fd)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        _kill_tasks(d)
        with pytest.raises(subprocess.TimeoutExpired):  # still alive half a second later
            bystander.wait(0.5)
    finally:
        if t.is_alive():  # the old code listed once: release the second answer
            fd = os.open(procs, os.O_RDONLY | os.O_NONBLOCK)
            t.join(5)
            os.close(fd)
        bystander.kill()
        bystander.wait()
