"""An LLM agent on dsec sandboxes, end to end: an OpenAI-compatible model, the asyncio
rollout engine, a tamper-proof judge, GRPO groups, pass rates and trajectory export.

    sudo python examples/rl_llm_agent.py --out /tmp/trajectories.jsonl

Runs against the scripted endpoint on loopback (model ``honest``); for a real model start
vLLM (``vllm serve Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser hermes``) and
pass ``--base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B``. Sandboxes come from a
container LocalCluster (root), or from ``dsec up`` / a remote cluster with ``--dsec-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from dsec import AsyncClient, LocalCluster
from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig, SamplingParams
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.scripted import ScriptedEndpoint
from dsec.rl.engine import EngineConfig, RolloutEngine
from dsec.rl.export import write_jsonl
from dsec.rl.judges import ExecutableJudge
from dsec.rl.tasks import AgentTask, TaskRegistry
from dsec.wire.spec import SandboxSpec

SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)
HIDDEN_TEST = b'test "$(cat /workspace/answer)" = "$(sort -n /workspace/nums | tail -1)"\n'

TASKS = [
    AgentTask(id="max-number",
              prompt="/workspace/nums holds integers, one per line. Write the largest to "
                     "/workspace/answer, then call submit.\n"
                     # the scripted `honest` model runs this block; a real model ignores it
                     "```bash\nsort -n /workspace/nums | tail -1 > /workspace/answer\n```",
              files={"/workspace/nums": b"17\n4\n99\n23\n"}, spec=SPEC, max_turns=8,
              judge=ExecutableJudge(hidden_files={"test.sh": HIDDEN_TEST},
                                    command=["/bin/sh", "{tests}/test.sh"],
                                    carry=["/workspace/answer", "/workspace/nums"])),
]


async def run(ac: AsyncClient, base_url: str, model: str = "honest", *, group_size: int = 4,
              out: str | None = None) -> dict[str, Any]:
    policy = OpenAIPolicy(PolicyConfig(
        base_url=base_url, model=model, max_concurrency=32,
        sampling=SamplingParams(temperature=0.7, max_tokens=512),
        system_prompt="You are a careful engineer working in a Linux sandbox."))
    registry = TaskRegistry(TASKS)
    engine = RolloutEngine(ClientSandboxes(ac), policy,
                           EngineConfig(max_concurrent_episodes=32, step_timeout_s=120.0,
                                        episode_timeout_s=600.0), registry=registry)
    try:
        trajs = await engine.run(registry.tasks(), epochs=1, group_size=group_size)
    finally:
        await engine.close()
        await policy.close()
    if out:
        write_jsonl(trajs, out)
    return {"rewards": [t.reward for t in trajs],
            "pass_rate": {t.id: registry.stats(t.id).pass_rate for t in registry.tasks()},
            "infra_errors": [t.infra_error for t in trajs if t.infra_error],
            "steps": [len(t.steps) for t in trajs],
            "logprobs": all(m.logprobs for t in trajs for m in t.messages
                            if m.role == "assistant")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write trajectories here (JSON lines)")
    ap.add_argument("--base-url", help="an OpenAI-compatible endpoint (default: scripted)")
    ap.add_argument("--model", default="honest")
    ap.add_argument("--dsec-url", help="a dsec cluster (default: a local container one)")
    ap.add_argument("--group-size", type=int, default=4)
    args = ap.parse_args(argv)

    async def go(base_url: str, cluster: LocalCluster | None) -> dict[str, Any]:
        ac = cluster.async_client() if cluster else AsyncClient(args.dsec_url)
        try:
            return await run(ac, base_url, args.model, group_size=args.group_size,
                             out=args.out)
        finally:
            await ac.close()

    if args.base_url:
        base_url, ep = args.base_url, None
    else:
        ep = ScriptedEndpoint().start()
        base_url = ep.base_url
    try:
        if args.dsec_url:
            summary = asyncio.run(go(base_url, None))
        else:
            with LocalCluster(edges=1, backend="container") as cl:
                summary = asyncio.run(go(base_url, cl))
    finally:
        if ep is not None:
            ep.stop()
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
