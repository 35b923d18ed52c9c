"""Rollout workers: agent loops that run next to their sandboxes and outlive the trainer
(issue 18 section 4; docs/rl.md, "Rollouts that outlive the trainer")."""

from dsec.rl.worker.queue import RolloutQueue
from dsec.rl.worker.trainer import TrainerClient, WorkerHandle, Workers, start_worker, workers
from dsec.rl.worker.types import WorkerConfig, WorkerTask

__all__ = ["RolloutQueue", "TrainerClient", "WorkerConfig", "WorkerHandle", "WorkerTask",
           "Workers", "start_worker", "workers"]
