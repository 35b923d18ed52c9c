"""Adapters onto RL trainers: a verl agent loop and a TRL reward function built on dsec
judges. The frameworks themselves stay optional: each adapter works on their data formats
and plugs into them when they are installed (docs/rl.md)."""

from dsec.rl.adapters.trl import JudgeReward
from dsec.rl.adapters.verl import VERL_OUTPUT_FIELDS, DsecAgentLoop, trajectory_to_verl

__all__ = ["VERL_OUTPUT_FIELDS", "DsecAgentLoop", "JudgeReward", "trajectory_to_verl"]
