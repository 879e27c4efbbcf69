"""PPO on Pendulum-v1 with real environment steps: the classic-control path runs and does not do worse
than a random policy; the example script runs with async vector envs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("gymnasium")

from grpo_ascend.errors import ConfigError  # noqa: E402
from grpo_ascend.examples_support.pendulum import (  # noqa: E402
    ControlPPOConfig,
    GaussianActorCritic,
    random_policy_return,
    train_control_ppo,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pendulum_ppo.py"


@pytest.fixture()
def one_thread():
    """Small MLPs run far faster on one thread, especially on a shared CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_pendulum_ppo_is_no_worse_than_random(one_thread):
    cfg = ControlPPOConfig(num_envs=8, num_steps=256, total_timesteps=8 * 256 * 8, device="cpu", eval_episodes=16)
    result = train_control_ppo(cfg)
    history = result["history"]
    assert len(history) == 8
    for record in history:
        assert all(math.isfinite(v) for k, v in record.items() if k != "episode_return"), record
    # Every env finishes a 200-step episode within each 256-step rollout.
    assert all(r["episodes"] >= cfg.num_envs for r in history)
    # The critic learns the returns; the policy is not worse than uniformly random actions.
    assert history[-1]["explained_variance"] > 0.5, history[-1]
    assert result["eval_return"] > result["random_return"] - 100, (result["eval_return"], result["random_return"])
    assert -1700 < result["random_return"] < -800


def test_example_runs_with_async_vector_envs(tmp_path, one_thread):
    spec = importlib.util.spec_from_file_location("pendulum_ppo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "pendulum.json"
    rc = module.main([
        "--vectorization-mode", "async", "--num-envs", "2", "--num-steps", "64", "--total-timesteps", "256",
        "--ppo-epochs", "2", "--num-mini-batches", "2", "--eval-episodes", "2", "--device", "cpu",
        "--json", str(out), "--plot", str(tmp_path / "pendulum.png"),
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["vectorization_mode"] == "async"
    assert len(data["history"]) == 2
    assert data["history"][-1]["timesteps"] == 256
    assert math.isfinite(data["summary"]["eval_return"])
    assert (tmp_path / "pendulum.png").stat().st_size > 0


def test_actions_are_reproducible_with_a_seeded_generator():
    agent = GaussianActorCritic(3, 1)
    obs = torch.randn(4, 3)
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(7)
        draws.append(agent.act(obs, gen))
    for a, b in zip(*draws):
        assert torch.equal(a, b)
    logp, entropy, value = agent.evaluate(obs, draws[0][0])
    torch.testing.assert_close(logp, draws[0][1])
    torch.testing.assert_close(value, draws[0][2])
    assert entropy.shape == (4,)


def test_random_baseline_is_seeded():
    assert random_policy_return(episodes=2, seed=3) == random_policy_return(episodes=2, seed=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vectorization_mode": "threads"}, "vectorization_mode"),
        ({"num_envs": 0}, "num_envs"),
        ({"gamma": 1.5}, "gamma"),
        ({"num_envs": 1, "num_steps": 2, "num_mini_batches": 4}, "num_mini_batches"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ControlPPOConfig(**kwargs)
