"""The task flywheel end to end against the scripted OpenAI-compatible endpoint.

proposer -> environment builder (an agent prepares the task's environment in a sandbox;
snapshotted with pack_diff and registered as the task's image) -> GRPO groups of solver
rollouts from that snapshot -> judge with the hidden tests in a toolkit layer the solver
never mounts -> pass rates in the task registry, trajectories as JSON lines.

    sudo python examples/rl_flywheel.py --out /tmp/flywheel.jsonl

Runs a container LocalCluster (root) and the scripted endpoint on loopback; point
``PolicyConfig(base_url=..., model=...)`` at vLLM/SGLang to use a real model. The scripted
models: ``proposer`` submits the proposals below, ``honest`` runs the ```bash block of its
prompt (the builders' setup steps, the solvers' scripted solution), ``cheating`` tries
reward hacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dsec import AsyncClient, LocalCluster
from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.scripted import ScriptedEndpoint, ScriptedTurn
from dsec.rl.engine import EngineConfig, RolloutEngine
from dsec.rl.export import write_jsonl
from dsec.rl.flywheel import Flywheel
from dsec.rl.tasks import TaskRegistry
from dsec.wire.spec import SandboxSpec

SUM_TEST = ('test "$(cat /workspace/answer)" = "$(awk \'{s+=$1} END {print s}\' '
            '/workspace/data.txt)" || { echo "wrong sum"; exit 1; }\n')
PROPOSALS: list[dict[str, Any]] = [
    {"id": "sum-numbers",
     "prompt": "/workspace/data.txt holds one number per line. Write their sum to "
               "/workspace/answer, then submit.\n```bash\n"
               "awk '{s+=$1} END {print s}' /workspace/data.txt > /workspace/answer\n"
               "cat /workspace/answer\n```",
     "setup": ["mkdir -p /workspace", "seq 1 100 > /workspace/data.txt"],
     "ready": "test $(wc -l < /workspace/data.txt) -eq 100",
     "tests": {"test.sh": SUM_TEST},
     "verify": ["/bin/sh", "{hidden}/test.sh"],
     "answer_files": ["/workspace/answer"]},
    {"id": "count-words",        # the scripted solver gets this one wrong (off by one)
     "prompt": "Write the number of words in /workspace/text.txt to /workspace/answer."
               "\n```bash\necho 4 > /workspace/answer\n```",
     "setup": ["mkdir -p /workspace", "echo 'the quick brown fox jumps' > /workspace/text.txt"],
     "ready": "test -s /workspace/text.txt",
     "tests": {"check/test.sh": 'test "$(cat /workspace/answer)" = 5\n'},
     "verify": ["/bin/sh", "{hidden}/check/test.sh"],
     "answer_files": ["/workspace/answer"]},
]


def proposer(messages: Sequence[Mapping[str, Any]]) -> ScriptedTurn:
    return ScriptedTurn(calls=(("submit", {"answer": json.dumps(PROPOSALS)}),))


async def run(ac: AsyncClient, base_url: str, *, group_size: int = 4,
              out: str | None = None, registry: TaskRegistry | None = None) -> dict[str, Any]:
    spec = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)
    sandboxes = ClientSandboxes(ac)
    pols = {m: OpenAIPolicy(PolicyConfig(base_url=base_url, model=m))
            for m in ("proposer", "honest", "cheating")}
    registry = TaskRegistry() if registry is None else registry
    builder = RolloutEngine(sandboxes, pols["honest"], EngineConfig(keep_sandboxes=True))
    solver = RolloutEngine(sandboxes, pols["honest"], registry=registry)
    cheater = RolloutEngine(sandboxes, pols["cheating"], registry=registry)
    fly = Flywheel(proposer=pols["proposer"], builder=builder, solver=solver,
                   registry=registry, spec=spec)
    try:
        groups = await fly.turn("Propose shell tasks for a busybox sandbox.",
                                group_size=group_size)
        cheats = await cheater.group(registry.get("sum-numbers"), 2)
        trajs = [t for g in groups.values() for t in g] + cheats
        if out:
            write_jsonl(trajs, out)
        return {
            "tasks": {t.id: {"image": t.metadata["image"], "hidden_layer":
                             t.metadata["hidden_layer"],
                             "attempts": registry.stats(t.id).attempts,
                             "pass_rate": registry.stats(t.id).pass_rate}
                      for t in registry.tasks()},
            "rewards": {tid: [t.reward for t in g] for tid, g in groups.items()},
            "cheater_rewards": [t.reward for t in cheats],
            "infra_errors": [t.infra_error for t in trajs if t.infra_error],
            "trajectories": len(trajs),
        }
    finally:
        for e in (builder, solver, cheater):
            await e.close()
        for p in pols.values():
            await p.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the trajectories here (JSON lines)")
    ap.add_argument("--group-size", type=int, default=4)
    args = ap.parse_args(argv)
    with ScriptedEndpoint(policies={"proposer": proposer}) as ep, \
            LocalCluster(edges=1, backend="container") as cl:
        async def go() -> dict[str, Any]:
            ac = cl.async_client()
            try:
                return await run(ac, ep.base_url, group_size=args.group_size, out=args.out)
            finally:
                await ac.close()
        summary = asyncio.run(go())
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
