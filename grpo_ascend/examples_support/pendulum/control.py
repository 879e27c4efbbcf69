"""PPO for continuous-control gymnasium environments (Pendulum-v1 by default) with the data on the device.

This is the setting the original design notes start from: a vector of environments (sync or
async) steps on the host while the policy, the rollout storage, GAE and the PPO losses live on
the device. Per environment step the only transfers are the observation/reward/done arrays in
and the action array out. Storage is the on-device ring buffer
:class:`~grpo_ascend.examples_support.pendulum.buffer.RolloutBuffer`
(preallocated ring, pointer modulo capacity) with one item per time step and a leading env
dimension, so ``buffer.all()`` is exactly the time-first [T, N] layout of
:func:`~grpo_ascend.algorithms.gae.gae_advantages_env`; the update reuses
:func:`~grpo_ascend.algorithms.losses.ppo_policy_loss` and ``ppo_value_loss`` (each transition is a
one-token sequence).

Episodes cut by a time limit (Pendulum ends every 200 steps) are bootstrapped: γ·V(final
observation) is added to the last reward and the step counts as done, as the GAE docstring
prescribes. Environments auto-reset in gymnasium's SAME_STEP mode, so the observation returned by
``step`` is always the next state to act on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.algorithms.gae import gae_advantages_env, whiten
from grpo_ascend.algorithms.losses import ppo_policy_loss, ppo_value_loss
from grpo_ascend.errors import ConfigError
from grpo_ascend.examples_support.pendulum.buffer import FieldSpec, RolloutBuffer

VECTORIZATION_MODES = ("sync", "async")


@dataclass
class ControlPPOConfig:
    """Settings of a classic-control PPO run; the defaults solve Pendulum-v1 in about 100k steps."""

    env_id: str = "Pendulum-v1"
    num_envs: int = 8
    vectorization_mode: str = "sync"
    num_steps: int = 256
    total_timesteps: int = 100_000
    learning_rate: float = 1e-3
    anneal_lr: bool = True
    gamma: float = 0.9
    lam: float = 0.95
    ppo_epochs: int = 10
    num_mini_batches: int = 16
    clip_range: float = 0.2
    cliprange_value: float = 1.0
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    max_grad_norm: float = 0.5
    reward_scale: float = 0.1
    hidden_size: int = 64
    init_log_std: float = 0.0
    eval_episodes: int = 16
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.vectorization_mode not in VECTORIZATION_MODES:
            raise ConfigError(f"vectorization_mode must be one of {VECTORIZATION_MODES}, got {self.vectorization_mode!r}")
        for name in ("num_envs", "num_steps", "total_timesteps", "ppo_epochs", "num_mini_batches", "hidden_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "clip_range", "reward_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma and lam must be in [0, 1], got gamma={self.gamma}, lam={self.lam}")
        if self.cliprange_value < 0 or self.eval_episodes < 0:
            raise ConfigError("cliprange_value and eval_episodes must be >= 0")
        if self.num_envs * self.num_steps < self.num_mini_batches:
            raise ConfigError(
                f"a rollout of num_envs × num_steps = {self.num_envs * self.num_steps} transitions cannot be cut "
                f"into num_mini_batches = {self.num_mini_batches}"
            )

    @property
    def num_updates(self) -> int:
        """PPO updates (one rollout of num_envs × num_steps transitions each) in the run."""
        return max(1, self.total_timesteps // (self.num_envs * self.num_steps))


def _mlp(inputs: int, hidden: int, outputs: int, last_gain: float) -> nn.Sequential:
    layers = [nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)]
    for layer in layers:
        if isinstance(layer, nn.Linear):
            gain = last_gain if layer is layers[-1] else math.sqrt(2)
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class GaussianActorCritic(nn.Module):
    """Separate actor (diagonal Gaussian, state-independent log-std) and critic MLPs.

    ``obs_scale`` divides observations (the Box bounds where finite) so inputs are O(1).
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden_size: int = 64, obs_scale: Tensor | None = None,
                 init_log_std: float = 0.0):
        super().__init__()
        self.actor = _mlp(obs_dim, hidden_size, act_dim, last_gain=0.01)
        self.critic = _mlp(obs_dim, hidden_size, 1, last_gain=1.0)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(init_log_std)))
        self.register_buffer("obs_scale", torch.ones(obs_dim) if obs_scale is None else obs_scale.float())

    def _inputs(self, obs: Tensor) -> Tensor:
        return obs / self.obs_scale

    def value(self, obs: Tensor) -> Tensor:
        """V(obs), shape [N]."""
        return self.critic(self._inputs(obs)).squeeze(-1)

    def distribution(self, obs: Tensor) -> torch.distributions.Normal:
        mean = self.actor(self._inputs(obs))
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))

    def act(self, obs: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Sample (action [N, A], log-prob [N], value [N]); reproducible for a seeded device generator."""
        dist = self.distribution(obs)
        noise = torch.randn(dist.mean.shape, generator=generator, device=obs.device, dtype=dist.mean.dtype)
        action = dist.mean + dist.stddev * noise
        return action, dist.log_prob(action).sum(-1), self.value(obs)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log-prob [N], entropy [N], value [N]) of given actions: the training forward."""
        dist = self.distribution(obs)
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.value(obs)


def make_vector_env(env_id: str, num_envs: int, mode: str = "sync") -> Any:
    """A gymnasium vector env (sync: one process; async: one subprocess per env) that auto-resets in
    SAME_STEP mode."""
    import gymnasium as gym

    if mode not in VECTORIZATION_MODES:
        raise ConfigError(f"vectorization_mode must be one of {VECTORIZATION_MODES}, got {mode!r}")
    try:
        return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode,
                            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    except gym.error.Error as exc:
        raise ConfigError(f"cannot create environment {env_id!r}: {exc}") from exc


def _check_spaces(envs: Any) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    import gymnasium as gym

    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    if not isinstance(obs_space, gym.spaces.Box) or not isinstance(act_space, gym.spaces.Box):
        raise ConfigError(
            f"continuous-control PPO needs Box observation and action spaces, got {obs_space} and {act_space}"
        )
    high = np.abs(np.asarray(obs_space.high, dtype=np.float64)).reshape(-1)
    scale = np.where(np.isfinite(high) & (high > 0), high, 1.0)
    return int(np.prod(obs_space.shape)), int(np.prod(act_space.shape)), scale, act_space.low, act_space.high


def _run_episodes(envs: Any, choose: Callable[[np.ndarray], np.ndarray], seed: int, max_steps: int = 100_000) -> float:
    """Mean return of the first episode of every env under the action rule ``choose(obs)``."""
    n = envs.num_envs
    obs, _ = envs.reset(seed=seed)
    returns = np.zeros(n)
    finished = np.zeros(n, dtype=bool)
    for _ in range(max_steps):
        obs, reward, terminated, truncated, _ = envs.step(choose(obs))
        returns += np.where(finished, 0.0, reward)
        finished |= terminated | truncated
        if finished.all():
            break
    return float(returns.mean())


def random_policy_return(env_id: str = "Pendulum-v1", episodes: int = 16, seed: int = 10_000) -> float:
    """Mean episode return of uniformly random actions (the baseline a trained policy must beat)."""
    envs = make_vector_env(env_id, episodes, "sync")
    try:
        envs.action_space.seed(seed)
        return _run_episodes(envs, lambda obs: envs.action_space.sample(), seed)
    finally:
        envs.close()


@torch.no_grad()
def evaluate_policy(agent: GaussianActorCritic, env_id: str = "Pendulum-v1", episodes: int = 16,
                    seed: int = 10_000) -> float:
    """Mean episode return of the deterministic policy (the Gaussian's mean, clipped to the bounds)."""
    envs = make_vector_env(env_id, episodes, "sync")
    device = agent.log_std.device
    low, high = envs.single_action_space.low, envs.single_action_space.high

    def choose(obs: np.ndarray) -> np.ndarray:
        mean = agent.distribution(torch.as_tensor(obs, dtype=torch.float32, device=device)).mean
        return np.clip(mean.cpu().numpy(), low, high)

    try:
        return _run_episodes(envs, choose, seed)
    finally:
        envs.close()


def _buffer_fields(num_envs: int, obs_dim: int, act_dim: int) -> dict[str, FieldSpec]:
    """One buffer item = one time step of all envs."""
    return {
        "obs": FieldSpec((num_envs, obs_dim)),
        "actions": FieldSpec((num_envs, act_dim)),
        "logps": FieldSpec((num_envs,)),
        "values": FieldSpec((num_envs,)),
        "rewards": FieldSpec((num_envs,)),
        "dones": FieldSpec((num_envs,), torch.bool),
    }


def train_control_ppo(
    cfg: ControlPPOConfig, log: Callable[[dict[str, float]], None] | None = None
) -> dict[str, Any]:
    """Train PPO on ``cfg.env_id``; returns the per-update history, the final and the random-policy
    evaluation returns, throughput and the trained agent. ``log`` receives each update's metrics."""
    dev.seed_everything(cfg.seed)
    device = dev.resolve_device(cfg.device)
    envs = make_vector_env(cfg.env_id, cfg.num_envs, cfg.vectorization_mode)
    try:
        obs_dim, act_dim, obs_scale, act_low, act_high = _check_spaces(envs)
        agent = GaussianActorCritic(
            obs_dim, act_dim, cfg.hidden_size, torch.as_tensor(obs_scale, dtype=torch.float32), cfg.init_log_std
        ).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
        buffer = RolloutBuffer(cfg.num_steps, _buffer_fields(cfg.num_envs, obs_dim, act_dim), device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.seed)
        low = torch.as_tensor(act_low, dtype=torch.float32, device=device)
        high = torch.as_tensor(act_high, dtype=torch.float32, device=device)

        obs_np, _ = envs.reset(seed=cfg.seed)
        obs = torch.as_tensor(obs_np, dtype=torch.float32, device=device)
        episode_return = np.zeros(cfg.num_envs)
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        timesteps = 0
        for update in range(cfg.num_updates):
            if cfg.anneal_lr:
                for group in optimizer.param_groups:
                    group["lr"] = cfg.learning_rate * (1.0 - update / cfg.num_updates)
            finished_returns: list[float] = []
            agent.eval()
            for _ in range(cfg.num_steps):
                with torch.no_grad():
                    action, logp, value = agent.act(obs, generator)
                env_action = torch.maximum(torch.minimum(action, high), low).cpu().numpy()
                obs_np, reward_np, terminated, truncated, info = envs.step(env_action)
                done_np = terminated | truncated
                reward = torch.as_tensor(reward_np, dtype=torch.float32, device=device) * cfg.reward_scale
                cut = truncated & ~terminated
                if cut.any():  # bootstrap time-limit truncations from the final observation
                    rows = np.nonzero(cut)[0]
                    final = torch.as_tensor(np.stack([info["final_obs"][i] for i in rows]), dtype=torch.float32,
                                            device=device)
                    with torch.no_grad():
                        reward[torch.as_tensor(rows, device=device)] += cfg.gamma * agent.value(final)
                buffer.add(
                    obs=obs.unsqueeze(0), actions=action.unsqueeze(0), logps=logp.unsqueeze(0),
                    values=value.unsqueeze(0), rewards=reward.unsqueeze(0),
                    dones=torch.as_tensor(done_np, device=device).unsqueeze(0),
                )
                episode_return += reward_np
                finished_returns.extend(episode_return[done_np].tolist())
                episode_return[done_np] = 0.0
                obs = torch.as_tensor(obs_np, dtype=torch.float32, device=device)
            timesteps += cfg.num_steps * cfg.num_envs
            with torch.no_grad():
                next_value = agent.value(obs)
            stats = _ppo_update(agent, optimizer, buffer.all(), next_value, cfg, generator)
            elapsed = time.perf_counter() - start
            record = {
                "update": float(update + 1),
                "timesteps": float(timesteps),
                "time": elapsed,
                "episode_return": float(np.mean(finished_returns)) if finished_returns else float("nan"),
                "episodes": float(len(finished_returns)),
                "steps_per_second": timesteps / max(elapsed, 1e-9),
                **stats,
            }
            history.append(record)
            if log is not None:
                log(record)
    finally:
        envs.close()
    wall = time.perf_counter() - start
    agent.eval()
    eval_seed = cfg.seed + 10_000
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "device": str(device),
        "history": history,
        "timesteps": timesteps,
        "wall_time_s": wall,
        "steps_per_second": timesteps / max(wall, 1e-9),
        "agent": agent,
    }
    if cfg.eval_episodes:
        result["eval_return"] = evaluate_policy(agent, cfg.env_id, cfg.eval_episodes, eval_seed)
        result["random_return"] = random_policy_return(cfg.env_id, cfg.eval_episodes, eval_seed)
    return result


