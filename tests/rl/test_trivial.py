"""TrivialEnv returns what its spaces say (issue 18): Gymnasium's checker, warnings fatal."""

from __future__ import annotations

import warnings

import numpy as np
from gymnasium.utils.env_checker import check_env

from dsec.rl.trivial import TrivialEnv


def test_trivial_env_passes_the_checker_without_warnings() -> None:
    env = TrivialEnv(episode_len=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # "Casting input x to numpy array" etc.
        check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert type(obs) is np.ndarray and obs.shape == () and obs.dtype == np.float32
    assert obs in env.observation_space and info == {}
    for t in range(1, 4):
        obs, reward, term, trunc, _ = env.step(np.int64(t & 1))
        assert type(obs) is np.ndarray and obs.dtype == np.float32 and obs.shape == ()
        assert type(reward) is float and reward == 1.0
        assert type(term) is bool and type(trunc) is bool
    assert term and float(obs) == 1.0
