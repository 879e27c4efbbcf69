"""PPO for causal LMs: a critic, KL-penalised token rewards, GAE, clipped policy and value losses.

Same API as :class:`~grpo_ascend.trainers.grpo.GRPOTrainer` (and the same engine, rewards, loss
registry, checkpoints and metrics)::

    trainer = PPOTrainer(model="builtin:tiny-warm", reward_funcs=[accuracy], args=PPOConfig(...),
                         train_dataset=dataset, peft_config=LoraConfig(...))
    trainer.train()

One rollout batch (``per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches``
completions per device) is :meth:`PPOTrainer.train_round`:

1. sample completions and score them (one score per completion), as GRPO does;
2. log-probs under the sampling policy (the engine's, exact in fp32) and the reference (base with
   adapters disabled), values from the critic — one no-grad forward each;
3. token rewards ``r_t = −β·(log π − log π_ref)_t`` plus the score on the last completion token,
   β from a fixed or adaptive KL controller;
4. GAE (vectorised, ``gamma``/``lam``), advantages whitened over valid tokens (all ranks);
5. the update reads it all from the round's :class:`~grpo_ascend.experience.Experience` (on the
   device: old log-probs, values, advantages and returns travel with the completions);
6. ``ppo_epochs`` passes × ``num_mini_batches`` optimizer steps, each accumulating
   ``gradient_accumulation_steps`` micro-batches of: critic forward + clipped value loss
   (``cliprange_value``, × ``vf_coef``) backward with the critic adapter active, then policy
   forward + the registry's clipped policy loss (``loss_type``, default ``bnpo`` = token mean, with
   ``entropy_coef``) backward; one clipped optimizer step over policy and critic parameters.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.algorithms.kl_control import make_kl_controller
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
    ppo_value_loss,
)
from grpo_ascend.algorithms.token_advantages import gae_token_advantages
from grpo_ascend.config.configs import PPOConfig
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience, experience_metrics
from grpo_ascend.models.critic import active_adapter, build_critic, enable_critic_grads
from grpo_ascend.tracking.phases import PhaseTimer
from grpo_ascend.trainers.base import RLTrainerBase, RoundLog
from grpo_ascend.trainers.step_metrics import accumulate, policy_metrics


class PPOTrainer(RLTrainerBase):
    """PPO trainer on accelerate; ``model`` is a path, hub id, ``builtin:*`` name or a loaded model."""

    config_class = PPOConfig
    algorithm = "ppo"
    args: PPOConfig
    prepared_models = 2  # policy and critic: engines that take one model per run refuse PPO

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: PPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Any = None,
    ):
        cfg = args if args is not None else PPOConfig()
        if not isinstance(cfg, PPOConfig):
            raise ConfigError(f"args must be a PPOConfig, got {type(cfg).__name__}")
        POLICY_LOSSES.get(cfg.loss_type)  # fail before loading anything on a bad name
        self.loss_settings = PolicyLossSettings(
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            entropy_coef=cfg.entropy_coef,
            max_completion_length=cfg.max_completion_length,
        )
        self.kl_ctl = make_kl_controller(cfg.kl_coef, cfg.adaptive_kl, cfg.target_kl, cfg.kl_horizon)
        super().__init__(model, cfg, train_dataset, processing_class, peft_config, callbacks, eval_dataset)
        self.critic = critic = build_critic(self.policy, cfg.critic_init, cfg.critic_model)
        critic.module.share_prompts = cfg.share_prompt_prefill
        self._ckpt_module: nn.Module = self.policy
        if critic.owned is not None:  # full fine-tuning: the critic's own backbone is checkpointed too
            self._ckpt_module = nn.ModuleDict({"policy": self.policy, "critic": critic.owned})
        self._build_training(reward_funcs, extra_parameters=critic.trainable)
        enable_critic_grads(critic)
        self.critic_model = self.strategy.prepare_critic(critic.module)
        critic_ids = {id(p) for p in critic.trainable}
        self._policy_params = [p for p in self.policy.parameters() if p.requires_grad and id(p) not in critic_ids]
        self.experience = self._make_experience_maker()
        self._build_parts()

    def _trainable_module(self) -> nn.Module:
        """Policy adapter(s) + critic adapter and head (LoRA), or policy + critic modules (full)."""
        return self._ckpt_module

    # ------------------------------------------------------------------------------ round
    def train_round(self) -> None:
        """Experience → values → KL-penalised token rewards and GAE → epochs of critic + policy steps → log."""
        args, ranks, critic = self.args, self.ranks, self.critic
        timer, started = PhaseTimer(self.device), time.perf_counter()
        exp, metrics = self.experience.make(self.plan.prompts_per_rank, timer, old_logps=True,
                                            trainer_state=self._trainer_state_for_rewards,
                                            complete=lambda annotated: self._values_and_advantages(annotated, timer))
        tokens_global = ranks.reduce(exp.loss_mask.sum())
        log = RoundLog(metrics, timer, prep_seconds=time.perf_counter() - started)

        for rows in self._step_rows(exp.size):
            step_start, sums = time.perf_counter(), {}
            normaliser = self._step_normaliser(exp.loss_mask[rows], tokens_global)
            self.policy.train()
            self.critic_model.train()
            micro_batches = 0
            for micro, last in self._micro_batches(rows, exp):
                micro_batches += 1
                inputs, mask = exp.model_inputs(micro), exp.loss_mask[micro]
                # Critic first, forward *and* backward with its adapter active (gradient checkpointing
                # recomputes the forward during backward with whatever adapter is active then).
                with self._no_sync(self.critic_model, last), active_adapter(self.policy, critic.adapter):
                    v_loss, v_stats = ppo_value_loss(self.critic_model(*inputs), exp.extras["values"][micro],
                                                     exp.extras["returns"][micro], mask, args.cliprange_value,
                                                     normaliser)
                    self._backward(args.vf_coef * v_loss, self.critic_model)
                with self._no_sync(self.logprob_model, last):
                    logps, entropies = self.logprob_model(*inputs, temperature=args.temperature, with_entropy=True,
                                                          entropy_grad=bool(args.entropy_coef))
                    batch = PolicyLossBatch(
                        logps=logps, advantages=exp.advantages[micro], mask=mask, old_logps=exp.old_logps[micro],
                        entropies=entropies if args.entropy_coef or entropies is None else entropies.detach(),
                    )
                    pg_loss, stats = policy_loss(args.loss_type, batch, self.loss_settings, normaliser)
                    self._backward(pg_loss)
                accumulate(sums, {"policy_loss": pg_loss, "value_loss": v_loss,
                                        "value_clipped": v_stats["value_clipped"], **stats})
            total = sums["policy_loss"] + args.vf_coef * sums["value_loss"]
            grad_norm, _ = self.clip_and_step(self._policy_params + critic.trainable, torch.isfinite(total))
            totals = ranks.sum_scalars(sums)
            world, n_tok = ranks.world, max(totals.get("token_count", 0.0), 1.0)
            step_metrics = {
                "loss": (totals["policy_loss"] + args.vf_coef * totals["value_loss"]) / world,
                "policy_loss": totals["policy_loss"] / world,
                "value_loss": totals["value_loss"] / world,
                "value_clip_fraction": totals["value_clipped"] / n_tok,
                "grad_norm": grad_norm,
                **policy_metrics(totals),
            }
            self._end_step(step_metrics, log, exp, step_start, micro_batches)

    @torch.no_grad()
    def _forward_values(self, exp: Experience) -> Tensor:
        """Critic values [B, Tc] of every completion token state (zero past the completion), without grad."""
        out, size = [], self.args.per_device_train_batch_size
        self.critic_model.eval()
        with active_adapter(self.policy, self.critic.adapter):
            for start in range(0, exp.size, size):
                out.append(self.critic_model(*exp.model_inputs(slice(start, start + size))))
        return torch.cat(out).float() * exp.completion_mask

    def _values_and_advantages(self, exp: Experience, timer: PhaseTimer) -> tuple[dict[str, Any], dict[str, float]]:
        """The critic's values, then GAE (see :meth:`_advantages`); the round's metrics."""
        metrics = experience_metrics(exp, self.ranks)
        metrics.update(self.ranks.mean_over_ranks(self.experience.source.metrics()))
        with timer.phase("values"):
            values = self._forward_values(exp)
        with timer.phase("advantages"):
            fields, advantage_metrics = self._advantages(exp, values)
        metrics.update(advantage_metrics)
        return fields, metrics

    def _advantages(self, exp: Experience, values: Tensor) -> tuple[dict[str, Any], dict[str, float]]:
        """Token rewards (−β·KL, the score on the last token), GAE and returns (see
        algorithms/token_advantages.py), and their metrics over all ranks. Adapts the KL coefficient.

        The fields: ``advantages`` [B, Tc] (whitened over every rank's tokens unless ``whiten_advantages``
        is off), ``old_logps`` masked to the completion, and ``extras`` with ``values`` and ``returns``.
        """
        args, ranks, mask = self.args, self.ranks, exp.loss_mask
        old_logps = exp.old_logps.float() * mask
        out = gae_token_advantages(exp.rewards, old_logps, exp.ref_logps, values, mask, self.kl_ctl.value,
                                   args.gamma, args.lam, args.whiten_advantages, reduce=ranks.reduce)
        metrics, sequences = out.metrics(values, mask, ranks.reduce, ranks.gather)
        if args.needs_reference_model:
            self.kl_ctl.update(metrics["kl/sequence"], sequences)
        fields = {"advantages": out.advantages, "old_logps": old_logps,
                  "extras": {**exp.extras, "values": values, "returns": out.returns}}
        return fields, metrics

    # ------------------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        return {**super()._trainer_state(), "kl_controller": self.kl_ctl.state_dict()}

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        if "kl_controller" in state:
            self.kl_ctl.load_state_dict(state["kl_controller"])