def _ppo_update(agent: GaussianActorCritic, optimizer: torch.optim.Optimizer, data: dict[str, Tensor],
                next_value: Tensor, cfg: ControlPPOConfig, generator: torch.Generator) -> dict[str, float]:
    """GAE over the [T, N] rollout, then ppo_epochs × num_mini_batches clipped updates; one host copy."""
    advantages, returns = gae_advantages_env(data["rewards"], data["values"], data["dones"], next_value,
                                             cfg.gamma, cfg.lam)
    flat = {
        "obs": data["obs"].flatten(0, 1),
        "actions": data["actions"].flatten(0, 1),
        "logps": data["logps"].flatten(),
        "values": data["values"].flatten(),
        "returns": returns.flatten(),
        "advantages": whiten(advantages.flatten()),
    }
    total = flat["logps"].shape[0]
    size = total // cfg.num_mini_batches
    agent.train()
    sums: dict[str, Tensor] = {}
    count = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(total, generator=generator, device=generator.device).to(flat["logps"].device)
        for k in range(cfg.num_mini_batches):
            idx = order[k * size : (k + 1) * size]
            logp, entropy, value = agent.evaluate(flat["obs"][idx], flat["actions"][idx])
            ones = torch.ones_like(logp).unsqueeze(1)
            old_logp = flat["logps"][idx].unsqueeze(1)
            pg_loss, pg_stats = ppo_policy_loss(logp.unsqueeze(1), old_logp, flat["advantages"][idx].unsqueeze(1),
                                                ones, cfg.clip_range)
            v_loss, v_stats = ppo_value_loss(value.unsqueeze(1), flat["values"][idx].unsqueeze(1),
                                             flat["returns"][idx].unsqueeze(1), ones, cfg.cliprange_value)
            loss = pg_loss + cfg.vf_coef * v_loss - cfg.entropy_coef * entropy.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                log_ratio = logp.detach() - old_logp.squeeze(1)
                step = {
                    "policy_loss": pg_loss.detach(),
                    "value_loss": v_loss.detach(),
                    "entropy": entropy.detach().mean(),
                    "clip_fraction": pg_stats["clipped_region"] / pg_stats["token_count"],
                    "value_clip_fraction": v_stats["clip_fraction"],
                    "approx_kl": ((log_ratio.exp() - 1) - log_ratio).mean(),
                }
            for key, val in step.items():
                sums[key] = sums[key] + val if key in sums else val.clone()
            count += 1
    var_returns = flat["returns"].var()
    explained = 1 - (flat["returns"] - flat["values"]).var() / var_returns.clamp(min=1e-8)
    means = {k: v / count for k, v in sums.items()}
    means["explained_variance"] = explained
    means["log_std"] = agent.log_std.detach().mean()
    return dict(zip(means, torch.stack(list(means.values())).tolist()))
