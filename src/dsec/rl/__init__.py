"""RL toolkit: replay buffer, GAE, env pool, rollout driver, sandbox-backed environments,
judges and preemptible rollouts (docs/rl.md)."""

from dsec.rl.buffer import Batch, ReplayBuffer, Violation
from dsec.rl.driver import Driver, PolicyOutput, RolloutHandle, RolloutStats, resume
from dsec.rl.envpool import BatchEnv, EnvPool, GymShard
from dsec.rl.gae import gae, gae_reference, numba_available
from dsec.rl.trivial import TrivialBatchEnv, TrivialEnv

__all__ = [
    "Batch", "BatchEnv", "Driver", "EnvPool", "GymShard", "PolicyOutput", "ReplayBuffer",
    "RolloutHandle", "RolloutStats", "TrivialBatchEnv", "TrivialEnv", "Violation", "gae",
    "gae_reference", "numba_available", "resume",
]
