"""A judge's files inside the agent's own sandbox, out of the agent's reach even as root
(issue 18): ExecRequest.hide puts the agent's commands under Landlock (the edge's
nsexec applies it before execve), so no path, /proc/<pid>/root, link, rename, ptrace or
signal reaches a hidden top-level directory or the judge's processes. Real containers,
root in the sandbox; CI runs these."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from dsec.edge.backends.container.linux import landlock_abi
from dsec.edge.node import EdgeNode
from dsec.errors import InvalidArgument
from dsec.rl.access import EdgeAccess
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec
from tests.rl.conftest import container_edge

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
    pytest.mark.skipif(landlock_abi() < 1, reason="the kernel has no Landlock"),
]

SPEC = SandboxSpec(backend="container", image="base", memory_bytes=256 << 20, pids_max=256)
HIDE = (".dsec-judge",)

PROBE_C = b"""#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
int main(int argc, char **argv) {
    int pid = atoi(argv[1]);
    char buf[16];
    struct iovec l = {buf, sizeof buf}, r = {(void *)0x400000, sizeof buf};
    printf("attach=%s ", ptrace(PTRACE_ATTACH, pid, 0, 0) < 0 ? strerror(errno) : "ok");
    printf("seize=%s ", ptrace(PTRACE_SEIZE, pid, 0, 0) < 0 ? strerror(errno) : "ok");
    printf("vm_readv=%s\\n",
           process_vm_readv(pid, &l, 1, &r, 1, 0) < 0 ? strerror(errno) : "ok");
    return 0;
}
"""


@pytest.fixture(scope="module")
def probe() -> Iterator[bytes]:
    """A static ptrace/process_vm_readv probe (busybox has no debugger)."""
    with tempfile.TemporaryDirectory(prefix="dsec-rl-probe-") as d:
        src, out = os.path.join(d, "probe.c"), os.path.join(d, "probe")
        with open(src, "wb") as f:
            f.write(PROBE_C)
        subprocess.run(["cc", "-O2", "-static", "-o", out, src], check=True,
                       capture_output=True, timeout=120)
        with open(out, "rb") as f:
            yield f.read()


@pytest.fixture(scope="module")
def container() -> Iterator[tuple[EdgeAccess, EdgeNode]]:
    with container_edge("rl-hide") as pair:
        yield pair


def _run(access: EdgeAccess, sid: str, shell: str, *, hide: tuple[str, ...] = HIDE,
         background: bool = False) -> ExecResult:
    r = access.exec_batch([(sid, ExecRequest(shell=shell, hide=hide, background=background,
                                             timeout_s=20.0))])[0]
    assert isinstance(r, ExecResult), r
    return r


def test_root_agent_cannot_reach_a_hidden_judge(container: tuple[EdgeAccess, EdgeNode],
                                                probe: bytes) -> None:
    access, _ = container
    sid = access.create(SPEC)
    try:
        # An agent process started BEFORE the judge's files exist, polling for them.
        _run(access, sid, "mkdir -p /tmp/w && /bin/busybox setsid /bin/busybox ash -c "
                          "'while :; do cat /.dsec-judge/secret >> /tmp/w/leak 2>/dev/null; "
                          "sleep 0.05; done' </dev/null >/dev/null 2>&1 &")
        # The judge (no hide): its directory, a secret, and a harness process living there.
        judge = _run(access, sid, "mkdir -m700 /.dsec-judge && echo s3cr3t > "
                                  "/.dsec-judge/secret && chmod 600 /.dsec-judge/secret",
                     hide=())
        assert judge.exit_code == 0, judge
        harness = _run(access, sid, "cd /.dsec-judge && exec sleep 60", hide=(),
                       background=True)
        assert harness.pid is not None, harness
        pid_s = str(harness.pid)
        cwd = _run(access, sid, f"for i in $(seq 200); do [ \"$(readlink /proc/{pid_s}/cwd)\""
                                f" = /.dsec-judge ] && break; sleep 0.02; done; "
                                f"readlink /proc/{pid_s}/cwd", hide=())
        assert cwd.stdout == b"/.dsec-judge\n", cwd    # the sandbox's own pid of it
        access.write_file(sid, "/tmp/w/probe", probe, mode=0o755)

        attempts = {
            "read": "cat /.dsec-judge/secret",
            "list": "ls /.dsec-judge",
            "proc-root": f"cat /proc/{pid_s}/root/.dsec-judge/secret",
            "proc-cwd": f"cat /proc/{pid_s}/cwd/secret",
            "symlink": "ln -s /.dsec-judge/secret /tmp/w/s && cat /tmp/w/s",
            "hardlink": "ln /.dsec-judge/secret /etc/h && cat /etc/h",   # same filesystem
            "rename": "mv /.dsec-judge /tmp/w/j && cat /tmp/w/j/secret",
            "truncate": ": > /.dsec-judge/secret",
            "overwrite": "echo 0 > /.dsec-judge/secret",
            "remove": "rm -f /.dsec-judge/secret",
            "plant": "mkdir /.dsec-judge2",                  # nothing new in "/" either
            "signal": f"kill -9 {pid_s}",                    # the judge's process lives
        }
        for name, cmd in attempts.items():
            r = _run(access, sid, cmd)
            assert r.exit_code != 0 and b"s3cr3t" not in r.stdout, (name, r)
        r = _run(access, sid, f"/tmp/w/probe {pid_s}")
        assert r.exit_code == 0, r
        assert b"attach=ok" not in r.stdout and b"seize=ok" not in r.stdout, r.stdout
        assert b"vm_readv=ok" not in r.stdout, r.stdout
        # the agent still works everywhere else
        ok = _run(access, sid, "echo hi > /tmp/w/a && cat /tmp/w/a && ls /bin >/dev/null "
                               "&& id -u")
        assert ok.exit_code == 0 and ok.stdout == b"hi\n0\n", ok     # ... as root
        # the judge is untouched and sees its own files
        seen = _run(access, sid, f"cat /.dsec-judge/secret && kill -0 {pid_s} && "
                                 "cat /tmp/w/leak 2>/dev/null; true", hide=())
        assert seen.stdout == b"s3cr3t\n", seen          # nothing leaked to the poller
        # the same commands without hide do reach it (the test can tell); ptrace is also
        # refused by the sandbox's seccomp profile, so for it Landlock is a second wall
        for cmd in (f"cat /proc/{pid_s}/root/.dsec-judge/secret",
                    "ln /.dsec-judge/secret /etc/h && cat /etc/h"):
            assert _run(access, sid, cmd, hide=()).stdout == b"s3cr3t\n", cmd
    finally:
        access.destroy(sid)


def test_hide_is_refused_where_it_cannot_hold(sim_access: EdgeAccess) -> None:
    sid = sim_access.create(SandboxSpec())
    try:
        r = sim_access.exec_batch([(sid, ExecRequest(shell="true", hide=HIDE))])[0]
        assert isinstance(r, InvalidArgument) and "cannot hide" in str(r)
    finally:
        sim_access.destroy(sid)
    for bad in ("", "..", "a/b", "a:b"):
        with pytest.raises(InvalidArgument, match="hide entry"):
            ExecRequest(shell="true", hide=(bad,))


TEST_SH = b'test "$(cat /workspace/answer)" = 42 || exit 1\n'


def test_in_place_judge_under_hide_with_the_agent_left_running(
        container: tuple[EdgeAccess, EdgeNode]) -> None:
    """SandboxEnvConfig(hide=...) + an in-place judge whose tests live in the hidden root:
    the agent (root) leaves pollers that try to copy and rewrite whatever tests appear,
    and uses its file tools through a symlink; with stop_agent=False (so Landlock alone
    holds the line) none of it works and the verdict is the honest one."""
    from dsec.rl.judges import ExecutableJudge
    from dsec.rl.sandbox import SandboxEnv, SandboxEnvConfig, Task

    access, _ = container
    judge = ExecutableJudge(hidden_files={"test.sh": TEST_SH},
                            command=["/bin/sh", "{tests}/test.sh"], cwd="/workspace",
                            isolate=False, stop_agent=False, tests_root="/.dsec-judge")
    # a harness file that lives in the hidden root for the whole episode
    task = Task(prompt="write the answer to /workspace/answer", judge=judge, spec=SPEC,
                files={"/.dsec-judge/harness/secret": b"s3cr3t\n"}, max_turns=20)
    env = SandboxEnv(access, [task], config=SandboxEnvConfig(hide=HIDE))
    cheats = [
        "echo 41 > /workspace/answer",
        ("/bin/busybox setsid /bin/busybox ash -c 'while :; do for f in /.dsec-judge/.judge-*/*; "
         "do cat \"$f\" >> /tmp/leak; echo \"exit 0\" > \"$f\"; done 2>/dev/null; "
         "cat /.dsec-judge/harness/secret >> /tmp/leak 2>/dev/null; "
         "sleep 0.02; done' </dev/null >/dev/null 2>&1 &"),
        "ln -s /.dsec-judge /workspace/j",
    ]
    try:
        env.reset(seed=0)
        for a in cheats:
            *_, term, trunc, _ = env.step(a)
            assert not (term or trunc)
        obs, *_ = env.step('{"tool": "read_file", "path": "/workspace/j/harness/secret"}')
        assert obs.startswith("error:") and "s3cr3t" not in obs, obs
        obs, *_ = env.step('{"tool": "write_file", "path": "/workspace/j/harness/secret", '
                           '"content": "1"}')
        assert obs.startswith("error:"), obs
        obs, *_ = env.step("cat /.dsec-judge/harness/secret")
        assert "s3cr3t" not in obs, obs
        obs, *_ = env.step('{"tool": "write_file", "path": "/workspace/ok", "content": "1"}')
        assert obs == "wrote /workspace/ok"
        _, reward, term, _, info = env.step('{"tool": "submit"}')
        assert term and reward == 0.0 and info["verdict"].detail == "verifier exit 1"
        sid = env.episodes.states[0].sandbox_id
        assert sid is not None
        after = _run(access, sid, "cat /tmp/leak 2>/dev/null; stat -c %a /tmp; "
                                  "cat /.dsec-judge/harness/secret", hide=())
        # nothing leaked, the harness is intact, /tmp untouched by the judge's mkdir -p
        assert after.stdout == b"1777\ns3cr3t\n", after
        # the same episode, honest
        env.reset()
        env.step("echo 42 > /workspace/answer")
        _, reward, *_ = env.step('{"tool": "submit"}')
        assert reward == 1.0
    finally:
        env.close()
