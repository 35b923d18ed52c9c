"""F3: ``ToolConfig(user="agent")`` runs the agent's bash as that unprivileged user, but
its read_file / write_file / str_replace tools go through the file API, which acts as the
sandbox's root: the agent reads root-only files (0600: a harness's expected outputs,
credentials) and overwrites root-owned ones (/etc/passwd -> uid 0; the harness an in-place
judge runs) with one tool call. Every tool must act with the configured user's rights.

The sandbox below is a fake at the ToolSandbox boundary that keeps one root-only file and
answers as a kernel would: root (the file API, an exec without ``user``) may read/write
it, anyone else gets EACCES. What is under test is which identity the executor uses."""

from __future__ import annotations

import asyncio

from dsec.errors import PermissionDenied
from dsec.rl.agent.executor import ToolConfig, run_action
from dsec.rl.agent.tools import ReadFile, WriteFile
from dsec.wire.spec import ExecRequest, ExecResult

SECRET = b"expected-output: 42\n"


class OneRootFile:
    """/root/answers is root:root 0600."""

    def __init__(self) -> None:
        self.files = {"/root/answers": SECRET}
        self.root_ops: list[str] = []

    async def exec(self, sid: str, req: ExecRequest) -> ExecResult:
        argv = tuple(req.argv or ())
        path = argv[-1] if argv else ""
        if req.user not in (None, "", "0", "root") and path in self.files:
            return ExecResult(exit_code=1, stdout=b"",
                              stderr=f"cat: {path}: Permission denied\n".encode())
        if argv[:2] == ("cat", "--"):
            return ExecResult(exit_code=0, stdout=self.files.get(path, b""), stderr=b"")
        self.files[path] = req.stdin or b""
        return ExecResult(exit_code=0, stdout=b"", stderr=b"")

    async def write_file(self, sid: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self.root_ops.append(f"write {path}")
        self.files[path] = data

    async def mkdir(self, sid: str, path: str) -> None:
        self.root_ops.append(f"mkdir {path}")

    async def read_file(self, sid: str, path: str, *, length: int | None = None) -> bytes:
        self.root_ops.append(f"read {path}")
        if path not in self.files:
            raise PermissionDenied(f"{path}: no such file")
        return self.files[path]


def test_read_file_tool_runs_with_the_agents_user_not_root() -> None:
    sb = OneRootFile()
    cfg = ToolConfig(user="nobody")
    out = asyncio.run(run_action(sb, "sb-1", ReadFile(path="/root/answers"), cfg))
    assert "42" not in out.observation, (
        f"an agent confined to user 'nobody' read a root-only file through read_file "
        f"(file API as root: {sb.root_ops})")


def test_write_file_tool_runs_with_the_agents_user_not_root() -> None:
    sb = OneRootFile()
    cfg = ToolConfig(user="nobody")
    asyncio.run(run_action(sb, "sb-1", WriteFile(path="/root/answers", content="pwned"), cfg))
    assert sb.files["/root/answers"] == SECRET, (
        f"an agent confined to user 'nobody' overwrote a root-owned file through "
        f"write_file (file API as root: {sb.root_ops})")
