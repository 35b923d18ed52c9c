"""LLM agents on dsec sandboxes: episode records, tool schemas and tool-call parsing, an
OpenAI-compatible policy client and the asyncio rollout engine (docs/rl.md, "LLM agents")."""

from dsec.rl.agent.types import (
    LOGPROB_FLOOR,
    EpisodeEnd,
    Message,
    ModelInfo,
    Role,
    Step,
    StepTimings,
    ToolCall,
    Trajectory,
    TrajectoryTimings,
    VerdictRecord,
    trajectory_from_json,
    trajectory_to_json,
)

__all__ = [
    "LOGPROB_FLOOR", "EpisodeEnd", "Message", "ModelInfo", "Role", "Step", "StepTimings", "ToolCall",
    "Trajectory", "TrajectoryTimings", "VerdictRecord", "trajectory_from_json",
    "trajectory_to_json",
]
