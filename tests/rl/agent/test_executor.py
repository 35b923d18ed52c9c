"""Tools run in a real container sandbox through the SDK: the agent's mistakes are
observations, a lost sandbox is an infrastructure error."""

from __future__ import annotations

import pytest

from dsec import AsyncClient
from dsec.errors import DsecError
from dsec.rl.access import is_infra_error
from dsec.rl.agent.executor import ToolConfig, run_action
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.tools import Bash, ReadFile, StrReplace, Submit, WriteFile
from dsec.wire.spec import SandboxSpec

SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)


async def test_tools_in_a_container(aclient: AsyncClient) -> None:
    sbx = ClientSandboxes(aclient)
    cfg = ToolConfig(workdir="/workspace", command_timeout_s=2.0, max_observation_chars=200,
                     max_file_bytes=1000)
    sid = await sbx.create(SPEC)
    try:
        out = await run_action(sbx, sid, WriteFile(path="src/a.py", content="x = 1\ny = 1\n"),
                               cfg)                             # parents are made
        assert out.observation == "wrote 12 bytes to /workspace/src/a.py" and out.error is None
        out = await run_action(sbx, sid, Bash(command="cat src/a.py; exit 3"), cfg)
        assert out.observation == "x = 1\ny = 1\n[exit 3]" and out.exit_code == 3
        assert out.started_at is not None
        out = await run_action(sbx, sid, StrReplace(path="src/a.py", old_str="= 1",
                                                    new_str="= 2"), cfg)
        assert out.error == "not_unique" and "2 times" in out.observation
        out = await run_action(sbx, sid, StrReplace(path="src/a.py", old_str="y = 1",
                                                    new_str="y = 2"), cfg)
        assert out.error is None
        out = await run_action(sbx, sid, ReadFile(path="/workspace/src/a.py"), cfg)
        assert out.observation == "x = 1\ny = 2\n"
        # the agent's mistakes: observations, never exceptions
        out = await run_action(sbx, sid, ReadFile(path="missing.txt"), cfg)
        assert out.error == "file_error" and "missing.txt" in out.observation
        out = await run_action(sbx, sid, ReadFile(path="/workspace"), cfg)   # a directory
        assert out.error is not None
        out = await run_action(sbx, sid, WriteFile(path="/proc/version", content="x"), cfg)
        assert out.error == "file_error"
        await run_action(sbx, sid, Bash(command="head -c 2000 /dev/zero > big"), cfg)
        out = await run_action(sbx, sid, ReadFile(path="big"), cfg)
        assert out.error == "file_too_large"
        out = await run_action(sbx, sid, Bash(command="sleep 5", timeout_s=60), cfg)
        assert out.observation.endswith("[timed out]")       # capped at 2 s
        out = await run_action(sbx, sid, Bash(command="seq 1 1000"), cfg)
        assert len(out.observation) <= 200 and "characters cut" in out.observation
        assert out.observation.endswith("[exit 0]")
        out = await run_action(sbx, sid, Submit(answer="42"), cfg)
        assert out.submitted and out.answer == "42"
    finally:
        await sbx.destroy(sid)
    # the platform's failure: the sandbox is gone
    for action in (Bash(command="true"), WriteFile(path="a", content="b"),
                   ReadFile(path="a")):
        with pytest.raises(DsecError) as ei:
            await run_action(sbx, sid, action, cfg)
        assert is_infra_error(ei.value), ei.value


async def test_hidden_dirs_are_out_of_the_agents_reach(aclient: AsyncClient) -> None:
    """A harness's files in the agent's own sandbox (/.dsec-judge): with ToolConfig.hide
    no tool reaches them, even as root; the platform's file API still does."""
    sbx = ClientSandboxes(aclient)
    cfg = ToolConfig(hide=(".dsec-judge",))
    sid = await sbx.create(SPEC)
    try:
        await sbx.mkdir(sid, "/.dsec-judge")
        await sbx.write_file(sid, "/.dsec-judge/expected", b"secret-42\n")
        for action in (Bash(command="cat /.dsec-judge/expected"),
                       Bash(command="cd / && cat .dsec-judge/* && rm -rf /.dsec-judge"),
                       ReadFile(path="/.dsec-judge/expected"),
                       WriteFile(path="/.dsec-judge/expected", content="forged"),
                       StrReplace(path="/.dsec-judge/expected", old_str="secret",
                                  new_str="x")):
            out = await run_action(sbx, sid, action, cfg)
            assert "secret-42" not in out.observation, (action, out)
        assert await sbx.read_file(sid, "/.dsec-judge/expected") == b"secret-42\n"
        # everything else works as without hide
        out = await run_action(sbx, sid, WriteFile(path="deep/a.txt", content="hi"), cfg)
        assert out.error is None, out
        out = await run_action(sbx, sid, ReadFile(path="deep/a.txt"), cfg)
        assert out.observation == "hi"
        out = await run_action(sbx, sid, StrReplace(path="deep/a.txt", old_str="hi",
                                                    new_str="ho"), cfg)
        assert out.error is None
        assert (await run_action(sbx, sid, Bash(command="cat deep/a.txt"), cfg)
                ).observation == "ho\n[exit 0]"
    finally:
        await sbx.destroy(sid)
